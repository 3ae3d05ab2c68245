"""megarl's core attention (``megarl.models.attention``) against a naive float64 reference with dense
masks: the blockwise kernel (sliding window, soft-capping, sinks, grouped heads, MLA's wider keys,
context-parallel query chunks), the SDPA paths, and the megatron module around them. One process.
"""
import itertools
from types import SimpleNamespace

import pytest
import torch

from megarl.models.attention import PackedLayout, blockwise_attention, sdpa_causal, sdpa_causal_segments

TOLERANCE = 1e-5


def naive(q, k, v, q_pos, k_pos, segments, scale, window=None, softcap=None, sinks=None):
    """Dense-mask attention in float64: scores, cap, mask, softmax over keys (and the sink), values."""
    q, k, v = q.double(), k.double(), v.double()
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    out = torch.zeros(q.shape[0], q.shape[1], v.shape[-1], dtype=torch.float64)
    for qs, qe, ks, ke in segments:
        s = torch.einsum("qhd,khd->hqk", q[qs:qe], k[ks:ke]) * scale
        if softcap is not None:
            s = softcap * torch.tanh(s / softcap)
        visible = k_pos[ks:ke][None, :] <= q_pos[qs:qe][:, None]
        if window is not None:
            visible &= q_pos[qs:qe][:, None] - k_pos[ks:ke][None, :] < window
        s = s.masked_fill(~visible, float("-inf"))
        if sinks is not None:
            s = torch.cat([s, sinks.double()[:, None, None].expand(-1, s.shape[1], 1)], -1)
        p = torch.softmax(s, -1)
        out[qs:qe] = torch.einsum("hqk,khd->qhd", p[..., : ke - ks], v[ks:ke])
    return out


def grads(fn, tensors, weight):
    for t in tensors:
        t.grad = None
    (fn().double() * weight).sum().backward()
    return [t.grad.clone() for t in tensors]


def max_diff(a, b):
    return max((x.double() - y.double()).abs().max().item() for x, y in zip(a, b))


def zigzag_case(lengths, cp, heads=4, groups=2, dk=8, dv=8, seed=0):
    """Queries of every CP rank (its chunks of each sequence) and the whole sequences' keys."""
    generator = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    q = torch.randn(total, heads, dk, generator=generator)
    k = torch.randn(total, groups, dk, generator=generator)
    v = torch.randn(total, groups, dv, generator=generator)
    return q, k, v


FEATURES = list(itertools.product([None, 5], [None, 2.0], [False, True]))


@pytest.mark.parametrize("window,softcap,sink", FEATURES)
def test_blockwise_kernel_matches_the_naive_reference_in_values_and_gradients(window, softcap, sink):
    """Two sequences (7 and 29 tokens), queries a subset of each (as a CP rank holds them), grouped
    heads, keys wider than values (MLA), blocks of 4 so that masked and windowed blocks are skipped."""
    generator = torch.Generator().manual_seed(1)
    lengths, heads, groups = [7, 29], 6, 3
    segments, q_pos, k_pos, qs, ks = [], [], [], 0, 0
    for n in lengths:
        chosen = [p for p in range(n) if p % 3 != 1]
        segments.append((qs, qs + len(chosen), ks, ks + n))
        q_pos += chosen
        k_pos += range(n)
        qs, ks = qs + len(chosen), ks + n
    q_pos, k_pos = torch.tensor(q_pos), torch.tensor(k_pos)
    q = torch.randn(len(q_pos), heads, 12, generator=generator, requires_grad=True)
    k = torch.randn(len(k_pos), groups, 12, generator=generator, requires_grad=True)
    v = torch.randn(len(k_pos), groups, 8, generator=generator, requires_grad=True)
    sinks = torch.randn(heads, generator=generator, requires_grad=True) if sink else None
    tensors = [q, k, v] + ([sinks] if sink else [])
    args = (q_pos, k_pos, segments, 0.3, window, softcap, sinks)
    ours = blockwise_attention(q, k, v, *args, block=4)
    reference = naive(q, k, v, *args)
    assert (ours.double() - reference).abs().max() <= TOLERANCE
    weight = torch.randn(reference.shape, generator=generator, dtype=torch.float64)
    assert max_diff(grads(lambda: blockwise_attention(q, k, v, *args, block=4), tensors, weight),
                    grads(lambda: naive(q, k, v, *args), tensors, weight)) <= TOLERANCE


