"""verl's command-line forms, shared by ``python -m megarl.trainer.main_ppo``, ``megarl train``
and ``megarl config show``:

    python -m megarl.trainer.main_ppo --config-path=config --config-name=ppo_megatron_trainer.yaml a.b=1 +c.d=2 ~e
    python -m megarl.trainer.main_ppo a.b=1 ...          # override-only: the default config
    megarl train --config-name quickstart a.b=1           # megarl's packaged configs by name
    megarl config show grpo_math.yaml a.b=1               # a leading name is the config name

``--config-path``/``-cp`` and ``--config-name``/``-cn`` take ``=value`` or the next argument, as
Hydra's do; ``--config`` is megarl's older spelling of ``--config-name``. ``--cfg job`` prints the
resolved config and stops (Hydra's flag; ``megarl config show`` does the same). ``--verbose``
(``-v``) shows everything on the console (``trainer.log_level=DEBUG``). Every other argument is
an override in Hydra's grammar.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from megarl.config.compose import DEFAULT_CONFIG

USAGE = ("usage: [--config-path DIR] [--config-name NAME[.yaml]] [--verbose] [key=value | +key=value | ++key=value | "
         "~key ...]\n"
         "  the default config is megarl's ppo_megatron_trainer (verl's default name); see docs/configuration.md")


class CommandLineError(ValueError):
    pass


@dataclass
class CommandLine:
    config_path: str | None = None
    config_name: str | None = None
    overrides: list[str] = field(default_factory=list)
    print_config: bool = False
    help: bool = False
    verbose: bool = False  # --verbose: the console shows everything (trainer.log_level=DEBUG)

    @property
    def name(self) -> str:
        return self.config_name or DEFAULT_CONFIG


OPTIONS = {"--config-path": "config_path", "-cp": "config_path", "--config-name": "config_name",
           "-cn": "config_name", "--config": "config_name"}


def parse_command_line(argv: list[str], leading_name: bool = False) -> CommandLine:
    """Split ``argv`` into the config's path and name and the overrides.

    ``leading_name``: a first argument that is not an option or an override names the config
    (``megarl config show quickstart``).
    """
    cmd = CommandLine()
    args = list(argv)
    i = 0
    while i < len(args):
        arg = args[i]
        option, eq, value = arg.partition("=")
        if option in OPTIONS:
            if not eq:
                if i + 1 >= len(args):
                    raise CommandLineError(f"{option} needs a value\n{USAGE}")
                i += 1
                value = args[i]
            setattr(cmd, OPTIONS[option], value)
        elif arg in ("--cfg", "-c"):
            if i + 1 < len(args) and args[i + 1] in ("job", "all", "hydra"):
                i += 1
            cmd.print_config = True
        elif arg in ("-h", "--help"):
            cmd.help = True
        elif arg in ("-v", "--verbose"):
            cmd.verbose = True
        elif arg in ("-m", "--multirun"):
            raise CommandLineError("--multirun (Hydra sweeps) is not supported: megarl runs one job per launch")
        elif arg.startswith("-"):  # an override never starts with a dash
            raise CommandLineError(f"unknown option {arg}\n{USAGE}")
        elif leading_name and i == 0 and "=" not in arg and not arg.startswith(("~", "+")):
            cmd.config_name = arg
        else:
            cmd.overrides.append(arg)
        i += 1
    return cmd
