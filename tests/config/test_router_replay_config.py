"""verl's router replay key (``actor_rollout_ref.actor.router_replay.mode``, and the mainline's
``actor.megatron.router_replay.mode``): R2 honoured, the rest refused by name before anything starts."""
from __future__ import annotations

import pytest

from megarl.checks import load_config
from tests.config._fixtures import problem_messages
from megarl.checks.router_replay import model_problems
from megarl.settings.engine import actor_settings

# the quickstart takes two mini-batches per batch: the old-log-prob pass runs, and R2 has something to replay
STEPS: list[str] = []
ON_POLICY = ["actor_rollout_ref.actor.ppo_mini_batch_size=16"]  # one optimizer step per batch of 16


def problems(*overrides: str) -> list[str]:
    return problem_messages(*overrides, config="quickstart")


@pytest.mark.parametrize("key", ["actor_rollout_ref.actor.router_replay.mode",
                                 "actor_rollout_ref.actor.megatron.router_replay.mode"])
def test_r2_reaches_the_actor_under_either_of_verls_spellings(key):
    assert actor_settings(load_config("quickstart", []), 1).router_replay is None
    assert actor_settings(load_config("quickstart", [*STEPS, f"{key}=R2"]), 1).router_replay == "R2"


def test_r3_and_unknown_modes_are_refused_naming_what_to_use():
    (r3,) = problems("actor_rollout_ref.actor.router_replay.mode=R3")
    assert "enable_return_routed_experts" in r3 and "use R2" in r3
    (bad,) = problems("actor_rollout_ref.actor.router_replay.mode=R1")
    assert "'R1' is not one of ('disabled', 'R2', 'R3')" in bad


def test_combinations_that_cannot_replay_are_refused():
    (bypass,) = problems(*STEPS, "actor_rollout_ref.actor.router_replay.mode=R2",
                         "algorithm.rollout_correction.bypass_mode=true", "algorithm.rollout_correction.rollout_is=null")
    assert "bypass_mode=True skips that pass" in bypass
    (fused,) = problems(*STEPS, "actor_rollout_ref.actor.router_replay.mode=R2",
                        "+actor_rollout_ref.actor.megatron.override_transformer_config.moe_router_fusion=true")
    assert "moe_router_fusion" in fused
    found = problems("actor_rollout_ref.actor.router_replay.record_file=/tmp/routes.pt")
    assert any("routing tables in files" in p for p in found), found
    found = problems("actor_rollout_ref.ref.router_replay.mode=R2")
    assert any("router replay outside the actor" in p for p in found), found


def test_r2_with_one_on_policy_step_per_batch_says_it_has_nothing_to_replay():
    notes: list[str] = []
    cfg = load_config("quickstart", [*ON_POLICY, "actor_rollout_ref.actor.router_replay.mode=R2"], notes=notes)
    assert actor_settings(cfg, 1).router_replay == "R2"
    assert any("nothing to replay" in note for note in notes), notes
    notes.clear()
    load_config("quickstart", [*STEPS, "actor_rollout_ref.actor.router_replay.mode=R2"], notes=notes)
    assert not any("nothing to replay" in note for note in notes)


def test_a_dense_model_is_refused_and_a_mixture_of_experts_accepted(tmp_path):
    from megarl.devtools.tiny_model import make_tiny_model
    from megarl.models import model_dims

    cfg = load_config("quickstart", [*STEPS, "actor_rollout_ref.actor.router_replay.mode=R2"])
    dense = model_dims(make_tiny_model("qwen2", "tiny", tmp_path / "dense", seed=0))
    (found,) = model_problems(cfg, dense)
    assert "is a dense model" in found.message
    assert model_problems(cfg, model_dims(make_tiny_model("qwen3_moe", "tiny", tmp_path / "moe", seed=0))) == []
