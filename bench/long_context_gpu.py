"""GPU check of long sequences: megarl's core attention on CUDA, packed (THD) micro-batches through the
local spec and Transformer Engine's, and what packing buys there. One line of figures per section.

    python3 bench/long_context_gpu.py [--device auto|cuda|cpu] [--only kernel packed speed cp] [--iters 3]

On a lent machine (no megatron-core, omegaconf or network there) carry the wheels the GPU check uses:
``scripts/gpu_check.sh --prepare`` here, then there
``python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl &&
PYTHONPATH=$PWD:/tmp/site python3 bench/long_context_gpu.py``. Sections, each on its own (a missing
piece prints ``skipped: <why>``, a failure ``FAILED: <error>`` and exit status 1):

* ``kernel``: the blockwise kernel (context parallelism, windows, caps, sinks) against torch's SDPA on
  the device, fp32: a CP rank's query chunks with a window, values and gradients;
* ``packed``: the engine's log-probs of a long-tailed batch (responses 8x their median at the
  longest), packed (THD ``PackedSeqParams``) against padded rows, bf16, for the local spec (megarl's
  core attention) and, where Transformer Engine imports, TE's (its fused THD attention), beside HF
  fp32 on the same checkpoint;
* ``speed``: tokens/s of ``update_policy`` on that batch, packed against padded (TE's spec where it
  imports), micro-batches of 4 samples;
* ``cp``: Transformer Engine's context parallelism (CP=2, NCCL) against CP=1: needs TE and two GPUs
  (NCCL refuses two ranks on one device), else it says which is missing.

``--device cpu`` runs ``kernel``, ``packed`` and ``speed`` on the CPU in fp32 on a small model (their
logic, without a GPU); ``--device auto`` without CUDA skips everything.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SECTIONS = ("kernel", "packed", "speed", "cp")
ROOT = Path(__file__).resolve().parents[1]


class Skipped(Exception):
    """The section cannot run here; the message says why."""


def te_available() -> bool:
    try:
        import transformer_engine  # noqa: F401
    except Exception:  # noqa: BLE001 - an absent or broken TE install is the same answer
        return False
    return True


def model_config(device: str):
    from transformers import LlamaConfig

    big = device == "cuda"  # ~1.2B on a GPU: matmuls, not launches, dominate
    return LlamaConfig(hidden_size=2048 if big else 256, num_hidden_layers=8 if big else 4,
                       num_attention_heads=16 if big else 8, num_key_value_heads=8 if big else 4,
                       intermediate_size=8192 if big else 512, vocab_size=32768 if big else 512,
                       max_position_embeddings=16384, rope_theta=500000.0, tie_word_embeddings=False)


def long_tailed_batch(device: str, vocab: int):
    """16 samples: 32-token prompts, responses at a log-normal's quantiles, the longest 8x the median."""
    sys.path.insert(0, str(ROOT / "bench"))
    from long_context import long_tailed_lengths, make_batch

    median = 768 if device == "cuda" else 96
    return make_batch(long_tailed_lengths(16, median), vocab).to(device)


def setup_once() -> None:
    import torch.distributed as dist

    from megarl.platform import init_distributed, initialize_model_parallel

    if not dist.is_initialized():
        init_distributed()
        initialize_model_parallel(seed=0)


def actor(checkpoint: Path, impl: str, dtype, packed: bool, micro: int = 4):
    from megarl.engine import ActorSettings, BatchSettings, MegatronActor, OptimizerSettings
    from megarl.models import ParallelLayout, build_model

    settings = BatchSettings(micro_batch_size=micro, use_remove_padding=packed)
    chunks = build_model(checkpoint, ParallelLayout(), "actor", params_dtype=dtype, transformer_impl=impl)
    return MegatronActor(chunks, ActorSettings(train=settings, log_prob=settings, optim=OptimizerSettings(lr=1e-6)))


