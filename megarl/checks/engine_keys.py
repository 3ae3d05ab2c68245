"""verl's engine-side keys, checked before any process starts (``megarl.checks.rules.config_problems`` calls this).

Covers ``*.megatron.override_transformer_config`` and ``*.optim.override_optimizer_config``
(field names against megatron-core's dataclasses, fields megarl sets itself), the offload keys,
uneven pipeline stages and recompute against the model's layer count (when the HF config at
``model.path`` can be read: megatron-core's own ``TransformerConfig`` checks run on the model's
real dimensions), ``checkpoint.save_contents`` / ``load_contents``, checkpoint retention and
``actor_rollout_ref.nccl_timeout``. Returns one line per problem.
"""
from __future__ import annotations

import warnings
from pathlib import Path

from megarl.config.errors import refusal
from megarl.settings import plain

from megarl.engine.overrides import (LAYOUT_FIELDS, PIPELINE_SPLIT_FIELDS, RECOMPUTE_FIELDS, optimizer_override_problems,
                                     transformer_override_problems, transformer_overrides)
from megarl.trainer.checkpointing import contents_problems, retention_problems

ACTOR, REF = "actor_rollout_ref.actor", "actor_rollout_ref.ref"


def _plain(value) -> dict:
    return dict(plain(value) or {})


def _roles(cfg, with_critic: bool) -> list[tuple[str, object, object, object]]:
    """(section, megatron, optim or None, model) per model the workers build."""
    arr = cfg.actor_rollout_ref
    roles = [(ACTOR, arr.actor.megatron, arr.actor.optim, arr.model), (REF, arr.ref.megatron, None, arr.model)]
    if with_critic:
        roles.append(("critic", cfg.critic.megatron, cfg.critic.optim, cfg.critic.model))
    return roles


def engine_key_problems(cfg, with_critic: bool) -> list:
    problems: list = []  # str, or a config Problem (a refusal)
    add = problems.extend
    roles = _roles(cfg, with_critic)
    vpp = cfg.actor_rollout_ref.actor.megatron.virtual_pipeline_model_parallel_size
    derived = None
    model_config = Path(cfg.actor_rollout_ref.model.path) / "config.json"
    if model_config.is_file() and any(_plain(m.override_transformer_config) or model.enable_gradient_checkpointing
                                      for _, m, _, model in roles):
        try:
            derived, model_problems = _model_checks(cfg, roles)
            add(model_problems)
        except (OSError, ValueError, KeyError) as exc:
            problems.append(f"actor_rollout_ref.model.path: cannot read the model's config to check the megatron "
                            f"overrides: {exc}")
    actor_overrides = _plain(roles[0][1].override_transformer_config)
    actor_split = {k: v for k, v in actor_overrides.items() if k in PIPELINE_SPLIT_FIELDS}
    for section, megatron, optim, model in roles:
        key = f"{section}.megatron.override_transformer_config"
        overrides = _plain(megatron.override_transformer_config)
        if section != REF or overrides != actor_overrides:  # the reference inherits the actor's by default
            # a layout field repeated here with the engine key's own value (verl's Ascend launches) says nothing new
            repeated = {name for name, value in overrides.items() if name in LAYOUT_FIELDS
                        and value == megatron.get(LAYOUT_FIELDS[name].split(".", 1)[1])}
            add(transformer_override_problems({k: v for k, v in overrides.items() if k not in repeated}, key, derived,
                                              vpp, model.enable_gradient_checkpointing))
        split = {k: v for k, v in overrides.items() if k in PIPELINE_SPLIT_FIELDS}
        if split and split != actor_split:
            problems.append(f"{key}: pipeline stage sizes {split} differ from the actor's {actor_split or '(even)'}; "
                            "actor, reference and critic share one pipeline layout: set them on the actor only.")
        if optim is not None:
            add(optimizer_override_problems(_plain(optim.override_optimizer_config), section,
                                            megatron.use_distributed_optimizer))
    for name in ("grad_offload", "optimizer_offload"):
        if cfg.actor_rollout_ref.ref.megatron[name]:
            problems.append(f"{REF}.megatron.{name}=True: the reference has no gradients or optimizer state; "
                            "only param_offload applies to it.")
    add(contents_problems(ACTOR, cfg.actor_rollout_ref.actor.checkpoint))
    if with_critic:
        add(contents_problems("critic", cfg.critic.checkpoint))
    add(retention_problems(cfg.trainer))
    if cfg.actor_rollout_ref.nccl_timeout <= 0:
        problems.append(f"actor_rollout_ref.nccl_timeout={cfg.actor_rollout_ref.nccl_timeout}: a timeout in seconds, > 0.")
    return problems


