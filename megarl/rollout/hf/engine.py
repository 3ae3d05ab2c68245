"""The hf backend's model and its batched KV cache: prefill, decode, teacher-forced scoring.

``HFEngine`` owns one ``AutoModelForCausalLM`` (eager attention and fp32 on CPU; sdpa and bf16 by
default on GPU) and the KV cache of the running batch: one transformers ``DynamicCache`` whose
rows are the running sequences, left-padded to a common length, with a 0/1 attention mask and
explicit position ids (each row counts only its own tokens, so padding never shifts a position).
Every call runs on the replica's one engine thread (``scheduler.Scheduler``), never two at once.

One ``step(keep, prompts, ...)``:

1. keeps the cache rows of the running sequences listed in ``keep`` (the others finished or were
   aborted), dropping the leading columns no row uses any more;
2. decodes one token for them: the token each sampled last, fed at its row's position;
3. prefills the newly admitted prompts in one left-padded forward (a prompt shared by the n
   samples of a request is prefilled once and its cache rows repeated) and appends their rows,
   the shorter of the two caches padded on the left;
4. samples one token per row (``sampler.sample_rows``: each row with its own settings and seed).

A row's numbers do not depend on the other rows beyond floating-point summation order: padding
is masked out, and sampling is per row.

Models whose cache is not one plain key/value pair per layer (linear attention's recurrent state:
Qwen3-Next, Qwen3.5; sliding windows: gpt-oss, Gemma) cannot share a left-padded cache: padding
would enter a recurrent state, and a window cache cannot be re-aligned. They run row by row
(``per_row``): each sequence keeps its own cache and is prefilled and decoded at batch size 1, the
n samples of a prompt starting from copies of its one prefill. Slower, and the same numbers.
"""
from __future__ import annotations

from typing import Sequence

import copy

import torch
import torch.nn.functional as F

from megarl.rollout.hf.sampler import RowSampling, sample_rows


def resolve_dtype(dtype: str, on_gpu: bool) -> torch.dtype:
    """``auto`` -> bfloat16 on GPU, float32 on CPU (vLLM's choice in megarl); else the named dtype."""
    name = ("bfloat16" if on_gpu else "float32") if dtype == "auto" else dtype
    value = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(value, torch.dtype) or not value.is_floating_point:
        raise ValueError(f"actor_rollout_ref.rollout.dtype={dtype!r}: use auto, float32, bfloat16 or float16")
    return value


