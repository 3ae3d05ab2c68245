"""Bytes a weight sync moves over each link of each GPU, and how long that takes.

The weight-sync planner (``megarl.weight_sync.planner``) sends every needed region of every HF
tensor once, from one of the trainer ranks that hold it (spreading the load over the
data-parallel copies and every pipeline stage / expert group), and fans a region that several
rollout ranks need out by broadcast along one route ``(source, destinations)``. A full plan of a
671B layout enumerates 1.5M regions (seconds); the traffic per GPU follows from the same inputs
without that: the shard layout says which ranks hold each tensor, vLLM's TP split
(``megarl.models.vllm_splits``) which region each rollout rank needs, so this module walks
tensor *kinds* (stage, split, shape) instead of tensors. ``traffic_from_plan`` computes the same
numbers from a real ``SyncPlan``; the tests check that both agree.

Link model, per route of ``B`` bytes: the source sends ``B`` once (over the network when a
destination is on another node); a destination on the source's node receives it over NVLink;
the destinations on another node receive ``B`` into that node once, through their own network
interfaces (NCCL runs one ring per NIC), and the rest of it over NVLink from their neighbours.
A GPU's time is its network bytes (the larger direction) over its NIC's bandwidth plus its NVLink
bytes over NVLink's; the sync takes as long as the slowest GPU. ``protocol="nemo_rl"`` models
NeMo-RL's ``nccl_reshard`` refit for comparison: FFN and expert projections shard to shard, every
other tensor broadcast whole from one trainer rank to every rollout rank, after the bulk.
"""
from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field

from megarl.models.layout import ParallelLayout, rank_coords
from megarl.plan.model import ModelFacts, is_ffn_projection, split_key

PROTOCOLS = ("megarl", "nemo_rl")


@dataclass
class LinkBytes:
    ib_in: float = 0.0
    ib_out: float = 0.0
    nvlink_in: float = 0.0
    nvlink_out: float = 0.0

    def seconds(self, ib_bytes_per_s: float, nvlink_bytes_per_s: float) -> float:
        return max(self.ib_in, self.ib_out) / ib_bytes_per_s + max(self.nvlink_in, self.nvlink_out) / nvlink_bytes_per_s


@dataclass
class SyncTraffic:
    """Per sync rank (trainer ranks first, then the rollout workers replica by replica) link bytes."""

    bytes_sent: int  # leaving trainer ranks, each byte once
    bytes_delivered: int  # arriving at rollout ranks (a broadcast region counts once per destination)
    per_rank: dict[int, LinkBytes]
    phases: list[dict[int, LinkBytes]] = field(default_factory=list)  # sequential parts (nemo_rl: bulk, misc)
    tensors_per_destination: int = 0

    slots: dict[int, int] = field(default_factory=dict)  # sync rank -> GPU slot (colocated ranks share a GPU's links)

    def per_gpu(self, ranks: dict[int, LinkBytes] | None = None) -> dict[int, LinkBytes]:
        gpus: dict[int, LinkBytes] = defaultdict(LinkBytes)
        for rank, b in (self.per_rank if ranks is None else ranks).items():
            g = gpus[self.slots.get(rank, rank)]
            g.ib_in += b.ib_in
            g.ib_out += b.ib_out
            g.nvlink_in += b.nvlink_in
            g.nvlink_out += b.nvlink_out
        return dict(gpus)

    def seconds(self, ib_bytes_per_s: float, nvlink_bytes_per_s: float) -> float:
        """The slowest GPU's link time, summed over the sequential phases."""
        phases = self.phases or [self.per_rank]
        return sum(max((b.seconds(ib_bytes_per_s, nvlink_bytes_per_s) for b in self.per_gpu(phase).values()),
                       default=0.0) for phase in phases)

    def busiest_gpu(self, ib_bytes_per_s: float, nvlink_bytes_per_s: float) -> tuple[int, LinkBytes]:
        gpus = self.per_gpu()
        slot = max(gpus, key=lambda g: gpus[g].seconds(ib_bytes_per_s, nvlink_bytes_per_s))
        return slot, gpus[slot]


