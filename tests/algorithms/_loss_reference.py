"""Loop references for the newer policy losses (DPPO, CISPO, SAPO, GMPO, DRO, KL-Cov, SPPO) and SPIN's DPO.

Plain Python on lists of floats, one token and one sequence at a time, written from the papers'
formulas and verl's definitions (``core_algos.py``), independently of megarl.algorithms. Each
function returns the per-token loss matrix (to aggregate with ``_algo_reference.aggregate``) and,
where the loss's gradient differs from the loss's derivative through the ratio, the per-token
derivative with respect to ``log_prob`` (before aggregation).
"""

from __future__ import annotations

import math


def _tokens(*matrices):
    """Zip several row lists token by token: yields (row index, column index, values...)."""
    for i, row in enumerate(zip(*matrices)):
        for j, values in enumerate(zip(*row)):
            yield i, j, values


def zeros_like(matrix):
    return [[0.0 for _ in row] for row in matrix]


def dppo(old, new, adv, kind, low, high, cap):
    """DPPO: (loss, d loss / d log_prob, valid, capped) per token; kind 'tv' or 'kl'."""
    loss, grad, valid, capped = (zeros_like(old) for _ in range(4))
    for i, j, (o, n, a) in _tokens(old, new, adv):
        p, po = math.exp(n), math.exp(o)
        if kind == "tv":
            ok = (p - po <= high) if a > 0 else (p - po >= -low)
        else:
            div = po * (o - n) + (1 - po) * math.log((1 - po + 1e-8) / (1 - p + 1e-8))
            ok = (div <= high or p <= po) if a > 0 else (div <= low or p >= po)
        weight = min(math.exp(n - o), cap)  # truncated importance weight, no gradient
        loss[i][j] = -a * weight * n * ok
        grad[i][j] = -a * weight * ok
        valid[i][j] = float(ok)
        capped[i][j] = float(math.exp(n - o) > cap and ok)
    return loss, grad, valid, capped


def cispo(old, new, adv, low, high):
    loss, grad, clipped = zeros_like(old), zeros_like(old), zeros_like(old)
    for i, j, (o, n, a) in _tokens(old, new, adv):
        r = math.exp(n - o)
        c = max(1 - low, min(1 + high, r))
        loss[i][j], grad[i][j], clipped[i][j] = -c * a * n, -c * a, float(c != r)
    return loss, grad, clipped


def sapo(old, new, adv, tau_pos, tau_neg):
    loss = zeros_like(old)
    for i, j, (o, n, a) in _tokens(old, new, adv):
        tau = tau_pos if a > 0 else tau_neg
        gate = 1 / (1 + math.exp(-tau * (math.exp(n - o) - 1))) * 4 / tau
        loss[i][j] = -gate * a
    return loss


def geo_mean(old, new, adv, mask, low, high):
    """GMPO: one loss per non-empty sequence; returns (mean over them, clipped-up count, clipped-down count)."""
    seq_losses, up, down = [], 0, 0
    for o_row, n_row, a_row, m_row in zip(old, new, adv, mask):
        kept, advs = [], []
        for o, n, a, m in zip(o_row, n_row, a_row, m_row):
            if not m:
                continue
            lr = n - o
            if a > 0:
                kept.append(min(lr, high))  # the clip only lowers a rising ratio
            elif a < 0:
                kept.append(max(lr, -low))  # ... and only raises a falling one
            else:
                kept.append(0.0)
            advs.append(a)
            clipped = lr > high or lr < -low
            up += clipped and a > 0
            down += clipped and a < 0
        if kept:
            seq_losses.append(-sum(advs) / len(advs) * math.exp(sum(kept) / len(kept)))
    return sum(seq_losses) / len(seq_losses), up, down


def dro(old, new, adv, beta):
    loss = zeros_like(old)
    for i, j, (o, n, a) in _tokens(old, new, adv):
        loss[i][j] = -(n * a - beta / 2 * (n - o) ** 2)
    return loss


def kl_cov(old, new, adv, mask, ratio, coef):
    """KL-Cov: the unclipped surrogate, plus coef * |log r| on the top max(1, int(ratio * N)) covariance tokens."""
    valid = [(i, j, a, n) for i, j, (a, n, m) in _tokens(adv, new, mask) if m]
    mean_a = sum(v[2] for v in valid) / len(valid)
    mean_n = sum(v[3] for v in valid) / len(valid)
    ranked = sorted(valid, key=lambda v: (v[2] - mean_a) * (v[3] - mean_n), reverse=True)
    chosen = {(v[0], v[1]) for v in ranked[:max(1, int(len(valid) * ratio))]}
    loss = zeros_like(old)
    for i, j, (o, n, a) in _tokens(old, new, adv):
        loss[i][j] = -a * math.exp(n - o) + (coef * abs(n - o) if (i, j) in chosen else 0.0)
    return loss, chosen


def soft_mean(values, beta):
    if beta == 0:
        return sum(values) / len(values)
    return math.log(sum(math.exp(beta * v) for v in values) / len(values)) / beta


def sppo_loss(old, new, adv, mask, eta):
    """SPPO: per non-empty sample, (sum_t (log_prob - old) - eta * A)^2; the mean over those samples."""
    squares = []
    for o_row, n_row, a_row, m_row in zip(old, new, adv, mask):
        tokens = [(o, n, a) for o, n, a, m in zip(o_row, n_row, a_row, m_row) if m]
        if tokens:
            advantage = sum(t[2] for t in tokens) / len(tokens)
            squares.append((sum(n - o for o, n, _ in tokens) - eta * advantage) ** 2)
    return sum(squares) / len(squares)


def dpo_pair_loss(z, beta, loss_type, smoothing):
    if loss_type == "sigmoid":
        def log_sigmoid(x):
            return -math.log1p(math.exp(-x))
        return -(1 - smoothing) * log_sigmoid(beta * z) - smoothing * log_sigmoid(-beta * z)
    return (z - 1 / (2 * beta)) ** 2
