"""Grouped-GEMM experts (``moe_grouped_gemm=True``) in this process (world size 1, gloo), against SequentialMLP.

On CPU megatron builds its legacy ``GroupedMLP`` over the stand-in of ``grouped_gemm`` (``cpu_standins.gmm``);
the bridge reads and writes its fused ``weight1`` / ``weight2`` as per-expert views under SequentialMLP's names
(``megarl.models.grouped_experts``). From the same HF checkpoint both builds give the same logits and gradients
(fp32), the export reproduces the checkpoint bit for bit, and the weight sync sends the same bytes. TP2 / EP2 /
expert-TP2 and the distributed checkpoint: ``test_grouped_experts_distributed.py``.
"""
from __future__ import annotations

import pytest
import torch

from megarl.models import ParallelLayout, build_model, export_hf_pieces, family_for, gather_hf_tensors, load_hf_config
from megarl.models.grouped_experts import bridge_tensors, grouped_expert_views, grouped_gemm_problem, te_expert_name
from megarl.platform.cpu_standins import gmm

FAMILIES = ["qwen3_moe", "deepseek_v3", "qwen3_next"]  # plain MoE; shared expert + MLA + sigmoid routing; own decoder


def _reference_gmm(a, b, sizes, trans_b):
    out, start = [], 0
    for i, n in enumerate(sizes):
        w = b[i].t() if trans_b else b[i]
        out.append(a[start:start + n] @ w)
        start += n
    return torch.cat(out)


@pytest.mark.parametrize("trans_b", [False, True])
def test_the_gmm_stand_in_is_a_loop_of_matmuls_forward_and_backward_with_empty_groups(trans_b):
    generator = torch.Generator().manual_seed(0)
    sizes = [3, 0, 5, 0]  # two experts get no token
    a = torch.randn(sum(sizes), 6, generator=generator, dtype=torch.float64)
    b = torch.randn(4, 7, 6, generator=generator, dtype=torch.float64) if trans_b else \
        torch.randn(4, 6, 7, generator=generator, dtype=torch.float64)
    upstream = torch.randn(sum(sizes), 7, generator=generator, dtype=torch.float64)
    results = []
    for function in (lambda a, b: gmm(a, b, torch.tensor(sizes), trans_b=trans_b),
                     lambda a, b: _reference_gmm(a, b, sizes, trans_b)):
        a_, b_ = a.clone().requires_grad_(), b.clone().requires_grad_()
        out = function(a_, b_)
        out.backward(upstream)
        results.append((out.detach(), a_.grad, b_.grad))
    (out, a_grad, b_grad), (ref_out, ref_a_grad, ref_b_grad) = results
    assert out.shape == (8, 7)
    assert torch.equal(out, ref_out) and torch.equal(a_grad, ref_a_grad) and torch.equal(b_grad, ref_b_grad)
    assert not b_grad[1].any() and not b_grad[3].any()  # an empty group's weight gets a zero gradient
    with pytest.raises(ValueError, match="batch_sizes"):
        gmm(a, b, torch.tensor([3, 5]), trans_b=trans_b)


def test_transformer_engine_grouped_names_are_sequential_names():
    """TEGroupedMLP (GPU, Transformer Engine) holds one [out, in] parameter per local expert, ``weight<i>``."""
    assert te_expert_name("decoder.layers.3.mlp.experts.linear_fc1.weight12") == \
        "decoder.layers.3.mlp.experts.local_experts.12.linear_fc1.weight"
    assert te_expert_name("decoder.layers.0.mlp.experts.linear_fc2.weight0") == \
        "decoder.layers.0.mlp.experts.local_experts.0.linear_fc2.weight"
    for unchanged in ("decoder.layers.0.mlp.shared_experts.linear_fc1.weight", "decoder.layers.0.mlp.router.weight",
                      "decoder.layers.0.mlp.experts.local_experts.1.linear_fc1.weight"):
        assert te_expert_name(unchanged) == unchanged

    experts = torch.nn.Module()
    experts.linear_fc1, experts.linear_fc2 = torch.nn.Module(), torch.nn.Module()
    for i in range(2):
        experts.linear_fc1.register_parameter(f"weight{i}", torch.nn.Parameter(torch.full((8, 4), float(i))))
        experts.linear_fc2.register_parameter(f"weight{i}", torch.nn.Parameter(torch.full((4, 4), float(i))))
    layer = torch.nn.Module()
    layer.mlp = torch.nn.Module()
    layer.mlp.experts = experts
    tensors = bridge_tensors(layer)
    names = [f"mlp.experts.local_experts.{i}.{fc}.weight" for i in range(2) for fc in ("linear_fc1", "linear_fc2")]
    assert sorted(tensors) == names
    assert tensors["mlp.experts.local_experts.1.linear_fc1.weight"] is experts.linear_fc1.weight1


