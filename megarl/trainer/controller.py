"""The single controller: one readable RL loop over Ray actors.

One step (``RLTrainer.train_step``):

  1. draw a batch of prompts (the loader's position is checkpointed);
  2. rollout: ``rollout.n`` trajectories per prompt through the agent seam (``megarl.agent``): each
     sample's agent loop (single-turn, or multi-turn with tools) generates on the vLLM fleet;
  3. reward: rule or custom functions score the decoded responses, with a reward model or an LLM
     judge when ``reward_model.enable`` (``megarl.rewards.reward_models``; its engines wake for the pass);
  4. the Megatron workers compute old log-probs, reference log-probs and values; distillation teachers
     (``teachers.py``) score the sampled tokens;
  5. advantages: KL-in-reward if enabled, then the registered estimator;
  6. update: critic, then actor (after ``trainer.critic_warmup`` steps);
  7. weight sync: the trainer's shards go to the fleet, versioned (with colocated GPUs the engines
     sleep from after generation until the sync: ``rollout_memory``);
  8. metrics to TensorBoard/console. Around the steps, ``megarl.run.loop.TrainingLoop`` validates
     every ``test_freq`` steps, saves every ``save_freq`` steps and resumes.

Old log-probs: with one update per batch (on-policy: ``ppo_mini_batch_size`` = ``train_batch_size``,
``ppo_epochs=1``) they equal the update's own forward, so the separate pass (step 4) is skipped and
the update uses its forward, detached (``megarl.config.derived.old_log_prob_pass`` names what keeps the pass:
several updates per batch, KL in the reward, dropout, ``actor.recompute_old_log_prob=True``).

``rollout/logprob_diff`` (with ``rollout.weight_sync.verify``, the default) compares the fleet's
log-probs of the sampled tokens with the trainer's, computed with the same weights (the old-log-prob
pass, or the on-policy update's forward before its optimizer step): it checks every step that the
previous weight sync took effect. Every per-token
quantity counts the tokens of the loss mask only: the tokens the model sampled, not tool output.

Asynchronous modes (``async_training.mode``, ``async_loop.py``): the batches come from a producer
that generates ahead of the trainer under a staleness bound (``take``), weights are published
every ``trigger_parameter_sync_step`` steps (``sync_due``); the rest of the step is the same.
Off-policy data is corrected (``algorithm.rollout_correction``, ``off_policy.py``) and its
staleness logged (``training/off_policy/*``).

The reference model (KL terms, SPIN) is the initial model; with ``trainer.ref_update_freq=k`` (verl's
SPIN key) it takes the actor's weights at the start of every k-th step (before its log-prob pass).

Validation scores every row of ``data.val_files``; ``trainer.log_val_generations=N`` also records
N of its samples (prompt, response, ground truth, score) through the metrics logger, the same
prompts every time (picked as verl does: sorted by prompt, shuffled with seed 42).
"""
from __future__ import annotations

import logging
import time
from contextlib import contextmanager
from typing import Any

import numpy as np
import ray
import torch

from megarl.algorithms.mismatch import rollout_mismatch_metrics
from megarl.algorithms import (RolloutCorrection, filter_groups_by_metric, get_kl_controller, masked_mean,
                               need_more_gen_batches, seq_metric_values)
from megarl.rewards import scores_to_token_level
from megarl.rewards.reward_models import ResponsesToScore
from megarl.trainer.advantage_step import compute_advantages, token_level_rewards
from megarl.trainer.megatron_worker import dp_leaders, gather_data_parallel
from megarl.trainer.metrics import agent_metrics, data_metrics, throughput_metrics, timing_metrics
from megarl.trainer.off_policy import correct, staleness_metrics
from megarl.trainer.rollout_batch import PROMPT_COLUMNS, StepData, build_step_data, concat_step_data, reward_extra_info
from megarl.trainer.rollout_memory import RolloutMemory
from megarl.settings.trainer import TrainerSettings
from megarl.trainer.training_safety import refuse_nonfinite_weights

logger = logging.getLogger(__name__)


