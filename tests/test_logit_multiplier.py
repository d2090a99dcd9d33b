"""attention(logit_multiplier=t): query i's logits are t_i * cap(scale * q_i . k_j).

Its numerics on every backend run in tests/test_backends.py (CONFIGS with ``multiplier=``,
against the float64 oracle, which applies t after the cap); tests/test_oracle.py checks the
oracle's t against the literal loop and finite differences. Here: the argument's checks,
that t gets no gradient, a traced or int t, and a non-finite t (it poisons its query).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import oracle
import rankattn
from helpers import assert_explained, attention_vjp, random_qkv

SEG = np.array([[1, 1, 1, 1, -1, -1, -1, 0, 2, 2, -2, 0]], np.int32)
B, S, HQ, HKV, D = 1, SEG.shape[1], 4, 2, 8


def inputs(seed=0):
    q, k, v, w = random_qkv(seed, B, S, HQ, HKV, D)
    t = np.random.default_rng(seed).uniform(-1, 2, (B, S)).astype(np.float32)
    return q, k, v, w, t


@pytest.mark.parametrize("bad, match", [
    (np.ones((B, S + 1)), r"logit_multiplier has shape \(1, 13\)"),
    (np.ones((B, S, HQ + 1)), r"logit_multiplier has shape \(1, 12, 5\)"),
    (np.ones((S,)), r"logit_multiplier has shape \(12,\)"),
    (np.ones((B, S), bool), "logit_multiplier has dtype bool"),
    (np.ones((B, S), np.complex64), "logit_multiplier has dtype complex64"),
])
def test_malformed_multipliers_raise_ra127(bad, match):
    q, k, v, _, _ = inputs()
    with pytest.raises(rankattn.RankattnError, match=match) as info:
        rankattn.attention(q, k, v, segment_ids=SEG, logit_multiplier=bad, impl="reference")
    assert info.value.code == "RA127"
    assert_explained(info.value)


def test_rows_and_heads_forms_agree_and_ints_are_taken():
    """[B, Sq] is [B, Sq, Hq] broadcast over heads; an int32 multiplier is its float32 values
    (Phoenix passes int32 ones)."""
    q, k, v, _, _ = inputs()
    t = np.random.default_rng(1).integers(-2, 3, (B, S)).astype(np.int32)
    rows = rankattn.attention(q, k, v, segment_ids=SEG, logit_multiplier=t, impl="xla")
    heads = rankattn.attention(q, k, v, segment_ids=SEG, impl="xla",
                               logit_multiplier=np.repeat(t[..., None], HQ, -1).astype(float))
    np.testing.assert_array_equal(np.asarray(rows), np.asarray(heads))
    want, _ = oracle.attention_loops(q, k, v, oracle.mask_dense(SEG, False), logit_multiplier=t)
    np.testing.assert_allclose(np.asarray(rows), want, atol=2e-6)


@pytest.mark.parametrize("dtype", [np.int64, np.uint64, None])  # None: a Python list of ints
def test_an_int_multiplier_past_int32_is_its_float32_value_regression(dtype):
    """An int64 / uint64 multiplier (or a list of ints) past int32 is taken as its float32
    value: it went through jnp.asarray first, which takes 64-bit ints to 32 bits while x64 is
    off (2**32 + 2 became 2, 2**40 became 0)."""
    q, k, v, _, _ = inputs()
    t = np.ones((B, S), np.int64) * 2
    t[0, :3] = [2**32 + 2, 2**40, 2**33]
    given = t.tolist() if dtype is None else t.astype(dtype)
    got = rankattn.attention(q, k, v, segment_ids=SEG, logit_multiplier=given, impl="xla",
                             return_lse=True)
    want = rankattn.attention(q, k, v, segment_ids=SEG, logit_multiplier=t.astype(np.float32),
                              impl="xla", return_lse=True)
    for x, y in zip(got, want):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    assert np.asarray(got[1])[0, :, 0].min() > 1e8  # the huge factors did scale the logits


def test_the_multiplier_gets_no_gradient_and_may_be_traced():
    """Phoenix's backward returns zeros for temp; a traced t gives what a concrete one does."""
    q, k, v, w, t = inputs(2)

    def loss(t, q):
        return (rankattn.attention(q, k, v, segment_ids=SEG, logit_multiplier=t, impl="xla")
                * w).sum()

    d_t, d_q = jax.jit(jax.grad(loss, (0, 1)))(t, q)
    assert np.all(np.asarray(d_t) == 0)
    assert np.abs(np.asarray(d_q)).max() > 0
    eager = rankattn.attention(q, k, v, segment_ids=SEG, logit_multiplier=t, impl="xla")
    traced = jax.jit(lambda t: rankattn.attention(q, k, v, segment_ids=SEG, logit_multiplier=t,
                                                  impl="xla"))(t)
    np.testing.assert_array_equal(np.asarray(eager), np.asarray(traced))


@pytest.mark.parametrize("value", [np.nan, np.inf])
def test_a_non_finite_multiplier_poisons_exactly_its_query(impl, value):
    """Like a non-finite q: that query (in that head) gets NaN out and lse where it sees a key
    and passes no gradient; every other result is bit-identical to a run with a finite t."""
    q, k, v, d_out, _ = inputs(3)
    t = np.random.default_rng(4).uniform(0.5, 1.5, (B, S, HQ)).astype(np.float32)
    d_lse = np.random.default_rng(5).normal(0, 1, (B, HQ, S)).astype(np.float32)
    clean = attention_vjp(q, k, v, d_out, d_lse, segment_ids=SEG, impl=impl, logit_multiplier=t)
    sees = oracle.mask_dense(SEG, False)[0].any(-1)
    for pos, head in ((2, 1), (5, 3), (7, 0)):  # history, a candidate, padding (sees nothing)
        bad = t.copy()
        bad[0, pos, head] = value
        got = attention_vjp(q, k, v, d_out, d_lse, segment_ids=SEG, impl=impl,
                            logit_multiplier=bad)
        out, lse = np.asarray(got[0]), np.asarray(got[1])
        hit = np.zeros((B, S, HQ), bool)
        hit[0, pos, head] = sees[pos]
        assert np.isnan(out[hit]).all() and np.isnan(lse.transpose(0, 2, 1)[hit]).all()
        np.testing.assert_array_equal(out[~hit], np.asarray(clean[0])[~hit])
        np.testing.assert_array_equal(lse.transpose(0, 2, 1)[~hit],
                                      np.asarray(clean[1]).transpose(0, 2, 1)[~hit])
        assert np.all(np.asarray(got[2])[hit] == 0)  # dq of the poisoned query
        for g in got[2:]:
            assert np.isfinite(np.asarray(g)).all()


def test_sharded_calls_take_the_multiplier():
    """The batch / heads path hands each device its rows of t (one device here: the mapping
    itself; tests/distributed/ runs the meshes)."""
    q, k, v, _, t = inputs(6)
    mesh = jax.make_mesh((1,), ("data",))
    sharded = rankattn.attention(q, k, v, segment_ids=SEG, logit_multiplier=t, impl="xla",
                                 sharding=rankattn.Sharding(mesh, batch="data"))
    plain = rankattn.attention(q, k, v, segment_ids=SEG, logit_multiplier=t, impl="xla")
    np.testing.assert_allclose(np.asarray(sharded), np.asarray(plain), atol=1e-6)
    assert jnp.asarray(sharded).shape == (B, S, HQ, D)
