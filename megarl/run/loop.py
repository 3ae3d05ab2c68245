"""The loop around the RL steps: resume, validation, metrics, checkpoints.

``TrainingLoop.run`` resumes (``megarl.trainer.resume`` picks the checkpoint; the newest whole one is
loaded and the fleet synced to it; what an earlier run logged after that step is dropped from the
metrics), validates when asked, then runs ``RLTrainer.train_step`` step by step, logging each,
stopping a run whose optimizer steps keep being skipped (``trainer.max_consecutive_skipped_steps``),
warning when the sync probe says the fleet serves other weights (``trainer.stale_weights_warn_threshold``)
and saving every ``trainer.save_freq`` steps (retention after each save; never non-finite weights).
A SIGTERM or SIGUSR1 received during a step (``megarl.run.preemption``) saves that step at its end
and stops the run as an interrupt does. Every step logs ``run/restarts``, the times this run was
restarted after a lost worker (``megarl.run.restarts``). It says on the console what a person
follows and feeds the end-of-run summary.
"""
from __future__ import annotations

import logging
import time

from megarl.logging.console import say
from megarl.logging.progress import Progress, StepProgress, directory_bytes, duration, human
from megarl.run.interrupts import Interrupted
from megarl.run.preemption import Preemption
from megarl.run.summary import RunSummary
from megarl.trainer.checkpointing import prune_checkpoints, save_on_workers
from megarl.trainer.controller import RLTrainer
from megarl.trainer.resume import load_first_whole, resume_plan
from megarl.trainer.training_safety import SkippedSteps, StaleWeights, refuse_nonfinite_weights

logger = logging.getLogger(__name__)


def _fleet_sampling(fleet) -> tuple:
    """(the rollout section, the dtype its engines run in) of a started fleet; (None, None) when unknown."""
    infos = getattr(fleet, "replica_infos", None) or [{}]
    return getattr(fleet, "config", None), infos[0].get("dtype") if isinstance(infos[0], dict) else None


