"""rankattn.phoenix: the Phoenix ranker's three attention entry points, each against a dense
float64 expectation written from Phoenix's documented behaviour (x-algorithm 28e414f,
phoenix/xrex/pallas/): the mask predicate of each entry point, logits cap(sm_scale q . k)
(times temp in v2), a softmax over visible keys with 0 for rows that see nothing, base-2
residuals in fa3, and z-loss as the gradient of w / 2 * sum(lse ** 2).
"""

from __future__ import annotations

import inspect
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import oracle
import rankattn
from helpers import assert_explained, random_qkv
from rankattn.phoenix import ranker_attention_fa3 as fa3
from rankattn.phoenix import ranker_attention_v2 as v2
from rankattn.phoenix import ranker_attention_varlen as varlen
from tolerances import assert_close_f32

# --- The expectation: dense, float64, differentiable (jnp under x64). ------------------------


def cap_fn(s, cap, method):
    if cap <= 0 or method == "none":
        return s
    if method == "tanh":
        return cap * jnp.tanh(s / cap)
    return s / (1 + jnp.abs(s) / cap)


def dense(q, k, v, mask, *, sm_scale, cap=-1.0, cap_method="tanh", temp=None):
    """(out [B, S, Hq, Dv], natural lse [B, Hq, S]) of the visible keys, float64; GQA by
    query head h -> kv head h // G; temp [B, S] multiplies row i's logits after the cap."""
    group = q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)
    s = cap_fn(jnp.einsum("bihd,bjhd->bhij", q, k) * sm_scale, cap, cap_method)
    if temp is not None:
        s = s * temp[:, None, :, None]
    s = jnp.where(mask[:, None], s, -jnp.inf)
    lse = jax.nn.logsumexp(s, axis=-1)
    p = jnp.where(mask[:, None], jnp.exp(s - jnp.where(jnp.isfinite(lse), lse, 0)[..., None]), 0)
    return jnp.einsum("bhij,bjhd->bihd", p, v), lse


def v2_mask(seg, causal):
    """Phoenix v2 (ranker_attention_v2.py:117-138): seg_i != 0, seg_j == 1 or i == j,
    and i >= j when causal."""
    seg = np.asarray(seg)
    i, j = np.arange(seg.shape[1])[:, None], np.arange(seg.shape[1])[None, :]
    mask = (seg[:, :, None] != 0) & ((seg[:, None, :] == 1) | (i == j))
    return mask & (i >= j) if causal else mask


def varlen_mask(seg, cu, causal):
    """Phoenix varlen (ranker_attention_varlen.py:272-292): one session, i not padding,
    seg_j > 0 or i == j, and i >= j when causal; rows in no session see nothing."""
    seg = np.asarray(seg)
    total = seg.shape[0]
    session = np.full(total, -1)
    for n in range(len(cu) - 1):
        session[cu[n]:cu[n + 1]] = n
    i, j = np.arange(total)[:, None], np.arange(total)[None, :]
    mask = ((session[:, None] == session[None, :]) & (session[:, None] >= 0)
            & (seg[:, None] != 0) & ((seg[None, :] > 0) | (i == j)))
    return (mask & (i >= j) if causal else mask)[None]


def expected_with_grads(mask, q, k, v, w, z_loss_weight=0.0, **options):
    """out, lse and d/d(q, k, v) of sum(out * w) + z / 2 * sum(lse ** 2), in float64."""
    with jax.enable_x64(True):
        def loss(q, k, v):
            out, lse = dense(q, k, v, jnp.asarray(mask), **options)
            z = jnp.where(jnp.isfinite(lse), lse, 0)
            return (out * w).sum() + z_loss_weight / 2 * (z ** 2).sum(), (out, lse)

        args = [jnp.asarray(x, jnp.float64) for x in (q, k, v)]
        (_, (out, lse)), grads = jax.value_and_grad(loss, (0, 1, 2), has_aux=True)(*args)
        return [np.asarray(x) for x in (out, lse, *grads)]


def got_with_grads(f, q, k, v, w):
    """out and d/d(q, k, v) of sum(out * w), for a drop-in f(q, k, v) -> out."""
    def loss(q, k, v):
        out = f(q, k, v)
        return (out.astype(jnp.float32) * w).sum(), out

    (_, out), grads = jax.jit(jax.value_and_grad(loss, (0, 1, 2), has_aux=True))(q, k, v)
    return [np.asarray(x) for x in (out, *grads)]


