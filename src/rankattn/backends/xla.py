"""Blocked flash attention in plain JAX/XLA, with a custom VJP. Runs on any backend.

How it works:

1. Fix up shapes in Python: pad the sequence to a multiple of the block sizes
   (padding gets segment id 0, so it is invisible) and split heads into
   (kv head, group) so GQA never repeats K/V.
2. Plan: from the segment ids (traced values welcome) decide for every
   (query block, key block) pair whether any query can see any key
   (:func:`rankattn.semantics.block_visibility`), and list, per query block,
   the key blocks to visit, visited ones first.
3. Forward: all query blocks advance together through their lists, one key
   block per step, with an online softmax; the loop runs as many steps as the
   longest list, so packed rows cost their sessions' blocks, not S^2.
4. Backward: the same plan and the saved log-sum-exp; dq accumulates in
   place, dk/dv scatter-add into the visited key blocks. No S x S tensor is
   ever formed, forward or backward.
"""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp

from rankattn import semantics
from rankattn.backends.base import Backend, compute_dtype
from rankattn.validate import AttentionCall


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Query and key block lengths."""

    block_q: int = 128
    block_k: int = 128

    def __post_init__(self):
        for name in ("block_q", "block_k"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                from rankattn.errors import fail
                raise fail("RA116", f"BlockSizes.{name} must be a positive int; got {value!r}.")

    def for_lengths(self, q_len: int, kv_len: int) -> BlockSizes:
        """Blocks no longer than the sequences (rounded up to 8), so short calls pad little."""
        return BlockSizes(min(self.block_q, -(-q_len // 8) * 8), min(self.block_k, -(-kv_len // 8) * 8))


class BlockPlan(NamedTuple):
    """Which key blocks each query block visits. A pytree of int32 arrays."""

    kv_index: jax.Array  # [B, nQ, nK]: visited key blocks first, ascending
    kv_count: jax.Array  # [B, nQ]: how many leading entries of kv_index are visited


@dataclasses.dataclass(frozen=True)
class _Static:
    """Everything that selects the compiled program."""

    causal: bool
    scale: float
    softcap: float | None
    softcap_method: str
    block_q: int
    block_k: int


def make_plan(seg_q, seg_k, block_q: int, block_k: int, causal: bool) -> BlockPlan:
    """Plan for query / key segment ids [B, Sq], [B, Skv], padded to their block sizes."""
    nonempty, _ = semantics.block_visibility(seg_q, seg_k, block_q, block_k, causal)
    order = jnp.argsort(~nonempty, axis=-1, stable=True).astype(jnp.int32)
    return BlockPlan(kv_index=order, kv_count=nonempty.sum(-1, dtype=jnp.int32))


def flash_attention(q, k, v, segment_ids, *, causal: bool, scale: float, softcap: float | None,
                    softcap_method: str, block_sizes: BlockSizes = BlockSizes()):
    """Blocked attention; arguments and results as :func:`rankattn.attention` (checked).

    Without segment ids every token is history of one session; q and k may then
    differ in length (plain cross-attention).
    """
    b, sq, hq, _ = q.shape
    skv, hkv = k.shape[1], k.shape[2]
    sizes = block_sizes.for_lengths(sq, skv)
    if segment_ids is None:
        seg_q, seg_k = jnp.ones((b, sq), jnp.int32), jnp.ones((b, skv), jnp.int32)
    else:
        seg_q = seg_k = segment_ids.astype(jnp.int32)
    seg_q, seg_k = _pad(seg_q, sizes.block_q), _pad(seg_k, sizes.block_k)

    dtype = compute_dtype(q.dtype)
    plan = make_plan(seg_q, seg_k, sizes.block_q, sizes.block_k, causal)
    static = _Static(causal, scale, softcap, softcap_method, sizes.block_q, sizes.block_k)
    qb = _query_blocks(_pad(q.astype(dtype), sizes.block_q), hkv, sizes.block_q)
    kb = _key_blocks(_pad(k.astype(dtype), sizes.block_k), sizes.block_k)
    vb = _key_blocks(_pad(v.astype(dtype), sizes.block_k), sizes.block_k)
    out, lse = _flash(static, qb, kb, vb, seg_q, seg_k, plan)
    # [B, nQ, Hkv, G, bq, Dv] -> [B, Sq, Hq, Dv];  [B, nQ, Hkv, G, bq] -> [B, Hq, Sq]
    padded = seg_q.shape[1]
    out = out.transpose(0, 1, 4, 2, 3, 5).reshape(b, padded, hq, -1)[:, :sq]
    lse = lse.transpose(0, 2, 3, 1, 4).reshape(b, hq, padded)[:, :, :sq]
    return out.astype(q.dtype), lse.astype(jnp.float32)


def _pad(x, block: int):
    """Zero-pad axis 1 to a multiple of ``block``; zero segment ids are invisible padding."""
    extra = -x.shape[1] % block
    return jnp.pad(x, [(0, 0), (0, extra)] + [(0, 0)] * (x.ndim - 2))


def _query_blocks(q, hkv: int, block: int):
    """[B, S, Hq, D] -> [B, nQ, Hkv, G, bq, D]; query head h = kv_head * G + g."""
    b, s, hq, d = q.shape
    return q.reshape(b, s // block, block, hkv, hq // hkv, d).transpose(0, 1, 3, 4, 2, 5)


def _key_blocks(x, block: int):
    """[B, S, Hkv, D] -> [B, nK, Hkv, bk, D]."""
    b, s, h, d = x.shape
    return x.reshape(b, s // block, block, h, d).transpose(0, 1, 3, 2, 4)


def _gather(blocks, index):
    """blocks [B, nK, ...], index [B, nQ] -> [B, nQ, ...]."""
    return jax.vmap(lambda x, i: x[i])(blocks, index)


class _Step(NamedTuple):
    """One key block per query block: what both passes need at step t."""

    index: jax.Array   # [B, nQ] key block visited
    k: jax.Array       # [B, nQ, Hkv, bk, D]
    v: jax.Array       # [B, nQ, Hkv, bk, Dv]
    mask: jax.Array    # [B, nQ, 1, 1, bq, bk]
    logits: jax.Array  # [B, nQ, Hkv, G, bq, bk], before the cap


def _step(static: _Static, t, qb, kb, vb, seg_q, seg_k, plan: BlockPlan) -> _Step:
    b, n_q = plan.kv_count.shape
    index = jax.lax.dynamic_index_in_dim(plan.kv_index, t, axis=2, keepdims=False)
    k_t, v_t = _gather(kb, index), _gather(vb, index)
    seg_q = seg_q.reshape(b, n_q, static.block_q)
    seg_k = _gather(seg_k.reshape(b, -1, static.block_k), index)
    pos_q = (jnp.arange(n_q) * static.block_q)[None, :, None] + jnp.arange(static.block_q)
    pos_k = index[..., None] * static.block_k + jnp.arange(static.block_k)
    mask = semantics.visible(seg_q[..., :, None], seg_k[..., None, :],
                             pos_q[..., :, None], pos_k[..., None, :], static.causal)
    mask &= (t < plan.kv_count)[..., None, None]
    logits = jnp.einsum("bnhgqd,bnhkd->bnhgqk", qb, k_t, precision="highest") * static.scale
    return _Step(index, k_t, v_t, mask[:, :, None, None], logits)


@partial(jax.custom_vjp, nondiff_argnums=(0,))
def _flash(static: _Static, qb, kb, vb, seg_q, seg_k, plan: BlockPlan):
    return _forward(static, qb, kb, vb, seg_q, seg_k, plan)


def _forward(static: _Static, qb, kb, vb, seg_q, seg_k, plan: BlockPlan):
    rows = qb.shape[:-1]  # [B, nQ, Hkv, G, bq]

    def body(t, carry):
        m, l, acc = carry
        st = _step(static, t, qb, kb, vb, seg_q, seg_k, plan)
        s = semantics.softcap(st.logits, static.softcap, static.softcap_method)
        m_new = jnp.maximum(m, jnp.where(st.mask, s, -jnp.inf).max(-1))
        shift = jnp.where(jnp.isfinite(m_new), m_new, 0)
        p = jnp.where(st.mask, jnp.exp(s - shift[..., None]), 0)
        alpha = jnp.exp(m - shift)
        acc = acc * alpha[..., None] + jnp.einsum("bnhgqk,bnhkd->bnhgqd", p, st.v,
                                                  precision="highest")
        return m_new, l * alpha + p.sum(-1), acc

    init = (jnp.full(rows, -jnp.inf, qb.dtype), jnp.zeros(rows, qb.dtype),
            jnp.zeros(rows + vb.shape[-1:], qb.dtype))
    m, l, acc = jax.lax.fori_loop(0, plan.kv_count.max(), body, init)
    seen = l > 0
    out = acc / jnp.where(seen, l, 1)[..., None]
    lse = jnp.where(seen, m + jnp.log(jnp.where(seen, l, 1)), -jnp.inf)
    return out, lse


def _flash_fwd(static, qb, kb, vb, seg_q, seg_k, plan):
    out, lse = _forward(static, qb, kb, vb, seg_q, seg_k, plan)
    return (out, lse), (qb, kb, vb, seg_q, seg_k, plan, out, lse)


def _flash_bwd(static, residuals, cotangents):
    qb, kb, vb, seg_q, seg_k, plan, out, lse = residuals
    d_out, d_lse = cotangents
    # d lse / d s = P, so an lse cotangent enters exactly like -delta does.
    delta = (d_out * out).sum(-1) - d_lse
    lse_safe = jnp.where(jnp.isfinite(lse), lse, 0)
    batch = jnp.arange(qb.shape[0])[:, None]

    def body(t, carry):
        dq, dk, dv = carry
        st = _step(static, t, qb, kb, vb, seg_q, seg_k, plan)
        s = semantics.softcap(st.logits, static.softcap, static.softcap_method)
        p = jnp.where(st.mask, jnp.exp(s - lse_safe[..., None]), 0)
        dv_t = jnp.einsum("bnhgqk,bnhgqd->bnhkd", p, d_out, precision="highest")
        dp = jnp.einsum("bnhgqd,bnhkd->bnhgqk", d_out, st.v, precision="highest")
        ds = p * (dp - delta[..., None])
        ds = ds * semantics.softcap_grad(st.logits, static.softcap, static.softcap_method)
        ds = ds * static.scale
        dq = dq + jnp.einsum("bnhgqk,bnhkd->bnhgqd", ds, st.k, precision="highest")
        dk_t = jnp.einsum("bnhgqk,bnhgqd->bnhkd", ds, qb, precision="highest")
        return dq, dk.at[batch, st.index].add(dk_t), dv.at[batch, st.index].add(dv_t)

    init = (jnp.zeros_like(qb), jnp.zeros_like(kb), jnp.zeros_like(vb))
    dq, dk, dv = jax.lax.fori_loop(0, plan.kv_count.max(), body, init)
    return dq, dk, dv, None, None, None


_flash.defvjp(_flash_fwd, _flash_bwd)


class Xla(Backend):
    """The blocked backend; ``Xla(BlockSizes(64, 64))`` picks other block sizes."""

    name = "xla"

    def __init__(self, block_sizes: BlockSizes = BlockSizes()):
        self.block_sizes = block_sizes

    def __call__(self, call: AttentionCall):
        return flash_attention(call.q, call.k, call.v, call.segment_ids, causal=call.causal,
                               scale=call.scale, softcap=call.softcap,
                               softcap_method=call.softcap_method, block_sizes=self.block_sizes)

    def __repr__(self) -> str:
        return f"<rankattn backend 'xla' {self.block_sizes}>"
