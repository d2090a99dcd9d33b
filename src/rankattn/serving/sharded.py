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
the history as a partial (out, lse); the partials (T x Hq x Dv per row: the keys stay
where they are) are all-gathered over the context axes and merged by
:func:`rankattn.distributed.merge_partials`, with the self term as one more partial.
Exact attention only: Quest (``budget=``) runs on batch shards, where every user's
pages are whole, but not across context shards (see docs/serving.md). The merged
log-sum-exp is what ``attend(..., return_lse=True)`` returns.

A stacked sharded cache (L layers) has arrays [L, nb, nc, ...]: layer i of it is a
sharded cache, and ``attend(..., sharding=, layer=i)`` slices it on every device.
"""

from __future__ import annotations

import functools

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
from rankattn.serving.cache import (PagedKVCache, _positive_int, cache_from_history,
                                    check_alike, check_history, keyword_options, select_layer,
                                    shapes)
from rankattn.validate import concrete


def _shards(sharding: Sharding) -> tuple[int, int]:
    return sharding.size(sharding.batch), sharding.size(sharding.context)


def _check_sharding(sharding) -> None:
    if not isinstance(sharding, Sharding):
        raise fail("RA119", f"sharding must be a rankattn.Sharding; got {type(sharding).__name__}.")
    if sharding.heads:
        raise fail("RA215", f"serving shards users (batch=) and history (context=), not heads; "
                            f"got heads={sharding.heads!r}. Drop heads=.")


@keyword_options("sharding")
def shard_cache(caches, *, sharding: Sharding) -> PagedKVCache:
    """Stack ``caches[i][j]`` (batch shard i, context shard j: nb lists of nc PagedKVCache,
    RA215 otherwise; equal shapes and dtypes, RA201 otherwise) into a sharded cache whose
    arrays are placed on ``sharding``'s mesh, [nb, nc, ...] over (batch, context).
    Stacked caches of L layers each give a stacked sharded cache, [L, nb, nc, ...] (the layer
    axis first, so that layer i is a sharded cache)."""
    _check_sharding(sharding)
    nb, nc = _shards(sharding)

    def is_list(x):  # a PagedKVCache is a tuple too: a flat list of 8 passed as 8 rows of 8
        return isinstance(x, (list, tuple)) and not isinstance(x, PagedKVCache)

    if not is_list(caches) or len(caches) != nb or any(
            not is_list(row) or len(row) != nc for row in caches):
        got = ([len(row) if is_list(row) else type(row).__name__ for row in caches]
               if is_list(caches) else type(caches).__name__)
        raise fail("RA215", f"shard_cache needs {nb} lists of {nc} caches (batch x context "
                            f"shards of the sharding); got {got}.")
    flat = [c for row in caches for c in row]
    labels = [f"caches[{i}][{j}]" for i in range(nb) for j in range(nc)]
    for label, cache in zip(labels, flat):
        if not isinstance(cache, PagedKVCache):
            raise fail("RA215", f"shard_cache: {label} is {type(cache).__name__}, not a "
                                "PagedKVCache.")
    check_alike(flat, labels, "shard_cache", "every shard's cache")
    stacked = jax.tree.map(lambda *xs: jnp.stack(xs).reshape((nb, nc) + xs[0].shape), *flat)
    layers = stacked.k_pages.ndim == 7
    if layers:
        stacked = jax.tree.map(lambda x: jnp.moveaxis(x, 2, 0), stacked)
    spec = _spec(*[()] * layers, sharding.batch, sharding.context)
    placement = jax.sharding.NamedSharding(sharding.mesh, spec)
    return jax.tree.map(lambda x: jax.device_put(x, placement), stacked)


@keyword_options("sharding", "page_size")
def sharded_cache_from_history(k_hist, v_hist, lengths, *, sharding: Sharding,
                               page_size: int = 16, num_pages: int | None = None,
                               max_pages: int | None = None) -> PagedKVCache:
    """A sharded cache of dense histories: users split over the batch shards, each history over
    the context shards.

    Args:
      k_hist, v_hist, lengths: as :func:`rankattn.serving.cache_from_history` ([U, S, Hkv, D],
        or [L, U, S, Hkv, D] for a stacked cache of L layers; lengths [U]). U must be a
        multiple of the batch shards' count nb.
      sharding: rankattn.Sharding(mesh, batch=..., context=...) (keyword-only).
      page_size: P, tokens per page.
      num_pages, max_pages: per shard. Every (batch shard, context shard) has its own cache
        of U / nb users holding C tokens of each history (C = S / nc rounded up to whole
        pages): ``num_pages`` physical pages (default (U / nb) * max_pages) of which one user
        may own ``max_pages`` (default C / P, a whole C-token slice). A user whose slice on a
        shard needs more than max_pages pages is RA210.

    Returns:
      PagedKVCache with arrays [nb, nc, ...] ([L, nb, nc, ...] stacked) placed on the mesh;
      cache [i, j] equals cache_from_history of batch shard i's users and context shard j's
      tokens.
    """
    _check_sharding(sharding)
    lengths = jnp.asarray(check_history(k_hist, v_hist, lengths, "sharded_cache_from_history"))
    if not _positive_int(page_size):
        raise fail("RA212", f"page_size={page_size!r}; pass a positive Python int such as 16.")
    nb, nc = _shards(sharding)
    users, length = k_hist.shape[-4:-2]
    if users % nb:
        raise fail("RA215", f"{users} users cannot be split over {nb} batch shards; pass a "
                            f"multiple of {nb} users (empty histories are fine).")
    chunk = -(-length // (nc * page_size)) * page_size  # tokens per context shard
    pad = [(0, 0)] * (k_hist.ndim - 3) + [(0, nc * chunk - length), (0, 0), (0, 0)]
    k_hist, v_hist = jnp.pad(k_hist, pad), jnp.pad(v_hist, pad)
    per = users // nb

    def part(x, i, j):  # batch shard i's users, context shard j's tokens (of every layer)
        return x[..., i * per:(i + 1) * per, j * chunk:(j + 1) * chunk, :, :]

    caches = [[cache_from_history(part(k_hist, i, j), part(v_hist, i, j),
                                  jnp.clip(lengths[i * per:(i + 1) * per] - j * chunk, 0, chunk),
                                  page_size=page_size, num_pages=num_pages, max_pages=max_pages)
               for j in range(nc)] for i in range(nb)]
    return shard_cache(caches, sharding=sharding)


def local_view(cache, sharding: Sharding) -> PagedKVCache:
    """One shard's cache, as shapes: what the single-device checks read."""
    _check_sharding(sharding)
    nb, nc = _shards(sharding)
    shape = getattr(getattr(cache, "k_pages", None), "shape", None)
    if not isinstance(cache, PagedKVCache) or shape is None or len(shape) != 6 \
            or tuple(shape[:2]) != (nb, nc):
        raise fail("RA215", f"with sharding=, cache must be a sharded cache whose arrays lead "
                            f"with ({nb}, {nc}) = (batch, context) shards; got k_pages of shape "
                            f"{shape}. Build it with rankattn.serving.sharded_cache_from_history "
                            "or shard_cache.")
    return shapes(cache, 2)


