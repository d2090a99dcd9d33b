"""Block-sparse flash attention as Pallas kernels on the Triton lowering (GPUs, sm80 and newer).

Three kernels, each one program per block:

* forward, grid (query block, batch, query head): the online softmax over the
  key blocks of the plan's list for this query block, full blocks first (no
  mask arithmetic), then partial ones; then the candidates' own-key logit.
* dq, grid (query block, batch, query head): the same lists, recomputing p
  from the saved log-sum-exp.
* dk / dv, grid (key block, batch, kv head): the transposed lists (the query
  blocks that see this key block), looping over the G query heads of the
  group inside the program, so dk and dv are written once per kv head with
  no atomics and no per-query-head copies.

Lists come from :mod:`rankattn.blocks` (the same plan the ``xla`` backend
reads), as int32 inputs read inside loops whose trip counts are data. The
mask inside partial blocks is :func:`rankattn.semantics.sees_history`; a
candidate's own key is one extra logit per row, so candidate-candidate blocks
are never visited.

Numerics: bf16 / f16 operands feed the dots with float32 accumulation
(tensor cores); float32 operands use exact float32 dots ("ieee", not tf32)
unless ``PallasTriton(precision=...)`` opts into tensor cores (F32_DOTS).
Logits are scaled and capped in float32, the softmax runs in base 2 with
log2(e) folded into the scale, p is cast to the value dtype for the PV product
and ds to the query / key dtype for the dq / dk products. Rows that see no
key get out 0, lse -inf and zero gradients: the running maximum is guarded
and masked logits are -inf, never a finite stand-in.

Shape fix-ups happen in Python before the kernels: the sequence is padded to
the block sizes (segment id 0), head dims to a power of two >= 16 (zeros,
which change no dot product), as Triton's loads and dots need.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from pathlib import Path
from typing import Callable

import jax
import jax.numpy as jnp

from rankattn import semantics
from rankattn.backends import flash_math, gpu_config
from rankattn.backends.base import Backend, first_derivatives_only
from rankattn.backends.gpu_config import (MIN_BLOCK, PORTABLE_TARGET, SHARED_MEMORY_PER_BLOCK,
                                          GpuTarget, KernelConfig, default_config,
                                          next_power_of_2, padded_head_dim)
from rankattn.blocks import (BlockPlan, BlockSizes, check_block_sizes, pad_axis1,
                             segments_and_plan, round_up)
from rankattn.errors import fail
from rankattn.validate import AttentionCall, check_optional_bool, is_positive_int

try:  # JAX may one day drop the Triton lowering (0.11 deprecates it for Mosaic GPU).
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu
    IMPORT_ERROR = None
except ImportError as error:  # pragma: no cover - depends on the installed JAX
    pl = plgpu = None
    IMPORT_ERROR = error

SUPPORTED_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)


def plan_sizes(sizes: BlockSizes, seq_len: int, smallest: int = MIN_BLOCK) -> BlockSizes:
    """Blocks no longer than the sequence needs (a power of two >= ``smallest``)."""
    longest = max(smallest, next_power_of_2(seq_len))
    return BlockSizes(min(sizes.block_q, longest), min(sizes.block_k, longest))


@dataclasses.dataclass(frozen=True)
class _Static:
    """Everything that selects the compiled kernels."""

    causal: bool
    scale: float
    softcap: float | None
    softcap_method: str
    own_key: bool  # self-attention with a mask: candidates add their own key
    multiplied: bool  # a logit multiplier per query row follows the cap (one more input)
    block_q: int
    block_k: int
    group: int  # query heads per kv head
    split_dkv: bool  # dk and dv in two kernels (see default_config)
    key_major: bool  # the dk / dv kernels' logits as [bk, bq] (see KernelConfig)
    precision: str   # of float32 dots, a key of F32_DOTS
    num_warps: int
    num_stages: int
    interpret: bool
    # The kernels: None for this module's; or another set with the contracts of
    # :func:`_forward`, :func:`_dq` and :func:`_dkv` (rankattn.backends.mosaic_gpu).
    kernels: "Kernels | None" = None

    def launch(self):
        return dict(interpret=self.interpret,
                    compiler_params=plgpu.CompilerParams(num_warps=self.num_warps,
                                                         num_stages=self.num_stages))


# --- Pieces shared by the three kernels. ------------------------------------------


# float32 dots by `precision` (JAX's names): "highest" exact float32 ("ieee", no tensor cores),
# "high" three bf16 passes on tensor cores (a_hi b_hi + a_hi b_lo + a_lo b_hi), "default" one
# tf32 pass. 16-bit operands always take one tensor-core pass.
F32_DOTS = {"highest": jax.lax.Precision.HIGHEST,
            "high": jax.lax.DotAlgorithmPreset.BF16_BF16_F32_X3,
            "default": jax.lax.Precision.DEFAULT}


def _dot(st: "_Static", a, b, contract=(1, 1)):
    """2-D dot with float32 accumulation; float32 operands as ``st.precision`` says.

    In interpret mode the tensor-core modes are emulated (XLA:CPU computes every float32 dot
    exactly), so CPU tests and benchmarks/precision.py see the GPU's rounding of operands.
    """
    dims = (((contract[0],), (contract[1],)), ((), ()))
    if a.dtype != jnp.float32:
        return jax.lax.dot_general(a, b, dims, preferred_element_type=jnp.float32)
    if not st.interpret or st.precision == "highest":
        return jax.lax.dot_general(a, b, dims, precision=F32_DOTS[st.precision],
                                   preferred_element_type=jnp.float32)
    exact = functools.partial(jax.lax.dot_general, dimension_numbers=dims,
                              precision=jax.lax.Precision.HIGHEST)
    if st.precision == "default":
        return exact(_round_to_tf32(a), _round_to_tf32(b))
    (a_hi, a_lo), (b_hi, b_lo) = _bf16_split(a), _bf16_split(b)
    return exact(a_hi, b_hi) + (exact(a_hi, b_lo) + exact(a_lo, b_hi))


def _round_to_tf32(x):
    """float32 rounded to tf32's 10-bit mantissa (nearest, ties away from zero), as the
    tensor cores' operand conversion does."""
    bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
    rounded = (bits + jnp.uint32(0x1000)) & jnp.uint32(0xFFFFE000)
    return jax.lax.bitcast_convert_type(rounded, jnp.float32)


