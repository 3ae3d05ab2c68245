"""The built-in agent loops: ``single_turn_agent`` (alias ``single_turn``) and ``tool_agent``.

``single_turn_agent``: one engine call; the response is what the model sampled. With the seeds of
``turn_seed`` it samples exactly what ``RolloutFleet.generate`` samples for the same prompt.

``tool_agent`` (verl's): the model answers; every ``<tool_call>`` in its turn (format
``multi_turn.format``) is executed, concurrently, up to ``max_parallel_calls`` per turn; the
responses, cut to ``max_tool_response_length`` characters, are rendered with the chat template's
tool role and appended with loss mask 0; then the model continues. It stops on:

- a turn without a tool call (``stop``);
- the response budget, ``rollout.response_length`` tokens of model and tool output together, or
  the engine's context (``length``; the last turn is cut to fit);
- ``max_assistant_turns`` model turns or ``max_user_turns`` tool turns (``max_turns``).

A malformed call, an unknown tool, a tool that raises, times out or returns garbage becomes an
error message in the tool turn (the model may try again) and is counted. Per-sample extras:
``num_turns`` (model + tool turns), ``tool_calls`` (executed), ``tool_errors``,
``tool_timeouts``, ``tool_malformed``, ``tool_reward`` (step rewards plus ``calc_reward``),
``tool_truncated`` (responses cut), and, with the drift check on, ``drift`` (1 if the turn-by-turn
tokens differ from the whole-conversation render).
"""
from __future__ import annotations

import asyncio
import logging
from typing import Any

from megarl.agent.chat import check_drift, env_turn_ids
from megarl.agent.loop import AgentLoop, AgentSample, register_agent_loop
from megarl.agent.parsers import ParsedTurn, get_tool_parser
from megarl.agent.settings import truncate_text
from megarl.agent.trajectory import Trajectory, TrajectoryBuilder

logger = logging.getLogger(__name__)


@register_agent_loop("single_turn_agent")
@register_agent_loop("single_turn")
class SingleTurnAgentLoop(AgentLoop):
    groups_samples = True  # a prompt's n samples are one engine request (its prefix is computed once)

    async def run(self, sample: AgentSample, client) -> Trajectory:
        return (await self.run_group([sample], client))[0]

    async def run_group(self, samples: list[AgentSample], client) -> list[Trajectory]:
        first = samples[0]
        if [s.sample_index for s in samples] != list(range(first.sample_index, first.sample_index + len(samples))):
            raise ValueError(f"run_group takes consecutive samples of one prompt, got {[s.sample_index for s in samples]}")
        builder = TrajectoryBuilder(first.prompt_ids, self.context.response_length)
        room = min(builder.room, client.room(len(first.prompt_ids)))
        if room < 1:
            return [TrajectoryBuilder(s.prompt_ids, self.context.response_length).build("length", "", num_turns=1)
                    for s in samples]
        # the k-th sample's seed is seed(0) of sample k = the group's seed + k (rollout.sampling.turn_seed)
        generations = await client.generate_group(first.prompt_ids, first.sampling, first.seed(0), len(samples),
                                                  max_tokens=room, images=first.images)
        trajectories = []
        for sample, generation in zip(samples, generations):
            builder = TrajectoryBuilder(sample.prompt_ids, self.context.response_length)
            builder.add_model(generation.token_ids, generation.logprobs, generation.versions)
            trajectories.append(builder.build(generation.finish_reason, generation.text, num_turns=2))
        return trajectories