def local_users(users, batch: int, users_per_shard: int, sharding: Sharding):
    """Global user ids [B] -> ids in their shard's cache; RA206 for an id outside every
    shard's users, RA216 when a row's user is on another shard."""
    nb, _ = _shards(sharding)
    if batch % nb:
        raise fail("RA215", f"q has {batch} rows, which {nb} batch shards cannot split; pass a "
                            f"multiple of {nb} rows (pad with any user and ignore the output).")
    values = concrete(users)
    if values is None:  # traced: the caller guarantees the routing (see the module docstring)
        return jnp.asarray(users, jnp.int32) % users_per_shard
    values = np.asarray(values)
    if values.ndim == 1 and values.shape[0] == batch and np.issubdtype(values.dtype, np.integer):
        # Refused here: the modulo below would make an id past the shards' users a valid one.
        bad = values[(values < 0) | (values >= nb * users_per_shard)]
        if bad.size:
            raise fail("RA206", f"attend: users holds {bad[:5].tolist()}, outside [0, "
                                f"{nb * users_per_shard}) (the {nb} batch shards' caches "
                                f"hold {users_per_shard} users each).")
        row_shard = np.arange(batch) // (batch // nb)
        wrong = np.flatnonzero(values // users_per_shard != row_shard)
        if wrong.size:
            b = int(wrong[0])
            raise fail("RA216", f"row {b} is on batch shard {row_shard[b]} (rows are split "
                                f"{batch // nb} per shard) but its user {int(values[b])} is "
                                f"cached on shard {int(values[b]) // users_per_shard} "
                                f"({users_per_shard} users per shard). Put each request on "
                                "the rows of its user's shard.")
        return values % users_per_shard
    return values  # malformed: the single-device checks name the problem


def attend(plan, query, cache: PagedKVCache, users, sharding: Sharding, layer, attend_partial,
           attend_exact):
    """Sharded scoring: (out [B, T, Hq, Dv] in q's dtype, lse [B, T, Hq]); ``plan`` / ``query``
    are the checked single-device arguments, ``layer`` the layer of a stacked cache (or None).
    Jitted on the static arguments: called eagerly, a shard_map would run its body op by op
    (and a jit of a closure made here compiled again at every call)."""
    k_self, v_self = query.self_kv
    return _attend(query.q, users, k_self, v_self, cache, layer, plan=plan, sharding=sharding,
                   attend_partial=attend_partial, attend_exact=attend_exact)


@functools.partial(jax.jit, static_argnames=("plan", "sharding", "attend_partial",
                                             "attend_exact"))
def _attend(q, users, k_self, v_self, cache, layer, *, plan, sharding: Sharding, attend_partial,
            attend_exact):
    batch, context = sharding.batch, sharding.context
    rows, shards = _spec(batch), _spec(batch, context)

    def body(q, users, k_self, v_self, cache):
        cache = jax.tree.map(lambda x: x[0, 0], cache)
        if not context:
            return attend_exact(plan, q, cache, users, k_self, v_self, None)
        out, lse = attend_partial(plan, q, cache, users, None, None)
        gathered = [jax.lax.all_gather(x, context) for x in (out, lse)]  # [nc, ...]
        parts = [(o, s) for o, s in zip(*gathered)]
        if k_self is not None:  # the self key: one more partial, on every shard alike
            is_self = -jnp.ones(q.shape[:2], jnp.int32)
            parts.append(own_key_partial(plan, q, k_self, v_self, is_self))
        out, lse = merge_partials(parts)
        return out.astype(q.dtype), jnp.swapaxes(lse, 1, 2)

    specs = (rows, rows, None if k_self is None else rows, None if v_self is None else rows,
             jax.tree.map(lambda _: shards, cache))
    mapped = _shard_map(body, sharding.mesh, specs, (rows, rows))
    # A stack's layer, sliced on every device.
    return mapped(q, users, k_self, v_self, select_layer(cache, layer))
