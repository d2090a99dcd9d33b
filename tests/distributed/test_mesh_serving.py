"""rankattn.serving.attend(..., sharding=) on 8 fake devices against the single-device attend.

Users are split over batch shards, long histories over context shards (sessions longer
than a shard, empty shards, histories ending mid-page); exact results (out and lse) must
match one device within 1e-5, and Quest budgets on batch shards must match exactly. A
stacked sharded cache's layer equals that layer's own sharded cache bit for bit.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
from jax.sharding import Mesh

import rankattn
from helpers import assert_explained
from tolerances import SAME_MATH_TOL, SHARDED_TOL, assert_close_f32
from rankattn import serving

USERS, LENGTH, HQ, HKV, D, T, P = 16, 100, 4, 2, 8, 3, 4


def mesh(**axes):
    return Mesh(np.array(jax.devices()).reshape(tuple(axes.values())), tuple(axes))


def data(seed=0, rows=8):
    rng = np.random.default_rng(seed)
    k = rng.normal(size=(USERS, LENGTH, HKV, D)).astype(np.float32)
    v = rng.normal(size=(USERS, LENGTH, HKV, D)).astype(np.float32)
    lengths = rng.integers(0, LENGTH + 1, USERS)
    lengths[:3] = [LENGTH, 0, 37]  # full, empty, ending mid-page
    q = rng.normal(0, 1.5, (rows, T, HQ, D)).astype(np.float32)
    self_kv = (rng.normal(size=(rows, T, HKV, D)).astype(np.float32),
               rng.normal(size=(rows, T, HKV, D)).astype(np.float32))
    return k, v, lengths, q, self_kv


def routed_users(rows: int, batch_shards: int, seed=0):
    """One user per row, drawn from the users cached on that row's batch shard."""
    rng = np.random.default_rng(seed)
    per_row, per_shard = rows // batch_shards, USERS // batch_shards
    shard = np.arange(rows) // per_row
    users = shard * per_shard + rng.integers(0, per_shard, rows)
    return users.astype(np.int32)


@pytest.mark.parametrize("axes, roles", [(dict(data=8), dict(batch="data")),
                                         (dict(data=2, ctx=4), dict(batch="data", context="ctx")),
                                         (dict(ctx=8), dict(context="ctx"))],
                         ids=["data8", "data2-context4", "context8"])
@pytest.mark.parametrize("impl", ["auto", "xla"])  # the cpu kernel (pages in place); gathered
def test_exact_attend_matches_one_device(axes, roles, impl):
    sharding = rankattn.Sharding(mesh(**axes), **roles)
    k, v, lengths, q, self_kv = data()
    users = routed_users(len(q), sharding.size(sharding.batch))
    users[0] = 1  # an empty history (on shard 0, as row 0): only the self term
    one = serving.cache_from_history(k, v, lengths, page_size=P)
    cache = serving.sharded_cache_from_history(k, v, lengths, sharding=sharding, page_size=P)
    for self_term in (None, self_kv):
        want = serving.attend(q, one, users, self_kv=self_term, return_lse=True)
        got = serving.attend(q, cache, users, self_kv=self_term, sharding=sharding,
                             return_lse=True, impl=impl)
        for name, a, b in zip(("out", "lse"), got, want):  # lse: merged over context shards
            assert a.shape == b.shape and a.dtype == b.dtype
            assert_close_f32(np.asarray(a), np.asarray(b),
                             f"{name}, self term {self_term is not None}", tol=SHARDED_TOL)
        if self_term is None:  # row 0's user has no history: it saw nothing
            assert np.isneginf(np.asarray(got[1])[0]).all()


def test_an_eager_sharded_attend_compiles_once_regression():
    """The same eager call twice compiles at most once: each call jitted a closure made for it, so
    every call compiled again."""
    from rankattn.serving import sharded
    sharding = rankattn.Sharding(mesh(data=2, ctx=4), batch="data", context="ctx")
    k, v, lengths, q, self_kv = data()
    users = routed_users(len(q), 2)
    cache = serving.sharded_cache_from_history(k, v, lengths, sharding=sharding, page_size=P)
    outs, sizes = [], []
    for _ in range(2):
        outs.append(serving.attend(q, cache, users, self_kv=self_kv, sharding=sharding))
        sizes.append(sharded._attend._cache_size())
    assert sizes[1] == sizes[0], sizes  # (the first may have been compiled by a test before)
    np.testing.assert_array_equal(np.asarray(outs[0]), np.asarray(outs[1]))


