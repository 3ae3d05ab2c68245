"""The parallel layout of one model replica: TP, PP (with virtual chunks), CP, EP and expert-TP.

Pure arithmetic, no processes: which decoder layers a pipeline stage (and virtual chunk) holds,
which experts an expert-parallel rank holds, and where a global rank sits in megatron-core's
process grid. The weight-sync planner and the conversion tools use these to reason about ranks
they are not running on.

The rules reproduce megatron-core 0.16.1 (``get_transformer_layer_offset``,
``get_num_layers_to_build``, ``RankGenerator`` with the default order ``tp-cp-ep-dp-pp``);
``tests/models/test_layout.py`` checks them against megatron's own functions.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ParallelLayout:
    """How one model replica is split over ranks.

    tp:  tensor parallel size (attention, dense MLP, embeddings, output layer).
    pp:  pipeline parallel stages.
    ep:  expert parallel size; experts are split over EP ranks (MoE only).
    etp: expert tensor parallel size; each expert's weights are split over ETP ranks.
    vpp: model chunks per pipeline stage (1 = no interleaving; megatron's virtual pipeline size).
    cp:  context parallel size: each sequence is split over CP ranks, which hold replicas of every
        weight (like data-parallel ranks: the shard layout, sync and checkpoints ignore it).
    sequence_parallel: megatron's sequence parallelism inside TP; changes activations only, never
        the shard layout of the weights.
    first_stage_layers / last_stage_layers: uneven pipelines, as megatron's
        ``num_layers_in_first_pipeline_stage`` / ``num_layers_in_last_pipeline_stage``; the other
        layers are split evenly over the middle stages.
    make_vocab_size_divisible_by: the embedding and output layer hold the vocabulary padded to a
        multiple of this times ``tp`` (megatron's rule and default, 128); the padding rows hold no
        HF data and their logits are masked.
    """

    tp: int = 1
    pp: int = 1
    ep: int = 1
    etp: int = 1
    vpp: int = 1
    cp: int = 1
    sequence_parallel: bool = False
    first_stage_layers: int | None = None
    last_stage_layers: int | None = None
    make_vocab_size_divisible_by: int = 128

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "ep", "etp", "vpp", "cp", "make_vocab_size_divisible_by"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"ParallelLayout.{name}={value!r}: must be an integer >= 1")
        if self.vpp > 1 and self.pp < 2:
            raise ValueError(f"vpp={self.vpp} needs pipeline parallelism; set pp >= 2 or vpp=1")
        if self.sequence_parallel and self.tp < 2:
            raise ValueError("sequence_parallel needs tp >= 2; set sequence_parallel=False at tp=1")
        uneven = (self.first_stage_layers, self.last_stage_layers)
        if any(n is not None for n in uneven) and self.pp < 2:
            raise ValueError("first_stage_layers/last_stage_layers need pp >= 2")
        for n in uneven:
            if n is not None and (n < 1 or n % self.vpp):
                raise ValueError(
                    f"an uneven first/last stage needs >= 1 layers and a multiple of vpp={self.vpp}, got {n}"
                )

    def padded_vocab_size(self, vocab_size: int) -> int:
        """The vocabulary rounded up to a multiple of ``make_vocab_size_divisible_by * tp`` (megatron's rule)."""
        multiple = self.make_vocab_size_divisible_by * self.tp
        return -(-vocab_size // multiple) * multiple

    @property
    def model_parallel_size(self) -> int:
        """Ranks holding one copy of the dense weights (TP x PP)."""
        return self.tp * self.pp

    @property
    def replica_ranks(self) -> int:
        """Ranks running one replica of the model on one share of the data (TP x PP x CP)."""
        return self.tp * self.pp * self.cp

    def stage_layer_counts(self, num_layers: int) -> list[int]:
        """Number of decoder layers on each pipeline stage."""
        first, last = self.first_stage_layers, self.last_stage_layers
        middle_stages = self.pp - (first is not None) - (last is not None)
        middle_layers = num_layers - (first or 0) - (last or 0)
        if middle_stages == 0:
            if middle_layers != 0:
                raise ValueError(
                    f"first_stage_layers + last_stage_layers = {(first or 0) + (last or 0)} but the model has "
                    f"{num_layers} layers; make them add up"
                )
            per_middle = 0
        else:
            if middle_layers < middle_stages or middle_layers % (middle_stages * self.vpp):
                raise ValueError(
                    f"{middle_layers} decoder layers cannot be split evenly over {middle_stages} pipeline "
                    f"stage(s) x vpp={self.vpp} chunks; choose pp/vpp that divide the layer count, or set "
                    "first_stage_layers/last_stage_layers"
                )
            per_middle = middle_layers // middle_stages
        counts = [per_middle] * self.pp
        if first is not None:
            counts[0] = first
        if last is not None:
            counts[-1] = last
        return counts

    def chunk_layers(self, num_layers: int, pp_stage: int, vpp_chunk: int = 0) -> list[int]:
        """Global decoder-layer indices (0-based) held by model chunk ``vpp_chunk`` of ``pp_stage``.

        Chunks are ordered chunk-major: all stages' chunk 0 first, then all stages' chunk 1, ...
        (megatron's interleaved schedule); within a chunk, stages in order.
        """
        if not (0 <= pp_stage < self.pp and 0 <= vpp_chunk < self.vpp):
            raise ValueError(f"no chunk ({pp_stage=}, {vpp_chunk=}) in a layout with pp={self.pp}, vpp={self.vpp}")
        per_chunk = [count // self.vpp for count in self.stage_layer_counts(num_layers)]
        start = vpp_chunk * sum(per_chunk) + sum(per_chunk[:pp_stage])
        return list(range(start, start + per_chunk[pp_stage]))

    def is_first_chunk(self, pp_stage: int, vpp_chunk: int) -> bool:
        """True for the chunk that holds the embedding (megatron's ``pre_process``)."""
        return pp_stage == 0 and vpp_chunk == 0

    def is_last_chunk(self, pp_stage: int, vpp_chunk: int) -> bool:
        """True for the chunk that holds the final norm and the output layer (``post_process``)."""
        return pp_stage == self.pp - 1 and vpp_chunk == self.vpp - 1

    def experts_of_rank(self, num_experts: int, ep_rank: int) -> list[int]:
        """Global expert indices held by ``ep_rank``; local index j is ``experts[j]``."""
        if num_experts % self.ep:
            raise ValueError(f"{num_experts} experts cannot be split over ep={self.ep} ranks; pick ep dividing it")
        per_rank = num_experts // self.ep
        return list(range(ep_rank * per_rank, (ep_rank + 1) * per_rank))

    def expert_owner(self, num_experts: int, expert: int) -> tuple[int, int]:
        """(ep_rank, local index) of global expert ``expert``."""
        per_rank = num_experts // self.ep
        return expert // per_rank, expert % per_rank


@dataclass(frozen=True)
class RankCoords:
    """Where one global rank sits in megatron-core's process grid.

    Dense weights are identical on every ``dp`` rank (EP ranks included: megatron carves EP out
    of data parallelism); expert weights are identical on every ``edp`` (expert data parallel) rank.
    """

    rank: int
    pp: int
    tp: int
    dp: int
    ep: int
    etp: int
    edp: int
    cp: int = 0


def rank_coords(layout: ParallelLayout, world_size: int, rank: int) -> RankCoords:
    """Coordinates of ``rank`` in a world of ``world_size`` ranks laid out as megatron-core does.

    megatron-core's default order is ``tp-cp-ep-dp-pp`` (first varies fastest). Dense params use the
    grid (tp, cp, dp, pp), the CP ranks holding copies as the DP ranks do; expert params use
    (etp, ep, edp, pp) over the same ranks (megatron folds CP into expert data parallelism).
    """
    if world_size % layout.replica_ranks:
        raise ValueError(f"world size {world_size} is not a multiple of tp*pp*cp = {layout.replica_ranks}")
    per_stage = world_size // layout.pp
    if per_stage % (layout.etp * layout.ep):
        raise ValueError(
            f"world size {world_size} / pp {layout.pp} = {per_stage} ranks per stage is not a multiple of "
            f"etp*ep = {layout.etp * layout.ep}"
        )
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside a world of {world_size}")
    dp = per_stage // (layout.tp * layout.cp)
    edp = per_stage // (layout.etp * layout.ep)
    tp_rank, rest = rank % layout.tp, rank // layout.tp
    cp_rank, rest = rest % layout.cp, rest // layout.cp
    dp_rank, pp_rank = rest % dp, rest // dp
    etp_rank, rest = rank % layout.etp, rank // layout.etp
    ep_rank, rest = rest % layout.ep, rest // layout.ep
    edp_rank = rest % edp
    return RankCoords(rank=rank, pp=pp_rank, tp=tp_rank, dp=dp_rank, ep=ep_rank, etp=etp_rank, edp=edp_rank, cp=cp_rank)
