"""The paged history KV cache: a pytree of arrays and pure functions that update it.

Layout (one cache per layer):

* ``k_pages [N, Hkv, P, D]`` and ``v_pages [N, Hkv, P, Dv]``: N physical pages of P
  tokens each, shared by all users. Head-major inside a page, so that one
  (page, kv head) is one contiguous P * D block: Quest gathers selected pages
  per kv head, and on XLA:CPU a gather of such blocks measured 2x faster
  than of the token-major layout [N, P, Hkv, D] (whose rows are D long);
* ``k_min``, ``k_max [N, Hkv, D]`` (float32, float64 for float64 caches): per page,
  per kv head, per channel, the min / max over the page's *filled* slots only
  (``+inf`` / ``-inf`` on a page with no token), which is what Quest's bound needs;
* ``page_table [U, max_pages]`` int32: user u's token i lives in slot ``i % P`` of
  page ``page_table[u, i // P]``; ``-1`` marks no page;
* ``lengths [U]`` int32: tokens cached per user (user u owns exactly its first
  ``ceil(lengths[u] / P)`` page-table entries);
* ``free [N]`` bool: pages not owned by any user; allocation takes the free pages
  with the lowest ids;
* ``overflow []`` bool: set (and kept) when an append under jit skipped a user (it did
  not fit, or a value would have overflowed the cache dtype); ``append(...,
  return_status=True)`` says which users.

Every function returns a new cache and never mutates its argument; jit them with
``donate_argnums=0`` to let XLA update the pages in place.

**Stacked caches** (one pytree for L layers): every array above gains a leading
layer axis [L] (``k_pages [L, N, Hkv, P, D]``, ..., ``overflow [L]``). Each layer's
cache is complete and independent, so ``jax.tree.map(lambda x: x[i], cache)`` (what
``jax.lax.scan`` hands its body when it scans over the stack) is an ordinary cache.
Built together (:func:`stack_caches`, 5-D histories in :func:`cache_from_history`,
``empty_cache(num_layers=L)``) and appended to with the same users and counts, the
layers' page tables, lengths and free lists stay equal; keeping a copy per layer costs
L * (U * max_pages + U + N) small ints next to the pages, and is what lets a slice of
every leaf be a cache. The functions take ``layer=i`` (a Python int or a traced int32
scalar, e.g. a ``fori_loop`` index) to use layer i of a stacked cache in place.
"""

from __future__ import annotations

import functools
import inspect
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from rankattn.backends.base import compute_dtype
from rankattn.errors import fail
from rankattn.validate import INT32_MAX, as_array, concrete, int32_array


class AppendStatus(NamedTuple):
    """What one :func:`append` did, per row b of its arguments."""

    appended: jax.Array      # [B] bool: row b's tokens are in the cache (True for counts 0)
    no_room: jax.Array       # [B] bool: skipped, past max_pages * P tokens or out of free pages
    out_of_range: jax.Array  # [B] bool: skipped, a finite value would be +-inf in the cache dtype


class PagedKVCache(NamedTuple):
    """Paged K/V history of many users for one layer, or for L layers stacked (see the module
    docstring). The properties read the trailing axes, so they hold for stacked and sharded
    caches too (per layer, per shard)."""

    k_pages: jax.Array     # [N, Hkv, P, D]
    v_pages: jax.Array     # [N, Hkv, P, Dv]
    k_min: jax.Array       # [N, Hkv, D] float32; +inf where a page has no token
    k_max: jax.Array       # [N, Hkv, D] float32; -inf where a page has no token
    page_table: jax.Array  # [U, max_pages] int32; -1 = no page
    lengths: jax.Array     # [U] int32
    free: jax.Array        # [N] bool
    overflow: jax.Array    # [] bool, sticky

    @property
    def page_size(self) -> int:
        return self.k_pages.shape[-2]

    @property
    def num_pages(self) -> int:
        return self.k_pages.shape[-4]

    @property
    def num_users(self) -> int:
        return self.page_table.shape[-2]

    @property
    def max_pages(self) -> int:
        return self.page_table.shape[-1]

    @property
    def kv_heads(self) -> int:
        return self.k_pages.shape[-3]

    @property
    def head_dim(self) -> int:
        return self.k_pages.shape[-1]

    @property
    def v_head_dim(self) -> int:
        return self.v_pages.shape[-1]

    @property
    def num_layers(self) -> int | None:
        """L of a stacked cache (k_pages [L, N, Hkv, P, D], or [L, nb, nc, ...] sharded); None
        for one layer's cache."""
        return self.k_pages.shape[0] if self.k_pages.ndim in (5, 7) else None


