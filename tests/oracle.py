"""An independent float64 oracle for rankattn, written from the spec text only.

Nothing here imports rankattn. The spec, quoted:

    segment_ids int [B, S]: 0 padding; +s history of session s; -s candidate
    of session s. Key j is visible to query i iff both non-padding, same |s|,
    and (key is history and (not causal or query is a candidate or j <= i))
    or (i == j and both candidates). bounds (hist_lo, hist_hi, cand_lo,
    cand_hi) half-open == segment ids 1 / -1 / 0. Neither: full bidirectional
    (or causal).

    logits: (q . k) * scale (default 1/sqrt(D)), then softcap (tanh:
    c * tanh(s / c); soft_sign: s / (1 + |s| / c)), then times the query's
    logit multiplier t (per query, or per query and head; default 1), then
    mask, softmax. A query with no visible key: out 0, lse -inf. GQA: q head h
    uses kv head h // (Hq // Hkv). t gets no gradient.

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
    """Segment ids [B, S] from bounds [4] or [B, 4]; a token in both ranges is history."""
    bounds = np.broadcast_to(np.asarray(bounds), (batch, 4))
    seg = np.zeros((batch, seq_len), np.int32)
    for r, (hl, hh, cl, ch) in enumerate(bounds.tolist()):
        seg[r, cl:ch] = -1
        seg[r, hl:hh] = 1
    return seg


def phoenix_bounds_mask(bounds, seq_len: int, batch: int) -> np.ndarray:
    """bool [B, S, S] of the Phoenix ranker's mask function for bounds [4] or [B, 4], written
    from its documented predicate (x-algorithm phoenix/xrex/pallas/ranker_attention_utils.py,
    ``history_candidate_mask``): vis(i, j) = (H(j) and (H(i) or C(i))) or (C(i) and C(j) and
    i == j), with H / C membership of the half-open history / candidate ranges."""
    bounds = np.broadcast_to(np.asarray(bounds), (batch, 4))
    pos = np.arange(seq_len)
    masks = []
    for hl, hh, cl, ch in bounds.tolist():
        h, c = (hl <= pos) & (pos < hh), (cl <= pos) & (pos < ch)
        hi, ci, hj, cj = h[:, None], c[:, None], h[None, :], c[None, :]
        masks.append((hj & (hi | ci)) | (ci & cj & (pos[:, None] == pos[None, :])))
    return np.stack(masks)


def softcap(s, cap, method: str):
    """The spec's cap, elementwise (scalars or numpy arrays)."""
    if cap is None:
        return s
    if method == "tanh":
        return cap * np.tanh(s / cap)
    if method == "soft_sign":
        return s / (1 + np.abs(s) / cap)
    raise ValueError(method)


def multiplier_rows(logit_multiplier, batch: int, q_len: int, q_heads: int) -> np.ndarray:
    """float64 [B, Sq, Hq] from a multiplier [B, Sq] or [B, Sq, Hq] (None: ones)."""
    if logit_multiplier is None:
        return np.ones((batch, q_len, q_heads))
    t = np.asarray(logit_multiplier, np.float64)
    return np.broadcast_to(t[:, :, None] if t.ndim == 2 else t, (batch, q_len, q_heads))


def attention_loops(q, k, v, mask, *, scale=None, softcap_value=None, softcap_method="tanh",
                    logit_multiplier=None):
    """out [B, Sq, Hq, Dv] and lse [B, Hq, Sq] in float64, one (i, j) pair at a time.

    ``mask`` is bool [B, Sq, Skv] (from `mask_loops`, `no_mask` or `mask_dense`);
    ``logit_multiplier`` [B, Sq] or [B, Sq, Hq], or None.
    """
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    b, sq, hq, d = q.shape
    skv, hkv, dv = k.shape[1], k.shape[2], v.shape[3]
    group = hq // hkv
    scale = 1 / math.sqrt(d) if scale is None else scale
    t = multiplier_rows(logit_multiplier, b, sq, hq)
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
                        logits.append(t[r, i, h] * softcap(s, softcap_value, softcap_method))
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


# --- The vectorised oracle: forward, analytic backward and error magnitudes. ----------------
#
# The same rules as `attention_loops`, as float64 numpy array expressions, so that every
# backend can be checked against it directly at the suite's shapes (S up to ~1100). Its
# backward is the analytic gradient of the spec's softmax, written out below and checked
# against finite differences of the loop (tests/test_oracle.py).


def softcap_grad(s, cap, method: str):
    """d softcap(s) / d s, elementwise."""
    if cap is None:
        return np.ones_like(s)
    if method == "tanh":
        return 1 - np.tanh(s / cap) ** 2
    return 1 / (1 + np.abs(s) / cap) ** 2


