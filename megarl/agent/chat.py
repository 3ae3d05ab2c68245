"""Chat-template arithmetic for multi-turn rollouts: the tokens of an environment turn, and the
drift check (verl's ``tokenization_sanity_check_mode``).

Token in, token out: a trajectory keeps the exact tokens the model sampled, and appends the tokens
of each tool turn as the chat template renders it. ``env_turn_ids`` finds those tokens as the
difference between two renders of the conversation (before and after the tool messages), starting
right after the model's last sampled token, so the template's own separators (e.g. the newline
after ``<|im_end|>``) are included and nothing is rendered twice.

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


def encode(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def env_turn_ids(tokenizer: Any, history: Sequence[dict], new_messages: Sequence[dict], model_text: str,
                 tools: list | None = None, kwargs: dict[str, Any] | None = None) -> list[int]:
    """Token ids that follow the model's last turn: the rest of its turn's template markup, the
    ``new_messages`` (tool responses) and the generation prompt of the next assistant turn.

    ``history`` ends with the assistant message holding ``model_text`` verbatim (the decoded
    sampled tokens, special tokens included) as its content.
    """
    before = render_text(tokenizer, history, tools, False, kwargs)
    after = render_text(tokenizer, list(history) + list(new_messages), tools, True, kwargs)
    if not after.startswith(before):
        raise ValueError("the chat template renders the earlier turns differently once tool messages follow; "
                         "megarl cannot append tool turns token by token with it")
    tail = ""
    end = before.rfind(model_text) if model_text else -1
    if end >= 0:  # the template's markup after what the model sampled (e.g. "\n" after <|im_end|>)
        tail = before[end + len(model_text):]
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