def check(got, want, names=("out", "dq", "dk", "dv")):
    for name, a, b in zip(names, got, want):
        assert_close_f32(a, b, name)


# --- fa3 attention. ---------------------------------------------------------------------

B, S, HQ, HKV, D = 2, 21, 4, 2, 16
SCALE = math.sqrt(128) / 128  # what the model passes at key_size 128


@pytest.mark.parametrize("bound", [
    None, (0, 16, 16, 21), (0, 13, 13, 21),     # all history; aligned; unaligned boundary
    (0, 15, 9, 21), (3, 18, 0, 21),             # overlapping: partly, history inside
    (0, 40, 40, 40), (5, 2, 10, 30),            # past S (clamped); hi < lo is empty
    ((0, 12, 12, 21), (2, 9, 9, 17)),           # one row per batch row (an extension)
], ids=["none", "aligned", "unaligned", "overlap", "inside", "past-end", "empty", "rows"])
def test_fa3_matches_the_mask_function(bound):
    q, k, v, w = random_qkv(0, B, S, HQ, HKV, D, q_std=4.0)
    got = got_with_grads(lambda q, k, v: fa3.attention(q, k, v, None, bound=bound,
                                                        sm_scale=SCALE), q, k, v, w)
    clipped = (0, S, S, S) if bound is None else np.clip(np.array(bound), 0, S)
    mask = oracle.phoenix_bounds_mask(clipped, S, B)
    check(got, [x for i, x in enumerate(expected_with_grads(mask, q, k, v, w, sm_scale=SCALE))
                if i != 1])


@pytest.mark.parametrize("cap, cap_method", [(5.0, "tanh"), (5.0, "soft_sign"), (5.0, "none"),
                                             (0.0, "tanh"), (-1.0, "soft_sign")])
def test_fa3_caps_and_base2_residuals_and_z_loss(cap, cap_method):
    """cap <= 0 or "none" is no cap; save_residuals gives lse [B, Hq, S] in base 2; the
    z-loss adds w / 2 * sum(lse ** 2)'s gradient whatever the output's cotangent."""
    q, k, v, w = random_qkv(1, B, S, HQ, HKV, D, q_std=4.0)
    bound, z = (0, 14, 11, 19), 0.3
    mask = oracle.phoenix_bounds_mask(bound, S, B)
    want = expected_with_grads(mask, q, k, v, w, z_loss_weight=z, sm_scale=SCALE, cap=cap,
                               cap_method=cap_method)
    options = dict(bound=bound, sm_scale=SCALE, cap=cap, cap_method=cap_method,
                   z_loss_weight=z)
    out, (lse2,) = fa3.attention(q, k, v, fa3.TuningConfig(64, 64, 2), True, **options)
    assert lse2.shape == (B, HQ, S) and lse2.dtype == jnp.float32
    assert_close_f32(lse2, want[1] / math.log(2), "lse base 2")
    assert np.isneginf(np.asarray(lse2)[:, :, 19:]).all()  # rows in neither range
    got = got_with_grads(lambda q, k, v: fa3.attention(q, k, v, None, **options), q, k, v, w)
    check(got, [want[0], *want[2:]])


def test_fa3_keeps_phoenix_signature():
    """Porting is an import change: same parameters, order and defaults as Phoenix's."""
    parameters = inspect.signature(fa3.attention).parameters
    assert list(parameters)[:10] == ["q", "k", "v", "config", "save_residuals", "bound",
                                     "sm_scale", "cap", "cap_method", "z_loss_weight"]
    defaults = {n: p.default for n, p in parameters.items()}
    assert (defaults["save_residuals"], defaults["bound"], defaults["sm_scale"],
            defaults["cap"], defaults["cap_method"], defaults["z_loss_weight"]) == (
        False, None, 1.0, -1.0, "tanh", 0.0)


