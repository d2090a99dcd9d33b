"""The block planner, rankattn.semantics.history_block_visibility, against the oracle's mask.

For every (query block, key block) pair the planner says `nonempty` (some query of
the block may see some history key of the block) and `full` (every query sees
every key, so the mask can be skipped). Both must be conservative: a pair with
any visible history pair must be nonempty, and a pair marked full must have all
pairs visible. The candidate-own-key part of the mask is not the planner's job
(the blocked backend adds it without visiting blocks), so the oracle side here
is the spec's mask restricted to history keys.
"""

from __future__ import annotations

import jax
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

import oracle
from helpers import pad_blocks, segment_row, visited_pairs
from rankattn import semantics
from rankattn.blocks import BlockSizes, make_block_plan

planner = jax.jit(semantics.history_block_visibility, static_argnums=(2, 3, 4, 5))


def history_mask(seg_q, seg_k, causal):
    """The oracle's mask [B, Sq, Skv] restricted to history keys, for zero-padded ids."""
    length = max(seg_q.shape[1], seg_k.shape[1])
    seg = np.zeros((seg_q.shape[0], length), np.int64)
    seg[:, :seg_k.shape[1]] = seg_k
    assert np.array_equal(seg[:, :seg_q.shape[1]], seg_q)
    mask = oracle.mask_dense(seg, causal) & (seg[:, None, :] > 0)
    return mask[:, :seg_q.shape[1], :seg_k.shape[1]]


def block_truth(mask, block_q, block_k):
    """(any visible, all visible), each [B, nQ, nK], of a dense mask."""
    b, sq, sk = mask.shape
    blocks = mask.reshape(b, sq // block_q, block_q, sk // block_k, block_k)
    return blocks.any((2, 4)), blocks.all((2, 4))


def plan_and_truth(seg, block_q, block_k, causal):
    seg_q, seg_k = pad_blocks(seg, block_q), pad_blocks(seg, block_k)
    nonempty, full = (np.asarray(x) for x in planner(seg_q, seg_k, block_q, block_k, causal))
    return nonempty, full, *block_truth(history_mask(seg_q, seg_k, causal), block_q, block_k)


BLOCKS = [1, 3, 8, 16]


@settings(max_examples=4 * settings.default.max_examples)  # cheap: no attention compiled
@given(data=st.data(), seq=st.sampled_from([5, 13, 16, 37]), block_q=st.sampled_from(BLOCKS),
       block_k=st.sampled_from(BLOCKS), causal=st.booleans())
def test_planner_is_conservative(data, seq, block_q, block_k, causal):
    seg = np.array(data.draw(st.lists(segment_row(seq), min_size=3, max_size=3)), np.int32)
    nonempty, full, any_visible, all_visible = plan_and_truth(seg, block_q, block_k, causal)
    missed = any_visible & ~nonempty
    assert not missed.any(), f"blocks with visible keys planned empty: {np.argwhere(missed)}"
    wrong_full = full & ~all_visible
    assert not wrong_full.any(), f"blocks planned full with masked pairs: {np.argwhere(wrong_full)}"


# Session 1 history on 0..15, its candidates on 16..23; session 2 history on 24..39.
ALIGNED = np.array([[1] * 16 + [-1] * 8 + [2] * 16], np.int32)


def test_planner_is_tight_on_aligned_sessions():
    """Where block boundaries follow the sessions, the verdicts are exact, not just safe."""
    for causal in (False, True):
        nonempty, full, any_visible, all_visible = plan_and_truth(ALIGNED, 8, 8, causal)
        assert np.array_equal(nonempty, any_visible), causal
        assert np.array_equal(full, all_visible), causal
        assert full.any() and (~nonempty).any()        # the plan skips work in both ways


def test_padding_blocks_are_empty():
    seg = np.array([[0] * 8 + [3] * 8 + [0] * 16], np.int32)
    nonempty, full = (np.asarray(x) for x in planner(seg, seg, 8, 8, False))
    assert nonempty[0].tolist() == [[False] * 4, [False, True, False, False], [False] * 4,
                                    [False] * 4]
    assert np.array_equal(full, nonempty)


def test_cross_attention_lengths():
    """Without a mask every token is history: real blocks are full, padded ones partial."""
    seg_q, seg_k = np.ones((1, 24), np.int32), pad_blocks(np.ones((1, 20), np.int32), 8)
    nonempty, full = (np.asarray(x) for x in planner(seg_q, seg_k, 8, 8, False))
    assert nonempty.all()
    assert full[0].tolist() == [[True, True, False]] * 3


make_plan = jax.jit(make_block_plan, static_argnums=(2, 3, 4))


@settings(max_examples=4 * settings.default.max_examples)  # cheap: no attention compiled
@given(data=st.data(), seq=st.sampled_from([5, 17, 37]), block_q=st.sampled_from([1, 8, 16]),
       block_k=st.sampled_from([1, 8, 16]), causal=st.booleans())
def test_block_plan_lists_each_pair_once_per_direction(data, seq, block_q, block_k, causal):
    """Per query block (forward, dq) and per key block (dk / dv), every nonempty pair is
    listed exactly once, as full or partial, and the two directions agree on each pair:
    no double counting at unaligned boundaries, and no pair the planner marked empty."""
    seg = np.array(data.draw(st.lists(segment_row(seq), min_size=2, max_size=2)), np.int32)
    sizes = BlockSizes(block_q, block_k)
    seg_q, seg_k = pad_blocks(seg, block_q), pad_blocks(seg, block_k)
    plan = jax.tree.map(np.asarray, make_plan(seg_q, seg_k, sizes, causal, seq))
    nonempty, full = (np.asarray(x) for x in planner(seg_q, seg_k, block_q, block_k, causal,
                                                     seq))
    by_query = visited_pairs(plan.kv_index, plan.full_count, plan.count)
    by_key = visited_pairs(plan.q_index, plan.q_full_count, plan.q_count)
    assert by_query == {(b, j, i): f for (b, i, j), f in by_key.items()}
    assert set(by_query) == {tuple(x) for x in np.argwhere(nonempty)}
    assert {p for p, f in by_query.items() if f} == {tuple(x) for x in np.argwhere(full)}