def test_sdpa_paths_equal_the_reference():
    generator = torch.Generator().manual_seed(2)
    rows = torch.randn(3, 9, 4, 8, generator=generator)  # [s, b, heads, d] with 2 KV groups below
    q, k, v = rows[:, :, :4], rows[:, :, :2], rows[:, :, 2:]
    out = sdpa_causal(q, k, v, scale=0.4)
    flat = [t.permute(1, 0, 2, 3).reshape(27, t.shape[2], 8) for t in (q, k, v)]
    positions = torch.arange(3).repeat(9)
    segments = [(3 * i, 3 * i + 3, 3 * i, 3 * i + 3) for i in range(9)]
    reference = naive(*flat, positions, positions, segments, 0.4).reshape(9, 3, 4, 8).permute(1, 0, 2, 3)
    assert (out.double() - reference).abs().max() <= TOLERANCE
    packed = sdpa_causal_segments(*flat, [0, 5, 5, 27], scale=0.4)  # an empty sequence is allowed
    positions = torch.cat([torch.arange(5), torch.arange(22)])
    reference = naive(*flat, positions, positions, [(0, 5, 0, 5), (5, 27, 5, 27)], 0.4)
    assert (packed.double() - reference).abs().max() <= TOLERANCE


@pytest.mark.parametrize("cp", [2, 3])
def test_context_parallel_chunks_cover_every_query_once_and_reproduce_full_attention(cp):
    """Sequences padded to 2 x CP chunks; rank r's queries (chunks r and 2CP-1-r of every sequence)
    against the whole sequences' keys, put back together over ranks, equal attention on the whole row."""
    lengths = (4 * cp, 2 * cp, 8 * cp)
    q, k, v = zigzag_case(lengths, cp)
    whole = PackedLayout(lengths)
    reference = naive(q, k, v, whole.sequence_positions, whole.sequence_positions, whole.segments, 0.3, window=3)
    combined = torch.zeros_like(reference)
    seen = torch.zeros(sum(lengths), dtype=torch.long)
    for rank in range(cp):
        layout = PackedLayout(lengths, cp, rank)
        index = layout.local_index
        assert len(index) == sum(lengths) // cp
        seen[index] += 1
        out = blockwise_attention(q[index], k, v, layout.local_positions, layout.sequence_positions, layout.segments,
                                  0.3, window=3, block=3)
        combined[index] = out.double()
        assert layout.gather_order[torch.cat([PackedLayout(lengths, cp, r).local_index for r in range(cp)])].equal(
            torch.arange(sum(lengths)))
    assert seen.eq(1).all()
    assert (combined - reference).abs().max() <= TOLERANCE


def test_sequences_that_do_not_split_into_two_cp_chunks_are_refused():
    with pytest.raises(ValueError, match="2 x CP = 4"):
        PackedLayout((8, 6), cp_size=2)


def test_invalid_window_and_cap_are_refused():
    q = torch.zeros(2, 1, 4)
    positions = torch.arange(2)
    with pytest.raises(ValueError, match="at least one token"):
        blockwise_attention(q, q, q, positions, positions, [(0, 2, 0, 2)], 1.0, window=0)
    with pytest.raises(ValueError, match="positive cap"):
        blockwise_attention(q, q, q, positions, positions, [(0, 2, 0, 2)], 1.0, softcap=0.0)


# ---------------------------------------------------------------------------- the megatron module
# (``world``: tests/models/conftest.py)
def module(softmax_type="vanilla", window_size=None, skip=None, **kwargs):
    from megatron.core.transformer import TransformerConfig

    from megarl.models.attention import CoreAttention
    from megarl.platform import transformer_config_overrides

    config = TransformerConfig(num_layers=4, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                               softmax_type=softmax_type, window_size=window_size, window_attn_skip_freq=skip,
                               attention_dropout=0.0, **transformer_config_overrides())
    return CoreAttention(config, layer_number=kwargs.pop("layer_number", 1), **kwargs)


