"""Which checkpoint a run resumes from, decided before any process starts.

The candidates are the ``step_<N>`` directories under ``<trainer.default_local_dir>/actor``, newest
first; with a critic, a step counts only when ``critic/step_<N>`` is there too (the worker saves the
critic first and the actor last, and ``actor/latest`` moves only after both, but a step is still
judged by both directories). A step is usable when each directory is complete (its
``megarl_checkpoint.json`` is written before the rename) and every file has the size its manifest
records (``megarl.engine.checkpoint_problems``: a stat per file, no data read). ``actor/latest`` is
not trusted blindly: a ``latest`` naming an interrupted or damaged save only means an older step.

``trainer.resume_mode``:

* ``auto``: the newest usable step; each newer step passed over is named with its reason, and the
  step used instead. When step directories exist but none is usable, the run is refused: it never
  starts over on top of checkpoints unless ``resume_mode=disable`` says so;
* ``disable``: start over; the checkpoints there are replaced as the run saves (said once);
* ``resume_path``: ``trainer.resume_from_path`` (``.../actor/step_<N>``) and its critic; refused when
  not usable.

Checksums are read when the workers load (each rank hashes a share of the files); a mismatch there
makes ``TrainingLoop.resume`` go on to the next candidate of the ``ResumePlan``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

SHOWN = 4  # problems named per refusal


class ResumeError(ValueError):
    """The checkpoints present cannot be resumed and starting over would overwrite them (or the
    checkpoint ``resume_from_path`` names is not usable)."""


@dataclass
class ResumePlan:
    candidates: list[tuple[Path, Path | None]]  # usable (actor, critic) step directories, newest first
    notes: list[str] = field(default_factory=list)  # what to say before starting: steps passed over, ...

    @property
    def first(self) -> tuple[Path, Path | None] | None:
        return self.candidates[0] if self.candidates else None


def critic_partner(actor: Path) -> Path:
    return actor.parent.parent / "critic" / actor.name


def step_problems(actor: Path, critic: bool) -> list[str]:
    """Why the step of ``actor`` (and, with a critic, its partner) cannot be resumed; [] if it can."""
    from megarl.engine import checkpoint_problems

    problems = [f"{actor}: {p}" for p in checkpoint_problems(actor)]
    if critic:
        partner = critic_partner(actor)
        if partner.is_dir():
            problems += [f"{partner}: {p}" for p in checkpoint_problems(partner)]
        elif partner.with_name(partner.name + ".tmp").is_dir():
            problems.append(f"{partner} was not finished ({partner.name}.tmp: its save was interrupted)")
        else:
            problems.append(f"{partner} is missing (the run stopped between the actor's and the critic's saves)")
    return problems


def existing_steps(root: str | Path) -> list[Path]:
    """The ``step_<N>`` directories of both roles under ``root`` (complete or not)."""
    from megarl.engine import step_directories

    return [p for role in ("actor", "critic") for p in step_directories(Path(root) / role)]


def resume_plan(trainer_cfg, root: str | Path, critic: bool = False) -> ResumePlan:
    """The checkpoints this run may resume from (``trainer.resume_mode``; ``critic``: the run has one)."""
    from megarl.engine import step_directories

    root = Path(root)
    mode = trainer_cfg.resume_mode
    if mode == "disable":
        existing = existing_steps(root)
        note = (f"trainer.resume_mode=disable: starting over in {root}; its checkpoints "
                f"({', '.join(sorted({p.name for p in existing}))}) are replaced as this run saves") if existing else None
        return ResumePlan([], [note] if note else [])
    if mode == "resume_path":
        return _given_path(Path(trainer_cfg.resume_from_path), critic)
    candidates, passed = [], []
    for actor in step_directories(root / "actor"):
        problems = step_problems(actor, critic)
        if not problems:
            candidates.append((actor, critic_partner(actor) if critic else None))
        elif not candidates:
            passed.append("; ".join(problems))
    if not candidates:
        existing = existing_steps(root)
        if existing:
            raise ResumeError(
                f"trainer.default_local_dir={root} holds checkpoints ({', '.join(str(p.relative_to(root)) for p in existing)}) "
                f"but none can be resumed: {'; '.join(passed[:SHOWN]) or 'no actor checkpoint'}. Starting over would "
                "overwrite them: set trainer.resume_mode=disable to start over anyway, or trainer.resume_mode=resume_path "
                "with trainer.resume_from_path=.../actor/step_<N> for one of them")
        return ResumePlan([])
    used = candidates[0][0]
    notes = [f"checkpoint not usable: {reason}; resuming from {used} instead" for reason in passed]
    return ResumePlan(candidates, notes)


def _given_path(actor: Path, critic: bool) -> ResumePlan:
    if not actor.is_dir():
        raise FileNotFoundError(f"trainer.resume_from_path={actor} is not a checkpoint directory "
                                "(expected .../actor/step_<N>)")
    problems = step_problems(actor, critic)
    if problems:
        usable = [p for p in _siblings(actor) if not step_problems(p, critic)]
        hint = f"; the newest usable one there is {usable[0]}" if usable else ""
        raise ResumeError(f"trainer.resume_from_path={actor} cannot be resumed: {'; '.join(problems[:SHOWN])}{hint}")
    return ResumePlan([(actor, critic_partner(actor) if critic else None)])


def _siblings(actor: Path) -> list[Path]:
    from megarl.engine import step_directories

    return step_directories(actor.parent)


def find_resume_checkpoint(trainer_cfg, root: str | Path, critic: bool = False) -> tuple[Path, Path | None] | None:
    """The (actor, critic) step a run resumes from (None: it starts fresh); see ``resume_plan``."""
    return resume_plan(trainer_cfg, root, critic).first


def load_first_whole(load: Callable[[Path, Path | None], Any], candidates: list[tuple[Path, Path | None]]):
    """``load(actor, critic)`` on the newest candidate whose files pass their checksums (the workers
    check before loading anything); each one that fails is said, with the one tried next.
    Returns ``((actor, critic), what load returned)``."""
    from megarl.engine import integrity_error
    from megarl.logging.console import say

    for index, (actor, critic) in enumerate(candidates):
        try:
            return (actor, critic), load(actor, critic)
        except Exception as exc:
            damaged = integrity_error(exc)
            if damaged is None:
                raise
            if index + 1 == len(candidates):
                raise ResumeError(f"{damaged}; no older usable checkpoint is left (set trainer.resume_mode=disable to "
                                  "start over)") from None
            say("%s; resuming from %s instead", damaged, candidates[index + 1][0])
