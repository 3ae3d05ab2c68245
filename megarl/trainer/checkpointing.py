"""Where checkpoints live and which one a run resumes from (``trainer.resume_mode``).

Layout under ``trainer.default_local_dir``::

    actor/step_<N>/    megatron dist checkpoint of the actor (model, optimizer, LR schedule, RNG)
                       plus the controller state (step, data-loader position, KL controller, config)
    actor/latest       the name of the newest complete step directory (written last, atomically)
    critic/step_<N>/   the critic, when there is one

``auto`` resumes from ``actor/latest`` if it exists and starts fresh otherwise; ``disable``
always starts fresh; ``resume_path`` loads ``trainer.resume_from_path`` (a ``step_<N>``
directory) and fails if it is missing.
"""
from __future__ import annotations

from pathlib import Path


def find_resume_checkpoint(trainer_cfg, root: str | Path) -> tuple[Path, Path | None] | None:
    from megarl.engine import latest_checkpoint

    mode = trainer_cfg.resume_mode
    if mode == "disable":
        return None
    if mode == "resume_path":
        actor = Path(trainer_cfg.resume_from_path)
        if not actor.is_dir():
            raise FileNotFoundError(f"trainer.resume_from_path={actor} is not a checkpoint directory "
                                    "(expected .../actor/step_<N>)")
    else:
        actor = latest_checkpoint(Path(root) / "actor")
        if actor is None:
            return None
    critic = actor.parent.parent / "critic" / actor.name
    return actor, (critic if critic.is_dir() else None)