@register_agent_loop("tool_agent")
class ToolAgentLoop(AgentLoop):
    uses_tools = True

    def __init__(self, context):
        super().__init__(context)
        if not context.tools:
            raise ValueError("the tool_agent loop (a row's agent_name, or agent.default_agent_loop) needs tools: set "
                             "actor_rollout_ref.rollout.multi_turn.enable=True and multi_turn.tool_config_path or "
                             "multi_turn.function_tool_path")
        self.settings = context.multi_turn
        self.parser = get_tool_parser(self.settings.format)
        self.schemas = context.tools.schemas
        self._warned_drift = False

    async def run(self, sample: AgentSample, client) -> Trajectory:
        ctx, settings, tools = self.context, self.settings, self.context.tools
        tokenizer = ctx.tokenizer
        builder = TrajectoryBuilder(sample.prompt_ids, ctx.response_length)
        messages = [dict(m) for m in sample.messages]  # as a chat API would store them (for the drift check)
        counts = dict(tool_calls=0, tool_errors=0, tool_timeouts=0, tool_malformed=0, tool_truncated=0)
        step_rewards, assistant_turns, user_turns = 0.0, 0, 0
        instances = await tools.create(sample.tools_kwargs)
        finish = "stop"
        try:
            while True:
                room = min(builder.room, client.room(len(builder.context)))
                if room < 1:
                    finish = "length"
                    break
                generation = await client.generate(builder.context, sample.sampling, sample.seed(assistant_turns),
                                                   max_tokens=room, images=sample.images)
                assistant_turns += 1
                builder.add_model(generation.token_ids, generation.logprobs, generation.versions)
                turn = self.parser.parse(tokenizer.decode(generation.token_ids, skip_special_tokens=True))
                messages.append(_assistant_message(turn))
                if generation.finish_reason == "length":
                    finish = "length"
                    break
                if not turn.wants_tools:
                    break
                if settings.max_assistant_turns and assistant_turns >= settings.max_assistant_turns:
                    finish = "max_turns"
                    break
                if settings.max_user_turns and user_turns >= settings.max_user_turns:
                    finish = "max_turns"
                    break
                replies = await self._execute(turn, instances, sample, counts)
                step_rewards += sum(reward for _, reward in replies)
                tool_messages = [{"role": "tool", "content": text} for text, _ in replies]
                user_turns += 1
                last = generation.token_ids[-1] if generation.token_ids else None
                ids = env_turn_ids(tokenizer, messages[-1], tool_messages, last, self.schemas, ctx.chat_template_kwargs)
                messages += tool_messages
                if not builder.add_env(ids):
                    finish = "length"
                    break
            final_rewards = await tools.rewards(instances, sample.tools_kwargs)
        finally:
            await tools.release(instances, sample.tools_kwargs)
        extras: dict[str, Any] = dict(num_turns=assistant_turns + user_turns + 1, **counts,
                                      tool_reward=step_rewards + sum(final_rewards.values()))
        if settings.tokenization_sanity_check_mode != "disable":
            extras["drift"] = self._drift(builder, messages, finish)
        text = tokenizer.decode(builder.response_ids, skip_special_tokens=True)
        return builder.build(finish, text, **extras)

    async def _execute(self, turn: ParsedTurn, instances: dict, sample: AgentSample, counts: dict) -> list[tuple[str, float]]:
        """One reply per call and per malformed call, in the order the model wrote them."""
        tools, limit = self.context.tools, self.settings.max_parallel_calls
        calls = turn.calls[:limit]
        outcomes = await asyncio.gather(*[tools.call(c.name, c.arguments, instances, sample.tools_kwargs) for c in calls])
        replies = []
        for outcome in outcomes:
            counts["tool_calls"] += 1
            if outcome.error:
                counts["tool_errors"] += 1
                counts["tool_timeouts"] += outcome.error == "timeout"
            text, cut = truncate_text(outcome.text, self.settings.max_tool_response_length,
                                      self.settings.tool_response_truncate_side)
            counts["tool_truncated"] += cut
            replies.append((text, outcome.reward))
        for _ in turn.calls[limit:]:
            counts["tool_errors"] += 1
            replies.append((f"Error: at most {limit} tool call(s) per turn are executed; this one was not.", 0.0))
        for error in turn.errors:
            counts["tool_malformed"] += 1
            counts["tool_errors"] += 1
            replies.append((f"Error: {error}", 0.0))
        return replies

    def _drift(self, builder: TrajectoryBuilder, messages: list[dict], finish: str) -> int:
        if finish == "length":  # a cut turn has no whole-conversation render to compare with
            return 0
        ctx, mode = self.context, self.settings.tokenization_sanity_check_mode
        found = check_drift(ctx.tokenizer, builder.context, messages, self.schemas, mode, ctx.chat_template_kwargs)
        if found is None:
            return 0
        if self.settings.drift_action == "raise":
            raise RuntimeError(f"token drift ({mode} check): {found.describe()}. Fix the chat template, or set "
                               "multi_turn.tokenization_sanity_check_mode=ignore_strippable/disable or "
                               "multi_turn.drift_action=warn")
        if not self._warned_drift:
            self._warned_drift = True
            logger.warning("token drift (%s check, reported once; counted in agent/drift_ratio): %s", mode,
                           found.describe())
        return 1


def _assistant_message(turn: ParsedTurn) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": turn.content}
    if turn.calls:
        message["tool_calls"] = [{"type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                                 for c in turn.calls]
    return message
