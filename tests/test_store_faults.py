"""serving.HistoryStore under stress (issue 36): calls that must answer while another thread
compiles or waits for a reader, copies and device updates that fail, and the count of
compiled programs. tests/test_store_rules.py tests the rules one by one."""

from __future__ import annotations

import logging
import queue
import threading
import time

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from rankattn import serving
from rankattn.serving import store as store_module
from rankattn.serving import store_device
from test_serving_errors import raises
from test_store import check_rows, write_rows
from test_store_rules import CONFIG, acquired, shared, store  # noqa: F401  (fixtures)

# A call that must answer does within WAIT seconds: thousands of times its quiet time (a
# stats() or a hit takes microseconds), and what it must not wait for is held far longer.
WAIT = 5.0


def finishes(fn, *args):
    """``fn(*args)`` on another thread: its result, or a failure if it has not returned within
    WAIT seconds (the call is then left blocked, on a daemon thread)."""
    out = queue.Queue()
    thread = threading.Thread(target=lambda: out.put(_outcome(fn, *args)), daemon=True)
    thread.start()
    return _result(out, fn)


def _outcome(fn, *args):
    try:
        return True, fn(*args)
    except BaseException as e:  # noqa: BLE001 - raised again by _result
        return False, e


def _result(out: queue.Queue, fn):
    try:
        ok, value = out.get(timeout=WAIT)
    except queue.Empty:
        pytest.fail(f"{fn.__qualname__} did not return within {WAIT} s")
    if not ok:
        raise value
    return value


def wait_for_a_waiting_update(store) -> None:
    """Until a device update waits for its turn (it reads stats(), never another thread's
    frames: reading a running thread's frame is an interpreter internal)."""
    deadline = time.monotonic() + WAIT
    while time.monotonic() < deadline:
        if store.stats()["device_updates_waiting"]:
            return
        time.sleep(0.001)
    pytest.fail("no device update ever waited")


class Reader:
    """A thread inside ``store.reading()`` that runs there the calls it is given."""

    def __init__(self, store):
        self.calls, self.out = queue.Queue(), queue.Queue()
        self.thread = threading.Thread(target=self._read, args=(store,), daemon=True)
        self.thread.start()
        assert self.out.get(timeout=WAIT) == (True, "inside")

    def _read(self, store):
        with store.reading():
            self.out.put((True, "inside"))
            for fn in iter(self.calls.get, None):
                self.out.put(_outcome(fn))

    def run(self, fn):
        self.calls.put(fn)
        return _result(self.out, fn)

    def leave(self):
        self.calls.put(None)
        self.thread.join(WAIT)
        assert not self.thread.is_alive()


class UpdateWaitingForReader:
    """A reader inside ``store.reading()``, and another thread's release, whose device update
    (the drop of an unwritten entry) waits for that reader to leave."""

    def __init__(self, store):
        self.store = store
        with acquired(store, [(2, 0, 4)]):  # a written entry: later acquires of it are hits
            pass
        lease = store.acquire([1], [0], [4])
        self.reader = Reader(store)
        self.update = threading.Thread(target=store.release, args=(lease,), daemon=True,
                                       name="release")
        self.update.start()
        wait_for_a_waiting_update(store)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.reader.leave()
        self.update.join(WAIT)
        assert not self.update.is_alive(), "the update never ran once the reader left"


# --- Nothing waits for a compile, or for an update that waits for a reader. --------------------


def test_stats_answers_while_warmup_compiles(monkeypatch):
    """Regression (issue 36, finding 1): warmup() held the store's lock through its whole
    compile, so a /metrics scrape (stats()) waited for it: 23.8 s in the audit."""
    store = serving.HistoryStore(**{**CONFIG, "max_batch": 1, "max_pages_per_user": 1})
    compiling, compiled = threading.Event(), threading.Event()
    drop = store_device.drop

    def slow_drop(*args):  # warm-up's first program: a compile as long as this test wants
        compiling.set()
        compiled.wait(WAIT * 4)
        return drop(*args)

    monkeypatch.setattr(store_device, "drop", slow_drop)
    warmup = threading.Thread(target=store.warmup, daemon=True)
    warmup.start()
    assert compiling.wait(WAIT)
    stats = finishes(store.stats)
    assert stats["device_pages_used"] == 0 and warmup.is_alive()
    compiled.set()
    warmup.join(WAIT * 4)
    assert not warmup.is_alive()


