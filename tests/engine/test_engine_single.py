"""The engine in one process (TP=PP=DP=1) against Hugging Face transformers.

One worker process runs every scenario (``_engine_worker.py single``); the tests compare its
measurements with references computed here by HF transformers and the algorithms library on
the whole batch at once (``_engine_hf``): log-probs, entropy, values, the loss, the
gradient norm and the weights after AdamW steps.
"""
import math

import pytest
import torch

import _engine_data as _data
import _engine_hf as _hf_reference
from _engine_launch import run_worker

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(400)]

TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def single(engine_work):
    return run_worker(engine_work, "single", processes=1, timeout=380)


@pytest.fixture(scope="module")
def dense_batch(data):
    return data["batches"][_data.DENSE]


@pytest.fixture(scope="module")
def hf_step(engine_work, dense_batch):
    return _hf_reference.hf_training_steps(engine_work / _data.DENSE, [dense_batch], _data.LOSS, _data.OPTIM)


def max_weight_diff(engine: dict, reference: dict) -> float:
    assert engine and set(engine) <= set(reference), sorted(set(engine) - set(reference))
    return max((engine[name] - reference[name]).abs().max().item() for name in engine)


def assert_same_step(update: dict, reference: dict, step_index: int = -1) -> None:
    metrics = update["metrics"]
    assert metrics["actor/pg_loss"] == pytest.approx(reference["pg_losses"][step_index], rel=1e-5, abs=1e-6)
    assert metrics["actor/grad_norm"] == pytest.approx(reference["grad_norms"][step_index], rel=1e-4)
    assert max_weight_diff(update["weights"], reference["weights"]) <= TOLERANCE


def test_log_probs_and_entropy_match_hugging_face(single, engine_work, dense_batch):
    log_probs, entropy = _hf_reference.hf_log_probs(engine_work / _data.DENSE, dense_batch)
    assert single["log_probs"]["log_probs"].shape == dense_batch.response_mask.shape
    assert (single["log_probs"]["log_probs"] - log_probs).abs().max() <= TOLERANCE
    assert (single["log_probs"]["entropy"] - entropy).abs().max() <= TOLERANCE


def test_reference_model_gives_the_same_log_probs_and_is_frozen(single, engine_work, dense_batch):
    log_probs, _ = _hf_reference.hf_log_probs(engine_work / _data.DENSE, dense_batch)
    assert (single["reference"]["log_probs"] - log_probs).abs().max() <= TOLERANCE
    assert single["reference"]["trainable"] == 0


def test_reference_takes_the_trained_actors_weights(single):
    """trainer.ref_update_freq (SPIN's opponent): after take_weights the reference is the actor."""
    refreshed = single["reference/refreshed"]
    assert (refreshed["log_probs"] - refreshed["actor_log_probs"]).abs().max() == 0
    assert (refreshed["log_probs"] - single["reference"]["log_probs"]).abs().max() > 1e-4  # the actor had moved


@pytest.mark.parametrize("split", ["mbs1", "mbs2", "mbs4", "dynamic", "recompute"])
def test_any_micro_batch_split_gives_the_full_mini_batch_loss_gradient_and_update(single, hf_step, split):
    """token-mean loss with entropy bonus and KL loss: micro-batches of 1, 2, 4 samples, a token
    budget, and activation recomputation all equal one HF step on the whole mini-batch."""
    assert_same_step(single[f"update/{split}"], hf_step)


def test_rollout_correction_in_the_engine_matches_the_whole_batch_reference(single, engine_work, dense_batch):
    """Decoupled: the batch's importance weights multiply each token's loss. Bypass: the correction is
    computed per micro-batch from the current policy (REINFORCE with truncated weights, token rejection)
    and equals it computed on the whole batch at once."""
    decoupled = _hf_reference.hf_training_steps(engine_work / _data.DENSE, [_data.with_importance_weights(dense_batch)],
                                                _data.LOSS, _data.OPTIM)
    assert_same_step(single["update/decoupled_tis"], decoupled)
    assert max_weight_diff(single["update/decoupled_tis"]["weights"], single["update/mbs2"]["weights"]) > 1e-5  # control
    bypass = _hf_reference.hf_training_steps(engine_work / _data.DENSE, [dense_batch], _data.BYPASS_LOSS, _data.OPTIM)
    assert_same_step(single["update/bypass_reinforce"], bypass)
    metrics = single["update/bypass_reinforce"]["metrics"]
    assert 0 < metrics["actor/rollout_rs_masked_fraction"] < 1 and metrics["actor/rollout_is_mean"] > 0


