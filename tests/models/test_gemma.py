"""The gemma2 / gemma3 families without processes: dims, names, vLLM splits, refusals; and that the
tiny models' features act (a bridge that dropped one would still match HF if it did not).

The HF-logits and export tests live with the other families (test_bridge_tp1.py, test_bridge_distributed.py).
"""
import pytest
import torch

from megarl.devtools.tiny_model import build_config
from megarl.models import ParallelLayout, model_dims, param_shards, vllm_splits
from megarl.models.config import transformer_config_kwargs
from megarl.models.dims import DefaultRope, LinearRope
from megarl.models.families import family_for
from tests.models.test_shards import check_layout_exact


def test_gemma2_dims_read_every_feature():
    dims = model_dims(build_config("gemma2", "tiny"))
    a = dims.attention
    assert (a.softcap, a.windows, a.softmax_scale, a.qk_norm) == (0.2, (5, None), 24 ** -0.5, False)
    assert (dims.activation, dims.embedding_scale, dims.final_logit_softcap) == ("gelu_tanh", 128 ** 0.5, 0.6)
    assert dims.rope == DefaultRope(10000.0) and dims.local_rope is None and dims.tie_word_embeddings
    kwargs = transformer_config_kwargs(dims, family_for(build_config("gemma2", "tiny")), ParallelLayout())
    assert kwargs["softmax_scale"] == 24 ** -0.5 and kwargs["activation_func"](torch.tensor(1.0)) == pytest.approx(0.841192)


def test_gemma3_dims_read_two_ropes_and_qk_norm():
    dims = model_dims(build_config("gemma3", "small"))  # 4 layers: 3 sliding, 1 global
    assert dims.attention.windows == (5, 5, 5, None) and dims.attention.qk_norm and dims.attention.softcap is None
    assert dims.rope == LinearRope(1000000.0, 8.0) and dims.local_rope == DefaultRope(10000.0)


def test_four_norms_per_layer_and_one_name_under_transformer_engine():
    config = build_config("gemma3", "tiny")
    specs = {s.name: s.pieces[0].hf_name for s in param_shards(config, ParallelLayout()) if ".layers.1." in s.name}
    norms = {k: v for k, v in specs.items() if "norm" in k}
    assert norms == {
        "decoder.layers.1.input_layernorm.weight": "model.layers.1.input_layernorm.weight",
        "decoder.layers.1.self_attention.linear_proj.post_layernorm.weight": "model.layers.1.post_attention_layernorm.weight",
        "decoder.layers.1.self_attention.q_layernorm.weight": "model.layers.1.self_attn.q_norm.weight",
        "decoder.layers.1.self_attention.k_layernorm.weight": "model.layers.1.self_attn.k_norm.weight",
        "decoder.layers.1.pre_mlp_layernorm.weight": "model.layers.1.pre_feedforward_layernorm.weight",
        "decoder.layers.1.mlp.linear_fc2.post_layernorm.weight": "model.layers.1.post_feedforward_layernorm.weight",
    }
    te = {s.name for s in param_shards(config, ParallelLayout(), transformer_impl="transformer_engine")}
    assert te == {s.name for s in param_shards(config, ParallelLayout())}
    for layout in (ParallelLayout(tp=2), ParallelLayout(pp=2), ParallelLayout(tp=2, sequence_parallel=True)):
        check_layout_exact(config, layout)


def test_vllm_splits_replicate_the_norms():
    splits = vllm_splits(build_config("gemma2", "tiny"))
    assert splits["model.layers.0.post_feedforward_layernorm.weight"].kind == "replicated"
    assert splits["model.layers.0.mlp.down_proj.weight"].kind == "row"
    assert splits["model.layers.0.self_attn.k_proj.weight"].kind == "kv_heads"


def _with(family, **fields):
    config = build_config(family, "tiny")
    for key, value in fields.items():
        setattr(config, key, value)
    return config


@pytest.mark.parametrize("family, fields, message", [
    ("gemma2", {"tie_word_embeddings": False}, "tie_word_embeddings=False"),
    ("gemma2", {"attention_bias": True}, "attention_bias=True"),
    ("gemma3", {"layer_types": ["sliding_attention", "chunked_attention"]}, "layer_types="),
    ("gemma3", {"use_bidirectional_attention": True}, "use_bidirectional_attention=True"),
    ("gemma3", {"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                                    "sliding_attention": {"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0}}},
     "rope_parameters.sliding_attention.rope_type='linear'"),
    ("gemma2", {"hidden_activation": "relu"}, "hidden_activation='relu'"),
])
def test_unsupported_variants_are_refused_naming_the_field(family, fields, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("[", r"\[")):
        model_dims(_with(family, **fields))


def _hf_logits(checkpoint, input_ids, **config_changes):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32, attn_implementation="eager",
                                                 **config_changes).eval()
    with torch.no_grad():
        return model(input_ids).logits


@pytest.mark.parametrize("name, change", [
    ("gemma2", {"attn_logit_softcapping": None}),
    ("gemma2", {"final_logit_softcapping": None}),
    ("gemma2", {"sliding_window": 64}),
    ("gemma2", {"query_pre_attn_scalar": 32}),
    ("gemma3", {"sliding_window": 64}),
    ("gemma3", {"rope_parameters": {"full_attention": {"rope_type": "linear", "rope_theta": 1000000.0, "factor": 8.0},
                                    "sliding_attention": {"rope_type": "default", "rope_theta": 1000000.0}}}),
    ("gemma3", {"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
                                    "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}}),
])
def test_each_tiny_feature_changes_the_reference_logits(model_zoo, name, change):
    """Without the feature, transformers' own logits move by far more than the bridge's 1e-5 tolerance."""
    reference = torch.load(model_zoo / "reference.pt")[name]
    changed = _hf_logits(model_zoo / name, reference["input_ids"], **change)
    assert (changed - reference["output"]).abs().max().item() > 1e-3
