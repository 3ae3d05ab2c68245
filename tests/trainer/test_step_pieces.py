"""The controller's pure pieces: step tensors from samples, advantages, metrics, resume choice."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from megarl.agent.trajectory import Trajectory
from megarl.checks import load_config
from megarl.trainer.advantage_step import compute_advantages, token_level_rewards
from megarl.algorithms import masked_mean
from megarl.trainer.resume import find_resume_checkpoint
from megarl.trainer.metrics import agent_metrics, data_metrics, timing_metrics
from megarl.trainer.rollout_batch import build_step_data, concat_step_data

BASE = ["data.train_files=x.parquet", "actor_rollout_ref.model.path=/m", "algorithm.adv_estimator=grpo",
        "trainer.n_gpus_per_node=1", "data.train_batch_size=2", "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=1"]


def trajectory(prompt, response, lp, mask=None, **extras):
    return Trajectory(prompt, response, [1] * len(response) if mask is None else mask, lp, "stop",
                      " ".join(map(str, response)), extras)


def prompts():
    return {"data_source": ["a", "b"], "ground_truth": ["1", "2"], "extra_info": [{"i": 0}, {"i": 1}]}


def test_step_data_layout_left_padded_prompts_right_padded_responses():
    samples = [trajectory([5, 6, 7], [8], [-0.5]), trajectory([5, 6, 7], [9, 10], [-0.1, -0.2]),
               trajectory([4], [11, 12, 13], [-1.0, -2.0, -3.0]), trajectory([4], [], [])]
    rows = [0, 0, 1, 1]
    data = build_step_data(prompts(), samples, rows, [f"3:{r}" for r in rows], pad_token_id=0, response_length=4)
    b = data.batch
    assert b.input_ids.tolist() == [[5, 6, 7, 8, 0, 0, 0], [5, 6, 7, 9, 10, 0, 0],
                                    [0, 0, 4, 11, 12, 13, 0], [0, 0, 4, 0, 0, 0, 0]]
    assert b.response_mask.tolist() == [[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [0, 0, 0, 0]]
    assert data["uid"] == ["3:0", "3:0", "3:1", "3:1"]
    assert data["ground_truth"] == ["1", "1", "2", "2"] and data["extra_info"][2] == {"i": 1}
    assert data["rollout_log_probs"][2].tolist() == [-1.0, -2.0, -3.0, 0.0]
    assert data["response_lengths"].tolist() == [1, 2, 3, 0]
    picked = data.select([2, 0])
    assert picked["uid"] == ["3:1", "3:0"] and picked.batch.input_ids[0].tolist() == b.input_ids[2].tolist()
    merged = concat_step_data([data.select([0, 1]), build_step_data(prompts(), samples[2:], [1, 1], ["4:1"] * 2, 0)])
    assert merged.batch.input_ids.shape == (4, 7) and merged["uid"][-1] == "4:1"
    assert merged.batch.input_ids[2].tolist() == [0, 0, 4, 11, 12, 13, 0]
    assert merged["rollout_log_probs"].shape == (4, 4) and merged["response_lengths"].tolist() == [1, 2, 3, 0]


def test_step_data_carries_each_prompts_pixels_once_and_keeps_them_with_their_rows(tmp_path):
    """A vision-language batch: each sample's pixel inputs are its prompt row's (computed once and shared by the
    group's samples), a text row's are {}, and select / concat keep them with their rows."""
    from PIL import Image
    from transformers import AutoProcessor

    from megarl.data.images import pixel_inputs
    from megarl.devtools.tiny_model import make_tiny_model

    processor = AutoProcessor.from_pretrained(make_tiny_model("qwen2_5_vl", "tiny", tmp_path / "vl"))
    pad = processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    red, blue = Image.new("RGB", (56, 84), "red"), Image.new("RGB", (84, 56), "blue")
    cols = {**prompts(), "images": [(red, blue), ()]}
    samples = [trajectory([3, pad, pad, pad, pad, pad, pad, 4, 3, pad, pad, pad, pad, pad, pad, 4, 7], [8], [-0.5])] * 2 \
        + [trajectory([4], [11], [-1.0])] * 2
    data = build_step_data(cols, samples, [0, 0, 1, 1], ["s:0", "s:0", "s:1", "s:1"], 0, processor=processor)
    inputs = data.batch.multi_modal_inputs
    expected = pixel_inputs([red, blue], processor)
    assert torch.equal(inputs[0]["pixel_values"], expected["pixel_values"]) and inputs[0]["image_grid_thw"].tolist() == \
        [[1, 6, 4], [1, 4, 6]]  # (t, h, w): PIL sizes are (w, h)
    assert inputs[1] is inputs[0] and inputs[2] == {} and inputs[3] == {}  # once per prompt row; text rows empty
    assert data["images"] == [(red, blue), (red, blue), (), ()]
    picked = data.select([2, 1])
    assert picked.batch.multi_modal_inputs[0] == {} and picked.batch.multi_modal_inputs[1] is inputs[0]
    text_only = build_step_data(prompts(), samples[2:], [1, 1], ["t:1"] * 2, 0, processor=processor)
    assert text_only.batch.multi_modal_inputs is None  # no row has images: a text batch
    merged = concat_step_data([text_only, data.select([0])])
    assert merged.batch.multi_modal_inputs[:2] == [{}, {}] and merged.batch.multi_modal_inputs[2] is inputs[0]
    assert build_step_data(cols, samples, [0, 0, 1, 1], ["s:0"] * 4, 0).batch.multi_modal_inputs is None  # text model


def test_step_data_takes_the_loss_mask_and_every_extra_as_a_field():
    """A tool turn inside the response is context (attention 1) but not trained on (loss mask 0);
    response_length counts model tokens; a trajectory's extras become fields by name."""
    tool = trajectory([5, 6], [7, 8, 30, 31, 9], [-0.1, -0.2, 0.0, 0.0, -0.3], mask=[1, 1, 0, 0, 1],
                      num_turns=4, tool_calls=1)
    plain = trajectory([5, 6], [7], [-0.5], num_turns=2)
    data = build_step_data(prompts(), [tool, plain], [0, 1], ["s:0", "s:1"], pad_token_id=0, response_length=6)
    assert data.batch.response_mask.tolist() == [[1, 1, 0, 0, 1, 0], [1, 0, 0, 0, 0, 0]]
    assert data.batch.attention_mask[:, 2:].tolist() == [[1, 1, 1, 1, 1, 0], [1, 0, 0, 0, 0, 0]]
    assert data["response_lengths"].tolist() == [3, 1] and data["response_tokens"].tolist() == [5, 1]
    assert data["num_turns"] == [4, 2] and data["tool_calls"] == [1, None]
    m = agent_metrics(data.fields)
    assert m["num_turns/mean"] == 3 and m["tool_calls/max"] == 1 and m["tool_calls/min"] == 1
    data.add(score=[1.0, 0.0])
    assert data.select([1])["score"] == [0.0]
    with pytest.raises(ValueError, match="3 entries for 2 samples"):
        data.add(bad=[1, 2, 3])
    with pytest.raises(ValueError, match="log-prob 0.0"):
        trajectory([1], [2, 3], [-0.1, -0.2], mask=[1, 0])


def test_grpo_advantages_through_the_step():
    cfg = load_config(None, BASE)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 0, 0]])
    scores = torch.zeros(4, 3)
    scores[0, 1], scores[2, 2] = 1.0, 1.0  # prompt 0: [1, 0]; prompt 1: [1, 0]
    rewards, metrics = token_level_rewards(cfg.algorithm, scores, mask, None, None, None)
    assert metrics == {} and torch.equal(rewards, scores)
    adv, ret = compute_advantages(cfg.algorithm, rewards, mask, ["p0", "p0", "p1", "p1"])
    expected = 1 / torch.tensor([1.0, 0.0]).std()  # (1 - 0.5) / std([1, 0]) for the winner
    assert adv[0, 0].item() == pytest.approx(0.5 * expected.item(), rel=1e-5)
    assert adv[1, 0].item() == pytest.approx(-0.5 * expected.item(), rel=1e-5)
    assert (adv * (1 - mask)).abs().sum() == 0  # padding stays 0
    assert torch.equal(adv, ret)