@dataclass(frozen=True)
class SyncLayout:
    """Where every sync rank sits: trainer ranks ``0..W-1`` on ``trainer_slots``, then the rollout
    workers (replica-major) on ``replica_slots``; ``per_node`` slots per node."""

    trainer_slots: tuple[int, ...]
    replica_slots: tuple[tuple[int, ...], ...]
    per_node: int
    mode: str = "shard"  # full | shard (see megarl.weight_sync.rollout_layout)

    @property
    def trainer_world(self) -> int:
        return len(self.trainer_slots)

    def rollout_rank(self, replica: int, tp_rank: int) -> int:
        return self.trainer_world + replica * len(self.replica_slots[0]) + tp_rank

    def slot(self, sync_rank: int) -> int:
        if sync_rank < self.trainer_world:
            return self.trainer_slots[sync_rank]
        index = sync_rank - self.trainer_world
        tp = len(self.replica_slots[0])
        return self.replica_slots[index // tp][index % tp]

    def node(self, sync_rank: int) -> int:
        return self.slot(sync_rank) // self.per_node


def _add_route(traffic: dict[int, LinkBytes], layout: SyncLayout, srcs: list[int], dsts: list[int], nbytes: float) -> None:
    """Account a route's ``nbytes`` on every member's links (the link model of the module docstring);
    ``srcs`` share the sending equally and sit on one node (the holders of a region spread the load)."""
    src_node = layout.node(srcs[0])
    by_node: dict[int, list[int]] = defaultdict(list)
    for dst in dsts:
        by_node[layout.node(dst)].append(dst)
    share = nbytes / len(srcs)
    leaves_node = any(node != src_node for node in by_node)
    for src in srcs:
        if leaves_node:
            traffic[src].ib_out += share
        elif any(layout.slot(d) != layout.slot(src) for d in dsts):
            traffic[src].nvlink_out += share
    for node, members in by_node.items():
        if node == src_node:
            for dst in members:
                traffic[dst].nvlink_in += nbytes
            continue
        through_nic = nbytes / len(members)
        for dst in members:
            traffic[dst].ib_in += through_nic
            traffic[dst].nvlink_in += nbytes - through_nic
            traffic[dst].nvlink_out += nbytes - through_nic  # it relays its share to the node's other members


def _tensor_stage(name: str, dims, layout: ParallelLayout, layer_stage: dict[int, int]) -> int:
    """The pipeline stage holding HF tensor ``name``: its layer's, the first for the embedding and a vision
    tower (replicated on the first stage's TP ranks), the last for the final norm and lm_head. Layers and the
    embedding are under the family's prefix (``model.``; Qwen3-VL's ``model.language_model.``)."""
    prefix = dims.hf_prefix
    if name.startswith(f"{prefix}layers."):
        return layer_stage[int(name[len(prefix) + len("layers."):].split(".")[0])]
    if name.startswith(f"{prefix}embed_tokens") or (dims.vision is not None and name.startswith(dims.vision.hf_prefix)):
        return 0
    return layout.pp - 1  # final norm, lm_head


def sync_traffic(model: ModelFacts, layout: ParallelLayout, sync: SyncLayout, itemsize: int = 2,
                 protocol: str = "megarl") -> SyncTraffic:
    """The link bytes of one sync of ``model`` from the trainer ``layout`` to ``sync``'s rollout ranks."""
    if protocol not in PROTOCOLS:
        raise ValueError(f"sync protocol {protocol!r}; expected one of {PROTOCOLS}")
    world = sync.trainer_world
    layer_stage = {}
    for stage in range(layout.pp):
        for chunk in range(layout.vpp):
            for layer in layout.chunk_layers(model.dims.num_layers, stage, chunk):
                layer_stage[layer] = stage
    holders: dict[int, list[int]] = defaultdict(list)
    for rank in range(world):
        holders[rank_coords(layout, world, rank).pp].append(rank)
    # tensor kinds: (stage, split, shape, fp32, full) -> count
    kinds: dict[tuple, int] = defaultdict(int)
    for name, shape in model.hf_shapes.items():
        full = sync.mode == "full" or (protocol == "nemo_rl" and not is_ffn_projection(name))
        kinds[(_tensor_stage(name, model.dims, layout, layer_stage), split_key(model.vllm_splits[name]), tuple(shape),
               name in model.fp32_tensors, full)] += 1
    replicas, tp = len(sync.replica_slots), len(sync.replica_slots[0])
    ranks = list(range(world + replicas * tp))
    bulk = {r: LinkBytes() for r in ranks}
    misc = {r: LinkBytes() for r in ranks}
    sent = delivered = 0
    for (stage, key, shape, fp32, full), count in kinds.items():
        size = (4 if fp32 else itemsize) * count
        split = model.vllm_split(key)
        regions: dict[tuple, list[int]] = defaultdict(list)  # region -> rollout TP ranks needing it
        for t in range(tp):
            region = tuple((0, n) for n in shape) if full else split.region("", shape, tp, t)
            if region:
                regions[region].append(t)
        misc_path = protocol == "nemo_rl" and full and sync.mode != "full"
        sources = [0] if misc_path else holders[stage]
        by_node: dict[int, list[int]] = defaultdict(list)
        for src in sources:
            by_node[sync.node(src)].append(src)
        target = misc if misc_path else bulk
        for region, tp_ranks in regions.items():
            region_bytes = size * math.prod(stop - start for start, stop in region)
            dsts = [sync.rollout_rank(i, t) for i in range(replicas) for t in tp_ranks]
            for group in by_node.values():
                _add_route(target, sync, group, dsts, region_bytes * len(group) / len(sources))
            delivered += region_bytes * len(dsts)
        sent += math.prod(shape) * size
    per_rank = {r: LinkBytes(bulk[r].ib_in + misc[r].ib_in, bulk[r].ib_out + misc[r].ib_out,
                             bulk[r].nvlink_in + misc[r].nvlink_in, bulk[r].nvlink_out + misc[r].nvlink_out)
                for r in ranks}
    phases = [bulk, misc] if protocol == "nemo_rl" else [bulk]
    return SyncTraffic(sent, delivered, per_rank, phases, len(model.hf_shapes), {r: sync.slot(r) for r in ranks})


def traffic_from_plan(plan, sync: SyncLayout) -> SyncTraffic:
    """The same link bytes from a real ``SyncPlan`` (its buckets' routes), for checking ``sync_traffic``."""
    ranks = set(range(sync.trainer_world + len(sync.replica_slots) * len(sync.replica_slots[0])))
    traffic = {r: LinkBytes() for r in ranks}
    for bucket in plan.buckets:
        _add_route(traffic, sync, [bucket.src], list(bucket.dsts), bucket.nbytes)
    return SyncTraffic(plan.bytes_sent, plan.bytes_delivered, traffic, [traffic], 0, {r: sync.slot(r) for r in ranks})
