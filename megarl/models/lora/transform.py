"""``LoRATransform``: the model transform that puts adapters on a freshly built model.

    chunks = build_model(path, layout, "actor", transforms=[LoRATransform(settings)])

After the base weights are loaded, every parameter is frozen (a critic's value head stays
trainable: it is new; the embedding's output is marked as needing a gradient, so recomputed layers
still back-propagate into their adapters), and each selected linear of this rank (``settings``: targets, excludes)
gets ``lora_A`` / ``lora_B`` (``layers.attach``). Initial values are drawn in HF coordinates: A
from a generator seeded by the linear's global name, each HF projection's rows of B from one
seeded by that projection's PEFT name, then cut to this rank's shard by the adapter's pieces. So
every layout (TP, PP, EP) starts from the same adapters, and the TP=2 model equals the TP=1 one.

Init methods (``lora_A_init_method`` / ``lora_B_init_method``, verl's names): ``xavier`` (uniform,
bound sqrt(6 / (fan_in + fan_out))), ``kaiming`` / ``uniform`` (PEFT's default: kaiming-uniform
with a = sqrt(5), bound 1 / sqrt(fan_in)), ``normal`` (std 1 / rank, PEFT's "gaussian"), ``zero``
(B only; the default: the adapted model starts as the base model).
"""
from __future__ import annotations

import math
import zlib
from dataclasses import dataclass

import torch

from megarl.models.lora.layers import COLUMN, REPLICATED, ROW, adapted_linears, attach, placement_of
from megarl.models.lora.settings import LoRASettings
from megarl.models.lora.shards import AdapterSpec, adapter_specs, b_mask, selection

LAYERNORM_OUTPUT = "return_layernorm_output"


@dataclass
class LoRAReport:
    """What the transform did on this rank."""

    adapted: list[str]  # the linears (chunk-local names, per chunk) that got adapters
    adapter_elements: int
    frozen_elements: int


def _generator(seed: int, name: str) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(f"{seed}:{name}".encode()) + seed)


def _draw(method: str, shape: tuple[int, ...], fan_in: int, fan_out: int, rank: int, generator) -> torch.Tensor:
    if method == "zero":
        return torch.zeros(shape)
    if method == "normal":
        return torch.randn(shape, generator=generator) / rank
    bound = math.sqrt(6.0 / (fan_in + fan_out)) if method == "xavier" else 1.0 / math.sqrt(fan_in)
    return (torch.rand(shape, generator=generator) * 2 - 1) * bound


def initial_values(spec: AdapterSpec, settings: LoRASettings) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's initial (A, B) in fp32, the same values in HF coordinates under any layout."""
    r = settings.rank
    a_full = spec.a.pieces[0].hf_shape
    out_total = sum(piece.hf_shape[0] for piece in {p.hf_name: p for p in spec.b.pieces}.values())
    in_total = a_full[1]
    a = torch.empty(spec.a.local_shape)
    if settings.canonical:  # one A per projection, each seeded by its PEFT name (as its B)
        for piece in spec.a.pieces:
            full_a = _draw(settings.lora_A_init_method, a_full, in_total, r, r, _generator(settings.seed, piece.hf_name))
            a[piece.megatron_slice] = full_a[piece.hf_slice]
    else:  # one A shared by the projections of the linear
        full_a = _draw(settings.lora_A_init_method, a_full, in_total, r, r, _generator(settings.seed, spec.global_module))
        piece = spec.a.pieces[0]
        a[piece.megatron_slice] = full_a[piece.hf_slice]
    b = torch.zeros(spec.b.local_shape)
    drawn: dict[str, torch.Tensor] = {}
    for piece in spec.b.pieces:
        if piece.hf_name not in drawn:
            drawn[piece.hf_name] = _draw(settings.lora_B_init_method, piece.hf_shape, r, out_total, r,
                                         _generator(settings.seed, piece.hf_name))
        b[piece.megatron_slice] = drawn[piece.hf_name][piece.hf_slice]
    return a, b


