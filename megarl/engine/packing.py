"""Turn an RL micro-batch into model inputs, and the model's per-position outputs back into ``[B, R]``.

``RLBatch`` rows hold padding on both sides (left-padded prompt, right-padded response). The model
sees one of two layouts (``<role>.megatron.use_remove_padding``, verl's key and default):

* **packed** (``packed_row``): the real tokens of every sample one after the other in a single row
  (megatron's THD format), ``PackedSeqParams.cu_seqlens`` marking where each sample starts; the
  core attention keeps samples apart and RoPE restarts at each. No padding token is computed. With
  context parallelism each sample is padded to a multiple of ``2 x CP`` (at most ``2 x CP - 1``
  tokens) and every CP rank keeps its two chunks of each (``megarl.models.attention.context_parallel``);
  under sequence parallelism the last sample is extended so that each rank's share divides by TP.
* **padded** (``padded_rows``): each sample's real tokens moved to the left of its own row, rows cut
  to the micro-batch's longest sample; a causal mask is all the model needs.

Positions restart at 0 in every sample (or follow the batch's ``position_ids``). The output at a
token's position predicts the next token, so response token ``k`` of sample ``i`` is scored at the
position of that token minus one. ``gather_response`` picks this rank's scoring outputs (only real
response tokens: no padding reaches a softmax or a loss) and ``scatter_response`` lays per-token
results out as ``[B, R]`` (0 at padding), summed over the CP group so that every CP rank holds all of
them; its backward hands each rank the gradient of its own tokens.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from megarl.engine.batch import RLBatch
from megarl.models.attention.context_parallel import PackedLayout, packed_layout


@dataclass
class ModelInputs:
    tokens: torch.Tensor  # [rows, S]: rows = samples (padded) or 1 (packed); S this CP rank's tokens
    position_ids: torch.Tensor  # [rows, S]
    response_index: torch.Tensor  # [B, R] flat index into [rows * S] of the output scoring response token k
    response_here: torch.Tensor  # [B, R] bool: a real response token scored on this rank
    response_valid: torch.Tensor  # [B, R] bool: a real response token
    targets: torch.Tensor  # [B, R] response token ids (0 where not real)
    source: torch.Tensor | None = None  # [rows, S] flat index into the batch's [B * T] tokens; -1: padding
    packed_seq_params: object | None = None  # megatron's PackedSeqParams (packed layout)
    cp_group: object | None = None  # the CP group when CP > 1 (scatter_response sums over it)
    image_mask: torch.Tensor | None = None  # [rows, S] bool: the prompts' image tokens (vision-language models)
    pixel_values: torch.Tensor | None = None  # [patches, D] the micro-batch's images in row (packing) order
    image_grid_thw: torch.Tensor | None = None  # [images, 3]

    @property
    def global_length(self) -> int:
        """Tokens of one row before the CP split: the pipeline schedule's ``seq_length``."""
        params = self.packed_seq_params
        return self.tokens.shape[1] if params is None else int(params.cu_seqlens_q_padded[-1])


