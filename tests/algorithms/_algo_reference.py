"""Straightforward reference implementations for the algorithm tests.

Plain Python on lists of floats, one sample and one token at a time, written from the papers'
and verl's definitions, independently of megarl.algorithms (which is vectorised torch).
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict


def rows(t):
    """A 2-D tensor (or list) as a list of lists of Python floats."""
    return [[float(x) for x in row] for row in (t.tolist() if hasattr(t, "tolist") else t)]


def groups_of(index):
    out = defaultdict(list)
    for i, key in enumerate(index):
        out[key].append(i)
    return out


# ------------------------------------------------------------------ masked reductions
def whiten(values, mask):
    """verl's masked_whiten: (v - mean) / sqrt(unbiased var + 1e-8) over the valid entries."""
    valid = [v for rv, rm in zip(values, mask) for v, m in zip(rv, rm) if m]
    if len(valid) < 2:
        return [[0.0 for _ in row] for row in values]
    mean = sum(valid) / len(valid)
    var = sum((v - mean) ** 2 for v in valid) / (len(valid) - 1)
    return [[(v - mean) / math.sqrt(var + 1e-8) for v in row] for row in values]


def aggregate(loss, mask, mode, loss_scale_factor=None):
    """agg_loss from its definition, one sequence at a time."""
    seq_sums, seq_means, total, tokens = [], [], 0.0, 0
    for lrow, mrow in zip(loss, mask):
        n = sum(1 for m in mrow if m)
        s = sum(l for l, m in zip(lrow, mrow) if m)
        total += s
        tokens += n
        if n:
            seq_sums.append(s)
            seq_means.append(s / n)
    if mode == "token-mean":
        return total / tokens if tokens else 0.0
    if mode == "token-sum":
        return total
    if mode == "seq-mean-token-sum":
        return sum(seq_sums) / len(seq_sums) if seq_sums else 0.0
    if mode == "seq-mean-token-mean":
        return sum(seq_means) / len(seq_means) if seq_means else 0.0
    if mode == "seq-mean-token-sum-norm":
        scale = len(mask[0]) if loss_scale_factor is None else loss_scale_factor
        return (sum(seq_sums) / len(seq_sums) if seq_sums else 0.0) / scale
    raise ValueError(mode)


# ------------------------------------------------------------------------ advantages
def gae(rewards, values, mask, gamma, lam):
    """GAE over the valid tokens only; a padded position takes the advantage of the next valid one."""
    advantages = []
    for r, v, m in zip(rewards, values, mask):
        length = len(r)
        valid = [t for t in range(length) if m[t]]
        adv = [0.0] * length
        for k in reversed(range(len(valid))):
            t = valid[k]
            next_value = v[valid[k + 1]] if k + 1 < len(valid) else 0.0
            next_adv = adv[valid[k + 1]] if k + 1 < len(valid) else 0.0
            adv[t] = r[t] + gamma * next_value - v[t] + gamma * lam * next_adv
        for t in range(length):
            if not m[t]:
                later = [s for s in valid if s > t]
                adv[t] = adv[later[0]] if later else 0.0
        advantages.append(adv)
    returns = [[a + vv for a, vv in zip(ar, vr)] for ar, vr in zip(advantages, values)]
    return whiten(advantages, mask), returns


def outcome(rewards):
    return [sum(r) for r in rewards]


def grpo(rewards, mask, index, epsilon=1e-6, norm=True):
    scores = outcome(rewards)
    adv = [0.0] * len(scores)
    for members in groups_of(index).values():
        vals = [scores[i] for i in members]
        mean, std = (0.0, 1.0) if len(vals) == 1 else (statistics.fmean(vals), statistics.stdev(vals))
        for i in members:
            adv[i] = (scores[i] - mean) / (std + epsilon) if norm else scores[i] - mean
    return [[adv[i] * m for m in mask[i]] for i in range(len(scores))]


