"""Loss aggregation: a `[batch, response_len]` loss matrix -> one scalar (`loss_agg_mode`).

Modes, as in verl's `agg_loss` (`actor_rollout_ref.actor.loss_agg_mode`; checked against verl's
August 2026 snapshot, which added `token-sum`):

- `token-mean`: sum over all valid tokens / number of valid tokens (DAPO's token-level loss).
- `token-sum`: sum over all valid tokens, not normalised (its gradient grows with the batch; SPIN's
  DPO weights, `megarl.algorithms.spin`, are made for it).
- `seq-mean-token-sum`: each sequence sums its tokens; mean over non-empty sequences.
- `seq-mean-token-mean`: each sequence averages its tokens; mean over non-empty sequences
  (the original GRPO / PPO-for-LLMs form).
- `seq-mean-token-sum-norm`: `seq-mean-token-sum` divided by a constant, `loss_scale_factor`
  (default: the padded response length), as in Dr. GRPO (arXiv:2503.20783).

Global normalisation for gradient accumulation: a micro-batch is normalised by totals of the
global batch when they are given (`batch_num_tokens` for token-mean, `global_batch_size`
for the seq-mean modes; `token-sum` needs none), and multiplied by `dp_size` to undo data-parallel
gradient averaging.
Without them the micro-batch's own totals are used. An empty mask gives 0, never NaN.
"""

from __future__ import annotations

import torch

from megarl.algorithms.masked import masked_sum

LOSS_AGG_MODES: tuple[str, ...] = (
    "token-mean",
    "token-sum",
    "seq-mean-token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
)


def agg_loss(
    loss_mat: torch.Tensor,
    loss_mask: torch.Tensor,
    loss_agg_mode: str,
    dp_size: int = 1,
    batch_num_tokens: float | torch.Tensor | None = None,
    global_batch_size: float | torch.Tensor | None = None,
    loss_scale_factor: float | None = None,
) -> torch.Tensor:
    """Aggregate a per-token loss matrix into a scalar.

    Args:
        loss_mat: per-token losses, `[batch, response_len]`.
        loss_mask: 1 for tokens that count, 0 for padding, same shape.
        loss_agg_mode: one of `LOSS_AGG_MODES`.
        dp_size: data-parallel size; the result is multiplied by it (see module docstring).
        batch_num_tokens: valid tokens in the global batch (token-mean); required when dp_size > 1.
        global_batch_size: non-empty sequences in the global batch (seq-mean modes); required when dp_size > 1.
        loss_scale_factor: divisor of `seq-mean-token-sum-norm`; default `loss_mask.shape[-1]`.
            Keep it constant over training (e.g. the max response length) to reproduce Dr. GRPO.
    """
    if loss_agg_mode not in LOSS_AGG_MODES:
        raise ValueError(
            f"unknown loss_agg_mode {loss_agg_mode!r} (set by `actor_rollout_ref.actor.loss_agg_mode`). "
            f"Known names: {', '.join(LOSS_AGG_MODES)}."
        )
    if loss_mat.shape != loss_mask.shape:
        raise ValueError(f"loss_mat {tuple(loss_mat.shape)} and loss_mask {tuple(loss_mask.shape)} must have the same shape")
    loss_mask = loss_mask.to(loss_mat.dtype)

    if loss_agg_mode == "token-mean":
        denominator = _global_total(batch_num_tokens, loss_mask.sum(), dp_size, "batch_num_tokens")
        return _safe_divide(masked_sum(loss_mat, loss_mask), denominator) * dp_size
    if loss_agg_mode == "token-sum":  # the sum over the global batch once DDP has averaged the ranks' gradients
        return masked_sum(loss_mat, loss_mask) * dp_size

    token_counts = loss_mask.sum(dim=-1)
    seq_mask = (token_counts > 0).to(loss_mat.dtype)  # empty sequences do not count
    seq_losses = masked_sum(loss_mat, loss_mask, axis=-1)
    if loss_agg_mode == "seq-mean-token-mean":
        seq_losses = seq_losses / (token_counts + 1e-8)
    denominator = _global_total(global_batch_size, seq_mask.sum(), dp_size, "global_batch_size")
    loss = _safe_divide(masked_sum(seq_losses, seq_mask), denominator) * dp_size
    if loss_agg_mode == "seq-mean-token-sum-norm":
        loss = loss / (loss_mask.shape[-1] if loss_scale_factor is None else loss_scale_factor)
    return loss


def _global_total(given, local: torch.Tensor, dp_size: int, name: str):
    if given is not None:
        return given
    if dp_size > 1:
        raise ValueError(f"{name} (a global-batch total) is required when dp_size={dp_size} > 1")
    return local


def _safe_divide(numerator: torch.Tensor, denominator) -> torch.Tensor:
    """numerator / denominator, with 0 / 0 = 0 (an empty batch). Gradients stay finite."""
    denominator = torch.as_tensor(denominator, dtype=numerator.dtype, device=numerator.device)
    return numerator / torch.where(denominator == 0, torch.ones_like(denominator), denominator)
