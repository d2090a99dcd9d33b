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
    Against a float32 reference run on the same (rounded, up-cast) inputs:
    |actual - expected| <= eps(dtype) * max |expected| for out, dq, dk and dv
    (eps: 2^-7 for bf16, 2^-10 for f16, one ulp at 1.0, so between one and two
    ulps of the tensor's largest entry), and the float32 rule for lse, which is
    float32 math on the same values. The output cast alone costs half an ulp;
    the backends measured at most 0.71 eps (dq of the mixed-precision paths,
    whose p and ds are rounded to bf16 for the matmuls). A backend that lost the
    float32 softmax fails: a naive all-bf16 attention is 1.5-2.5 eps off
    (test_backends.py::test_naive_low_precision_attention_fails_the_rule).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

F32_TOL = 1e-4


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


def assert_low_precision_close(actual, expected, dtype, name: str = "value"):
    """The bf16 / f16 rule above, for out, dq, dk and dv (lse takes assert_close_f32)."""
    a, e = _split_infinite(name, actual, expected)
    if e.size == 0:
        return
    eps = float(jnp.finfo(dtype).eps)
    err, bound = float(np.abs(a - e).max()), eps * float(np.abs(e).max())
    assert err <= bound, (f"{name}: error {err:.3g} > eps({dtype}) x max |expected| = {bound:.3g} "
                          f"({err / max(bound, 1e-30):.2f} of the bound)")
