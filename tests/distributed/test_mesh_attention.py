"""rankattn.attention(..., sharding=) on 8 fake devices against single-device rankattn.attention.

Every case runs forward (out, lse) and backward (jax.vjp with random cotangents on out
and on lse) once sharded and once on one device, in float32: outputs within 1e-5,
gradients within 1e-4 of the largest gradient entry. The segment rows put sessions
shorter and longer than a shard, a session ending exactly on a shard edge, candidates on
shard edges, split history, random packing and whole shards of padding on every mesh.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

import rankattn
from rankattn.backends import BlockSizes, PallasTpu
from tolerances import SHARDED_TOL, assert_close_f32

S, HQ, HKV, D = 64, 4, 2, 8  # with 8 context shards a shard holds 8 tokens, 4 per causal chunk


def test_eight_devices():
    assert jax.device_count() == 8


def mesh(**axes):
    return Mesh(np.array(jax.devices()).reshape(tuple(axes.values())), tuple(axes))


def edge_rows(batch: int, seed: int = 0) -> np.ndarray:
    """[batch, 64] segment ids. Shard edges (8, 16 or 32 tokens apart) sit at multiples of 8."""
    seg = np.zeros((batch, S), np.int32)
    # Row 0: session 1 ends exactly on the edge at 16; session 2 spans shards 2-5 with its
    # candidates at 41-42; session 3's candidates fill the last shard (edges 56 and 63).
    seg[0, 0:13], seg[0, 13:16], seg[0, 16:41], seg[0, 41:43] = 1, -1, 2, -2
    seg[0, 48:56], seg[0, 56:64] = 3, -3
    # Row 1: the first 16 tokens (one or two whole shards) are padding; session 5's
    # candidates straddle the edge at 32 and its history continues after them; a session
    # shorter than a shard; then random tokens.
    seg[1, 16:30], seg[1, 30:34], seg[1, 34:40] = 5, -5, 5
    seg[1, 40:44], seg[1, 44:46] = 6, -6
    rng = np.random.default_rng(seed)
    seg[1, 48:] = rng.choice([7, 7, 8, -7, -8, 0], 16)
    for row in range(2, batch):  # random packing, including rows that are mostly padding
        seg[row] = rng.choice([0, 1, 1, 2, 2, -1, -2, 3, -3], S)
    return seg


def inputs(batch: int, seed: int):
    rng = np.random.default_rng(seed)
    normal = lambda *shape, std=1.0: rng.normal(0, std, shape).astype(np.float32)
    q, k, v = normal(batch, S, HQ, D, std=1.5), normal(batch, S, HKV, D), normal(batch, S, HKV, D)
    d_out, d_lse = normal(batch, S, HQ, D), normal(batch, HQ, S)
    return q, k, v, d_out, d_lse


@functools.cache
def run(sharding, causal: bool, softcap, impl: str = "auto"):
    """A jitted (q, k, v, seg, d_out, d_lse, logit multiplier or None) -> (out, lse, dq, dk,
    dv)."""
    def f(q, k, v, seg, d_out, d_lse, multiplier=None):
        def attend(q, k, v):
            return rankattn.attention(q, k, v, segment_ids=seg, causal=causal, softcap=softcap,
                                      logit_multiplier=multiplier, return_lse=True, impl=impl,
                                      sharding=sharding)
        (out, lse), pullback = jax.vjp(attend, q, k, v)
        return (out, lse) + pullback((d_out, d_lse))
    return jax.jit(f)


def check_against_one_device(sharding, batch, causal, softcap=None, seed=0, impl="auto",
                             multiplier=False):
    """``multiplier``: also pass a logit multiplier [B, S, Hq] (values in [-1, 2])."""
    q, k, v, d_out, d_lse = inputs(batch, seed)
    seg = edge_rows(batch, seed)
    t = None
    if multiplier:
        t = np.random.default_rng(seed).uniform(-1, 2, (batch, S, HQ)).astype(np.float32)
    want = run(None, causal, softcap)(q, k, v, seg, d_out, d_lse, t)
    got = run(sharding, causal, softcap, impl)(q, k, v, seg, d_out, d_lse, t)
    names = ("out", "lse", "dq", "dk", "dv")
    for name, w, g in zip(names, want, got):
        w, g = np.asarray(w), np.asarray(g)
        assert np.isfinite(g[np.isfinite(w)]).all(), name
        if name == "lse":
            assert np.array_equal(np.isneginf(w), np.isneginf(g)), "rows that see nothing differ"
            w, g = np.where(np.isneginf(w), 0, w), np.where(np.isneginf(g), 0, g)
        bound = 1e-5 if name in ("out", "lse") else 1e-4 * np.abs(w).max()
        assert np.abs(w - g).max() <= bound, (name, float(np.abs(w - g).max()), bound)
    # Padding (whole shards of it in row 1): out 0, lse -inf, no gradient, as on one device.
    out, lse, dq = (np.asarray(x) for x in got[:3])
    pad = seg == 0
    assert (out[pad] == 0).all() and np.isneginf(lse.transpose(0, 2, 1)[pad]).all()
    assert (dq[pad] == 0).all()
    return got


CONTEXT_MESHES = {
    "context8": lambda: rankattn.Sharding(mesh(ctx=8), context="ctx"),
    "data2-context4": lambda: rankattn.Sharding(mesh(data=2, ctx=4), batch="data", context="ctx"),
    "data2-heads2-context2": lambda: rankattn.Sharding(mesh(data=2, heads=2, ctx=2), batch="data",
                                                       heads="heads", context="ctx"),
    # Context over two mesh axes: shard i is listed-order for axis_index and the data, and the
    # causal reorder's permutes must move its chunks there (Sharding refuses other orders).
    "context2x4": lambda: rankattn.Sharding(mesh(outer=2, inner=4), context=("outer", "inner")),
}


# Every mesh runs both strategies and both masks; the 8-shard mesh every combination.
CONTEXT_CASES = [("context8", c, s) for c in (False, True) for s in ("all_gather", "ring")] + [
    ("data2-context4", True, "ring"), ("data2-context4", False, "all_gather"),
    ("data2-heads2-context2", True, "all_gather"), ("data2-heads2-context2", False, "ring"),
    ("context2x4", True, "ring")]


@pytest.mark.parametrize("mesh_name, causal, strategy", CONTEXT_CASES,
                         ids=[f"{m}-{'causal' if c else 'bidirectional'}-{s}"
                              for m, c, s in CONTEXT_CASES])
def test_context_sharding_matches_one_device(mesh_name, causal, strategy):
    base = CONTEXT_MESHES[mesh_name]()
    sharding = rankattn.Sharding(base.mesh, batch=base.batch, heads=base.heads,
                                 context=base.context, strategy=strategy)
    check_against_one_device(sharding, batch=2, causal=causal)


def test_batch_sharding_matches_one_device():
    check_against_one_device(rankattn.Sharding(mesh(data=8), batch="data"), batch=8, causal=True)


def test_an_eager_sharded_call_compiles_once_regression():
    """The same eager call twice compiles at most once, on batch and on context shards: each call
    jitted a closure made for it, so every call compiled again (about a second each)."""
    from rankattn import distributed
    q, k, v, _, _ = inputs(8, 0)
    seg = edge_rows(8)
    for sharding in (rankattn.Sharding(mesh(data=8), batch="data"),
                     rankattn.Sharding(mesh(ctx=8), context="ctx", strategy="ring")):
        outs, sizes = [], []
        for _ in range(2):
            outs.append(rankattn.attention(q, k, v, segment_ids=seg, causal=True,
                                           sharding=sharding))
            sizes.append(distributed._sharded_attention._cache_size())
        assert sizes[1] == sizes[0], sizes  # (the first may have been compiled before)
        np.testing.assert_array_equal(np.asarray(outs[0]), np.asarray(outs[1]))


@pytest.mark.parametrize("strategy", ["all_gather", "ring"])
def test_meshes_of_jax_make_mesh_work(strategy):
    """Regression: jax.make_mesh gives Explicit axes (jax >= 0.7), whose shard_map refused
    unsharded inputs with a JAX ValueError; the inputs are now resharded first."""
    explicit = jax.make_mesh((2, 4), ("data", "ctx"))
    check_against_one_device(rankattn.Sharding(explicit, batch="data", context="ctx",
                                               strategy=strategy), batch=2, causal=True)


@pytest.mark.parametrize("mesh_name, strategy", [("context8", "ring"),
                                                 ("data2-heads2-context2", "all_gather")])
def test_logit_multiplier_on_shards(mesh_name, strategy):
    """Each device gets its queries' multipliers, moved with them into the causal balanced
    order, and the candidates' own keys take them too."""
    base = CONTEXT_MESHES[mesh_name]()
    sharding = rankattn.Sharding(base.mesh, batch=base.batch, heads=base.heads,
                                 context=base.context, strategy=strategy)
    check_against_one_device(sharding, batch=2, causal=True, softcap=2.0, multiplier=True)
    check_against_one_device(rankattn.Sharding(mesh(data=2, heads=2, ctx=2), batch="data",
                                               heads="heads"), batch=2, causal=False,
                             multiplier=True)


