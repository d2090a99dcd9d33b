"""Blocked flash attention in plain JAX/XLA, with a custom VJP. Runs on any backend.

How it works:

1. Shape fix-ups in Python: pad the sequence to a multiple of the block sizes
   (padding gets segment id 0, so it is invisible) and split query heads into
   (kv head, group) so GQA never repeats K/V.
2. The mask splits into two disjoint parts (:mod:`rankattn.semantics`): the
   history part, and each candidate's own key. The own-key part is one logit
   per candidate, computed for all rows at once in O(S * D); so no block is
   ever visited just to find a candidate's diagonal.
3. Plan (:class:`rankattn.blocks.BlockPlan`): for every (query block, key block) pair, whether
   the history part is empty, full or partial there, computed on device from
   the (possibly traced) segment ids. Per query block it lists the full key
   blocks, then the partial ones.
4. Forward: all query blocks advance together through their lists, one key
   block per step, with an online softmax; full blocks skip the mask
   arithmetic, empty blocks are never touched. The own-key logit joins the
   softmax at the end.
5. Backward: the same plan and the saved log-sum-exp; dq accumulates in
   place, dk/dv scatter-add into the visited key blocks. No S x S tensor is
   formed, forward or backward. Recomputing p measured faster on CPU than
   keeping the forward's p (a slot per visited block, 256 MiB cap): nano
   fwd+bwd (B=4) took 1.09x the time with kept p, the short call (B=2, 320
   tokens) the same; the memory traffic costs what the matmul and exp save.
   A key-major backward (S^T = K Q^T, so every dot contracts its left
   operand's last axis and XLA:CPU runs it on YNNPACK; dQ^T = K^T dS^T
   scattered into the query blocks) took 1.07-1.16x the time on the 2-core
   AVX2 EPYC (fwd+bwd of 2 + 1022 history + 64 candidates, nano, packed
   rows): there YNNPACK's block dots are no faster than Eigen's. It is commit
   c2e865f, for a machine where they are.

Precision (``mixed_precision``): bf16 / f16 operands feed the dots directly
with float32 accumulation (tensor cores on GPU, the MXU on TPU, AMX or AVX-512
BF16 on CPU), except f16 on CPU, which is up-cast to float32 with the dots at
"highest" precision (float64 stays float64): each measured the faster there
(see Xla). The softmax, the scale and every accumulator stay float32 either way.
"""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp

from rankattn import semantics
from rankattn.backends.base import Backend, compute_dtype, first_derivatives_only
from rankattn.blocks import (BlockPlan, BlockSizes, check_block_sizes, pad_axis1, pad_positions,
                             round_up, segments_and_plan)
from rankattn.errors import fail
from rankattn.validate import AttentionCall, check_optional_bool, is_positive_int


# The xla backend's default blocks. Measured on the 2-core AMD EPYC development machine
# (nano-fwd of benchmarks/bench.py, median ms; query x key block, logits per scan step):
# 128x128 1 MiB 237, 128x256 2 MiB 197, 128x512 4 MiB 148, 128x512 16 MiB 225, 128x1024
# 4 MiB 155, 256x128 2 MiB 444; packed-fwd and long-history-fwd agree (128x512 4 MiB 134 ms
# vs 215 ms at 128x128 1 MiB; 9.2 s vs 13.0 s).
DEFAULT_BLOCK_SIZES = BlockSizes(128, 512)
# With the default blocks, queries up to this long form a single query block: fewer, larger
# steps. Measured (benchmarks/bench.py shapes, forward, median of per-round ratios to
# 128-query blocks): B=2 and B=16 with 2 + 254 history + 64 candidates 0.66x and 0.74x the
# time, 20/4 heads 0.67x, 128 + 16 tokens 0.57x, fwd+bwd at B=4 0.78x.
SHORT_QUERY_LEN = 512


