"""rankattn.flax: rankattn as the attention_fn of nnx.MultiHeadAttention.

Checked against the float64 oracle (tests/oracle.py) and against Flax's own attention with the
equivalent dense boolean mask, forward and gradients, on packed ranking rows with padding and
a row of padding only. Where a query sees no key, rankattn gives 0 and Flax averages every
value, so outputs are compared on the other rows only (their gradients agree everywhere: the
loss weighs no padding row).
"""

from __future__ import annotations

import functools
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

nnx = pytest.importorskip("flax.nnx")  # flax is optional: `pip install -e '.[test,flax]'`

import oracle  # noqa: E402
import rankattn  # noqa: E402
import rankattn.flax  # noqa: E402
from helpers import ROOT, assert_explained, random_qkv  # noqa: E402
from tolerances import assert_close_f32, assert_matches  # noqa: E402

# Two sessions packed in one row, then padding (README's picture); two sessions between
# padding; a row of padding only.
SEG = np.array([[1, 1, 1, 1, -1, -1, -1, 2, 2, -2, -2, 0],
                [0, 3, 3, 3, -3, -3, 0, 4, 4, 4, -4, 0],
                [0] * 12], np.int32)
PAD = SEG == 0
B, S = SEG.shape
D, WIDTH = 8, 16


def dense_mask(causal: bool = False):
    """Flax's spelling of SEG's mask: bool [B, 1, S, S], broadcast over heads."""
    return jnp.asarray(oracle.mask_dense(SEG, causal)[:, None])


def as_numpy(tree):
    return jax.tree.map(lambda x: np.asarray(x, np.float64), tree)


# --- The attention_fn on its own. ---------------------------------------------------------


@functools.partial(jax.jit, static_argnums=0)
def outputs_and_grads(fn, q, k, v, w, mask):
    """out and d(sum(out * w)) / d(q, k, v) of ``fn(q, k, v, mask=mask)``."""
    def loss(q, k, v):
        out = fn(q, k, v, mask=mask)
        return jnp.sum(out * w), out

    (_, out), (dq, dk, dv) = jax.value_and_grad(loss, (0, 1, 2), has_aux=True)(q, k, v)
    return dict(out=out, dq=dq, dk=dk, dv=dv)


@pytest.mark.parametrize("hq, hkv, softcap", [(2, 2, None), (4, 2, None), (2, 1, 5.0)],
                         ids=["mha", "gqa", "softcap"])
def test_attention_fn_matches_the_oracle_and_flax(hq, hkv, softcap):
    q, k, v, w = random_qkv(0, B, S, hq, hkv, D)
    w = w * ~PAD[:, :, None, None]
    fn = rankattn.flax.attention_fn(softcap=softcap)
    got = as_numpy(outputs_and_grads(fn, q, k, v, w, rankattn.plan(segment_ids=SEG)))

    want = oracle.attention(q, k, v, oracle.mask_dense(SEG, False), w=w, softcap_value=softcap,
                            magnitudes=True)
    for name in ("out", "dq", "dk", "dv"):
        assert_matches(name, got[name], want[name], "float32", want["terms"][name],
                       want["amplified"][name], 2 * S)
    assert np.all(got["out"][PAD] == 0) and np.all(got["dq"][PAD] == 0)

    if softcap is None:  # Flax has no soft cap
        flax = as_numpy(outputs_and_grads(nnx.dot_product_attention, q, k, v, w, dense_mask()))
        assert_close_f32(got["out"][~PAD], flax["out"][~PAD], "out")
        assert np.abs(flax["out"][PAD]).max() > 0.1  # Flax averages where nothing is visible
        for name in ("dq", "dk", "dv"):
            assert_close_f32(got[name], flax[name], name)


def test_batch_axes_are_flattened():
    """[batch..., S, H, D] with any number of batch axes; a plan covers their product."""
    q, k, v, _ = random_qkv(1, 2 * B, S, 2, 2, D)
    fn = rankattn.flax.attention_fn()
    plan = rankattn.plan(segment_ids=np.concatenate([SEG, SEG]))
    flat = np.asarray(fn(q, k, v, mask=plan))
    nested = fn(*(x.reshape(2, B, S, 2, D) for x in (q, k, v)), mask=plan)
    assert nested.shape == (2, B, S, 2, D)
    np.testing.assert_array_equal(np.asarray(nested).reshape(flat.shape), flat)
    single = fn(q[0], k[0], v[0], mask=rankattn.plan(segment_ids=SEG[:1]))
    assert single.shape == (S, 2, D)
    assert_close_f32(single, flat[0])


# --- nnx.MultiHeadAttention with the adapter. ----------------------------------------------


