"""verl's reward-model keys (``reward_model.*`` and the 2026 ``reward.reward_model.*``), the checks
made before anything starts, the reward-model arguments of reward functions, and the placement of
a reward model's replicas. No process starts here."""
from __future__ import annotations

import textwrap

import pytest

from megarl.checks import ConfigError, load_config
from megarl.rewards.custom import RewardFunction
from megarl.cluster.placement import plan_placement, plan_reward_pool, with_colocated_reward_model
from megarl.settings.cluster import plan_from_config, reward_pool_from_config
from tests.config._fixtures import write_model_config, write_prompts

BATCH = ["algorithm.adv_estimator=grpo", "trainer.n_gpus_per_node=2", "data.train_batch_size=4",
         "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
         "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2", "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
         "actor_rollout_ref.rollout.gpu_memory_utilization=0.5", "reward_model.rollout.gpu_memory_utilization=0.3"]


@pytest.fixture()
def files(tmp_path):
    from megarl.devtools.tiny_model import build_tokenizer

    policy = write_model_config(tmp_path / "policy")
    rm = write_model_config(tmp_path / "rm", "Qwen2ForSequenceClassification", num_labels=1)
    build_tokenizer("qwen2").save_pretrained(policy)
    build_tokenizer("llama").save_pretrained(rm)  # another tokenizer and chat template
    judge = write_model_config(tmp_path / "judge", "LlamaForCausalLM", "llama")
    data = write_prompts(tmp_path / "train.parquet", rows=8, data_source="anything/without/a/rule")
    reward = tmp_path / "reward.py"
    reward.write_text(textwrap.dedent('''
        def with_score(data_source, solution_str, ground_truth, extra_info, rm_score):
            return rm_score + float(ground_truth in solution_str)

        async def verl_genrm(data_source, solution_str, ground_truth, extra_info, reward_router_address,
                             reward_model_tokenizer):
            return 0.0

        def with_judge(data_source, solution_str, ground_truth, extra_info=None, judge=None):
            return 0.0

        def plain(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
            return 0.0
    '''))
    return {"policy": policy, "rm": rm, "judge": judge, "data": data, "reward": reward}


def load(files, *overrides: str, preflight: bool = True):
    return load_config(None, [*BATCH, f"actor_rollout_ref.model.path={files['policy']}",
                              f"data.train_files={files['data']}", *overrides], preflight=preflight)


def problems(files, *overrides: str) -> list[str]:
    try:
        load(files, *overrides)
    except ConfigError as exc:
        return [p.message for p in exc.problems]
    return []


def test_both_spellings_set_the_same_keys(files):
    older = load(files, "reward_model.enable=True", f"reward_model.model.path={files['rm']}",
                 "reward_model.rollout.tensor_model_parallel_size=1", "reward_model.enable_resource_pool=True",
                 "reward_model.nnodes=1", "reward_model.n_gpus_per_node=2", "reward_model.reward_manager=dapo",
                 "reward_model.micro_batch_size_per_gpu=8", "reward_model.forward_max_token_len_per_gpu=4096",
                 "reward_model.max_length=300")
    newer = load(files, "reward.reward_model.enable=True", f"reward.reward_model.model_path={files['rm']}",
                 "reward.reward_model.rollout.tensor_model_parallel_size=1", "reward.reward_model.enable_resource_pool=True",
                 "reward.reward_model.nnodes=1", "reward.reward_model.n_gpus_per_node=2", "reward.reward_manager.name=dapo",
                 "+reward.reward_model.micro_batch_size_per_gpu=8", "+reward.reward_model.forward_max_token_len_per_gpu=4096",
                 "+reward.reward_model.max_length=300")
    for cfg in (older, newer):
        rm = cfg.reward_model
        assert rm.enable and rm.model.path == str(files["rm"]) and rm.enable_resource_pool
        assert (rm.nnodes, rm.n_gpus_per_node, rm.reward_manager, rm.max_length) == (1, 2, "dapo", 300)
        # verl's legacy worker sized its forwards with these: the vLLM engines' step limits
        assert (rm.rollout.max_num_seqs, rm.rollout.max_num_batched_tokens) == (8, 4096)
    text = "\n".join(problems(files, "reward_model.enable=True", f"reward_model.model.path={files['rm']}",
                              "reward_model.rollout.tensor_model_parallel_size=1",
                              f"reward.reward_model.model_path={files['judge']}"))
    assert "are the same setting (two spellings) with different values" in text


