"""The gpt_oss family without processes: dims, megatron fields, names, the packed experts, refusals; and
that the tiny model's features act (a bridge that dropped one would still match HF if it did not).

The HF-logits and export tests live with the other families (test_bridge_tp1.py, test_bridge_distributed.py).
"""
import math

import pytest
import torch

from megarl.devtools.tiny_model import build_config
from megarl.models import ParallelLayout, model_dims, param_shards, vllm_splits
from megarl.models.config import transformer_config_kwargs
from megarl.models.families import family_for
from megarl.models.families.gpt_oss import TINY_SWIGLU_LIMIT
from megarl.models.packed import expert_rows, pack_stream, packed_parts


def tiny():
    return build_config("gpt_oss", "tiny")


def test_dims_read_windows_biases_and_the_clamped_swiglu():
    dims = model_dims(tiny())
    assert dims.attention.windows == (5, None) and dims.attention.qkv_bias
    assert (dims.moe.num_experts, dims.moe.topk, dims.moe.layers, dims.moe.ffn_hidden_size) == (8, 2, (True, True), 64)
    assert dims.clamped_swiglu == (TINY_SWIGLU_LIMIT, 1.702)


def test_megatron_config_fields():
    from megatron.core.activations import quick_gelu

    kwargs = transformer_config_kwargs(model_dims(tiny()), family_for(tiny()), ParallelLayout(ep=2))
    expected = dict(add_qkv_bias=True, add_bias_linear=True, softmax_type="learnable", window_size=(4, 0),
                    window_attn_skip_freq=[1, 0], moe_router_score_function="softmax", moe_router_pre_softmax=False,
                    glu_linear_offset=1.0, activation_func_clamp_value=TINY_SWIGLU_LIMIT, num_moe_experts=8)
    assert {k: kwargs[k] for k in expected} == expected
    assert kwargs["activation_func"] is quick_gelu


def test_another_alpha_gets_its_own_sigmoid_gate():
    config = tiny()
    config.swiglu_alpha = 1.5
    act = transformer_config_kwargs(model_dims(config), family_for(config), ParallelLayout())["activation_func"]
    x = torch.linspace(-3, 3, 7)
    assert torch.allclose(act(x), x * torch.sigmoid(1.5 * x))


def test_names_of_sinks_biases_and_expert_parts():
    specs = {s.name: s.pieces[0].hf_name for s in param_shards(tiny(), ParallelLayout()) if s.pieces}
    assert specs["decoder.layers.0.self_attention.core_attention.softmax_offset"] == "model.layers.0.self_attn.sinks"
    assert specs["decoder.layers.0.self_attention.linear_proj.bias"] == "model.layers.0.self_attn.o_proj.bias"
    assert specs["decoder.layers.1.mlp.router.bias"] == "model.layers.1.mlp.router.bias"
    assert specs["decoder.layers.1.mlp.experts.local_experts.7.linear_fc2.bias"] == "model.layers.1.mlp.experts.7.down_proj.bias"


def test_sinks_split_with_the_heads_over_tp():
    # 4 heads in 2 query groups: TP rank 1 holds group 1, i.e. heads 2 and 3, and their sinks
    [spec] = [s for s in param_shards(tiny(), ParallelLayout(tp=2))
              if s.name == "decoder.layers.0.self_attention.core_attention.softmax_offset" and s.tp_rank == 1]
    assert spec.pieces[0].hf_slice == (slice(2, 4),)


