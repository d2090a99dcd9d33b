"""The reference backend against the float64 oracle written from the spec (tests/oracle.py).

This is what makes impl='reference' a trustworthy ground truth for
tests/test_backends.py: its forward pass, lse and gradients agree with a literal
double loop over (query, key) pairs and with finite differences of that loop.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import helpers
import oracle
from helpers import LSE_WEIGHT, Case, case_id, random_segments, run
from tolerances import assert_close_f32

# Hand-derived from the spec for seg = [1, 1, -1, -1, 0, 2, -2, 1]:
# history of session 1 at 0, 1, 7; candidates of session 1 at 2, 3; padding at 4;
# session 2: history at 5, candidate at 6.
HAND_SEG = [1, 1, -1, -1, 0, 2, -2, 1]
HAND_MASK = {
    False: ["11000001",   # history sees all history of its session
            "11000001",
            "11100001",   # a candidate: the session's history and itself
            "11010001",
            "00000000",   # padding sees nothing
            "00000100",
            "00000110",
            "11000001"],
    True: ["10000000",    # causal history: history keys j <= i
           "11000000",
           "11100001",    # candidates still see the whole history (7 too)
           "11010001",
           "00000000",
           "00000100",
           "00000110",
           "11000001"],
}


@pytest.mark.parametrize("causal", [False, True])
def test_oracle_mask_matches_hand_derivation(causal):
    want = np.array([[c == "1" for c in row] for row in HAND_MASK[causal]])
    assert np.array_equal(oracle.mask_loops(np.array([HAND_SEG]), causal)[0], want)
    assert np.array_equal(oracle.mask_dense(np.array([HAND_SEG]), causal)[0], want)


@pytest.mark.parametrize("seed", range(20))
@pytest.mark.parametrize("causal", [False, True])
def test_vectorised_oracle_mask_matches_loops(seed, causal):
    rng = np.random.default_rng(seed)
    seg = rng.integers(-3, 4, (2, int(rng.integers(1, 20))))
    assert np.array_equal(oracle.mask_dense(seg, causal), oracle.mask_loops(seg, causal))


def test_oracle_bounds_match_segment_ids():
    seg = oracle.bounds_to_segments(np.array([[1, 3, 4, 6], [5, 7, 0, 2]]), 8, 2)
    assert seg.tolist() == [[0, 1, 1, 0, -1, -1, 0, 0], [-1, -1, 0, 0, 0, 1, 1, 0]]


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_oracle_bounds_follow_the_phoenix_predicate(data):
    """Two formulations of bounds, overlaps included: segment ids (a token in both ranges is
    history) through the segment-id mask, and Phoenix's predicate on the ranges."""
    seq = data.draw(st.integers(1, 12))
    bounds = data.draw(helpers.bounds(2, seq, broadcast=False))
    seg = oracle.bounds_to_segments(bounds, seq, 2)
    np.testing.assert_array_equal(oracle.mask_dense(seg, causal=False),
                                  oracle.phoenix_bounds_mask(bounds, seq, 2))


def _segments(case: Case, layout: str) -> Case:
    return case.with_mask(random_segments(case.seed, case.batch, case.seq, layout))


ORACLE_CASES = [
    _segments(Case(batch=2, seq=7, heads_q=2, heads_kv=2, dim=4, mask="segment_ids"), "packed"),
    _segments(Case(batch=2, seq=9, heads_q=4, heads_kv=2, dim=4, mask="segment_ids", causal=True,
                   seed=1), "interleaved"),
    _segments(Case(batch=1, seq=8, heads_q=3, heads_kv=1, dim=5, dim_v=3, mask="segment_ids",
                   softcap=2.0, softcap_method="tanh", seed=2), "packed"),
    _segments(Case(batch=2, seq=6, heads_q=2, heads_kv=1, dim=4, mask="segment_ids",
                   softcap=2.0, softcap_method="soft_sign", scale=0.7, seed=3), "interleaved"),
    # history then candidates, candidates first with a gap, no history at all
    Case(batch=3, seq=7, heads_q=2, heads_kv=1, dim=4, mask="bounds_rows", seed=3,
         mask_values=((1, 3, 4, 7), (4, 6, 0, 3), (0, 0, 2, 5))),
    Case(batch=2, seq=6, heads_q=2, heads_kv=2, dim=4, mask="bounds_broadcast", causal=True,
         seed=4, mask_values=(1, 4, 4, 6)),
    Case(batch=2, seq=5, heads_q=2, heads_kv=1, dim=4),
    Case(batch=1, seq=6, heads_q=2, heads_kv=1, dim=4, causal=True, softcap=1.5),
    Case(batch=2, seq=3, kv_seq=7, heads_q=2, heads_kv=1, dim=4, dim_v=6),
    _segments(Case(batch=1, seq=1, heads_q=1, heads_kv=1, dim=3, mask="segment_ids"), "packed"),
    _segments(Case(batch=2, seq=7, heads_q=2, heads_kv=1, dim=4, mask="segment_ids", softcap=2.0,
                   multiplier="rows", seed=5), "packed"),
    _segments(Case(batch=1, seq=8, heads_q=4, heads_kv=2, dim=4, mask="segment_ids",
                   softcap=2.0, softcap_method="soft_sign", multiplier="heads", seed=6),
              "interleaved"),
]