def test_stats_and_hits_answer_while_an_update_waits_for_a_reader(store):
    """Regression (issue 36, finding 1): an update waited for readers holding the store's
    lock, so stats() and every acquire waited for the slowest reader."""
    with UpdateWaitingForReader(store):
        stats = finishes(store.stats)  # the release is done; only its device update waits
        assert (stats["device_entries"], stats["pinned_entries"]) == (1, 0)
        hit = finishes(store.acquire, [2], [0], [4])
        assert hit.source == ["device"]
    store.release(hit)


def test_stats_inside_reading_while_another_thread_updates(store):
    """Regression (issue 36, finding 2): stats() inside reading() deadlocked against a writer
    that held the store's lock while it waited for that reader."""
    with UpdateWaitingForReader(store) as waiting:
        stats = waiting.reader.run(store.stats)
        assert (stats["device_entries"], stats["device_updates_waiting"]) == (1, 1)
        assert waiting.update.is_alive()  # still waiting for this reader
    assert store.stats()["device_updates_waiting"] == 0  # it ran once the reader left


# --- A failed copy or update unpins and drops what it was for. ---------------------------------


def simulated_failure(*args, **kwargs):
    raise RuntimeError("RESOURCE_EXHAUSTED: simulated device allocation failure")


def fill(store):
    """Users 0-3 (8 tokens: 2 pages each) written and released: every slot and page taken,
    user 0 least recently used."""
    for u in range(4):
        with acquired(store, [(u, 0, 8)]):
            pass


def assert_settled(store, device_entries, host_entries):
    """No pins; entries and pages as given (every entry here holds 2 pages)."""
    stats = store.stats()
    assert stats["pinned_entries"] == 0, stats
    assert (stats["device_entries"], stats["host_entries"]) == (device_entries, host_entries)
    assert stats["device_pages_used"] == 2 * device_entries, stats
    assert stats["host_pages_used"] == 2 * host_entries, stats


def test_a_failed_spill_drops_the_spilled_entry_and_unpins(store, monkeypatch):
    """Regression (issue 36, finding 3): a spill that failed left the store's slot and pages
    taken (or, failing in its copy, the call's rows pinned) and the user's entry never ready."""
    fill(store)
    with monkeypatch.context() as patch:
        patch.setattr(store_device, "gather", simulated_failure)
        with raises("RA224", "spill", "user 0", "simulated device allocation failure"):
            store.acquire([9], [0], [8])  # evicts user 0, whose spill fails
    assert_settled(store, 3, 0)
    for rows in ([(9, 0, 8)], [(0, 0, 8)]):  # both again, as misses
        lease = finishes(store.acquire, *map(list, zip(*rows)))
        assert lease.source == ["miss"]
        write_rows(store, lease, CONFIG)
        check_rows(store, lease, CONFIG)
        store.release(lease)
    assert_settled(store, 4, 1)  # the second miss spilled user 1


def test_a_failed_restore_drops_the_entry_and_unpins(store, monkeypatch):
    """Regression (issue 36, finding 3): a restore that failed kept its entry pinned and never
    ready, so the same key waited forever (RA222 after a timeout)."""
    fill(store)
    with acquired(store, [(9, 0, 8)]):  # user 0 spilled to the host tier
        pass
    assert_settled(store, 4, 1)
    with monkeypatch.context() as patch:
        patch.setattr(store_device, "restore", simulated_failure)
        with raises("RA224", "restor", "user 0", "simulated device allocation failure"):
            store.acquire([0], [0], [8])  # evicts user 1 (spilled), restores user 0: fails
    assert_settled(store, 3, 1)
    lease = finishes(store.acquire, [0], [0], [8])
    assert lease.source == ["miss"]
    write_rows(store, lease, CONFIG)
    check_rows(store, lease, CONFIG)
    store.release(lease)
    assert_settled(store, 4, 1)


