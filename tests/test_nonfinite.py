"""Non-finite inputs stay where they are, on every backend (rankattn.semantics states the rule).

A query is poisoned when it sees a key and its own q (in its head) or the k or v of a
key it sees (in that key's kv head) holds a NaN or an inf: its out and lse are NaN and it
passes no gradient. Everything else is bit-identical to a run without the bad value, and
every gradient stays finite. The expected poisoned rows come from the float64 oracle's mask,
not from rankattn.

The row packs two sessions with padding, as the hardening issue's example does: a bad value
in session 1 used to make all of session 2 NaN (0 * NaN in P @ V) and its dq NaN.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

import oracle
from conftest import skip_if_float16_declined
from helpers import attention_vjp, random_qkv

# Session 1: history 0-9, candidates 10-12; session 2: history 13-24, candidates 25-27; pad.
ROW = np.array([1] * 10 + [-1] * 3 + [2] * 12 + [-2] * 3 + [0] * 2, np.int32)
SEG = np.stack([ROW, np.roll(ROW, 7)])
B, S, HQ, HKV, D = 2, len(ROW), 4, 2, 8
BAD = [  # (tensor, batch row, position, head, what the position is in its row)
    ("v", 0, 4, 1, "history of session 1"),
    ("k", 0, 4, 0, "history of session 1"),
    ("q", 0, 4, 3, "history of session 1"),
    ("k", 0, 11, 1, "a candidate's own key"),
    ("v", 1, 2, 0, "history of session 2, shifted"),
    ("q", 0, 28, 2, "padding"),
    ("k", 0, 29, 0, "padding"),
]


def poisoned_rows(tensor, b, pos, head, causal):
    """bool [B, S, Hq]: the queries the spec poisons, from the oracle's mask."""
    mask = oracle.mask_dense(SEG, causal)                       # [B, S, S]
    hit = np.zeros((B, S, HQ), bool)
    if tensor == "q":
        hit[b, pos, head] = mask[b, pos].any()
    else:
        group = HQ // HKV
        hit[b, :, head * group:(head + 1) * group] = mask[b, :, pos][:, None]
    return hit


def run(impl, q, k, v, d_out, d_lse, causal):
    out, lse, dq, dk, dv = attention_vjp(q, k, v, d_out, d_lse, segment_ids=SEG, causal=causal,
                                         impl=impl)
    return {"out": np.asarray(out), "lse": np.asarray(lse).transpose(0, 2, 1),
            "dq": np.asarray(dq), "dk": np.asarray(dk), "dv": np.asarray(dv)}


@pytest.mark.parametrize("dtype, causal", [("float32", False), ("float32", True),
                                           ("bfloat16", False), ("float16", True)])
@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf])
def test_a_bad_value_poisons_exactly_the_queries_that_see_it(impl, dtype, causal, value):
    """In every input dtype: bf16 and f16 hold NaN and inf too (the kernels test their bits)."""
    skip_if_float16_declined(impl, dtype)
    q, k, v, d_out = random_qkv(11, B, S, HQ, HKV, D)
    q, k, v = (x.astype(jnp.dtype(dtype)) for x in (q, k, v))
    d_lse = np.random.default_rng(12).normal(0, 1, (B, HQ, S)).astype(np.float32)
    clean = run(impl, q, k, v, d_out, d_lse, causal)
    session_of = np.abs(SEG)
    for tensor, b, pos, head, what in BAD:
        inputs = {"q": q.copy(), "k": k.copy(), "v": v.copy()}
        inputs[tensor][b, pos, head, 3] = value
        got = run(impl, inputs["q"], inputs["k"], inputs["v"], d_out, d_lse, causal)
        hit = poisoned_rows(tensor, b, pos, head, causal)
        where = f"{tensor}[{b}, {pos}, {head}] = {value} ({what})"
        assert np.isnan(got["out"][hit]).all() and np.isnan(got["lse"][hit]).all(), where
        for name in ("out", "lse"):
            np.testing.assert_array_equal(got[name][~hit], clean[name][~hit], f"{name}: {where}")
        # Gradients: finite everywhere; bit-identical outside the session of the bad value.
        other = session_of != session_of[b, pos]
        other[1 - b] = True
        for name in ("dq", "dk", "dv"):
            assert np.isfinite(got[name]).all(), f"{name} not finite: {where}"
            np.testing.assert_array_equal(got[name][other], clean[name][other],
                                          f"{name} outside the session: {where}")
        if session_of[b, pos]:
            assert hit.any(), f"vacuous case: {where}"


