"""Command line: write a tiny random-initialised Hugging Face checkpoint with its tokenizer.

    python -m megarl.devtools.make_tiny_model --family qwen3 --size small --out /tmp/qwen3-small

No hub access is needed. See ``megarl.devtools.tiny_model`` for what the checkpoint contains.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from megarl.devtools.tiny_model import FAMILIES, HEADS, SIZES, make_tiny_model, parameter_count


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m megarl.devtools.make_tiny_model",
        description="Write a random-initialised HF checkpoint (safetensors, config, tokenizer).",
        epilog="families:\n"
        + "\n".join(f"  {name:10s} {family.description}" for name, family in FAMILIES.items())
        + "\nsizes:\n"
        + "\n".join(
            f"  {name:10s} hidden {s.hidden_size}, {s.num_hidden_layers} layers, "
            f"{s.num_attention_heads} heads, {s.num_key_value_heads} KV heads, "
            f"FFN {s.intermediate_size}"
            for name, s in SIZES.items()
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--family", required=True, choices=list(FAMILIES))
    parser.add_argument("--size", default="tiny", choices=list(SIZES))
    parser.add_argument("--out", required=True, type=Path, help="output directory")
    parser.add_argument("--seed", type=int, default=0, help="weight init seed (default 0)")
    parser.add_argument("--head", default="causal_lm", choices=list(HEADS),
                        help="causal_lm (default) or seq_cls: a one-label sequence classifier (a reward model)")
    parser.add_argument("--vocab-size", type=int, default=512, help="multiple of 8 (default 512)")
    parser.add_argument(
        "--tie-word-embeddings", action="store_true", help="share embedding and output weights"
    )
    shard = parser.add_mutually_exclusive_group()
    shard.add_argument("--shards", type=int, help="split the weights into at least N files")
    shard.add_argument("--max-shard-size", help='largest safetensors file, e.g. "200KB"')
    parser.add_argument("--overwrite", action="store_true", help="replace a non-empty --out")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        out = make_tiny_model(
            args.family,
            args.size,
            args.out,
            seed=args.seed,
            tie_word_embeddings=args.tie_word_embeddings,
            vocab_size=args.vocab_size,
            overwrite=args.overwrite,
            max_shard_size=args.max_shard_size,
            shards=args.shards,
            head=args.head,
        )
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"wrote {out}")
    print(f"  family: {args.family}   size: {args.size}   head: {args.head}   seed: {args.seed}")
    print(f"  parameters: {parameter_count(out):,}")
    for path in sorted(out.iterdir()):
        print(f"  {path.name:40s} {path.stat().st_size:>12,} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
