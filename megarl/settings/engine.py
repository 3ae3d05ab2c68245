"""What a config says about the Megatron engines, and how verl's keys map onto their settings.

Their parallel layout (``layout_from_config``), whether a reference model runs, the megatron
checkpoints they start from, and each role's engine settings (``megarl.engine.settings``
dataclasses; tests build those directly), read from verl's key names:

* batch sizes: verl counts ``ppo_mini_batch_size`` in prompts over the whole data-parallel
  world; the engine counts samples on one data-parallel rank:
  ``mini_batch_size = ppo_mini_batch_size * rollout.n / dp_size``;
* gradient clipping: ``actor.grad_clip`` (``critic.grad_clip``) wins over ``optim.clip_grad``;
  a warning names both when they differ;
* LR schedule: warmup for ``optim.lr_warmup_steps`` steps (or, when that is -1,
  ``lr_warmup_steps_ratio * total_training_steps``) from ``lr_warmup_init``, then
  ``optim.lr_decay_style`` (else ``warmup_style``): constant, linear or cosine down to
  ``min_lr`` (``lr * min_lr_ratio`` when that is set) at ``total_training_steps``;
* megatron-core config fields: ``model_overrides`` gives a role's TransformerConfig fields
  (``megatron.override_transformer_config`` plus the ``model.enable_gradient_checkpointing``
  shorthand, see ``megarl.engine.overrides``); ``optim.override_optimizer_config`` becomes
  ``OptimizerSettings.megatron_overrides``;
* offload (``megatron.*_offload``): the worker moves state between phases (``offload_flags``).

The checks, the planner and the workers read them from here alike.
"""
from __future__ import annotations

import logging

from megarl.settings import plain

from megarl.algorithms.rollout_correction import RolloutCorrection
from megarl.engine.overrides import optimizer_overrides, transformer_overrides
from megarl.engine.offload_phases import MODELS
from megarl.engine.settings import ActorSettings, BatchSettings, CriticSettings, OptimizerSettings, PolicyLossSettings
from megarl.settings.distillation import loss_settings

logger = logging.getLogger(__name__)


def layout_from_config(megatron, num_layers: int | None = None) -> "ParallelLayout":  # noqa: F821
    """The layout of ``megatron`` (a ``*.megatron`` section); ``num_layers`` (the model's) is needed
    to turn ``override_transformer_config.account_for_*_in_pipeline_split`` into stage sizes."""
    from megarl.engine.overrides import pipeline_stage_layers
    from megarl.models import ParallelLayout

    tp, pp = megatron.tensor_model_parallel_size, megatron.pipeline_model_parallel_size
    vpp = megatron.virtual_pipeline_model_parallel_size or 1
    overrides = plain(megatron.override_transformer_config)
    if num_layers is None and any((overrides or {}).get(k) for k in ("account_for_embedding_in_pipeline_split",
                                                                     "account_for_loss_in_pipeline_split")):
        raise ValueError("account_for_*_in_pipeline_split needs the model's layer count")
    first, last = pipeline_stage_layers(overrides, num_layers or 0, pp, vpp)
    return ParallelLayout(
        tp=tp, pp=pp, ep=megatron.expert_model_parallel_size, etp=megatron.expert_tensor_parallel_size or 1,
        vpp=vpp, cp=megatron.context_parallel_size, sequence_parallel=bool(megatron.sequence_parallel and tp > 1),
        first_stage_layers=first, last_stage_layers=last,
        make_vocab_size_divisible_by=megatron.make_vocab_size_divisible_by)


def needs_reference(cfg) -> bool:
    """Whether a reference model runs: for the KL loss, the KL in the reward, or an estimator that reads its
    log-probs (SPIN)."""
    from megarl.settings.derived import estimator_reads_log_probs

    return bool(cfg.actor_rollout_ref.actor.use_kl_loss or cfg.algorithm.use_kl_in_reward
                or estimator_reads_log_probs(cfg))


def initial_checkpoints(cfg) -> dict[str, str | None]:
    """The megatron dist checkpoint each model starts from (None: its HF checkpoint).

    ``actor_rollout_ref.actor.megatron.dist_checkpointing_path`` (e.g. written by ``conversion
    hf-to-megatron`` under any layout) starts the actor, and the reference unless
    ``actor_rollout_ref.ref.megatron.dist_checkpointing_path`` names its own; the critic only
    loads ``critic.megatron.dist_checkpointing_path`` (a value model has its own head).
    """
    def path_of(megatron) -> str | None:
        return megatron.dist_checkpointing_path if megatron.use_dist_checkpointing else None

    actor = path_of(cfg.actor_rollout_ref.actor.megatron)
    return {"actor": actor, "ref": path_of(cfg.actor_rollout_ref.ref.megatron) or actor,
            "critic": path_of(cfg.critic.megatron)}


# ------------------------------------------------------------------ from the megarl config
def _per_rank(prompts: int, rollout_n: int, dp_size: int, key: str) -> int:
    samples = prompts * rollout_n
    if samples % dp_size:
        raise ValueError(f"{key}={prompts} prompts x rollout.n={rollout_n} = {samples} samples do not split over {dp_size} data-parallel ranks")
    return samples // dp_size


