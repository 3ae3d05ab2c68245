"""The bridge in this process at TP=PP=EP=1 (world size 1, gloo), against Hugging Face transformers."""
import pytest
import torch
from safetensors import safe_open

from megarl.models import (
    ParallelLayout,
    build_model,
    export_hf_pieces,
    gather_hf_tensors,
    load_hf_weights,
    save_hf_checkpoint,
)

TOLERANCE = 1e-5
CHECKPOINTS = ["llama", "qwen2", "qwen3", "qwen3_moe", "mixtral", "llama_tied", "llama_small", "deepseek_v3", "llama_rope3",
               "gemma2", "gemma3", "glm4_moe", "kimi_k2", "gpt_oss", "gpt_oss_yarn", "qwen3_next", "qwen3_5", "qwen3_5_moe"]


def _reference(model_zoo, name):
    return torch.load(model_zoo / "reference.pt")[name]


def _forward(model, input_ids):
    position_ids = torch.arange(input_ids.shape[1]).unsqueeze(0)
    model.eval()
    with torch.no_grad():
        return model(input_ids, position_ids, None)


def _checkpoint_tensors(checkpoint):
    tensors = {}
    for path in sorted(checkpoint.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            tensors.update({name: f.get_tensor(name) for name in f.keys()})
    return tensors


@pytest.mark.parametrize("name", CHECKPOINTS)
def test_logits_match_hugging_face(world, model_zoo, name):
    [model] = build_model(model_zoo / name, ParallelLayout())
    reference = _reference(model_zoo, name)
    logits = _forward(model, reference["input_ids"])
    assert logits.shape == reference["output"].shape
    assert (logits - reference["output"]).abs().max().item() <= TOLERANCE


@pytest.mark.parametrize("name", ["llama", "qwen3", "qwen3_moe", "deepseek_v3", "llama_rope3", "gemma2", "gemma3", "glm4_moe", "gpt_oss", "gpt_oss_yarn",
                                  "qwen3_next", "qwen3_5"])
def test_packed_sequences_match_hugging_face(world, model_zoo, name):
    """A prefix of row 0 and all of row 1 packed into one row (megatron's THD with ``cu_seqlens``): RoPE
    restarts at each sequence and nothing attends across them, so each equals HF on its own."""
    from megatron.core.packed_seq_params import PackedSeqParams

    [model] = build_model(model_zoo / name, ParallelLayout())
    reference = _reference(model_zoo, name)
    ids, expected = reference["input_ids"], reference["output"]
    cut = ids.shape[1] // 2 + 1
    tokens = torch.cat([ids[0, :cut], ids[1]]).unsqueeze(0)
    positions = torch.cat([torch.arange(cut), torch.arange(ids.shape[1])]).unsqueeze(0)
    cu = torch.tensor([0, cut, cut + ids.shape[1]], dtype=torch.int32)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=ids.shape[1],
                             max_seqlen_kv=ids.shape[1])
    model.eval()
    with torch.no_grad():
        logits = model(tokens, positions, None, packed_seq_params=params)[0]
    assert (logits[:cut] - expected[0, :cut]).abs().max().item() <= TOLERANCE
    assert (logits[cut:] - expected[1]).abs().max().item() <= TOLERANCE


@pytest.mark.parametrize("dispatcher", ["alltoall", "allgather"])
def test_moe_dispatchers_match_hugging_face(world, model_zoo, dispatcher):
    [model] = build_model(model_zoo / "mixtral", ParallelLayout(), moe_token_dispatcher=dispatcher)
    reference = _reference(model_zoo, "mixtral")
    assert (_forward(model, reference["input_ids"]) - reference["output"]).abs().max().item() <= TOLERANCE


def test_tied_embeddings_share_one_tensor(world, model_zoo):
    [model] = build_model(model_zoo / "llama_tied", ParallelLayout())
    names = [name for name, _ in model.named_parameters()]
    assert "output_layer.weight" not in names
    assert model.shared_embedding_or_output_weight() is model.embedding.word_embeddings.weight