def attention(q, k, v, mask, *, w=None, lse_weight: float = 0.0, d_lse=None, scale=None,
              softcap_value=None, softcap_method="tanh", logit_multiplier=None,
              magnitudes: bool = False):
    """Forward and (with ``w``) backward in float64, vectorised; a dict of numpy arrays.

    q [B, Sq, Hq, D], k [B, Skv, Hkv, D], v [B, Skv, Hkv, Dv], mask bool [B, Sq, Skv],
    logit_multiplier [B, Sq] or [B, Sq, Hq] or None.
    ``w`` is the cotangent of out, and the lse cotangent is ``2 * lse_weight * lse`` on rows
    that see a key (the derivative of ``loss``), plus ``d_lse`` [B, Hq, Sq] when given.
    Keys: out, lse (and dq, dk, dv with ``w``). With ``magnitudes``, also ``terms`` and
    ``amplified``: for each result, per element, the sum of the absolute values of the terms
    that form it (see tests/tolerances.py for how they bound rounding error).
    """
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    b, sq, hq, d = q.shape
    skv, hkv, dv = k.shape[1], k.shape[2], v.shape[3]
    g = hq // hkv
    scale = 1 / math.sqrt(d) if scale is None else scale
    qg = q.reshape(b, sq, hkv, g, d)
    m4 = np.asarray(mask, bool)[:, None, None]                          # [B, 1, 1, Sq, Skv]

    # The multiplier as [B, Hkv, G, Sq, 1], against the logits [B, Hkv, G, Sq, Skv].
    t = multiplier_rows(logit_multiplier, b, sq, hq).reshape(b, sq, hkv, g)
    t = t.transpose(0, 2, 3, 1)[..., None]
    s = scale * np.einsum("bihgd,bjhd->bhgij", qg, k)
    c = t * softcap(s, softcap_value, softcap_method)
    m = np.where(m4, c, -np.inf).max(-1, keepdims=True)
    seen = np.isfinite(m)
    m = np.where(seen, m, 0.0)
    e = np.where(m4, np.exp(np.where(m4, c, m) - m), 0.0)
    l = e.sum(-1, keepdims=True)
    p = e / np.where(seen, l, 1.0)                                      # [B, Hkv, G, Sq, Skv]
    lse = np.where(seen, m + np.log(np.where(seen, l, 1.0)), -np.inf)[..., 0]  # [B, Hkv, G, Sq]
    out = np.einsum("bhgij,bjhd->bihgd", p, v)
    res = dict(out=out.reshape(b, sq, hq, dv), lse=lse.reshape(b, hq, sq))
    if w is None:
        return res

    do = np.asarray(w, np.float64).reshape(b, sq, hkv, g, dv)
    dl = np.where(seen[..., 0], 2 * lse_weight * np.where(seen[..., 0], lse, 0.0), 0.0)
    if d_lse is not None:
        dl = dl + np.asarray(d_lse, np.float64).reshape(b, hkv, g, sq)
    # d out_i / d c_ij = p_ij (v_j - out_i) and d lse_i / d c_ij = p_ij, so with
    # dp_ij = do_i . v_j and delta_i = do_i . out_i the logit cotangent is
    # p_ij (dp_ij - delta_i + dlse_i), times d c / d s: the cap's derivative times t.
    dp = np.einsum("bihgd,bjhd->bhgij", do, v)
    delta = np.einsum("bihgd,bihgd->bhgi", do, out)
    cg = t * softcap_grad(s, softcap_value, softcap_method)
    ds = p * (dp - delta[..., None] + dl[..., None]) * cg
    res["dq"] = (scale * np.einsum("bhgij,bjhd->bihgd", ds, k)).reshape(b, sq, hq, d)
    res["dk"] = scale * np.einsum("bhgij,bihgd->bjhd", ds, qg)
    res["dv"] = np.einsum("bhgij,bihgd->bjhd", p, do)
    if not magnitudes:
        return res

    # Magnitudes. A computed logit is off by about u * L_ij (u: the unit roundoff of the
    # math) where L_ij = scale * |q_i| . |k_j| sums the products forming it, scaled by the
    # cap's slope; the lse by about u * the p-weighted mean of those. So each p_ij carries a
    # relative error of about u * (1 + E_ij), E_ij = L_ij + mean_j' L_ij'. "terms" leaves
    # that amplification out (errors of rounding the operands and results once each),
    # "amplified" puts it in (errors of the float math itself).
    aq, ak, av, ado = np.abs(qg), np.abs(k), np.abs(v), np.abs(do)
    big_l = scale * np.einsum("bihgd,bjhd->bhgij", aq, ak)
    lc = np.where(m4, big_l * np.abs(cg), 0.0)
    lbar = (p * lc).sum(-1)
    amp = 1 + lc + lbar[..., None]
    if softcap_value is not None:  # the cap's slope moves by up to 2 / cap per unit of logit
        amp = amp + 2 * big_l * np.abs(t) / softcap_value
    dp_t = np.einsum("bihgd,bjhd->bhgij", ado, av)
    delta_t = np.einsum("bihgd,bihgd->bhgi", ado, np.abs(out))
    # ds itself, plus what rounding out moves it by (through delta); the float math's
    # error of dp - delta + dlse is in the amplified magnitude, which keeps all its terms.
    ds_t = np.abs(ds) + p * delta_t[..., None] * np.abs(cg)
    ds_a = p * (dp_t + delta_t[..., None] + np.abs(dl)[..., None]) * np.abs(cg) * amp

    def fields(pw, dsw, lse_t):
        return dict(
            out=np.einsum("bhgij,bjhd->bihgd", pw, av).reshape(b, sq, hq, dv),
            lse=np.where(seen[..., 0], lse_t, 0.0).reshape(b, hq, sq),
            dq=(scale * np.einsum("bhgij,bjhd->bihgd", dsw, ak)).reshape(b, sq, hq, d),
            dk=scale * np.einsum("bhgij,bihgd->bjhd", dsw, aq),
            dv=np.einsum("bhgij,bihgd->bjhd", pw, ado))

    abs_lse = np.abs(np.where(seen[..., 0], lse, 0.0))
    res["terms"] = fields(p, ds_t, 1 + abs_lse)
    res["amplified"] = fields(p * amp, ds_a, 1 + abs_lse + lbar)
    return res
