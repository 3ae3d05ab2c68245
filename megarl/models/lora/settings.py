"""What a LoRA run asks for, and which parts of which linear layers that selects (pure functions).

``LoRASettings`` carries verl's keys (``actor_rollout_ref.model.lora.*``): rank, alpha, dropout,
the init methods of A and B, ``target_modules`` and ``exclude_modules``.

Target names. A megatron-core linear of a decoder layer (``linear_qkv``, ``linear_proj``,
``linear_fc1``, ``linear_fc2``, MLA's ``linear_q_proj`` / ``linear_q_down_proj`` /
``linear_q_up_proj`` / ``linear_kv_down_proj`` / ``linear_kv_up_proj``, and the same names inside
experts and shared experts) is made of one or more HF projections (``linear_qkv`` = q_proj, k_proj
and v_proj fused per query group; ``linear_fc1`` = gate_proj and up_proj). A target is

* a megatron name (``linear_qkv``): the whole linear, every layer (experts too);
* an HF name (``q_proj``, ``gate_proj``, ``o_proj``, Mixtral's ``w1``, MLA's ``kv_b_proj``, ...): that
  projection. On a fused linear whose other projections are not targeted (``q_proj`` and ``v_proj``
  without ``k_proj``) the fused linear gets one adapter whose B rows of the other projections are
  held at zero, so exactly the named projections change (PEFT's semantics for the update). With
  ``type=lora`` the projections of one fused linear share one A (Megatron-Bridge's fused LoRA);
  with ``type=canonical_lora`` each has its own A and B of rank ``rank``, as PEFT and Bridge's
  canonical LoRA train them: the fused linear holds them as one adapter of rank ``k * rank`` (``k``
  projections: A stacked, B block-diagonal, the blocks off the diagonal held at zero), the same
  function at the same cost;
* ``all-linear``: every linear of every decoder layer (PEFT's meaning: not the output layer);
* a pattern with ``*`` / ``?`` / ``[`` or a dot: matched (``fnmatch``) against the linear's full
  megatron name with global layer numbers, e.g. ``decoder.layers.1?.self_attention.linear_qkv``.

``exclude_modules`` takes the same forms and removes what they name (an HF name removes that
projection of a fused linear). A name that matches nothing in the model is an error, as is a
selection that adapts nothing.
"""
from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass

LORA_TYPES = ("lora", "canonical_lora")
INIT_METHODS_A = ("xavier", "kaiming", "uniform", "normal")
INIT_METHODS_B = ("zero", "xavier", "kaiming", "uniform", "normal")
DROPOUT_POSITIONS = ("pre",)
ALL_LINEAR = "all-linear"
# The megatron-core linears of a decoder layer (local and Transformer Engine specs use the same names).
MEGATRON_LINEARS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2", "linear_q_proj", "linear_q_down_proj",
                    "linear_q_up_proj", "linear_kv_down_proj", "linear_kv_up_proj")
_LAYER = re.compile(r"^decoder\.layers\.\d+\.")


@dataclass(frozen=True)
class LoRASettings:
    """One model's LoRA: ``scale = alpha / rank`` multiplies ``B @ A``."""

    rank: int
    alpha: float = 32.0
    dropout: float = 0.0
    target_modules: tuple[str, ...] = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
    exclude_modules: tuple[str, ...] = ()
    lora_A_init_method: str = "xavier"
    lora_B_init_method: str = "zero"
    seed: int = 42  # the adapters' initialisation (every rank draws the same values in HF coordinates)
    type: str = "lora"  # canonical_lora: each HF projection of a fused linear has its own A (PEFT's, Bridge's)

    @property
    def canonical(self) -> bool:
        return self.type == "canonical_lora"

    def __post_init__(self) -> None:
        object.__setattr__(self, "target_modules", _names(self.target_modules))
        object.__setattr__(self, "exclude_modules", _names(self.exclude_modules))
        problems = settings_problems(self)
        if problems:
            raise ValueError("; ".join(problems))

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    def to_dict(self) -> dict:
        return {"rank": self.rank, "alpha": self.alpha, "dropout": self.dropout,
                "target_modules": list(self.target_modules), "exclude_modules": list(self.exclude_modules),
                "lora_A_init_method": self.lora_A_init_method, "lora_B_init_method": self.lora_B_init_method,
                "seed": self.seed, "type": self.type}

    @classmethod
    def from_dict(cls, values: dict) -> "LoRASettings":
        return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in values.items()})


def _names(value) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):  # verl's FSDP form: target_modules: all-linear
        return (value,)
    return tuple(str(v) for v in value)


