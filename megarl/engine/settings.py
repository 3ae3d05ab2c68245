"""What the engine needs, as plain dataclasses (tests build them directly; ``megarl.settings.engine``
reads them from a megarl config: ``actor_settings``, ``critic_settings``, ``reference_settings``).

How verl's keys (batch sizes, clipping, the LR schedule) map onto them: ``megarl.settings.engine``.

Offloading (``megatron.*_offload``) is not an engine setting: the trainer's worker moves state
between phases (``offload``).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field


from megarl.algorithms.rollout_correction import RolloutCorrection
from megarl.algorithms.distillation import DistillationLossSettings

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
    # on-policy distillation (verl's distillation.*): the loss against the teacher's log-probs in the batch
    distillation: DistillationLossSettings | None = None


@dataclass
class ActorSettings:
    train: BatchSettings
    log_prob: BatchSettings
    loss: PolicyLossSettings = field(default_factory=PolicyLossSettings)
    optim: OptimizerSettings = field(default_factory=OptimizerSettings)
    temperature: float = 1.0  # logits are divided by the sampling temperature, as in rollout
    # MoE router replay (verl's router_replay.mode): None, "R2" (the old-log-prob pass records, the update
    # replays) or "R3" (the rollout's routing, replayed in the log-prob pass and the update); engine.router_replay
    router_replay: str | None = None

    def __post_init__(self) -> None:
        from megarl.engine.router_replay import MODES

        if self.router_replay not in (None, *MODES):
            raise ValueError(f"router_replay must be None, 'R2' or 'R3', got {self.router_replay!r}")


@dataclass
class CriticSettings:
    train: BatchSettings
    values: BatchSettings
    cliprange_value: float = 0.5
    loss_agg_mode: str = "token-mean"
    optim: OptimizerSettings = field(default_factory=lambda: OptimizerSettings(lr=1e-5))


