"""Which device entry a :class:`~rankattn.serving.HistoryStore` evicts: the policies.

The store keeps the bookkeeping (slots, pages, pins, versions, the host tier) and asks a
policy one question: in what order may the entries on the device be evicted. A policy sees
the entries that are on the device and what happens to them; it never frees anything
itself, and it never sees the host tier (which drops its least recently evicted entries,
whatever the policy).

``EVICTION_POLICIES`` names the choices (``HistoryStore(..., policy=name)``):

* ``"lru"`` (the default): least recently used first, where acquiring and releasing are
  uses.
* ``"s3fifo"``: S3-FIFO (Yang et al., "FIFO queues are all you need for cache eviction",
  SOSP 2023). New entries go into a small FIFO queue (10% of the store); one that is
  requested again while there moves to the main queue when it reaches the queue's end, one
  that is not is evicted and its user remembered in a ghost queue; a user in the ghost queue
  comes back straight into the main queue. The main queue is a FIFO that gives an entry
  requested since it last passed its end another pass (a 2-bit count, at most 3). On skewed
  traces most one-off users never reach the main queue, so the frequent users stay: it beats
  LRU there, and a scan of new users flushes only the small queue.

Sizes. An entry's weight is its share of the store's scarcer resource, slots or pages:
``max(pages * max_users, device_pages)`` in units of which the store holds
``device_pages * max_users``. So "10% of the store" means 10% of the slots for short
histories and 10% of the pages for long ones.

The contract (what the store calls, under its lock):

* ``inserted(entry)``: the entry arrived on the device (a miss placed, or a restore from the
  host tier). A call's new entries are inserted after its evictions are chosen.
* ``requested(entry, hit)``: a row of an acquire asked for it; ``hit`` when the row found it
  on the device (a device or prefix hit), False for the row that placed it.
* ``released(entry)``: a lease that held it was released.
* ``removed(entry)``: it left the device for another reason than this policy's eviction
  (a changed history, a failed write, a clear). Ignored for entries the policy no longer
  holds.
* ``evictions(evictable, leaving)``: the order of victims, planned on a copy of the policy's
  state: an iterator whose ``next`` is the next victim among the entries for which
  ``evictable(entry)`` holds when it is asked (None when none is left). ``leaving`` are entries
  this call drops first (stale histories): they are not there for the plan. The plan changes
  nothing until ``commit(plan)``, which makes the policy's state what the plan left (its
  victims gone, any moves it made); a plan that is not committed is forgotten. Nothing may
  change the policy between a plan and its commit.

Entries are the store's objects, compared by identity; a policy reads only ``entry.user``
and ``len(entry.pages)``.
"""

from __future__ import annotations

import abc
import collections
from typing import Callable, Iterable, Iterator


class EvictionPolicy(abc.ABC):
    """The order in which a store's device entries may be evicted (see the module
    docstring for the contract). ``slots``, ``pages``: the store's max_users and
    device_pages."""

    name: str

    def __init__(self, slots: int, pages: int):
        self.slots, self.pages = slots, pages

    def weight(self, entry) -> int:
        """The entry's share of the store, in units of which it holds slots * pages."""
        return max(len(entry.pages) * self.slots, self.pages)

    @abc.abstractmethod
    def inserted(self, entry) -> None: ...

    @abc.abstractmethod
    def requested(self, entry, hit: bool) -> None: ...

    @abc.abstractmethod
    def released(self, entry) -> None: ...

    @abc.abstractmethod
    def removed(self, entry) -> None: ...

    @abc.abstractmethod
    def evictions(self, evictable: Callable, leaving: Iterable = ()) -> "Plan": ...

    @abc.abstractmethod
    def commit(self, plan: "Plan") -> None: ...


class Plan(abc.ABC):
    """Victims in order, chosen on a copy of a policy's state (EvictionPolicy.evictions)."""

    @abc.abstractmethod
    def next(self):
        """The next victim, or None when no entry is evictable."""


class Lru(EvictionPolicy):
    """Least recently used (acquired or released) first."""

    name = "lru"

    def __init__(self, slots: int, pages: int):
        super().__init__(slots, pages)
        self._order: collections.OrderedDict[int, object] = collections.OrderedDict()

    def inserted(self, entry) -> None:
        self._order[id(entry)] = entry

    def requested(self, entry, hit: bool) -> None:
        self.released(entry)

    def released(self, entry) -> None:
        if id(entry) in self._order:
            self._order.move_to_end(id(entry))

    def removed(self, entry) -> None:
        self._order.pop(id(entry), None)

    def evictions(self, evictable, leaving=()) -> "_LruPlan":
        return _LruPlan(self, evictable)

    def commit(self, plan: "_LruPlan") -> None:
        for entry in plan.victims:
            self.removed(entry)


class _LruPlan(Plan):
    def __init__(self, policy: Lru, evictable):
        self._policy, self._evictable = policy, evictable
        self._order: Iterator | None = None  # taken at the first victim asked: a call of
        self.victims: list = []              # hits only pays nothing

    def next(self):
        if self._order is None:
            # Victims come in order and are never offered twice, so one pass over the order
            # (as it was when the plan began) serves the whole plan.
            self._order = iter(list(self._policy._order.values()))
        victim = next((e for e in self._order if self._evictable(e)), None)
        if victim is not None:
            self.victims.append(victim)
        return victim