def _reference(case: Case):
    got = run(case, "reference")
    return got["out"], got["lse"], [got["dq"], got["dk"], got["dv"]]


def _loop_mask(case: Case):
    """The mask by the literal loop (or the plain/causal mask when the case has none)."""
    seg = case.segments()
    if seg is None:
        return oracle.no_mask(case.batch, case.seq, case.kv_seq or case.seq, case.causal)
    return oracle.mask_loops(seg, case.causal)


def _oracle_kwargs(case: Case):
    return dict(scale=case.scale, softcap_value=case.softcap, softcap_method=case.softcap_method,
                logit_multiplier=case.logit_multiplier())


@pytest.mark.parametrize("case", ORACLE_CASES, ids=case_id)
def test_reference_forward_matches_oracle(case):
    q, k, v, _ = case.values()
    want_out, want_lse = oracle.attention_loops(q, k, v, _loop_mask(case), **_oracle_kwargs(case))
    out, lse, _ = _reference(case)
    assert_close_f32(out, want_out, "out")
    assert_close_f32(lse, want_lse, "lse")


# Finite differences of the float64 loop need tiny tensors.
GRAD_CASES = [dataclasses.replace(c, dim=3, dim_v=2)
              for c in ORACLE_CASES[:4] + ORACLE_CASES[5:9] + ORACLE_CASES[10:]]


@pytest.mark.parametrize("case", GRAD_CASES, ids=case_id)
def test_reference_gradients_match_finite_differences(case):
    q, k, v, w = case.values()
    want = oracle.finite_difference_grads(q, k, v, _loop_mask(case), w, LSE_WEIGHT,
                                          **_oracle_kwargs(case))
    _, _, got = _reference(case)
    for name, g, e in zip(("dq", "dk", "dv"), got, want):
        assert np.abs(e).max() > 1e-3, f"{name}: degenerate case, the check would be vacuous"
        assert_close_f32(g, e, name)


# --- The vectorised oracle (the judge of every backend) against the loop. -------------------


@pytest.mark.parametrize("case", ORACLE_CASES, ids=case_id)
def test_vectorised_oracle_forward_matches_loops(case):
    q, k, v, _ = case.values()
    want_out, want_lse = oracle.attention_loops(q, k, v, _loop_mask(case), **_oracle_kwargs(case))
    got = oracle.attention(q, k, v, _loop_mask(case), **_oracle_kwargs(case))
    np.testing.assert_array_equal(np.isfinite(got["lse"]), np.isfinite(want_lse))
    assert np.abs(got["out"] - want_out).max() <= 1e-12
    finite = np.isfinite(want_lse)
    assert np.abs(got["lse"][finite] - want_lse[finite]).max(initial=0) <= 1e-12


@pytest.mark.parametrize("case", GRAD_CASES, ids=case_id)
def test_analytic_backward_matches_finite_differences(case):
    """Central differences (step 1e-6) of the float64 loop resolve gradients to ~1e-9."""
    q, k, v, w = case.values()
    mask = _loop_mask(case)
    want = oracle.finite_difference_grads(q, k, v, mask, w, LSE_WEIGHT, **_oracle_kwargs(case))
    got = oracle.attention(q, k, v, mask, w=w, lse_weight=LSE_WEIGHT, **_oracle_kwargs(case))
    for name, e in zip(("dq", "dk", "dv"), want):
        assert np.abs(e).max() > 1e-3, f"{name}: degenerate case, the check would be vacuous"
        assert np.abs(got[name] - e).max() <= 1e-7 * max(1.0, np.abs(e).max()), name


def test_analytic_backward_takes_an_lse_cotangent():
    """d_lse enters as p_ij per key: checked against finite differences of sum(c * lse)."""
    case = GRAD_CASES[1]
    q, k, v, _ = case.values()
    mask = _loop_mask(case)
    c = np.random.default_rng(0).normal(size=(case.batch, case.heads_q, case.seq))
    zero_w = np.zeros((case.batch, case.seq, case.heads_q, case.dim_v))
    got = oracle.attention(q, k, v, mask, w=zero_w, d_lse=c, **_oracle_kwargs(case))
    args = [np.array(x, np.float64) for x in (q, k, v)]

    def f():
        lse = oracle.attention_loops(*args, mask, **_oracle_kwargs(case))[1]
        return float(np.where(np.isfinite(lse), c * lse, 0).sum())

    x = args[0]
    idx = np.unravel_index(np.abs(got["dq"]).argmax(), x.shape)  # a query that sees keys
    orig = x[idx]
    x[idx] = orig + 1e-6
    plus = f()
    x[idx] = orig - 1e-6
    minus = f()
    x[idx] = orig
    assert abs(plus - minus) / 2e-6 > 1e-3, "degenerate entry: the check would be vacuous"
    assert abs(got["dq"][idx] - (plus - minus) / 2e-6) <= 1e-7
