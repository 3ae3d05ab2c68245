"""Turn one step's prompts and generated samples into the trainer's tensors.

The rollout fleet returns plain lists (``RolloutSample``); the Megatron engine takes an
``RLBatch`` in verl's layout: left-padded prompts, right-padded responses. ``StepData`` keeps
both the tensors and the per-sample facts the reward manager and the metrics need, in one
order: prompt by prompt, each prompt's ``n`` samples together (the GRPO group).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from megarl.engine.batch import RLBatch


@dataclass
class StepData:
    batch: RLBatch
    uid: list[str]  # group id per sample: samples of one prompt share it
    data_source: list[str]
    ground_truth: list[Any]
    extra_info: list[Any]
    response_text: list[str]
    finish_reason: list[str]
    rollout_log_probs: torch.Tensor  # [B, R] the engine's log-probs of the sampled tokens
    prompt_lengths: torch.Tensor  # [B]
    response_lengths: torch.Tensor  # [B]
    fields: dict[str, Any] = field(default_factory=dict)  # per-sample extras (reward dict keys, ...)

    def __len__(self) -> int:
        return len(self.uid)

    def select(self, indices: Sequence[int]) -> "StepData":
        idx = list(indices)
        pick = lambda values: [values[i] for i in idx]  # noqa: E731
        index = torch.as_tensor(idx, dtype=torch.long)
        return StepData(
            batch=self.batch.select(idx), uid=pick(self.uid), data_source=pick(self.data_source),
            ground_truth=pick(self.ground_truth), extra_info=pick(self.extra_info),
            response_text=pick(self.response_text), finish_reason=pick(self.finish_reason),
            rollout_log_probs=self.rollout_log_probs.index_select(0, index),
            prompt_lengths=self.prompt_lengths.index_select(0, index),
            response_lengths=self.response_lengths.index_select(0, index),
            fields={k: pick(v) for k, v in self.fields.items()})


def build_step_data(prompts: dict[str, list[Any]], samples: Sequence[Any], pad_token_id: int,
                    step: int, response_length: int | None = None) -> StepData:
    """``prompts``: the data loader's columns; ``samples``: the fleet's output for them.

    ``response_length`` pads every response to the same width (the configured maximum), so
    tensor shapes stay constant from step to step; None pads to the longest response.
    """
    if not samples:
        raise ValueError("the rollout returned no samples")
    longest = max(max(len(s.response_ids) for s in samples), 1)
    width = max(response_length or 0, longest)
    prompt_width = max(len(s.prompt_ids) for s in samples)
    batch_size = len(samples)
    input_ids = torch.full((batch_size, prompt_width + width), pad_token_id, dtype=torch.long)
    attention = torch.zeros((batch_size, prompt_width + width), dtype=torch.long)
    log_probs = torch.zeros((batch_size, width), dtype=torch.float32)
    for row, s in enumerate(samples):
        p, r = len(s.prompt_ids), len(s.response_ids)
        if p < 1:
            raise ValueError(f"sample {row} (prompt {s.prompt_index}) has an empty prompt")
        input_ids[row, prompt_width - p:prompt_width] = torch.tensor(s.prompt_ids, dtype=torch.long)
        attention[row, prompt_width - p:prompt_width] = 1
        if r:
            input_ids[row, prompt_width:prompt_width + r] = torch.tensor(s.response_ids, dtype=torch.long)
            attention[row, prompt_width:prompt_width + r] = 1
            log_probs[row, :r] = torch.tensor(s.logprobs[:r], dtype=torch.float32)
    response_mask = attention[:, prompt_width:].clone()
    batch = RLBatch(input_ids=input_ids, attention_mask=attention, response_mask=response_mask)
    col = lambda key: [prompts[key][s.prompt_index] for s in samples]  # noqa: E731
    return StepData(
        batch=batch,
        uid=[f"{step}:{s.prompt_index}" for s in samples],
        data_source=col("data_source"), ground_truth=col("ground_truth"), extra_info=col("extra_info"),
        response_text=[s.response_text for s in samples], finish_reason=[s.finish_reason for s in samples],
        rollout_log_probs=log_probs,
        prompt_lengths=torch.tensor([len(s.prompt_ids) for s in samples]),
        response_lengths=torch.tensor([len(s.response_ids) for s in samples]),
    )