class LoRATransform:
    """A ``build_model`` transform: LoRA adapters on the linears ``settings`` selects, base frozen."""

    def __init__(self, settings: LoRASettings):
        self.settings = settings
        self.report: LoRAReport | None = None

    def __call__(self, models: list, context) -> None:
        from megarl.models.grouped_experts import has_grouped_experts
        from megarl.models.loading import this_rank_shards, unwrap

        s = self.settings
        hf_config, layout, role, impl = context.hf_config, context.layout, context.role, context.transformer_impl
        chosen = selection(hf_config, s, role, impl)
        specs = adapter_specs(this_rank_shards(hf_config, layout, role, impl), chosen, s.rank, s.canonical)
        if layout.etp > 1 and any(spec.base.is_expert for spec in specs):
            raise ValueError(f"LoRA on expert linears needs expert_tensor_parallel_size=1 (got {layout.etp}); set "
                             "actor_rollout_ref.actor.megatron.expert_tensor_parallel_size=1, or exclude the experts "
                             "(exclude_modules: ['*.experts.*'])")
        chunks = [unwrap(model) for model in models]
        if any(spec.base.is_expert for spec in specs) and any(has_grouped_experts(chunk) for chunk in chunks):
            raise ValueError("LoRA on expert linears needs per-expert linears (SequentialMLP): leave "
                             "override_transformer_config.moe_grouped_gemm unset, or exclude the experts "
                             "(exclude_modules: ['*.experts.*'])")
        for chunk in chunks:
            for name, param in chunk.named_parameters():
                param.requires_grad_(role == "critic" and name.startswith("output_layer."))  # a new value head trains
        adapted = []
        for spec in specs:
            chunk = chunks[spec.base.vpp_chunk]
            module = chunk.get_submodule(spec.module)
            placement = placement_of(module)
            if placement.parallel != spec.parallel and placement.parallel != REPLICATED and spec.parallel != REPLICATED:
                raise ValueError(f"{spec.global_module}: the shard layout splits it as {spec.parallel}, the model's "
                                 f"{type(module).__name__} as {placement.parallel}")
            a, b = initial_values(spec, s)
            mask = b_mask(spec)
            weight = module.weight
            if mask is not None:
                b = b * mask
                mask = mask.to(dtype=weight.dtype, device=weight.device)
            if placement.layernorm_fused:
                setattr(module, LAYERNORM_OUTPUT, True)
            attach(module, placement, a.to(dtype=weight.dtype, device=weight.device),
                   b.to(dtype=weight.dtype, device=weight.device), mask, s.scale, s.dropout,
                   expert_split=spec.base.is_expert and spec.parallel in (COLUMN, ROW) and layout.etp > 1)
            module.lora_swiglu = spec.module.endswith("linear_fc1") and _is_gate_up(spec)
            adapted.append(spec.module)
        for chunk in chunks:
            embedding = getattr(chunk, "embedding", None)
            if embedding is not None:  # see _input_requires_grad
                embedding.register_forward_hook(_input_requires_grad)
        for index, chunk in enumerate(chunks):
            if not adapted_linears(chunk):
                raise ValueError(f"LoRA adapts no linear of model chunk {index} on this rank (pipeline stage layers "
                                 f"without a target); megatron's DDP needs trainable parameters in every chunk: widen "
                                 f"target_modules or narrow exclude_modules")
        elements = sum(p.numel() for c in chunks for p in c.parameters() if p.requires_grad)
        frozen = sum(p.numel() for c in chunks for p in c.parameters() if not p.requires_grad)
        self.report = LoRAReport(adapted, elements, frozen)


def _input_requires_grad(module, inputs, output):
    """The frozen embedding's output is marked as needing a gradient. Without it, activation recompute
    (megatron's reentrant checkpoint of whole layers) sees a layer input that needs none and skips the
    layer's backward: the adapters inside would get no gradient (HF's ``enable_input_require_grads``
    for PEFT does the same). Stages after the first receive inputs that need gradients already."""
    return output.requires_grad_(True) if torch.is_grad_enabled() and not output.requires_grad else output


def _is_gate_up(spec: AdapterSpec) -> bool:
    """A SwiGLU ``linear_fc1``: its rows are [gate; up] (megatron checkpoints store the halves apart)."""
    names = [p.hf_name for p in spec.base.pieces]
    return len(names) == 2 and names[0] != names[1]


def has_adapters(models) -> bool:
    from megarl.models.loading import unwrap

    return any(adapted_linears(unwrap(model)) for model in models)


def adapter_parameters(models) -> list[tuple[str, torch.nn.Parameter]]:
    """(chunk-local name, parameter) of every adapter tensor of ``models``, chunk by chunk."""
    from megarl.models.loading import unwrap

    out = []
    for model in models:
        for name, module in adapted_linears(unwrap(model)):
            out += [(f"{name}.lora_A", module.lora_A), (f"{name}.lora_B", module.lora_B)]
    return out