def _bf16_split(x):
    """x = hi + lo + O(2^-16 |x|), both parts bfloat16 values held in float32."""
    hi = x.astype(jnp.bfloat16).astype(jnp.float32)
    return hi, (x - hi).astype(jnp.bfloat16).astype(jnp.float32)


def _logits(st: _Static, q, k):
    """(base-2 logits after scale and cap, scaled logits before the cap or None), [bq, bk]."""
    return flash_math.capped_logits(st, _dot(st, q, k))


def _multiplier_ref(st: _Static, refs):
    """(the logit multiplier's ref or None, the other refs): the kernels take it as one more
    input after their own, when ``st.multiplied``."""
    return (refs[0], refs[1:]) if st.multiplied else (None, refs)


def _mask(st: _Static, seg_q, seg_k, q_start, k_start, key_major: bool = False):
    """The history part of the mask for a block pair (rankattn.semantics): [bq, bk], or
    [bk, bq] with ``key_major``."""
    pos_q = q_start + jnp.arange(st.block_q)
    pos_k = k_start + jnp.arange(st.block_k)
    q_axis, k_axis = (0, 1) if key_major else (1, 0)
    seg_q, pos_q = jnp.expand_dims(seg_q, q_axis), jnp.expand_dims(pos_q, q_axis)
    seg_k, pos_k = jnp.expand_dims(seg_k, k_axis), jnp.expand_dims(pos_k, k_axis)
    return semantics.sees_history(seg_q, seg_k, pos_q, pos_k, st.causal)


def _two_loops(index_ref, full, count, body, carry):
    """Run body(block index, masked, carry) over a plan list: full blocks, then partial ones."""
    def visit(masked):
        return lambda t, c: body(index_ref[t], masked, c)

    carry = jax.lax.fori_loop(0, full, visit(False), carry)
    return jax.lax.fori_loop(full, count, visit(True), carry)


def _rows(start, size):
    return pl.ds(pl.multiple_of(start, size), size)


# --- Forward. ---------------------------------------------------------------------


def _forward_kernel(kv_index_ref, full_ref, count_ref, seg_q_ref, seg_k_ref, q_ref, k_ref,
                    v_ref, poison_ref, *refs, st: _Static):
    mult_ref, (out_ref, lse_ref) = _multiplier_ref(st, refs)
    mult = None if mult_ref is None else mult_ref[...]  # [bq]
    q_start = pl.program_id(0) * st.block_q
    q = q_ref[...]
    seg_q = seg_q_ref[_rows(q_start, st.block_q)]

    def online_softmax(s, v, carry):
        """Fold base-2 logits s [bq, n] and values v [n, Dv] into (acc, m, l)."""
        acc, m, l = carry
        m_new = jnp.maximum(m, s.max(1))
        shift = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # a row that has seen nothing yet
        p = jnp.exp2(s - shift[:, None])
        alpha = jnp.exp2(m - shift)
        return acc * alpha[:, None] + _dot(st, p.astype(v.dtype), v, (1, 0)), m_new, \
            l * alpha + p.sum(1)

    def block(j, masked, carry):
        keys = _rows(j * st.block_k, st.block_k)
        s, _ = _logits(st, q, k_ref[keys, :])
        s = flash_math.times(s, None if mult is None else mult[:, None])
        s = s + poison_ref[keys][None, :]  # NaN for keys whose k or v is non-finite
        if masked:
            s = jnp.where(_mask(st, seg_q, seg_k_ref[keys], q_start, j * st.block_k), s, -jnp.inf)
        return online_softmax(s, v_ref[keys, :], carry)

    bq, dv = q.shape[0], v_ref.shape[-1]
    carry = (jnp.zeros((bq, dv), jnp.float32), jnp.full((bq,), -jnp.inf, jnp.float32),
             jnp.zeros((bq,), jnp.float32))
    acc, m, l = _two_loops(kv_index_ref, full_ref[...], count_ref[...], block, carry)

    if st.own_key:  # the own-key logit joins the softmax as one more column
        own = _rows(q_start, st.block_q)
        s_own, _ = flash_math.own_logits(st, q, k_ref[own, :], seg_q, poison_ref[own], mult)
        m_new = jnp.maximum(m, s_own)
        shift = jnp.where(m_new == -jnp.inf, 0.0, m_new)
        p_own = jnp.exp2(s_own - shift)
        alpha = jnp.exp2(m - shift)
        acc = acc * alpha[:, None] + p_own[:, None] * v_ref[own, :].astype(jnp.float32)
        l = l * alpha + p_own
        m = m_new

    seen = l != 0  # NaN (a poisoned row) counts as seen
    safe_l = jnp.where(seen, l, 1.0)
    out_ref[...] = (acc / safe_l[:, None]).astype(out_ref.dtype)
    lse_ref[...] = jnp.where(seen, (m + jnp.log2(safe_l)) * flash_math.LN2, -jnp.inf)


