"""The fused CPU backend: blocked attention in C++ (``cpu_attention.cc``) through ``jax.ffi``.

This module owns what the C++ side does not: the block plan, the custom VJP,
the per-row terms of the backward (:func:`rankattn.semantics.backward_rows`), and
which calls the kernel takes. The kernel reads q, k, v as they are ([B, S, H, D],
float32 / bfloat16 / float16, any S and D, no padding or layout copies), does
the dots, mask, exp and online softmax of one (batch row, kv head, query block)
in cache, with every query head of the kv head's group in one block (GQA never
repeats K/V), and threads over those blocks on XLA's CPU thread pool. The math is
float32; bf16 inputs run their dots in bf16 (AMX tiles, or AVX-512 BF16), with p
and ds rounded to bf16 before theirs, and every other dot is float32. The
backward is key-major: one task per (batch row, kv head) runs its key blocks in
order, accumulating dk / dv over the query blocks that see each and adding dq as
it goes; or, where those tasks do not fill the threads (not a multiple of them, and
fewer than 8 per thread), one task per key block keeps dS^T, from which one task per
query block sums its dq. Nothing is added
atomically, and results are bit-identical for either pass and any thread count.

For serving (:mod:`rankattn.serving.scoring`) the same forward reads K / V from the
cache's pages through a page table, with each candidate's own key from separate
arrays (:func:`paged_forward`; exact scoring's mask built by the kernel from the
histories' lengths, :func:`paged_candidates_forward`), and :func:`page_bounds` computes
Quest's page bounds.

It is compiled on first use for the host CPU (:mod:`rankattn.native`); where
that is impossible, ``impl='auto'`` falls back to ``xla`` and
``not_supported_reasons`` says why.
"""

from __future__ import annotations

import dataclasses
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from rankattn import native, semantics
from rankattn.backends.base import Backend, first_derivatives_only
from rankattn.blocks import BlockPlan, BlockSizes, check_block_sizes, segments_and_plan
from rankattn.errors import fail
from rankattn.validate import AttentionCall

LIBRARY = "cpu_attention"
SYMBOLS = ("RankattnCpuForward", "RankattnCpuPagedForward", "RankattnCpuPagedCandidatesForward",
           "RankattnCpuBackward", "RankattnCpuPageBounds")
SUPPORTED_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)
DEFAULT_BLOCK_SIZES = BlockSizes(64, 256)
# A plan skips whole key blocks only, so keys that fit one default block were computed densely
# whatever the mask: 2 x (128 history + 64 candidates) spent a third of its forward on the
# candidates' keys, which no query reads from the blocks. The default key block halves, down
# to this, while it holds every key: 0.93 -> 0.67 ms forward and 3.5 -> 2.7 ms fwd+bwd there
# (benchmarks/CPU_KERNEL.md). Halving further measured 3% slower at 320 keys, whose
# history the blocks of 256 already split from its candidates.
SMALLEST_DEFAULT_KEY_BLOCK = 64


def plan_sizes(sizes: BlockSizes | None, q_len: int, kv_len: int) -> BlockSizes:
    """Blocks no longer than the sequences. Nothing is padded: the last block may be ragged.

    ``None`` means the defaults for this shape: DEFAULT_BLOCK_SIZES, the key block halved
    (not below SMALLEST_DEFAULT_KEY_BLOCK) while it holds all ``kv_len`` keys.
    """
    if sizes is None:
        block_k = DEFAULT_BLOCK_SIZES.block_k
        while block_k > SMALLEST_DEFAULT_KEY_BLOCK and block_k >= kv_len:
            block_k //= 2
        sizes = BlockSizes(DEFAULT_BLOCK_SIZES.block_q, block_k)
    return BlockSizes(min(sizes.block_q, q_len), min(sizes.block_k, kv_len))