def test_fa3_traced_bound_regression():
    """Regression: a bound traced under jit raised JAX's TracerArrayConversionError
    (np.array(bound)). [4] and [B, 4] are clamped and emptied with jnp, as concrete ones."""
    q, k, v, w = random_qkv(9, B, S, HQ, HKV, D, q_std=4.0)
    rows = np.array([[-3, 13, 13, 40], [6, 2, 4, 19]], np.int32)  # past the ends; hi < lo
    mask = oracle.phoenix_bounds_mask(np.clip(rows, 0, S), S, B)

    def f(bound):
        return lambda q, k, v: fa3.attention(q, k, v, None, bound=bound, sm_scale=SCALE)

    def loss(bound, q, k, v):
        return (f(bound)(q, k, v) * w).sum()

    out = jax.jit(lambda b: f(b)(q, k, v))(rows)
    grads = jax.jit(jax.grad(loss, (1, 2, 3)))(rows, q, k, v)
    want = expected_with_grads(mask, q, k, v, w, sm_scale=SCALE)
    check([out, *grads], [want[0], *want[2:]])
    one = jax.jit(lambda b: f(b)(q, k, v))(rows[0])  # [4]: every batch row
    assert_close_f32(one, expected_with_grads(oracle.phoenix_bounds_mask(
        np.clip(rows[0], 0, S), S, B), q, k, v, w, sm_scale=SCALE)[0], "out [4]")
    for bad in (np.zeros((B, 5), np.int32), np.zeros(4, np.float32)):  # refused, traced too
        with pytest.raises(rankattn.RankattnTypeError, match="RA108") as err:
            jax.jit(lambda b: f(b)(q, k, v))(bad)
        assert_explained(err.value)


def test_fa3_bounds_past_int32_cover_every_token_eager_and_traced_regression():
    """Regression: a traced hi of 2**32 - 1 (uint32) was cast to int32 before the clamp and
    wrapped to -1, an empty history (out 0), and eagerly a uint64 hi of 2**64 - 1 did the same
    through int64, where hi past S covers every token: the result of bound=None."""
    q, k, v, _ = random_qkv(9, B, S, HQ, HKV, D)
    want = fa3.attention(q, k, v, None, sm_scale=SCALE)
    for bound in (np.array([0, 2**32 - 1, 0, 0], np.uint32),
                  np.array([0, 2**64 - 1, 0, 0], np.uint64)):
        got = fa3.attention(q, k, v, None, bound=bound, sm_scale=SCALE)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    traced = jax.jit(lambda b: fa3.attention(q, k, v, None, bound=b, sm_scale=SCALE))(
        jnp.array([0, 2**32 - 1, 0, 0], jnp.uint32))
    assert_close_f32(traced, want, "traced uint32 bound")


def test_fa3_normalize_bound_regression():
    """Regression (missing name): Phoenix's _normalize_bound(bound, batch_size, seq_len):
    None or a (4,) bound, concrete or traced, to int32 [B, 4], values as given."""
    for bound, row in ((None, [0, S + 1, S + 1, S + 1]), ((0, 13, 13, 30), [0, 13, 13, 30]),
                       (np.array([2, 9, 9, 17], np.int64), [2, 9, 9, 17])):
        got = fa3._normalize_bound(bound, 3, S)
        assert got.dtype == jnp.int32 and got.shape == (3, 4)
        np.testing.assert_array_equal(got, [row] * 3)
    traced = jax.jit(lambda b: fa3._normalize_bound(b, 2, S))(jnp.array([0, 5, 5, 9]))
    np.testing.assert_array_equal(traced, [[0, 5, 5, 9]] * 2)
    for bad, fragment in (((0, 1, 2), "(3,)"), (np.zeros((2, 4), np.int32), "(2, 4)"),
                          ((0.0, 5.0, 5.0, 9.0), "float64")):
        with pytest.raises(rankattn.RankattnError, match="RA108") as err:
            fa3._normalize_bound(bad, 2, S)
        assert fragment in str(err.value)
        assert_explained(err.value)


