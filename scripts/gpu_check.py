"""The first thing to run on a GPU machine: five checks of megarl's GPU path, one line of figures each.

    python3 scripts/gpu_check.py [--device auto|cuda|cpu] [--preset gpu|cpu] [--only logits train sync offload experts]

``scripts/gpu_check.sh`` runs it on a lent machine (with the wheels it needs carried); this file is
its Python part. Sections, each independent (one failing or missing a package does not stop the
others; the exit status is 1 if any failed):

* ``logits``: the engine's bf16 log-probs of a random batch against Hugging Face's on the same
  checkpoint, for the local layer spec and, where Transformer Engine imports, TE's; the max and mean
  absolute difference against an fp32 HF reference, beside HF's own bf16 difference (the noise floor).
* ``train``: tokens/s of the actor's ``update_policy`` (forward, PPO loss, backward, Adam step) and its
  MFU: model FLOPs (PaLM's count, 6 x matmul params + 12 x layers x hidden x seq per token) against the
  device's dense bf16 peak (``--peak-tflops``; by default the datasheet value of a known device) and
  against a bf16 matmul measured here.
* ``sync``: a full weight sync of the model from a trainer rank into a receiver process that holds
  plain tensors (``WeightReceiver``, no vLLM), over CUDA IPC and over NCCL; bytes/s against a
  device-to-device copy of the same bytes (the physical limit on one device). NCCL needs two devices
  (it refuses two ranks on one GPU) and says so on a one-GPU machine.
* ``offload``: offload and reload round trips of the trained model's weights, grads and optimizer
  state (``megarl.engine.offload``), their bytes and time.
* ``experts``: grouped-GEMM experts (``moe_grouped_gemm=True``) against ``SequentialMLP`` on a tiny
  Qwen3-MoE, per layer spec (local: megatron's ``GroupedMLP``, which needs the ``grouped_gemm``
  package on a GPU; TE's ``TEGroupedMLP`` where Transformer Engine imports): the log-prob difference
  and the time of one update, grouped over sequential.

``--device cpu`` runs every section on the CPU in fp32 with the ``cpu`` preset (what the test does, so
the logic is checked without a GPU); with ``--device auto`` on a machine without CUDA every section
prints ``skipped: no CUDA``.
"""
from __future__ import annotations

import argparse
import math
import multiprocessing as mp
import socket
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path

SECTIONS = ("logits", "train", "sync", "offload", "experts")


class Skipped(Exception):
    """A section cannot run here (no CUDA, a package missing); the message says why."""


@dataclass(frozen=True)
class Preset:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    batch: int
    seq: int

    def llama_config(self):
        from transformers import LlamaConfig

        return LlamaConfig(hidden_size=self.hidden, num_hidden_layers=self.layers, num_attention_heads=self.heads,
                           num_key_value_heads=self.kv_heads, intermediate_size=self.ffn, vocab_size=self.vocab,
                           max_position_embeddings=max(4096, self.seq), tie_word_embeddings=False,
                           rope_theta=500000.0, torch_dtype="float32")


PRESETS = {
    # ~1.2B parameters: big enough that the H200's matmuls dominate launch overhead
    "gpu": Preset(hidden=2048, layers=16, heads=16, kv_heads=8, ffn=8192, vocab=32768, batch=8, seq=2048),
    # the tests' "small" size: seconds on a CPU
    "cpu": Preset(hidden=256, layers=4, heads=8, kv_heads=4, ffn=512, vocab=512, batch=2, seq=64),
}
# dense bf16 TFLOP/s from the vendors' datasheets (SXM parts)
DATASHEET_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "B200": 2250.0}


def log(message: str) -> None:
    print(message, flush=True)


# ---------------------------------------------------------------- shared pieces
def setup(args) -> None:
    """Single-process torch.distributed and Megatron's model parallel state (once)."""
    from megarl.platform import init_distributed, initialize_model_parallel

    import torch.distributed as dist

    if not dist.is_initialized():
        init_distributed()
        initialize_model_parallel(seed=0)