class S3Fifo(EvictionPolicy):
    """S3-FIFO: a small probationary FIFO, a main FIFO with reinsertion, a ghost queue of
    users (see the module docstring)."""

    name = "s3fifo"
    SMALL_SHARE = 0.10   # the small queue's share of the store (the paper's 10%)
    MAX_FREQUENCY = 3    # the paper's 2-bit count

    def __init__(self, slots: int, pages: int):
        super().__init__(slots, pages)
        self._state = _S3State.empty()
        self._small_target = int(self.SMALL_SHARE * slots * pages)
        self._ghost_size = slots  # users remembered: as many as the device holds entries

    def inserted(self, entry) -> None:
        s = self._state
        s.weight[id(entry)] = self.weight(entry)
        s.frequency[id(entry)] = 0
        if entry.user in s.ghost:  # evicted from the small queue lately: a returning user
            del s.ghost[entry.user]
            s.main[id(entry)] = entry
        else:
            s.small[id(entry)] = entry
            s.small_weight += s.weight[id(entry)]

    def requested(self, entry, hit: bool) -> None:
        s = self._state
        if id(entry) not in s.weight:
            return
        if hit:
            s.frequency[id(entry)] = min(s.frequency[id(entry)] + 1, self.MAX_FREQUENCY)
        # A causal prefix grows in place: its pages, and so its weight, change at a hit.
        weight = self.weight(entry)
        if id(entry) in s.small:
            s.small_weight += weight - s.weight[id(entry)]
        s.weight[id(entry)] = weight

    def released(self, entry) -> None:
        """FIFO order: a release is no use."""

    def removed(self, entry) -> None:
        self._state.remove(entry)

    def evictions(self, evictable, leaving=()) -> "_S3Plan":
        return _S3Plan(self, evictable, leaving)

    def commit(self, plan: "_S3Plan") -> None:
        if plan.state is not None:
            self._state = plan.state


class _S3State:
    """S3-FIFO's queues: ordered dicts id -> entry, oldest first; the ghost: users, oldest
    first."""

    def __init__(self, small, main, ghost, frequency, weight, small_weight):
        self.small, self.main, self.ghost = small, main, ghost
        self.frequency, self.weight, self.small_weight = frequency, weight, small_weight

    @classmethod
    def empty(cls) -> "_S3State":
        return cls(collections.OrderedDict(), collections.OrderedDict(),
                   collections.OrderedDict(), {}, {}, 0)

    def copy(self) -> "_S3State":
        return _S3State(self.small.copy(), self.main.copy(), self.ghost.copy(),
                        dict(self.frequency), dict(self.weight), self.small_weight)

    def remove(self, entry) -> None:
        if id(entry) in self.small:
            del self.small[id(entry)]
            self.small_weight -= self.weight[id(entry)]
        self.main.pop(id(entry), None)
        self.frequency.pop(id(entry), None)
        self.weight.pop(id(entry), None)


class _S3Plan(Plan):
    """S3-FIFO's eviction, run on a copy of the state (taken at the first victim asked)."""

    def __init__(self, policy: S3Fifo, evictable, leaving):
        self._policy, self._evictable, self._leaving = policy, evictable, list(leaving)
        self.state: _S3State | None = None

    def next(self):
        if self.state is None:
            self.state = self._policy._state.copy()
            for entry in self._leaving:
                self.state.remove(entry)
        s = self.state
        if s.small_weight >= self._policy._small_target or not self._any(s.main):
            victim = self._from_small() or self._from_main()
        else:
            victim = self._from_main() or self._from_small()
        return victim

    def _any(self, queue) -> bool:
        return any(self._evictable(e) for e in queue.values())

    def _from_small(self):
        """The small queue's oldest evictable entry that was not requested again since it
        came: evicted, its user into the ghost queue; those requested again move to the main
        queue on the way. Entries that cannot be evicted now keep their places."""
        s = self.state
        for key, entry in list(s.small.items()):
            if not self._evictable(entry):
                continue
            del s.small[key]
            s.small_weight -= s.weight[key]
            if s.frequency[key] > 0:
                s.frequency[key] = 0
                s.main[key] = entry
                continue
            del s.frequency[key], s.weight[key]
            s.ghost[entry.user] = None
            s.ghost.move_to_end(entry.user)
            while len(s.ghost) > self._policy._ghost_size:
                s.ghost.popitem(last=False)
            return entry
        return None

    def _from_main(self):
        """The main queue's oldest evictable entry with no request left to its credit:
        evicted; those passed over spend one and go to the queue's end. Entries that cannot
        be evicted now keep their places."""
        s = self.state
        if not self._any(s.main):
            return None
        while True:  # ends: each pass spends a request of every evictable entry it meets
            for key, entry in list(s.main.items()):
                if not self._evictable(entry):
                    continue
                if s.frequency[key] > 0:
                    s.frequency[key] -= 1
                    s.main.move_to_end(key)
                    continue
                del s.main[key], s.frequency[key], s.weight[key]
                return entry


EVICTION_POLICIES: dict[str, type[EvictionPolicy]] = {p.name: p for p in (Lru, S3Fifo)}