@pytest.mark.parametrize("form", ["normalized", "rows", "none"])
def test_fa3_attention_forward_inference_regression(form):
    """Regression (missing name): Phoenix's inference forward, out only, takes the [B, 4] array
    of _normalize_bound (traced here under jit), [B, 4] rows, or None (all history). A history
    end off the block boundary (13) leaks nothing, unlike Phoenix's kernel."""
    q, k, v, w = random_qkv(10, B, S, HQ, HKV, D, q_std=4.0)
    options = dict(sm_scale=SCALE, cap=5.0, cap_method="soft_sign")
    config = fa3.TuningConfig(64, 128, 2)
    if form == "normalized":
        bound = jnp.array([0, 13, 13, 19])
        out = jax.jit(lambda b: fa3._attention_forward_inference(
            q, k, v, config=config, bound=fa3._normalize_bound(b, B, S), **options))(bound)
        mask = oracle.phoenix_bounds_mask((0, 13, 13, 19), S, B)
    elif form == "rows":
        rows = np.array([[0, 13, 13, 21], [1, 8, 8, 20]], np.int32)
        out = fa3._attention_forward_inference(q, k, v, config, rows, **options)
        mask = oracle.phoenix_bounds_mask(rows, S, B)
    else:
        out = fa3._attention_forward_inference(q, k, v, config, **options)
        mask = np.ones((B, S, S), bool)
    assert_close_f32(out, expected_with_grads(mask, q, k, v, w, **options)[0], "out")


# --- v2 mha. ------------------------------------------------------------------------------

V2_SEG = np.array([[1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, -1, -1, -1, 2, -1, -1, 0, 0, 0],
                   [0, 1, 1, -1, 1, 1, 1, -1, 1, 1, -1, 1, 1, 1, 1, -1, -1, -1, -1, -1, 0]])


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("cap, cap_method", [(-1.0, "tanh"), (3.0, "soft_sign")])
def test_v2_matches_its_mask_with_causal_candidates(causal, cap, cap_method):
    """Only id 1 is history; id 0 is padding (out 0); causal masks candidates too."""
    q, k, v, w = random_qkv(2, B, S, HQ, HKV, D, q_std=4.0)
    temp = np.ones((B, S), np.int32)  # what the model passes
    options = dict(sm_scale=SCALE, cap=cap, cap_method=cap_method)
    got = got_with_grads(lambda q, k, v: v2.mha(q, k, v, temp, V2_SEG, causal=causal,
                                                z_loss_weight=0.2, **options), q, k, v, w)
    want = expected_with_grads(v2_mask(V2_SEG, causal), q, k, v, w, z_loss_weight=0.2, **options)
    check(got, [want[0], *want[2:]])
    assert not np.asarray(got[0])[V2_SEG == 0].any()


def temps(kind):
    """[B, S] temps: Phoenix's int32 ones, one value, or per-query values of both signs."""
    if kind == "ones":
        return np.ones((B, S), np.int32)
    if kind == "uniform":
        return np.full((B, S), 2.5, np.float32)
    if kind == "zero":
        return np.zeros((B, S), np.float32)
    return np.random.default_rng(0).uniform(-1.0, 2.5, (B, S)).astype(np.float32)


@pytest.mark.parametrize("kind, cap, cap_method, causal, traced", [
    ("rows", 3.0, "tanh", True, True), ("rows", 3.0, "soft_sign", False, False),
    ("rows", -1.0, "tanh", True, False), ("uniform", 3.0, "tanh", False, True),
    ("zero", -1.0, "tanh", False, False), ("ones", 3.0, "soft_sign", False, True),
], ids=["rows-capped-causal-traced", "rows-softsign", "rows-uncapped-causal", "uniform-traced",
        "zero", "model-int32-ones-traced"])
def test_v2_temp_multiplies_capped_logits_regression(kind, cap, cap_method, causal, traced):
    """Regression: temp multiplies each query's logits after the cap, own key included, for
    any values (negative and zero too), concrete or traced, with any cap and causal; it was
    RA124 for a temp that varies with a cap, and NaN rows when that temp was traced."""
    q, k, v, w = random_qkv(3, B, S, HQ, HKV, D, q_std=2.0)
    temp = temps(kind)
    options = dict(sm_scale=SCALE, cap=cap, cap_method=cap_method)
    want = expected_with_grads(v2_mask(V2_SEG, causal), q, k, v, w, temp=temp,
                               z_loss_weight=0.2, **options)

    def f(t, q, k, v):
        return v2.mha(q, k, v, t, V2_SEG, causal=causal, z_loss_weight=0.2, **options)

    if traced:
        def loss(t, q, k, v):
            out = f(t, q, k, v)
            return (out * w).sum(), out

        (_, out), grads = jax.jit(jax.value_and_grad(loss, (1, 2, 3), has_aux=True))(
            temp, q, k, v)
        got = [out, *grads]
    else:
        got = got_with_grads(lambda q, k, v: f(temp, q, k, v), q, k, v, w)
    check(got, [want[0], *want[2:]])


