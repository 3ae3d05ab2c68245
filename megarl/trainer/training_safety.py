"""A run that has gone numerically bad stops, saying why, instead of training on, syncing or saving it.

Two guards, fed by the training loop (``megarl.run.loop.TrainingLoop``):

* ``SkippedSteps``: megatron's optimizer step is skipped when the gradient norm is inf/NaN
  (``megarl.engine.optimizer.guarded_step``; ``<role>/skipped_steps`` of ``<role>/optimizer_steps``
  per step). An occasional skip is harmless; ``trainer.max_consecutive_skipped_steps`` training
  steps in a row whose optimizer steps were all skipped (of the actor or the critic) mean the
  weights, the optimizer state or the data produce non-finite gradients every time: the run stops.
* ``refuse_nonfinite_weights``: before every weight sync and every checkpoint save, the trainer
  ranks check that the weights are finite (``megarl.engine.finite``); a NaN would otherwise reach
  the rollout fleet or overwrite a good checkpoint. Nothing is synced or saved then.

Both raise ``TrainingHalted``: the entry point prints its message (the cause, where to look, the
last checkpoint to go back to) and exits with status 1.

One more watch only warns: ``StaleWeights``. Every step that runs the sync probe logs
``rollout/logprob_diff`` (the mean absolute difference between the fleet's log-probs of the sampled
tokens and the trainer's, same weights after a correct sync); above
``trainer.stale_weights_warn_threshold`` the fleet may serve stale or partly loaded weights, and the
console says so at the first such step and every ``STALE_WEIGHTS_REPEAT``-th after.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

ROLES = ("actor", "critic")
LOOK_AT = "Look at the learning rate ({lr}), the data, and the checkpoint the run started or resumed from"


class TrainingHalted(RuntimeError):
    """The run stopped itself: its gradients or weights are not finite. The message says why and what next."""


@dataclass
class SkippedSteps:
    limit: int  # trainer.max_consecutive_skipped_steps; 0: never stop
    skipped: dict[str, int] = field(default_factory=dict)  # optimizer steps skipped since the start, per role
    tried: dict[str, int] = field(default_factory=dict)
    streak: dict[str, list[int]] = field(default_factory=dict)  # the current run of all-skipped training steps

    @classmethod
    def from_section(cls, trainer) -> "SkippedSteps":
        """From the typed ``trainer`` section (``max_consecutive_skipped_steps``)."""
        return cls(int(trainer.max_consecutive_skipped_steps))

    def record(self, step: int, metrics: dict) -> str | None:
        """Count a training step's optimizer steps; the role whose streak reached the limit, if any."""
        for role in ROLES:
            tried = int(metrics.get(f"{role}/optimizer_steps", 0))
            if not tried:
                continue  # the role did not train this step (no critic, critic warm-up)
            skipped = int(metrics.get(f"{role}/skipped_steps", 0))
            self.tried[role] = self.tried.get(role, 0) + tried
            self.skipped[role] = self.skipped.get(role, 0) + skipped
            self.streak[role] = self.streak.get(role, []) + [step] if skipped == tried else []
        return next((role for role in ROLES if self.limit > 0 and len(self.streak.get(role, [])) >= self.limit), None)

    def summary(self) -> str:
        """``actor 11 of 12`` for the roles that skipped any (empty when none did)."""
        return ", ".join(f"{role} {self.skipped[role]} of {self.tried[role]}" for role in ROLES if self.skipped.get(role))

    def halt(self, role: str, settings) -> TrainingHalted:
        steps = self.streak[role]
        span = f"steps {steps[0]}-{steps[-1]}" if len(steps) > 1 else f"step {steps[0]}"
        return TrainingHalted(
            f"training stopped at step {steps[-1]}: the {role}'s optimizer skipped every step of {len(steps)} training "
            f"steps in a row ({span}; trainer.max_consecutive_skipped_steps={self.limit}) because its gradients are "
            f"not finite (inf/NaN), {self.skipped[role]} of {self.tried[role]} optimizer steps since the start. "
            + LOOK_AT.format(lr=f"{_section(role)}.optim.lr={settings.lrs.get(role)}") + ". "
            + last_checkpoint_note(settings.trainer, before=steps[0]))


def refuse_nonfinite_weights(workers, coords: list[dict], roles: tuple[str, ...], action: str, settings) -> None:
    """Raise ``TrainingHalted`` unless every weight of ``roles`` is finite on every trainer rank.

    ``action`` is what would have happened ("sync the weights to the rollout fleet after step 3");
    ``settings`` (``TrainerSettings``) gives the learning rates and the checkpoint directory the message names."""
    reports = workers.call("nonfinite_params", list(roles))
    for role in roles:
        count = reports[0][role]["count"]  # the same on every rank: all-reduced
        if not count:
            continue
        rank, first = next((i, r[role]["first"]) for i, r in enumerate(reports) if r[role]["first"])
        where = coords[rank]
        raise TrainingHalted(
            f"refusing to {action}: the {role}'s weights hold non-finite values (inf/NaN), first in {first} (trainer "
            f"rank {where['rank']}: pipeline stage {where['pp']}, tensor rank {where['tp']}), {count} tensor(s) in all; "
            "nothing was synced or saved. " + LOOK_AT.format(lr=f"{_section(role)}.optim.lr={settings.lrs.get(role)}")
            + "; the actor's skipped optimizer steps (actor/skipped_steps) show when the gradients went bad. "
            + last_checkpoint_note(settings.trainer))