def test_quest_on_batch_shards_matches_one_device():
    sharding = rankattn.Sharding(mesh(data=8), batch="data")
    k, v, lengths, q, self_kv = data(1)
    users = routed_users(len(q), 8, 1)
    one = serving.cache_from_history(k, v, lengths, page_size=P)
    cache = serving.sharded_cache_from_history(k, v, lengths, sharding=sharding, page_size=P)
    want = serving.attend(q, one, users, self_kv=self_kv, budget=24, return_lse=True)
    got = serving.attend(q, cache, users, self_kv=self_kv, budget=24, sharding=sharding,
                         return_lse=True)
    for name, a, b in zip(("out", "lse"), got, want):
        assert_close_f32(np.asarray(a), np.asarray(b), f"Quest on batch shards, {name}",
                         tol=SAME_MATH_TOL)


def test_stacked_sharded_cache_by_layer_equals_each_layers_sharded_cache():
    """5-D histories give a stacked sharded cache [L, nb, nc, ...], placed with the layer
    axis unsharded; layer=i (an int, or traced) equals layer i's own sharded cache bit for
    bit, and num_pages / max_pages size every shard's own cache."""
    sharding = rankattn.Sharding(mesh(data=2, ctx=4), batch="data", context="ctx")
    layers = [data(seed) for seed in (2, 3)]
    lengths, q, self_kv = layers[0][2], layers[0][3], layers[0][4]
    k = np.stack([x[0] for x in layers])
    v = np.stack([x[1] for x in layers])
    users = routed_users(len(q), 2, 2)
    sizes = dict(page_size=P, num_pages=60, max_pages=9)       # default per shard: 56 and 7
    stacked = serving.sharded_cache_from_history(k, v, lengths, sharding=sharding, **sizes)
    assert stacked.k_pages.shape == (2, 2, 4, 60, HKV, P, D) and stacked.max_pages == 9
    assert stacked.k_pages.sharding.spec == jax.sharding.PartitionSpec(None, "data", "ctx")
    by_layer = jax.jit(lambda q, c, u, kv, i: serving.attend(
        q, c, u, self_kv=kv, sharding=sharding, layer=i, return_lse=True))
    for i in range(2):
        own = serving.sharded_cache_from_history(k[i], v[i], lengths, sharding=sharding, **sizes)
        want = serving.attend(q, own, users, self_kv=self_kv, sharding=sharding, return_lse=True)
        for got in (serving.attend(q, stacked, users, self_kv=self_kv, sharding=sharding,
                                   layer=i, return_lse=True),
                    by_layer(q, stacked, users, self_kv, jax.numpy.int32(i))):
            for a, b in zip(got, want):
                np.testing.assert_array_equal(a, b)
        one = serving.cache_from_history(k[i], v[i], lengths, page_size=P)
        assert_close_f32(np.asarray(want[0]), np.asarray(serving.attend(
            q, one, users, self_kv=self_kv)), f"layer {i} against one device", tol=SHARDED_TOL)


def test_a_user_on_another_shard_is_refused():
    sharding = rankattn.Sharding(mesh(data=8), batch="data")
    k, v, lengths, q, _ = data()
    cache = serving.sharded_cache_from_history(k, v, lengths, sharding=sharding, page_size=P)
    users = routed_users(len(q), 8)
    users[3] = 0  # row 3 sits on shard 3; user 0 lives on shard 0
    with pytest.raises(rankattn.RankattnError, match="RA216") as info:
        serving.attend(q, cache, users, sharding=sharding)
    assert_explained(info.value)


def test_a_user_past_every_shard_is_refused_not_wrapped_regression():
    """Regression (review): an id outside [0, shards x users per shard) skipped the shard
    check, and the modulo that makes ids local then scored it against another user's
    history (-1 against the shard's last user), where one device raises RA206."""
    sharding = rankattn.Sharding(mesh(data=8), batch="data")
    k, v, lengths, q, _ = data()
    cache = serving.sharded_cache_from_history(k, v, lengths, sharding=sharding, page_size=P)
    total = USERS  # every shard's users
    for bad in (-1, total):
        users = routed_users(len(q), 8)
        users[-1] = bad
        with pytest.raises(rankattn.RankattnError, match="RA206") as info:
            serving.attend(q, cache, users, sharding=sharding)
        assert f"[{bad}], outside [0, {total})" in str(info.value)
        assert_explained(info.value)