# ---------------------------------------------------------------- sections
def section_kernel(args, work: Path) -> str:
    import torch
    import torch.nn.functional as F

    from megarl.models.attention import PackedLayout, blockwise_attention

    device, generator = args.device, torch.Generator(device=args.device).manual_seed(0)
    lengths, cp, heads, groups, dim = (1024, 512, 2048), 2, 8, 4, 64
    q, k, v = (torch.randn(sum(lengths), h, dim, device=device, generator=generator, requires_grad=True)
               for h in (heads, groups, groups))
    whole = PackedLayout(lengths)
    reference = torch.cat([F.scaled_dot_product_attention(
        *(t[s:e].transpose(0, 1).unsqueeze(0).repeat_interleave(heads // t.shape[1], 1) for t in (q, k, v)),
        is_causal=True).squeeze(0).transpose(0, 1) for s, e in zip(whole.offsets[:-1], whole.offsets[1:])])
    weight = torch.randn(reference.shape, device=device, generator=generator)
    grads_ref = torch.autograd.grad((reference * weight).sum(), (q, k, v))
    worst = grad_worst = 0.0
    for rank in range(cp):  # each CP rank's two chunks of every sequence against the whole sequences
        layout = PackedLayout(lengths, cp, rank)
        index = layout.local_index.to(device)
        out = blockwise_attention(q[index], k, v, layout.local_positions.to(device),
                                  layout.sequence_positions.to(device), layout.segments, dim ** -0.5)
        worst = max(worst, (out - reference[index]).abs().max().item())
        grads = torch.autograd.grad((out * weight[index]).sum(), (q, k, v))
        grad_worst = max(grad_worst, (grads[0][index] - grads_ref[0][index]).abs().max().item())
    start = time.perf_counter()
    out = blockwise_attention(q, k, v, whole.sequence_positions.to(device), whole.sequence_positions.to(device),
                              whole.segments, dim ** -0.5, window=512, softcap=30.0)
    out.sum().backward()
    if device == "cuda":
        torch.cuda.synchronize()
    return (f"CP2 chunks vs SDPA fp32: max |out| diff {worst:.2e}, |dq| diff {grad_worst:.2e}; "
            f"window 512 + softcap 30 over {sum(lengths)} tokens, forward+backward {time.perf_counter() - start:.2f} s")


def section_packed(args, work: Path) -> str:
    import torch
    from transformers import AutoModelForCausalLM, LlamaForCausalLM

    setup_once()
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    torch.manual_seed(0)
    checkpoint = work / "model"
    if not checkpoint.exists():
        LlamaForCausalLM(model_config(args.device)).save_pretrained(checkpoint)
    batch = long_tailed_batch(args.device, model_config(args.device).vocab_size)
    hf = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).to(args.device).eval()
    mask = batch.response_mask.bool()
    with torch.no_grad():
        reference = torch.zeros(mask.shape, device=args.device)
        for row in range(len(batch)):  # one sample at a time: no padding inside HF
            ids = batch.input_ids[row][batch.attention_mask[row].bool()].unsqueeze(0)
            n = int(mask[row].sum())
            logits = hf(ids).logits[0, -n - 1:-1].float()
            reference[row, :n] = logits.log_softmax(-1).gather(-1, ids[0, -n:].unsqueeze(-1)).squeeze(-1)
    del hf
    parts = []
    impls = ["local"] + (["transformer_engine"] if args.device == "cuda" and te_available() else [])
    for impl in impls:
        results = {packed: actor(checkpoint, impl, dtype, packed).compute_log_prob(batch)[0] for packed in (True, False)}
        packed_vs_padded = (results[True] - results[False])[mask].abs()
        packed_vs_hf = (results[True].to(reference.device) - reference)[mask].abs()
        parts.append(f"{impl} {str(dtype)[6:]}: packed vs padded max {packed_vs_padded.max():.3g} mean "
                     f"{packed_vs_padded.mean():.3g}; packed vs HF fp32 max {packed_vs_hf.max():.3g} mean {packed_vs_hf.mean():.3g}")
    if len(impls) == 1:
        parts.append("transformer_engine: skipped: " + ("no CUDA" if args.device != "cuda" else
                                                        "Transformer Engine does not import here"))
    return "; ".join(parts)


def section_speed(args, work: Path) -> str:
    import torch

    if not (work / "model").exists():
        section_packed(args, work)  # writes the checkpoint
    setup_once()
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    impl = "transformer_engine" if args.device == "cuda" and te_available() else "local"
    batch = long_tailed_batch(args.device, model_config(args.device).vocab_size)
    tokens, rates = int(batch.attention_mask.sum()), {}
    for packed in (False, True):
        model = actor(work / "model", impl, dtype, packed)
        model.update_policy(batch)  # warm-up
        seconds = []
        for _ in range(args.iters):
            if args.device == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            model.update_policy(batch)
            if args.device == "cuda":
                torch.cuda.synchronize()
            seconds.append(time.perf_counter() - start)
        rates[packed] = tokens / statistics.median(seconds)
        del model
    return (f"{impl}, {tokens} real tokens: padded {rates[False]:.0f} tok/s, packed {rates[True]:.0f} tok/s, "
            f"ratio {rates[True] / rates[False]:.2f} (target >= 1.5)")


def section_cp(args, work: Path) -> str:
    import torch

    if args.device != "cuda":
        raise Skipped("no CUDA")
    if not te_available():
        raise Skipped("Transformer Engine does not import here (its CP is what this section runs; the local "
                      "spec's CP is tested on CPU: tests/engine/test_context_parallel.py)")
    if torch.cuda.device_count() < 2:
        raise Skipped(f"CP=2 needs two GPUs (NCCL refuses two ranks on one device); {torch.cuda.device_count()} here")
    if not (work / "model").exists():
        section_packed(args, work)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", __file__,
               "--cp-worker", str(work)]
    done = subprocess.run(command, env={**os.environ, "PYTHONPATH": f"{ROOT}:{os.environ.get('PYTHONPATH', '')}"},
                          capture_output=True, text=True, timeout=400)
    if done.returncode != 0:
        raise RuntimeError(done.stderr[-2000:])
    return done.stdout.strip().splitlines()[-1]