def grpo_passk(rewards, mask, index, epsilon=1e-6, norm=True):
    scores = outcome(rewards)
    adv = [0.0] * len(scores)
    for members in groups_of(index).values():
        ordered = sorted(members, key=lambda i: scores[i], reverse=True)
        best, second = scores[ordered[0]], scores[ordered[1]]
        value = best - second
        if norm:
            value /= statistics.stdev([scores[i] for i in members]) + epsilon
        if value != 0:
            adv[ordered[0]] = value
    return [[adv[i] * m for m in mask[i]] for i in range(len(scores))]


def rloo(rewards, mask, index):
    scores = outcome(rewards)
    adv = list(scores)
    for members in groups_of(index).values():
        if len(members) > 1:
            for i in members:
                others = [scores[j] for j in members if j != i]
                adv[i] = scores[i] - sum(others) / len(others)
    return [[adv[i] * m for m in mask[i]] for i in range(len(scores))]


def discounted_returns(rewards, mask, gamma):
    out = []
    for r, m in zip(rewards, mask):
        ret, running = [0.0] * len(r), 0.0
        for t in reversed(range(len(r))):
            running = r[t] + gamma * running
            ret[t] = running
            if not m[t]:
                running = 0.0
        out.append(ret)
    return out


def reinforce_plus_plus(rewards, mask, gamma):
    returns = discounted_returns(rewards, mask, gamma)
    white = whiten(returns, mask)
    return [[w * m for w, m in zip(wr, mr)] for wr, mr in zip(white, mask)], returns


def reinforce_plus_plus_baseline(rewards, mask, index):
    scores = outcome(rewards)
    centred = list(scores)
    for members in groups_of(index).values():
        mean = 0.0 if len(members) == 1 else statistics.fmean(scores[i] for i in members)
        for i in members:
            centred[i] = scores[i] - mean
    tiled = [[centred[i] * m for m in mask[i]] for i in range(len(scores))]
    white = whiten(tiled, mask)
    return [[w * m for w, m in zip(wr, mr)] for wr, mr in zip(white, mask)]


def remax(rewards, mask, baselines):
    returns = [[sum(r[s] * m[s] for s in range(t, len(r))) for t in range(len(r))] for r, m in zip(rewards, mask)]
    adv = [[g - b * mm for g, mm in zip(gr, m)] for gr, m, b in zip(returns, mask, baselines)]
    return adv, returns


def opo(rewards, mask, index):
    scores = outcome(rewards)
    lengths = [sum(m) for m in mask]
    adv = [0.0] * len(scores)
    for members in groups_of(index).values():
        total = sum(lengths[i] for i in members)
        if len(members) == 1 or total == 0:
            baseline = 0.0
        else:
            baseline = sum(lengths[i] * scores[i] for i in members) / total
        for i in members:
            adv[i] = scores[i] - baseline
    return [[adv[i] * m for m in mask[i]] for i in range(len(scores))]


# ------------------------------------------------------------------------- losses
def ppo_token_loss(log_ratio, advantage, low, high, clip_c):
    """PPO clip with clip-higher and dual-clip for one token; returns (loss, clipped, dual_clipped)."""
    ratio = math.exp(max(-20.0, min(20.0, log_ratio)))
    unclipped = -advantage * ratio
    clipped = -advantage * max(1 - low, min(1 + high, ratio))
    loss = max(unclipped, clipped)
    dual = False
    if advantage < 0:
        bound = -advantage * clip_c
        dual = loss > bound
        loss = min(loss, bound)
    return loss, clipped > unclipped, dual


def kl_estimate(logp, ref_logp, kind):
    d = logp - ref_logp
    if kind in ("kl", "k1"):
        return d
    if kind == "abs":
        return abs(d)
    if kind in ("mse", "k2"):
        return 0.5 * d * d
    x = max(-20.0, min(20.0, -d))
    return max(-10.0, min(10.0, math.exp(x) - x - 1))


def entropy(logits_row):
    top = max(logits_row)
    exps = [math.exp(z - top) for z in logits_row]
    total = sum(exps)
    return -sum((e / total) * math.log(e / total) for e in exps if e > 0)