@dataclasses.dataclass(frozen=True)
class _Static:
    """The kernel's attributes: everything that selects the compiled program."""

    scale: float
    softcap: float | None
    soft_sign: bool
    causal: bool
    own: bool  # add each candidate's own key (a whole sequence, or serving's self keys)
    sizes: BlockSizes

    def attributes(self) -> dict:
        return dict(scale=np.float32(self.scale), softcap=np.float32(self.softcap or 0.0),
                    soft_sign=self.soft_sign, causal=self.causal, own=self.own,
                    block_q=np.int64(self.sizes.block_q), block_k=np.int64(self.sizes.block_k))


def fused_attention(q, k, v, segment_ids, *, causal: bool, scale: float, softcap: float | None,
                    softcap_method: str, block_sizes: BlockSizes | None = None,
                    block_plan: BlockPlan | None = None,
                    shard_mask: semantics.ShardMask | None = None, logit_multiplier=None):
    """The ``cpu`` kernel; arguments and results as :func:`rankattn.attention` (checked;
    ``logit_multiplier`` float32 [B, Sq, Hq], finite, or None).

    ``block_plan``: :func:`rankattn.blocks.make_block_plan` of these segment ids at
    ``plan_sizes(block_sizes, ...)``, made here when not given. ``shard_mask``: the
    call is one shard of a longer sequence (history part only, see
    :class:`rankattn.semantics.ShardMask`).
    """
    static, mask, block_plan = _prepare(q.shape, k.shape[1], segment_ids, causal, scale, softcap,
                                        softcap_method, block_sizes, block_plan, shard_mask,
                                        logit_multiplier,
                                        own=segment_ids is not None and shard_mask is None)
    return _fused(static, q, k, v, mask, block_plan)


def paged_forward(q, k_pages, v_pages, page_table, self_kv, segment_ids, *, shard_mask,
                  scale: float, softcap: float | None, softcap_method: str,
                  block_sizes: BlockSizes | None = None):
    """Serving's scoring on the ``cpu`` kernel, reading the cache's pages in place.

    q [B, T, Hq, D]; k_pages / v_pages [N, Hkv, P, D / Dv] (q's dtype; [N, P, D / Dv]: one
    kv head), Hq a multiple of Hkv; page_table int32 [B, M]: row b's keys are its M pages in
    order (S = M * P tokens), every kv head of them (entries outside [0, N) read a clamped
    page, so mask them). ``segment_ids`` [B, T] and ``shard_mask`` (keys [B, S]) as
    :func:`fused_attention`'s; ``self_kv``: None, or (k_self, v_self) [B, T, Hkv, D / Dv],
    each query's own key, seen by the candidates (segment id < 0).
    Returns (out [B, T, Hq, Dv], lse [B, Hq, T] float32). Forward only (no VJP: the
    caller's custom VJP differentiates an equivalent contiguous call).
    """
    s = page_table.shape[1] * k_pages.shape[-2]
    static, mask, block_plan = _prepare(q.shape, s, segment_ids, False, scale, softcap,
                                        softcap_method, block_sizes, None, shard_mask,
                                        None, own=self_kv is not None)
    return _paged_call("rankattn_cpu_paged_forward", q, v_pages)(
        q, k_pages, v_pages, page_table.astype(jnp.int32), *_self_keys(q, self_kv), *mask,
        block_plan.kv_index, block_plan.full_count, block_plan.count, **static.attributes())


def paged_candidates_forward(q, k_pages, v_pages, page_table, self_kv, lengths, *,
                             scale: float, softcap: float | None, softcap_method: str,
                             block_sizes: BlockSizes | None = None):
    """Serving's exact scoring on the ``cpu`` kernel: :func:`paged_forward` where every query
    of row b is a candidate that sees keys [0, lengths[b]) of its row (int32 [B], clamped to
    [0, S]) and its own key (``self_kv``), the kernel building that mask and its block plan
    from the lengths. The call's XLA program is then this kernel alone (and what gathers its
    operands), which XLA runs on the calling thread (see the kernel's CandidatesMask).
    Returns (out [B, T, Hq, Dv], lse [B, Hq, T] float32)."""
    t = q.shape[1]
    s = page_table.shape[1] * k_pages.shape[-2]
    static = _Static(float(scale), softcap, softcap_method == "soft_sign", False,
                     self_kv is not None, plan_sizes(block_sizes, t, s))
    return _paged_call("rankattn_cpu_paged_candidates_forward", q, v_pages)(
        q, k_pages, v_pages, page_table.astype(jnp.int32), *_self_keys(q, self_kv),
        jnp.asarray(lengths, jnp.int32), **static.attributes())


