"""What sequence packing saves on a run's length distribution: tokens computed per pass, packed
(real tokens only) against padded (every sample of a micro-batch at the longest one's length).

The plan's memory and times are upper bounds with every sample at full length, where packing
saves nothing. Reasoning-RL responses are long-tailed, though: given the median response length
(``megarl plan --response-length-median N``), responses are drawn log-normal around it (sigma 1: the
99th percentile about 10x the median) and cut at ``response_length``, after prompts at their full
length. Each pass's batch on one rank is split by the engine's own functions (fixed micro-batches,
or the token budget: packed by real tokens, padded by samples x longest, ``x CP`` per micro-batch)
over 16 seeded draws, and the tokens each layout computes are summed: the ratio is the compute
(and, for the largest micro-batch, the activation memory) that padding would add.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from megarl.plan.inputs import RunInputs

DRAWS = 16


@dataclass(frozen=True)
class Lengths:
    """Prompt + response lengths of one rank's samples (see the module docstring)."""

    prompt: int
    median: int
    cap: int
    sigma: float = 1.0

    def draw(self, samples: int, seed: int) -> list[int]:
        generator = torch.Generator().manual_seed(seed)
        normal = torch.randn(samples, generator=generator, dtype=torch.float64)
        responses = (math.log(self.median) + self.sigma * normal).exp().round().clamp(1, self.cap)
        return [self.prompt + int(n) for n in responses.tolist()]


@dataclass(frozen=True)
class PassPacking:
    name: str  # e.g. "actor update"
    packed: bool  # the run packs this pass (use_remove_padding)
    real_tokens: float  # per rank and step, averaged over draws
    padded_tokens: float
    largest_packed: float  # the largest micro-batch's tokens, per CP group
    largest_padded: float

    @property
    def ratio(self) -> float:
        return self.padded_tokens / self.real_tokens


def _split(settings, lengths: list[int], packed: bool, cp: int) -> list[list[int]]:
    from megarl.engine.batching import fixed_micro_batches, token_budget_micro_batches

    if settings.use_dynamic_bsz:
        return token_budget_micro_batches(lengths, settings.max_token_len * cp, packed=packed)
    return fixed_micro_batches(len(lengths), settings.micro_batch_size)


def pass_packing(name: str, settings, samples: int, lengths: Lengths, cp: int) -> PassPacking:
    real = padded = largest_real = largest_padded = 0.0
    for seed in range(DRAWS):
        drawn = lengths.draw(samples, seed)
        real += sum(drawn)
        largest_real += max(sum(drawn[i] for i in part) for part in _split(settings, drawn, True, cp))
        padded_parts = _split(settings, drawn, False, cp)
        padded += sum(len(part) * max(drawn[i] for i in part) for part in padded_parts)
        largest_padded += max(len(part) * max(drawn[i] for i in part) for part in padded_parts)
    return PassPacking(name, settings.use_remove_padding, real / DRAWS, padded / DRAWS, largest_real / DRAWS,
                       largest_padded / DRAWS)


def packing_plan(inputs: RunInputs, median: int) -> list[PassPacking]:
    """Packed against padded tokens of every Megatron pass of a step, at responses of median ``median``."""
    if not 1 <= median <= inputs.rollout.response_length:
        raise ValueError(f"--response-length-median {median}: give a length between 1 and the response length "
                         f"{inputs.rollout.response_length}")
    lengths = Lengths(inputs.rollout.prompt_length, median, inputs.rollout.response_length)
    passes = []
    for role in inputs.roles:
        label = {"actor": "old log-probs", "ref": "ref log-probs", "critic": "values"}[role.name]
        passes.append(pass_packing(label, role.forward, inputs.samples_per_rank, lengths, inputs.cp))
        if role.train is not None:
            mini = role.train.mini_batch_size or inputs.samples_per_rank
            passes.append(pass_packing(f"{role.name} update", role.train, mini, lengths, inputs.cp))
    return passes
