"""A vLLM worker's memory: its weights, its activation peak and the KV cache that fits.

vLLM takes ``gpu_memory_utilization`` of the GPU's memory and, after loading the weights and
profiling one forward of ``max_num_batched_tokens`` tokens, gives the rest to the KV cache. The
plan does the same arithmetic: weights by vLLM's TP split (``ModelFacts.vllm_weight_bytes``),
an activation peak estimated from the model's widths (vLLM measures its own at start), the KV
bytes per token (``ModelFacts.kv_bytes_per_token``: MLA's compressed latent for DeepSeek-V3),
and sequences of ``prompt_length + response_length`` tokens rounded up to vLLM's 16-token blocks.
"""
from __future__ import annotations

from dataclasses import dataclass

from megarl.plan.hardware import GB
from megarl.plan.inputs import RolloutInputs
from megarl.plan.model import ModelFacts

BLOCK = 16  # vLLM's KV-cache block size (tokens)
FP32 = 4


@dataclass(frozen=True)
class EngineMemory:
    budget: float  # gpu_memory_utilization x the GPU's memory
    weights: int
    activations: int
    context: float  # the worker's CUDA context, inside the budget
    kv_bytes_per_token: int
    sequence_length: int  # tokens a sequence may reach (block-rounded)

    @property
    def kv_cache(self) -> float:
        return self.budget - self.weights - self.activations - self.context

    @property
    def concurrent_sequences(self) -> int:
        """Full-length sequences the KV cache holds at once (0: not even one)."""
        if self.kv_cache <= 0:
            return 0
        return int(self.kv_cache // (self.kv_bytes_per_token * self.sequence_length))


def activation_peak(model: ModelFacts, rollout: RolloutInputs, itemsize: int) -> int:
    """vLLM's profiling forward: ``max_num_batched_tokens`` tokens through the widest layer, plus
    the fp32 logits of up to ``max_num_seqs`` sampled positions (an estimate; vLLM measures it)."""
    d, tp = model.dims, rollout.tp
    ffn = d.ffn_hidden_size if d.moe is None else max(d.ffn_hidden_size, d.moe.topk * d.moe.ffn_hidden_size)
    layer = rollout.max_num_batched_tokens * (4 * d.hidden_size + 3 * ffn // tp) * itemsize
    logits = min(rollout.max_num_seqs, rollout.max_num_batched_tokens) * (d.vocab_size // tp) * FP32 * 2
    return layer + logits


def engine_memory(model: ModelFacts, rollout: RolloutInputs, memory_bytes: float, itemsize: int,
                  context_gb: float) -> EngineMemory:
    seq = -(-rollout.sequence_length // BLOCK) * BLOCK
    return EngineMemory(
        budget=rollout.gpu_memory_utilization * memory_bytes,
        weights=model.vllm_weight_bytes(rollout.tp, itemsize),
        activations=activation_peak(model, rollout, itemsize),
        context=context_gb * GB,
        kv_bytes_per_token=model.kv_bytes_per_token(rollout.tp, itemsize),
        sequence_length=seq,
    )