def test_grouped_mlp_weights_are_per_expert_transposed_views():
    """GroupedMLP's weight1 [hidden, E x fc1] is [E, hidden, fc1] in memory; weight2 [E x ffn, hidden] is
    [E, ffn, hidden]."""
    hidden, ffn, experts = 4, 3, 2
    fc1 = [torch.randn(2 * ffn, hidden) for _ in range(experts)]  # SequentialMLP's [gate; up] per expert
    fc2 = [torch.randn(hidden, ffn) for _ in range(experts)]
    weight1 = torch.stack([w.t() for w in fc1]).reshape(hidden, -1)
    weight2 = torch.stack([w.t() for w in fc2]).reshape(-1, hidden)
    views = {**grouped_expert_views("experts.", 1, weight1, experts, hidden),
             **grouped_expert_views("experts.", 2, weight2, experts, hidden)}
    for i in range(experts):
        assert torch.equal(views[f"experts.local_experts.{i}.linear_fc1.weight"], fc1[i])
        assert torch.equal(views[f"experts.local_experts.{i}.linear_fc2.weight"], fc2[i])
    views["experts.local_experts.1.linear_fc2.weight"][0, 2] = 5.0  # a view: writes reach the fused parameter
    assert weight2.view(experts, ffn, hidden)[1, 2, 0] == 5.0


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    from megarl.devtools.tiny_model import make_tiny_model

    root = tmp_path_factory.mktemp("grouped_experts")
    return {family: make_tiny_model(family, "tiny", root / family, seed=0) for family in FAMILIES}


def _run(checkpoint, grouped: bool, input_ids):
    """logits, gradients by the bridge's names (grouped experts per expert), the model."""
    [model] = build_model(checkpoint, ParallelLayout(), config_overrides={"moe_grouped_gemm": grouped})
    positions = torch.arange(input_ids.shape[1]).unsqueeze(0)
    logits = model(input_ids, positions, None)
    (logits.float() ** 2).mean().backward()
    grads = bridge_tensors(model, of=lambda param: param.grad)
    return logits.detach(), grads, model


def _checkpoint_tensors(checkpoint):
    from safetensors.torch import load_file

    return {name: tensor for path in sorted(checkpoint.glob("*.safetensors")) for name, tensor in load_file(path).items()}


@pytest.mark.parametrize("family", FAMILIES)
def test_grouped_experts_give_sequential_logits_and_gradients_and_export_bit_for_bit(world, checkpoints, family):
    input_ids = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(0))
    sequential_logits, sequential_grads, _ = _run(checkpoints[family], False, input_ids)
    logits, grads, model = _run(checkpoints[family], True, input_ids)
    assert any(name.endswith("experts.weight1") for name, _ in model.named_parameters())  # GroupedMLP was built
    assert (logits - sequential_logits).abs().max().item() <= 1e-6
    assert sorted(grads) == sorted(sequential_grads)
    assert max((grads[n] - sequential_grads[n]).abs().max().item() for n in grads) <= 1e-6
    exported = dict(gather_hf_tensors([model], checkpoints[family], ParallelLayout()))
    original = _checkpoint_tensors(checkpoints[family])
    config = load_hf_config(checkpoints[family])
    skipped = family_for(config).skipped_hf_tensors(config)  # multi-token-prediction layers
    assert set(exported) == {name for name in original if skipped is None or not skipped.search(name)}
    assert all(torch.equal(tensor, original[name]) for name, tensor in exported.items())