def need_megatron() -> None:
    try:
        import megatron.core  # noqa: F401
    except ImportError as exc:
        raise Skipped(f"megatron-core does not import ({exc}); carry its wheel (scripts/gpu_check.sh --prepare)")


def write_checkpoint(preset: Preset, directory: Path, dtype) -> Path:
    """A random-initialised Llama checkpoint of ``preset`` (saved in ``dtype``)."""
    import torch
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(preset.llama_config()).to(dtype)
    model.save_pretrained(directory)
    return directory


def random_batch(preset: Preset, device):
    """A batch of full-length rows (half prompt, half response, no padding) on ``device``."""
    import torch

    from megarl.engine import RLBatch

    generator = torch.Generator().manual_seed(0)
    prompt, response = preset.seq // 2, preset.seq - preset.seq // 2
    prompts = torch.randint(3, preset.vocab, (preset.batch, prompt), generator=generator)
    responses = torch.randint(3, preset.vocab, (preset.batch, response), generator=generator)
    batch = RLBatch.from_parts(prompts, torch.ones_like(prompts), responses,
                               torch.ones(preset.batch, response, dtype=torch.long),
                               advantages=torch.randn(preset.batch, response, generator=generator))
    return batch.to(device)


def hf_log_probs(model, batch):
    import torch

    ids = batch.input_ids
    with torch.no_grad():
        logits = model(input_ids=ids).logits[:, batch.prompt_length - 1: -1].float()
    return torch.log_softmax(logits, dim=-1).gather(-1, batch.responses.unsqueeze(-1)).squeeze(-1).cpu()


def make_actor(checkpoint_or_config, impl: str, dtype, micro_batch: int):
    from megarl.engine import ActorSettings, BatchSettings, MegatronActor, OptimizerSettings
    from megarl.models import ParallelLayout, build_model

    settings = ActorSettings(train=BatchSettings(micro_batch_size=micro_batch),
                             log_prob=BatchSettings(micro_batch_size=micro_batch),
                             optim=OptimizerSettings(lr=1e-6, weight_decay=0.0))
    chunks = build_model(checkpoint_or_config, ParallelLayout(), "actor", params_dtype=dtype, transformer_impl=impl,
                         load_weights=not hasattr(checkpoint_or_config, "to_dict"))
    return MegatronActor(chunks, settings)


def synchronize() -> None:
    from megarl.platform import synchronize as platform_synchronize

    platform_synchronize()


def timed(function, iters: int) -> list[float]:
    times = []
    for _ in range(iters):
        synchronize()
        start = time.perf_counter()
        function()
        synchronize()
        times.append(time.perf_counter() - start)
    return times


def te_available() -> bool:
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception:  # TE raises more than ImportError when its CUDA libraries are missing
        return False
    return True


# ---------------------------------------------------------------- sections
def section_logits(args, preset: Preset, work: Path) -> str:
    import torch
    from transformers import AutoModelForCausalLM

    need_megatron()
    setup(args)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    preset = replace(preset, layers=min(preset.layers, 4), batch=min(preset.batch, 4), seq=min(preset.seq, 512))
    checkpoint = write_checkpoint(preset, work / "logits_model", torch.float32)
    batch = random_batch(preset, device)
    reference = hf_log_probs(AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).to(device).eval(),
                             batch)
    hf_low = hf_log_probs(AutoModelForCausalLM.from_pretrained(checkpoint, dtype=dtype).to(device).eval(), batch)
    mask = batch.response_mask.bool().cpu()
    noise = (hf_low - reference)[mask].abs()
    parts = [f"HF {str(dtype)[6:]} vs HF fp32 (the noise floor): max {noise.max():.3g} mean {noise.mean():.3g}"]
    impls = ["local"] + (["transformer_engine"] if args.device == "cuda" and te_available() else [])
    for impl in impls:
        actor = make_actor(str(checkpoint), impl, dtype, preset.batch)
        engine = actor.compute_log_prob(batch)[0].cpu().float()
        diff = (engine - reference)[mask].abs()
        versus = f" = {diff.mean() / noise.mean():.2f}x the floor" if noise.mean() > 0 else ""
        parts.append(f"engine[{impl}] {str(dtype)[6:]} vs HF fp32: max {diff.max():.3g} mean {diff.mean():.3g}{versus}")
        del actor
    if len(impls) == 1:
        parts.append("engine[transformer_engine]: skipped: " +
                     ("no CUDA" if args.device != "cuda" else "Transformer Engine does not import"))
    return "; ".join(parts)


