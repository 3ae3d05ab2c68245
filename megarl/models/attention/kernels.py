"""The arithmetic of exact causal attention: torch's fused SDPA where it is exact, a blockwise kernel
with its own backward everywhere else.

Sequences are segments of a token dimension. A segment pairs a run of queries with the run of keys
they may see (the same sequence); every query and key carries its position in its sequence, so a
query may sit anywhere in the key run (context parallelism hands a rank two separate chunks of each
sequence, and those queries see all keys of the sequence up to their own position).

``blockwise_attention`` computes, per query block and key block (``block`` tokens each), the scores
``q k^T * scale``, optional logit soft-capping ``cap * tanh(s / cap)`` (Gemma-2), the causal mask with
an optional sliding window (a query sees the ``window`` keys ending at its own position, Hugging
Face's semantics), and an online softmax whose denominator may hold a per-head sink logit (gpt-oss's
attention sinks, megatron's ``softmax_type``: ``exp(sink)`` joins the sum, no value goes with it).
Nothing larger than a block pair of scores exists at once: the forward keeps q, k, v, the output and
one log-sum-exp per query and head; the backward recomputes each block's probabilities from them
(FlashAttention's scheme), so memory grows linearly with the sequence. Blocks wholly outside the
causal window are skipped. All arithmetic is fp32 whatever the inputs' dtype.

Grouped-query attention is handled by broadcasting: query head ``h`` reads key/value head
``h // (heads / groups)``, as megatron's ``repeat_interleave``; no key or value is copied.
"""
from __future__ import annotations


import torch
import torch.nn.functional as F

Segment = tuple[int, int, int, int]  # (first query, end of queries, first key, end of keys)
DEFAULT_BLOCK = 256


def sdpa_causal(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float, dropout: float = 0.0) -> torch.Tensor:
    """Plain causal attention of ``[s, b, heads, d]`` tensors (megatron's layout) by torch's fused SDPA;
    ``[s, b, heads, dv]`` out. Keys and values have ``groups`` heads dividing ``heads``."""
    groups = query.shape[2] // key.shape[2]
    if groups > 1:
        key, value = key.repeat_interleave(groups, dim=2), value.repeat_interleave(groups, dim=2)
    q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # -> [b, heads, s, d]
    out = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True, scale=scale)
    return out.permute(2, 0, 1, 3)


def sdpa_causal_segments(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, bounds: list[int], scale: float,
                         dropout: float = 0.0) -> torch.Tensor:
    """Plain causal attention of packed ``[t, heads, d]`` tensors, each sequence ``bounds[i]:bounds[i+1]``
    on its own (positions restart per sequence): one fused SDPA call per sequence."""
    out = query.new_empty(query.shape[0], query.shape[1], value.shape[-1])
    for start, end in zip(bounds[:-1], bounds[1:]):
        if end > start:
            piece = (t[start:end].unsqueeze(1) for t in (query, key, value))
            out[start:end] = sdpa_causal(*piece, scale=scale, dropout=dropout).squeeze(1)
    return out


def blockwise_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, query_positions: torch.Tensor,
                        key_positions: torch.Tensor, segments: list[Segment], scale: float, window: int | None = None,
                        softcap: float | None = None, sinks: torch.Tensor | None = None,
                        block: int = DEFAULT_BLOCK) -> torch.Tensor:
    """Exact causal attention of ``query [tq, heads, dk]`` over ``key [tk, groups, dk]`` / ``value [tk,
    groups, dv]`` within ``segments``; ``[tq, heads, dv]`` out, differentiable in q, k, v and ``sinks``
    (``[heads]`` logits). Key positions must ascend within each segment; every query must see at least
    one key (its own position is among its segment's keys)."""
    if window is not None and window < 1:
        raise ValueError(f"a sliding window must hold at least one token, got {window}")
    if softcap is not None and softcap <= 0:
        raise ValueError(f"logit soft-capping needs a positive cap, got {softcap}")
    empty = query.new_zeros(0)
    return _Blockwise.apply(query, key, value, empty if sinks is None else sinks, query_positions, key_positions,
                            tuple(segments), scale, window, softcap, block)


def _blocks(segments, query_positions, key_positions, block: int, window: int | None):
    """(query slice, key slice) of every block pair that holds a visible key, segment by segment."""
    q_pos, k_pos = query_positions.tolist(), key_positions.tolist()
    for q_start, q_end, k_start, k_end in segments:
        for q0 in range(q_start, q_end, block):
            q1 = min(q0 + block, q_end)
            lowest, highest = min(q_pos[q0:q1]), max(q_pos[q0:q1])
            for k0 in range(k_start, k_end, block):
                k1 = min(k0 + block, k_end)
                if k_pos[k0] > highest:
                    break  # ascending key positions: every later block is in the future too
                if window is not None and k_pos[k1 - 1] <= lowest - window:
                    continue  # wholly behind every query's window
                yield slice(q0, q1), slice(k0, k1)


