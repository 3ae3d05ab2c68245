"""The LoRA keys (``actor_rollout_ref.model.lora.*``, ``critic.model.lora.*``), checked before anything starts.

``lora_problems`` checks the values (type, dropout position, rank, alpha, init methods, merge and
what adapter-only updates need); ``lora_preflight_problems`` checks them against the model at
``model.path`` (every target and exclude name matches one of its linears, expert adapters have
expert-TP 1, ``adapter_path`` is an adapter of this rank and alpha). docs/lora.md.
"""
from __future__ import annotations

from pathlib import Path

from megarl.config.errors import Problem, refusal

ACTOR, CRITIC = "actor_rollout_ref.model.lora", "critic.model.lora"
OTHER_TYPES = {
    "dora": ("DoRA (weight-decomposed adapters)", "use lora.type=lora"),
    "vlm_lora": ("vision-language LoRA", "megarl trains text-only causal LMs; use lora.type=lora"),
}


def _sections(cfg):
    from megarl.settings.derived import critic_enabled

    yield ACTOR, "actor", cfg.actor_rollout_ref.model.lora
    if critic_enabled(cfg):
        yield CRITIC, "critic", cfg.critic.model.lora


def lora_problems(cfg) -> list[Problem]:
    """Value problems of the LoRA sections (no file is read)."""
    from megarl.settings.engine import lora_settings

    problems: list[Problem] = []
    for prefix, role, lora in _sections(cfg):
        if lora.rank < 0:
            problems.append(Problem(f"{prefix}.rank={lora.rank}: use 0 (no LoRA) or a rank >= 1", key=f"{prefix}.rank"))
            continue
        if lora.rank == 0:
            if lora.adapter_path:
                problems.append(Problem(f"{prefix}.adapter_path={lora.adapter_path} needs {prefix}.rank > 0 (the "
                                        "adapter's rank)", key=f"{prefix}.adapter_path"))
            continue
        if lora.type in OTHER_TYPES:
            feature, instead = OTHER_TYPES[lora.type]
            problems.append(refusal(f"{prefix}.type={lora.type}", feature, instead))
        elif lora.type not in ("lora", "canonical_lora"):
            problems.append(Problem(f"{prefix}.type={lora.type!r}: use lora (one A per fused linear) or "
                                    "canonical_lora (one A per projection)", key=f"{prefix}.type"))
        if lora.dropout_position != "pre":
            problems.append(refusal(f"{prefix}.dropout_position={lora.dropout_position}", "dropout on the adapter's "
                                    "output", "the dropout applies to the adapter's input (dropout_position=pre)"))
        try:
            lora_settings(cfg, role)
        except ValueError as exc:  # less the type, reported above
            rest = [part for part in str(exc).split("; ") if not part.startswith("lora.type=")]
            if rest:
                problems.append(Problem(f"{prefix}: {'; '.join(rest)}", key=prefix))
        if role == "actor":
            problems += _update_mode_problems(cfg, lora)
    return problems


def _update_mode_problems(cfg, lora) -> list[Problem]:
    """``merge=False`` (verl's default): the fleet keeps model.path's weights as its base and receives
    only the adapter each step, so the trainer's base must be model.path's."""
    if lora.merge:
        return []
    start = cfg.actor_rollout_ref.actor.megatron
    if start.use_dist_checkpointing and start.dist_checkpointing_path:
        return [Problem(f"{ACTOR}.merge=False sends only the adapter each step: the fleet's base is "
                        f"actor_rollout_ref.model.path, but the actor starts from the megatron checkpoint "
                        f"{start.dist_checkpointing_path}, whose weights may differ; set {ACTOR}.merge=True (merged "
                        "weights are synced) or start the actor from model.path", key=f"{ACTOR}.merge")]
    return []


