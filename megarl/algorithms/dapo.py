"""DAPO (arXiv:2503.14476) pieces: dynamic sampling and overlong reward shaping.

Dynamic sampling (`algorithm.filter_groups`): a group whose samples all have the same metric
value (all right or all wrong) has zero GRPO advantage and teaches nothing, so it is dropped and
more prompts are generated until the batch holds `data.train_batch_size` prompts, at most
`max_num_gen_batches` generation rounds (0: no limit). The trainer's loop, as in verl's DAPO:

    kept, metrics = filter_groups_by_metric(index, metric_values)      # per generated batch
    batch = concat(batch, new_batch[kept]); num_prompts += metrics["filter_groups/num_groups_kept"]
    if need_more_gen_batches(num_prompts, train_batch_size, num_gen_batches, max_num_gen_batches):
        continue                                                        # generate again
    batch = batch[: train_batch_size * rollout_n]                       # trim to the batch size

Overlong reward shaping (`reward_model.overlong_buffer` in verl's DAPO recipe, here
`algorithm.overlong_buffer`): a response longer than max_response_length - buffer_len gets a
penalty growing linearly to -penalty_factor at the maximum length.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch


def seq_metric_values(
    metric: str,
    token_level_scores: torch.Tensor | None = None,
    token_level_rewards: torch.Tensor | None = None,
    reward_extra_info: Mapping[str, Sequence[Any]] | None = None,
) -> np.ndarray:
    """The per-sample values of `algorithm.filter_groups.metric`, as in verl's DAPO trainer.

    `seq_reward` sums `token_level_scores`, `seq_final_reward` sums `token_level_rewards` (after
    the KL penalty); any other name (e.g. `acc`, `score`) is read from the reward function's extra
    info.
    """
    if metric == "seq_reward":
        source = token_level_scores
    elif metric == "seq_final_reward":
        source = token_level_rewards
    else:
        if not reward_extra_info or metric not in reward_extra_info:
            known = ["seq_reward", "seq_final_reward", *sorted(reward_extra_info or {})]
            raise ValueError(
                f"algorithm.filter_groups.metric={metric!r} is neither a tensor sum nor a key the reward "
                f"function returned. Known names: {', '.join(known)}."
            )
        return np.asarray(reward_extra_info[metric], dtype=np.float64)
    if source is None:
        raise ValueError(f"filter_groups metric {metric!r} needs the corresponding token-level tensor")
    return source.detach().sum(dim=-1).cpu().double().numpy()


def filter_groups_by_metric(index: Sequence[Any], metric_values: Sequence[float]) -> tuple[np.ndarray, dict[str, int]]:
    """Keep the samples of groups whose metric values are not all equal.

    A group of one sample is kept (verl keeps it too: it cannot be judged). Samples keep their
    batch order. Returns the kept sample indices (int64) and the metrics
    `filter_groups/num_groups_kept`, `.../num_groups_dropped` and `.../num_samples_kept`.
    """
    if isinstance(index, torch.Tensor):
        index = index.tolist()
    if isinstance(metric_values, torch.Tensor):
        metric_values = metric_values.detach().cpu().double().numpy()
    values = np.asarray(metric_values, dtype=np.float64)
    if values.ndim != 1 or len(values) != len(index):
        raise ValueError(f"need one metric value per sample: {len(index)} ids but metric values of shape {values.shape}")
    if not np.all(np.isfinite(values)):
        raise ValueError("filter_groups metric values contain NaN or inf; check the reward function")

    group_values: dict[Any, list[float]] = {}
    for key, value in zip(index, values):
        group_values.setdefault(key, []).append(float(value))
    kept_groups = {key for key, vals in group_values.items() if len(vals) == 1 or max(vals) != min(vals)}
    kept = np.array([i for i, key in enumerate(index) if key in kept_groups], dtype=np.int64)
    metrics = {
        "filter_groups/num_groups_kept": len(kept_groups),
        "filter_groups/num_groups_dropped": len(group_values) - len(kept_groups),
        "filter_groups/num_samples_kept": int(len(kept)),
    }
    return kept, metrics


def need_more_gen_batches(
    num_prompts_in_batch: int, train_batch_size: int, num_gen_batches: int, max_num_gen_batches: int
) -> bool:
    """True while fewer than `train_batch_size` prompts were kept and the generation budget allows
    another round; raises once `max_num_gen_batches` rounds (> 0) did not fill the batch."""
    if num_prompts_in_batch >= train_batch_size:
        return False
    if max_num_gen_batches <= 0 or num_gen_batches < max_num_gen_batches:
        return True
    raise RuntimeError(
        f"dynamic sampling kept {num_prompts_in_batch} of {train_batch_size} prompts after "
        f"{num_gen_batches} generation batches (algorithm.filter_groups.max_num_gen_batches="
        f"{max_num_gen_batches}). The data may be too hard or too easy (every group all right or all "
        "wrong); raise max_num_gen_batches, or set it to 0 for no limit."
    )


def compute_overlong_penalty(
    response_lengths: torch.Tensor | Sequence[int],
    max_response_length: int,
    overlong_buffer_len: int,
    penalty_factor: float,
) -> torch.Tensor:
    """DAPO's soft overlong punishment, per sample (<= 0), to add to the sequence reward.

    expected = max_response_length - overlong_buffer_len;
    penalty = min(-(length - expected) / overlong_buffer_len * penalty_factor, 0).
    So 0 up to `expected` tokens, then linear down to -penalty_factor at `max_response_length`.
    """
    if overlong_buffer_len <= 0:
        raise ValueError(f"overlong_buffer.len must be > 0 when overlong_buffer.enable, got {overlong_buffer_len}")
    if overlong_buffer_len > max_response_length:
        raise ValueError(
            f"overlong_buffer.len={overlong_buffer_len} exceeds the max response length {max_response_length}"
        )
    lengths = torch.as_tensor(response_lengths)
    lengths = lengths.to(torch.float32 if not lengths.is_floating_point() else lengths.dtype)
    expected_length = max_response_length - overlong_buffer_len
    exceed = lengths - expected_length
    return torch.clamp(-exceed / overlong_buffer_len * penalty_factor, max=0.0)
