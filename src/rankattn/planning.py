"""Plans: the mask of a batch, prepared once and reused by every layer.

Like FlexAttention's BlockMask: deriving which key blocks each query block
must visit, and which of those need no mask, depends only on the segment ids,
so a model builds it once per batch and passes it to every attention layer
(and the backward pass reuses it). It is a pytree, so it can be built inside
``jax.jit`` from traced segment ids and passed between jitted functions.

Blocked backends differ in the block sizes they read (``xla`` uses about 128 x 512, the
query block chosen per length to pad least, or one query block for short queries; ``cpu``
64 x 256, or key blocks of 128 or 64 where one of 256 would hold every key; ``pallas_triton``
16-64 x 16-32 tiles per GPU, dtype and head dim), so a plan keeps one
:class:`rankattn.blocks.BlockPlan` per block-size pair, each with the lists per
query block (forward, dq) and per key block (dk / dv). A backend asks the plan
for its pair; a plan made for other backends still gives exact results, the
backend then derives its lists from the plan's segment ids on every call.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from rankattn.blocks import BlockPlan, BlockSizes, make_block_plan, pad_axis1
from rankattn.errors import fail
from rankattn.validate import (BOUNDS_FORM, INT32_MAX, as_array, check_mask_args,
                               check_one_mask, segment_ids_array)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Plan:
    """A prepared mask: pass it as ``rankattn.attention(q, k, v, plan=plan)``."""

    segment_ids: jax.Array  # int32 [B, S], canonical (bounds already converted)
    block_plans: tuple[BlockPlan, ...]  # one per entry of block_sizes
    causal: bool = dataclasses.field(metadata=dict(static=True))
    block_sizes: tuple[BlockSizes, ...] = dataclasses.field(metadata=dict(static=True))

    @property
    def shape(self) -> tuple[int, int]:
        """(B, S) of the queries and keys this plan is for."""
        return tuple(self.segment_ids.shape)

    def broadcast_to(self, batch: int) -> "Plan":
        """This plan for ``batch`` rows: a plan of one row (from [4] bounds, or segment ids
        [1, S]) broadcasts over any batch, as [4] bounds do in ``attention``."""
        if self.shape[0] == batch:
            return self
        if self.shape[0] != 1 or not isinstance(batch, (int, np.integer)) or batch < 1:
            raise fail("RA117", f"this plan is for {self.shape[0]} rows and cannot serve "
                                f"batch={batch!r}: a plan of one row broadcasts to any batch "
                                ">= 1; a plan of B rows serves B. Make the plan from this "
                                "batch's mask.")
        # Broadcast now: under jit, a broadcast of a prepared (known) plan would be traced,
        # and a backend that sizes its grid from known lists (pallas_tpu) would take the
        # worst case.
        with jax.ensure_compile_time_eval():
            return jax.tree.map(lambda x: jnp.broadcast_to(x, (batch, *x.shape[1:])), self)

    def block_plan(self, sizes: BlockSizes) -> BlockPlan:
        """The visit lists for ``sizes``: prepared ones if the plan has them, else made now."""
        if sizes in self.block_sizes:
            return self.block_plans[self.block_sizes.index(sizes)]
        return self_attention_block_plan(self.segment_ids, sizes, self.causal)


def self_attention_block_plan(segment_ids, sizes: BlockSizes, causal: bool) -> BlockPlan:
    """The block plan of self-attention over segment ids [B, S] at ``sizes``."""
    return make_block_plan(pad_axis1(segment_ids, sizes.block_q),
                           pad_axis1(segment_ids, sizes.block_k), sizes, causal,
                           segment_ids.shape[1])


def plan(*, segment_ids=None, bounds=None, seq_len: int | None = None, causal: bool = False,
         impl="auto", impls=None) -> Plan:
    """Prepare the mask of a batch once, for every layer that attends over it.

    Args:
      segment_ids: int [B, S], as in :func:`rankattn.attention`.
      bounds: int [B, 4] or [4] = (hist_lo, hist_hi, cand_lo, cand_hi);
        needs ``seq_len``. A [4] bounds (or segment ids [1, S]) gives a plan of
        one row, which broadcasts over any batch, as [4] bounds do in
        :func:`rankattn.attention`.
      seq_len: the sequence length S, with bounds.
      causal: as in :func:`rankattn.attention`.
      impl: the backends whose block lists to prepare, as ``attention``'s
        ``impl``: 'auto' (default: those ``impl='auto'`` can use on this
        machine, ``rankattn.available_impls()``; None means the same), a name,
        a backend instance, or a list of those, e.g.
        ``[rankattn.backends.Xla(rankattn.backends.BlockSizes(64, 64)), 'cpu']``.
      impls: the old name of ``impl``; raises RA125.

    Returns:
      A :class:`Plan`; ``attention(q, k, v, plan=plan)`` gives bit-identical
      results to ``attention(q, k, v, segment_ids=..., causal=...)``.
    """
    from rankattn.api import resolve_impls  # the dispatcher imports this module

    if impls is not None:
        raise fail("RA125", f"plan(impls={impls!r}): the argument is now impl=, as in "
                            "rankattn.attention, and takes a name, a backend or a list of them. "
                            f"Pass impl={impls!r}.")
    if segment_ids is None and bounds is None:
        raise fail("RA117", "plan() needs segment_ids or bounds; for unmasked attention pass "
                            "segment_ids=jnp.ones((B, S), jnp.int32).")
    check_one_mask(segment_ids, bounds)
    if bounds is None:
        segment_ids = segment_ids_array(segment_ids)
        if np.ndim(segment_ids) != 2:
            raise fail("RA107", f"segment_ids has shape {np.shape(segment_ids)}; plan() needs "
                                "[B, S].")
    else:
        bounds = as_array("bounds", bounds, "RA108", BOUNDS_FORM)
    given, shape = (("segment_ids", np.shape(segment_ids)) if bounds is None
                    else ("bounds", np.shape(bounds)))
    if 0 in (shape if given == "segment_ids" else shape[:-1]):  # bounds' last axis: the 4
        raise fail("RA105", f"plan({given}=...) got shape {shape}; a plan needs at least one "
                            "row of at least one token (B >= 1, S >= 1), as rankattn.attention "
                            "does. Skip the call for an empty batch, or pad to length 1 and "
                            "mask the pad with segment id 0.")
    if bounds is not None:
        if seq_len is None:
            raise fail("RA117", "plan(bounds=...) needs seq_len=S, the sequence length.")
        if (not isinstance(seq_len, (int, np.integer)) or isinstance(seq_len, bool)
                or not 0 < seq_len <= INT32_MAX):
            raise fail("RA117", f"plan(bounds=...) got seq_len={seq_len!r}; it must be the "
                                f"sequence length S, a Python int in [1, {INT32_MAX}] (positions "
                                "are int32).")
        seq_len = int(seq_len)
        rows = np.shape(bounds)[0] if np.ndim(bounds) == 2 else 1
        batch, length = rows, seq_len
    else:
        batch, length = np.shape(segment_ids)[0], np.shape(segment_ids)[-1]
        if seq_len is not None and seq_len != length:  # it would be ignored without a word
            raise fail("RA117", f"plan(segment_ids=...) got seq_len={seq_len!r}, but the ids "
                                f"have length {length}; leave seq_len out (it is for bounds=).")
    segment_ids, causal = check_mask_args(segment_ids, bounds, causal, batch, length)
    backends = resolve_impls(impl)
    sizes = tuple(dict.fromkeys(s for b in backends for s in b.plan_sizes(length)))
    return Plan(segment_ids=segment_ids,
                block_plans=tuple(self_attention_block_plan(segment_ids, s, causal) for s in sizes),
                causal=causal, block_sizes=sizes)
