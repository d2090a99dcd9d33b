"""Serving: history K/V cached per layer once, candidates scored against the caches.

``cached_logits`` is what a ranking service runs per request: the history-only
forward pass fills one stacked ``rankattn.serving`` cache, a layer axis in front
(done once per user and history), then the candidate tokens alone go through the
layers one after another, layer ``l`` attending to its layer of the stacked cache
(``attend(..., layer=l)``) and to its own key. With a ``budget`` every
layer keeps only the history pages Quest's bound ranks highest.

``store_logits`` does the same through a ``rankattn.serving.HistoryStore`` that
keeps histories across requests: only the sessions whose history the store does
not hold run the history pass. The store's key is the user, a digest of what
shapes the history's K/V (``history_version``: the request context, which the user
token embeds, and the history's items, authors and actions) and its length.
"""

from __future__ import annotations

import dataclasses
import hashlib

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from rankattn import serving
from rankattn.serving.store_device import padded

from examples.ranker import evaluate
from examples.ranker.config import ACTIONS, MAIN_ACTION
from examples.ranker.packing import CANDIDATE, Batch, pack
from examples.ranker.world import Sessions, auc

PAGE_SIZE = 16


def history_only(sessions: Sessions) -> Sessions:
    """The same sessions without candidates (what the history forward pass sees)."""
    empty = lambda a: a[:, :0]  # noqa: E731
    return dataclasses.replace(sessions, cand_item=empty(sessions.cand_item),
                               cand_author=empty(sessions.cand_author),
                               labels=empty(sessions.labels), probs=empty(sessions.probs))


def candidate_batch(sessions: Sessions, anchor: int) -> Batch:
    """The candidates of every session as a [N, C] batch of candidate tokens at the anchor."""
    shape = sessions.cand_item.shape
    zeros = np.zeros(shape, np.int32)
    return Batch(kind=np.full(shape, CANDIDATE, np.int32), segment_ids=np.full(shape, -1, np.int32),
                 positions=np.full(shape, anchor, np.int32), user=zeros, context=zeros,
                 item=sessions.cand_item.astype(np.int32), author=sessions.cand_author.astype(np.int32),
                 actions=np.zeros(shape + sessions.labels.shape[-1:], np.float32),
                 labels=sessions.labels, session=zeros, candidate=zeros)


@jax.jit
def _caches(graphdef, params, batch: Batch, lengths):
    kv = nnx.merge(graphdef, params).history_kv(batch)
    k, v = (jnp.stack(x) for x in zip(*kv))                 # [layers, U, S, Hkv, D]
    return serving.cache_from_history(k, v, lengths, page_size=PAGE_SIZE)


def build_caches(graphdef, params, sessions: Sessions, anchor: int):
    """One stacked serving cache (layer l of every array is layer l's cache); cache user u is
    session u's [user token, history]."""
    rows = 1 + sessions.history_item.shape[1]
    batch, _ = pack(history_only(sessions), rows, anchor, one_per_row=True)
    return _caches(graphdef, params, batch, jnp.asarray(1 + sessions.history_len, jnp.int32))


def _score(graphdef, params, candidates: Batch, caches, users, budget, gqa):
    return nnx.merge(graphdef, params).score_cached(candidates, caches, users, budget, gqa)


score = jax.jit(_score, static_argnames=("budget", "gqa"))


def cached_logits(graphdef, params, sessions: Sessions, anchor: int, budget: int | None = None,
                  gqa: str = "group", caches=None):
    """Logits [N, C, A] of every session's candidates, scored against cached histories."""
    caches = build_caches(graphdef, params, sessions, anchor) if caches is None else caches
    users = jnp.arange(len(sessions))
    return score(graphdef, params, candidate_batch(sessions, anchor), caches, users, budget, gqa)


# --- Through a history store. ---------------------------------------------------------------


def history_version(sessions: Sessions, i: int) -> int:
    """The store's version of session i's history: a 63-bit digest of the request context and
    the history's items, authors and actions, everything its K/V depend on. A changed history
    (or context) gets another version, so it is never served from a stale entry, whatever
    version a client claims."""
    n = int(sessions.history_len[i])
    return history_digest(sessions.context[i], sessions.history_item[i, :n],
                          sessions.history_author[i, :n], sessions.history_actions[i, :n])


def history_digest(context, items, authors, actions, hint: int | None = None) -> int:
    """:func:`history_version` of one history given as arrays. ``hint`` (a client's own
    version, if any) is hashed in too: a new hint forces a recomputation, an old hint with a
    changed history cannot prevent one."""
    digest = hashlib.blake2b(digest_size=8)
    for part in (context, items, authors, actions) + (() if hint is None else (hint,)):
        digest.update(np.ascontiguousarray(part, np.int64).tobytes())
    return int.from_bytes(digest.digest(), "little") >> 1