@pytest.mark.parametrize("strategy", ["all_gather", "ring"])
def test_softcap_and_reference_kernel_on_shards(strategy):
    sharding = rankattn.Sharding(mesh(ctx=8), context="ctx", strategy=strategy)
    check_against_one_device(sharding, batch=2, causal=True, softcap=2.0, seed=1,
                             impl="reference")


def test_perturbing_one_shards_candidates_changes_nothing_else():
    sharding = rankattn.Sharding(mesh(ctx=8), context="ctx", strategy="ring")
    q, k, v, d_out, d_lse = inputs(2, 3)
    seg = edge_rows(2)
    shard = slice(56, 64)  # row 0: candidates of session 3 only
    assert (seg[0, shard] < 0).all()
    q2, k2, v2 = (x.copy() for x in (q, k, v))
    for x in (q2, k2, v2):
        x[0, shard] = np.random.default_rng(9).normal(size=x[0, shard].shape)
    f = run(sharding, True, None)
    base, moved = f(q, k, v, seg, d_out, d_lse), f(q2, k2, v2, seg, d_out, d_lse)
    others = np.ones((2, S), bool)
    others[0, shard] = False
    for name, a, b in zip(("out", "dq"), (base[0], base[2]), (moved[0], moved[2])):
        assert np.array_equal(np.asarray(a)[others], np.asarray(b)[others]), name
    assert np.array_equal(np.asarray(base[1]).transpose(0, 2, 1)[others],
                          np.asarray(moved[1]).transpose(0, 2, 1)[others])
    assert not np.array_equal(np.asarray(base[0])[0, shard], np.asarray(moved[0])[0, shard])


