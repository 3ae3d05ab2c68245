"""Multimodal RoPE (M-RoPE) of the Qwen vision-language models: 3-D positions and their rotary embedding.

Every token has three positions, (time, height, width). A text token's three are equal and count up
by one per token; the tokens of an image with a merged grid of ``h x w`` (its ``image_grid_thw`` row
``(t, H, W)`` divided by the spatial merge size) sit on that grid: position ``start + (0, i, j)`` for
the token in row ``i``, column ``j``, where ``start`` is the position the image begins at. The text
after the image goes on from ``start + max(h, w)``. This is what transformers'
``get_rope_index`` computes (5.x, images; videos are not supported here), written out per row.

The rotary embedding gives each frequency of a head to one of the three position streams:
``mrope_section = [t, h, w]`` frequency counts. Qwen2.5-VL gives them in blocks (the first ``t``
frequencies to time, the next ``h`` to height, the last ``w`` to width; megatron's
``MultimodalRotaryEmbedding`` layout); Qwen3-VL interleaves them (``mrope_interleaved``: frequency
``j`` is height's when ``j % 3 == 1`` and ``j < 3h``, width's when ``j % 3 == 2`` and ``j < 3w``, else
time's). Megatron's ``rotary_interleaved`` is another thing (pairs of adjacent channels instead of
halves) and stays off: both models rotate halves. ``MropeEmbedding`` computes either layout in
megatron's shape ``[S, B, 1, head_dim]``.

Packed sequences (THD, one row): give each sample's positions as computed for its own row; megatron
applies RoPE to a packed row from the embedding of every token of it (its freqs cover ``cu_seqlens[-1]``
tokens), so samples stay independent.
"""
from __future__ import annotations

import torch


MASK_HINT = " (image token ids a response holds as text need image_mask: the prompt's image tokens)"


def image_runs(is_image: torch.Tensor) -> list[tuple[int, int]]:
    """[start, stop) of every run of consecutive image tokens (``is_image``, one row): one run per image."""
    is_image = is_image.int()
    edges = torch.diff(is_image, prepend=is_image.new_zeros(1), append=is_image.new_zeros(1))
    starts = (edges == 1).nonzero().flatten().tolist()
    stops = (edges == -1).nonzero().flatten().tolist()
    return list(zip(starts, stops))


def row_positions(is_image: torch.Tensor, grids: list[tuple[int, int, int]], spatial_merge_size: int,
                  where: str = "row") -> torch.Tensor:
    """[3, len(is_image)] positions of one sample's real tokens (``is_image``: its image tokens), its images'
    grids (t, H, W) in order."""
    runs = image_runs(is_image)
    if len(runs) != len(grids):
        raise ValueError(f"{where}: {len(runs)} runs of image tokens but {len(grids)} images in image_grid_thw; "
                         f"each image must be one run of image tokens, as the processor expands it{MASK_HINT}")
    pieces, position, cursor = [], 0, 0
    for (start, stop), (t, height, width) in zip(runs, grids):
        h, w = height // spatial_merge_size, width // spatial_merge_size
        if stop - start != t * h * w:
            raise ValueError(f"{where}: an image of grid {(t, height, width)} needs {t * h * w} image tokens, the row "
                             f"has {stop - start} at {start}; expand the prompt with the grids it is given{MASK_HINT}")
        text = start - cursor
        pieces.append(torch.arange(text).expand(3, text) + position)
        position += text
        grid_t, grid_h, grid_w = torch.meshgrid(torch.arange(t), torch.arange(h), torch.arange(w), indexing="ij")
        pieces.append(torch.stack([grid_t, grid_h, grid_w]).reshape(3, -1) + position)
        position += max(h, w)
        cursor = stop
    text = len(is_image) - cursor
    pieces.append(torch.arange(text).expand(3, text) + position)
    return torch.cat(pieces, dim=1)


