"""The engine on image samples (``RLBatch.multi_modal_inputs``) against Hugging Face: in this process at
TP=PP=1, and in one torchrun launch (2 ranks) at TP=2 + SP, PP=2 (padded and packed) and DP=2.

The batch (``_vision_engine_data``) mixes image and text samples in verl's layout (left-padded prompts,
right-padded responses). The actor's log-prob pass (``compute_log_prob``, the call the trainer makes) must give
HF's log-probs of the response tokens, packed (``use_remove_padding``) and padded, with micro-batches that split
the images; one update step's pg_loss and gradient norm must equal a direct HF step (vision tower included).
"""
import dataclasses

import pytest
import torch

import _engine_data as _data
import _engine_hf
import _vision_engine_data as _vision
from _engine_launch import run_worker
from megarl.engine import MegatronActor
from megarl.models import ParallelLayout, build_model

pytestmark = [pytest.mark.timeout(400), pytest.mark.usefixtures("world")]
WORKER = __import__("pathlib").Path(__file__).with_name("_vision_engine_worker.py")

TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def vision_work(tmp_path_factory):
    from megarl.devtools.tiny_model import make_tiny_model

    root = tmp_path_factory.mktemp("vision_engine")
    cases = {}
    for family in _vision.FAMILIES:
        make_tiny_model(family, "tiny", root / family, seed=0)
        batch = _vision.image_batch(root / family, family)
        hf = _vision.hf_log_probs(root / family, batch)
        cases[family] = {"batch": batch, "hf": hf, "trained": _data.with_behaviour_log_probs(batch, hf)}
    torch.save({"batches": {family: case["trained"] for family, case in cases.items()}}, root / "batch.pt")
    return root, cases


@pytest.fixture(scope="module")
def hf_steps(vision_work):
    """HF's training step (pg_loss, grad norm) per family on the batch with old/ref log-probs."""

    from tests.models.vision_fixture import hf_model

    root, cases = vision_work
    original, steps = _engine_hf.load_causal_lm, {}
    try:
        for family, case in cases.items():
            _engine_hf.load_causal_lm = lambda path, batch=case["trained"]: _vision.WithImages(hf_model(path), batch)
            steps[family] = _engine_hf.hf_training_steps(root / family, [case["trained"]], _data.LOSS, _data.OPTIM)
    finally:
        _engine_hf.load_causal_lm = original
    return steps


def _actor(checkpoint, dynamic: bool = False, **settings):
    """The actor at TP1; ``dynamic``: token-budget micro-batches (``use_dynamic_bsz``) for both passes, 100
    tokens for samples of 16..51: packed [[0, 3], [1, 2]] (out of order), padded [[0], [1], [2, 3]]."""
    settings = _data.actor_settings(**settings)
    if dynamic:
        budget = 100
        settings = dataclasses.replace(
            settings, train=dataclasses.replace(settings.train, use_dynamic_bsz=True, max_token_len=budget),
            log_prob=dataclasses.replace(settings.log_prob, use_dynamic_bsz=True, max_token_len=budget))
    return MegatronActor(build_model(checkpoint, ParallelLayout(), "actor"), settings)


@pytest.mark.parametrize("packed, dynamic", [(True, False), (False, False), (True, True), (False, True)],
                         ids=["packed", "padded", "packed_dynamic", "padded_dynamic"])
@pytest.mark.parametrize("family", _vision.FAMILIES)
def test_the_log_prob_pass_gives_hugging_faces_log_probs(vision_work, family, packed, dynamic):
    root, cases = vision_work
    batch, expected = cases[family]["batch"], cases[family]["hf"]
    assert batch.has_images() and not all(batch.multi_modal_inputs)  # image and text samples mixed
    # fixed micro-batches of 3: [0, 1, 2], [3]; token budgets: the samples dealt out of order
    log_probs, _ = _actor(root / family, dynamic, packed=packed).compute_log_prob(batch)
    assert (log_probs - expected).abs().max().item() <= TOLERANCE
    assert (log_probs != 0).sum() == batch.attention_mask[:, batch.prompt_length:].sum()


