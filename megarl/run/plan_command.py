"""``megarl plan <config> [key=value ...]``: the plan of a run, with the launch's command line.

    megarl plan configs/grpo_70b.yaml                       # H100 figures
    megarl plan grpo_moe_671b --gpu h200 --json             # packaged config by name, JSON for tools
    megarl plan my.yaml actor_rollout_ref.actor.megatron.tensor_model_parallel_size=4 --memory-gb 96
    megarl plan configs/grpo_70b.yaml --comment            # the plan as the comment block a config carries
    megarl plan configs/grpo_70b.yaml --response-length-median 300   # what packing saves on long-tailed lengths

The config is loaded and checked as ``megarl train`` does (files are not required, but the model's
config.json is: ``actor_rollout_ref.model.path`` must name a directory holding it). Exit status:
0 the run fits, 1 it does not (the output names the keys that would make it fit), 2 a bad
command line or config.
"""
from __future__ import annotations

import sys

FIGURES = {"--memory-gb": "memory_gb", "--tflops": "bf16_tflops", "--hbm-gbps": "hbm_gbps",
           "--nvlink-gbps": "nvlink_gbps", "--ib-gbps": "ib_gbps"}
EFFICIENCIES = {"--mfu": "mfu", "--decode-hbm": "decode_hbm", "--prefill-mfu": "prefill_mfu",
                "--link-efficiency": "link", "--context-gb": "cuda_context_gb"}
USAGE = ("usage: megarl plan [NAME | --config-path DIR --config-name NAME] [key=value ...] [--gpu "
         "a100|a100-40gb|h100|h200|b200] [--memory-gb X] [--tflops X] [--hbm-gbps X] [--nvlink-gbps X] "
         "[--ib-gbps X] [--mfu X] [--decode-hbm X] [--prefill-mfu X] [--link-efficiency X] [--context-gb X] "
         "[--response-length-median N] [--json | --comment]")


def _options(argv: list[str]) -> tuple[dict, list[str]]:
    """Split the planner's own options from the config command line."""
    options: dict = {"gpu": "h100", "json": False, "comment": False, "figures": {}, "efficiency": {}, "median": None}
    rest, i = [], 0
    while i < len(argv):
        arg = argv[i]
        name, eq, value = arg.partition("=")
        if name in ("--json", "--comment"):
            options[name[2:]] = True
        elif name in ("--gpu", "--response-length-median", *FIGURES, *EFFICIENCIES):
            if not eq:
                if i + 1 >= len(argv):
                    raise ValueError(f"{name} needs a value")
                i += 1
                value = argv[i]
            if name == "--gpu":
                options["gpu"] = value
            elif name == "--response-length-median":
                if not value.isdigit():
                    raise ValueError(f"{name}={value!r}: give a whole number of tokens")
                options["median"] = int(value)
            else:
                try:
                    number = float(value)
                except ValueError:
                    raise ValueError(f"{name}={value!r}: give a number") from None
                table = options["figures"] if name in FIGURES else options["efficiency"]
                table[(FIGURES | EFFICIENCIES)[name]] = number
        else:
            rest.append(arg)
        i += 1
    return options, rest


def main(argv: list[str]) -> int:
    from megarl.checks import ConfigError, load_config
    from megarl.config.command_line import CommandLineError, parse_command_line
    from megarl.plan import Efficiency, gpu, plan_config
    from megarl.plan.hardware import efficiency_with, with_overrides
    from megarl.plan.report import config_comment, render, to_json

    try:
        options, rest = _options(argv)
        hardware = with_overrides(gpu(options["gpu"]), **options["figures"])
        efficiency = efficiency_with(Efficiency(), **options["efficiency"])
        cmd = parse_command_line(rest, leading_name=True)
    except (ValueError, CommandLineError) as exc:
        print(f"error: {exc}\n{USAGE}", file=sys.stderr)
        return 2
    if cmd.help:
        print(__doc__.strip() + "\n\n" + USAGE)
        return 0
    try:
        cfg = load_config(cmd.name, cmd.overrides, config_path=cmd.config_path)
        plan = plan_config(cfg, hardware, efficiency, response_median=options["median"])
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except ValueError as exc:  # the model directory, or a layout the model cannot take
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if options["comment"]:
        print("\n".join(config_comment(plan, cmd.name)))
    else:
        print(to_json(plan) if options["json"] else render(plan, cmd.name))
    return 0 if plan.fits else 1