def test_verl_keys_megarl_does_not_run_are_refused_or_renamed(files):
    rm = ["reward_model.enable=True", f"reward_model.model.path={files['rm']}", "reward_model.rollout.tensor_model_parallel_size=1"]
    text = "\n".join(problems(files, *rm, "+reward_model.use_reward_loop=False", "reward_model.megatron.tensor_model_parallel_size=4",
                              "+reward_model.rollout.load_format=dummy", "reward_model.rollout.name=sglang",
                              "+reward_model.micro_batch_size=64", "+reward_model.reward_loop_source=importlib"))
    assert "verl's legacy reward-model worker (a training-engine forward) is not supported" in text
    assert "a Megatron layout for the reward model is not supported" in text and \
        "reward_model.rollout.tensor_model_parallel_size" in text
    assert "vLLM load formats other than auto" in text
    assert "sglang as the reward model's engine is not supported" in text
    assert "reward_model.micro_batch_size is a deprecated verl key" in text and "micro_batch_size_per_gpu" in text
    assert "reward managers from other sources" in text
    # at the values that ask for nothing, verl's keys load
    assert problems(files, *rm, "+reward_model.use_reward_loop=True", "reward_model.megatron.tensor_model_parallel_size=1",
                    "reward_model.strategy=megatron", "reward_model.use_dynamic_bsz=True") == []


def test_checks_before_anything_starts(files, tmp_path):
    rm = [f"reward_model.model.path={files['rm']}", "reward_model.rollout.tensor_model_parallel_size=1"]
    two_labels = write_model_config(tmp_path / "two", "Qwen2ForSequenceClassification", num_labels=2)
    token_cls = write_model_config(tmp_path / "critic", "Qwen2ForTokenClassification", num_labels=1)
    text = "\n".join(problems(files, "reward_model.enable=True", "reward_model.model.input_tokenizer=/some/other/tokenizer",
                              "reward_model.rollout.gpu_memory_utilization=0.6", *rm))
    assert "decoding the responses with a tokenizer other than the policy's is not supported" in text
    assert "reward_model.rollout.gpu_memory_utilization=0.6 + actor_rollout_ref.rollout.gpu_memory_utilization=0.5 > 1" in text
    assert "has 2 labels; a reward model has one" in problems(files, "reward_model.enable=True",
                                                              f"reward_model.model.path={two_labels}")[0]
    assert "reward models of architecture ['Qwen2ForTokenClassification'] is not supported" in problems(
        files, "reward_model.enable=True", f"reward_model.model.path={token_cls}")[0]
    assert "is a causal LM, a judge: a custom reward function must build the judge's prompt" in problems(
        files, "reward_model.enable=True", f"reward_model.model.path={files['judge']}")[0]
    text = "\n".join(problems(files, "reward_model.enable=True", f"reward_model.model.path={files['rm']}",
                              "reward_model.rollout.tensor_model_parallel_size=4", "reward_model.judge.max_retries=-1"))
    assert "reward_model.rollout.tensor_model_parallel_size=4 must divide the 2 devices" in text
    assert "reward_model.judge.max_retries=-1 must be >= 0" in text
    assert "needs reward_model.nnodes=0 and reward_model.n_gpus_per_node=0 >= 1" in "\n".join(problems(
        files, "reward_model.enable=True", *rm, "reward_model.enable_resource_pool=True"))
    # the policy's tokens go to the reward model as they are only when both tokenize alike
    (problem,) = problems(files, "reward_model.enable=True", *rm, "reward_model.model.input_tokenizer=null")
    assert "feeds the policy's token ids to the reward model, but its tokenizer" in problem
    assert f"set reward_model.model.input_tokenizer={files['policy']}" in problem
    # no rule reward is needed for the data sources: the reward model scores
    assert problems(files, "reward_model.enable=True", *rm) == []


