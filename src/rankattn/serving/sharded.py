"""Serving on a device mesh: caches split over users (batch axes) and over history (context axes).

A *sharded cache* is a :class:`PagedKVCache` whose every array has two leading axes
[nb, nc]: nb = the size of the sharding's batch axes, nc = of its context axes (1
when a role has no axes). Cache [i, j] is an ordinary cache with its own page pool:

* batch shard i holds users [i * U, (i + 1) * U) (U users per shard); global user
  id u is local id u % U of shard u // U. A query row must sit on the batch shard
  of its user (rows are split over the batch axes like q: row b on shard
  b // (B / nb)), which is how requests are routed to the device that holds the user;
* context shard j holds tokens [j * C, (j + 1) * C) of each of those users'
  histories (C = the history length / nc, rounded up to whole pages).

:func:`attend` with ``sharding=`` runs the single-device code on every shard inside a
``shard_map``. With context shards each computes its rows' attention to its part of
the history as a partial (out, lse); the partials (C x Hq x Dv per row: the keys stay
where they are) are all-gathered over the context axes and merged by
:func:`rankattn.distributed.merge_partials`, with the self term as one more partial.
Exact attention only: Quest (``budget=``) runs on batch shards, where every user's
pages are whole, but not across context shards (see docs/serving.md).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from rankattn.distributed import (
    Sharding,
    _shard_map,
    _spec,
    merge_partials,
    own_key_partial,
)
from rankattn.errors import fail
from rankattn.serving.cache import PagedKVCache, cache_from_history
from rankattn.validate import concrete


def _shards(sharding: Sharding) -> tuple[int, int]:
    return sharding.size(sharding.batch), sharding.size(sharding.context)


def shard_cache(caches, sharding: Sharding) -> PagedKVCache:
    """Stack ``caches[i][j]`` (batch shard i, context shard j; equal shapes) into a sharded
    cache whose arrays are placed on ``sharding``'s mesh, [nb, nc, ...] over (batch, context)."""
    nb, nc = _shards(sharding)
    if len(caches) != nb or any(len(row) != nc for row in caches):
        raise fail("RA215", f"shard_cache needs {nb} x {nc} caches (batch x context shards of "
                            f"the sharding); got {[len(row) for row in caches]}.")
    stacked = jax.tree.map(lambda *xs: jnp.stack(xs).reshape((nb, nc) + xs[0].shape),
                           *[c for row in caches for c in row])
    placement = jax.sharding.NamedSharding(sharding.mesh, _spec(sharding.batch, sharding.context))
    return jax.tree.map(lambda x: jax.device_put(x, placement), stacked)