def test_module_on_padded_rows_and_packed_sequences_matches_the_reference(world):
    """The same three sequences as padded rows and as one packed row (positions restarting), with
    and without soft-capping: both equal the reference on every real token."""
    from megatron.core.packed_seq_params import PackedSeqParams

    generator = torch.Generator().manual_seed(3)
    lengths = [5, 2, 7]
    for softcap in (None, 3.0):
        attention = module(softcap=softcap)
        q, k, v = (torch.randn(sum(lengths), heads, 8, generator=generator) for heads in (4, 2, 2))
        positions = torch.cat([torch.arange(n) for n in lengths])
        whole = PackedLayout(tuple(lengths))
        reference = naive(q, k, v, positions, positions, whole.segments, attention.softmax_scale, softcap=softcap)
        cu = torch.tensor(whole.offsets, dtype=torch.int32)
        params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=7, max_seqlen_kv=7)
        packed = attention(q, k, v, None, packed_seq_params=params).reshape(sum(lengths), 4, 8)
        assert (packed.double() - reference).abs().max() <= TOLERANCE
        padded = [torch.zeros(7, 3, t.shape[1], 8) for t in (q, k, v)]  # right padding after each sequence
        for row, (start, n) in enumerate(zip(whole.offsets, lengths)):
            for pad, t in zip(padded, (q, k, v)):
                pad[:n, row] = t[start:start + n]
        rows = attention(*padded, None).reshape(7, 3, 4, 8)
        for row, (start, n) in enumerate(zip(whole.offsets, lengths)):
            assert (rows[:n, row].double() - reference[start:start + n]).abs().max() <= TOLERANCE


def test_megatron_window_and_sinks_configure_the_module(world):
    """``window_size=(left, 0)`` is a window of ``left + 1`` keys on the layers ``window_attn_skip_freq``
    leaves windowed; ``learnable`` sinks are a TP-split parameter that trains, ``off-by-one`` a zero logit."""
    assert module(window_size=(3, 0)).window == 4
    assert [module(window_size=(3, 0), skip=2, layer_number=n).window for n in (1, 2)] == [4, None]
    assert module(window_size=(3, 0), window=9).window == 9  # the spec's own window wins
    with pytest.raises(ValueError, match="no future keys"):
        module(window_size=(3, 2))
    learnable = module("learnable")
    sinks = learnable.softmax_offset
    assert isinstance(sinks, torch.nn.Parameter) and sinks.shape == (4,) and sinks.tensor_model_parallel
    generator = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(6, 1, heads, 8, generator=generator) for heads in (4, 2, 2))
    learnable(q, k, v, None).sum().backward()
    assert sinks.grad is not None and sinks.grad.abs().sum() > 0
    positions = torch.arange(6)
    flat = [t[:, 0] for t in (q, k, v)]
    zero = naive(*flat, positions, positions, [(0, 6, 0, 6)], module().softmax_scale, sinks=torch.zeros(4))
    assert module("off-by-one").softmax_offset.eq(0).all()
    assert (module("off-by-one")(q, k, v, None).reshape(6, 4, 8).double() - zero).abs().max() <= TOLERANCE


def test_module_refuses_what_it_cannot_compute(world):
    attention = module(window=3)
    q = torch.zeros(4, 1, 4, 8)
    kv = torch.zeros(4, 1, 2, 8)
    with pytest.raises(ValueError, match="attention bias"):
        attention(q, kv, kv, None, attention_bias=torch.zeros(1))
    with pytest.raises(ValueError, match="explicit attention mask"):
        attention(q, kv, kv, torch.zeros(1, 1, 4, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="'sbhd'"):
        attention(q, kv, kv, None, packed_seq_params=SimpleNamespace(qkv_format="sbhd"))


def test_the_local_spec_gets_megarl_core_attention(world):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from megarl.models.attention import CoreAttention, use_core_attention

    spec = get_gpt_layer_local_spec()
    assert use_core_attention(spec)
    assert spec.submodules.self_attention.submodules.core_attention is CoreAttention
