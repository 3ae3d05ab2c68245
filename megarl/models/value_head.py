"""The critic's scalar value head, put in place of GPTModel's output layer.

Why this shape: GPTModel's post-processing calls ``self.output_layer(hidden, weight=...,
runtime_gather_output=...)`` on the final-norm hidden states and returns the result as
[batch, seq, out]. A module with that call signature returning ([seq, batch, 1], None) turns
the same GPTModel (same pipeline schedule, same final norm) into a critic that returns values
[batch, seq, 1]; no megatron code is forked.

The head is ``Linear(hidden, 1)`` with a bias, replicated on every TP rank, like HF's
``AutoModelForTokenClassification(num_labels=1).score``; it exports as ``score.weight`` /
``score.bias``. With sequence parallelism the hidden states arrive split over TP along the
sequence; they are all-gathered first, and since every TP rank then computes the same values,
the backward splits the gradient (no reduce-scatter sum, which would scale it by TP).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


class ValueHead(torch.nn.Module):
    def __init__(self, hidden_size: int, sequence_parallel: bool, dtype: torch.dtype, device, init_std: float, seed: int):
        super().__init__()
        self.sequence_parallel = sequence_parallel
        self.weight = torch.nn.Parameter(torch.empty(1, hidden_size, dtype=dtype, device=device))
        self.bias = torch.nn.Parameter(torch.zeros(1, dtype=dtype, device=device))
        self.reset_parameters(init_std, seed)

    @torch.no_grad()
    def reset_parameters(self, init_std: float, seed: int) -> None:
        """Normal(0, init_std) from a private seeded generator, so every TP rank draws the same head."""
        generator = torch.Generator(device="cpu").manual_seed(seed)
        weight = torch.randn(self.weight.shape, generator=generator, dtype=torch.float32) * init_std
        self.weight.copy_(weight)
        self.bias.zero_()

    def forward(self, hidden_states: torch.Tensor, weight=None, runtime_gather_output=None):
        if self.sequence_parallel:
            from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

            hidden_states = gather_from_sequence_parallel_region(hidden_states, tensor_parallel_output_grad=False)
        return F.linear(hidden_states, self.weight, self.bias), None
