"""The ``hf`` rollout backend's settings, its config refusals and its registry entry (imports no
transformers model code).

One replica is one process holding the model (no tensor parallelism: ``rollout.tensor_model_parallel_size``
must be 1). It receives full HF tensors from the weight sync, serves no LoRA adapters (merged
updates only) and has no sleep mode. The rollout keys it reads: ``dtype``, ``max_model_len`` (else
prompt + response length), ``max_num_seqs`` (sequences per step), ``max_num_batched_tokens`` (tokens
per step: one per running sequence plus the prompts it admits), ``gpu_memory_utilization`` (GPU: the
process's share of the device, ``platform.hardware.limit_memory_fraction``), ``logprobs_mode``,
``disable_log_stats``, ``seed``; what it cannot do is refused by ``config_problems`` before anything
starts (``megarl.checks`` calls it for ``rollout.name=hf``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from megarl.config.errors import Problem, refusal
from megarl.rollout.backend import ReplicaRequest, RolloutBackend, register_rollout_backend

PREFIX = "actor_rollout_ref.rollout"


@dataclass(frozen=True)
class HFReplicaSpec:
    model_path: str
    tokenizer_path: str | None
    dtype: str  # "auto": bfloat16 on GPU, float32 on CPU
    max_model_len: int
    max_num_seqs: int  # sequences batched into one forward
    seed: int
    cpu_threads: int
    logprobs_mode: str = "processed_logprobs"
    trust_remote_code: bool = False
    tensor_parallel_size: int = 1
    enable_sleep_mode: bool = False
    max_lora_rank: int = 0
    max_num_batched_tokens: int = 8192  # tokens per forward: one per running sequence + admitted prompts
    gpu_memory_utilization: float = 0.5  # GPU: this process's share of the device memory
    disable_log_stats: bool = True
    hf_overrides: tuple[tuple[str, Any], ...] = ()  # HF config fields set on the checkpoint's (override_config)


def spec_for(request: ReplicaRequest) -> HFReplicaSpec:
    config = request.config
    tp = int(config.tensor_model_parallel_size)
    if tp != 1:
        raise ValueError(f"{PREFIX}.tensor_model_parallel_size={tp}: the hf rollout backend runs one "
                         "process per replica (no tensor parallelism); set it to 1, or use rollout.name=vllm")
    if request.lora_rank:
        raise ValueError("adapter-only LoRA updates (actor_rollout_ref.model.lora.merge=False) need vLLM's LoRA: the hf "
                         "rollout backend takes merged weights; set lora.merge=True, or use rollout.name=vllm")
    if request.use_gpu and request.sleep_mode:
        raise ValueError(f"{PREFIX}.free_cache_engine=True in colocated placement asks the engines to sleep while the "
                         "trainer works; the hf rollout backend has no sleep mode (its model stays on the GPU): set "
                         f"{PREFIX}.free_cache_engine=False, or use rollout.name=vllm")
    for key in ("prompt_length", "response_length"):
        if not isinstance(_get(config, key), int):
            raise ValueError(f"rollout.{key}={_get(config, key)!r} is not an integer; build the rollout config from the "
                             f"full megarl config or set rollout.{key} explicitly")
    max_model_len = _get(config, "max_model_len") or config.prompt_length + config.response_length
    return HFReplicaSpec(
        model_path=request.model_path, tokenizer_path=request.tokenizer_path, dtype=str(config.dtype),
        max_model_len=int(max_model_len), max_num_seqs=int(config.max_num_seqs), seed=int(config.seed),
        cpu_threads=max(1, int(request.cpus_per_replica)),
        logprobs_mode=request.logprobs_mode or _get(config, "logprobs_mode") or "processed_logprobs",
        trust_remote_code=request.trust_remote_code,
        max_num_batched_tokens=int(_get(config, "max_num_batched_tokens") or 8192),
        gpu_memory_utilization=float(_get(config, "gpu_memory_utilization") or 0.5),
        disable_log_stats=bool(_get(config, "disable_log_stats", True)),
        hf_overrides=tuple(sorted((request.hf_overrides or {}).items())))


def _get(config: Any, key: str, default: Any = None) -> Any:
    """A rollout key, with a default for partial configs (tests build plain ones)."""
    value = config.get(key, default) if hasattr(config, "get") else getattr(config, key, default)
    return default if value is None else value


def config_problems(rollout: Any, lora: Any, notes: list[str]) -> list[Problem]:
    """What a config (its ``rollout`` and ``model.lora`` sections) asks of ``rollout.name=hf`` that it cannot do
    (one problem each); notes for the rest."""
    problems = []
    tp = rollout.tensor_model_parallel_size
    if tp != 1:
        problems.append(refusal(f"{PREFIX}.tensor_model_parallel_size={tp} with rollout.name=hf", "tensor-parallel hf "
                                "rollout replicas", "an hf replica is one process: set tensor_model_parallel_size=1 "
                                "(more replicas with num_replicas), or use rollout.name=vllm"))
    if lora.rank > 0 and not lora.merge:
        problems.append(refusal("actor_rollout_ref.model.lora.merge=False with rollout.name=hf", "adapter-only LoRA "
                                "updates on the hf rollout backend", "set lora.merge=True (the merged weights are "
                                "synced), or use rollout.name=vllm"))
    for key, value in sorted(dict(rollout.engine_kwargs.vllm or {}).items()):
        problems.append(refusal(f"{PREFIX}.engine_kwargs.vllm.{key}={value} with rollout.name=hf", "vLLM engine "
                                "arguments on the hf rollout backend", f"drop {PREFIX}.engine_kwargs.vllm.{key}, or use "
                                "rollout.name=vllm"))
    if not rollout.enforce_eager:
        problems.append(refusal(f"{PREFIX}.enforce_eager=False with rollout.name=hf", "CUDA graphs on the hf rollout "
                                "backend", "it runs the model eagerly: set enforce_eager=True, or use rollout.name=vllm"))
    if rollout.scheduling_policy != "fcfs":
        problems.append(refusal(f"{PREFIX}.scheduling_policy={rollout.scheduling_policy} with rollout.name=hf",
                                "priority scheduling on the hf rollout backend", "it serves requests first come, first "
                                "served: set scheduling_policy=fcfs, or use rollout.name=vllm"))
    if rollout.enable_prefix_caching or rollout.enable_chunked_prefill:
        notes.append(f"rollout.name=hf: {PREFIX}.enable_prefix_caching and enable_chunked_prefill are vLLM scheduler "
                     "features; the hf backend prefills each admitted prompt whole, once for its n samples, and keeps "
                     "no cache across requests (results are the same, only speed differs)")
    return problems


def replica_env(spec: HFReplicaSpec, on_gpu: bool) -> dict[str, str]:
    env = {"TOKENIZERS_PARALLELISM": "false"}
    if not on_gpu:
        env.update(OMP_NUM_THREADS=str(spec.cpu_threads), MKL_NUM_THREADS=str(spec.cpu_threads))
    return env


HF = register_rollout_backend(
    RolloutBackend(name="hf", description="Hugging Face transformers generation",
                   replica_class="megarl.rollout.hf.replica:HFReplica", replica_spec=spec_for,
                   replica_env=replica_env, tensor_splits=None, config_problems=config_problems))
