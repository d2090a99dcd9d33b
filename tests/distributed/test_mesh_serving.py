"""rankattn.serving.attend(..., sharding=) on 8 fake devices against the single-device attend.

Users are split over batch shards, long histories over context shards (sessions longer
than a shard, empty shards, histories ending mid-page); exact results must match one
device within 1e-5, and Quest budgets on batch shards must match exactly.
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
def test_exact_attend_matches_one_device(axes, roles):
    sharding = rankattn.Sharding(mesh(**axes), **roles)
    k, v, lengths, q, self_kv = data()
    users = routed_users(len(q), sharding.size(sharding.batch))
    users[0] = 1  # an empty history (on shard 0, as row 0): only the self term
    one = serving.cache_from_history(k, v, lengths, page_size=P)
    cache = serving.sharded_cache_from_history(k, v, lengths, sharding, page_size=P)
    for self_term in (None, self_kv):
        want = np.asarray(serving.attend(q, one, users, self_term))
        got = np.asarray(serving.attend(q, cache, users, self_term, sharding=sharding))
        assert_close_f32(got, want, f"self term {self_term is not None}", tol=SHARDED_TOL)


def test_quest_on_batch_shards_matches_one_device():
    sharding = rankattn.Sharding(mesh(data=8), batch="data")
    k, v, lengths, q, self_kv = data(1)
    users = routed_users(len(q), 8, 1)
    one = serving.cache_from_history(k, v, lengths, page_size=P)
    cache = serving.sharded_cache_from_history(k, v, lengths, sharding, page_size=P)
    want = serving.attend(q, one, users, self_kv, budget=24)
    got = serving.attend(q, cache, users, self_kv, budget=24, sharding=sharding)
    assert_close_f32(np.asarray(got), np.asarray(want), "Quest on batch shards", tol=SAME_MATH_TOL)


def test_a_user_on_another_shard_is_refused():
    sharding = rankattn.Sharding(mesh(data=8), batch="data")
    k, v, lengths, q, _ = data()
    cache = serving.sharded_cache_from_history(k, v, lengths, sharding, page_size=P)
    users = routed_users(len(q), 8)
    users[3] = 0  # row 3 sits on shard 3; user 0 lives on shard 0
    with pytest.raises(rankattn.RankattnError, match="RA216") as info:
        serving.attend(q, cache, users, sharding=sharding)
    assert_explained(info.value)
