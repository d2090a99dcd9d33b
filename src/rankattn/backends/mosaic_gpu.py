"""The forward as a Pallas Mosaic GPU kernel for Hopper (sm_90a): warp-specialised and
block-sparse on rankattn's block plans; the backward on :mod:`pallas_triton`'s kernels.

One ``plgpu.kernel`` over (query head, query block, batch) with three warpgroups
(Warpgroup lowering semantics, set explicitly: jax 0.11 changes the default). The last,
the memory warpgroup, streams the plan's key blocks for this query block into shared
memory rings with TMA (``plgpu.emit_pipeline_warp_specialized``: its grid is the list's
count, read in the kernel, and its index map reads the list, so only listed key blocks
are fetched); the two compute warpgroups own 64 query rows each and share the stream,
each arriving on a slot's "consumed" barrier once done with it. Per key block: s = q k^T
by wgmma (f32 accumulation, K through a transposed shared-memory view), scale, cap,
logit multiplier and the keys' poison (NaN for a key whose k or v is non-finite), the
mask in partial blocks only (``j < full_count``: the list holds full blocks first), the
online softmax in base 2, p v by wgmma with p in registers. Then each candidate's own
key joins as one more column (its k and v rows copied once per warpgroup), and out /
lse are written through shared memory.

Per-key vectors (the keys' segment ids, poison) ride the pipeline beside K and V as
[64] blocks; per-query vectors (segment ids, positions, the multiplier, the own key's
poison) are copied once per warpgroup. The mask is :func:`rankattn.semantics.sees_history`
recast on three int32 rows made by XLA: a query's |segment id| and its position (a
candidate's: ``CANDIDATE``, past every key), a key's segment id (-1 for padding and
candidates), so that it is ``row_seg == key_seg`` (and ``key_pos <= row_pos`` for causal
history), and a query is a candidate where its position is ``CANDIDATE``.

The contract is :func:`rankattn.backends.pallas_triton._forward`'s (padded inputs, plan,
poison, multiplier), so :class:`MosaicGpu` runs through ``triton_attention`` with this
forward, and Triton's dq and dk / dv kernels take its out and lse: the Mosaic GPU
backward kernels are not written yet. Interpret mode runs the warpgroups as threads in
JAX's Mosaic GPU interpreter with its race detector, after the fixes of
:mod:`rankattn.backends.mosaic_gpu_interpret`.

Numerics: ``approx_math`` (the hardware's approximate exp2, log2 and tanh, as JAX's FA3
example) and 16-bit operands only. It lowers for CUDA without a GPU (tested); its deviceless
compile for sm_90a is not in benchmarks/gpu_compile.py yet. No GPU has run it.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from rankattn.backends import flash_math, mosaic_gpu_interpret
from rankattn.backends.base import Backend
from rankattn.backends.pallas_triton import PallasTriton, plan_sizes, triton_attention
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
ROWS = 64        # a warpgroup's wgmma rows
BLOCK_K = 64
COMPUTE_WARPGROUPS = 2
HEAD_DIMS = (64, 128)  # the tiles' head dims (smaller ones padded to 64 by XLA)
PIPELINE_DEPTH = 2     # key blocks in flight
CANDIDATE = 1 << 30    # a candidate row's position: past every key


def mosaic_forward(st, q, k, v, seg, plan: BlockPlan, poison, multiplier):
    """out [B, S, Hq, D] (q's dtype) and lse float32 [B, Hq, S] on inputs padded as
    :func:`rankattn.backends.pallas_triton._forward` takes them, for a plan of
    BlockSizes(``st.block_q``, 64) with ``st.block_q`` 64 or 128 (one or two compute
    warpgroups), D in :data:`HEAD_DIMS`."""
    b, s, hq, d = q.shape
    hkv = k.shape[2]
    warpgroups = st.block_q // ROWS
    assert st.block_k == BLOCK_K and st.block_q in (ROWS, 2 * ROWS), (st.block_q, st.block_k)
    assert d in HEAD_DIMS and k.shape == v.shape == (b, s, hkv, d), (q.shape, v.shape)
    n_q = s // st.block_q
    multiplied = multiplier is not None
    seg_q, seg_k = (x.astype(jnp.int32) for x in seg)
    row_seg = jnp.abs(seg_q)
    row_pos = jnp.where(seg_q < 0, CANDIDATE, jnp.arange(s, dtype=jnp.int32)[None])
    key_seg = jnp.where(seg_k > 0, seg_k, -1)
    # Per-query rows, each copied into a [warpgroups, 64] shared-memory buffer.
    row_names = ["seg", "pos"] + ["mult"] * multiplied + ["own_poison"] * st.own_key
    row_dtypes = dict(seg=jnp.int32, pos=jnp.int32, mult=jnp.float32, own_poison=jnp.float32)

    def kernel(q_ref, k_ref, v_ref, index_ref, full_ref, count_ref, row_seg_ref, row_pos_ref,
               key_seg_ref, poison_ref, *refs):
        mult_ref, refs = (refs[0], refs[1:]) if multiplied else (None, refs)
        out_ref, lse_ref, smem, q_barriers, row_barriers, own_barriers, schedule_barrier = refs
        qo_smem, lse_smem, row_smem, own_smem = smem
        bi, qb, h = (jax.lax.axis_index(n) for n in ("batch", "q_block", "heads"))
        wg = jax.lax.axis_index("wg")
        kv_head = jax.lax.div(h, jnp.array(st.group, h.dtype))
        rows = pl.ds(qb * st.block_q + wg * ROWS, ROWS)
        row_sources = dict(seg=row_seg_ref.at[bi, rows], pos=row_pos_ref.at[bi, rows])
        if multiplied:
            row_sources["mult"] = mult_ref.at[bi, h, rows]
        if st.own_key:
            row_sources["own_poison"] = poison_ref.at[bi, kv_head, rows]

        def row(name):
            return row_smem[row_names.index(name)].at[wg][...]

        def by_row(x, shape):
            return jax.lax.broadcast_in_dim(x, shape, [0])

        def schedule():  # the two compute warpgroups take turns at the tensor cores
            if warpgroups > 1:
                plgpu.barrier_arrive(schedule_barrier)
                plgpu.barrier_wait(schedule_barrier)

        def compute(pipeline):
            q_smem = qo_smem.at[wg]
            plgpu.copy_gmem_to_smem(q_ref.at[bi, rows, h], q_smem, q_barriers.at[wg])
            for i, name in enumerate(row_names):
                plgpu.copy_gmem_to_smem(row_sources[name], row_smem[i].at[wg],
                                        row_barriers.at[i * warpgroups + wg])
            if st.own_key:
                for i, ref in enumerate((k_ref, v_ref)):
                    plgpu.copy_gmem_to_smem(ref.at[bi, rows, kv_head], own_smem[i].at[wg],
                                            own_barriers.at[i * warpgroups + wg])
            plgpu.barrier_wait(q_barriers.at[wg])
            for i in range(len(row_names)):
                plgpu.barrier_wait(row_barriers.at[i * warpgroups + wg])
            carry = (jnp.zeros((ROWS, d), jnp.float32), jnp.full((ROWS,), -jnp.inf, jnp.float32),
                     jnp.zeros((ROWS,), jnp.float32))
            if warpgroups > 1:
                pl.when(wg == 1)(schedule)
            acc, m, l = pipeline(carry)
            if warpgroups > 1:
                pl.when(wg == 0)(schedule)
            if st.own_key:  # the own-key logit joins the softmax as one more column
                for i in range(2):
                    plgpu.barrier_wait(own_barriers.at[i * warpgroups + wg])
                k_own, v_own = (own_smem[i].at[wg][...].astype(jnp.float32) for i in range(2))
                s_own, _ = flash_math.own_logits(
                    st, q_smem[...], k_own, jnp.where(row("pos") == CANDIDATE, -1, 1),
                    row("own_poison"), row("mult") if multiplied else None)
                m_new = jnp.maximum(m, s_own)
                shift = jnp.where(m_new == -jnp.inf, 0.0, m_new)
                p_own, alpha = jnp.exp2(s_own - shift), jnp.exp2(m - shift)
                acc = by_row(alpha, acc.shape) * acc + by_row(p_own, acc.shape) * v_own
                l, m = l * alpha + p_own, m_new
            seen = l != 0  # NaN (a poisoned row) counts as seen
            safe_l = jnp.where(seen, l, 1.0)
            q_smem[...] = (acc / by_row(safe_l, acc.shape)).astype(q.dtype)  # out, via SMEM
            lse_smem.at[wg][...] = jnp.where(seen, (m + jnp.log2(safe_l)) * flash_math.LN2,
                                             -jnp.inf)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(q_smem, out_ref.at[bi, rows, h])
            plgpu.copy_smem_to_gmem(lse_smem.at[wg], lse_ref.at[bi, h, rows])
            plgpu.wait_smem_to_gmem(0)

        def step(indices, k_smem, v_smem, key_seg_smem, poison_smem, k_consumed, v_consumed,
                 key_seg_consumed, poison_consumed, carry):
            (t,) = indices
            acc, m, l = carry
            shape = (ROWS, BLOCK_K)

            def qk(acc_ref):
                plgpu.wgmma(acc_ref, qo_smem.at[wg], plgpu.transpose_ref(k_smem, (1, 0)))
                schedule()
                return acc_ref[...]

            s2, _ = flash_math.capped_logits(
                st, pl.run_scoped(qk, plgpu.ACC(shape, jnp.float32)))
            plgpu.barrier_arrive(k_consumed)
            if multiplied:
                s2 = s2 * by_row(row("mult"), shape)
            s2 = s2 + jax.lax.broadcast_in_dim(poison_smem[...], shape, [1])
            plgpu.barrier_arrive(poison_consumed)

            def masked(s2):
                sees = by_row(row("seg"), shape) == jax.lax.broadcast_in_dim(
                    key_seg_smem[...], shape, [1])
                if st.causal:
                    key_pos = (jax.lax.broadcasted_iota(jnp.int32, shape, 1)
                               + index_ref[bi, qb, t] * BLOCK_K)
                    sees &= key_pos <= by_row(row("pos"), shape)
                return jnp.where(sees, s2, -jnp.inf)

            s2 = jax.lax.cond(t < full_ref[bi, qb], lambda s2: s2, masked, s2)
            plgpu.barrier_arrive(key_seg_consumed)
            m_new = jnp.maximum(m, s2.max(axis=1))
            shift = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # a row that has seen nothing
            alpha = jnp.exp2(m - shift)
            p = jnp.exp2(s2 - by_row(shift, shape))
            l = l * alpha + p.sum(axis=1)
            p = p.astype(q.dtype)
            schedule()

            def pv(acc_ref):  # into a fresh accumulator: run_state is not interpreted
                plgpu.wgmma(acc_ref, p, v_smem)
                return acc_ref[...]

            acc = by_row(alpha, acc.shape) * acc + pl.run_scoped(
                pv, plgpu.ACC((ROWS, d), jnp.float32))
            plgpu.barrier_arrive(v_consumed)
            return acc, m_new, l

        def key_block(t):
            return index_ref[bi, qb, t], 0

        def key_row(t):
            return (index_ref[bi, qb, t],)

        pipeline = plgpu.emit_pipeline_warp_specialized(
            step, grid=(count_ref[bi, qb],), max_concurrent_steps=PIPELINE_DEPTH,
            num_compute_wgs=warpgroups, memory_registers=40, wg_axis="wg",
            manual_consumed_barriers=True, compute_context=compute,
            in_specs=[plgpu.BlockSpec(block_shape=(BLOCK_K, d), index_map=key_block)] * 2
            + [plgpu.BlockSpec(block_shape=(BLOCK_K,), index_map=key_row)] * 2,
            out_specs=[])
        pipeline(k_ref.at[bi, :, kv_head, :], v_ref.at[bi, :, kv_head, :],
                 key_seg_ref.at[bi], poison_ref.at[bi, kv_head])

    own_smem = tuple(plgpu.SMEM((warpgroups, ROWS, d), q.dtype) for _ in range(2 * st.own_key))
    scratch = (
        (plgpu.SMEM((warpgroups, ROWS, d), q.dtype), plgpu.SMEM((warpgroups, ROWS), jnp.float32),
         tuple(plgpu.SMEM((warpgroups, ROWS), row_dtypes[n]) for n in row_names), own_smem),
        plgpu.Barrier(num_barriers=warpgroups),
        plgpu.Barrier(num_barriers=warpgroups * len(row_names)),
        plgpu.Barrier(num_barriers=warpgroups * max(1, 2 * st.own_key)),
        plgpu.Barrier(num_arrivals=warpgroups),
    )
    interpret = mosaic_gpu_interpret.interpret_params() if st.interpret else None
    args = [q, k, v, plan.kv_index.astype(jnp.int32), plan.full_count.astype(jnp.int32),
            plan.count.astype(jnp.int32), row_seg, row_pos.astype(jnp.int32), key_seg,
            poison.astype(jnp.float32)] + ([multiplier.astype(jnp.float32)] if multiplied else [])
    return plgpu.kernel(
        kernel,
        out_type=[jax.ShapeDtypeStruct((b, s, hq, d), q.dtype),
                  jax.ShapeDtypeStruct((b, hq, s), jnp.float32)],
        scratch_types=scratch, grid=(hq, n_q, b), grid_names=("heads", "q_block", "batch"),
        num_threads=warpgroups + 1, thread_name="wg",
        compiler_params=plgpu.CompilerParams(
            approx_math=True, lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        interpret=interpret,
    )(*args)


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
    """The forward on Pallas Mosaic GPU for Hopper (sm_90a), warp-specialised and
    block-sparse; the backward on :class:`PallasTriton`'s dq and dk / dv kernels, which take
    its out and lse (Mosaic GPU backward kernels are not written yet).

    Blocks: 128 query rows (two compute warpgroups of 64) x 64 keys, 64 x 64 for sequences
    of at most 64 tokens. Inputs bfloat16 or float16 (wgmma's 16-bit operands; float32 is
    declined, so ``auto`` falls back), head dims up to 128 (padded to 64 or 128 by XLA).

    ``interpret``: False (default) compiles for the GPU; True runs the kernels on any
    backend, CPU included (slow, for tests): the forward in the Mosaic GPU interpreter, its
    warpgroups as threads with the race detector on, the backward in Pallas' interpreter.

    By name (``impl='mosaic_gpu'``) it runs only on a GPU of compute capability 9.0; an
    instance passed as ``impl=`` is not checked, so a CPU-only machine can lower it for CUDA.
    ``impl='auto'`` does not take it yet: no GPU has run it.
    """

    name = "mosaic_gpu"

    def __init__(self, *, interpret: bool = False):
        if not isinstance(interpret, bool):
            raise fail("RA116", f"MosaicGpu interpret={interpret!r}; pass True or False.")
        self.interpret = interpret
        self.triton = PallasTriton(interpret=interpret)

    def platform_reasons(self) -> list[str]:
        if IMPORT_ERROR is not None:
            return [self._no_lowering()]
        reasons = self.triton.platform_reasons()
        if not reasons and not self.interpret:
            capability = getattr(jax.devices()[0], "compute_capability", None)
            if capability != "9.0":
                reasons.append(f"mosaic_gpu: its kernels are for compute capability 9.0 "
                               f"(H100 / H200); this GPU's is {capability}; use "
                               "impl='pallas_triton'")
        return [r.replace("pallas_triton needs", "mosaic_gpu needs") for r in reasons]

    def not_supported_reasons(self, call: AttentionCall) -> list[str]:
        if IMPORT_ERROR is not None:
            return [self._no_lowering()]
        reasons = []
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
        if call.shard_mask is not None:
            reasons.append("mosaic_gpu: its kernels read positions from their indices, so "
                           "they cannot run on one context shard yet; use impl='xla'")
        return reasons + self.triton.not_supported_reasons(call)

    def sizes(self, seq_len: int) -> BlockSizes:
        return plan_sizes(BlockSizes(COMPUTE_WARPGROUPS * ROWS, BLOCK_K), seq_len, ROWS)

    def plan_sizes(self, seq_len: int) -> tuple[BlockSizes, ...]:
        return (self.sizes(seq_len),)

    def __call__(self, call: AttentionCall):
        if self.interpret and isinstance(call.q, jax.core.Tracer) and _under_jit(call.q):
            raise fail("RA128", "MosaicGpu(interpret=True) was called under jax.jit (q is "
                                f"{type(call.q).__name__}); call it eagerly (jax.grad and "
                                "jax.vjp are fine), or use PallasTriton(interpret=True) or "
                                "impl='xla' under jit.")
        base = self.triton.config(call.q.dtype, max(call.q.shape[-1], call.v.shape[-1]),
                                  call.q.shape[2] // call.k.shape[2])
        config = dataclasses.replace(base, block_sizes=BlockSizes(COMPUTE_WARPGROUPS * ROWS,
                                                                 BLOCK_K))
        blocks = None
        if call.plan is not None:
            blocks = call.plan.block_plan(self.sizes(call.q.shape[1]))
        return triton_attention(call.q, call.k, call.v, call.segment_ids, causal=call.causal,
                                scale=call.scale, softcap=call.softcap,
                                softcap_method=call.softcap_method, config=config,
                                block_plan=blocks, interpret=self.interpret,
                                logit_multiplier=call.logit_multiplier, forward=mosaic_forward,
                                head_dim_multiple=HEAD_DIMS[0], smallest_block=ROWS)

    @staticmethod
    def _no_lowering() -> str:
        return (f"mosaic_gpu: this JAX ({jax.__version__}) lacks the Mosaic GPU names its "
                f"kernels need ({IMPORT_ERROR}); use impl='pallas_triton'")

    def __repr__(self) -> str:
        options = " interpret=True" if self.interpret else ""
        return f"<rankattn backend 'mosaic_gpu'{options}>"
