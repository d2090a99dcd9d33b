"""A user-keyed history store over one stacked paged cache: reuse, staleness, eviction, a host tier.

:class:`HistoryStore` owns one stacked :class:`~rankattn.serving.PagedKVCache` (every
layer's K/V) and decides, on the host and under one lock, which user's history occupies
which cache slot and pages, whether a cached history may serve a request, what is evicted
when pages run out, and which evicted histories wait in host memory. The device side moves
data only (:mod:`rankattn.serving.store_device`); attention reads the cache as before
(:func:`rankattn.serving.attend`).

A request's rows go through three calls::

    lease = store.acquire(user_ids, versions, lengths)   # pin: hits, restores, room for misses
    store.write(lease, k, v)                             # the history pass's K/V for the rest
    with store.reading() as cache:                       # a consistent cache to score against
        out = serving.attend(q, cache, lease.slots, self_kv=..., layer=...)
    store.release(lease)                                 # unpin (a Lease is a context manager)

The rules (docs/serving.md, "The history store", says the same with an example):

* Validity. ``history="bidirectional"`` (Phoenix: one new action changes every history
  token above the first layer): an entry serves a row only for the same user, version and
  length; otherwise it is dropped (an invalidation) and the row is a miss.
  ``history="causal"`` (HSTU): the same version and a cached length <= the row's reuse the
  prefix (source "prefix"; ``write`` appends the rest). An equal length is a hit.
* Pinning. ``acquire`` pins its rows' entries until ``release``; a pinned entry is never
  evicted, moved or overwritten. Hits on the device are pinned first, then the other rows
  are placed in row order.
* Eviction, whole unpinned entries in the order of the store's eviction policy (``policy``:
  least recently used first by default; :mod:`rankattn.serving.eviction`), until the row
  fits. With ``host_pages > 0`` an evicted entry's pages (every layer) move to host
  memory; the host tier drops its least recently evicted entries when full. A later acquire
  of the same user, version and length restores them (source "host").
* Rows of one user with the same version and length share one slot (pinned once per row,
  written once); with different ones in one call, RA220.
* A new version of a user whose entry is pinned goes into a fresh slot: the old entry can no
  longer be acquired and is freed (not spilled) at its last release. A causal prefix pinned
  by another lease is never extended: the row is a miss in a fresh slot.
* Written before visible: an acquire that matches an entry another lease has yet to write
  (or restore) waits for it; a release without a write drops the unwritten entries.
* All or nothing: a row that cannot be placed (RA221: longer than a user's capacity; RA222:
  every entry pinned, or the call's rows together larger than the store) fails the whole
  call and changes nothing.
* A failed copy or update (RA224): a spill, restore or device update that raises (an
  allocation failure) drops the entries it was for; a failed acquire unpins its rows and
  returns no lease, a failed write leaves the lease held with those rows no longer shared.

Threads: every method may be called from any thread. Policy runs under one lock, held only
for bookkeeping: never while a device program runs (a first call compiles) or while a
thread waits. Device updates are jitted, donated programs; each takes a turn where the
policy decides it and runs in that order, outside the lock, once the readers inside
``reading()`` have left (so no buffer a reader holds is donated). Copies between host and
device memory (a spill's pages to host, a restore's to the device) run outside the lock.
So ``stats()`` answers at once from any thread, inside ``reading()`` too, and an acquire
that needs no device update (all hits) does not wait for other threads' updates.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import heapq
import threading
import time
from typing import Iterator

import jax
import jax.numpy as jnp
import numpy as np

from rankattn.errors import RankattnError, fail
from rankattn.serving import store_device as device
from rankattn.serving.cache import PagedKVCache, check_values_fit, empty_cache
from rankattn.serving.eviction import EVICTION_POLICIES

HISTORIES = ("bidirectional", "causal")
SOURCES = ("device", "host", "prefix", "miss")
INT64_MIN, INT64_MAX = int(np.iinfo(np.int64).min), int(np.iinfo(np.int64).max)


@dataclasses.dataclass(eq=False)
class _Entry:
    """One user's cached history (one version and length) in one tier."""

    user: int
    version: int
    length: int           # tokens valid now (on the device, or in the snapshot)
    target: int           # tokens once its pending write is done (== length when ready)
    tier: str             # "device" or "host"
    slot: int = -1        # the cache user index, on the device
    pages: list = dataclasses.field(default_factory=list)  # device page ids, in token order
    snapshot: tuple | None = None  # host: (k, v, k_min, k_max) numpy, [L, pages, ...]
    host_size: int = 0    # host pages it holds (reserved when its spill starts)
    pins: int = 0
    ready: bool = False   # False while a write, a restore or a spill's copy is pending
    visible: bool = True  # False once a newer version replaced it (freed at its last release)


class Lease:
    """The rows of one :meth:`HistoryStore.acquire`: where each row's history is in the
    cache, how much of it is there, and where it came from.

    slots: int32 [B], the cache user index of each row (``serving.attend``'s ``users``).
    cached: int32 [B], tokens of the row's history already in the cache and valid.
    source: B strings, "device", "host", "prefix" or "miss".
    missing: int32 [B], ``lengths - cached``: the tokens ``write`` must bring per row.
    """

    def __init__(self, store, users, versions, lengths, entries, sources, cached):
        self._store = store
        self.users, self.versions = users, versions
        self.lengths = lengths
        self.slots = np.array([e.slot for e in entries], np.int32)
        self.cached = np.asarray(cached, np.int32)
        self.source = list(sources)
        self.missing = (self.lengths - self.cached).astype(np.int32)
        self._entries = entries
        self._to_write = {}  # id(entry) -> (its first row, entry): what write brings
        for b, e in enumerate(entries):
            if e.target > e.length:
                self._to_write.setdefault(id(e), (b, e))
        self.written = False
        self.released = False

    def __enter__(self) -> "Lease":
        return self

    def __exit__(self, *exc) -> None:
        if not self.released:
            self._store.release(self)

    def __repr__(self) -> str:
        return (f"<Lease rows={len(self.slots)} sources={self.source} "
                f"{'released' if self.released else 'held'}>")


