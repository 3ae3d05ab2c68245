"""Log-probs and entropy from logits whose vocabulary is split over tensor-parallel ranks.

Each TP rank holds ``[..., vocab / tp]`` logits. The full-vocabulary logits are never gathered:
the softmax normaliser, the target logit and the entropy's ``sum p * z`` are reduced over TP as
scalars per token. Both functions are differentiable, and every TP rank returns the same values.
Logits of ``-inf`` (the masked vocabulary padding, ``megarl.models.vocab_padding``) have
probability 0 and contribute nothing, to the values or the gradients.
"""
from __future__ import annotations

import torch
import torch.distributed as dist


def vocab_parallel_log_probs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """``log softmax(logits)[target]`` per token, ``[..., V/tp], [...] -> [...]``, in fp32.

    Uses megatron's ``vocab_parallel_cross_entropy`` (its memory-lean custom backward). That
    function works in place on fp32 logits, so it gets a copy: the caller's logits stay usable.
    """
    from megatron.core import tensor_parallel

    return -tensor_parallel.vocab_parallel_cross_entropy(logits.to(torch.float32, copy=True), targets)


def vocab_parallel_entropy(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of ``softmax(logits)`` per token, ``[..., V/tp] -> [...]``, in fp32.

    H = log S - sum_v exp(z_v - m) (z_v - m) / S with m the global max and S = sum_v exp(z_v - m).
    The sums over each rank's vocabulary slice are all-reduced over TP (forward: sum; backward:
    identity, as the result is used identically on every TP rank).
    """
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

    logits = logits.float()
    global_max = logits.detach().max(dim=-1, keepdim=True).values
    if parallel_state.get_tensor_model_parallel_world_size() > 1:
        dist.all_reduce(global_max, op=dist.ReduceOp.MAX, group=parallel_state.get_tensor_model_parallel_group())
    shifted = logits - global_max
    exp = shifted.exp()
    sum_exp = reduce_from_tensor_model_parallel_region(exp.sum(dim=-1))
    # p * log p is 0 where p = 0: a -inf logit must not turn 0 * -inf into NaN (nor its gradient)
    weighted = reduce_from_tensor_model_parallel_region((exp * shifted.nan_to_num(neginf=0.0)).sum(dim=-1))
    return sum_exp.log() - weighted / sum_exp


def vocab_parallel_log_probs_at(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """``log softmax(logits)`` at several token ids per token, ``[n, V/tp], [n, k] -> [n, k]``, in fp32.

    The normaliser is reduced over TP as in ``vocab_parallel_entropy``; each id's logit comes from the
    rank whose vocabulary slice holds it (the others add 0). Differentiable; the same values on every
    TP rank. The ids must be real tokens (not the masked vocabulary padding).
    """
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

    logits = logits.float()
    width, tp = logits.shape[-1], parallel_state.get_tensor_model_parallel_world_size()
    global_max = logits.detach().max(dim=-1, keepdim=True).values
    if tp > 1:
        dist.all_reduce(global_max, op=dist.ReduceOp.MAX, group=parallel_state.get_tensor_model_parallel_group())
    log_normaliser = reduce_from_tensor_model_parallel_region((logits - global_max).exp().sum(-1, keepdim=True)).log()
    local = ids - (parallel_state.get_tensor_model_parallel_rank() * width if tp > 1 else 0)
    here = (local >= 0) & (local < width)
    picked = torch.where(here, logits.gather(-1, local.clamp(0, width - 1)) - global_max, torch.zeros_like(local,
                                                                                                       dtype=logits.dtype))
    return reduce_from_tensor_model_parallel_region(picked) - log_normaliser