def _query_block_specs(st: _Static, q, v, plan: BlockPlan):
    """Grid (query block i, batch b, query head h) and the BlockSpecs of the inputs the forward
    and dq kernels share: the plan's list and counts for (b, i), both segment-id rows, this
    query block, and the whole K / V of the kv head h // G."""
    b, s_pad, hq, d = q.shape
    g = st.group
    per_block = lambda i, b_, h: (b_, i)
    row = lambda i, b_, h: (b_, 0)
    kv_head = lambda i, b_, h: (b_, 0, h // g, 0)
    grid = (plan.kv_index.shape[1], b, hq)
    return grid, [
        pl.BlockSpec((None, None, plan.kv_index.shape[2]), lambda i, b_, h: (b_, i, 0)),
        pl.BlockSpec((None, None), per_block),
        pl.BlockSpec((None, None), per_block),
        pl.BlockSpec((None, s_pad), row),
        pl.BlockSpec((None, s_pad), row),
        pl.BlockSpec((None, st.block_q, None, d), _query_block),
        pl.BlockSpec((None, s_pad, None, d), kv_head),
        pl.BlockSpec((None, s_pad, None, v.shape[-1]), kv_head),
    ]


def _query_block(i, b, h):
    return b, i, h, 0


def _forward(st: _Static, q, k, v, seg, plan: BlockPlan, poison, multiplier):
    """out [B, nQ*bq, Hq, Dv] (q's dtype) and lse [B, Hq, nQ*bq] float32, on padded inputs.

    poison [B, Hkv, S_pad]: 0, or NaN for a key whose k or v is non-finite; added to the
    logits so that exactly the rows that see such a key become NaN (rankattn.semantics).
    multiplier: float32 [B, Hq, S_pad] (with ``st.multiplied``) or None.
    """
    b, s_pad, hq, _ = q.shape
    dv = v.shape[-1]
    grid, in_specs = _query_block_specs(st, q, v, plan)
    bq, rows = st.block_q, grid[0] * st.block_q
    extra_specs, extra = _multiplier_inputs(st, multiplier)
    return pl.pallas_call(
        functools.partial(_forward_kernel, st=st),
        grid=grid,
        in_specs=in_specs + [pl.BlockSpec((None, None, s_pad),
                                          lambda i, b_, h: (b_, h // st.group, 0))]
        + extra_specs,
        out_specs=[
            pl.BlockSpec((None, bq, None, dv), _query_block),
            pl.BlockSpec((None, None, bq), _query_rows),
        ],
        out_shape=[jax.ShapeDtypeStruct((b, rows, hq, dv), q.dtype),
                   jax.ShapeDtypeStruct((b, hq, rows), jnp.float32)],
        name="rankattn_forward",
        **st.launch(),
    )(plan.kv_index, plan.full_count, plan.count, *seg, q, k, v, poison, *extra)


def _query_rows(i, b, h):
    return b, h, i


def _multiplier_inputs(st: _Static, multiplier, spec=None):
    """([its BlockSpec], [multiplier]) when ``st.multiplied``, else ([], []). ``spec``: the
    block of [B, Hq, S_pad] a program reads (default: its query block's rows)."""
    if not st.multiplied:
        return [], []
    return [spec or pl.BlockSpec((None, None, st.block_q), _query_rows)], [multiplier]


# --- Backward: dq. --------------------------------------------------------------


def _dq_kernel(kv_index_ref, full_ref, count_ref, seg_q_ref, seg_k_ref, q_ref, k_ref, v_ref,
               do_ref, lse_ref, delta_ref, *refs, st: _Static):
    mult_ref, (dq_ref,) = _multiplier_ref(st, refs)
    mult = None if mult_ref is None else mult_ref[...]  # [bq]
    q_start = pl.program_id(0) * st.block_q
    q, do = q_ref[...], do_ref[...]
    seg_q = seg_q_ref[_rows(q_start, st.block_q)]
    lse = lse_ref[...]
    lse2 = flash_math.lse2(lse)
    delta = delta_ref[...]

    def block(j, masked, dq):
        keys = _rows(j * st.block_k, st.block_k)
        k, v = k_ref[keys, :], v_ref[keys, :]
        s2, s = _logits(st, q, k)
        row_mult = None if mult is None else mult[:, None]
        s2 = flash_math.times(s2, row_mult)
        if masked:
            mask = _mask(st, seg_q, seg_k_ref[keys], q_start, j * st.block_k)
            s2 = jnp.where(mask, s2, -jnp.inf)
        p = jnp.exp2(s2 - lse2[:, None])
        ds = flash_math.logit_grads(st, p, _dot(st, do, v), delta[:, None], s, row_mult)
        return dq + _dot(st, ds.astype(k.dtype), k, (1, 0))

    dq = _two_loops(kv_index_ref, full_ref[...], count_ref[...], block,
                    jnp.zeros(q.shape, jnp.float32))
    if st.own_key:
        own = _rows(q_start, st.block_q)
        k_own, v_own = k_ref[own, :].astype(jnp.float32), v_ref[own, :].astype(jnp.float32)
        s2, s = flash_math.own_logits(st, q, k_own, seg_q, multiplier=mult)
        p = jnp.exp2(s2 - lse2)
        ds = flash_math.logit_grads(st, p, (do.astype(jnp.float32) * v_own).sum(1), delta, s,
                                    mult)
        dq = dq + ds[:, None] * k_own
    dq_ref[...] = dq.astype(dq_ref.dtype)


def _dq(st: _Static, q, k, v, seg, plan: BlockPlan, d_out, lse, delta, multiplier):
    """dq [B, S_pad, Hq, D] (rows past nQ * bq are never written; the caller drops them)."""
    bq = st.block_q
    grid, in_specs = _query_block_specs(st, q, v, plan)
    extra_specs, extra = _multiplier_inputs(st, multiplier)
    return pl.pallas_call(
        functools.partial(_dq_kernel, st=st),
        grid=grid,
        in_specs=in_specs + [pl.BlockSpec((None, bq, None, v.shape[-1]), _query_block),
                             pl.BlockSpec((None, None, bq), _query_rows),
                             pl.BlockSpec((None, None, bq), _query_rows)] + extra_specs,
        out_specs=pl.BlockSpec((None, bq, None, q.shape[-1]), _query_block),
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        name="rankattn_dq",
        **st.launch(),
    )(plan.kv_index, plan.full_count, plan.count, *seg, q, k, v, d_out, lse, delta, *extra)


# --- Backward: dk and dv. ---------------------------------------------------------


def _dkv_kernel(q_index_ref, full_ref, count_ref, seg_q_ref, seg_k_ref, q_ref, k_ref, v_ref,
                do_ref, lse_ref, delta_ref, *refs, st: _Static, grads: tuple[str, ...]):
    """The key block's gradients named in ``grads`` ("dk", "dv" or both), in that order."""
    mult_ref, out_refs = _multiplier_ref(st, refs)
    k_start = pl.program_id(0) * st.block_k
    keys = _rows(k_start, st.block_k)
    k, v = k_ref[...], v_ref[...]
    seg_k = seg_k_ref[keys]
    full, count = full_ref[...], count_ref[...]
    query_axis = 1 if st.key_major else 0  # of p and ds

    def per_query(x):
        """A per-query vector shaped to broadcast along p's query axis."""
        return jnp.expand_dims(x, 1 - query_axis)

    def head(g, acc):
        """Add query head g of the group's contributions."""
        def block(i, masked, acc):
            queries = _rows(i * st.block_q, st.block_q)
            q, do = q_ref[queries, g, :], do_ref[queries, g, :]
            s2, s = _logits(st, *((k, q) if st.key_major else (q, k)))
            row_mult = None if mult_ref is None else per_query(mult_ref[g, queries])
            s2 = flash_math.times(s2, row_mult)
            if masked:
                mask = _mask(st, seg_q_ref[queries], seg_k, i * st.block_q, k_start,
                             st.key_major)
                s2 = jnp.where(mask, s2, -jnp.inf)
            p = jnp.exp2(s2 - per_query(flash_math.lse2(lse_ref[g, queries])))
            acc = dict(acc)
            if "dv" in acc:
                acc["dv"] = acc["dv"] + _dot(st, p.astype(do.dtype), do, (query_axis, 0))
            if "dk" in acc:
                dp = _dot(st, v, do) if st.key_major else _dot(st, do, v)
                ds = flash_math.logit_grads(st, p, dp, per_query(delta_ref[g, queries]), s,
                                            row_mult)
                acc["dk"] = acc["dk"] + _dot(st, ds.astype(q.dtype), q, (query_axis, 0))
            return acc

        acc = dict(_two_loops(q_index_ref, full, count, block, acc))
        if st.own_key:  # queries at this block's positions, each on its own key
            q = q_ref[keys, g, :].astype(jnp.float32)
            do = do_ref[keys, g, :].astype(jnp.float32)
            lse = lse_ref[g, keys]
            own_mult = None if mult_ref is None else mult_ref[g, keys]
            s2, s = flash_math.own_logits(st, q, k, seg_q_ref[keys], multiplier=own_mult)
            p = jnp.exp2(s2 - flash_math.lse2(lse))
            if "dv" in acc:
                acc["dv"] = acc["dv"] + p[:, None] * do
            if "dk" in acc:
                ds = flash_math.logit_grads(st, p, (do * v.astype(jnp.float32)).sum(1),
                                            delta_ref[g, keys], s, own_mult)
                acc["dk"] = acc["dk"] + ds[:, None] * q
        return acc

    like = dict(dk=k, dv=v)
    acc = jax.lax.fori_loop(0, st.group, head,
                            {n: jnp.zeros(like[n].shape, jnp.float32) for n in grads})
    for name, ref in zip(grads, out_refs):
        ref[...] = acc[name].astype(ref.dtype)


def _dkv(st: _Static, q, k, v, seg, plan: BlockPlan, d_out, lse, delta, multiplier):
    """dk, dv [B, S_pad, Hkv, D / Dv] (rows past nK * bk are never written): one kernel, or
    with ``st.split_dkv`` one kernel each (half the accumulators, p computed twice)."""
    args = (q, k, v, seg, plan, d_out, lse, delta, multiplier)
    if st.split_dkv:
        return _dkv_call(st, ("dk",), *args)[0], _dkv_call(st, ("dv",), *args)[0]
    return tuple(_dkv_call(st, ("dk", "dv"), *args))


def _dkv_call(st: _Static, grads: tuple[str, ...], q, k, v, seg, plan: BlockPlan, d_out, lse,
              delta, multiplier):
    b, s_pad, hkv, d = k.shape
    dv = v.shape[-1]
    n_k = plan.q_index.shape[1]
    bk, g = st.block_k, st.group
    per_block = lambda j, b_, h: (b_, j)
    row = lambda j, b_, h: (b_, 0)
    key_block = lambda j, b_, h: (b_, j, h, 0)
    group = lambda j, b_, h: (b_, 0, h, 0)  # the G query heads of kv head h
    group_rows = lambda j, b_, h: (b_, h, 0)
    like = dict(dk=k, dv=v)
    extra_specs, extra = _multiplier_inputs(st, multiplier,
                                            pl.BlockSpec((None, g, s_pad), group_rows))
    return pl.pallas_call(
        functools.partial(_dkv_kernel, st=st, grads=grads),
        grid=(n_k, b, hkv),
        in_specs=[
            pl.BlockSpec((None, None, plan.q_index.shape[2]), lambda j, b_, h: (b_, j, 0)),
            pl.BlockSpec((None, None), per_block),
            pl.BlockSpec((None, None), per_block),
            pl.BlockSpec((None, s_pad), row),
            pl.BlockSpec((None, s_pad), row),
            pl.BlockSpec((None, s_pad, g, d), group),
            pl.BlockSpec((None, bk, None, d), key_block),
            pl.BlockSpec((None, bk, None, dv), key_block),
            pl.BlockSpec((None, s_pad, g, dv), group),
            pl.BlockSpec((None, g, s_pad), group_rows),
            pl.BlockSpec((None, g, s_pad), group_rows),
        ] + extra_specs,
        out_specs=[pl.BlockSpec((None, bk, None, like[n].shape[-1]), key_block) for n in grads],
        out_shape=[jax.ShapeDtypeStruct(like[n].shape, like[n].dtype) for n in grads],
        name="rankattn_dkv" if len(grads) == 2 else f"rankattn_{grads[0]}",
        **st.launch(),
    )(plan.q_index, plan.q_full_count, plan.q_count, *seg, q, k, v, d_out, lse, delta, *extra)


# --- The differentiable core, on padded inputs. -----------------------------------


@dataclasses.dataclass(frozen=True)
class Kernels:
    """A forward, dq and dk / dv kernel with the contracts of this module's :func:`_forward`,
    :func:`_dq` and :func:`_dkv`: padded inputs, one block plan, lse and delta [B, Hq, S_pad]."""

    forward: Callable
    dq: Callable
    dkv: Callable


TRITON_KERNELS = Kernels(_forward, _dq, _dkv)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attention(st: _Static, q, k, v, seg, plan: BlockPlan, poison, multiplier):
    return _run_forward(st, q, k, v, seg, plan, poison, multiplier)


@first_derivatives_only("pallas_triton or mosaic_gpu")
def _run_forward(st: _Static, q, k, v, seg, plan: BlockPlan, poison, multiplier):
    return (st.kernels or TRITON_KERNELS).forward(st, q, k, v, seg, plan, poison, multiplier)


def _attention_fwd(st, q, k, v, seg, plan, poison, multiplier):
    out, lse = _run_forward(st, q, k, v, seg, plan, poison, multiplier)
    return (out, lse), (q, k, v, seg, plan, out, lse, multiplier)


@first_derivatives_only("pallas_triton or mosaic_gpu")
def _attention_bwd(st, residuals, cotangents):
    q, k, v, seg, plan, out, lse, multiplier = residuals
    d_out, d_lse = cotangents
    lse, d_out, delta = semantics.backward_rows(out, d_out, lse.transpose(0, 2, 1),
                                                d_lse.transpose(0, 2, 1))
    lse, delta = lse.transpose(0, 2, 1), delta.transpose(0, 2, 1)
    # The forward wrote nQ * bq rows; the dk / dv kernel reads rows up to the padded length.
    rows = q.shape[1]
    d_out, lse, delta = pad_axis1(d_out, rows), _pad_last(lse, rows), _pad_last(delta, rows)
    kernels = st.kernels or TRITON_KERNELS
    dq = kernels.dq(st, q, k, v, seg, plan, d_out, lse, delta, multiplier)
    dk, dv = kernels.dkv(st, q, k, v, seg, plan, d_out, lse, delta, multiplier)
    return dq, dk, dv, None, None, None, None


_attention.defvjp(_attention_fwd, _attention_bwd)


def _pad_last(x, length: int):
    """Zero-pad the last axis to ``length`` (a no-op when it already is that long)."""
    extra = length - x.shape[-1]
    return x if not extra else jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, extra)])


def _pad_head_dim(x, multiple: int = 1):
    """Zero-pad the last axis to a power of two >= 16 and a multiple of ``multiple`` (zeros
    change no dot product)."""
    return _pad_last(x, round_up(padded_head_dim(x.shape[-1]), multiple))


def triton_attention(q, k, v, segment_ids, *, causal: bool, scale: float, softcap: float | None,
                     softcap_method: str, config: KernelConfig,
                     block_plan: BlockPlan | None = None,
                     precision: str = "highest", interpret: bool = False,
                     logit_multiplier=None, kernels: Kernels | None = None,
                     head_dim_multiple: int = 1, smallest_block: int = MIN_BLOCK):
    """Blocked attention on Pallas/Triton; arguments and results as :func:`rankattn.attention`
    (``logit_multiplier``: float32 [B, Sq, Hq], finite, or None).

    ``block_plan``, if given, is the self-attention plan of these segment ids
    at ``plan_sizes(config.block_sizes, S)``; without one it is made here. ``kernels``
    replaces this module's (see :class:`Kernels`); ``head_dim_multiple``: head
    dims are padded to a multiple of it too, and ``smallest_block`` bounds the blocks of
    short sequences from below (that kernel's tiles).
    """
    b, sq, hq, d = q.shape
    skv, hkv, dv = k.shape[1], k.shape[2], v.shape[3]
    sizes = plan_sizes(config.block_sizes, max(sq, skv), smallest_block)
    bq, bk = sizes.block_q, sizes.block_k
    seg_q, seg_k, block_plan = segments_and_plan(segment_ids, b, sq, skv, sizes, causal,
                                                 block_plan)
    # One padded length for queries and keys: the own-key term reads keys at query rows
    # and queries at key rows. Padding has segment id 0, so it is invisible.
    s_pad = round_up(max(sq, skv), max(bq, bk))
    seg = (pad_axis1(seg_q, s_pad), pad_axis1(seg_k, s_pad))
    (q, q_poison), (k, k_poison), (v, v_poison) = map(semantics.split_nonfinite, (q, k, v))
    poison = pad_axis1(k_poison + v_poison, s_pad).transpose(0, 2, 1)  # [B, Hkv, S_pad]
    q_p, k_p, v_p = (pad_axis1(_pad_head_dim(x, head_dim_multiple), s_pad) for x in (q, k, v))

    d_pad, dv_pad = q_p.shape[-1], v_p.shape[-1]
    multiplier = None
    if logit_multiplier is not None:  # [B, Hq, S_pad], rows as lse's
        multiplier = pad_axis1(logit_multiplier, s_pad).transpose(0, 2, 1)
    st = _Static(causal=causal, scale=scale, softcap=softcap, softcap_method=softcap_method,
                 own_key=segment_ids is not None, multiplied=multiplier is not None,
                 block_q=bq, block_k=bk, group=hq // hkv,
                 split_dkv=config.split_dkv, key_major=config.key_major, precision=precision,
                 num_warps=config.num_warps,
                 num_stages=(config.num_stages
                             or _default_stages(sizes, d_pad, dv_pad, q.dtype.itemsize)),
                 interpret=interpret, kernels=kernels)
    out, lse = _attention(st, q_p, k_p, v_p, seg, block_plan, poison, multiplier)
    return semantics.poison_rows(out[:, :sq, :, :dv], lse[:, :, :sq], q_poison)


# Shared memory a kernel may plan for: under the ~100 KiB of an RTX-class sm86 part and the
# 163-227 KiB of A100 / H100, with room for Triton's own layout conversions.
SHARED_MEMORY_BUDGET = 96 << 10


def _default_stages(sizes: BlockSizes, d: int, dv: int, itemsize: int) -> int:
    """Two pipeline stages (K / V of the next block loads during this one) when they fit."""
    resident = sizes.block_q * (d + dv) * itemsize
    per_stage = sizes.block_k * (d + dv) * itemsize
    return 2 if resident + 2 * per_stage <= SHARED_MEMORY_BUDGET else 1


class PallasTriton(Backend):
    """The Pallas kernels on the Triton lowering, for NVIDIA GPUs of sm80 (Ampere) and newer.

    The tiles, warps, pipeline stages and whether dk and dv share a kernel are chosen per
    GPU, dtype, head dim and GQA group (:func:`rankattn.backends.gpu_config.default_config`):
    the tuned table's entry, timed on such a GPU by ``benchmarks/gpu.py --tune``, else the
    configuration without register spills in the deviceless compile of
    benchmarks/gpu_compile.py. ``tuned``: None (default) reads the table shipped with
    rankattn, or the file ``$RANKATTN_GPU_TUNED`` names; a path reads that table; False
    uses the spill-free rules only. ``target`` names the GPU: None
    (default) reads it from the device on a GPU machine, and uses ``PORTABLE_TARGET``
    (settings that compile on every supported GPU) when lowering for CUDA elsewhere; or
    "sm_80", "sm_89", "sm_90", (9, 0), a :class:`GpuTarget`.

    ``precision`` (JAX's names, for float32 inputs): "highest" (default) exact float32
    dots, without tensor cores; "high" three bf16 tensor-core passes per dot (the error of
    about 2^-16 relative per product); "default" one tf32 pass (about 2^-11). 16-bit
    inputs always take one tensor-core pass with float32 accumulation.

    Overrides, each fixed for every call: ``block_sizes``, the query x key tile (powers of
    two >= 16; shorter sequences get smaller tiles); ``num_warps``; ``num_stages`` (default:
    two pipeline stages when they fit in shared memory); ``split_dkv``; ``key_major`` (the
    dk / dv kernels' logits as k q^T, see :class:`KernelConfig`).
    ``interpret=True`` runs the same kernels in Pallas interpret mode, on any backend (CPU
    included): slow, for tests.

    By name (``impl='pallas_triton'`` or ``'auto'``) it runs only where JAX's
    default backend is a GPU (``pip install 'rankattn[cuda13]'`` or ``'[cuda12]'``
    installs jax's CUDA plugin); an instance passed as ``impl=`` is not checked,
    so a CPU-only machine can lower it for CUDA (``with
    gpu_config.lowering_without_gpu(): jax.jit(f).trace(...)
    .lower(lowering_platforms=('cuda',))``; jax 0.11 needs that context).
    """

    name = "pallas_triton"

    def __init__(self, block_sizes: BlockSizes | None = None, *, num_warps: int | None = None,
                 num_stages: int | None = None, split_dkv: bool | None = None,
                 key_major: bool | None = None, target=None, precision: str = "highest",
                 tuned: str | os.PathLike | bool | None = None, interpret: bool = False):
        block_sizes = check_block_sizes(block_sizes)
        for field in ("block_q", "block_k"):
            value = None if block_sizes is None else getattr(block_sizes, field)
            if value is not None and (value < MIN_BLOCK or value & (value - 1)):
                raise fail("RA116", f"PallasTriton block_sizes.{field}={value}; Triton tiles must "
                                    f"be powers of two >= {MIN_BLOCK}, e.g. 32, 64 or 128.")
        if num_warps is not None and not gpu_config.is_num_warps(num_warps):
            raise fail("RA116", f"PallasTriton num_warps={num_warps!r}; pass "
                                f"{gpu_config.NUM_WARPS_TEXT} (Triton takes a power of two), "
                                "or None for the default.")
        if num_stages is not None and not is_positive_int(num_stages):
            raise fail("RA116", f"PallasTriton num_stages={num_stages!r}; pass a positive int "
                                "or None for the default.")
        if precision not in F32_DOTS:
            raise fail("RA116", f"PallasTriton precision={precision!r}; pass one of "
                                f"{', '.join(map(repr, F32_DOTS))}.")
        self.block_sizes = block_sizes
        self.num_warps = num_warps
        self.num_stages = num_stages
        self.split_dkv = check_optional_bool("PallasTriton split_dkv", split_dkv)
        self.key_major = check_optional_bool("PallasTriton key_major", key_major)
        self.precision = precision
        self.target = None if target is None else GpuTarget.of(target)
        self.tuned = gpu_config.check_tuned(tuned, "PallasTriton")
        self.interpret = bool(interpret)

    def gpu_target(self) -> GpuTarget:
        """The GPU the kernels are configured for (see the class docstring)."""
        if self.target is not None:
            return self.target
        if jax.default_backend() == "gpu" and not self.interpret:
            capability = tuple(map(int, jax.devices()[0].compute_capability.split(".")))
            if capability in SHARED_MEMORY_PER_BLOCK:
                return GpuTarget.of(capability)
            # A GPU newer than this table: its instructions, the smallest shared memory.
            return GpuTarget(capability, PORTABLE_TARGET.shared_memory_per_block)
        return PORTABLE_TARGET

    def table(self) -> tuple[gpu_config.TunedEntry, ...]:
        """The tuned table's entries this instance consults (see ``tuned``)."""
        if self.tuned is False:
            return ()
        return gpu_config.load_table(gpu_config.table_path() if self.tuned is None
                                     else Path(self.tuned))

    def config(self, dtype, head_dim: int, group: int = 1) -> KernelConfig:
        """The configuration of a call with this dtype, (larger) head dim and GQA group."""
        chosen = default_config(self.gpu_target(), dtype, padded_head_dim(head_dim),
                                self.precision, group, self.table())
        return KernelConfig(self.block_sizes or chosen.block_sizes,
                            chosen.split_dkv if self.split_dkv is None else self.split_dkv,
                            self.num_warps or chosen.num_warps,
                            chosen.key_major if self.key_major is None else self.key_major,
                            self.num_stages or chosen.num_stages)

    def platform_reasons(self) -> list[str]:
        if IMPORT_ERROR is not None:
            return [self._no_lowering()]
        if not self.interpret and jax.default_backend() != "gpu":
            return [f"pallas_triton needs a GPU, and JAX's default backend here is "
                    f"{jax.default_backend()!r}; on an NVIDIA GPU machine install jax with its "
                    "CUDA plugin (pip install 'rankattn[cuda13]', or '[cuda12]' for a CUDA 12 "
                    "driver: jax's own extras), pass "
                    "impl=rankattn.backends.PallasTriton(interpret=True) to run its kernels in "
                    "Pallas interpret mode on CPU (slow), or use impl='xla'"]
        return []

    def not_supported_reasons(self, call: AttentionCall) -> list[str]:
        if IMPORT_ERROR is not None:
            return [self._no_lowering()]
        if not any(call.q.dtype == d for d in SUPPORTED_DTYPES):
            return [f"pallas_triton: inputs are {call.q.dtype}; its kernels take float32, "
                    "bfloat16 or float16 (use impl='xla' for float64)"]
        if call.shard_mask is not None:
            return ["pallas_triton: its kernels read positions from their indices, so they "
                    "cannot run on one context shard of a sequence yet; use impl='xla'"]
        return []

    def plan_sizes(self, seq_len: int) -> tuple[BlockSizes, ...]:
        """Every tile pair a call of this length may use: over dtypes and head dims by the
        built-in rules, and every tuned table entry for this GPU."""
        capability = self.gpu_target().compute_capability
        tuned = [e.config.block_sizes for e in self.table()
                 if e.backend == self.name and e.compute_capability == capability]
        sizes = [self.config(dtype, head_dim).block_sizes for dtype in (jnp.bfloat16, jnp.float32)
                 for head_dim in (128, 256)]
        return tuple(dict.fromkeys(plan_sizes(self.block_sizes or s, seq_len)
                                   for s in sizes + tuned))

    def __call__(self, call: AttentionCall):
        config = self.config(call.q.dtype, max(call.q.shape[-1], call.v.shape[-1]),
                             call.q.shape[2] // call.k.shape[2])
        blocks = None
        if call.plan is not None:
            blocks = call.plan.block_plan(plan_sizes(config.block_sizes, call.q.shape[1]))
        return triton_attention(call.q, call.k, call.v, call.segment_ids, causal=call.causal,
                                scale=call.scale, softcap=call.softcap,
                                softcap_method=call.softcap_method, config=config,
                                block_plan=blocks,
                                precision=self.precision, interpret=self.interpret,
                                logit_multiplier=call.logit_multiplier)

    @staticmethod
    def _no_lowering() -> str:
        return (f"pallas_triton: this JAX ({jax.__version__}) has no Pallas Triton lowering "
                f"({IMPORT_ERROR}); use impl='xla'")

    def __repr__(self) -> str:
        options = [f"{self.block_sizes or 'tiles per GPU, dtype and head dim'}"]
        options += [f"{n}={getattr(self, n)}" for n in ("num_warps", "num_stages", "split_dkv",
                                                  "key_major")
                    if getattr(self, n) is not None]
        if self.target is not None:
            options.append(f"target={self.target.name}")
        if self.precision != "highest":
            options.append(f"precision={self.precision!r}")
        if self.tuned is not None:
            options.append(f"tuned={self.tuned!r}")
        if self.interpret:
            options.append("interpret=True")
        return f"<rankattn backend 'pallas_triton' {' '.join(options)}>"