def _micro(value: int | None, dynamic: bool, key: str) -> int | None:
    if value is None and not dynamic:
        raise ValueError(f"{key} is not set: set it (samples per forward on one device) or use_dynamic_bsz=true")
    return value


def _clip(grad_clip: float, optim_clip: float, section: str) -> float:
    if grad_clip != optim_clip:
        logger.warning("%s.grad_clip=%s wins over %s.optim.clip_grad=%s", section, grad_clip, section, optim_clip)
    return grad_clip


def optimizer_settings(optim, grad_clip: float, megatron, section: str) -> OptimizerSettings:
    """OptimizerSettings from an ``optim`` section plus the role's ``grad_clip`` and ``megatron`` section."""
    total = optim.total_training_steps
    warmup = optim.lr_warmup_steps
    if warmup is None or warmup < 0:
        warmup = int(optim.lr_warmup_steps_ratio * total) if total > 0 else 0
    min_lr = optim.lr * optim.min_lr_ratio if optim.min_lr_ratio is not None else optim.min_lr
    return OptimizerSettings(
        lr=optim.lr,
        weight_decay=optim.weight_decay,
        betas=tuple(optim.betas),
        eps=optim.eps,
        clip_grad=_clip(grad_clip, optim.clip_grad, section),
        lr_warmup_steps=warmup,
        lr_warmup_init=optim.lr_warmup_init,
        lr_decay_style=optim.lr_decay_style or optim.warmup_style,
        min_lr=min_lr,
        total_training_steps=total,
        use_distributed_optimizer=megatron.use_distributed_optimizer,
        megatron_overrides=optimizer_overrides(plain(optim.override_optimizer_config)),
    )


def model_overrides(cfg, role: str, typed: bool = True) -> dict:
    """The TransformerConfig fields ``role`` (actor | ref | critic) is built with (``typed``: as
    megatron-core's types, see ``transformer_overrides``)."""
    if role == "critic":
        megatron, model = cfg.critic.megatron, cfg.critic.model
    else:
        arr = cfg.actor_rollout_ref
        megatron, model = (arr.actor if role == "actor" else arr.ref).megatron, arr.model
    return transformer_overrides(plain(megatron.override_transformer_config), model.enable_gradient_checkpointing,
                                 typed)


def hf_config_overrides(cfg, role: str) -> dict:
    """The HF config fields ``role`` (actor | ref | critic) is built with: verl's ``override_config.model_config``
    of its model section (the actor's and the reference's: ``actor_rollout_ref.model``)."""
    model = cfg.critic.model if role == "critic" else cfg.actor_rollout_ref.model
    return plain(model.override_config.model_config) or {}


def lora_settings(cfg, role: str):
    """The ``LoRASettings`` of ``role``: the actor's ``actor_rollout_ref.model.lora.*``, the critic's
    ``critic.model.lora.*``; None when its rank is 0 (and always for the reference, which is the
    actor's base model). The adapters are initialised from the role's ``megatron.seed``."""
    from megarl.models.lora import LoRASettings

    if role == "ref":
        return None
    lora = cfg.actor_rollout_ref.model.lora if role == "actor" else cfg.critic.model.lora
    if lora.rank <= 0:
        return None
    megatron = cfg.actor_rollout_ref.actor.megatron if role == "actor" else cfg.critic.megatron
    return LoRASettings(rank=int(lora.rank), alpha=float(lora.alpha), dropout=float(lora.dropout),
                        target_modules=tuple(lora.target_modules), exclude_modules=tuple(lora.exclude_modules),
                        lora_A_init_method=lora.lora_A_init_method, lora_B_init_method=lora.lora_B_init_method,
                        seed=int(megatron.seed), type=str(lora.type))


