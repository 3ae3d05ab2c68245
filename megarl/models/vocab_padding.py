"""Masked logits for the vocabulary padding rows.

megatron splits the embedding and output layer over TP only when the vocabulary divides evenly,
so the bridge pads it (``ParallelLayout.padded_vocab_size``: megatron's
``make_vocab_size_divisible_by * tp`` rule). The padding rows are zero and come from no HF
tensor; their logits would still take part in every softmax (a zero logit is a real
probability). ``mask_padding_logits`` sets them to ``-inf`` at the output layer itself, so every
consumer (the engine's log-probs and entropy, megatron's own loss, any forward a user runs) sees
exactly the HF model's distribution, and no gradient reaches the padding rows.
"""
from __future__ import annotations

import torch

from megarl.models.layout import ParallelLayout


def real_columns(vocab_size: int, layout: ParallelLayout, tp_rank: int) -> int:
    """How many of TP rank ``tp_rank``'s logit columns are real vocabulary entries (the rest are padding)."""
    per_rank = layout.padded_vocab_size(vocab_size) // layout.tp
    return max(0, min(per_rank, vocab_size - tp_rank * per_rank))


def mask_padding_logits(models: list, vocab_size: int, layout: ParallelLayout) -> int:
    """On this rank's last-stage chunk, make the padding logits ``-inf``; returns how many columns are masked."""
    from megatron.core import parallel_state as ps

    padded = layout.padded_vocab_size(vocab_size)
    per_rank = padded // layout.tp
    real = real_columns(vocab_size, layout, ps.get_tensor_model_parallel_rank())
    if padded == vocab_size:
        return 0
    for model in models:
        output_layer = getattr(model, "output_layer", None)
        if output_layer is not None and getattr(model, "post_process", False):
            output_layer.register_forward_hook(_masking_hook(per_rank, real, padded, vocab_size))
    return per_rank - real


def _masking_hook(per_rank: int, real: int, padded: int, vocab_size: int):
    """Mask columns >= ``real`` of this rank's logits (>= ``vocab_size`` if the output was gathered)."""

    def mask(module, args, output):
        logits, bias = output
        columns = logits.shape[-1]
        first_padding = real if columns == per_rank else vocab_size if columns == padded else None
        if first_padding is None:
            raise RuntimeError(f"output layer gave {columns} logit columns; expected {per_rank} (this TP rank) or {padded}")
        if first_padding == columns:
            return output
        padding = torch.arange(columns, device=logits.device) >= first_padding
        return logits.masked_fill(padding, float("-inf")), bias

    return mask
