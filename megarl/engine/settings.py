"""What the engine needs from the config, as plain dataclasses, and how verl's keys map onto them.

The engine works on these (tests build them directly); ``actor_settings``, ``critic_settings``
and ``reference_settings`` read them from a megarl config (verl's key names):

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
  shorthand, see ``overrides``); ``optim.override_optimizer_config`` becomes
  ``OptimizerSettings.megatron_overrides``.

Offloading (``megatron.*_offload``) is not an engine setting: the trainer's worker moves state
between phases (``offload``).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

from omegaconf import OmegaConf

from megarl.algorithms.rollout_correction import RolloutCorrection
from megarl.engine.overrides import optimizer_overrides, transformer_overrides

logger = logging.getLogger(__name__)

DECAY_STYLES = ("constant", "linear", "cosine")


@dataclass
class OptimizerSettings:
    lr: float = 1e-6
    weight_decay: float = 0.01
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    clip_grad: float = 1.0  # max global grad norm; <= 0 turns clipping off
    lr_warmup_steps: int = 0
    lr_warmup_init: float = 0.0
    lr_decay_style: str = "constant"  # constant | linear | cosine
    min_lr: float = 0.0
    total_training_steps: int = -1  # needed for linear/cosine decay; -1: unknown
    use_distributed_optimizer: bool = True
    megatron_overrides: dict = field(default_factory=dict)  # OptimizerConfig fields (optim.override_optimizer_config)

    def __post_init__(self) -> None:
        if self.lr_decay_style not in DECAY_STYLES:
            raise ValueError(f"lr decay style {self.lr_decay_style!r} is not one of {DECAY_STYLES} (optim.warmup_style / optim.lr_decay_style)")
        if self.lr_decay_style != "constant" and self.total_training_steps <= 0:
            raise ValueError(
                f"lr decay style {self.lr_decay_style!r} needs optim.total_training_steps > 0 (the trainer fills it in); "
                "use warmup_style=constant otherwise"
            )
        if self.lr_warmup_steps < 0:
            raise ValueError(f"lr_warmup_steps must be >= 0, got {self.lr_warmup_steps}")


@dataclass
class BatchSettings:
    """How one data-parallel rank splits its samples for training (or, with mini_batch_size None, inference)."""

    mini_batch_size: int | None = None  # samples per optimizer step on this rank; None: the whole batch
    micro_batch_size: int | None = None  # samples per forward; None with use_dynamic_bsz
    use_dynamic_bsz: bool = False
    # tokens per micro-batch and device when use_dynamic_bsz: real tokens when packed, else samples x longest
    max_token_len: int = 16384
    # packed micro-batches (megatron's THD, no padding computed) or padded rows (megatron.use_remove_padding)
    use_remove_padding: bool = True
    epochs: int = 1
    shuffle: bool = False
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.use_dynamic_bsz and (self.micro_batch_size is None or self.micro_batch_size < 1):
            raise ValueError(
                "set a micro-batch size (ppo_micro_batch_size_per_gpu / log_prob_micro_batch_size_per_gpu) "
                f"or use_dynamic_bsz=True, got micro_batch_size={self.micro_batch_size}"
            )
        if self.use_dynamic_bsz and self.max_token_len < 1:
            raise ValueError(f"max token length per micro-batch must be >= 1, got {self.max_token_len}")


@dataclass
class PolicyLossSettings:
    loss_mode: str = "vanilla"
    # None: the policy loss's own default (GSPO: seq-mean-token-mean) and token-mean for entropy and KL
    loss_agg_mode: str | None = None
    clip_ratio: float = 0.2
    clip_ratio_low: float | None = None
    clip_ratio_high: float | None = None
    clip_ratio_c: float = 3.0
    entropy_coeff: float = 0.0
    use_kl_loss: bool = False
    kl_loss_coef: float = 0.001
    kl_loss_type: str = "low_var_kl"
    # algorithm.rollout_correction; the engine acts on it only in bypass mode (decoupled weights come in the batch)
    rollout_correction: RolloutCorrection | None = None
    # the options of particular losses (megarl.algorithms.LOSS_OPTIONS: SAPO's tau_pos, DRO's dro_beta, ...)
    options: dict = field(default_factory=dict)


@dataclass
class ActorSettings:
    train: BatchSettings
    log_prob: BatchSettings
    loss: PolicyLossSettings = field(default_factory=PolicyLossSettings)
    optim: OptimizerSettings = field(default_factory=OptimizerSettings)
    temperature: float = 1.0  # logits are divided by the sampling temperature, as in rollout


@dataclass
class CriticSettings:
    train: BatchSettings
    values: BatchSettings
    cliprange_value: float = 0.5
    loss_agg_mode: str = "token-mean"
    optim: OptimizerSettings = field(default_factory=lambda: OptimizerSettings(lr=1e-5))


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
        megatron_overrides=optimizer_overrides(_plain(optim.override_optimizer_config)),
    )


def _plain(value):
    return OmegaConf.to_container(value, resolve=True) if OmegaConf.is_config(value) else value


def model_overrides(cfg, role: str, typed: bool = True) -> dict:
    """The TransformerConfig fields ``role`` (actor | ref | critic) is built with (``typed``: as
    megatron-core's types, see ``transformer_overrides``)."""
    if role == "critic":
        megatron, model = cfg.critic.megatron, cfg.critic.model
    else:
        arr = cfg.actor_rollout_ref
        megatron, model = (arr.actor if role == "actor" else arr.ref).megatron, arr.model
    return transformer_overrides(_plain(megatron.override_transformer_config), model.enable_gradient_checkpointing,
                                 typed)


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
                        seed=int(megatron.seed))


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
    )
    return ActorSettings(
        train=train,
        log_prob=log_prob,
        loss=loss,
        optim=optimizer_settings(actor.optim, actor.grad_clip, actor.megatron, "actor_rollout_ref.actor"),
        # the distribution the fleet sampled from (greedy rollouts report log_softmax(logits): temperature 1)
        temperature=rollout.temperature if rollout.do_sample and rollout.temperature > 0 else 1.0,
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
