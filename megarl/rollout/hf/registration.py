"""The ``hf`` rollout backend's settings and registry entry (imports no transformers model code).

One replica is one process holding the model (no tensor parallelism: ``rollout.tensor_model_parallel_size``
must be 1). It receives full HF tensors from the weight sync, serves no LoRA adapters (merged
updates only) and has no sleep mode; the config check says so before anything starts.
"""
from __future__ import annotations

from dataclasses import dataclass

from megarl.rollout.backend import ReplicaRequest, RolloutBackend, register_rollout_backend


@dataclass(frozen=True)
class HFReplicaSpec:
    model_path: str
    tokenizer_path: str | None
    dtype: str  # "auto": bfloat16 on GPU, float32 on CPU
    max_model_len: int
    max_num_seqs: int  # requests batched into one forward
    seed: int
    cpu_threads: int
    logprobs_mode: str = "processed_logprobs"
    trust_remote_code: bool = False
    tensor_parallel_size: int = 1
    enable_sleep_mode: bool = False
    max_lora_rank: int = 0


def spec_for(request: ReplicaRequest) -> HFReplicaSpec:
    config = request.config
    tp = int(config.tensor_model_parallel_size)
    if tp != 1:
        raise ValueError(f"actor_rollout_ref.rollout.tensor_model_parallel_size={tp}: the hf rollout backend runs one "
                         "process per replica (no tensor parallelism); set it to 1, or use rollout.name=vllm")
    if request.lora_rank:
        raise ValueError("adapter-only LoRA updates (actor_rollout_ref.model.lora.merge=False) need vLLM's LoRA: the hf "
                         "rollout backend takes merged weights; set lora.merge=True, or use rollout.name=vllm")
    max_model_len = config.max_model_len or config.prompt_length + config.response_length
    logprobs_mode = request.logprobs_mode or (config.get("logprobs_mode", None) if hasattr(config, "get") else None)
    return HFReplicaSpec(
        model_path=request.model_path, tokenizer_path=request.tokenizer_path, dtype=str(config.dtype),
        max_model_len=int(max_model_len), max_num_seqs=int(config.max_num_seqs), seed=int(config.seed),
        cpu_threads=max(1, int(request.cpus_per_replica)), logprobs_mode=logprobs_mode or "processed_logprobs",
        trust_remote_code=request.trust_remote_code)


def replica_env(spec: HFReplicaSpec, on_gpu: bool) -> dict[str, str]:
    env = {"TOKENIZERS_PARALLELISM": "false"}
    if not on_gpu:
        env.update(OMP_NUM_THREADS=str(spec.cpu_threads), MKL_NUM_THREADS=str(spec.cpu_threads))
    return env


HF = register_rollout_backend(
    RolloutBackend(name="hf", description="Hugging Face transformers generation",
                   replica_class="megarl.rollout.hf.replica:HFReplica", replica_spec=spec_for,
                   replica_env=replica_env, tensor_splits=None))
