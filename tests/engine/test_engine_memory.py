"""The memory and training knobs on 2 ranks (one torchrun launch, ``_memory_worker.py memory``):

* ``nccl_timeout``: the default group and megatron's groups get the configured timeout;
* uneven pipeline stages (``num_layers_in_first_pipeline_stage=1`` of 4 layers, PP=2) give the
  log-probs and the training step of HF and of PP=1; a checkpoint saved under them (model and HF
  export only) loads at PP=1, and asking it for optimizer state fails by name;
* recompute (full uniform / full block / selective) lowers the activation memory autograd holds
  and changes neither the loss nor the gradients;
* offload: weights, grads and distributed-optimizer state leave their storages and come back bit
  for bit; the step after the round trip equals the step without it; a checkpoint written while
  offloaded resumes to the same step.
"""
from pathlib import Path

import pytest
from safetensors.torch import load_file

import _engine_data as _data
import _engine_hf as _hf_reference
from _engine_launch import run_worker

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(500)]

TOLERANCE = 1e-5
WORKER = Path(__file__).with_name("_memory_worker.py")


@pytest.fixture(scope="module")
def memory(engine_work):
    return run_worker(engine_work, "memory", processes=2, timeout=480, worker=WORKER)


def max_diff(a: dict, b: dict) -> float:
    assert a and set(a) <= set(b), sorted(set(a) ^ set(b))
    return max((a[name] - b[name]).abs().max().item() for name in a)


def test_collectives_get_the_configured_timeout(memory):
    assert memory["timeouts"] == {"world": 4321, "data_parallel": 1234, "tensor_parallel": 1234, "pipeline": 1234}


def test_uneven_stages_give_the_log_probs_and_step_of_hugging_face_and_pp1(memory, engine_work, data):
    result = memory["uneven"]
    assert result["layers_on_stage"] == [1]  # rank 0 is stage 0: one layer (stage 1 has the other 3)
    model = _data.DENSE_SMALL
    batch = data["batches"][model]
    log_probs, entropy = _hf_reference.hf_log_probs(engine_work / model, batch)
    assert (result["log_probs"] - log_probs).abs().max() <= TOLERANCE
    assert (result["entropy"] - entropy).abs().max() <= TOLERANCE
    assert (result["log_probs"] - result["even"]["log_probs"]).abs().max() <= TOLERANCE
    reference = _hf_reference.hf_training_steps(engine_work / model, [batch], _data.LOSS, _data.OPTIM)
    assert result["metrics"]["actor/pg_loss"] == pytest.approx(reference["pg_losses"][0], rel=1e-5, abs=1e-6)
    assert result["metrics"]["actor/grad_norm"] == pytest.approx(reference["grad_norms"][0], rel=1e-4)
    assert max_diff(result["weights"], reference["weights"]) <= TOLERANCE
    assert max_diff(result["weights"], result["even"]["weights"]) <= TOLERANCE


def test_a_checkpoint_of_uneven_stages_loads_at_pp1_with_its_hf_export(memory, engine_work, caplog):
    result = memory["uneven"]
    assert result["contents"] == ["model", "hf_model"]
    assert max_diff(result["loaded_weights"], result["weights"]) == 0.0
    assert "model.safetensors" in result["hf_export"] and "config.json" in result["hf_export"]
    exported = load_file(str(engine_work / "uneven_checkpoints" / "step_1" / "huggingface" / "model.safetensors"))
    assert max_diff(result["weights"], exported) == 0.0
    assert "not ['optimizer', 'rng']" in result["missing_optimizer_error"]
    # a resume asking for parts the checkpoint lacks is refused by key; without them it is allowed and logged
    from megarl.trainer.checkpointing import check_loadable

    key = "actor_rollout_ref.actor.checkpoint.load_contents"
    path = engine_work / "uneven_checkpoints" / "step_1"
    with pytest.raises(ValueError, match=r"saved without \['optimizer', 'extra'\].*load_contents=\['model', 'optimizer', 'extra'\]"):
        check_loadable(path, ["model", "optimizer", "extra"], key)
    with caplog.at_level("WARNING", logger="megarl.trainer.checkpointing"):
        check_loadable(path, ["model", "hf_model"], key)
    assert "has no 'optimizer': Adam restarts from zero moments" in caplog.text


def test_recompute_lowers_activation_memory_and_keeps_loss_and_gradients(memory):
    runs = memory["recompute"]
    base = runs["none"]
    for name in ("full_uniform", "full_block", "selective"):
        run = runs[name]
        assert run["metrics"]["actor/pg_loss"] == pytest.approx(base["metrics"]["actor/pg_loss"], abs=1e-6), name
        assert run["metrics"]["actor/grad_norm"] == pytest.approx(base["metrics"]["actor/grad_norm"], abs=1e-6), name
        assert max_diff(run["weights"], base["weights"]) <= 1e-6, name
    peak = {name: run["peak_activation_bytes"] for name, run in runs.items()}
    assert peak["full_uniform"] < peak["full_block"] < peak["none"], peak  # block recomputes 2 of 4 layers
    assert peak["full_uniform"] < 0.5 * peak["none"], peak
    assert peak["selective"] < peak["none"], peak


def test_offload_frees_the_storages_and_brings_back_the_same_bits(memory):
    result = memory["offload"]
    partial = result["partial"]
    assert partial["resident"] == {"params": True, "grads": False, "optimizer": False}
    assert partial["param_bytes"] > 0 and partial["state_bytes"] == 0
    out = result["out"]
    assert out["resident"] == {"params": False, "grads": False, "optimizer": False}
    assert out["param_storage_bytes"] == out["state_storage_bytes"] == out["grad_storage_bytes"] == 0
    assert out["params_moved"] and out["readable_while_offloaded"]  # host copies, readable in place
    back = result["back"]
    assert back["resident"] == {"params": True, "grads": True, "optimizer": True}
    assert back["same_storages"] and back["params_exact"] and back["state_exact"]
    assert back["grads_zero"] and back["grad_storage_bytes"] > 0


def test_the_step_after_an_offload_round_trip_equals_the_step_without_it(memory):
    steps = memory["offload"]["steps"]
    assert steps["round_trip"]["metrics"] == steps["twin"]["metrics"]
    assert max_diff(steps["round_trip"]["weights"], steps["twin"]["weights"]) == 0.0
    # a checkpoint written from the offloaded (host) state resumes to the same step
    assert steps["loaded"]["extra"] == {"step": 1}
    assert steps["loaded"]["metrics"]["actor/grad_norm"] == pytest.approx(steps["twin"]["metrics"]["actor/grad_norm"], rel=1e-6)
    assert max_diff(steps["loaded"]["weights"], steps["twin"]["weights"]) <= 1e-6