def test_micro_batch_splits_agree_with_each_other(single):
    reference = single["update/mbs1"]["weights"]
    for split in ["mbs2", "mbs4", "dynamic", "recompute"]:
        assert max_weight_diff(single[f"update/{split}"]["weights"], reference) <= TOLERANCE


def test_two_mini_batches_are_two_sequential_optimizer_steps(single, engine_work, dense_batch):
    halves = [dense_batch.select(list(range(4))), dense_batch.select(list(range(4, 8)))]
    reference = _hf_reference.hf_training_steps(engine_work / _data.DENSE, halves, _data.LOSS, _data.OPTIM)
    update = single["update/two_mini_batches"]
    assert max_weight_diff(update["weights"], reference["weights"]) <= TOLERANCE
    assert update["metrics"]["actor/pg_loss"] == pytest.approx(sum(reference["pg_losses"]) / 2, rel=1e-5)
    assert update["metrics"]["actor/grad_norm"] == pytest.approx(sum(reference["grad_norms"]) / 2, rel=1e-4)


def test_seq_mean_token_mean_loss_matches_the_full_batch(single, engine_work, dense_batch):
    reference = _hf_reference.hf_training_steps(engine_work / _data.DENSE, [dense_batch], _data.SEQ_MEAN_LOSS, _data.OPTIM)
    assert_same_step(single["update/seq_mean"], reference)


@pytest.mark.parametrize("split, loss", [("token_sum", _data.TOKEN_SUM_LOSS), ("sapo", _data.SAPO_LOSS)])
def test_token_sum_and_a_loss_with_options_match_the_full_batch(single, engine_work, dense_batch, split, loss):
    """Micro-batches of 2 add up to the whole batch's token sum; SAPO's temperatures reach the engine's loss."""
    reference = _hf_reference.hf_training_steps(engine_work / _data.DENSE, [dense_batch], loss, _data.OPTIM)
    assert_same_step(single[f"update/{split}"], reference)


def test_moe_log_probs_and_update_match_hugging_face(single, engine_work, data):
    batch = data["batches"][_data.MOE]
    log_probs, _ = _hf_reference.hf_log_probs(engine_work / _data.MOE, batch)
    assert (single["moe/log_probs"] - log_probs).abs().max() <= TOLERANCE
    reference = _hf_reference.hf_training_steps(engine_work / _data.MOE, [batch], _data.LOSS, _data.OPTIM)
    assert_same_step(single["moe/update"], reference)


def test_metrics_have_verl_names(single):
    metrics = single["update/mbs2"]["metrics"]
    expected = {"pg_loss", "pg_clipfrac", "pg_clipfrac_lower", "ppo_kl", "entropy", "kl_loss", "kl_coef", "grad_norm", "lr", "skipped_steps",
                "optimizer_steps"}
    assert {f"actor/{name}" for name in expected} <= set(metrics)
    assert metrics["actor/lr"] == _data.LR and metrics["actor/kl_coef"] == _data.LOSS.kl_loss_coef
    assert 0 < metrics["actor/pg_clipfrac"] < 1  # the noisy old log-probs make some ratios clip


def test_non_finite_grad_norm_skips_the_step(single):
    result = single["nonfinite"]
    assert result["bad"]["actor/skipped_steps"] == result["bad"]["actor/optimizer_steps"] == 1.0
    assert math.isnan(result["bad"]["actor/grad_norm"])
    assert all(torch.equal(result["after_bad"][name], result["before"][name]) for name in result["before"])
    assert result["good"]["actor/skipped_steps"] == 0.0
    changed = max((result["after_good"][name] - result["before"][name]).abs().max().item() for name in result["before"])
    assert changed > 1e-4
    assert all(torch.isfinite(value).all() for value in result["after_good"].values())


def test_policy_learns_a_preferred_token(single):
    """GRPO with reward 1 for one token id: its log-prob rises clearly within 20 steps."""
    curve = single["learning"]["chosen_log_probs"]
    assert curve[-1] - curve[0] > 2.0, curve
    assert math.exp(curve[-1]) > 5 * math.exp(curve[0])


def test_critic_values_match_hugging_face_and_the_value_loss_falls(single, engine_work, dense_batch):
    values = _hf_reference.hf_values(engine_work / _data.CRITIC, dense_batch)
    assert (single["critic"]["values"] - values).abs().max() <= TOLERANCE
    losses = single["critic"]["vf_losses"]
    assert losses[-1] < 0.2 * losses[0], losses


