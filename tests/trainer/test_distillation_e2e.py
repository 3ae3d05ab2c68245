"""On-policy distillation end to end on CPU: the quickstart student, a teacher that knows the sums, on vLLM.

The teacher is the quickstart model after supervised steps on the right answers. Its vLLM replica
must score a batch's response tokens as transformers does (padding, prompts of several lengths),
and a GRPO run with the distillation loss added must train through the real fleet, teacher and
weight sync, logging the distillation metrics every step.

The learning curve (``make test-all``, marker ``curve``): the quickstart model after its GRPO run
(validation 1.00) teaches the warmed-up model with the top-k forward KL added to GRPO; over the same
40 steps from the same start, GRPO alone stays near its start (measured: 0.08 -> 0.04) while the
distilled student's validation rises (0.08 -> 0.93). Each step takes 64 prompts x 2 samples: the
answer of this task is one token, so the top-k loss teaches at one position per prompt, and a step
of 16 prompts (the quickstart's) learned too slowly to show it in 40 steps.
"""
from __future__ import annotations

import math
import random
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from megarl.checks import load_config

pytestmark = [pytest.mark.ray, pytest.mark.vllm, pytest.mark.slow, pytest.mark.usefixtures("joins_ray")]
STEPS = 3
TOPK = 25  # more than vLLM's default cap of 20 log-probs per position: the teacher engine raises it


@pytest.fixture(scope="module")
def inputs(quickstart_inputs, tmp_path_factory):
    from megarl.devtools.chat_warmup import warmup_on_conversations

    root = tmp_path_factory.mktemp("distillation")
    made = quickstart_inputs  # tests/conftest.py: built once per session
    rows = pq.read_table(made["data"] / "train.parquet").to_pylist()

    def answered(rng: random.Random) -> list[dict]:
        row = rows[rng.randrange(len(rows))]
        return [*row["prompt"], {"role": "assistant", "content": str(row["reward_model"]["ground_truth"])}]

    teacher = warmup_on_conversations(made["model"], root / "teacher", answered, tools=None, steps=40, lr=1e-3,
                                      seed=0, label="the teacher's supervised steps")
    return {**made, "teacher": teacher, "rows": rows}


def overrides(inputs, out: Path, *extra: str) -> list[str]:
    return [f"data.train_files={inputs['data'] / 'train.parquet'}", f"data.val_files={inputs['data'] / 'test.parquet'}",
            f"actor_rollout_ref.model.path={inputs['model']}", f"trainer.default_local_dir={out}",
            f"trainer.total_training_steps={STEPS}", "trainer.test_freq=-1", "trainer.val_before_train=false",
            "trainer.save_freq=-1", "distillation.enabled=true", "distillation.nnodes=1",
            "distillation.n_gpus_per_node=1", f"distillation.teacher_models.teacher_model.model_path={inputs['teacher']}",
            "distillation.teacher_models.teacher_model.inference.tensor_model_parallel_size=1", *extra]


