"""The Megatron actor: log-probs of responses and the PPO/GRPO policy update.

The loss of a micro-batch is the registered policy loss (``policy_loss.loss_mode``), minus
``entropy_coeff`` times the aggregated entropy, plus ``kl_loss_coef`` times the KL loss to the
reference (``use_kl_loss``, ``kl_loss_type``), all aggregated with ``loss_agg_mode`` over the
whole mini-batch (see ``update`` for why the split into micro-batches does not matter).

Metrics (verl's names), averaged over the mini-batches of one ``update_policy`` call:
``actor/pg_loss``, ``actor/entropy`` and ``actor/kl_loss`` are the mini-batch losses
(aggregated with ``loss_agg_mode``); ``actor/pg_clipfrac``, ``actor/pg_clipfrac_lower`` and
``actor/ppo_kl`` are means over the mini-batch's response tokens; ``actor/grad_norm`` is the mean
pre-clip norm of the steps taken; ``actor/lr`` the learning rate used; ``actor/optimizer_steps``
counts the optimizer steps tried, ``actor/skipped_steps`` those skipped for a non-finite gradient norm. ``actor/kl_loss`` and
``actor/kl_coef`` appear when ``use_kl_loss`` is on.

On-policy distillation (``loss.distillation``, ``megarl.algorithms.distillation``): the batch brings
the teacher's log-probs of the sampled tokens (``teacher_log_probs``), or for ``forward_kl_topk`` its
top-k tokens and their log-probs (``teacher_topk_ids`` / ``teacher_topk_log_probs``), whose student
log-probs come from the vocabulary shards (``vocab_parallel_log_probs_at``); the distillation loss is added
to the policy loss times ``distillation_loss_coef`` (or is the whole loss without the task's rewards).
It reports ``distillation/loss`` (the mini-batch's aggregated loss), ``distillation/token_loss`` (the
per-token loss's mean over the response tokens), with a top-k loss ``distillation/student_mass`` and
``distillation/teacher_mass``, and, as a reward, ``distillation/pg_clipfrac`` and ``distillation/ppo_kl``.

Rollout correction (``algorithm.rollout_correction``, ``megarl.algorithms.rollout_correction``): in
decoupled mode the controller puts the importance weights into the batch
(``batch.rollout_is_weights``, multiplied into each token's loss) and the rejected tokens out of
its ``response_mask``. In bypass mode ``batch.old_log_probs`` are the rollout's and the correction
is computed here, per micro-batch, from the detached current log-probs: rejected tokens leave the
loss (they stay in token-mean's count, the mini-batch's response tokens: the rejection is decided in
the forward, after the count), and ``loss_type=reinforce`` trains REINFORCE weighted by the truncated ``pi_theta /
pi_rollout``; ``actor/rollout_is_mean`` and ``actor/rollout_rs_masked_fraction`` report them.

On-policy updates (one mini-batch, one epoch: the batch is used for exactly one optimizer step)
may come without ``old_log_probs``: the policy that generated the data is the one being updated,
so the old log-probs are the update's own forward, detached (ratio 1; verl's and TRL's on-policy
rule), and the separate log-prob pass is not needed. With ``rollout_log_probs`` in the batch such
an update also reports the sync probe ``rollout/logprob_diff`` (mean over the loss mask) and
``rollout/logprob_diff_max`` from that forward: trainer weights before the step against the fleet's.
"""
from __future__ import annotations

from typing import Sequence

import torch

from megarl.algorithms import agg_loss, compute_kl_loss, compute_rollout_correction, get_policy_loss
from megarl.algorithms.distillation import distillation_loss
from megarl.algorithms.mismatch import probs_diff_sums, verl_probs_diff
from megarl.engine.batch import RLBatch
from megarl.engine.batching import mini_batches
from megarl.engine.optimizer import build_optimizer, wrap_for_training
from megarl.engine.router_replay import RoutingReplay
from megarl.engine.runner import MicroBatch, ModelRunner, response_log_probs, response_logits
from megarl.engine.settings import ActorSettings
from megarl.engine.update import run_update
from megarl.engine.vocab_parallel import vocab_parallel_entropy, vocab_parallel_log_probs, vocab_parallel_log_probs_at

_TOKEN_MEANS = ("pg_clipfrac", "pg_clipfrac_lower", "ppo_kl")
_PROBE = ("logprob_diff", "logprob_diff_max")  # reported as rollout/<name>
_VERL_PROBE = ("probs_diff", "probs_diff_sq", "probs_diff_max")  # verl's training/rollout_probs_diff_* (mismatch.py)
_DISTILL_MEANS = ("distill_token_loss", "distill_pg_clipfrac", "distill_ppo_kl")  # reported as distillation/<name>
_TOPK_MEANS = ("distill_student_mass", "distill_teacher_mass")  # top-k losses: the mass on the teacher's top-k


