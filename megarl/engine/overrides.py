"""verl's ``override_transformer_config`` / ``override_optimizer_config`` onto megatron-core's configs.

``megatron.override_transformer_config.<field>`` (actor; the reference inherits the actor's; the
critic has its own) sets a field of megatron-core's ``TransformerConfig`` and
``optim.override_optimizer_config.<field>`` one of its ``OptimizerConfig``, as in verl. Before
any process starts every name is checked against the installed dataclasses (an unknown one is an
error naming the closest fields), and fields megarl sets itself are refused with the key that
sets them:

* parallel sizes and sequence parallelism: ``megatron.*_parallel_size``, ``megatron.sequence_parallel``;
* dtypes: the platform (bf16 on GPU, fp32 on CPU);
* the architecture (layers, widths, heads, norms, MoE routing...): the HF config at ``model.path``;
* optimizer hyper-parameters: ``optim.lr``, ``optim.betas``, ``optim.weight_decay``, ... .

Rules megarl applies on top:

* recompute: ``recompute_granularity`` (full | selective), ``recompute_method`` (uniform | block),
  ``recompute_num_layers``, ``recompute_modules`` go to megatron unchanged.
  ``model.enable_gradient_checkpointing=True`` is a shorthand for full recompute of every layer
  (granularity full, method uniform, 1 layer per unit); when ``recompute_granularity`` is given
  in ``override_transformer_config`` that wins and the shorthand is ignored (logged).
* uneven pipeline stages: ``num_layers_in_first_pipeline_stage`` /
  ``num_layers_in_last_pipeline_stage`` become the ``ParallelLayout``'s first/last stage sizes, so
  the model, the shard layout (weight sync, conversion) and checkpoints agree.
  ``account_for_embedding_in_pipeline_split`` / ``account_for_loss_in_pipeline_split`` (count
  the embedding / the loss as one layer when splitting) are translated into the same two sizes:
  with ``L`` layers over ``pp`` stages, every stage gets ``(L + e + l) / pp`` slots and the
  first (last) stage gives one of its slots to the embedding (loss). With a virtual pipeline
  that gives chunks of different sizes within a stage, which megarl's layout does not model:
  refused there, in favour of the explicit first/last sizes.
* on a machine without CUDA the platform's CPU flags (fusions off, CPU initialisation) win over
  an override of the same field, with one log line: the fused kernels need CUDA.
"""
from __future__ import annotations

import dataclasses
import difflib
import enum
import logging
import typing
import warnings
from typing import Any, Collection, Mapping

import torch

from megarl.config.errors import refusal
from megarl.engine.source_fields import field_names

logger = logging.getLogger(__name__)

LAYOUT_FIELDS = {
    "tensor_model_parallel_size": "megatron.tensor_model_parallel_size",
    "pipeline_model_parallel_size": "megatron.pipeline_model_parallel_size",
    "virtual_pipeline_model_parallel_size": "megatron.virtual_pipeline_model_parallel_size",
    "context_parallel_size": "megatron.context_parallel_size",
    "sequence_parallel": "megatron.sequence_parallel",
    "expert_model_parallel_size": "megatron.expert_model_parallel_size",
    "expert_tensor_parallel_size": "megatron.expert_tensor_parallel_size",
}
DTYPE_FIELDS = ("params_dtype", "pipeline_dtype", "bf16", "fp16")
VOCAB_FIELDS = ("vocab_size", "padded_vocab_size", "make_vocab_size_divisible_by")  # GPTModel arguments, not fields
# field -> (the one value accepted, why others are refused)
REFUSED_TRANSFORMER_FIELDS = {
    "pipeline_model_parallel_layout": (None, "set num_layers_in_first_pipeline_stage / num_layers_in_last_pipeline_stage instead"),
    "perform_initialization": (None, "megarl initialises exactly the models it does not load from a checkpoint"),
    "use_cpu_initialization": (None, "set by the platform (True on CPU machines)"),
}
# Fields the bridge derives from the HF config that are training choices, not the architecture
# (``moe_grouped_gemm``: the experts' module, megarl.models.grouped_experts).
TRAINING_FIELDS = {"hidden_dropout", "attention_dropout", "attention_softmax_in_fp32", "init_method_std",
                   "moe_router_load_balancing_type", "moe_aux_loss_coeff", "moe_token_dispatcher_type",
                   "moe_grouped_gemm"}
PIPELINE_SPLIT_FIELDS = ("num_layers_in_first_pipeline_stage", "num_layers_in_last_pipeline_stage",
                         "account_for_embedding_in_pipeline_split", "account_for_loss_in_pipeline_split")