def last_checkpoint_note(trainer, before: int | None = None) -> str:
    """Where to go back to: the run's latest checkpoint, and what resumes from it."""
    from megarl.trainer.checkpointing import latest_checkpoint_step

    latest = latest_checkpoint_step(trainer.default_local_dir)
    if latest is None:
        return "The run has no checkpoint yet."
    step, path = latest
    note = f"Last checkpoint: step {step} at {path}"
    if before is not None and step >= before:
        note += (f" (saved during the skipped steps: it holds the weights of step {before - 1}, whose gradients were "
                 "not finite; an earlier checkpoint may be the one to go back to)")
    return note + "; trainer.resume_mode=resume_path trainer.resume_from_path=<a step_N directory> resumes from one."


def _section(role: str) -> str:
    return "actor_rollout_ref.actor" if role == "actor" else "critic"


# The mean |fleet - trainer| log-prob a correct sync stays under, by the rollout's dtype: float32 differs by
# ~1e-6 (the CPU tests), bf16 kernels by a few hundredths; stale or partly loaded weights by ~1.
STALE_WEIGHTS_THRESHOLDS = {"float32": 1e-3, "bfloat16": 0.1, "float16": 0.1}
STALE_WEIGHTS_REPEAT = 10  # warn at the first step over the threshold, then at every 10th such step


@dataclass
class StaleWeights:
    """Warns when the sync probe says the fleet's weights are not the trainer's (see the module docstring)."""

    threshold: float  # on rollout/logprob_diff; 0: off
    source: str = ""  # where the threshold comes from, for the message
    off: str | None = None  # why the watch is off (asynchronous modes, truncated sampling, no probe)
    every: int = STALE_WEIGHTS_REPEAT
    steps: list[int] = field(default_factory=list)  # the steps over the threshold so far

    @classmethod
    def for_run(cls, settings, rollout: Any = None, dtype: str | None = None) -> "StaleWeights":
        """From ``TrainerSettings`` (``trainer.stale_weights_warn_threshold``, the probe, the async mode), the
        rollout section (``top_p``, ``top_k``) and the dtype the fleet's engines run in (None: unknown)."""
        chosen = settings.trainer.stale_weights_warn_threshold
        dtype = str(dtype).removeprefix("torch.") if dtype else None  # replicas report torch's name: torch.bfloat16
        if chosen is not None:
            threshold, source = float(chosen), f"trainer.stale_weights_warn_threshold={chosen}"
        else:
            threshold = STALE_WEIGHTS_THRESHOLDS.get(str(dtype), STALE_WEIGHTS_THRESHOLDS["bfloat16"])
            source = f"the default for {dtype or 'an unknown dtype'}"
        off = None
        if not settings.verify_sync:
            off = "actor_rollout_ref.rollout.weight_sync.verify=False: no probe"
        elif settings.asynchronous is not None:
            off = "asynchronous training: samples come from older weights by design"
        elif rollout is not None and getattr(rollout, "do_sample", True) and (
                float(getattr(rollout, "top_p", 1.0)) < 1 or int(getattr(rollout, "top_k", -1)) > 0):
            off = "top_p/top_k sampling: the trainer's log-probs are lower by the mass cut off"
        elif threshold <= 0:
            off = "trainer.stale_weights_warn_threshold=0"
        return cls(threshold, source, off)

    def record(self, step: int, metrics: dict) -> str | None:
        """The warning to print for this step's metrics, or None."""
        diff = metrics.get("rollout/logprob_diff")
        if self.off is not None or diff is None or not diff > self.threshold:
            return None
        self.steps.append(step)
        if (len(self.steps) - 1) % self.every:
            return None
        worst = metrics.get("rollout/logprob_diff_max")
        count = len(self.steps)
        return (f"step {step}: rollout/logprob_diff={diff:.3g}" + (f" (max {worst:.3g})" if worst is not None else "")
                + f" is above {self.threshold:g} ({self.source}): the rollout fleet's log-probs of the sampled tokens "
                "differ from the trainer's, so it may be serving stale or partly loaded weights. Check the weight "
                "sync's lines in the log (versions, errors), that the fleet and the trainer use the same dtype and "
                "temperature, and docs/troubleshooting.md (Weight sync mismatch). "
                + (f"{count} steps over it so far; " if count > 1 else "")
                + f"said again every {self.every} such steps.")