class HFEngine:
    def __init__(self, model, device: torch.device, pad_token_id: int, logprobs_mode: str = "processed_logprobs"):
        self.model, self.device, self.pad_token_id, self.logprobs_mode = model, device, pad_token_id, logprobs_mode
        self.cache = None  # transformers DynamicCache of the running rows
        self.mask: torch.Tensor | None = None  # [rows, columns] 0/1: which cache columns each row uses
        self.last: torch.Tensor | None = None  # [rows]: the token each row sampled last, not yet fed
        self.per_row = bool(self.special_cache_layers())
        self.row_caches: list = []  # per_row: each running row's own cache and the tokens it has fed
        self.row_lengths: list[int] = []

    @property
    def rows(self) -> int:
        if self.per_row:
            return len(self.row_caches)
        return 0 if self.mask is None else int(self.mask.shape[0])

    def special_cache_layers(self) -> list[str]:
        """The model's cache layer kinds other than a plain key/value pair (sliding windows, linear attention)."""
        from transformers import DynamicCache
        from transformers.cache_utils import DynamicLayer

        return sorted({type(layer).__name__ for layer in DynamicCache(config=self.model.config).layers
                       if type(layer) is not DynamicLayer})

    def reset(self) -> None:
        """Drop the running batch's cache (nothing runs)."""
        self.cache = self.mask = self.last = None
        self.row_caches, self.row_lengths = [], []

    @torch.no_grad()
    def step(self, keep: Sequence[int], prompts: Sequence[list[int]], settings: Sequence[RowSampling],
             generators: Sequence[torch.Generator]) -> tuple[list[int], list[float]]:
        """One token for every kept row, then for every new prompt (in that order): tokens and log-probs."""
        logits = []
        if not keep:
            self.reset()
        elif self.per_row:
            logits.append(self._decode_rows(list(keep)))
        else:
            self._keep(list(keep))
            logits.append(self._decode())
        if prompts:
            logits.append(self._prefill_rows(list(prompts)) if self.per_row else self._prefill(list(prompts)))
        tokens, logprobs = sample_rows(torch.cat(logits), settings, generators, self.logprobs_mode)
        self.last = torch.tensor(tokens, device=self.device)
        return tokens, logprobs

    def _keep(self, keep: list[int]) -> None:
        if keep != list(range(self.rows)):
            index = torch.tensor(keep, device=self.device)
            for layer in self.cache.layers:
                layer.keys, layer.values = layer.keys.index_select(0, index), layer.values.index_select(0, index)
            self.mask, self.last = self.mask.index_select(0, index), self.last.index_select(0, index)
        used = self.mask.any(dim=0)
        first = int(used.int().argmax()) if bool(used.any()) else self.mask.shape[1]
        if first:  # columns of rows that are gone
            for layer in self.cache.layers:
                layer.keys, layer.values = layer.keys[:, :, first:], layer.values[:, :, first:]
            self.mask = self.mask[:, first:]

    def _decode(self) -> torch.Tensor:
        positions = self.mask.sum(dim=1, keepdim=True)
        self.mask = torch.cat([self.mask, torch.ones_like(self.mask[:, :1])], dim=1)
        out = self.model(input_ids=self.last.unsqueeze(1), attention_mask=self.mask, position_ids=positions,
                         past_key_values=self.cache, use_cache=True)
        self.cache = out.past_key_values
        return out.logits[:, -1]

    def _forward_row(self, ids: list[int], start: int, cache) -> tuple[torch.Tensor, object]:
        """One row's tokens ``ids`` fed at positions ``start...`` onto its ``cache``: the last logits, the cache."""
        positions = torch.arange(start, start + len(ids), device=self.device).unsqueeze(0)
        out = self.model(input_ids=torch.tensor([ids], device=self.device), position_ids=positions,
                         past_key_values=cache, use_cache=True, logits_to_keep=1)
        return out.logits[:, -1], out.past_key_values

    def _decode_rows(self, keep: list[int]) -> torch.Tensor:
        self.row_caches = [self.row_caches[i] for i in keep]
        self.row_lengths = [self.row_lengths[i] for i in keep]
        last = self.last.index_select(0, torch.tensor(keep, device=self.device)).tolist()
        logits = []
        for row, token in enumerate(last):
            row_logits, self.row_caches[row] = self._forward_row([token], self.row_lengths[row], self.row_caches[row])
            self.row_lengths[row] += 1
            logits.append(row_logits)
        return torch.cat(logits)

    def _prefill_rows(self, prompts: list[list[int]]) -> torch.Tensor:
        from transformers import DynamicCache

        prefilled: dict[tuple[int, ...], tuple[torch.Tensor, object]] = {}
        logits = []
        for prompt in prompts:
            key = tuple(prompt)
            if key in prefilled:  # another sample of the prompt: a copy of its prefill
                row_logits, cache = prefilled[key][0], copy.deepcopy(prefilled[key][1])
            else:
                row_logits, cache = self._forward_row(list(prompt), 0, DynamicCache(config=self.model.config))
                prefilled[key] = (row_logits, copy.deepcopy(cache))
            self.row_caches.append(cache)
            self.row_lengths.append(len(prompt))
            logits.append(row_logits)
        return torch.cat(logits)

    def _prefill(self, prompts: list[list[int]]) -> torch.Tensor:
        from transformers import DynamicCache

        unique: dict[tuple[int, ...], int] = {}
        rows = [unique.setdefault(tuple(p), len(unique)) for p in prompts]
        width = max(len(p) for p in unique)
        ids = torch.full((len(unique), width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(unique), width), dtype=torch.long)
        for i, prompt in enumerate(unique):
            ids[i, width - len(prompt):] = torch.tensor(prompt)
            mask[i, width - len(prompt):] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        positions = (mask.cumsum(dim=1) - 1).clamp(min=0)
        cache = DynamicCache(config=self.model.config)
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=cache,
                         use_cache=True, logits_to_keep=1)
        index = torch.tensor(rows, device=self.device)
        cache = out.past_key_values
        if rows != list(range(len(unique))):  # the n samples of a prompt: its rows repeated
            for layer in cache.layers:
                layer.keys, layer.values = layer.keys.index_select(0, index), layer.values.index_select(0, index)
        self._append(cache, mask.index_select(0, index))
        return out.logits[:, -1].index_select(0, index)

    def _append(self, cache, mask: torch.Tensor) -> None:
        """Add new rows to the running batch, the shorter side padded on the left."""
        if self.cache is None:
            self.cache, self.mask = cache, mask
            return
        width = max(self.mask.shape[1], mask.shape[1])
        grow_old, grow_new = width - self.mask.shape[1], width - mask.shape[1]
        for old, new in zip(self.cache.layers, cache.layers):
            old.keys = torch.cat([F.pad(old.keys, (0, 0, grow_old, 0)), F.pad(new.keys, (0, 0, grow_new, 0))])
            old.values = torch.cat([F.pad(old.values, (0, 0, grow_old, 0)), F.pad(new.values, (0, 0, grow_new, 0))])
        self.mask = torch.cat([F.pad(self.mask, (grow_old, 0)), F.pad(mask, (grow_new, 0))])

    @torch.no_grad()
    def score(self, sequences: Sequence[list[int]], skip: Sequence[int], topk: int = 0) -> list:
        """``log_softmax(logits)`` of each sequence's own tokens after its first ``skip`` (>= 1), teacher-forced;
        with ``topk``, ``TopkScores`` (also the ``topk`` most likely tokens at each position)."""
        from megarl.rollout.sample import TopkScores

        result = []
        for sequence, start in zip(sequences, skip):
            if not 1 <= start < len(sequence):
                raise ValueError(f"score: skip={start} for a sequence of {len(sequence)} tokens; need 1 <= skip < length")
            ids = torch.tensor([sequence], device=self.device)
            logits = self.model(input_ids=ids, use_cache=False, logits_to_keep=len(sequence) - start + 1).logits[0, :-1]
            logp = torch.log_softmax(logits.float(), dim=-1)
            targets = torch.tensor(sequence[start:], device=self.device)
            own = logp.gather(1, targets.unsqueeze(1)).squeeze(1).tolist()
            if topk:
                best = logp.topk(topk, dim=-1)
                result.append(TopkScores(own, best.indices.tolist(), best.values.tolist()))
            else:
                result.append(own)
        return result
