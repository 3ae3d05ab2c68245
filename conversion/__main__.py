"""``python -m conversion <hf-to-megatron|megatron-to-hf|verify> ...`` (also ``megarl convert ...``).

Multi-rank layouts run under torchrun; when the process count does not fit the layout the
command prints the exact torchrun line to use. Exit codes: 0 done (verify: within tolerance),
1 verify above tolerance, 2 bad input (the message names the problem: a damaged checkpoint file, one
that would run code when unpickled, a full disk, ...).
"""
from __future__ import annotations

import argparse
import os
import sys

from megarl.platform.gc_tuning import tune_gc

tune_gc()  # the command's process: before the tools below load torch and megatron (megarl/platform/gc_tuning.py)

from conversion import hf_to_megatron, megatron_to_hf, verify  # noqa: E402
from conversion.common import ConversionError, fail

COMMANDS = {
    "hf-to-megatron": (hf_to_megatron, "HF safetensors -> megatron-core dist checkpoint"),
    "megatron-to-hf": (megatron_to_hf, "megatron-core dist checkpoint -> HF safetensors"),
    "verify": (verify, "compare megatron and HF logits on sample text"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m conversion", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (module, help_text) in COMMANDS.items():
        command = sub.add_parser(name, help=help_text, description=module.__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
        module.add_arguments(command)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    args = build_parser().parse_args(argv)
    module, _ = COMMANDS[args.command]
    from megarl.engine import CheckpointSpaceError

    try:
        result = module.run(args, argv[1:])
    except (ConversionError, FileNotFoundError, KeyError, ValueError, CheckpointSpaceError) as exc:
        return fail(str(exc).strip("'\""))
    return result if isinstance(result, int) else 0


if __name__ == "__main__":
    sys.exit(main())