RECOMPUTE_FIELDS = ("recompute_granularity", "recompute_method", "recompute_num_layers", "recompute_modules")
# OptimizerConfig field -> the key (relative to the role's section) that sets it
OPTIMIZER_FIELDS_SET_BY_KEYS = {
    "optimizer": "optim.optimizer", "lr": "optim.lr", "min_lr": "optim.min_lr (or optim.min_lr_ratio)",
    "weight_decay": "optim.weight_decay", "adam_beta1": "optim.betas", "adam_beta2": "optim.betas",
    "adam_eps": "optim.eps", "clip_grad": "grad_clip (or optim.clip_grad)",
    "use_distributed_optimizer": "megatron.use_distributed_optimizer",
}
OPTIMIZER_FIELDS_SET_BY_MEGARL = {"bf16": "the platform sets the dtype (bf16 on GPU, fp32 on CPU)",
                                  "fp16": "the platform sets the dtype", "params_dtype": "the platform sets the dtype",
                                  "timers": "megarl times its own phases"}
_DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
           "fp16": torch.float16, "float16": torch.float16, "fp8": torch.uint8, "uint8": torch.uint8}


def _quietly_import(module: str, *names: str) -> list:
    """megatron-core warns on import that Transformer Engine / apex are missing; the controller does not care."""
    import importlib

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loaded = importlib.import_module(module)
    return [getattr(loaded, name) for name in names]


# (module, classes): the TransformerConfig classes the bridge may build (MLA models use the MLA
# subclass), and megatron's OptimizerConfig
_TRANSFORMER_CONFIGS = ("megatron.core.transformer.transformer_config", ("TransformerConfig", "MLATransformerConfig"))
_OPTIMIZER_CONFIGS = ("megatron.core.optimizer.optimizer_config", ("OptimizerConfig",))


def transformer_config_classes() -> list[type]:
    """The TransformerConfig classes the bridge may build, imported."""
    module, classes = _TRANSFORMER_CONFIGS
    return _quietly_import(module, *classes)


def optimizer_config_class() -> type:
    module, classes = _OPTIMIZER_CONFIGS
    return _quietly_import(module, *classes)[0]


def _field_names(module: str, classes: tuple[str, ...]) -> set[str]:
    """The classes' field names, read from source (no megatron-core import) or, failing that, imported."""
    names: set[str] = set()
    for cls in classes:
        found = field_names(module, cls)
        if found is None:
            return set(_fields(_quietly_import(module, *classes)))
        names |= found
    return names


def _fields(classes: list[type]) -> dict[str, Any]:
    hints: dict[str, Any] = {}
    for cls in classes:
        names = {f.name for f in dataclasses.fields(cls)}
        hints.update({k: v for k, v in typing.get_type_hints(cls).items() if k in names})
    return hints


# override_transformer_config fields of other Megatron builds that verl's 2026 launches set: refused by what
# they belong to (only while the installed megatron-core lacks them), not reported as misspellings
_MINDSPEED = ("MindSpeed's (Ascend NPU) TransformerConfig options",
              "megarl runs megatron-core on CUDA GPUs (or CPU), where these fused kernels and flags do not exist: "
              "drop them")
_DEEPSEEK_V4 = ("DeepSeek-V4's sparse-attention kernels and mHC (a newer megatron-core)",
                "megarl's megatron-core has no DeepSeek-V4 layers, and DeepseekV4ForCausalLM has no bridge family")
FOREIGN_FIELDS = {**{name: _MINDSPEED for name in (
    "use_flash_attn", "use_fused_rmsnorm", "swiglu", "use_fused_swiglu", "use_naive_l2norm",
    "use_distributed_optimizer", "context_parallel_algo", "use_fused_rotary_pos_emb", "use_fused_ring_attention_update")},
                  **{name: _DEEPSEEK_V4 for name in ("apply_dsa_kernel_fusion", "use_fused_mhc")}}


def _unknown(name: str, known: Collection[str], key: str, what: str) -> str:
    close = difflib.get_close_matches(name, sorted(known), n=3, cutoff=0.6)
    hint = f"; closest: {', '.join(close)}" if close else ""
    return f"{key}.{name}: megatron-core's {what} has no such field{hint}."


