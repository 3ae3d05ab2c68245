"""A scripted stand-in for the engine, fake tools, and helpers for driving an agent loop in a test."""
from __future__ import annotations

import asyncio
from typing import Any

from megarl.agent.chat import render_text
from megarl.agent.loop import AgentContext, AgentSample
from megarl.agent.settings import MultiTurnSettings
from megarl.agent.tools.base import BaseTool, ToolResponse
from megarl.agent.tools.toolset import ToolSet
from megarl.rollout.sample import Generation
from megarl.rollout.sampling import Sampling

SAMPLING = Sampling(n=1, temperature=1.0, top_p=1.0, top_k=-1, max_tokens=64)
QUESTION = [{"role": "system", "content": "Use the tools."}, {"role": "user", "content": "What is 12 * 34?"}]


def schema(name: str, **properties: str) -> dict:
    return {"type": "function", "function": {"name": name, "description": f"the {name} tool", "parameters": {
        "type": "object", "properties": {k: {"type": v} for k, v in properties.items()}}}}


class ScriptedClient:
    """Plays the model: call k returns the tokens of ``script[k]`` followed by the end-of-turn token,
    each with log-prob ``-0.5 - 0.001 * position``; records every context and seed it was given."""

    def __init__(self, tokenizer, script: list[str], max_model_len: int = 4096):
        self.tokenizer, self.script, self.max_model_len = tokenizer, list(script), max_model_len
        self.contexts: list[list[int]] = []
        self.seeds: list[int] = []
        self.sampled: list[list[int]] = []
        self.images: list[list] = []  # the images each call was given

    def room(self, num_tokens: int) -> int:
        return self.max_model_len - num_tokens

    async def generate(self, prompt_ids, sampling, seed, max_tokens=None, images=()) -> Generation:
        assert len(prompt_ids) + max_tokens <= self.max_model_len, "the loop asked for more than the context holds"
        self.images.append(list(images))
        text = self.script[len(self.contexts)]
        self.contexts.append(list(prompt_ids))
        self.seeds.append(seed)
        ids = list(self.tokenizer(text, add_special_tokens=False)["input_ids"]) + [self.tokenizer.eos_token_id]
        cut = ids[:max_tokens]
        self.sampled.append(cut)
        return Generation(cut, [-0.5 - 0.001 * i for i in range(len(cut))], "length" if len(cut) < len(ids) else "stop",
                          None, self.tokenizer.decode(cut, skip_special_tokens=True))

    async def generate_group(self, prompt_ids, sampling, seed, n, max_tokens=None, images=()) -> list[Generation]:
        return [await self.generate(prompt_ids, sampling, seed + k, max_tokens, images) for k in range(n)]


class EchoTool(BaseTool):
    """Replies with its ``text`` argument, after ``delay_s``; step reward 0.25 per call."""

    def __init__(self, config=None, tool_schema=None):
        super().__init__(config, tool_schema or schema("echo", text="string"))
        self.delay_s = float(self.config.get("delay_s", 0.0))
        self.created: list[dict] = []
        self.released: list[str] = []
        self.running = self.most_at_once = 0

    async def create(self, instance_id=None, **kwargs):
        self.created.append(kwargs)
        return await super().create(instance_id, **kwargs)

    async def execute(self, instance_id, parameters, **kwargs):
        self.running += 1
        self.most_at_once = max(self.most_at_once, self.running)
        try:
            await asyncio.sleep(self.delay_s)
        finally:
            self.running -= 1
        return ToolResponse(text=str(parameters.get("text", ""))), 0.25, {}

    async def calc_reward(self, instance_id, **kwargs):
        return 1.0

    async def release(self, instance_id, **kwargs):
        self.released.append(instance_id)
        await super().release(instance_id)


class RaisingTool(BaseTool):
    def __init__(self, config=None, tool_schema=None):
        super().__init__(config, tool_schema or schema("boom"))

    async def execute(self, instance_id, parameters, **kwargs):
        raise RuntimeError("the tool broke")


class HangingTool(BaseTool):
    def __init__(self, config=None, tool_schema=None):
        super().__init__(config, tool_schema or schema("hang"))

    async def execute(self, instance_id, parameters, **kwargs):
        await asyncio.sleep(3600)


class HugeTool(BaseTool):
    """A response of 10,000 characters: 'A' * 5000 + 'Z' * 5000."""

    def __init__(self, config=None, tool_schema=None):
        super().__init__(config, tool_schema or schema("huge"))

    async def execute(self, instance_id, parameters, **kwargs):
        return "A" * 5000 + "Z" * 5000, 0.0, {}


def context(tokenizer, tools: list[BaseTool], response_length: int = 512, **settings: Any) -> AgentContext:
    timeout = settings.pop("tool_timeout_s", 5.0)
    return AgentContext(tokenizer=tokenizer, response_length=response_length,
                        multi_turn=MultiTurnSettings(enable=True, tool_timeout_s=timeout, **settings),
                        tools=ToolSet({t.name: t for t in tools}, timeout))


def sample(tokenizer, ctx: AgentContext, messages=QUESTION, extra_info=None, sample_index: int = 0) -> AgentSample:
    text = render_text(tokenizer, messages, ctx.tools.schemas, True)
    prompt_ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    return AgentSample(prompt_ids=prompt_ids, messages=list(messages), extra_info=dict(extra_info or {}),
                       prompt_index=3, sample_index=sample_index, step=7, base_seed=11, sampling=SAMPLING)


def call(name: str, **arguments: Any) -> str:
    import json

    return "<tool_call>" + json.dumps({"name": name, "arguments": arguments}) + "</tool_call>"


def run(loop, sample_, client):
    return asyncio.run(loop.run(sample_, client))
