"""Every numerical tolerance of the suite, in one place, and why each is what it is.

Backends are checked per element against the float64 oracle (tests/oracle.py), run on
exactly the values the backend saw (bf16 / f16 inputs and the loss weight rounded to
that dtype first). The bound of each element scales with what forms that element, not
with the largest entry of the tensor: a small dk entry that is the difference of large
terms may be off by much more than its own size, while a small out entry made of small
terms may not. The oracle returns two magnitudes per element (`oracle.attention(...,
magnitudes=True)`):

* ``terms``: the sum of the absolute values of the terms that form the element:
  ``sum_j p_ij |v_jd|`` for out, ``sum_i p_ij |do_id|`` for dv, ``scale sum_j |ds_ij|' |k_jd|``
  for dq and ``scale sum_i |ds_ij|' |q_id|`` for dk, where ``|ds_ij|' = |ds_ij| + p_ij |cap'|
  |do_i| . |out_i|`` adds what rounding out can move ds by (through ``delta_i = do_i .
  out_i``); ``1 + |lse|`` for lse.
* ``amplified``: what bounds the error of the float math itself. The same sums with each
  ``p_ij`` weighted by ``1 + E_ij``, where ``E_ij`` sums the magnitudes of the products
  forming logit ``ij`` and the lse (``scale |q_i| . |k_j|`` times the cap's slope), and with
  ``|ds_ij|'`` replaced by ``p_ij (|do_i| . |v_j| + |do_i| . |out_i| + |dlse_i|) |cap'|`` (the
  terms of ``dp - delta`` before they cancel). A logit computed with unit roundoff ``u`` is
  off by about ``u L_ij``, which moves ``p_ij`` by that much relative to itself: this is how
  the error of the float math grows with the size of the logits.

The rules (``u``: unit roundoff, half of ``finfo(dtype).eps``):

float64 math (float64 inputs)
    ``|actual - expected| <= TOL64 * amplified``, TOL64 = 2**-40 (about 4e3 u of float64, so
    at most 1e-12 of the magnitude, a hundred times inside the 1e-10 that is asked). A float64
    backend whose math silently ran in float32 is off by about 1e-7 of it.

float32
    ``|actual - expected| <= TOL32 * amplified``, TOL32 = 2**-19 (32 u of float32): room for
    sums reordered by blocking (online softmax over key blocks, scatter-adds of dk / dv over
    query blocks), whose rounding the magnitude already scales. The correct backends measured
    at most 0.08 of it (reference, xla 16 x 8, xla mixed precision: every configuration of
    tests/test_backends.py, 20 seeds each, ``cd tests && ../.venv/bin/python
    tolerance_report.py --seeds 20``; test_tolerances.py runs 20 seeds of three configurations
    in CI on the reference, xla (two settings), pallas_triton (interpreted) and the cpu
    kernel; pallas_tpu and mosaic_gpu are checked against the oracle, not for this room);
    a wrong mask, scale, cap or GQA mapping moves elements by 1e-3 or
    more of their magnitude, a hundred times the bound.

bfloat16 / float16 (f32 math on the rounded inputs)
    ``|actual - expected| <= LOW_K * eps * terms + TOL32 * amplified``, LOW_K = 1, so 2u of
    the terms. What a correct backend may lose to the low-precision dtype, with the math in
    float32:

    * out, dq, dk, dv are rounded once to the dtype: ``u |x| <= u terms``;
    * the mixed-precision paths feed p (for out and dv) and ds (for dq and dk) to the dots
      in the dtype: at most ``u`` of each term, another ``u terms``; dq and dk also see out
      rounded to the dtype inside ``delta``, which the ``|ds|'`` of their terms covers.

    The float32 rule alone for lse, whose math is float32 on the same values. None of these
    grows with the logits: the logits of bf16 operands are exact products summed in float32.
    Measured on correct backends (the same report): at most 0.84 of the bound on out and 0.83
    on dv (the mixed-precision path, p rounded), 0.64 on dk, 0.49 on dq; 0.50 / 0.50 / 0.46 /
    0.36 where only the result is rounded (reference, xla on CPU). What breaks the rule (tests/test_tolerances.py
    runs each, and each fails on every field it changes): a softmax in bf16 (logits rounded:
    ``u |s_ij|`` relative on p, several eps at logits of a few units), dk / dv accumulated
    in bf16 over query blocks (1.7x and 4.2x the bound on 1031 tokens), a scale rounded to
    bf16, a dropped own-key term.

Underflow
    Every rule also allows ``FLOOR * n`` absolute (n: the number of terms in the element's
    sums), ``FLOOR`` a small multiple of float32's smallest normal plus the dtype's smallest
    subnormal: p below float32's normal range is flushed to 0 on CPU, and float16 results
    below its normal range keep a fixed absolute spacing.

Non-finite entries (lse of rows that see nothing) must match exactly; NaN fails.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

TOL64 = 2.0 ** -40
TOL32 = 2.0 ** -19
LOW_K = 1.0

FIELDS = ("out", "lse", "dq", "dk", "dv")


def _split_infinite(name, actual, expected):
    """Check non-finite entries agree exactly; return the finite parts as float64 and their mask."""
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
    return actual[finite], expected[finite], finite


def floor(dtype, n_terms: int) -> float:
    """The absolute allowance for underflow (see above)."""
    sub = float(jnp.finfo(dtype).smallest_subnormal)
    return n_terms * (16 * float(np.finfo(np.float32).tiny) + 2 * sub)


def bound(name: str, dtype, terms, amplified, n_terms: int):
    """Per-element bound on |actual - expected| for field ``name`` of a ``dtype`` result."""
    dtype = jnp.dtype(dtype)
    amplified = np.asarray(amplified, np.float64)
    if dtype == jnp.float64:
        b = TOL64 * amplified
    else:
        b = TOL32 * amplified
        if dtype != jnp.float32 and name != "lse":
            b = b + LOW_K * float(jnp.finfo(dtype).eps) * np.asarray(terms, np.float64)
    return b + floor(dtype, n_terms)


def error_ratio(name, actual, expected, dtype, terms, amplified, n_terms: int) -> float:
    """max over elements of |actual - expected| / bound; <= 1 passes (inf: NaN or infinities
    that differ)."""
    try:
        a, e, finite = _split_infinite(name, actual, expected)
    except AssertionError:
        return float("inf")
    if e.size == 0:
        return 0.0
    b = bound(name, dtype, terms, amplified, n_terms)[finite]
    return float((np.abs(a - e) / b).max())


def assert_matches(name, actual, expected, dtype, terms, amplified, n_terms: int):
    """The rule above for one field; the message gives the worst element."""
    a, e, finite = _split_infinite(name, actual, expected)
    if e.size == 0:
        return
    b = bound(name, dtype, terms, amplified, n_terms)[finite]
    ratio = np.abs(a - e) / b
    worst = int(ratio.argmax())
    assert ratio[worst] <= 1, (
        f"{name} ({jnp.dtype(dtype).name}): error {abs(a[worst] - e[worst]):.3g} is "
        f"{ratio[worst]:.2f}x its bound {b[worst]:.3g} at flat index {worst} "
        f"(got {a[worst]!r}, expected {e[worst]!r})")


# --- Comparisons without an oracle magnitude. ---------------------------------------------
#
# Two rankattn results that should agree up to float32 reordering (a plan against the mask it
# was made from, serving against the core call, one device against a mesh): the tensor-wide
# float32 rule, |actual - expected| <= F32_TOL * max(1, max |expected|). 1e-4 of the largest
# entry is ~800 float32 ulps, room for sums of a few thousand terms in another order.

F32_TOL = 1e-4
# Serving rows against a float64 numpy softmax over the same few keys (tens to hundreds, values
# of size ~1): a few float32 ulps; 1e-5 is ~80 ulps at 1.0.
FEW_KEYS_TOL = 1e-5
# The same per-user computation on one device and on a mesh shard: only XLA's fusion differs.
SAME_MATH_TOL = 1e-6
# One device against a mesh whose shards' partial results merge by log-sum-exp: the same float32
# sums split in another place, a few ulps at values of size ~1.
SHARDED_TOL = 1e-5
# The reference ranker's cached serving against its full forward pass: the example's documented
# target (examples/ranker/README.md), a few layers of float32 attention in two orders.
RANKER_CACHED_TOL = 1e-5


def assert_close_f32(actual, expected, name: str = "value", tol: float = F32_TOL):
    a, e, _ = _split_infinite(name, actual, expected)
    if e.size == 0:
        return
    limit = tol * max(1.0, float(np.abs(e).max()))
    err = np.abs(a - e)
    assert err.max() <= limit, (
        f"{name}: max error {err.max():.3g} > {limit:.3g} at flat index {int(err.argmax())} "
        f"(got {a[err.argmax()]!r}, expected {e[err.argmax()]!r})")
