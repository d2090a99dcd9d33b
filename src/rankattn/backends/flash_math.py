"""The per-block arithmetic of a flash-attention kernel, independent of how it is lowered.

The Pallas TPU kernels (:mod:`rankattn.backends.pallas_tpu`) call these inside their
kernel bodies; they are plain ``jnp`` on arrays (values loaded from refs), so any
Pallas lowering can trace them. Every step follows :mod:`rankattn.semantics`:
``s = t * cap(scale * q . k)``, the softmax in base 2 (``log2(e)`` folded into the
logits, so ``exp2`` gives the probabilities), the saved log-sum-exp in natural log.

Shapes are those of the caller: a helper broadcasts whatever it is given, so a kernel
may hold logits as [rows, keys] with per-row vectors shaped [rows, 1] (TPU: 2-D
vectors only), or as [rows, keys] with per-row vectors shaped [rows] (Triton).
"""

from __future__ import annotations

import math

import jax.numpy as jnp

from rankattn import semantics

LOG2E = math.log2(math.e)
LN2 = math.log(2.0)


def capped_logits(st, qk):
    """(base-2 logits after scale and cap, scaled logits before the cap or None) from the
    raw dot products ``qk = q . k`` (float32). ``st`` has ``scale``, ``softcap`` and
    ``softcap_method``; the scaled logits are what :func:`logit_grads` needs for the
    cap's derivative (None without a cap: no derivative to take)."""
    if st.softcap is None:
        return qk * (st.scale * LOG2E), None
    s = qk * st.scale
    return semantics.softcap(s, st.softcap, st.softcap_method) * LOG2E, s


def times(x, multiplier):
    """x times the rows' logit multiplier (shaped to broadcast against x), or x (None)."""
    return x if multiplier is None else x * multiplier


def own_logits(st, q, k_own, seg_q, poison=0.0, multiplier=None, keepdims: bool = False):
    """Each candidate's logit on its own key, per row: (base-2 logits, times the row's
    multiplier, plus the key's poison, masked to -inf off candidates; scaled logits before
    the cap). ``q`` [..., rows, D] and ``k_own`` [rows, D] (the key at each query's
    position) reduce over D; ``keepdims`` keeps that axis as size 1 (2-D TPU vectors)."""
    s = (q.astype(jnp.float32) * k_own.astype(jnp.float32)).sum(-1, keepdims=keepdims)
    s = s * st.scale
    s2 = times(semantics.softcap(s, st.softcap, st.softcap_method) * LOG2E, multiplier) + poison
    return jnp.where(seg_q < 0, s2, -jnp.inf), s


def logit_grads(st, p, dp, delta, s, multiplier=None):
    """d loss / d (q . k) from p, dp = dO . v and delta, with the cap's derivative (at the
    scaled logits ``s``), the rows' logit multiplier and the scale."""
    ds = p * (dp - delta)
    if st.softcap is not None:
        ds = ds * semantics.softcap_grad(s, st.softcap, st.softcap_method)
    return times(ds, multiplier) * st.scale


def logit_grad_factor(st, p, multiplier=None, *, s=None, lse2=None):
    """The factor of :func:`logit_grads` known before dp: d loss / d (q . k) is this times
    (dp - delta). With a cap, its derivative is taken at the scaled logits ``s``, or, without
    a multiplier, from p = exp2(s2 - lse2) and ``lse2`` alone: the capped logit is
    (log2(p) + lse2) / log2(e) (:func:`rankattn.semantics.softcap_grad_of_capped`), good to a
    few ulps of lse2. For a kernel that cannot keep the logits live beside p until dp is
    known (mosaic_gpu's dk / dv at D=128). (Under a multiplier m the logit would come back
    divided by m, its error too: p's float32 precision bounds |m| c, not c, so a tiny m
    gives garbage; there ``s`` is needed.) Where p is 0 (masked, underflowed, a poisoned
    row's) the recovered factor is 0."""
    factor = times(p, multiplier) * st.scale
    if st.softcap is None:
        return factor
    if s is not None:
        return factor * semantics.softcap_grad(s, st.softcap, st.softcap_method)
    assert multiplier is None and lse2 is not None, "recovering the logit needs lse2, no m"
    slope = semantics.softcap_grad_of_capped((jnp.log2(p) + lse2) * (1 / LOG2E), st.softcap,
                                             st.softcap_method)
    return jnp.where(p > 0, factor * slope, 0.0)


def lse2(lse):
    """The saved lse in base 2, for recomputing p = exp2(s2 - lse2) in a backward kernel.

    Rows that pass no gradient (poisoned, or seeing nothing) arrive as +inf
    (semantics.backward_rows): every p is 0.
    """
    return lse * LOG2E


def online_softmax_step(s2, v, m, l, acc, dot):
    """Fold base-2 logits ``s2`` [rows, n] of one key block with values ``v`` [n, Dv] into
    the running (acc [rows, Dv], m [rows, 1], l [rows, 1]); ``dot(p, v)`` is the caller's
    float32-accumulating product. Returns the new (acc, m, l).

    A row that has seen nothing yet keeps its shift at 0, so exp2(-inf - 0) = 0, never NaN.
    """
    m_new = jnp.maximum(m, s2.max(-1, keepdims=True))
    shift = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    p = jnp.exp2(s2 - shift)
    alpha = jnp.exp2(m - shift)
    return acc * alpha + dot(p.astype(v.dtype), v), m_new, l * alpha + p.sum(-1, keepdims=True)


def finish(acc, m, l):
    """(out, lse in natural log) from the online softmax's (acc, m, l); rows that saw no
    key (l == 0) get out 0 and lse -inf, a poisoned row (NaN) stays NaN."""
    seen = l != 0
    safe_l = jnp.where(seen, l, 1.0)
    return acc / safe_l, jnp.where(seen, (m + jnp.log2(safe_l)) * LN2, -jnp.inf)
