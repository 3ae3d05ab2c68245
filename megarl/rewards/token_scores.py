"""Turn one score per response into verl's ``token_level_scores``.

verl places a response's scalar reward on its last valid token and zeros
elsewhere, so that returns computed backwards over tokens start from it, and
outcome estimators (GRPO, RLOO, ...) read it with ``.sum(-1)``.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

if TYPE_CHECKING:
    import torch


def scores_to_token_level(scores: Sequence[float] | torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """A ``[batch, response_len]`` float tensor with ``scores[i]`` at row i's last mask position.

    ``response_mask`` is 1 on valid response tokens (right padding is 0). The
    last 1 of each row receives the score; a row with no valid token gets it at
    position 0 (where the mask zeroes it out of any loss, but ``.sum(-1)`` still
    sees it).
    """
    import torch  # here, not at module level: reward worker processes never need torch

    if response_mask.dim() != 2:
        raise ValueError(f"response_mask must be [batch, response_len], got shape {tuple(response_mask.shape)}")
    scores_t = torch.as_tensor(scores, dtype=torch.float32, device=response_mask.device).reshape(-1)
    batch, length = response_mask.shape
    if scores_t.numel() != batch:
        raise ValueError(f"{scores_t.numel()} scores for a response_mask with {batch} rows")
    positions = torch.arange(1, length + 1, device=response_mask.device)
    last = (response_mask.bool() * positions).amax(dim=1) - 1  # -1 for an all-zero row
    last = last.clamp(min=0)
    token_scores = torch.zeros(batch, length, dtype=torch.float32, device=response_mask.device)
    token_scores[torch.arange(batch, device=response_mask.device), last] = scores_t
    return token_scores
