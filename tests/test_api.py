"""The public call under JAX transformations and its options, on every backend.

Expected values come from the float64 oracle (tests/oracle.py), never from rankattn.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import oracle
import rankattn
from conftest import CPU_KERNEL_REASONS, skip_if_float16_declined
from helpers import Case, attention_jit, check_against_oracle, random_qkv
from rankattn.backends import Cpu, Reference, Xla
from tolerances import assert_close_f32

B, S, HQ, HKV, D = 2, 20, 4, 2, 8
ONE_SESSION = np.ones((B, S), np.int32)
PACKED = np.array([[0, 2, 2, 2, -2, -2, 5, 5, 5, 5, 5, 5, 5, 5, 5, -5, -5, -5, 0, 0],
                   [1, 1, -1, 1, 1, -1, -1, -1, 0, 1, 9, 9, -9, 9, -9, 9, 9, 9, 0, -9]], np.int32)
MOSTLY_PADDING = np.zeros((B, S), np.int32)
MOSTLY_PADDING[:, 13:16] = [4, -4, 4]


def expected(q, k, v, seg, causal=False, **kwargs):
    """Oracle out [B, S, Hq, Dv] and lse [B, Hq, S] in float64."""
    mask = oracle.mask_dense(seg, causal)
    return oracle.attention_loops(q, k, v, mask, **kwargs)


def test_jit_reuses_one_program_for_new_segment_ids(impl):
    """Segment ids are traced: a new layout must not reuse a stale block plan."""
    q, k, v, _ = random_qkv(1, B, S, HQ, HKV, D)
    traces = []

    @jax.jit
    def f(q, k, v, seg):
        traces.append(None)
        return rankattn.attention(q, k, v, segment_ids=seg, return_lse=True, impl=impl)

    for seg in (ONE_SESSION, PACKED, MOSTLY_PADDING, ONE_SESSION):
        out, lse = f(q, k, v, seg)
        want_out, want_lse = expected(q, k, v, seg)
        assert_close_f32(out, want_out, "out")
        assert_close_f32(lse, want_lse, "lse")
    assert len(traces) == 1, "the jitted function was retraced; the test would not catch staleness"


def test_jit_with_traced_bounds(impl):
    causal = True  # the harder mask; causal=False bounds: test_backends.py
    q, k, v, _ = random_qkv(2, B, S, HQ, HKV, D)
    f = jax.jit(lambda q, k, v, b: rankattn.attention(q, k, v, bounds=b, causal=causal,
                                                      return_lse=True, impl=impl))
    for bounds in ([[0, 11, 11, 20], [3, 9, 12, 17]], [[14, 20, 1, 6], [0, 0, 0, 0]],
                   [5, 15, 15, 19]):
        bounds = np.array(bounds, np.int32)
        out, lse = f(q, k, v, bounds)
        want_out, want_lse = expected(q, k, v, oracle.bounds_to_segments(bounds, S, B), causal)
        assert_close_f32(out, want_out, f"out for bounds {bounds.tolist()}")
        assert_close_f32(lse, want_lse, f"lse for bounds {bounds.tolist()}")


OVERLAPPING_BOUNDS = [[[0, 12, 8, 20], [4, 16, 0, 20]],    # partly; candidates around history
                      [[2, 18, 5, 9], [10, 20, 10, 20]],    # inside; the same range
                      [0, 20, 3, 7]]                        # one row for the batch


@pytest.mark.parametrize("bounds", OVERLAPPING_BOUNDS, ids=["partly", "inside", "broadcast"])
def test_overlapping_bounds_follow_phoenix_mask_concrete_and_traced(impl, bounds):
    """Issue 19's rule: a token in both ranges is history (Phoenix's history_candidate_mask).
    Traced bounds once resolved overlaps the other way (candidates won): the two spellings
    must agree with each other bit for bit and with the predicate written from Phoenix."""
    q, k, v, _ = random_qkv(3, B, S, HQ, HKV, D)
    bounds = np.array(bounds, np.int32)
    concrete = rankattn.attention(q, k, v, bounds=bounds, return_lse=True, impl=impl)
    traced = jax.jit(lambda b: rankattn.attention(q, k, v, bounds=b, return_lse=True,
                                                  impl=impl))(bounds)
    for a, b in zip(concrete, traced):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    want_out, want_lse = oracle.attention_loops(q, k, v, oracle.phoenix_bounds_mask(bounds, S, B))
    assert_close_f32(concrete[0], want_out, "out")
    assert_close_f32(concrete[1], want_lse, "lse")


def test_traced_unsigned_bounds_past_int32_are_positions_past_the_end_regression():
    """Regression: traced bounds were cast to int32 as given, so a uint32 hi of 2**32 - 1 (past
    the end: every token) wrapped to -1 (no token) and the rows saw nothing (lse -inf)."""
    q, k, v, _ = random_qkv(3, B, S, HQ, HKV, D)
    bounds = np.array([0, 5, 5, 2**32 - 1], np.uint32)
    traced = jax.jit(lambda b: rankattn.attention(q, k, v, bounds=b, return_lse=True))(bounds)
    want = oracle.attention_loops(q, k, v, oracle.phoenix_bounds_mask(
        np.array([0, 5, 5, S]), S, B))
    for got, want_part, name in zip(traced, want, ("out", "lse")):
        assert_close_f32(got, want_part, name)


@pytest.mark.parametrize("dtype, wide", [(np.uint32, 2**32 - 1), (np.int32, -2**31)])
def test_traced_segment_ids_past_int32_are_padding_regression(dtype, wide):
    """Regression (review): traced segment ids were cast to int32 as given, so a uint32 history
    id of 2**32 - 1 wrapped to -1 and its tokens became candidates of session 1 (concrete ids
    raise RA118). Such a traced id is now padding, in any dtype, int32's -2**31 too."""
    q, k, v, _ = random_qkv(3, B, S, HQ, HKV, D)
    seg = np.ones((B, S), np.int64)
    seg[:, S // 2:] = wide
    with pytest.raises(rankattn.RankattnError, match="RA118"):
        rankattn.attention(q, k, v, segment_ids=seg.astype(dtype))
    traced = jax.jit(lambda s: rankattn.attention(q, k, v, segment_ids=s, return_lse=True))(
        seg.astype(dtype))
    padded = np.where(seg == 1, 1, 0)
    want = oracle.attention_loops(q, k, v, oracle.mask_dense(padded, False))
    for got, want_part, name in zip(traced, want, ("out", "lse")):
        assert_close_f32(got, want_part, name)


def test_vmap_over_an_extra_leading_axis(impl):
    n = 3
    qs, ks, vs, ws = (np.stack(x) for x in zip(*(random_qkv(10 + i, B, S, HQ, HKV, D)
                                                  for i in range(n))))
    segs = np.stack([PACKED, MOSTLY_PADDING, ONE_SESSION])

    def loss(q, k, v, seg, w):
        out = rankattn.attention(q, k, v, segment_ids=seg, causal=True, impl=impl)
        return jnp.sum(out * w), out

    grad = jax.jit(jax.vmap(jax.grad(loss, (0, 1, 2), has_aux=True)))
    (dq, dk, dv), out = grad(qs, ks, vs, segs, ws)
    single = jax.jit(jax.grad(loss, (0, 1, 2), has_aux=True))
    for i in range(n):
        assert_close_f32(out[i], expected(qs[i], ks[i], vs[i], segs[i], causal=True)[0], f"out {i}")
        (dq1, dk1, dv1), _ = single(qs[i], ks[i], vs[i], segs[i], ws[i])
        for name, a, e in (("dq", dq[i], dq1), ("dk", dk[i], dk1), ("dv", dv[i], dv1)):
            assert_close_f32(a, e, f"{name} {i}")


def test_return_lse(impl):
    q, k, v, _ = random_qkv(3, B, S, HQ, HKV, D, dim_v=5)
    out = attention_jit(q, k, v, segment_ids=PACKED, impl=impl)
    both = attention_jit(q, k, v, segment_ids=PACKED, impl=impl, return_lse=True)
    assert isinstance(out, jax.Array) and out.shape == (B, S, HQ, 5) and out.dtype == jnp.float32
    assert isinstance(both, tuple) and len(both) == 2
    assert both[1].shape == (B, HQ, S) and both[1].dtype == jnp.float32
    np.testing.assert_array_equal(both[0], out)
    want_out, want_lse = expected(q, k, v, PACKED)
    assert_close_f32(both[0], want_out, "out")
    assert_close_f32(both[1], want_lse, "lse")


@pytest.mark.parametrize("scale", [1.3, -0.4])
def test_scale_override(impl, scale):
    q, k, v, _ = random_qkv(4, B, S, HQ, HKV, D)
    out, lse = jax.jit(lambda q, k, v: rankattn.attention(
        q, k, v, segment_ids=PACKED, scale=scale, softcap=3.0, return_lse=True, impl=impl))(q, k, v)
    want_out, want_lse = expected(q, k, v, PACKED, scale=scale, softcap_value=3.0)
    assert_close_f32(out, want_out, "out")
    assert_close_f32(lse, want_lse, "lse")
    default_out, _ = expected(q, k, v, PACKED, softcap_value=3.0)
    assert np.abs(want_out - default_out).max() > 1e-2, "scale has no effect on this case"


def test_large_logits_are_stable(impl):
    """Logits in the hundreds: the online softmax must not overflow or lose the winner."""
    q, k, v, _ = random_qkv(7, B, S, HQ, HKV, D)
    q, k = q * 12, k * 12
    out, lse = jax.jit(lambda q, k, v: rankattn.attention(
        q, k, v, segment_ids=PACKED, causal=True, return_lse=True, impl=impl))(q, k, v)
    want_out, want_lse = expected(q, k, v, PACKED, causal=True)
    assert np.abs(want_lse[np.isfinite(want_lse)]).max() > 100
    assert_close_f32(out, want_out, "out")
    assert_close_f32(lse, want_lse, "lse")


def test_float16(impl):
    """float16 in, float16 out (lse float32), within the low-precision rule of a naive f16 pass."""
    skip_if_float16_declined(impl, "float16")
    case = Case(batch=2, seq=24, heads_q=4, heads_kv=2, dim=16, dtype="float16",
                mask="segment_ids", mask_values=tuple(map(tuple, np.tile(PACKED, (1, 2))[:, :24])),
                causal=True, softcap=2.0)
    check_against_oracle(case, impl)


def test_unmasked_call_runs_eagerly(impl):
    """No jit anywhere: the eager path validates and runs too (concrete bounds, numpy inputs)."""
    q, k, v, _ = random_qkv(5, 1, 9, 2, 1, 4)
    out = rankattn.attention(q, k, v, bounds=(0, 5, 5, 9), impl=impl)
    want, _ = expected(q, k, v, oracle.bounds_to_segments([0, 5, 5, 9], 9, 1))
    assert_close_f32(out, want)


def test_auto_picks_the_fused_kernel_then_xla(monkeypatch):
    """On CPU: 'cpu' when its kernel builds here, else 'xla'."""
    first = "xla" if CPU_KERNEL_REASONS else "cpu"
    calls = []
    for cls in (Cpu, Xla, Reference):
        original = cls.__call__
        monkeypatch.setattr(cls, "__call__",
                            lambda self, call, original=original: calls.append(self.name)
                            or original(self, call))
    q, k, v, _ = random_qkv(6, 1, 8, 2, 1, 4)
    rankattn.attention(q, k, v, segment_ids=np.ones((1, 8), np.int32), impl="auto")
    assert calls == [first]
    assert rankattn.available_impls()[0] == first
    rankattn.attention(q, k, v, impl="reference")
    assert calls == [first, "reference"]


@pytest.mark.parametrize("dtype", [np.int8, np.uint8, np.int16, np.uint32, np.int64, np.uint64])
def test_any_integer_dtype_of_segment_ids(dtype):
    """Segment ids of every integer dtype mean the same mask (checked, then cast to int32)."""
    q, k, v, _ = random_qkv(7, B, S, HQ, HKV, D)
    seg = np.abs(PACKED) if np.issubdtype(dtype, np.unsignedinteger) else PACKED
    want = attention_jit(q, k, v, segment_ids=seg.astype(np.int32), impl="reference")
    got = rankattn.attention(q, k, v, segment_ids=seg.astype(dtype), impl="reference")
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_impl_list_falls_back_in_order():
    """impl= takes a list, tried in order, as plan(impl=) does: pallas_triton declines
    float64, so the next entry runs; a list of backends none of which can run names each
    one's reason."""
    from rankattn.backends import PallasTriton
    with jax.enable_x64(True):
        q, k, v, _ = (x.astype(np.float64) for x in random_qkv(9, B, S, HQ, HKV, D))
        got = rankattn.attention(q, k, v, segment_ids=PACKED,
                                 impl=[PallasTriton(interpret=True), "xla"])
        want = rankattn.attention(q, k, v, segment_ids=PACKED, impl="xla")
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
        with pytest.raises(rankattn.RankattnValueError, match="RA115") as err:
            rankattn.attention(q, k, v, impl=[PallasTriton(interpret=True)])
        assert "float64" in str(err.value)


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="needs a machine without a GPU/TPU")
def test_a_listed_name_that_cannot_run_here_is_passed_over_regression():
    """['pallas_triton', 'xla'] on a CPU runs xla, as a list tried in order should (every
    name was resolved first, and pallas_triton's RA115 ended the call); plan(impl=) too. A list
    of names none of which can run here names each one with its reason."""
    q, k, v, _ = random_qkv(10, B, S, HQ, HKV, D)
    got = rankattn.attention(q, k, v, segment_ids=PACKED, impl=["pallas_triton", "xla"])
    want = rankattn.attention(q, k, v, segment_ids=PACKED, impl="xla")
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    plan = rankattn.plan(segment_ids=PACKED, impl=["pallas_tpu", "xla"])
    assert plan.block_sizes == rankattn.plan(segment_ids=PACKED, impl="xla").block_sizes
    with pytest.raises(rankattn.RankattnValueError, match="RA115") as err:
        rankattn.attention(q, k, v, impl=["pallas_triton", "mosaic_gpu"])
    assert "'pallas_triton': pallas_triton needs a GPU" in str(err.value)
    assert "'mosaic_gpu': mosaic_gpu needs a GPU" in str(err.value)
