#!/usr/bin/env bash
# GRPO on a DeepSeek-V3-sized MoE (671B, 256 experts) with PP16 x EP16 on the trainer and TP=32 rollout.
#
#   MODEL_PATH=/models/<moe-checkpoint> TRAIN_FILES=... VAL_FILES=... sbatch launch/grpo_moe_671b.sh [key=value ...]
#
# Note: the bridge does not map MLA yet (see README, "Model bridge"); a Qwen3-MoE-architecture
# checkpoint of this size runs today. Memory plan: configs/grpo_moe_671b.yaml.
#SBATCH --job-name=megarl-grpo-moe-671b
#SBATCH --nodes=32
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=96
#SBATCH --mem=0
#SBATCH --exclusive
#SBATCH --time=72:00:00
#SBATCH --output=megarl-%x-%j.out
set -euo pipefail
exec bash "${MEGARL_REPO:-${SLURM_SUBMIT_DIR:-.}}/slurm/launch.sh" grpo_moe_671b "$@"
