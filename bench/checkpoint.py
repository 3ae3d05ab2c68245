"""What a checkpoint's manifest costs: SHA-256 of every file at save, the check at load, against the
save and the load themselves, measured in one run.

    OMP_NUM_THREADS=1 .venv/bin/python bench/checkpoint.py [--vocab 32768] [--repeats 3] [--dir DIR]

One process (gloo, CPU): a Qwen2 of the tiny-model ``small`` shape (hidden 256, 4 layers) with a
``--vocab`` vocabulary (32768: 20M parameters; the checkpoint with its Adam state is about 330 MB),
random weights, after one optimizer step. Each repeat saves it (``save_checkpoint``: the state, the
contents file, the manifest), times ``write_manifest`` again on the saved directory (what the save
spent hashing: the files are in the page cache right after writing, as they are during a save),
then times ``verify_checkpoint`` and ``load_checkpoint(verify=False)`` from the page cache, and
then from the disk: the checkpoint's pages are evicted (``posix_fadvise(DONTNEED)`` on its files
alone, after an fsync) before a cold load, and before a cold verify followed by the load (which
then finds the pages the verify read). Prints the median of each, the hashing speed in MB/s, and
three ratios: manifest / the rest of the save, verify / load (cached), and (verify + load) / load
from a cold disk.
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path


def timed(call) -> float:
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


def evict(path: Path) -> None:
    """Drop ``path``'s files from the page cache (written back first), so the next read is from disk."""
    for file in path.rglob("*"):
        if file.is_file():
            fd = os.open(file, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def build_actor(vocab: int, work: Path):
    from megarl.engine import MegatronActor
    from megarl.engine.settings import ActorSettings, BatchSettings, OptimizerSettings, PolicyLossSettings
    from megarl.models import ParallelLayout, build_model
    from megarl.devtools.tiny_model import build_config

    build_config("qwen2", "small", vocab_size=vocab).save_pretrained(str(work / "model"))
    batches = BatchSettings(micro_batch_size=1)
    settings = ActorSettings(train=batches, log_prob=batches, loss=PolicyLossSettings(), optim=OptimizerSettings(lr=1e-4))
    actor = MegatronActor(build_model(work / "model", ParallelLayout(), "actor", load_weights=False), settings)
    return actor


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where to write the checkpoints (default: a temporary directory)")
    args = parser.parse_args()

    from megarl.engine import load_checkpoint, save_checkpoint, verify_checkpoint
    from megarl.engine.manifest import write_manifest
    from megarl.logging.progress import directory_bytes
    from megarl.platform import init_distributed, initialize_model_parallel

    init_distributed()
    initialize_model_parallel(tp=1, pp=1, seed=0)
    work = Path(args.dir or tempfile.mkdtemp(prefix="megarl_bench_checkpoint_"))
    actor = build_actor(args.vocab, work)
    params = sum(p.numel() for chunk in actor.model for p in chunk.parameters())
    rows = {"save": [], "manifest": [], "verify": [], "load": [], "load cold": [], "verify+load cold": []}
    size = 0
    for repeat in range(args.repeats + 1):  # the first one warms up (spawns megatron's save helper)
        root = work / "checkpoints"
        shutil.rmtree(root, ignore_errors=True)
        save = timed(lambda: save_checkpoint(root, 1, actor.model, actor.optimizer, actor.scheduler))
        path = root / "step_1"
        size = directory_bytes(path)
        manifest = timed(lambda: write_manifest(path))
        verify = timed(lambda: verify_checkpoint(path))
        load = timed(lambda: load_checkpoint(path, actor.model, actor.optimizer, actor.scheduler, verify=False))
        evict(path)
        load_cold = timed(lambda: load_checkpoint(path, actor.model, actor.optimizer, actor.scheduler, verify=False))
        evict(path)
        both_cold = timed(lambda: load_checkpoint(path, actor.model, actor.optimizer, actor.scheduler))
        if repeat:
            for name, value in zip(rows, (save, manifest, verify, load, load_cold, both_cold)):
                rows[name].append(value)
    median = {name: statistics.median(values) for name, values in rows.items()}
    megabytes = size / 1e6
    print(f"checkpoint: {params / 1e6:.1f}M parameters with Adam state, {megabytes:.0f} MB in {len(list(path.iterdir()))} files")
    for name, seconds in median.items():
        print(f"  {name:16s} {seconds:6.2f} s   ({megabytes / seconds:6.0f} MB/s)")
    print(f"manifest / rest of the save: {median['manifest'] / (median['save'] - median['manifest']):.2f}")
    print(f"verify / load (cached):      {median['verify'] / median['load']:.2f}")
    print(f"(verify + load) / load, cold: {median['verify+load cold'] / median['load cold']:.2f}")
    if args.dir is None:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