# ------------------------------------------------------------------ checks before any process starts
def transformer_override_problems(overrides: Mapping[str, Any], key: str, derived: Mapping[str, Any] | None = None,
                                  vpp: int | None = None, gradient_checkpointing: bool = False) -> list:
    """Problems with one ``override_transformer_config`` (``key`` is its full config key).

    ``derived``: the fields the bridge derives for the configured model (when its HF config can be
    read), so overriding the architecture is refused by name. ``gradient_checkpointing``: the
    role's ``model.enable_gradient_checkpointing``.
    """
    if not overrides:
        return []
    known = _field_names(*_TRANSFORMER_CONFIGS)
    problems = []
    for name, value in overrides.items():
        if name in VOCAB_FIELDS:
            problems.append(f"{key}.{name}: the vocabulary comes from the HF config at actor_rollout_ref.model.path; "
                            "its padding is set by actor_rollout_ref.actor.megatron.make_vocab_size_divisible_by.")
        elif name not in known and name in FOREIGN_FIELDS:
            feature, instead = FOREIGN_FIELDS[name]
            problems.append(refusal(f"{key}.{name}={value}", feature, instead))
        elif name not in known:
            problems.append(_unknown(name, known, key, "TransformerConfig"))
        elif name in LAYOUT_FIELDS:
            problems.append(f"{key}.{name}: set it with {key.rsplit('.', 1)[0]}.{LAYOUT_FIELDS[name].split('.', 1)[1]}.")
        elif name in DTYPE_FIELDS:
            problems.append(f"{key}.{name}: the dtype is set by the platform (bf16 on GPU, fp32 on CPU).")
        elif name == "pipeline_model_parallel_layout" and value is not None:
            problems.append(refusal(f"{key}.{name}={value}", "pipeline layouts by layer-type string "
                                    "(pipeline_model_parallel_layout)", REFUSED_TRANSFORMER_FIELDS[name][1]))
        elif name in REFUSED_TRANSFORMER_FIELDS and value not in (None, REFUSED_TRANSFORMER_FIELDS[name][0]):
            problems.append(f"{key}.{name}={value}: {REFUSED_TRANSFORMER_FIELDS[name][1]}.")
        elif derived is not None and name in derived and name not in TRAINING_FIELDS and value is not None \
                and value != derived[name]:
            problems.append(f"{key}.{name}={value}: the architecture comes from the HF config at "
                            f"actor_rollout_ref.model.path (it gives {derived[name]!r}); change the model's config.json.")
    orphans = [n for n in ("recompute_method", "recompute_num_layers") if overrides.get(n) is not None]
    if orphans and overrides.get("recompute_granularity") is None and not gradient_checkpointing:
        problems.append(f"{key}: {', '.join(orphans)} without recompute_granularity recomputes nothing (megatron "
                        "ignores them); set recompute_granularity=full (or model.enable_gradient_checkpointing=True).")
    accounted = [n for n in PIPELINE_SPLIT_FIELDS[2:] if overrides.get(n)]
    explicit = [n for n in PIPELINE_SPLIT_FIELDS[:2] if overrides.get(n) is not None]
    if accounted and explicit:
        problems.append(f"{key}: {', '.join(accounted)} cannot be combined with {', '.join(explicit)} "
                        "(megatron-core refuses it too); give the first/last stage sizes only.")
    elif accounted and (vpp or 1) > 1:
        problems.append(f"{key}: {', '.join(accounted)} with a virtual pipeline gives chunks of different sizes within "
                        "a stage, which megarl's layout does not model; set num_layers_in_first_pipeline_stage / "
                        "num_layers_in_last_pipeline_stage instead.")
    return problems


def optimizer_override_problems(overrides: Mapping[str, Any], section: str, use_distributed_optimizer: bool) -> list[str]:
    """Problems with ``<section>.optim.override_optimizer_config`` (``section``: e.g. ``critic``)."""
    if not overrides:
        return []
    key = f"{section}.optim.override_optimizer_config"
    known = _field_names(*_OPTIMIZER_CONFIGS)
    problems = []
    for name in overrides:
        if name not in known:
            problems.append(_unknown(name, known, key, "OptimizerConfig"))
        elif name in OPTIMIZER_FIELDS_SET_BY_KEYS:
            problems.append(f"{key}.{name}: set it with {section}.{OPTIMIZER_FIELDS_SET_BY_KEYS[name]}.")
        elif name in OPTIMIZER_FIELDS_SET_BY_MEGARL:
            problems.append(f"{key}.{name}: {OPTIMIZER_FIELDS_SET_BY_MEGARL[name]}.")
    if overrides.get("optimizer_cpu_offload"):
        if not overrides.get("use_precision_aware_optimizer"):
            problems.append(f"{key}.optimizer_cpu_offload=True needs {key}.use_precision_aware_optimizer=True "
                            "(megatron-core's hybrid CPU optimizer cannot step views of the weights otherwise).")
        if not use_distributed_optimizer:
            problems.append(f"{key}.optimizer_cpu_offload=True needs {section}.megatron.use_distributed_optimizer=True.")
    fraction = overrides.get("optimizer_offload_fraction")
    if fraction is not None and not 0.0 <= float(fraction) <= 1.0:
        problems.append(f"{key}.optimizer_offload_fraction={fraction}: must be in [0, 1].")
    return problems


