"""Values a run would accept and never read are refused, naming what would take effect (``megarl.checks.no_effect``)."""
from __future__ import annotations

import pytest

from megarl.checks import ConfigError, load_config
from tests.config.test_command_line import VALID

KL_IN_REWARD = ["algorithm.use_kl_in_reward=True", "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=2"]


def problems(*overrides: str) -> list:
    with pytest.raises(ConfigError) as info:
        load_config(None, [*VALID, *overrides])
    return info.value.problems


def test_the_kl_controller_without_kl_in_the_reward_is_refused():
    (problem,) = problems("algorithm.kl_ctrl.type=adaptive", "algorithm.kl_ctrl.target_kl=0.05")
    assert problem.key == "algorithm.kl_ctrl.type"
    assert problem.message.startswith("algorithm.kl_ctrl.type=adaptive, algorithm.kl_ctrl.target_kl=0.05 set, but "
                                      "algorithm.use_kl_in_reward=False")
    assert "actor_rollout_ref.actor.use_kl_loss=True" in problem.message
    (problem,) = problems("algorithm.kl_ctrl.kl_coef=0.05")
    assert "algorithm.kl_ctrl.kl_coef=0.05 set" in problem.message
    load_config(None, [*VALID, "algorithm.kl_ctrl.kl_coef=0.0"])  # asks for nothing (verl's launches write it)
    cfg = load_config(None, [*VALID, *KL_IN_REWARD, "algorithm.kl_ctrl.type=adaptive", "algorithm.kl_ctrl.target_kl=0.05"])
    assert (cfg.algorithm.kl_ctrl.type, cfg.algorithm.kl_ctrl.target_kl) == ("adaptive", 0.05)


def test_the_adaptive_controllers_settings_with_a_fixed_controller_are_refused():
    (problem,) = problems(*KL_IN_REWARD, "algorithm.kl_ctrl.target_kl=0.05", "algorithm.kl_ctrl.horizon=500")
    assert problem.message.startswith("algorithm.kl_ctrl.target_kl=0.05, algorithm.kl_ctrl.horizon=500 set, but "
                                      "algorithm.kl_ctrl.type=fixed keeps kl_coef constant")
    load_config(None, [*VALID, *KL_IN_REWARD, "algorithm.kl_ctrl.kl_coef=0.05"])  # the fixed controller's own value


def test_tool_files_without_multi_turn_are_refused(tmp_path):
    tools = tmp_path / "tools.yaml"
    tools.write_text("tools:\n  - class_name: calculator\n")
    (problem,) = problems(f"actor_rollout_ref.rollout.multi_turn.tool_config_path={tools}")
    assert problem.key == "actor_rollout_ref.rollout.multi_turn.enable"
    assert "set, but actor_rollout_ref.rollout.multi_turn.enable=False: no tool is built" in problem.message
    load_config(None, [*VALID, f"actor_rollout_ref.rollout.multi_turn.tool_config_path={tools}",
                       "actor_rollout_ref.rollout.multi_turn.enable=True"])


def test_megatron_dtype_bfloat16_is_accepted_with_a_word_on_what_a_cpu_host_trains_in():
    """verl's default ``megatron.dtype=bfloat16`` loads (a full verl config carries it), but the run says that a
    CPU host trains in fp32 instead of staying silent; another dtype is refused."""
    notes: list[str] = []
    load_config(None, [*VALID, "actor_rollout_ref.actor.megatron.dtype=bfloat16",
                       "actor_rollout_ref.ref.megatron.dtype=bf16"], notes=notes)
    (note,) = [n for n in notes if "megatron.dtype" in n]
    assert note.startswith("actor_rollout_ref.actor.megatron.dtype=bfloat16, actor_rollout_ref.ref.megatron.dtype=bf16: ")
    assert "on a CPU host it trains in fp32 whatever this key says" in note
    notes.clear()
    load_config(None, list(VALID), notes=notes)
    assert not [n for n in notes if "megatron.dtype" in n]  # not given: nothing to say
    (problem,) = problems("critic.megatron.dtype=float16")
    assert "critic.megatron.dtype=float16" in problem.message and "fp32 on CPUs" in problem.message