def keyword_options(*old: str):
    """Decorator for a function whose arguments after its positional ones are keyword-only.

    ``old`` names what the extra positional arguments meant in an older spelling
    (``old[0]`` the first one past the positional arguments). A call that passes more
    positional arguments raises RA217 naming the keyword spelling, instead of Python's
    TypeError or a silent misreading. The signature (``inspect.signature``, what
    ``jax.jit(..., static_argnames=)`` reads) is the decorated function's own.
    """
    def wrap(f):
        names = [p.name for p in inspect.signature(f).parameters.values()
                 if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD]

        @functools.wraps(f)
        def call(*args, **kwargs):
            if len(args) > len(names):
                extra = args[len(names):]
                spelled = ", ".join(f"{name}=<{_describe(x)}>" for name, x in zip(old, extra))
                fix = (f"write {f.__name__}({', '.join(names)}, {spelled})"
                       if len(extra) <= len(old) else "pass each option by its name")
                raise fail("RA217", f"{f.__name__} takes {len(names)} positional arguments "
                                    f"({', '.join(names)}) and every option by keyword; got "
                                    f"{len(args)} positional arguments: {fix}.")
            return f(*args, **kwargs)
        return call
    return wrap


def empty_cache(*, num_users: int, num_pages: int, page_size: int, kv_heads: int, head_dim: int,
                v_head_dim: int | None = None, max_pages: int | None = None,
                dtype=jnp.float32, num_layers: int | None = None) -> PagedKVCache:
    """A cache with no tokens: every page free, every length 0.

    Args:
      num_users: U, the number of user slots (rows of the page table).
      num_pages: N, physical pages shared by all users.
      page_size: P, tokens per page (e.g. 16, 32, 64).
      kv_heads, head_dim: Hkv and D of the keys.
      v_head_dim: Dv of the values (default D).
      max_pages: most pages one user may own (default N); user capacity is
        max_pages * P tokens. The page table costs U * max_pages int32.
      dtype: float dtype of k_pages / v_pages (min/max are kept in float32, float64 for
        a float64 cache).
      num_layers: L for a stacked cache (every array gains a leading [L] axis, see
        the module docstring); None (default) for one layer's cache.

    Returns:
      PagedKVCache; pages hold zeros, k_min +inf, k_max -inf, page_table -1.
    """
    v_head_dim = head_dim if v_head_dim is None else v_head_dim
    max_pages = num_pages if max_pages is None else max_pages
    sizes = dict(num_users=num_users, num_pages=num_pages, page_size=page_size,
                 kv_heads=kv_heads, head_dim=head_dim, v_head_dim=v_head_dim, max_pages=max_pages)
    if num_layers is not None:
        sizes["num_layers"] = num_layers
    bad = {n: v for n, v in sizes.items() if not _positive_int(v)}
    if bad:
        raise fail("RA212", "empty_cache needs positive Python ints; got "
                            + ", ".join(f"{n}={v!r}" for n, v in bad.items()) + ".")
    # Page ids, slots and lengths are int32; XLA aborts the process on a shape whose size
    # overflows, so sizes past any memory are refused here.
    # Rows of the pages (a write's padding goes to a page past the last).
    wide = {"(num_pages + 1) * kv_heads * page_size": (num_pages + 1) * kv_heads * page_size,
            "max_pages * page_size": max_pages * page_size, "num_users": num_users}
    wide = {n: v for n, v in wide.items() if v > INT32_MAX}
    elements = (num_layers or 1) * num_pages * kv_heads * page_size * max(head_dim, v_head_dim)
    if wide or elements > 2**48:
        raise fail("RA212", f"empty_cache sizes {sizes} are too large: "
                            + (", ".join(f"{n} = {v}" for n, v in wide.items())
                               + f" must be at most {INT32_MAX} (int32 indices)" if wide else
                               f"the pages would hold {elements} elements")
                            + ". Pass the pages and tokens the cache is to hold.")
    try:
        parsed = jnp.dtype(dtype)
    except TypeError:  # not a dtype at all ('nope')
        parsed = None
    if parsed is None or not jnp.issubdtype(parsed, jnp.floating):
        raise fail("RA213", f"empty_cache dtype={parsed if parsed is not None else repr(dtype)}; "
                            "pass a float dtype such as jnp.float32 or jnp.bfloat16.")
    stat = compute_dtype(dtype)
    lead = () if num_layers is None else (num_layers,)
    return PagedKVCache(
        k_pages=jnp.zeros(lead + (num_pages, kv_heads, page_size, head_dim), dtype),
        v_pages=jnp.zeros(lead + (num_pages, kv_heads, page_size, v_head_dim), dtype),
        k_min=jnp.full(lead + (num_pages, kv_heads, head_dim), jnp.inf, stat),
        k_max=jnp.full(lead + (num_pages, kv_heads, head_dim), -jnp.inf, stat),
        page_table=jnp.full(lead + (num_users, max_pages), -1, jnp.int32),
        lengths=jnp.zeros(lead + (num_users,), jnp.int32),
        free=jnp.ones(lead + (num_pages,), bool),
        overflow=jnp.zeros(lead, bool),
    )


