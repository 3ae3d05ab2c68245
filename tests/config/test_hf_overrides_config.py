"""verl's ``<model>.override_config.model_config``: Hugging Face config fields set before every model of the
run is built (actor, reference, critic, the rollout engines); refused where they name no field of the config or
would change its tensors."""
from __future__ import annotations

import pytest

from megarl.checks import load_config
from megarl.checks.preflight import preflight_problems
from megarl.settings.rollout import fleet_arguments
from megarl.settings.worker import worker_settings

KEY = "actor_rollout_ref.model.override_config.model_config"


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from megarl.devtools.tiny_model import make_tiny_model

    return make_tiny_model("qwen2", "tiny", tmp_path_factory.mktemp("overrides") / "qwen2", seed=0)


def config(model, *overrides: str):
    return load_config("quickstart", [f"actor_rollout_ref.model.path={model}", *overrides])


def override_messages(cfg) -> list[str]:
    return [p.message for p in preflight_problems(cfg) if "override_config" in (p.key or "")]


def test_the_fields_reach_every_model_of_the_run_and_the_engines(model):
    from types import SimpleNamespace

    cfg = config(model, f"+{KEY}.max_position_embeddings=10240", f"+{KEY}.rms_norm_eps=1e-5",
                 "actor_rollout_ref.actor.use_kl_loss=true", "critic.enable=true", "critic.ppo_micro_batch_size_per_gpu=8",
                 "+critic.model.override_config.model_config.rms_norm_eps=1e-4")
    wanted = {"max_position_embeddings": 10240, "rms_norm_eps": 1e-5}
    settings = worker_settings(cfg, 1)
    assert settings.actor_role.hf_overrides == wanted and settings.ref_role.hf_overrides == wanted
    assert settings.critic_role.hf_overrides == {"rms_norm_eps": 1e-4}  # the critic's own section, as in verl
    assert fleet_arguments(cfg, SimpleNamespace(mode="colocated"))["hf_overrides"] == wanted
    assert override_messages(cfg) == []
    assert worker_settings(config(model), 1).actor_role.hf_overrides == {}


def test_fields_the_config_lacks_or_that_change_the_tensors_are_refused_before_start(model):
    (unknown,) = override_messages(config(model, f"+{KEY}.rms_norm_epsilon=1e-5"))
    assert "has no field 'rms_norm_epsilon'" in unknown
    (shape,) = override_messages(config(model, f"+{KEY}.hidden_size=256", f"+{KEY}.max_position_embeddings=4096"))
    assert "overriding hidden_size would change the model's tensors" in shape  # max_position_embeddings alone would not
    (layers,) = override_messages(config(model, f"+{KEY}.num_hidden_layers=1"))
    assert "num_hidden_layers" in layers


def test_the_vllm_engines_take_them_beside_the_models_own_facts(model):
    from megarl.rollout.backend import ReplicaRequest
    from megarl.rollout.vllm.registration import spec_for as vllm_spec
    from megarl.rollout.hf.registration import spec_for as hf_spec

    cfg = config(model, f"+{KEY}.max_position_embeddings=10240")
    rollout = cfg.actor_rollout_ref.rollout
    request = ReplicaRequest(rollout, str(model), use_gpu=False, hf_overrides={"max_position_embeddings": 10240})
    assert dict(vllm_spec(request).hf_overrides)["max_position_embeddings"] == 10240
    assert dict(hf_spec(request).hf_overrides) == {"max_position_embeddings": 10240}
