"""One step's data: the trainer's tensors plus a table of per-sample fields, in one order.

The order is prompt by prompt, each prompt's ``n`` samples together (the GRPO group). ``batch``
is the ``RLBatch`` the Megatron engine takes (verl's layout: left-padded prompts, right-padded
responses); its ``response_mask`` is the trajectories' **loss mask**: 1 on tokens the model
sampled, 0 on tool output and padding, so everything downstream (policy loss, entropy, KL,
advantages, metrics) counts model tokens only. ``fields`` holds every per-sample value, each
either a list or a tensor whose first dimension is the batch (``[B]``, or ``[B, R]`` aligned with
the responses): a new field is one more entry, and ``select`` and ``concat_step_data`` handle it
with the rest.

Fields ``build_step_data`` writes: ``uid`` (group id: samples of one prompt draw share it),
``prompt_ids``, ``prompt_text`` (the prompt as the model saw it, chat template applied), ``raw_prompt``, ``agent_name``, ``data_source``, ``ground_truth``, ``extra_info``,
``response_text``, ``finish_reason``, ``rollout_log_probs`` ``[B, R]`` (the engine's log-probs of
the sampled tokens, 0 elsewhere), ``versions`` ``[B, R]`` (the weight version that sampled each
token; -1 on tokens the model did not sample and where the loop did not record it),
``first_version`` ``[B]`` (the version of a sample's first sampled token, -1 if unknown),
``prompt_lengths``, ``response_lengths`` (model tokens),
``response_tokens`` (model and tool tokens), ``images`` (a vision-language row's resized images; the batch's
``multi_modal_inputs`` hold their pixel values, computed once per prompt), and every key of the trajectories' ``extras``
(``num_turns``, ``tool_calls``, ...; None where a sample's loop has no such key). The controller
adds ``score`` and the reward function's extra keys.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import torch

from megarl.engine.batch import RLBatch, concat_multi_modal_inputs

PROMPT_COLUMNS = ("prompt_ids", "prompt_text", "raw_prompt", "agent_name", "data_source", "ground_truth", "extra_info",
                  "images")


@dataclass
class StepData:
    batch: RLBatch
    fields: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name, value in self.fields.items():
            self._check(name, value)

    def _check(self, name: str, value: Any) -> None:
        if len(value) != len(self.batch):
            raise ValueError(f"step field {name!r} has {len(value)} entries for {len(self.batch)} samples")

    def __len__(self) -> int:
        return len(self.batch)

    def __getitem__(self, name: str) -> Any:
        try:
            return self.fields[name]
        except KeyError:
            raise KeyError(f"step data has no field {name!r}; fields: {sorted(self.fields)}") from None

    def __contains__(self, name: str) -> bool:
        return name in self.fields

    def add(self, **values: Any) -> None:
        """Add or replace per-sample fields (lists or tensors with the batch as first dimension)."""
        for name, value in values.items():
            self._check(name, value)
            self.fields[name] = value

    def select(self, indices: Sequence[int]) -> "StepData":
        idx = list(indices)
        index = torch.as_tensor(idx, dtype=torch.long)
        picked = {name: value.index_select(0, index) if isinstance(value, torch.Tensor) else [value[i] for i in idx]
                  for name, value in self.fields.items()}
        return StepData(self.batch.select(idx), picked)


def concat_step_data(parts: Sequence[StepData]) -> StepData:
    """Samples of several ``StepData`` in order; prompts and responses re-padded to the widest."""
    if len(parts) == 1:
        return parts[0]
    names = set(parts[0].fields)
    if any(set(p.fields) != names for p in parts):
        raise ValueError(f"cannot join step data with different fields: {[sorted(p.fields) for p in parts]}")
    width_p = max(p.batch.prompt_length for p in parts)
    width_r = max(p.batch.response_length for p in parts)
    pad = torch.nn.functional.pad
    ids, attention, mask = [], [], []
    for p in parts:
        b = p.batch
        sides = (width_p - b.prompt_length, width_r - b.response_length)
        ids.append(pad(b.input_ids, sides))
        attention.append(pad(b.attention_mask, sides))
        mask.append(pad(b.response_mask, (0, sides[1])))
    batch = RLBatch(input_ids=torch.cat(ids), attention_mask=torch.cat(attention), response_mask=torch.cat(mask),
                    multi_modal_inputs=concat_multi_modal_inputs([p.batch for p in parts]))
    joined = {}
    for name in parts[0].fields:
        values = [p.fields[name] for p in parts]
        if isinstance(values[0], torch.Tensor):
            if values[0].dim() == 2:  # response-aligned
                values = [pad(v, (0, width_r - v.shape[1])) for v in values]
            joined[name] = torch.cat(values)
        else:
            joined[name] = [v for value in values for v in value]
    return StepData(batch, joined)


def multi_modal_inputs(images: Mapping[int, Sequence[Any]], rows: Sequence[int], processor: Any) -> list[dict] | None:
    """Each sample's pixel inputs (``megarl.data.images.pixel_inputs``) from its prompt row's images: computed once
    per prompt row (a group's samples share the tensors); ``{}`` for a text row; None when no row has images."""
    if processor is None or not any(images.get(r) for r in rows):
        return None
    from megarl.data.images import pixel_inputs

    per_row = {r: dict(pixel_inputs(list(images[r]), processor)) if images.get(r) else {} for r in set(rows)}
    return [per_row[r] for r in rows]


def build_step_data(prompts: Mapping[str, list], trajectories: Sequence[Any], prompt_rows: Sequence[int],
                    uids: Sequence[str], pad_token_id: int, response_length: int | None = None,
                    processor: Any = None) -> StepData:
    """``trajectories[j]`` answers the prompt at row ``prompt_rows[j]`` of the loader's ``prompts``
    columns and belongs to group ``uids[j]``.

    ``response_length`` pads every response to the same width (the configured budget), so tensor
    shapes stay constant from step to step; None pads to the longest response. ``processor`` (a
    vision-language model's): the batch carries the pixel values of the rows' ``images``.
    """
    if not trajectories:
        raise ValueError("the rollout returned no trajectories")
    if not len(trajectories) == len(prompt_rows) == len(uids):
        raise ValueError(f"{len(trajectories)} trajectories, {len(prompt_rows)} prompt rows, {len(uids)} uids")
    longest = max(max(len(t.response_ids) for t in trajectories), 1)
    width = max(response_length or 0, longest)
    prompt_width = max(len(t.prompt_ids) for t in trajectories)
    size = len(trajectories)
    input_ids = torch.full((size, prompt_width + width), pad_token_id, dtype=torch.long)
    attention = torch.zeros((size, prompt_width + width), dtype=torch.long)
    loss_mask = torch.zeros((size, width), dtype=torch.long)
    log_probs = torch.zeros((size, width), dtype=torch.float32)
    versions = torch.full((size, width), -1, dtype=torch.long)
    for row, t in enumerate(trajectories):
        p, r = len(t.prompt_ids), len(t.response_ids)
        if p < 1:
            raise ValueError(f"trajectory {row} (prompt row {prompt_rows[row]}) has an empty prompt")
        input_ids[row, prompt_width - p:prompt_width] = torch.tensor(t.prompt_ids, dtype=torch.long)
        attention[row, prompt_width - p:prompt_width] = 1
        if r:
            input_ids[row, prompt_width:prompt_width + r] = torch.tensor(t.response_ids, dtype=torch.long)
            attention[row, prompt_width:prompt_width + r] = 1
            loss_mask[row, :r] = torch.tensor(t.loss_mask, dtype=torch.long)
            log_probs[row, :r] = torch.tensor(t.logprobs, dtype=torch.float32)
            if getattr(t, "versions", None) is not None:
                versions[row, :r] = torch.tensor(t.versions, dtype=torch.long)
    column = prompts.get("images") or []
    pixels = multi_modal_inputs({r: column[r] for r in set(prompt_rows) if r < len(column)}, prompt_rows, processor)
    batch = RLBatch(input_ids=input_ids, attention_mask=attention, response_mask=loss_mask, multi_modal_inputs=pixels)
    fields: dict[str, Any] = {"uid": list(uids)}
    for key in PROMPT_COLUMNS:
        column = prompts.get(key)
        fields[key] = [column[i] for i in prompt_rows] if column is not None else [None] * size
    fields.update(
        response_text=[t.response_text for t in trajectories], finish_reason=[t.finish_reason for t in trajectories],
        rollout_log_probs=log_probs, versions=versions,
        first_version=torch.where(versions >= 0, versions, torch.iinfo(torch.long).max).min(-1).values.masked_fill(
            (versions < 0).all(-1), -1),
        prompt_lengths=torch.tensor([len(t.prompt_ids) for t in trajectories]),
        response_lengths=loss_mask.sum(-1),
        response_tokens=torch.tensor([len(t.response_ids) for t in trajectories]))
    for key in sorted({k for t in trajectories for k in t.extras}):
        if key in fields:
            raise ValueError(f"a trajectory extra is named {key!r}, which is a built-in step field; rename it")
        fields[key] = [t.extras.get(key) for t in trajectories]
    return StepData(batch, fields)


def reward_extra_info(data: StepData, extras_keys: Sequence[str]) -> list[dict[str, Any]]:
    """Each sample's ``extra_info`` for the reward function, plus its loop's extras (``num_turns``, ...)."""
    out = []
    for i, info in enumerate(data["extra_info"]):
        merged = dict(info or {})
        merged.update({k: data[k][i] for k in extras_keys if data[k][i] is not None})
        out.append(merged)
    return out