def _self_keys(q, self_kv):
    """(k_self, v_self), or placeholders that the kernel ignores without an own key."""
    return self_kv or (jnp.zeros((1, 1, 1, 1), q.dtype),) * 2


def _paged_call(target: str, q, v_pages):
    """The FFI call of a paged entry: (out [B, T, Hq, Dv] in q's dtype, lse [B, Hq, T])."""
    b, t, hq = q.shape[:3]
    shapes = (jax.ShapeDtypeStruct((b, t, hq, v_pages.shape[-1]), q.dtype),
              jax.ShapeDtypeStruct((b, hq, t), jnp.float32))
    return jax.ffi.ffi_call(target, shapes, vmap_method="sequential")


def page_bounds(q, k_max, k_min, page_table, npages):
    """Quest's page bounds on the kernel: float32 q [B, Hkv, R, D] (already scaled), page stats
    k_max / k_min [N, Hkv, D] (float32), page_table int32 [B, M], npages int32 [B]. Returns
    (bounds [B, Hkv, R, M] float32: max(q, 0) . M_j + min(q, 0) . m_j of page j, -inf for
    j >= npages; bad [B, Hkv, M] int32: 1 where a real page's stats are not all finite, those
    stats counted as 0 in its bound)."""
    b, h, r, _ = q.shape
    m = page_table.shape[1]
    shapes = (jax.ShapeDtypeStruct((b, h, r, m), jnp.float32),
              jax.ShapeDtypeStruct((b, h, m), jnp.int32))
    call = jax.ffi.ffi_call("rankattn_cpu_page_bounds", shapes, vmap_method="sequential")
    return call(q, k_max, k_min, page_table.astype(jnp.int32), npages.astype(jnp.int32))


def _prepare(q_shape, skv: int, segment_ids, causal: bool, scale: float, softcap, softcap_method,
             block_sizes, block_plan, shard_mask, logit_multiplier, *, own: bool):
    """(the kernel's attributes, its per-token arrays (logit multiplier [B, Sq, Hq] or empty,
    seg_q, seg_k, pos_q, pos_k), block plan)."""
    b, sq = q_shape[:2]
    sizes = plan_sizes(block_sizes, sq, skv)
    seg_q, seg_k, block_plan = segments_and_plan(segment_ids, b, sq, skv, sizes, causal,
                                                 block_plan, shard_mask)
    if shard_mask is None:
        pos_q = jnp.broadcast_to(jnp.arange(sq, dtype=jnp.int32), (b, sq))
        pos_k = jnp.broadcast_to(jnp.arange(skv, dtype=jnp.int32), (b, skv))
    else:
        pos_q = jnp.asarray(shard_mask.q_positions, jnp.int32)
        pos_k = jnp.asarray(shard_mask.kv_positions, jnp.int32)
    static = _Static(float(scale), softcap, softcap_method == "soft_sign", causal, own, sizes)
    multiplier = jnp.zeros((0,), jnp.float32) if logit_multiplier is None else logit_multiplier
    return static, (multiplier, seg_q[:, :sq], seg_k[:, :skv], pos_q, pos_k), block_plan


@partial(jax.custom_vjp, nondiff_argnums=(0,))
def _fused(static: _Static, q, k, v, mask, block_plan: BlockPlan):
    return _forward(static, q, k, v, mask, block_plan)


@first_derivatives_only("cpu")
def _forward(static: _Static, q, k, v, mask, block_plan: BlockPlan):
    b, sq, hq, _ = q.shape
    shapes = (jax.ShapeDtypeStruct((b, sq, hq, v.shape[-1]), q.dtype),
              jax.ShapeDtypeStruct((b, hq, sq), jnp.float32))
    call = jax.ffi.ffi_call("rankattn_cpu_forward", shapes, vmap_method="sequential")
    return call(q, k, v, *mask, block_plan.kv_index, block_plan.full_count, block_plan.count,
                **static.attributes())