def test_v2_temp_shape_and_dtype_errors():
    """A temp that is not a real [B, S] array raises RA124, naming temp and the shape."""
    q, k, v, _ = random_qkv(4, B, S, HQ, HKV, D)
    for temp, fragment in ((np.ones((B, S + 1)), f"({B}, {S + 1})"),
                           (np.ones(S), f"({S},)"), (np.ones((B, S), bool), "bool")):
        for f in (v2.mha, v2.mha_inference_gqa):
            with pytest.raises(rankattn.RankattnValueError, match="RA124") as err:
                f(q, k, v, temp, V2_SEG, cap=3.0)
            assert fragment in str(err.value) and "temp" in str(err.value)
            assert_explained(err.value)


def test_varlen_causal_must_be_a_bool_regression():
    """varlen passed causal through unchecked: causal="False" ran causal."""
    q, k, v, _ = random_qkv(4, 1, S, HQ, HKV, D)
    with pytest.raises(rankattn.RankattnTypeError, match="RA116"):
        varlen.mha(q[0], k[0], v[0], None, np.ones(S, np.int32), np.array([0, S]),
                   np.array([0, S]), S, S, causal="False")


def test_z_loss_with_traced_masks_under_scan_and_checkpoint_regression():
    """The z-loss's custom VJP closed over the mask arrays: traced ones (a layer inside
    lax.scan and jax.checkpoint, taking its mask as an argument) raised JAX's
    UnexpectedTracerError on every drop-in. Each now matches the same layers with the mask
    known (checked against the dense expectation by the tests above); a negative weight adds
    nothing, as Phoenix's kernels test z_loss_weight > 0."""
    q, k, v, w = random_qkv(8, 1, S, HQ, HKV, D)
    seg = np.array([[1] * 9 + [-1] * 4 + [1] * 5 + [-1] * 3], np.int32)
    cu = np.array([0, 13, S], np.int32)
    layers = {
        "fa3": (lambda x, m, z: fa3.attention(x, k, v, None, bound=m, sm_scale=SCALE,
                                              z_loss_weight=z), np.array([0, 9, 9, 13])),
        "v2": (lambda x, m, z: v2.mha(x, k, v, np.ones((1, S)), m, sm_scale=SCALE, causal=True,
                                      z_loss_weight=z), seg),
        "varlen": (lambda x, m, z: varlen.mha(x[0], k[0], v[0], None, seg[0], m, m, S, S,
                                              sm_scale=SCALE, z_loss_weight=z)[None], cu),
    }
    def stacked(layer, x, m, z):
        step = lambda c, _: (jax.checkpoint(lambda c: layer(c, m, z))(c), None)
        return (jax.lax.scan(step, x, None, length=2)[0] * w).sum()

    for name, (layer, mask) in layers.items():
        traced = jax.jit(jax.grad(lambda x, m: stacked(layer, x, m, 0.25)))(q, mask)
        known = jax.jit(jax.grad(lambda x: stacked(layer, x, mask, 0.25)))(q)
        assert_close_f32(np.asarray(traced), np.asarray(known), f"{name} dq")
    layer = lambda z: jax.jit(jax.grad(lambda x: (layers["fa3"][0](x, (0, 9, 9, 13), z)
                                                  * w).sum()))(q)
    negative, none, some = layer(-1.0), layer(0.0), layer(0.25)
    np.testing.assert_array_equal(np.asarray(negative), np.asarray(none))
    assert np.abs(np.asarray(some) - np.asarray(none)).max() > 1e-3  # the z-loss runs at all


def test_v2_causal_must_be_a_bool():
    """Regression: causal="False" (a truthy string) ran causal; it is RA116 as in
    rankattn.attention."""
    q, k, v, _ = random_qkv(4, B, S, HQ, HKV, D)
    with pytest.raises(rankattn.RankattnTypeError, match="RA116") as err:
        v2.mha(q, k, v, np.ones((B, S), np.float32), V2_SEG, causal="False")
    assert "causal" in str(err.value)
    assert_explained(err.value)


def _phoenix_qkv():
    q, k, v, _ = random_qkv(4, B, S, HQ, HKV, D)
    return q, k, v


