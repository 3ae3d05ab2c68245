"""The verl guide's two workflows, as a verl user writes them, with only the model path and sizes changed.

Workflow 1: an override-only command (verl's quick start) on a parquet with only ``prompt`` and
``reward_model`` columns, scored by a custom per-sample ``compute_score``.
Workflow 2: a YAML in ``config/`` built on the default config, plus a command line, with a batch
reward function ``compute_reward(responses, ground_truths)``. Both pass the command line's checks;
Workflow 2 also runs for real: 2 GRPO steps on a tiny model (Megatron actor, vLLM fleet, Ray).
"""
from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from megarl.checks import load_config
from megarl.config.command_line import parse_command_line

SEED_REWARD = textwrap.dedent('''
    import json, os, re

    def compute_score(data_source, solution_str, ground_truth, extra_info=None):
        numbers = re.findall(r"-?\\d+", solution_str)
        return 1.0 if numbers and numbers[0] == str(ground_truth) else 0.0

    def compute_reward(responses, ground_truths):
        with open(os.environ["SEED_REWARD_CALLS"], "a") as log:   # each call, to check the batch form
            log.write(json.dumps(len(responses)) + "\\n")
        return [compute_score(None, r, g) for r, g in zip(responses, ground_truths)]
''')

WORKFLOW_2_YAML = textwrap.dedent('''
    hydra:
      searchpath:
        - file://verl/trainer/config
    defaults:
      - ppo_megatron_trainer
      - _self_

    data:
      train_files: data/train.parquet
      val_files: data/test.parquet
      max_prompt_length: 48
      max_response_length: 8
      train_batch_size: 4
    actor_rollout_ref:
      model:
        path: MODEL
      actor:
        ppo_mini_batch_size: 4
        ppo_micro_batch_size_per_gpu: 16
        optim:
          lr: 1.0e-4
        megatron:
          tensor_model_parallel_size: 1
          sequence_parallel: false
      rollout:
        name: vllm
        n: 4
        tensor_model_parallel_size: 1
        gpu_memory_utilization: 0.9
    custom_reward_function:
      path: reward.py
      name: compute_reward
    algorithm:
      adv_estimator: grpo
    trainer:
      logger: [console, tensorboard]
      n_gpus_per_node: 1
      nnodes: 1
      test_freq: 2
      save_freq: -1
      log_val_generations: 3
''')


def write_seed_parquet(questions: list[str], answers: list[str], path: Path) -> None:
    """The data snippet a verl user writes, with pandas (installed with megarl): a chat prompt and a ground truth."""
    import pandas as pd

    rows = [{"prompt": [{"role": "user", "content": q}], "reward_model": {"ground_truth": a}}
            for q, a in zip(questions, answers)]
    pd.DataFrame(rows).to_parquet(path)


@pytest.fixture(scope="module")
def seed_project(tmp_path_factory):
    """A user's directory: seed-style parquet files (prompt + reward_model only), reward.py, config/."""
    from megarl.data.prepare import prepare_arithmetic
    from megarl.devtools.tiny_model import make_tiny_model

    root = tmp_path_factory.mktemp("seed")
    model = make_tiny_model("llama", "tiny", root / "model", seed=0)
    prepare_arithmetic(root / "arith", num_train=64, num_test=8, seed=0, max_operand=8, ops=["+"], second_operand=1)
    (root / "data").mkdir()
    for split in ("train", "test"):
        questions = [row["prompt"][0]["content"] for row in pq.read_table(root / "arith" / f"{split}.parquet").to_pylist()]
        answers = [row["reward_model"]["ground_truth"] for row in pq.read_table(root / "arith" / f"{split}.parquet").to_pylist()]
        write_seed_parquet(questions, answers, root / "data" / f"{split}.parquet")
    assert pq.read_schema(root / "data" / "train.parquet").names == ["prompt", "reward_model"]
    (root / "reward.py").write_text(SEED_REWARD)
    (root / "config").mkdir()
    (root / "config" / "grpo_math.yaml").write_text(WORKFLOW_2_YAML.replace("MODEL", str(model)))
    return root, model


def workflow_1(root: Path, model: Path) -> list[str]:
    return ["algorithm.adv_estimator=grpo", f"data.train_files={root}/data/train.parquet",
            f"data.val_files={root}/data/test.parquet", "data.train_batch_size=4", "data.max_prompt_length=48",
            "data.max_response_length=8", f"actor_rollout_ref.model.path={model}",
            "actor_rollout_ref.actor.ppo_mini_batch_size=4", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16",
            "actor_rollout_ref.rollout.n=4", "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
            "actor_rollout_ref.rollout.name=vllm", f"custom_reward_function.path={root}/reward.py",
            "custom_reward_function.name=compute_score", "trainer.n_gpus_per_node=1", "trainer.logger=['console']",
            "trainer.total_epochs=1"]


