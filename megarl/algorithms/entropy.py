"""Token entropy of the policy from its logits, and the entropy term of the actor loss.

H = logsumexp(z) - sum(softmax(z) * z), which equals -sum(p log p) without computing log p, so
it stays finite for very large or very small logits (verl's `entropy_from_logits`). Vocabulary
entries masked out with -inf logits contribute 0, as their probability is 0.
"""

from __future__ import annotations

import torch

from megarl.algorithms.aggregation import agg_loss


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy over the last dimension: `[..., vocab]` -> `[...]`."""
    probs = torch.softmax(logits, dim=-1)
    # 0 * -inf would be NaN: entries with probability 0 contribute 0 (and no gradient).
    finite_logits = torch.where(probs > 0, logits, torch.zeros_like(logits))
    return torch.logsumexp(logits, dim=-1) - torch.sum(probs * finite_logits, dim=-1)


def compute_entropy_loss(
    logits: torch.Tensor, response_mask: torch.Tensor, loss_agg_mode: str = "token-mean"
) -> torch.Tensor:
    """Aggregated entropy of `[batch, response_len, vocab]` logits over the response tokens.

    The actor subtracts `entropy_coeff * entropy` from its loss (verl logs `actor/entropy`).
    """
    return agg_loss(entropy_from_logits(logits), response_mask, loss_agg_mode)