def test_packed_experts_unpack_and_pack_back_exactly():
    """The parts read from the packed rows (gate at even, up at odd columns, transposed) pack back bit for bit."""
    family, dims = family_for(tiny()), model_dims(tiny())
    parts = packed_parts(family, dims)
    generator = torch.Generator().manual_seed(0)
    checkpoint = {p.name: torch.randn(p.shape, generator=generator) for p in family.packed_tensors(dims)}
    unpacked = [(name, unpack(checkpoint[packed.name][row])) for name, (packed, row, unpack) in parts.items()]
    gate_up = checkpoint["model.layers.0.mlp.experts.gate_up_proj"]
    assert torch.equal(dict(unpacked)["model.layers.0.mlp.experts.3.up_proj.weight"], gate_up[3][:, 1::2].t())
    repacked = dict(pack_stream(family, dims, iter([("model.norm.weight", torch.ones(1))] + unpacked)))
    assert sorted(repacked) == sorted(list(checkpoint) + ["model.norm.weight"])
    assert all(torch.equal(repacked[name], tensor) for name, tensor in checkpoint.items())
    with pytest.raises(RuntimeError, match="incomplete"):
        list(pack_stream(family, dims, iter(unpacked[:-1])))


def test_the_sync_sends_parts_and_the_rollout_worker_packs_each_experts_row():
    """The sync plans the parts with their own splits (vLLM's loader takes each expert's row, so nothing is
    refused); the rollout worker's rows, in any arrival order, are the checkpoint's rows bit for bit."""
    family, dims = family_for(tiny()), model_dims(tiny())
    splits = vllm_splits(tiny())
    assert splits["model.layers.0.mlp.experts.3.gate_proj.weight"].kind == "column"
    assert splits["model.layers.0.mlp.experts.3.down_proj.weight"].kind == "row"
    assert splits["model.layers.0.mlp.experts.3.down_proj.bias"].kind == "replicated"
    generator = torch.Generator().manual_seed(0)
    checkpoint = {p.name: torch.randn(p.shape, generator=generator) for p in family.packed_tensors(dims)}
    unpacked = [(name, unpack(checkpoint[packed.name][row]))
                for name, (packed, row, unpack) in packed_parts(family, dims).items()]
    shuffled = [unpacked[i] for i in torch.randperm(len(unpacked), generator=generator).tolist()]
    rows = dict(expert_rows(family, dims, iter([("model.norm.weight", torch.ones(1))] + shuffled)))
    assert len(rows) == 1 + sum(p.shape[0] for p in family.packed_tensors(dims))
    for name, tensor in checkpoint.items():
        head, tail = name.rsplit(".", 1)
        assert all(torch.equal(rows[f"{head}.{e}.{tail}"], tensor[e]) for e in range(tensor.shape[0])), name
    with pytest.raises(RuntimeError, match="expert rows left incomplete.*gate_up_proj.*expert 3"):
        list(expert_rows(family, dims, iter([n_t for n_t in unpacked if n_t[0] != "model.layers.1.mlp.experts.3.up_proj.weight"])))


