"""verl's ``distillation.*`` keys: one teacher or several, their pool, the loss; what megarl refuses, by name."""
from __future__ import annotations

import pytest

from megarl.checks import load_config
from tests.config._fixtures import problem_messages
from megarl.settings.distillation import distillation_settings
from megarl.settings.engine import actor_settings

ON = ["distillation.enabled=true", "distillation.nnodes=1", "distillation.n_gpus_per_node=2"]
ONE = [*ON, "distillation.teacher_models.teacher_model.model_path=/models/teacher",
       "distillation.teacher_models.teacher_model.inference.tensor_model_parallel_size=1"]
TWO = [*ON, "+distillation.teacher_models.math.key=math", "+distillation.teacher_models.math.model_path=/models/m",
       "+distillation.teacher_models.math.num_replicas=1",
       "+distillation.teacher_models.math.inference.tensor_model_parallel_size=1",
       "+distillation.teacher_models.code.key=code", "+distillation.teacher_models.code.model_path=/models/c",
       "+distillation.teacher_models.code.num_replicas=1",
       "+distillation.teacher_models.code.inference.tensor_model_parallel_size=1"]


def problems(*overrides: str) -> list[str]:
    return problem_messages(*overrides, config="quickstart")


def test_off_by_default():
    cfg = load_config("quickstart", [])
    assert distillation_settings(cfg) is None and actor_settings(cfg, 1).loss.distillation is None


def test_one_teacher_fills_the_pool_and_scores_every_sample():
    cfg = load_config("quickstart", [*ONE, "distillation.distillation_loss.loss_mode=k2",
                                     "distillation.distillation_loss.loss_max_clamp=5"])
    settings = distillation_settings(cfg)
    (teacher,) = settings.teachers
    assert settings.single and teacher.key == "default" and teacher.model_path == "/models/teacher"
    assert teacher.num_replicas == 2 and teacher.engine.name == "vllm"  # the student's engine, verl's default
    assert teacher.engine.prompt_length == cfg.data.max_prompt_length
    loss = actor_settings(cfg, 1).loss.distillation
    assert (loss.loss_mode, loss.loss_max_clamp, loss.use_task_rewards, loss.use_policy_gradient) == ("k2", 5.0, True, False)


def test_several_teachers_are_keyed_and_replace_the_default_entry():
    cfg = load_config("quickstart", [*TWO, "distillation.teacher_key=data_source"])
    settings = distillation_settings(cfg)
    assert not settings.single and settings.teacher_key == "data_source"
    assert [(t.key, t.model_path, t.num_replicas) for t in settings.teachers] == [("math", "/models/m", 1),
                                                                                  ("code", "/models/c", 1)]


def test_replicas_must_fill_the_pool():
    found = problems(*TWO[:-1], "+distillation.teacher_models.code.inference.tensor_model_parallel_size=2")
    assert any("take 3 devices" in p and "pool has 2" in p for p in found), found
    found = problems(*ON, "distillation.teacher_models.teacher_model.model_path=/m")  # TP 2 in a pool of 2: fine
    assert found == []
    assert problems(*ONE, "distillation.teacher_models.teacher_model.num_replicas=2") == []  # what the pool holds
    assert problems(*ONE, "distillation.teacher_models.teacher_model.inference.free_cache_engine=false") == []
    found = problems(*ON[:2], "distillation.n_gpus_per_node=3", "distillation.teacher_models.teacher_model.model_path=/m")
    assert any("must divide the teachers' pool of 3" in p for p in found), found


@pytest.mark.parametrize("override, words", [
    ("distillation.teacher_models.teacher_model.inference.data_parallel_size=2", "data or expert parallelism"),
    ("distillation.teacher_models.teacher_model.inference.temperature=0.7", "scoring with a teacher at a temperature"),
    ("distillation.teacher_models.teacher_model.inference.gpu_memory_util=0.3", "unknown config key"),
    ("distillation.distillation_loss.log_prob_min_clamp=-10", "verl clamps log-probs in its top-k losses only"),
    ("distillation.distillation_loss.policy_loss_mode=gspo", "vanilla PPO-clip"),
    ("distillation.distillation_loss.loss_mode=forward_kl_topk distillation.distillation_loss.topk=0",
     "at least one teacher token"),
    ("distillation.distillation_loss.loss_mode=k1", "does not depend on the teacher"),
    ("distillation.teacher_models.teacher_model.num_replicas=3", "one teacher fills its pool, so it has 2 replica(s)"),
])
def test_what_megarl_lacks_is_refused_by_key(override, words):
    found = problems(*ONE, *override.split())
    assert any(words in p for p in found), found


