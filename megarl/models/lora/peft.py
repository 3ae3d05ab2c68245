"""The adapter in PEFT's format: ``adapter_config.json`` + ``adapter_model.safetensors``, written and read.

PEFT names each HF projection's matrices ``base_model.model.<module>.lora_{A,B}.weight``
(``<module>`` = ``model.layers.N.self_attn.q_proj``, ``model.layers.N.mlp.experts.E.gate_proj``, ...)
with ``lora_A`` ``[r, in]`` and ``lora_B`` ``[out, r]``, and applies ``scale = lora_alpha / r``.
megarl's adapter of a fused linear becomes the adapters of its projections: B split back row
range by row range (per query group for q/k/v under GQA, [gate; up] for SwiGLU, as the weight's
shard layout says), A copied to each (``canonical_lora``: each projection's own block of A, and of
B's columns). The result is exactly the update megarl trains, so
``PeftModel.from_pretrained(base, dir)`` gives the engine's logits (tested).

Reading (``actor_rollout_ref.model.lora.adapter_path``) is the inverse, with checks: ``r`` and
``lora_alpha`` must equal the run's (the scale comes from the config, so a mismatch would rescale
every update silently), the file must hold an adapter for exactly the projections the run
adapts. With ``lora.type=canonical_lora`` each projection keeps its own A (any PEFT adapter loads
exactly); with ``lora.type=lora`` the projections of one fused linear must share one A (an adapter
trained by megarl's fused LoRA), and one that does not is refused, naming ``canonical_lora``.
"""
from __future__ import annotations

import json
import logging
import os
import re
from pathlib import Path

import torch
import torch.distributed as dist

from megarl.models.lora.settings import LoRASettings, hf_short
from megarl.models.lora.shards import AdapterSpec, lora_shards, selection

logger = logging.getLogger(__name__)

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


def peft_target_modules(chosen: dict[str, tuple[str, ...]], all_modules: list[str]) -> list[str] | str:
    """PEFT's ``target_modules``: the projections' short names when they select exactly the adapted
    modules (the usual case), else a regex that matches exactly the adapted modules' full names."""
    adapted = sorted({m for modules in chosen.values() for m in modules})
    shorts = sorted({hf_short(m) for m in adapted})
    if sorted(m for m in all_modules if hf_short(m) in shorts) == adapted:
        return shorts
    return "^(?:" + "|".join(re.escape(m) for m in adapted) + ")$"


def peft_config(settings: LoRASettings, hf_config, base_model: str | os.PathLike | None, role: str = "actor") -> dict:
    """The ``adapter_config.json`` of an adapter trained with ``settings`` on ``hf_config``."""
    from megarl.models.lora.shards import linear_parts
    from megarl.models.layout import ParallelLayout
    from megarl.models.shards import param_shards

    chosen = selection(hf_config, settings, role)
    every = [m for part in linear_parts(param_shards(hf_config, ParallelLayout(), role)) for m in part.hf_modules]
    return {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": str(base_model or ""),
        "r": settings.rank, "lora_alpha": settings.alpha, "lora_dropout": settings.dropout,
        "target_modules": peft_target_modules(chosen, every), "bias": "none", "fan_in_fan_out": False,
        "inference_mode": True, "modules_to_save": None, "use_rslora": False, "use_dora": False,
        "init_lora_weights": True, "layers_to_transform": None, "layers_pattern": None,
        "rank_pattern": {}, "alpha_pattern": {},
    }


def _local_adapters(models: list, specs: list[AdapterSpec]) -> dict:
    """(vpp_chunk, adapter tensor name) -> this rank's lora_A / lora_B (B with untrained rows at zero)."""
    from megarl.models.loading import unwrap

    local = {}
    for spec in specs:
        module = unwrap(models[spec.base.vpp_chunk]).get_submodule(spec.module)
        local[(spec.base.vpp_chunk, spec.a.name)] = module.lora_A.detach()
        local[(spec.base.vpp_chunk, spec.b.name)] = module.lora_B_effective().detach()
    return local


def this_rank_adapters(hf_config, layout, settings: LoRASettings, role: str, transformer_impl: str) -> list[AdapterSpec]:
    from megatron.core import parallel_state as ps

    pp, tp = ps.get_pipeline_model_parallel_rank(), ps.get_tensor_model_parallel_rank()
    ep = ps.get_expert_model_parallel_rank() if layout.ep > 1 else 0
    etp = ps.get_expert_tensor_parallel_rank() if layout.etp > 1 else 0
    return [s for s in lora_shards(hf_config, layout, settings, role, transformer_impl)
            if s.base.pp_stage == pp and (s.base.tp_rank == tp if not s.base.is_expert else
                                          (s.base.ep_rank == ep and s.base.etp_rank == etp))]