def test_without_the_images_the_log_probs_differ(vision_work):
    """The pixels reach the model: the same ids with the images zeroed give other log-probs."""
    root, cases = vision_work
    batch = cases["qwen2_5_vl"]["batch"]
    blank = [{k: torch.zeros_like(v) if k == "pixel_values" else v for k, v in s.items()} for s in batch.multi_modal_inputs]
    log_probs, _ = _actor(root / "qwen2_5_vl").compute_log_prob(batch.with_fields(multi_modal_inputs=blank))
    assert (log_probs - cases["qwen2_5_vl"]["hf"]).abs().max().item() > 1e-3


def _assert_step_matches(metrics, expected):
    assert metrics["actor/pg_loss"] == pytest.approx(expected["pg_losses"][0], rel=1e-5, abs=1e-6)
    assert metrics["actor/grad_norm"] == pytest.approx(expected["grad_norms"][0], rel=1e-4)


@pytest.mark.parametrize("dynamic", [False, True], ids=["fixed", "dynamic"])
@pytest.mark.parametrize("family", _vision.FAMILIES)
def test_an_update_step_matches_hugging_face(vision_work, hf_steps, family, dynamic):
    root, cases = vision_work
    metrics = _actor(root / family, dynamic, micro_batch_size=2).update_policy(cases[family]["trained"])
    _assert_step_matches(metrics, hf_steps[family])


@pytest.fixture(scope="module")
def distributed(vision_work):
    return run_worker(vision_work[0], "vision", processes=2, timeout=380, worker=WORKER)


SCENARIOS = [f"{family}/{layout}" for family in _vision.FAMILIES for layout in ("tp2_sp", "pp2_padded", "pp2_packed", "dp2")]


@pytest.mark.distributed
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_the_log_prob_pass_and_an_update_match_hugging_face_on_two_ranks(vision_work, hf_steps, distributed, scenario):
    family = scenario.split("/")[0]
    result = distributed[scenario]
    assert (result["log_probs"] - vision_work[1][family]["hf"]).abs().max().item() <= TOLERANCE
    _assert_step_matches(result["metrics"], hf_steps[family])


def test_a_text_model_refuses_a_batch_with_images(vision_work, tmp_path):
    from megarl.devtools.tiny_model import make_tiny_model

    make_tiny_model("qwen2", "tiny", tmp_path / "text", seed=0)
    _, cases = vision_work
    batch = cases["qwen2_5_vl"]["batch"]
    text_only = batch.with_fields(input_ids=batch.input_ids.clamp(max=500), multi_modal_inputs=None)
    _actor(tmp_path / "text").compute_log_prob(text_only)  # the same rows without images run
    with pytest.raises(ValueError, match="carries images .* text model"):
        _actor(tmp_path / "text").compute_log_prob(batch.with_fields(input_ids=text_only.input_ids))


def test_the_reference_pass_gives_hugging_faces_log_probs(vision_work):
    from megarl.engine import BatchSettings, MegatronReference

    root, cases = vision_work
    reference = MegatronReference(build_model(root / "qwen3_vl", ParallelLayout(), "ref"), BatchSettings(micro_batch_size=2))
    log_probs = reference.compute_ref_log_prob(cases["qwen3_vl"]["batch"])
    assert (log_probs - cases["qwen3_vl"]["hf"]).abs().max().item() <= TOLERANCE


def test_critic_values_see_the_images(vision_work):
    """A vision-language critic (the actor's checkpoint, a fresh value head): packed and padded values agree, and
    blank images change them."""
    from megarl.engine import BatchSettings, CriticSettings, MegatronCritic

    root, cases = vision_work
    batch = cases["qwen2_5_vl"]["batch"]
    values = {}
    for packed in (True, False):
        settings = CriticSettings(train=BatchSettings(micro_batch_size=2, use_remove_padding=packed),
                                  values=BatchSettings(micro_batch_size=3, use_remove_padding=packed))
        critic = MegatronCritic(build_model(root / "qwen2_5_vl", ParallelLayout(), "critic"), settings)
        values[packed] = critic.compute_values(batch)
    blank = [{k: torch.zeros_like(v) if k == "pixel_values" else v for k, v in s.items()} for s in batch.multi_modal_inputs]
    blanked = critic.compute_values(batch.with_fields(multi_modal_inputs=blank))
    assert (values[True] - values[False]).abs().max().item() <= TOLERANCE
    assert (blanked - values[False]).abs().max().item() > 1e-4
