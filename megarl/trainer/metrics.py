"""verl's step metrics, computed from one step's tensors.

Names match verl's ``compute_data_metrics`` / ``compute_timing_metrics`` /
``compute_throughout_metrics`` so that dashboards carry over: ``critic/score/*`` (sequence
scores from the reward function), ``critic/rewards/*`` (after KL penalty), ``critic/advantages/*``,
``critic/returns/*``, ``critic/values/*``, ``response_length/*``, ``prompt_length/*``,
``timing_s/*``, ``timing_per_token_ms/*`` and ``perf/*``. ``response_length/*`` counts the tokens
the model sampled (the loss mask); ``response_length/with_tools_mean`` counts tool tokens too, and
``response_length/clip_ratio`` is the share of responses that filled the response budget (model
and tool tokens together).

Agent-loop metrics (``agent_metrics``): ``num_turns/{mean,max,min}``,
``tool_calls/{mean,max,min}`` (calls executed per sample), ``tool_calls/errors``,
``tool_calls/timeouts``, ``tool_calls/malformed``, ``tool_calls/truncated`` (totals of the step),
``tool_calls/reward_mean`` and ``agent/drift_ratio`` (share of samples whose turn-by-turn tokens
differ from the chat template applied to the whole conversation).
"""
from __future__ import annotations

from typing import Any, Mapping

import torch


def _stats(prefix: str, values: torch.Tensor) -> dict[str, float]:
    if values.numel() == 0:
        return {f"{prefix}/mean": 0.0, f"{prefix}/max": 0.0, f"{prefix}/min": 0.0}
    values = values.float()
    return {f"{prefix}/mean": values.mean().item(), f"{prefix}/max": values.max().item(),
            f"{prefix}/min": values.min().item()}


def data_metrics(*, token_level_scores: torch.Tensor, token_level_rewards: torch.Tensor,
                 advantages: torch.Tensor, returns: torch.Tensor, response_mask: torch.Tensor,
                 prompt_lengths: torch.Tensor, response_lengths: torch.Tensor, max_response_length: int,
                 max_prompt_length: int, values: torch.Tensor | None = None,
                 response_tokens: torch.Tensor | None = None) -> dict[str, float]:
    mask = response_mask.bool()
    out: dict[str, float] = {}
    out.update(_stats("critic/score", token_level_scores.sum(-1)))
    out.update(_stats("critic/rewards", token_level_rewards.sum(-1)))
    out.update(_stats("critic/advantages", advantages[mask]))
    out.update(_stats("critic/returns", returns[mask]))
    if values is not None:
        out.update(_stats("critic/values", values[mask]))
        residual = (returns - values)[mask]
        var_returns = returns[mask].float().var(unbiased=False) if mask.any() else torch.tensor(0.0)
        out["critic/vf_explained_var"] = (1.0 - residual.float().var(unbiased=False) / (var_returns + 1e-5)).item()
    out.update(_stats("response_length", response_lengths))
    budget_used = response_lengths if response_tokens is None else response_tokens
    out["response_length/clip_ratio"] = (budget_used >= max_response_length).float().mean().item()
    if response_tokens is not None:
        out["response_length/with_tools_mean"] = response_tokens.float().mean().item()
    out.update(_stats("prompt_length", prompt_lengths))
    out["prompt_length/clip_ratio"] = (prompt_lengths >= max_prompt_length).float().mean().item()
    return out


def agent_metrics(fields: Mapping[str, Any]) -> dict[str, float]:
    """Turn and tool-call statistics from the step's per-sample fields (samples without them skipped)."""
    def present(name: str) -> torch.Tensor | None:
        values = [v for v in fields.get(name, []) if v is not None]
        return torch.tensor(values, dtype=torch.float64) if values else None

    out: dict[str, float] = {}
    for name in ("num_turns", "tool_calls"):
        values = present(name)
        if values is not None:
            out.update(_stats(name, values))
    for name, metric in (("tool_errors", "errors"), ("tool_timeouts", "timeouts"), ("tool_malformed", "malformed"),
                         ("tool_truncated", "truncated")):
        values = present(name)
        if values is not None:
            out[f"tool_calls/{metric}"] = float(values.sum())
    rewards = present("tool_reward")
    if rewards is not None:
        out["tool_calls/reward_mean"] = float(rewards.mean())
    drift = present("drift")
    if drift is not None:
        out["agent/drift_ratio"] = float(drift.mean())
    return out


def timing_metrics(timings: Mapping[str, float], num_prompt_tokens: int, num_response_tokens: int) -> dict[str, float]:
    out = {f"timing_s/{name}": float(seconds) for name, seconds in timings.items()}
    tokens = {"gen": num_response_tokens}
    total = num_prompt_tokens + num_response_tokens
    for name, seconds in timings.items():
        count = tokens.get(name, total)
        if count and name != "step":
            out[f"timing_per_token_ms/{name}"] = 1000.0 * seconds / count
    return out


def throughput_metrics(step_seconds: float, num_tokens: int, num_devices: int) -> dict[str, float]:
    return {"perf/total_num_tokens": float(num_tokens), "perf/time_per_step": step_seconds,
            "perf/throughput": num_tokens / max(step_seconds, 1e-9) / max(num_devices, 1)}