def plan_sizes(sizes: BlockSizes | None, q_len: int, kv_len: int) -> BlockSizes:
    """Blocks no longer than the sequences (rounded up to 8), so short calls pad little.

    ``None`` means the defaults chosen per shape: DEFAULT_BLOCK_SIZES, with the
    query block adjusted to pad least (:func:`query_block`) and a single query
    block for queries of at most SHORT_QUERY_LEN tokens. Key blocks keep their
    length: padded keys are candidates' or padding's, in blocks the plan skips.
    """
    if sizes is None:
        short = q_len <= SHORT_QUERY_LEN
        sizes = BlockSizes(round_up(q_len, 8) if short
                           else query_block(q_len, DEFAULT_BLOCK_SIZES.block_q),
                           DEFAULT_BLOCK_SIZES.block_k)
    return BlockSizes(min(sizes.block_q, round_up(q_len, 8)), min(sizes.block_k, round_up(kv_len, 8)))


def query_block(q_len: int, target: int) -> int:
    """A multiple of 8 within 25% of ``target`` whose blocks pad ``q_len`` least (the one
    nearest ``target`` among equals): 2 + 1022 history + 64 candidates, 1088 queries, take
    8 blocks of 136 instead of 9 of 128 (6% padded queries)."""
    options = []
    for blocks in range(-(-q_len * 4 // (target * 5)), -(-q_len * 4 // (target * 3)) + 1):
        size = round_up(-(-q_len // blocks), 8)
        options.append((blocks * size - q_len, abs(size - target), size))
    return min(options)[2]


# Query blocks are processed a few at a time ("units" per scan step: one query block of one
# batch row each): XLA materialises each step's logits for every unit it handles at once.
# Measured on the 2-core AMD EPYC development machine (AVX2; interleaved medians of per-round
# ratios to 4 units per step, 11 rounds; 2 + 1022 history + 64 candidates, B=2, D=128):
# - GQA (4/2 heads): 2 units per step 1.02x forward, 1.00x fwd+bwd; 1 unit 0.88x / 0.88x;
#   8 units 0.81x / 0.90x (5 rounds). Packed rows (8 sessions in 8192 tokens): 1.01x.
#   With 20/4 heads two units took 0.74x the time of one (nano, B=2).
# - MHA (4/4 heads), whose K/V blocks per unit are twice as large: 1 unit per step 1.27x
#   forward, 1.15x fwd+bwd; 2 units 1.18x / 1.14x.
# An explicit ``step_logits_bytes`` instead sets how many units' logits a step may hold.
UNITS_PER_STEP_MHA, UNITS_PER_STEP_GQA = 1, 2
# Single-query-block calls (SHORT_QUERY_LEN) keep a logits budget per step instead: 16 MiB
# took 0.76x the time of 4 MiB at B=16 with 2 + 254 history + 64 candidates, 0.58x with
# 20/4 heads at B=2.
SHORT_STEP_LOGITS_BYTES = 16 << 20


def units_per_step(units: int, unit_bytes: int, n_q: int, group: int,
                   step_logits_bytes: int | None) -> int:
    """How many units (query blocks of a row) one scan step processes.

    A divisor of ``units`` when one is at least half the size the rule allows, so that no
    step computes padded units (18 units of 4 took 5 steps, 2 of them padding); otherwise
    (a prime count, say) as even as possible.
    """
    if step_logits_bytes is None and n_q > 1:
        most = min(units, UNITS_PER_STEP_MHA if group == 1 else UNITS_PER_STEP_GQA)
    else:
        limit = step_logits_bytes or SHORT_STEP_LOGITS_BYTES
        most = -(-units // -(-units * unit_bytes // limit))
    divisor = max(d for d in range(1, most + 1) if units % d == 0)
    return divisor if 2 * divisor >= most else most


@dataclasses.dataclass(frozen=True)
class _Static:
    """Everything that selects the compiled program."""

    causal: bool
    scale: float  # applied to the float32 logits; 1.0 when it is folded into q
    softcap: float | None
    softcap_method: str
    operands: jnp.dtype  # what the block dots read: the accumulation dtype, or bf16 / f16
    accumulate: jnp.dtype
    sizes: BlockSizes
    n_q: int    # query blocks per row
    n_k: int    # key blocks per row
    chunk: int  # query blocks (units) per scan step

    def scaled(self, x):
        return x if self.scale == 1.0 else x * self.scale

    def cap(self, s):
        return semantics.softcap(s, self.softcap, self.softcap_method)

    def cap_grad(self, s):
        return semantics.softcap_grad(s, self.softcap, self.softcap_method)


class _Units(NamedTuple):
    """The plan per unit, a unit being one query block of one batch row (u = b * nQ + n)."""

    kv_index: jax.Array    # [U, nK] key blocks as rows of the flattened [B * nK] block array
    full_count: jax.Array  # [U]
    count: jax.Array       # [U]
    q_pos: jax.Array       # [U, bq] positions of the unit's queries (in the whole sequence)


# Jitted: called eagerly, its loops would be traced and compiled again at every call (0.7 s a
# call at B=2, S=64); under an outer jit this is inlined.
@partial(jax.jit, static_argnames=("causal", "scale", "softcap", "softcap_method",
                                   "block_sizes", "mixed_precision", "step_logits_bytes"))
def flash_attention(q, k, v, segment_ids, *, causal: bool, scale: float, softcap: float | None,
                    softcap_method: str, block_sizes: BlockSizes | None = None,
                    block_plan: BlockPlan | None = None, mixed_precision: bool = False,
                    step_logits_bytes: int | None = None,
                    shard_mask: semantics.ShardMask | None = None, logit_multiplier=None):
    """Blocked attention; arguments and results as :func:`rankattn.attention` (checked;
    ``logit_multiplier`` float32 [B, Sq, Hq], finite, or None).

    Without segment ids every token is history of one session, and q and k may
    differ in length (plain cross-attention). ``block_plan``, if given, is
    :func:`rankattn.blocks.make_block_plan` of these segment ids, padded to
    ``plan_sizes(block_sizes, ...)``, and ``causal``; without one it is made
    here, by the same code. ``mixed_precision`` feeds bf16 / f16 operands to
    the dots as they are (float32 accumulation) instead of up-casting them.
    ``shard_mask``: the call is one shard of a longer sequence (rankattn.distributed):
    keys with their own segment ids, positions from the mask, history part only.
    """
    b, sq, hq, _ = q.shape
    dtype = q.dtype
    skv, hkv = k.shape[1], k.shape[2]
    sizes = plan_sizes(block_sizes, sq, skv)
    bq, bk = sizes.block_q, sizes.block_k
    seg_q, seg_k, block_plan = segments_and_plan(segment_ids, b, sq, skv, sizes, causal,
                                                 block_plan, shard_mask)
    if shard_mask is None:
        pos_q = jnp.broadcast_to(jnp.arange(seg_q.shape[1], dtype=jnp.int32), seg_q.shape)
        pos_k = jnp.broadcast_to(jnp.arange(seg_k.shape[1], dtype=jnp.int32), seg_k.shape)
    else:
        pos_q = pad_positions(shard_mask.q_positions, bq)
        pos_k = pad_positions(shard_mask.kv_positions, bk)

    n_q, n_k = seg_q.shape[1] // bq, seg_k.shape[1] // bk
    chunk = units_per_step(b * n_q, hq * bq * bk * 4, n_q, hq // hkv, step_logits_bytes)
    n_units = round_up(b * n_q, chunk)
    accumulate = compute_dtype(q.dtype)
    operands = q.dtype if mixed_precision else accumulate
    if not mixed_precision:
        # Fold the scale into q, in the accumulation dtype: cheaper than scaling every logit,
        # and autodiff of this wrapper then applies it to dq.
        q, scale = q.astype(accumulate) * scale, 1.0
    static = _Static(causal, scale, softcap, softcap_method, operands, accumulate, sizes, n_q,
                     n_k, chunk)

    def units(x):
        """[B, nQ, ...] -> [U, ...], padded with zero units (which see nothing)."""
        x = x.reshape((b * n_q,) + x.shape[2:])
        return jnp.pad(x, [(0, n_units - b * n_q)] + [(0, 0)] * (x.ndim - 1))

    def key_rows(x):
        """[B, S, Hkv, D] -> [B * nK, Hkv, bk, D]."""
        x = pad_axis1(x.astype(operands), bk)
        return x.reshape(b * n_k, bk, hkv, -1).transpose(0, 2, 1, 3)

    def query_units(x, heads, dtype=operands):
        """[B, S, H, D] -> [U, Hkv, H // Hkv, bq, D]; query head h = kv_head * G + g."""
        x = pad_axis1(x.astype(dtype), bq).reshape(b, n_q, bq, hkv, heads // hkv, -1)
        return units(x.transpose(0, 1, 3, 4, 2, 5))

    plan = _Units(
        kv_index=units(block_plan.kv_index + (jnp.arange(b, dtype=jnp.int32) * n_k)[:, None, None]),
        full_count=units(block_plan.full_count), count=units(block_plan.count),
        q_pos=units(pos_q.reshape(b, n_q, bq)))
    qu = query_units(q, hq)
    multiplier = None  # [U, Hkv, G, bq]
    if logit_multiplier is not None:
        multiplier = query_units(logit_multiplier[..., None], hq, accumulate)[..., 0]
    kb, vb = key_rows(k), key_rows(v)
    own_kv = None
    if segment_ids is not None and shard_mask is None:  # each query's own key and value
        own_kv = (query_units(k, hkv)[:, :, 0], query_units(v, hkv)[:, :, 0])
    # Non-finite inputs (rankattn.semantics): the kernel computes on finite operands and is
    # told which query rows and keys held a non-finite entry. Done here, in the layout copies.
    bad = _Bad(q=semantics.nonfinite(qu),
               key=semantics.nonfinite(kb) | semantics.nonfinite(vb),
               own=None if own_kv is None else (semantics.nonfinite(own_kv[0])
                                                | semantics.nonfinite(own_kv[1])))
    qu, kb, vb = semantics.finite(qu), semantics.finite(kb), semantics.finite(vb)
    own_kv = None if own_kv is None else tuple(map(semantics.finite, own_kv))
    out, lse = _flash(static, qu, kb, vb, own_kv, units(seg_q.reshape(b, n_q, bq)),
                      seg_k.reshape(b * n_k, bk), pos_k.reshape(b * n_k, bk), plan, bad,
                      multiplier)
    # [U, Hkv, G, bq, Dv] -> [B, Sq, Hq, Dv];  [U, Hkv, G, bq] -> [B, Hq, Sq]
    out = out[:b * n_q].reshape(b, n_q, hq, bq, -1).transpose(0, 1, 3, 2, 4)
    out = out.reshape(b, n_q * bq, hq, -1)[:, :sq]
    lse = lse[:b * n_q].reshape(b, n_q, hq, bq).transpose(0, 2, 1, 3).reshape(b, hq, -1)[:, :, :sq]
    return out.astype(dtype), lse.astype(compute_dtype(dtype))


def _chunks(static: _Static, tree):
    """Split every leading unit axis [U, ...] into [U / chunk, chunk, ...] for lax.scan."""
    return jax.tree.map(lambda x: x.reshape((-1, static.chunk) + x.shape[1:]), tree)


def _unchunk(tree):
    return jax.tree.map(lambda x: x.reshape((-1,) + x.shape[2:]), tree)


class _Bad(NamedTuple):
    """Which inputs held a non-finite entry (the kernel's operands have 0 there)."""

    q: jax.Array         # [U, Hkv, G, bq] query rows
    key: jax.Array       # [B * nK, Hkv, bk] keys, by k or v
    own: jax.Array | None  # [U, Hkv, bq] each query's own key, by k or v (None without a mask)


class _Visit(NamedTuple):
    """Step t of one of the two loops: one key block for every unit of a chunk."""

    index: jax.Array   # [C] key block visited (row of the flattened block array)
    valid: jax.Array   # [C] whether this unit has a t-th block in this loop
    k: jax.Array       # [C, Hkv, bk, D]
    v: jax.Array       # [C, Hkv, bk, Dv]
    mask: jax.Array | None  # [C, 1, 1, bq, bk] for partial blocks, None for full ones
    logits: jax.Array  # [C, Hkv, G, bq, bk], scaled, before the cap


def _loops(plan: _Units):
    """(masked, first list position, trip count) of the full-block and partial-block loops."""
    return ((False, jnp.zeros_like(plan.full_count), plan.full_count),
            (True, plan.full_count, plan.count - plan.full_count))


def _visit(static: _Static, masked: bool, t, start, count, q, kb, vb, seg_q, seg_kb, pos_kb,
           plan: _Units) -> _Visit:
    position = jnp.minimum(start + t, static.n_k - 1)
    index = jnp.take_along_axis(plan.kv_index, position[:, None], axis=-1)[:, 0]
    valid = t < count
    k_t, v_t = kb[index], vb[index]
    logits = static.scaled(_block_dot(static, "chrd,chkd->chrk", q, k_t))
    mask = None
    if masked:
        mask = semantics.sees_history(seg_q[:, :, None], seg_kb[index][:, None, :],
                                      plan.q_pos[:, :, None], pos_kb[index][:, None, :],
                                      static.causal)
        mask = (mask & valid[:, None, None])[:, None, None]
    return _Visit(index, valid, k_t, v_t, mask, logits)


def _block_dot(static: _Static, spec: str, x, y):
    """einsum of block operands, with each 5-D operand's (G, bq) axes merged into one row axis r.

    XLA's CPU dot is markedly faster on [rows, D] x [D, bk] than with a separate
    group axis; the merge and split are free reshapes. Operands are cast to
    ``static.operands`` (a no-op on the float32 path; p and ds in bf16 / f16 on
    the mixed-precision path) and the result accumulates in float32.
    """
    def merge(a):
        a = a.astype(static.operands)
        return a.reshape(a.shape[:2] + (-1,) + a.shape[4:]) if a.ndim == 5 else a

    group = (x if x.ndim == 5 else y).shape[2]
    precision = "highest" if static.operands == static.accumulate else "default"
    out = jnp.einsum(spec, merge(x), merge(y), precision=precision,
                     preferred_element_type=static.accumulate)
    if "r" in spec.split("->")[1]:
        out = out.reshape(out.shape[:2] + (group, -1) + out.shape[3:])
    return out


def _row(x):
    """[C] -> broadcastable against [C, Hkv, G, bq]."""
    return x[:, None, None, None]


def _own_logits(static: _Static, q, own_kv, seg_q):
    """Each candidate's logit on its own key: (capped, raw) [C, Hkv, G, bq], and the mask."""
    # Elementwise, not einsum: as a dot, XLA transposes q to batch over (h, q).
    acc = static.accumulate
    raw = (q.astype(acc) * own_kv[0][:, :, None].astype(acc)).sum(-1)
    raw = static.scaled(raw)
    is_cand = (seg_q < 0)[:, None, None, :]
    return static.cap(raw), raw, is_cand


@partial(jax.custom_vjp, nondiff_argnums=(0,))
def _flash(static: _Static, qu, kb, vb, own_kv, seg_qu, seg_kb, pos_kb, plan: _Units,
           bad: _Bad, multiplier):
    return _forward(static, qu, kb, vb, own_kv, seg_qu, seg_kb, pos_kb, plan, bad, multiplier)


def _multiplied(s, multiplier):
    """Capped logits [..., bq, n] times their query's logit multiplier [..., bq] (or None)."""
    return s if multiplier is None else s * multiplier[..., None]


@first_derivatives_only("xla", forward_over_reverse=True)
def _forward(static: _Static, qu, kb, vb, own_kv, seg_qu, seg_kb, pos_kb, plan: _Units,
             bad: _Bad, multiplier):
    """A row that sees a key flagged in ``bad.key`` / ``bad.own``, or that is flagged in
    ``bad.q`` and sees anything, ends with l = NaN, so its out and lse are NaN
    (rankattn.semantics). Partial blocks set flagged keys' logits to NaN under the mask; in
    a full block every row sees every key, so one flag per unit and kv head suffices
    (setting every logit there measured 5-6% slower on nano-fwd)."""
    def chunk(_, xs):
        q, own, seg_q, units, q_bad, own_bad, mult = xs
        rows, acc_dtype = q.shape[:-1], static.accumulate  # rows: [C, Hkv, G, bq]
        carry = (jnp.full(rows, -jnp.inf, acc_dtype), jnp.zeros(rows, acc_dtype),
                 jnp.zeros(rows + vb.shape[-1:], acc_dtype), jnp.zeros(rows[:2], bool))
        for masked, start, count in _loops(units):
            def body(t, carry, masked=masked, start=start, count=count):
                m, l, acc, seen_bad = carry
                vis = _visit(static, masked, t, start, count, q, kb, vb, seg_q, seg_kb, pos_kb,
                             units)
                s = _multiplied(static.cap(vis.logits), mult)
                key_bad = bad.key[vis.index]
                if masked:
                    s = jnp.where(vis.mask, jnp.where(key_bad[:, :, None, None, :], jnp.nan, s),
                                  -jnp.inf)
                else:
                    seen_bad |= vis.valid[:, None] & key_bad.any(-1)
                m_new = jnp.maximum(m, s.max(-1))
                shift = jnp.where(jnp.isfinite(m_new), m_new, 0)
                p = jnp.exp(s - shift[..., None])
                alpha = jnp.exp(m - shift)
                l_new = l * alpha + p.sum(-1)
                acc_new = acc * alpha[..., None] + _block_dot(static, "chrk,chkd->chrd", p, vis.v)
                if masked:  # invalid steps are already fully masked
                    return m_new, l_new, acc_new, seen_bad
                # A full-block step past this unit's list must change nothing.
                ok = _row(vis.valid)
                return (jnp.where(ok, m_new, m), jnp.where(ok, l_new, l),
                        jnp.where(ok[..., None], acc_new, acc), seen_bad)

            carry = jax.lax.fori_loop(0, count.max(), body, carry)
        m, l, acc, seen_bad = carry
        l = jnp.where(seen_bad[:, :, None, None], jnp.nan, l)

        if own is not None:  # the own-key logit joins the softmax
            s_own, _, is_cand = _own_logits(static, q, own, seg_q)
            s_own = _multiplied(s_own[..., None], mult)[..., 0]
            s_own = jnp.where(own_bad[:, :, None], jnp.nan, s_own)
            m_new = jnp.where(is_cand, jnp.maximum(m, s_own), m)
            shift = jnp.where(jnp.isfinite(m_new), m_new, 0)
            p_own = jnp.where(is_cand, jnp.exp(s_own - shift), 0)
            alpha = jnp.exp(m - shift)
            l = l * alpha + p_own
            acc = acc * alpha[..., None] + p_own[..., None] * own[1][:, :, None].astype(acc_dtype)
            m = m_new

        # A non-finite query poisons its row if it saw any key: checked after the own key, as
        # a candidate with no history sees that one only.
        l = jnp.where(q_bad & (l != 0), jnp.nan, l)
        seen = l != 0  # NaN (a poisoned row) counts as seen
        out = acc / jnp.where(seen, l, 1)[..., None]
        lse = jnp.where(seen, m + jnp.log(jnp.where(seen, l, 1)), -jnp.inf)
        return None, (out, lse)

    xs = (qu, own_kv, seg_qu, plan, bad.q, bad.own, multiplier)
    _, result = jax.lax.scan(chunk, None, _chunks(static, xs))
    return _unchunk(result)


def _flash_fwd(static, qu, kb, vb, own_kv, seg_qu, seg_kb, pos_kb, plan, bad, multiplier):
    out, lse = _forward(static, qu, kb, vb, own_kv, seg_qu, seg_kb, pos_kb, plan, bad,
                        multiplier)
    return (out, lse), (qu, kb, vb, own_kv, seg_qu, seg_kb, pos_kb, plan, out, lse, multiplier)


@first_derivatives_only("xla", forward_over_reverse=True)
def _flash_bwd(static, residuals, cotangents):
    qu, kb, vb, own_kv, seg_qu, seg_kb, pos_kb, plan, out, lse, multiplier = residuals
    d_out, d_lse = cotangents
    acc_dtype = static.accumulate
    # Rows that pass no gradient get lse +inf: every p is 0.
    lse, d_out, delta = semantics.backward_rows(out, d_out, lse, d_lse)

    def chunk(carry, xs):
        dk, dv = carry
        q, own, seg_q, units, d_o, dlt, lse_c, mult = xs
        dq = jnp.zeros(q.shape, acc_dtype)
        for masked, start, count in _loops(units):
            def body(t, grads, masked=masked, start=start, count=count):
                dq, dk, dv = grads
                vis = _visit(static, masked, t, start, count, q, kb, vb, seg_q, seg_kb, pos_kb,
                             units)
                mask = vis.mask if masked else _row(vis.valid)[..., None]
                s = _multiplied(static.cap(vis.logits), mult)
                p = jnp.where(mask, jnp.exp(s - lse_c[..., None]), 0)
                dp = _block_dot(static, "chrd,chkd->chrk", d_o, vis.v)
                ds = _multiplied(p * (dp - dlt[..., None]) * static.cap_grad(vis.logits), mult)
                ds = static.scaled(ds)
                dq = dq + _block_dot(static, "chrk,chkd->chrd", ds, vis.k)
                dk = dk.at[vis.index].add(_block_dot(static, "chrk,chrd->chkd", ds, q))
                dv = dv.at[vis.index].add(_block_dot(static, "chrk,chrd->chkd", p, d_o))
                return dq, dk, dv

            dq, dk, dv = jax.lax.fori_loop(0, count.max(), body, (dq, dk, dv))

        d_own = None
        if own is not None:
            s_own, raw, is_cand = _own_logits(static, q, own, seg_q)
            p_own = jnp.where(is_cand, jnp.exp(_multiplied(s_own[..., None], mult)[..., 0]
                                               - lse_c), 0)
            own_k, own_v = (x[:, :, None].astype(acc_dtype) for x in own)
            dp_own = (d_o.astype(acc_dtype) * own_v).sum(-1)
            ds_own = p_own * (dp_own - dlt) * static.cap_grad(raw)
            ds_own = static.scaled(_multiplied(ds_own[..., None], mult)[..., 0])
            dq = dq + ds_own[..., None] * own_k
            d_own = ((ds_own[..., None] * q.astype(acc_dtype)).sum(2),
                     (p_own[..., None] * d_o.astype(acc_dtype)).sum(2))
        return (dk, dv), (dq, d_own)

    xs = _chunks(static, (qu, own_kv, seg_qu, plan, d_out, delta, lse, multiplier))
    (dk, dv), (dq, d_own) = jax.lax.scan(chunk, _key_grad_accumulators(static, kb, vb), xs)
    # Cotangents in the primal dtypes (bf16 / f16 operands on the mixed-precision path).
    like = lambda grads, primals: jax.tree.map(lambda g, x: g.astype(x.dtype), grads, primals)
    return (like(_unchunk(dq), qu), like(dk, kb), like(dv, vb), like(_unchunk(d_own), own_kv),
            None, None, None, None, None, None)


def _key_grad_accumulators(static: _Static, kb, vb):
    """Zero dk, dv in the accumulation dtype: every query block adds into them, so in bf16
    (the operands' dtype on the mixed-precision path) each addition would round."""
    return jnp.zeros(kb.shape, static.accumulate), jnp.zeros(vb.shape, static.accumulate)


_flash.defvjp(_flash_fwd, _flash_bwd)


class Xla(Backend):
    """The blocked backend in plain JAX, for any platform.

    ``block_sizes``: None (default) chooses them per shape (DEFAULT_BLOCK_SIZES,
    one query block for short queries: see plan_sizes); ``Xla(BlockSizes(64, 64))``
    fixes them. ``mixed_precision``:
    None (default) feeds bf16 / f16 operands to the dots as they are, with
    float32 accumulation, except f16 on CPU, which it up-casts. Measured on the
    2-core CI CPU (Xeon with AMX, jax 0.10.2; interleaved medians, up-cast time /
    mixed time): bf16 1.50x nano-fwd, 1.32x nano-fwdbwd, 1.23x / 1.21x at the
    short call; f16 0.95x and 0.85x. True or False forces either path (True on
    CPU is how the tests check the GPU / TPU numerics). ``step_logits_bytes``: the logits one scan
    step may hold (query blocks are processed that many at a time); None
    (default) chooses it per shape, see UNITS_PER_STEP_GQA.
    """

    name = "xla"
    takes_shard_mask = True

    def __init__(self, block_sizes: BlockSizes | None = None, *positional,
                 mixed_precision: bool | None = None, step_logits_bytes: int | None = None):
        if positional:
            raise fail("RA125", f"Xla got {len(positional) + 1} positional arguments; only "
                                "block_sizes is positional, its options are keyword-only, as "
                                "every backend's: Xla(block_sizes, mixed_precision=..., "
                                "step_logits_bytes=...).")
        self.block_sizes = check_block_sizes(block_sizes)
        self.mixed_precision = check_optional_bool("Xla mixed_precision", mixed_precision)
        if step_logits_bytes is not None and not is_positive_int(step_logits_bytes):
            raise fail("RA116", f"Xla step_logits_bytes={step_logits_bytes!r}; pass None (chosen "
                                "per shape) or a positive int of bytes, e.g. 16 << 20.")
        self.step_logits_bytes = step_logits_bytes

    def plan_sizes(self, seq_len: int) -> tuple[BlockSizes, ...]:
        return (plan_sizes(self.block_sizes, seq_len, seq_len),)

    def __call__(self, call: AttentionCall):
        blocks = None
        if call.plan is not None:
            seq_len = call.q.shape[1]
            blocks = call.plan.block_plan(plan_sizes(self.block_sizes, seq_len, seq_len))
        mixed = self.mixed_precision
        if mixed is None:
            mixed = jax.default_backend() != "cpu" or call.q.dtype == jnp.bfloat16
        return flash_attention(call.q, call.k, call.v, call.segment_ids, causal=call.causal,
                               scale=call.scale, softcap=call.softcap,
                               softcap_method=call.softcap_method, block_sizes=self.block_sizes,
                               block_plan=blocks, mixed_precision=mixed,
                               step_logits_bytes=self.step_logits_bytes,
                               shard_mask=call.shard_mask,
                               logit_multiplier=call.logit_multiplier)

    def __repr__(self) -> str:
        return (f"<rankattn backend 'xla' {self.block_sizes or 'blocks per shape'}"
                f"{'' if self.mixed_precision is None else f' mixed_precision={self.mixed_precision}'}>")