@keyword_options("page_size")
def cache_from_history(k_hist, v_hist, lengths, *, page_size: int = 16,
                       num_pages: int | None = None, max_pages: int | None = None) -> PagedKVCache:
    """Build a cache from dense per-user histories (user u = row u).

    Args:
      k_hist: [U, S, Hkv, D] keys, or [L, U, S, Hkv, D] for L layers (a stacked
        cache); float dtype (the cache keeps it).
      v_hist: [U, S, Hkv, Dv] values, or [L, U, S, Hkv, Dv] (stored in k_hist's dtype).
      lengths: int [U]; positions >= lengths[u] of row u are not history (every
        layer has the same lengths).
      page_size: P, tokens per page (keyword-only; positionally it is RA217).
      num_pages: physical pages (per layer; default U * max_pages, room for every
        row to grow to max_pages pages).
      max_pages: pages one user may own (default ceil(S / P)).

    Returns:
      PagedKVCache with user u's first lengths[u] tokens; users own pages in
      row order. Same as ``append(empty_cache(...), arange(U), k_hist, v_hist,
      lengths)``, which is how it is computed; with 5-D histories, the same for
      every layer (vmapped over the layer axis), so layer l equals
      ``cache_from_history(k_hist[l], v_hist[l], lengths, ...)`` bit for bit.
    """
    lengths = check_history(k_hist, v_hist, lengths, "cache_from_history")
    for name, value in (("page_size", page_size), ("max_pages", max_pages)):
        if value is not None and not _positive_int(value):
            raise fail("RA212", f"{name}={value!r}; pass a positive Python int such as 16.")
    u, s, hkv, d = k_hist.shape[-4:]
    max_pages = -(-s // page_size) if max_pages is None else max_pages
    num_pages = u * max_pages if num_pages is None else num_pages
    cache = empty_cache(num_users=u, num_pages=num_pages, page_size=page_size, kv_heads=hkv,
                        head_dim=d, v_head_dim=v_hist.shape[-1], max_pages=max_pages,
                        dtype=k_hist.dtype)
    users, counts = jnp.arange(u, dtype=jnp.int32), jnp.asarray(lengths, jnp.int32)
    _check_append_values(cache, users, counts, k_hist, v_hist)  # every layer's values at once
    build = lambda k, v: _append(cache, users, k, v, counts, None)[0]  # noqa: E731
    return build(k_hist, v_hist) if k_hist.ndim == 4 else jax.vmap(build)(k_hist, v_hist)


def stack_caches(caches) -> PagedKVCache:
    """One stacked cache of L layers' caches: array x of the result is
    ``jnp.stack([c.x for c in caches])``, so layer l of it is ``caches[l]``.

    Args:
      caches: a non-empty sequence of PagedKVCache of one layer each, all with the
        same shapes and dtypes (sharded caches [nb, nc, ...] stack to [L, nb, nc, ...]).

    Returns:
      PagedKVCache with a leading [L] axis on every array (see the module docstring).
    """
    if isinstance(caches, PagedKVCache) or not isinstance(caches, (list, tuple)) or not caches \
            or not all(isinstance(c, PagedKVCache) for c in caches):
        got = (type(caches).__name__ if isinstance(caches, PagedKVCache)
               or not isinstance(caches, (list, tuple))
               else f"a {type(caches).__name__} of {[type(c).__name__ for c in caches][:4]}")
        raise fail("RA201", f"stack_caches takes a non-empty list of PagedKVCache, one per layer; "
                            f"got {got}.")
    first = caches[0]
    if first.k_pages.ndim not in (4, 6):
        raise fail("RA201", f"stack_caches takes one layer's caches; caches[0].k_pages has shape "
                            f"{tuple(first.k_pages.shape)} (already stacked). Pass the caches of "
                            "single layers.")
    check_cache(shapes(first, first.k_pages.ndim - 4))
    check_alike(caches, [f"caches[{i}]" for i in range(len(caches))], "stack_caches",
                "every layer's cache")
    return jax.tree.map(lambda *xs: jnp.stack(xs), *caches)


def check_alike(caches, labels: list[str], caller: str, whose: str) -> None:
    """RA201 unless every one of ``caches`` (named ``labels``) has the first's shapes and
    dtypes: stacking them would fail inside jnp.stack, or silently promote a dtype."""
    first = caches[0]
    for label, cache in zip(labels[1:], caches[1:]):
        for name, x, y in zip(PagedKVCache._fields, cache, first):
            if (tuple(x.shape), x.dtype) != (tuple(y.shape), y.dtype):
                raise fail("RA201", f"{caller}: {label}.{name} is {_describe(x)} but "
                                    f"{labels[0]}.{name} is {_describe(y)}; {whose} must have "
                                    "the same shapes and dtypes.")


def append(cache: PagedKVCache, users, k_new, v_new, counts, *, layer=None,
           return_status: bool = False):
    """Append new history tokens: row b adds its first counts[b] tokens to user users[b].

    Args:
      cache: PagedKVCache (stacked: pass ``layer``).
      users: int [B], distinct user ids in [0, U).
      k_new: [B, T, Hkv, D] keys (any float dtype; stored in the cache's dtype).
      v_new: [B, T, Hkv, Dv] values.
      counts: int [B], 0 <= counts[b] <= T.
      layer: with a stacked cache, the layer to append to (an int, or a traced int32
        scalar in [0, L)); the other layers are returned unchanged and the pages are
        scattered into the stack in place. None for one layer's cache.
      return_status: also return an :class:`AppendStatus` (which rows were
        appended, which were skipped and why).

    Returns:
      The new cache (and the status). Pages are allocated from the free pages
      with the lowest ids; key min/max are updated with a scatter-min/max of
      exactly the new tokens, so a partially filled page covers only its filled
      slots.

    Raises RA210 when the arrays are concrete and a user would exceed max_pages * P
    tokens or the free pages run out, and RA214 when a finite new value would
    become +-inf in the cache dtype (e.g. |v| > 65504 in float16); nothing is
    changed. Under jit such users are skipped whole, ``cache.overflow`` is set
    and the status says which. Non-finite values given as such are stored
    as they are: they poison only the rows that read them (rankattn.semantics).
    Ids repeated within one call are an error when concrete and undefined
    under jit. Cost: O(B * T) scatters plus O(B * max_pages + N) bookkeeping.
    To append to every layer of a stack at once, vmap it:
    ``jax.vmap(append, in_axes=(0, None, 0, 0, None))(cache, users, k [L, B, T, Hkv, D],
    v, counts)``.
    """
    view, layer = layer_view(cache, layer, "append")
    check_cache(view)
    users = check_users(users, view, "append")
    b = users.shape[0]
    for name, x, last in (("k_new", k_new, view.head_dim), ("v_new", v_new, view.v_head_dim)):
        if not hasattr(x, "shape") or len(x.shape) != 4:
            raise fail("RA211", f"{name} must be 4-D [B, T, Hkv, D]; got {_describe(x)}.")
        check_float(name, x)
        want = (b, k_new.shape[1], view.kv_heads, last)
        if tuple(x.shape) != want:
            raise fail("RA211", f"{name} has shape {tuple(x.shape)}; with {b} users and a cache of "
                                f"{view.kv_heads} kv heads it must be {want} [B, T, Hkv, D].")
    if not hasattr(counts, "shape"):
        counts = np.asarray(counts)
    if tuple(counts.shape) != (b,) or not jnp.issubdtype(counts.dtype, jnp.integer):
        raise fail("RA211", f"counts must be an int array of shape ({b},), one count per user; got "
                            f"{_describe(counts)}.")
    counts = int32_array("counts", counts, "RA211", "append counts are tokens per user, in "
                         "[0, T]")
    _check_append_values(view, users, counts, k_new, v_new)
    cache, status = _append(cache, users, k_new, v_new, counts, layer)
    return (cache, status) if return_status else cache


def release(cache: PagedKVCache, users, *, layer=None) -> PagedKVCache:
    """Free the pages of ``users`` (int [B]) and set their lengths to 0.

    Freed pages get k_min = +inf, k_max = -inf again, so their next owner's
    bounds cover only its own tokens. Repeated ids are harmless. ``layer``: as
    :func:`append` (to release users in every layer of a stack,
    ``jax.vmap(release, in_axes=(0, None))(cache, users)``).
    """
    view, layer = layer_view(cache, layer, "release")
    check_cache(view)
    users = check_users(users, view, "release")
    return _release(cache, users, layer)


# --- Checks shared with attend. ---------------------------------------------------------------


def _positive_int(v) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, bool) and v >= 1


