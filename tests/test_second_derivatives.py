"""Second derivatives: where they run they match the float64 oracle, elsewhere RA130.

The backends' first derivatives come from custom VJPs whose backward is itself a kernel (an
FFI call, a Pallas kernel, a loop of dynamic length), which JAX cannot differentiate again.
The reference is plain jnp and gives any order; the xla backend's loops have a forward-mode
derivative, so jax.jvp of jax.grad (a Hessian-vector product) runs there. Everywhere else a
second derivative is refused with RA130 at trace time, before any kernel runs, instead of
JAX's message about an FFI call or a while_loop.

The expected Hessian-vector product is a central difference of the oracle's analytic float64
gradients: with step 1e-4 its truncation error is ~1e-8 of the result and its rounding ~1e-12,
far inside the float32 rule it is checked with (tolerances.F32_TOL).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import oracle
import rankattn
from helpers import random_qkv
from rankattn import serving
from rankattn.backends import Xla
from tolerances import assert_close_f32

# Two packed sessions (history, then candidates) and padding: candidate isolation's blocks.
ROW = np.array([1] * 9 + [-1] * 3 + [2] * 6 + [-2] * 2 + [0] * 2, np.int32)
SEG = np.stack([ROW, np.roll(ROW, 5)])
B, S, HQ, HKV, D = 2, len(ROW), 4, 2, 8
SOFTCAP = 5.0
STEP = 1e-4


def _inputs():
    q, k, v, w = random_qkv(21, B, S, HQ, HKV, D)
    tangents = random_qkv(22, B, S, HQ, HKV, D)[:3]
    return (q, k, v), w, tangents


def _loss(impl, w):
    def loss(q, k, v):
        out = rankattn.attention(q, k, v, segment_ids=SEG, softcap=SOFTCAP, impl=impl)
        return (out * w).sum()
    return loss


def _hvp_forward_over_reverse(impl):
    primals, w, tangents = _inputs()
    return jax.jit(lambda p, t: jax.jvp(jax.grad(_loss(impl, w), argnums=(0, 1, 2)), p, t)[1])(
        primals, tangents)


def _hvp_batched(impl):
    """Forward over reverse under vmap (what jax.hessian and probes of a Hessian trace do),
    along t and 2 t: the second half is twice the first."""
    primals, w, tangents = _inputs()
    grad = jax.grad(_loss(impl, w), argnums=(0, 1, 2))
    stacked = tuple(jnp.stack([t, 2 * t]) for t in tangents)
    both = jax.jit(jax.vmap(lambda t: jax.jvp(grad, primals, t)[1]))(stacked)
    assert_close_f32(np.asarray(both[0][1]), 2 * np.asarray(both[0][0]), "vmap: H.2t = 2 H.t")
    return [x[0] for x in both]


def _hvp_reverse_over_reverse(impl):
    primals, w, tangents = _inputs()
    grads = jax.grad(_loss(impl, w), argnums=(0, 1, 2))
    inner = lambda *x: sum((g * t).sum() for g, t in zip(grads(*x), tangents))
    return jax.jit(jax.grad(inner, argnums=(0, 1, 2)))(*primals)


def _oracle_hvp():
    primals, w, tangents = _inputs()
    mask = oracle.mask_dense(SEG, False)

    def grads(sign):
        moved = [np.float64(x) + sign * STEP * np.float64(t) for x, t in zip(primals, tangents)]
        res = oracle.attention(*moved, mask, w=w, softcap_value=SOFTCAP)
        return [res[name] for name in ("dq", "dk", "dv")]

    return [(p - m) / (2 * STEP) for p, m in zip(grads(1), grads(-1))]


@pytest.fixture(scope="module")
def oracle_hvp():
    return _oracle_hvp()


def _d_cotangent(impl):
    """The gradient's derivative with respect to the loss weight alone: only the backward is
    differentiated (q, k, v are constants of the pullback)."""
    primals, w, tangents = _inputs()
    _, pullback = jax.vjp(lambda q, k, v: rankattn.attention(
        q, k, v, segment_ids=SEG, softcap=SOFTCAP, impl=impl), *primals)
    return jax.grad(lambda w: sum((g * t).sum() for g, t in zip(pullback(w), tangents)))(w)


def test_second_derivatives_match_the_oracle_or_raise_ra130(impl, oracle_hvp):
    """reference: both products against the oracle; xla: forward over reverse against the
    oracle, under vmap too (jax.custom_derivatives.linear_call had no batching rule, so
    jax.hessian failed: regression), the rest RA130; every other backend RA130 for each kind, including one that
    differentiates the backward kernel alone."""
    refused = []
    if impl == "reference":
        computed = [_hvp_forward_over_reverse, _hvp_reverse_over_reverse]
    elif isinstance(impl, Xla):
        computed = [_hvp_forward_over_reverse, _hvp_batched]
        refused = [_hvp_reverse_over_reverse, _d_cotangent]
    else:
        computed = []
        refused = [_hvp_forward_over_reverse, _hvp_reverse_over_reverse, _d_cotangent]
    for compute in computed:
        for field, got, want in zip(("dq", "dk", "dv"), compute(impl), oracle_hvp):
            assert_close_f32(np.asarray(got), want, f"{compute.__name__}, {field}")
    for compute in refused:
        with pytest.raises(rankattn.RankattnError, match=r"\[RA130\]"):
            compute(impl)


def test_serving_second_derivatives_raise_ra130_on_cpu():
    """serving.attend's cpu path reads pages in place through a custom VJP of its own, whose
    forward kernel refuses too (the xla path runs the kernels checked above)."""
    rng = np.random.default_rng(23)
    k_hist, v_hist = (jnp.asarray(rng.normal(size=(2, 40, 2, 16)), jnp.float32) for _ in "kv")
    cache = serving.cache_from_history(k_hist, v_hist, jnp.array([40, 25]))
    q, t = (jnp.asarray(rng.normal(size=(2, 3, 4, 16)), jnp.float32) for _ in "qt")
    grad = jax.grad(lambda q: serving.attend(q, cache, jnp.arange(2), impl="cpu").sum() ** 2)
    with pytest.raises(rankattn.RankattnError, match=r"\[RA130\]"):
        jax.jvp(grad, (q,), (t,))
    with pytest.raises(rankattn.RankattnError, match=r"\[RA130\]"):
        jax.grad(lambda q: (grad(q) * t).sum())(q)
