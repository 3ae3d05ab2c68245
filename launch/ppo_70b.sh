#!/usr/bin/env bash
# PPO (GAE with a 70B critic) on a 70B dense model across H100 nodes.
#
#   MODEL_PATH=/models/Llama-3.1-70B-Instruct TRAIN_FILES=... VAL_FILES=... sbatch launch/ppo_70b.sh [key=value ...]
#
# The critic shares the actor's megatron layout (configs/ppo_70b.yaml has the memory plan).
#SBATCH --job-name=megarl-ppo-70b
#SBATCH --nodes=16
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=96
#SBATCH --mem=0
#SBATCH --exclusive
#SBATCH --time=48:00:00
#SBATCH --output=megarl-%x-%j.out
#SBATCH --open-mode=append
# Preemption: Slurm's warning (SIGUSR1) this long before the time limit (and at preemption where the
# cluster sets PreemptParameters=send_user_signal) goes to this script, which forwards it to the driver:
# the step in progress ends, its checkpoint is saved, and the job requeues itself and resumes from it
# (slurm/signals.sh, trainer.save_on_preempt). The step in progress and one save must fit in it.
#SBATCH --signal=B:USR1@900
#SBATCH --requeue
set -euo pipefail
exec bash "${MEGARL_REPO:-${SLURM_SUBMIT_DIR:-.}}/slurm/launch.sh" ppo_70b "$@"