@pytest.mark.parametrize("call, code, fragments", [
    (lambda q, k, v: fa3.attention(q[0, 0, 0], k, v), "RA101", ["q", "1-D"]),
    (lambda q, k, v: fa3.attention(None, k, v), "RA101", ["q", "NoneType"]),
    (lambda q, k, v: v2.mha(q.tolist(), k, v, np.ones((B, S)), V2_SEG), "RA101", ["q", "list"]),
    (lambda q, k, v: fa3.attention(q, k, v, sm_scale=None), "RA113", ["sm_scale", "None"]),
    (lambda q, k, v: fa3.attention(q, k, v, sm_scale="abc"), "RA113", ["sm_scale", "'abc'"]),
    (lambda q, k, v: fa3.attention(q, k, v, cap="x"), "RA111", ["cap", "'x'"]),
    (lambda q, k, v: fa3.attention(q, k, v, cap=10**400), "RA111", ["cap", "out of range"]),
    (lambda q, k, v: v2.mha(q, k, v, np.ones((B, S)), V2_SEG, cap=None), "RA111", ["cap"]),
    (lambda q, k, v: fa3.attention(q, k, v, z_loss_weight="abc"), "RA129", ["z_loss_weight"]),
    (lambda q, k, v: jax.jit(lambda s: fa3.attention(q, k, v, sm_scale=s))(1.0), "RA113",
     ["sm_scale", "traced"]),
    (lambda q, k, v: jax.jit(lambda c: fa3.attention(q, k, v, cap=c))(1.0), "RA111",
     ["cap", "traced"]),
    (lambda q, k, v: fa3._normalize_bound((0, 2, 2, 4), -1, 4), "RA116", ["batch_size=-1"]),
    (lambda q, k, v: fa3._normalize_bound((0, 2, 2, 4), 2.5, 4), "RA116", ["batch_size=2.5"]),
    (lambda q, k, v: fa3._normalize_bound(None, 1, None), "RA116", ["seq_len=None"]),
    (lambda q, k, v: fa3.attention(q, k, v, sm_scale="0.5"), "RA113", ["sm_scale", "'0.5'"]),
    (lambda q, k, v: fa3.attention(q, k, v, sm_scale=True), "RA113", ["sm_scale", "True"]),
    (lambda q, k, v: fa3.attention(q, k, v, z_loss_weight=True), "RA129", ["z_loss_weight"]),
    (lambda q, k, v: fa3.attention(q, k, v, z_loss_weight=float("inf")), "RA129",
     ["z_loss_weight=inf"]),
    (lambda q, k, v: fa3.attention(q, k[:, :-1], v[:, :-1], bound=(0, S, S, S)), "RA106",
     ["bound describes", f"q has length {S}", f"k has length {S - 1}"]),
    (lambda q, k, v: jax.jit(lambda b: fa3.attention(q, k[:, :-1], v[:, :-1], bound=b))(
        jnp.array([0, 2, 2, 4])), "RA106", ["bound describes", f"k has length {S - 1}"]),
    (lambda q, k, v: fa3.attention(q, k, v, bound=np.zeros((B + 1, 4), np.int32)), "RA108",
     ["bound has shape", f"({B + 1}, 4)", f"({B}, 4) for this q"]),
    (lambda q, k, v: v2.mha(q, k, v, np.ones((B, S)), None), "RA107", ["dtype object"]),
    (lambda q, k, v: varlen.mha(q[0].tolist(), k[0], v[0], None, np.ones(S), np.array([0, S]),
                                np.array([0, S]), S, S), "RA101", ["q", "list"]),
    (lambda q, k, v: v2.mha(q, k, v, np.ones((B, S)), np.full((B, S), 0.5)), "RA107",
     ["dtype float64", "int array"]),
    # Phoenix's names and choices, where rankattn's checks named softcap, scale and roles:
    (lambda q, k, v: fa3.attention(q, k, v, sm_scale=0.0), "RA113", ["sm_scale=0.0"]),
    (lambda q, k, v: fa3.attention(q, k, v, cap=float("inf")), "RA111",
     ["cap=inf", "cap_method='none'"]),
    (lambda q, k, v: fa3.attention(q, k, v, cap=3.0, cap_method="bogus"), "RA112",
     ["cap_method='bogus'", "'none'"]),
    (lambda q, k, v: varlen.mha(q[0], k[0], v[0], None, np.ones(S), np.array([0, S]),
                                np.array([0, S]), S, S), "RA107",
     ["segment_ids", f"[total] = ({S},)", "float64"]),
    (lambda q, k, v: varlen.mha(q[0], k[0], v[0], None, np.ones(S - 1, np.int32),
                                np.array([0, S]), np.array([0, S]), S, S), "RA107",
     ["segment_ids", f"shape ({S - 1},)"]),
    (lambda q, k, v: v2.mha(q, k, v, np.ones((B, S)), V2_SEG, causal=True,
                            impl=rankattn.backends.PallasTriton(interpret=True)), "RA115",
     ["Phoenix's causal=True", "causal=False"]),
], ids=["fa3-q-1d", "fa3-q-none", "v2-q-list", "scale-none", "scale-str", "cap-str",
        "cap-overflow", "v2-cap-none", "z-loss-str", "jit-scale", "jit-cap", "batch-negative",
        "batch-float", "seq-none", "scale-numeric-str", "scale-bool", "z-loss-bool",
        "z-loss-inf", "whole-history-bound-k-shorter", "traced-bound-k-shorter",
        "bound-rows-not-batch", "v2-ids-none", "varlen-q-list",
        "v2-ids-float", "scale-zero", "cap-inf", "cap-method", "varlen-ids-float",
        "varlen-ids-short", "v2-causal-on-a-gpu-kernel"])
