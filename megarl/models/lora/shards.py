"""Where every adapter tensor lives and which PEFT tensors it holds (pure functions of the shard layout).

An adapted linear of one rank has ``lora_A`` ``[rank, in_local]`` and ``lora_B`` ``[out_local,
rank]``, split over TP like the base weight:

* column-parallel base (split along the output, ``split_dim`` 0: ``linear_qkv``, ``linear_fc1``, MLA's
  up-projections): B is split along its rows exactly as the weight (a fused QKV shard's B rows are
  the q, k and v rows of its query groups), A is whole on every TP rank;
* row-parallel base (split along the input, ``split_dim`` 1: ``linear_proj``, ``linear_fc2``): A is
  split along its columns as the weight, B is whole;
* a replicated base: both whole.

Each adapter tensor is described as a ``ShardSpec`` whose pieces name PEFT tensors
(``base_model.model.model.layers.N.self_attn.q_proj.lora_B.weight``): a fused linear's B is made of
the B's of its HF projections, row range by row range, and its A *is* the A of each of them (one
piece per projection, all covering the whole local A); under ``canonical_lora`` each projection's A
is its own block of rows of the local A, and its B rows take the matching block of columns (the
rest of B is held at zero: ``b_mask``). The PEFT export, the adapter-only weight
update, loading ``adapter_path`` and the adapters' initialisation all read these pieces; the
pieces of a fused B are exactly the weight's pieces cut to ``rank`` columns, so the q/k/v (and
gate/up) split under GQA is the one the bridge is tested on.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from megarl.models.layout import ParallelLayout
from megarl.models.lora.settings import LinearParts, LoRASettings, is_decoder_linear, select
from megarl.models.shards import HFPiece, ShardSpec, param_shards

PEFT_PREFIX = "base_model.model."
COLUMN, ROW, REPLICATED = "column", "row", "replicated"


def peft_name(hf_module: str, matrix: str) -> str:
    """PEFT's tensor name of ``lora_A`` / ``lora_B`` of the HF module ``model.layers.0.self_attn.q_proj``."""
    return f"{PEFT_PREFIX}{hf_module}.{matrix}.weight"


def hf_module_of(hf_tensor: str) -> str:
    return hf_tensor.removesuffix(".weight")


@dataclass(frozen=True)
class AdapterSpec:
    """The adapter of one adapted linear on one rank."""

    base: ShardSpec  # the linear's weight on this rank
    parallel: str  # column | row | replicated (the base weight's split)
    hf_modules: tuple[str, ...]  # the HF projections adapted, in the linear's order
    a: ShardSpec  # lora_A, pieces named as PEFT tensors
    b: ShardSpec  # lora_B, likewise
    trained: bool  # False: some of B is held at zero (rows of projections not adapted, canonical_lora's off-diagonal blocks)

    @property
    def module(self) -> str:
        """The linear's name in its model chunk (stage-local layer, local expert)."""
        return self.base.name.removesuffix(".weight")

    @property
    def global_module(self) -> str:
        return self.base.global_name.removesuffix(".weight")


def linear_parts(specs: list[ShardSpec]) -> list[LinearParts]:
    """The decoder linears among ``specs`` (one entry per linear) and the HF projections of each."""
    seen: dict[str, list[str]] = {}
    for spec in specs:
        if is_decoder_linear(spec.global_name):
            modules = seen.setdefault(spec.global_name.removesuffix(".weight"), [])
            for piece in spec.pieces:
                if hf_module_of(piece.hf_name) not in modules:
                    modules.append(hf_module_of(piece.hf_name))
    return [LinearParts(name, tuple(modules)) for name, modules in seen.items()]


def selection(hf_config, settings: LoRASettings, role: str = "actor",
              transformer_impl: str = "local") -> dict[str, tuple[str, ...]]:
    """Global linear name -> adapted HF projections, for the whole model (independent of the layout)."""
    whole = param_shards(hf_config, ParallelLayout(), role, transformer_impl)
    return select(linear_parts(whole), settings)


def _whole(shape: tuple[int, ...]) -> tuple[slice, ...]:
    return tuple(slice(0, n) for n in shape)


