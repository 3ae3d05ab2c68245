"""Shared fixtures for tests/models: tiny HF checkpoints of every family and HF reference outputs.

``model_zoo`` (session scope) writes, under one temporary directory:
  <family>        for llama, qwen2, qwen3, qwen3_moe, mixtral (tiny: 2 layers, hidden 128)
  llama_tied      tied input/output embeddings
  llama_small     4 layers (for PP=2 x VPP=2)
  llama_sharded   the llama weights split over several safetensors files with an index
  llama_critic    LlamaForTokenClassification(num_labels=1) on the llama backbone (value head)
  deepseek_v3     tiny DeepSeek-V3 (MLA, YaRN, 16 experts in 4 groups, shared expert, random router
                  bias, one dense layer then two MoE layers, an MTP layer in the checkpoint)
  llama_rope3     llama with Llama-3 RoPE whose factors and original context differ from megatron's 1/4/8192
  llama_vocab504  llama with a vocabulary of 504 (padded to 512 for megatron)
  gemma2, gemma3  tiny Gemma-2 / Gemma-3 text (``megarl.models.families.gemma``: soft-caps that clip,
                  a window of 5 on 16 tokens, Gemma-3's two RoPEs with a linear-scaled global one)
  glm4_moe        tiny GLM-4.5 (half-rotary heads, QKV bias, qk-norm, 8 experts in 2 groups with a
                  random router bias, a shared expert, layer 0 dense)
  kimi_k2         tiny Kimi-K2: DeepSeek-V3's architecture under model_type kimi_k2 (transformers has
                  none: megarl registers it), Kimi-K2's one expert group, YaRN betas 1/1, scaling 2.827
  gpt_oss         tiny gpt-oss (sinks, biases on q/k/v/o, the router and the experts, a window of 5
                  on layer 0 and full attention on layer 1, 8 experts top-2, a SwiGLU clamp that clips)
  gpt_oss_yarn    gpt_oss (seed 6) with YaRN as gpt-oss publishes it (truncate: false), factor 4 over an
                  original context of 16, on 64 tokens
  qwen3_next      tiny Qwen3-Next: 4 layers linear, full, linear, linear (gated DeltaNet with 2 key / 4
                  value heads; gated, quarter-rotary full attention), 8 experts top-2 with a gated shared
                  expert, layer 2 dense
  qwen3_5         tiny Qwen3.5 text: Qwen3-Next's 4 hybrid layers with unfused DeltaNet projections in flat
                  head order and mrope sections, a dense MLP (``megarl.models.families.qwen3_5``)
  qwen3_5_moe     tiny Qwen3.5-MoE text: the same layers, 8 experts top-2 with a gated shared expert in each
  reference.pt    {checkpoint: {"input_ids", "output"}}: HF transformers logits (values for the
                  critic) in fp32 on a fixed random batch, the reference every test compares to.
                  RoPE checkpoints get sequences past their original context (YaRN / Llama-3 scaling).
                  transformers runs with eager attention (its SDPA path ignores Gemma's soft-capping).
"""
import json
from pathlib import Path

import pytest
import torch

from tests.built_once import built_once

FAMILIES = ["llama", "qwen2", "qwen3", "qwen3_moe", "mixtral"]
NEW_FAMILIES = ["gemma2", "gemma3", "glm4_moe", "kimi_k2", "gpt_oss", "qwen3_next", "qwen3_5", "qwen3_5_moe"]  # families of issue 24, their own tiny models (FamilySpec.tiny_config)
BATCH, SEQ = 2, 16
LONG = {"deepseek_v3": 96, "kimi_k2": 96, "llama_rope3": 160,  # past YaRN's original 64 / the Llama-3 original 32
        "qwen3_next": 80, "gpt_oss_yarn": 64}  # past the gated delta rule's first chunk of 64
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 2.0,
               "high_freq_factor": 8.0, "original_max_position_embeddings": 32}
