"""Chat-template arithmetic for multi-turn rollouts: the tokens of an environment turn, and the
drift check (verl's ``tokenization_sanity_check_mode``).

Token in, token out: a trajectory keeps the exact tokens the model sampled, and appends the tokens
of each tool turn as the chat template renders it. ``env_turn_ids`` finds those tokens as the
difference between two renders (without and with the tool messages), starting right after the
model's last sampled token, so the template's own separators (e.g. the newline after
``<|im_end|>``) are included and nothing is rendered twice.

Drift: re-applying the template to the whole conversation may give other tokens than the turn by
turn concatenation the model was trained on (templates that drop ``<think>`` from earlier turns,
re-serialised tool-call JSON, BPE merges across a turn boundary). ``check_drift`` compares the two
in the configured mode and reports the first difference.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence


def render_text(tokenizer: Any, messages: Sequence[dict], tools: list | None, add_generation_prompt: bool,
                kwargs: dict[str, Any] | None = None) -> str:
    extra = dict(kwargs or {})
    if tools:
        extra["tools"] = tools
    return tokenizer.apply_chat_template(list(messages), add_generation_prompt=add_generation_prompt, tokenize=False,
                                         **extra)


def dropped_tool_schemas(tokenizer: Any, tools: list, kwargs: dict[str, Any] | None = None) -> list[str]:
    """The names of ``tools`` that the chat template leaves out of a prompt rendered with them (all of them
    for a template that ignores ``tools``, e.g. SmolLM2's): the model would never see those schemas."""
    names = [str(t.get("function", t).get("name")) for t in tools]
    messages = [{"role": "user", "content": "Which tools do you have?"}]
    rendered = render_text(tokenizer, messages, tools, True, kwargs)
    if rendered == render_text(tokenizer, messages, None, True, kwargs):
        return names
    return [name for name in names if name not in rendered]


def encode(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def env_turn_ids(tokenizer: Any, assistant_message: dict, new_messages: Sequence[dict], last_token_id: int | None,
                 tools: list | None = None, kwargs: dict[str, Any] | None = None) -> list[int]:
    """Token ids that follow the model's turn: the rest of that turn's template markup, the
    ``new_messages`` (tool responses) and the generation prompt of the next assistant turn.

    The tool messages are rendered after a stand-in conversation (a one-character user message and
    an assistant message with a one-character content and the turn's tool calls), not after the
    real history: a template may render earlier turns differently once more follow (Qwen3 drops
    their ``<think>``), and the sampled tokens of those turns must stay as they are. ``last_token_id`` is the model's last
    sampled token: when it is a special token (end of turn), what the template writes after it
    (e.g. the newline after ``<|im_end|>``) is part of the environment's tokens.
    """
    stand_in = [{"role": "user", "content": "."}, {**assistant_message, "content": "."}]
    before = render_text(tokenizer, stand_in, tools, False, kwargs)
    after = render_text(tokenizer, stand_in + list(new_messages), tools, True, kwargs)
    if not after.startswith(before):
        raise ValueError("the chat template renders an assistant turn differently once tool messages follow it; "
                         "megarl cannot append tool turns token by token with this template")
    tail = ""
    if last_token_id is not None and last_token_id in set(tokenizer.all_special_ids):
        end_text = tokenizer.decode([last_token_id])
        at = before.rfind(end_text)
        if at >= 0:
            tail = before[at + len(end_text):]
    return encode(tokenizer, tail + after[len(before):])


@dataclass(frozen=True)
class Drift:
    position: int  # first differing token (or character, in ignore_strippable mode)
    turn_by_turn: str  # a snippet of the trajectory's text there
    whole: str  # the same place in the whole-conversation render

    def describe(self) -> str:
        return (f"the turn-by-turn tokens differ from the chat template applied to the whole conversation at "
                f"{self.position}: {self.turn_by_turn!r} vs {self.whole!r}")


def check_drift(tokenizer: Any, trajectory_ids: Sequence[int], messages: Sequence[dict], tools: list | None,
                mode: str, kwargs: dict[str, Any] | None = None) -> Drift | None:
    """None when the trajectory matches the template applied to the whole ``messages``.

    ``strict``: the token ids must be equal (the render may go on with whitespace after the model's
    last token). ``ignore_strippable``: the decoded texts must be equal
    once whitespace is removed. ``disable``: no check.
    """
    if mode == "disable":
        return None
    whole_text = render_text(tokenizer, messages, tools, False, kwargs)
    if mode == "strict":
        whole = encode(tokenizer, whole_text)
        ours = list(trajectory_ids)
        # the render goes on after the model's last sampled token with the template's closing
        # markup (e.g. the newline after <|im_end|>), which the model never samples
        if whole[:len(ours)] == ours and not tokenizer.decode(whole[len(ours):]).strip():
            return None
        at = next((i for i, (a, b) in enumerate(zip(ours, whole)) if a != b), min(len(ours), len(whole)))
        return Drift(at, tokenizer.decode(ours[at:at + 12]), tokenizer.decode(whole[at:at + 12]))
    if mode != "ignore_strippable":
        raise ValueError(f"tokenization_sanity_check_mode={mode!r}: use strict, ignore_strippable or disable")
    ours_text = "".join(tokenizer.decode(list(trajectory_ids)).split())
    whole_text = "".join(whole_text.split())
    if ours_text == whole_text:
        return None
    at = next((i for i, (a, b) in enumerate(zip(ours_text, whole_text)) if a != b), min(len(ours_text), len(whole_text)))
    return Drift(at, ours_text[at:at + 40], whole_text[at:at + 40])
