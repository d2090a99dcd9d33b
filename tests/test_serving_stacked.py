"""Stacked caches: one PagedKVCache of L layers, scanned over or indexed with layer=.

Every result on a stack must equal, bit for bit, the same call on that layer's own cache:
layer l of every array of a stack *is* that cache, so no tolerance is needed. Scanning a
small multi-layer model over a stack (what a model's serving path does) must equal running
it layer by layer on per-layer caches, for exact attention, a Quest budget and appends.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from test_serving import assert_cache_matches
from rankattn import serving

L, U, S, HKV, HQ, D, P, B, T = 3, 4, 26, 2, 4, 8, 4, 3, 2
LENGTHS = np.array([S, 0, 9, 16])


def histories(seed):
    rng = np.random.default_rng(seed)
    return (rng.normal(size=(L, U, S, HKV, D)).astype(np.float32),
            rng.normal(size=(L, U, S, HKV, D)).astype(np.float32))


def per_layer_caches(k, v, **kw):
    return [serving.cache_from_history(jnp.asarray(k[i]), jnp.asarray(v[i]), LENGTHS,
                                       page_size=P, **kw) for i in range(L)]


def assert_same_cache(got, want, name="cache"):
    for field, a, b in zip(serving.PagedKVCache._fields, got, want):
        np.testing.assert_array_equal(a, b, err_msg=f"{name}.{field}")


def layer(cache, i):
    return jax.tree.map(lambda x: x[i], cache)


def test_the_three_ways_to_build_a_stack_agree():
    """5-D histories, stack_caches of per-layer caches, and empty_cache(num_layers=L) appended
    to layer by layer: the same arrays, bit for bit; layer i is layer i's own cache."""
    k, v = histories(0)
    caches = per_layer_caches(k, v, num_pages=30, max_pages=8)
    stacked = serving.cache_from_history(jnp.asarray(k), jnp.asarray(v), LENGTHS, page_size=P,
                                         num_pages=30, max_pages=8)
    assert stacked.num_layers == L and stacked.k_pages.shape == (L, 30, HKV, P, D)
    assert (stacked.num_pages, stacked.max_pages, stacked.page_size) == (30, 8, P)
    assert_same_cache(stacked, serving.stack_caches(caches))
    empty = serving.empty_cache(num_users=U, num_pages=30, page_size=P, kv_heads=HKV,
                                head_dim=D, max_pages=8, num_layers=L)
    assert empty.overflow.shape == (L,) and empty.num_layers == L
    for i in range(L):
        empty = serving.append(empty, jnp.arange(U), jnp.asarray(k[i]), jnp.asarray(v[i]),
                               jnp.asarray(LENGTHS), layer=i)
        assert_same_cache(layer(stacked, i), caches[i], f"layer {i}")
    assert_same_cache(empty, stacked)
    assert_cache_matches(layer(stacked, 1), {u: (k[1, u, :n], v[1, u, :n])
                                             for u, n in enumerate(LENGTHS) if n})


def request(seed):
    rng = np.random.default_rng(seed)
    return (jnp.asarray(rng.normal(size=(B, T, HQ, D)), jnp.float32),
            jnp.asarray(rng.normal(size=(B, T, HKV, D)), jnp.float32),
            jnp.array([0, 2, 1]))


@pytest.mark.parametrize("budget, gqa", [(None, "group"), (2 * P, "group"), (2 * P, "per_head")])
def test_attend_on_a_layer_of_the_stack_equals_its_own_cache(budget, gqa):
    k, v = histories(1)
    caches = per_layer_caches(k, v)
    stacked = serving.stack_caches(caches)
    q, ks, users = request(2)
    for i in range(L):
        got = serving.attend(q, stacked, users, self_kv=(ks, ks), budget=budget, gqa=gqa,
                             layer=i, return_lse=True)
        want = serving.attend(q, caches[i], users, self_kv=(ks, ks), budget=budget, gqa=gqa,
                              return_lse=True)
        for a, b in zip(got, want):
            np.testing.assert_array_equal(a, b, err_msg=f"layer {i}")
        if budget is not None:
            np.testing.assert_array_equal(
                serving.select_pages(q, stacked, users, budget=budget, gqa=gqa, layer=i),
                serving.select_pages(q, caches[i], users, budget=budget, gqa=gqa))
    np.testing.assert_array_equal(serving.page_bounds(q, stacked, users, layer=jnp.int32(2)),
                                  serving.page_bounds(q, caches[2], users))


# --- A small L-layer model over a stacked cache. ----------------------------------------------


def weights(seed):
    """Per layer: query, key and value projections [W, H*D] and the output [HQ*D, W]."""
    rng = np.random.default_rng(seed)
    w = HQ * D
    return {name: jnp.asarray(rng.normal(0, 0.3, (L, w, n)), jnp.float32)
            for name, n in (("q", HQ * D), ("k", HKV * D), ("v", HKV * D), ("o", w))}


def block(x, params, cache, users, budget, new_counts, layer_index=None):
    """One layer: candidates x [B, T, W] attend to the cache and themselves, and their k/v are
    appended to it (the first new_counts[b] of row b), as a decode step would."""
    heads = lambda name, n: (x @ params[name]).reshape(B, T, n, D)  # noqa: E731
    q, k, v = heads("q", HQ), heads("k", HKV), heads("v", HKV)
    out = serving.attend(q, cache, users, self_kv=(k, v), budget=budget, layer=layer_index)
    cache = serving.append(cache, users, k, v, new_counts, layer=layer_index)
    return x + out.reshape(B, T, -1) @ params["o"], cache