def test_phoenix_arguments_of_the_wrong_kind_are_rankattn_errors(call, code, fragments):
    """Regression: these raised bare IndexError, AttributeError, ValueError, TypeError,
    OverflowError or JAX's ConcretizationTypeError from deep inside the drop-ins; then (the
    next seven) ran: a numeric string or a bool as a number, an infinite z-loss weight into
    NaN gradients, a bound of every token history with k of another length as no mask at
    all (every query saw every key), where the same bound traced raised RA106, and v2's
    float ids (0.5 a candidate), where None was reported as ids of shape (); varlen's list
    q raised a bare TypeError."""
    with pytest.raises(rankattn.RankattnError, match=code) as err:
        call(*_phoenix_qkv())
    for fragment in fragments:
        assert fragment in str(err.value), (fragment, str(err.value))
    assert_explained(err.value)


def test_v2_mha_inference_gqa_regression():
    """Regression (missing name): Phoenix's GQA inference forward takes K/V unrepeated and
    computes v2's mask without causal: every non-padding query sees history, and a candidate
    sees itself only (Phoenix's kernel lets it see the candidates in the last history block);
    out only; temp (traced, varying, with a cap) after the cap."""
    q, k, v, w = random_qkv(11, B, S, HQ, HKV, D, q_std=4.0)
    temp = temps("rows")
    options = dict(sm_scale=SCALE, cap=3.0, cap_method="tanh")
    out = jax.jit(lambda t: v2.mha_inference_gqa(q, k, v, t, V2_SEG, **options))(temp)
    want = expected_with_grads(v2_mask(V2_SEG, False), q, k, v, w, temp=temp, **options)
    assert_close_f32(out, want[0], "out")
    assert not np.asarray(out)[V2_SEG == 0].any()


def test_v2_ignores_what_phoenix_ignores():
    """window_len and every kernel option change nothing (Phoenix deletes window_len)."""
    q, k, v, _ = random_qkv(5, B, S, HQ, HKV, D)
    temp = np.ones((B, S), np.float32)
    plain = v2.mha(q, k, v, temp, V2_SEG)
    tuned = v2.mha(q, k, v, temp, V2_SEG, 1.0, -1.0, "tanh", True, 7, 0.0, 64, 64, 64, 16, 16,
                   64, "triton_split", 4, 3, (1, 2, 3), True, True)
    np.testing.assert_array_equal(np.asarray(plain), np.asarray(tuned))


# --- varlen mha. --------------------------------------------------------------------------


@st.composite
def packed_sessions(draw):
    """cu_seqlens over sessions of 0-9 tokens (roles 1 / -1 / 0), plus trailing rows."""
    lengths = draw(st.lists(st.integers(0, 9), min_size=1, max_size=4))
    tail = draw(st.integers(0, 3))
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    roles = draw(st.lists(st.sampled_from([1, 1, 2, -1, -3, 0]), min_size=int(cu[-1]) + tail,
                          max_size=int(cu[-1]) + tail))
    return cu, np.array(roles, np.int32)


