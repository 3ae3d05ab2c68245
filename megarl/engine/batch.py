"""The RL batch on the trainer: prompt + response token ids and the per-token fields of RL.

Layout (verl's): ``input_ids`` is ``[B, T]`` with ``T = P + R``: the prompt part ``[:, :P]`` is
LEFT-padded, the response part ``[:, P:]`` (``responses``) is RIGHT-padded. ``attention_mask``
marks the real tokens of both parts. ``response_mask [B, R]`` marks the response tokens that
count in losses (usually the response's attention mask; multi-turn data may mask tool output).
Per-token RL fields (old/ref/rollout/teacher log-probs, advantages, returns, values, rollout importance
weights) are ``[B, R]``, aligned with ``responses``; the MoE routing table of router replay,
``routed_experts``, is ``[B, T, layers, top-k]``, aligned with ``input_ids``; a distillation teacher's
top-k (``teacher_topk_ids`` / ``_log_probs``) is ``[B, R, k]``. A vision-language batch carries each
sample's pixel inputs in ``multi_modal_inputs`` (verl's name), a list of B dicts
``{"pixel_values": [patches, D], "image_grid_thw": [images, 3]}`` (the processor's output for that sample's
images, in prompt order; ``{}`` for a text sample); None for a text-only batch. Its prompt ids hold each
image's tokens expanded; the response never holds an image.

The engine never feeds this padded layout to the model directly: ``packing`` packs the samples'
real tokens into one row (or, with ``use_remove_padding=False``, left-aligns each row), see there.
"""
from __future__ import annotations

from dataclasses import dataclass, fields, replace

import torch

PER_TOKEN_FIELDS = ("old_log_probs", "ref_log_probs", "advantages", "returns", "values", "rollout_is_weights",
                    "rollout_log_probs", "teacher_log_probs")


