"""Tool configs (verl's YAML, function tools) and the built-in calculator and answer-check tools."""
from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from megarl.agent.tools.answer_check import Geo3kTool, Gsm8kTool
from megarl.agent.tools.calculator import CalculatorError, CalculatorTool, SafeCalculator
from megarl.agent.tools.config import load_function_tools, load_tool_config
from megarl.agent.tools.toolset import ToolSet

VERL_TOOL_CONFIGS = Path(__file__).resolve().parents[1] / "config" / "verl_launches" / "tool_config"  # verl's files


def run(coro):
    return asyncio.run(coro)


def verl_configs() -> Path:
    return VERL_TOOL_CONFIGS


def test_verls_tool_configs_load_as_megarls_tools():
    gsm8k, = load_tool_config(verl_configs() / "gsm8k_tool_config.yaml")
    geo3k, = load_tool_config(verl_configs() / "geo3k_tool_config.yaml")
    assert isinstance(gsm8k, Gsm8kTool) and gsm8k.name == "calc_gsm8k_reward"
    assert isinstance(geo3k, Geo3kTool) and geo3k.name == "calc_geo3k_reward"
    assert gsm8k.get_openai_tool_schema()["function"]["parameters"]["required"] == ["answer"]


def test_gsm8k_tool_scores_like_verls():
    tool, = load_tool_config(verl_configs() / "gsm8k_tool_config.yaml")
    tools = ToolSet({tool.name: tool})
    instances = run(tools.create({tool.name: {"create_kwargs": {"ground_truth": "72"}}}))
    wrong = run(tools.call(tool.name, {"answer": "70"}, instances))
    right = run(tools.call(tool.name, {"answer": "72"}, instances))
    again = run(tools.call(tool.name, {"answer": "#### 72"}, instances))
    assert "reward=0.0" in wrong.text and wrong.reward == -0.05  # no better than the last answer (none: 0)
    assert "reward=1.0" in right.text and right.reward == 0.0  # improved
    assert again.reward == -0.05
    assert run(tools.rewards(instances)) == {tool.name: 1.0}
    with pytest.raises(ValueError, match="needs a ground_truth"):
        run(tools.create({}))


def test_gsm8k_tools_step_reward_compares_with_the_last_answer_as_verls_does():
    """verl's Gsm8kTool.execute: 0.0 if this answer scores above the previous one, else -0.05."""
    tool, = load_tool_config(verl_configs() / "gsm8k_tool_config.yaml")
    tools = ToolSet({tool.name: tool})
    instances = run(tools.create({tool.name: {"create_kwargs": {"ground_truth": "72"}}}))
    rewards = [run(tools.call(tool.name, {"answer": answer}, instances)).reward for answer in ("72", "70", "72")]
    assert rewards == [0.0, -0.05, 0.0]


