"""The history store's device side: jitted updates of one stacked :class:`PagedKVCache`.

:class:`rankattn.serving.HistoryStore` decides which user occupies which cache slot and
which pages (the policy, on the host); the programs here only move data, on pages and slots
they are given:

* :func:`write`: tokens into given pages of given slots (a history pass's K/V), with the
  pages' key min / max, the slots' page tables and lengths;
* :func:`drop`: slots emptied and pages freed (min / max reset, so a page's next owner's
  Quest bounds cover only its own tokens);
* :func:`gather`: the pages of one entry, for a spill to host memory;
* :func:`restore`: one entry's pages, stats, page table and length back from host memory.

Every update donates the cache it is given, so XLA updates the pages in place, and takes
arrays from a small fixed set of shapes (:class:`Buckets`): rows and pages padded to powers
of two, padding aimed at an out-of-range index that the scatters drop. A stream of requests
therefore compiles a bounded number of programs (:meth:`Buckets.programs`).

The layout is cache.py's, with the leading layer axis: ``k_pages [L, N, Hkv, P, D]``,
``page_table [L, U, M]`` and so on; every layer's table, lengths and free list stay equal.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from rankattn.serving.cache import PagedKVCache


def _power_buckets(limit: int) -> tuple[int, ...]:
    """1, 2, 4, ... up to ``limit``, and ``limit`` itself."""
    sizes = [1 << i for i in range(max(1, limit).bit_length()) if 1 << i < limit]
    return tuple(sizes + [limit])


@dataclasses.dataclass(frozen=True)
class Buckets:
    """The shapes the device programs are compiled for.

    rows: rows per :func:`write` / :func:`drop` call (larger calls are split);
    pages: pages per :func:`gather` / :func:`restore` call and, times the page size, tokens
    per row of a :func:`write`.
    """

    rows: tuple[int, ...]
    pages: tuple[int, ...]

    @classmethod
    def of(cls, max_rows: int, max_pages: int) -> "Buckets":
        return cls(_power_buckets(max_rows), _power_buckets(max_pages))

    @staticmethod
    def fit(n: int, sizes: tuple[int, ...]) -> int:
        """The smallest bucket of ``sizes`` holding ``n`` (``n`` <= the largest)."""
        return next(s for s in sizes if s >= n)

    def programs(self) -> int:
        """How many programs a store compiles at most: write (rows x pages), drop (rows),
        gather and restore (pages each)."""
        return len(self.rows) * len(self.pages) + len(self.rows) + 2 * len(self.pages)


def _pages_view(pages):
    """[L, N, Hkv, P, D] -> [L, N * Hkv * P, D]: row (page * Hkv + h) * P + slot."""
    return pages.reshape(pages.shape[0], -1, pages.shape[-1])


@functools.partial(jax.jit, donate_argnums=0)
def write(cache: PagedKVCache, slots, pages, starts, counts, k, v) -> PagedKVCache:
    """Row b's first counts[b] tokens become tokens starts[b].. of slot slots[b], whose pages
    (in order) are pages[b] (int32 [B, M], -1 past its last); the slot's page table becomes
    those pages and its length starts[b] + counts[b].

    slots int32 [B] (padding rows: U, dropped); starts, counts int32 [B]; k [L, B, T, Hkv, D],
    v [L, B, T, Hkv, Dv] in any float dtype (stored in the cache's). The page holding token
    starts[b] - 1 keeps its tokens before starts[b] (its min / max grow by a scatter-min / max
    of the new keys as stored); the later pages start afresh, their min / max reset first
    (a drop that failed left them those of the pages' last holder).
    """
    num_layers, n, hkv, p, _ = cache.k_pages.shape
    b, t = k.shape[1:3]
    pos = starts[:, None] + jnp.arange(t)[None, :]                       # [B, T]
    valid = jnp.arange(t)[None, :] < counts[:, None]
    page = jnp.take_along_axis(pages, jnp.clip(pos // p, 0, pages.shape[1] - 1), axis=1)
    page = jnp.where(valid & (page >= 0), page, n)                       # n: dropped
    flat = ((page[..., None] * hkv + jnp.arange(hkv)) * p + (pos % p)[..., None]).reshape(-1)

    def scatter(into, new):
        new = new.reshape(num_layers, -1, new.shape[-1]).astype(into.dtype)
        return _pages_view(into).at[:, flat].set(new, mode="drop").reshape(into.shape)

    stored = k.astype(cache.k_pages.dtype).astype(cache.k_min.dtype)
    stored = stored.reshape(num_layers, b * t, hkv, -1)
    index = jnp.arange(pages.shape[1])[None, :]
    owned = index < -(-(starts + counts) // p)[:, None]
    table = jnp.where(owned, pages, -1)
    fresh = jnp.where(owned & (index >= -(-starts // p)[:, None]) & (pages >= 0), pages, n)
    fresh = fresh.reshape(-1)
    return cache._replace(
        k_pages=scatter(cache.k_pages, k),
        v_pages=scatter(cache.v_pages, v),
        k_min=cache.k_min.at[:, fresh].set(jnp.inf, mode="drop")
                         .at[:, page.reshape(-1)].min(stored, mode="drop"),
        k_max=cache.k_max.at[:, fresh].set(-jnp.inf, mode="drop")
                         .at[:, page.reshape(-1)].max(stored, mode="drop"),
        page_table=cache.page_table.at[:, slots].set(table, mode="drop"),
        lengths=cache.lengths.at[:, slots].set(starts + counts, mode="drop"),
        free=cache.free.at[:, jnp.where(owned, pages, n).reshape(-1)].set(False, mode="drop"))


@functools.partial(jax.jit, donate_argnums=0)
def drop(cache: PagedKVCache, slots, pages) -> PagedKVCache:
    """Slots ``slots`` (int32 [B], U = padding) emptied and pages ``pages`` (int32 [B, M], -1 =
    none) freed: page table -1, length 0, min / max +inf / -inf, free."""
    n = cache.k_pages.shape[1]
    flat = jnp.where(pages >= 0, pages, n).reshape(-1)
    return cache._replace(
        k_min=cache.k_min.at[:, flat].set(jnp.inf, mode="drop"),
        k_max=cache.k_max.at[:, flat].set(-jnp.inf, mode="drop"),
        page_table=cache.page_table.at[:, slots].set(-1, mode="drop"),
        lengths=cache.lengths.at[:, slots].set(0, mode="drop"),
        free=cache.free.at[:, flat].set(True, mode="drop"))


@jax.jit
def gather(cache: PagedKVCache, pages):
    """(k [L, n, Hkv, P, D], v, k_min [L, n, Hkv, D], k_max) of pages ``pages`` (int32 [n];
    padding entries, N, read page N - 1, which the caller drops)."""
    at = jnp.clip(pages, 0, cache.k_pages.shape[1] - 1)
    return cache.k_pages[:, at], cache.v_pages[:, at], cache.k_min[:, at], cache.k_max[:, at]


@functools.partial(jax.jit, donate_argnums=0)
def restore(cache: PagedKVCache, slot, pages, table, length, k, v, k_min, k_max) -> PagedKVCache:
    """One entry back: pages ``pages`` (int32 [n], N = padding) receive k / v / k_min / k_max
    ([L, n, ...], as :func:`gather` gave them) and are taken; slot ``slot`` (int32 scalar; U =
    padding, dropped) gets page table ``table`` (int32 [M]) and length ``length``."""
    n = cache.k_pages.shape[1]
    taken = jnp.where(pages < n, pages, n)
    return cache._replace(
        k_pages=cache.k_pages.at[:, taken].set(k.astype(cache.k_pages.dtype), mode="drop"),
        v_pages=cache.v_pages.at[:, taken].set(v.astype(cache.v_pages.dtype), mode="drop"),
        k_min=cache.k_min.at[:, taken].set(k_min, mode="drop"),
        k_max=cache.k_max.at[:, taken].set(k_max, mode="drop"),
        page_table=cache.page_table.at[:, slot].set(table, mode="drop"),
        lengths=cache.lengths.at[:, slot].set(length, mode="drop"),
        free=cache.free.at[:, taken].set(False, mode="drop"))


def padded(x: np.ndarray, size: int, axis: int, fill) -> np.ndarray:
    """``x`` padded with ``fill`` along ``axis`` to ``size``."""
    extra = size - x.shape[axis]
    if not extra:
        return x
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, extra)
    return np.pad(x, pad, constant_values=fill)


def rows_of(x, index: np.ndarray, tokens: int):
    """Rows ``index`` and tokens [0, ``tokens``) of x [L, B, T, H, D], zero-padded past T: what
    :func:`write` takes from a caller's K/V. numpy stays numpy; a jax array stays on its device
    (one small program per input shape and bucket)."""
    if isinstance(x, jax.Array):
        return _device_rows_of(x, index, tokens)  # index as numpy: no program to move it
    return padded(np.asarray(x)[:, index, :tokens], tokens, 2, 0)


@functools.partial(jax.jit, static_argnums=2)
def _device_rows_of(x, index, tokens: int):
    x = x[:, index, :tokens]
    return jnp.pad(x, [(0, 0), (0, 0), (0, tokens - x.shape[2]), (0, 0), (0, 0)])
