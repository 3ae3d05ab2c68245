"""Benchmark: one weight sync of a 40M-parameter Llama (fp32) from trainer TP=2 x PP=2 to 2 rollout replicas.

    OMP_NUM_THREADS=1 .venv/bin/python bench/weight_sync.py [--bucket-mb 16] [--iters 5] [--no-thp]

Six processes on this machine: sync ranks 0-3 are the trainer (rank = pp_stage * 2 + tp_rank, each
holding exactly its megatron shard set from ``megarl.models.shards``), ranks 4-5 are two rollout
replicas with vLLM TP=1 in full mode (each needs every HF tensor whole). All figures come from
one run on the same data:

1. bytes planned / the minimum the destinations need (target 1.00);
2. time of a gather-then-broadcast baseline (slime / verl style: every trainer rank sends its
   shards to rank 0, which assembles the full tensors, then broadcasts them in buckets of the
   same size, double-buffered, to the receivers) / time of our sync (target >= 2);
3. bytes/s of a plain gloo broadcast of one buffer of the same total size from one rank to the
   receivers (this machine's limit) / bytes/s of our sync (target <= 1.5).

Our receivers stream the tensors out of ``WeightReceiver.receive`` as vLLM's loader would, with
``recycle=True`` (a consumed tensor's memory is reused); a second line shows ``recycle=False``.
The baseline is favoured: its full tensors are allocated once and reused. Every span runs from
a barrier to the last participant's end; medians of ``--iters`` rounds and the median of per-round ratios are reported, after one
warm-up run whose results are checked bit-exact against the trainer's weights.
"""
from __future__ import annotations

import argparse
import math
import multiprocessing as mp
import os
import socket
import statistics
import time
import zlib
from datetime import timedelta

import torch
import torch.distributed as dist
from transformers import LlamaConfig

from megarl.models.layout import ParallelLayout
from megarl.models.shards import hf_tensor_shapes, rank_shards
from megarl.models.vllm_layout import vllm_splits
from megarl.weight_sync.planner import Piece, TensorMeta, plan_sync
from megarl.weight_sync.receiver import WeightReceiver
from megarl.weight_sync.rollout_layout import RolloutLayout, rollout_needs
from megarl.weight_sync.sender import from_export, region_reader, source_pieces
from megarl.weight_sync.transport import make_transport

TRAINER = ParallelLayout(tp=2, pp=2)
N_SOURCES = TRAINER.tp * TRAINER.pp
ROLLOUT = RolloutLayout(replicas=2, tp=1, mode="full", first_rank=N_SOURCES)
WORLD = N_SOURCES + ROLLOUT.replicas * ROLLOUT.tp


def llama_config() -> LlamaConfig:
    return LlamaConfig(hidden_size=512, intermediate_size=1408, num_hidden_layers=8, num_attention_heads=8,
                       num_key_value_heads=4, vocab_size=16000, tie_word_embeddings=False)


def full_tensor(name: str, shape: tuple[int, ...]) -> torch.Tensor:
    """The trainer's weight ``name``, reproducible in any process from the name alone."""
    return torch.randn(shape, generator=torch.Generator().manual_seed(zlib.crc32(name.encode())))