def _describe(x) -> str:
    if hasattr(x, "shape") and hasattr(x, "dtype"):
        return f"{x.dtype} array of shape {tuple(x.shape)}"
    return type(x).__name__


def check_cache(cache) -> None:
    """Raise RA201 unless ``cache`` is a consistent PagedKVCache of one layer."""
    if not isinstance(cache, PagedKVCache):
        raise fail("RA201", f"cache must be a rankattn.serving.PagedKVCache; got "
                            f"{type(cache).__name__}. Build one with cache_from_history or "
                            "empty_cache.")
    if len(cache.k_pages.shape) != 4:
        raise fail("RA201", f"cache.k_pages has shape {tuple(cache.k_pages.shape)}; one layer's "
                            "cache holds k_pages [N, Hkv, P, D]. A sharded cache [nb, nc, ...] "
                            "needs attend's sharding= (select_pages and page_bounds score one "
                            "shard's cache: jax.tree.map(lambda x: x[i, j], cache) takes batch "
                            "shard i, context shard j), a stacked one [L, ...] layer=.")
    n, h, p, d = cache.k_pages.shape
    want = {"v_pages": (n, h, p, cache.v_head_dim), "k_min": (n, h, d), "k_max": (n, h, d),
            "page_table": (cache.num_users, cache.max_pages), "lengths": (cache.num_users,),
            "free": (n,), "overflow": ()}
    for name, shape in want.items():
        got = tuple(getattr(cache, name).shape)
        if got != shape:
            raise fail("RA201", f"cache.{name} has shape {got}, but k_pages {tuple(cache.k_pages.shape)} "
                                f"implies {shape}. Use the cache returned by append / release.")
    # Indices and flags of another dtype fail deep in an indexing op, or index wrongly.
    for name, integer in (("page_table", True), ("lengths", True), ("free", False),
                          ("overflow", False)):
        dtype = getattr(cache, name).dtype
        if jnp.issubdtype(dtype, jnp.integer) if integer else dtype == jnp.bool_:
            continue
        raise fail("RA201", f"cache.{name} has dtype {dtype}; a PagedKVCache holds it as "
                            f"{'int32' if integer else 'bool'}. Use the cache returned by "
                            "append / release.")