def _sync_bytes(model, checkpoint) -> list[torch.Tensor]:
    """The bytes of every bucket of a sync from this trainer rank into a rollout engine at TP=2 (fp32)."""
    from megarl.weight_sync.layouts import plan_for_layouts
    from megarl.weight_sync.packing import pack_bucket
    from megarl.weight_sync.rollout_layout import RolloutLayout
    from megarl.weight_sync.sender import from_export, region_reader

    plan = plan_for_layouts(checkpoint, ParallelLayout(), 1, RolloutLayout(1, 2, "shard", first_rank=1), itemsize=4,
                            bucket_bytes=64 << 10)
    pieces = export_hf_pieces([model], checkpoint, ParallelLayout(), replicas=True)
    read = region_reader(from_export((p.hf_name, p.hf_slice, p.tensor) for p in pieces))
    return [pack_bucket(bucket, plan.meta, read, torch.empty(bucket.nbytes, dtype=torch.uint8)).clone()
            for bucket in plan.buckets]


def test_the_weight_sync_sends_the_same_bytes_from_grouped_experts(world, checkpoints):
    checkpoint = checkpoints["qwen3_moe"]
    sent = [_sync_bytes(build_model(checkpoint, ParallelLayout(), config_overrides={"moe_grouped_gemm": grouped})[0],
                        checkpoint) for grouped in (False, True)]
    assert len(sent[0]) == len(sent[1]) > 1
    assert all(torch.equal(a, b) for a, b in zip(*sent))


def test_lora_on_grouped_experts_is_refused_naming_the_way_out(world, checkpoints):
    from megarl.models.lora import LoRASettings, LoRATransform

    with pytest.raises(ValueError, match=r"LoRA on expert linears needs per-expert linears.*exclude_modules"):
        build_model(checkpoints["qwen3_moe"], ParallelLayout(), config_overrides={"moe_grouped_gemm": True},
                    transforms=[LoRATransform(LoRASettings(rank=4))])


def test_gpt_oss_refuses_grouped_experts_before_the_build(world):
    from megarl.devtools.tiny_model import build_config

    with pytest.raises(ValueError, match=r"gpt_oss: moe_grouped_gemm=True: gpt-oss's experts have biases"):
        build_model(build_config("gpt_oss"), ParallelLayout(), config_overrides={"moe_grouped_gemm": True})


def test_on_a_gpu_without_transformer_engine_or_grouped_gemm_the_legacy_module_is_refused(monkeypatch):
    from megatron.core.transformer.moe import grouped_gemm_util

    from megarl.models.families import family_for
    from megarl.devtools.tiny_model import build_config

    family = family_for(build_config("qwen3_moe"))
    assert grouped_gemm_problem(family, uses_te_spec=True, has_cuda=True) is None  # TEGroupedMLP
    assert grouped_gemm_problem(family, uses_te_spec=False, has_cuda=False) is None  # CPU: GroupedMLP + stand-in
    monkeypatch.setattr(grouped_gemm_util, "grouped_gemm", None)
    problem = grouped_gemm_problem(family, uses_te_spec=False, has_cuda=True)
    assert "needs Transformer Engine (TEGroupedMLP)" in problem and "grouped_gemm package" in problem


def _expert_checkpoint_tensors(model) -> dict:
    """Every expert tensor of the model's distributed-checkpoint state (megatron's ``sharded_state_dict``), each
    assembled from its shards into the global tensor a checkpoint stores under its key."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories

    state = model.sharded_state_dict()
    apply_factories(state)  # GroupedMLP's fused weights become per-expert shards here
    full = {}
    for shard in nested_values(state):
        if isinstance(shard, ShardedTensor) and ".experts." in shard.key:
            tensor = full.setdefault(shard.key, torch.full(shard.global_shape, float("nan")))
            leading = len(shard.global_shape) - shard.data.dim()
            index = tuple(slice(o, o + 1) for o in shard.global_offset[:leading]) + \
                tuple(slice(o, o + n) for o, n in zip(shard.global_offset[leading:], shard.data.shape))
            tensor[index] = shard.data.reshape(tensor[index].shape)
    return full


def test_the_distributed_checkpoint_stores_grouped_experts_as_sequential_ones(world, checkpoints):
    """Same keys, global shapes and values: a checkpoint's weights load under either expert module."""
    states = [_expert_checkpoint_tensors(build_model(checkpoints["qwen3_moe"], ParallelLayout(),
                                                     config_overrides={"moe_grouped_gemm": grouped})[0])
              for grouped in (False, True)]
    assert sorted(states[0]) == sorted(states[1]) and len(states[0]) == 4  # fc1 and fc2 of 2 layers
    for key, tensor in states[0].items():
        assert not tensor.isnan().any() and torch.equal(tensor, states[1][key]), key