# gpt-oss's published YaRN (factor 32, betas 32 / 1, truncate false) on a short original context of 16
GPT_OSS_YARN = {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
                "truncate": False, "original_max_position_embeddings": 16}


def _hf_output(checkpoint: Path, input_ids: torch.Tensor, critic: bool) -> torch.Tensor:
    from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

    auto = AutoModelForTokenClassification if critic else AutoModelForCausalLM
    model = auto.from_pretrained(str(checkpoint), dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        return model(input_ids).logits


def _make_critic(backbone: Path, out_dir: Path) -> None:
    """An HF critic checkpoint: the backbone plus a seeded score head with a non-zero bias."""
    from transformers import AutoModelForTokenClassification

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(3)
        model = AutoModelForTokenClassification.from_pretrained(str(backbone), num_labels=1, dtype=torch.float32)
        with torch.no_grad():
            model.score.weight.normal_(0.0, 0.1)
            model.score.bias.fill_(0.25)
    model.save_pretrained(str(out_dir))


def with_config(checkpoint: Path, **fields) -> Path:
    """The checkpoint with other values of weightless config.json fields."""
    path = checkpoint / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **fields}, indent=2))
    return checkpoint


def with_rope(checkpoint: Path, rope_parameters: dict) -> Path:
    """The checkpoint with other RoPE parameters in its config.json (RoPE has no weights)."""
    return with_config(checkpoint, rope_parameters=rope_parameters)


def build_zoo(root: Path) -> Path:
    """Write every checkpoint and reference.pt under ``root`` (see the module docstring)."""
    from megarl.devtools.tiny_model import make_tiny_model

    for family in FAMILIES:
        make_tiny_model(family, "tiny", root / family, seed=0)
    make_tiny_model("llama", "tiny", root / "llama_tied", seed=1, tie_word_embeddings=True)
    make_tiny_model("llama", "small", root / "llama_small", seed=2)
    make_tiny_model("llama", "tiny", root / "llama_sharded", seed=0, shards=6)
    _make_critic(root / "llama", root / "llama_critic")
    make_tiny_model("deepseek_v3", "tiny", root / "deepseek_v3", seed=0)
    with_rope(make_tiny_model("llama", "tiny", root / "llama_rope3", seed=4), LLAMA3_ROPE)
    make_tiny_model("llama", "tiny", root / "llama_vocab504", seed=5, vocab_size=504)
    for family in NEW_FAMILIES:
        make_tiny_model(family, "tiny", root / family, seed=0)
    with_rope(make_tiny_model("gpt_oss", "tiny", root / "gpt_oss_yarn", seed=6), GPT_OSS_YARN)

    generator = torch.Generator().manual_seed(0)
    reference = {}
    extra = ["llama_tied", "llama_small", "llama_sharded", "llama_critic", "deepseek_v3", "llama_rope3", "llama_vocab504",
             "gpt_oss_yarn"]
    for name in FAMILIES + extra + NEW_FAMILIES:
        vocab = 504 if name == "llama_vocab504" else 512
        input_ids = torch.randint(0, vocab, (BATCH, LONG.get(name, SEQ)), generator=generator)
        output = _hf_output(root / name, input_ids, critic=name == "llama_critic")
        reference[name] = {"input_ids": input_ids, "output": output}
    torch.save(reference, root / "reference.pt")
    return root


@pytest.fixture(scope="session")
def model_zoo(tmp_path_factory) -> Path:
    return built_once(tmp_path_factory, "model_zoo", build_zoo)


@pytest.fixture(scope="session")
def vision_zoo(tmp_path_factory) -> Path:
    """Tiny Qwen2.5-VL / Qwen3-VL checkpoints, an image + text batch and HF's logits (``vision_fixture``)."""
    from tests.models.vision_fixture import make_vision_zoo

    return built_once(tmp_path_factory, "vision_zoo", make_vision_zoo)

