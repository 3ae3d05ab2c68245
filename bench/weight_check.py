"""What the finiteness check before every weight sync and checkpoint save costs (``megarl.engine.finite``).

    OMP_NUM_THREADS=1 .venv/bin/python bench/weight_check.py [--model tiny|100m|1b] [--device cpu|cuda] [--dtype fp32|bf16]

The tensors have the shapes of one trainer rank's megatron GPT (TP=PP=1): the embedding, per layer
the fused QKV, the attention output, the fused gate/up and the down projection with their norms,
the final norm and an untied output layer. ``tiny`` is the quickstart's model (hidden 128, 2 layers),
``100m`` is SmolLM2-135M's shape (hidden 576, 30 layers, 135M parameters), ``1b`` a 1.2B one. Prints
the check's median time, the bytes it read per second, and its ratio to one plain read of the same
bytes (``torch.stack([t.sum() for t in tensors])``, per-tensor reductions alike) and to
``torch._foreach_norm`` (the fused multi-tensor alternative).

The module is loaded by its file path: it imports only torch, so this runs where megatron-core is
not installed (a GPU machine's stock image).
"""
from __future__ import annotations

import argparse
import importlib.util
import statistics
import time
from pathlib import Path

import torch

SHAPES = {  # hidden, layers, ffn, vocab, query heads, kv heads, head dim
    "tiny": (128, 2, 256, 512, 4, 2, 32),
    "100m": (576, 30, 1536, 49152, 9, 3, 64),
    "1b": (2048, 16, 8192, 128256, 32, 8, 64),
}


def gpt_tensors(name: str, device: str, dtype: torch.dtype) -> list[tuple[str, torch.Tensor]]:
    hidden, layers, ffn, vocab, heads, kv, head_dim = SHAPES[name]
    make = lambda *shape: torch.randn(*shape, device=device, dtype=dtype) * 0.02  # noqa: E731
    named = [("embedding.word_embeddings.weight", make(vocab, hidden))]
    for i in range(layers):
        prefix = f"decoder.layers.{i}."
        named += [(prefix + "self_attention.linear_qkv.layer_norm_weight", make(hidden)),
                  (prefix + "self_attention.linear_qkv.weight", make((heads + 2 * kv) * head_dim, hidden)),
                  (prefix + "self_attention.linear_proj.weight", make(hidden, heads * head_dim)),
                  (prefix + "mlp.linear_fc1.layer_norm_weight", make(hidden)),
                  (prefix + "mlp.linear_fc1.weight", make(2 * ffn, hidden)),
                  (prefix + "mlp.linear_fc2.weight", make(hidden, ffn))]
    return named + [("decoder.final_layernorm.weight", make(hidden)), ("output_layer.weight", make(vocab, hidden))]


def timed(fn, device: str, rounds: int) -> float:
    fn()
    times = []
    for _ in range(rounds):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=sorted(SHAPES), default="100m")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    parser.add_argument("--rounds", type=int, default=20)
    args = parser.parse_args()
    spec = importlib.util.spec_from_file_location("finite", Path(__file__).parents[1] / "megarl" / "engine" / "finite.py")
    finite = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(finite)

    named = gpt_tensors(args.model, args.device, torch.bfloat16 if args.dtype == "bf16" else torch.float32)
    tensors = [t for _, t in named]
    count = sum(t.numel() for t in tensors)
    size = sum(t.numel() * t.element_size() for t in tensors)
    check = timed(lambda: finite.nonfinite_tensors(named), args.device, args.rounds)
    read = timed(lambda: torch.stack([t.sum() for t in tensors]).sum().item(), args.device, args.rounds)
    foreach = timed(lambda: torch.stack(torch._foreach_norm(tensors, float("inf"))).isfinite().all().item(),
                    args.device, args.rounds)
    tensors[len(tensors) // 2].view(-1)[7] = float("nan")  # the verdict and the name, on a bad tensor
    assert finite.nonfinite_tensors(named) == (1, [named[len(tensors) // 2][0]])
    print(f"{args.model} ({count / 1e6:.1f}M parameters, {len(tensors)} tensors, {size / 2**20:.0f} MiB {args.dtype}) on "
          f"{args.device}: check {check * 1e3:.2f} ms ({size / check / 1e9:.1f} GB/s); ratio to one plain read "
          f"{check / read:.2f}, to torch._foreach_norm {check / foreach:.2f}")


if __name__ == "__main__":
    main()
