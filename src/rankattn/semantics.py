"""The mask and logit semantics of rankattn, in one place.

Every backend, the reference and the block planner call these functions, so
there is exactly one definition of "query i may see key j".

Segment ids (int [B, S]) are the canonical mask:

* ``0``  padding: sees nothing, is seen by nothing;
* ``+s`` a user / history token of session ``s``;
* ``-s`` a candidate of session ``s``.

Key j is visible to query i iff both are non-padding, in the same session
``|s|``, and either the key is history (any query of the session sees it; with
``causal`` a history query only sees history keys ``j <= i``) or ``i == j`` and
both are candidates. Candidates therefore see their session's whole history
and themselves, never another candidate.

``bounds = (hist_lo, hist_hi, cand_lo, cand_hi)`` is the reference kernels'
spelling of one session per row: segment id 1 on ``[hist_lo, hist_hi)``, -1 on
``[cand_lo, cand_hi)`` and 0 elsewhere. The ranges may overlap: a token in both
is history. That is the Phoenix ranker's mask function (``history_candidate_mask``
in xai-org/x-algorithm, phoenix/xrex/pallas/ranker_attention_utils.py): key j is
visible to query i iff j is history and i is in either range, or i == j is a
candidate; a token in both ranges sees every history key and is seen by every
query of either range, as a history token is. Concrete and traced bounds follow
the same rule.

Logits: ``s = (q . k) * scale``, then the soft cap, then the query's logit
multiplier ``t`` (``rankattn.attention(logit_multiplier=)``, 1 when not given:
``s = t_i * cap(scale * q_i . k_j)``, the candidate's own key included), then the
mask, then a softmax over the visible keys; lse includes ``t``, and ``t`` gets no
gradient. A query with no visible key has output 0 and log-sum-exp ``-inf``.

Non-finite inputs (NaN, +-inf) stay where they are: a query is *poisoned* when
it sees at least one key and its own q or logit multiplier (in its head) or the k
or v of a key it sees (in its kv head) holds a non-finite value. A poisoned query gets out and
lse NaN and passes no gradient; every other query's results are exactly those
of a run where the bad values are finite. Backends get there by computing on
sanitised operands (non-finite entries replaced by 0, so a masked pair never
multiplies 0 by NaN) and poisoning the affected rows: :func:`split_nonfinite`,
:func:`poison_rows` and :func:`backward_rows` below.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

SOFTCAP_METHODS = ("tanh", "soft_sign")


def visible(seg_q, seg_k, pos_q, pos_k, causal: bool):
    """Whether query (seg_q, pos_q) sees key (seg_k, pos_k); all arguments broadcast.

    The union of two disjoint parts (their keys are history and candidates
    respectively), which the blocked backend computes separately.
    """
    return (sees_history(seg_q, seg_k, pos_q, pos_k, causal)
            | sees_itself(seg_q, pos_q, pos_k))


def sees_history(seg_q, seg_k, pos_q, pos_k, causal: bool):
    """The history part: key is history of the query's session (and j <= i for causal history)."""
    visible_history = (jnp.abs(seg_q) == seg_k) & (seg_k > 0)
    if causal:
        visible_history &= (seg_q < 0) | (pos_k <= pos_q)
    return visible_history


def sees_itself(seg_q, pos_q, pos_k):
    """The candidate part: a candidate sees its own key, and no other candidate's."""
    return (seg_q < 0) & (pos_q == pos_k)


def dense_mask(seg_q, seg_k, causal: bool, pos_q=None, pos_k=None, own_key: bool = True):
    """The whole mask, bool [B, Sq, Skv], for segment ids [B, Sq] and [B, Skv]. References only.

    ``pos_q`` [B, Sq] / ``pos_k`` [B, Skv] are the tokens' positions in the whole sequence
    (default: their indices), for a shard of a longer sequence; ``own_key=False`` leaves
    out the candidates' own keys (the history part only, see :class:`ShardMask`).
    """
    pos_q = jnp.arange(seg_q.shape[1])[None, :] if pos_q is None else pos_q
    pos_k = jnp.arange(seg_k.shape[1])[None, :] if pos_k is None else pos_k
    pos_q, pos_k = pos_q[:, :, None], pos_k[:, None, :]
    seg_q, seg_k = seg_q[:, :, None], seg_k[:, None, :]
    if not own_key:
        return sees_history(seg_q, seg_k, pos_q, pos_k, causal)
    return visible(seg_q, seg_k, pos_q, pos_k, causal)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ShardMask:
    """The mask of a call that sees one shard of a longer sequence (rankattn.distributed).

    The call's ``segment_ids`` are its queries'; its keys may be another part of
    the sequence, so they bring their own segment ids, and every token its
    position in the whole sequence: causal history compares these positions,
    so shard edges change nothing. Only the history part of the mask is
    computed: a candidate's own key always sits on the candidate's own shard,
    and the caller adds that logit (as a partial result merged by log-sum-exp).
    """

    kv_segment_ids: jax.Array  # int32 [B, Skv]
    q_positions: jax.Array     # int32 [B, Sq], positions in the whole sequence
    kv_positions: jax.Array    # int32 [B, Skv]


