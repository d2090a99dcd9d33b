"""Block-sparse flash attention as Pallas kernels on the Mosaic TPU lowering.

Three kernels, each over a grid (batch, kv head, step) whose first two dimensions are
"parallel" and whose last, "arbitrary", walks a schedule made from a block plan's lists
(:mod:`rankattn.blocks`, :func:`schedule`): per step, the own block (whose output the
program accumulates), the visited DMA block and what to do (open and / or close the own
block; compute each compute block of the DMA block full or masked, or skip it). The
visited side is fetched in DMA blocks of up to 4 compute blocks (512 tokens by default,
:data:`TARGETS`, :func:`dma_lists`), as splash attention's block_kv is apart from its
block_kv_compute: a quarter of the steps and their fixed cost, each DMA larger. The
schedule is scalar prefetch (SMEM; int16 while the indices fit, :func:`list_dtype`), so
the BlockSpec index maps fetch only the listed blocks. For a plan prepared by
:func:`rankattn.plan` and closed over, the grid is a step per visited DMA block plus one
per own block that visits nothing (a step that only writes its output), for the longest
batch row; under jit with traced segment ids it is the worst case, every pair of an own
block and a DMA block (steps past a list's count repeat its last block: no DMA, nothing
computed, but the pipeline's per-step overhead). Batches whose schedules exceed the
generation's SMEM budget run as several calls of fewer rows or own blocks:

* forward, own blocks the query blocks: the online softmax over the key blocks of
  ``kv_index[b, i]`` in order, full ones without mask arithmetic, partial ones masked
  (from segment-id vectors, :func:`rankattn.semantics.sees_history`); at the own block's
  last step the candidates' own-key logit joins as one more column and out / lse are
  written.
* dq, the same schedule, recomputing p from the saved log-sum-exp.
* dk / dv, own blocks the key blocks, over the transposed lists ``q_index[b, j]`` (the
  query blocks that see key block j): each own block's dk and dv are accumulated by
  consecutive steps of one program, so there are no atomics and the result is
  deterministic. It works key-major, ``s^T = k q^T`` (as splash attention does), so no
  product contracts a transposed operand.

Layout. rankattn's arrays are [B, S, H, D]; a TPU block's last two dimensions must be
multiples of (8, 128) or the whole axis, so a [bq, G, D] block of the G query heads of
one kv head is illegal unless G is a multiple of 8. The kernels therefore run head-major:
q as [B, Hkv, G, S, D], k / v as [B, Hkv, S, D], and a query block holds all G query
heads of its kv head, ``[G, bq, D]``, flattened in the kernel to ``[G * bq, D]`` rows (a
free reshape: bq is a multiple of 8) so that one MXU matmul serves the whole group and
K / V are read once per group (GQA without repeating K / V). The transposes in and out
are XLA ops outside the kernels; on a TPU they cost nothing for q, out, dO and dq, since XLA
lays a [B, S, H, D] array out head-major in HBM (``{3,1,2,0}``), so the view is a bitcast.
Blocks of the caller's [B, S, H * D] instead (G * D lanes a block) measured worse:
deviceless v5e, B=4 S=4096, temp HBM 2.2x the arguments against 0.2x, the reshape being
the copy there. q, k, v and dO are never padded or cleaned by XLA (each would be a copy as
large as q): a ragged last block reads past the array's end, and the kernels zero those
rows and any non-finite entry as they read (:func:`_q_rows`, :func:`_kv_rows`,
:func:`_d_out_rows`); the per-position rows alone are padded. Head dims are never padded: a block
spans the whole head dim, legal whatever its size, and Mosaic pads the lanes in VMEM only,
so D = 64 moves and multiplies 64 columns, not 128 (deviceless compiles for v5e, v6e and
TPU7x pass at D = 8, 48, 64, 80, 96, 128, 200 and 256).
Per-position vectors are lane-dense rows in HBM and in the pipeline's buffers: segment ids
[B, 1, S], key poison [B, Hkv, 1, S], lse, delta and the logit multiplier [B, Hkv, G, S]
(a [S, 1] column would be tiled (8, 128) on TPU: 128 times its size). Where a kernel needs
one value per logit row it turns its block's row into a column in VMEM
(:func:`_column`, :func:`_group_column`); the forward writes lse back as rows.

Numerics: float32 operands are multiplied at ``precision=HIGHEST`` (Mosaic's default for
float32 is one bf16 MXU pass); bfloat16 operands feed the MXU with float32 accumulation.
Logits are scaled and capped in float32 and the softmax runs in base 2
(:mod:`rankattn.backends.flash_math`); p is cast to the value dtype for the PV product
and ds to the query / key dtype for the dq / dk products. Rows that see no key get out
0, lse -inf and zero gradients; non-finite inputs poison exactly the rows of
:mod:`rankattn.semantics`.

The candidates' own key is one extra logit per row, never a visited block. Under
``rankattn.Sharding`` the kernels run per batch / heads shard, and as the per-shard kernel
of context sharding (``takes_shard_mask``: a :class:`rankattn.semantics.ShardMask` brings
the keys' segment ids and every token's position, read as [B, 1, S] rows in place of the
indices); Phoenix's causal drop-ins go through that path.

JAX: built and tested with 0.10.2. It needs ``pltpu.PrefetchScalarGridSpec``,
``pltpu.CompilerParams`` and ``pltpu.InterpretParams`` (older JAX spelled the last two
``TPUCompilerParams`` / ``TPUInterpretParams``); where one is missing the backend declines
with the reason instead of failing at import.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from rankattn import semantics
from rankattn.backends import flash_math
from rankattn.backends.base import Backend, first_derivatives_only
from rankattn.blocks import (BlockPlan, BlockSizes, check_block_sizes, pad_axis1, round_up,
                             segments_and_plan)
from rankattn.errors import fail
from rankattn.validate import AttentionCall, concrete, is_positive_int

# Pallas TPU names moved between JAX versions (TPUCompilerParams became CompilerParams); the
# backend declines with the missing names rather than failing at import.
NEEDED_NAMES = ("PrefetchScalarGridSpec", "CompilerParams", "InterpretParams")
try:
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import tpu as pltpu
    MISSING = [name for name in NEEDED_NAMES if not hasattr(pltpu, name)]
    IMPORT_ERROR = f"jax.experimental.pallas.tpu lacks {', '.join(MISSING)}" if MISSING else None
except ImportError as error:  # pragma: no cover - depends on the installed JAX
    pl = pltpu = None
    IMPORT_ERROR = str(error)

SUBLANES = 8  # a TPU block's second-to-last dim: a multiple of 8 (or the whole axis)
LANES = 128  # a TPU block's last dim: a multiple of 128 (or the whole axis)
SUPPORTED_DTYPES = (jnp.float32, jnp.bfloat16)


# --- The kernels' configuration per TPU generation. ---------------------------------


@dataclasses.dataclass(frozen=True)
class TpuTarget:
    """The TPU generation the kernels are configured for.

    ``block_sizes``: query x key compute blocks (multiples of 128: both index lane-dense
    rows). ``dma_block``: the tokens of a visited block as the pipeline fetches it, one DMA
    holding up to :data:`MAX_SUB_BLOCKS` compute blocks (:func:`sub_blocks`): the key
    blocks the forward and dq visit, the query blocks dk / dv visit.
    ``smem_budget``: bytes of scalar prefetch (the plan lists) one kernel call may hold;
    larger batches are split into calls of fewer rows (:func:`rows_per_call`), longer rows
    into calls over ranges of blocks (:func:`_call`).
    ``vmem_limit_bytes``: the scoped VMEM limit asked of Mosaic, or None for its default.
    """

    name: str
    block_sizes: BlockSizes
    smem_budget: int
    vmem_limit_bytes: int | None = None
    dma_block: int = 512

    def __post_init__(self):  # the checks PallasTpu's own block_sizes= and dma_block= get
        where = f"TpuTarget({self.name!r}, ...)"
        if not isinstance(self.block_sizes, BlockSizes):
            raise fail("RA116", f"{where} block_sizes={self.block_sizes!r}; pass the "
                                "generation's BlockSizes(block_q, block_k), e.g. "
                                "BlockSizes(128, 256).")
        check_tpu_blocks(self.block_sizes, where)
        check_dma_block(self.dma_block, where, "")
        if not is_positive_int(self.smem_budget):
            raise fail("RA116", f"{where} smem_budget={self.smem_budget!r}; pass the bytes of "
                                "scalar prefetch one call may hold, e.g. 512 << 10.")
        if self.vmem_limit_bytes is not None and not is_positive_int(self.vmem_limit_bytes):
            raise fail("RA116", f"{where} vmem_limit_bytes={self.vmem_limit_bytes!r}; pass "
                                "None (Mosaic's default) or a positive int, e.g. 32 << 20.")


def check_tpu_blocks(block_sizes: BlockSizes, where: str) -> None:
    """RA116 unless both blocks are multiples of the sublanes and one divides the other."""
    bq, bk = block_sizes.block_q, block_sizes.block_k
    if bq % SUBLANES or bk % SUBLANES or (max(bq, bk) % min(bq, bk)):
        raise fail("RA116", f"{where} block_sizes=({bq}, {bk}); blocks must be multiples of "
                            f"{SUBLANES}, one dividing the other, e.g. BlockSizes(128, 256) "
                            "(block_k a multiple of 128 on a TPU).")


def check_dma_block(dma_block, where: str, alternative: str) -> None:
    """RA116 unless ``dma_block`` is a positive multiple of the sublanes (``alternative``: what
    else the message may offer, e.g. "None (the target's) or ")."""
    if not is_positive_int(dma_block) or dma_block % SUBLANES:
        raise fail("RA116", f"{where} dma_block={dma_block!r}; pass {alternative}a positive "
                            f"multiple of {SUBLANES} tokens, e.g. 512 (a multiple of the "
                            "blocks; a multiple of 128 on a TPU).")


# Blocks per generation (benchmarks/TPU_COMPILE.md: all 144 configurations of float32 /
# bfloat16 x D 64 / 128 / 256 x GQA 1 / 5 x causal x cap compile deviceless, forward and
# backward). Compute blocks: 128 query rows per head, the G heads of a group making G * 128
# MXU rows; keys 128 on v5e (128 x 128 MXUs), 256 on v6e and TPU7x (256 x 256 MXUs, so a
# [rows, 256] logit tile fills one). DMA blocks: 512 tokens everywhere (4 compute blocks on
# v5e, 2 of v6e's keys), a quarter of the grid steps of 128-token fetches, chosen from VMEM:
# the largest plan, float32 D = 256 GQA 5, is 13.9 MiB on v5e and 17.7 MiB on v6e / TPU7x
# (bf16 D = 128 GQA 5, Phoenix's: 3.6 / 4.7 MiB). v6e and TPU7x compile it within Mosaic's
# default scoped VMEM; v5e's 16 MiB default fails it once Mosaic's temporaries join the plan
# (CompileTimeScopedVmemOom), so v5e asks 32 MiB of its 128 MiB; 1024-token DMA blocks
# would double the visited blocks' share and waste more of each fetch on a causal diagonal.
# No TPU has timed them. The list budget is half of each generation's 1 MiB SMEM
# (pltpu.get_tpu_info_for_chip), leaving room for Mosaic's own.
TARGETS = {
    "v5e": TpuTarget("v5e", BlockSizes(128, 128), smem_budget=512 << 10,
                     vmem_limit_bytes=32 << 20),
    "v6e": TpuTarget("v6e", BlockSizes(128, 256), smem_budget=512 << 10),
    "tpu7x": TpuTarget("tpu7x", BlockSizes(128, 256), smem_budget=512 << 10),
}
# Lowering without a TPU and without a named target: the smallest generation's settings.
PORTABLE_TARGET = TARGETS["v5e"]
# device_kind spellings -> table entry (other generations take the portable settings).
DEVICE_KINDS = {"v5 lite": "v5e", "v5e": "v5e", "v6 lite": "v6e", "v6e": "v6e", "7x": "tpu7x"}


def target_of(spec) -> TpuTarget:
    """A TpuTarget from itself or its name ("v5e", "v6e", "tpu7x")."""
    if isinstance(spec, TpuTarget):
        return spec
    if not isinstance(spec, str) or spec not in TARGETS:  # a list is not even hashable
        raise fail("RA116", f"PallasTpu target={spec!r}; pass one of "
                            f"{', '.join(map(repr, TARGETS))} or a TpuTarget(name, "
                            "block_sizes, smem_budget) for another generation.")
    return TARGETS[spec]


def plan_sizes(sizes: BlockSizes, seq_len: int) -> BlockSizes:
    """The blocks of a call of ``seq_len`` tokens: ``sizes``, or for a sequence no longer
    than a query block one block of ``round_up(seq_len, 8)`` each way (a whole axis is a
    legal TPU block whatever its length, so short calls compute no padding)."""
    whole = round_up(seq_len, SUBLANES)
    if whole <= sizes.block_q:
        return BlockSizes(whole, whole)
    return sizes


def list_dtype(n_q: int, n_k: int):
    """The plan lists' dtype in SMEM: int16 while block indices and counts fit (below 32768
    blocks a side; splash attention shrinks its lists alike), else int32. Kernels and index
    maps read them as int32 (index maps must return int32)."""
    return jnp.int16 if max(n_q, n_k) <= jnp.iinfo(jnp.int16).max else jnp.int32


def list_bytes(n_own: int, n_visits: int, dtype) -> int:
    """SMEM bytes of one batch row's schedule (:func:`schedule`) for ``n_own`` blocks whose
    lists hold at most ``n_visits`` entries: three arrays of up to n_own * n_visits steps,
    in ``dtype`` (:func:`list_dtype`)."""
    return jnp.dtype(dtype).itemsize * 3 * n_own * n_visits


def rows_per_call(batch: int, lists, budget: int) -> int:
    """How many batch rows one kernel call takes so its plan lists fit ``budget`` bytes (at
    least one: :func:`_call` splits a row's blocks further); ``lists``: each kernel's
    (own blocks, visited DMA blocks) per row."""
    per_row = max(list_bytes(n_own, n_visits, list_dtype(n_own, n_visits))
                  for n_own, n_visits in lists)
    return max(1, min(batch, budget // per_row))


@dataclasses.dataclass(frozen=True)
class _Static:
    """Everything that selects the compiled kernels."""

    causal: bool
    scale: float
    softcap: float | None
    softcap_method: str
    own_key: bool     # self-attention with a mask: candidates add their own key
    positions: bool   # a ShardMask's positions (two more inputs), not the tokens' indices
    multiplied: bool  # a logit multiplier per query row (one more input)
    block_q: int      # the compute blocks (the own blocks too)
    block_k: int
    group: int        # query heads per kv head
    q_len: int        # the queries' and keys' true lengths: a ragged last block reads past
    kv_len: int       # them (unspecified memory), which the kernels zero
    interpret: Any    # False, True or a pltpu.InterpretParams (hashable)
    vmem_limit_bytes: int | None
    smem_budget: int  # bytes of plan lists per kernel call (see _call)
    q_sub: int = 1    # query blocks per DMA block (dk / dv visit them; sub_blocks)
    k_sub: int = 1    # key blocks per DMA block (forward and dq visit them)
    count_visits: bool = False  # the forward also outputs visits per query block (tests)
    q_ranges: tuple = ()  # the query blocks of each forward / dq call (call_ranges)
    k_ranges: tuple = ()  # the key blocks of each dk / dv call

    @property
    def dma_q(self) -> int:
        return self.q_sub * self.block_q

    @property
    def dma_k(self) -> int:
        return self.k_sub * self.block_k

    def launch(self, name: str):
        semantics_ = ("parallel", "parallel", "arbitrary")
        return dict(interpret=self.interpret, name=name,
                    compiler_params=pltpu.CompilerParams(
                        dimension_semantics=semantics_, vmem_limit_bytes=self.vmem_limit_bytes))


# --- Pieces shared by the three kernels. --------------------------------------------


def _dot(a, b, contract):
    """2-D dot with float32 accumulation; float32 operands at HIGHEST precision (the MXU's
    exact float32 passes, not Mosaic's default single bf16 pass). ``contract``: the
    contracted axes of a and b, (1, 0) for a b, (1, 1) for a b^T (no kernel contracts a
    transposed lhs: the dk / dv kernel works key-major instead)."""
    precision = jax.lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
    return jax.lax.dot_general(a, b, (((contract[0],), (contract[1],)), ((), ())),
                               precision=precision, preferred_element_type=jnp.float32)


NN, NT = (1, 0), (1, 1)


# A step's code in the schedule (:func:`schedule`): whether it opens and / or closes its own
# block (initialises the accumulators; finishes and writes them), and what it computes in
# each compute block of its visited DMA block, two bits each from KIND_SHIFT on.
FIRST, LAST = 1, 2
OVERFLOW = 4  # with LAST: the own block's list was longer than max_visits, its results NaN
SKIP, FULL, PARTIAL = 0, 1, 2  # nothing; a full block (no mask arithmetic); a masked one
KIND_SHIFT, KIND_BITS = 3, 2
# Compute blocks per DMA block, at most: their kinds and the flags share one int16 code.
MAX_SUB_BLOCKS = 4


def sub_blocks(dma_block: int, block: int, n_blocks: int) -> int:
    """How many compute blocks of ``block`` tokens one DMA block of about ``dma_block``
    tokens holds: at least 1, at most :data:`MAX_SUB_BLOCKS` and ``n_blocks`` (a sequence
    shorter than a DMA block takes one DMA block of its compute blocks)."""
    return max(1, min(MAX_SUB_BLOCKS, dma_block // block, n_blocks))


def kinds_code(kinds):
    """Per compute block kinds [..., f] (SKIP / FULL / PARTIAL) as one code [...]."""
    shifts = KIND_SHIFT + KIND_BITS * np.arange(kinds.shape[-1])
    return (kinds << shifts).sum(-1)


def dma_lists(index, full, count, factor: int):
    """One direction's block lists (index [B, nOwn, V], full and count [B, nOwn]: a
    :class:`BlockPlan`'s, every list a permutation of the V visitable blocks) over DMA blocks
    of ``factor`` of them: (index [B, nOwn, W], code [B, nOwn, W], count [B, nOwn]) with
    W = ceil(V / factor); per own block the DMA blocks holding a visited block, in order,
    each with its compute blocks' kinds (:func:`kinds_code`), then the others (code 0).
    Sorts only (no gather: a gather's [..., n, 1] indices would be padded 128-fold on TPU)."""
    batch, n_own, width = index.shape
    place = jnp.argsort(index, axis=-1)  # each visitable block's place in its list
    kind = jnp.where(place < full[..., None], FULL,
                     jnp.where(place < count[..., None], PARTIAL, SKIP)).astype(jnp.int32)
    n_dma = -(-width // factor)
    kind = jnp.pad(kind, [(0, 0), (0, 0), (0, n_dma * factor - width)])
    code = kinds_code(kind.reshape(batch, n_own, n_dma, factor))
    unvisited = (code == 0).astype(jnp.int32)
    dma = jnp.broadcast_to(jnp.arange(n_dma, dtype=jnp.int32), code.shape)
    _, dma, code = jax.lax.sort((unvisited, dma, code), dimension=2, num_keys=1)
    return dma, code, (1 - unvisited).sum(-1, dtype=jnp.int32)


def schedule(index, code, count, max_visits: int | None = None):
    """The flattened grid of one direction's DMA block lists (:func:`dma_lists`: index and
    code [B, nOwn, W], count [B, nOwn]) as (own block, visited DMA block, step code)
    [B, steps] int32; a step's code is its visited block's (the kinds of its compute
    blocks) plus FIRST and / or LAST.

    Where the lists are known now (a plan prepared by :func:`rankattn.plan` and closed
    over, or an eager call), numpy arrays, compact: per batch row, every own block's visits
    in order, one step each, and one step computing nothing for an own block whose list is
    empty (it still opens and closes it, so its output is written); rows shorter than the
    longest repeat their last step (the same block indices: the pipeline fetches nothing,
    and nothing is computed). Steps: the longest row's visits plus its empty own blocks.
    Where traced (under jit), the worst case: W steps per own block, or ``max_visits``
    where given, the ones past its count repeating its last visited block; an own block
    whose list is longer than ``max_visits`` visits its first ``max_visits`` blocks and
    its last step carries OVERFLOW (the kernels write NaN results for it: never a silently
    partial sum). Computed with broadcasts and reductions only, so no gather leaves a
    [..., n, 1] index array (TPU pads it 128-fold) around the kernels."""
    known = [concrete(x) for x in (index, code, count)]
    if all(x is not None for x in known):
        return _compact_schedule(*(np.asarray(x, np.int64) for x in known))
    batch, n_own, width = index.shape
    width = width if max_visits is None else min(width, max_visits)
    index, code = index[..., :width], code[..., :width]
    count = count.astype(jnp.int32)[..., None]
    t = jnp.arange(width, dtype=jnp.int32)
    steps = jnp.minimum(jnp.maximum(count, 1), width)  # the steps that open, visit, close
    last_entry = jnp.sum(jnp.where(t == jnp.maximum(jnp.minimum(count, width) - 1, 0), index,
                                   0), axis=-1, keepdims=True)
    visit = jnp.where(t < count, index, last_entry).astype(jnp.int32)
    closes = t == steps - 1
    code = (jnp.where(t < count, code, 0) + FIRST * (t == 0) + LAST * closes
            + OVERFLOW * (closes & (count > width)))
    own = jnp.broadcast_to(jnp.arange(n_own, dtype=jnp.int32)[:, None], (n_own, width))
    return tuple(jnp.broadcast_to(x, (batch, n_own, width)).reshape(batch, n_own * width)
                 for x in (own, visit, code))


def _compact_schedule(index, code, count):
    """:func:`schedule` of known lists (numpy int64)."""
    batch, n_own, width = index.shape
    per_block = np.maximum(count, 1)
    end = np.cumsum(per_block, axis=1)
    start = end - per_block
    total = end[:, -1:]
    steps = int(total.max())
    step = np.minimum(np.arange(steps)[None], total - 1)  # past a row's total: its last step
    # The own block of each step: how many own blocks after the first begin at or before it.
    own = np.stack([np.searchsorted(start[b, 1:], step[b], side="right") for b in range(batch)])

    def own_blocks(x):
        return np.take_along_axis(x, own, axis=1)

    def entries(x):
        return np.take_along_axis(x.reshape(batch, -1), entry, axis=1)

    t = step - own_blocks(start)
    n = own_blocks(count)
    entry = own * width + np.minimum(t, np.maximum(n - 1, 0))
    visit = entries(index)
    step_code = (np.where(t < n, entries(code), 0) + FIRST * (t == 0)
                 + LAST * (t == own_blocks(per_block) - 1))
    step_code = np.where(np.arange(steps)[None] < total, step_code, 0)
    return tuple(x.astype(np.int32) for x in (own, visit, step_code))


def call_ranges(batch: int, n_own: int, n_visits: int, budget: int) -> list[range]:
    """The own blocks each kernel call takes so that its schedule (worst case, every own
    block visiting ``n_visits`` blocks) fits ``budget`` bytes of SMEM (at least one)."""
    per_block = batch * list_bytes(1, n_visits, list_dtype(n_own, n_visits))
    per_call = max(1, min(n_own, budget // per_block))
    return [range(start, min(start + per_call, n_own)) for start in range(0, n_own, per_call)]


class Schedules(NamedTuple):
    """The kernels' grids (scalar prefetch), one (own, visit, code, offset) per call:
    ``queries`` for the forward and dq (own blocks: query blocks; visits: key DMA blocks),
    ``keys`` for dk / dv (own: key blocks; visits: query DMA blocks); offset [1] int32 is
    the call's first own block."""

    queries: tuple
    keys: tuple


def schedules(plan: BlockPlan, budget: int, max_visits: int | None, q_sub: int, k_sub: int):
    """(:class:`Schedules`, the query-block ranges, the key-block ranges): the
    :func:`schedule` of each kernel call (:func:`call_ranges`) of ``plan``, over DMA blocks
    of ``k_sub`` key blocks (forward, dq) and ``q_sub`` query blocks (dk / dv);
    ``max_visits`` bounds a traced plan's schedule (:func:`schedule`)."""
    lists = (plan.kv_index, plan.full_count, plan.count, plan.q_index, plan.q_full_count,
             plan.q_count)
    traced = any(concrete(x) is None for x in lists)

    def calls(index, full, count, factor):
        with jax.ensure_compile_time_eval():  # known lists stay known (numpy schedules)
            index, code, count = dma_lists(index, full, count, factor)
        batch, n_own, width = index.shape
        dtype = list_dtype(n_own, width)
        bound = min(width, max_visits) if traced and max_visits is not None else width
        ranges = call_ranges(batch, n_own, bound, budget)
        return tuple(
            tuple(jnp.asarray(x, dtype) for x in schedule(
                *(x[:, r.start:r.stop] for x in (index, code, count)), max_visits))
            + (jnp.array([r.start], jnp.int32),)
            for r in ranges), tuple(ranges)

    queries, q_ranges = calls(*lists[:3], k_sub)
    keys, k_ranges = calls(*lists[3:], q_sub)
    return Schedules(queries, keys), q_ranges, k_ranges


def _column(row):
    """A lane-dense row [1, n] as the column [n, 1] that broadcasts against [n, keys]
    logits (a relayout in VMEM: HBM and the pipeline's buffers hold the row)."""
    return row[0][:, None]


def _head_columns(rows):
    """The group's per-row values [G, n] (one lane-dense row per head) as columns
    [G, n, 1], against the group's [G, n, c] blocks."""
    return rows[:, :, None]


def _group_column(rows):
    """The group's per-row values [G, n] as the column [G * n, 1] of the group's logit
    rows (:func:`_rows`): head by head (Mosaic casts [n] to [n, 1], but not [G, n, 1] to
    [G * n, 1])."""
    return jnp.concatenate([row[:, None] for row in rows], axis=0)


def _group_row(rows):
    """The group's per-row values [G, n] as one row [1, G * n], the lanes of the dk / dv
    kernel's transposed logits (head by head, as :func:`_rows` stacks them)."""
    return jnp.concatenate([rows[g:g + 1] for g in range(rows.shape[0])], axis=1)


def _finite_rows(x, first, length: int, rows_per_head: int):
    """x [G * n, W] (a group's heads, head by head, or one head's [n, W]) with its non-finite
    entries zero, and the rows at positions from ``length`` on too: a ragged last block
    reads past the array's end (unspecified memory). Row r sits at position
    first + r % n. The kernels read q, k and v as the caller gave them; the rows a
    non-finite entry poisons are made NaN by the keys' poison and semantics.poison_rows."""
    ok = jnp.abs(x) < jnp.inf  # false for inf and NaN
    if length % rows_per_head:
        position = first + jax.lax.broadcasted_iota(jnp.int32, (rows_per_head, 1), 0)
        position = jnp.concatenate([position] * (x.shape[0] // rows_per_head), axis=0)
        ok = ok & (position < length)
    return jnp.where(ok, x, jnp.zeros((), x.dtype))


def _sub(c: int, n: int) -> slice:
    """The rows of compute block c (``n`` tokens) within a DMA block: a static slice."""
    return slice(c * n, (c + 1) * n)


def _q_rows(st: _Static, ref, first, part=slice(None)):
    """The rows ``part`` of the q block [G, n, D], whose first position is ``first``, as
    finite rows [G * rows, D]."""
    x = ref[:, part, :]
    return _finite_rows(_rows(x), first, st.q_len, x.shape[1])


def _kv_rows(st: _Static, ref, first, part=slice(None)):
    """The rows ``part`` of the k or v block [n, W], whose first is at ``first``, finite."""
    x = ref[part, :]
    return _finite_rows(x, first, st.kv_len, x.shape[0])


def _d_out_rows(st: _Static, ref, lse_column, part=slice(None)):
    """The rows ``part`` of the dO block as rows [G * rows, Dv], zero in the rows whose
    saved lse is +inf (rows that pass no gradient and those past the queries' end:
    :func:`_attention_bwd`), so that p = 0 there meets a finite dO."""
    return jnp.where(lse_column == jnp.inf, 0, _rows(ref[:, part, :])).astype(ref.dtype)


def _mask(st: _Static, r: dict, q_start, k_start, q_part=slice(None), k_part=slice(None),
          keys_major: bool = False):
    """The history part of the mask (rankattn.semantics) for a pair of compute blocks, bool
    [bq, bk], from the lanes ``q_part`` and ``k_part`` of the kernel's segment-id refs seg_q
    and seg_k (lane-dense rows [1, n]: a DMA block's hold several compute blocks) and
    either the position refs pos_q / pos_k (a ShardMask's) or the blocks' first indices.
    ``keys_major``: the transposed mask of the group, [bk, G * bq] (keys on rows, the
    queries of each head on lanes), built at that width: Mosaic cannot concatenate bool
    vectors at lane offsets that are not multiples of 128."""
    if st.positions:
        pos_q, pos_k = r["pos_q"][:, q_part], r["pos_k"][:, k_part]
    else:
        pos_q = q_start + jax.lax.broadcasted_iota(jnp.int32, (1, st.block_q), 1)
        pos_k = k_start + jax.lax.broadcasted_iota(jnp.int32, (1, st.block_k), 1)
    seg_q, seg_k = r["seg_q"][:, q_part], r["seg_k"][:, k_part]
    if keys_major:
        def tiled(row):
            return jnp.concatenate([row] * st.group, axis=1)
        return semantics.sees_history(tiled(seg_q), _column(seg_k), tiled(pos_q),
                                      _column(pos_k), st.causal)
    return semantics.sees_history(_column(seg_q), seg_k, _column(pos_q), pos_k, st.causal)


def _segment_names(st: _Static) -> list[str]:
    """The kernels' first refs: segment ids, then a ShardMask's positions."""
    return ["seg_q", "seg_k"] + ["pos_q", "pos_k"] * st.positions


def _segment_specs(st: _Static, seg, queries_visited: bool):
    """(BlockSpecs, arrays) of ``seg`` (seg_q and seg_k [B, 1, S] and, with st.positions,
    pos_q / pos_k alike): the query side at the program's own block and the key side at the
    visited DMA block, or the other way round (dk / dv)."""
    q_side = _spec(st, "seg_row", st.dma_q if queries_visited else st.block_q,
                   visited=queries_visited)
    k_side = _spec(st, "seg_row", st.block_k if queries_visited else st.dma_k,
                   visited=not queries_visited)
    return [q_side, k_side] * (len(seg) // 2), list(seg)


def _masked(st: _Static, s2, mask):
    """Logits [G * bq, bk] with the pairs outside ``mask`` [bq, bk] (each head alike) -inf."""
    rows, keys = s2.shape
    grouped = s2.reshape(st.group, rows // st.group, keys)
    return jnp.where(mask[None], grouped, -jnp.inf).reshape(rows, keys)


def _rows(x):
    """[G, n, c] -> [G * n, c]: the group's heads as one matrix of rows."""
    return x.reshape(x.shape[0] * x.shape[1], x.shape[2])


def _named(names, refs):
    """The kernel's refs by name (their order is the pallas_call's)."""
    assert len(names) == len(refs), (names, len(refs))
    return dict(zip(names, refs))


class _Step:
    """This grid step's entry of the schedule (:func:`schedule`), read from the scalar
    prefetch: the batch row, the own block (its index within this call, ``own``, and in
    the whole sequence, ``block``), the visited block, and what to do."""

    def __init__(self, own_ref, visit_ref, code_ref, offset_ref):
        self.b, p = pl.program_id(0), pl.program_id(2)
        self.own = own_ref[self.b, p].astype(jnp.int32)
        self.block = offset_ref[0] + self.own
        self.visit = visit_ref[self.b, p].astype(jnp.int32)  # a DMA block
        self.code = code_ref[self.b, p].astype(jnp.int32)
        self.first, self.last = (self.code & FIRST) != 0, (self.code & LAST) != 0
        self.overflow = (self.code & OVERFLOW) != 0  # its results NaN (schedule's max_visits)

    def nan_if_overflow(self, x):
        """x, or NaN throughout where this own block's list overran max_visits."""
        return jnp.where(self.overflow, jnp.nan, x)

    def visits(self, visit, n_sub: int):
        """Run ``visit(c, masked)`` for each of the visited DMA block's ``n_sub`` compute
        blocks c that this step computes, full or partial (unrolled: the slices of the DMA
        block stay static)."""
        for c in range(n_sub):
            kind = (self.code >> (KIND_SHIFT + KIND_BITS * c)) & (2 ** KIND_BITS - 1)
            pl.when(kind == FULL)(functools.partial(visit, c, False))
            pl.when(kind == PARTIAL)(functools.partial(visit, c, True))


# The operands' layouts (module docstring): name -> (the block shape holding ``rows``
# sequence positions of ``width`` features, the block indices of batch row b, kv head h and
# sequence block n). Per-position vectors are lane-dense rows (``*_row``): TPU tiles an
# array's last two dims by (8, 128), so a [S, 1] column would take 128 times its size.
LAYOUTS = {
    "seg_row": (lambda st, rows, width: (None, 1, rows),      # [B, 1, S]
                lambda b, h, n: (b, 0, n)),
    "group": (lambda st, rows, width: (None, None, st.group, rows, width),  # [B, Hkv, G, S, C]
              lambda b, h, n: (b, h, 0, n, 0)),
    "group_row": (lambda st, rows, width: (None, None, st.group, rows),  # [B, Hkv, G, S]
                  lambda b, h, n: (b, h, 0, n)),
    "kv": (lambda st, rows, width: (None, None, rows, width),  # [B, Hkv, S, C]
           lambda b, h, n: (b, h, n, 0)),
    "kv_row": (lambda st, rows, width: (None, None, 1, rows),  # [B, Hkv, 1, S]
               lambda b, h, n: (b, h, 0, n)),
}


def _spec(st: _Static, layout: str, rows: int, width: int = 1, visited: bool = False,
          output: bool = False):
    """The BlockSpec of an operand in ``layout`` for a grid (b, kv head, step p) with the
    scalar prefetch of :func:`_call` (the schedule's own block, visited block and code
    [B, steps], the first own block's offset): an input blocked at step p's own block
    (offset + own), or with ``visited`` at its visited block; an ``output`` at own (each
    call writes its own blocks)."""
    shape, place = LAYOUTS[layout]
    if visited:
        def index_map(b, h, p, own_ref, visit_ref, code_ref, offset_ref):
            return place(b, h, visit_ref[b, p].astype(jnp.int32))
    elif output:
        def index_map(b, h, p, own_ref, visit_ref, code_ref, offset_ref):
            return place(b, h, own_ref[b, p].astype(jnp.int32))
    else:
        def index_map(b, h, p, own_ref, visit_ref, code_ref, offset_ref):
            return place(b, h, offset_ref[0] + own_ref[b, p].astype(jnp.int32))
    return pl.BlockSpec(shape(st, rows, width), index_map)


def _call(st: _Static, kernel, name: str, calls, ranges, grid, in_specs, out_specs,
          out_shape, scratch, args, row_axes=None):
    """pallas_call over the grid ``grid`` (b, kv head) x the steps of a schedule, once per
    entry of ``calls`` (:class:`Schedules`: the scalar prefetch) over the own blocks of
    ``ranges`` (:func:`call_ranges`, so each schedule fits ``st.smem_budget``), each
    writing its rows; concatenates the outputs (``out_shape`` sized for every own block,
    the last one possibly ragged; their rows on the axes ``row_axes``, by default each
    output's second to last)."""
    row_axes = [x.ndim - 2 for x in out_shape] if row_axes is None else row_axes
    parts = []
    for prefetch, own in zip(calls, ranges, strict=True):
        start, count = own.start, len(own)
        shapes = []
        for x, a, spec in zip(out_shape, row_axes, out_specs):
            block = spec.block_shape[a]  # the last block may be ragged: rows end at x's
            rows = min(count * block, x.shape[a] - start * block)
            shapes.append(jax.ShapeDtypeStruct(x.shape[:a] + (rows,) + x.shape[a + 1:], x.dtype))
        grid_spec = pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=4, grid=grid + (prefetch[0].shape[1],), in_specs=in_specs,
            out_specs=out_specs, scratch_shapes=scratch)
        parts.append(pl.pallas_call(functools.partial(kernel, st=st), grid_spec=grid_spec,
                                    out_shape=shapes, **st.launch(name))(*prefetch, *args))
    return [jnp.concatenate(outs, axis=a) for outs, a in zip(zip(*parts), row_axes)]


# --- Forward. -----------------------------------------------------------------------


def _forward_kernel(own_ref, visit_ref, code_ref, offset_ref, *refs, st: _Static):
    names = _segment_names(st) + ["q", "k", "v", "poison"]
    names += ["k_own", "v_own", "poison_own"] * st.own_key + ["mult"] * st.multiplied
    names += ["out", "lse"] + ["visits"] * st.count_visits + ["m", "l", "acc"]
    r = _named(names, refs)
    step = _Step(own_ref, visit_ref, code_ref, offset_ref)
    mult = _group_column(r["mult"][...]) if st.multiplied else None  # [G * bq, 1]

    @pl.when(step.first)
    def _():
        r["m"][...] = jnp.full(r["m"].shape, -jnp.inf, jnp.float32)
        r["l"][...] = jnp.zeros(r["l"].shape, jnp.float32)
        r["acc"][...] = jnp.zeros(r["acc"].shape, jnp.float32)
        if st.count_visits:
            r["visits"][...] = jnp.zeros(r["visits"].shape, jnp.int32)

    q_start = step.block * st.block_q

    def visit(c: int, masked: bool):
        part, k_start = _sub(c, st.block_k), step.visit * st.dma_k + c * st.block_k
        q = _q_rows(st, r["q"], q_start)
        k, v = (_kv_rows(st, r[n], k_start, part) for n in ("k", "v"))
        s2, _ = flash_math.capped_logits(st, _dot(q, k, NT))
        s2 = flash_math.times(s2, mult) + r["poison"][:, part]  # NaN: keys with non-finite k, v
        if masked:
            s2 = _masked(st, s2, _mask(st, r, q_start, k_start, k_part=part))
        r["acc"][...], r["m"][...], r["l"][...] = flash_math.online_softmax_step(
            s2, v, r["m"][...], r["l"][...], r["acc"][...], lambda p, v: _dot(p, v, NN))
        if st.count_visits:
            r["visits"][...] += 1

    step.visits(visit, st.k_sub)

    @pl.when(step.last)
    def _():
        acc, m, l = r["acc"][...], r["m"][...], r["l"][...]
        if st.own_key:  # the own-key logit joins the softmax as one more column
            q = _q_rows(st, r["q"], q_start).reshape(st.group, st.block_q, -1)  # [G, bq, D]
            k_own, v_own = (_kv_rows(st, r[n], q_start) for n in ("k_own", "v_own"))
            s_own, _ = flash_math.own_logits(
                st, q, k_own, _column(r["seg_q"][...]), _column(r["poison_own"][...]),
                _head_columns(r["mult"][...]) if st.multiplied else None, keepdims=True)
            v_own = jnp.broadcast_to(v_own.astype(jnp.float32)[None],
                                     (st.group,) + v_own.shape)
            acc, m, l = flash_math.online_softmax_step(_rows(s_own), _rows(v_own), m, l, acc,
                                                       lambda p, v: p * v)
        out, lse = map(step.nan_if_overflow, flash_math.finish(acc, m, l))
        r["out"][...] = out.reshape(r["out"].shape).astype(r["out"].dtype)
        r["lse"][...] = lse.reshape(r["lse"].shape)  # [G * bq, 1] -> rows [G, bq]


@first_derivatives_only("pallas_tpu")
def _forward(st: _Static, q, k, v, seg, grids: Schedules, poison, multiplier):
    """out [B, Hkv, G, Sq, Dv] (q's dtype) and lse float32 [B, Hkv, G, nQ * bq], on
    head-major inputs (see :func:`tpu_attention`); with ``st.count_visits`` also the key
    blocks each query block computed, int32 [B, Hkv, nQ, 1]."""
    b, hkv, g, _, d = q.shape
    dv = v.shape[-1]
    n_q = st.q_ranges[-1].stop
    bq = st.block_q
    in_specs, args = _segment_specs(st, seg, queries_visited=False)
    in_specs += [_spec(st, "group", bq, d), _spec(st, "kv", st.dma_k, d, visited=True),
                 _spec(st, "kv", st.dma_k, dv, visited=True),
                 _spec(st, "kv_row", st.dma_k, visited=True)]
    args += [q, k, v, poison]
    if st.own_key:  # the keys, values and poison at the query block's own positions
        in_specs += [_spec(st, "kv", bq, d), _spec(st, "kv", bq, dv), _spec(st, "kv_row", bq)]
        args += [k, v, poison]
    if st.multiplied:
        in_specs.append(_spec(st, "group_row", bq))
        args.append(multiplier)
    out_specs = [_spec(st, "group", bq, dv, output=True),
                 _spec(st, "group_row", bq, output=True)]
    out_shape = [jax.ShapeDtypeStruct((b, hkv, g, st.q_len, dv), q.dtype),
                 jax.ShapeDtypeStruct((b, hkv, g, n_q * bq), jnp.float32)]
    row_axes = [3, 3]
    if st.count_visits:
        out_specs.append(pl.BlockSpec((None, None, 1, 1), lambda b_, h, p, own_ref, *_: (
            b_, h, own_ref[b_, p].astype(jnp.int32), 0)))
        out_shape.append(jax.ShapeDtypeStruct((b, hkv, n_q, 1), jnp.int32))
        row_axes.append(2)
    scratch = [pltpu.VMEM((g * bq, 1), jnp.float32), pltpu.VMEM((g * bq, 1), jnp.float32),
               pltpu.VMEM((g * bq, dv), jnp.float32)]
    results = _call(st, _forward_kernel, "rankattn_tpu_forward",
                    grids.queries, st.q_ranges, (b, hkv),
                    in_specs, out_specs, out_shape, scratch, args, row_axes)
    return tuple(results)


# --- Backward: dq. ------------------------------------------------------------------


def _dq_kernel(own_ref, visit_ref, code_ref, offset_ref, *refs, st: _Static):
    names = _segment_names(st) + ["q", "k", "v", "do", "lse", "delta"]
    names += ["k_own", "v_own"] * st.own_key + ["mult"] * st.multiplied + ["dq", "acc"]
    r = _named(names, refs)
    step = _Step(own_ref, visit_ref, code_ref, offset_ref)
    mult = _group_column(r["mult"][...]) if st.multiplied else None  # [G * bq, 1]

    @pl.when(step.first)
    def _():
        r["acc"][...] = jnp.zeros(r["acc"].shape, jnp.float32)

    q_start = step.block * st.block_q
    lse = _group_column(r["lse"][...])  # [G * bq, 1]

    def visit(c: int, masked: bool):
        part, k_start = _sub(c, st.block_k), step.visit * st.dma_k + c * st.block_k
        k, v = (_kv_rows(st, r[n], k_start, part) for n in ("k", "v"))
        qk = _dot(_q_rows(st, r["q"], q_start), k, NT)
        s2, s = flash_math.capped_logits(st, qk)
        s2 = flash_math.times(s2, mult)
        if masked:
            s2 = _masked(st, s2, _mask(st, r, q_start, k_start, k_part=part))
        p = jnp.exp2(s2 - flash_math.lse2(lse))
        dp = _dot(_d_out_rows(st, r["do"], lse), v, NT)
        ds = flash_math.logit_grads(st, p, dp, _group_column(r["delta"][...]), s, mult)
        r["acc"][...] += _dot(ds.astype(k.dtype), k, NN)

    step.visits(visit, st.k_sub)

    @pl.when(step.last)
    def _():
        dq = r["acc"][...]  # [G * bq, D]
        if st.own_key:
            k_own, v_own = (_kv_rows(st, r[n], q_start).astype(jnp.float32)
                            for n in ("k_own", "v_own"))
            heads = (st.group, st.block_q, -1)
            mult3 = _head_columns(r["mult"][...]) if st.multiplied else None  # [G, bq, 1]
            s2, s = flash_math.own_logits(st, _q_rows(st, r["q"], q_start).reshape(heads), k_own,
                                          _column(r["seg_q"][...]), multiplier=mult3,
                                          keepdims=True)
            p = jnp.exp2(s2 - flash_math.lse2(_head_columns(r["lse"][...])))
            d_out = _d_out_rows(st, r["do"], lse).reshape(heads).astype(jnp.float32)
            dp = (d_out * v_own).sum(-1, keepdims=True)
            dq = dq + _rows(flash_math.logit_grads(st, p, dp, _head_columns(r["delta"][...]), s,
                                                   mult3) * k_own)
        r["dq"][...] = step.nan_if_overflow(dq).reshape(r["dq"].shape).astype(r["dq"].dtype)


def _dq(st: _Static, q, k, v, seg, grids: Schedules, d_out, lse, delta, multiplier):
    """dq [B, Hkv, G, Sq, D]; d_out as out, lse and delta rows [B, Hkv, G, length] (lse +inf
    in the rows that pass no gradient: :func:`_attention_bwd`)."""
    b, hkv, g, _, d = q.shape
    dv = v.shape[-1]
    bq = st.block_q
    in_specs, args = _segment_specs(st, seg, queries_visited=False)
    in_specs += [_spec(st, "group", bq, d), _spec(st, "kv", st.dma_k, d, visited=True),
                 _spec(st, "kv", st.dma_k, dv, visited=True), _spec(st, "group", bq, dv),
                 _spec(st, "group_row", bq), _spec(st, "group_row", bq)]
    args += [q, k, v, d_out, lse, delta]
    if st.own_key:
        in_specs += [_spec(st, "kv", bq, d), _spec(st, "kv", bq, dv)]
        args += [k, v]
    if st.multiplied:
        in_specs.append(_spec(st, "group_row", bq))
        args.append(multiplier)
    return _call(st, _dq_kernel, "rankattn_tpu_dq", grids.queries, st.q_ranges, (b, hkv),
                 in_specs, [_spec(st, "group", bq, d, output=True)],
                 [jax.ShapeDtypeStruct(q.shape, q.dtype)],
                 [pltpu.VMEM((g * bq, d), jnp.float32)], args)[0]


# --- Backward: dk and dv. -----------------------------------------------------------


def _dkv_kernel(own_ref, visit_ref, code_ref, offset_ref, *refs, st: _Static):
    names = _segment_names(st) + ["q", "k", "v", "do", "lse", "delta"]
    names += ["mult"] * st.multiplied
    if st.own_key:  # the queries at this key block's positions, each on its own key
        names += ["seg_own", "q_own", "do_own", "lse_own", "delta_own"]
        names += ["mult_own"] * st.multiplied
    names += ["dk", "dv", "dk_acc", "dv_acc"]
    r = _named(names, refs)
    step = _Step(own_ref, visit_ref, code_ref, offset_ref)
    k_start = step.block * st.block_k
    k, v = (_kv_rows(st, r[n], k_start) for n in ("k", "v"))

    @pl.when(step.first)
    def _():
        r["dk_acc"][...] = jnp.zeros(r["dk_acc"].shape, jnp.float32)
        r["dv_acc"][...] = jnp.zeros(r["dv_acc"].shape, jnp.float32)

    def visit(c: int, masked: bool):
        # Key-major: s^T = k q^T [bk, G * bq], so dv = p^T dO and dk = ds^T q are plain
        # products and the queries' lse / delta / multiplier are lane-dense rows.
        part, q_start = _sub(c, st.block_q), step.visit * st.dma_q + c * st.block_q
        q = _q_rows(st, r["q"], q_start, part)
        lse = r["lse"][:, part]  # [G, bq]
        do = _d_out_rows(st, r["do"], _group_column(lse), part)
        mult = _group_row(r["mult"][:, part]) if st.multiplied else None
        s2, s = flash_math.capped_logits(st, _dot(k, q, NT))
        s2 = flash_math.times(s2, mult)
        if masked:
            mask = _mask(st, r, q_start, k_start, q_part=part, keys_major=True)
            s2 = jnp.where(mask, s2, -jnp.inf)
        p = jnp.exp2(s2 - flash_math.lse2(_group_row(lse)))
        r["dv_acc"][...] += _dot(p.astype(do.dtype), do, NN)
        ds = flash_math.logit_grads(st, p, _dot(v, do, NT), _group_row(r["delta"][:, part]),
                                    s, mult)
        r["dk_acc"][...] += _dot(ds.astype(q.dtype), q, NN)

    step.visits(visit, st.q_sub)

    @pl.when(step.last)
    def _():
        dk, dv = r["dk_acc"][...], r["dv_acc"][...]
        if st.own_key:  # [G, bk, ...]: the group's heads at this block's positions
            heads = (st.group, st.block_k, -1)
            q_own = _q_rows(st, r["q_own"], k_start).reshape(heads).astype(jnp.float32)
            do_own = _d_out_rows(st, r["do_own"], _group_column(r["lse_own"][...]))
            do_own = do_own.reshape(heads).astype(jnp.float32)
            mult3 = _head_columns(r["mult_own"][...]) if st.multiplied else None
            s2, s = flash_math.own_logits(st, q_own, k, _column(r["seg_own"][...]),
                                          multiplier=mult3, keepdims=True)
            p = jnp.exp2(s2 - flash_math.lse2(_head_columns(r["lse_own"][...])))
            dv = dv + (p * do_own).sum(0)
            dp = (do_own * v.astype(jnp.float32)).sum(-1, keepdims=True)
            ds = flash_math.logit_grads(st, p, dp, _head_columns(r["delta_own"][...]), s, mult3)
            dk = dk + (ds * q_own).sum(0)
        r["dk"][...] = step.nan_if_overflow(dk).astype(r["dk"].dtype)
        r["dv"][...] = step.nan_if_overflow(dv).astype(r["dv"].dtype)


def _dkv(st: _Static, q, k, v, seg, grids: Schedules, d_out, lse, delta, multiplier):
    """dk [B, Hkv, Skv, D] and dv [B, Hkv, Skv, Dv]; other arguments as :func:`_dq`."""
    b, hkv, g, _, d = q.shape
    dv = v.shape[-1]
    bk = st.block_k
    in_specs, args = _segment_specs(st, seg, queries_visited=True)
    in_specs += [_spec(st, "group", st.dma_q, d, visited=True), _spec(st, "kv", bk, d),
                 _spec(st, "kv", bk, dv), _spec(st, "group", st.dma_q, dv, visited=True),
                 _spec(st, "group_row", st.dma_q, visited=True),
                 _spec(st, "group_row", st.dma_q, visited=True)]
    args += [q, k, v, d_out, lse, delta]
    if st.multiplied:
        in_specs.append(_spec(st, "group_row", st.dma_q, visited=True))
        args.append(multiplier)
    if st.own_key:
        in_specs += [_spec(st, "seg_row", bk), _spec(st, "group", bk, d),
                     _spec(st, "group", bk, dv), _spec(st, "group_row", bk),
                     _spec(st, "group_row", bk)]
        args += [seg[0], q, d_out, lse, delta]
        if st.multiplied:
            in_specs.append(_spec(st, "group_row", bk))
            args.append(multiplier)
    return _call(st, _dkv_kernel, "rankattn_tpu_dkv",
                 grids.keys, st.k_ranges, (b, hkv), in_specs,
                 [_spec(st, "kv", bk, d, output=True), _spec(st, "kv", bk, dv, output=True)],
                 [jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
                 [pltpu.VMEM((bk, d), jnp.float32), pltpu.VMEM((bk, dv), jnp.float32)], args)


# --- The differentiable core, on head-major inputs. -------------------------------


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attention(st: _Static, q, k, v, seg, grids: Schedules, poison, multiplier):
    return _forward(st, q, k, v, seg, grids, poison, multiplier)


def _attention_fwd(st, q, k, v, seg, grids, poison, multiplier):
    out, lse = _forward(st, q, k, v, seg, grids, poison, multiplier)
    return (out, lse), (q, k, v, seg, grids, out, lse, multiplier)


@first_derivatives_only("pallas_tpu")
def _attention_bwd(st, residuals, cotangents):
    q, k, v, seg, grids, out, lse, multiplier = residuals
    d_out, d_lse = cotangents
    # semantics.backward_rows on the queries' true rows, for lse and delta (a row_dot of dO as
    # given); its dO with poisoned rows zeroed is left unused (XLA drops it): the kernels zero
    # those rows of dO as they read it, where lse is +inf (_d_out_rows). Past the queries' end
    # lse is +inf too, so every p there is 0 and dO's unspecified rows are never used.
    lse, _, delta = semantics.backward_rows(out, d_out, lse[..., :st.q_len],
                                            d_lse[..., :st.q_len])
    length = seg[0].shape[-1]  # the rows' padded length: every block of either size
    lse = jnp.pad(lse, [(0, 0)] * 3 + [(0, length - st.q_len)], constant_values=jnp.inf)
    delta = jnp.pad(delta, [(0, 0)] * 3 + [(0, length - st.q_len)])
    dq = _dq(st, q, k, v, seg, grids, d_out, lse, delta, multiplier)
    dk, dv = _dkv(st, q, k, v, seg, grids, d_out, lse, delta, multiplier)
    return dq, dk, dv, None, None, None, None


_attention.defvjp(_attention_fwd, _attention_bwd)


def _group_major(x, hkv: int):
    """[B, S, Hq, C] -> [B, Hkv, G, S, C]: query head h * G + g as (h, g)."""
    b, s, hq, c = x.shape
    return x.reshape(b, s, hkv, hq // hkv, c).transpose(0, 2, 3, 1, 4)


def _head_rows(x, hkv: int, length: int):
    """Per-position values [B, S, H] -> lane-dense rows [B, Hkv, H / Hkv, length]."""
    b, s, h = x.shape
    x = pad_axis1(x, length) if length > s else x
    return x.transpose(0, 2, 1).reshape(b, hkv, h // hkv, length)


def tpu_attention(q, k, v, segment_ids, *, causal: bool, scale: float, softcap: float | None,
                  softcap_method: str, block_sizes: BlockSizes, block_plan: BlockPlan | None = None,
                  interpret=False, logit_multiplier=None, shard_mask=None,
                  smem_budget: int = 512 << 10, vmem_limit_bytes: int | None = None,
                  dma_block: int = 512, max_visits: int | None = None,
                  count_visits: bool = False):
    """Blocked attention on Pallas Mosaic TPU; arguments and results as
    :func:`rankattn.attention` (q [B, Sq, Hq, D], k [B, Skv, Hkv, D], v [B, Skv, Hkv, Dv];
    out [B, Sq, Hq, Dv] in q's dtype, lse float32 [B, Hq, Sq]; ``logit_multiplier``:
    float32 [B, Sq, Hq], finite, or None; ``shard_mask``: a
    :class:`rankattn.semantics.ShardMask`, the per-shard call of context sharding, whose
    keys bring their own segment ids and every token its position: the history part only).

    ``max_visits``: see :class:`PallasTpu`.
    ``block_sizes``: the compute blocks, as :func:`plan_sizes` gives them for this length;
    ``dma_block``: the visited blocks' DMA (:func:`sub_blocks`). ``block_plan``, if
    given, is the self-attention plan of these segment ids at those sizes; without one it
    is made here. The kernels' plan lists (scalar prefetch) stay within ``smem_budget``
    bytes per call: calls take chunks of batch rows (:func:`rows_per_call`), and a row whose
    lists alone exceed it runs as calls over ranges of query blocks (forward, dq) and key
    blocks (dk / dv) (:func:`_call`). ``count_visits`` (tests) returns a third result: the key
    blocks each query block of the forward computed, int32 [B, Hkv, nQ], without the
    custom gradient.
    """
    b, sq, hq, d = q.shape
    skv, hkv, dv = k.shape[1], k.shape[2], v.shape[3]
    bq, bk = block_sizes.block_q, block_sizes.block_k
    seg_q, seg_k, block_plan = segments_and_plan(segment_ids, b, sq, skv, block_sizes, causal,
                                                 block_plan, shard_mask)
    n_q, n_k = block_plan.kv_index.shape[1:]
    q_sub, k_sub = sub_blocks(dma_block, bq, n_q), sub_blocks(dma_block, bk, n_k)
    # q, k and v are read as given, their last blocks ragged (the kernels zero what lies
    # past their ends). The per-position rows (segment ids, positions, poison, multiplier,
    # lse, delta) are padded, to one length for queries and keys (the own-key term reads
    # keys at query blocks and queries at key blocks) covering every DMA block. Padding has
    # segment id 0: invisible.
    length = round_up(max(sq, skv), math.lcm(q_sub * bq, k_sub * bk))
    seg_q, seg_k = pad_axis1(seg_q, length), pad_axis1(seg_k, length)
    positions = ()
    if shard_mask is not None:  # padding repeats the last position (blocks.pad_positions)
        positions = tuple(jnp.pad(jnp.asarray(p, jnp.int32), [(0, 0), (0, length - p.shape[1])],
                                  mode="edge")
                          for p in (shard_mask.q_positions, shard_mask.kv_positions))
    q_poison = semantics.nonfinite_poison(q)
    poison = _head_rows(semantics.nonfinite_poison(k) + semantics.nonfinite_poison(v), hkv,
                        length)  # [B, Hkv, 1, length]
    q_h = _group_major(q, hkv)
    k_h, v_h = (_group_major(x, hkv)[:, :, 0] for x in (k, v))
    multiplier = None
    if logit_multiplier is not None:
        multiplier = _head_rows(logit_multiplier, hkv, length)
    st = _Static(causal=causal, scale=scale, softcap=softcap, softcap_method=softcap_method,
                 own_key=segment_ids is not None and shard_mask is None,
                 positions=shard_mask is not None, multiplied=multiplier is not None,
                 block_q=bq, block_k=bk, group=hq // hkv, q_len=sq, kv_len=skv,
                 interpret=interpret,
                 vmem_limit_bytes=vmem_limit_bytes, smem_budget=smem_budget,
                 q_sub=q_sub, k_sub=k_sub, count_visits=count_visits)

    chunk = rows_per_call(b, [(n_q, -(-n_k // k_sub)), (n_k, -(-n_q // q_sub))], smem_budget)
    results = []
    for start in range(0, b, chunk):
        rows = slice(start, start + chunk)
        seg = (seg_q[rows, None, :], seg_k[rows, None, :])
        if positions:
            seg += (positions[0][rows, None, :], positions[1][rows, None, :])
        mult = None if multiplier is None else multiplier[rows]
        # The schedules are made here, where a prepared plan's lists are still known (inside
        # the custom VJP every operand is traced): their lengths are the grids'. Under jit a
        # slice of a known list would be traced, so the rows are sliced now.
        with jax.ensure_compile_time_eval():
            plan = jax.tree.map(lambda x: x[rows], block_plan)
        grids, q_ranges, k_ranges = schedules(plan, smem_budget, max_visits, q_sub, k_sub)
        st_rows = dataclasses.replace(st, q_ranges=q_ranges, k_ranges=k_ranges)
        core = _forward if count_visits else _attention
        results.append(core(st_rows, q_h[rows], k_h[rows], v_h[rows], seg, grids, poison[rows],
                            mult))
    out, lse, *visits = (jnp.concatenate(parts) for parts in zip(*results))
    out = out.transpose(0, 3, 1, 2, 4).reshape(b, sq, hq, dv)
    lse = lse.reshape(b, hq, -1)[:, :, :sq]
    out, lse = semantics.poison_rows(out, lse, q_poison)
    return (out, lse, visits[0][..., 0]) if count_visits else (out, lse)


class PallasTpu(Backend):
    """The Pallas kernels on the Mosaic TPU lowering (TPU v5e, v6e, TPU7x and others).

    ``target`` names the generation whose settings (:data:`TARGETS`: blocks, the SMEM
    budget of the plan lists, the VMEM limit) the kernels take: None (default) reads it from
    the device on a TPU machine and uses ``PORTABLE_TARGET`` (v5e's) elsewhere; or "v5e",
    "v6e", "tpu7x", a :class:`TpuTarget`. ``block_sizes`` overrides the target's blocks
    (block_q a multiple of 8, block_k of 8, one dividing the other; on a TPU both must be
    multiples of 128, since both index lane-dense rows, unless a call fits one block, and
    a call spanning several blocks of other sizes is declined there, RA115): the compute
    blocks. ``dma_block`` overrides the target's DMA block (tokens): the visited
    blocks (keys in the forward and dq, queries in dk / dv) are fetched that many tokens at
    a time and computed block by block, each step skipping the compute blocks its plan
    skips (:func:`sub_blocks`: up to 4 compute blocks a DMA block).

    ``max_visits`` bounds the grid where the block plan is traced (segment ids traced under
    jit, or a plan passed into jit as an argument): each query block then gets at most that
    many steps over key DMA blocks (and each key block over query DMA blocks in the
    backward) instead of one per DMA block. A block whose list is longer comes back NaN (out
    and lse of its queries, dq, or dk / dv of its keys): never a silently partial sum. Leave
    it None unless you know your masks' longest list (a causal row of n tokens visits up to
    n / dma_block DMA blocks, rounded up); a plan prepared by :func:`rankattn.plan` and
    closed over needs no bound, its grid being exactly its visits.

    ``interpret``: False (default) compiles for the TPU; True runs the same kernels in
    Pallas' generic interpreter on any backend (CPU included; slow, for tests); a
    ``pltpu.InterpretParams(...)`` runs them in the TPU simulator (memory spaces, DMAs,
    two cores with ``num_cores_or_threads=2``, a race detector with ``detect_races=True``).

    By name (``impl='pallas_tpu'`` or ``'auto'``, which tries it first) it runs only where
    JAX's default backend is a TPU; an instance passed as ``impl=`` is not checked, so a
    CPU-only machine can lower it for TPU (``jax.jit(f).trace(...)
    .lower(lowering_platforms=('tpu',))``). No TPU has timed it yet.
    """

    name = "pallas_tpu"
    takes_shard_mask = True

    def __init__(self, block_sizes: BlockSizes | None = None, *, target=None, interpret=False,
                 dma_block: int | None = None, max_visits: int | None = None):
        block_sizes = check_block_sizes(block_sizes)
        if block_sizes is not None:
            check_tpu_blocks(block_sizes, "PallasTpu")
        if not isinstance(interpret, bool) and not (
                pltpu is not None and hasattr(pltpu, "InterpretParams")
                and isinstance(interpret, pltpu.InterpretParams)):
            raise fail("RA116", f"PallasTpu interpret={interpret!r}; pass True, False or a "
                                "jax.experimental.pallas.tpu.InterpretParams(...).")
        if dma_block is not None:
            check_dma_block(dma_block, "PallasTpu", "None (the target's) or ")
        if max_visits is not None and not is_positive_int(max_visits):
            raise fail("RA116", f"PallasTpu max_visits={max_visits!r}; pass None (every block "
                                "under jit) or a positive int, the most key blocks a query "
                                "block visits (and query blocks a key block) in your masks.")
        self.block_sizes = block_sizes
        self.target = None if target is None else target_of(target)
        self.interpret = interpret
        self.dma_block = dma_block
        self.max_visits = max_visits

    def tpu_target(self) -> TpuTarget:
        """The generation the kernels are configured for (see the class docstring)."""
        if self.target is not None:
            return self.target
        if jax.default_backend() == "tpu" and self.interpret is False:
            kind = jax.devices()[0].device_kind.lower()
            for spelling, name in DEVICE_KINDS.items():
                if spelling in kind:
                    return TARGETS[name]
        return PORTABLE_TARGET

    def sizes(self, seq_len: int) -> BlockSizes:
        """The blocks of a call of ``seq_len`` tokens (queries or keys, the longer)."""
        return plan_sizes(self.block_sizes or self.tpu_target().block_sizes, seq_len)

    def dma(self) -> int:
        """The DMA block (tokens) the kernels fetch visited blocks by."""
        return self.dma_block or self.tpu_target().dma_block

    def platform_reasons(self) -> list[str]:
        if IMPORT_ERROR is not None:
            return [self._no_lowering()]
        if self.interpret is False and jax.default_backend() != "tpu":
            return [f"pallas_tpu needs a TPU, and JAX's default backend here is "
                    f"{jax.default_backend()!r}; on a TPU machine install jax with libtpu "
                    "(pip install 'rankattn[tpu]': jax's own extra), pass "
                    "impl=rankattn.backends.PallasTpu(interpret=True) to run its kernels in "
                    "Pallas interpret mode on CPU (slow), or use impl='xla'"]
        return []

    def not_supported_reasons(self, call: AttentionCall) -> list[str]:
        if IMPORT_ERROR is not None:
            return [self._no_lowering()]
        if not any(call.q.dtype == d for d in SUPPORTED_DTYPES):
            return [f"pallas_tpu: inputs are {call.q.dtype}; its kernels take float32 or "
                    "bfloat16 (cast float16 inputs to bfloat16, or use impl='xla')"]
        seq = max(call.q.shape[1], call.k.shape[1])
        sizes = self.sizes(seq)
        n_q, n_k = -(-seq // sizes.block_q), -(-seq // sizes.block_k)
        # Interpret mode takes any multiple of 8; Mosaic takes a lane-dense row's block (the
        # per-position rows: segment ids, lse, ...) only as the whole row or a multiple of 128
        # tokens, and fails inside Pallas otherwise. DMA blocks are whole compute blocks
        # (sub_blocks), so they are multiples of 128 where the compute blocks are.
        if (self.interpret is False and max(n_q, n_k) > 1
                and (sizes.block_q % LANES or sizes.block_k % LANES)):
            return [f"pallas_tpu: {seq} tokens span several blocks of {sizes.block_q} x "
                    f"{sizes.block_k}, and on a TPU blocks that do not cover a call must be "
                    f"multiples of {LANES} tokens; pass block_sizes of multiples of {LANES} "
                    "(e.g. BlockSizes(128, 256)), interpret=True, or use impl='xla'"]
        visits = max(-(-n_k // sub_blocks(self.dma(), sizes.block_k, n_k)),
                     -(-n_q // sub_blocks(self.dma(), sizes.block_q, n_q)))
        one_block = list_bytes(1, min(visits, self.max_visits or visits), list_dtype(n_q, n_k))
        budget = self.tpu_target().smem_budget
        if one_block > budget:
            return [f"pallas_tpu: one block's list of {seq} tokens at blocks {sizes.block_q} x "
                    f"{sizes.block_k} (DMA blocks of {self.dma()}) takes {one_block} bytes of "
                    f"SMEM, over the {budget}-byte budget of {self.tpu_target().name}; pass "
                    "larger block_sizes or dma_block, or use impl='xla'"]
        return []

    def plan_sizes(self, seq_len: int) -> tuple[BlockSizes, ...]:
        return (self.sizes(seq_len),)

    def __call__(self, call: AttentionCall):
        sizes = self.sizes(max(call.q.shape[1], call.k.shape[1]))
        blocks = None if call.plan is None else call.plan.block_plan(sizes)
        target = self.tpu_target()
        return tpu_attention(call.q, call.k, call.v, call.segment_ids, causal=call.causal,
                             scale=call.scale, softcap=call.softcap,
                             softcap_method=call.softcap_method, block_sizes=sizes,
                             block_plan=blocks, interpret=self.interpret,
                             logit_multiplier=call.logit_multiplier,
                             shard_mask=call.shard_mask, smem_budget=target.smem_budget,
                             vmem_limit_bytes=target.vmem_limit_bytes, dma_block=self.dma(),
                             max_visits=self.max_visits)

    @staticmethod
    def _no_lowering() -> str:
        return (f"pallas_tpu: this JAX ({jax.__version__}) lacks a Pallas TPU name the kernels "
                f"need ({IMPORT_ERROR}); upgrade jax, or use impl='xla'")

    def __repr__(self) -> str:
        options = [f"{self.block_sizes or 'blocks per TPU generation'}"]
        if self.target is not None:
            options.append(f"target={self.target.name}")
        if self.dma_block is not None:
            options.append(f"dma_block={self.dma_block}")
        if self.interpret is not False:
            options.append(f"interpret={self.interpret!r}")
        if self.max_visits is not None:
            options.append(f"max_visits={self.max_visits}")
        return f"<rankattn backend 'pallas_tpu' {' '.join(options)}>"