def check_history(k_hist, v_hist, lengths, where: str):
    """lengths (an int array [U]) after checking histories [U, S, Hkv, D] / [U, S, Hkv, Dv], or
    [L, U, S, Hkv, D] / [L, U, S, Hkv, Dv] for L layers (RA212, RA213)."""
    for name, x in (("k_hist", k_hist), ("v_hist", v_hist)):
        if not hasattr(x, "shape") or len(x.shape) not in (4, 5) or 0 in x.shape:
            raise fail("RA212", f"{where}: {name} must be a non-empty 4-D array [U, S, Hkv, D] "
                                f"(or 5-D [L, U, S, Hkv, D] for L layers); got {_describe(x)}.")
        check_float(name, x)
    if len(k_hist.shape) != len(v_hist.shape) or k_hist.shape[:-1] != v_hist.shape[:-1]:
        raise fail("RA212", f"{where}: k_hist is {tuple(k_hist.shape)} and v_hist is "
                            f"{tuple(v_hist.shape)}; they must agree on every axis but the last "
                            "(layers, users, length, kv heads).")
    u, s = k_hist.shape[-4:-2]
    lengths = as_array(f"{where}: lengths", lengths, "RA212", f"pass an int array of shape ({u},).")
    if tuple(lengths.shape) != (u,) or not jnp.issubdtype(lengths.dtype, jnp.integer):
        raise fail("RA212", f"{where}: lengths must be an int array of shape ({u},), one per "
                            f"history row; got {_describe(lengths)}.")
    values = concrete(lengths)
    if values is not None and ((values < 0) | (values > s)).any():
        raise fail("RA212", f"{where}: lengths {values.tolist()[:8]} must lie in [0, S={s}].")
    return lengths


def shapes(cache: PagedKVCache, lead: int) -> PagedKVCache:
    """``cache`` as shapes and dtypes, without its first ``lead`` axes: what checks read of one
    shard or one layer without slicing its pages."""
    return PagedKVCache(*[jax.ShapeDtypeStruct(x.shape[lead:], x.dtype) for x in cache])