def _fused_fwd(static: _Static, q, k, v, mask, block_plan: BlockPlan):
    out, lse = _forward(static, q, k, v, mask, block_plan)
    return (out, lse), (q, k, v, mask, block_plan, out, lse)


@first_derivatives_only("cpu")
def _fused_bwd(static: _Static, residuals, cotangents):
    q, k, v, mask, block_plan, out, lse = residuals
    d_out, d_lse = cotangents
    # Per query row, [B, Sq, Hq]: rows that pass no gradient (poisoned, or seeing nothing) get
    # lse +inf (every p is 0), d_out and delta 0.
    lse_rows, d_out, delta = semantics.backward_rows(out, d_out, lse.transpose(0, 2, 1),
                                                     d_lse.transpose(0, 2, 1))
    shapes = tuple(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (q, k, v))
    call = jax.ffi.ffi_call("rankattn_cpu_backward", shapes, vmap_method="sequential")
    dq, dk, dv = call(q, k, v, d_out.astype(q.dtype), lse_rows.astype(jnp.float32),
                      delta.astype(jnp.float32), *mask, block_plan.kv_index,
                      block_plan.full_count, block_plan.count, block_plan.q_index,
                      block_plan.q_full_count, block_plan.q_count, **static.attributes())
    return dq, dk, dv, None, None


_fused.defvjp(_fused_fwd, _fused_bwd)


def library() -> native.Library:
    """The compiled kernel (built on first use), with its FFI targets registered."""
    return native.register(LIBRARY, SYMBOLS)


class Cpu(Backend):
    """The fused C++ kernel for CPUs (x86 with AVX-512 or AVX2, ARM, anything g++ targets).

    ``block_sizes``: None (default) gives DEFAULT_BLOCK_SIZES, with shorter key blocks
    for short sequences (see plan_sizes); ``Cpu(BlockSizes(16, 8))`` fixes them (any
    positive sizes: the last block of a row may be ragged).
    """

    name = "cpu"
    takes_shard_mask = True

    def __init__(self, block_sizes: BlockSizes | None = None):
        self.block_sizes = check_block_sizes(block_sizes)

    def platform_reasons(self) -> list[str]:
        if jax.default_backend() != "cpu":
            return [f"cpu: the fused kernel runs on CPU, and JAX's default backend here is "
                    f"{jax.default_backend()!r}"]
        return self._library_reasons()

    def not_supported_reasons(self, call: AttentionCall) -> list[str]:
        if not any(call.q.dtype == d for d in SUPPORTED_DTYPES):
            return [f"cpu: inputs are {call.q.dtype}; the fused kernel takes float32, bfloat16 "
                    "or float16 (use impl='xla' for float64)"]
        return self._library_reasons()

    @staticmethod
    def _library_reasons() -> list[str]:
        return [f"cpu: {why}; impl='auto' uses 'xla' instead" for why in library().reasons]

    def plan_sizes(self, seq_len: int) -> tuple[BlockSizes, ...]:
        return (plan_sizes(self.block_sizes, seq_len, seq_len),)

    def __call__(self, call: AttentionCall):
        why = self._library_reasons()
        if why:
            raise fail("RA115", "impl=Cpu() cannot run this call:\n    - " + "\n    - ".join(why))
        blocks = None
        if call.plan is not None:
            seq_len = call.q.shape[1]
            blocks = call.plan.block_plan(plan_sizes(self.block_sizes, seq_len, seq_len))
        return fused_attention(call.q, call.k, call.v, call.segment_ids, causal=call.causal,
                               scale=call.scale, softcap=call.softcap,
                               softcap_method=call.softcap_method, block_sizes=self.block_sizes,
                               block_plan=blocks, shard_mask=call.shard_mask,
                               logit_multiplier=call.logit_multiplier)

    def __repr__(self) -> str:
        return f"<rankattn backend 'cpu' {self.block_sizes or 'default blocks'}>"