def matmul_tflops(device: str) -> float:
    """A measured dense bf16 matmul rate (8192^3 on CUDA), the achievable peak."""
    import torch

    n = 8192 if device == "cuda" else 256
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(3):
        a @ b
    seconds = statistics.median(timed(lambda: a @ b, 10))
    return 2 * n ** 3 / seconds / 1e12


def peak_tflops(args) -> tuple[float | None, str]:
    if args.peak_tflops:
        return args.peak_tflops, "--peak-tflops"
    if args.device != "cuda":
        return None, "no datasheet peak for a CPU"
    import torch

    name = torch.cuda.get_device_name()
    for key, value in DATASHEET_TFLOPS.items():
        if key in name:
            return value, f"datasheet {name}"
    return None, f"unknown device {name!r}: pass --peak-tflops"


def flops_per_token(preset: Preset, matmul_params: int) -> float:
    return 6 * matmul_params + 12 * preset.layers * preset.hidden * preset.seq


def trained_actor(args, preset: Preset):
    """An actor of ``preset`` (random weights) after one update, and its batch."""
    import torch

    need_megatron()
    setup(args)
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    impl = "transformer_engine" if args.device == "cuda" and te_available() else "local"
    actor = make_actor(preset.llama_config(), impl, dtype, micro_batch=1 if args.device == "cuda" else preset.batch)
    batch = random_batch(preset, torch.device(args.device))
    batch = batch.with_fields(old_log_probs=actor.compute_log_prob(batch)[0].float())
    actor.update_policy(batch)  # warm-up: allocator, kernels, Adam state
    return actor, batch, impl


def section_train(args, preset: Preset, work: Path) -> str:
    actor, batch, impl = trained_actor(args, preset)
    seconds = statistics.median(timed(partial(actor.update_policy, batch), args.iters))
    tokens = int(batch.attention_mask.sum())
    params = sum(p.numel() for chunk in actor.model for p in chunk.parameters())
    embedding = preset.vocab * preset.hidden  # the input embedding is a lookup, no FLOPs
    achieved = flops_per_token(preset, params - embedding) * tokens / seconds / 1e12
    peak, source = peak_tflops(args)
    measured = matmul_tflops(args.device)
    line = (f"{params / 1e6:.1f}M params ({impl}), {preset.batch} x {preset.seq} tokens: {seconds:.3f} s/step, "
            f"{tokens / seconds:,.0f} tok/s, {achieved:.3g} TFLOP/s; MFU vs measured matmul ({measured:.3g} TFLOP/s): "
            f"{achieved / measured:.1%}")
    line += f"; MFU vs peak ({peak:.0f}, {source}): {achieved / peak:.1%}" if peak else f"; MFU vs peak: {source}"
    del actor
    return line