@pytest.mark.parametrize("name", ["llama", "qwen2", "qwen3", "qwen3_moe", "mixtral", "llama_tied", "gemma2", "gemma3", "glm4_moe", "kimi_k2", "gpt_oss", "qwen3_next", "qwen3_5",
                                  "qwen3_5_moe"])
def test_export_reproduces_the_checkpoint_bit_for_bit(world, model_zoo, name):
    [model] = build_model(model_zoo / name, ParallelLayout())
    original = _checkpoint_tensors(model_zoo / name)
    exported = dict(gather_hf_tensors([model], model_zoo / name, ParallelLayout()))
    assert list(exported) and sorted(exported) == sorted(original)
    for tensor_name, tensor in exported.items():
        assert tensor.dtype == original[tensor_name].dtype and torch.equal(tensor, original[tensor_name]), tensor_name


def test_exported_pieces_tile_every_tensor_once(world, model_zoo):
    """The weight-sync view: pieces from this rank's shards, assembled by hand, equal the checkpoint."""
    [model] = build_model(model_zoo / "qwen2", ParallelLayout())
    original = _checkpoint_tensors(model_zoo / "qwen2")
    assembled = {name: torch.full_like(t, float("nan")) for name, t in original.items()}
    counts = {name: torch.zeros(t.shape, dtype=torch.int32) for name, t in original.items()}
    for piece in export_hf_pieces([model], model_zoo / "qwen2", ParallelLayout()):
        assembled[piece.hf_name][piece.hf_slice] = piece.tensor
        counts[piece.hf_name][piece.hf_slice] += 1
    for name in original:
        assert torch.all(counts[name] == 1), name
        assert torch.equal(assembled[name], original[name]), name


def test_saved_checkpoint_reloads_with_equal_logits(world, model_zoo, tmp_path):
    from transformers import AutoModelForCausalLM

    [model] = build_model(model_zoo / "qwen3_moe", ParallelLayout())
    save_hf_checkpoint([model], model_zoo / "qwen3_moe", ParallelLayout(), tmp_path / "out", max_shard_bytes=400_000)
    assert (tmp_path / "out" / "model.safetensors.index.json").is_file()
    reference = _reference(model_zoo, "qwen3_moe")
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"), dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        assert torch.equal(hf(reference["input_ids"]).logits, reference["output"])


def test_kimi_k2_saves_under_its_own_model_type_and_reloads_with_equal_logits(world, model_zoo, tmp_path):
    import json

    from transformers import AutoModelForCausalLM

    from megarl.models import load_hf_config

    [model] = build_model(model_zoo / "kimi_k2", ParallelLayout())
    save_hf_checkpoint([model], model_zoo / "kimi_k2", ParallelLayout(), tmp_path / "out")
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    assert (written["model_type"], written["architectures"]) == ("kimi_k2", ["DeepseekV3ForCausalLM"])
    load_hf_config(tmp_path / "out")  # registers kimi_k2 with transformers' Auto classes
    input_ids = _reference(model_zoo, "kimi_k2")["input_ids"]

    def logits(checkpoint):
        hf = AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32, attn_implementation="eager")
        with torch.no_grad():
            return hf.eval()(input_ids).logits

    # the original's logits in this process too: a 2-worker run once saw the reload differ in the last bits from the
    # zoo's reference, computed in another process (cause not found); the export itself is tested bit for bit
    assert torch.equal(logits(tmp_path / "out"), logits(model_zoo / "kimi_k2"))


