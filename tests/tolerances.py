"""Every numerical tolerance of the suite, in one place.

float32 (and the reference vs the float64 oracle)
    |actual - expected| <= F32_TOL * max(1, max |expected|), over the whole
    tensor, with infinities (lse of fully masked rows) required to match exactly.

    Why scale-aware and absolute rather than per-element relative: a blocked
    backend reorders every sum (online softmax over key blocks, scatter-add of
    dk/dv over query blocks), so its rounding error is proportional to the size
    of the terms being summed, which is bounded by the largest entries of the
    tensor, not by each entry (a small dk entry is often the difference of large
    terms). 1e-4 of the largest entry is ~800 float32 ulps: room for sums of a
    few thousand terms, while a real mask, scale, softcap or GQA bug moves
    outputs by 1e-2 or more of that size.

bfloat16 / float16
    The error of the implementation against a float32 reference run on the
    same (up-cast) inputs must be at most LOW_PRECISION_FACTOR times the error
    of a naive computation done entirely in the low-precision dtype (einsum and
    softmax in bf16/f16, tests/helpers.py:naive_attention) against the same
    reference, plus a floor of LOW_PRECISION_FLOOR * max |reference| for the
    cases where the naive error is itself ~0 (e.g. a query that sees one key).
    The floor is half a bf16 ulp at the top of the tensor's range: the output
    cast alone can cost that much.
"""

from __future__ import annotations

import numpy as np

F32_TOL = 1e-4
LOW_PRECISION_FACTOR = 2.0
LOW_PRECISION_FLOOR = 2.0 ** -9


def _split_infinite(name, actual, expected):
    """Check non-finite entries agree exactly; return the finite parts as float64."""
    actual = np.asarray(actual, np.float64)
    expected = np.asarray(expected, np.float64)
    assert actual.shape == expected.shape, f"{name}: shape {actual.shape} != {expected.shape}"
    assert not np.isnan(actual).any(), f"{name}: NaN in result"
    assert not np.isnan(expected).any(), f"{name}: NaN in expected values"
    inf_a, inf_e = ~np.isfinite(actual), ~np.isfinite(expected)
    assert np.array_equal(inf_a, inf_e), (
        f"{name}: non-finite entries differ at {np.argwhere(inf_a != inf_e)[:5].tolist()}")
    assert np.array_equal(actual[inf_a], expected[inf_e]), f"{name}: infinities differ in sign"
    finite = ~inf_e
    return actual[finite], expected[finite]


def assert_close_f32(actual, expected, name: str = "value", tol: float = F32_TOL):
    a, e = _split_infinite(name, actual, expected)
    if e.size == 0:
        return
    bound = tol * max(1.0, float(np.abs(e).max()))
    err = np.abs(a - e)
    assert err.max() <= bound, (
        f"{name}: max error {err.max():.3g} > {bound:.3g} at flat index {int(err.argmax())} "
        f"(got {a[err.argmax()]!r}, expected {e[err.argmax()]!r})")


def assert_low_precision_close(actual, reference, naive, name: str = "value"):
    """The bf16/f16 rule above: error(actual) <= 2 * error(naive) + floor."""
    a, e = _split_infinite(name, actual, reference)
    naive = np.asarray(naive, np.float64)[np.isfinite(np.asarray(reference, np.float64))]
    if e.size == 0:
        return
    assert np.isfinite(naive).all(), f"{name}: the naive baseline is not finite (test bug)"
    err = float(np.abs(a - e).max())
    naive_err = float(np.abs(naive - e).max())
    bound = LOW_PRECISION_FACTOR * naive_err + LOW_PRECISION_FLOOR * float(np.abs(e).max())
    assert err <= bound, (f"{name}: error {err:.3g} > {LOW_PRECISION_FACTOR} x naive error "
                          f"{naive_err:.3g} + floor (bound {bound:.3g})")