class TrainingLoop:
    """Drives ``RLTrainer`` over steps: validation, metrics, checkpoints and resume.

    It says on the console what a person follows (one line per resume, validation and checkpoint,
    with progress while they run), feeds the end-of-run ``RunSummary`` and, when given one, the
    ``SampleReporter`` (train samples, rollout dumps, the constant-reward hint). ``step`` is the
    step in progress, for the interrupt report. ``preemption`` (the InterruptGuard's) is armed while the
    steps run; ``restarts`` is logged as ``run/restarts`` with every step.
    """

    def __init__(self, trainer: RLTrainer, metrics_logger, checkpoint_root: str, summary=None, samples=None,
                 plan=None):
        self.trainer, self.metrics_logger, self.root = trainer, metrics_logger, checkpoint_root
        self.plan = plan  # a ResumePlan decided (and said) before start-up; None: decided in resume()
        self.summary = summary if summary is not None else RunSummary(trainer.total_steps)
        self.samples = samples
        self.skips = SkippedSteps.from_section(trainer.settings.trainer)  # non-finite gradients: stop a run that has diverged
        self.stale = StaleWeights.for_run(trainer.settings, *_fleet_sampling(getattr(trainer, "fleet", None)))
        self.step = 0
        self.preemption = Preemption(enabled=False)
        self.restarts = 0
        self._checkpoint_bytes: int | None = None  # the last checkpoint's size: the next save's progress total

    def resume(self) -> int:
        """Load the checkpoint ``trainer.resume_mode`` asks for (``megarl.trainer.resume``); return the step
        it holds (0: none). The metrics logged after that step by an earlier run are dropped."""
        t = self.trainer
        plan = self.plan
        if plan is None:
            plan = resume_plan(t.settings.trainer, self.root, t.settings.use_critic)
            for note in plan.notes:
                say("%s", note)
        if plan.first is None:
            start = t.settings.start_source
            if start:  # the actor starts from a megatron checkpoint or a LoRA adapter, the fleet from the HF one
                self._sync_fleet(None, source=str(start))
                say("actor started from %s; fleet synced to it", start)
            return 0
        with Progress(f"loading {plan.first[0]}", total=None) as progress:
            loaded = self._sync_fleet(plan.candidates, source="the resumed checkpoint")
        self._checkpoint_bytes = directory_bytes(*[p for p in loaded if p is not None])
        say("resumed from %s (%s): step %d of %d, in %s", loaded[0], human(self._checkpoint_bytes, "B"),
            t.global_step, t.total_steps, duration(progress.elapsed))
        self.summary.add_history(t.history)
        if self.metrics_logger is not None:
            self.metrics_logger.rewind(t.global_step)
        return t.global_step

    def _sync_fleet(self, candidates: list | None, source: str) -> tuple | None:
        """Outside a step: (load the newest whole checkpoint of ``candidates``, then) sync the fleet, in a
        step's memory order; returns the (actor, critic) loaded. ``source`` names where the weights come from."""
        t = self.trainer
        t.rollout_memory.release(will_sync=True)  # the fleet's weights are about to be rewritten
        loaded = None
        if candidates:
            loaded, state = load_first_whole(
                lambda actor, critic: t.workers.call("load_checkpoint", str(actor), critic and str(critic))[0],
                candidates)
            t.load_state_dict(state)
            source = str(loaded[0])
        refuse_nonfinite_weights(t.workers, t.coords, ("actor",), f"sync the weights of {source} to the rollout fleet",
                                 t.settings)
        t.rollout_memory.wake_for_sync()
        t.weight_sync.sync()  # the fleet must serve the trainer's weights
        t.rollout_memory.wake_for_rollout()
        return loaded

    def save(self, step: int) -> None:
        t = self.trainer
        refuse_nonfinite_weights(t.workers, t.coords, ("actor", "critic") if t.use_critic else ("actor",),
                                 f"save the step-{step} checkpoint", t.settings)
        staging = [f"{self.root}/{role}/step_{step}.tmp" for role in ("actor", "critic")]
        with Progress(f"checkpoint step {step}", total=self._checkpoint_bytes, unit="B",
                      poll=lambda: directory_bytes(*staging)) as progress:
            path = save_on_workers(t.workers, self.root, step, t.state_dict(), t.settings.trainer)
        self._checkpoint_bytes = directory_bytes(path, f"{self.root}/critic/step_{step}")
        seconds = progress.elapsed
        say("checkpoint step %d: %s (%s in %s, %s/s)", step, path, human(self._checkpoint_bytes, "B"),
            duration(seconds), human(self._checkpoint_bytes / max(seconds, 1e-9), "B"))
        prune_checkpoints(f"{self.root}/actor", t.settings.trainer.max_actor_ckpt_to_keep)
        prune_checkpoints(f"{self.root}/critic", t.settings.trainer.max_critic_ckpt_to_keep)

    def validate(self, step: int) -> dict[str, float]:
        t = self.trainer
        start = time.perf_counter()
        metrics = t.validate()
        if metrics:
            sources = {k[len("val-core/"):].removesuffix("/reward/mean@1"): v for k, v in metrics.items()
                       if k.startswith("val-core/")}
            per_source = " (" + ", ".join(f"{s} {v:.3f}" for s, v in sources.items()) + ")" if len(sources) > 1 else ""
            say("validation at step %d: score %.3f%s over %d prompts in %s", step, metrics["val/score"], per_source,
                len(t.val_dataset), duration(time.perf_counter() - start))
            self.summary.record_validation(step, metrics["val/score"])
        self.metrics_logger.log_generations(t.val_generations, step=step)
        if self.samples is not None and t.last_val_data is not None:
            self.samples.on_validation(step, t.last_val_data, t.reward_extra_keys, bool(t.val_generations))
        return metrics

    def run(self) -> dict[str, float]:
        t, cfg, summary = self.trainer, self.trainer.settings.trainer, self.summary
        with summary.timed("start-up"):
            start = self.resume()
        self.step = start
        last: dict[str, float] = {}
        if (cfg.val_only or (start == 0 and cfg.val_before_train)) and t.val_dataset is not None:
            with summary.timed("validation"):
                last = self.validate(start)
            t.history.append({"step": start, **last})
            self.metrics_logger.log(last, step=start, console=False)  # the validation line said it
        if cfg.val_only:
            return last
        with self.preemption.armed():
            return self._steps(start, last)

    def _steps(self, start: int, last: dict[str, float]) -> dict[str, float]:
        t, cfg, summary = self.trainer, self.trainer.settings.trainer, self.summary
        progress = StepProgress(start + 1, t.total_steps)
        for step in range(start + 1, t.total_steps + 1):
            self.step = step
            metrics = t.train_step(step)
            metrics["run/restarts"] = float(self.restarts)
            t.global_step = step
            summary.record_step(step, metrics)
            if self.samples is not None:
                self.samples.on_train_step(step, t.last_data, t.reward_extra_keys)
            if cfg.test_freq > 0 and (step % cfg.test_freq == 0 or step == t.total_steps):
                with summary.timed("validation"):
                    metrics.update(self.validate(step))
            t.history.append({"step": step, **{k: v for k, v in metrics.items()
                                               if k in ("critic/score/mean", "val/score", "critic/vf_loss")}})
            self.metrics_logger.log(metrics, step=step, progress=progress.text(step, metrics.get("perf/total_num_tokens", 0.0)))
            stale = self.stale.record(step, metrics)
            if stale is not None:
                logger.warning("%s", stale)
            diverged = self.skips.record(step, metrics)
            summary.skipped_steps = self.skips.summary()
            if diverged is not None:
                raise self.skips.halt(diverged, t.settings)
            saved = cfg.save_freq > 0 and (step % cfg.save_freq == 0 or step == t.total_steps)
            if saved:
                with summary.timed("checkpoints"):
                    self.save(step)
            last = metrics
            self.stop_if_preempted(step, saved)
        return last

    def stop_if_preempted(self, step: int, saved: bool) -> None:
        """At a step boundary: after a SIGTERM/SIGUSR1 received during the step, save the step (unless it was
        just saved) and stop as an interrupt does (the entry point reports it and exits 128 + the signal)."""
        signum = self.preemption.requested
        if signum is None:
            return
        if not saved:
            with self.summary.timed("checkpoints"):
                self.save(step)
        interrupted = Interrupted(signum)
        say("%s: stopping after the checkpoint of step %d (trainer.save_on_preempt)", interrupted.name, step)
        raise interrupted