def mha(attention_fn=None, **kwargs):
    """A small nnx.MultiHeadAttention; every call makes the same parameters (seed 0)."""
    kwargs = {"decode": False, **kwargs}
    if attention_fn is not None:
        kwargs["attention_fn"] = attention_fn
    return nnx.MultiHeadAttention(num_heads=4, in_features=WIDTH, qkv_features=4 * D,
                                  rngs=nnx.Rngs(0), **kwargs)


@functools.partial(nnx.jit, static_argnames="is_causal")
def layer_outputs_and_grads(model, x, mask, w, is_causal=False):
    """model(x, mask=mask) and the gradients of sum(output * w) with respect to its parameters."""
    def loss(model):
        y = model(x, mask=mask, is_causal=is_causal)
        return jnp.sum(y * w), y

    (_, y), grads = nnx.value_and_grad(loss, has_aux=True)(model)
    return y, grads


def assert_same_grads(got, want):
    for (path, g), (_, r) in zip(jax.tree_util.tree_leaves_with_path(got),
                                 jax.tree_util.tree_leaves_with_path(want), strict=True):
        assert_close_f32(g, r, jax.tree_util.keystr(path))


def inputs(seed: int):
    """Tokens x [B, S, WIDTH] and a loss weight [B, S, WIDTH] that is 0 on padding tokens."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(B, S, WIDTH)).astype(np.float32)
    w = rng.normal(size=(B, S, WIDTH)).astype(np.float32) * ~PAD[..., None]
    return x, w


@pytest.mark.parametrize("kv_heads", [4, 2], ids=["mha", "gqa"])
def test_multi_head_attention_matches_flax(kv_heads):
    layer = mha(rankattn.flax.attention_fn(), num_kv_heads=kv_heads)
    flax_layer = mha(num_kv_heads=kv_heads)
    x, w = inputs(2)
    y, grads = layer_outputs_and_grads(layer, x, rankattn.plan(segment_ids=SEG), w)
    y_ref, grads_ref = layer_outputs_and_grads(flax_layer, x, dense_mask(), w)
    assert_close_f32(y[~PAD], y_ref[~PAD], "output")
    # A padding token's attention is 0, so its output is the output projection's bias.
    np.testing.assert_array_equal(np.asarray(y)[PAD],
                                  np.broadcast_to(layer.out.bias[...], (PAD.sum(), WIDTH)))
    assert_same_grads(grads, grads_ref)


def test_is_causal_without_a_plan_matches_flax():
    x, w = inputs(3)
    w = np.ones_like(w)
    y, grads = layer_outputs_and_grads(mha(rankattn.flax.attention_fn()), x, None, w, True)
    y_ref, grads_ref = layer_outputs_and_grads(mha(), x, None, w, True)
    assert_close_f32(y, y_ref, "output")
    assert_same_grads(grads, grads_ref)


class TwoLayers(nnx.Module):
    def __init__(self, attention_fn=None):
        self.layers = nnx.List([mha(attention_fn), mha(attention_fn)])

    def __call__(self, x, mask):
        for layer in self.layers:
            x = x + layer(x, mask=mask)
        return x


def test_one_plan_serves_two_layers_under_jit():
    """The plan is built inside nnx.jit from the batch's segment ids, once, for both layers."""
    x, _ = inputs(4)
    model = TwoLayers(rankattn.flax.attention_fn(softcap=None))
    assert model.layers[0].attention_fn == rankattn.flax.attention_fn()  # compares by value

    @nnx.jit
    def forward(model, x, segment_ids):
        return model(x, rankattn.plan(segment_ids=segment_ids))

    y = forward(model, x, SEG)
    y_ref = nnx.jit(lambda m, x, mask: m(x, mask))(TwoLayers(), x, dense_mask())
    # Padding tokens differ after the first layer, but no other token sees them.
    assert_close_f32(np.asarray(y)[~PAD], np.asarray(y_ref)[~PAD], "output")
    # A new batch's segment ids under the same jit give that batch's mask, not a stale one.
    other = np.where(SEG != 0, 1, 0).astype(np.int32)
    with_other = np.asarray(forward(model, x, other))
    assert_close_f32(with_other, np.asarray(model(x, rankattn.plan(segment_ids=other))))
    assert not np.allclose(with_other[~PAD], np.asarray(y)[~PAD])


# --- What rankattn cannot honour: catalogued errors. ----------------------------------------


def call_fn(**kwargs):
    q = jnp.ones((B, S, 2, D))
    return rankattn.flax.attention_fn()(q, q, q, **kwargs)


def decode_step():
    layer = mha(rankattn.flax.attention_fn(), decode=True)
    layer.init_cache((1, S, WIDTH))
    return layer(jnp.ones((1, 1, WIDTH)))