def bounds_to_segment_ids(bounds, seq_len: int):
    """Segment ids [B, S] (int32) equal to ``bounds`` [B, 4]; a token in both ranges is history."""
    pos = jnp.arange(seq_len, dtype=jnp.int32)[None, :]
    b = bounds.astype(jnp.int32)
    hist = (pos >= b[:, 0:1]) & (pos < b[:, 1:2])
    cand = (pos >= b[:, 2:3]) & (pos < b[:, 3:4])
    return jnp.where(hist, 1, jnp.where(cand, -1, 0)).astype(jnp.int32)


def cu_seqlens_to_segment_ids(cu_seqlens, roles):
    """Segment ids [T] (int32) of packed sessions: token t of session n (``cu_seqlens[n] <= t <
    cu_seqlens[n + 1]``) gets ``n + 1`` with the sign of ``roles[t]`` (> 0 history, < 0
    candidate, 0 padding); tokens outside ``[cu_seqlens[0], cu_seqlens[-1])`` get 0."""
    t = jnp.arange(roles.shape[0], dtype=jnp.int32)
    cu = cu_seqlens.astype(jnp.int32)
    session = jnp.searchsorted(cu, t, side="right").astype(jnp.int32)  # n + 1 inside session n
    inside = (t >= cu[0]) & (t < cu[-1])
    return jnp.where(inside, jnp.sign(roles).astype(jnp.int32) * session, 0)


def softcap(s, cap: float | None, method: str):
    """Apply the logit cap (identity when ``cap`` is None)."""
    if cap is None:
        return s
    if method == "tanh":
        return cap * jnp.tanh(s / cap)
    return s / (1 + jnp.abs(s) / cap)


def softcap_grad(s, cap: float | None, method: str):
    """d softcap(s) / d s, as a factor on the capped logit's cotangent."""
    if cap is None:
        return jnp.ones_like(s)
    if method == "tanh":
        return 1 - jnp.square(jnp.tanh(s / cap))
    return 1 / jnp.square(1 + jnp.abs(s) / cap)


def softcap_grad_of_capped(y, cap: float | None, method: str):
    """:func:`softcap_grad` as a function of the capped logit ``y = softcap(s)``, for a kernel
    that keeps y but not s: tanh's 1 - tanh^2 is 1 - (y / cap)^2, soft_sign's
    1 / (1 + |s| / cap)^2 is (1 - |y| / cap)^2."""
    if cap is None:
        return jnp.ones_like(y)
    if method == "tanh":
        return 1 - jnp.square(y / cap)
    return jnp.square(1 - jnp.abs(y) / cap)


# --- Non-finite inputs. -------------------------------------------------------------


def nonfinite(x):
    """bool [...]: whether the vector along the last axis holds a NaN or an inf."""
    return ~jnp.isfinite(x).all(-1)


def finite(x):
    """x with its non-finite entries replaced by 0."""
    return jnp.where(jnp.isfinite(x), x, jnp.zeros((), x.dtype))


def nonfinite_poison(x):
    """float32 [...]: NaN where nonfinite(x), else 0.

    Adding a key's poison to its logits (before the mask) makes exactly the rows
    that see it NaN; a masked entry is replaced by -inf whatever its value.
    """
    return jnp.where(nonfinite(x), jnp.nan, 0.0).astype(jnp.float32)


def split_nonfinite(x):
    """(finite(x), :func:`nonfinite_poison` of x)."""
    return finite(x), nonfinite_poison(x)


def poison_multiplied_rows(q, multiplier):
    """(q, finite(multiplier)) with q NaN in the rows and heads whose multiplier [B, Sq, Hq] is
    not finite: such a query is poisoned like one with a non-finite q, by every backend."""
    bad = ~jnp.isfinite(multiplier)
    return jnp.where(bad[..., None], jnp.nan, q).astype(q.dtype), finite(multiplier)


def poison_rows(out, lse, q_poison):
    """NaN out [B, S, Hq, Dv] and lse [B, Hq, S] of queries with a non-finite q that see a key.

    A ``where``, so those rows pass no gradient.
    """
    hit = jnp.isnan(q_poison) & (lse.transpose(0, 2, 1) != -jnp.inf)  # [B, S, Hq]
    return (jnp.where(hit[..., None], jnp.nan, out).astype(out.dtype),
            jnp.where(hit.transpose(0, 2, 1), jnp.nan, lse))


def row_dot(x, y):
    """sum(x * y) over the last axis, in float32 (float64 for float64), as a dot.

    A dot, not ``(x * y).sum(-1)``: XLA's CPU fusion of that reduce took 51 ms for
    one 8192-token row ``[1, 8192, 4, 128]`` (the dot 0.9 ms; at ``[2, 8192, 4, 128]``
    2.4 ms either way). HIGHEST keeps it float32 where a dot's default precision is not.
    """
    acc = jnp.promote_types(jnp.promote_types(x.dtype, y.dtype), jnp.float32)
    return jnp.einsum("...d,...d->...", x.astype(acc), y.astype(acc),
                      precision=jax.lax.Precision.HIGHEST)