def _scores(q, k, q_pos, k_pos, scale, window, softcap):
    """Masked (and capped) scores ``[groups, rep, bq, bk]`` of one block pair, and tanh of the capped ones."""
    raw = torch.matmul(q, k.unsqueeze(1).transpose(-1, -2)) * scale
    tanh = None
    if softcap is not None:
        tanh = torch.tanh(raw / softcap)
        raw = softcap * tanh
    visible = k_pos.unsqueeze(0) <= q_pos.unsqueeze(1)
    if window is not None:
        visible &= q_pos.unsqueeze(1) - k_pos.unsqueeze(0) < window
    return raw.masked_fill(~visible, float("-inf")), tanh


def _grouped(t: torch.Tensor, groups: int) -> torch.Tensor:
    """``[t, heads, d]`` -> ``[groups, heads / groups, t, d]`` in fp32."""
    return t.float().reshape(t.shape[0], groups, t.shape[1] // groups, t.shape[2]).permute(1, 2, 0, 3)


def _ungrouped(t: torch.Tensor) -> torch.Tensor:
    """``[groups, rep, t, d]`` -> ``[t, groups * rep, d]``."""
    return t.permute(2, 0, 1, 3).reshape(t.shape[2], t.shape[0] * t.shape[1], t.shape[3])


class _Blockwise(torch.autograd.Function):
    @staticmethod
    def forward(ctx, query, key, value, sinks, q_pos, k_pos, segments, scale, window, softcap, block):
        groups, heads = key.shape[1], query.shape[1]
        rep = heads // groups
        sink = sinks.float().reshape(groups, rep, 1) if sinks.numel() else None
        out = torch.zeros(query.shape[0], heads, value.shape[-1], dtype=torch.float32, device=query.device)
        lse = torch.zeros(groups, rep, query.shape[0], dtype=torch.float32, device=query.device)
        keys = key.float().permute(1, 0, 2)  # [groups, tk, d]
        values = value.float().permute(1, 0, 2)
        current, state = None, None
        for qs, ks in list(_blocks(segments, q_pos, k_pos, block, window)) + [(None, None)]:
            if current is not None and qs != current:  # the previous query block is complete
                m, total, acc = state
                out[current] = _ungrouped(acc / total.unsqueeze(-1))
                lse[:, :, current] = m + total.log()
                state = None
            if qs is None:
                break
            current = qs
            q = _grouped(query[qs], groups)
            if state is None:
                shape = q.shape[:-1]
                m = sink.expand(shape).clone() if sink is not None else q.new_full(shape, float("-inf"))
                total = q.new_ones(shape) if sink is not None else q.new_zeros(shape)
                state = (m, total, q.new_zeros(*shape, values.shape[-1]))
            s, _ = _scores(q, keys[:, ks], q_pos[qs], k_pos[ks], scale, window, softcap)
            m, total, acc = state
            new_m = torch.maximum(m, s.amax(-1))
            safe = new_m.masked_fill(new_m == float("-inf"), 0.0)
            p = torch.exp(s - safe.unsqueeze(-1))
            correction = torch.exp(m - safe)
            state = (new_m, total * correction + p.sum(-1), acc * correction.unsqueeze(-1) + torch.matmul(p, values[:, ks].unsqueeze(1)))
        ctx.save_for_backward(query, key, value, sinks, q_pos, k_pos, out, lse)
        ctx.settings = (segments, scale, window, softcap, block)
        return out.to(query.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        query, key, value, sinks, q_pos, k_pos, out, lse = ctx.saved_tensors
        segments, scale, window, softcap, block = ctx.settings
        groups, heads = key.shape[1], query.shape[1]
        rep = heads // groups
        keys, values = key.float().permute(1, 0, 2), value.float().permute(1, 0, 2)
        d_query = torch.zeros(query.shape, dtype=torch.float32, device=query.device)
        d_keys, d_values = torch.zeros_like(keys), torch.zeros_like(values)
        grad = _grouped(grad_out, groups)  # [groups, rep, tq, dv]
        delta = (grad * _grouped(out, groups)).sum(-1)  # [groups, rep, tq]: rowsum(dO * O)
        for qs, ks in _blocks(segments, q_pos, k_pos, block, window):
            q = _grouped(query[qs], groups)
            s, tanh = _scores(q, keys[:, ks], q_pos[qs], k_pos[ks], scale, window, softcap)
            p = torch.exp(s - lse[:, :, qs].unsqueeze(-1))
            g = grad[:, :, qs]
            d_values[:, ks] += torch.matmul(p.transpose(-1, -2), g).sum(1)
            ds = p * (torch.matmul(g, values[:, ks].unsqueeze(1).transpose(-1, -2)) - delta[:, :, qs].unsqueeze(-1))
            if tanh is not None:
                ds = ds * (1 - tanh * tanh)
            d_query[qs] += _ungrouped(torch.matmul(ds, keys[:, ks].unsqueeze(1)) * scale)
            d_keys[:, ks] += torch.matmul(ds.transpose(-1, -2), q).sum(1) * scale
        d_sinks = None
        if sinks.numel():  # d lse / d sink = p_sink, and dL/d sink = -p_sink * rowsum(dO * O)
            p_sink = torch.exp(sinks.float().reshape(groups, rep, 1) - lse)
            d_sinks = -(p_sink * delta).sum(-1).reshape(heads).to(sinks.dtype)
        return (d_query.to(query.dtype), d_keys.permute(1, 0, 2).to(key.dtype), d_values.permute(1, 0, 2).to(value.dtype),
                d_sinks, None, None, None, None, None, None, None)