@settings(max_examples=8, deadline=None)
@given(packed_sessions(), st.booleans())
def test_varlen_matches_its_mask(packed, causal):
    cu, roles = packed
    total = len(roles)
    assume(total > 0)
    q, k, v, w = (x[0] for x in random_qkv(6, 1, total, HQ, HKV, D, q_std=3.0))
    got = got_with_grads(lambda q, k, v: varlen.mha(q, k, v, None, roles, cu, cu, 16, 16,
                                                    sm_scale=SCALE, causal=causal), q, k, v, w)
    want = expected_with_grads(varlen_mask(roles, cu, causal), q[None], k[None], v[None],
                               w[None], sm_scale=SCALE)
    check(got, [want[0][0], *(g[0] for g in want[2:])])


def test_varlen_under_jit_and_its_errors():
    cu, roles = np.array([0, 5, 5, 12], np.int32), np.array([1, 1, -1, -1, 1] + [1] * 5
                                                            + [-1, 0, 0, 1], np.int32)
    q, k, v, _ = (x[0] for x in random_qkv(7, 1, 14, HQ, HKV, D))
    eager = varlen.mha(q, k, v, None, roles, cu, cu, 7, 7, causal=False)
    traced = jax.jit(lambda c, r: varlen.mha(q, k, v, None, r, c, c, 7, 7, causal=False))(cu,
                                                                                         roles)
    np.testing.assert_array_equal(np.asarray(eager), np.asarray(traced))
    assert not np.asarray(eager)[12:].any()  # past cu_seqlens[-1]: padding, zeros
    with pytest.raises(rankattn.RankattnValueError, match="RA123") as err:
        varlen.mha(q, k, v, None, roles, cu, np.array([0, 4, 5, 12]), 7, 7)
    assert_explained(err.value)


# --- The cu_seqlens helper (rankattn.segment_ids_from_cu_seqlens). ------------------------


@settings(max_examples=25, deadline=None)
@given(packed_sessions())
def test_segment_ids_from_cu_seqlens_equals_a_loop(packed):
    cu, roles = packed
    want = np.zeros(len(roles), np.int32)
    for n in range(len(cu) - 1):
        for t in range(cu[n], cu[n + 1]):
            want[t] = (n + 1) * np.sign(roles[t])
    np.testing.assert_array_equal(rankattn.segment_ids_from_cu_seqlens(cu, roles), want)
    traced = jax.jit(rankattn.segment_ids_from_cu_seqlens)(cu, roles)
    np.testing.assert_array_equal(traced, want)


def test_segment_ids_from_cu_seqlens_packs_like_separate_calls():
    """Three sessions packed by cu_seqlens give each session's own attention."""
    cu = np.array([0, 6, 7, 15])
    seg = rankattn.segment_ids_from_cu_seqlens(cu, length=17)
    np.testing.assert_array_equal(seg, [1] * 6 + [2] + [3] * 8 + [0, 0])
    # Regression (review): a numpy length (what x.shape[0] of a numpy int gives) was RA123.
    np.testing.assert_array_equal(rankattn.segment_ids_from_cu_seqlens(cu, length=np.int64(17)),
                                  seg)
    q, k, v, _ = random_qkv(8, 1, 17, HQ, HKV, D)
    packed = np.asarray(rankattn.attention(q, k, v, segment_ids=seg[None]))
    for a, b in zip(cu[:-1], cu[1:]):
        alone = rankattn.attention(q[:, a:b], k[:, a:b], v[:, a:b])
        assert_close_f32(packed[:, a:b], alone, f"session [{a}, {b})")


@pytest.mark.parametrize("args, fragment", [
    (([0, 4, 3],), "non-decreasing"), (([0, 9],), "T = 8"), (([-1, 8],), "non-decreasing"),
    ((np.zeros((2, 2), np.int32),), "1-D"), (([0.0, 8.0],), "float64"),
    ((np.zeros(0, np.int32),), "empty"),
], ids=["decreasing", "past-end", "negative", "2d", "float", "empty"])
def test_segment_ids_from_cu_seqlens_errors(args, fragment):
    with pytest.raises(rankattn.RankattnError, match="RA123") as err:
        rankattn.segment_ids_from_cu_seqlens(np.asarray(args[0]), np.ones(8, np.int32))
    assert fragment in str(err.value)
    assert_explained(err.value)