def export(rank: int, shapes: dict) -> list[tuple[str, tuple[slice, ...], torch.Tensor, bool]]:
    """Trainer rank ``rank``'s pieces: (hf_name, hf_slice, tensor, primary), as the bridge's export gives them."""
    specs = rank_shards(llama_config(), TRAINER, pp_stage=rank // TRAINER.tp, tp_rank=rank % TRAINER.tp)
    cache: dict[str, torch.Tensor] = {}
    out = []
    for spec in specs:
        for piece in spec.pieces:
            if piece.hf_name not in cache:
                cache[piece.hf_name] = full_tensor(piece.hf_name, shapes[piece.hf_name])
            out.append((piece.hf_name, piece.hf_slice, cache[piece.hf_name][piece.hf_slice].clone(), spec.primary))
    return out


def pieces_of(rank: int) -> list[tuple[str, tuple[slice, ...], bool]]:
    """The same pieces without data (every process computes every rank's layout)."""
    specs = rank_shards(llama_config(), TRAINER, pp_stage=rank // TRAINER.tp, tp_rank=rank % TRAINER.tp)
    return [(p.hf_name, p.hf_slice, s.primary) for s in specs for p in s.pieces]


# ---------------------------------------------------------------- the bench's own process groups
class Groups:
    """Standalone gloo groups for barriers, the baseline and the plain broadcast (a store of their own)."""

    def __init__(self, rank: int, port: int) -> None:
        self.rank = rank
        self.store = dist.TCPStore("127.0.0.1", port, WORLD, rank == 0, timedelta(seconds=300), wait_for_workers=False)
        self.all = self._group("all", list(range(WORLD)))
        self.gather = self._group("gather", list(range(N_SOURCES)))
        self.bcast = self._group("bcast", [0] + ROLLOUT.ranks)

    def _group(self, name: str, ranks: list[int]):
        if self.rank not in ranks:
            return None
        store = dist.PrefixStore(f"bench/{name}", self.store)
        return dist.ProcessGroupGloo(store, ranks.index(self.rank), len(ranks), timedelta(seconds=300))

    def span(self, start: float, end: float) -> float:
        """Seconds from the earliest start to the latest end over all ranks."""
        both = torch.tensor([-start, end], dtype=torch.float64)
        options = dist.AllreduceOptions()
        options.reduceOp = dist.ReduceOp.MAX
        self.all.allreduce([both], options).wait()
        return float(both[0] + both[1])

    def barrier(self) -> None:
        self.all.allreduce([torch.zeros(1)]).wait()


def broadcast_from(group, tensor: torch.Tensor) -> object:
    options = dist.BroadcastOptions()
    options.rootRank = 0
    return group.broadcast([tensor], options)


# ---------------------------------------------------------------- the three methods
def our_sync(rank, transport, plan, reader, receiver, check_against=None) -> None:
    """Our sync; receivers stream the tensors out as a vLLM loader would (and drop them)."""
    if rank < N_SOURCES:
        transport.run(plan, rank, get_region=reader)
        return
    seen = 0
    for name, tensor in receiver.receive(transport):
        if check_against is not None and not torch.equal(tensor, check_against(name)):
            raise SystemExit(f"our sync: {name} differs from the trainer's weight")
        seen += 1
    if seen != len(plan.meta):
        raise SystemExit(f"our sync: got {seen} of {len(plan.meta)} tensors")


def baseline_layout(shapes: dict, bucket_bytes: int) -> list[list[str]]:
    """Whole tensors packed into broadcast buckets of at most ``bucket_bytes`` (a bigger tensor alone)."""
    buckets, current, size = [], [], 0
    for name in sorted(shapes):
        nbytes = math.prod(shapes[name]) * 4
        if current and size + nbytes > bucket_bytes:
            buckets.append(current)
            current, size = [], 0
        current.append(name)
        size += nbytes
    return buckets + [current] if current else buckets


def gather_then_broadcast(rank, groups, shapes, layout, primary_pieces, local, memory) -> None:
    """Baseline: rank 0 gathers every primary shard, assembles full tensors, broadcasts them bucket by bucket.

    To favour the baseline, its full tensors (rank 0 and receivers) are allocated once and reused.
    """
    if rank not in memory:
        memory[rank] = {name: torch.empty(shape) for name, shape in shapes.items()} if rank == 0 or rank >= N_SOURCES else {}
    full = memory[rank]
    if 0 < rank < N_SOURCES:
        flat = torch.cat([t.reshape(-1) for name, _, t, primary in local if primary])
        groups.gather.send([flat], 0, 0).wait()
        return
    if rank == 0:
        for name, hf_slice, tensor, primary in local:
            if primary:
                full[name][hf_slice] = tensor
        inbox = {}
        for src in range(1, N_SOURCES):  # all receives posted at once: the sources send concurrently
            numel = sum(math.prod(s.stop - s.start for s in hf_slice) for _, hf_slice, primary in primary_pieces[src] if primary)
            flat = torch.empty(numel)
            inbox[src] = (flat, groups.gather.recv([flat], src, 0))
        for src, (flat, work) in inbox.items():
            work.wait()
            offset = 0
            for name, hf_slice, primary in primary_pieces[src]:
                if primary:
                    view = full[name][hf_slice]
                    view.copy_(flat[offset:offset + view.numel()].view(view.shape))
                    offset += view.numel()
        pending = []
        for names in layout:  # double-buffered, like our transport
            pending.append(broadcast_from(groups.bcast, torch.cat([full[n].reshape(-1) for n in names])))
            if len(pending) == 2:
                pending.pop(0).wait()
        for work in pending:
            work.wait()
        return
    for names in layout:
        buffer = torch.empty(sum(math.prod(shapes[n]) for n in names))
        broadcast_from(groups.bcast, buffer).wait()
        offset = 0
        for n in names:
            numel = math.prod(shapes[n])
            full[n].copy_(buffer[offset:offset + numel].view(shapes[n]))
            offset += numel


def plain_broadcast(rank, groups, buffer) -> None:
    if rank == 0 or rank >= N_SOURCES:
        broadcast_from(groups.bcast, buffer).wait()


# ---------------------------------------------------------------- one process
def participant(rank: int, ports: list[int], bucket_bytes: int, iters: int, window: int) -> None:
    torch.set_num_threads(1)
    shapes = hf_tensor_shapes(llama_config())
    meta = {name: TensorMeta(tuple(shape), 4, "float32") for name, shape in shapes.items()}
    everyone = {r: pieces_of(r) for r in range(N_SOURCES)}
    sources = [Piece(r, name, tuple((s.start, s.stop) for s in hf_slice))
               for r, items in everyone.items() for name, hf_slice, _ in items]
    needs = rollout_needs(shapes, ROLLOUT, vllm_splits(llama_config()))
    plan = plan_sync(sources, needs, meta, bucket_bytes)
    local = export(rank, shapes) if rank < N_SOURCES else []
    shards = from_export((name, hf_slice, tensor) for name, hf_slice, tensor, _ in local)
    if rank < N_SOURCES:
        assert sorted(source_pieces(rank, shards), key=repr) == sorted((p for p in sources if p.rank == rank), key=repr)
    reader = region_reader(shards)
    layout = baseline_layout(shapes, bucket_bytes)
    plain_buffer = torch.ones(plan.bytes_sent, dtype=torch.uint8)

    groups = Groups(rank, ports[1])
    transport = make_transport("gloo", window=window)
    transport.connect(rank, WORLD, "127.0.0.1", ports[0], plan, timeout_s=300)
    receivers = {flag: WeightReceiver(plan, rank, recycle=flag) for flag in (True, False)} if rank >= N_SOURCES else {}
    baseline_memory: dict = {}

    def measure(fn) -> float:
        groups.barrier()
        start = time.time()
        fn()
        return groups.span(start, time.time())

    times: dict[str, list[float]] = {"ours": [], "ours_fresh": [], "baseline": [], "plain": []}
    for it in range(iters + 1):
        reference = (lambda name: full_tensor(name, shapes[name])) if it == 0 else None  # checked in the warm-up
        spans = {
            "ours": measure(lambda: our_sync(rank, transport, plan, reader, receivers.get(True), reference)),
            "ours_fresh": measure(lambda: our_sync(rank, transport, plan, reader, receivers.get(False))),
            "baseline": measure(lambda: gather_then_broadcast(rank, groups, shapes, layout, everyone, local,
                                                              baseline_memory)),
            "plain": measure(lambda: plain_broadcast(rank, groups, plain_buffer)),
        }
        if it == 0 and rank >= N_SOURCES:
            check(baseline_memory[rank], shapes, "baseline")
        if it > 0:  # the first round warms up allocators and connections
            for key, span in spans.items():
                times[key].append(span)
    transport.close()
    if rank == 0:
        report(plan, shapes, times, bucket_bytes, window)


def check(got: dict, shapes: dict, what: str) -> None:
    wrong = [n for n in shapes if not torch.equal(got[n], full_tensor(n, shapes[n]))]
    if wrong:
        raise SystemExit(f"{what}: {len(wrong)} tensors differ from the trainer's, e.g. {wrong[:3]}")


def report(plan, shapes, times, bucket_bytes, window) -> None:
    """Ratios are taken per round (the methods of one round run back to back), then the median."""
    def ratio(a: str, b: str) -> float:
        return statistics.median(x / y for x, y in zip(times[a], times[b]))

    median = {k: statistics.median(v) for k, v in times.items()}
    model_bytes = sum(math.prod(s) * 4 for s in shapes.values())
    print(f"model: Llama {sum(math.prod(s) for s in shapes.values()) / 1e6:.1f}M params fp32 = {model_bytes / 2**20:.1f} MiB; "
          f"trainer TP=2 x PP=2 (4 ranks) -> rollout 2 replicas x TP=1, full mode; gloo, window {window}, "
          f"{len(plan.buckets)} buckets of <= {bucket_bytes / 2**20:g} MiB; THP_MEM_ALLOC_ENABLE="
          f"{os.environ.get('THP_MEM_ALLOC_ENABLE', '0')}")
    print("spans (s): " + "; ".join(f"{k} {[round(t, 3) for t in v]}" for k, v in times.items()))
    print(f"[1] bytes planned / bytes the destinations need: {plan.bytes_delivered / plan.bytes_needed():.2f} "
          f"(delivered {plan.bytes_delivered / 2**20:.1f} MiB for {plan.bytes_needed() / 2**20:.1f} MiB needed; "
          f"bytes leaving the trainer / model size: {plan.bytes_sent / model_bytes:.2f})   target 1.00")
    print(f"[2] gather-then-broadcast baseline / our sync: {median['baseline']:.3f} s / {median['ours']:.3f} s "
          f"(medians); per-round ratio {ratio('baseline', 'ours'):.2f}x faster   target >= 2x")
    print(f"[3] plain gloo broadcast / our sync, bytes/s: {plan.bytes_sent / median['plain'] / 2**20:.0f} MiB/s / "
          f"{plan.bytes_sent / median['ours'] / 2**20:.0f} MiB/s (medians); per-round ratio "
          f"{ratio('ours', 'plain'):.2f}x   target <= 1.5x")
    print(f"    our sync with fresh tensors every sync (recycle=False): {median['ours_fresh']:.3f} s, "
          f"{ratio('baseline', 'ours_fresh'):.2f}x faster than the baseline, {ratio('ours_fresh', 'plain'):.2f}x the "
          f"plain broadcast's time")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bucket-mb", type=float, default=16.0)
    parser.add_argument("--iters", type=int, default=7)
    parser.add_argument("--window", type=int, default=2, help="buckets in flight per rank")
    parser.add_argument("--no-thp", action="store_true", help="do not back large CPU tensors with huge pages")
    args = parser.parse_args()
    os.environ["OMP_NUM_THREADS"] = "1"  # inherited by the spawned participants
    if not args.no_thp:  # torch's CPU allocator: madvise(MADV_HUGEPAGE) for tensors >= 2 MiB (fewer page faults)
        os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")
    ports = []
    for _ in range(2):  # the sync's store, the bench's own store
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            ports.append(sock.getsockname()[1])
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=participant, args=(r, ports, int(args.bucket_mb * 2**20), args.iters, args.window))
             for r in range(WORLD)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join()
    failed = [(r, p.exitcode) for r, p in enumerate(procs) if p.exitcode != 0]
    if failed:
        raise SystemExit(f"participants failed: {failed}")


if __name__ == "__main__":
    main()
