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