def test_a_failed_write_drops_the_entry(store, monkeypatch):
    """Regression (issue 36, finding 3): a write that failed left its entries not ready and
    visible, so an acquire of the same key waited for a write that never came."""
    lease = store.acquire([5, 6], [0, 0], [8, 8])
    with monkeypatch.context() as patch:
        patch.setattr(store_device, "write", simulated_failure)
        with raises("RA224", "write", "users [5, 6]", "simulated device allocation failure"):
            write_rows(store, lease, CONFIG)
    again = finishes(store.acquire, [5], [0], [8])  # waits for nothing: a miss, fresh slot
    assert again.source == ["miss"] and again.slots[0] not in lease.slots
    store.release(lease)
    write_rows(store, again, CONFIG)
    check_rows(store, again, CONFIG)
    store.release(again)
    assert_settled(store, 1, 0)


def test_an_empty_history_never_reads_a_slot_whose_drop_failed(store, monkeypatch):
    """Regression (review): a failed drop left its slot's old length and page table on the
    device while the store counted the slot free, and a 0-token miss, ready at once and never
    written, took it and read the old user's history; the failed acquire also left that
    entry visible, so the same row came back as a hit, not the miss RA224 promises."""
    fill(store)
    with monkeypatch.context() as patch:
        patch.setattr(store_device, "drop", simulated_failure)
        with raises("RA224", "emptying", "simulated device allocation failure"):
            store.acquire([9], [0], [0])  # evicts user 0 (spilled); the slot's drop fails
    lease = finishes(store.acquire, [9], [0], [0])
    assert lease.source == ["miss"] and lease.cached.tolist() == [0]
    with store.reading() as cache:
        assert int(cache.lengths[0, lease.slots[0]]) == 0
        assert (np.asarray(cache.page_table[0, lease.slots[0]]) == -1).all()
    store.release(lease)
    assert finishes(store.stats)["pinned_entries"] == 0


class InterruptedWait:
    """``store``'s device condition, whose first wait on this thread raises KeyboardInterrupt:
    Ctrl-C while an update waits for its turn."""

    def __init__(self, store, patch):
        self.thread, self.wait = threading.current_thread(), store._device.wait
        patch.setattr(store._device, "wait", self)
        self.raised = False

    def __call__(self, *args, **kwargs):
        if threading.current_thread() is self.thread and not self.raised:
            self.raised = True
            raise KeyboardInterrupt
        return self.wait(*args, **kwargs)


def test_an_interrupted_acquire_leaves_no_pin_and_an_interrupted_warmup_no_turn(
        store, monkeypatch):
    """Regressions (review): Ctrl-C while an acquire's update waited for a reader left its
    rows pinned and its entries visible and unwritten for good (every later acquire of them
    timed out, RA222, and the slot could never be evicted); while warmup() waited, its turn
    was never taken, and every later update and reader waited for good."""
    fill(store)
    reader = Reader(store)
    with monkeypatch.context() as patch:
        interrupt = InterruptedWait(store, patch)
        with pytest.raises(KeyboardInterrupt):
            store.acquire([9], [0], [8])  # evicts user 0: its spill waits for the reader
        assert interrupt.raised
        with pytest.raises(KeyboardInterrupt):
            InterruptedWait(store, patch)
            store.warmup()
    reader.leave()
    assert finishes(store.stats)["pinned_entries"] == 0
    for user in (9, 0):  # the acquire's own row, and the user whose spill never ran
        lease = finishes(store.acquire, [user], [0], [8])
        assert lease.source == ["miss"]
        write_rows(store, lease, CONFIG)
        check_rows(store, lease, CONFIG)
        store.release(lease)


