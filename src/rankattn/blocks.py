"""Block sizes and block plans: which key blocks each query block visits.

This is the part of a blocked kernel that does not depend on how the kernel
is lowered. The ``xla`` and ``pallas_triton`` backends (and a future Mosaic GPU
kernel) read the same :class:`BlockPlan`; they differ only in the block sizes
they ask for, and a :class:`rankattn.Plan` keeps one block plan per size pair.

A block plan covers the history part of the mask only (see
:mod:`rankattn.semantics`): a candidate's own key is one extra logit that every
backend adds without visiting a block.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp

from rankattn import semantics
from rankattn.errors import fail
from rankattn.validate import is_positive_int


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Query and key block lengths of a blocked backend."""

    block_q: int
    block_k: int

    def __post_init__(self):
        for name in ("block_q", "block_k"):
            value = getattr(self, name)
            if not is_positive_int(value):
                raise fail("RA116", f"BlockSizes.{name} must be a positive int; got {value!r}.")


def check_block_sizes(block_sizes) -> BlockSizes | None:
    """A backend's ``block_sizes`` argument: None (chosen per shape) or a BlockSizes."""
    if block_sizes is not None and not isinstance(block_sizes, BlockSizes):
        raise fail("RA116", f"block_sizes={block_sizes!r}; pass None (chosen per shape) or "
                            "rankattn.backends.BlockSizes(block_q, block_k), e.g. "
                            "BlockSizes(64, 128).")
    return block_sizes


class BlockPlan(NamedTuple):
    """Visit lists of one block-size pair, for B rows of nQ query blocks and nK key blocks.

    A pytree of int32 arrays, so it can be built once under jit and reused by
    every layer and by the backward pass. Each list holds the full blocks
    (every query sees every key: no mask arithmetic), then the partial ones,
    then the rest; the counts say how many of the first entries are visited.
    Every nonempty block pair sits in exactly one of the two visited parts.
    """

    kv_index: jax.Array      # [B, nQ, nK]: per query block, the key blocks it sees
    full_count: jax.Array    # [B, nQ]
    count: jax.Array         # [B, nQ]
    q_index: jax.Array       # [B, nK, nQ]: per key block, the query blocks that see it
    q_full_count: jax.Array  # [B, nK]
    q_count: jax.Array       # [B, nK]


def make_block_plan(seg_q, seg_k, sizes: BlockSizes, causal: bool, q_len: int,
                    pos_q=None, pos_k=None) -> BlockPlan:
    """The plan for segment ids padded to multiples of their block sizes; q_len real queries.

    ``pos_q`` / ``pos_k``: positions in the whole sequence of a shard's queries and keys
    (:class:`rankattn.semantics.ShardMask`), padded like the segment ids (:func:`pad_positions`).

    The transposed lists (per key block) serve backward kernels that own a key
    block and accumulate its dk / dv; forward-only users never read them, and
    under jit XLA drops them.
    """
    nonempty, full = semantics.history_block_visibility(seg_q, seg_k, sizes.block_q,
                                                        sizes.block_k, causal, q_len, pos_q, pos_k)

    def lists(nonempty, full):
        rank = jnp.where(full, 0, jnp.where(nonempty, 1, 2))
        order = jnp.argsort(rank, axis=-1, stable=True).astype(jnp.int32)
        return order, full.sum(-1, dtype=jnp.int32), nonempty.sum(-1, dtype=jnp.int32)

    swap = (0, 2, 1)
    return BlockPlan(*lists(nonempty, full),
                     *lists(nonempty.transpose(swap), full.transpose(swap)))


def segments_and_plan(segment_ids, batch: int, q_len: int, kv_len: int, sizes: BlockSizes,
                      causal: bool, block_plan: BlockPlan | None = None,
                      shard_mask: semantics.ShardMask | None = None):
    """(seg_q, seg_k, block plan) of a call: int32 segment ids padded to the block sizes, and
    the plan, made from them unless given. Without segment ids every token is history of one
    session, and q and k may differ in length (plain cross-attention). With a
    ``shard_mask`` the keys bring their own segment ids and every token its position."""
    if segment_ids is None:
        seg_q, seg_k = jnp.ones((batch, q_len), jnp.int32), jnp.ones((batch, kv_len), jnp.int32)
    else:
        seg_q = seg_k = segment_ids.astype(jnp.int32)
    pos_q = pos_k = None
    if shard_mask is not None:
        seg_k = shard_mask.kv_segment_ids.astype(jnp.int32)
        pos_q = pad_positions(shard_mask.q_positions, sizes.block_q)
        pos_k = pad_positions(shard_mask.kv_positions, sizes.block_k)
    seg_q, seg_k = pad_axis1(seg_q, sizes.block_q), pad_axis1(seg_k, sizes.block_k)
    if block_plan is None:
        block_plan = make_block_plan(seg_q, seg_k, sizes, causal, q_len, pos_q, pos_k)
    return seg_q, seg_k, block_plan


def pad_positions(pos, multiple: int):
    """Positions [B, S] (int32) padded on axis 1 to a multiple of ``multiple`` by repeating the
    last one, so a block's smallest and largest position stay those of its real tokens."""
    pos = jnp.asarray(pos, jnp.int32)
    extra = -pos.shape[1] % multiple
    return jnp.pad(pos, [(0, 0), (0, extra)], mode="edge") if extra else pos


def pad_axis1(x, multiple: int):
    """Zero-pad axis 1 to a multiple of ``multiple`` (a no-op when it already is one).

    Zero is the padding segment id, so padded tokens are invisible.
    """
    x = jnp.asarray(x)
    extra = -x.shape[1] % multiple
    if not extra:
        return x
    return jnp.pad(x, [(0, 0), (0, extra)] + [(0, 0)] * (x.ndim - 2))


def round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple
