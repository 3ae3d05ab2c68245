"""The weight sync's plan for gpt-oss's packed experts against vLLM's own expert loader, no engine.

vLLM's gpt-oss loader takes each expert's row of the packed tensors (``experts.<e>.gate_up_proj``
[hidden, 2 x ffn], gate and up interleaved; ``down_proj`` [ffn, hidden]; their biases), so the sync sends
the bridge's parts (gate, up, down and their biases, one per expert) with their own splits and the rollout
worker packs the rows (``megarl.models.packed.expert_rows``). In the sync's ``shard`` mode (GPU engines) a
rank receives only its region of each part, the rest of the tensor is left uninitialised: here it holds -1.
Each row is then loaded by vLLM's ``GptOssRoutedExperts`` into a parameter of the shape vLLM gives a TP rank,
and must equal the load of the whole row: every element the loader reads was sent to that rank.
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from megarl.devtools.tiny_model import build_config
from megarl.models import model_dims, vllm_splits
from megarl.models.families import family_for
from megarl.models.packed import expert_rows, packed_parts

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm  # vLLM's layers import py-cpuinfo, which runs a subprocess at its first import


def _load(routed, row_name: str, row: torch.Tensor, tp: int, rank: int, h: int, ffn: int) -> torch.Tensor:
    """What vLLM's ``GptOssRoutedExperts`` keeps of one expert's row on TP rank ``rank``: its parameter, of the
    shape vLLM gives it there (``UnquantizedFusedMoEMethod.create_weights``), filled by its loader."""
    loader = SimpleNamespace(moe_config=SimpleNamespace(moe_parallel_config=SimpleNamespace(tp_rank=rank)),
                             _narrow_for_rank=routed._narrow_for_rank, _copy_to_expert=routed._copy_to_expert)
    part, tail = ffn // tp, row_name.rsplit(".", 1)[1]
    expert_data = torch.full({"gate_up_proj": (2 * part, h), "down_proj": (h, part),
                              "gate_up_proj_bias": (2 * part,), "down_proj_bias": (h,)}[tail], -2.0)
    shard_id = "gpt_oss_w13" if tail.startswith("gate_up") else "gpt_oss_w2"
    if tail.endswith("_bias"):
        routed._load_expert_bias(loader, expert_data, row, shard_id)
    else:
        routed._load_unquantized_expert(loader, expert_data, row, shard_id)
    return expert_data


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_each_tp_rank_reads_only_what_the_sync_sends_it(tp):
    from vllm.model_executor.models.gpt_oss import GptOssRoutedExperts

    config = build_config("gpt_oss", "tiny")
    family, dims, splits = family_for(config), model_dims(config), vllm_splits(config)
    ffn, offset, whole = dims.moe.ffn_hidden_size, 0, {}
    for name, (packed, row, unpack) in packed_parts(family, dims).items():  # every element a distinct value >= 0
        shape = tuple(unpack(torch.empty(packed.shape[1:])).shape)
        whole[name] = torch.arange(offset, offset + torch.Size(shape).numel(), dtype=torch.float32).reshape(shape)
        offset += whole[name].numel()
    full_rows = dict(expert_rows(family, dims, iter(whole.items())))
    for rank in range(tp):
        sent = {}
        for name, tensor in whole.items():
            region = splits[name].region(name, tuple(tensor.shape), tp, rank)
            sent[name] = torch.full_like(tensor, -1.0)  # uninitialised outside the rank's region
            index = tuple(slice(a, b) for a, b in region)
            sent[name][index] = tensor[index]
        for row_name, row in expert_rows(family, dims, iter(sent.items())):
            reference = _load(GptOssRoutedExperts, row_name, full_rows[row_name], tp, rank, dims.hidden_size, ffn)
            loaded = _load(GptOssRoutedExperts, row_name, row, tp, rank, dims.hidden_size, ffn)
            assert (loaded != -2).all(), (row_name, tp, rank)  # vLLM filled the whole parameter
            assert torch.equal(loaded, reference), (row_name, tp, rank)  # and read nothing the sync left out
