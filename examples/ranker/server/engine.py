"""The ranking server's engine: requests batched through a HistoryStore, in two stages.

Accepted requests wait in a bounded queue (:class:`RequestQueue`). Two threads serve it:

* the **front** stage takes a batch (``max_batch`` requests, or what arrived within
  ``max_wait`` of the oldest), merges requests with equal store keys into one row, acquires
  the rows (``HistoryStore.acquire``), scores the requests whose history the store holds
  (device or host tier) in one jitted call and answers them, and hands the misses, their
  lease still held, to the history stage through an unbounded FIFO (the hand-off never
  blocks the front stage);
* the **history** stage runs one batched history pass over a job's misses
  (``serve.fill_misses``), scores them in one call, answers them and releases the lease.

A hit therefore never waits for a miss's history pass, in its own batch or an earlier one,
however many jobs the history stage has queued: the two stages share the CPU cores and the
store's lock (held for policy and dispatch, not for passes) and nothing else. Batching
rules:

* a user's second version in one batch waits for the next batch (one acquire holds one
  history per user: RA220);
* a request whose key the history stage has yet to write waits in the queue until it is
  written (then it is a hit) instead of blocking the front stage inside acquire;
* a batch the store cannot place (RA222: what could make room is pinned by batches in
  flight) is split in halves; a single request it cannot place is answered 503 cache_full.
  Pins are held by the front stage's batch, the job the history stage runs and every job
  queued for it (a miss keeps its pins until its history is written): a store of
  ``3 * max_batch`` longest histories holds one batch in each stage and one queued, and a
  longer backlog of misses (bounded by admission: the jobs ahead at the history stage's
  mean job time must fit a request's deadline) can fill it, so further misses get 503
  cache_full while hits are still answered.

Shapes (:class:`Shapes`): rows are padded to powers of two up to ``max_batch`` (rounded
up), candidates to 8, 16, ... up to ``max_candidates``, histories to the store's page
buckets (16, 32, 64, ... tokens, and the longest). :meth:`Engine.warmup` runs every shape
once, so traffic compiles nothing (``compiles_after_warmup`` counts what it would).

``--no-cache`` (``Options.cache=False``) keys every batch's rows with a version of their
own: nothing is reused across batches, every history is recomputed (``"cache": "off"``),
through the same code.

Hot swaps (:meth:`Engine.swap`, driven by reload.py): the front stage takes the served
:class:`Model` once per batch and that batch's rows are placed, computed and scored with it,
in both stages, whatever is swapped in meanwhile; the store versions fold the model in
(:func:`store_version`), so K/V one model computed never serve another's scoring: after a
swap the old entries stop hitting and age out of the store.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import itertools
import logging
import queue
import threading
import time

import jax
import numpy as np

from rankattn.errors import RankattnError
from rankattn.serving.store_device import Buckets, padded

from examples.ranker import serve
from examples.ranker.config import ACTIONS
from examples.ranker.server.metrics import STORE_COUNTS, Metrics
from examples.ranker.server.schema import (ID_LIMIT, Answer, Request, expired, ranked,
                                           unavailable)
from examples.ranker.world import Sessions

log = logging.getLogger("examples.ranker.server")
DEFAULT_DEVICE_PAGES = 4096
LOWERING_EVENT = "/jax/core/compile/jaxpr_to_mlir_module_duration"  # one per program built
STATE_REASONS = {"warming": "compiling the programs traffic uses", "serving": "ready",
                 "draining": "shutting down, answering the requests it accepted"}
STATE_FIXES = {
    "warming": "Retry shortly: a warming server answers once it has compiled its programs "
               "(GET /readyz answers 200).",
    "draining": "Send to another replica: this one is shutting down.",
    "broken": "Send to another replica: this one must be restarted (GET /livez answers 503)."}
OVERLOADED_FIX = ("Retry after the Retry-After seconds or on another replica, or send a later "
                  "deadline (X-Request-Deadline-Ms or deadline_ms, at most the server's "
                  "--deadline-ms).")


# A stage busy with one batch or job this long is stuck (a hung device, a wait nobody will
# end): readiness fails and stop() stops waiting for it. A pass takes milliseconds to a few
# seconds, an unexpected compile tens of seconds.
STUCK_SECONDS = 120.0


@dataclasses.dataclass(frozen=True)
class Options:
    """The server's limits and store (the CLI's flags of the same names)."""

    max_history: int
    max_candidates: int
    max_batch: int = 8
    max_wait: float = 0.002        # seconds
    max_queue: int = 64
    device_pages: int = DEFAULT_DEVICE_PAGES
    host_pages: int = 0
    max_users: int | None = None   # store slots; default: device_pages
    eviction_policy: str = "lru"   # a name in rankattn.serving.EVICTION_POLICIES
    cache: bool = True
    acquire_timeout: float = 1.0   # seconds an acquire may wait for an entry to be written


@dataclasses.dataclass(frozen=True)
class Model:
    """A served checkpoint: its ``step``, graph and parameters, and ``serial``, the models
    this engine served before it (0: the first; :meth:`Engine.swap` sets it). The store
    versions fold in both: a step number reused by another training run (a rewritten run
    directory) cannot serve K/V of the model it replaced either. ``checkpoint``: the
    reloader's identity of the checkpoint it came from (None: fresh weights)."""

    step: int
    graphdef: object
    params: object
    serial: int = 0
    checkpoint: tuple | None = None


