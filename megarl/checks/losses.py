"""The configured policy loss and advantage estimator, tried on a tiny batch, and their combinations.

Each loss and estimator checks its own options when called (DRO's ``dro_beta``, SAPO's
temperatures, SPPO's aggregation, SPIN's pairs and ``dpo_loss_type``, ...); calling the configured
ones once on a two-token batch shaped like the run's groups reports those errors before any
process starts, without a list of rules kept here. The combinations a loss or estimator cannot
honour are refused by their traits: a rollout correction with a loss that takes no correction
weights (SPPO), SPIN's advantages with another update than the one they are the gradient weights
of, and ``trainer.ref_update_freq`` where no reference model of its own runs.
"""
from __future__ import annotations

import torch

from megarl.algorithms import ADVANTAGE_ESTIMATORS, POLICY_LOSSES, get_adv_estimator, get_policy_loss
from megarl.algorithms.rollout_correction import RolloutCorrection
from megarl.config.errors import Problem
from megarl.settings.engine import loss_options
from megarl.settings.derived import estimator_loss
from megarl.settings.engine import initial_checkpoints, needs_reference

LOSS_MODE = "actor_rollout_ref.actor.policy_loss.loss_mode"

# verl's spellings whose name megarl does not register, with what to write instead
NAME_HINTS = {
    (LOSS_MODE, "bypass_mode"): " verl sets loss_mode=bypass_mode itself from algorithm.rollout_correction.bypass_mode="
                                "True; megarl reads that key (the loss follows rollout_correction.loss_type): set it and "
                                "keep loss_mode=vanilla.",
    ("algorithm.adv_estimator", None): " verl's SPIN and SPPO recipes write null and run trainers of their own; megarl "
                                       "runs them as estimators: --config-name spin_trainer or sppo_trainer, or "
                                       "algorithm.adv_estimator=spin or sppo (docs/algorithms.md).",
}


def name_hint(key: str, name) -> str:
    return NAME_HINTS.get((key, name), "")


def loss_problems(cfg, notes: list[str]) -> list[Problem]:
    """The problems of the configured loss and estimator (see the module docstring); notes for accepted differences."""
    actor = cfg.actor_rollout_ref.actor
    mode, estimator = actor.policy_loss.loss_mode, cfg.algorithm.adv_estimator
    if mode not in POLICY_LOSSES or estimator not in ADVANTAGE_ESTIMATORS:
        return []  # the registry check names them
    problems = _trial_loss(cfg) + _trial_estimator(cfg)
    try:
        correction = RolloutCorrection.from_config(cfg.algorithm.rollout_correction)
    except ValueError:  # the rollout-correction check reports it
        correction = RolloutCorrection()
    if correction.corrects and "rollout_is_weights" not in get_policy_loss(mode).accepted:
        problems.append(Problem(f"{LOSS_MODE}={mode} takes no rollout-correction weights, but algorithm.rollout_correction "
                                f"is on ({_correction_keys(correction)}); {mode} trains on the synchronous loop's own "
                                "samples: drop the correction (and use async_training.mode=sync)", key=LOSS_MODE))
    problems += _spin_update_problems(cfg, correction)
    problems += _reference_refresh_problems(cfg)
    if mode in ("sapo", "geo_mean") and actor.loss_agg_mode not in (None, "seq-mean-token-mean"):
        what = "aggregates its policy term with it" if mode == "sapo" else "has one value per sequence, averaged over " \
            "sequences, whatever it says"
        notes.append(f"actor_rollout_ref.actor.loss_agg_mode={actor.loss_agg_mode}: {mode} {what}; verl's {mode} "
                     "always uses seq-mean-token-mean there")
    return problems


def _trial_loss(cfg) -> list[Problem]:
    actor = cfg.actor_rollout_ref.actor
    tokens = torch.tensor([[-1.0, -2.0]])
    given = {} if actor.loss_agg_mode is None else {"loss_agg_mode": actor.loss_agg_mode}
    try:
        get_policy_loss(actor.policy_loss.loss_mode)(
            old_log_prob=tokens, log_prob=tokens, advantages=torch.ones(1, 2), response_mask=torch.ones(1, 2),
            clip_ratio=actor.clip_ratio, clip_ratio_low=actor.clip_ratio_low, clip_ratio_high=actor.clip_ratio_high,
            clip_ratio_c=actor.clip_ratio_c, **given, **loss_options(actor))
    except ValueError as exc:
        return [Problem(f"{LOSS_MODE}={actor.policy_loss.loss_mode}: {exc}.", key=LOSS_MODE)]
    return []


