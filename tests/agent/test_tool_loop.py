"""The tool agent loop, driven by a scripted engine and fake tools: masks, termination, truncation,
failing tools, parallel calls, tools_kwargs, drift. No processes: each test runs in milliseconds."""
from __future__ import annotations

import asyncio
import logging
import time

import pytest

from megarl.agent.builtin_loops import SingleTurnAgentLoop, ToolAgentLoop
from megarl.agent.chat import encode, render_text
from megarl.agent.parsers import HermesToolParser
from megarl.agent.settings import truncate_text
from megarl.rollout.sampling import turn_seed
from megarl.trainer.rollout_batch import build_step_data

from tests.agent.fakes import (QUESTION, EchoTool, HangingTool, HugeTool, RaisingTool, ScriptedClient, call, context,
                               run, sample)


@pytest.fixture(scope="module")
def tokenizer():
    from megarl.devtools.tiny_tokenizer import build_tokenizer

    return build_tokenizer("qwen3")


def model_spans(trajectory):
    """(start, end) of each run of loss-mask 1 in the response."""
    spans, start = [], None
    for i, m in enumerate(trajectory.loss_mask + [0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            spans.append((start, i))
            start = None
    return spans


def test_masks_are_one_on_model_tokens_and_zero_on_tool_tokens(tokenizer):
    echo = EchoTool()
    ctx = context(tokenizer, [echo])
    s = sample(tokenizer, ctx)
    client = ScriptedClient(tokenizer, [call("echo", text="408"), "The answer is 408."])
    t = run(ToolAgentLoop(ctx), s, client)
    assert t.finish_reason == "stop" and t.extras["num_turns"] == 4 and t.extras["tool_calls"] == 1
    # the model's tokens, exactly as sampled, with mask 1 and their log-probs; everything else mask 0, log-prob 0
    spans = model_spans(t)
    assert [t.response_ids[a:b] for a, b in spans] == client.sampled
    assert [t.logprobs[a:b] for a, b in spans] == [[-0.5 - 0.001 * i for i in range(len(x))] for x in client.sampled]
    tool_part = t.response_ids[spans[0][1]:spans[1][0]]
    assert all(m == 0 for m in t.loss_mask[spans[0][1]:spans[1][0]])
    assert all(lp == 0.0 for lp, m in zip(t.logprobs, t.loss_mask) if m == 0)
    assert tokenizer.decode(tool_part) == "\n<|im_start|>user\n<tool_response>\n408\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    # the second turn saw the first turn and the tool turn, token for token
    assert client.contexts[1] == s.prompt_ids + t.response_ids[:spans[1][0]]
    # turn-by-turn tokens equal the chat template applied to the whole conversation: no drift
    assert t.extras["drift"] == 0
    whole = QUESTION + [{"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "echo", "arguments": {"text": "408"}}}]},
                        {"role": "tool", "content": "408"}, {"role": "assistant", "content": "The answer is 408."}]
    rendered = encode(tokenizer, render_text(tokenizer, whole, ctx.tools.schemas, False))
    assert rendered[:len(s.prompt_ids) + len(t.response_ids)] == s.prompt_ids + t.response_ids
    # seeds: one per turn, from (seed, step, prompt, sample, turn) only
    assert client.seeds == [turn_seed(11, 7, 3, 0, 0), turn_seed(11, 7, 3, 0, 1)]
    assert t.extras["tool_reward"] == pytest.approx(0.25 + 1.0)  # step reward + calc_reward
    assert len(echo.released) == 1
    # in the step batch: padding has mask 0 too, and the mask is the batch's response mask
    data = build_step_data({}, [t], [0], ["u"], pad_token_id=0, response_length=len(t.response_ids) + 5)
    assert data.batch.response_mask[0].tolist() == t.loss_mask + [0] * 5
    assert data["response_lengths"].tolist() == [sum(t.loss_mask)]


def test_a_turn_without_a_call_ends_the_loop(tokenizer):
    ctx = context(tokenizer, [EchoTool()])
    client = ScriptedClient(tokenizer, ["408", "never asked"])
    t = run(ToolAgentLoop(ctx), sample(tokenizer, ctx), client)
    assert t.finish_reason == "stop" and len(client.contexts) == 1 and t.loss_mask == [1] * len(t.response_ids)
    assert t.extras["num_turns"] == 2 and t.extras["tool_calls"] == 0


def test_max_assistant_and_user_turns(tokenizer):
    script = [call("echo", text=str(i)) for i in range(10)]
    ctx = context(tokenizer, [EchoTool()], max_assistant_turns=3)
    client = ScriptedClient(tokenizer, script)
    t = run(ToolAgentLoop(ctx), sample(tokenizer, ctx), client)
    assert t.finish_reason == "max_turns" and len(client.contexts) == 3 and t.extras["tool_calls"] == 2
    ctx = context(tokenizer, [EchoTool()], max_user_turns=2)
    client = ScriptedClient(tokenizer, script)
    t = run(ToolAgentLoop(ctx), sample(tokenizer, ctx), client)
    assert t.finish_reason == "max_turns" and len(client.contexts) == 3 and t.extras["num_turns"] == 3 + 2 + 1
    assert len(model_spans(t)) == 3


def test_response_budget_counts_model_and_tool_tokens_and_cuts_the_last_turn(tokenizer):
    script = [call("echo", text="x" * 40)] * 10
    first = ScriptedClient(tokenizer, script)
    unbounded = run(ToolAgentLoop(context(tokenizer, [EchoTool()], response_length=4096, max_assistant_turns=3)),
                    sample(tokenizer, context(tokenizer, [EchoTool()])), first)
    budget = len(unbounded.response_ids) - 7  # ends inside the third model turn
    ctx = context(tokenizer, [EchoTool()], response_length=budget)
    client = ScriptedClient(tokenizer, script)
    t = run(ToolAgentLoop(ctx), sample(tokenizer, ctx), client)
    assert t.finish_reason == "length" and len(t.response_ids) == budget
    assert t.response_ids == unbounded.response_ids[:budget] and t.loss_mask == unbounded.loss_mask[:budget]
    # a budget that ends inside a tool turn: the tool tokens are cut, no model turn follows
    spans = model_spans(unbounded)
    inside_tool = spans[0][1] + 3
    client = ScriptedClient(tokenizer, script)
    t = run(ToolAgentLoop(context(tokenizer, [EchoTool()], response_length=inside_tool)),
            sample(tokenizer, ctx), client)
    assert t.finish_reason == "length" and len(client.contexts) == 1 and len(t.response_ids) == inside_tool
    assert t.loss_mask[spans[0][1]:] == [0, 0, 0]
    # the engine's context (max_model_len) also ends the trajectory
    s = sample(tokenizer, ctx)
    client = ScriptedClient(tokenizer, script, max_model_len=len(s.prompt_ids) + 30)
    t = run(ToolAgentLoop(context(tokenizer, [EchoTool()], response_length=4096)), s, client)
    assert t.finish_reason == "length" and len(s.prompt_ids) + len(t.response_ids) <= len(s.prompt_ids) + 30


@pytest.mark.parametrize("side,kept", [("left", "A"), ("right", "Z"), ("middle", "AZ")])
def test_huge_tool_output_is_truncated_on_the_configured_side(tokenizer, side, kept):
    ctx = context(tokenizer, [HugeTool()], max_tool_response_length=100, tool_response_truncate_side=side)
    t = run(ToolAgentLoop(ctx), sample(tokenizer, ctx), ScriptedClient(tokenizer, [call("huge"), "done"]))
    tool_text = tokenizer.decode([i for i, m in zip(t.response_ids, t.loss_mask) if m == 0])
    body = tool_text.split("<tool_response>\n")[1].split("\n</tool_response>")[0]
    assert len(body) == 100 and "(truncated)" in body and t.extras["tool_truncated"] == 1
    assert body.startswith("A") == ("A" in kept) and body.endswith("Z") == ("Z" in kept)
    assert truncate_text("short", 100, side) == ("short", False)


def test_malformed_calls_become_error_messages(tokenizer):
    ctx = context(tokenizer, [EchoTool()], response_length=4096)
    script = ['<tool_call>{"name": "echo", "arguments": {"text": </tool_call>', '<tool_call>["echo"]</tool_call>',
              '<tool_call>{"name": "echo"', call("nope", a=1), "ok"]
    t = run(ToolAgentLoop(ctx), sample(tokenizer, ctx), ScriptedClient(tokenizer, script))
    text = tokenizer.decode(t.response_ids)
    assert "not valid JSON" in text and "must be a JSON object" in text and "never closed" in text
    assert "there is no tool named 'nope'" in text
    assert t.finish_reason == "stop" and t.extras["tool_malformed"] == 3 and t.extras["tool_errors"] == 4


def test_a_tool_that_raises_or_hangs_is_reported_not_fatal(tokenizer):
    ctx = context(tokenizer, [RaisingTool(), HangingTool()], tool_timeout_s=0.3, max_parallel_calls=2)
    start = time.perf_counter()
    t = run(ToolAgentLoop(ctx), sample(tokenizer, ctx), ScriptedClient(tokenizer, [call("boom") + call("hang"), "ok"]))
    assert time.perf_counter() - start < 5
    text = tokenizer.decode(t.response_ids)
    assert "failed: RuntimeError: the tool broke" in text and "did not finish within 0.3 s" in text
    assert t.extras["tool_errors"] == 2 and t.extras["tool_timeouts"] == 1 and t.finish_reason == "stop"


def test_parallel_calls_run_concurrently_up_to_the_limit(tokenizer):
    echo = EchoTool({"delay_s": 0.3})
    ctx = context(tokenizer, [echo], max_parallel_calls=2)
    three = call("echo", text="a") + call("echo", text="b") + call("echo", text="c")
    t = run(ToolAgentLoop(ctx), sample(tokenizer, ctx), ScriptedClient(tokenizer, [three, "done"]))
    text = tokenizer.decode(t.response_ids)
    assert echo.most_at_once == 2 and t.extras["tool_calls"] == 2
    assert text.index("\na\n") < text.index("\nb\n") and "at most 2 tool call(s) per turn" in text


def test_tools_kwargs_reach_create(tokenizer):
    echo = EchoTool()
    ctx = context(tokenizer, [echo])
    extra = {"tools_kwargs": {"echo": {"create_kwargs": {"ground_truth": "408"}}}, "index": 5}
    run(ToolAgentLoop(ctx), sample(tokenizer, ctx, extra_info=extra), ScriptedClient(tokenizer, ["no call"]))
    assert echo.created == [{"ground_truth": "408"}]
    with pytest.raises(ValueError, match="names tools \\['other'\\]"):
        run(ToolAgentLoop(ctx), sample(tokenizer, ctx, extra_info={"tools_kwargs": {"other": {}}}),
            ScriptedClient(tokenizer, ["x"]))


QWEN3_STYLE = (  # drops the reasoning of earlier assistant turns, as Qwen3's template does
    "{%- for message in messages %}"
    "{%- set content = message['content'] %}"
    "{%- if message['role'] == 'assistant' and not loop.last and '</think>' in content %}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') %}{%- endif %}"
    "{%- if message['role'] == 'tool' %}{{- '<|im_start|>user\\n<tool_response>\\n' + content + '\\n</tool_response><|im_end|>\\n' }}"
    "{%- elif message['role'] == 'assistant' and message['tool_calls'] %}{{- '<|im_start|>assistant\\n' + content }}"
    "{%- for c in message['tool_calls'] %}{{- '<tool_call>{\"name\": \"' + c['function']['name'] + '\", \"arguments\": ' + (c['function']['arguments'] | tojson) + '}</tool_call>' }}{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>' + message['role'] + '\\n' + content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")


def test_drift_with_a_template_that_strips_think_from_history(tokenizer, caplog):
    from megarl.devtools.tiny_tokenizer import build_tokenizer

    qwen3 = build_tokenizer("qwen3")
    qwen3.chat_template = QWEN3_STYLE
    script = ["<think>multiply</think>" + call("echo", text="408"), "<think>done</think>408"]
    ctx = context(qwen3, [EchoTool()])
    loop = ToolAgentLoop(ctx)
    with caplog.at_level(logging.WARNING, logger="megarl.agent.builtin_loops"):
        first = run(loop, sample(qwen3, ctx), ScriptedClient(qwen3, script))
        second = run(loop, sample(qwen3, ctx), ScriptedClient(qwen3, script))
    assert first.extras["drift"] == 1 and second.extras["drift"] == 1
    warnings = [r for r in caplog.records if "token drift" in r.message]
    assert len(warnings) == 1 and "multiply" in warnings[0].message
    # the same conversation without <think>: no drift, on the same template
    plain = run(ToolAgentLoop(ctx), sample(qwen3, ctx), ScriptedClient(qwen3, [call("echo", text="408"), "408"]))
    assert plain.extras["drift"] == 0
    # ignore_strippable does not excuse dropped text; disable skips the check; raise stops the rollout
    ctx = context(qwen3, [EchoTool()], tokenization_sanity_check_mode="ignore_strippable")
    assert run(ToolAgentLoop(ctx), sample(qwen3, ctx), ScriptedClient(qwen3, script)).extras["drift"] == 1
    ctx = context(qwen3, [EchoTool()], tokenization_sanity_check_mode="disable")
    assert "drift" not in run(ToolAgentLoop(ctx), sample(qwen3, ctx), ScriptedClient(qwen3, script)).extras
    ctx = context(qwen3, [EchoTool()], drift_action="raise")
    with pytest.raises(RuntimeError, match="token drift"):
        run(ToolAgentLoop(ctx), sample(qwen3, ctx), ScriptedClient(qwen3, script))


def test_single_turn_loop_samples_once_with_the_batch_seed(tokenizer):
    ctx = context(tokenizer, [EchoTool()], response_length=5)
    s = sample(tokenizer, ctx, sample_index=2)
    client = ScriptedClient(tokenizer, ["a b c d e f g"])
    t = run(SingleTurnAgentLoop(ctx), s, client)
    assert client.seeds == [turn_seed(11, 7, 3, 2, 0)] and len(t.response_ids) == 5 and t.finish_reason == "length"
    assert t.loss_mask == [1] * 5 and t.extras == {"num_turns": 2}


def test_hermes_parser():
    p = HermesToolParser()
    turn = p.parse('I will compute. <tool_call>{"name": "calc", "arguments": "{\\"e\\": \\"1+1\\"}"}</tool_call> ok')
    assert turn.content == "I will compute.  ok" and turn.calls[0].name == "calc" and turn.calls[0].arguments == {"e": "1+1"}
    assert not p.parse("no calls here").wants_tools
    assert p.parse('<tool_call>{"name": "", "arguments": {}}</tool_call>').errors
    assert p.parse('<tool_call>{"name": "x", "arguments": [1]}</tool_call>').errors


def test_many_trajectories_share_one_loop_concurrently(tokenizer):
    echo = EchoTool({"delay_s": 0.2})
    ctx = context(tokenizer, [echo])
    loop = ToolAgentLoop(ctx)

    async def many():
        return await asyncio.gather(*[loop.run(sample(tokenizer, ctx, sample_index=k),
                                               ScriptedClient(tokenizer, [call("echo", text=str(k)), str(k)]))
                                      for k in range(8)])

    start = time.perf_counter()
    results = asyncio.run(many())
    assert time.perf_counter() - start < 1.2  # 8 x 0.2 s of tool time, overlapped
    assert echo.most_at_once == 8
    assert [tokenizer.decode(r.response_ids, skip_special_tokens=True).split("\n")[-1] for r in results] == \
        [str(k) for k in range(8)]


def test_a_samples_images_go_with_every_engine_call(tokenizer):
    """A vision-language row's images reach the engine with the group call and with every turn of a tool loop
    (each turn's context still holds the image tokens, so the engine needs the pixels again)."""
    from dataclasses import replace

    from PIL import Image

    images = (Image.new("RGB", (56, 56), "red"), Image.new("RGB", (28, 84), "blue"))
    ctx = context(tokenizer, [EchoTool()])
    client = ScriptedClient(tokenizer, [call("echo", text="hi"), "done"])
    run(ToolAgentLoop(ctx), replace(sample(tokenizer, ctx), images=images), client)
    assert len(client.images) == 2 and all(seen == list(images) for seen in client.images)
    single = ScriptedClient(tokenizer, ["a b"])
    run(SingleTurnAgentLoop(ctx), replace(sample(tokenizer, ctx), images=images), single)
    assert single.images == [list(images)]
    text = ScriptedClient(tokenizer, ["a b"])
    run(SingleTurnAgentLoop(ctx), sample(tokenizer, ctx), text)
    assert text.images == [[]]
