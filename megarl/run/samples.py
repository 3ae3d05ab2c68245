"""What the model generated, shown to a person: train samples, rollout dumps, a hint when rewards say nothing.

* ``trainer.log_train_generations=N`` (megarl's key, the train-side twin of verl's
  ``log_val_generations``) records N samples of a training step every
  ``trainer.log_train_generations_freq`` steps (prompt, response, ground truth, score; the first
  sample of each of the step's first N prompts): printed on the console, written as TensorBoard
  text (``train/generations``) and appended to ``<default_local_dir>/train_generations.jsonl``.
* ``trainer.rollout_data_dir`` / ``trainer.validation_data_dir`` (verl's keys) dump every sample of
  every training step / validation to ``<dir>/<step>.jsonl``, one JSON object per sample with
  verl's fields: ``input`` (the prompt as the model saw it), ``output``, ``gts``, ``score``,
  ``step`` and the reward function's extra values (``acc``, ``pred``, ...).
* When every sample of the first ``HINT_STEPS`` training steps a run takes (a resumed run's too)
  gets the same reward of 0 or less, one hint names a sample and what the reward function accepts
  (``megarl.rewards.diagnose``).
"""
from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Sequence

from megarl.logging.console import say
from megarl.logging.metrics_logger import TRAIN_GENERATIONS_FILE

logger = logging.getLogger(__name__)

HINT_STEPS = 2


def dump_generations(directory: str | Path, step: int, data, reward_keys: Sequence[str]) -> Path:
    """verl's ``_dump_generations``: every sample of ``data`` as one JSON line of ``<directory>/<step>.jsonl``."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{step}.jsonl"
    extras = [k for k in reward_keys if k in data]
    with open(path, "w", encoding="utf-8") as out:
        for i in range(len(data)):
            entry = {"input": data["prompt_text"][i], "output": data["response_text"][i],
                     "gts": data["ground_truth"][i], "score": float(data["score"][i]), "step": step}
            entry.update({k: _scalar(data[k][i]) for k in extras})
            out.write(json.dumps(entry, ensure_ascii=False, default=str) + "\n")
    return path


def _scalar(value: Any) -> Any:
    return value.item() if hasattr(value, "item") and getattr(value, "ndim", 1) == 0 else value


def first_samples(data, count: int) -> list[dict[str, Any]]:
    """The first sample of each of the first ``count`` prompts (groups) of a step."""
    seen: list[int] = []
    groups: set[str] = set()
    for i, uid in enumerate(data["uid"]):
        if uid not in groups:
            groups.add(uid)
            seen.append(i)
            if len(seen) == count:
                break
    return [{"prompt": data["prompt_text"][i], "response": data["response_text"][i],
             "ground_truth": data["ground_truth"][i], "score": float(data["score"][i])} for i in seen]


class SampleReporter:
    """Fed each training step's and validation's step data by the training loop."""

    def __init__(self, cfg, metrics_logger, reward_manager):
        self.cfg = cfg
        self.trainer_cfg = cfg.trainer
        self.metrics_logger = metrics_logger
        self.reward = reward_manager
        self._watch: list[tuple[int, Any]] | None = []  # (step, data) while every reward is the same; None: done
        self.files: list[Path] = []  # what it wrote, for the summary

    def on_train_step(self, step: int, data, reward_keys: Sequence[str]) -> None:
        t = self.trainer_cfg
        if t.rollout_data_dir:
            self._note(dump_generations(t.rollout_data_dir, step, data, reward_keys).parent)
        count, freq = t.log_train_generations, t.log_train_generations_freq
        if count > 0 and freq > 0 and step % freq == 0:
            self.metrics_logger.log_generations(first_samples(data, count), step=step, title="train/generations",
                                                file_name=TRAIN_GENERATIONS_FILE)
            self._note(Path(t.default_local_dir) / TRAIN_GENERATIONS_FILE)
        self._watch_rewards(step, data)

    def on_validation(self, step: int, data, reward_keys: Sequence[str], logged_samples: bool) -> None:
        t = self.trainer_cfg
        if t.validation_data_dir:
            self._note(dump_generations(t.validation_data_dir, step, data, reward_keys).parent)
        if logged_samples:
            from megarl.logging import GENERATIONS_FILE

            self._note(Path(t.default_local_dir) / GENERATIONS_FILE)

    def _note(self, path: Path) -> None:
        if path not in self.files:
            self.files.append(path)

    def _watch_rewards(self, step: int, data) -> None:
        """The first ``HINT_STEPS`` steps this process trains (a resumed run's too)."""
        if self._watch is None:
            return
        scores = [float(s) for s in data["score"]]
        first = float(self._watch[0][1]["score"][0]) if self._watch else scores[0]
        if any(s != first for s in scores) or first > 0:
            self._watch = None  # the reward varies (or is positive everywhere): nothing to explain
            return
        self._watch.append((step, data))
        if len(self._watch) == HINT_STEPS:
            try:
                say("%s", self._hint(first))
            except Exception as exc:  # a hint must never end a run
                logger.warning("could not work out why every reward is %g: %s", first, exc)
            self._watch = None

    def _hint(self, value: float) -> str:
        from megarl.rewards.diagnose import constant_reward_hint
        from megarl.settings.derived import critic_enabled

        steps = [step for step, _ in self._watch]
        parts = [data for _, data in self._watch]
        column = lambda name: [v for d in parts for v in d[name]]  # noqa: E731

        def score(sources, texts, truths, extras):
            return list(self.reward.score(sources, texts, truths, extras, [1] * len(texts)).scores)

        custom = self.cfg.custom_reward_function
        source = parts[0]["data_source"][0]
        name = (f"{custom.name} in {custom.path} (custom_reward_function)" if custom.path else
                f"megarl's rule reward for data_source {source!r}")
        return constant_reward_hint(score, name, value, steps, column("prompt_text"), column("response_text"),
                                    column("ground_truth"), column("data_source"), column("extra_info"),
                                    column("finish_reason"), self.cfg.actor_rollout_ref.rollout.response_length,
                                    critic=critic_enabled(self.cfg))
