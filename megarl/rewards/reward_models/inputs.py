"""What a discriminative reward model reads: one token sequence per response.

Two ways, as in verl (``reward_model.model.input_tokenizer``):

* ``input_tokenizer`` set (verl's default: the policy's path): the reward model may tokenize and
  template differently, so the conversation is rebuilt as text: the prompt's chat messages plus
  ``{"role": "assistant", "content": <the decoded response>}``, rendered with the reward model's
  chat template (``add_generation_prompt=False``) and tokenized with its tokenizer. A leading BOS
  written by the template is dropped and the tokenizer's own special tokens added, so a tokenizer
  that adds BOS on encode gets exactly one (verl's reward loop does the same);
* ``input_tokenizer`` null: the reward model shares the policy's tokenizer (the config check
  compares the vocabularies), and reads the policy's own tokens, prompt ids + response ids, as
  sampled (tool output of multi-turn responses included), nothing re-tokenized.

Its score is its output at the last token of the sequence. A sequence longer than
``reward_model.max_length`` is cut on the right to that length (verl's reward-model worker
truncates on the right too), and counted.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence


@dataclass
class ResponsesToScore:
    """One entry per response: its prompt (token ids and chat messages), its tokens and its text."""

    prompt_ids: Sequence[Sequence[int]]
    response_ids: Sequence[Sequence[int]]
    prompts: Sequence[Any]  # chat messages: a list of {role, content} per sample
    responses: Sequence[str]

    def __post_init__(self) -> None:
        sizes = {len(self.prompt_ids), len(self.response_ids), len(self.prompts), len(self.responses)}
        if len(sizes) != 1:
            raise ValueError(f"responses to score: prompt_ids, response_ids, prompts and responses differ in length "
                             f"({len(self.prompt_ids)}, {len(self.response_ids)}, {len(self.prompts)}, {len(self.responses)})")

    def __len__(self) -> int:
        return len(self.responses)


def chat_messages(prompt: Any) -> list[dict[str, Any]]:
    """A sample's prompt as a plain list of ``{role, content}`` dicts (parquet rows may hold arrays)."""
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    messages = [dict(m) for m in list(prompt)]
    if not all("role" in m and "content" in m for m in messages):
        raise ValueError(f"a prompt to re-template must be chat messages with role and content, got {prompt!r:.200}")
    return messages


def retemplated(tokenizer: Any, prompt: Any, response: str) -> list[int]:
    """The conversation prompt + response as the reward model's own chat-template tokens."""
    conversation = chat_messages(prompt) + [{"role": "assistant", "content": response}]
    text = tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=False)
    bos = getattr(tokenizer, "bos_token", None)
    if bos and text.startswith(bos):
        text = text[len(bos):]
    return list(tokenizer(text, add_special_tokens=True)["input_ids"])


def model_sequences(batch: ResponsesToScore, tokenizer: Any | None, max_length: int) -> tuple[list[list[int]], int]:
    """(one token sequence per response, how many were cut to ``max_length``); ``tokenizer`` is the
    reward model's when re-templating, None to read the policy's tokens."""
    sequences, cut = [], 0
    for i in range(len(batch)):
        if tokenizer is not None:
            ids = retemplated(tokenizer, batch.prompts[i], batch.responses[i])
        else:
            ids = [int(t) for t in batch.prompt_ids[i]] + [int(t) for t in batch.response_ids[i]]
        if not ids:
            raise ValueError(f"response {i}: nothing to score (an empty prompt and response)")
        if len(ids) > max_length:
            ids, cut = ids[:max_length], cut + 1
        sequences.append(ids)
    return sequences, cut
