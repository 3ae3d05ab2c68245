"""The clipped value-function loss of PPO's critic (verl's `compute_value_loss`)."""

from __future__ import annotations

from typing import Any, Mapping

import torch

from megarl.algorithms.aggregation import agg_loss
from megarl.algorithms.masked import masked_mean


def compute_value_loss(
    vpreds: torch.Tensor,
    returns: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    cliprange_value: float,
    loss_agg_mode: str = "token-mean",
    global_batch_info: Mapping[str, Any] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """0.5 * agg(max((V - R)^2, (clip(V, V_old - c, V_old + c) - R)^2)), c = `critic.cliprange_value`.

    Args:
        vpreds: values predicted now; values: values at rollout time (V_old); returns: targets.
    Returns:
        (vf_loss, vf_clipfrac): the scalar loss and the fraction of valid tokens where the
        clipped term is the larger one (verl logs `critic/vf_clipfrac`).
    """
    vpred_clipped = torch.maximum(torch.minimum(vpreds, values + cliprange_value), values - cliprange_value)
    vf_losses1 = (vpreds - returns) ** 2
    vf_losses2 = (vpred_clipped - returns) ** 2
    clipped_vf_losses = torch.maximum(vf_losses1, vf_losses2)
    vf_loss = 0.5 * agg_loss(clipped_vf_losses, response_mask, loss_agg_mode, **dict(global_batch_info or {}))
    vf_clipfrac = masked_mean(torch.gt(vf_losses2, vf_losses1).float(), response_mask)
    return vf_loss, vf_clipfrac.detach()