# ------------------------------------------------------------------ what the workers apply
def _convert(value: Any, hint: Any) -> Any:
    """A YAML value as the dataclass field's type: enum members by name, torch dtypes by name."""
    options = typing.get_args(hint) or (hint,)
    if isinstance(value, str):
        for option in options:
            if isinstance(option, type) and issubclass(option, enum.Enum):
                return option[value]
            if option is torch.dtype:
                return _DTYPES[value.removeprefix("torch.")]
    return value


def transformer_overrides(overrides: Mapping[str, Any] | None, enable_gradient_checkpointing: bool = False,
                          typed: bool = True) -> dict:
    """The TransformerConfig fields a role's model is built with: the overrides without unset (None)
    values and without the pipeline-split fields (the layout carries those), converted to the
    fields' types (``typed``: the workers; the planner reads the values as given and so does not
    import megatron-core), plus the ``enable_gradient_checkpointing`` shorthand (see the module doc)."""
    hints = _fields(transformer_config_classes()) if overrides and typed else {}
    result = {name: _convert(value, hints.get(name)) for name, value in (overrides or {}).items()
              if value is not None and name not in PIPELINE_SPLIT_FIELDS}
    if enable_gradient_checkpointing:
        if result.get("recompute_granularity"):
            logger.info("override_transformer_config.recompute_granularity=%s wins over "
                        "model.enable_gradient_checkpointing", result["recompute_granularity"])
        else:  # the shorthand's method and unit size unless given
            result["recompute_granularity"] = "full"
            result.setdefault("recompute_method", "uniform")
            result.setdefault("recompute_num_layers", 1)
    if result.get("recompute_granularity") is None:
        for name in RECOMPUTE_FIELDS:  # verl's defaults list recompute_modules even without recompute
            result.pop(name, None)
    return result


def optimizer_overrides(overrides: Mapping[str, Any] | None) -> dict:
    """The OptimizerConfig fields given in ``optim.override_optimizer_config``, typed."""
    if not overrides:
        return {}
    hints = _fields([optimizer_config_class()])
    return {name: _convert(value, hints.get(name)) for name, value in overrides.items() if value is not None}


def pipeline_stage_layers(overrides: Mapping[str, Any] | None, num_layers: int, pp: int,
                          vpp: int = 1) -> tuple[int | None, int | None]:
    """(first, last) pipeline-stage layer counts for ``ParallelLayout`` (None: even split)."""
    overrides = overrides or {}
    first = overrides.get("num_layers_in_first_pipeline_stage")
    last = overrides.get("num_layers_in_last_pipeline_stage")
    embedding = bool(overrides.get("account_for_embedding_in_pipeline_split"))
    loss = bool(overrides.get("account_for_loss_in_pipeline_split"))
    if not (embedding or loss):
        return first, last  # ParallelLayout checks them (pp >= 2, the sum, vpp multiples)
    if pp < 2:
        return None, None  # one stage holds the embedding, every layer and the loss anyway
    if vpp > 1 or first is not None or last is not None:
        raise ValueError("account_for_embedding/loss_in_pipeline_split cannot be combined with a virtual pipeline "
                         "or explicit first/last stage sizes")
    slots = num_layers + embedding + loss
    if slots % pp:
        raise ValueError(f"{num_layers} layers + {int(embedding)} (embedding) + {int(loss)} (loss) = {slots} do not "
                         f"split evenly over pipeline_model_parallel_size={pp}; change pp or set "
                         "num_layers_in_first/last_pipeline_stage")
    per_stage = slots // pp
    return (per_stage - 1 if embedding else None), (per_stage - 1 if loss else None)


def without_cpu_conflicts(overrides: dict, platform_flags: Mapping[str, Any], role: str, log: bool = True) -> dict:
    """The overrides minus fields the platform must set on this machine (CPU flags), logged when ``log``."""
    dropped = {k: v for k, v in overrides.items() if k in platform_flags and v != platform_flags[k]}
    if dropped and log:
        logger.info("%s: override_transformer_config %s ignored on this machine without CUDA (the fused kernels "
                    "need it); they apply on GPU", role, ", ".join(f"{k}={v}" for k, v in sorted(dropped.items())))
    return {k: v for k, v in overrides.items() if k not in dropped}