def test_without_task_rewards_no_other_loss_term_is_silently_dropped():
    found = problems(*ONE, "distillation.distillation_loss.use_task_rewards=false",
                     "actor_rollout_ref.actor.use_kl_loss=true")
    assert any("actor_rollout_ref.actor.use_kl_loss=True with distillation" in p for p in found), found
    assert problems(*ONE, "distillation.distillation_loss.use_task_rewards=false") == []


def test_a_teacher_needs_a_model_and_several_need_keys():
    assert any("model_path is not set" in p for p in problems(*ON))
    found = problems(*TWO[:-5], "+distillation.teacher_models.code.model_path=/c",
                     "+distillation.teacher_models.code.num_replicas=1",
                     "+distillation.teacher_models.code.inference.tensor_model_parallel_size=1")
    assert any("distillation.teacher_models.code.key is not set" in p for p in found), found


def test_with_several_teachers_every_prompt_must_name_one_before_any_process_starts():
    from types import SimpleNamespace

    from megarl.settings.distillation import routing_problem

    settings = distillation_settings(load_config("quickstart", TWO))
    data = SimpleNamespace(items=[SimpleNamespace(data_source="math"), SimpleNamespace(data_source="code")])
    assert routing_problem(settings, {"train": data}) is None
    data.items.append(SimpleNamespace(data_source="poetry"))
    assert "data_source values ['poetry'] name no teacher (the teachers' keys: ['code', 'math'])" in \
        routing_problem(settings, {"train": data})
    other = distillation_settings(load_config("quickstart", [*TWO, "distillation.teacher_key=ability"]))
    assert "a sample's teacher is picked by one of its fields" in routing_problem(other, {"train": data})


def test_the_teachers_pool_is_cut_into_their_replicas_in_order():
    from megarl.cluster.placement import plan_teacher_pool

    plan = plan_teacher_pool(2, 2, [(1, 2), (2, 1)])
    assert plan.mode == "pool" and plan.replicas == ((0, 1), (2,), (3,))
    with pytest.raises(ValueError, match=r"must fill their pool of distillation.nnodes=1 x n_gpus_per_node=2"):
        plan_teacher_pool(1, 2, [(3, 1)])
    with pytest.raises(ValueError, match="would span nodes"):
        plan_teacher_pool(2, 2, [(1, 1), (1, 2), (1, 1)])


def test_the_top_k_forward_kl_reaches_the_loss_and_the_teacher_engine():
    from megarl.settings.distillation import VLLM_MAX_LOGPROBS, scoring_engine

    cfg = load_config("quickstart", [*ONE, "distillation.distillation_loss.loss_mode=forward_kl_topk",
                                     "distillation.distillation_loss.topk=40",
                                     "distillation.distillation_loss.log_prob_min_clamp=-20",
                                     "distillation.distillation_loss.use_chunked_topk=true"])
    settings = distillation_settings(cfg)
    loss = actor_settings(cfg, 1).loss.distillation
    assert (loss.loss_mode, loss.topk, loss.log_prob_min_clamp) == ("forward_kl_topk", 40, -20.0)
    engine = scoring_engine(settings.teachers[0].engine, loss.topk)
    assert engine.engine_kwargs.vllm["max_logprobs"] == 40 > VLLM_MAX_LOGPROBS  # vLLM caps at 20 by default
    assert engine.max_model_len == cfg.data.max_prompt_length + cfg.data.max_response_length + 1  # sample = prompt
    plain = scoring_engine(settings.teachers[0].engine)
    assert "max_logprobs" not in plain.engine_kwargs.vllm
    assert plain.max_model_len == cfg.data.max_prompt_length + cfg.data.max_response_length