WORKFLOW_2_ARGS = ["--config-path", "config", "--config-name", "grpo_math", "trainer.total_training_steps=2"]


def test_both_workflows_pass_the_command_line_checks(seed_project, monkeypatch):
    root, model = seed_project
    monkeypatch.chdir(root)
    cmd = parse_command_line(workflow_1(root, model))
    cfg = load_config(cmd.name, cmd.overrides, config_path=cmd.config_path, preflight=True)
    assert cfg.custom_reward_function.name == "compute_score" and cfg.data.filter_overlong_prompts is False
    cmd = parse_command_line(WORKFLOW_2_ARGS)
    cfg = load_config(cmd.name, cmd.overrides, config_path=cmd.config_path, preflight=True)
    assert (cfg.custom_reward_function.name, cfg.trainer.total_training_steps) == ("compute_reward", 2)
    assert cfg.data.train_files == "data/train.parquet"  # relative to the working directory, as in verl


def given_keys(root: Path, model: str) -> list[str]:
    """Every key the two workflows set: workflow 1's overrides and the leaves of workflow 2's YAML."""
    import yaml

    keys = [arg.split("=", 1)[0].lstrip("+~") for arg in workflow_1(root, model) if "=" in arg]

    def leaves(node, prefix=""):
        for name, value in node.items():
            if isinstance(value, dict):
                yield from leaves(value, f"{prefix}{name}.")
            else:
                yield f"{prefix}{name}"
    return keys + [k for k in leaves(yaml.safe_load(WORKFLOW_2_YAML)) if not k.startswith(("hydra.", "defaults"))]


def test_no_key_the_workflows_set_is_accepted_and_ignored(seed_project, monkeypatch):
    """Each key is a schema key (every one is read by a check or a settings constructor:
    tests/config/test_key_readers.py) and none is inert; on a CPU host the GPU-only
    rollout.gpu_memory_utilization=0.9 is accepted with a note saying so."""
    from megarl.config.screen import in_schema
    from megarl.devtools.key_readers import INERT
    from megarl.platform import has_cuda

    root, model = seed_project
    for key in given_keys(root, model):
        assert in_schema(key), key
        assert key not in INERT, f"{key} is accepted but has no effect: {INERT[key]}"
    monkeypatch.chdir(root)
    notes: list[str] = []
    cmd = parse_command_line(WORKFLOW_2_ARGS)
    load_config(cmd.name, cmd.overrides, config_path=cmd.config_path, notes=notes)
    said = [n for n in notes if n.startswith("actor_rollout_ref.rollout.gpu_memory_utilization=0.9")]
    assert len(said) == (0 if has_cuda() else 1), notes
    assert has_cuda() or "on this CPU host each engine's KV cache holds max_num_seqs sequences" in said[0]


@pytest.mark.ray
@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.usefixtures("joins_ray")
def test_workflow_2_trains_two_steps_with_the_batch_reward_and_logs_samples(seed_project, monkeypatch, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from megarl.run.train import main

    root, _ = seed_project
    monkeypatch.chdir(root)
    calls = tmp_path / "calls.jsonl"
    monkeypatch.setenv("SEED_REWARD_CALLS", str(calls))
    out = tmp_path / "run"
    assert main([*WORKFLOW_2_ARGS, f"trainer.default_local_dir={out}"]) == 0

    batch_sizes = [json.loads(line) for line in calls.read_text().splitlines()]
    assert batch_sizes == [8, 16, 16, 8], batch_sizes  # validation, 2 steps of 4 prompts x 4, validation: one call each
    acc = EventAccumulator(str(out / "tensorboard"), size_guidance={"tensors": 0})
    acc.Reload()
    scalars = set(acc.Tags()["scalars"])
    assert {"critic/score/mean", "actor/pg_loss", "rollout/logprob_diff", "val-core/unknown/reward/mean@1"} <= scalars
    assert [e.step for e in acc.Scalars("actor/pg_loss")] == [1, 2]
    samples = [json.loads(line) for line in (out / "val_generations.jsonl").read_text().splitlines()]
    assert [s["step"] for s in samples] == [0, 0, 0, 2, 2, 2]
    assert all(set(s) == {"step", "prompt", "response", "ground_truth", "score"} for s in samples)
    assert [s["prompt"] for s in samples[:3]] == [s["prompt"] for s in samples[3:]]  # the same prompts each time
    assert [e.step for e in acc.Tensors("val/generations/text_summary")] == [0, 2]