class HistoryStore:
    """Cached history K/V of many users, in one stacked paged cache. See the module docstring.

    Args (keyword-only):
      num_layers, kv_heads, head_dim, v_head_dim: the cache's L, Hkv, D, Dv (Dv default D).
      page_size: P, tokens per page.
      device_pages: N, pages on the device (per layer).
      max_users: U, cache slots (entries on the device at once).
      max_pages_per_user: M; a history holds at most M * P tokens.
      host_pages: pages (every layer's) the host tier holds; 0: no host tier.
      dtype: the pages' dtype.
      history: "bidirectional" or "causal" (the validity rule).
      max_batch: rows per device update at most (larger calls are split); with
        ``max_pages_per_user``, the buckets of compiled shapes.
      policy: which device entry is evicted first, a name in
        ``rankattn.serving.EVICTION_POLICIES``: "lru" (least recently used) or "s3fifo"
        (S3-FIFO: frequent users stay, one-off users leave first).
    """

    def __init__(self, *, num_layers: int, kv_heads: int, head_dim: int,
                 v_head_dim: int | None = None, page_size: int = 16, device_pages: int,
                 max_users: int, max_pages_per_user: int, host_pages: int = 0,
                 dtype=jnp.float32, history: str = "bidirectional", max_batch: int = 16,
                 policy: str = "lru"):
        sizes = dict(num_layers=num_layers, kv_heads=kv_heads, head_dim=head_dim,
                     page_size=page_size, device_pages=device_pages, max_users=max_users,
                     max_pages_per_user=max_pages_per_user, max_batch=max_batch)
        if v_head_dim is not None:
            sizes["v_head_dim"] = v_head_dim
        bad = {n: v for n, v in sizes.items() if not _positive_int(v)}
        if not _positive_int(host_pages) and host_pages != 0:
            bad["host_pages"] = host_pages
        if bad:
            raise fail("RA219", "HistoryStore needs positive Python ints (host_pages may be 0); "
                                "got " + ", ".join(f"{n}={v!r}" for n, v in bad.items()) + ".")
        if not isinstance(history, str) or history not in HISTORIES:
            raise fail("RA219", f"HistoryStore history={history!r}; pass 'bidirectional' (a "
                                "cached entry serves only the exact history it was computed "
                                "from, as in Phoenix) or 'causal' (a cached prefix stays valid, "
                                "as in HSTU).")
        if not isinstance(policy, str) or policy not in EVICTION_POLICIES:
            raise fail("RA219", f"HistoryStore policy={policy!r}; pass one of "
                                f"{sorted(EVICTION_POLICIES)} (rankattn.serving."
                                "EVICTION_POLICIES): 'lru' evicts the least recently used "
                                "entry first, 's3fifo' keeps frequent users over one-off ones.")
        if max_pages_per_user > device_pages:
            raise fail("RA219", f"HistoryStore max_pages_per_user={max_pages_per_user} exceeds "
                                f"device_pages={device_pages}: one user could never fit. Pass "
                                "max_pages_per_user <= device_pages.")
        self.history = history
        self.page_size, self.max_pages = page_size, max_pages_per_user
        self.num_pages, self.num_users, self.host_capacity = device_pages, max_users, host_pages
        self.buckets = device.Buckets.of(max_batch, max_pages_per_user)
        try:
            self._cache = empty_cache(num_users=max_users, num_pages=device_pages,
                                      page_size=page_size, kv_heads=kv_heads,
                                      head_dim=head_dim, v_head_dim=v_head_dim,
                                      max_pages=max_pages_per_user, dtype=dtype,
                                      num_layers=num_layers)
        except RankattnError as error:  # named in the store's own arguments
            reason = str(error).split("] ", 1)[1].split("\n")[0]
            raise fail("RA219", f"HistoryStore cannot build its cache ({reason}); "
                                "empty_cache's num_users, num_pages and max_pages are this "
                                "store's max_users, device_pages and max_pages_per_user.") from None
        # Policy state, under self._lock.
        self._lock = threading.Condition()
        self._index: dict[int, _Entry] = {}             # user -> its visible entry
        self._device_entries: dict[int, _Entry] = {}   # id -> visible entry on the device
        self._pinned: dict[int, _Entry] = {}   # id -> entry a lease pins, visible or hidden
        self.policy = policy
        self._policy = EVICTION_POLICIES[policy](max_users, device_pages)
        self._host: collections.OrderedDict[int, _Entry] = collections.OrderedDict()  # by spill
        self._free_slots = list(range(max_users))
        self._free_pages = list(range(device_pages))    # heaps: lowest ids first
        self._host_used = 0
        self._counts = collections.Counter()
        # Device updates, under self._device: each takes a ticket where it is decided (under
        # the policy lock when the policy orders it) and runs in ticket order once no reader
        # holds the cache; new readers wait while updates are pending (so a stream of readers
        # cannot starve them). Nobody waits here holding the policy lock.
        self._device = threading.Condition()
        self._issued = 0   # tickets handed out
        self._done = 0     # tickets run (or failed): ticket t runs when _done == t
        self._readers = 0
        self._reading = threading.local()
        self._unrun_updates = threading.local()  # .updates: issued here, not yet dispatched
        self._built = 0    # programs JAX built for this store's calls (see _on_jax_event)
        self._built_lock = threading.Lock()

    # --- Reading. -------------------------------------------------------------------------

    @property
    def cache(self) -> PagedKVCache:
        """The current stacked cache, for single-threaded callers: the next update (acquire,
        write, release) may donate its buffers. Threads read through :meth:`reading`."""
        return self._cache

    @contextlib.contextmanager
    def reading(self) -> Iterator[PagedKVCache]:
        """The current cache, kept valid while the block runs: no update donates its
        buffers before the block ends. Inside it, do not acquire, write, release, clear or
        warm up on the same thread (RA223), nor wait for another thread doing so; stats()
        and a nested reading() are fine."""
        nested = getattr(self._reading, "depth", 0) > 0  # pending updates wait for us anyway
        with self._device:
            while self._issued > self._done and not nested:
                self._device.wait()
            self._readers += 1
            cache = self._cache
        self._reading.depth = getattr(self._reading, "depth", 0) + 1
        try:
            yield cache
        finally:
            self._reading.depth -= 1
            with self._device:
                self._readers -= 1
                self._device.notify_all()

    # --- Acquire. -------------------------------------------------------------------------

    def acquire(self, user_ids, versions, lengths, *, timeout: float | None = None) -> Lease:
        """Pin a batch's histories: B rows of (user, version, length), ints each.

        Returns a :class:`Lease` once every row has a slot: a hit (pinned), a restore from
        the host tier (its pages back in the cache), or room for the tokens ``write`` must
        bring (``lease.missing``). Waits for entries another lease is writing or restoring
        (at most ``timeout`` seconds, then RA222). Raises RA220 for malformed rows, RA221 for
        a history longer than a user's capacity, RA222 when the store cannot make room
        because what it holds is pinned, or at once when the call's rows need more slots or
        pages than the whole store has (split it); a call that raises these changes nothing.
        RA224 when a spill, a restore or a device update failed: the entries it was for are
        dropped, the rows unpinned, and no lease is returned (evictions it made stand).
        """
        self._not_reading("acquire")
        users, versions, lengths = self._check_rows(user_ids, versions, lengths, "acquire")
        keys = list(dict.fromkeys(zip(users.tolist(), versions.tolist(), lengths.tolist())))
        if timeout is not None and not (isinstance(timeout, (int, float, np.integer, np.floating))
                                        and not isinstance(timeout, bool) and timeout >= 0):
            raise fail("RA223", f"acquire: timeout={timeout!r}; pass the seconds to wait for "
                                "an unwritten entry (a number >= 0), or None to wait as long as "
                                "it takes.")
        if timeout is not None and timeout >= 1e9:  # past any wait: as None (and time_t's range)
            timeout = None
        deadline = None if timeout is None else time.monotonic() + timeout
        self._check_fits(keys)
        with self._every_turn_taken():
            return self._acquire(keys, users, versions, lengths, timeout, deadline)

    def _check_fits(self, keys) -> None:
        """RA221 for a history longer than a user's capacity, RA222 for a call whose rows
        together need more slots or pages than the whole store has: neither could be placed
        even in an empty store, so the call raises before it waits for anything."""
        p = self.page_size
        needs = [-(-length // p) for _, _, length in keys]
        for (user, _, length), need in zip(keys, needs):
            if need > self.max_pages:
                raise fail("RA221", f"user {user}'s history of {length} tokens needs {need} "
                                    f"pages of {p}; a user holds at most max_pages_per_user = "
                                    f"{self.max_pages} pages ({self.max_pages * p} tokens). "
                                    "Cut the history to its newest tokens, or build the store "
                                    "with a larger max_pages_per_user.")
        # A lease holds every row's history on the device at once, one slot per user (keys
        # are one per user: RA220). RA222, not RA221: no history is too long, and splitting
        # the call (what a server does on RA222) places it.
        if len(keys) > self.num_users or sum(needs) > self.num_pages:
            raise fail("RA222", f"acquire: this call is larger than the whole store, so it "
                                "can never be placed, not even in an empty store (a retry "
                                f"will not help): user_ids holds {len(keys)} distinct users, "
                                f"one slot each, of max_users = {self.num_users} slots, and "
                                f"their lengths need {sum(needs)} pages of {p} tokens in all, "
                                f"of device_pages = {self.num_pages}. Split the rows into "
                                "calls that fit, or build a larger store.")

    def _acquire(self, keys, users, versions, lengths, timeout, deadline) -> Lease:
        placed, spills, pinned = {}, {}, []  # filled as they happen: what an interrupt undoes
        try:
            with self._lock:
                while True:
                    pending = [self._index[u] for u, v, n in keys if self._awaits_write(u, v, n)]
                    if not pending:
                        break
                    left = None if deadline is None else deadline - time.monotonic()
                    if left is not None and left <= 0:
                        raise fail("RA222", f"acquire waited {timeout} s for user "
                                            f"{pending[0].user}'s entry, which another lease "
                                            "has yet to write or restore; retry later, or "
                                            "release that lease.")
                    self._lock.wait(left)
                steps, evictions = self._plan(keys)
                updates, restores, emptied = self._apply(steps, evictions, placed, spills)
                # An entry other acquires wait for may be gone (replaced, or dropped from the
                # host tier before its spill was copied): they look again.
                self._lock.notify_all()
                rows = [placed[key] for key in zip(users.tolist(), versions.tolist(),
                                                   lengths.tolist())]
                for entry, source, _ in rows:
                    entry.pins += 1
                    pinned.append(entry)
                    self._pinned[id(entry)] = entry
                    self._policy.requested(entry, hit=source in ("device", "prefix"))
                for _, source, _ in rows:
                    self._counts[_COUNTER[source]] += 1
                lease = Lease(self, users, versions, lengths, [r[0] for r in rows],
                              [r[1] for r in rows], [r[2] for r in rows])
            failures = []
            failed = self._dispatch(updates)
            if failed and not failed.reads:  # a spill's gather is reported with its spill
                failures.append(("emptying evicted entries' slots and pages", failed.error))
            failures += self._finish_spills(spills.values())
            failures += self._finish_restores(restores)
        except BaseException:  # an interrupt: no lease goes out, so nothing may stay pinned,
            with self._lock:   # nor what it placed or a spill never copied wait to be ready
                for entry, _, _ in spills.values():
                    if id(entry) in self._host and not entry.ready:
                        self._hide(entry, [])
                # Its updates' turns are skipped as it ends (_every_turn_taken).
                self._let_go(pinned, [entry for entry, _, _ in placed.values()])
            raise
        if failures:
            with self._lock:
                updates = self._unpin(lease)
            self._dispatch(updates)  # its own failure would add nothing to the first one's
            what, error = failures[0]
            raise _failed("acquire", what, error, "the entries it was for were dropped and "
                          "this call's rows unpinned; no lease was returned. Acquire the rows "
                          "again: they come back as misses.") from error
        if emptied:
            with self._lock:
                for entry in emptied:
                    entry.ready = True
                self._lock.notify_all()
        return lease

    def _awaits_write(self, user: int, version: int, length: int) -> bool:
        """Whether the row's entry is one that acquire waits for: placed by another lease,
        and not yet written or restored."""
        entry = self._index.get(user)
        return entry is not None and not entry.ready and self._matches(entry, version, length)

    def _matches(self, entry: _Entry, version: int, length: int) -> bool:
        """Whether ``entry`` (a user's visible entry) is what a row of (version, length)
        reuses: as it is, or (causal) as a prefix."""
        if entry.version != version:
            return False
        if self.history == "causal":
            return entry.target <= length
        return entry.target == length

    def _plan(self, keys):
        """The steps that place ``keys`` (unique (user, version, length), in row order),
        decided on counts alone: RA222 leaves the store as it was (_check_fits has refused
        what could never fit). Returns (steps, the eviction policy's plan, which _apply
        commits).

        Order: device hits (pinned first), then every entry of these users this call replaces
        dropped (stale ones, and causal prefixes another lease pins: invalidations free room
        before anything is placed), then the other rows in row order, each evicting entries
        in the policy's order until it fits. Steps:
        ("hit", key, entry), ("invalidate", None, entry), ("evict", None, entry, spill),
        ("host_evict", None, entry), ("restore", key, entry, pages), ("prefix", key, entry,
        pages), ("miss", key, None, pages), in the order they apply.
        """
        p = self.page_size
        steps, placing, stale, keep = [], [], [], set()
        for key in keys:
            entry = self._index.get(key[0])
            if entry is None or not self._matches(entry, key[1], key[2]):
                placing.append((key, None))
                if entry is not None:
                    stale.append(entry)
                continue
            if entry.tier == "device" and entry.target == key[2]:
                steps.append(("hit", key, entry))
            elif entry.tier == "device" and entry.pins:  # a prefix another lease holds: it
                placing.append((key, None))              # stays with it, out of sight
                stale.append(entry)
                continue
            else:
                placing.append((key, entry))
            keep.add(id(entry))  # reused: never evicted by this call
        total = sum(-(-length // p) for _, _, length in keys)
        free_slots, free_pages, host_used = (len(self._free_slots), len(self._free_pages),
                                             self._host_used)
        gone = keep | set(map(id, stale))  # ids no device eviction may pick
        host_gone = set(gone)               # ids no host eviction may pick
        evictions = self._policy.evictions(
            lambda e: e.pins == 0 and e.ready and id(e) not in gone, stale)
        host = [e for e in self._host.values() if id(e) not in gone]
        # Host pages of entries this call restores: not for the host tier to give up.
        kept_host = sum(e.host_size for _, e in placing if e is not None and e.tier == "host")
        for entry in stale:
            steps.append(("invalidate", None, entry))
            if entry.tier == "host":
                host_used -= entry.host_size
            elif entry.pins == 0:
                free_slots, free_pages = free_slots + 1, free_pages + len(entry.pages)

        def room(slots: int, pages: int) -> None:
            """Evict (spilling where the host tier takes them) entries in the policy's order
            until ``slots`` slots and ``pages`` pages are free; RA222 when none is left."""
            nonlocal free_slots, free_pages, host_used
            while free_slots < slots or free_pages < pages:
                victim = evictions.next()
                if victim is None:  # the store's counts now: free_* are what this
                    # call's earlier rows would leave, which no caller could check
                    raise fail("RA222", f"acquire: the store cannot make room for this "
                                        f"call's {len(keys)} users ({total} pages of {p} "
                                        "tokens in all, hits included): "
                                        f"{len(self._free_pages)} of {self.num_pages} pages "
                                        f"and {len(self._free_slots)} of {self.num_users} "
                                        f"slots are free, {len(self._pinned)} entries are "
                                        "pinned by leases not yet released, and no other "
                                        "entry can be evicted for it. Retry once leases are "
                                        "released, acquire fewer rows at once, or build a "
                                        "larger store.")
                gone.add(id(victim))
                size = len(victim.pages)
                free_slots, free_pages = free_slots + 1, free_pages + size
                spill = 0 < size <= self.host_capacity - kept_host
                while spill and host_used + size > self.host_capacity:
                    old = next(e for e in host if id(e) not in host_gone)  # exists: see spill
                    host_gone.add(id(old))
                    host_used -= old.host_size if old.tier == "host" else len(old.pages)
                    steps.append(("host_evict", None, old))
                steps.append(("evict", None, victim, spill))
                if spill:
                    host_used += size
                    host.append(victim)  # the newest spill: the last the host tier drops

        for key, entry in placing:
            need = -(-key[2] // p)
            if entry is not None and entry.tier == "host":
                room(1, need)
                free_slots, free_pages = free_slots - 1, free_pages - need
                host_used -= entry.host_size
                kept_host -= entry.host_size
                steps.append(("restore", key, entry, need))
            elif entry is not None:  # causal: a prefix nobody else holds
                grow = need - len(entry.pages)
                room(0, grow)
                free_pages -= grow
                steps.append(("prefix", key, entry, grow))
            else:  # a miss
                room(1, need)
                free_slots, free_pages = free_slots - 1, free_pages - need
                steps.append(("miss", key, None, need))
        return steps, evictions

    def _apply(self, steps, evictions, placed: dict, spills: dict):
        """Carry out a plan under the lock: the policy state, and the device programs in
        the same order (the spills' gathers first, before the drop of any page), issued here
        and run by the caller after the lock. The eviction policy takes its plan's outcome
        first and hears of the new entries last (its plan chose the victims before they
        came). Fills ``placed`` ({key: (entry, source, cached)}) and ``spills`` ({id: (entry,
        pages, its gather)}) as it goes, so that an interrupted call knows what to undo.
        Returns (the device updates, restores, empty histories); the spills' and restores'
        copies finish outside the lock, and the empty histories are ready once the updates
        that empty their slots have run."""
        restores, dropped, arrived, emptied = [], [], [], []
        # Issued before anything changes: an interrupt while they are issued leaves the
        # store as it was (their turns are skipped).
        gathers = {id(entry): self._gather(entry.pages)
                   for kind, _, entry, *more in steps if kind == "evict" and more[0]}
        updates = list(gathers.values())
        # (An interrupt between this commit and the evict steps below, a few bytecodes, would
        # leave entries the policy has forgotten, evictable again only after clear().)
        self._policy.commit(evictions)
        for kind, key, entry, *more in steps:
            if kind == "hit":
                placed[key] = (entry, "device", entry.length)
            elif kind == "invalidate":
                self._counts["invalidations"] += 1
                self._hide(entry, dropped)
            elif kind == "evict":
                self._counts["evictions"] += 1
                del self._device_entries[id(entry)]
                del self._index[entry.user]
                if more[0]:  # gathered above, copied to host memory after the lock
                    spills[id(entry)] = (entry, len(entry.pages), gathers[id(entry)])
                    size = len(entry.pages)
                    dropped.append(self._take_back(entry))
                    entry.tier, entry.ready, entry.host_size = "host", False, size
                    self._host[id(entry)] = entry
                    self._index[entry.user] = entry
                    self._host_used += size
                else:
                    dropped.append(self._take_back(entry))
            elif kind == "host_evict":
                self._counts["host_evictions"] += 1
                spills.pop(id(entry), None)
                self._drop_host(entry)
            elif kind == "restore":
                snapshot = entry.snapshot
                placed[key] = (entry, "host", entry.length)
                self._drop_host(entry)
                entry.tier, entry.ready, entry.target = "device", False, key[2]
                entry.slot, entry.pages = self._take_slot(), self._take_pages(more[0])
                self._index[entry.user] = entry
                arrived.append(entry)
                restores.append((entry, snapshot))
            elif kind == "prefix":
                entry.pages += self._take_pages(more[0])
                entry.target, entry.ready = key[2], False
                placed[key] = (entry, "prefix", entry.length)
            else:  # miss
                entry = _Entry(key[0], key[1], 0, key[2], "device", slot=self._take_slot(),
                               pages=self._take_pages(more[0]))
                placed[key] = (entry, "miss", 0)
                if key[2] == 0:  # never written: its slot is emptied here, in case the drop
                    dropped.append((entry.slot, []))  # of its last holder failed or was skipped
                    emptied.append(entry)  # ready once that has run
                self._index[entry.user] = entry
                arrived.append(entry)
        for entry in arrived:
            self._device_entries[id(entry)] = entry
            self._policy.inserted(entry)
        updates += self._drop_device(dropped)
        return updates, restores, emptied

    # --- Write and release. ---------------------------------------------------------------

    def write(self, lease: Lease, k, v, *, rows=None) -> None:
        """The history pass's K/V for a lease's rows: k [L, R, T, Hkv, D], v [L, R, T, Hkv, Dv]
        (any float dtype, stored in the cache's) hold lease rows ``rows`` (int [R]; default
        every row, R = B). Row b's tokens ``lease.cached[b]`` .. ``lengths[b] - 1`` are its
        first ``lease.missing[b]`` positions (T >= the largest of them); every row with
        tokens missing must be there (a repeated row once is enough), and rows with nothing
        missing are not read. Once written, the rows' entries serve other acquires. RA223
        for a released or already written lease, a missing row or arrays of the wrong shape.
        RA224 when taking the rows or the device update failed: the rows' entries are dropped
        from the store (no other acquire waits for them or reuses them) and stay the lease's
        until it is released. RA214 (nothing written) for a float16 store given a finite value
        past float16's range.
        """
        self._not_reading("write")
        self._check_lease(lease, "write")
        if lease.written:
            raise fail("RA223", "write was called twice for one lease; each lease's missing "
                                "tokens are written once.")
        rows = np.arange(len(lease.slots)) if rows is None else self._check_write_rows(
            rows, len(lease.slots))
        position = {}  # id(entry) -> its row of k / v
        for i, b in enumerate(rows.tolist()):
            position.setdefault(id(lease._entries[b]), i)
        absent = [b for b, e in lease._to_write.values() if id(e) not in position]
        if absent:
            raise fail("RA223", f"write: lease rows {absent[:8]} have tokens missing "
                                f"({lease.missing[absent[:8]].tolist()}) but are not among "
                                f"rows={rows.tolist()[:8]}; pass their K/V too.")
        cache = self._cache
        num_layers, _, hkv, _, d = cache.k_pages.shape
        want_t = int(lease.missing[rows].max(initial=0))
        for name, x, last in (("k", k, d), ("v", v, cache.v_pages.shape[-1])):
            shape = tuple(getattr(x, "shape", ()))
            if (len(shape) != 5 or shape[:2] != (num_layers, len(rows)) or shape[2] < want_t
                    or shape[3:] != (hkv, last)
                    or not jnp.issubdtype(getattr(x, "dtype", np.int32), jnp.floating)):
                raise fail("RA223", f"write: {name} has shape {shape} and dtype "
                                    f"{getattr(x, 'dtype', type(x).__name__)}; it must be float "
                                    f"[L, R, T, Hkv, {'D' if name == 'k' else 'Dv'}] = "
                                    f"[{num_layers}, {len(rows)}, >= {want_t}, {hkv}, "
                                    f"{last}] (R rows, T covering their missing tokens).")
        if cache.k_pages.dtype == jnp.float16:
            # A value past float16's 65504 would be stored as inf and score NaN. (bfloat16
            # shares float32's exponent range: only values within 0.4% of float32's largest
            # could overflow there, not worth a device read on every write.)
            check_values_fit(cache.k_pages.dtype, (("k", k), ("v", v)),
                             lease.users[rows], lease.missing[rows])
        entries = [e for _, e in sorted(lease._to_write.values(), key=lambda r: r[0])]
        with self._every_turn_taken():
            self._write(lease, entries, position, k, v)

    def _write(self, lease: Lease, entries, position, k, v) -> None:
        top = self.buckets.rows[-1]
        batches = []
        try:
            with _building(self):  # a jax array's rows: a program per input shape
                for start in range(0, len(entries), top):
                    chunk = entries[start:start + top]
                    n_rows = device.Buckets.fit(len(chunk), self.buckets.rows)
                    longest = max(e.target - e.length for e in chunk)
                    t = device.Buckets.fit(-(-longest // self.page_size),
                                           self.buckets.pages) * self.page_size
                    index = device.padded(np.array([position[id(e)] for e in chunk], np.int32),
                                          n_rows, 0, 0)
                    batches.append((chunk, n_rows,
                                    *(device.rows_of(x, index, t) for x in (k, v))))
        except Exception as error:  # noqa: BLE001 - raised as RA224
            self._write_failed(entries, "taking the rows of k / v", error)
        updates = []
        with self._lock:
            self._check_lease(lease, "write")
            for chunk, n_rows, ks, vs in batches:
                pad = n_rows - len(chunk)
                slots = np.array([e.slot for e in chunk] + [self.num_users] * pad, np.int32)
                pages = np.full((n_rows, self.max_pages), -1, np.int32)
                for i, e in enumerate(chunk):
                    pages[i, :len(e.pages)] = e.pages
                starts = np.array([e.length for e in chunk] + [0] * pad, np.int32)
                counts = np.array([e.target - e.length for e in chunk] + [0] * pad, np.int32)
                updates.append(self._issue(device.write, slots, pages, starts, counts, ks, vs))
        failed = self._dispatch(updates)
        if failed:
            self._write_failed(entries, "the device update", failed.error)
        with self._lock:
            for entry in entries:
                entry.length, entry.ready = entry.target, True
            lease.written = True
            self._lock.notify_all()

    def _write_failed(self, entries, what: str, error: Exception):
        """Drop a failed write's entries from the store (pinned: freed at the lease's
        release) and raise RA224."""
        with self._lock:
            for entry in entries:
                self._hide(entry, [])
            self._lock.notify_all()
        raise _failed("write", f"{what} for users {[e.user for e in entries]}", error,
                      "those rows' entries were dropped from the store, and this lease still "
                      "holds their slots. Release it, then acquire the rows again: they come "
                      "back as misses.") from error

    def release(self, lease: Lease) -> None:
        """Unpin a lease's rows (RA223 when it was released before). Entries it left unwritten
        are dropped; entries a newer version replaced are freed at their last release."""
        self._not_reading("release")
        with self._every_turn_taken():
            with self._lock:
                self._check_lease(lease, "release")
                updates = self._unpin(lease)
            self._dropped(updates, "release")

    def _unpin(self, lease: Lease) -> list:
        """Release ``lease`` (under the lock); the device updates that empty the slots of
        the entries it lets go (see _let_go)."""
        lease.released = True
        return self._let_go(lease._entries)

    def _let_go(self, pinned, placed=()) -> list:
        """Under the lock: unpin ``pinned`` (an entry once per pin); drop those of them and
        of ``placed`` that were to be brought and were not (unwritten, a failed restore, or
        an empty history whose slot was not emptied), and free the entries a newer version
        replaced once unpinned. Returns the device updates that empty their slots."""
        dropped = []
        for entry in pinned:
            entry.pins -= 1
            if not entry.pins:
                self._pinned.pop(id(entry), None)
            self._policy.released(entry)
        for entry in {id(e): e for e in [*pinned, *placed]}.values():
            if entry.visible and not entry.ready:
                self._hide(entry, dropped)
            elif not entry.visible and entry.pins == 0 and entry.slot >= 0:
                dropped.append(self._take_back(entry))
        self._lock.notify_all()
        return self._drop_device(dropped)

    def _dropped(self, updates, call: str) -> None:
        """Run the device updates that empty dropped entries' slots and pages; RA224 if one
        failed."""
        failed = self._dispatch(updates)
        if failed:
            raise _failed(call, "emptying dropped entries' slots and pages", failed.error,
                          "the store's own records are updated; those pages' key bounds on "
                          "the device may be stale until rewritten.") from failed.error

    def clear(self) -> None:
        """Drop everything (a new model version): no entry can be acquired again; pinned
        entries stay valid for their leases and are freed at their last release. The
        eviction policy starts afresh (an S3-FIFO ghost forgets its users)."""
        self._not_reading("clear")
        with self._every_turn_taken():
            with self._lock:
                dropped = []
                for entry in list(self._index.values()):
                    self._hide(entry, dropped)
                self._policy = EVICTION_POLICIES[self.policy](self.num_users, self.num_pages)
                updates = self._drop_device(dropped)
                self._counts["clears"] += 1
                self._lock.notify_all()
            self._dropped(updates, "clear")

    # --- Inspection. ----------------------------------------------------------------------

    def unwritten(self, user_ids, versions, lengths) -> np.ndarray:
        """bool [B]: whether each row's entry is still to be written or restored by another
        lease, which an acquire of the row would wait for (rows as :meth:`acquire` takes
        them). A caller whose acquire timed out (RA222) learns which rows it waited on."""
        users, versions, lengths = self._check_rows(user_ids, versions, lengths, "unwritten")
        with self._lock:
            return np.array([self._awaits_write(u, v, n) for u, v, n in
                             zip(users.tolist(), versions.tolist(), lengths.tolist())], bool)

    def stats(self) -> dict:
        """Counters since the store was built: rows by source (hits, host_hits, prefix_hits,
        misses), invalidations (stale entries dropped), evictions (device, by the policy),
        host_evictions, clears; and now: device_pages_used, host_pages_used, entries on the
        device and in the host tier, pinned entries (every entry a lease holds, including
        those a newer version or clear() replaced), device_updates_waiting (issued, not yet
        run: behind another update, or waiting for readers to leave ``reading()``), and
        compiled_programs (the programs JAX built for this store's calls: the device updates,
        per shape and input dtype, and the row takes of jax inputs to write; one this process
        built before for another store of the same shapes is reused, not counted).

        Never waits for a compile or an update: it takes the policy lock, which no method
        holds while a device program runs or while it waits; safe inside ``reading()``."""
        with self._built_lock:
            built = self._built
        with self._device:  # not inside the policy lock, which is taken before this one
            waiting = self._issued - self._done
        with self._lock:
            out = {name: self._counts[name] for name in
                   ("hits", "host_hits", "prefix_hits", "misses", "invalidations",
                    "evictions", "host_evictions", "clears")}
            out.update(device_pages_used=self.num_pages - len(self._free_pages),
                       host_pages_used=self._host_used,
                       device_entries=len(self._device_entries),
                       host_entries=len(self._host),
                       pinned_entries=len(self._pinned),
                       device_updates_waiting=waiting, compiled_programs=built)
            return out

    def warmup(self) -> int:
        """Compile every device program for every bucket (a server calls this before it
        takes traffic) for the cache's dtype; returns ``stats()["compiled_programs"]``
        after. Each runs on the real cache with padding only, which changes nothing; other
        threads may use the store meanwhile (their updates wait their turn)."""
        self._not_reading("warmup")
        cache = self._cache
        num_layers, _, hkv, p, d = cache.k_pages.shape
        building = None

        def run(program, *args, reads: bool = False) -> None:
            # Issued and run before the next one's inputs are made: nothing can fail between
            # a turn and its run, and one program's padding is alive at a time.
            nonlocal building
            building = program.__name__
            failed = self._dispatch([self._issue(program, *args, reads=reads)])
            if failed:
                raise failed.error

        try:
            # Its turns taken even if interrupted: a turn never taken stops the store for good.
            with self._every_turn_taken():
                for rows in self.buckets.rows:
                    slots = np.full(rows, self.num_users, np.int32)
                    pages = np.full((rows, self.max_pages), -1, np.int32)
                    zeros = np.zeros(rows, np.int32)
                    run(device.drop, slots, pages)
                    for n in self.buckets.pages:
                        building = f"{n * p} tokens of padding for {rows} rows"
                        k = jnp.zeros((num_layers, rows, n * p, hkv, d), cache.k_pages.dtype)
                        v = jnp.zeros((num_layers, rows, n * p, hkv, cache.v_pages.shape[-1]),
                                      cache.v_pages.dtype)
                        run(device.write, slots, pages, zeros, zeros, k, v)
                for n in self.buckets.pages:
                    ids = np.full(n, self.num_pages, np.int32)
                    run(device.gather, ids, reads=True)
                    building = f"{n} pages of padding"
                    parts = [jnp.zeros(x.shape[:1] + (n,) + x.shape[2:], x.dtype)
                             for x in (cache.k_pages, cache.v_pages, cache.k_min, cache.k_max)]
                    run(device.restore, np.int32(self.num_users), ids,
                        np.full(self.max_pages, -1, np.int32), np.int32(0), *parts)
        except Exception as error:  # noqa: BLE001 - raised as RA224
            raise _failed("warmup", f"building or running {building}", error, "the store is "
                          "unchanged; check the device's free memory, or build a smaller "
                          "store.") from error
        with self.reading() as cache:
            jax.block_until_ready(cache)
        return self.stats()["compiled_programs"]

    # --- Internals. -----------------------------------------------------------------------

    @staticmethod
    def _check_write_rows(rows, lease_rows: int) -> np.ndarray:
        a = np.asarray(rows)
        if a.ndim == 1 and a.size == 0:  # [] is float64 to numpy
            return a.astype(np.int64)
        if (a.ndim != 1 or not np.issubdtype(a.dtype, np.integer)
                or ((a < 0) | (a >= lease_rows)).any()):
            raise fail("RA223", f"write: rows must be a 1-D sequence of ints in [0, "
                                f"{lease_rows}), the lease's rows that k / v hold in order; "
                                f"got {_describe(rows)}.")
        return a

    def _check_rows(self, user_ids, versions, lengths, call: str):
        arrays = []
        for name, x in (("user_ids", user_ids), ("versions", versions), ("lengths", lengths)):
            a = np.asarray(x)
            if a.ndim != 1 or a.size == 0 or not (np.issubdtype(a.dtype, np.integer)
                                                  or a.dtype == object and all(
                                                      isinstance(i, int) for i in a.tolist())):
                raise fail("RA220", f"{call}: {name} must be a non-empty 1-D sequence of ints, "
                                    f"one per row; got {_describe(x)}.")
            # Entries are keyed on int64: a wider int would wrap onto another user or version
            # (2**63 as -2**63) and be served its history.
            if a.dtype == np.uint64 or a.dtype == object:
                wide = [i for i in a.tolist() if not INT64_MIN <= i <= INT64_MAX]
                if wide:
                    raise fail("RA220", f"{call}: {name} holds {wide[:4]}, outside the signed "
                                        "64-bit range the store keys on; map them into "
                                        "[-2**63, 2**63) without collisions (a signed 64-bit "
                                        "hash, or the unsigned one minus 2**63).")
            arrays.append(a.astype(np.int64))
        users, versions, lengths = arrays
        if not len(users) == len(versions) == len(lengths):
            raise fail("RA220", f"{call}: user_ids, versions and lengths have {len(users)}, "
                                f"{len(versions)} and {len(lengths)} rows; give one of each "
                                "per row.")
        if (lengths < 0).any():
            raise fail("RA220", f"{call}: lengths holds {lengths[lengths < 0][:4].tolist()}; "
                                "a history has >= 0 tokens.")
        seen = {}
        for u, v, n in zip(users.tolist(), versions.tolist(), lengths.tolist()):
            if seen.setdefault(u, (v, n)) != (v, n):
                raise fail("RA220", f"{call}: user {u} appears with (version, length) "
                                    f"{seen[u]} and {(v, n)} in one call; a user's rows in one "
                                    "call must share them. Acquire the second history in a "
                                    "later call.")
        return users, versions, lengths

    def _check_lease(self, lease, what: str) -> None:
        if not isinstance(lease, Lease) or lease._store is not self:
            raise fail("RA223", f"{what}: {type(lease).__name__} is not a Lease of this store; "
                                "pass the object this store's acquire returned.")
        if lease.released:
            raise fail("RA223", f"{what}: the lease was already released; acquire the rows "
                                "again.")

    def _not_reading(self, what: str) -> None:
        if getattr(self._reading, "depth", 0):
            raise fail("RA223", f"{what} was called inside store.reading() on the same thread; "
                                "it would wait for that reader to finish. Leave the with block "
                                "first.")

    def _take_slot(self) -> int:
        return heapq.heappop(self._free_slots)

    def _take_pages(self, n: int) -> list:
        return [heapq.heappop(self._free_pages) for _ in range(n)]

    def _take_back(self, entry: _Entry):
        """Return a device entry's slot and pages to the free lists; (slot, pages) for the
        device drop."""
        slot, pages = entry.slot, entry.pages
        heapq.heappush(self._free_slots, slot)
        for page in pages:
            heapq.heappush(self._free_pages, page)
        entry.slot, entry.pages = -1, []
        return slot, pages

    def _hide(self, entry: _Entry, dropped: list) -> None:
        """``entry`` can no longer be acquired; freed now unless pinned (then at its last
        release)."""
        if self._index.get(entry.user) is entry:
            del self._index[entry.user]
        entry.visible = False
        if entry.tier == "host":
            self._drop_host(entry)
        else:
            self._device_entries.pop(id(entry), None)
            self._policy.removed(entry)
            if entry.pins == 0 and entry.slot >= 0:  # not taken back already
                dropped.append(self._take_back(entry))

    def _drop_host(self, entry: _Entry) -> None:
        """Remove a host entry (and its user's index entry); its pages leave the host tier."""
        self._host.pop(id(entry), None)
        if self._index.get(entry.user) is entry:
            del self._index[entry.user]
        self._host_used -= entry.host_size
        entry.snapshot, entry.host_size = None, 0

    def _drop_device(self, dropped) -> list:
        """The device updates (issued now) that empty the dropped (slot, pages), a bucket of
        rows each."""
        top = self.buckets.rows[-1]
        updates = []
        for start in range(0, len(dropped), top):
            chunk = dropped[start:start + top]
            rows = device.Buckets.fit(len(chunk), self.buckets.rows)
            slots = np.full(rows, self.num_users, np.int32)
            pages = np.full((rows, self.max_pages), -1, np.int32)
            for i, (slot, ids) in enumerate(chunk):
                slots[i] = slot
                pages[i, :len(ids)] = ids
            updates.append(self._issue(device.drop, slots, pages))
        return updates

    def _gather(self, pages: list) -> "_Update":
        """The read of ``pages``' device arrays, issued (under the lock) before the pages are
        freed; the copy to host memory happens after it runs."""
        n = device.Buckets.fit(len(pages), self.buckets.pages)
        ids = device.padded(np.array(pages, np.int32), n, 0, self.num_pages)
        return self._issue(device.gather, ids, reads=True)

    def _finish_spills(self, spills) -> list:
        """Copy spilled pages to host memory (outside the lock), then make them restorable
        (unless the host tier dropped them meanwhile). A spill that failed drops its entry;
        returns (what, error) of each."""
        failures = []
        for entry, n, gather in spills:
            error, snapshot = gather.error, None
            if error is None:
                try:
                    # Copied: a view would keep the whole padded bucket alive (up to
                    # twice the pages the host tier counts).
                    snapshot = tuple(np.asarray(x)[:, :n].copy() for x in gather.result)
                except Exception as e:  # noqa: BLE001 - host memory: raised as RA224
                    error = e
            with self._lock:
                if id(entry) in self._host:
                    if error is None:
                        entry.snapshot, entry.ready = snapshot, True
                    else:
                        self._hide(entry, [])
                self._lock.notify_all()
            if error is not None:
                failures.append((f"the spill of user {entry.user}'s history ({n} pages) to "
                                 "host memory", error))
        return failures

    def _finish_restores(self, restores) -> list:
        """Copy restored pages to the device (outside the lock), then scatter them in; the
        entry is ready unless a causal row still has to write its new tokens. A restore that
        failed leaves its entry not ready (the caller drops it); returns (what, error) of
        each."""
        failures = []
        for entry, (k, v, k_min, k_max) in restores:
            count = k.shape[1]
            what = f"the restore of user {entry.user}'s history ({count} pages) from host memory"
            n = device.Buckets.fit(count, self.buckets.pages)
            ids = device.padded(np.array(entry.pages[:count], np.int32), n, 0, self.num_pages)
            table = np.full(self.max_pages, -1, np.int32)
            table[:count] = entry.pages[:count]
            try:
                parts = [jax.device_put(device.padded(x, n, 1, 0)) for x in (k, v, k_min, k_max)]
            except Exception as error:  # noqa: BLE001 - device memory: raised as RA224
                failures.append((what, error))
                continue
            # Its slot and pages are pinned, so no other update touches them: any turn will do.
            failed = self._dispatch([self._issue(device.restore, np.int32(entry.slot), ids,
                                                 table, np.int32(entry.length), *parts)])
            if failed:
                failures.append((what, failed.error))
                continue
            with self._lock:
                entry.ready = entry.target == entry.length
                self._lock.notify_all()
        return failures

    def _issue(self, program, *args, reads: bool = False) -> "_Update":
        """A ticket for ``program(cache, *args)``: a donating update returning the new cache,
        or (``reads``) a read whose result the update keeps. Called under the policy lock
        where the policy orders the update (it then runs in policy order)."""
        with self._device:
            self._issued += 1
            update = _Update(self._issued - 1, program, args, reads)
        self._unrun().append(update)
        return update

    def _unrun(self) -> list:
        """This thread's issued updates that no _dispatch has taken yet."""
        if not hasattr(self._unrun_updates, "updates"):
            self._unrun_updates.updates = []
        return self._unrun_updates.updates

    @contextlib.contextmanager
    def _every_turn_taken(self) -> Iterator[None]:
        """Every update this thread issues in the block is dispatched in it or, when the
        block raises first (an allocation, an interrupt), skipped in its turn as it ends: a
        turn never taken would stop every later update and reader for good."""
        try:
            yield
        finally:
            if self._unrun():
                self._dispatch(list(self._unrun()), run=False)

    def _dispatch(self, updates, run: bool = True) -> "_Update | None":
        """Run this thread's ``updates`` (issued in this order), each in its turn once no
        reader holds the cache, with no lock held while it runs (a first call compiles).
        Every one runs, since the later ones were decided assuming the earlier; returns the
        first that failed (its ``error`` set), or None. ``run=False`` only takes their
        turns (see _every_turn_taken)."""
        failed = None
        for update in updates:
            with self._device:
                while self._done != update.ticket or (run and self._readers):
                    self._device.wait()
            try:
                if run:
                    with _building(self):
                        out = update.program(self._cache, *update.args)
                    if update.reads:
                        update.result = out
                    else:
                        self._cache = out
            except Exception as error:  # noqa: BLE001 - the caller raises it as RA224
                update.error = error
                failed = failed or update
            finally:
                with self._device:
                    self._done += 1
                    self._device.notify_all()
                self._unrun().remove(update)
        return failed


@dataclasses.dataclass(eq=False)
class _Update:
    """One device update and its turn (see HistoryStore._issue)."""

    ticket: int
    program: object
    args: tuple
    reads: bool
    result: object = None
    error: Exception | None = None


# JAX reports each program it builds (traces, lowers and compiles, on the thread that calls
# it) as this event; the store counts those built while its own calls run.
_LOWERING_EVENT = "/jax/core/compile/jaxpr_to_mlir_module_duration"
_BUILDER = threading.local()  # .store: the store whose program this thread is running


@contextlib.contextmanager
def _building(store: HistoryStore) -> Iterator[None]:
    _BUILDER.store = store
    try:
        yield
    finally:
        _BUILDER.store = None


def _on_jax_event(event: str, seconds: float, **_) -> None:
    store = getattr(_BUILDER, "store", None)
    if store is not None and event == _LOWERING_EVENT:
        with store._built_lock:
            store._built += 1


jax.monitoring.register_event_duration_secs_listener(_on_jax_event)


_COUNTER = {"device": "hits", "host": "host_hits", "prefix": "prefix_hits", "miss": "misses"}


def _failed(call: str, what: str, error: Exception, then: str):
    """RA224 for ``call``, whose ``what`` raised ``error``; ``then`` says what became of the
    entries and what to do."""
    return fail("RA224", f"{call}: {what} failed ({type(error).__name__}: {error}); {then}")


def _positive_int(x) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool) and x > 0


def _describe(x) -> str:
    if hasattr(x, "shape") and hasattr(x, "dtype"):
        return f"{type(x).__name__} of shape {tuple(x.shape)} and dtype {x.dtype}"
    return f"{type(x).__name__} {x!r}"[:120]
