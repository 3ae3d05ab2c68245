"""The engine on 2 ranks (torchrun, gloo): TP=2 with sequence parallelism, PP=2 (tied embeddings
across stages), DP=2 with token-budget micro-batches, PP=2 x VPP=2, and EP=2 for a MoE model;
then a checkpoint saved at TP=2 and resumed at PP=2.

One launch runs every scenario (``_engine_worker.py layouts``). Every layout must reproduce the
Hugging Face reference: log-probs, the mini-batch loss, the gradient norm and the weights after
one AdamW step on the whole batch (so the layouts also agree with each other and with TP=1).
"""
import pytest

import _engine_data as _data
import _engine_hf as _hf_reference
from _engine_launch import run_worker
from test_engine_single import assert_on_policy_pair_identical

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(400)]

TOLERANCE = 1e-5
LAYOUT_MODELS = {"tp2_sp": _data.DENSE, "pp2": _data.DENSE, "dp2": _data.DENSE, "pp2_vpp2": _data.DENSE_SMALL, "ep2": _data.MOE}


@pytest.fixture(scope="module")
def layouts(engine_work):
    return run_worker(engine_work, "layouts", processes=2, timeout=380)


@pytest.fixture(scope="module")
def hf_steps(engine_work, data):
    models = set(LAYOUT_MODELS.values())
    return {m: _hf_reference.hf_training_steps(engine_work / m, [data["batches"][m]], _data.LOSS, _data.OPTIM) for m in models}


def max_diff(a: dict, b: dict) -> float:
    assert a and set(a) <= set(b), sorted(set(a) - set(b))
    return max((a[name] - b[name]).abs().max().item() for name in a)


@pytest.mark.parametrize("layout", list(LAYOUT_MODELS))
def test_log_probs_and_entropy_match_hugging_face(layouts, engine_work, data, layout):
    """Vocab-parallel log-softmax and entropy at TP=2 (and the other layouts) against HF's full softmax."""
    model = LAYOUT_MODELS[layout]
    batch = data["batches"][model]
    log_probs, entropy = _hf_reference.hf_log_probs(engine_work / model, batch)
    assert layouts[layout]["log_probs"].shape == batch.response_mask.shape
    assert (layouts[layout]["log_probs"] - log_probs).abs().max() <= TOLERANCE
    assert (layouts[layout]["entropy"] - entropy).abs().max() <= TOLERANCE


@pytest.mark.parametrize("layout", list(LAYOUT_MODELS))
def test_one_training_step_matches_hugging_face(layouts, hf_steps, layout):
    result, reference = layouts[layout], hf_steps[LAYOUT_MODELS[layout]]
    assert result["metrics"]["actor/pg_loss"] == pytest.approx(reference["pg_losses"][0], rel=1e-5, abs=1e-6)
    assert result["metrics"]["actor/grad_norm"] == pytest.approx(reference["grad_norms"][0], rel=1e-4)
    assert max_diff(result["weights"], reference["weights"]) <= TOLERANCE


def test_critic_values_at_tp2_with_sequence_parallelism_match_hugging_face(layouts, engine_work, data):
    values = _hf_reference.hf_values(engine_work / _data.CRITIC, data["batches"][_data.DENSE])
    assert (layouts["critic_tp2_sp"] - values).abs().max() <= TOLERANCE


def test_checkpoint_saved_at_tp2_loads_at_pp2_with_weights_and_adam_moments(layouts):
    result = layouts["checkpoint"]
    assert result["extra"] == {"trainer_step": 1}
    assert max_diff(result["loaded_weights"], result["saved_weights"]) == 0.0
    saved, loaded = result["saved_moments"], result["loaded_moments"]
    assert set(saved) == set(loaded) and any(name.startswith("exp_avg_sq/") for name in saved)
    assert all(saved[name].abs().max() > 0 for name in saved)  # moments of a real step, not zeros
    assert max_diff(loaded, saved) == 0.0


def test_resumed_run_takes_the_same_next_step(layouts):
    """Step 2 after resuming at PP=2 equals step 2 of the uninterrupted TP=2 run: the weights, the
    Adam moments, the step count and the LR schedule (warmup: step 2 has lr/2) all carried over."""
    result = layouts["checkpoint"]
    continued, resumed = result["continued"], result["resumed"]
    assert result["loaded_steps"] == [1.0] and result["resumed_steps"] == [2.0]  # one Adam step count per parameter
    assert resumed["metrics"]["actor/lr"] == continued["metrics"]["actor/lr"] == pytest.approx(_data.LR / 2)
    assert resumed["metrics"]["actor/grad_norm"] == pytest.approx(continued["metrics"]["actor/grad_norm"], rel=1e-5)
    assert max_diff(resumed["weights"], continued["weights"]) <= TOLERANCE
    moved = max_diff(continued["weights"], result["saved_weights"])
    assert moved > 1e-4  # step 2 did train


def test_rng_states_are_restored_under_the_same_layout(layouts):
    result = layouts["checkpoint"]
    assert result["draws_after_same_layout_load"] == result["draws_after_save"]


def test_a_crash_during_save_leaves_the_previous_checkpoint_as_latest(layouts):
    result = layouts["checkpoint"]
    assert result["crash_raised"]
    assert result["latest_after_crash"] == "step_1"
    assert "step_2" not in result["dirs_after_crash"] and "step_2.tmp" in result["dirs_after_crash"]


@pytest.mark.parametrize("layout", ["dp2", "pp2"])
def test_on_policy_update_without_the_old_log_prob_pass_is_identical(layouts, layout):
    """As at TP=1, over two data-parallel ranks (the probe's mean and max reduce over DP) and two
    pipeline stages (they come from the last stage)."""
    assert_on_policy_pair_identical(layouts[f"on_policy/{layout}"])


def test_top_k_distillation_at_tp2_with_sequence_parallelism_trains_as_hugging_face(layouts, engine_work, data):
    """The task's loss plus the forward KL over a teacher's top-k tokens: the student's log-probs of the k ids
    come from vocabulary shards (megarl.engine.vocab_parallel_log_probs_at); HF's from its full softmax."""
    reference = _hf_reference.hf_training_steps(engine_work / _data.DENSE, [data["distill"]], _data.DISTILL_LOSS,
                                                _data.OPTIM)
    result = layouts["distill_topk_tp2_sp"]
    assert 0 < result["metrics"]["distillation/teacher_mass"] < 1 and result["metrics"]["distillation/token_loss"] > 0
    assert result["metrics"]["actor/grad_norm"] == pytest.approx(reference["grad_norms"][0], rel=1e-4)
    assert max_diff(result["weights"], reference["weights"]) <= TOLERANCE
