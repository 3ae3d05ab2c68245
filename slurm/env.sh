# Environment for multi-node GPU jobs (sourced by slurm/launch.sh). Every value can be overridden
# by exporting it before sbatch. Harmless on CPU-only test clusters.
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
export TOKENIZERS_PARALLELISM=${TOKENIZERS_PARALLELISM:-false}
# NCCL over InfiniBand: use the IB HCAs, GPUDirect RDMA when the fabric allows it, and keep
# bootstrap traffic off the loopback/docker interfaces.
export NCCL_IB_DISABLE=${NCCL_IB_DISABLE:-0}
export NCCL_IB_HCA=${NCCL_IB_HCA:-mlx5}
export NCCL_NET_GDR_LEVEL=${NCCL_NET_GDR_LEVEL:-PHB}
export NCCL_SOCKET_IFNAME=${NCCL_SOCKET_IFNAME:-^lo,docker0}
export NCCL_CROSS_NIC=${NCCL_CROSS_NIC:-0}
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
# Long weight syncs and checkpoint saves must not trip the NCCL watchdog.
export TORCH_NCCL_ASYNC_ERROR_HANDLING=${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}
export TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC=${TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC:-1800}
# megatron-core: overlap of grad reduce needs ordered kernel launches.
export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1}
# vLLM in Ray actors: let each engine pick its own GPUs inside its placement-group bundle.
export VLLM_USE_V1=${VLLM_USE_V1:-1}
export RAY_AUTH_MODE=${RAY_AUTH_MODE:-disabled}