def lora_preflight_problems(cfg) -> list[Problem]:
    """The LoRA sections against the model: target names, expert-TP, adapter_path."""
    from megarl.models.locate import resolve_model_path
    from megarl.settings.engine import lora_settings
    from megarl.models.lora import selection

    problems: list[Problem] = []
    for prefix, role, lora in _sections(cfg):
        try:
            settings = lora_settings(cfg, role)
        except ValueError:
            continue  # reported by lora_problems
        if settings is None:
            continue
        path = cfg.actor_rollout_ref.model.path if role == "actor" else cfg.critic.model.path
        local = resolve_model_path(str(path))
        if local is None or not (Path(local) / "config.json").is_file():
            continue  # reported with the model
        try:
            chosen = selection(local, settings, role)
        except ValueError as exc:
            problems.append(Problem(f"{prefix}.target_modules / exclude_modules: {exc}", key=f"{prefix}.target_modules"))
            continue
        megatron = cfg.actor_rollout_ref.actor.megatron
        etp = megatron.expert_tensor_parallel_size or 1
        if etp > 1 and any(".experts." in name for name in chosen):
            problems.append(Problem(f"{prefix}: adapters on expert linears need actor_rollout_ref.actor.megatron."
                                    f"expert_tensor_parallel_size=1 (got {etp}); or exclude the experts "
                                    "(exclude_modules: ['*.experts.*'])", key=f"{prefix}.target_modules"))
        overrides = dict(megatron.override_transformer_config or {})
        section = cfg.critic.megatron if role == "critic" else megatron
        if dict(section.override_transformer_config or {}).get("moe_grouped_gemm") and \
                any(".experts." in name for name in chosen):
            owner = "critic" if role == "critic" else "actor_rollout_ref.actor"
            problems.append(Problem(f"{prefix}: adapters on expert linears need per-expert linears (SequentialMLP), "
                                    f"but {owner}.megatron.override_transformer_config.moe_grouped_gemm=True groups "
                                    "them; leave moe_grouped_gemm unset, or exclude the experts "
                                    "(exclude_modules: ['*.experts.*'])", key=f"{prefix}.target_modules"))
        rate = overrides.get("moe_router_bias_update_rate")
        if rate and _has_expert_bias(local):
            problems.append(Problem(f"actor_rollout_ref.actor.megatron.override_transformer_config."
                                    f"moe_router_bias_update_rate={rate} with LoRA: the base model is frozen, the "
                                    "router's expert bias included (megarl sets the rate to 0); drop the override",
                                    key=f"{prefix}.rank"))
        if lora.adapter_path:
            problems += _adapter_path_problems(f"{prefix}.adapter_path", lora.adapter_path, settings, local, role)
    return problems


def _has_expert_bias(model_path: str) -> bool:
    from megarl.models import model_dims

    dims = model_dims(model_path)
    return dims.moe is not None and dims.moe.expert_bias


def _adapter_path_problems(key: str, path: str, settings, model_path: str, role: str) -> list[Problem]:
    """A PEFT adapter directory of this rank and alpha that megarl's fused adapters represent exactly (its
    weights read here: what ``load_peft_adapter`` would refuse after the workers start), or a megarl LoRA checkpoint."""
    from megarl.engine.checkpoint import META_FILE, checkpoint_meta
    from megarl.models.lora.peft import ADAPTER_CONFIG, check_peft_config, peft_adapter_problems, read_peft_config

    folder = Path(path).expanduser()
    if not folder.is_dir():
        return [Problem(f"{key}={path}: no such directory (a PEFT adapter directory or a megarl LoRA checkpoint)", key=key)]
    try:
        if (folder / ADAPTER_CONFIG).is_file():
            check_peft_config(read_peft_config(folder), settings, str(folder))
            return [Problem(f"{key}: {message}", key=key) for message in peft_adapter_problems(folder, model_path, settings, role)]
        if (folder / META_FILE).is_file() or (folder / "latest").is_file():
            meta = checkpoint_meta(folder)
            saved = meta.get("lora")
            if meta.get("model_part") != "trainable" or not saved:
                return [Problem(f"{key}={path} is a megarl checkpoint without LoRA adapters", key=key)]
            differ = [f"{k}: {saved.get(k, 'lora' if k == 'type' else None)} vs {v}"
                      for k, v in (("rank", settings.rank), ("alpha", settings.alpha), ("type", settings.type))
                      if saved.get(k, "lora" if k == "type" else None) != v]
            if differ:
                return [Problem(f"{key}={path} was trained with other LoRA settings ({'; '.join(differ)}); set them to "
                                "the checkpoint's", key=key)]
            return []
    except (ValueError, FileNotFoundError, OSError) as exc:
        return [Problem(f"{key}: {exc}", key=key)]
    return [Problem(f"{key}={path} has neither {ADAPTER_CONFIG} (a PEFT adapter) nor {META_FILE} (a megarl "
                    "checkpoint)", key=key)]
