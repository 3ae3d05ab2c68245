"""The agent keys: validation before any process starts, old spellings, refusals, data columns."""
from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from megarl.settings.agent import agent_settings
from megarl.checks import ConfigError, load_config

BASE = ["data.train_files=x.parquet", "actor_rollout_ref.model.path=/m", "algorithm.adv_estimator=grpo",
        "trainer.n_gpus_per_node=1", "data.train_batch_size=2", "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=1"]
MT = "actor_rollout_ref.rollout.multi_turn"


def test_old_spelling_is_read_with_one_note(tmp_path):
    tools = tmp_path / "tools.yaml"
    tools.write_text("tools:\n  - class_name: calculator\n")
    notes: list[str] = []
    cfg = load_config(None, BASE + [f"{MT}.enable=true", f"actor_rollout_ref.rollout.tool_kwargs.tools_config_file={tools}"],
                      notes=notes)
    assert cfg.actor_rollout_ref.rollout.multi_turn.tool_config_path == str(tools)
    assert [n for n in notes if "old spelling" in n] == [
        "actor_rollout_ref.rollout.tool_kwargs.tools_config_file: an old spelling, read as "
        "actor_rollout_ref.rollout.multi_turn.tool_config_path"]


@pytest.mark.parametrize("override,message", [
    (f"{MT}.enable=true", "multi_turn.enable=True needs tools"),
    (f"{MT}.tool_config_path=/no/such.yaml", "tool_config_path=/no/such.yaml: file not found"),
    (f"{MT}.interaction_config_path=x.yaml", "interactions .* is not supported"),
    (f"{MT}.use_inference_chat_template=true", "keeps the tokens of every turn as sampled"),
    (f"{MT}.num_repeat_rollouts=2", "use actor_rollout_ref.rollout.n"),
    (f"{MT}.tool_response_truncate_side=top", "tool_response_truncate_side='top'"),
    (f"{MT}.tokenization_sanity_check_mode=loose", "tokenization_sanity_check_mode='loose'"),
    (f"{MT}.max_assistant_turns=0", "max_assistant_turns=0"),
    ("actor_rollout_ref.rollout.agent.custom_async_server.path=x.py", "custom rollout servers is not supported"),
    ("actor_rollout_ref.rollout.agent.num_workers=-1", "agent.num_workers=-1"),
])
def test_bad_agent_keys_fail_before_any_process_naming_the_key(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, BASE + [override])


def test_agent_name_column_picks_the_loop_and_tool_rows_render_their_schemas(tmp_path):
    from megarl.agent.rollout import LoopSet, build_agent_context, tool_schemas_for
    from megarl.settings.agent import default_loop_name
    from megarl.settings.data import build_dataset
    from megarl.data.rows import DataFormatError
    from megarl.devtools.tiny_tokenizer import build_tokenizer

    tools = tmp_path / "tools.yaml"
    tools.write_text("tools:\n  - class_name: calculator\n")
    rows = [{"data_source": "s", "prompt": [{"role": "user", "content": "What is 2 * 3?"}],
             "reward_model": {"ground_truth": "6"}, "agent_name": name} for name in ("tool_agent", None)]
    data = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist(rows), data)
    with pytest.raises(ConfigError, match="no tool is built"):  # multi_turn.enable is off: the tools would be unused
        load_config(None, BASE + [f"data.train_files={data}", f"{MT}.tool_config_path={tools}"])
    cfg = load_config(None, BASE + [f"data.train_files={data}"])
    tokenizer = build_tokenizer("qwen3")
    context = build_agent_context(agent_settings(cfg), tokenizer)
    assert context.tools is None
    with pytest.raises(ValueError, match="needs tools: set actor_rollout_ref.rollout.multi_turn.enable=True"):
        build_dataset(cfg.data, tokenizer, "train",
                      chat_tools=tool_schemas_for(LoopSet(context), default_loop_name(cfg.actor_rollout_ref.rollout)))
    cfg = load_config(None, BASE + [f"data.train_files={data}", f"{MT}.tool_config_path={tools}", f"{MT}.enable=true"])
    context = build_agent_context(agent_settings(cfg), tokenizer)
    assert default_loop_name(cfg.actor_rollout_ref.rollout) == "tool_agent"
    dataset = build_dataset(cfg.data, tokenizer, "train",
                            chat_tools=tool_schemas_for(LoopSet(context), default_loop_name(cfg.actor_rollout_ref.rollout)))
    assert [item.agent_name for item in dataset.items] == ["tool_agent", None]
    assert all('"name": "calculator"' in item.prompt_text for item in dataset.items)  # None -> the default, tool_agent
    bad = tmp_path / "bad.parquet"
    pq.write_table(pa.Table.from_pylist([{**rows[0], "agent_name": ""}]), bad)
    with pytest.raises(DataFormatError, match="row 0: key 'agent_name'"):
        build_dataset(load_config(None, BASE + [f"data.train_files={bad}"]).data, tokenizer, "train")


