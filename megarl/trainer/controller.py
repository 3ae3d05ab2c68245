"""The single controller: one readable RL loop over Ray actors.

One step (``RLTrainer.train_step``):

  1. draw a batch of prompts (the loader's position is checkpointed);
  2. rollout: the vLLM fleet generates ``rollout.n`` responses per prompt;
  3. reward: rule or custom functions score the decoded responses;
  4. the Megatron workers compute old log-probs, reference log-probs and values;
  5. advantages: KL-in-reward if enabled, then the registered estimator;
  6. update: critic, then actor (after ``trainer.critic_warmup`` steps);
  7. weight sync: the trainer's shards go to the fleet, versioned (with colocated GPUs the engines
     sleep from after generation until the sync: ``rollout_memory``);
  8. metrics to TensorBoard/console; validation every ``test_freq``; checkpoint every ``save_freq``.

``rollout/logprob_diff`` (with ``rollout.weight_sync.verify``, the default) compares the fleet's
log-probs of the sampled tokens with the trainer's old log-probs, which are computed with the
same weights: it checks every step that the previous weight sync took effect.

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
from omegaconf import DictConfig, OmegaConf

from megarl.algorithms import filter_groups_by_metric, get_kl_controller, need_more_gen_batches, seq_metric_values
from megarl.config import critic_enabled, devices_for
from megarl.rewards import RewardManager, scores_to_token_level
from megarl.trainer.advantage_step import compute_advantages, token_level_rewards
from megarl.trainer.megatron_worker import dp_leaders, gather_data_parallel, initial_checkpoints
from megarl.trainer.metrics import data_metrics, throughput_metrics, timing_metrics
from megarl.trainer.offload_phases import offload_flags
from megarl.trainer.rollout_batch import StepData, build_step_data
from megarl.trainer.rollout_memory import RolloutMemory

logger = logging.getLogger(__name__)


class RLTrainer:
    def __init__(self, cfg: DictConfig, workers, fleet, weight_sync, tokenizer, train_loader, val_dataset=None,
                 metrics_logger=None):
        self.cfg, self.workers, self.fleet, self.weight_sync = cfg, workers, fleet, weight_sync
        self.tokenizer, self.train_loader, self.val_dataset = tokenizer, train_loader, val_dataset
        self.metrics_logger = metrics_logger
        self.reward = RewardManager.from_config(cfg)
        self.kl_ctrl = get_kl_controller(cfg.algorithm.kl_ctrl)
        self.use_critic = critic_enabled(cfg)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.global_step = 0
        self.version = 0
        self.history: list[dict[str, float]] = []
        self.val_generations: list[dict[str, Any]] = []  # the last validation's samples to log
        self.coords = workers.call("coords")
        self.leaders = dp_leaders(self.coords)
        self.num_devices = devices_for(cfg)[0]
        self.rollout_memory = RolloutMemory(fleet, getattr(fleet, "sleep_mode", False), workers,
                                            trainer_offload=any(offload_flags(cfg).values()))
        per_epoch = len(train_loader)
        self.total_steps = cfg.trainer.total_training_steps or per_epoch * cfg.trainer.total_epochs

    # ------------------------------------------------------------------ worker calls
    def _gather(self, method: str, batch_ref) -> Any:
        """Call ``method`` on every rank; concatenate the data-parallel leaders' results."""
        return gather_data_parallel(self.workers, self.leaders, method, batch_ref)

    def _update(self, method: str, batch_ref) -> dict[str, float]:
        results = ray.get([getattr(a, method).remote(batch_ref) for a in self.workers.actors])
        return results[self.leaders[0]]

    # ------------------------------------------------------------------ one step
    def rollout_and_score(self, prompt_batch, step: int, timings: dict) -> StepData:
        cols = prompt_batch.columns()
        rollout = self.cfg.actor_rollout_ref.rollout
        with timer(timings, "gen"):
            samples = self.fleet.generate(cols["prompt_ids"], n=rollout.n, step=step)
        data = build_step_data(cols, samples, self.pad_id, step, rollout.response_length)
        with timer(timings, "reward"):
            result = self.reward.score(data.data_source, data.response_text, data.ground_truth, data.extra_info,
                                       data.response_lengths.tolist())
        data.fields["score"] = result.scores
        data.fields.update(result.extra)
        data.fields["_reward_metrics"] = [result.metrics] * len(data)
        if result.errors:
            logger.warning("step %d: %d reward function error(s); first: %s", step, len(result.errors),
                           result.errors[0])
        return data

    def collect_batch(self, step: int, timings: dict) -> tuple[StepData, dict[str, float]]:
        """A step's data; with DAPO dynamic sampling, groups with all-equal rewards are dropped and
        more prompt batches are generated until ``data.train_batch_size`` groups remain."""
        fg = self.cfg.algorithm.filter_groups
        data = self.rollout_and_score(self.train_loader.next_batch(), step, timings)
        if not fg.enable:
            return data, {}
        n = self.cfg.actor_rollout_ref.rollout.n
        want = self.cfg.data.train_batch_size
        kept_parts, metrics, gen_batches = [], {}, 1
        while True:
            scores = scores_to_token_level(data.fields["score"], data.batch.response_mask)
            values = seq_metric_values(fg.metric, token_level_scores=scores, token_level_rewards=scores,
                                       reward_extra_info={k: v for k, v in data.fields.items() if not k.startswith("_")})
            kept, m = filter_groups_by_metric(data.uid, values)
            for key, value in m.items():
                metrics[key] = metrics.get(key, 0) + value
            kept_parts.append(data.select(kept.tolist()))
            have = sum(len(p) for p in kept_parts) // n
            if not need_more_gen_batches(have, want, gen_batches, fg.max_num_gen_batches):
                break
            gen_batches += 1
            data = self.rollout_and_score(self.train_loader.next_batch(), step * 1000 + gen_batches, timings)
        merged = concat_step_data(kept_parts)
        metrics["filter_groups/num_gen_batches"] = gen_batches
        return merged.select(list(range(want * n))), metrics

    def train_step(self, step: int) -> dict[str, float]:
        timings: dict[str, float] = {}
        t0 = time.perf_counter()
        data, metrics = self.collect_batch(step, timings)
        if self.cfg.trainer.balance_batch:
            data = self._balance(data, metrics)
        will_sync = step > self.cfg.trainer.critic_warmup
        baselines = None
        if self.cfg.algorithm.adv_estimator == "remax":  # greedy generations, while the engines are awake
            with timer(timings, "gen"):
                baselines = self._greedy_baselines(data, step)
        self.rollout_memory.release(will_sync)
        batch = data.batch
        mask = batch.response_mask
        scores = scores_to_token_level(data.fields["score"], mask)
        batch_ref = ray.put(batch)
        with timer(timings, "old_log_prob"):
            old_log_probs, entropy = self._gather("compute_log_prob", batch_ref)
        metrics["actor/entropy"] = masked_mean(entropy, mask) if entropy is not None else 0.0
        if self.cfg.actor_rollout_ref.rollout.weight_sync.verify:
            metrics["rollout/logprob_diff"] = masked_mean((old_log_probs - data.rollout_log_probs).abs(), mask)
            metrics["rollout/logprob_diff_max"] = float(((old_log_probs - data.rollout_log_probs).abs() * mask).max())
        ref_log_probs = values = None
        if self.cfg.actor_rollout_ref.actor.use_kl_loss or self.cfg.algorithm.use_kl_in_reward:
            with timer(timings, "ref"):
                ref_log_probs = self._gather("compute_ref_log_prob", batch_ref)
        if self.use_critic:
            with timer(timings, "values"):
                values = self._gather("compute_values", batch_ref)
        with timer(timings, "adv"):
            rewards, kl_metrics = token_level_rewards(self.cfg, scores, mask, old_log_probs, ref_log_probs, self.kl_ctrl)
            metrics.update(kl_metrics)
            advantages, returns = compute_advantages(self.cfg, rewards, mask, data.uid, values, baselines)
        fields = dict(old_log_probs=old_log_probs, advantages=advantages, returns=returns)
        if ref_log_probs is not None:
            fields["ref_log_probs"] = ref_log_probs
        if values is not None:
            fields["values"] = values
        train_ref = ray.put(batch.with_fields(**fields))
        if self.use_critic:
            with timer(timings, "update_critic"):
                metrics.update(self._update("update_critic", train_ref))
        if will_sync:
            with timer(timings, "update_actor"):
                metrics.update(self._update("update_actor", train_ref))
            with timer(timings, "sync"):
                self.rollout_memory.wake_for_sync()
                self.version += 1
                metrics.update(self.weight_sync.sync(self.version))
        with timer(timings, "wake"):
            self.rollout_memory.wake_for_rollout()
        timings["step"] = time.perf_counter() - t0
        metrics.update(data_metrics(
            token_level_scores=scores, token_level_rewards=rewards, advantages=advantages, returns=returns,
            response_mask=mask, prompt_lengths=data.prompt_lengths, response_lengths=data.response_lengths,
            max_response_length=self.cfg.data.max_response_length, max_prompt_length=self.cfg.data.max_prompt_length,
            values=values))
        reward_metrics = data.fields["_reward_metrics"][0]
        metrics.update({k: v for k, v in reward_metrics.items() if not isinstance(v, str)})
        prompt_tokens, response_tokens = int(data.prompt_lengths.sum()), int(data.response_lengths.sum())
        metrics.update(timing_metrics(timings, prompt_tokens, response_tokens))
        metrics.update(throughput_metrics(timings["step"], prompt_tokens + response_tokens, self.num_devices))
        metrics["training/global_step"] = step
        metrics["training/epoch"] = self.train_loader.sampler.epoch
        metrics["rollout/weight_version"] = self.version
        return metrics

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
        """ReMax: the reward of a greedy response to each sample's prompt."""
        prompts, first = [], {}
        for row, uid in enumerate(data.uid):
            if uid not in first:
                first[uid] = len(prompts)
                ids = data.batch.input_ids[row][data.batch.attention_mask[row].bool()][: int(data.prompt_lengths[row])]
                prompts.append(ids.tolist())
        samples = self.fleet.generate(prompts, {"do_sample": False, "temperature": 0.0}, n=1, step=step)
        rows = [data.uid.index(uid) for uid in first]
        result = self.reward.score([data.data_source[r] for r in rows], [s.response_text for s in samples],
                                   [data.ground_truth[r] for r in rows], [data.extra_info[r] for r in rows],
                                   [len(s.response_ids) for s in samples])
        per_prompt = torch.tensor(result.scores, dtype=torch.float32)
        return per_prompt[[first[u] for u in data.uid]]

    # ------------------------------------------------------------------ validation
    def validate(self) -> dict[str, float]:
        from megarl.data import iterate_in_order

        if self.val_dataset is None:
            return {}
        texts, sources, truths, extras, lengths, prompts = [], [], [], [], [], []
        for items in iterate_in_order(self.val_dataset, self.cfg.data.val_batch_size):
            samples = self.fleet.generate([it.prompt_ids for it in items], validate=True)
            texts += [s.response_text for s in samples]
            sources += [items[s.prompt_index].data_source for s in samples]
            truths += [items[s.prompt_index].ground_truth for s in samples]
            extras += [items[s.prompt_index].extra_info for s in samples]
            lengths += [len(s.response_ids) for s in samples]
            prompts += [items[s.prompt_index].prompt_text for s in samples]
        result = self.reward.score(sources, texts, truths, extras, lengths)
        self.val_generations = pick_generations(prompts, texts, truths, result.scores,
                                                self.cfg.trainer.log_val_generations)
        scores = np.asarray(result.scores, dtype=np.float64)
        out = {"val/score": float(scores.mean())}
        for source in sorted(set(sources)):
            picked = [s for s, src in zip(scores, sources) if src == source]
            out[f"val-core/{source}/reward/mean@1"] = float(np.mean(picked))
        return out

    # ------------------------------------------------------------------ state for checkpoints
    def state_dict(self) -> dict[str, Any]:
        return {"global_step": self.global_step, "version": self.version,
                "data_loader": self.train_loader.state_dict(), "kl_ctrl": self.kl_ctrl.state_dict(),
                "history": self.history, "config": OmegaConf.to_container(self.cfg, resolve=True)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.global_step = int(state["global_step"])
        self.version = int(state["version"])
        self.train_loader.load_state_dict(state["data_loader"])
        self.kl_ctrl.load_state_dict(state["kl_ctrl"])
        self.history = list(state.get("history", []))


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


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> float:
    m = mask.to(values.dtype)
    return float((values * m).sum() / m.sum().clamp(min=1))


def concat_step_data(parts: list[StepData]) -> StepData:
    from megarl.engine import RLBatch

    if len(parts) == 1:
        return parts[0]
    width_p = max(p.batch.prompt_length for p in parts)
    width_r = max(p.batch.response_length for p in parts)
    batches = []
    for p in parts:
        b = p.batch
        left, right = width_p - b.prompt_length, width_r - b.response_length
        pad = lambda t, value=0: torch.nn.functional.pad(t, (left, right), value=value)  # noqa: E731
        batches.append((pad(b.input_ids), pad(b.attention_mask),
                        torch.nn.functional.pad(b.response_mask, (0, right))))
    merged = RLBatch(input_ids=torch.cat([x[0] for x in batches]), attention_mask=torch.cat([x[1] for x in batches]),
                     response_mask=torch.cat([x[2] for x in batches]))
    join = lambda key: [v for p in parts for v in getattr(p, key)]  # noqa: E731
    return StepData(
        batch=merged, uid=join("uid"), data_source=join("data_source"), ground_truth=join("ground_truth"),
        extra_info=join("extra_info"), response_text=join("response_text"), finish_reason=join("finish_reason"),
        rollout_log_probs=torch.cat([torch.nn.functional.pad(p.rollout_log_probs, (0, width_r - p.batch.response_length))
                                     for p in parts]),
        prompt_lengths=torch.cat([p.prompt_lengths for p in parts]),
        response_lengths=torch.cat([p.response_lengths for p in parts]),
        fields={k: [v for p in parts for v in p.fields[k]] for k in parts[0].fields})


@contextmanager
def timer(timings: dict, name: str):
    start = time.perf_counter()
    try:
        yield
    finally:
        timings[name] = timings.get(name, 0.0) + time.perf_counter() - start


class TrainingLoop:
    """Drives ``RLTrainer`` over steps: validation, metrics, checkpoints and resume."""

    def __init__(self, trainer: RLTrainer, metrics_logger, checkpoint_root: str):
        self.trainer, self.metrics_logger, self.root = trainer, metrics_logger, checkpoint_root

    def resume(self) -> int:
        """Load the checkpoint ``trainer.resume_mode`` asks for; return the step it holds (0: none)."""
        from megarl.trainer.checkpointing import find_resume_checkpoint

        t = self.trainer
        found = find_resume_checkpoint(t.cfg.trainer, self.root)
        if found is None:
            start = initial_checkpoints(t.cfg)["actor"]
            if start is not None:  # the actor starts from a megatron checkpoint, the fleet from the HF one
                self._sync_fleet(load=None)
                logger.info("actor started from %s; fleet synced to it", start)
            return 0
        actor_path, critic_path = found
        self._sync_fleet(load=(str(actor_path), critic_path and str(critic_path)))
        logger.info("resumed from %s at step %d", actor_path, t.global_step)
        return t.global_step

    def _sync_fleet(self, load: tuple | None) -> None:
        """Outside a step: (load a checkpoint, then) sync the fleet, in a step's memory order."""
        t = self.trainer
        t.rollout_memory.release(will_sync=True)  # the fleet's weights are about to be rewritten
        if load is not None:
            t.load_state_dict(t.workers.call("load_checkpoint", *load)[0])
        t.rollout_memory.wake_for_sync()
        t.version += 1
        t.weight_sync.sync(t.version)  # the fleet must serve the trainer's weights
        t.rollout_memory.wake_for_rollout()

    def save(self, step: int) -> None:
        from megarl.trainer.checkpointing import prune_checkpoints

        t = self.trainer
        t.workers.call("save_checkpoint", self.root, step, t.state_dict())
        prune_checkpoints(f"{self.root}/actor", t.cfg.trainer.max_actor_ckpt_to_keep)
        prune_checkpoints(f"{self.root}/critic", t.cfg.trainer.max_critic_ckpt_to_keep)

    def validate(self, step: int) -> dict[str, float]:
        metrics = self.trainer.validate()
        self.metrics_logger.log_generations(self.trainer.val_generations, step=step)
        return metrics

    def run(self) -> dict[str, float]:
        t, cfg = self.trainer, self.trainer.cfg.trainer
        start = self.resume()
        last: dict[str, float] = {}
        if (cfg.val_only or (start == 0 and cfg.val_before_train)) and t.val_dataset is not None:
            last = self.validate(start)
            t.history.append({"step": start, **last})
            self.metrics_logger.log(last, step=start)
        if cfg.val_only:
            return last
        for step in range(start + 1, t.total_steps + 1):
            metrics = t.train_step(step)
            t.global_step = step
            if cfg.test_freq > 0 and (step % cfg.test_freq == 0 or step == t.total_steps):
                metrics.update(self.validate(step))
            t.history.append({"step": step, **{k: v for k, v in metrics.items()
                                               if k in ("critic/score/mean", "val/score", "critic/vf_loss")}})
            self.metrics_logger.log(metrics, step=step)
            if cfg.save_freq > 0 and (step % cfg.save_freq == 0 or step == t.total_steps):
                self.save(step)
            last = metrics
        return last
