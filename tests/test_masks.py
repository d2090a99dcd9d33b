"""Named mask properties, on every backend (the `impl` fixture in conftest.py).

* Queries that see no key (padding rows, padding inside a packed row, bounds
  with empty ranges) give out exactly 0, lse -inf, exactly zero gradients, and
  no NaN anywhere, even when the loss puts a cotangent on their -inf lse.
* Candidate isolation and batch independence: changing other candidates,
  other sessions or other batch rows leaves a query's results bit-for-bit
  unchanged (masked keys contribute exact zeros).
* A packed row equals its sessions run as separate rows.
"""

from __future__ import annotations

import numpy as np
import pytest

from helpers import Case, attention_jit, attention_vjp, random_qkv, run
from tolerances import assert_close_f32

PAD_INSIDE = [0, 3, 3, -3, 0, -3, 3, 0, 0, 5, -5, -5, 5, 5, 5, 5, 5, 5, 0, 0, 0]  # 21 tokens


def _blind_case(kind: str, causal: bool) -> Case:
    """A case where some queries see nothing, and the bool [B, S] of those queries."""
    seq = len(PAD_INSIDE)
    if kind == "bounds":   # row 0: both ranges empty; row 1: history only, rest padding
        return Case(batch=2, seq=seq, heads_q=4, heads_kv=2, dim=8, mask="bounds_rows",
                    mask_values=((4, 4, 9, 9), (3, 11, 11, 11)), causal=causal, seed=7)
    return Case(batch=2, seq=seq, heads_q=4, heads_kv=2, dim=8, mask="segment_ids",
                mask_values=((0,) * seq, tuple(PAD_INSIDE)), causal=causal, seed=7)


@pytest.mark.parametrize("kind, causal", [("segment_ids", False), ("segment_ids", True),
                                          ("bounds", False)])
def test_queries_that_see_nothing_are_exact_zeros(impl, kind, causal):
    case = _blind_case(kind, causal)
    seg = case.segments()
    blind = seg == 0                                      # [B, S]; padding sees nothing
    assert blind[0].all() and blind[1].any() and not blind[1].all()
    got = run(case, impl)
    for name, x in got.items():
        assert not np.isnan(x).any(), f"NaN in {name}"
    assert np.all(got["out"][blind] == 0)
    assert np.all(got["lse"].transpose(0, 2, 1)[blind] == -np.inf)
    assert np.isfinite(got["lse"].transpose(0, 2, 1)[~blind]).all()
    # Padding keys are seen by nobody and padding queries see nobody: zero gradients.
    for name in ("dq", "dk", "dv"):
        assert np.all(got[name][blind] == 0), name
        assert np.abs(got[name][~blind]).max() > 0, f"{name} vanishes everywhere: vacuous test"


@pytest.mark.parametrize("kind", ["segment_ids", "bounds"])
def test_lse_cotangent_on_blind_rows_gives_no_nan(impl, kind):
    """d loss / d lse = 1 even where lse = -inf: gradients stay finite, zero on blind rows."""
    case = _blind_case(kind, causal=False)
    q, k, v, w = case.values()
    kw, mask = case.mask_arg()
    d_lse = np.ones((case.batch, case.heads_q, case.seq), np.float32)
    _, _, dq, dk, dv = attention_vjp(q, k, v, w, d_lse, **{kw: mask}, impl=impl)
    blind = case.segments() == 0
    for name, g in (("dq", dq), ("dk", dk), ("dv", dv)):
        g = np.asarray(g)
        assert np.isfinite(g).all(), f"non-finite {name}"
        assert np.all(g[blind] == 0), name


def _isolation_row():
    """Session 1: history 0-5, candidates 6-9; session 2: history 10-14, candidates 15-17; pad."""
    return np.array([1] * 6 + [-1] * 4 + [2] * 5 + [-2] * 3 + [0] * 2, np.int32)