@dataclasses.dataclass(frozen=True)
class Shapes:
    """Bucket shapes of the model's programs: ``rows`` (requests per scoring call and
    histories per history pass), ``candidates`` per row, ``tokens`` per history row (the
    user token and the events)."""

    rows: tuple[int, ...]
    candidates: tuple[int, ...]
    tokens: tuple[int, ...]

    @classmethod
    def of(cls, store, options: Options) -> "Shapes":
        # The store's page buckets: a history pass of `tokens` writes one bucket of pages.
        tokens = sorted({min(p * store.page_size, 1 + options.max_history)
                         for p in store.buckets.pages})
        candidates = [min(8, options.max_candidates)]
        while candidates[-1] < options.max_candidates:
            candidates.append(min(2 * candidates[-1], options.max_candidates))
        return cls(store.buckets.rows, tuple(candidates), tuple(tokens))


class RequestQueue:
    """Accepted requests, oldest first, taken in batches; ``put`` refuses past ``capacity``.

    It also holds the keys the history stage has yet to write: a request for one of them
    waits here until it is written (and then hits) rather than inside acquire.
    """

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._items: collections.deque[Request] = collections.deque()
        self._held = collections.Counter()
        self._cond = threading.Condition()
        self._closed = False

    def __len__(self) -> int:
        return len(self._items)

    def put(self, request: Request) -> bool:
        """Queue ``request``; False when the queue is full or closed."""
        with self._cond:
            if len(self._items) >= self.capacity or self._closed:
                return False
            self._items.append(request)
            self._cond.notify_all()
            return True

    def take(self, max_rows: int, max_wait: float) -> list[Request] | None:
        """The next batch: up to ``max_rows`` requests, once that many are eligible or the
        oldest has waited ``max_wait`` seconds (at once when closed); None once closed and
        empty."""
        with self._cond:
            while True:
                batch = self._eligible(max_rows)
                now = time.perf_counter()
                if batch and (len(batch) == max_rows or self._closed
                              or now >= batch[0].arrival + max_wait):
                    taken = set(map(id, batch))
                    self._items = collections.deque(r for r in self._items
                                                    if id(r) not in taken)
                    return batch
                if self._closed and not self._items:
                    return None
                self._cond.wait(batch[0].arrival + max_wait - now if batch else None)

    def _eligible(self, max_rows: int) -> list[Request]:
        """The oldest requests that may share a batch: one key per user, none held."""
        batch, keys = [], {}
        for request in self._items:
            if self._held[request.key] or keys.setdefault(request.user,
                                                          request.key) != request.key:
                continue
            batch.append(request)
            if len(batch) == max_rows:
                break
        return batch

    def hold(self, keys) -> None:
        with self._cond:
            self._held.update(keys)

    def free(self, keys) -> None:
        with self._cond:
            self._held.subtract(keys)
            self._held = +self._held
            self._cond.notify_all()

    def close(self) -> None:
        """Take no more requests; ``take`` empties the queue, then returns None."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()


class ServiceTime:
    """An exponentially weighted mean of measured seconds (the newest weighs ``weight``);
    0 until the first measurement."""

    def __init__(self, weight: float = 0.2):
        self.weight, self.mean = weight, 0.0
        self._measured = False

    def add(self, seconds: float) -> None:
        self.mean += (self.weight if self._measured else 1.0) * (seconds - self.mean)
        self._measured = True


@dataclasses.dataclass
class _Job:
    """A batch's misses handed to the history stage: its lease (every row of one acquire),
    the rows' request groups, and which rows missed."""

    lease: object
    groups: list[list[Request]]
    misses: list[int]
    handed: float
    model: Model  # the model that placed the batch: it computes and scores the misses