def test_kl_in_reward_needs_log_probs():
    cfg = load_config(None, BASE + ["algorithm.use_kl_in_reward=true", "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=2"])
    with pytest.raises(ValueError, match="needs old and reference log-probs"):
        token_level_rewards(cfg.algorithm, torch.zeros(1, 2), torch.ones(1, 2), None, None, None)


def test_data_metrics_use_verl_names():
    mask = torch.tensor([[1, 1], [1, 0]])
    m = data_metrics(token_level_scores=torch.tensor([[0.0, 1.0], [0.5, 0.0]]),
                     token_level_rewards=torch.tensor([[0.0, 0.9], [0.5, 0.0]]), advantages=torch.ones(2, 2),
                     returns=torch.ones(2, 2), response_mask=mask, prompt_lengths=torch.tensor([3, 5]),
                     response_lengths=torch.tensor([2, 1]), max_response_length=2, max_prompt_length=8)
    m_tools = data_metrics(token_level_scores=torch.zeros(2, 2), token_level_rewards=torch.zeros(2, 2),
                           advantages=torch.ones(2, 2), returns=torch.ones(2, 2), response_mask=mask,
                           prompt_lengths=torch.tensor([3, 5]), response_lengths=torch.tensor([1, 1]),
                           response_tokens=torch.tensor([2, 1]), max_response_length=2, max_prompt_length=8)
    assert m_tools["response_length/mean"] == 1 and m_tools["response_length/clip_ratio"] == 0.5
    assert m["critic/score/mean"] == pytest.approx(0.75) and m["critic/rewards/max"] == pytest.approx(0.9)
    assert m["response_length/clip_ratio"] == 0.5 and m["prompt_length/max"] == 5
    t = timing_metrics({"gen": 2.0, "update_actor": 1.0, "step": 4.0}, num_prompt_tokens=100, num_response_tokens=50)
    assert t["timing_s/gen"] == 2.0 and t["timing_per_token_ms/gen"] == pytest.approx(40.0)
    assert float(masked_mean(torch.tensor([[1.0, 5.0]]), torch.tensor([[1, 0]]))) == pytest.approx(1.0)  # the masked 5.0 is out


