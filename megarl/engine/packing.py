"""Turn a padded RL micro-batch into model inputs, and model outputs back into ``[B, R]`` tensors.

``RLBatch`` rows hold padding on both sides (left-padded prompt, right-padded response).
``pack`` moves each row's real tokens to the left: then every real token only attends to real
tokens before it, the model's default causal mask is all it needs (no attention-mask tensor),
and the sequence dimension can be cut to the micro-batch's longest sample. Positions are kept
(0, 1, 2, ... over the real tokens, or the batch's ``position_ids`` when given).

The output at packed position ``j`` predicts the token at ``j + 1``, so response token ``k`` of
row ``i`` is scored at ``response_index[i, k] = packed position of that token - 1``.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from megarl.engine.batch import RLBatch


@dataclass
class PackedInputs:
    tokens: torch.Tensor  # [b, S] real tokens first, then padding (id 0)
    position_ids: torch.Tensor  # [b, S]
    response_index: torch.Tensor  # [b, R] packed position whose output scores response token k
    response_valid: torch.Tensor  # [b, R] bool: response token k is a real token
    targets: torch.Tensor  # [b, R] response token ids (0 where not real)


def pack(batch: RLBatch, multiple_of: int = 1) -> PackedInputs:
    """Left-align the real tokens of every row; the length is padded up to ``multiple_of``
    (the TP size under sequence parallelism, which splits the sequence over TP ranks)."""
    real = batch.attention_mask.bool()
    packed_position = real.long().cumsum(dim=1) - 1  # where each real token lands
    lengths = real.sum(dim=1)
    length = int(lengths.max())
    length = -(-length // multiple_of) * multiple_of
    rows = torch.arange(len(batch), device=real.device).unsqueeze(1).expand_as(real)

    tokens = torch.zeros(len(batch), length, dtype=batch.input_ids.dtype, device=real.device)
    tokens[rows[real], packed_position[real]] = batch.input_ids[real]
    positions = torch.zeros_like(tokens)
    source_positions = packed_position if batch.position_ids is None else batch.position_ids
    positions[rows[real], packed_position[real]] = source_positions[real].to(positions.dtype)

    prompt_length = batch.prompt_length
    response_valid = real[:, prompt_length:]
    response_index = (packed_position[:, prompt_length:] - 1).clamp(min=0)
    targets = torch.where(response_valid, batch.responses, torch.zeros_like(batch.responses))
    return PackedInputs(tokens, positions, response_index, response_valid, targets)


def pad_to(packed: PackedInputs, rows: int, length: int) -> PackedInputs:
    """Model inputs grown to ``[rows, length]`` with padding rows and columns (token id 0).

    For schedules that need every micro-batch in the same shape; the extra rows are never read.
    """
    def grow(tensor: torch.Tensor) -> torch.Tensor:
        grown = tensor.new_zeros(rows, length)
        grown[: tensor.shape[0], : tensor.shape[1]] = tensor
        return grown

    return PackedInputs(grow(packed.tokens), grow(packed.position_ids), packed.response_index, packed.response_valid, packed.targets)


def gather_response(per_position: torch.Tensor, packed: PackedInputs) -> torch.Tensor:
    """Pick the outputs that score the response tokens: ``[b, S, ...]`` -> ``[b, R, ...]``."""
    index = packed.response_index
    if per_position.dim() == 3:
        index = index.unsqueeze(-1).expand(-1, -1, per_position.shape[-1])
    return per_position.gather(1, index)