def sharded_cache_from_history(k_hist, v_hist, lengths, sharding: Sharding,
                               page_size: int = 16) -> PagedKVCache:
    """A sharded cache of dense histories k_hist [U, S, Hkv, D], v_hist, lengths [U] (numpy or
    concrete): users split over the batch shards, each history over the context shards."""
    nb, nc = _shards(sharding)
    users, length = k_hist.shape[:2]
    if users % nb:
        raise fail("RA215", f"{users} users cannot be split over {nb} batch shards; pass a "
                            f"multiple of {nb} users (empty histories are fine).")
    chunk = -(-length // (nc * page_size)) * page_size  # tokens per context shard
    pad = [(0, 0), (0, nc * chunk - length), (0, 0), (0, 0)]
    k_hist, v_hist = jnp.pad(k_hist, pad), jnp.pad(v_hist, pad)
    lengths = np.asarray(lengths)
    per = users // nb
    caches = [[cache_from_history(k_hist[i * per:(i + 1) * per, j * chunk:(j + 1) * chunk],
                                  v_hist[i * per:(i + 1) * per, j * chunk:(j + 1) * chunk],
                                  np.clip(lengths[i * per:(i + 1) * per] - j * chunk, 0, chunk),
                                  page_size)
               for j in range(nc)] for i in range(nb)]
    return shard_cache(caches, sharding)


def local_view(cache, sharding: Sharding) -> PagedKVCache:
    """One shard's cache, as shapes: what the single-device checks read."""
    if not isinstance(sharding, Sharding):
        raise fail("RA119", f"sharding must be a rankattn.Sharding; got {type(sharding).__name__}.")
    if sharding.heads:
        raise fail("RA215", f"serving shards users (batch=) and history (context=), not heads; "
                            f"got heads={sharding.heads!r}. Drop heads=.")
    nb, nc = _shards(sharding)
    if not isinstance(cache, PagedKVCache) or cache.k_pages.ndim != 6 or \
            tuple(cache.k_pages.shape[:2]) != (nb, nc):
        shape = getattr(getattr(cache, "k_pages", None), "shape", None)
        raise fail("RA215", f"with sharding=, cache must be a sharded cache whose arrays lead "
                            f"with ({nb}, {nc}) = (batch, context) shards; got k_pages of shape "
                            f"{shape}. Build it with rankattn.serving.sharded_cache_from_history "
                            "or shard_cache.")
    return PagedKVCache(*[jax.ShapeDtypeStruct(x.shape[2:], x.dtype) for x in cache])


def local_users(users, batch: int, users_per_shard: int, sharding: Sharding):
    """Global user ids [B] -> ids in their shard's cache; RA216 when a row's user is elsewhere."""
    nb, _ = _shards(sharding)
    if batch % nb:
        raise fail("RA215", f"q has {batch} rows, which {nb} batch shards cannot split; pass a "
                            f"multiple of {nb} rows (pad with any user and ignore the output).")
    values = concrete(users)
    if values is None:  # traced: the caller guarantees the routing (see the module docstring)
        return jnp.asarray(users, jnp.int32) % users_per_shard
    values = np.asarray(values)
    if values.ndim == 1 and values.shape[0] == batch and np.issubdtype(values.dtype, np.integer):
        row_shard = np.arange(batch) // (batch // nb)
        wrong = np.flatnonzero((values // users_per_shard != row_shard)
                               & (values >= 0) & (values < nb * users_per_shard))
        if wrong.size:
            b = int(wrong[0])
            raise fail("RA216", f"row {b} is on batch shard {row_shard[b]} (rows are split "
                                f"{batch // nb} per shard) but its user {int(values[b])} is "
                                f"cached on shard {int(values[b]) // users_per_shard} "
                                f"({users_per_shard} users per shard). Put each request on "
                                "the rows of its user's shard.")
        return values % users_per_shard
    return values  # malformed: the single-device checks name the problem


def attend(plan, query, cache: PagedKVCache, users, sharding: Sharding, attend_partial,
           attend_exact):
    """Sharded scoring; ``plan`` / ``query`` are the checked single-device arguments."""
    batch, context = sharding.batch, sharding.context
    rows, shards = _spec(batch), _spec(batch, context)
    k_self, v_self = query.self_kv

    def body(q, users, k_self, v_self, cache):
        cache = jax.tree.map(lambda x: x[0, 0], cache)
        if not context:
            return attend_exact(plan, q, cache, users, k_self, v_self)
        out, lse = attend_partial(plan, q, cache, users, None, None)
        gathered = [jax.lax.all_gather(x, context) for x in (out, lse)]  # [nc, ...]
        parts = [(o, s) for o, s in zip(*gathered)]
        if k_self is not None:  # the self key: one more partial, on every shard alike
            is_self = -jnp.ones(q.shape[:2], jnp.int32)
            parts.append(own_key_partial(plan, q, k_self, v_self, is_self))
        return merge_partials(parts)[0].astype(q.dtype)

    specs = (rows, rows, None if k_self is None else rows, None if v_self is None else rows,
             jax.tree.map(lambda _: shards, cache))
    mapped = _shard_map(body, sharding.mesh, specs, rows)
    return jax.jit(mapped)(query.q, users, k_self, v_self, cache)