def test_sharded_inputs_and_outputs_keep_the_layout():
    sharding = rankattn.Sharding(mesh(data=2, ctx=4), batch="data", context="ctx")
    q, k, v, _, _ = inputs(2, 0)
    spec = jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec("data", "ctx"))
    q, k, v = (jax.device_put(x, spec) for x in (q, k, v))
    out, lse = rankattn.attention(q, k, v, segment_ids=edge_rows(2), return_lse=True,
                                  sharding=sharding)
    assert tuple(out.sharding.spec)[:2] == ("data", "ctx")
    assert tuple(lse.sharding.spec) == ("data", None, "ctx")


def test_auto_strategy_follows_the_gathered_size(monkeypatch):
    from rankattn import distributed

    sharding = rankattn.Sharding(mesh(ctx=8), context="ctx")
    q = jnp.zeros((1, S, HQ, D))
    call = rankattn.validate.check_attention_args(
        q, q[:, :, :HKV], q[:, :, :HKV], segment_ids=None, bounds=None, causal=False,
        scale=None, softcap=None, softcap_method="tanh")
    assert distributed.choose_strategy(call, sharding) == "all_gather"
    monkeypatch.setattr(distributed, "ASSUMED_DEVICE_BYTES", 8 * S * HKV * 2 * D * 4 - 8)
    assert distributed.choose_strategy(call, sharding) == "ring"


def test_a_plan_is_split_over_the_batch():
    """Batch sharding passes a plan's per-row lists through the shard_map; context sharding
    keeps only its segment ids. Both equal the call with the mask itself."""
    q, k, v, _, _ = inputs(8, 5)
    seg = edge_rows(8, 5)
    plan = rankattn.plan(segment_ids=seg, causal=True)
    want = np.asarray(rankattn.attention(q, k, v, segment_ids=seg, causal=True))
    for sharding in (rankattn.Sharding(mesh(data=8), batch="data"),
                     rankattn.Sharding(mesh(data=2, ctx=4), batch="data", context="ctx")):
        got = np.asarray(rankattn.attention(q, k, v, plan=plan, sharding=sharding))
        assert_close_f32(got, want, f"plan under {sharding}", tol=SHARDED_TOL)