def _trial_estimator(cfg) -> list[Problem]:
    """The estimator on two prompts of ``rollout.n`` samples each (scores 0, 1, 2, ...)."""
    a, n = cfg.algorithm, max(cfg.actor_rollout_ref.rollout.n, 1)
    rows = 2 * n
    rewards = torch.zeros(rows, 2)
    rewards[:, -1] = torch.arange(rows, dtype=torch.float32)
    zeros = torch.zeros(rows, 2)
    try:
        get_adv_estimator(a.adv_estimator)(
            token_level_rewards=rewards, response_mask=torch.ones(rows, 2), index=[i // n for i in range(rows)],
            values=zeros, reward_baselines=torch.zeros(rows), old_log_prob=zeros, ref_log_prob=zeros, gamma=a.gamma,
            lam=a.lam, norm_adv_by_std_in_grpo=a.norm_adv_by_std_in_grpo, sppo_eta=a.sppo_eta,
            dpo_beta=cfg.actor_rollout_ref.actor.dpo_beta, dpo_loss_type=a.dpo_loss_type,
            dpo_label_smoothing=a.dpo_label_smoothing)
    except ValueError as exc:
        return [Problem(f"algorithm.adv_estimator={a.adv_estimator}: {exc}.", key="algorithm.adv_estimator")]
    return []


def _spin_update_problems(cfg, correction: RolloutCorrection) -> list[Problem]:
    """An estimator whose advantages are a loss's gradient weights (SPIN) needs exactly that update, once per batch."""
    wanted = estimator_loss(cfg)
    if wanted is None:
        return []
    actor, a = cfg.actor_rollout_ref.actor, cfg.algorithm
    loss_mode, agg = wanted
    name = f"algorithm.adv_estimator={a.adv_estimator}"
    why = f"{name} gives the gradient weights of its loss (DPO's) at the step's starting policy"
    problems = []
    if POLICY_LOSSES[actor.policy_loss.loss_mode] is not POLICY_LOSSES[loss_mode] or actor.loss_agg_mode != agg:
        problems.append(Problem(f"{why}, for the loss {loss_mode} summed over tokens: set {LOSS_MODE}={loss_mode} and "
                                f"actor_rollout_ref.actor.loss_agg_mode={agg} (--config-name spin_trainer does)",
                                key=LOSS_MODE))
    if actor.ppo_epochs != 1 or actor.ppo_mini_batch_size != cfg.data.train_batch_size:
        problems.append(Problem(f"{why}, exact for one optimizer step per batch (verl's SPIN recipe takes one): set "
                                "actor_rollout_ref.actor.ppo_mini_batch_size=data.train_batch_size "
                                f"({cfg.data.train_batch_size}) and ppo_epochs=1", key="actor_rollout_ref.actor.ppo_epochs"))
    if correction.corrects or cfg.async_training.mode != "sync":
        problems.append(Problem(f"{name} trains on the synchronous loop's own pairs (verl's SPIN recipe); a rollout "
                                "correction or an asynchronous mode would reweight DPO's gradient: use "
                                "async_training.mode=sync and no algorithm.rollout_correction", key="async_training.mode"))
    if a.use_kl_in_reward:
        problems.append(Problem(f"{name} ranks each pair by its scores (verl's SPIN recipe); algorithm.use_kl_in_reward "
                                "would rank by scores minus a KL penalty: set it to False (a KL loss, "
                                "actor.use_kl_loss, is honoured)", key="algorithm.use_kl_in_reward"))
    return problems


def _reference_refresh_problems(cfg) -> list[Problem]:
    freq, key = cfg.trainer.ref_update_freq, "trainer.ref_update_freq"
    if freq <= 0:
        return []
    if not needs_reference(cfg):
        return [Problem(f"{key}={freq} refreshes the reference model, but none runs (no KL loss, no KL in the reward, "
                        "no estimator that reads it such as spin): drop the key", key=key)]
    start = initial_checkpoints(cfg)
    if cfg.actor_rollout_ref.model.lora.rank > 0 and start["ref"] == start["actor"]:
        return [Problem(f"{key}={freq}: with LoRA the reference is the actor's frozen base model (adapters off), which "
                        "cannot take the trained weights without merging them: drop the key, or train without LoRA",
                        key=key)]
    return []


def _correction_keys(c: RolloutCorrection) -> str:
    on = [f"{k}={getattr(c, k)}" for k in ("rollout_is", "rollout_rs", "bypass_mode") if getattr(c, k)]
    return ", ".join(on) or "rollout_token_veto_threshold"