def make_store(model, max_history: int, *, users: int, device_pages: int | None = None,
               host_pages: int = 0, max_batch: int = 8,
               policy: str = "lru") -> serving.HistoryStore:
    """A history store for ``model`` (a ModelConfig) holding ``users`` histories of up to
    ``max_history`` events (+ the user token); ``device_pages`` defaults to room for all;
    ``policy``: its eviction policy (serving.EVICTION_POLICIES)."""
    per_user = -(-(1 + max_history) // PAGE_SIZE)
    return serving.HistoryStore(
        num_layers=model.layers, kv_heads=model.kv_heads, head_dim=model.head_dim,
        page_size=PAGE_SIZE, device_pages=device_pages or users * per_user, max_users=users,
        max_pages_per_user=per_user, host_pages=host_pages, max_batch=max_batch, policy=policy)


@jax.jit
def _history_kv(graphdef, params, batch: Batch):
    k, v = zip(*nnx.merge(graphdef, params).history_kv(batch))
    return jnp.stack(k), jnp.stack(v)                     # [layers, B, S, Hkv, D]


def fill_misses(store: serving.HistoryStore, lease: serving.Lease, graphdef, params,
                sessions: Sessions, anchor: int) -> int:
    """Run the history pass on the lease's rows that miss (rows = sessions) and write their
    K/V; the batch is padded to a power of two (repeating a row, which write reads once).
    Returns the rows it computed, once their K/V are computed: the write is dispatched after
    the pass has finished, so that it never holds other threads' reads of the cache (their
    scoring) behind this pass."""
    todo = np.flatnonzero(lease.missing)
    if todo.size:
        rows = padded(todo, 1 << int(todo.size - 1).bit_length(), 0, todo[-1])
        batch, _ = pack(history_only(sessions.take(rows)), 1 + sessions.history_item.shape[1],
                        anchor, one_per_row=True)
        k, v = jax.block_until_ready(_history_kv(graphdef, params, batch))
        store.write(lease, k, v, rows=rows)
    return int(todo.size)


def store_logits(store: serving.HistoryStore, graphdef, params, sessions: Sessions,
                 anchor: int, budget: int | None = None, gqa: str = "group"):
    """(logits [N, C, A], the rows' cache sources): every session's candidates scored against
    its history as the store holds it, after the history pass of the sessions it misses."""
    versions = [history_version(sessions, i) for i in range(len(sessions))]
    with store.acquire(sessions.user, versions, 1 + sessions.history_len) as lease:
        fill_misses(store, lease, graphdef, params, sessions, anchor)
        return score_rows(store, graphdef, params, sessions, lease.slots, anchor, budget,
                          gqa), list(lease.source)


def score_rows(store: serving.HistoryStore, graphdef, params, sessions: Sessions, slots,
               anchor: int, budget: int | None = None, gqa: str = "group") -> np.ndarray:
    """Logits [N, C, A] of every session's candidates against the history in cache slot
    ``slots[i]`` (int [N]; the slots of a lease the caller holds), in one jitted call."""
    with store.reading() as cache:
        logits = score(graphdef, params, candidate_batch(sessions, anchor), cache,
                       jnp.asarray(slots, jnp.int32), budget, gqa)
        return np.asarray(logits)


def pages_kept(sessions: Sessions, budget: int) -> float:
    """Mean fraction of a history's pages that a query keeps under ``budget`` tokens."""
    pages = np.ceil((1 + sessions.history_len) / PAGE_SIZE)
    return float(np.minimum(1.0, (budget // PAGE_SIZE) / pages).mean())


def report(graphdef, params, world, preset, sessions: int = 256) -> dict:
    """Serving on long histories: cached = full, isolation, and Quest's AUC per budget.

    Returns ``cached_vs_full_max_abs_diff`` (largest |cached - full| logit),
    ``isolation_bit_identical`` (candidate 0's logits unchanged, bit for bit,
    when every other candidate of its request is replaced) and ``quest``: per
    token budget, the fraction of history pages a query keeps and the AUC of
    the main action (``budget=None``: exact).
    """
    rng = np.random.default_rng([preset.train.seed, 1 << 31])
    long = world.sample(rng, sessions, long=True)
    anchor = preset.model.max_position
    caches = build_caches(graphdef, params, long, anchor)
    exact = np.asarray(cached_logits(graphdef, params, long, anchor, caches=caches))
    t = preset.train
    full = evaluate.full_logits(graphdef, params, long, t.row_tokens, t.rows, anchor)
    others = long.cand_item.copy()
    others[:, 1:] = rng.integers(1, world.config.items + 1, size=others[:, 1:].shape)
    swapped = dataclasses.replace(long, cand_item=others, cand_author=world.item_author[others])
    again = np.asarray(cached_logits(graphdef, params, swapped, anchor, caches=caches))
    a = ACTIONS.index(MAIN_ACTION)
    labels = long.labels[..., a]
    quest = [dict(budget=None, pages_kept=1.0, auc=auc(labels, exact[..., a]))]
    max_pages = int(np.ceil((1 + long.history_item.shape[1]) / PAGE_SIZE))
    for pages in (3, 6, 12, 24, 48):  # 3: the least a budget can be (sink, recent, one scored)
        if pages < max_pages:
            budget = pages * PAGE_SIZE
            logits = np.asarray(cached_logits(graphdef, params, long, anchor, budget, caches=caches))
            quest.append(dict(budget=budget, pages_kept=pages_kept(long, budget),
                              auc=auc(labels, logits[..., a])))
    return dict(sessions=sessions, mean_history=float(long.history_len.mean()),
                cached_vs_full_max_abs_diff=float(np.abs(exact - full).max()),
                isolation_bit_identical=bool((exact[:, 0] == again[:, 0]).all()),
                oracle_auc=auc(labels, long.probs[..., a]), quest=quest)