class MegatronActor:
    """The policy: ``compute_log_prob`` and ``update_policy`` on megatron-core model chunks.

    ``model_chunks`` are this rank's GPTModels (one per virtual pipeline stage) with weights
    loaded (``megarl.models.build_model``); they are wrapped in mcore DDP here (``self.model``)
    and get their own optimizer and LR schedule.
    """

    def __init__(self, model_chunks: Sequence[torch.nn.Module], settings: ActorSettings):
        correction = settings.loss.rollout_correction
        self.bypass = correction if correction is not None and correction.bypass_mode else None
        loss_mode = "reinforce" if self.bypass is not None and self.bypass.loss_type == "reinforce" else \
            settings.loss.loss_mode
        self.policy_loss = get_policy_loss(loss_mode)  # an unknown name fails here, early
        self.token_means = _TOKEN_MEANS + (("rollout_is_mean", "rollout_rs_masked_fraction") if self.bypass else ())
        self.settings = settings
        self.model = wrap_for_training(model_chunks, settings.optim.use_distributed_optimizer)
        self.runner = ModelRunner(self.model)
        if settings.router_replay is not None:
            self.runner.replay = RoutingReplay(self.runner.chunks, self.runner.config)
        self.optimizer, self.scheduler = build_optimizer(self.model, settings.optim)

    def compute_log_prob(self, batch: RLBatch, with_entropy: bool = False, record_routing: bool = False) -> tuple:
        """Log-probs ``[B, R]`` of ``batch.responses`` under the current policy, and their entropy
        (None unless ``with_entropy``). The same tensors on every model-parallel rank; 0 at padding.

        Router replay: with ``R3`` the routers route by ``batch.routed_experts`` (the rollout's);
        ``record_routing`` (``R2``) adds a third result, the routers' choices ``[B, T, layers, k]``
        for the update to replay."""
        names = ["log_probs", "entropy"] if with_entropy else ["log_probs"]

        def compute(micro_batch: MicroBatch, logits: torch.Tensor) -> dict[str, torch.Tensor]:
            log_probs, entropy = response_log_probs(logits, micro_batch, self.settings.temperature, with_entropy)
            return {"log_probs": log_probs, "entropy": entropy}

        if record_routing and self.runner.replay is None:
            raise ValueError("record_routing needs router replay (router_replay.mode=R2)")
        routing = "record" if record_routing else "replay" if self.settings.router_replay == "R3" else None
        result = self.runner.infer(batch, self.settings.log_prob, compute, names, routing=routing)
        if record_routing:
            return result["log_probs"], result.get("entropy"), result["routed_experts"]
        return result["log_probs"], result.get("entropy")

    def update_policy(self, batch: RLBatch) -> dict[str, float]:
        """One PPO update over ``batch`` (``ppo_epochs`` passes of mini-batches). Returns metrics.

        Without ``batch.old_log_probs`` the update must be on-policy (see the module docstring).
        """
        use_kl, distill = self.settings.loss.use_kl_loss, self.settings.loss.distillation
        teacher = [] if not distill else ["teacher_topk_ids", "teacher_topk_log_probs"] if distill.uses_topk \
            else ["teacher_log_probs"]
        batch.require("advantages", *(["ref_log_probs"] if use_kl else []), *teacher, purpose="update_policy")
        if batch.old_log_probs is None:
            self._require_on_policy(len(batch))
        # R2 without a table: the update is its own old-log-prob pass (on-policy), which routes the same
        replay = self.settings.router_replay == "R3" or (self.settings.router_replay == "R2"
                                                         and batch.routed_experts is not None)
        if replay:
            self.runner.replay.reset_stats()  # count the update's replays only (R3's log-prob pass replays too)
        probe = batch.rollout_log_probs is not None
        sums = ["pg_loss", "entropy", *(["kl_loss"] if use_kl else []), *(["probe_tokens"] if probe else []),
                *(["distillation_loss"] if distill else [])]
        distill_means = () if not distill else _DISTILL_MEANS if distill.use_policy_gradient else _DISTILL_MEANS[:1]
        if distill and distill.uses_topk:
            distill_means = (*distill_means, *_TOPK_MEANS)
        token_means = (*self.token_means, *distill_means)
        metrics = run_update(
            "actor", self.runner, self.optimizer, self.scheduler, batch, self.settings.train, self._loss_fn, sums,
            (*token_means, *_PROBE[:1], *_VERL_PROBE[:2]) if probe else token_means,
            maxes=(_PROBE[1], _VERL_PROBE[2]) if probe else (), routing="replay" if replay else None
        )
        if replay:  # tokens x layers, summed over ranks (TP ranks without sequence parallelism count each the same)
            metrics.update({f"actor/{name}": value for name, value in self.runner.replay.take_stats().items()})
        if distill:
            metrics["distillation/loss"] = metrics.pop("actor/distillation_loss")
            for name in distill_means:
                metrics[f"distillation/{name.removeprefix('distill_')}"] = metrics.pop(f"actor/{name}")
        if probe:
            for name in _PROBE:
                metrics[f"rollout/{name}"] = metrics.pop(f"actor/{name}")
            mean, mean_sq, largest = (metrics.pop(f"actor/{name}") for name in _VERL_PROBE)
            metrics.update(verl_probs_diff(mean, mean_sq, largest, metrics.pop("actor/probe_tokens")))
        if use_kl:
            metrics["actor/kl_coef"] = self.settings.loss.kl_loss_coef
        return metrics

    def _require_on_policy(self, batch_size: int) -> None:
        train = self.settings.train
        steps = len(mini_batches(batch_size, train.mini_batch_size or batch_size, train.epochs))  # run_update's steps
        if steps != 1:
            raise ValueError(
                f"update_policy without old_log_probs takes the update's own forward as the old policy, which holds "
                f"only for one optimizer step per batch; this one takes {steps} ({train.epochs} epoch(s) of mini-batches "
                f"of {train.mini_batch_size} from {batch_size} samples): compute old_log_probs first (compute_log_prob)")

    def _loss_fn(self, info: dict):
        """The loss of one micro-batch of a mini-batch whose global totals are ``info``."""
        s, dp_size = self.settings.loss, self.runner.dp_size

        def loss(micro_batch: MicroBatch, logits: torch.Tensor):
            batch = micro_batch.batch
            mask = batch.response_mask
            response = response_logits(logits, micro_batch, self.settings.temperature)
            log_probs = micro_batch.to_response(vocab_parallel_log_probs(response, micro_batch.response_targets()))
            # on-policy without a log-prob pass: the old policy is this very forward (ratio 1)
            old_log_probs = log_probs.detach() if batch.old_log_probs is None else batch.old_log_probs
            with torch.set_grad_enabled(s.entropy_coeff != 0):  # without the bonus it is only a metric
                entropy = micro_batch.to_response(vocab_parallel_entropy(response))
            agg = s.loss_agg_mode or "token-mean"  # entropy and KL; the policy loss keeps its own default
            weights, loss_mask = batch.rollout_is_weights, mask
            if self.bypass is not None:  # old_log_probs are the rollout's: correct against the current policy
                correction = compute_rollout_correction(log_probs.detach(), batch.old_log_probs, mask, self.bypass,
                                                        with_metrics=False)
                loss_mask = correction.mask
                weights = correction.weights if self.bypass.loss_type == "reinforce" else None
            pg_loss, pg_metrics = self.policy_loss(
                old_log_prob=old_log_probs,
                log_prob=log_probs,
                advantages=batch.advantages,
                response_mask=loss_mask,
                rollout_is_weights=weights,
                **({} if s.loss_agg_mode is None else {"loss_agg_mode": s.loss_agg_mode}),
                clip_ratio=s.clip_ratio,
                clip_ratio_low=s.clip_ratio_low,
                clip_ratio_high=s.clip_ratio_high,
                clip_ratio_c=s.clip_ratio_c,
                global_batch_info=info,
                **s.options,
            )
            entropy_loss = agg_loss(entropy, mask, agg, **info)
            total = pg_loss - s.entropy_coeff * entropy_loss
            tokens = mask.float().sum()
            collected = {"pg_loss": pg_loss.detach() / dp_size, "entropy": entropy_loss.detach() / dp_size, "tokens": tokens}
            collected.update({name: pg_metrics[name].detach() * tokens for name in _TOKEN_MEANS})
            if self.bypass is not None:
                valid = mask.float()
                collected["rollout_is_mean"] = ((weights if weights is not None else valid) * valid).sum()
                collected["rollout_rs_masked_fraction"] = (valid - loss_mask.float()).sum()
            if batch.rollout_log_probs is not None:  # the sync probe: this forward against the fleet's log-probs
                diff = (log_probs.detach() - batch.rollout_log_probs).abs() * mask
                collected.update(logprob_diff=diff.sum(), logprob_diff_max=diff.max())
                collected.update(probs_diff_sums(log_probs.detach(), batch.rollout_log_probs, mask), probe_tokens=tokens)
            if s.use_kl_loss:
                kl_loss = compute_kl_loss(log_probs, batch.ref_log_probs, mask, s.kl_loss_type, agg, info)
                total = total + s.kl_loss_coef * kl_loss
                collected["kl_loss"] = kl_loss.detach() / dp_size
            if s.distillation is not None:
                student_topk = None
                if s.distillation.uses_topk:  # the student's log-probs of the teacher's top-k tokens
                    ids = batch.teacher_topk_ids[micro_batch.inputs.response_here]
                    student_topk = micro_batch.to_response(vocab_parallel_log_probs_at(response, ids))
                distill, distill_metrics = distillation_loss(log_probs, old_log_probs, batch.teacher_log_probs,
                                                             loss_mask, s.distillation, agg, info, weights,
                                                             student_topk, batch.teacher_topk_log_probs)
                # without the task's rewards the distillation loss is the whole loss (checks refuse KL and entropy terms)
                total = (total if s.distillation.use_task_rewards else 0.0) + s.distillation.coef * distill
                collected["distillation_loss"] = distill.detach() / dp_size
                collected.update({f"distill_{name}": value * tokens for name, value in distill_metrics.items()})
            return total * micro_batch.count, collected

        return loss