def test_resume_choice(tmp_path):
    trainer = SimpleNamespace(resume_mode="auto", resume_from_path=None)
    assert find_resume_checkpoint(trainer, tmp_path) is None
    step = tmp_path / "actor" / "step_4"
    step.mkdir(parents=True)
    (tmp_path / "actor" / "latest").write_text("step_4\n")
    from megarl.engine.checkpoint import META_FILE

    (step / META_FILE).write_text("{}")
    assert find_resume_checkpoint(trainer, tmp_path) == (step, None)
    assert find_resume_checkpoint(SimpleNamespace(resume_mode="disable"), tmp_path) is None
    with pytest.raises(FileNotFoundError, match="resume_from_path"):
        find_resume_checkpoint(SimpleNamespace(resume_mode="resume_path", resume_from_path=str(tmp_path / "no")), tmp_path)


@pytest.mark.parametrize("extra, reason", [
    ([], None),  # one mini-batch, one epoch: the update's own forward gives the old log-probs
    (["actor_rollout_ref.actor.recompute_old_log_prob=true"], "recompute_old_log_prob=True"),
    (["data.train_batch_size=4"], "ppo_mini_batch_size=2 < data.train_batch_size=4"),
    (["actor_rollout_ref.actor.ppo_epochs=2"], "ppo_epochs=2"),
    (["algorithm.use_kl_in_reward=true", "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=2"], "use_kl_in_reward"),
    (["+actor_rollout_ref.actor.megatron.override_transformer_config.hidden_dropout=0.1"], "dropout"),
    (["algorithm.adv_estimator=gae", "critic.ppo_micro_batch_size_per_gpu=2"], None),  # the critic needs values, not old log-probs
])
def test_the_old_log_prob_pass_runs_only_when_something_needs_it(extra, reason):
    from megarl.config.derived import old_log_prob_pass

    got = old_log_prob_pass(load_config(overrides=BASE + extra))
    assert got is None if reason is None else reason in got, got


def test_refusing_the_old_log_prob_pass_where_it_is_needed_is_an_error():
    from megarl.config import ConfigError

    load_config(overrides=BASE + ["actor_rollout_ref.actor.recompute_old_log_prob=false"])  # on-policy: fine
    with pytest.raises(ConfigError, match="recompute_old_log_prob=False, but the old log-probs are needed"):
        load_config(overrides=BASE + ["actor_rollout_ref.actor.recompute_old_log_prob=false", "actor_rollout_ref.actor.ppo_epochs=2"])