def test_tool_config_errors_name_the_problem(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("tools:\n  - class_name: megarl.agent.tools.calculator.CalculatorTool\n    config: {type: mcp}\n")
    with pytest.raises(ValueError, match="type='mcp'.*native"):
        load_tool_config(bad)
    bad.write_text("tools:\n  - class_name: no.such.Tool\n")
    with pytest.raises(ImportError, match="no.such"):
        load_tool_config(bad)
    bad.write_text("tools:\n  - class_name: megarl.agent.tools.calculator.CalculatorTool\n    tool_schem: {}\n")
    with pytest.raises(ValueError, match="unknown keys \\['tool_schem'\\]"):
        load_tool_config(bad)
    bad.write_text("tools: []\n")
    with pytest.raises(ValueError, match="top-level 'tools' list"):
        load_tool_config(bad)
    good = tmp_path / "calc.yaml"
    good.write_text("tools:\n  - class_name: calculator\n    config: {max_digits: 50}\n")
    calc, = load_tool_config(good)
    assert calc.name == "calculator" and calc.calculator.max_digits == 50


def test_function_tools_from_a_file(tmp_path):
    file = tmp_path / "my_tools.py"
    file.write_text('''
import asyncio

def add(a: int, b: int = 0):
    """Add two integers.

    More detail the model does not need."""
    return a + b

async def shout(text: str) -> str:
    """Upper-case a text."""
    await asyncio.sleep(0)
    return text.upper()

def _private(): pass
''')
    add, shout = load_function_tools(file)
    schema = add.get_openai_tool_schema()["function"]
    assert schema["name"] == "add" and schema["description"] == "Add two integers."
    assert schema["parameters"]["properties"] == {"a": {"type": "integer"}, "b": {"type": "integer"}}
    assert schema["parameters"]["required"] == ["a"]
    tools = ToolSet({"add": add, "shout": shout})
    instances = run(tools.create({}))
    assert run(tools.call("add", {"a": 2, "b": 3}, instances)).text == "5"
    assert run(tools.call("shout", {"text": "hi"}, instances)).text == "HI"
    assert "no parameters ['c']" in run(tools.call("add", {"a": 1, "c": 2}, instances)).text
    assert run(tools.call("add", {"a": "x", "b": 1}, instances)).error == "raised"  # "x" + 1: a TypeError, reported


def test_a_blocking_function_tool_does_not_stall_other_calls(tmp_path):
    import time

    file = tmp_path / "slow.py"
    file.write_text("import time\n\ndef slow(seconds: float):\n    time.sleep(seconds)\n    return 'done'\n")
    slow, = load_function_tools(file)
    tools = ToolSet({"slow": slow}, timeout_s=0.5)
    instances = run(tools.create({}))

    async def both():
        return await asyncio.gather(tools.call("slow", {"seconds": 0.3}, instances),
                                    tools.call("slow", {"seconds": 0.3}, instances),
                                    tools.call("slow", {"seconds": 2}, instances))

    start = time.perf_counter()
    quick, other, stuck = run(both())
    assert time.perf_counter() - start < 1.5  # the two 0.3 s calls overlapped; the 2 s one timed out at 0.5 s
    assert quick.text == other.text == "done" and stuck.error == "timeout"


@pytest.mark.parametrize("expression,value", [("12 * 34", 408), ("2 ** 10", 1024), ("-(3 + 4) / 2", -3.5),
                                              ("sqrt(16) + max(1, 2)", 6.0), ("7 // 2 + 7 % 2", 4), ("pi > 3", None)])
def test_calculator_evaluates_arithmetic_only(expression, value):
    calc = SafeCalculator()
    if value is None:
        with pytest.raises(CalculatorError):
            calc.evaluate(expression)
    else:
        assert calc.evaluate(expression) == value


@pytest.mark.parametrize("expression", ["__import__('os').system('id')", "().__class__", "open('/etc/passwd')",
                                        "9 ** 9 ** 9", "10 ** 5000", "[x for x in range(9)]", "'a' * 3", "1e308 * 10",
                                        "x", "1 / 0", "1 +", "2 ** 3000"])
def test_calculator_refuses_anything_else_cheaply(expression):
    with pytest.raises(CalculatorError):
        SafeCalculator().evaluate(expression)


def test_calculator_tool_replies_with_the_value_or_an_error():
    tool = CalculatorTool()
    response, reward, _ = run(tool.execute("i", {"expression": "123456789 * 987654321"}))
    assert response.text == str(123456789 * 987654321) and reward == 0.0
    response, _, metrics = run(tool.execute("i", {"expression": "import os"}))
    assert response.text.startswith("Error:") and metrics == {"calculator_error": 1}
    with pytest.raises(ValueError, match="unknown config keys"):
        CalculatorTool({"max_digitz": 5})


VERL_GSM8K_TOOL_FILE = '''
import logging
from typing import Any, Optional
from uuid import uuid4

from verl.utils.reward_score import gsm8k
from verl.utils.rollout_trace import rollout_trace_op
from verl.tools.base_tool import BaseTool
from verl.tools.schemas import OpenAIFunctionToolSchema, ToolResponse


class Gsm8kTool(BaseTool):
    pass
'''


def test_a_tool_file_copied_from_verl_names_every_megarl_replacement(tmp_path):
    """verl's Gsm8kTool, copied as a user file: its five verl imports, each with megarl's replacement, in a config
    problem before any process starts (not a raw ModuleNotFoundError)."""
    from megarl.checks import ConfigError, load_config
    from tests.config._fixtures import write_model_config, write_prompts
    from tests.config.test_preflight import BATCH

    (tmp_path / "my_gsm8k_tool.py").write_text(VERL_GSM8K_TOOL_FILE)
    config = tmp_path / "tools.yaml"
    config.write_text(f"tools:\n  - class_name: {tmp_path / 'my_gsm8k_tool.py'}:Gsm8kTool\n")
    with pytest.raises(ImportError) as info:
        load_tool_config(config)
    message = str(info.value)
    for replacement in ("from megarl.agent.tools import BaseTool", "from megarl.agent.tools import ToolResponse",
                        "from megarl.rewards import gsm8k", "delete the @rollout_trace_op decorator",
                        "tool_schema is the OpenAI schema as a plain dict"):
        assert replacement in message, message
    assert "imports 'verl' (No module named 'verl'): megarl does not install verl" in message
    model, data = write_model_config(tmp_path / "model"), write_prompts(tmp_path / "train.parquet", rows=8)
    with pytest.raises(ConfigError) as info:
        load_config(None, [*BATCH, f"actor_rollout_ref.model.path={model}", f"data.train_files={data}",
                           f"actor_rollout_ref.rollout.multi_turn.tool_config_path={config}",
                           "actor_rollout_ref.rollout.multi_turn.enable=True"], preflight=True)
    (problem,) = info.value.problems
    assert problem.key == "actor_rollout_ref.rollout.multi_turn.tool_config_path"
    assert "from megarl.agent.tools import BaseTool" in problem.message


VERL_SANDBOX_FUSION = """tools:
  - class_name: "verl.tools.sandbox_fusion_tools.SandboxFusionTool"
    config: {CONFIG}
    tool_schema:
      type: "function"
      function:
        name: "code_interpreter"
        description: "A tool for executing code."
        parameters:
          type: "object"
          properties:
            code:
              type: "string"
              description: "The code to execute."
          required: ["code"]
"""


@pytest.mark.heavy  # starts a process
def test_verls_sandbox_fusion_config_maps_onto_the_python_tool_and_refuses_the_rest(tmp_path):
    from megarl.agent.tools.python_code import PythonCodeTool

    config = tmp_path / "sandbox_fusion_tool_config.yaml"
    config.write_text(VERL_SANDBOX_FUSION.replace("{CONFIG}", '{"sandbox_fusion_url": "https://x.example/run_code", '
                                                              '"default_language": "cpp", "num_workers": 4}'))
    with pytest.raises(ValueError) as info:
        load_tool_config(config)
    message = str(info.value)
    assert "verl's SandboxFusionTool runs as megarl's python tool" in message
    assert "sandbox_fusion_url: megarl runs the code in its local sandbox (bubblewrap)" in message
    assert "default_language: megarl's sandbox runs Python only" in message
    config.write_text(VERL_SANDBOX_FUSION.replace("{CONFIG}", '{"default_timeout": 5, "memory_limit_mb": 256, '
                                                              '"num_workers": 8, "rate_limit": 3, "type": native}'))
    tool, = load_tool_config(config)
    assert isinstance(tool, PythonCodeTool) and tool.name == "code_interpreter"
    assert (tool.limits.timeout_s, tool.limits.cpu_s, tool.limits.memory_mb, tool.max_concurrent_calls) == (5, 5, 256, 3)
    assert run(tool.execute("i", {"code": "print(6 * 7)"}))[0].text == "42"
    with pytest.raises(ImportError, match="class_name verl.tools.search_tool.SearchTool is verl's, and megarl has no "
                                          "counterpart; megarl maps .*SandboxFusionTool"):
        config.write_text("tools:\n  - class_name: verl.tools.search_tool.SearchTool\n")
        load_tool_config(config)


def test_the_python_tool_runs_at_most_max_concurrent_calls_at_once(monkeypatch):
    import megarl.agent.tools.python_code as python_code
    from megarl.agent.tools.sandbox import SandboxResult

    running, most = [0], [0]

    async def sandbox(code, limits):  # stands for the sandbox: counts the calls inside it at once
        running[0] += 1
        most[0] = max(most[0], running[0])
        await asyncio.sleep(0.01)
        running[0] -= 1
        return SandboxResult("ok", "", 0, False, False, 0.01)

    monkeypatch.setattr(python_code, "run_python", sandbox)

    async def calls(tool):
        return await asyncio.gather(*(tool.execute(str(i), {"code": "pass"}) for i in range(5)))

    for limit, expected in ((2, 2), (None, 5)):
        most[0] = 0
        run(calls(python_code.PythonCodeTool({"max_concurrent_calls": limit} if limit else {})))
        assert most[0] == expected


LOOKUP = {"type": "function", "function": {"name": "lookup_code", "description": "The code of an item.",
                                           "parameters": {"type": "object", "properties": {"item": {"type": "integer"}}}}}


def test_a_chat_template_that_renders_no_tool_schema_is_warned_about_before_start(caplog):
    """A template that ignores ``tools`` (the tiny Llama's, like SmolLM2's) leaves every schema out of the prompt: the
    run warns, naming the tools; Qwen3's renders them: no warning."""
    import logging
    from types import SimpleNamespace

    from megarl.agent.chat import dropped_tool_schemas
    from megarl.checks import load_config
    from megarl.devtools.tiny_tokenizer import build_tokenizer
    from megarl.run.train import tool_template_warning

    llama, qwen3 = build_tokenizer("llama"), build_tokenizer("qwen3")
    assert dropped_tool_schemas(llama, [LOOKUP]) == ["lookup_code"]
    assert dropped_tool_schemas(qwen3, [LOOKUP]) == []
    cfg = load_config("quickstart", ["data.train_files=/d/train.parquet", "actor_rollout_ref.model.path=/models/smol"])
    tools = SimpleNamespace(schemas=[LOOKUP])
    with caplog.at_level(logging.WARNING, logger="megarl.run.train"):
        tool_template_warning(cfg, qwen3, tools)
        assert not caplog.records
        tool_template_warning(cfg, llama, tools)
    (record,) = caplog.records
    assert record.getMessage().startswith("the chat template of /models/smol renders no schema of the tools "
                                          "lookup_code")