def section_offload(args, preset: Preset, work: Path) -> str:
    from megarl.engine.offload import model_offload_groups

    actor, _, _ = trained_actor(args, preset)
    groups = model_offload_groups(actor.model, actor.optimizer)
    parts = []
    for name, group in groups.items():
        rounds = []
        moved = 0
        for _ in range(args.iters):
            synchronize()
            start = time.perf_counter()
            moved = group.offload()
            middle = time.perf_counter()
            group.reload()
            rounds.append((middle - start, time.perf_counter() - middle))
        off, back = statistics.median(r[0] for r in rounds), statistics.median(r[1] for r in rounds)
        what = "discarded" if not group.keep_values else "moved"
        parts.append(f"{name} {moved / 2**30:.2f} GiB {what}: off {off * 1e3:.1f} ms, back {back * 1e3:.1f} ms"
                     + (f" ({2 * moved / (off + back) / 2**30:.1f} GiB/s)" if group.keep_values and off + back else ""))
    del actor
    return "; ".join(parts)


# ---------------------------------------------------------------- sync: trainer rank -> receiver process
def sync_plan(preset: Preset, dtype_name: str, bucket_bytes: int):
    from megarl.models.shards import hf_tensor_shapes
    from megarl.models.vllm_layout import vllm_splits
    from megarl.weight_sync.planner import Piece, TensorMeta, plan_sync
    from megarl.weight_sync.rollout_layout import RolloutLayout, rollout_needs

    config = preset.llama_config()
    shapes = hf_tensor_shapes(config)
    itemsize = 2 if dtype_name == "bfloat16" else 4
    meta = {name: TensorMeta(tuple(shape), itemsize, dtype_name) for name, shape in shapes.items()}
    sources = [Piece(0, name, tuple((0, n) for n in shape)) for name, shape in shapes.items()]
    needs = rollout_needs(shapes, RolloutLayout(replicas=1, tp=1, mode="full", first_rank=1), vllm_splits(config))
    return shapes, plan_sync(sources, needs, meta, bucket_bytes)


def sync_participant(rank: int, transport_name: str, port: int, preset: Preset, device: str, dtype_name: str,
                     bucket_bytes: int, iters: int, results) -> None:
    import torch

    from megarl.weight_sync.receiver import WeightReceiver
    from megarl.weight_sync.sender import from_export, region_reader
    from megarl.weight_sync.transport import make_transport

    torch.set_num_threads(1)
    if device == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    dtype = getattr(torch, dtype_name)
    shapes, plan = sync_plan(preset, dtype_name, bucket_bytes)
    transport = make_transport(transport_name)
    transport.connect(rank, 2, "127.0.0.1", port, plan, timeout_s=120)
    if rank == 0:
        generator = torch.Generator(device=device).manual_seed(0)
        tensors = {n: torch.randn(s, generator=generator, device=device, dtype=torch.float32).to(dtype)
                   for n, s in shapes.items()}
        reader = region_reader(from_export((n, tuple(slice(0, k) for k in t.shape), t) for n, t in tensors.items()))
        checksum = sum(float(t.float().sum()) for t in tensors.values())
    else:
        receiver = WeightReceiver(plan, rank, device=device, recycle=True)
    spans = []
    for version in range(1, iters + 2):
        synchronize()
        start = time.perf_counter()
        if rank == 0:
            transport.run(plan, 0, get_region=reader)
            synchronize()
        else:
            got = 0.0
            for _, tensor in receiver.receive(transport):
                got += float(tensor.float().sum()) if version == 1 else 0.0
            synchronize()
            if version == 1:
                results.put(("checksum", got))
        spans.append(time.perf_counter() - start)
    transport.close()
    if rank == 0:
        results.put(("checksum0", checksum))
    results.put((f"span{rank}", statistics.median(spans[1:])))