def adapter_spec(base: ShardSpec, hf_modules: tuple[str, ...], rank: int, canonical: bool = False) -> AdapterSpec:
    """The adapter tensors of the linear ``base`` adapting the HF projections ``hf_modules``; ``canonical``:
    each projection of a fused linear has its own A (rows ``j*rank:(j+1)*rank`` of the local A) and its B
    rows use only those columns."""
    out_local, in_local = base.local_shape
    parallel = {0: COLUMN, 1: ROW, None: REPLICATED}[base.split_dim]
    split_rank = base.etp_rank if base.is_expert else base.tp_rank
    whole_primary = base.primary and (parallel == REPLICATED or split_rank == 0)
    chosen = [p for p in base.pieces if hf_module_of(p.hf_name) in hf_modules]
    local_a, local_b = (rank, in_local), (out_local, rank)
    if parallel == ROW:
        if len(base.pieces) != 1:
            raise ValueError(f"{base.global_name}: a row-parallel linear made of {len(base.pieces)} HF tensors")
        (piece,) = base.pieces
        module = hf_module_of(piece.hf_name)
        a_pieces = [HFPiece(peft_name(module, "lora_A"), (rank, piece.hf_shape[1]),
                            (slice(0, rank), piece.hf_slice[1]), (slice(0, rank), piece.megatron_slice[1]))]
        b_pieces = [HFPiece(peft_name(module, "lora_B"), (piece.hf_shape[0], rank), _whole(local_b), _whole(local_b))]
        a_split, a_primary, b_split, b_primary = 1, base.primary, None, whole_primary
    else:
        modules = list(dict.fromkeys(hf_module_of(p.hf_name) for p in chosen))
        in_total = base.pieces[0].hf_shape[1]
        block = {m: slice(j * rank, (j + 1) * rank) if canonical else slice(0, rank) for j, m in enumerate(modules)}
        if canonical:
            local_a, local_b = (rank * len(modules), in_local), (out_local, rank * len(modules))
        a_pieces = [HFPiece(peft_name(m, "lora_A"), (rank, in_total), (slice(0, rank), slice(0, in_total)),
                            (block[m], slice(0, in_local))) for m in modules]
        b_pieces = [HFPiece(peft_name(hf_module_of(p.hf_name), "lora_B"), (p.hf_shape[0], rank),
                            (p.hf_slice[0], slice(0, rank)), (p.megatron_slice[0], block[hf_module_of(p.hf_name)]))
                    for p in chosen]
        a_split, a_primary = None, whole_primary
        b_split, b_primary = (0, base.primary) if parallel == COLUMN else (None, whole_primary)
    module_local, module_global = base.name.removesuffix(".weight"), base.global_name.removesuffix(".weight")

    def tensor(matrix: str, shape, split, primary, pieces) -> ShardSpec:
        return replace(base, name=f"{module_local}.{matrix}", global_name=f"{module_global}.{matrix}",
                       local_shape=shape, split_dim=split, primary=primary, pieces=tuple(pieces), padding=None)

    trained = len(chosen) == len(base.pieces) and (len(a_pieces) == 1 or not canonical)
    return AdapterSpec(base, parallel, tuple(hf_modules), tensor("lora_A", local_a, a_split, a_primary, a_pieces),
                       tensor("lora_B", local_b, b_split, b_primary, b_pieces), trained)


def adapter_specs(base_specs: list[ShardSpec], chosen: dict[str, tuple[str, ...]], rank: int,
                  canonical: bool = False) -> list[AdapterSpec]:
    """The adapters among ``base_specs`` (any set of ranks' specs) for a ``selection``."""
    return [adapter_spec(spec, chosen[spec.global_name.removesuffix(".weight")], rank, canonical) for spec in base_specs
            if is_decoder_linear(spec.global_name) and spec.global_name.removesuffix(".weight") in chosen]


def lora_shards(hf_config, layout: ParallelLayout, settings: LoRASettings, role: str = "actor",
                transformer_impl: str = "local") -> list[AdapterSpec]:
    """Every adapter of one model replica under ``layout`` (all PP stages, TP, EP and expert-TP ranks)."""
    chosen = selection(hf_config, settings, role, transformer_impl)
    return adapter_specs(param_shards(hf_config, layout, role, transformer_impl), chosen, settings.rank,
                         settings.canonical)


def b_mask(spec: AdapterSpec):
    """``[out_local, local rank]`` ones where B trains (its pieces), or None when all of it does."""
    import torch

    if spec.trained:
        return None
    mask = torch.zeros(spec.b.local_shape)
    for piece in spec.b.pieces:
        mask[piece.megatron_slice] = 1.0
    return mask


def lora_parameter_count(hf_config, settings: LoRASettings, role: str = "actor") -> int:
    """Elements of the adapter tensors of the whole model (each counted once, whatever the layout):
    ``rank * (in + out)`` per adapted linear (a fused linear counts once, its held-at-zero B rows included;
    canonical_lora: ``k * rank`` for a fused linear of ``k`` adapted projections)."""
    total = 0
    for spec in lora_shards(hf_config, ParallelLayout(), settings, role):
        for tensor in (spec.a, spec.b):
            total += tensor.local_shape[0] * tensor.local_shape[1]
    return total