def _unsupported_architecture(path: Path) -> bool:
    """config.json names an architecture no bridge family has (the model check refuses it)."""
    import json

    from megarl.models.families import supported_architectures

    try:
        architectures = json.loads((path / "config.json").read_text()).get("architectures") or []
    except (OSError, ValueError):
        return False
    return bool(architectures) and architectures[0] not in supported_architectures()


def _model_checks(cfg, roles) -> tuple[dict, list[str]]:
    """(the TransformerConfig fields the bridge derives for the model, problems found with its dims).

    Raises OSError / ValueError when the HF config cannot be read.
    """
    from megarl.models import load_hf_config, model_dims
    from megarl.models.config import transformer_config_kwargs
    from megarl.models.families import family_for
    from megarl.settings.engine import layout_from_config

    path = Path(cfg.actor_rollout_ref.model.path)
    try:
        hf_config = load_hf_config(path)
    except ValueError:
        if _unsupported_architecture(path):
            return {}, []  # transformers cannot read a model no bridge has: the pre-flight check refuses it
        raise
    try:
        family = family_for(hf_config)
    except ValueError:
        return {}, []  # no bridge for this architecture: the pre-flight check refuses it
    dims = model_dims(path)
    megatron = cfg.actor_rollout_ref.actor.megatron
    try:
        layout = layout_from_config(megatron, dims.num_layers)
        layout.stage_layer_counts(dims.num_layers)
    except ValueError as exc:
        return {}, [f"{ACTOR}.megatron.override_transformer_config: the pipeline stages of a {dims.num_layers}-layer "
                    f"model over pipeline_model_parallel_size={megatron.pipeline_model_parallel_size}: {exc}."]
    derived = transformer_config_kwargs(dims, family, layout)
    problems = []
    actor_overrides = _plain(megatron.override_transformer_config)
    for section, megatron_section, _, model in roles:
        if section == REF and _plain(megatron_section.override_transformer_config) == actor_overrides:
            continue  # inherited from the actor: checked there
        recompute = {k: v for k, v in transformer_overrides(_plain(megatron_section.override_transformer_config),
                                                            model.enable_gradient_checkpointing).items()
                     if k in RECOMPUTE_FIELDS}
        if recompute:
            problems += _megatron_refuses(derived, recompute, f"{section}.megatron.override_transformer_config",
                                          family.config_class)
        grouped = _plain(megatron_section.override_transformer_config).get("moe_grouped_gemm")
        if grouped and dims.is_moe and family.grouped_gemm_refusal is not None:
            problems.append(refusal(f"{section}.megatron.override_transformer_config.moe_grouped_gemm={grouped}",
                                    f"grouped-GEMM experts for {family.name}",
                                    f"{family.grouped_gemm_refusal}; leave moe_grouped_gemm unset (SequentialMLP)"))
    return derived, problems


def _megatron_refuses(derived: dict, fields: dict, key: str, config_class: str) -> list[str]:
    """megatron-core's own TransformerConfig checks of ``fields`` on the model's dimensions."""
    from megarl.models.config import build_transformer_config
    from megarl.platform import cpu_transformer_config_overrides

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            build_transformer_config(derived, cpu_transformer_config_overrides(), fields, config_class)
    except (ValueError, AssertionError, TypeError) as exc:
        return [f"{key} {fields}: megatron-core refuses it for this model: {exc}"]
    return []