@dataclass
class RLBatch:
    input_ids: torch.Tensor  # [B, P + R] long: left-padded prompt, right-padded response
    attention_mask: torch.Tensor  # [B, P + R] 1 for real tokens, 0 for padding
    response_mask: torch.Tensor  # [B, R] 1 for response tokens that count in losses
    position_ids: torch.Tensor | None = None  # [B, P + R]; None: 0, 1, 2, ... over the real tokens
    old_log_probs: torch.Tensor | None = None  # [B, R] log-probs of the policy that generated the data
    ref_log_probs: torch.Tensor | None = None  # [B, R] log-probs of the reference policy
    advantages: torch.Tensor | None = None  # [B, R]
    returns: torch.Tensor | None = None  # [B, R] value targets (critic)
    values: torch.Tensor | None = None  # [B, R] values at rollout time (critic clipping)
    rollout_is_weights: torch.Tensor | None = None  # [B, R] a rollout correction's importance weights (detached)
    rollout_log_probs: torch.Tensor | None = None  # [B, R] the engine's log-probs: the sync probe of an on-policy update
    teacher_log_probs: torch.Tensor | None = None  # [B, R] a distillation teacher's log-probs of the sampled tokens
    teacher_topk_ids: torch.Tensor | None = None  # [B, R, k] the teacher's top-k tokens at each response position
    teacher_topk_log_probs: torch.Tensor | None = None  # [B, R, k] their log-probs (top-k distillation losses)
    routed_experts: torch.Tensor | None = None  # [B, P + R, layers, top-k] int16 MoE routing to replay (router_replay)
    multi_modal_inputs: list[dict[str, torch.Tensor]] | None = None  # B dicts: pixel_values, image_grid_thw ({}: text)

    def __post_init__(self) -> None:
        if self.input_ids.dim() != 2 or self.input_ids.dtype not in (torch.int32, torch.int64):
            raise ValueError(
                f"input_ids must be a [batch, seq] integer tensor, got {tuple(self.input_ids.shape)} {self.input_ids.dtype}"
            )
        if self.attention_mask.shape != self.input_ids.shape:
            raise ValueError(
                f"attention_mask {tuple(self.attention_mask.shape)} must have the shape of input_ids {tuple(self.input_ids.shape)}"
            )
        if self.position_ids is not None and self.position_ids.shape != self.input_ids.shape:
            raise ValueError(
                f"position_ids {tuple(self.position_ids.shape)} must have the shape of input_ids {tuple(self.input_ids.shape)}"
            )
        batch_size, total = self.input_ids.shape
        if self.response_mask.dim() != 2 or self.response_mask.shape[0] != batch_size or not 0 < self.response_mask.shape[1] < total:
            raise ValueError(
                f"response_mask must be [batch={batch_size}, R] with 0 < R < {total} (the last R columns of input_ids "
                f"are the response), got {tuple(self.response_mask.shape)}"
            )
        for name in PER_TOKEN_FIELDS:
            value = getattr(self, name)
            if value is not None and value.shape != self.response_mask.shape:
                raise ValueError(f"{name} {tuple(value.shape)} must have the shape of response_mask {tuple(self.response_mask.shape)}")
        for name in ("teacher_topk_ids", "teacher_topk_log_probs"):
            value = getattr(self, name)
            if value is not None and (value.dim() != 3 or value.shape[:2] != self.response_mask.shape):
                raise ValueError(f"{name} {tuple(value.shape)} must be [batch, R, k] with the batch and R of "
                                 f"response_mask {tuple(self.response_mask.shape)}")
        if self.routed_experts is not None and (self.routed_experts.dim() != 4
                                                or self.routed_experts.shape[:2] != self.input_ids.shape):
            raise ValueError(f"routed_experts {tuple(self.routed_experts.shape)} must be [batch, tokens, layers, top-k] "
                             f"with the batch and tokens of input_ids {tuple(self.input_ids.shape)}")
        if self.multi_modal_inputs is not None:
            check_multi_modal_inputs(self.multi_modal_inputs, batch_size)
        outside = self.response_mask.bool() & ~self.attention_mask[:, self.prompt_length :].bool()
        if bool(outside.any()):
            raise ValueError("response_mask marks padding tokens (attention_mask 0) as trainable; it must be 0 there")
        prompt_tokens = self.attention_mask[:, : self.prompt_length].sum(-1)
        if bool((prompt_tokens < 1).any()):
            rows = torch.nonzero(prompt_tokens < 1).flatten().tolist()
            raise ValueError(f"samples {rows[:8]} have no prompt token; every sample needs at least one (e.g. BOS)")

    @classmethod
    def from_parts(
        cls,
        prompt_ids: torch.Tensor,
        prompt_mask: torch.Tensor,
        response_ids: torch.Tensor,
        response_attention_mask: torch.Tensor,
        response_mask: torch.Tensor | None = None,
        **per_token: torch.Tensor,
    ) -> "RLBatch":
        """Join a left-padded prompt batch ``[B, P]`` and a right-padded response batch ``[B, R]``.

        ``response_mask`` defaults to the response's attention mask.
        """
        return cls(
            input_ids=torch.cat([prompt_ids, response_ids], dim=1),
            attention_mask=torch.cat([prompt_mask, response_attention_mask], dim=1),
            response_mask=response_attention_mask if response_mask is None else response_mask,
            **per_token,
        )

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    @property
    def response_length(self) -> int:
        """R: the padded response length."""
        return self.response_mask.shape[1]

    @property
    def prompt_length(self) -> int:
        """P: the padded prompt length."""
        return self.input_ids.shape[1] - self.response_length

    @property
    def responses(self) -> torch.Tensor:
        """``[B, R]`` response token ids (a view of ``input_ids``)."""
        return self.input_ids[:, self.prompt_length :]

    def sequence_lengths(self) -> torch.Tensor:
        """``[B]`` real tokens per sample (prompt + response): the cost of a sample in the model."""
        return self.attention_mask.sum(-1)

    def select(self, indices: torch.Tensor | list[int]) -> "RLBatch":
        """The samples at ``indices``, in that order."""
        index = torch.as_tensor(indices, dtype=torch.long, device=self.input_ids.device)
        picked = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "multi_modal_inputs" and value is not None:
                picked[f.name] = [value[i] for i in index.tolist()]
            else:
                picked[f.name] = None if value is None else value.index_select(0, index)
        return RLBatch(**picked)

    def with_fields(self, **values: torch.Tensor) -> "RLBatch":
        """A copy with some fields replaced (e.g. ``old_log_probs`` after computing them)."""
        return replace(self, **values)

    def require(self, *names: str, purpose: str) -> None:
        """Raise a ValueError naming the fields that ``purpose`` needs and the batch lacks."""
        missing = [name for name in names if getattr(self, name) is None]
        if missing:
            raise ValueError(f"{purpose} needs batch.{', batch.'.join(missing)}; compute them before calling it")

    def to(self, device: torch.device | str) -> "RLBatch":
        moved = {f.name: getattr(self, f.name) for f in fields(self)}
        images = moved.pop("multi_modal_inputs")
        if images is not None:
            images = [{key: tensor.to(device) for key, tensor in sample.items()} for sample in images]
        return RLBatch(**{name: None if value is None else value.to(device) for name, value in moved.items()},
                       multi_modal_inputs=images)

    def has_images(self) -> bool:
        """Whether any sample carries pixel inputs."""
        return self.multi_modal_inputs is not None and any(self.multi_modal_inputs)

    def pixel_inputs(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The samples' ``pixel_values`` and ``image_grid_thw`` concatenated in row order (the order in
        which the model writes images over the image tokens, padded or packed); None without images."""
        if not self.has_images():
            return None
        samples = [sample for sample in self.multi_modal_inputs if sample]
        return (torch.cat([sample["pixel_values"] for sample in samples]),
                torch.cat([sample["image_grid_thw"] for sample in samples]))


MULTI_MODAL_KEYS = ("pixel_values", "image_grid_thw")


def check_multi_modal_inputs(samples: list, batch_size: int) -> None:
    """Raise a ValueError naming the sample whose pixel inputs do not fit the field's contract."""
    if not isinstance(samples, (list, tuple)) or len(samples) != batch_size:
        raise ValueError(f"multi_modal_inputs must be a list of {batch_size} dicts (one per sample, {{}} for a text "
                         f"sample), got {type(samples).__name__} of {len(samples) if hasattr(samples, '__len__') else '?'}")
    for row, sample in enumerate(samples):
        if not isinstance(sample, dict) or (sample and set(sample) != set(MULTI_MODAL_KEYS)):
            raise ValueError(f"multi_modal_inputs[{row}] must be {{}} or a dict with exactly the keys "
                             f"{MULTI_MODAL_KEYS}, got {sorted(sample) if isinstance(sample, dict) else type(sample).__name__}")
        if not sample:
            continue
        pixels, grid = sample["pixel_values"], sample["image_grid_thw"]
        if grid.dim() != 2 or grid.shape[1] != 3 or grid.shape[0] < 1:
            raise ValueError(f"multi_modal_inputs[{row}]['image_grid_thw'] must be [images >= 1, 3], got {tuple(grid.shape)}")
        patches = int(grid.long().prod(dim=1).sum())
        if pixels.dim() != 2 or pixels.shape[0] != patches:
            raise ValueError(f"multi_modal_inputs[{row}]['pixel_values'] {tuple(pixels.shape)} must be [patches, D] with "
                             f"patches = sum(t*h*w) of its image_grid_thw = {patches}")


def concat_multi_modal_inputs(batches: list[RLBatch]) -> list[dict[str, torch.Tensor]] | None:
    """The ``multi_modal_inputs`` of ``batches`` joined in order (rows of a text-only batch: ``{}``), for code
    that concatenates batches' rows; None when no batch has the field."""
    if all(b.multi_modal_inputs is None for b in batches):
        return None
    return [sample for b in batches for sample in (b.multi_modal_inputs or [{}] * len(b))]


def data_parallel_shard(batch: RLBatch, dp_rank: int, dp_size: int) -> RLBatch:
    """The contiguous share of ``batch`` that data-parallel rank ``dp_rank`` of ``dp_size`` trains on.

    The engine's methods take the samples of their own data-parallel replica; a caller holding the
    whole batch uses this to cut it. The batch size must be divisible by ``dp_size``.
    """
    if len(batch) % dp_size:
        raise ValueError(f"batch of {len(batch)} samples cannot be split evenly over {dp_size} data-parallel ranks")
    per_rank = len(batch) // dp_size
    return batch.select(list(range(dp_rank * per_rank, (dp_rank + 1) * per_rank)))