def actor_settings(cfg, dp_size: int) -> ActorSettings:
    """ActorSettings from a megarl config (``actor_rollout_ref.*``) for ``dp_size`` data-parallel ranks."""
    arr = cfg.actor_rollout_ref
    actor, rollout = arr.actor, arr.rollout
    micro = actor.ppo_micro_batch_size_per_gpu
    if micro is None and actor.ppo_micro_batch_size is not None:  # verl's deprecated global form
        micro = max(actor.ppo_micro_batch_size // dp_size, 1)
    key = "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu"
    train = BatchSettings(
        mini_batch_size=_per_rank(actor.ppo_mini_batch_size, rollout.n, dp_size, "actor.ppo_mini_batch_size"),
        micro_batch_size=_micro(micro, actor.use_dynamic_bsz, key),
        use_dynamic_bsz=actor.use_dynamic_bsz,
        max_token_len=actor.ppo_max_token_len_per_gpu,
        use_remove_padding=actor.megatron.use_remove_padding,
        epochs=actor.ppo_epochs,
        shuffle=actor.shuffle,
        seed=actor.data_loader_seed if actor.data_loader_seed is not None else actor.megatron.seed,
    )
    # The old log-probs (verl: the rollout's log-prob pass): rollout.log_prob_* keys, which default to the actor's.
    log_prob = BatchSettings(
        micro_batch_size=_micro(rollout.log_prob_micro_batch_size_per_gpu or micro, rollout.log_prob_use_dynamic_bsz,
                                "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu"),
        use_dynamic_bsz=rollout.log_prob_use_dynamic_bsz,
        max_token_len=rollout.log_prob_max_token_len_per_gpu,
        use_remove_padding=actor.megatron.use_remove_padding,
    )
    loss = PolicyLossSettings(
        loss_mode=actor.policy_loss.loss_mode,
        loss_agg_mode=actor.loss_agg_mode,
        clip_ratio=actor.clip_ratio,
        clip_ratio_low=actor.clip_ratio_low,
        clip_ratio_high=actor.clip_ratio_high,
        clip_ratio_c=actor.clip_ratio_c,
        entropy_coeff=actor.entropy_coeff,
        use_kl_loss=actor.use_kl_loss,
        kl_loss_coef=actor.kl_loss_coef,
        kl_loss_type=actor.kl_loss_type,
        rollout_correction=RolloutCorrection.from_config(cfg.algorithm.rollout_correction),
        options=loss_options(actor),
        distillation=loss_settings(cfg.distillation.distillation_loss) if cfg.distillation.enabled else None,
    )
    return ActorSettings(
        train=train,
        log_prob=log_prob,
        loss=loss,
        optim=optimizer_settings(actor.optim, actor.grad_clip, actor.megatron, "actor_rollout_ref.actor"),
        # the distribution the fleet sampled from (greedy rollouts report log_softmax(logits): temperature 1)
        temperature=rollout.temperature if rollout.do_sample and rollout.temperature > 0 else 1.0,
        router_replay=None if actor.router_replay.mode == "disabled" else actor.router_replay.mode,
    )


def loss_options(actor) -> dict:
    """The options of particular policy losses (``megarl.algorithms.LOSS_OPTIONS``) from ``actor_rollout_ref.actor``."""
    loss = actor.policy_loss
    return dict(tau_pos=actor.tau_pos, tau_neg=actor.tau_neg, sppo_eta=actor.sppo_eta,
                clip_cov_ratio=loss.clip_cov_ratio, clip_cov_lb=loss.clip_cov_lb, clip_cov_ub=loss.clip_cov_ub,
                kl_cov_ratio=loss.kl_cov_ratio, ppo_kl_coef=loss.ppo_kl_coef, dro_beta=loss.dro_beta)


def reference_settings(cfg) -> BatchSettings:
    """The reference model's log-prob batching (``actor_rollout_ref.ref.log_prob_*``)."""
    ref = cfg.actor_rollout_ref.ref
    key = "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu"
    return BatchSettings(
        micro_batch_size=_micro(ref.log_prob_micro_batch_size_per_gpu, ref.log_prob_use_dynamic_bsz, key),
        use_dynamic_bsz=ref.log_prob_use_dynamic_bsz,
        max_token_len=ref.log_prob_max_token_len_per_gpu,
        use_remove_padding=ref.megatron.use_remove_padding,
    )


def critic_settings(cfg, dp_size: int) -> CriticSettings:
    """CriticSettings from a megarl config (``critic.*``) for ``dp_size`` data-parallel ranks."""
    critic = cfg.critic
    n = cfg.actor_rollout_ref.rollout.n
    micro = _micro(critic.ppo_micro_batch_size_per_gpu, critic.use_dynamic_bsz, "critic.ppo_micro_batch_size_per_gpu")
    train = BatchSettings(
        mini_batch_size=_per_rank(critic.ppo_mini_batch_size, n, dp_size, "critic.ppo_mini_batch_size"),
        micro_batch_size=micro,
        use_dynamic_bsz=critic.use_dynamic_bsz,
        max_token_len=critic.ppo_max_token_len_per_gpu,
        use_remove_padding=critic.megatron.use_remove_padding,
        epochs=critic.ppo_epochs,
        shuffle=critic.shuffle,
        seed=critic.megatron.seed,
    )
    values = BatchSettings(micro_batch_size=micro, use_dynamic_bsz=critic.use_dynamic_bsz,
                           max_token_len=critic.ppo_max_token_len_per_gpu,
                           use_remove_padding=critic.megatron.use_remove_padding)
    return CriticSettings(
        train=train,
        values=values,
        cliprange_value=critic.cliprange_value,
        loss_agg_mode=critic.loss_agg_mode or "token-mean",
        optim=optimizer_settings(critic.optim, critic.grad_clip, critic.megatron, "critic"),
    )


def offload_flags(cfg) -> dict[str, bool]:
    """``<model>.<kind>`` -> whether its offload is on."""
    arr = cfg.actor_rollout_ref
    flags = {}
    for model, megatron in zip(MODELS, (arr.actor.megatron, arr.ref.megatron, cfg.critic.megatron)):
        flags.update({f"{model}.params": megatron.param_offload, f"{model}.grads": megatron.grad_offload,
                      f"{model}.optimizer": megatron.optimizer_offload})
    return flags