def test_published_yarn_reads_as_transformers_frequencies_and_a_softmax_scale():
    """gpt-oss-120b's RoPE (YaRN factor 32 over 4096, truncate false): transformers' cos/sin factor
    0.1 ln 32 + 1 = 1.3466 scales q and k, so the softmax scale is head_dim^-0.5 times its square."""
    from megarl.models.dims import TransformersRope

    config = _with(rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0,
                                    "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 4096})
    dims = model_dims(config)
    assert isinstance(dims.rope, TransformersRope) and dims.rope.rope_type == "yarn"
    assert dims.rope.attention_factor == pytest.approx(0.1 * math.log(32) + 1)
    assert dims.attention.softmax_scale == pytest.approx(32 ** -0.5 * (0.1 * math.log(32) + 1) ** 2)


def test_yarn_without_truncation_changes_the_reference_logits(model_zoo):
    """truncate: false (gpt-oss) against megatron's always-truncated correction range: HF's own logits
    move by more than 1e-3 on the tiny YaRN model, so matching HF there tests the untruncated frequencies."""
    from transformers import AutoModelForCausalLM

    from tests.models.conftest import GPT_OSS_YARN

    reference = torch.load(model_zoo / "reference.pt")["gpt_oss_yarn"]
    model = AutoModelForCausalLM.from_pretrained(str(model_zoo / "gpt_oss_yarn"), dtype=torch.float32,
                                                 attn_implementation="eager",
                                                 rope_parameters={**GPT_OSS_YARN, "truncate": True}).eval()
    with torch.no_grad():
        changed = model(reference["input_ids"]).logits
    assert (changed - reference["output"]).abs().max().item() > 1e-3


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_attention_splits_follow_vllms_gpt_oss_rules(tp):
    """The attention's vLLM splits, derived from the maps, are vLLM's: q/k/v/o by its GQA rules, the sinks narrowed to each rank's heads (vLLM's
    ``weight.narrow(0, head_start, heads_per_rank)``), the o_proj bias whole on every rank (added after the reduce)."""
    from megarl.models import hf_tensor_shapes
    from megarl.models.shards import chunk_params
    from megarl.models.vllm_layout import splits_of_params
    from tests.weight_sync.test_planner import reference_vllm_slice

    config, family = build_config("gpt_oss", "small"), family_for(tiny())  # 8 heads, 4 KV heads
    splits = splits_of_params(chunk_params(model_dims(config), family, ParallelLayout(), 0, 0, "actor"), family)
    shapes = hf_tensor_shapes(config)
    for rank in range(tp):
        for name, shape in shapes.items():
            if ".self_attn." in name and name.endswith(("_proj.weight", "q_proj.bias", "k_proj.bias", "v_proj.bias")):
                assert splits[name].region(name, shape, tp, rank) == reference_vllm_slice(
                    name, shape, tp, rank, config.num_key_value_heads), (name, tp, rank)
        per = 8 // tp
        assert splits["model.layers.0.self_attn.sinks"].region("sinks", (8,), tp, rank) == ((rank * per, (rank + 1) * per),)
        assert splits["model.layers.0.self_attn.o_proj.bias"].region("o_proj.bias", (256,), tp, rank) == ((0, 256),)


def _with(**fields):
    config = tiny()
    for key, value in fields.items():
        setattr(config, key, value)
    return config


@pytest.mark.parametrize("fields, message", [
    ({"attention_bias": False}, "attention_bias=False"),
    ({"layer_types": ["sliding_attention", "chunked_attention"]}, "layer_types=\\['chunked_attention'\\]"),
    ({"rope_parameters": {"rope_type": "linear", "rope_theta": 150000.0, "factor": 4.0}}, "linear"),
])
def test_unsupported_variants_are_refused_naming_the_field(fields, message):
    """(MXFP4 expert weights are read: tests/models/test_mxfp4.py.)"""
    with pytest.raises(ValueError, match=message):
        model_dims(_with(**fields))


@pytest.mark.parametrize("change", [
    {"swiglu_limit": 7.0},  # the published clamp: nothing clips on the tiny model
    {"sliding_window": 64},  # no window acts on 16 tokens
    {"swiglu_alpha": 1.0},
])
def test_each_tiny_feature_changes_the_reference_logits(model_zoo, change):
    """Without the feature, transformers' own logits move by far more than the bridge's 1e-5 tolerance."""
    from transformers import AutoModelForCausalLM

    reference = torch.load(model_zoo / "reference.pt")["gpt_oss"]
    model = AutoModelForCausalLM.from_pretrained(str(model_zoo / "gpt_oss"), dtype=torch.float32,
                                                 attn_implementation="eager", **change).eval()
    with torch.no_grad():
        changed = model(reference["input_ids"]).logits
    assert (changed - reference["output"]).abs().max().item() > 1e-3


def test_zero_sinks_and_biases_change_the_reference_logits(model_zoo):
    from transformers import AutoModelForCausalLM

    reference = torch.load(model_zoo / "reference.pt")["gpt_oss"]
    for suffix in ("sinks", "gate_up_proj_bias", "down_proj_bias", "router.bias", "o_proj.bias"):
        model = AutoModelForCausalLM.from_pretrained(str(model_zoo / "gpt_oss"), dtype=torch.float32,
                                                     attn_implementation="eager").eval()
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith(suffix):
                    param.zero_()
            changed = model(reference["input_ids"]).logits
        assert (changed - reference["output"]).abs().max().item() > 1e-3, suffix
