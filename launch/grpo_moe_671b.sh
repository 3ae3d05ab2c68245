#!/usr/bin/env bash
# GRPO on DeepSeek-V3 (671B, MLA + 256 experts) with PP16 x EP16 on the trainer and TP=32 rollout (verl's layout).
#
#   MODEL_PATH=/models/DeepSeek-V3-bf16 TRAIN_FILES=... VAL_FILES=... CKPT_DIR=... sbatch launch/grpo_moe_671b.sh [key=value ...]
#
# MODEL_PATH: a bf16 safetensors checkpoint (the official release is FP8 block-quantised; dequantise it first).
# Layout and memory plan: configs/grpo_moe_671b.yaml. Submit from the repository root (or set MEGARL_REPO).
#SBATCH --job-name=megarl-grpo-moe-671b
#SBATCH --nodes=32
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=96
#SBATCH --mem=0
#SBATCH --exclusive
#SBATCH --time=72:00:00
#SBATCH --output=megarl-%x-%j.out
#SBATCH --open-mode=append
# Preemption: Slurm's warning (SIGUSR1) this long before the time limit (and at preemption where the
# cluster sets PreemptParameters=send_user_signal) goes to this script, which forwards it to the driver:
# the step in progress ends, its checkpoint is saved, and the job requeues itself and resumes from it
# (slurm/signals.sh, trainer.save_on_preempt). The step in progress and one save must fit in it.
#SBATCH --signal=B:USR1@1800
#SBATCH --requeue
set -euo pipefail
exec bash "${MEGARL_REPO:-${SLURM_SUBMIT_DIR:-.}}/slurm/launch.sh" grpo_moe_671b "$@"