def test_poisoned_queries_pass_no_gradient(impl):
    """A NaN in session 1's history poisons all of session 1 (non-causal): none of its
    queries passes gradient, so its keys and queries get exactly zero gradient."""
    q, k, v, d_out = random_qkv(13, B, S, HQ, HKV, D)
    d_lse = np.ones((B, HQ, S), np.float32)
    v[0, 3, :, 0] = np.nan                                      # both kv heads
    got = run(impl, q, k, v, d_out, d_lse, False)
    session_1 = np.abs(SEG[0]) == 1
    assert np.isnan(got["out"][0, session_1]).all()
    for name in ("dq", "dk", "dv"):
        assert np.all(got[name][0, session_1] == 0), name
        assert np.abs(got[name][0, ~session_1 & (SEG[0] != 0)]).max() > 0, f"{name}: vacuous"


LONG_ROW = np.array([1] * 48 + [-1] * 8 + [2] * 16 + [0] * 8, np.int32)[None]


@pytest.mark.parametrize("tensor", ["k", "v"])
def test_a_bad_key_in_full_blocks_poisons_its_session_only(impl, tensor):
    """48 history tokens of one session: with 16 x 8 (or 16 x 16) blocks most block pairs are
    full, where the backends skip the mask; the poison must reach those rows too."""
    q, k, v, d_out = random_qkv(14, 1, LONG_ROW.shape[1], 2, 1, 8)
    d_lse = np.zeros((1, 2, LONG_ROW.shape[1]), np.float32)
    inputs = {"q": q, "k": k.copy(), "v": v.copy()}
    inputs[tensor][0, 20, 0, 5] = np.nan
    out, lse, *grads = (np.asarray(x) for x in attention_vjp(
        inputs["q"], inputs["k"], inputs["v"], d_out, d_lse, segment_ids=LONG_ROW, impl=impl))
    clean_out = np.asarray(attention_vjp(q, k, v, d_out, d_lse, segment_ids=LONG_ROW,
                                         impl=impl)[0])
    session_1 = np.abs(LONG_ROW[0]) == 1
    assert np.isnan(out[0, session_1]).all() and np.isnan(lse[0][:, session_1]).all()
    np.testing.assert_array_equal(out[0, ~session_1], clean_out[0, ~session_1])
    for g in grads:
        assert np.isfinite(g).all()


def test_nan_cotangents_of_rows_that_see_nothing_and_a_lone_candidate_regression(impl):
    """Two bugs, one call. A row that sees no key (lse -inf, out 0) passes no gradient even when
    its cotangents are NaN, as ``where(isfinite(lse), lse ** 2, 0)`` hands back (cpu and xla
    gave NaN to every dk and dv of its blocks). A candidate of a session with no history sees
    its own key only, so a NaN in its q poisons it (xla checked q before the own key joined,
    and returned a finite row that passed gradient to its own v)."""
    seg = np.array([[1] * 6 + [-1] * 2 + [-2] * 2 + [0] * 2], np.int32)  # session 2: no history
    q, k, v, d_out = random_qkv(15, 1, seg.shape[1], HQ, HKV, D)
    d_lse = np.random.default_rng(16).normal(0, 1, (1, HQ, seg.shape[1])).astype(np.float32)
    blind = seg[0] == 0
    quiet_out, quiet_lse = d_out.copy(), d_lse.copy()  # the padding rows' cotangents 0, and
    quiet_out[0, blind], quiet_lse[0][:, blind] = 0, 0  # the poisoned query's
    quiet_out[0, 8, 1], quiet_lse[0, 1, 8] = 0, 0
    want = attention_vjp(q, k, v, quiet_out, quiet_lse, segment_ids=seg, impl=impl)
    d_out[0, blind], d_lse[0][:, blind] = np.nan, np.nan
    q = q.copy()
    q[0, 8, 1, 3] = np.nan
    got = attention_vjp(q, k, v, d_out, d_lse, segment_ids=seg, impl=impl)
    out, lse = np.asarray(got[0]), np.asarray(got[1]).transpose(0, 2, 1)
    hit = np.zeros(out.shape[:3], bool)
    hit[0, 8, 1] = True
    assert np.isnan(out[hit]).all() and np.isnan(lse[hit]).all()
    for name, x, y in zip(("out", "lse"), (out, lse),
                          (np.asarray(want[0]), np.asarray(want[1]).transpose(0, 2, 1))):
        np.testing.assert_array_equal(x[~hit], y[~hit], name)
    for name, x, y in zip(("dq", "dk", "dv"), got[2:], want[2:]):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y), name)
