"""The optimizer keys of each trained role (the actor; the critic when it runs), before any process starts.

Without these checks a bad value surfaces only once the trainer ranks build their optimizer, 90 s
or more into a launch, as torch's ``Invalid learning rate: -0.001`` or megatron's bare
``assert self.max_lr >= self.min_lr``. The rules are those of torch's Adam (``lr``, ``eps`` and
``weight_decay`` >= 0, each beta in [0, 1)) and of megatron's ``OptimizerParamScheduler``
(``0 <= min_lr <= lr``, ``lr_warmup_init <= lr``); a NaN fails every one of them. ``lr=0`` is
allowed, as in verl (a role that does not learn), with a note.
"""
from __future__ import annotations

import math

from megarl.settings.derived import critic_enabled
from megarl.config.errors import Problem, refusal


def optimizer_problems(cfg, notes: list[str]) -> list[Problem]:
    from megarl.engine.settings import DECAY_STYLES

    problems: list[Problem] = []
    for section in ("actor_rollout_ref.actor", "critic"):
        if section == "critic" and not critic_enabled(cfg):
            continue
        optim = cfg.actor_rollout_ref.actor.optim if section != "critic" else cfg.critic.optim
        style = optim.lr_decay_style or optim.warmup_style
        key = f"{section}.optim.{'lr_decay_style' if optim.lr_decay_style else 'warmup_style'}"
        if style not in DECAY_STYLES:
            problems.append(Problem(f"{key}={style!r}: LR schedules are {DECAY_STYLES}.", key=key))
        if optim.optimizer != "adam":
            problems.append(refusal(f"{section}.optim.optimizer={optim.optimizer}", "optimizers other than Adam",
                                    "megarl trains with megatron's (distributed) Adam"))
        if len(optim.betas) != 2:
            problems.append(Problem(f"{section}.optim.betas={list(optim.betas)}: give two values, e.g. [0.9, 0.999].",
                                    key=f"{section}.optim.betas"))
        problems += _value_problems(f"{section}.optim", optim)
        if optim.lr == 0:
            notes.append(f"{section}.optim.lr=0: that role's weights never change")
    return problems


def _value_problems(prefix: str, optim) -> list[Problem]:
    found: list[tuple[str, str]] = []
    lr = optim.lr
    if not (math.isfinite(lr) and lr >= 0):
        found.append(("lr", f"lr={lr}: the learning rate must be a finite number >= 0 (a negative one ascends the "
                            "loss); verl's actor default is 1e-6, its critic's 1e-5"))
    min_lr = lr * optim.min_lr_ratio if optim.min_lr_ratio is not None else optim.min_lr
    what = f"min_lr_ratio={optim.min_lr_ratio} gives min_lr={min_lr:g}" if optim.min_lr_ratio is not None \
        else f"min_lr={min_lr}"
    if not 0 <= min_lr <= max(lr, 0):
        found.append(("min_lr_ratio" if optim.min_lr_ratio is not None else "min_lr",
                      f"{what}: the schedule's floor must lie in [0, lr={lr}]"))
    if not 0 <= optim.lr_warmup_init <= max(lr, 0):
        found.append(("lr_warmup_init", f"lr_warmup_init={optim.lr_warmup_init}: the warmup starts in [0, lr={lr}]"))
    for key in ("eps", "weight_decay"):
        if not optim[key] >= 0:
            found.append((key, f"{key}={optim[key]}: must be >= 0"))
    if len(optim.betas) == 2 and not all(0 <= beta < 1 for beta in optim.betas):
        found.append(("betas", f"betas={list(optim.betas)}: each must lie in [0, 1), e.g. [0.9, 0.999]"))
    return [Problem(f"{prefix}.{message}.", key=f"{prefix}.{key}") for key, message in found]