def layer_view(cache, layer, where: str, *, lead: int = 0):
    """(one layer of ``cache`` for the checks, ``layer`` as an int32 scalar or None).

    ``cache`` is one layer's cache (``layer`` must be None) or a stacked one (``layer``
    required: a Python int or an integer scalar array, checked against [0, L) when
    concrete); ``lead`` counts the sharded axes [nb, nc] that follow the layer axis.
    The view holds the pages as shapes only and the small arrays (page table, lengths,
    free list) of that layer. RA218 for a stacked cache without ``layer`` or a ``layer``
    without one.
    """
    if not isinstance(cache, PagedKVCache) or not hasattr(cache.k_pages, "shape"):
        return cache, None  # check_cache names the problem
    shape = tuple(cache.k_pages.shape)
    stacked = len(shape) == 5 + lead
    layout = "[L, nb, nc, N, Hkv, P, D]" if lead else "[L, N, Hkv, P, D]"
    if layer is None:
        if stacked:
            raise fail("RA218", f"{where}: cache is a stack of {shape[0]} layers' caches "
                                f"(k_pages {shape}) but no layer= was given. Pass layer=i (an int, "
                                "or a traced int32 scalar such as a fori_loop index), or scan over "
                                "the stack: jax.lax.scan hands its body one layer's cache.")
        return cache, None
    if lead == 0 and len(shape) == 7:
        fix = ("pass sharding= with it" if where == "attend" else
               "pass one shard's stack, jax.tree.map(lambda x: x[:, i, j], cache) (batch shard "
               "i, context shard j), with layer=")
        raise fail("RA218", f"{where}: cache has k_pages {shape}, a stack of sharded caches "
                            f"[L, nb, nc, N, Hkv, P, D]: {fix}.")
    if not stacked:
        raise fail("RA218", f"{where}: layer={layer!r} was given but cache has no layer axis "
                            f"(k_pages {shape}; a stack of layers has k_pages {layout}). Drop "
                            "layer=, or build a stack with stack_caches, cache_from_history of "
                            "[L, U, S, Hkv, D] histories or empty_cache(..., num_layers=L).")
    count = shape[0]
    if isinstance(layer, bool) or not (
            isinstance(layer, (int, np.integer))
            or (isinstance(layer, (np.ndarray, jax.Array)) and layer.ndim == 0
                and jnp.issubdtype(layer.dtype, jnp.integer))):
        raise fail("RA218", f"{where}: layer={layer!r} ({_describe(layer)}) must be an int index "
                            f"into the stack's {count} layers: a Python int or an integer scalar "
                            "array (traced under jit, scan or fori_loop is fine).")
    value = concrete(layer)
    if value is not None and not 0 <= int(value) < count:
        raise fail("RA218", f"{where}: layer={int(value)} is outside the stack's {count} layers; "
                            f"pass 0 <= layer < {count}.")
    layer = jnp.asarray(layer, jnp.int32)
    small = {"page_table", "lengths", "free", "overflow"}
    view = shapes(cache, 1)._replace(**{name: getattr(cache, name)[layer] for name in small})
    return view, layer


def select_layer(cache: PagedKVCache, layer) -> PagedKVCache:
    """Layer ``layer`` of a stacked cache (``cache`` itself for layer None): every array
    sliced, what an update of that layer reads. Scoring reads through :func:`read_layer`."""
    return cache if layer is None else jax.tree.map(lambda x: x[layer], cache)


def read_layer(cache: PagedKVCache, layer) -> PagedKVCache:
    """Layer ``layer`` of a stacked cache as attention reads it (``cache`` itself for layer
    None): the layer's page table and lengths, with the stack's pages and key stats viewed as
    one layer's [L * N, ...] (a reshape, no copy) and the table offset into them.

    A slice of the layer's pages (:func:`select_layer`) is copied by XLA before the cpu
    kernel's custom call reads it: every layer's pages on every call, whatever the batch
    (6.8 ms per call for 4096 pages of the reference ranker's tiny preset, 52 ms for 16384;
    0.7 ms read this way, the same results). Scanning over a stack hands the body such slices
    too: with the cpu kernel, loop over ``layer=`` instead.
    """
    if layer is None:
        return cache
    num_layers, n = cache.k_pages.shape[:2]
    flat = lambda x: x.reshape(num_layers * n, *x.shape[2:])  # noqa: E731
    table = cache.page_table[layer]
    return cache._replace(k_pages=flat(cache.k_pages), v_pages=flat(cache.v_pages),
                          k_min=flat(cache.k_min), k_max=flat(cache.k_max),
                          page_table=jnp.where(table >= 0, table + layer * n, -1),
                          lengths=cache.lengths[layer], free=flat(cache.free),
                          overflow=cache.overflow[layer])


