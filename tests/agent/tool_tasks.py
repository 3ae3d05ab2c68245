"""Tool-calling tasks for the training tests: data, tool configs and format warm-ups on a tiny model.

``gsm8k``: verl's multi-turn GSM8K (``prepare gsm8k --multiturn`` rows, verl's own
``gsm8k_tool_config.yaml``). Its warm-up teaches the format only: call ``calc_gsm8k_reward`` with a
*random* number, read the tool's reply, answer ``#### <that number>``.

``lookup`` (the learning test): "What is the code of item 417?" where each item's code is a secret
digit that only the ``lookup`` tool knows (it gets the sample's answer through
``tools_kwargs.lookup.create_kwargs``, as verl's GSM8K tool gets its ground truth). Nothing in
the prompt says anything about the code: without the tool the best policy is a guess (chance 0.1).
The warm-up teaches the format only: call ``lookup``, read its reply, answer with a *uniformly
random* digit, so its answers carry no information and accuracy after it is chance; RL has to
discover that the reply is the answer.
"""
from __future__ import annotations

import random
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

VERL_GSM8K_TOOL_CONFIG = (Path(__file__).resolve().parents[1] / "config" / "verl_launches" / "tool_config" /
                          "gsm8k_tool_config.yaml")  # verl's file, unchanged
GSM8K_SAMPLE = Path(__file__).resolve().parent / "gsm8k_sample"  # the first rows of openai/grade-school-math (MIT)
def tool_call(name: str, **arguments) -> dict:
    return {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {
        "name": name, "arguments": arguments}}]}


# ----------------------------------------------------------------------------- GSM8K (verl's)
def gsm8k_data(out: Path, num_train: int = 64, num_test: int = 16) -> dict[str, Path]:
    from megarl.data.prepare import gsm8k_rows

    files = {}
    for split, count in (("train", num_train), ("test", num_test)):
        rows = gsm8k_rows(GSM8K_SAMPLE / f"{split}.jsonl", split, multiturn=True)[:count]
        files[split] = out / f"{split}.parquet"
        out.mkdir(parents=True, exist_ok=True)
        pq.write_table(pa.Table.from_pylist(rows), files[split])
    return files


def gsm8k_conversation(prompts: list[list[dict]]):
    def make(rng: random.Random) -> list[dict]:
        guess = str(rng.randrange(1, 200))
        return list(rng.choice(prompts)) + [
            tool_call("calc_gsm8k_reward", answer=guess),
            {"role": "tool", "content": f"Current parsed answer={guess!r} reward=0.0"},
            {"role": "assistant", "content": f"#### {guess}"}]
    return make


# The test model's chat template leaves the tool schemas out of the prompt (as many real templates
# do): a tiny model learns the call format from the warm-up, and prompts stay ~20 tokens, not ~250.
PLAIN_CHATML = (
    "{%- for message in messages %}"
    "{%- if message['role'] == 'tool' %}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + message['content'] + '\\n</tool_response><|im_end|>\\n' }}"
    "{%- elif message['role'] == 'assistant' and message['tool_calls'] %}"
    "{{- '<|im_start|>assistant\\n' + message['content'] }}"
    "{%- for call in message['tool_calls'] %}"
    "{{- '<tool_call>{\"name\": \"' + call['function']['name'] + '\", \"arguments\": ' + (call['function']['arguments'] | tojson) + '}</tool_call>' }}"
    "{%- endfor %}{{- '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")


def tiny_tool_model(out: Path, size: str = "tiny") -> Path:
    """A tiny Qwen3 model, its chat template without the tool schemas (``PLAIN_CHATML``)."""
    from transformers import AutoTokenizer

    from megarl.devtools.tiny_model import make_tiny_model

    path = make_tiny_model("qwen3", size, out, seed=0, overwrite=True)
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.chat_template = PLAIN_CHATML
    tokenizer.save_pretrained(path)
    return path


def tool_schemas(config: Path) -> list:
    from megarl.agent.tools.config import load_tool_config

    return [tool.get_openai_tool_schema() for tool in load_tool_config(config)]


# ----------------------------------------------------------------------------- lookup (learning test)
LOOKUP_SOURCE = "megarl/lookup"
LOOKUP_TOOL = '''
from megarl.agent.tools import BaseTool, ToolResponse

class LookupTool(BaseTool):
    """Tells the code of this sample's item (create_kwargs: code)."""

    async def create(self, instance_id=None, code=None, **kwargs):
        return await super().create(instance_id, code=code)

    async def execute(self, instance_id, parameters, **kwargs):
        return ToolResponse(text=str(self.instance(instance_id)["code"])), 0.0, {}
'''
LOOKUP_CONFIG = """tools:
  - class_name: {path}:LookupTool
    config: {{type: native}}
    tool_schema:
      type: function
      function:
        name: lookup
        description: The code of the item in question.
        parameters: {{type: object, properties: {{}}}}
"""
DISABLED_LOOKUP = '''
def lookup() -> str:
    """The code of the item in question."""
    return "Error: the lookup service is not available."
'''
LOOKUP_REWARD = '''
import re

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """1 if the final answer (the first digit after the last tool response) is the code."""
    final = re.search(r"\\d", solution_str.split("</tool_response>")[-1])
    return 1.0 if final is not None and final.group() == str(ground_truth) else 0.0
'''


def lookup_rows(count: int, split: str, rng: random.Random) -> list[dict]:
    rows = []
    for index in range(count):
        item, code = rng.randint(100, 999), rng.randint(0, 9)
        rows.append({"data_source": LOOKUP_SOURCE, "agent_name": "tool_agent",
                     "prompt": [{"role": "user", "content": f"What is the code of item {item}?"}],
                     "reward_model": {"style": "rule", "ground_truth": str(code)},
                     "extra_info": {"split": split, "index": index,
                                    "tools_kwargs": {"lookup": {"create_kwargs": {"code": code}}}}})
    return rows


def lookup_files(out: Path, num_train: int = 1024, num_test: int = 100) -> dict[str, Path]:
    rng = random.Random(1)
    out.mkdir(parents=True, exist_ok=True)
    files = {"tool": out / "lookup_tool.py", "tools": out / "lookup.yaml", "disabled": out / "disabled_lookup.py",
             "reward": out / "reward.py", "train": out / "train.parquet", "test": out / "test.parquet"}
    files["tool"].write_text(LOOKUP_TOOL)
    files["tools"].write_text(LOOKUP_CONFIG.format(path=files["tool"]))
    files["disabled"].write_text(DISABLED_LOOKUP)
    files["reward"].write_text(LOOKUP_REWARD)
    pq.write_table(pa.Table.from_pylist(lookup_rows(num_train, "train", rng)), files["train"])
    pq.write_table(pa.Table.from_pylist(lookup_rows(num_test, "test", rng)), files["test"])
    return files


def lookup_conversation(rng: random.Random) -> list[dict]:
    item, code = rng.randint(100, 999), rng.randint(0, 9)
    return [{"role": "user", "content": f"What is the code of item {item}?"}, tool_call("lookup"),
            {"role": "tool", "content": str(code)}, {"role": "assistant", "content": str(rng.randint(0, 9))}]