def test_what_a_reward_function_takes_must_be_what_the_reward_model_gives(files):
    reward = str(files["reward"])
    judge = [f"reward_model.model.path={files['judge']}", "reward_model.rollout.tensor_model_parallel_size=1"]
    rm = [f"reward_model.model.path={files['rm']}", "reward_model.rollout.tensor_model_parallel_size=1"]
    assert "takes rm_score, which a reward model gives: set reward_model.enable=True" in problems(
        files, f"custom_reward_function.path={reward}", "custom_reward_function.name=with_score")[0]
    assert problems(files, "reward_model.enable=True", *rm, f"custom_reward_function.path={reward}",
                    "custom_reward_function.name=with_score") == []
    assert "takes judge, but reward_model.model.path" in problems(
        files, "reward_model.enable=True", *rm, f"custom_reward_function.path={reward}",
        "custom_reward_function.name=with_judge")[0]
    assert "takes rm_score, but reward_model.model.path" in problems(
        files, "reward_model.enable=True", *judge, f"custom_reward_function.path={reward}",
        "custom_reward_function.name=with_score")[0]
    for name in ("verl_genrm", "with_judge", "plain"):
        assert problems(files, "reward_model.enable=True", *judge, f"custom_reward_function.path={reward}",
                        f"custom_reward_function.name={name}") == [], name


def test_reward_model_arguments_of_reward_functions(files):
    reward = str(files["reward"])
    verl = RewardFunction(reward, "verl_genrm")  # verl's GenRM signature: both arguments required, by name
    assert (verl.form, verl.is_async) == ("sample", True)
    assert verl.context == verl.required_context == {"reward_router_address", "reward_model_tokenizer"}
    assert RewardFunction(reward, "plain").context == {"reward_router_address", "reward_model_tokenizer"}  # **kwargs
    assert RewardFunction(reward, "with_judge").context == {"judge"} and not RewardFunction(reward, "with_judge").required_context
    assert RewardFunction(reward, "with_score").required_context == {"rm_score"}


def test_managers_by_name(files):
    plain = [f"custom_reward_function.path={files['reward']}", "custom_reward_function.name=plain"]
    # verl's rate_limited keys are absent from its defaults, so its users add them with '+'
    cfg = load(files, *plain, "reward_model.reward_manager=rate_limited", "+reward_model.max_concurrent=4",
               "+reward_model.max_tpm=1000", "+reward_model.estimated_tokens_per_request=100", "+reward_model.timeout=5")
    assert (cfg.reward_model.max_concurrent, cfg.reward_model.max_tpm, cfg.reward_model.timeout) == (4, 1000, 5.0)
    assert problems(files, *plain, "reward.reward_manager.name=limited") == []  # verl's module name
    text = "\n".join(problems(files, *plain, "reward_model.reward_manager=rate_limited", "+reward_model.max_tpm=100",
                              "reward.num_workers=2"))
    assert "estimated_tokens_per_request=2000 exceeds reward_model.max_tpm=100" in text
    assert "the rate_limited manager runs its calls concurrently in the controller" in text
    assert "verl's 'prime' reward manager is not supported" in problems(files, *plain, "reward_model.reward_manager=prime")[0]
    assert "megarl's reward managers are naive, dapo, batch, rate_limited" in problems(
        files, *plain, "reward_model.reward_manager=mine")[0]


def test_placement_of_a_reward_model(files):
    colocated = with_colocated_reward_model(plan_placement(1, 4, "colocated", rollout_tp=2), tp=2)
    assert colocated.reward_replicas == ((0, 1), (2, 3))
    assert colocated.share_of(0) == pytest.approx(1 / 3)  # trainer rank, rollout TP rank, reward-model TP rank
    split = with_colocated_reward_model(plan_placement(1, 4, "split", rollout_tp=2, rollout_devices=2), tp=1)
    assert split.reward_replicas == ((0,), (1,)) and split.share_of(0) == 0.5 and split.share_of(3) == 1.0
    pool = plan_reward_pool(2, 4, tp=4)
    assert pool.replicas == ((0, 1, 2, 3), (4, 5, 6, 7)) and pool.share_of(5) == 1.0 and pool.trainer == ()
    with pytest.raises(ValueError, match="would span nodes"):
        plan_reward_pool(3, 2, tp=3)
    cfg = load(files, "reward_model.enable=True", f"reward_model.model.path={files['rm']}",
               "reward_model.rollout.tensor_model_parallel_size=1", preflight=False)
    assert plan_from_config(cfg).reward_replicas == ((0,), (1,)) and reward_pool_from_config(cfg) is None


def test_the_hf_rollout_backend_serves_no_reward_model(files):
    rm = ["reward_model.enable=True", f"reward_model.model.path={files['rm']}", "reward_model.rollout.tensor_model_parallel_size=1"]
    text = "\n".join(problems(files, *rm, "reward_model.rollout.name=hf"))
    assert "reward_model.rollout.name=hf: hf as the reward model's engine is not supported" in text
    assert "no classifier head runner and no OpenAI-compatible server" in text and "set reward_model.rollout.name=vllm" in text