def copy_seconds(nbytes: int, device: str, iters: int) -> float:
    import torch

    source = torch.empty(nbytes, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    target.copy_(source)
    return statistics.median(timed(lambda: target.copy_(source), iters))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_sync(transport_name: str, args, preset: Preset, dtype_name: str, bucket_bytes: int) -> tuple[float, bool]:
    """Median seconds of one sync (the slower side) and whether the receiver got the trainer's values."""
    context = mp.get_context("spawn")
    results = context.Queue()
    port = free_port()
    procs = [context.Process(target=sync_participant, args=(rank, transport_name, port, preset, args.device,
                                                           dtype_name, bucket_bytes, args.iters, results))
             for rank in (0, 1)]
    for proc in procs:
        proc.start()
    got = {}
    deadline = time.monotonic() + args.sync_timeout
    while len(got) < 4 and time.monotonic() < deadline and any(p.is_alive() for p in procs) | (not results.empty()):
        try:
            key, value = results.get(timeout=1)
            got[key] = value
        except Exception:  # queue.Empty
            continue
    for proc in procs:
        proc.join(timeout=10)
        if proc.is_alive():
            proc.kill()
    if len(got) < 4:
        codes = [p.exitcode for p in procs]
        raise RuntimeError(f"{transport_name} sync did not finish (exit codes {codes}); see the output above")
    same = math.isclose(got["checksum"], got["checksum0"], rel_tol=1e-6, abs_tol=1e-3)
    return max(got["span0"], got["span1"]), same


def section_sync(args, preset: Preset, work: Path) -> str:
    import torch

    dtype_name = "bfloat16" if args.device == "cuda" else "float32"
    _, plan = sync_plan(preset, dtype_name, args.bucket_mb * 2**20)
    nbytes = plan.bytes_sent
    copy = copy_seconds(nbytes, args.device, args.iters)
    parts = [f"{nbytes / 2**30:.2f} GiB ({dtype_name}, {len(plan.buckets)} buckets of <= {args.bucket_mb:g} MiB); "
             f"device copy {nbytes / copy / 2**30:.1f} GiB/s"]
    transports = ["cuda_ipc", "nccl"] if args.device == "cuda" else ["cuda_ipc", "gloo"]
    for name in transports:
        if name == "nccl" and torch.cuda.device_count() < 2:
            parts.append("nccl: skipped: needs 2 GPUs (NCCL refuses two ranks on one device)")
            continue
        seconds, same = run_sync(name, args, preset, dtype_name, args.bucket_mb * 2**20)
        parts.append(f"{name}{' (host shared memory on CPU)' if name == 'cuda_ipc' and args.device != 'cuda' else ''} "
                     f"{nbytes / seconds / 2**30:.1f} GiB/s = {copy / seconds:.2f}x the copy"
                     f"{'' if same else ' VALUES DIFFER'}")
    return "; ".join(parts)


def section_experts(args, preset: Preset, work: Path) -> str:
    import torch

    from megarl.devtools.tiny_model import make_tiny_model
    from megarl.engine import ActorSettings, BatchSettings, MegatronActor, OptimizerSettings
    from megarl.models import ParallelLayout, build_model

    need_megatron()
    setup(args)
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    size = "small" if args.device == "cuda" else "tiny"
    checkpoint = make_tiny_model("qwen3_moe", size, work / "moe_model", seed=0)
    preset = replace(preset, vocab=512, batch=min(preset.batch, 4), seq=min(preset.seq, 256))
    batch = random_batch(preset, torch.device(args.device))
    settings = ActorSettings(train=BatchSettings(micro_batch_size=preset.batch),
                             log_prob=BatchSettings(micro_batch_size=preset.batch),
                             optim=OptimizerSettings(lr=1e-6, weight_decay=0.0))

    def measured(impl: str, grouped: bool) -> tuple[torch.Tensor, float]:
        torch.manual_seed(0)
        actor = MegatronActor(build_model(str(checkpoint), ParallelLayout(), "actor", params_dtype=dtype,
                                          transformer_impl=impl, config_overrides={"moe_grouped_gemm": grouped}),
                              settings)
        log_probs = actor.compute_log_prob(batch)[0].float().cpu()
        update = batch.with_fields(old_log_probs=log_probs.to(batch.input_ids.device))
        actor.update_policy(update)  # warm-up
        seconds = statistics.median(timed(partial(actor.update_policy, update), args.iters))
        del actor
        release_memory(args.device)
        return log_probs, seconds

    parts = []
    impls = ["local"] + (["transformer_engine"] if args.device == "cuda" and te_available() else [])
    for impl in impls:
        sequential, sequential_s = measured(impl, False)
        try:
            grouped, grouped_s = measured(impl, True)
        except ValueError as exc:  # the build's refusal: grouped_gemm (local spec on a GPU) does not import
            parts.append(f"experts[{impl}]: skipped: {exc}")
            continue
        diff = (grouped - sequential)[batch.response_mask.bool().cpu()].abs()
        parts.append(f"experts[{impl}] grouped vs sequential {str(dtype)[6:]}: log-probs max {diff.max():.3g} "
                     f"mean {diff.mean():.3g}; update {grouped_s:.3f} s vs {sequential_s:.3f} s = "
                     f"{sequential_s / grouped_s:.2f}x")
    if len(impls) == 1:
        parts.append("experts[transformer_engine]: skipped: " +
                     ("no CUDA" if args.device != "cuda" else "Transformer Engine does not import"))
    return f"qwen3_moe {size}, {preset.batch} x {preset.seq} tokens; " + "; ".join(parts)


def release_memory(device: str) -> None:
    """What a finished section held goes back before the next one builds its model."""
    import gc

    import torch

    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


RUNNERS = {"logits": section_logits, "train": section_train, "sync": section_sync, "offload": section_offload,
           "experts": section_experts}


def parse(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto",
                        help="auto: CUDA if present, else every section is skipped; cpu: run the logic on the CPU")
    parser.add_argument("--preset", choices=sorted(PRESETS), help="model and batch size (default: gpu on CUDA, cpu on CPU)")
    parser.add_argument("--only", nargs="+", choices=SECTIONS, default=list(SECTIONS), metavar="SECTION",
                        help=f"sections to run, of {', '.join(SECTIONS)}")
    parser.add_argument("--iters", type=int, default=5, help="timed iterations per figure (after one warm-up)")
    parser.add_argument("--peak-tflops", type=float, help="the device's dense bf16 peak, for MFU")
    parser.add_argument("--bucket-mb", type=float, default=256.0, help="weight-sync bucket size")
    parser.add_argument("--sync-timeout", type=float, default=180.0, help="seconds one transport's sync may take")
    args = parser.parse_args(argv)
    if args.iters < 1:
        parser.error(f"--iters must be >= 1, got {args.iters}")
    return args


def main(argv=None) -> int:
    args = parse(argv)
    import torch

    cuda = torch.cuda.is_available()
    if args.device == "auto":
        args.device = "cuda" if cuda else "none"
    if args.device == "cuda" and not cuda:
        log("--device cuda: torch sees no CUDA device")
        return 1
    preset = PRESETS[args.preset or ("gpu" if args.device == "cuda" else "cpu")]
    where = {"cuda": torch.cuda.get_device_name() if cuda else "", "cpu": "CPU (--device cpu)", "none": "no CUDA"}[args.device]
    log(f"gpu_check: {where}; torch {torch.__version__}; python {sys.version.split()[0]}; preset {preset}")
    failed = 0
    with tempfile.TemporaryDirectory(prefix="megarl_gpu_check_") as directory:
        for name in args.only:
            start = time.perf_counter()
            try:
                if args.device == "none":
                    raise Skipped("no CUDA")
                line = RUNNERS[name](args, preset, Path(directory))
            except Skipped as reason:
                line = f"skipped: {reason}"
            except Exception as exc:  # a section's failure is reported, the others still run
                failed += 1
                line = f"FAILED: {type(exc).__name__}: {exc}"
            log(f"[{name}] {line}  ({time.perf_counter() - start:.1f} s)")
            release_memory(args.device)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
