"""rankattn.plan: built once per batch, reused by every layer, bit-identical to passing the mask."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import rankattn
from helpers import random_qkv, random_segments
from rankattn.backends import BlockSizes, Xla
from tolerances import assert_close_f32

SMALL = BlockSizes(16, 8)
SMALL_XLA = Xla(SMALL)


def reference(q, k, v, return_lse=False, **mask):
    """impl='reference' under jit (one compile instead of one per eager op)."""
    return jax.jit(lambda q, k, v, mask: rankattn.attention(
        q, k, v, impl="reference", return_lse=return_lse, **mask))(q, k, v, mask)


def _segments(seed=0, batch=2, seq=53):
    return jnp.asarray(random_segments(seed, batch, seq, "packed"))


@pytest.mark.parametrize("causal", [False, True])
def test_plan_is_bit_identical_to_passing_the_mask(causal):
    seg = _segments()
    q, k, v, _ = random_qkv(1, 2, 53, 4, 2, 16)
    plan = rankattn.plan(segment_ids=seg, causal=causal, impl=[SMALL_XLA])
    with_plan = jax.jit(lambda p: rankattn.attention(q, k, v, plan=p, return_lse=True,
                                                     impl=SMALL_XLA))(plan)
    without = jax.jit(lambda s: rankattn.attention(q, k, v, segment_ids=s, causal=causal,
                                                   impl=SMALL_XLA, return_lse=True))(seg)
    for a, b in zip(with_plan, without):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("impl", [SMALL_XLA, "auto"], ids=["xla-16x8", "auto"])
def test_a_one_row_plan_broadcasts_like_one_row_of_bounds(impl):
    """Issue 19: attention(bounds=[4]) broadcast over the batch while plan(bounds=[4]) made a
    plan for one row only. Now both broadcast, bit for bit, and a [1, S] plan too."""
    q, k, v, _ = random_qkv(3, 3, 40, 4, 2, 8)
    bounds = np.array([0, 25, 22, 37], np.int32)  # overlapping: the token in both is history
    want = rankattn.attention(q, k, v, bounds=bounds, return_lse=True, impl=impl)
    for plan in (rankattn.plan(bounds=bounds, seq_len=40, impl=impl),
                 rankattn.plan(segment_ids=rankattn.plan(bounds=bounds[None], seq_len=40)
                               .segment_ids, impl=impl)):
        assert plan.shape == (1, 40)
        got = jax.jit(lambda p: rankattn.attention(q, k, v, plan=p, return_lse=True,
                                                   impl=impl))(plan)
        for a, b in zip(got, want):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("rows, batch", [(2, 3), (1, 0), (2, 1)])
def test_broadcast_to_a_batch_it_cannot_serve_is_ra117_regression(rows, batch):
    """Regression (review): Plan.broadcast_to, public, raised JAX's broadcasting ValueError for a
    plan of B > 1 rows and another batch (attention checks the shapes first; direct callers
    did not)."""
    plan = rankattn.plan(segment_ids=np.ones((rows, 8), np.int32))
    with pytest.raises(rankattn.RankattnValueError, match="RA117") as err:
        plan.broadcast_to(batch)
    assert f"{rows} rows" in str(err.value) and f"batch={batch}" in str(err.value)
    assert plan.broadcast_to(rows) is plan


def test_old_spellings_raise_naming_the_new_ones():
    with pytest.raises(rankattn.RankattnValueError, match="RA125") as err:
        rankattn.plan(segment_ids=_segments(), impls=[SMALL_XLA])
    assert "impl=" in str(err.value)
    with pytest.raises(rankattn.RankattnValueError, match="RA125") as err:
        Xla(SMALL, True)
    assert "mixed_precision=" in str(err.value)
    assert Xla(SMALL, mixed_precision=True).mixed_precision is True


def test_plan_from_bounds_equals_segment_ids():
    bounds = jnp.array([[0, 30, 30, 41], [5, 20, 25, 53]], jnp.int32)
    q, k, v, _ = random_qkv(2, 2, 53, 2, 2, 8)
    plan = rankattn.plan(bounds=bounds, seq_len=53)
    want = reference(q, k, v, bounds=bounds)
    assert_close_f32(jax.jit(lambda p: rankattn.attention(q, k, v, plan=p))(plan), want, "out")


def test_one_plan_serves_every_layer_and_the_backward_pass():
    """A 3-layer stack: the plan is built inside jit from traced segment ids, once."""
    seg = _segments(3)
    x, _, _, _ = random_qkv(4, 2, 53, 4, 2, 16)
    weights = [jnp.asarray(np.random.default_rng(i).normal(0, 0.3, (4, 16, 16)), jnp.float32)
               for i in range(3)]

    def model(x, weights, seg, use_plan):
        plan = rankattn.plan(segment_ids=seg, impl=[SMALL_XLA]) if use_plan else None
        for w in weights:
            q = jnp.einsum("bshd,hde->bshe", x, w)
            kv = q[:, :, ::2]
            if use_plan:
                x = x + rankattn.attention(q, kv, kv, plan=plan, impl=SMALL_XLA)
            else:
                x = x + rankattn.attention(q, kv, kv, segment_ids=seg, impl="reference")
        return (x ** 2).sum()

    loss = jax.jit(jax.value_and_grad(model, argnums=(0, 1)), static_argnums=3)
    (got, (gx, gw)) = loss(x, weights, seg, True)
    (want, (wx, ww)) = loss(x, weights, seg, False)
    assert_close_f32(got, want, "loss")
    assert_close_f32(gx, wx, "dx")
    for i, (a, b) in enumerate(zip(gw, ww)):
        assert_close_f32(a, b, f"dw{i}")


def test_jitted_plan_sees_new_segment_values():
    """Same compiled function, different traced segment ids: no stale plan."""
    q, k, v, _ = random_qkv(5, 2, 53, 2, 1, 8)

    @jax.jit
    def run(seg):
        return rankattn.attention(q, k, v, plan=rankattn.plan(segment_ids=seg, impl=[SMALL_XLA]),
                                  impl=SMALL_XLA)

    for seed in (6, 7):
        seg = _segments(seed)
        want = reference(q, k, v, segment_ids=seg)
        assert_close_f32(run(seg), want, f"out (segments of seed {seed})")


def test_plan_passes_through_jit_boundaries_as_a_pytree():
    seg = _segments(8)
    plan = jax.jit(lambda s: rankattn.plan(segment_ids=s, impl=[SMALL_XLA]))(seg)
    q, k, v, _ = random_qkv(9, 2, 53, 2, 2, 8)
    got = jax.jit(lambda q, k, v, p: rankattn.attention(q, k, v, plan=p, impl=SMALL_XLA))(q, k, v, plan)
    assert_close_f32(got, reference(q, k, v, segment_ids=seg), "out")


def test_plan_blocks_follow_the_backend_classification():
    """One session of 32 history + 8 candidates in 16x8 blocks: full, partial and empty lists."""
    seg = jnp.asarray(np.r_[[1] * 32, [-1] * 8, [0] * 8][None], jnp.int32)
    plan = rankattn.plan(segment_ids=seg, impl=[SMALL_XLA])
    # Query blocks 0-1 are history (all real): key blocks 0-3 are all history -> full.
    # Query block 2 holds 8 candidates and 8 padding tokens -> history blocks are partial.
    np.testing.assert_array_equal(np.asarray(plan.block_plans[0].full_count), [[4, 4, 0]])
    np.testing.assert_array_equal(np.asarray(plan.block_plans[0].count), [[4, 4, 4]])
    assert set(np.asarray(plan.block_plans[0].kv_index)[0, 2, :4]) == {0, 1, 2, 3}


def test_ragged_last_query_block_is_full_despite_internal_padding():
    """The backend pads 44 queries to 48; those 4 rows are discarded, so block 2 stays full.

    (A user's own padding, segment id 0, is different: its rows must output 0,
    so it makes a block partial, as the test above shows.)
    """
    seg = jnp.asarray(np.r_[[1] * 32, [-1] * 12][None], jnp.int32)
    plan = rankattn.plan(segment_ids=seg, impl=[SMALL_XLA])
    np.testing.assert_array_equal(np.asarray(plan.block_plans[0].full_count), [[4, 4, 4]])
    np.testing.assert_array_equal(np.asarray(plan.block_plans[0].count), [[4, 4, 4]])
    q, k, v, _ = random_qkv(10, 1, 44, 2, 1, 8)
    want = reference(q, k, v, segment_ids=seg, return_lse=True)
    got = jax.jit(lambda p: rankattn.attention(q, k, v, plan=p, return_lse=True,
                                               impl=SMALL_XLA))(plan)
    for name, a, b in zip(("out", "lse"), got, want):
        assert_close_f32(a, b, name)
    grads = [jax.jit(jax.grad(lambda q, k, v, kw=kw: (rankattn.attention(q, k, v, **kw) ** 2).sum(),
                              argnums=(0, 1, 2)))(q, k, v)
             for kw in (dict(plan=plan, impl=SMALL_XLA), dict(segment_ids=seg, impl="reference"))]
    for name, a, b in zip(("dq", "dk", "dv"), *grads):
        assert_close_f32(a, b, name)


@pytest.mark.parametrize("kwargs, fragment", [
    (dict(), "needs segment_ids or bounds"),
    (dict(bounds=np.array([0, 3, 3, 5])), "needs seq_len"),
    (dict(segment_ids=np.ones(5, np.int32)), "needs [B, S]"),
    # Regression cases (review): ragged lists raised numpy's bare ValueError; zero rows of
    # bounds made a plan no call could use; both masks without seq_len asked for seq_len.
    (dict(segment_ids=[[1, 2], [1]]), "[RA107] segment_ids must be an int array [B, S]; got list"),
    (dict(bounds=[[0, 1, 1], [0, 1, 1, 2]], seq_len=5), "[RA108] bounds [[0, 1, 1], [0, 1, 1, 2]] "
                                                        "is not a rectangular array"),
    (dict(bounds=np.zeros((0, 4), int), seq_len=5), "[RA105] plan(bounds=...) got shape (0, 4)"),
    (dict(segment_ids=np.ones((1, 4), np.int32), bounds=[0, 1, 1, 2]), "[RA110]"),
])
def test_plan_argument_errors(kwargs, fragment):
    with pytest.raises(rankattn.RankattnError, match="RA1") as err:
        rankattn.plan(**kwargs)
    assert fragment in str(err.value)


def test_attention_rejects_a_plan_with_a_mask_or_of_another_shape():
    seg = _segments()
    plan = rankattn.plan(segment_ids=seg)
    q, k, v, _ = random_qkv(0, 2, 53, 2, 2, 8)
    with pytest.raises(rankattn.RankattnValueError, match=r"RA117.*segment_ids"):
        rankattn.attention(q, k, v, plan=plan, segment_ids=seg)
    with pytest.raises(rankattn.RankattnValueError, match=r"RA117.*\(2, 53\).*S=40"):
        rankattn.attention(q[:, :40], k[:, :40], v[:, :40], plan=plan)
