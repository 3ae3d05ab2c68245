"""Masked reductions over `[batch, response_len]` tensors (sum, mean, variance, whitening).

These follow verl's `verl.utils.torch_functional` definitions so that numbers match:
`masked_mean` divides by `mask.sum() + 1e-8`, `masked_var` is Bessel-corrected and
`masked_whiten` scales by `rsqrt(var + 1e-8)`. One deliberate difference: whitening fewer than
two valid elements returns zeros (the centred value of a single element) instead of raising,
so a batch of empty responses yields zeros, never NaN.
"""

from __future__ import annotations

import torch


def masked_sum(values: torch.Tensor, mask: torch.Tensor, axis: int | None = None) -> torch.Tensor:
    """Sum of `values` where `mask` is non-zero (weighted by `mask`).

    Values outside the mask are replaced by 0 first, so a NaN or inf in padding cannot leak in.
    """
    valid = torch.where(mask.bool(), values, torch.zeros_like(values))
    product = valid * mask
    return product.sum() if axis is None else product.sum(dim=axis)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, axis: int | None = None) -> torch.Tensor:
    """Mean of `values` over the mask; 0 where the mask is empty (denominator `mask.sum() + 1e-8`)."""
    count = mask.sum() if axis is None else mask.sum(dim=axis)
    return masked_sum(values, mask, axis) / (count + 1e-8)


def masked_var(values: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance of `values` over the whole mask (a scalar), Bessel-corrected when `unbiased`."""
    mean = masked_mean(values, mask)
    variance = masked_mean((values - mean) ** 2, mask)
    if unbiased:
        count = mask.sum()
        if count <= 1:
            raise ValueError(
                f"the unbiased variance needs at least 2 valid elements, the mask has {float(count):g}; "
                "use a larger batch or unbiased=False."
            )
        variance = variance * (count / (count - 1))
    return variance


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
    """Normalise `values` to zero mean and unit variance over the mask, as verl does.

    Positions outside the mask are transformed too (verl does the same); callers multiply by
    the mask where it matters. With fewer than 2 valid elements the centred result is all zeros.
    """
    mean = masked_mean(values, mask)
    if mask.sum() <= 1:
        whitened = torch.zeros_like(values)
    else:
        whitened = (values - mean) * torch.rsqrt(masked_var(values, mask) + 1e-8)
    if not shift_mean:
        whitened = whitened + mean
    return whitened