def mrope_position_ids(input_ids: torch.Tensor, image_grid_thw: torch.Tensor | None, attention_mask: torch.Tensor | None,
                       *, image_token_id: int, spatial_merge_size: int, image_mask: torch.Tensor | None = None) -> torch.Tensor:
    """[3, B, S] M-RoPE positions of a batch (transformers' ``get_rope_index``), 0 at padding.

    ``input_ids [B, S]``; ``image_grid_thw [images, 3]``: the images of all rows in row order (rows
    without images take none); ``attention_mask [B, S]`` (None: no padding) marks the real tokens,
    wherever the padding sits (left, right or both). ``image_mask [B, S]``: the tokens that hold an image
    (transformers' ``mm_token_type_ids == 1``); None: every ``image_token_id``. Give it when a response may
    hold that token id as text (a sampled one, which vLLM embeds and positions as text), e.g. the prompt's
    image tokens only.
    """
    batch, length = input_ids.shape
    mask = torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
    is_image = (input_ids == image_token_id) if image_mask is None else image_mask.bool()
    grids = [] if image_grid_thw is None else [tuple(int(v) for v in g) for g in image_grid_thw.tolist()]
    positions = torch.zeros(3, batch, length, dtype=torch.long)
    used = 0
    for b in range(batch):
        row_images = is_image[b][mask[b]].cpu()
        count = len(image_runs(row_images))
        if used + count > len(grids):
            raise ValueError(f"row {b}: image_grid_thw has {len(grids)} images, the rows up to this one hold {used + count}")
        row = row_positions(row_images, grids[used:used + count], spatial_merge_size, where=f"row {b}")
        positions[:, b, mask[b].cpu()] = row
        used += count
    if used != len(grids):
        raise ValueError(f"image_grid_thw has {len(grids)} images, the rows hold {used}")
    return positions.to(input_ids.device)


def frequency_streams(mrope_section: list[int], interleaved: bool) -> torch.Tensor:
    """For each rotary frequency, the stream (0 time, 1 height, 2 width) whose position turns it."""
    t, h, w = mrope_section
    count = t + h + w
    if not interleaved:
        return torch.tensor([0] * t + [1] * h + [2] * w)
    streams = torch.zeros(count, dtype=torch.long)
    for j in range(count):
        if j % 3 == 1 and j < 3 * h:
            streams[j] = 1
        elif j % 3 == 2 and j < 3 * w:
            streams[j] = 2
    return streams


class MropeEmbedding(torch.nn.Module):
    """Megatron's rotary embedding module for M-RoPE (``GPTModel.rotary_pos_emb`` with
    ``position_embedding_type='mrope'``): ``forward(position_ids [3, B, S], mrope_section)`` -> [S, B, 1, head_dim]."""

    def __init__(self, head_dim: int, theta: float, mrope_section: list[int], interleaved: bool, device=None):
        super().__init__()
        if 2 * sum(mrope_section) != head_dim:
            raise ValueError(f"mrope_section {mrope_section} must cover head_dim={head_dim} / 2 frequencies")
        self.inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim))
        self.streams = frequency_streams(mrope_section, interleaved).to(device)

    def forward(self, position_ids: torch.Tensor, mrope_section=None, cp_group=None) -> torch.Tensor:
        if position_ids.dim() != 3 or position_ids.shape[0] != 3:
            raise ValueError(f"M-RoPE needs position_ids [3, batch, seq] (megarl.models.mrope.mrope_position_ids), got "
                             f"{tuple(position_ids.shape)}")
        if cp_group is not None and cp_group.size() > 1:
            raise ValueError("M-RoPE under context parallelism is not supported; use context_parallel_size=1")
        freqs = position_ids.to(self.inv_freq.device).float()[..., None] * self.inv_freq  # [3, B, S, dim/2]
        streams = self.streams.to(freqs.device).expand(1, *freqs.shape[1:])
        chosen = freqs.gather(0, streams)[0]  # [B, S, dim/2]
        emb = torch.cat((chosen, chosen), dim=-1)
        return emb.transpose(0, 1)[:, :, None, :].contiguous()
