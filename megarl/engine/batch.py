"""The RL batch on the trainer: prompt + response token ids and the per-token fields of RL.

Layout (verl's): ``input_ids`` is ``[B, T]`` with ``T = P + R``: the prompt part ``[:, :P]`` is
LEFT-padded, the response part ``[:, P:]`` (``responses``) is RIGHT-padded. ``attention_mask``
marks the real tokens of both parts. ``response_mask [B, R]`` marks the response tokens that
count in losses (usually the response's attention mask; multi-turn data may mask tool output).
Per-token RL fields (old/ref/rollout/teacher log-probs, advantages, returns, values, rollout importance
weights) are ``[B, R]``, aligned with ``responses``; the MoE routing table of router replay,
``routed_experts``, is ``[B, T, layers, top-k]``, aligned with ``input_ids``; a distillation teacher's
top-k (``teacher_topk_ids`` / ``_log_probs``) is ``[B, R, k]``.

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
        return RLBatch(**{name: None if value is None else value.to(device) for name, value in moved.items()})


def data_parallel_shard(batch: RLBatch, dp_rank: int, dp_size: int) -> RLBatch:
    """The contiguous share of ``batch`` that data-parallel rank ``dp_rank`` of ``dp_size`` trains on.

    The engine's methods take the samples of their own data-parallel replica; a caller holding the
    whole batch uses this to cut it. The batch size must be divisible by ``dp_size``.
    """
    if len(batch) % dp_size:
        raise ValueError(f"batch of {len(batch)} samples cannot be split evenly over {dp_size} data-parallel ranks")
    per_rank = len(batch) // dp_size
    return batch.select(list(range(dp_rank * per_rank, (dp_rank + 1) * per_rank)))