@pytest.mark.parametrize("budget", [None, 2 * P])
def test_scan_and_fori_loop_over_a_stack_equal_per_layer_caches(budget):
    """The serving path of a model: scan over (weights, stacked cache) -- the body gets one
    layer's cache -- and fori_loop over layer=i of the whole stack (a traced layer), against a
    Python loop over per-layer caches. Outputs and updated caches, bit for bit."""
    k, v = histories(3)
    caches = per_layer_caches(k, v, num_pages=40, max_pages=10)
    stacked = serving.stack_caches(caches)
    params = weights(4)
    x0 = jnp.asarray(np.random.default_rng(5).normal(size=(B, T, HQ * D)), jnp.float32)
    users, counts = jnp.array([0, 2, 1]), jnp.array([2, 1, 0])

    @jax.jit
    def loop(x, caches):
        out = []
        for i in range(L):
            x, cache = block(x, layer(params, i), caches[i], users, budget, counts)
            out.append(cache)
        return x, out

    @jax.jit
    def scanned(x, stacked):
        def body(x, inputs):
            return block(x, *inputs, users, budget, counts)
        return jax.lax.scan(body, x, (params, stacked))

    @jax.jit
    def indexed(x, stacked):
        def body(i, carry):
            x, stacked = carry
            return block(x, layer(params, i), stacked, users, budget, counts, layer_index=i)
        return jax.lax.fori_loop(0, L, body, (x, stacked))

    want_x, want_caches = loop(x0, caches)
    assert not np.array_equal(want_x, x0)
    for name, (got_x, got_cache) in (("scan", scanned(x0, stacked)),
                                     ("fori_loop", indexed(x0, stacked))):
        np.testing.assert_array_equal(got_x, want_x, err_msg=name)
        assert_same_cache(got_cache, serving.stack_caches(want_caches), name)
    assert np.asarray(want_caches[0].lengths).tolist() == [S + 2, 0, 9 + 1, 16]


def test_append_and_release_on_one_layer_leave_the_others_alone():
    k, v = histories(6)
    caches = per_layer_caches(k, v, num_pages=40, max_pages=10)
    stacked = serving.stack_caches(caches)
    new = jnp.asarray(np.random.default_rng(7).normal(size=(2, 5, HKV, D)), jnp.float32)
    users, counts = jnp.array([1, 3]), jnp.array([5, 3])
    got, status = serving.append(stacked, users, new, new, counts, layer=1, return_status=True)
    want, want_status = serving.append(caches[1], users, new, new, counts, return_status=True)
    for a, b in zip(status, want_status):
        np.testing.assert_array_equal(a, b)
    released = serving.release(got, jnp.array([0]), layer=2)
    expected = [caches[0], want, serving.release(caches[2], jnp.array([0]))]
    assert_same_cache(released, serving.stack_caches(expected))


def test_vmap_appends_to_and_releases_every_layer_at_once():
    k, v = histories(8)
    caches = per_layer_caches(k, v, num_pages=40, max_pages=10)
    rng = np.random.default_rng(9)
    new_k = jnp.asarray(rng.normal(size=(L, 2, 4, HKV, D)), jnp.float32)
    new_v = jnp.asarray(rng.normal(size=(L, 2, 4, HKV, D)), jnp.float32)
    users, counts = jnp.array([3, 1]), jnp.array([4, 2])
    got = jax.vmap(serving.append, in_axes=(0, None, 0, 0, None))(
        serving.stack_caches(caches), users, new_k, new_v, counts)
    got = jax.vmap(serving.release, in_axes=(0, None))(got, jnp.array([2]))
    want = [serving.release(serving.append(c, users, new_k[i], new_v[i], counts), jnp.array([2]))
            for i, c in enumerate(caches)]
    assert_same_cache(got, serving.stack_caches(want))


@given(steps=st.lists(st.tuples(st.integers(0, L - 1), st.sampled_from([(1, 3), (2, 0, 1)]),
                                st.integers(0, 5), st.integers(0, 2**31 - 1)),
                      min_size=1, max_size=6))
def test_random_layer_appends_match_per_layer_caches(steps):
    """Appends to random layers (some with a traced layer under jit) keep every layer of the
    stack equal to a cache that received only that layer's appends."""
    # Room for every step's tokens (6 x 5 per user), so the eager appends never raise RA210.
    caches = [serving.empty_cache(num_users=U, num_pages=32, page_size=P, kv_heads=HKV,
                                  head_dim=D, max_pages=8) for _ in range(L)]
    stacked = serving.empty_cache(num_users=U, num_pages=32, page_size=P, kv_heads=HKV,
                                  head_dim=D, max_pages=8, num_layers=L)
    jit_append = jax.jit(serving.append)
    for i, (where, who, count, seed) in enumerate(steps):
        new = jnp.asarray(np.random.default_rng(seed).normal(size=(len(who), 5, HKV, D)),
                          jnp.float32)
        users, counts = jnp.array(who), jnp.full((len(who),), count)
        caches[where] = jit_append(caches[where], users, new, new, counts)
        run = jit_append if i % 2 else serving.append
        stacked = run(stacked, users, new, new, counts, layer=jnp.int32(where))
    assert_same_cache(stacked, serving.stack_caches(caches))
