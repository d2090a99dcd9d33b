"""Block-sparse flash attention as Pallas Mosaic GPU kernels for Hopper (sm_90a).

Three kernels, each a ``plgpu.kernel`` of three warpgroups with the Warpgroup lowering
semantics set explicitly (jax 0.11 changes the default): the last, the memory warpgroup
(24 registers a thread, as FA3's producer), streams the plan's blocks into shared-memory
rings by TMA (``plgpu.emit_pipeline_warp_specialized``, its grid the list's count, read in
the kernel, and its index maps reading the list, so only listed blocks are fetched); the
two compute warpgroups (240 registers) own 64 rows each and share the stream, arriving on
a slot's "consumed" barrier once done with it. Blocks of the plan are 128 x 128 tokens
(64 for sequences of at most 64 tokens; :class:`MosaicGpu` options), streamed in steps
of 64 tokens; the list holds full blocks first, so ``entry < full_count`` skips the mask.

* forward, grid (batch, query head, query block): per key block, s = q k^T by wgmma (f32
  accumulation, K through a transposed shared-memory view), scale, cap, logit multiplier
  and the keys' poison (NaN for a key whose k or v is non-finite), the mask in partial
  blocks only, the online softmax in base 2, p v by wgmma with p in registers; the two
  compute warpgroups take turns at the tensor cores (FA3's ping-pong). Then each
  candidate's own key joins as one more column, and out / lse leave through shared memory.
* dq, the same grid and stream: p recomputed from the saved lse, dp = dO v^T, ds, and
  dq += ds k by wgmma; the own key's term per row.
* dk / dv, grid (batch, kv head, key block): each compute warpgroup owns 64 keys and
  accumulates their dk and dv in registers over the G query heads of the group (K / V
  read once per group), streamed (query head, query block) steps from the plan's
  transposed lists: Q, dO and the queries' rows. dk and dv take 128 of a compute
  warpgroup's 240 registers a thread at D=128, so ds is factor * (dp - delta), the factor
  (p, the cap's derivative, the multiplier, the scale) taken before dp's product where there
  is a cap; without a multiplier the cap's derivative is recovered from p and lse
  (:func:`flash_math.logit_grad_factor`), not from logits kept live. The candidates'
  own-key terms of dk and dv are per token and summed over the group: XLA adds them in the
  fusion that casts the kernel's float32 sums (one more read of Q and dO).

Grids end with the block axis, which Mosaic GPU makes CUDA's x, launched fastest: the blocks
launched together are one row's and head's (and then the group's next heads'), which read the
same K / V (the forward, dq) or Q / dO (dk / dv), so L2 serves most of those reads. (With
the batch last, as at first, the blocks launched together were different rows', sharing
nothing.) CUDA caps the z dim, the batch's, at 65535 blocks, which Mosaic GPU does not fold
into x (Triton's lowering does): larger batches are declined.

Per-token vectors ride the pipelines beside the tiles as [64] blocks, or are copied once
per warpgroup. The mask is :func:`rankattn.semantics.sees_history` recast on three int32
rows made by XLA (:func:`_token_rows`). The kernels take
:func:`rankattn.backends.pallas_triton._forward`'s contract (padded inputs, plan, poison,
multiplier), so :class:`MosaicGpu` runs through ``triton_attention`` with
:data:`MOSAIC_KERNELS`.

Numerics: ``approx_math`` (the hardware's approximate exp2, log2 and tanh, as JAX's FA3
example) and 16-bit operands only. Interpret mode runs the warpgroups as threads in JAX's
Mosaic GPU interpreter with its race detector, after the fixes of
:mod:`rankattn.backends.mosaic_gpu_interpret`; it accumulates wgmma products into fresh
accumulators (the interpreter lacks ``run_state``), the compiled kernels in place.
Registers, spills, barriers and shared memory for sm_90a, compiled without a GPU, are in
benchmarks/GPU_COMPILE.md. No GPU has run these kernels yet.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from rankattn.backends import flash_math, gpu_config, mosaic_gpu_interpret
from rankattn.backends.base import Backend
from rankattn.backends.pallas_triton import Kernels, PallasTriton, plan_sizes, triton_attention
from rankattn.blocks import BlockPlan, BlockSizes
from rankattn.errors import fail
from rankattn.validate import AttentionCall

NEEDED_NAMES = ("kernel", "emit_pipeline_warp_specialized", "wgmma", "LoweringSemantics")
try:
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu
    MISSING = [name for name in NEEDED_NAMES if not hasattr(plgpu, name)]
    IMPORT_ERROR = f"jax.experimental.pallas.mosaic_gpu lacks {', '.join(MISSING)}" if MISSING \
        else None
except ImportError as error:  # pragma: no cover - depends on the installed JAX
    pl = plgpu = None
    IMPORT_ERROR = str(error)

SUPPORTED_DTYPES = (jnp.bfloat16, jnp.float16)
ROWS = 64        # a warpgroup's wgmma rows, and the tokens of one pipeline step
BLOCK = 128      # the plan's query and key blocks (64 for sequences of at most 64 tokens)
HEAD_DIMS = (64, 128)  # the tiles' head dims (smaller ones padded to 64 by XLA)
PIPELINE_DEPTH = 2     # blocks in flight from the memory warpgroup, by default
# At least 2: with one, the forward's two compute warpgroups, taking turns at the tensor cores,
# wait for each other across a block the memory warpgroup cannot fetch yet (a deadlock).
PIPELINE_DEPTHS = gpu_config.MOSAIC_DEPTHS
# Shared memory a kernel may plan for: H100 / H200's 227 KB per block, less what barriers
# and alignment took in the deviceless compile (under 6 KB).
SHARED_MEMORY_BUDGET = 227 * 1024 - 8 * 1024
# Registers per thread of the memory warpgroup (setmaxnreg), as FA3's producer: the two compute
# warpgroups get (512 - 24) / 2, rounded down to 240, which dk / dv's accumulators need.
MEMORY_REGISTERS = 24
CANDIDATE = 1 << 30    # a candidate row's position: past every key
MAX_GRID_DIM = 65535   # CUDA's limit on a grid's z dim (the batch); Mosaic GPU does not fold it


def _token_rows(seg, s: int):
    """(row_seg, row_pos, key_seg), int32 [B, S]: :func:`rankattn.semantics.sees_history`
    recast so that a partial block's mask is two compares (:func:`_sees`). A query's
    |segment id| and its position (a candidate's: ``CANDIDATE``, past every key); a key's
    segment id, -1 for padding and candidates (which are no one's history)."""
    seg_q, seg_k = (x.astype(jnp.int32) for x in seg)
    row_pos = jnp.where(seg_q < 0, CANDIDATE, jnp.arange(s, dtype=jnp.int32)[None])
    return jnp.abs(seg_q), row_pos, jnp.where(seg_k > 0, seg_k, -1)


def _sees(st, row_seg, key_seg, positions):
    """The history mask from :func:`_token_rows`' rows, each broadcast to the logits' shape;
    ``positions()`` gives the rows' and the keys' positions, made for causal history only (an
    unused value leaves Mosaic GPU's layout inference without a solution)."""
    sees = row_seg == key_seg
    if st.causal:
        row_pos, key_pos = positions()
        sees &= key_pos <= row_pos
    return sees


def _along(x, shape, axis: int):
    """A vector broadcast along ``axis`` of ``shape`` (a per-row vector: axis 0)."""
    return jax.lax.broadcast_in_dim(x, shape, [axis])


def _matmul(shape, a, b, then=None):
    """a @ b by wgmma into a fresh float32 accumulator of ``shape``, read back after ``then()``
    (work overlapping the tensor cores)."""
    def body(acc_ref):
        plgpu.wgmma(acc_ref, a, b)
        if then is not None:
            then()
        return acc_ref[...]
    return pl.run_scoped(body, plgpu.ACC(shape, jnp.float32))


def _accumulate(st, acc, a, b):
    """acc + a @ b by wgmma, accumulating in acc's registers. Interpret mode takes a fresh
    accumulator and adds it (the interpreter lacks ``run_state`` / ``ACC.init``); compiled,
    that would hold a second accumulator live, which dk / dv's registers cannot spare."""
    if st.interpret:
        return acc + _matmul(acc.shape, a, b)

    def body(acc_ref):
        plgpu.wgmma(acc_ref, a, b)
    return pl.run_state(body)(plgpu.ACC.init(acc))


def _transposed(ref):
    return plgpu.transpose_ref(ref, (1, 0))


def _start_copies(copies, barriers, wg, warpgroups: int):
    """TMA copies (gmem source, smem destination) for warpgroup ``wg``, each on its own barrier;
    returns a function that waits for them all."""
    for i, (source, destination) in enumerate(copies):
        plgpu.copy_gmem_to_smem(source, destination, barriers.at[i * warpgroups + wg])

    def wait():
        for i in range(len(copies)):
            plgpu.barrier_wait(barriers.at[i * warpgroups + wg])
    return wait


def _pipeline_depth(st, fixed_bytes: int, step_bytes: int) -> int:
    """The pipeline depth asked for (``st.num_stages``), cut to what shared memory holds
    beside ``fixed_bytes`` at ``step_bytes`` per block in flight (the least depth always
    fits: 2 at D=128, measured in benchmarks/GPU_COMPILE.md)."""
    fits = (SHARED_MEMORY_BUDGET - fixed_bytes) // step_bytes
    return max(PIPELINE_DEPTHS[0], min(st.num_stages, fits))


def _sub_block(index_ref, per_entry: int, t):
    """The 64-token block of pipeline step ``t`` over a plan list whose entries are blocks of
    ``per_entry`` x 64 tokens."""
    return index_ref[t // per_entry] * per_entry + t % per_entry


def _launch(st, name: str, kernel, out_type, scratch, grid, grid_names, warpgroups: int,
            *args):
    kernel.__name__ = name  # the compiled kernel's name (PTX entry, ptxas report, profiles)
    return plgpu.kernel(
        kernel, out_type=out_type, scratch_types=scratch, grid=grid, grid_names=grid_names,
        num_threads=warpgroups + 1, thread_name="wg",
        compiler_params=plgpu.CompilerParams(
            approx_math=True, lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        interpret=mosaic_gpu_interpret.interpret_params() if st.interpret else None,
    )(*args)


# --- Forward and dq: a query block's rows against its list's key blocks. ----------------


def _query_major(st, q, k, v, seg, plan: BlockPlan, multiplier, poison=None, grads=None):
    """The forward (``grads`` None): (out, lse); or dq (``grads`` = (d_out, lse, delta)).

    Grid (batch, query head, query block); each compute warpgroup owns 64 of the block's
    rows, copied once with their per-row vectors, and both share the memory warpgroup's
    stream of key blocks (K, V, the keys' segment ids, and in the forward their poison).
    """
    b, s, hq, d = q.shape
    hkv = k.shape[2]
    warpgroups, per_entry = st.block_q // ROWS, st.block_k // ROWS
    forward = grads is None
    row_seg, row_pos, key_seg = _token_rows(seg, s)
    # Per-query rows: (name, [B, S] or [B, heads, S] array, which head indexes it).
    rows_in = [("seg", row_seg, None), ("pos", row_pos, None)]
    if multiplier is not None:
        rows_in.append(("mult", multiplier.astype(jnp.float32), "q"))
    if forward and st.own_key:
        rows_in.append(("own_poison", poison, "kv"))
    tiles_in = [q]  # [B, S, Hq, D] tiles of the block's rows
    if not forward:
        d_out, lse, delta = grads
        rows_in += [("lse2", flash_math.lse2(lse), "q"), ("delta", delta, "q")]
        tiles_in.append(d_out)
    names = [name for name, _, _ in rows_in]
    streamed = [k, v, key_seg] + ([poison] if forward else [])
    n_in = len(tiles_in) + len(streamed) + 3 + len(rows_in)

    def kernel(*refs):
        tile_refs, refs = refs[:len(tiles_in)], refs[len(tiles_in):]
        k_ref, v_ref, key_seg_ref, *refs = refs
        poison_ref, refs = (refs[0], refs[1:]) if forward else (None, refs)
        index_ref, full_ref, count_ref, *refs = refs
        row_refs, refs = refs[:len(rows_in)], refs[len(rows_in):]
        outs, (tile_smem, row_smem, own_smem, lse_smem), barriers, schedule_barrier = (
            refs[:-3], *refs[-3:])
        bi, qb, h = (jax.lax.axis_index(n) for n in ("batch", "q_block", "heads"))
        wg = jax.lax.axis_index("wg")
        kv_head = jax.lax.div(h, jnp.array(st.group, h.dtype))
        rows = pl.ds(qb * st.block_q + wg * ROWS, ROWS)
        heads = dict(q=h, kv=kv_head)
        q_smem = tile_smem[0].at[wg]

        def row(name):
            return row_smem[names.index(name)].at[wg][...]

        def by_row(name, shape):
            return _along(row(name), shape, 0)

        def schedule():  # the two compute warpgroups take turns at the tensor cores
            if forward and warpgroups > 1:
                plgpu.barrier_arrive(schedule_barrier)
                plgpu.barrier_wait(schedule_barrier)

        def compute(pipeline):
            copies = [(ref.at[bi, rows, h], tile_smem[i].at[wg])
                      for i, ref in enumerate(tile_refs)]
            copies += [(ref.at[bi, rows] if head is None else ref.at[bi, heads[head], rows],
                        row_smem[i].at[wg]) for i, (ref, (_, _, head)) in
                       enumerate(zip(row_refs, rows_in))]
            if st.own_key:
                copies += [(ref.at[bi, rows, kv_head], own_smem[i].at[wg])
                           for i, ref in enumerate((k_ref, v_ref))]
            _start_copies(copies, barriers, wg, warpgroups)()
            if forward:
                carry = (jnp.zeros((ROWS, d), jnp.float32),
                         jnp.full((ROWS,), -jnp.inf, jnp.float32),
                         jnp.zeros((ROWS,), jnp.float32))
            else:
                carry = jnp.zeros((ROWS, d), jnp.float32)
            if forward and warpgroups > 1:
                pl.when(wg == 1)(schedule)
            carry = pipeline(carry)
            if forward and warpgroups > 1:
                pl.when(wg == 0)(schedule)
            own = None
            if st.own_key:  # each candidate's logit on its own key
                k_own, v_own = (own_smem[i].at[wg][...].astype(jnp.float32) for i in range(2))
                s_own, s_scaled = flash_math.own_logits(
                    st, q_smem[...], k_own, jnp.where(row("pos") == CANDIDATE, -1, 1),
                    row("own_poison") if forward else 0.0,
                    row("mult") if multiplier is not None else None)
                own = (k_own, v_own, s_own, s_scaled)
            (finish_forward if forward else finish_dq)(carry, own)

        def finish_forward(carry, own):
            acc, m, l = carry
            if own is not None:  # the own-key logit joins the softmax as one more column
                _, v_own, s_own, _ = own
                m_new = jnp.maximum(m, s_own)
                shift = jnp.where(m_new == -jnp.inf, 0.0, m_new)
                p_own, alpha = jnp.exp2(s_own - shift), jnp.exp2(m - shift)
                acc = _along(alpha, acc.shape, 0) * acc + _along(p_own, acc.shape, 0) * v_own
                l, m = l * alpha + p_own, m_new
            seen = l != 0  # NaN (a poisoned row) counts as seen
            safe_l = jnp.where(seen, l, 1.0)
            q_smem[...] = (acc / _along(safe_l, acc.shape, 0)).astype(q.dtype)  # out, via SMEM
            lse_smem.at[wg][...] = jnp.where(seen, (m + jnp.log2(safe_l)) * flash_math.LN2,
                                             -jnp.inf)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(q_smem, outs[0].at[bi, rows, h])
            plgpu.copy_smem_to_gmem(lse_smem.at[wg], outs[1].at[bi, h, rows])
            plgpu.wait_smem_to_gmem(0)

        def finish_dq(dq, own):
            if own is not None:
                k_own, v_own, s_own, s_scaled = own
                p = jnp.exp2(s_own - row("lse2"))
                dp = (tile_smem[1].at[wg][...].astype(jnp.float32) * v_own).sum(1)
                ds = flash_math.logit_grads(st, p, dp, row("delta"), s_scaled,
                                            row("mult") if multiplier is not None else None)
                dq = dq + _along(ds, dq.shape, 0) * k_own
            q_smem[...] = dq.astype(q.dtype)  # dq, via SMEM (q is no longer read)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(q_smem, outs[0].at[bi, rows, h])
            plgpu.wait_smem_to_gmem(0)

        def step(indices, k_smem, v_smem, key_seg_smem, *refs):
            (t,) = indices
            poison_smem, refs = (refs[0], refs[1:]) if forward else (None, refs)
            k_consumed, v_consumed, key_seg_consumed, *refs = refs
            poison_consumed, (carry,) = (refs[0], refs[1:]) if forward else (None, refs)
            shape = (ROWS, ROWS)
            s2, s_scaled = flash_math.capped_logits(
                st, _matmul(shape, q_smem, _transposed(k_smem), schedule))
            if forward:
                plgpu.barrier_arrive(k_consumed)
            if multiplier is not None:
                s2 = s2 * by_row("mult", shape)
            if forward:
                s2 = s2 + _along(poison_smem[...], shape, 1)
                plgpu.barrier_arrive(poison_consumed)

            def masked(s2):
                def positions():
                    return by_row("pos", shape), (
                        jax.lax.broadcasted_iota(jnp.int32, shape, 1)
                        + _sub_block(index_ref.at[bi, qb], per_entry, t) * ROWS)
                sees = _sees(st, by_row("seg", shape), _along(key_seg_smem[...], shape, 1),
                             positions)
                return jnp.where(sees, s2, -jnp.inf)

            s2 = jax.lax.cond(t // per_entry < full_ref[bi, qb], lambda s2: s2, masked, s2)
            plgpu.barrier_arrive(key_seg_consumed)
            if forward:
                acc, m, l = carry
                m_new = jnp.maximum(m, s2.max(axis=1))
                shift = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # a row that has seen nothing
                alpha = jnp.exp2(m - shift)
                p = jnp.exp2(s2 - _along(shift, shape, 0))
                l = l * alpha + p.sum(axis=1)
                schedule()
                acc = _accumulate(st, _along(alpha, acc.shape, 0) * acc, p.astype(q.dtype),
                                  v_smem)
                plgpu.barrier_arrive(v_consumed)
                return acc, m_new, l
            p = jnp.exp2(s2 - by_row("lse2", shape))
            dp = _matmul(shape, tile_smem[1].at[wg], _transposed(v_smem))
            plgpu.barrier_arrive(v_consumed)
            ds = flash_math.logit_grads(st, p, dp, by_row("delta", shape), s_scaled,
                                        by_row("mult", shape) if multiplier is not None
                                        else None)
            dq = _accumulate(st, carry, ds.astype(q.dtype), k_smem)
            plgpu.barrier_arrive(k_consumed)
            return dq

        def key_block(t):
            return _sub_block(index_ref.at[bi, qb], per_entry, t), 0

        def key_row(t):
            return (_sub_block(index_ref.at[bi, qb], per_entry, t),)

        pipeline = plgpu.emit_pipeline_warp_specialized(
            step, grid=(count_ref[bi, qb] * per_entry,), max_concurrent_steps=depth,
            num_compute_wgs=warpgroups, memory_registers=MEMORY_REGISTERS, wg_axis="wg",
            manual_consumed_barriers=True, compute_context=compute,
            in_specs=[plgpu.BlockSpec(block_shape=(ROWS, d), index_map=key_block)] * 2
            + [plgpu.BlockSpec(block_shape=(ROWS,), index_map=key_row)] * (len(streamed) - 2),
            out_specs=[])
        pipeline(k_ref.at[bi, :, kv_head, :], v_ref.at[bi, :, kv_head, :],
                 key_seg_ref.at[bi], *([poison_ref.at[bi, kv_head]] if forward else []))

    row_dtypes = dict(seg=jnp.int32, pos=jnp.int32)
    own = 2 if st.own_key else 0
    copies = len(tiles_in) + len(rows_in) + own
    tile_bytes = warpgroups * ROWS * d * q.dtype.itemsize
    depth = _pipeline_depth(st, (len(tiles_in) + own) * tile_bytes
                            + (len(rows_in) + 1) * warpgroups * ROWS * 4,
                            2 * ROWS * d * q.dtype.itemsize + (len(streamed) - 2) * ROWS * 4)
    scratch = (
        (tuple(plgpu.SMEM((warpgroups, ROWS, d), q.dtype) for _ in tiles_in),
         tuple(plgpu.SMEM((warpgroups, ROWS), row_dtypes.get(n, jnp.float32)) for n in names),
         tuple(plgpu.SMEM((warpgroups, ROWS, d), q.dtype) for _ in range(own)),
         plgpu.SMEM((warpgroups, ROWS), jnp.float32)),  # the forward's lse (512 B, dq's idle)
        plgpu.Barrier(num_barriers=warpgroups * copies),
        plgpu.Barrier(num_arrivals=warpgroups),
    )
    # The plan's query blocks may cover fewer rows than S (padded to the larger block):
    # the forward writes those rows, dq all S of which the caller reads the first.
    n_q = plan.kv_index.shape[1]
    rows_out = n_q * st.block_q if forward else s
    out_type = [jax.ShapeDtypeStruct((b, rows_out, hq, d), q.dtype)]
    if forward:
        out_type.append(jax.ShapeDtypeStruct((b, hq, rows_out), jnp.float32))
    args = [*tiles_in, *streamed, plan.kv_index.astype(jnp.int32),
            plan.full_count.astype(jnp.int32), plan.count.astype(jnp.int32),
            *(x for _, x, _ in rows_in)]
    assert len(args) == n_in
    results = _launch(st, "rankattn_forward" if forward else "rankattn_dq", kernel, out_type,
                      scratch, (b, hq, n_q), ("batch", "heads", "q_block"), warpgroups,
                      *args)
    return tuple(results) if forward else results[0]


def mosaic_forward(st, q, k, v, seg, plan: BlockPlan, poison, multiplier):
    """out [B, S, Hq, D] (q's dtype) and lse float32 [B, Hq, S] on inputs padded as
    :func:`rankattn.backends.pallas_triton._forward` takes them, for a plan of
    BlockSizes(``st.block_q``, ``st.block_k``), each 64 or 128, D in :data:`HEAD_DIMS`."""
    _check_shapes(st, q, k, v)
    return _query_major(st, q, k, v, seg, plan, multiplier, poison=poison.astype(jnp.float32))


def mosaic_dq(st, q, k, v, seg, plan: BlockPlan, d_out, lse, delta, multiplier):
    """dq [B, S, Hq, D] as :func:`rankattn.backends.pallas_triton._dq`."""
    _check_shapes(st, q, k, v)
    return _query_major(st, q, k, v, seg, plan, multiplier, grads=(d_out, lse, delta))


def mosaic_dkv(st, q, k, v, seg, plan: BlockPlan, d_out, lse, delta, multiplier):
    """dk, dv [B, S, Hkv, D] as :func:`rankattn.backends.pallas_triton._dkv`: the key-major
    kernel's sums over the plan's query blocks (float32), plus the candidates' own-key terms
    in the same XLA fusion that casts them."""
    _check_shapes(st, q, k, v)
    dk, dv = _key_major(st, q, k, v, seg, plan, d_out, lse, delta, multiplier)
    if st.own_key:
        dk_own, dv_own = _own_key_kv_grads(st, q, k, v, seg[0], d_out, lse, delta, multiplier)
        dk, dv = dk + dk_own, dv + dv_own
    return dk.astype(k.dtype), dv.astype(v.dtype)


def _key_major(st, q, k, v, seg, plan: BlockPlan, d_out, lse, delta, multiplier):
    """dk, dv float32 [B, S, Hkv, D] of the history part.

    Grid (batch, kv head, key block); each compute warpgroup owns 64 of the block's keys
    (K, V and their segment ids copied once) and accumulates their dk and dv in registers
    over the G query heads of the group, so K / V are read once per group. Both share the
    memory warpgroup's stream of (query head, query block) steps: Q, dO, the queries'
    segment ids and positions, lse, delta and the multiplier, from the plan's transposed
    list (the query blocks that see this key block), once per query head.
    """
    b, s, hq, d = q.shape
    hkv = k.shape[2]
    warpgroups, per_entry = st.block_k // ROWS, st.block_q // ROWS
    multiplied = multiplier is not None
    row_seg, row_pos, key_seg = _token_rows(seg, s)
    per_head_rows = [flash_math.lse2(lse), delta] + ([multiplier.astype(jnp.float32)]
                                                     if multiplied else [])

    def kernel(q_ref, do_ref, row_seg_ref, row_pos_ref, *refs):
        head_row_refs, refs = refs[:len(per_head_rows)], refs[len(per_head_rows):]
        (k_ref, v_ref, key_seg_ref, index_ref, full_ref, count_ref, dk_ref, dv_ref,
         (kv_smem, key_seg_smem, out_smem), barriers) = refs
        bi, kb, kv_head = (jax.lax.axis_index(n) for n in ("batch", "k_block", "heads"))
        wg = jax.lax.axis_index("wg")
        keys = pl.ds(kb * st.block_k + wg * ROWS, ROWS)
        k_smem, v_smem = kv_smem[0].at[wg], kv_smem[1].at[wg]
        # Steps run the list once per query head of the group: head-major.
        per_head = jnp.maximum(count_ref[bi, kb] * per_entry, 1)

        def query_block(t):
            return _sub_block(index_ref.at[bi, kb], per_entry, t % per_head)

        def head(t):
            return kv_head * st.group + t // per_head

        def compute(pipeline):
            _start_copies([(k_ref.at[bi, keys, kv_head], k_smem),
                           (v_ref.at[bi, keys, kv_head], v_smem),
                           (key_seg_ref.at[bi, keys], key_seg_smem.at[wg])],
                          barriers, wg, warpgroups)()
            zeros = jnp.zeros((ROWS, d), jnp.float32)
            for ref, grad in zip((dk_ref, dv_ref), pipeline((zeros, zeros))):
                out_smem.at[wg][...] = grad  # via SMEM, one gradient at a time
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(out_smem.at[wg], ref.at[bi, keys, kv_head])
                plgpu.wait_smem_to_gmem(0)

        def step(indices, q_smem, do_smem, seg_smem, pos_smem, lse2_smem, delta_smem, *refs):
            (t,) = indices
            mult_smem, refs = (refs[0], refs[1:]) if multiplied else (None, refs)
            q_consumed, do_consumed, seg_consumed, pos_consumed, *refs = refs
            lse2_consumed, delta_consumed, *refs = refs
            mult_consumed, ((dk, dv),) = (refs[0], refs[1:]) if multiplied else (None, refs)
            shape = (ROWS, ROWS)  # keys x queries
            by_query = lambda ref: _along(ref[...], shape, 1)  # noqa: E731
            s2, s_scaled = flash_math.capped_logits(
                st, _matmul(shape, k_smem, _transposed(q_smem)))
            mult = by_query(mult_smem) if multiplied else None
            s2 = flash_math.times(s2, mult)

            def masked(s2):
                def positions():
                    return by_query(pos_smem), (jax.lax.broadcasted_iota(jnp.int32, shape, 0)
                                                + kb * st.block_k + wg * ROWS)
                sees = _sees(st, by_query(seg_smem), _along(key_seg_smem.at[wg][...], shape, 0),
                             positions)
                return jnp.where(sees, s2, -jnp.inf)

            s2 = jax.lax.cond((t % per_head) // per_entry < full_ref[bi, kb], lambda s2: s2,
                              masked, s2)
            plgpu.barrier_arrive(seg_consumed)
            plgpu.barrier_arrive(pos_consumed)
            p = jnp.exp2(s2 - by_query(lse2_smem))
            dv = _accumulate(st, dv, p.astype(q.dtype), do_smem)

            def grad_factor():  # all of ds but (dp - delta); lse read only where used (an
                # unused value leaves layout inference without a solution)
                if st.softcap is None or multiplied:
                    return flash_math.logit_grad_factor(st, p, mult, s=s_scaled)
                return flash_math.logit_grad_factor(st, p, lse2=by_query(lse2_smem))

            # With a cap, the factor is taken before dp's product, and without a multiplier the
            # cap's derivative comes from p and lse: holding the scaled logits beside p until
            # dp is known spilled 48-52 bytes at D=128. (Under a multiplier the logits are
            # kept: recovered, they lose the multiplier's precision.) Without a cap, after
            # dp's product: Mosaic GPU's layout inference finds no solution for the
            # multiplier's product before it.
            factor = grad_factor() if st.softcap is not None else None
            dp = _matmul(shape, v_smem, _transposed(do_smem))
            plgpu.barrier_arrive(do_consumed)
            ds = (grad_factor() if factor is None else factor) * (dp - by_query(delta_smem))
            for consumed in (lse2_consumed, delta_consumed, mult_consumed):
                if consumed is not None:
                    plgpu.barrier_arrive(consumed)
            dk = _accumulate(st, dk, ds.astype(q.dtype), q_smem)
            plgpu.barrier_arrive(q_consumed)
            return dk, dv

        def tile(t):
            return query_block(t), head(t), 0

        def token_row(t):
            return (query_block(t),)

        def head_row(t):
            return head(t), query_block(t)

        pipeline = plgpu.emit_pipeline_warp_specialized(
            step, grid=(st.group * count_ref[bi, kb] * per_entry,),
            max_concurrent_steps=depth, num_compute_wgs=warpgroups,
            memory_registers=MEMORY_REGISTERS, wg_axis="wg", manual_consumed_barriers=True,
            compute_context=compute,
            in_specs=[plgpu.BlockSpec(block_shape=(ROWS, None, d), index_map=tile)] * 2
            + [plgpu.BlockSpec(block_shape=(ROWS,), index_map=token_row)] * 2
            + [plgpu.BlockSpec(block_shape=(None, ROWS), index_map=head_row)]
            * len(per_head_rows),
            out_specs=[])
        pipeline(q_ref.at[bi], do_ref.at[bi], row_seg_ref.at[bi], row_pos_ref.at[bi],
                 *(ref.at[bi] for ref in head_row_refs))

    tile_bytes = warpgroups * ROWS * d * q.dtype.itemsize
    depth = _pipeline_depth(st, 2 * tile_bytes + warpgroups * ROWS * (4 + 4 * d),
                            2 * ROWS * d * q.dtype.itemsize + (2 + len(per_head_rows)) * ROWS * 4)
    scratch = (
        (tuple(plgpu.SMEM((warpgroups, ROWS, d), k.dtype) for _ in range(2)),
         plgpu.SMEM((warpgroups, ROWS), jnp.int32),
         plgpu.SMEM((warpgroups, ROWS, d), jnp.float32)),
        plgpu.Barrier(num_barriers=warpgroups * 3),
    )
    grad = jax.ShapeDtypeStruct((b, s, hkv, d), jnp.float32)
    return _launch(st, "rankattn_dkv", kernel, [grad, grad], scratch,
                   (b, hkv, plan.q_index.shape[1]),
                   ("batch", "heads", "k_block"), warpgroups, q, d_out, row_seg, row_pos,
                   *per_head_rows, k, v, key_seg, plan.q_index.astype(jnp.int32),
                   plan.q_full_count.astype(jnp.int32), plan.q_count.astype(jnp.int32))


def _own_key_kv_grads(st, q, k, v, seg_q, d_out, lse, delta, multiplier):
    """The candidates' own-key terms of dk and dv, float32 [B, S, Hkv, D]: per token, summed
    over the group's query heads at the same position (elementwise, so XLA fuses it with
    the kernel's sums; no block visits it)."""
    b, s, hq, d = q.shape
    hkv = k.shape[2]
    f32 = jnp.float32

    def grouped(x):  # [B, S, Hq, D] -> [B, S, Hkv, G, D]
        return x.astype(f32).reshape(b, s, hkv, st.group, d)

    def per_row(x):  # [B, Hq, S] -> [B, S, Hkv, G]
        return x.astype(f32).transpose(0, 2, 1).reshape(b, s, hkv, st.group)

    q_g, do_g = grouped(q), grouped(d_out)
    k_own, v_own = (x.astype(f32)[:, :, :, None] for x in (k, v))
    mult = None if multiplier is None else per_row(multiplier)
    s2, s_scaled = flash_math.own_logits(st, q_g, k_own, seg_q[:, :, None, None],
                                         multiplier=mult)
    p = jnp.exp2(s2 - flash_math.lse2(per_row(lse)))
    ds = flash_math.logit_grads(st, p, (do_g * v_own).sum(-1), per_row(delta), s_scaled, mult)
    return (ds[..., None] * q_g).sum(3), (p[..., None] * do_g).sum(3)


MOSAIC_KERNELS = Kernels(mosaic_forward, mosaic_dq, mosaic_dkv)


def _check_shapes(st, q, k, v):
    assert st.block_q in (ROWS, 2 * ROWS) and st.block_k in (ROWS, 2 * ROWS), st
    assert q.shape[-1] in HEAD_DIMS and k.shape == v.shape == (*q.shape[:2], *k.shape[2:]) \
        and k.shape[-1] == q.shape[-1], (q.shape, k.shape, v.shape)


# --- The backend. ---------------------------------------------------------------------


def _under_jit(x) -> bool:
    """Whether ``x`` is being traced into a jaxpr (jit, scan, ...), not just differentiated."""
    while isinstance(x, jax.core.Tracer):
        if type(x).__name__ == "DynamicJaxprTracer":
            return True
        x = getattr(x, "primal", None)
    return False


def tile_head_dim(size: int) -> int:
    """The head dim a tile holds for ``size``: the least of :data:`HEAD_DIMS` that fits."""
    return next((d for d in HEAD_DIMS if size <= d), size)


class MosaicGpu(Backend):
    """Pallas Mosaic GPU kernels for Hopper (sm_90a): forward, dq and dk / dv, each
    warp-specialised (a memory warpgroup streaming the plan's blocks by TMA to two compute
    warpgroups of 64 rows, wgmma with float32 accumulation) and block-sparse.

    Inputs bfloat16 or float16 (wgmma's 16-bit operands; float32 is declined, so ``auto``
    falls back), head dims up to 128 (padded to 64 or 128 by XLA).

    ``block_sizes``: the plan's query x key blocks, each 64 or 128 (one or two compute
    warpgroups; default 128 x 128, 64 for sequences of at most 64 tokens).
    ``pipeline_depth``: blocks in flight from the memory warpgroup, 2 (default) to 4, at most
    what each kernel's shared memory holds (per kernel, a deeper request is cut to that).
    Both default to the tuned table's ``mosaic_gpu`` entry for the call where there is one
    (``tuned``: as :class:`PallasTriton`'s, the same table), and ``target`` is the GPU whose
    entries are read (default: this machine's).

    ``interpret``: False (default) compiles for the GPU; True runs the kernels on any
    backend, CPU included (slow, for tests), in JAX's Mosaic GPU interpreter, warpgroups as
    threads with the race detector on; eagerly only (RA128 under jit).

    By name (``impl='mosaic_gpu'``) it runs only on a GPU of compute capability 9.0; an
    instance passed as ``impl=`` is not checked, so a CPU-only machine can lower and compile
    it for CUDA. ``impl='auto'`` tries it before pallas_triton but takes it only for calls
    whose first tuned-table entry names ``mosaic_gpu``: where ``benchmarks/gpu.py`` checked
    it against the reference and timed it faster on this GPU (:meth:`auto_reasons`).
    """

    name = "mosaic_gpu"

    def __init__(self, block_sizes: BlockSizes | None = None, *,
                 pipeline_depth: int | None = None, tuned=None, target=None,
                 interpret: bool = False):
        if block_sizes is not None and not (
                isinstance(block_sizes, BlockSizes)
                and {block_sizes.block_q, block_sizes.block_k} <= set(gpu_config.MOSAIC_TILES)):
            raise fail("RA116", f"MosaicGpu block_sizes={block_sizes!r}; pass BlockSizes(q, k) "
                                f"with each of {gpu_config.MOSAIC_TILES}, or None.")
        if pipeline_depth is not None and (isinstance(pipeline_depth, bool)
                                           or pipeline_depth not in PIPELINE_DEPTHS):
            raise fail("RA116", f"MosaicGpu pipeline_depth={pipeline_depth!r}; pass one of "
                                f"{PIPELINE_DEPTHS}, or None.")
        if not isinstance(interpret, bool):
            raise fail("RA116", f"MosaicGpu interpret={interpret!r}; pass True or False.")
        self.block_sizes = block_sizes
        self.pipeline_depth = pipeline_depth
        self.interpret = interpret
        # Its GPU, table and platform checks are pallas_triton's (one table for both), its
        # options' errors this class's.
        self.triton = PallasTriton(
            tuned=gpu_config.check_tuned(tuned, "MosaicGpu"), interpret=interpret,
            target=None if target is None else gpu_config.GpuTarget.of(target, "MosaicGpu"))

    def tuned_entry(self, dtype, head_dim: int, group: int, backend: str | None = "mosaic_gpu"):
        """The tuned table's first entry for a call (``backend``'s; None: any), or None."""
        return gpu_config.tuned_entry(self.triton.gpu_target().compute_capability, dtype,
                                      gpu_config.padded_head_dim(head_dim), group=group,
                                      table=self.triton.table(), backend=backend)

    def choices(self, dtype, head_dim: int, group: int = 1) -> tuple[BlockSizes, int]:
        """(block sizes, pipeline depth) of a call: the options, else the tuned table's
        mosaic_gpu entry, else the defaults."""
        entry = self.tuned_entry(dtype, head_dim, group)
        sizes = self.block_sizes or (entry.config.block_sizes if entry else BlockSizes(BLOCK,
                                                                                     BLOCK))
        depth = self.pipeline_depth or (entry and entry.config.num_stages) or PIPELINE_DEPTH
        return sizes, depth

    def config(self, dtype, head_dim: int, group: int = 1) -> gpu_config.KernelConfig:
        """:meth:`choices` as the configuration ``triton_attention`` and the tuned table take:
        the blocks and the depth (as num_stages) are read, the rest is Triton's."""
        sizes, depth = self.choices(dtype, head_dim, group)
        return gpu_config.KernelConfig(sizes, False, 4, False, depth)

    def platform_reasons(self) -> list[str]:
        if IMPORT_ERROR is not None:
            return [self._no_lowering()]
        if self.interpret:
            return []
        if jax.default_backend() != "gpu":
            return [f"mosaic_gpu needs a GPU, and JAX's default backend here is "
                    f"{jax.default_backend()!r}; on an H100 / H200 install jax with its CUDA "
                    "plugin (pip install 'rankattn[cuda13]'), pass "
                    "impl=rankattn.backends.MosaicGpu(interpret=True) to run its kernels in "
                    "JAX's Mosaic GPU interpreter on CPU (slow), or use impl='xla'"]
        capability = getattr(jax.devices()[0], "compute_capability", None)
        if capability != "9.0":
            return [f"mosaic_gpu: its kernels are for compute capability 9.0 (H100 / H200); "
                    f"this GPU's is {capability}; use impl='pallas_triton'"]
        return []

    def not_supported_reasons(self, call: AttentionCall) -> list[str]:
        if IMPORT_ERROR is not None:
            return [self._no_lowering()]
        reasons = []
        if self.interpret and mosaic_gpu_interpret.IMPORT_ERROR is not None:
            reasons.append(f"mosaic_gpu: interpret mode needs rankattn's fixes of JAX's Mosaic "
                           f"GPU interpreter, which do not apply here "
                           f"({mosaic_gpu_interpret.IMPORT_ERROR}); use "
                           "PallasTriton(interpret=True) or impl='xla' on this machine")
        if not any(call.q.dtype == d for d in SUPPORTED_DTYPES):
            reasons.append(f"mosaic_gpu: inputs are {call.q.dtype}; its wgmma kernels take "
                           "bfloat16 or float16 (use impl='pallas_triton' for float32)")
        widest = max(call.q.shape[-1], call.v.shape[-1])
        if widest > HEAD_DIMS[-1]:
            reasons.append(f"mosaic_gpu: head dim {widest}; its tiles take head dims up to "
                           f"{HEAD_DIMS[-1]} (use impl='pallas_triton')")
        elif len({tile_head_dim(call.q.shape[-1]), tile_head_dim(call.v.shape[-1])}) > 1:
            reasons.append(f"mosaic_gpu: q / k head dim {call.q.shape[-1]} and v head dim "
                           f"{call.v.shape[-1]} take different tiles; its kernel takes one "
                           "(use impl='pallas_triton')")
        if not self.interpret and call.q.shape[0] > MAX_GRID_DIM:
            reasons.append(f"mosaic_gpu: batch {call.q.shape[0]}; its grids put the batch on "
                           f"CUDA's z axis, at most {MAX_GRID_DIM} blocks (split the batch into "
                           "calls, or use impl='pallas_triton', whose lowering folds it into x)")
        if call.shard_mask is not None:
            reasons.append("mosaic_gpu: its kernels read positions from their indices, so "
                           "they cannot run on one context shard yet; use impl='xla'")
        return reasons

    def auto_reasons(self, call: AttentionCall) -> list[str]:
        entry = self.tuned_entry(call.q.dtype, max(call.q.shape[-1], call.v.shape[-1]),
                                 call.q.shape[2] // call.k.shape[2], backend=None)
        if entry is not None and entry.backend == self.name:
            return []
        return [f"mosaic_gpu: impl='auto' takes it where benchmarks/gpu.py --tune checked it "
                f"and timed it fastest on this GPU (the tuned table's first entry for "
                f"{jnp.dtype(call.q.dtype).name}, this head dim and group names "
                f"{entry.backend if entry else 'no backend'}); impl='mosaic_gpu' runs it"]

    def sizes(self, block_sizes: BlockSizes, seq_len: int) -> BlockSizes:
        return plan_sizes(block_sizes, seq_len, ROWS)

    def plan_sizes(self, seq_len: int) -> tuple[BlockSizes, ...]:
        """The default's or the option's, and every tuned mosaic_gpu entry's for this GPU."""
        capability = self.triton.gpu_target().compute_capability
        tuned = [e.config.block_sizes for e in self.triton.table()
                 if e.backend == self.name and e.compute_capability == capability]
        return tuple(dict.fromkeys(
            self.sizes(s, seq_len) for s in ([self.block_sizes] if self.block_sizes
                                             else [BlockSizes(BLOCK, BLOCK)] + tuned)))

    def __call__(self, call: AttentionCall):
        if self.interpret and isinstance(call.q, jax.core.Tracer) and _under_jit(call.q):
            raise fail("RA128", "MosaicGpu(interpret=True) was called under jax.jit (q is "
                                f"{type(call.q).__name__}); call it eagerly (jax.grad and "
                                "jax.vjp are fine), or use PallasTriton(interpret=True) or "
                                "impl='xla' under jit.")
        config = self.config(call.q.dtype, max(call.q.shape[-1], call.v.shape[-1]),
                             call.q.shape[2] // call.k.shape[2])
        blocks = None
        if call.plan is not None:
            blocks = call.plan.block_plan(self.sizes(config.block_sizes, call.q.shape[1]))
        return triton_attention(call.q, call.k, call.v, call.segment_ids, causal=call.causal,
                                scale=call.scale, softcap=call.softcap,
                                softcap_method=call.softcap_method, config=config,
                                block_plan=blocks, interpret=self.interpret,
                                logit_multiplier=call.logit_multiplier, kernels=MOSAIC_KERNELS,
                                head_dim_multiple=HEAD_DIMS[0], smallest_block=ROWS)

    @staticmethod
    def _no_lowering() -> str:
        return (f"mosaic_gpu: this JAX ({jax.__version__}) lacks the Mosaic GPU names its "
                f"kernels need ({IMPORT_ERROR}); use impl='pallas_triton'")

    def __repr__(self) -> str:
        options = [f"block_sizes={self.block_sizes}"] if self.block_sizes else []
        if self.pipeline_depth:
            options.append(f"pipeline_depth={self.pipeline_depth}")
        if self.triton.tuned is not None:
            options.append(f"tuned={self.triton.tuned!r}")
        if self.triton.target is not None:
            options.append(f"target={self.triton.target.name}")
        if self.interpret:
            options.append("interpret=True")
        return f"<rankattn backend 'mosaic_gpu'{''.join(' ' + o for o in options)}>"