def interrupt(*args, **kwargs):
    raise KeyboardInterrupt


@pytest.mark.parametrize("where", ["placing its rows", "building its lease"])
def test_an_acquire_interrupted_before_its_lease_exists_unpins_and_drops_what_it_placed(
        store, monkeypatch, where):
    """Regression (review): an acquire pinned its rows and built its lease before its
    cleanup began, so Ctrl-C there (or while it placed them) left the rows pinned, or its
    entry and the spill it began never ready: every later acquire of them waited for good
    (RA222 after its timeout)."""
    fill(store)
    with monkeypatch.context() as patch:
        if where == "placing its rows":  # the policy hears of the new entries last
            patch.setattr(store._policy, "inserted", interrupt)
        else:
            patch.setattr(store_module, "Lease", interrupt)
        with pytest.raises(KeyboardInterrupt):
            store.acquire([9], [0], [8])  # evicts user 0 (spilled), places user 9
    assert_settled(store, 3, 0)  # user 0's spill was never copied: dropped
    for user in (9, 0):  # nothing left to wait for: both are misses at once
        lease = store.acquire([user], [0], [8], timeout=0)
        assert lease.source == ["miss"]
        write_rows(store, lease, CONFIG)
        check_rows(store, lease, CONFIG)
        store.release(lease)
    assert_settled(store, 4, 1)  # the second miss spilled user 1


# --- compiled_programs counts compilations. ----------------------------------------------------


def test_a_warmup_that_fails_midway_leaves_no_turn_behind(monkeypatch):
    """Regression (review of issue 36): warmup() took every program's turn first and made
    their padding inputs in between, so an allocation that failed left turns never run: every
    later update and reader waited for good, and the error came out raw. Now each program
    is made, issued and run in turn; the failure is RA224 and the store goes on."""
    # Shapes of its own (head_dim): programs another test's store built would not compile.
    config = {**CONFIG, "max_batch": 1, "max_pages_per_user": 2, "head_dim": 8}
    store = serving.HistoryStore(**config)
    zeros, made = jnp.zeros, []

    def failing_zeros(*args, **kwargs):  # the second padding input of warm-up cannot be made
        made.append(args)
        if len(made) == 2:
            raise RuntimeError("RESOURCE_EXHAUSTED: simulated device allocation failure")
        return zeros(*args, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(jnp, "zeros", failing_zeros)
        with raises("RA224", "warmup", "RESOURCE_EXHAUSTED", "building or running"):
            store.warmup()
    def read():
        with store.reading():
            return True

    assert finishes(read)  # no turn left waiting
    with acquired(store, [(1, 0, 4)], config=config) as lease:
        assert lease.source == ["miss"]
    assert finishes(store.stats)["pinned_entries"] == 0


def test_compiled_programs_counts_a_write_compiled_per_input_dtype(caplog):
    """Regression (issue 36, finding 6): three input dtypes compiled write three times while
    compiled_programs (a count of shapes) rose by one. JAX's own compile log is the witness."""
    config = {**CONFIG, "head_dim": 6}  # shapes no other test compiles
    store = serving.HistoryStore(**config)
    before = store.stats()["compiled_programs"]
    caplog.set_level(logging.DEBUG, logger="jax._src.interpreters.pxla")
    for user, dtype in enumerate((np.float32, np.float16, ml_dtypes.bfloat16)):
        lease = store.acquire([user], [0], [8])
        k = np.ones((2, 1, 8, 1, 6), dtype)
        store.write(lease, k, k)
        store.release(lease)
    compiled = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Compiling")]
    assert sum(m.startswith("Compiling jit(write) ") for m in compiled) == 3, compiled
    assert store.stats()["compiled_programs"] - before == len(compiled) == 3
    with store.reading() as cache:
        assert cache.k_pages.dtype == jnp.float32