class Engine:
    """The model, the store, the queue and the two stage threads (see the module docstring).

    ``service`` holds each stage's mean seconds per batch ("front": a batch's acquire, hit
    scoring and hand-off; "history": a job's pass, write and scoring), which admission uses.
    """

    def __init__(self, preset, model: Model, options: Options):
        self.model = model  # replaced whole by swap(); each batch reads it once
        self.options = options
        self.anchor = preset.model.max_position
        rows = 1 << (options.max_batch - 1).bit_length()
        self.store = serve.make_store(preset.model, options.max_history,
                                      users=options.max_users or options.device_pages,
                                      device_pages=options.device_pages,
                                      host_pages=options.host_pages, max_batch=rows,
                                      policy=options.eviction_policy)
        self.shapes = Shapes.of(self.store, options)
        self.queue = RequestQueue(options.max_queue)
        self.service = {"front": ServiceTime(), "history": ServiceTime()}
        self.metrics = Metrics(self, rows)
        self.state = "warming"  # then "serving", then "draining" (health() adds "broken")
        self._state_lock = threading.Lock()
        self._programs_built = 0      # by this process (JAX's lowerings)
        self._programs_warm = None    # ... when warm-up ended
        jax.monitoring.register_event_duration_secs_listener(self._on_event)
        self._jobs: queue.Queue[_Job | None] = queue.Queue()  # unbounded: put never blocks
        self._history_busy = False
        self._busy_since = {"front": None, "history": None}  # perf_counter when it began
        self._batches = itertools.count()  # --no-cache: each batch's own version
        self._baseline: dict | None = None  # the store's stats when warm-up ended
        self._threads: list[threading.Thread] = []
        self._stopped = False

    # --- Life cycle. ----------------------------------------------------------------------

    def pinned_batches_fit(self) -> bool:
        """Whether three full batches of the longest history fit the store: one in each stage
        and one queued; acquire then does not fail for want of unpinned room while the
        history stage keeps up (a longer backlog of misses can still fill it)."""
        rows = self.shapes.rows[-1]
        return (3 * rows * self.store.max_pages <= self.store.num_pages
                and 3 * rows <= self.store.num_users)

    def warmup(self) -> int:
        """Compile every program traffic uses: the store's, and the history pass and scoring
        at every bucket shape, run once on made-up users that are then dropped. Returns the
        programs built.

        A history pass of ``rows`` rows in a token bucket runs on one history of that many
        tokens and ``rows - 1`` of one token (the least room a batch of that shape takes);
        shapes no acquire can place in this store are skipped: traffic cannot make them.
        """
        before = self._programs_built
        self.store.warmup()
        shape = itertools.count()  # each shape's own version: no row of it hits
        for rows in self.shapes.rows:
            for tokens in self.shapes.tokens:
                version = next(shape)
                made_up = [_made_up(i, tokens - 1 if i == 0 else 0, 1, version)
                           for i in range(rows)]
                try:
                    lease = self.store.acquire(*zip(*(r.key for r in made_up)))
                except RankattnError as err:
                    if err.code != "RA222":
                        raise
                    continue
                with lease:
                    self._history_pass(lease, made_up, self.model)
            for candidates in self.shapes.candidates:
                made_up = [_made_up(i, 0, candidates, 0) for i in range(rows)]
                self._logits(made_up, np.zeros(rows, np.int32), self.model)
        self.store.clear()
        jax.block_until_ready(self.store.cache)
        self._baseline = self.store.stats()
        self._programs_warm = self._programs_built
        return self._programs_warm - before

    def swap(self, model: Model) -> None:
        """Serve ``model`` from the next batch on (batches already taken finish with the
        model they started with). It must have the served model's graph and parameter
        shapes and dtypes, so that it runs the programs warm-up compiled (a ValueError
        otherwise, naming the difference); one scoring call runs it first, off the stages,
        and a program it built (none should be) is logged and counted in
        ``compiles_after_warmup``."""
        served = self.model
        if model.graphdef != served.graphdef:
            raise ValueError(f"checkpoint step {model.step} has another model graph than "
                             f"the served step {served.step} (another preset?): restart the "
                             "server with the matching --preset to serve it.")
        new, old = _signature(model.params), _signature(served.params)
        if new != old:
            changed = [f"{jax.tree_util.keystr(a[0])}: {a[1:]} for {b[1:]}"
                       for a, b in zip(new, old) if a != b]
            raise ValueError(f"checkpoint step {model.step}'s parameters differ in shape or "
                             f"dtype from the served step {served.step}'s ({changed[:3]}): "
                             "restart the server to serve it (its programs must be compiled "
                             "anew).")
        model = dataclasses.replace(model, serial=served.serial + 1)
        built = self._programs_built
        self._logits([_made_up(0, 0, 1, 0)], np.zeros(1, np.int32), model)
        if self._programs_built != built:
            log.warning("warming model step %d built %d programs", model.step,
                        self._programs_built - built)
        self.model = model
        log.info("swapped model step %d for step %d", served.step, model.step)

    @property
    def model_step(self) -> int:
        """The checkpoint step served (the next batch's)."""
        return self.model.step

    @property
    def model_checkpoint(self) -> tuple | None:
        """The served checkpoint's identity (Model.checkpoint)."""
        return self.model.checkpoint

    def store_keys(self, keys, model: Model, batch_number: int) -> tuple[tuple, list, tuple]:
        """(users, versions, lengths) to acquire for request ``keys`` (user, version,
        length) in batch ``batch_number`` under ``model``: each version folded with the
        model (:func:`store_version`) and, with ``--no-cache``, the batch number too (a
        version no other batch has: nothing is reused)."""
        users, versions, lengths = zip(*keys)
        salt = (model.step, model.serial) + (() if self.options.cache else (batch_number,))
        return users, [store_version(v, *salt) for v in versions], lengths

    def start(self) -> None:
        """Start the two stages (after :meth:`warmup`) and take requests, unless the
        engine was drained meanwhile."""
        with self._state_lock:
            if self.state != "warming":
                return
            threads = [self._stage("front", self._front), self._stage("history", self._history)]
            for thread in threads:
                thread.start()
            self._threads = threads  # started: health() never sees one not yet alive
            self.state = "serving"

    def drain(self) -> None:
        """Take no new requests (they get 503 draining); the accepted ones are served."""
        with self._state_lock:
            self.state = "draining"

    def stop(self) -> None:
        """Drain, answer every accepted request, and end the stage threads."""
        with self._state_lock:
            self.state = "draining"
            threads = self._threads
            self._stopped = True  # the stage threads now end on purpose
        self.queue.close()
        if threads:  # a stuck stage is not waited for past STUCK_SECONDS (the exit goes on)
            threads[0].join(STUCK_SECONDS)
            self._jobs.put(None)
            threads[1].join(STUCK_SECONDS)

    @property
    def jobs(self) -> int:
        """Jobs queued for the history stage (not counting the one it runs)."""
        return self._jobs.qsize()

    def health(self) -> tuple[str, str]:
        """(state, reason): "serving" (ready), "warming", "draining", or "broken" once a
        stage thread has died or has been busy with one batch or job for STUCK_SECONDS
        (checked on each call: the watchdog of every probe and submit). Never blocks."""
        dead = [t.name for t in self._threads if not t.is_alive()]
        if dead and not self._stopped:
            return "broken", (f"the {' and '.join(dead)} stage thread died (the log has the "
                              "traceback); this process cannot serve any more")
        now = time.perf_counter()
        stuck = [name for name, since in self._busy_since.items()
                 if since is not None and now - since > STUCK_SECONDS]
        if stuck:
            return "broken", (f"the {' and '.join(stuck)} stage has been busy with one batch "
                              f"for over {STUCK_SECONDS:.0f} s (a hung device or a wait "
                              "nobody ends); restart the process")
        return self.state, STATE_REASONS[self.state]

    def _stage(self, name: str, run) -> threading.Thread:
        """A stage thread; its death is logged (and seen by :meth:`health`)."""
        def logged():
            try:
                run()
            except BaseException:  # noqa: BLE001 - logged; health() reports it from now on
                log.critical("the %s stage thread died: the server answers 503 broken",
                             name, exc_info=True)
        return threading.Thread(target=logged, name=name, daemon=True)

    def _on_event(self, event: str, seconds: float, fun_name: str = "?", **_) -> None:
        if event == LOWERING_EVENT:
            self._programs_built += 1
            if self._programs_warm is not None:
                log.warning("program %s was built after warm-up (a shape warm-up missed)",
                            fun_name)

    @property
    def compiles_after_warmup(self) -> int:
        return 0 if self._programs_warm is None else self._programs_built - self._programs_warm

    def store_stats(self) -> dict | None:
        """The store's stats, its counts since warm-up; None until warm-up has ended (its
        counts are not traffic's, and warm-up holds the store)."""
        if self._baseline is None:
            return None
        stats = self.store.stats()
        return {k: v - self._baseline.get(k, 0) if k in STORE_COUNTS else v
                for k, v in stats.items()}

    # --- Requests. ------------------------------------------------------------------------

    def submit(self, request: Request) -> Answer | None:
        """Queue ``request`` (None: it is answered through ``request.reply``), or the 503
        that refuses it now: the engine is not serving, the queue is full, or the
        request's deadline is nearer than its estimated wait (:meth:`front_wait`)."""
        state, reason = self.health()
        if state != "serving":
            return unavailable(state, f"the server is {state}: {reason}.", STATE_FIXES[state])
        wait, left = self.front_wait(len(self.queue)), request.deadline - time.perf_counter()
        if wait > left:
            return unavailable("overloaded", f"the request's deadline is {1e3 * left:.0f} ms "
                               f"away and the server estimates {1e3 * wait:.0f} ms before it "
                               "could answer even a cached history.", OVERLOADED_FIX)
        if not self.queue.put(request):
            if self.state != "serving":  # stopped since the health check: closed, not full
                return unavailable("draining", f"the server is draining: "
                                   f"{STATE_REASONS['draining']}.", STATE_FIXES["draining"])
            return unavailable("queue_full", f"{self.queue.capacity} requests are already "
                               "queued.", "Retry after a short wait, send fewer requests at "
                               "once, or start the server with a larger --max-queue (or run "
                               "more replicas).")
        return None

    def front_wait(self, ahead: int) -> float:
        """Estimated seconds until a request queued behind ``ahead`` others is answered as a
        hit: its batch's wait to fill (none when the queue fills it), then the batches
        ahead and its own at the front stage's mean batch time."""
        fill = 0.0 if ahead + 1 >= self.options.max_batch else self.options.max_wait
        return fill + (ahead // self.options.max_batch + 1) * self.service["front"].mean

    def _live(self, requests: list[Request], stage: str) -> list[Request]:
        """The requests still to compute before ``stage`` ("queue": the acquire; "history":
        the history pass; "score": a scoring call): those past their deadline are answered
        504 deadline, those the HTTP layer gave up on are dropped, both counted; answered
        ones (refused at the hand-off) are left out."""
        now, live = time.perf_counter(), []
        for request in requests:
            if request.answered:
                continue
            if request.cancelled or now >= request.deadline:
                self.metrics.dropped.labels(stage, request.cancelled or "deadline").inc()
                request.answer(expired(request))  # ignored where the HTTP layer gave up
            else:
                live.append(request)
        return live

    def _front(self) -> None:
        while (batch := self.queue.take(self.options.max_batch,
                                        self.options.max_wait)) is not None:
            taken = time.perf_counter()
            self.metrics.batch.observe(len(batch))
            for request in batch:
                request.timings["queue"] = taken - request.arrival
            batch = self._live(batch, "queue")
            if not batch:
                continue
            groups = {}
            for request in batch:
                groups.setdefault(request.key, []).append(request)
            self._busy_since["front"] = taken
            _guard(batch, self._place, list(groups.values()), next(self._batches),
                   self.model)
            self._busy_since["front"] = None
            self.service["front"].add(time.perf_counter() - taken)

    def _place(self, groups: list[list[Request]], batch_number: int, model: Model) -> None:
        """Acquire the rows (one per group of equal keys) under ``model``'s store versions,
        answer the hits, hand the misses on; split on RA222 (after its timeout, the groups
        whose entries were never written are refused and the rest placed)."""
        users, versions, lengths = self.store_keys([g[0].key for g in groups], model,
                                                   batch_number)
        start = time.perf_counter()
        try:
            lease = self.store.acquire(users, versions, lengths,
                                       timeout=self.options.acquire_timeout)
        except RankattnError as err:
            if err.code != "RA222":
                raise
            if time.perf_counter() - start >= self.options.acquire_timeout:
                # RA222 comes at once when what could make room is pinned, and after the
                # timeout when an entry the rows match was never written (a fault: the
                # front stage only takes keys that no job is writing). Only the groups
                # waiting on such an entry are refused; the rest of the batch is placed.
                stuck = self.store.unwritten(users, versions, lengths)
                if not stuck.any():  # written since: nothing to tell apart
                    stuck[:] = True
                log.error("acquire timed out; %d of its batch's %d users are answered 503 "
                          "store_timeout: %s", stuck.sum(), len(groups), err)
                _answer_all([r for g, s in zip(groups, stuck) if s for r in g], unavailable(
                    "store_timeout", f"the history store did not place this request within "
                    f"{1e3 * self.options.acquire_timeout:.0f} ms (--acquire-timeout-ms): it "
                    "waited for a history that was never written.", "Retry; if it persists "
                    "the server's log has the cause (a fault: please report it)."))
                rest = [g for g, s in zip(groups, stuck) if not s]
                if rest:
                    _guard([r for g in rest for r in g], self._place, rest, batch_number,
                           model)
                return
            if len(groups) > 1:
                half = len(groups) // 2
                for part in (groups[:half], groups[half:]):
                    # Each half answers its own failure: the first half's misses may be the
                    # history stage's already.
                    _guard([r for g in part for r in g], self._place, part, batch_number,
                           model)
                return
            _answer_all(groups[0], unavailable(
                "cache_full", "the history store is full of histories that requests in "
                "flight are using.", "Retry after the Retry-After seconds; if this is "
                "frequent, start the server with more --device-pages (room for 3 * "
                "--max-batch of the longest histories does not fill while the history "
                "stage keeps up; a backlog of misses holds more), or fewer --max-batch."))
            return
        try:
            spent = time.perf_counter() - start
            misses = [i for i, source in enumerate(lease.source) if source == "miss"]
            for group in groups:
                for request in group:
                    request.timings["store"] = spent
                    request.batch_had_misses = bool(misses)
            hits = [i for i, source in enumerate(lease.source) if source != "miss"]
            if hits:
                self._score([groups[i] for i in hits], lease.slots[hits],
                            [lease.source[i] for i in hits], model)
            if misses and self._hand_off(lease, groups, misses, model):
                lease = None  # the history stage releases it
        finally:
            if lease is not None:
                self.store.release(lease)

    def _hand_off(self, lease, groups: list[list[Request]], misses: list[int],
                  model: Model) -> bool:
        """Queue the lease's misses for the history stage (never blocking); False, and the
        caller releases the lease, when none is left to compute: the requests that the
        history stage cannot answer before their deadline (its jobs ahead and this one at
        its mean job time) are refused 503 overloaded first."""
        wait = ((self.jobs + self._history_busy + 1)
                * self.service["history"].mean)
        late = time.perf_counter() + wait
        requests = [r for i in misses for r in groups[i]]
        refused = [r for r in requests if late > r.deadline]
        _answer_all(refused, unavailable(
            "overloaded", f"the history stage is busy: the server estimates {1e3 * wait:.0f} "
            "ms before it could compute this request's history, past its deadline.",
            OVERLOADED_FIX))
        if len(refused) == len(requests):
            return False
        if self.options.cache:
            self.queue.hold(groups[i][0].key for i in misses)
        self._jobs.put(_Job(lease, groups, misses, time.perf_counter(), model))
        return True

    def _history(self) -> None:
        while (job := self._jobs.get()) is not None:
            self._history_busy = True
            self._busy_since["history"] = time.perf_counter()
            requests = [r for i in job.misses for r in job.groups[i]]
            _guard(requests, self._compute, job)
            self._busy_since["history"] = None
            self._history_busy = False

    def _compute(self, job: _Job) -> None:
        """The misses of one job: history pass, write, score, answer, release; the pass is
        skipped when none of its requests is left to answer."""
        miss_groups = [job.groups[i] for i in job.misses]
        keys = [g[0].key for g in miss_groups] if self.options.cache else []
        written = False
        try:
            if not self._live([r for g in miss_groups for r in g], "history"):
                return
            start = time.perf_counter()
            rows = [None] * len(job.groups)
            for i in job.misses:
                rows[i] = job.groups[i][0]
            self._history_pass(job.lease, rows, job.model)
            self.queue.free(keys)  # written: the queue may take these keys (they hit)
            written = True
            spent = time.perf_counter() - start
            self.metrics.call("history", len(job.misses), spent)
            for group in miss_groups:
                for request in group:
                    request.timings.update(history_wait=start - job.handed, history=spent)
            self._score(miss_groups, job.lease.slots[job.misses], ["miss"] * len(job.misses),
                        job.model)
            self.service["history"].add(time.perf_counter() - start)
        finally:
            try:
                self.store.release(job.lease)
            finally:  # even when the release raises (RA224): a key held for good would
                # keep its requests in the queue until their deadlines, and stop() waiting
                if not written:  # released unwritten, the entries are dropped: the keys miss
                    self.queue.free(keys)

    def _history_pass(self, lease, rows: list[Request | None], model: Model) -> None:
        """The history pass (by ``model``) of the lease rows that miss (``rows[i]``: row
        i's request, None for rows that hit), in the token bucket of the longest, and their
        write."""
        missing = [r for r in rows if r is not None]
        tokens = Buckets.fit(max(r.key[2] for r in missing), self.shapes.tokens)
        sessions = _sessions(rows, len(rows), tokens - 1, 0)
        serve.fill_misses(self.store, lease, model.graphdef, model.params, sessions,
                          self.anchor)
        shape = f"history {1 << (len(missing) - 1).bit_length()}x{tokens}"  # fill_misses' rows
        for request in missing:
            request.shapes.append(shape)

    def _score(self, groups: list[list[Request]], slots, sources: list[str],
               model: Model) -> None:
        """Score the live requests of ``groups`` (group i reads cache slot ``slots[i]``) in
        one call by ``model``, and answer each (with its step)."""
        kept = [(live, slot, source) for group, slot, source in zip(groups, slots, sources)
                if (live := self._live(group, "score"))]
        if not kept:
            return
        groups, slots, sources = zip(*kept)
        requests = [r for g in groups for r in g]
        row_slots = np.repeat(np.asarray(slots, np.int32), [len(g) for g in groups])
        start = time.perf_counter()
        logits = self._logits(requests, row_slots, model)
        spent = time.perf_counter() - start
        self.metrics.call("score", len(requests), spent)
        row_sources = [s for g, s in zip(groups, sources) for _ in g]
        shape = "score {}x{}".format(*logits.shape[:2])
        for request, row, source in zip(requests, logits, row_sources):
            request.timings["score"] = spent
            request.shapes.append(shape)
            cache = source if self.options.cache else "off"
            request.answer(ranked(request, row[:len(request.cand_item)], cache,
                                  model.step))

    def _logits(self, requests: list[Request], slots: np.ndarray,
                model: Model) -> np.ndarray:
        """Logits [rows, C, A] by ``model`` of the requests' candidates against cache slots
        ``slots``, rows and candidates padded to their buckets (padding rows read the first
        slot)."""
        rows = Buckets.fit(len(requests), self.shapes.rows)
        width = Buckets.fit(max(len(r.cand_item) for r in requests), self.shapes.candidates)
        sessions = _sessions(requests, rows, 0, width)
        slots = padded(np.asarray(slots, np.int32), rows, 0, slots[0])
        return serve.score_rows(self.store, model.graphdef, model.params, sessions, slots,
                                self.anchor)


def store_version(version: int, *salt: int) -> int:
    """``version`` (a request's history digest) folded with ``salt`` (a model's step and
    serial, and with --no-cache a batch number): a 63-bit digest, the store's version."""
    digest = hashlib.blake2b(digest_size=8)
    digest.update(np.array((version,) + salt, np.uint64).tobytes())
    return int.from_bytes(digest.digest(), "little") >> 1


def _signature(params) -> list:
    """(path, shape, dtype) of every parameter array: what the compiled programs key on."""
    return [(path, x.shape, x.dtype) for path, x in
            jax.tree_util.tree_leaves_with_path(params)]


def _answer_all(requests: list[Request], answer: Answer) -> None:
    for request in requests:
        request.answer(answer)


def _guard(requests: list[Request], step, *args) -> None:
    """Run ``step``; if it fails, answer the requests it left unanswered (the traceback goes
    to the log), so that no accepted request goes without an answer: 503 store_failed when a
    store copy or update failed (RA224, e.g. out of memory: the store dropped the entries, a
    retry recomputes them), else 500 internal (a bug)."""
    try:
        step(*args)
    except Exception as err:  # noqa: BLE001 - answered, logged, and the stage goes on
        log.exception("serving a batch failed")
        if isinstance(err, RankattnError) and err.code == "RA224":
            answer = unavailable("store_failed", "the history store failed to copy or write "
                                 "this request's history (the log has why, e.g. out of "
                                 "memory) and dropped it.", "Retry: the history is then "
                                 "recomputed. If it recurs, give the server more memory or a "
                                 "smaller store (--device-pages, --host-pages).")
        else:
            answer = Answer(500, {"error": {
                "kind": "internal", "field": None, "message": "the server failed on this "
                "request's batch.", "fix": "Retry; the server's log has the traceback (a "
                "bug: please report it)."}}, kind="internal")
        _answer_all(requests, answer)


def _sessions(requests: list[Request | None], rows: int, events: int,
              candidates: int) -> Sessions:
    """Sessions [rows] of ``requests`` (None and rows past them: empty), histories padded to
    ``events`` events and candidates to ``candidates``."""
    a = len(ACTIONS)
    ints = lambda *shape: np.zeros((rows,) + shape, np.int64)  # noqa: E731
    out = Sessions(user=ints(), context=ints(), history_len=ints(),
                   history_item=ints(events), history_author=ints(events),
                   history_actions=np.zeros((rows, events, a), bool),
                   cand_item=ints(candidates), cand_author=ints(candidates),
                   labels=np.zeros((rows, candidates, a), np.float32),
                   probs=np.zeros((rows, candidates, a), np.float32))
    for i, request in enumerate(requests):
        if request is None:
            continue
        out.user[i], out.context[i] = request.user, request.context
        if events:
            n = out.history_len[i] = len(request.history_item)
            out.history_item[i, :n] = request.history_item
            out.history_author[i, :n] = request.history_author
            out.history_actions[i, :n] = request.history_actions
        if candidates:
            c = len(request.cand_item)
            out.cand_item[i, :c], out.cand_author[i, :c] = request.cand_item, request.cand_author
    return out


def _made_up(i: int, events: int, candidates: int, version: int) -> Request:
    """Warm-up's request i: user id ID_LIMIT - 1 - i (warm-up drops it), ``events`` events and
    ``candidates`` candidates of item 1, with store version ``version``."""
    ones = lambda n: np.ones(n, np.int64)  # noqa: E731
    return Request(ID_LIMIT - 1 - i, 0, ones(events), ones(events),
                   np.zeros((events, len(ACTIONS)), bool), ones(candidates), ones(candidates),
                   None, version, reply=lambda answer: None)