def test_unknown_loops_are_refused_with_the_known_names(tmp_path):
    from megarl.agent import resolve_agent_loop
    from megarl.agent.builtin_loops import SingleTurnAgentLoop

    with pytest.raises(ValueError, match="unknown agent loop 'react'.*single_turn_agent.*tool_agent"):
        resolve_agent_loop("react")
    file = tmp_path / "loops.py"
    file.write_text("from megarl.agent.builtin_loops import SingleTurnAgentLoop\nclass Mine(SingleTurnAgentLoop):\n    pass\n")
    assert issubclass(resolve_agent_loop(f"{file}:Mine"), SingleTurnAgentLoop)
    with pytest.raises(TypeError, match="not a subclass"):
        resolve_agent_loop("megarl.agent.settings:MultiTurnSettings")


EVIL_LOOP = '''
import pathlib
pathlib.Path({marker!r}).write_text("imported")  # code a downloaded dataset would run
from megarl.agent.builtin_loops import SingleTurnAgentLoop
class Loop(SingleTurnAgentLoop):
    pass
'''


@pytest.mark.parametrize("named", ["file", "module"])
def test_a_dataset_picks_among_the_configs_loops_and_never_imports_what_it_names(tmp_path, monkeypatch, named):
    """A row's agent_name naming a file or module (a dataset that would run code when loaded) is refused,
    naming the row and the allowed loops, and nothing is imported; the config may name the same file."""
    from megarl.agent.loop import DisallowedAgentLoop
    from megarl.agent.rollout import LoopSet, build_agent_context, tool_schemas_for
    from megarl.settings.agent import default_loop_name
    from megarl.settings.data import build_dataset
    from megarl.data.rows import DataFormatError
    from megarl.devtools.tiny_tokenizer import build_tokenizer

    marker = tmp_path / "imported.txt"
    (tmp_path / "evil_loops.py").write_text(EVIL_LOOP.format(marker=str(marker)))
    monkeypatch.syspath_prepend(str(tmp_path))
    target = f"{tmp_path / 'evil_loops.py'}:Loop" if named == "file" else "evil_loops:Loop"
    rows = [{"data_source": "s", "prompt": [{"role": "user", "content": "What is 2 * 3?"}],
             "reward_model": {"ground_truth": "6"}, "agent_name": name} for name in (None, "single_turn", target)]
    data = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist(rows), data)
    cfg = load_config(None, BASE + [f"data.train_files={data}"])
    tokenizer = build_tokenizer("qwen3")
    loops = LoopSet(build_agent_context(agent_settings(cfg), tokenizer))
    chat_tools = tool_schemas_for(loops, default_loop_name(cfg.actor_rollout_ref.rollout))
    with pytest.raises(DataFormatError, match=rf"train\.parquet: row 2: key 'agent_name': agent loop '{target}' is not "
                                              r"one of this run's: single_turn, single_turn_agent, tool_agent \("):
        build_dataset(cfg.data, tokenizer, "train", chat_tools=chat_tools)
    with pytest.raises(DisallowedAgentLoop):  # the rollout's own gate (rows that skipped the dataset's check)
        loops.get(target)
    assert not marker.exists(), "a name from the data was imported"

    # the config names the loop: its default may be that path, and a row may then name it too
    cfg = load_config(None, BASE + [f"data.train_files={data}", f"actor_rollout_ref.rollout.agent.default_agent_loop={target}"])
    loops = LoopSet(build_agent_context(agent_settings(cfg), tokenizer))
    dataset = build_dataset(cfg.data, tokenizer, "train", chat_tools=tool_schemas_for(loops, target))
    assert [item.agent_name for item in dataset.items] == [None, "single_turn", target] and marker.exists()


def test_agent_loop_config_names_are_what_rows_pick(tmp_path):
    from megarl.agent.builtin_loops import SingleTurnAgentLoop
    from megarl.agent.loop import allowed_loop_names
    from megarl.agent.rollout import LoopSet, build_agent_context
    from megarl.devtools.tiny_tokenizer import build_tokenizer

    (tmp_path / "mine.py").write_text("from megarl.agent.builtin_loops import SingleTurnAgentLoop\n"
                                      "class Mine(SingleTurnAgentLoop):\n    pass\n")
    listed = tmp_path / "loops.yaml"
    listed.write_text(f"- name: mine\n  _target_: {tmp_path / 'mine.py'}:Mine\n")
    cfg = load_config(None, BASE + [f"actor_rollout_ref.rollout.agent.agent_loop_config_path={listed}"])
    context = build_agent_context(agent_settings(cfg), build_tokenizer("qwen3"))
    assert allowed_loop_names(context) == ["mine", "single_turn", "single_turn_agent", "tool_agent"]
    assert isinstance(LoopSet(context).get("mine"), SingleTurnAgentLoop)