def check_users(users, cache: PagedKVCache, where: str):
    """users as int32 [B]; RA206 if malformed or (when concrete) out of range."""
    if not hasattr(users, "shape"):
        users = np.asarray(users)
    if users.ndim != 1 or users.shape[0] == 0 or not jnp.issubdtype(users.dtype, jnp.integer):
        raise fail("RA206", f"{where}: users must be a non-empty int array [B]; got "
                            f"{_describe(users)}.")
    values = concrete(users)
    if values is not None:
        bad = values[(values < 0) | (values >= cache.num_users)]
        if bad.size:
            raise fail("RA206", f"{where}: users holds {bad[:5].tolist()}, outside [0, "
                                f"{cache.num_users}) (the cache has {cache.num_users} users).")
    return jnp.asarray(users, jnp.int32)


def check_float(name: str, x) -> None:
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise fail("RA213", f"{name} has dtype {x.dtype}; it must be a float dtype. Cast with "
                            f"{name}.astype(jnp.float32).")


def _check_append_values(cache: PagedKVCache, users, counts, k_new, v_new) -> None:
    """The checks that need values; skipped under jit (the overflow flag and the status cover
    capacity and range there). k_new / v_new are [..., B, T, Hkv, D]: leading layer axes are
    checked at once."""
    u, c = concrete(users), concrete(counts)
    t = k_new.shape[-3]
    if u is None or c is None:
        return
    if len(set(u.tolist())) != len(u):
        raise fail("RA211", f"users {u.tolist()} repeats an id; give each user one row per call "
                            "(concatenate its tokens along T).")
    if ((c < 0) | (c > t)).any():
        raise fail("RA211", f"counts {c.tolist()} must lie in [0, T={t}].")
    check_values_fit(cache.k_pages.dtype, (("k_new", k_new), ("v_new", v_new)), u, c)
    lengths, free = concrete(cache.lengths), concrete(cache.free)
    if lengths is None or free is None:
        return
    p = cache.page_size
    old = lengths[u]
    over = old + c > cache.max_pages * p
    if over.any():
        i = int(np.argmax(over))
        raise fail("RA210", f"user {u[i]} holds {old[i]} tokens and appends {c[i]}, over its "
                            f"capacity max_pages * P = {cache.max_pages} * {p} = "
                            f"{cache.max_pages * p}. Release it or build the cache with a larger "
                            "max_pages.")
    need = int((-(-(old + c) // p) - (-(-old // p))).sum())
    if need > free.sum():
        raise fail("RA210", f"this append needs {need} new pages but only {int(free.sum())} of "
                            f"{cache.num_pages} are free. Release users or build the cache with "
                            "more num_pages.")


# --- Jitted bodies. ----------------------------------------------------------------------------
#
# With a stacked cache and a layer index, reads slice that layer (fused into the gathers) and
# writes scatter into the stack at [layer, ...], so XLA updates the layer in place instead of
# copying it out and back.


def check_values_fit(dtype, named_values, users, counts) -> None:
    """RA214 where row i's first counts[i] tokens of a (name, x [..., B, T, Hkv, D]) of
    ``named_values`` hold a finite value that ``dtype`` stores as +-inf (attention over it
    would be NaN); ``users`` names the rows (ints [B]). A device program and a read of its
    [B] flags."""
    for name, x in named_values:
        lossy = concrete(_lossy(x, dtype, jnp.asarray(counts)))
        if lossy is not None and lossy.any():
            i = int(np.argmax(lossy))
            big = float(np.abs(np.asarray(x[..., i, :counts[i], :, :], np.float64)).max())
            raise fail("RA214", f"{name} row {i} (user {users[i]}) holds {big:.6g}, which the "
                                f"cache's {jnp.dtype(dtype).name} stores as inf (largest finite "
                                f"{float(jnp.finfo(dtype).max):.6g}). Scale or clip the values, "
                                "or build the cache with dtype=jnp.float32.")


def _lossy(x, dtype, counts):
    """bool [B]: whether row b's first counts[b] tokens (x [..., B, T, Hkv, D], any leading
    axes) hold a finite value that ``dtype`` stores as +-inf."""
    x = jnp.asarray(x)
    b, t = x.shape[-4:-2]
    lost = jnp.isfinite(x) & ~jnp.isfinite(x.astype(dtype))
    lost = lost.reshape(-1, b, t, x.shape[-2] * x.shape[-1]).any((0, 3))
    return (lost & (jnp.arange(t)[None, :] < counts[:, None])).any(-1)


@jax.jit
def _append(cache: PagedKVCache, users, k_new, v_new, counts, layer):
    at = () if layer is None else (layer,)
    one = select_layer(cache, layer)
    n, p = one.num_pages, one.page_size
    b, t = k_new.shape[:2]
    counts = jnp.clip(counts, 0, t)
    old = one.lengths[users]
    pages_old = -(-old // p)
    need = -(-(old + counts) // p) - pages_old

    # Decide who is appended before touching anything: values the cache dtype can hold,
    # per-user capacity, then the free pages in row order (a skipped user frees nothing
    # for later rows, which keeps the rule simple and order-stable).
    out_of_range = (_lossy(k_new, one.k_pages.dtype, counts)
                    | _lossy(v_new, one.v_pages.dtype, counts))
    fits = (old + counts <= one.max_pages * p) & ~out_of_range
    need = jnp.where(fits, need, 0)
    start = jnp.cumsum(need) - need
    fits &= start + need <= one.free.sum()
    counts = jnp.where(fits, counts, 0)
    need = jnp.where(fits, need, 0)

    # New page-table entries j in [pages_old, pages_old + need) take consecutive
    # free pages (lowest ids first) starting at the row's offset `start`.
    free_ids = jnp.nonzero(one.free, size=n, fill_value=n)[0].astype(jnp.int32)  # int64 under x64
    j = jnp.arange(one.max_pages)[None, :]
    is_new = (j >= pages_old[:, None]) & (j < (pages_old + need)[:, None])
    take = jnp.clip(start[:, None] + j - pages_old[:, None], 0, n - 1)
    rows = jnp.where(is_new, free_ids[take], one.page_table[users])

    # Token (b, i) goes to slot (old + i) % P of page rows[b, (old + i) // P]; its
    # head h to row (page * Hkv + h) * P + slot of the pages viewed as [N*Hkv*P, D].
    hkv = one.kv_heads
    pos = old[:, None] + jnp.arange(t)[None, :]
    valid = jnp.arange(t)[None, :] < counts[:, None]
    page = jnp.take_along_axis(rows, jnp.clip(pos // p, 0, one.max_pages - 1), axis=1)
    page = jnp.where(valid, page, n)                        # n = dropped by mode="drop"
    flat = (page[..., None] * hkv + jnp.arange(hkv)) * p + (pos % p)[..., None]
    flat = flat.reshape(-1)
    page = page.reshape(-1)
    k_flat = k_new.reshape(b * t, hkv, -1)
    v_flat = v_new.reshape(b * t, hkv, -1)

    def write(pages, new):
        rows_view = pages.reshape(*pages.shape[:len(at)], -1, pages.shape[-1])
        new = new.reshape(-1, new.shape[-1]).astype(pages.dtype)
        return rows_view.at[(*at, flat)].set(new, mode="drop").reshape(pages.shape)

    # Min/max see the values as stored (after the cast to the cache dtype), so the
    # bound holds for exactly the keys attend will read.
    k_stored = k_flat.astype(one.k_pages.dtype).astype(one.k_min.dtype)
    status = AppendStatus(appended=fits, no_room=~fits & ~out_of_range, out_of_range=out_of_range)
    return PagedKVCache(
        k_pages=write(cache.k_pages, k_flat),
        v_pages=write(cache.v_pages, v_flat),
        k_min=cache.k_min.at[(*at, page)].min(k_stored, mode="drop"),
        k_max=cache.k_max.at[(*at, page)].max(k_stored, mode="drop"),
        page_table=cache.page_table.at[(*at, users)].set(rows),
        lengths=cache.lengths.at[(*at, users)].set(old + counts),
        free=cache.free.at[(*at, jnp.where(is_new, rows, n))].set(False, mode="drop"),
        overflow=cache.overflow.at[at].set(one.overflow | ~fits.all()),
    ), status


@jax.jit
def _release(cache: PagedKVCache, users, layer) -> PagedKVCache:
    at = () if layer is None else (layer,)
    one = select_layer(cache, layer)
    n = one.num_pages
    rows = one.page_table[users]
    pages = jnp.where(rows >= 0, rows, n).reshape(-1)
    return cache._replace(
        k_min=cache.k_min.at[(*at, pages)].set(jnp.inf, mode="drop"),
        k_max=cache.k_max.at[(*at, pages)].set(-jnp.inf, mode="drop"),
        page_table=cache.page_table.at[(*at, users)].set(-1),
        lengths=cache.lengths.at[(*at, users)].set(0),
        free=cache.free.at[(*at, pages)].set(True, mode="drop"),
    )