@pytest.mark.parametrize("causal", [False, True])
def test_other_candidates_and_sessions_do_not_leak(impl, causal):
    seg = _isolation_row()[None]
    q, k, v, _ = random_qkv(3, 1, seg.shape[1], 4, 2, 16)

    def call(q, k, v):
        out, lse = attention_jit(q, k, v, segment_ids=seg, causal=causal, return_lse=True,
                                 impl=impl)
        return np.asarray(out), np.asarray(lse).transpose(0, 2, 1)

    out, lse = call(q, k, v)
    rng = np.random.default_rng(0)
    for changed in ([7], [6, 8, 9], list(range(10, 18))):   # one / other candidates, other session
        q2, k2, v2 = q.copy(), k.copy(), v.copy()
        for x in (q2, k2, v2):
            x[0, changed] += rng.normal(0, 3, x[0, changed].shape).astype(np.float32)
        out2, lse2 = call(q2, k2, v2)
        same = np.ones(seg.shape[1], bool)
        same[changed] = False
        np.testing.assert_array_equal(out2[0, same], out[0, same])
        np.testing.assert_array_equal(lse2[0, same], lse[0, same])
        assert not np.allclose(out2[0, changed], out[0, changed]), "perturbation had no effect"


def test_other_batch_rows_do_not_leak(impl):
    seq = 40
    seg = np.stack([np.array([1] * 9 + [-1] * 7 + [0] * 24, np.int32),
                    np.array([2] * 30 + [-2] * 10, np.int32)])
    q, k, v, _ = random_qkv(4, 2, seq, 2, 1, 8)
    out, lse = attention_jit(q, k, v, segment_ids=seg, return_lse=True, impl=impl)
    # New values and a different (longer, many-block) layout in row 1 only.
    q2, k2, v2, _ = random_qkv(5, 2, seq, 2, 1, 8)
    q2[0], k2[0], v2[0] = q[0], k[0], v[0]
    seg2 = seg.copy()
    seg2[1] = np.tile([3, 3, -3, 4, -4], 8)
    out2, lse2 = attention_jit(q2, k2, v2, segment_ids=seg2, return_lse=True, impl=impl)
    np.testing.assert_array_equal(np.asarray(out2)[0], np.asarray(out)[0])
    np.testing.assert_array_equal(np.asarray(lse2)[0], np.asarray(lse)[0])


PACKED_ROWS = {
    "contiguous": [0, 4, 4, 4, -4, -4, 0, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, -7, -7, -7, 0, 2, -2, -2,
                   2, 2, 0, 0, 0],
    "interleaved": [4, 7, -4, 7, 2, 4, -7, 0, 7, -2, 4, 7, 7, -4, 2, 7, -7, 7, 0, 4, 4, -2, 7,
                    -4, 2, 7, 0, -7, 7],
}


def _values_and_grads(impl, q, k, v, seg, w, causal):
    d_lse = np.zeros((q.shape[0], q.shape[2], q.shape[1]), np.float32)
    out, lse, *grads = attention_vjp(q, k, v, w, d_lse, segment_ids=seg, causal=causal, impl=impl)
    return [np.asarray(x) for x in (out, lse.transpose(0, 2, 1), *grads)]


@pytest.mark.parametrize("layout, causal", [("contiguous", False), ("interleaved", True)])
def test_packed_row_equals_sessions_run_separately(impl, layout, causal):
    seg = np.array([PACKED_ROWS[layout]], np.int32)
    seq = seg.shape[1]
    q, k, v, w = random_qkv(6, 1, seq, 4, 1, 16)
    packed = _values_and_grads(impl, q, k, v, seg, w, causal)

    # Each session on its own batch row, tokens in their original order, padded at the end.
    sessions = sorted(set(np.abs(seg[0])) - {0})
    positions = [np.flatnonzero(np.abs(seg[0]) == s) for s in sessions]
    sep = [np.zeros((len(sessions),) + x.shape[1:], x.dtype) for x in (q, k, v, w, seg)]
    for r, pos in enumerate(positions):
        for dst, src in zip(sep, (q, k, v, w, seg)):
            dst[r, :len(pos)] = src[0, pos]
    separate = _values_and_grads(impl, *sep[:3], sep[4], sep[3], causal)

    for name, p, s in zip(("out", "lse", "dq", "dk", "dv"), packed, separate):
        for r, pos in enumerate(positions):
            assert_close_f32(p[0, pos], s[r, :len(pos)], f"{name} of session {sessions[r]}")
    pad = seg[0] == 0
    assert np.all(packed[0][0, pad] == 0)
