"""Plans: the mask of a batch, prepared once and reused by every layer.

Like FlexAttention's BlockMask: deriving which key blocks each query block
must visit, and which of those need no mask, depends only on the segment ids,
so a model builds it once per batch and passes it to every attention layer
(and the backward pass reuses it). It is a pytree, so it can be built inside
``jax.jit`` from traced segment ids and passed between jitted functions.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from rankattn.backends.xla import BlockPlan, BlockSizes, self_attention_plan
from rankattn.errors import fail
from rankattn.validate import check_mask_args


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Plan:
    """A prepared mask: pass it as ``rankattn.attention(q, k, v, plan=plan)``."""

    segment_ids: jax.Array  # int32 [B, S], canonical (bounds already converted)
    blocks: BlockPlan       # the blocked backend's visit lists
    causal: bool = dataclasses.field(metadata=dict(static=True))
    block_sizes: BlockSizes = dataclasses.field(metadata=dict(static=True))

    @property
    def shape(self) -> tuple[int, int]:
        """(B, S) of the queries and keys this plan is for."""
        return tuple(self.segment_ids.shape)


def plan(*, segment_ids=None, bounds=None, seq_len: int | None = None, causal: bool = False,
         block_sizes: BlockSizes = BlockSizes()) -> Plan:
    """Prepare the mask of a batch once, for every layer that attends over it.

    Args:
      segment_ids: int [B, S], as in :func:`rankattn.attention`.
      bounds: int [B, 4] or [4] = (hist_lo, hist_hi, cand_lo, cand_hi);
        needs ``seq_len`` (and a [4] bounds gives a batch of one row, which
        broadcasts over no other batch size: pass [B, 4] for B rows).
      seq_len: the sequence length S, with bounds.
      causal: as in :func:`rankattn.attention`.
      block_sizes: block sizes of the blocked backend (clamped to S).

    Returns:
      A :class:`Plan`; ``attention(q, k, v, plan=plan)`` gives bit-identical
      results to ``attention(q, k, v, segment_ids=..., causal=...)``.
    """
    if segment_ids is None and bounds is None:
        raise fail("RA117", "plan() needs segment_ids or bounds; for unmasked attention pass "
                            "segment_ids=jnp.ones((B, S), jnp.int32).")
    if segment_ids is not None and np.ndim(segment_ids) != 2:
        raise fail("RA107", f"segment_ids has shape {np.shape(segment_ids)}; plan() needs [B, S].")
    if bounds is not None:
        if seq_len is None:
            raise fail("RA117", "plan(bounds=...) needs seq_len=S, the sequence length.")
        rows = np.shape(bounds)[0] if np.ndim(bounds) == 2 else 1
        batch, length = rows, seq_len
    else:
        batch, length = np.shape(segment_ids)[0], np.shape(segment_ids)[-1]
    segment_ids, causal = check_mask_args(segment_ids, bounds, causal, batch, length)
    sizes, blocks = self_attention_plan(segment_ids, block_sizes, causal)
    return Plan(segment_ids=segment_ids, blocks=blocks, causal=causal, block_sizes=sizes)