@torch.no_grad()
def gather_adapter_tensors(models: list, hf_config, layout, settings: LoRASettings, role: str = "actor",
                           transformer_impl: str = "local", dst: int = 0):
    """PEFT-named full adapter tensors, yielded on rank ``dst`` (collective, like ``gather_hf_tensors``)."""
    from megarl.models.export import _sources, gather_pieces

    every = lora_shards(hf_config, layout, settings, role, transformer_impl)
    mine = this_rank_adapters(hf_config, layout, settings, role, transformer_impl)
    local = _local_adapters(models, mine)
    dtype = next(iter(local.values())).dtype
    sources = _sources([t for spec in every for t in (spec.a, spec.b)])
    shapes = {}
    for spec in every:
        for tensor in (spec.a, spec.b):
            for piece in tensor.pieces:
                shapes.setdefault(piece.hf_name, piece.hf_shape)
    yield from gather_pieces(dict(sorted(shapes.items(), key=lambda kv: _order(kv[0]))), sources, local, dst,
                             lambda spec: dtype)


def _order(name: str) -> tuple:
    """Layer number, then name: the order PEFT itself writes."""
    match = re.search(r"\.layers\.(\d+)\.", name)
    return (int(match.group(1)) if match else -1, name)


def save_peft_adapter(models: list, hf_config_or_dir, layout, settings: LoRASettings, out_dir, role: str = "actor",
                      transformer_impl: str = "local", dst: int = 0) -> Path:
    """Write the adapter in PEFT format from rank ``dst``; call on every rank."""
    from safetensors.torch import save_file

    from megarl.models.dims import load_hf_config

    config = load_hf_config(hf_config_or_dir)
    out_dir = Path(out_dir)
    tensors = dict(gather_adapter_tensors(models, config, layout, settings, role, transformer_impl, dst))
    if dist.get_rank() == dst:
        out_dir.mkdir(parents=True, exist_ok=True)
        base = hf_config_or_dir if not hasattr(hf_config_or_dir, "to_dict") else getattr(config, "_name_or_path", "")
        save_file(tensors, str(out_dir / ADAPTER_WEIGHTS), metadata={"format": "pt"})
        (out_dir / ADAPTER_CONFIG).write_text(json.dumps(peft_config(settings, config, base, role), indent=2) + "\n")
    dist.barrier()
    return out_dir


# ---------------------------------------------------------------------------- reading


def read_peft_config(adapter_dir: str | os.PathLike) -> dict:
    path = Path(adapter_dir) / ADAPTER_CONFIG
    if not path.is_file():
        raise FileNotFoundError(f"{adapter_dir} has no {ADAPTER_CONFIG}: adapter_path must be a PEFT adapter directory "
                                f"({ADAPTER_CONFIG} + {ADAPTER_WEIGHTS}) or a megarl LoRA checkpoint")
    return json.loads(path.read_text())


def check_peft_config(config: dict, settings: LoRASettings, where: str) -> None:
    """The adapter's own r / lora_alpha / type must be the run's."""
    problems = []
    if str(config.get("peft_type", "LORA")).upper() != "LORA":
        problems.append(f"peft_type={config.get('peft_type')!r} (megarl loads LoRA adapters)")
    if config.get("use_dora"):
        problems.append("use_dora=true (DoRA adapters are not LoRA)")
    if config.get("use_rslora"):
        problems.append("use_rslora=true (scale alpha/sqrt(r); megarl scales by alpha/r)")
    if config.get("r") is not None and int(config["r"]) != settings.rank:
        problems.append(f"r={config['r']} but the run's lora.rank={settings.rank}")
    if config.get("lora_alpha") is not None and float(config["lora_alpha"]) != float(settings.alpha):
        problems.append(f"lora_alpha={config['lora_alpha']} but the run's lora.alpha={settings.alpha} "
                        "(the update is scaled by alpha / rank from the config: a mismatch rescales it)")
    if config.get("rank_pattern") or config.get("alpha_pattern"):
        problems.append("per-module rank_pattern / alpha_pattern")
    if problems:
        raise ValueError(f"{where}/{ADAPTER_CONFIG} does not match this run's LoRA settings: {'; '.join(problems)}. "
                         "Set actor_rollout_ref.model.lora.* to the adapter's values or point at another adapter.")


def _separate_a_message(adapter_dir, spec: AdapterSpec) -> str:
    """The refusal of an adapter whose projections of one fused linear have their own A (PEFT's default)."""
    projections = [m.rsplit(".", 1)[-1] for m in spec.hf_modules]
    parent = spec.hf_modules[0].rsplit(".", 1)[0]
    return (f"{adapter_dir}: {', '.join(projections)} of {parent} have different lora_A matrices (PEFT trains each "
            f"projection's A separately), and lora.type=lora shares one A across the fused "
            f"{spec.module.rsplit('.', 1)[-1]} (Megatron-Bridge's fused LoRA). Set lora.type=canonical_lora (one A "
            "and B per projection, as PEFT trains them) to start from this adapter")


def peft_adapter_problems(adapter_dir, hf_config, settings: LoRASettings, role: str = "actor",
                          transformer_impl: str = "local") -> list[str]:
    """What ``load_peft_adapter`` would refuse in ``adapter_dir``, read before any process starts: the weights
    file, the projections it covers, and one shared A per fused linear (only the A matrices are read)."""
    from safetensors import safe_open

    from megarl.models.layout import ParallelLayout

    weights = Path(adapter_dir) / ADAPTER_WEIGHTS
    if not weights.is_file():
        return [f"{adapter_dir} has no {ADAPTER_WEIGHTS} (adapters saved as .bin are not read: re-save them with "
                "safe_serialization=True)"]
    specs = lora_shards(hf_config, ParallelLayout(), settings, role, transformer_impl)
    with safe_open(str(weights), framework="pt") as f:
        names = {_canonical(n): n for n in f.keys()}
        coverage = _coverage_problem(adapter_dir, specs, names)
        if coverage:
            return [coverage]
        for spec in specs if not settings.canonical else ():
            first, *others = [f.get_tensor(names[p.hf_name]) for p in spec.a.pieces]
            if any(not torch.equal(other, first) for other in others):
                return [_separate_a_message(adapter_dir, spec)]
    return []


def _coverage_problem(adapter_dir, specs: list[AdapterSpec], names: dict[str, str]) -> str | None:
    expected = {piece.hf_name for spec in specs for t in (spec.a, spec.b) for piece in t.pieces}
    missing, extra = sorted(expected - set(names)), sorted(set(names) - expected)
    if not (missing or extra):
        return None
    return (f"{adapter_dir}: the adapter does not cover exactly the projections this run adapts (target_modules / "
            f"exclude_modules): missing {missing[:4]}{' ...' if len(missing) > 4 else ''}, not adapted here "
            f"{extra[:4]}{' ...' if len(extra) > 4 else ''}")


@torch.no_grad()
def load_peft_adapter(models: list, adapter_dir, hf_config, layout, settings: LoRASettings, role: str = "actor",
                      transformer_impl: str = "local") -> int:
    """Fill this rank's adapters from a PEFT adapter directory; returns the elements read."""
    from safetensors import safe_open

    from megarl.models.loading import unwrap

    adapter_dir = Path(adapter_dir)
    check_peft_config(read_peft_config(adapter_dir), settings, str(adapter_dir))
    weights = adapter_dir / ADAPTER_WEIGHTS
    if not weights.is_file():
        raise FileNotFoundError(f"{adapter_dir} has no {ADAPTER_WEIGHTS} (adapters saved as .bin are not read: "
                                "re-save them with safe_serialization=True)")
    with safe_open(str(weights), framework="pt") as f:
        names = {_canonical(n): n for n in f.keys()}
        coverage = _coverage_problem(adapter_dir, lora_shards(hf_config, layout, settings, role, transformer_impl), names)
        if coverage:
            raise ValueError(coverage)
        read = 0
        for spec in this_rank_adapters(hf_config, layout, settings, role, transformer_impl):
            module = unwrap(models[spec.base.vpp_chunk]).get_submodule(spec.module)
            a_values = [f.get_slice(names[p.hf_name])[p.hf_slice] for p in spec.a.pieces]
            if not settings.canonical and any(not torch.equal(other, a_values[0]) for other in a_values[1:]):
                raise ValueError(_separate_a_message(adapter_dir, spec))
            for piece, value in zip(spec.a.pieces, a_values):  # one piece (shared A) or one per projection
                module.lora_A[piece.megatron_slice] = value.to(module.lora_A.dtype)
            for piece in spec.b.pieces:
                module.lora_B[piece.megatron_slice] = f.get_slice(names[piece.hf_name])[piece.hf_slice].to(module.lora_B.dtype)
            read += module.lora_A.numel() + module.lora_B.numel()
    logger.debug("loaded %d adapter elements from %s", read, adapter_dir)
    return read


def _canonical(name: str) -> str:
    """PEFT may save with an adapter name inside (``lora_A.default.weight``); megarl's names have none."""
    return re.sub(r"\.(lora_[AB])\.[^.]+\.weight$", r".\1.weight", name) if ".default." in name else name
