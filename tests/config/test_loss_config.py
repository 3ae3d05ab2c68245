"""The newer policy losses, SPIN and SPPO as a user selects them: verl's keys, what they imply, what is refused."""
from __future__ import annotations

import pytest

from megarl.algorithms import LOSS_OPTIONS
from megarl.checks import ConfigError, load_config
from megarl.settings.engine import actor_settings
from megarl.settings.derived import estimator_loss, old_log_prob_pass
from megarl.settings.engine import needs_reference

ACTOR = "actor_rollout_ref.actor"
VALID = ["data.train_files=/d/train.parquet", "actor_rollout_ref.model.path=/m", "algorithm.adv_estimator=grpo",
         "trainer.n_gpus_per_node=2", "data.train_batch_size=4", "actor_rollout_ref.rollout.n=2",
         f"{ACTOR}.ppo_mini_batch_size=2", f"{ACTOR}.ppo_micro_batch_size_per_gpu=2",
         "actor_rollout_ref.rollout.tensor_model_parallel_size=1"]
SPIN = ["algorithm.adv_estimator=spin", f"{ACTOR}.policy_loss.loss_mode=reinforce", f"{ACTOR}.loss_agg_mode=token-sum",
        f"{ACTOR}.ppo_mini_batch_size=4", "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=2"]


def messages(*overrides: str, name=None) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(name, [*VALID, *overrides])
    return "\n".join(p.message for p in info.value.problems)


@pytest.mark.parametrize("mode, extra", [("dppo_tv", []), ("dppo_kl", []), ("cispo", []), ("sapo", []),
                                         ("geo_mean", []), ("clip_cov", []), ("kl_cov", []), ("sppo", []),
                                         ("dro", [f"{ACTOR}.policy_loss.dro_beta=0.5"])])
def test_each_newer_loss_is_selected_by_its_verl_name_with_its_options(mode, extra):
    cfg = load_config(None, [*VALID, f"{ACTOR}.policy_loss.loss_mode={mode}", f"{ACTOR}.tau_neg=1.3",
                             f"{ACTOR}.policy_loss.kl_cov_ratio=0.01", *extra])
    options = actor_settings(cfg, dp_size=1).loss.options
    assert set(options) == set(LOSS_OPTIONS)
    assert options["tau_neg"] == 1.3 and options["kl_cov_ratio"] == 0.01 and options["tau_pos"] == 1.0


def test_token_sum_is_a_loss_agg_mode():
    cfg = load_config(None, [*VALID, f"{ACTOR}.loss_agg_mode=token-sum"])
    assert actor_settings(cfg, dp_size=1).loss.loss_agg_mode == "token-sum"


def test_a_loss_option_out_of_range_is_refused_before_any_process_starts():
    assert "dro_beta=None: DRO needs a positive value" in messages(f"{ACTOR}.policy_loss.loss_mode=dro")
    assert "tau_neg=0.0 must be > 0" in messages(f"{ACTOR}.policy_loss.loss_mode=sapo", f"{ACTOR}.tau_neg=0")
    assert "clip_ratio_c" in messages(f"{ACTOR}.policy_loss.loss_mode=dppo_tv", f"{ACTOR}.clip_ratio_c=0")
    assert "loss_agg_mode=token-mean" in messages(f"{ACTOR}.policy_loss.loss_mode=sppo",
                                                  f"{ACTOR}.loss_agg_mode=seq-mean-token-sum")
    assert "takes no rollout-correction weights" in messages(f"{ACTOR}.policy_loss.loss_mode=sppo",
                                                             "algorithm.rollout_correction.rollout_is=token")


def test_verls_spellings_that_megarl_reads_elsewhere_get_a_pointer():
    assert "rollout_correction.bypass_mode=True" in messages(f"{ACTOR}.policy_loss.loss_mode=bypass_mode")
    assert "--config-name spin_trainer" in messages("algorithm.adv_estimator=null")
    assert f"set {ACTOR}.dpo_beta" in messages(*SPIN, "+algorithm.dpo_beta=0.3")


def test_spin_runs_both_log_prob_passes_and_its_own_update():
    cfg = load_config(None, [*VALID, *SPIN, "trainer.ref_update_freq=1", "algorithm.dpo_loss_type=ipo"])
    assert needs_reference(cfg) and old_log_prob_pass(cfg) is not None  # on-policy, but read before the update
    assert estimator_loss(cfg) == ("reinforce", "token-sum")
    assert "the reference model runs" in messages(*SPIN[:-1])  # its micro-batch is needed, as for a KL term
    text = messages(*SPIN, f"{ACTOR}.policy_loss.loss_mode=vanilla")
    assert "loss_mode=reinforce" in text and "loss_agg_mode=token-sum" in text
    assert "ppo_epochs=1" in messages(*SPIN, f"{ACTOR}.ppo_mini_batch_size=2")
    assert "rollout.n=2" in messages(*SPIN, "actor_rollout_ref.rollout.n=4")
    assert "dpo_loss_type='hinge'" in messages(*SPIN, "algorithm.dpo_loss_type=hinge")
    assert "use_kl_in_reward" in messages(*SPIN, "algorithm.use_kl_in_reward=True")
    assert "recompute_old_log_prob=False" in messages(*SPIN, f"{ACTOR}.recompute_old_log_prob=False")


def test_ref_update_freq_needs_a_reference_of_its_own():
    assert "none runs" in messages("trainer.ref_update_freq=2")
    cfg = load_config(None, [*VALID, "trainer.ref_update_freq=2", f"{ACTOR}.use_kl_loss=True", SPIN[-1]])
    assert cfg.trainer.ref_update_freq == 2
    assert "with LoRA the reference" in messages(*SPIN, "trainer.ref_update_freq=1",
                                                 "actor_rollout_ref.model.lora.rank=8")


def test_the_shipped_spin_and_sppo_configs_select_their_algorithms():
    base = ["data.train_files=/d/train.parquet", "actor_rollout_ref.model.path=/m"]
    spin = load_config("spin_trainer", base)
    assert (spin.algorithm.adv_estimator, spin.actor_rollout_ref.actor.policy_loss.loss_mode) == ("spin", "reinforce")
    assert spin.actor_rollout_ref.actor.ppo_mini_batch_size == spin.data.train_batch_size
    sppo = load_config("sppo_trainer", base)
    assert (sppo.algorithm.adv_estimator, sppo.actor_rollout_ref.actor.policy_loss.loss_mode) == ("sppo", "sppo")