def _real_positions(batch: RLBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's index among its sample's real tokens (-1 before the first), and the real tokens per sample."""
    real = batch.attention_mask.bool()
    return real.long().cumsum(dim=1) - 1, real.sum(dim=1)


def _response_fields(batch: RLBatch, scoring: torch.Tensor) -> dict:
    """``scoring [B, R]``: the index of the output scoring each response token (-1: not on this rank)."""
    valid = batch.attention_mask[:, batch.prompt_length:].bool()
    here = valid & (scoring >= 0)
    targets = torch.where(valid, batch.responses, torch.zeros_like(batch.responses))
    return dict(response_index=scoring.clamp(min=0), response_here=here, response_valid=valid, targets=targets)


def _flat_token_index(batch: RLBatch) -> torch.Tensor:
    """``[B, T]``: each token's index in the flattened ``[B * T]`` batch."""
    return torch.arange(batch.input_ids.numel(), device=batch.input_ids.device).view_as(batch.input_ids)


def padded_rows(batch: RLBatch, multiple_of: int = 1) -> ModelInputs:
    """The padded layout: real tokens left-aligned per row; the length is padded up to ``multiple_of``
    (the TP size under sequence parallelism, which splits the sequence over TP ranks)."""
    real = batch.attention_mask.bool()
    index, lengths = _real_positions(batch)
    length = -(-int(lengths.max()) // multiple_of) * multiple_of
    rows = torch.arange(len(batch), device=real.device).unsqueeze(1).expand_as(real)
    tokens = torch.zeros(len(batch), length, dtype=batch.input_ids.dtype, device=real.device)
    tokens[rows[real], index[real]] = batch.input_ids[real]
    positions = torch.zeros_like(tokens)
    source = index if batch.position_ids is None else batch.position_ids
    positions[rows[real], index[real]] = source[real].to(positions.dtype)
    origin = torch.full_like(tokens, -1, dtype=torch.long)
    origin[rows[real], index[real]] = _flat_token_index(batch)[real]
    response = index[:, batch.prompt_length:]
    scoring = (response - 1).clamp(min=0) + torch.arange(len(batch), device=real.device).unsqueeze(1) * length
    return ModelInputs(tokens, positions, **_response_fields(batch, scoring), source=origin)


def packed_lengths(batch: RLBatch, cp_size: int = 1, multiple_of: int = 1, total: int | None = None) -> list[int]:
    """Each sample's length in the packed row: real tokens, padded to ``2 x CP`` chunks; the last one
    extended until the row (``total`` tokens when given) splits into ``CP x multiple_of`` shares."""
    unit = 2 * cp_size if cp_size > 1 else 1
    lengths = [-(-int(n) // unit) * unit for n in batch.sequence_lengths().tolist()]
    natural = sum(lengths)
    while natural % (cp_size * multiple_of):
        natural += unit
    target = natural if total is None else total
    if target < natural or (target - natural) % unit or target % (cp_size * multiple_of):
        raise ValueError(f"a packed row of {target} tokens cannot hold samples needing {natural} in units of {unit}")
    lengths[-1] += target - sum(lengths)
    return lengths


def packed_row(batch: RLBatch, cp_size: int = 1, cp_rank: int = 0, cp_group=None, multiple_of: int = 1,
               total: int | None = None) -> ModelInputs:
    """The packed layout as CP rank ``cp_rank`` holds it (see the module docstring)."""
    from megatron.core.packed_seq_params import PackedSeqParams

    real = batch.attention_mask.bool()
    index, real_lengths = _real_positions(batch)
    layout: PackedLayout = packed_layout(tuple(packed_lengths(batch, cp_size, multiple_of, total)), cp_size, cp_rank)
    starts = torch.tensor(layout.offsets[:-1], device=real.device)
    row = torch.zeros(layout.offsets[-1], dtype=batch.input_ids.dtype, device=real.device)
    where = (starts.unsqueeze(1) + index)[real]  # each real token's place in the whole packed row
    row[where] = batch.input_ids[real]
    origin = torch.full((layout.offsets[-1],), -1, dtype=torch.long, device=real.device)
    origin[where] = _flat_token_index(batch)[real]
    positions = layout.sequence_positions.to(real.device).clone()
    if batch.position_ids is not None:
        positions[where] = batch.position_ids[real].to(positions.dtype)
    local = layout.local_index.to(real.device)
    local_of = torch.full((layout.offsets[-1],), -1, dtype=torch.long, device=real.device)
    local_of[local] = torch.arange(len(local), device=real.device)
    scoring_global = starts.unsqueeze(1) + index[:, batch.prompt_length:] - 1
    scoring = local_of[scoring_global.clamp(min=0)]
    cu = torch.tensor(layout.offsets, dtype=torch.int32, device=real.device)
    cu_real = torch.cat([cu.new_zeros(1), real_lengths.cumsum(0).to(cu.dtype)])  # TE: without the padding
    longest = max(layout.lengths)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu_real, cu_seqlens_kv=cu_real, cu_seqlens_q_padded=cu,
                             cu_seqlens_kv_padded=cu, max_seqlen_q=longest, max_seqlen_kv=longest)
    return ModelInputs(row[local].unsqueeze(0), positions[local].unsqueeze(0), **_response_fields(batch, scoring),
                       source=origin[local].unsqueeze(0), packed_seq_params=params,
                       cp_group=cp_group if cp_size > 1 else None)


def with_vision(inputs: ModelInputs, batch: RLBatch, image_token_id: int, spatial_merge_size: int) -> ModelInputs:
    """``inputs`` for a vision-language model: M-RoPE positions ``[3, rows, S]`` (transformers' ``get_rope_index``
    of each sample's real tokens, so they restart in every sample of a packed row; 0 at padding), the image
    mask (the image tokens of the PROMPT part only: a response may sample the id as text) and the pixel inputs
    in the layout's sample order (both layouts keep the batch's row order)."""
    from megarl.models.mrope import mrope_position_ids

    if batch.position_ids is not None:
        raise ValueError("batch.position_ids cannot be given for a vision-language model: its M-RoPE positions "
                         "are computed from the image grids; leave position_ids None")
    pixels = batch.pixel_inputs()
    grid = None if pixels is None else pixels[1]
    image_mask = torch.zeros_like(batch.attention_mask, dtype=torch.bool)
    if pixels is not None:
        prompt = batch.input_ids[:, : batch.prompt_length]
        image_mask[:, : batch.prompt_length] = (prompt == image_token_id) & batch.attention_mask[:, : batch.prompt_length].bool()
    positions = mrope_position_ids(batch.input_ids, grid, batch.attention_mask, image_token_id=image_token_id,
                                   spatial_merge_size=spatial_merge_size, image_mask=image_mask)
    source, real = inputs.source.clamp(min=0), inputs.source >= 0
    flat = positions.reshape(3, -1)[:, source] * real  # [3, rows, S]
    image_mask = image_mask.reshape(-1)[source] & real
    return replace(inputs, position_ids=flat.to(inputs.position_ids.dtype), image_mask=image_mask,
                   pixel_values=None if pixels is None else pixels[0], image_grid_thw=grid)


def pad_to(inputs: ModelInputs, rows: int, length: int) -> ModelInputs:
    """Padded-layout inputs grown to ``[rows, length]`` with padding rows and columns (token id 0), for
    schedules that need every micro-batch in the same shape; the extra rows are never read."""
    def grow(tensor: torch.Tensor, fill: int = 0) -> torch.Tensor:  # [..., rows, S] (M-RoPE positions: [3, rows, S])
        grown = tensor.new_full((*tensor.shape[:-2], rows, length), fill)
        grown[..., : tensor.shape[-2], : tensor.shape[-1]] = tensor
        return grown

    old = inputs.tokens.shape[1]
    row = inputs.response_index // old
    return replace(inputs, tokens=grow(inputs.tokens), position_ids=grow(inputs.position_ids),
                   response_index=inputs.response_index + row * (length - old),
                   source=None if inputs.source is None else grow(inputs.source, -1),
                   image_mask=None if inputs.image_mask is None else grow(inputs.image_mask))


def gather_response(per_position: torch.Tensor, inputs: ModelInputs) -> torch.Tensor:
    """The outputs that score this rank's real response tokens: ``[rows, S, ...]`` -> ``[n, ...]`` (in
    ``response_here`` order)."""
    flat = per_position.reshape(per_position.shape[0] * per_position.shape[1], *per_position.shape[2:])
    return flat[inputs.response_index[inputs.response_here]]


def scatter_response(values: torch.Tensor, inputs: ModelInputs) -> torch.Tensor:
    """``[n, ...]`` per-token results (``gather_response``'s order) as ``[B, R, ...]``, 0 at padding,
    complete on every CP rank."""
    out = values.new_zeros(*inputs.response_here.shape, *values.shape[1:])
    here = inputs.response_here.view(*inputs.response_here.shape, *[1] * (values.dim() - 1)).expand_as(out)
    out = out.masked_scatter(here, values)
    return _SumOverGroup.apply(out, inputs.cp_group) if inputs.cp_group is not None else out


class _SumOverGroup(torch.autograd.Function):
    """All-reduce (sum) of per-rank parts that do not overlap; each rank then computes the same loss
    from the whole, so the backward hands every rank the gradient as it is (its own positions)."""

    @staticmethod
    def forward(ctx, tensor, group):
        tensor = tensor.clone()
        dist.all_reduce(tensor, group=group)
        return tensor

    @staticmethod
    def backward(ctx, grad):
        return grad, None
