"""An independent float64 oracle for rankattn, written from the spec text only.

Nothing here imports rankattn. The spec, quoted:

    segment_ids int [B, S]: 0 padding; +s history of session s; -s candidate
    of session s. Key j is visible to query i iff both non-padding, same |s|,
    and (key is history and (not causal or query is a candidate or j <= i))
    or (i == j and both candidates). bounds (hist_lo, hist_hi, cand_lo,
    cand_hi) half-open == segment ids 1 / -1 / 0. Neither: full bidirectional
    (or causal).

    logits: (q . k) * scale (default 1/sqrt(D)), then softcap (tanh:
    c * tanh(s / c); soft_sign: s / (1 + |s| / c)), then mask, softmax. A query
    with no visible key: out 0, lse -inf. GQA: q head h uses kv head
    h // (Hq // Hkv).

`attention_loops` is a literal double loop over (i, j) for tiny shapes and is
the ground truth of tests/test_oracle.py. `mask_dense` is a vectorised numpy
spelling of the same rule (checked against the loop) so that larger tests can
build masks without calling rankattn.semantics.
"""

from __future__ import annotations

import math

import numpy as np


def is_visible(seg_i: int, seg_j: int, i: int, j: int, causal: bool) -> bool:
    """The spec's visibility rule for query i and key j, one pair at a time."""
    if seg_i == 0 or seg_j == 0 or abs(seg_i) != abs(seg_j):
        return False
    key_is_history = seg_j > 0
    query_is_candidate = seg_i < 0
    if key_is_history and (not causal or query_is_candidate or j <= i):
        return True
    return i == j and seg_i < 0 and seg_j < 0


def mask_loops(seg, causal: bool) -> np.ndarray:
    """bool [B, S, S] by looping over (i, j) with `is_visible`."""
    seg = np.asarray(seg)
    b, s = seg.shape
    out = np.zeros((b, s, s), bool)
    for r in range(b):
        for i in range(s):
            for j in range(s):
                out[r, i, j] = is_visible(int(seg[r, i]), int(seg[r, j]), i, j, causal)
    return out


def no_mask(batch: int, q_len: int, kv_len: int, causal: bool) -> np.ndarray:
    """bool [B, Sq, Skv] for a call without segment ids or bounds."""
    m = np.ones((q_len, kv_len), bool)
    if causal:
        m = np.tril(m)
    return np.broadcast_to(m, (batch, q_len, kv_len)).copy()


def mask_dense(seg, causal: bool) -> np.ndarray:
    """Vectorised numpy version of `mask_loops` (tests/test_oracle.py checks they agree)."""
    seg = np.asarray(seg).astype(np.int64)
    si, sj = seg[:, :, None], seg[:, None, :]
    pos = np.arange(seg.shape[1])
    i, j = pos[:, None], pos[None, :]
    real_same = (si != 0) & (sj != 0) & (np.abs(si) == np.abs(sj))
    history_key = (sj > 0) & ((not causal) | (si < 0) | (j <= i))
    own_candidate = (i == j) & (si < 0) & (sj < 0)
    return real_same & (history_key | own_candidate)


def bounds_to_segments(bounds, seq_len: int, batch: int) -> np.ndarray:
    """Segment ids [B, S] from bounds [4] or [B, 4] (non-overlapping ranges)."""
    bounds = np.broadcast_to(np.asarray(bounds), (batch, 4))
    seg = np.zeros((batch, seq_len), np.int32)
    for r, (hl, hh, cl, ch) in enumerate(bounds.tolist()):
        seg[r, hl:hh] = 1
        seg[r, cl:ch] = -1
    return seg


def softcap(s: float, cap, method: str) -> float:
    if cap is None:
        return s
    if method == "tanh":
        return cap * math.tanh(s / cap)
    if method == "soft_sign":
        return s / (1 + abs(s) / cap)
    raise ValueError(method)


def attention_loops(q, k, v, mask, *, scale=None, softcap_value=None, softcap_method="tanh"):
    """out [B, Sq, Hq, Dv] and lse [B, Hq, Sq] in float64, one (i, j) pair at a time.

    ``mask`` is bool [B, Sq, Skv] (from `mask_loops`, `no_mask` or `mask_dense`).
    """
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    b, sq, hq, d = q.shape
    skv, hkv, dv = k.shape[1], k.shape[2], v.shape[3]
    group = hq // hkv
    scale = 1 / math.sqrt(d) if scale is None else scale
    out = np.zeros((b, sq, hq, dv))
    lse = np.full((b, hq, sq), -np.inf)
    for r in range(b):
        for h in range(hq):
            kvh = h // group
            for i in range(sq):
                logits, values = [], []
                for j in range(skv):
                    if mask[r, i, j]:
                        s = float(np.dot(q[r, i, h], k[r, j, kvh])) * scale
                        logits.append(softcap(s, softcap_value, softcap_method))
                        values.append(v[r, j, kvh])
                if not logits:
                    continue
                m = max(logits)
                weights = np.exp(np.array(logits) - m)
                lse[r, h, i] = m + math.log(weights.sum())
                out[r, i, h] = (weights[:, None] * np.array(values)).sum(0) / weights.sum()
    return out, lse


def loss(out, lse, w, lse_weight: float):
    """The scalar loss every gradient test differentiates (numpy float64 version)."""
    finite = np.where(np.isfinite(lse), lse, 0.0)
    return float((np.asarray(out, np.float64) * w).sum() + lse_weight * (finite ** 2).sum())


def finite_difference_grads(q, k, v, mask, w, lse_weight, eps=1e-6, **kwargs):
    """Central differences of `loss(attention_loops(...))` w.r.t. q, k and v, in float64."""
    args = [np.array(x, np.float64) for x in (q, k, v)]

    def f():
        return loss(*attention_loops(*args, mask, **kwargs), w, lse_weight)

    grads = []
    for x in args:
        g = np.zeros_like(x)
        for idx in np.ndindex(x.shape):
            orig = x[idx]
            x[idx] = orig + eps
            plus = f()
            x[idx] = orig - eps
            minus = f()
            x[idx] = orig
            g[idx] = (plus - minus) / (2 * eps)
        grads.append(g)
    return grads