def test_critic_values_match_hf_token_classification(world, model_zoo, tmp_path):
    from transformers import AutoModelForTokenClassification

    [critic] = build_model(model_zoo / "llama_critic", ParallelLayout(), role="critic")
    reference = _reference(model_zoo, "llama_critic")
    values = _forward(critic, reference["input_ids"])
    assert values.shape == (2, 16, 1)
    assert (values - reference["output"]).abs().max().item() <= TOLERANCE
    # Export writes an HF critic (ForTokenClassification, score.*) that transformers loads as is.
    save_hf_checkpoint([critic], model_zoo / "llama_critic", ParallelLayout(), tmp_path / "critic", role="critic")
    hf = AutoModelForTokenClassification.from_pretrained(str(tmp_path / "critic"), dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        assert torch.equal(hf(reference["input_ids"]).logits, reference["output"])


def test_critic_from_causal_lm_checkpoint_initialises_its_value_head(world, model_zoo):
    [critic] = build_model(model_zoo / "llama", ParallelLayout(), role="critic", load_weights=False)
    report = load_hf_weights([critic], model_zoo / "llama", ParallelLayout(), role="critic")
    assert sorted(report.left_initialised) == ["score.bias", "score.weight"]
    [again] = build_model(model_zoo / "llama", ParallelLayout(), role="critic")
    assert torch.equal(again.output_layer.weight, critic.output_layer.weight)  # same seed, same head
    assert torch.all(again.output_layer.bias == 0) and again.output_layer.weight.std() > 0
    # The backbone is the LM's: the final-norm hidden states through the head give the values.
    values = _forward(again, _reference(model_zoo, "llama")["input_ids"])
    assert values.shape == (2, 16, 1) and torch.isfinite(values).all()


def test_build_from_a_config_initialises_randomly(world):
    from megarl.models import param_shards
    from megarl.devtools.tiny_model import build_config

    config = build_config("qwen3_moe", "tiny")
    [model] = build_model(config, ParallelLayout())
    shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
    assert shapes == {s.name: s.local_shape for s in param_shards(config, ParallelLayout())}
    assert model.decoder.layers[0].mlp.router.weight.std() > 0
    ids = torch.zeros(1, 8, dtype=torch.long)
    assert _forward(model, ids).shape == (1, 8, 512)


def test_ref_model_is_frozen(world, model_zoo):
    [ref] = build_model(model_zoo / "llama", ParallelLayout(), role="ref")
    assert not ref.training
    assert not any(p.requires_grad for p in ref.parameters())


def test_layout_must_match_parallel_state(world, model_zoo):
    with pytest.raises(ValueError, match="disagrees with megatron's parallel state"):
        build_model(model_zoo / "llama", ParallelLayout(tp=2))


def test_unknown_role_is_rejected(world, model_zoo):
    with pytest.raises(ValueError, match="role='reward'"):
        build_model(model_zoo / "llama", ParallelLayout(), role="reward")


# ---------------------------------------------------------------- DeepSeek-V3, RoPE, vocab padding


def test_deepseek_v3_export_is_bit_exact_and_skips_the_mtp_layer(world, model_zoo, caplog, monkeypatch):
    import logging

    from megarl.models import loading

    monkeypatch.setattr(loading, "_logged_skips", set())  # once per checkpoint and process: forget earlier builds
    with caplog.at_level(logging.INFO, logger="megarl.models.loading"):
        [model] = build_model(model_zoo / "deepseek_v3", ParallelLayout())
    skip_lines = [r.getMessage() for r in caplog.records if "multi-token prediction" in r.getMessage()]
    assert len(skip_lines) == 1 and "skipping 4 tensors" in skip_lines[0] and "model.layers.3.*" in skip_lines[0]
    original = _checkpoint_tensors(model_zoo / "deepseek_v3")
    exported = dict(gather_hf_tensors([model], model_zoo / "deepseek_v3", ParallelLayout()))
    mtp = sorted(name for name in original if name.startswith("model.layers.3."))
    assert len(mtp) == 4 and sorted(exported) == sorted(set(original) - set(mtp))
    for name, tensor in exported.items():
        assert tensor.dtype == original[name].dtype and torch.equal(tensor, original[name]), name
    assert exported["model.layers.1.mlp.gate.e_score_correction_bias"].dtype == torch.float32


def test_deepseek_v3_router_bias_is_loaded_and_changes_the_routing(world, model_zoo):
    [model] = build_model(model_zoo / "deepseek_v3", ParallelLayout())
    reference = _reference(model_zoo, "deepseek_v3")
    router = model.decoder.layers[1].mlp.router
    assert router.expert_bias.dtype == torch.float32 and router.expert_bias.abs().min() > 0
    with torch.no_grad():
        router.expert_bias.zero_()
    assert (_forward(model, reference["input_ids"]) - reference["output"]).abs().max().item() > 1e-3


def test_llama3_rope_with_other_factors_matches_hugging_face_at_long_positions(world, model_zoo):
    """The exact HF inverse frequencies are used (megatron-core's llama3 scaling fixes 1/4/8192)."""
    from tests.models.conftest import LLAMA3_ROPE

    from megarl.models import model_dims

    rope = model_dims(model_zoo / "llama_rope3").rope
    assert (rope.low_freq_factor, rope.high_freq_factor, rope.original_max_position_embeddings) == (2.0, 8.0, 32)
    [model] = build_model(model_zoo / "llama_rope3", ParallelLayout())
    reference = _reference(model_zoo, "llama_rope3")
    assert reference["input_ids"].shape[1] > 4 * LLAMA3_ROPE["original_max_position_embeddings"]
    assert (_forward(model, reference["input_ids"]) - reference["output"]).abs().max().item() <= TOLERANCE


def test_padded_vocabulary_is_masked_zero_and_stripped(world, model_zoo):
    """504 tokens padded to 512: HF's logits on the real columns, -inf on the padding, zero padding rows,
    and an export without padding."""
    [model] = build_model(model_zoo / "llama_vocab504", ParallelLayout())
    assert model.embedding.word_embeddings.weight.shape[0] == 512 and model.output_layer.weight.shape[0] == 512
    assert torch.all(model.embedding.word_embeddings.weight[504:] == 0) and torch.all(model.output_layer.weight[504:] == 0)
    reference = _reference(model_zoo, "llama_vocab504")
    logits = _forward(model, reference["input_ids"])
    assert (logits[..., :504] - reference["output"]).abs().max().item() <= TOLERANCE
    assert torch.all(logits[..., 504:] == float("-inf"))
    exported = dict(gather_hf_tensors([model], model_zoo / "llama_vocab504", ParallelLayout()))
    original = _checkpoint_tensors(model_zoo / "llama_vocab504")
    assert exported["lm_head.weight"].shape == (504, 128)
    assert all(torch.equal(exported[name], original[name]) for name in original)


def test_padded_vocabulary_gives_hf_log_probs_and_entropy_with_zero_padding_grads(world, model_zoo):
    from megarl.engine.vocab_parallel import vocab_parallel_entropy, vocab_parallel_log_probs

    [model] = build_model(model_zoo / "llama_vocab504", ParallelLayout())
    reference = _reference(model_zoo, "llama_vocab504")
    ids = reference["input_ids"]
    position_ids = torch.arange(ids.shape[1]).unsqueeze(0)
    logits = model(ids, position_ids, None)[:, :-1]
    log_probs = vocab_parallel_log_probs(logits, ids[:, 1:])
    entropy = vocab_parallel_entropy(logits)
    expected = torch.log_softmax(reference["output"][:, :-1], dim=-1)
    assert (log_probs - expected.gather(-1, ids[:, 1:, None])[..., 0]).abs().max().item() <= TOLERANCE
    assert (entropy + (expected.exp() * expected).sum(-1)).abs().max().item() <= TOLERANCE
    (log_probs.sum() + entropy.sum()).backward()
    grad = model.output_layer.weight.grad
    assert torch.isfinite(grad).all() and torch.all(grad[504:] == 0) and grad[:504].abs().max() > 0


@pytest.mark.parametrize("variant", ["no_q_latent", "one_expert_group"])
def test_deepseek_variants_match_hugging_face(world, tmp_path, variant):
    """q_lora_rank=None (DeepSeek-V2-Lite style): q_proj maps to MLA's linear_q_proj. One expert group
    kept whole (Moonlight: n_group = topk_group = 1, 6 of 64 experts): no group limit, any top-k."""
    from transformers import AutoModelForCausalLM

    from megarl.devtools.tiny_model import build_config

    config = build_config("deepseek_v3", "tiny")
    if variant == "no_q_latent":
        config.q_lora_rank = None
    else:
        config.n_group, config.topk_group, config.num_experts_per_tok = 1, 1, 3
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(11)
        hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
        with torch.no_grad():
            for name, buffer in hf.named_buffers():
                if name.endswith("e_score_correction_bias"):
                    buffer.add_(0.1 * torch.randn_like(buffer))
    hf.save_pretrained(str(tmp_path))
    [model] = build_model(tmp_path, ParallelLayout())
    if variant == "no_q_latent":
        assert "decoder.layers.0.self_attention.linear_q_proj.weight" in dict(model.named_parameters())
    ids = torch.randint(0, 512, (2, 80), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        reference = hf(ids).logits
    assert (_forward(model, ids) - reference).abs().max().item() <= TOLERANCE


def test_qwen3_next_skips_its_mtp_tensors_by_name_and_exports_the_main_model(world, model_zoo, tmp_path, caplog, monkeypatch):
    """Qwen3-Next checkpoints carry their multi-token-prediction layer under ``mtp.*``: the load skips them
    in one named log line, the logits stay HF's, the export is the checkpoint without them (a documented skip)."""
    import logging
    import shutil

    from safetensors.torch import save_file

    from megarl.models import loading

    checkpoint = tmp_path / "qwen3_next_mtp"
    shutil.copytree(model_zoo / "qwen3_next", checkpoint)
    original = _checkpoint_tensors(checkpoint)
    mtp = {"mtp.fc.weight": torch.randn(128, 256), "mtp.pre_fc_norm_hidden.weight": torch.randn(128),
           "mtp.layers.0.input_layernorm.weight": torch.randn(128)}
    save_file({**original, **mtp}, str(checkpoint / "model.safetensors"), metadata={"format": "pt"})
    monkeypatch.setattr(loading, "_logged_skips", set())
    with caplog.at_level(logging.INFO, logger="megarl.models.loading"):
        [model] = build_model(checkpoint, ParallelLayout())
    [line] = [r.getMessage() for r in caplog.records if "multi-token prediction" in r.getMessage()]
    assert "skipping 3 tensors" in line and "mtp.*" in line
    assert loading.describe_skipped(checkpoint) == line
    reference = _reference(model_zoo, "qwen3_next")
    assert (_forward(model, reference["input_ids"]) - reference["output"]).abs().max().item() <= TOLERANCE
    exported = dict(gather_hf_tensors([model], checkpoint, ParallelLayout()))
    assert sorted(exported) == sorted(original)


@pytest.mark.parametrize("name", ["gpt_oss", "qwen3_next", "qwen3_5_moe"])
def test_backward_reaches_every_parameter(world, model_zoo, name):
    """A training step's gradients are finite and non-zero for every parameter: sinks, the experts' biases
    (megatron adds them in place: gpt-oss failed in backward before FreshOutputRowParallelLinear), every
    DeltaNet tensor."""
    [model] = build_model(model_zoo / name, ParallelLayout())
    model.train()
    ids = _reference(model_zoo, name)["input_ids"]
    logits = model(ids, torch.arange(ids.shape[1]).unsqueeze(0), None)
    logits.float().logsumexp(-1).mean().backward()
    routed = set()
    for param_name, param in model.named_parameters():
        assert param.grad is not None and torch.isfinite(param.grad).all(), param_name
        if ".local_experts." in param_name:  # an expert no token chose this step has a zero gradient
            if param.grad.abs().sum() > 0:
                routed.add(param_name.split(".local_experts.")[0])
        else:
            assert param.grad.abs().sum() > 0, param_name
    moe_layers = {n.split(".local_experts.")[0] for n, _ in model.named_parameters() if ".local_experts." in n}
    assert routed == moe_layers  # every MoE layer's experts got gradients


def _tiny_qwen3_5_vlm(directory):
    """A tiny Qwen3_5ForConditionalGeneration (the tiny qwen3_5 text model, a one-block vision tower), saved in
    several files with an index; returns the model."""
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    from megarl.devtools.tiny_model import build_config

    text = build_config("qwen3_5").to_dict()
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=128, patch_size=4,
                  num_position_embeddings=16)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(7)
        vlm = Qwen3_5ForConditionalGeneration(Qwen3_5Config(text_config=text, vision_config=vision)).eval()
    vlm.save_pretrained(str(directory), max_shard_size="300KB")
    return vlm


def test_qwen3_5_vision_language_checkpoint_extracted_to_its_language_model(world, model_zoo, tmp_path):
    """A tiny Qwen3_5ForConditionalGeneration (language model under model.language_model.*, a vision tower under
    model.visual.*) is refused; ``extract_language_model`` writes its language model as a qwen3_5 text checkpoint,
    whose megatron logits equal the vision-language model's on text and whose export is its tensors, bit for bit."""
    import json

    from megarl.devtools.extract_language_model import extract_language_model
    from megarl.models import family_for, load_hf_config

    vlm = _tiny_qwen3_5_vlm(tmp_path / "vlm")
    with pytest.raises(ValueError, match="vision-language model.*issue 28.*extract_language_model"):
        family_for(load_hf_config(tmp_path / "vlm"))
    out = extract_language_model(tmp_path / "vlm", tmp_path / "text")
    assert json.loads((out / "config.json").read_text())["architectures"] == ["Qwen3_5ForCausalLM"]
    weight_map = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(set(weight_map.values())) > 1 and not any(name.startswith("model.visual.") for name in weight_map)
    [model] = build_model(out, ParallelLayout())
    ids = _reference(model_zoo, "qwen3_5")["input_ids"]
    with torch.no_grad():
        reference = vlm(input_ids=ids).logits
    assert (_forward(model, ids) - reference).abs().max().item() <= TOLERANCE
    source = {name.replace("model.language_model.", "model."): tensor for name, tensor in _checkpoint_tensors(tmp_path / "vlm").items()
              if not name.startswith("model.visual.")}
    exported = dict(gather_hf_tensors([model], out, ParallelLayout()))
    assert sorted(exported) == sorted(source) and all(torch.equal(exported[n], source[n]) for n in source)


def test_qwen3_5_text_checkpoint_with_the_language_model_prefix(world, model_zoo, tmp_path):
    """transformers' Qwen3_5ForCausalLM loaded from the vision-language checkpoint saves its tensors as
    model.language_model.*: the load names the extraction, which writes model.* names that load."""
    from transformers import Qwen3_5ForCausalLM

    from megarl.devtools.extract_language_model import extract_language_model

    vlm = _tiny_qwen3_5_vlm(tmp_path / "vlm")
    Qwen3_5ForCausalLM.from_pretrained(str(tmp_path / "vlm"), dtype=torch.float32).save_pretrained(str(tmp_path / "hf"))
    assert "model.language_model.norm.weight" in _checkpoint_tensors(tmp_path / "hf")
    with pytest.raises(KeyError, match="model.language_model.*extract_language_model"):
        build_model(tmp_path / "hf", ParallelLayout())
    [model] = build_model(extract_language_model(tmp_path / "hf", tmp_path / "text"), ParallelLayout())
    ids = _reference(model_zoo, "qwen3_5")["input_ids"]
    with torch.no_grad():
        assert (_forward(model, ids) - vlm(input_ids=ids).logits).abs().max().item() <= TOLERANCE


def test_hf_config_overrides_change_the_model_as_they_change_hugging_faces(world, model_zoo):
    """verl's override_config.model_config: the fields are set before the bridge reads the config, so megatron
    computes what transformers computes from the same overridden config (and not what the checkpoint says)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from megarl.models import apply_overrides

    overrides = {"rms_norm_eps": 0.3, "rope_parameters": {"rope_type": "default", "rope_theta": 10.0}}
    [model] = build_model(model_zoo / "qwen3", ParallelLayout(), hf_overrides=overrides)
    reference = _reference(model_zoo, "qwen3")
    config = apply_overrides(AutoConfig.from_pretrained(str(model_zoo / "qwen3")), overrides)
    hf = AutoModelForCausalLM.from_pretrained(str(model_zoo / "qwen3"), config=config, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = hf(reference["input_ids"]).logits
    logits = _forward(model, reference["input_ids"])
    assert (logits - expected).abs().max().item() <= TOLERANCE
    assert (logits - reference["output"]).abs().max().item() > 1e-3  # the overrides did change the model
    with pytest.raises(ValueError, match="no field 'rms_norm_epsilon'"):
        apply_overrides(config, {"rms_norm_epsilon": 0.1})