def test_tool_tokens_are_isolated_from_the_loss(single):
    """Perturbing the logits at loss-masked positions (tool output inside a response, whose old
    log-probs and advantages are not zero) changes neither the loss nor any gradient; perturbing
    one trained position changes both (the control)."""
    result = single["masked"]
    clean, tool, trained = result["clean"], result["tool"], result["trained"]
    assert result["masked_tokens"] >= 4
    assert tool["loss"] == clean["loss"]
    assert clean["grads"].keys() == tool["grads"].keys() and len(clean["grads"]) > 10
    assert all(torch.equal(tool["grads"][name], clean["grads"][name]) for name in clean["grads"])
    assert trained["loss"]["pg_loss"] != clean["loss"]["pg_loss"]
    assert max((trained["grads"][n] - clean["grads"][n]).abs().max().item() for n in clean["grads"]) > 1e-3


def assert_on_policy_pair_identical(result: dict) -> None:
    """The on-policy update without the old-log-prob pass: the same loss, metrics, gradients and
    weights as with it, and the sync probe measured on the update's forward equals the probe on
    the pass."""
    with_pass, skipped = result["pass"], result["skip"]
    assert set(with_pass["metrics"]) == set(skipped["metrics"])
    assert {"rollout/logprob_diff", "rollout/logprob_diff_max", "actor/pg_loss", "actor/grad_norm",
            *(f"training/rollout_probs_diff_{s}" for s in ("max", "mean", "std"))} <= set(skipped["metrics"])
    for name, value in with_pass["metrics"].items():
        assert skipped["metrics"][name] == pytest.approx(value, rel=1e-6, abs=1e-9), name
    assert skipped["metrics"]["rollout/logprob_diff"] > 1e-4  # the probe sees the noise put on the rollout log-probs
    assert skipped["metrics"]["actor/ppo_kl"] == 0.0 and skipped["metrics"]["actor/pg_clipfrac"] == 0.0  # ratio 1
    assert with_pass["grads"].keys() == skipped["grads"].keys() and len(with_pass["grads"]) >= 8  # rank 0's parameters
    assert max((with_pass["grads"][n] - skipped["grads"][n]).abs().max().item() for n in with_pass["grads"]) <= 1e-7
    assert max_weight_diff(skipped["weights"], with_pass["weights"]) <= 1e-7
    assert "only for one optimizer step per batch" in result["off_policy_error"]


def test_on_policy_update_without_the_old_log_prob_pass_is_identical(single):
    assert_on_policy_pair_identical(single["on_policy"])


def test_packed_and_padded_micro_batches_give_the_same_results(single):
    """use_remove_padding on (the default, every test above) and off: the same log-probs, entropy,
    reference log-probs, values, losses, gradient norms and weights after the step, for fixed
    micro-batches and token budgets (which cost real tokens packed, samples x longest padded)."""
    padded = single["padded"]
    assert (padded["log_probs"] - single["log_probs"]["log_probs"]).abs().max() <= TOLERANCE
    assert (padded["entropy"] - single["log_probs"]["entropy"]).abs().max() <= TOLERANCE
    assert (padded["reference"] - single["reference"]["log_probs"]).abs().max() <= TOLERANCE
    assert (padded["values"] - single["critic"]["values"]).abs().max() <= TOLERANCE
    for name in ("mbs2", "dynamic"):
        ours, packed = padded[f"update/{name}"], single[f"update/{name}"]
        for metric in ("actor/pg_loss", "actor/entropy", "actor/kl_loss", "actor/grad_norm"):
            assert ours["metrics"][metric] == pytest.approx(packed["metrics"][metric], rel=1e-5, abs=1e-7), (name, metric)
        assert max_weight_diff(ours["weights"], packed["weights"]) <= TOLERANCE


def test_padding_never_enters_the_loss(single):
    """Padded rows with other token ids at every padding position and noise on those positions' logits:
    the loss pieces and every gradient are bit for bit those of the clean rows."""
    isolation = single["padded"]["isolation"]
    clean, noisy = isolation["clean"], isolation["noisy"]
    assert isolation["padding_positions"] >= 8
    assert noisy["loss"] == clean["loss"]
    assert all(torch.equal(noisy["grads"][name], clean["grads"][name]) for name in clean["grads"])
