"""Serving: a paged history KV cache, candidate scoring against it, and Quest page selection.

With candidate isolation, history tokens never see candidates, so a user's
history K/V per layer can be computed once and reused by every ranking request
of that user: scoring C candidates costs O(C * S) per layer instead of
O((S + C)^2), and scores are batch-invariant by construction.

* :class:`PagedKVCache`, :func:`empty_cache`, :func:`cache_from_history`,
  :func:`append` (with an :class:`AppendStatus` per user on request),
  :func:`release`: the cache (a pytree; every function is pure and jittable).
  :func:`stack_caches` (or 5-D histories, or ``empty_cache(num_layers=L)``) makes
  one cache of L layers that ``jax.lax.scan`` can carry; the functions take
  ``layer=i`` for one layer of it.
* :func:`attend`: queries [B, T, Hq, D] (or [B, Hq, D], [B, Hq*D]) against their
  users' cached history plus an optional self term; exact, or with a token
  ``budget`` using Quest's page bounds (``gqa='per_head' | 'group' | 'mean'``,
  pages selected per candidate or shared by a request: ``selection=``);
  ``return_lse=True`` adds each row's log-sum-exp.
* :func:`select_pages`, :func:`page_bounds`: the selection and the bounds
  behind it, for inspection.
* :func:`sharded_cache_from_history`, :func:`shard_cache` and ``attend(...,
  sharding=)``: caches split over users and over history on a device mesh
  (:mod:`rankattn.serving.sharded`).
* :class:`HistoryStore`: the serving state over one stacked cache, keyed by user:
  which histories stay cached, when one is stale, what is evicted (by a policy of
  ``EVICTION_POLICIES``, :mod:`rankattn.serving.eviction`: LRU or S3-FIFO; to a host
  tier), pinned while requests read it, safe from many threads
  (:mod:`rankattn.serving.store`).

Errors are RA2xx in docs/errors.md; the guide is docs/serving.md.
"""

from rankattn.serving import _errors  # noqa: F401  (registers RA2xx)
from rankattn.serving.scoring import (DEFAULT_GROUP_RULE, GQA_MODES, GROUP_RULES, SELECTIONS,
                                     attend, page_bounds, select_pages)
from rankattn.serving.cache import (AppendStatus, PagedKVCache, append, cache_from_history,
                                    empty_cache, release, stack_caches)
from rankattn.serving.eviction import EVICTION_POLICIES
from rankattn.serving.sharded import shard_cache, sharded_cache_from_history
from rankattn.serving.store import HistoryStore, Lease

__all__ = ["AppendStatus", "DEFAULT_GROUP_RULE", "EVICTION_POLICIES", "GQA_MODES", "GROUP_RULES", "HistoryStore",
           "Lease", "PagedKVCache", "SELECTIONS",
           "append", "attend",
           "cache_from_history", "empty_cache", "page_bounds", "release", "select_pages",
           "shard_cache", "sharded_cache_from_history", "stack_caches"]