def test_ring_second_derivatives_run_on_reference_and_raise_ra130_elsewhere():
    """Regression (review): the ring's custom VJP calls the kernel's own inside its rules, so
    jax.jvp of jax.grad failed with JAX's TypeError on xla (which takes it on one device, or
    with all_gather). Now RA130 on every kernel but the reference one, where it runs, matching
    one device."""
    q, k, v, tangent, _ = inputs(2, 5)
    seg = edge_rows(2, 5)

    def grad(impl, strategy):
        sharding = None if strategy is None else rankattn.Sharding(mesh(ctx=8), context="ctx",
                                                                   strategy=strategy)
        return jax.grad(lambda q: (rankattn.attention(
            q, k, v, segment_ids=seg, causal=True, impl=impl, sharding=sharding) ** 2).sum())

    want = jax.jvp(grad("reference", None), (q,), (tangent,))[1]
    got = jax.jvp(grad("reference", "ring"), (q,), (tangent,))[1]
    assert np.abs(np.asarray(got) - np.asarray(want)).max() <= 1e-4 * np.abs(want).max()
    with pytest.raises(rankattn.RankattnError, match=r"\[RA130\].*ring strategy on 'xla'"):
        jax.jvp(grad("xla", "ring"), (q,), (tangent,))
    with pytest.raises(rankattn.RankattnError, match=r"\[RA130\].*ring strategy on 'xla'"):
        jax.grad(lambda q: (grad("xla", "ring")(q) * tangent).sum())(q)


@pytest.mark.parametrize("strategy", ["all_gather", "ring"])
def test_tokens_reordered_once_per_batch(strategy):
    """balanced_layout=True: the caller reorders the sequence once; results in that order."""
    from rankattn.distributed import balanced_order

    sharding = rankattn.Sharding(mesh(ctx=8), context="ctx", strategy=strategy,
                                 balanced_layout=True)
    q, k, v, d_out, d_lse = inputs(2, 4)
    seg = edge_rows(2, 4)
    order = balanced_order(S, 8)
    back = np.argsort(order)
    want = run(None, True, None)(q, k, v, seg, d_out, d_lse)
    got = run(sharding, True, None)(q[:, order], k[:, order], v[:, order], seg[:, order],
                                    d_out[:, order], d_lse[:, :, order])
    for name, w, g in zip(("out", "lse", "dq", "dk", "dv"), want, got):
        g = np.asarray(g)[:, :, back] if name == "lse" else np.asarray(g)[:, back]
        w = np.asarray(w)
        if name == "lse":
            assert np.array_equal(np.isneginf(w), np.isneginf(g))
            w, g = np.where(np.isneginf(w), 0, w), np.where(np.isneginf(g), 0, g)
        bound = 1e-5 if name in ("out", "lse") else 1e-4 * np.abs(w).max()
        assert np.abs(w - g).max() <= bound, name


@pytest.mark.parametrize("strategy", ["all_gather", "ring"])
def test_non_finite_inputs_poison_the_same_rows(strategy):
    """rankattn.semantics: a NaN / inf in q or in a key a query sees makes that query's out and
    lse NaN, every other result is unchanged and every gradient finite, on shards as on one
    device (a candidate's own key, a query of a history token)."""
    sharding = rankattn.Sharding(mesh(ctx=8), context="ctx", strategy=strategy)
    q, k, v, d_out, d_lse = inputs(2, 0)
    seg = edge_rows(2)
    k[0, 41, 0, 0] = np.nan  # a candidate's own key (session 2)
    q[1, 20, 1, 0] = np.inf  # a history query (session 5)
    want = run(None, True, None)(q, k, v, seg, d_out, d_lse)
    got = run(sharding, True, None)(q, k, v, seg, d_out, d_lse)
    for name, w, g in zip(("out", "lse", "dq", "dk", "dv"), want, got):
        w, g = np.asarray(w), np.asarray(g)
        assert np.array_equal(np.isnan(w), np.isnan(g)), name
        assert np.isnan(w).any() == (name in ("out", "lse")), name
        finite = np.isfinite(w) & np.isfinite(g)
        bound = 1e-5 if name in ("out", "lse") else 1e-4 * np.abs(w[finite]).max()
        assert np.abs(w[finite] - g[finite]).max() <= bound, name


@pytest.mark.parametrize("strategy", ["all_gather", "ring"])
def test_pallas_tpu_kernels_on_shards(strategy):
    """pallas_tpu (interpret mode, 16 x 16 blocks) as the per-shard kernel: context shards run
    its ShardMask path (positions and the keys' own segment ids), batch and heads shards its
    plain one; results and gradients as on one device."""
    impl = PallasTpu(BlockSizes(16, 16), interpret=True)
    check_against_one_device(rankattn.Sharding(mesh(data=2, heads=2, ctx=2), batch="data",
                                               heads="heads", context="ctx", strategy=strategy),
                             batch=2, causal=True, softcap=2.0, impl=impl)