class RLTrainer:
    """``settings``: what the controller needs from the config (``megarl.settings.trainer.trainer_settings``);
    ``reward``: the run's ``RewardManager``; ``rollout``: the agent seam (``AgentRollout``) on ``fleet``."""

    def __init__(self, settings: TrainerSettings, workers, fleet, weight_sync, tokenizer, train_loader, reward,
                 rollout, val_dataset=None, metrics_logger=None, teachers=None, processor=None):
        from megarl.trainer.asynchronous.batches import AsyncBatches

        self.settings, self.workers, self.fleet, self.weight_sync = settings, workers, fleet, weight_sync
        self.rollout = rollout
        self.tokenizer, self.train_loader, self.val_dataset = tokenizer, train_loader, val_dataset
        self.metrics_logger = metrics_logger
        self.reward = reward
        self.teachers = teachers  # on-policy distillation (megarl.trainer.teachers), or None
        self.processor = processor  # a vision-language model's: the pixel values of the samples' images
        algorithm = settings.algorithm
        k = algorithm.kl_ctrl
        self.kl_ctrl = get_kl_controller(k.type, k.kl_coef, k.target_kl, k.horizon)
        self.use_critic = settings.use_critic
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.global_step = 0
        self.weights_published = True  # the fleet serves the trainer's weights (no update since the last sync)
        self.history: list[dict[str, float]] = []
        self.val_generations: list[dict[str, Any]] = []  # the last validation's samples to log
        self.last_data: StepData | None = None  # the last training step's samples (SampleReporter)
        self.last_val_data: StepData | None = None
        self.reward_extra_keys: list[str] = []  # the reward function's extra values (acc, pred, ...)
        self.coords = workers.call("coords")
        self.leaders = dp_leaders(self.coords)
        self.num_devices = settings.num_devices
        self.correction = RolloutCorrection.from_config(algorithm.rollout_correction)
        self.batches = None if settings.asynchronous is None else AsyncBatches(
            settings.asynchronous, self.rollout, train_loader, weight_sync, n=settings.n, pad_id=self.pad_id,
            response_length=settings.response_length, processor=processor)
        self.in_flight = "wait" if self.batches is None else self.batches.in_flight
        self.rollout_memory = RolloutMemory(fleet, getattr(fleet, "sleep_mode", False), workers,
                                            trainer_offload=settings.trainer_offload, in_flight=self.in_flight)
        self.old_log_prob_pass = settings.old_log_prob_pass  # None: the on-policy update's forward gives them
        self.refresh_after_resume = False  # trainer.ref_update_freq: the reference's weights were not saved
        logger.info("old log-probs: %s", "the rollout's (rollout_correction.bypass_mode)" if self.correction.bypass_mode
                    else f"a separate pass every step ({self.old_log_prob_pass})" if self.old_log_prob_pass
                    else "the update's own forward (one on-policy update per batch; no separate pass)")
        self.total_steps = total_training_steps(settings.trainer, len(train_loader))

    # ------------------------------------------------------------------ worker calls
    def _gather(self, method: str, batch_ref) -> Any:
        """Call ``method`` on every rank; concatenate the data-parallel leaders' results."""
        return gather_data_parallel(self.workers, self.leaders, method, batch_ref)

    def _update(self, method: str, batch_ref) -> dict[str, float]:
        return self.workers.call(method, batch_ref)[self.leaders[0]]

    # ------------------------------------------------------------------ one step
    def rollout_and_score(self, prompt_batch, step: int, timings: dict,
                          prompt_offset: int = 0) -> tuple[StepData, dict[str, float]]:
        """Trajectories for one prompt batch, scored. ``prompt_offset`` numbers its prompts after
        those of the step's earlier batches (DAPO): it enters the seeds and the group ids."""
        cols = prompt_batch.columns()
        n = self.settings.n
        with timer(timings, "gen"):
            trajectories = self.rollout.generate(cols, step=step, n=n, prompt_offset=prompt_offset)
        rows = [i for i in range(len(prompt_batch)) for _ in range(n)]
        uids = [f"{step}:{prompt_offset + i}" for i in rows]
        data = build_step_data(cols, trajectories, rows, uids, self.pad_id, self.settings.response_length,
                               processor=self.processor)
        return data, self._score(data, trajectories, timings)

    def _score(self, data: StepData, trajectories, timings: dict) -> dict[str, float]:
        extras = sorted({k for t in trajectories for k in t.extras})
        model_inputs = None
        if self.reward.model_reward is not None:  # what a reward model reads: the prompts and whole responses
            model_inputs = ResponsesToScore(data["prompt_ids"], [t.response_ids for t in trajectories],
                                            data["raw_prompt"], data["response_text"])
        with timer(timings, "reward"):
            # the overlong penalty counts the whole response budget: model and tool tokens
            result = self.reward.score(data["data_source"], data["response_text"], data["ground_truth"],
                                       reward_extra_info(data, extras), data["response_tokens"].tolist(), model_inputs)
        data.add(score=result.scores, **result.extra)
        self.reward_extra_keys = sorted(result.extra)
        if result.errors:
            logger.warning("%d reward function error(s); first: %s", len(result.errors), result.errors[0])
        return {k: v for k, v in result.metrics.items() if not isinstance(v, str)}

    def next_batch(self, step: int, timings: dict, prompt_offset: int = 0,
                   groups: int | None = None) -> tuple[StepData, dict[str, float]]:
        """One scored batch: generated now (``sync``), or taken from the producer (``groups`` of them)."""
        if self.batches is None:
            return self.rollout_and_score(self.train_loader.next_batch(), step, timings, prompt_offset)
        with timer(timings, "gen"):  # the trainer's wait for finished groups
            data, trajectories = self.batches.take(step, groups)
        return data, self._score(data, trajectories, timings)

    def collect_batch(self, step: int, timings: dict) -> tuple[StepData, dict[str, float]]:
        """A step's data; with DAPO dynamic sampling, groups with all-equal rewards are dropped and
        more prompt batches are generated (taken) until ``data.train_batch_size`` groups remain."""
        fg = self.settings.algorithm.filter_groups
        data, metrics = self.next_batch(step, timings)
        if not fg.enable:
            return data, metrics
        n = self.settings.n
        want = self.settings.train_batch_size
        kept_parts, gen_batches, offset = [], 1, want
        while True:
            scores = scores_to_token_level(data["score"], data.batch.response_mask)
            values = seq_metric_values(fg.metric, token_level_scores=scores, token_level_rewards=scores,
                                       reward_extra_info=data.fields)
            kept, m = filter_groups_by_metric(data["uid"], values)
            for key, value in m.items():
                metrics[key] = metrics.get(key, 0) + value
            kept_parts.append(data.select(kept.tolist()))
            if self.batches is not None:  # the filtered groups' slots go back to the producer
                self.batches.discard((len(data) - len(kept)) // n)
            have = sum(len(p) for p in kept_parts) // n
            if not need_more_gen_batches(have, want, gen_batches, fg.max_num_gen_batches):
                break
            gen_batches += 1
            data, more = self.next_batch(step, timings, prompt_offset=offset, groups=want - have)
            offset += want
            for key, value in more.items():  # error counts add up; means are the last batch's
                metrics[key] = metrics.get(key, 0) + value if key in ("reward/num_errors", "reward/num_timeouts") \
                    else value
        merged = concat_step_data(kept_parts)
        metrics["filter_groups/num_gen_batches"] = gen_batches
        return merged.select(list(range(want * n))), metrics

    def train_step(self, step: int) -> dict[str, float]:
        timings: dict[str, float] = {}
        t0 = time.perf_counter()
        data, metrics = self.collect_batch(step, timings)
        policy_version = self.weight_sync.version if self.batches is None else self.batches.window(step)
        if self.settings.trainer.balance_batch:
            data = self._balance(data, metrics)
        self.last_data = data
        will_sync = step > self.settings.trainer.critic_warmup
        baselines = None
        if self.settings.greedy_baselines:  # ReMax: greedy generations, while the engines are awake
            with timer(timings, "gen"):
                baselines = self._greedy_baselines(data, step)
        self.rollout_memory.release(will_sync)
        batch = data.batch
        mask = batch.response_mask  # the loss mask: model tokens only
        scores = scores_to_token_level(data["score"], mask)
        batch_ref = ray.put(batch)
        profiled = self.settings.profiling is not None and self.settings.profiling.profiles(step)
        if profiled:  # the workers' calls of this step, from the old log-probs to the actor's update
            self.workers.call("profile_begin", step)
        verify = self.settings.verify_sync
        old_log_probs = routed_experts = None
        if self.correction.bypass_mode:  # the rollout's log-probs are the old ones: no forward before the update
            old_log_probs = data["rollout_log_probs"]
        elif self.old_log_prob_pass:
            with timer(timings, "old_log_prob"):
                old_log_probs, entropy, *recorded = self._gather("compute_log_prob", batch_ref)
            routed_experts = recorded[0] if recorded else None  # router replay R2: the update routes by them
            metrics["actor/entropy"] = float(masked_mean(entropy, mask)) if entropy is not None else 0.0
            if verify:  # megarl's rollout/logprob_diff* and verl's training/rollout_probs_diff_*
                metrics.update(rollout_mismatch_metrics(old_log_probs, data["rollout_log_probs"], mask))
        train_mask, is_weights = mask, None
        if old_log_probs is not None:  # without them (on-policy skip) old_log_prob_pass saw no correction to apply
            train_mask, is_weights, correction_metrics = correct(self.correction, old_log_probs,
                                                                 data["rollout_log_probs"], mask)
            metrics.update(correction_metrics)
        ref_log_probs = values = None
        if self.settings.needs_reference:
            with timer(timings, "ref"):
                if self._reference_refresh_due(step):
                    self.workers.call("refresh_reference")
                ref_log_probs = self._gather("compute_ref_log_prob", batch_ref)
        if self.use_critic:
            with timer(timings, "values"):
                values = self._gather("compute_values", batch_ref)
        teacher = {}
        if self.teachers is not None:
            with timer(timings, "teacher"):
                teacher = self.teachers.log_probs(batch, data.fields)  # teacher_log_probs (and the top-k)
            metrics["distillation/teacher_log_prob"] = float(masked_mean(teacher["teacher_log_probs"], mask))
        with timer(timings, "adv"):
            rewards, kl_metrics = token_level_rewards(self.settings.algorithm, scores, mask, old_log_probs, ref_log_probs, self.kl_ctrl)
            metrics.update(kl_metrics)
            advantages, returns = compute_advantages(self.settings.algorithm, rewards, mask, data["uid"], values, baselines,
                                                     old_log_probs, ref_log_probs, metrics, self.settings.dpo_beta)
        fields = dict(advantages=advantages, returns=returns, response_mask=train_mask)
        if old_log_probs is not None:
            fields["old_log_probs"] = old_log_probs
        elif verify:  # the on-policy update measures the sync probe on its own forward
            fields["rollout_log_probs"] = data["rollout_log_probs"]
        if is_weights is not None:
            fields["rollout_is_weights"] = is_weights
        if ref_log_probs is not None:
            fields["ref_log_probs"] = ref_log_probs
        if values is not None:
            fields["values"] = values
        fields.update(teacher)
        if routed_experts is not None:
            fields["routed_experts"] = routed_experts
        train_ref = ray.put(batch.with_fields(**fields))
        if self.use_critic:
            with timer(timings, "update_critic"):
                metrics.update(self._update("update_critic", train_ref))
        if will_sync:
            with timer(timings, "update_actor"):
                metrics.update(self._update("update_actor", train_ref))
        if profiled:
            self.workers.call("profile_end", step)
        if will_sync:
            self.weights_published = False
            if self.batches is None or self.batches.sync_due(step):
                refuse_nonfinite_weights(self.workers, self.coords, ("actor",),
                                         f"sync the weights to the rollout fleet after step {step}", self.settings)
                with timer(timings, "sync"):
                    self.rollout_memory.wake_for_sync()
                    self.fleet.restore()  # lost replicas: replacements start; this sync gives them the weights
                    metrics.update(self.weight_sync.sync(in_flight=self.in_flight))
                self.weights_published = True
                if self.batches is not None:
                    self.batches.published(self.weight_sync.version)
        with timer(timings, "wake"):
            self.rollout_memory.wake_for_rollout()
        timings["step"] = time.perf_counter() - t0
        metrics.update(data_metrics(
            token_level_scores=scores, token_level_rewards=rewards, advantages=advantages, returns=returns,
            response_mask=mask, prompt_lengths=data["prompt_lengths"], response_lengths=data["response_lengths"],
            response_tokens=data["response_tokens"], max_response_length=self.settings.response_length,
            max_prompt_length=self.settings.max_prompt_length, values=values))
        metrics.update(agent_metrics(data.fields))
        metrics.update(staleness_metrics(data["versions"], data["first_version"], mask, policy_version))
        if self.batches is not None:
            metrics.update(self.batches.metrics())
        prompt_tokens, response_tokens = int(data["prompt_lengths"].sum()), int(data["response_tokens"].sum())
        metrics.update(timing_metrics(timings, prompt_tokens, response_tokens))
        metrics.update(throughput_metrics(timings["step"], prompt_tokens + response_tokens, self.num_devices))
        metrics["training/global_step"] = step
        metrics["training/epoch"] = self.train_loader.sampler.epoch
        metrics["rollout/weight_version"] = self.weight_sync.version
        metrics.update(self.fleet.health_metrics())
        return metrics

    def _reference_refresh_due(self, step: int) -> bool:
        """``trainer.ref_update_freq=k``: the reference takes the actor's weights at the start of every k-th step
        (verl's SPIN), and at the first step after a resume that needs it (see ``load_state_dict``)."""
        freq = self.settings.trainer.ref_update_freq
        due = freq > 0 and (step % freq == 0 or self.refresh_after_resume)
        self.refresh_after_resume = False
        return due

    def _balance(self, data: StepData, metrics: dict) -> StepData:
        """``trainer.balance_batch``: reorder so every data-parallel rank's contiguous share has a
        similar token count. Advantages group by uid, so only the order changes."""
        from megarl.engine import balanced_partitions

        dp = len(self.leaders)
        lengths = data.batch.attention_mask.sum(-1)
        parts = balanced_partitions(lengths, dp)
        metrics.update(seqlen_balance_metrics(lengths, parts))
        return data.select([i for part in parts for i in part])

    def _greedy_baselines(self, data: StepData, step: int) -> torch.Tensor:
        """ReMax: the reward of a greedy rollout (the same agent loop) of each sample's prompt."""
        first: dict[str, int] = {}
        for row, uid in enumerate(data["uid"]):
            first.setdefault(uid, row)
        rows = list(first.values())
        prompts = {key: [data[key][r] for r in rows] for key in PROMPT_COLUMNS}
        trajectories = self.rollout.generate(prompts, step=step, n=1, sampling={"do_sample": False, "temperature": 0.0})
        greedy = build_step_data(prompts, trajectories, list(range(len(rows))), list(first), self.pad_id)
        self._score(greedy, trajectories, {})
        per_prompt = torch.tensor(greedy["score"], dtype=torch.float32)
        order = {uid: i for i, uid in enumerate(first)}
        return per_prompt[[order[u] for u in data["uid"]]]

    # ------------------------------------------------------------------ validation
    def validate(self) -> dict[str, float]:
        from megarl.data import collate, iterate_in_order
        from megarl.logging.progress import Progress

        if self.val_dataset is None:
            return {}
        parts, trajectories = [], []
        with Progress("validation", total=len(self.val_dataset), unit="prompts") as progress:
            for items in iterate_in_order(self.val_dataset, self.settings.val_batch_size):
                cols = collate(items)
                got = self.rollout.generate(cols, step=0, validate=True)
                n = len(got) // len(items)
                rows = [i for i in range(len(items)) for _ in range(n)]
                parts.append(build_step_data(cols, got, rows, [str(items[i].index) for i in rows], self.pad_id))
                trajectories += got
                progress.update(len(items))
        data = concat_step_data(parts)
        self._score(data, trajectories, {})
        self.last_val_data = data
        self.val_generations = pick_generations(data["prompt_text"], data["response_text"], data["ground_truth"],
                                                data["score"], self.settings.trainer.log_val_generations)
        scores = np.asarray(data["score"], dtype=np.float64)
        out = {"val/score": float(scores.mean())}
        for source in sorted(set(data["data_source"])):
            picked = [s for s, src in zip(scores, data["data_source"]) if src == source]
            out[f"val-core/{source}/reward/mean@1"] = float(np.mean(picked))
        out.update({f"val/{k}": v for k, v in agent_metrics(data.fields).items()})
        return out

    # ------------------------------------------------------------------ state for checkpoints
    def state_dict(self) -> dict[str, Any]:
        state = {"global_step": self.global_step, "version": self.weight_sync.version,
                 "weights_published": self.weights_published,
                 "data_loader": self.train_loader.state_dict(), "kl_ctrl": self.kl_ctrl.state_dict(),
                 "history": self.history, "config": self.settings.config_record}
        if self.batches is not None:  # the prompts drawn ahead of the trainer, started again on resume
            state["async"] = self.batches.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.global_step = int(state["global_step"])
        # The resume's sync publishes the loaded weights: as the checkpoint's own version when they are
        # that version's (synced after the last update: always so in the synchronous loop), so that the
        # count goes on as in an uninterrupted run; else as a new one.
        version = int(state["version"])
        republish = state.get("weights_published", "async" not in state) and version > 0
        self.weight_sync.resume_at(version - 1 if republish else version)
        self.train_loader.load_state_dict(state["data_loader"])
        self.kl_ctrl.load_state_dict(state["kl_ctrl"])
        self.history = list(state.get("history", []))
        freq, step = self.settings.trainer.ref_update_freq, self.global_step + 1  # the next step
        if self.settings.needs_reference and freq > 0 and 0 < freq * (step // freq) < step:
            logger.warning("trainer.ref_update_freq=%d: the reference takes the resumed actor's weights (after step %d) "
                           "instead of those it took at the start of step %d, which checkpoints do not keep; a resume "
                           "from the checkpoint of a step k*%d - 1 continues exactly", freq, self.global_step,
                           freq * (step // freq), freq)
            self.refresh_after_resume = True
        drawn = state.get("async")
        if self.batches is not None and drawn is not None:
            self.batches.load_state_dict(drawn)
        elif drawn is not None and drawn["untrained"]:
            logger.warning("the checkpoint comes from an asynchronous run with %d prompts drawn but not trained; the "
                           "synchronous loop continues after them (async_training.mode=%s resumes them)",
                           len(drawn["untrained"]), state["config"]["async_training"]["mode"])

    def close(self) -> None:
        """Stop the producer of the asynchronous modes (before the fleet goes) and the reward workers."""
        if self.batches is not None:
            self.batches.close()
        self.reward.close()


def total_training_steps(trainer, batches_per_epoch: int) -> int:
    """``trainer.total_training_steps``, or ``trainer.total_epochs`` epochs of the loader's batches."""
    return trainer.total_training_steps or batches_per_epoch * trainer.total_epochs


def pick_generations(prompts: list[str], responses: list[str], ground_truths: list[Any], scores: list[float],
                     count: int) -> list[dict[str, Any]]:
    """``count`` samples to show, the same prompts at every validation: verl's choice (sorted by
    prompt, then shuffled by ``numpy.random.RandomState(42)``)."""
    if count <= 0:
        return []
    rows = sorted(zip(prompts, responses, ground_truths, scores), key=lambda row: row[0])
    np.random.RandomState(42).shuffle(rows)
    return [{"prompt": p, "response": r, "ground_truth": g, "score": float(s)} for p, r, g, s in rows[:count]]


def seqlen_balance_metrics(lengths: torch.Tensor, parts: list[list[int]]) -> dict[str, float]:
    """verl's ``global_seqlen/*``: tokens per data-parallel rank before (contiguous shares) and after balancing."""
    dp = len(parts)
    before = [int(chunk.sum()) for chunk in lengths.chunk(dp)]
    after = [int(lengths[part].sum()) for part in parts]
    return {"global_seqlen/min": min(before), "global_seqlen/max": max(before),
            "global_seqlen/minmax_diff": max(before) - min(before), "global_seqlen/balanced_min": min(after),
            "global_seqlen/balanced_max": max(after), "global_seqlen/mean": sum(after) / dp}


@contextmanager
def timer(timings: dict, name: str):
    start = time.perf_counter()
    try:
        yield
    finally:
        timings[name] = timings.get(name, 0.0) + time.perf_counter() - start