def backward_rows(out, d_out, lse, d_lse):
    """(lse, d_out, delta) for a flash backward, per row (``lse`` shaped ``out.shape[:-1]``).

    delta = rowsum(dO * O) - d lse (d lse / d s = p, so an lse cotangent enters
    exactly like -delta). Two kinds of rows pass no gradient: poisoned ones (lse NaN)
    and those that see no key (lse -inf, out 0), whose cotangents may be NaN (a loss
    that masks lse with ``where(isfinite(lse), lse ** 2, 0)`` hands back 2 lse 0 =
    NaN, and 0 * NaN in ds or dv would reach every key of their blocks). Their lse
    becomes +inf, so every recomputed p is exactly 0, and their d_out and delta 0.
    """
    quiet = jnp.isnan(lse) | (lse == -jnp.inf)
    # Of d_out as given (a quiet row's delta is replaced below): the dot need not wait
    # for the where.
    delta = row_dot(d_out, out) - d_lse
    d_out = jnp.where(quiet[..., None], 0, d_out).astype(d_out.dtype)
    return jnp.where(quiet, jnp.inf, lse), d_out, jnp.where(quiet, 0.0, delta)


# --- Block-level view, used to skip work. -------------------------------------
#
# Blocks only matter for the history part: the candidate part is one logit per
# candidate (its own key), which the blocked backend adds without visiting a
# block. A block pair is "empty" when no query of the query block sees a
# history key of the key block, and "full" when every query sees every key.
# Both verdicts must be exact or conservative with respect to `sees_history`:
# a missed "empty" or "full" costs time, a wrong one loses keys or skips the
# mask. A property test checks both.


def block_stats(seg, block: int, length: int | None = None):
    """Per-block summaries of segment ids [B, S] (S a multiple of ``block``).

    Positions from ``length`` on are padding whose results are discarded: they
    count as padding for what the block contains, but as anything at all for
    the "all" verdicts, so a ragged last query block can still be full.
    """
    b, s = seg.shape
    blocks = seg.reshape(b, s // block, block)
    session = jnp.abs(blocks)
    real = blocks != 0
    dont_care = (jnp.arange(s) >= (s if length is None else length)).reshape(s // block, block)
    big = jnp.iinfo(jnp.int32).max
    return dict(
        all_real=(real | dont_care).all(-1),
        lo=jnp.where(real, session, big).min(-1),
        hi=jnp.where(real, session, 0).max(-1),
        hist_lo=jnp.where(blocks > 0, blocks, big).min(-1),
        hist_hi=jnp.where(blocks > 0, blocks, 0).max(-1),
        all_hist=(blocks > 0).all(-1),
        any_cand=(blocks < 0).any(-1),
        all_cand=((blocks < 0) | dont_care).all(-1),
    )


def history_block_visibility(seg_q, seg_k, block_q: int, block_k: int, causal: bool,
                             q_len: int | None = None, pos_q=None, pos_k=None):
    """(nonempty, full), each bool [B, nQ, nK], of the history part of the mask.

    seg_q [B, Sq] and seg_k [B, Skv] are padded to multiples of their block
    sizes. Queries from ``q_len`` on are the caller's own padding, whose rows it
    discards: "full" may then count them as seeing every key (their outputs
    and, with zero cotangents, their gradient contributions are never used).
    ``pos_q`` / ``pos_k`` ([B, Sq] / [B, Skv], padded like the segment ids) are
    positions in a longer sequence (:class:`ShardMask`); causal blocks then
    compare each block's smallest and largest position instead of its indices.
    """
    q = {n: x[:, :, None] for n, x in block_stats(seg_q, block_q, q_len).items()}
    k = {n: x[:, None, :] for n, x in block_stats(seg_k, block_k).items()}
    n_q, n_k = seg_q.shape[1] // block_q, seg_k.shape[1] // block_k
    if pos_q is None:
        q_first = (jnp.arange(n_q) * block_q)[None, :, None]
        q_last = q_first + block_q - 1
    else:
        q_first, q_last = (x[:, :, None] for x in _position_range(pos_q, block_q))
    if pos_k is None:
        k_first = (jnp.arange(n_k) * block_k)[None, None, :]
        k_last = k_first + block_k - 1
    else:
        k_first, k_last = (x[:, None, :] for x in _position_range(pos_k, block_k))

    nonempty = (q["lo"] <= k["hist_hi"]) & (k["hist_lo"] <= q["hi"])
    if causal:
        nonempty &= q["any_cand"] | (k_first <= q_last)

    one_session = (q["lo"] == q["hi"]) & (q["lo"] == k["hist_lo"]) & (k["hist_lo"] == k["hist_hi"])
    full = q["all_real"] & k["all_hist"] & one_session
    if causal:
        full &= q["all_cand"] | (k_last <= q_first)
    return nonempty, full


def _position_range(pos, block: int):
    """(smallest, largest) position of each block of ``pos`` [B, S]: [B, S / block] each."""
    blocks = pos.reshape(pos.shape[0], -1, block)
    return blocks.min(-1), blocks.max(-1)