def dropout_layer(deterministic):
    layer = mha(rankattn.flax.attention_fn(), dropout_rate=0.1)
    return layer(jnp.ones((B, S, WIDTH)), mask=rankattn.plan(segment_ids=SEG),
                 deterministic=deterministic)


# (id, code, builtin type, call, message fragments)
ERROR_CASES = [
    ("boolean-mask", "RA301", TypeError, lambda: mha(rankattn.flax.attention_fn())(
        jnp.ones((B, S, WIDTH)), mask=dense_mask()), ["(3, 1, 12, 12)", "rankattn.plan"]),
    ("segment-ids-as-mask", "RA301", TypeError, lambda: call_fn(mask=SEG),
     ["ndarray", "(3, 12)", "mask=plan"]),
    ("decode", "RA301", TypeError, decode_step, ["decode=True", "rankattn.serving"]),
    ("is-causal-with-plan", "RA302", ValueError,
     lambda: call_fn(mask=rankattn.plan(segment_ids=SEG, causal=True), is_causal=True),
     ["is_causal=True", "causal=True"]),
    ("bias", "RA303", ValueError, lambda: call_fn(bias=jnp.zeros((B, 2, S, S))),
     ["(3, 2, 12, 12)", "bias=None"]),
    ("dropout", "RA304", ValueError, lambda: dropout_layer(False),
     ["dropout_rate=0.1", "deterministic=True"]),
    ("sow-weights", "RA305", ValueError, lambda: mha(rankattn.flax.attention_fn())(
        jnp.ones((B, S, WIDTH)), sow_weights=True), ["sow_weights", "dot_product_attention_weights"]),
    ("softcap", "RA111", ValueError, lambda: rankattn.flax.attention_fn(softcap=-1.0),
     ["softcap=-1.0"]),
    ("impl", "RA114", ValueError, lambda: rankattn.flax.attention_fn(impl="cuda"), ["'cuda'"]),
    # Regression (review): it said "Pass scale=None for 1/sqrt(1)", a placeholder head dim.
    ("scale-zero", "RA113", ValueError, lambda: rankattn.flax.attention_fn(scale=0.0),
     ["scale=0.0", "scale=None for 1/sqrt(D)"]),
    ("plan-batch", "RA117", ValueError,
     lambda: call_fn(mask=rankattn.plan(segment_ids=SEG[:2])), ["(2, 12)", "B=3"]),
]


@pytest.mark.parametrize("code, builtin, call, fragments", [c[1:] for c in ERROR_CASES],
                         ids=[c[0] for c in ERROR_CASES])
def test_error(code, builtin, call, fragments):
    with pytest.raises(rankattn.RankattnError) as info:
        call()
    err = info.value
    assert err.code == code and isinstance(err, builtin), repr(err)
    for fragment in fragments:
        assert fragment in str(err), f"{fragment!r} not in {str(err)!r}"
    assert_explained(err)


def test_attention_fn_of_a_jax_scalar_scale_is_hashable_regression():
    """Regression (review): the unchecked jnp scale was kept, so the promised hashable
    function raised TypeError: unhashable type."""
    fn = rankattn.flax.attention_fn(scale=jnp.float32(0.5), softcap=np.float32(30.0))
    assert hash(fn) == hash(rankattn.flax.attention_fn(scale=0.5, softcap=30.0))
    assert (fn.scale, fn.softcap) == (0.5, 30.0)


def test_attention_fn_of_an_impl_list_is_hashable_regression():
    """Regression (review): impl=[...] was kept as a list, so the function, and the GraphDef of
    every layer built with it, raised TypeError: unhashable type."""
    fn = rankattn.flax.attention_fn(impl=["xla", "reference"])
    assert hash(fn) == hash(rankattn.flax.attention_fn(impl=("xla", "reference")))
    q = np.ones((1, 4, 2, 8), np.float32)
    np.testing.assert_array_equal(fn(q, q, q), rankattn.attention(q, q, q, impl="xla"))


def test_dropout_is_fine_when_deterministic():
    y = dropout_layer(True)
    assert y.shape == (B, S, WIDTH) and bool(jnp.isfinite(y).all())


# --- Flax stays optional. ------------------------------------------------------------------

IMPORTS = """
import sys
import rankattn
assert not [m for m in sys.modules if m.split(".")[0] == "flax"], "import rankattn imported flax"
sys.modules["flax"] = None  # as if flax were not installed
try:
    import rankattn.flax
except ImportError as e:
    print(e)
else:
    raise SystemExit("rankattn.flax was imported without flax")
"""


def test_flax_is_optional():
    result = subprocess.run([sys.executable, "-c", IMPORTS], cwd=ROOT, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "pip install 'rankattn[flax]'" in result.stdout
