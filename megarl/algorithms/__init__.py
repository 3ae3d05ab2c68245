"""RL algorithms: advantage estimators, policy losses, KL, loss aggregation, value loss, DAPO, SPIN, SPPO.

Pure torch on `[batch, response_len]` tensors with a `response_mask`, on any device. The math and
the names follow verl's `core_algos.py`, so configs and curves carry over. Algorithms are picked
by name from registries:

| registry               | config key                                        |
|------------------------|---------------------------------------------------|
| ADVANTAGE_ESTIMATORS   | algorithm.adv_estimator                           |
| POLICY_LOSSES          | actor_rollout_ref.actor.policy_loss.loss_mode     |
| KL_PENALTIES           | actor_rollout_ref.actor.kl_loss_type, algorithm.kl_penalty |
| LOSS_AGG_MODES (tuple) | actor_rollout_ref.actor.loss_agg_mode             |
| LOSS_OPTIONS (tuple)   | a loss's own options (actor.tau_pos, actor.policy_loss.dro_beta, ...) |
| KL_CONTROLLERS (tuple) | algorithm.kl_ctrl.type                            |
| ROLLOUT_IS, ROLLOUT_RS | algorithm.rollout_correction.rollout_is / rollout_rs |

Unknown names raise `UnknownNameError` (a KeyError and a ValueError) listing the known names.
"""

from megarl.algorithms.advantages import (
    ADVANTAGE_ESTIMATORS,
    compute_gae_advantage_return,
    compute_gpg_outcome_advantage,
    compute_grpo_outcome_advantage,
    compute_grpo_passk_outcome_advantage,
    compute_opo_outcome_advantage,
    compute_reinforce_plus_plus_baseline_outcome_advantage,
    compute_reinforce_plus_plus_outcome_advantage,
    compute_remax_outcome_advantage,
    compute_rloo_outcome_advantage,
    estimator_traits,
    get_adv_estimator,
    register_adv_estimator,
)
from megarl.algorithms.aggregation import LOSS_AGG_MODES, agg_loss
from megarl.algorithms.dapo import (
    compute_overlong_penalty,
    filter_groups_by_metric,
    need_more_gen_batches,
    seq_metric_values,
)
from megarl.algorithms.entropy import compute_entropy_loss, entropy_from_logits
from megarl.algorithms.kl import (
    KL_CONTROLLERS,
    KL_PENALTIES,
    AdaptiveKLController,
    FixedKLController,
    apply_kl_penalty,
    compute_kl_loss,
    get_kl_controller,
    kl_penalty,
    register_kl_penalty,
)
from megarl.algorithms.masked import masked_mean, masked_sum, masked_var, masked_whiten
from megarl.algorithms.policy_losses import (
    LOSS_OPTIONS,
    POLICY_LOSSES,
    compute_policy_loss_gspo,
    compute_policy_loss_reinforce,
    compute_policy_loss_vanilla,
    get_policy_loss,
    register_policy_loss,
)
from megarl.algorithms.dppo import compute_policy_loss_dppo_kl, compute_policy_loss_dppo_tv
from megarl.algorithms.ratio_losses import (
    compute_policy_loss_cispo,
    compute_policy_loss_dro,
    compute_policy_loss_geo_mean,
    compute_policy_loss_sapo,
)
from megarl.algorithms.covariance_losses import compute_policy_loss_clip_cov, compute_policy_loss_kl_cov
from megarl.algorithms.sppo import compute_policy_loss_sppo, compute_sppo_outcome_advantage, soft_mean
from megarl.algorithms.spin import DPO_LOSS_TYPES, compute_spin_outcome_advantage, dpo_loss_and_slope, preference_pairs
from megarl.config.registry import Registry, UniformCall, UnknownNameError
from megarl.algorithms.rollout_correction import (
    ROLLOUT_IS,
    ROLLOUT_RS,
    Correction,
    RolloutCorrection,
    compute_rollout_correction,
    register_rollout_is,
    register_rollout_rs,
)
from megarl.algorithms.value_loss import compute_value_loss

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "DPO_LOSS_TYPES",
    "KL_CONTROLLERS",
    "LOSS_OPTIONS",
    "KL_PENALTIES",
    "LOSS_AGG_MODES",
    "POLICY_LOSSES",
    "ROLLOUT_IS",
    "ROLLOUT_RS",
    "Correction",
    "RolloutCorrection",
    "compute_rollout_correction",
    "register_rollout_is",
    "register_rollout_rs",
    "AdaptiveKLController",
    "FixedKLController",
    "Registry",
    "UniformCall",
    "UnknownNameError",
    "agg_loss",
    "apply_kl_penalty",
    "compute_entropy_loss",
    "compute_gae_advantage_return",
    "compute_gpg_outcome_advantage",
    "compute_grpo_outcome_advantage",
    "compute_grpo_passk_outcome_advantage",
    "compute_kl_loss",
    "compute_opo_outcome_advantage",
    "compute_overlong_penalty",
    "compute_policy_loss_cispo",
    "compute_policy_loss_clip_cov",
    "compute_policy_loss_dppo_kl",
    "compute_policy_loss_dppo_tv",
    "compute_policy_loss_dro",
    "compute_policy_loss_geo_mean",
    "compute_policy_loss_gspo",
    "compute_policy_loss_kl_cov",
    "compute_policy_loss_reinforce",
    "compute_policy_loss_sapo",
    "compute_policy_loss_sppo",
    "compute_policy_loss_vanilla",
    "compute_spin_outcome_advantage",
    "compute_sppo_outcome_advantage",
    "dpo_loss_and_slope",
    "preference_pairs",
    "soft_mean",
    "compute_reinforce_plus_plus_baseline_outcome_advantage",
    "compute_reinforce_plus_plus_outcome_advantage",
    "compute_remax_outcome_advantage",
    "compute_rloo_outcome_advantage",
    "compute_value_loss",
    "entropy_from_logits",
    "filter_groups_by_metric",
    "estimator_traits",
    "get_adv_estimator",
    "get_kl_controller",
    "get_policy_loss",
    "kl_penalty",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "need_more_gen_batches",
    "register_adv_estimator",
    "register_kl_penalty",
    "register_policy_loss",
    "seq_metric_values",
]