@pytest.mark.timeout(600)
def test_the_teacher_scores_a_batch_as_transformers_does(ray_address, inputs, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from megarl.cluster.ray_cluster import init_ray, shutdown_ray
    from megarl.engine import RLBatch
    from megarl.settings.distillation import distillation_settings
    from megarl.trainer.teachers import Teachers

    tokenizer = AutoTokenizer.from_pretrained(inputs["model"])
    prompts = [tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=True,
                                             return_dict=True)["input_ids"] for row in inputs["rows"][:4]]
    prompts[1] = prompts[1][3:]  # prompts of several lengths: left padding
    generator = torch.Generator().manual_seed(0)
    responses = [torch.randint(3, 300, (n,), generator=generator).tolist() for n in (2, 5, 1, 4)]
    width, length = max(map(len, prompts)), max(map(len, responses))
    ids = torch.zeros(4, width + length, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, (p, r) in enumerate(zip(prompts, responses)):
        ids[i, width - len(p):width], mask[i, width - len(p):width] = torch.tensor(p), 1
        ids[i, width:width + len(r)], mask[i, width:width + len(r)] = torch.tensor(r), 1
    batch = RLBatch(ids, mask, mask[:, width:].clone())

    init_ray(address=ray_address)
    teachers = None
    try:
        topk = load_config("quickstart", overrides(inputs, tmp_path, "distillation.distillation_loss.loss_mode=forward_kl_topk",
                                                   f"distillation.distillation_loss.topk={TOPK}"))
        teachers = Teachers.start(distillation_settings(topk), use_gpu=False)
        fields = teachers.log_probs(batch, {})
        plain = teachers.fleets["default"].compute_log_probs(prompts, responses)  # the sampled tokens only
    finally:
        if teachers is not None:
            teachers.close()
        shutdown_ray()
    model = AutoModelForCausalLM.from_pretrained(inputs["teacher"], dtype=torch.float32)
    scored, top_ids, top_lps = (fields[name] for name in ("teacher_log_probs", "teacher_topk_ids",
                                                          "teacher_topk_log_probs"))
    assert top_ids.shape == top_lps.shape == (*batch.response_mask.shape, TOPK)
    for i, (p, r) in enumerate(zip(prompts, responses)):
        with torch.no_grad():
            logits = model(torch.tensor([p + r])).logits[0, len(p) - 1:-1]
        log_softmax = torch.log_softmax(logits, -1)
        expected = log_softmax.gather(-1, torch.tensor(r).unsqueeze(-1)).squeeze(-1)
        assert torch.allclose(scored[i, :len(r)], expected, atol=1e-4), (i, scored[i], expected)
        assert torch.allclose(torch.tensor(plain[i]), expected, atol=1e-4), (i, plain[i], expected)
        assert (scored[i, len(r):] == 0).all() and (top_lps[i, len(r):] == 0).all()
        best = log_softmax.topk(TOPK, dim=-1)
        assert torch.allclose(top_lps[i, :len(r)], best.values, atol=1e-4), i  # most likely first
        # the teacher's own top-k tokens (up to the order of near ties): their log-probs are the k largest
        assert torch.allclose(log_softmax.gather(-1, top_ids[i, :len(r)]), best.values, atol=1e-4), i


def scalars(out: Path) -> dict[str, list[tuple[int, float]]]:
    acc = EventAccumulator(str(out / "tensorboard"))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


@pytest.mark.timeout(900)
def test_grpo_with_a_distillation_loss_trains_through_the_teacher(inputs, tmp_path):
    from megarl.run.train import run

    out = tmp_path / "run"
    run(load_config("quickstart", overrides(inputs, out, "distillation.distillation_loss.loss_mode=forward_kl_topk",
                                            "distillation.distillation_loss.topk=8",
                                            "distillation.distillation_loss.distillation_loss_coef=0.5")))
    logged = scalars(out)
    for name in ("distillation/loss", "distillation/token_loss", "distillation/teacher_log_prob",
                 "distillation/student_mass", "distillation/teacher_mass", "timing_s/teacher", "actor/pg_loss"):
        values = [v for _, v in logged[name]]
        assert len(values) == STEPS and all(math.isfinite(v) for v in values), (name, values)
    assert all(v > 0 for _, v in logged["distillation/token_loss"])  # the student is not the teacher
    assert all(0 < v <= 1 for name in ("distillation/student_mass", "distillation/teacher_mass")
               for _, v in logged[name])
    assert all(v < 0 for _, v in logged["distillation/teacher_log_prob"])
    assert max(v for _, v in logged["rollout/logprob_diff"]) < 1e-4  # the fleet still follows the trainer
    driver = (out / "logs" / "driver.log").read_text()
    assert "distillation: teacher" in driver and "1 replica(s) x TP1" in driver


@pytest.fixture(scope="module")
def grpo_teacher(inputs, tmp_path_factory):
    """The quickstart model after the quickstart's GRPO run, exported in HF format with its last checkpoint."""
    from megarl.run.train import run

    out = tmp_path_factory.mktemp("grpo_teacher")
    last = run(load_config("quickstart", [
        f"data.train_files={inputs['data'] / 'train.parquet'}", f"data.val_files={inputs['data'] / 'test.parquet'}",
        f"actor_rollout_ref.model.path={inputs['model']}", f"trainer.default_local_dir={out}", "trainer.save_freq=120",
        "actor_rollout_ref.actor.checkpoint.save_contents=[model,hf_model]"]))
    vals = [h["val/score"] for h in last["_history"] if "val/score" in h]
    assert vals[-1] >= 0.9, f"the teacher's GRPO run did not learn: {vals}"
    (exported,) = out.glob("actor/step_*/huggingface")
    return exported


@pytest.mark.curve
@pytest.mark.timeout(1800)
def test_distillation_from_a_stronger_teacher_rises_faster_than_grpo_alone(inputs, grpo_teacher, tmp_path):
    from megarl.run.train import run

    common = [f"data.train_files={inputs['data'] / 'train.parquet'}", f"data.val_files={inputs['data'] / 'test.parquet'}",
              f"actor_rollout_ref.model.path={inputs['model']}", "trainer.total_training_steps=40", "trainer.test_freq=20",
              "trainer.save_freq=-1", "data.train_batch_size=64", "actor_rollout_ref.rollout.n=2",
              "actor_rollout_ref.actor.ppo_mini_batch_size=32"]
    distill = ["distillation.enabled=true", "distillation.nnodes=1", "distillation.n_gpus_per_node=1",
               f"distillation.teacher_models.teacher_model.model_path={grpo_teacher}",
               "distillation.teacher_models.teacher_model.inference.tensor_model_parallel_size=1",
               "distillation.distillation_loss.loss_mode=forward_kl_topk", "distillation.distillation_loss.topk=16"]
    curves = {}
    for name, extra in (("distilled", distill), ("grpo", [])):
        last = run(load_config("quickstart", [*common, f"trainer.default_local_dir={tmp_path / name}", *extra]))
        curves[name] = [h["val/score"] for h in last["_history"] if "val/score" in h]
    distilled, alone = curves["distilled"], curves["grpo"]
    assert distilled[0] == alone[0]  # the same start
    assert distilled[-1] >= 0.5 and distilled[-1] - alone[-1] >= 0.3, curves
    losses = [v for _, v in scalars(tmp_path / "distilled")["distillation/token_loss"]]
    assert sum(losses[-5:]) / 5 < 0.85 * sum(losses[:5]) / 5, losses  # the student moves toward the teacher