def settings_problems(s: LoRASettings, prefix: str = "lora") -> list[str]:
    """Value problems of one settings object, each naming the key (``<prefix>.<key>``) and the fix."""
    problems = []
    if not isinstance(s.rank, int) or s.rank < 1:
        problems.append(f"{prefix}.rank={s.rank!r}: a LoRA rank is an integer >= 1")
    if not s.alpha > 0:
        problems.append(f"{prefix}.alpha={s.alpha!r}: must be > 0 (the update is scaled by alpha / rank)")
    if not 0.0 <= s.dropout < 1.0:
        problems.append(f"{prefix}.dropout={s.dropout!r}: a probability in [0, 1)")
    if s.type not in LORA_TYPES:
        problems.append(f"{prefix}.type={s.type!r}: use one of {list(LORA_TYPES)}")
    if s.lora_A_init_method not in INIT_METHODS_A:
        problems.append(f"{prefix}.lora_A_init_method={s.lora_A_init_method!r}: use one of {list(INIT_METHODS_A)}")
    if s.lora_B_init_method not in INIT_METHODS_B:
        problems.append(f"{prefix}.lora_B_init_method={s.lora_B_init_method!r}: use one of {list(INIT_METHODS_B)}")
    if not s.target_modules:
        problems.append(f"{prefix}.target_modules is empty: name the linears to adapt, e.g. [linear_qkv, linear_proj, "
                        f"linear_fc1, linear_fc2] or all-linear")
    if ALL_LINEAR in s.exclude_modules:
        problems.append(f"{prefix}.exclude_modules contains {ALL_LINEAR}: that excludes everything")
    return problems


# ---------------------------------------------------------------------------- selection


@dataclass(frozen=True)
class LinearParts:
    """One megatron linear of one layer: its full megatron name (global layer number) and the HF
    projections it is made of (``model.layers.3.self_attn.q_proj`` ...), in the fused order."""

    name: str
    hf_modules: tuple[str, ...]

    @property
    def megatron_short(self) -> str:
        return self.name.rsplit(".", 1)[-1]


def hf_short(hf_module: str) -> str:
    return hf_module.rsplit(".", 1)[-1]


def _is_pattern(name: str) -> bool:
    return any(c in name for c in "*?[.")


def _named_parts(name: str, linear: LinearParts) -> set[str] | None:
    """The HF projections of ``linear`` that the target/exclude entry ``name`` names (None: none)."""
    if name == ALL_LINEAR or name == linear.megatron_short:
        return set(linear.hf_modules)
    if _is_pattern(name):
        return set(linear.hf_modules) if fnmatch.fnmatchcase(linear.name, name) else None
    named = {m for m in linear.hf_modules if hf_short(m) == name}
    return named or None


def select(linears: list[LinearParts], settings: LoRASettings) -> dict[str, tuple[str, ...]]:
    """Linear name -> the HF projections to adapt (in the linear's order), for the linears adapted.

    Raises a ValueError naming every target / exclude entry that matches no linear of the model,
    and when nothing is adapted.
    """
    used: set[str] = set()
    chosen: dict[str, tuple[str, ...]] = {}
    for linear in linears:
        parts: set[str] = set()
        for name in settings.target_modules:
            named = _named_parts(name, linear)
            if named:
                used.add(name)
                parts |= named
        for name in settings.exclude_modules:
            named = _named_parts(name, linear)
            if named:
                used.add(name)
                parts -= named
        if parts:
            chosen[linear.name] = tuple(m for m in linear.hf_modules if m in parts)
    unknown = [n for n in (*settings.target_modules, *settings.exclude_modules) if n not in used]
    if unknown:
        megatron = sorted({l.megatron_short for l in linears})
        hf = sorted({hf_short(m) for l in linears for m in l.hf_modules})
        raise ValueError(f"LoRA target/exclude names {unknown} match no linear of this model; its linears are "
                         f"{megatron} (megatron names) or {hf} (HF names), or use {ALL_LINEAR} or a pattern on "
                         f"names like {linears[0].name if linears else 'decoder.layers.0.self_attention.linear_qkv'}")
    if not chosen:
        raise ValueError(f"LoRA adapts no linear: target_modules={list(settings.target_modules)} minus "
                         f"exclude_modules={list(settings.exclude_modules)} leaves nothing")
    return chosen


def is_decoder_linear(megatron_param: str) -> bool:
    """Whether a global megatron parameter name is the weight of a decoder layer's linear."""
    if not _LAYER.match(megatron_param) or not megatron_param.endswith(".weight"):
        return False
    return megatron_param[: -len(".weight")].rsplit(".", 1)[-1] in MEGATRON_LINEARS
