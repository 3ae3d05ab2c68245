"""The engine on image samples (``RLBatch.multi_modal_inputs``), in this process at TP=PP=1, against Hugging Face.

The batch (``_vision_engine_data``) mixes image and text samples in verl's layout (left-padded prompts,
right-padded responses). The actor's log-prob pass (``compute_log_prob``, the call the trainer makes) must give
HF's log-probs of the response tokens, packed (``use_remove_padding``) and padded, with micro-batches that split
the images; one update step's pg_loss and gradient norm must equal a direct HF step (vision tower included).
"""
import pytest
import torch

import _engine_data as _data
import _engine_hf
import _vision_engine_data as _vision
from megarl.engine import MegatronActor
from megarl.models import ParallelLayout, build_model
from tests.models.test_bridge_tp1 import world  # noqa: F401  (the TP=1 process group)

pytestmark = pytest.mark.timeout(300)

TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def vision_work(tmp_path_factory):
    from megarl.devtools.tiny_model import make_tiny_model

    root = tmp_path_factory.mktemp("vision_engine")
    cases = {}
    for family in _vision.FAMILIES:
        make_tiny_model(family, "tiny", root / family, seed=0)
        batch = _vision.image_batch(root / family, family)
        cases[family] = {"batch": batch, "hf": _vision.hf_log_probs(root / family, batch)}
    return root, cases


def _actor(checkpoint, **settings):
    return MegatronActor(build_model(checkpoint, ParallelLayout(), "actor"), _data.actor_settings(**settings))


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "padded"])
@pytest.mark.parametrize("family", _vision.FAMILIES)
def test_the_log_prob_pass_gives_hugging_faces_log_probs(world, vision_work, family, packed):
    root, cases = vision_work
    batch, expected = cases[family]["batch"], cases[family]["hf"]
    assert batch.has_images() and not all(batch.multi_modal_inputs)  # image and text samples mixed
    log_probs, _ = _actor(root / family, packed=packed).compute_log_prob(batch)  # micro-batches of 3: [0, 1, 2], [3]
    assert (log_probs - expected).abs().max().item() <= TOLERANCE
    assert (log_probs != 0).sum() == batch.attention_mask[:, batch.prompt_length:].sum()


def test_without_the_images_the_log_probs_differ(world, vision_work):
    """The pixels reach the model: the same ids with the images zeroed give other log-probs."""
    root, cases = vision_work
    batch = cases["qwen2_5_vl"]["batch"]
    blank = [{k: torch.zeros_like(v) if k == "pixel_values" else v for k, v in s.items()} for s in batch.multi_modal_inputs]
    log_probs, _ = _actor(root / "qwen2_5_vl").compute_log_prob(batch.with_fields(multi_modal_inputs=blank))
    assert (log_probs - cases["qwen2_5_vl"]["hf"]).abs().max().item() > 1e-3


@pytest.mark.parametrize("family", _vision.FAMILIES)
def test_an_update_step_matches_hugging_face(world, vision_work, family, monkeypatch):
    from tests.models.vision_fixture import hf_model

    root, cases = vision_work
    batch = _data.with_behaviour_log_probs(cases[family]["batch"], cases[family]["hf"])
    monkeypatch.setattr(_engine_hf, "load_causal_lm", lambda path: _vision.WithImages(hf_model(path), batch))
    expected = _engine_hf.hf_training_steps(root / family, [batch], _data.LOSS, _data.OPTIM)
    metrics = _actor(root / family, micro_batch_size=2).update_policy(batch)
    assert metrics["actor/pg_loss"] == pytest.approx(expected["pg_losses"][0], rel=1e-5, abs=1e-6)
    assert metrics["actor/grad_norm"] == pytest.approx(expected["grad_norms"][0], rel=1e-4)


def test_a_text_model_refuses_a_batch_with_images(world, vision_work, tmp_path):
    from megarl.devtools.tiny_model import make_tiny_model

    make_tiny_model("qwen2", "tiny", tmp_path / "text", seed=0)
    _, cases = vision_work
    batch = cases["qwen2_5_vl"]["batch"]
    text_only = batch.with_fields(input_ids=batch.input_ids.clamp(max=500), multi_modal_inputs=None)
    _actor(tmp_path / "text").compute_log_prob(text_only)  # the same rows without images run
    with pytest.raises(ValueError, match="carries images .* text model"):
        _actor(tmp_path / "text").compute_log_prob(batch.with_fields(input_ids=text_only.input_ids))