def cp_worker(work: Path) -> None:
    """Two ranks: log-probs at CP=2 (TE) and at CP=1 x DP=2 on the same batch; rank 0 prints the difference."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state

    from megarl.engine import data_parallel_shard
    from megarl.platform import init_distributed, initialize_model_parallel

    init_distributed()
    batch = long_tailed_batch("cuda", model_config("cuda").vocab_size)
    results = {}
    for cp in (2, 1):
        if parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()
        initialize_model_parallel(cp=cp, seed=0)
        model = actor(work / "model", "transformer_engine", torch.bfloat16, True)
        dp, dp_size = parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size()
        local = model.compute_log_prob(data_parallel_shard(batch, dp, dp_size))[0]
        parts = [torch.empty_like(local) for _ in range(dp_size)]
        dist.all_gather(parts, local.contiguous(), group=parallel_state.get_data_parallel_group())
        results[cp] = torch.cat(parts)
    diff = (results[2] - results[1])[batch.response_mask.bool()].abs()
    if dist.get_rank() == 0:
        print(f"TE CP2 vs CP1 bf16 log-probs: max {diff.max():.3g} mean {diff.mean():.3g}")
    dist.destroy_process_group()


RUNNERS = {"kernel": section_kernel, "packed": section_packed, "speed": section_speed, "cp": section_cp}


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--cp-worker"]:
        cp_worker(Path(argv[1]))
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    parser.add_argument("--only", nargs="+", choices=SECTIONS, default=list(SECTIONS))
    parser.add_argument("--iters", type=int, default=3)
    args = parser.parse_args(argv)
    import torch

    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "none"
    print(f"long_context_gpu: {torch.cuda.get_device_name() if args.device == 'cuda' else args.device}; torch "
          f"{torch.__version__}; Transformer Engine {'imports' if te_available() else 'does not import'}", flush=True)
    failed = 0
    with tempfile.TemporaryDirectory(prefix="megarl_long_context_") as directory:
        for name in args.only:
            start = time.perf_counter()
            try:
                if args.device == "none":
                    raise Skipped("no CUDA")
                try:
                    import megatron.core  # noqa: F401
                except ImportError as exc:
                    raise Skipped(f"megatron-core does not import ({exc}); carry the wheels of scripts/gpu_check.sh")
                line = RUNNERS[name](args, Path(directory))
            except Skipped as reason:
                line = f"skipped: {reason}"
            except Exception as exc:  # noqa: BLE001 - reported; the other sections still run
                failed += 1
                line = f"FAILED: {type(exc).__name__}: {exc}"
            print(f"[{name}] {line}  ({time.perf_counter() - start:.1f} s)", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
