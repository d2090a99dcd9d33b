"""serving.HistoryStore, rule by rule, and under threads (tests/test_store.py drives it at
random against a model of the same rules)."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

import rankattn
from rankattn import serving
from test_serving_errors import raises
from test_store import check_rows, history_kv, write_rows

CONFIG = dict(num_layers=2, kv_heads=1, head_dim=4, page_size=4, device_pages=8, max_users=4,
              max_pages_per_user=4, host_pages=4, max_batch=4, history="bidirectional")


@pytest.fixture(scope="module")
def shared():
    return serving.HistoryStore(**CONFIG)


@pytest.fixture
def store(shared):
    """The module's store, emptied: its programs compile once for every test here."""
    shared.clear()
    return shared


def acquired(store, rows, write=True, config=CONFIG):
    lease = store.acquire(*map(list, zip(*rows)))
    if write:
        write_rows(store, lease, config)
    return lease


def test_a_pinned_entry_survives_while_a_new_version_takes_a_fresh_slot(store):
    old = acquired(store, [(1, 0, 6)])
    new = acquired(store, [(1, 1, 9)])                  # user 1's next version, old pinned
    assert new.source == ["miss"] and new.slots[0] != old.slots[0]
    check_rows(store, old, CONFIG)                      # the old entry is still its history
    check_rows(store, new, CONFIG)
    assert store.stats()["invalidations"] == 1
    used = store.stats()["device_pages_used"]
    store.release(old)                                  # freed at its last release
    assert store.stats()["device_pages_used"] == used - 2
    again = acquired(store, [(1, 1, 9)], write=False)
    assert again.source == ["device"] and again.slots[0] == new.slots[0]
    for lease in (new, again):
        store.release(lease)


def test_a_failed_acquire_changes_nothing(store):
    held = [acquired(store, [(u, 0, 8)]) for u in range(4)]  # every slot pinned
    before = store.stats()
    with raises("RA222", "pinned"):
        store.acquire([9, 1], [0, 0], [4, 8])           # row 1 hits; row 0 cannot be placed
    assert store.stats() == before
    with raises("RA221", "17 tokens", "max_pages_per_user"):
        store.acquire([1, 5], [0, 0], [8, 17])
    assert store.stats() == before
    for lease in held:
        check_rows(store, lease, CONFIG)
        store.release(lease)
    evictions = store.stats()["evictions"]  # a count since the module's store was built
    lease = acquired(store, [(9, 0, 4)])
    assert lease.source == ["miss"] and store.stats()["evictions"] - evictions == 1
    store.release(lease)


def test_a_call_larger_than_the_store_is_refused_as_such_at_once(store):
    """Regression (review): a call that could never fit, even in an empty store (more
    distinct users than slots, or more pages than the device has), was RA222's "retry once
    leases are released", whose free counts were what the call's earlier rows would have
    left, naming 0 pinned entries. Now RA222 says the call is larger than the store and must
    be split, before it waits for anything; a store that is full gives its real counts."""
    writer = store.acquire([0], [0], [4])  # unwritten: a call that could fit would wait
    before = store.stats()
    for rows, fragment in ((([0, 1, 2, 3, 4], [0] * 5, [4] * 5), "5 distinct users"),
                           (([0, 1, 2], [0] * 3, [4, 16, 16]), "9 pages of 4 tokens")):
        with raises("RA222", "larger than the whole store", "a retry will not help",
                    "max_users = 4", "device_pages = 8", "Split the rows", fragment):
            store.acquire(*rows, timeout=5)
    assert store.stats() == before
    store.release(writer)
    held = [acquired(store, [(u, 0, 8)]) for u in range(3)]  # 3 slots and 6 pages pinned
    with raises("RA222", "2 of 8 pages and 1 of 4 slots are free", "3 entries are pinned"):
        store.acquire([7, 8], [0, 0], [4, 4])  # 2 slots: the second row finds none
    for lease in held:
        store.release(lease)


def test_a_spilled_history_holds_only_its_own_pages_in_host_memory(store):
    """Regression (review): the host tier kept a view of the spill's gather, padded to a
    power-of-two bucket of pages, so it kept up to twice the pages it counts alive."""
    for user, length in ((1, 12), (2, 16), (3, 8)):  # 3 + 4 + 2 of 8 pages: user 1 spilled
        with acquired(store, [(user, 0, length)]):
            pass
    assert store.stats()["host_pages_used"] == 3
    for x in store._index[1].snapshot:  # the arrays the host tier keeps (bucket: 4 pages)
        assert x.shape[1] == 3 and x.base is None, (x.shape, type(x.base))
    with store.acquire([1], [0], [12]) as lease:
        assert lease.source == ["host"]
        check_rows(store, lease, CONFIG)


def test_pinned_entries_counts_leases_held_on_replaced_and_cleared_entries(store):
    """Regression (review): stats()["pinned_entries"] counted the device's current entries
    only, so a lease still held on an entry a newer version or clear() replaced (whose
    pages stay taken until it is released) was invisible to a leak check."""
    replaced = acquired(store, [(1, 0, 8)])
    with acquired(store, [(1, 1, 4)]):  # user 1's next version
        pass
    cleared = acquired(store, [(2, 0, 4)])
    store.clear()
    stats = store.stats()
    assert (stats["pinned_entries"], stats["device_entries"], stats["device_pages_used"]) == (
        2, 0, 3), stats
    for lease in (replaced, cleared):
        store.release(lease)
    stats = store.stats()
    assert (stats["pinned_entries"], stats["device_pages_used"]) == (0, 0), stats


def test_one_user_twice_in_a_call(store):
    lease = acquired(store, [(2, 0, 5), (3, 0, 3), (2, 0, 5)])
    assert lease.slots[0] == lease.slots[2] and lease.source == ["miss", "miss", "miss"]
    check_rows(store, lease, CONFIG)
    store.release(lease)
    with raises("RA220", "user 2", "(0, 5)", "(1, 5)"):
        store.acquire([2, 2], [0, 1], [5, 5])


def test_ids_and_versions_past_int64_are_refused_not_wrapped_onto_another_entry(store):
    """Regression: numpy made 2**63 a uint64 that became -2**63, so version 2**63's history
    was served to version -2**63 as a hit (and 2**64 raised a bare OverflowError)."""
    stats = store.stats()
    for rows in ([[1], [2**63], [3]], [[2**63], [0], [3]], [[1], [2**64], [3]],
                 [[1], np.array([2**63], np.uint64), [3]]):
        with raises("RA220", "outside the signed 64-bit range", "2**63"):
            store.acquire(*rows)
    assert store.stats() == stats
    edge = -2**63
    with acquired(store, [(1, edge, 3), (2**63 - 1, 0, 3)]) as lease:
        assert lease.source == ["miss", "miss"]
    with store.acquire([1], [2**63 - 1], [3]) as other_version:
        assert other_version.source == ["miss"]


def test_write_rows_outside_the_lease_are_ra223_naming_rows(store):
    with store.acquire([1, 2], [0, 0], [3, 3]) as lease:
        k = np.zeros((2, 1, 3, 1, 4), np.float32)
        for rows in ([5], [-1], [0.0], [[0]]):
            with raises("RA223", "rows must be", "[0, 2)"):
                store.write(lease, k, k, rows=rows)
        assert not lease.written


def test_a_float16_store_refuses_a_value_it_would_store_as_inf():
    """Regression: a float16 store wrote 1e5 as inf and every score over it was NaN (append
    refused it with RA214; write did not). Now RA214 naming the row, user and value, nothing
    written; the same lease then takes values that fit, and a padded token past the row's
    missing ones may hold anything."""
    store = serving.HistoryStore(**{**CONFIG, "num_layers": 1, "host_pages": 0},
                                 dtype=np.float16)
    with store.acquire([7, 8], [0, 0], [3, 2]) as lease:
        k = np.ones((1, 2, 3, 1, 4), np.float32)
        v = k.copy()
        v[0, 1, 1, 0, 2] = 1e5
        k[0, 1, 2] = 1e9                    # row 1 misses 2 tokens: its third is padding
        with raises("RA214", "v row 1 (user 8)", "100000", "float16"):
            store.write(lease, k, v)
        assert not lease.written
        v[0, 1, 1, 0, 2] = 6e4
        store.write(lease, k, v)
        with store.reading() as cache:
            assert np.isfinite(np.asarray(cache.v_pages, np.float32)).all()


def test_a_release_without_a_write_drops_what_it_placed(store):
    lease = store.acquire([4], [0], [7])
    assert lease.missing.tolist() == [7]
    store.release(lease)
    assert store.stats()["device_pages_used"] == 0
    with acquired(store, [(4, 0, 7)]) as again:
        assert again.source == ["miss"]


def test_unwritten_names_the_rows_an_acquire_would_wait_for(store):
    with acquired(store, [(1, 0, 3)]):
        writer = store.acquire([2, 3], [0, 0], [4, 4])  # placed, not yet written
        rows = ([1, 2, 3], [0, 0, 0], [3, 4, 5])  # user 3's length does not match
        assert store.unwritten(*rows).tolist() == [False, True, False]
        assert store.unwritten([2], [1], [4]).tolist() == [False]  # nor another version
        write_rows(store, writer, CONFIG)
        assert not store.unwritten(*rows).any()
        store.release(writer)


class Waiting:
    """``event`` is set once another thread's acquire waits for an unwritten entry (the only
    wait on the store's policy lock), so a test goes on when it has blocked, not after a
    sleep. It is set under that lock: whoever takes the lock next finds the acquire
    waiting."""

    def __init__(self, store, patch):
        self.event, self._wait = threading.Event(), store._lock.wait
        patch.setattr(store._lock, "wait", self)

    def __call__(self, *args, **kwargs):
        self.event.set()
        return self._wait(*args, **kwargs)


def test_an_acquire_waits_for_the_write_it_matches(store, monkeypatch):
    writer = store.acquire([5], [0], [6])
    got = {}

    def reader():
        got["lease"] = store.acquire([5], [0], [6])
        got["at"] = time.monotonic()

    waiting = Waiting(store, monkeypatch)
    thread = threading.Thread(target=reader)
    thread.start()
    assert waiting.event.wait(10), "the acquire never waited for the unwritten entry"
    assert "lease" not in got, "an acquire saw an entry that was not written yet"
    written = time.monotonic()
    write_rows(store, writer, CONFIG)
    thread.join(10)
    assert got["at"] >= written and got["lease"].source == ["device"]
    check_rows(store, got["lease"], CONFIG)
    with raises("RA222", "yet to write"):
        other = store.acquire([6], [0], [3])
        store.acquire([6], [0], [3], timeout=0.05)
    for lease in (writer, got["lease"], other):
        store.release(lease)


def test_a_waiting_acquire_wakes_when_another_acquire_replaces_its_entry(store, monkeypatch):
    """Regression (review): an acquire waiting for an unwritten entry was not woken when
    another acquire replaced that entry (a new version of the user), and waited its whole
    timeout for an entry it could no longer get."""
    writer = store.acquire([1], [0], [8])  # placed, not yet written
    got = {}

    def reader():
        start = time.monotonic()
        got["lease"] = store.acquire([1], [0], [8], timeout=6)
        got["waited"] = time.monotonic() - start

    waiting = Waiting(store, monkeypatch)
    thread = threading.Thread(target=reader)
    thread.start()
    assert waiting.event.wait(10), "the acquire never waited for the unwritten entry"
    newer = store.acquire([1], [1], [8])  # hides the entry the reader waits for
    thread.join(10)
    assert got["waited"] < 3, got  # woken at once, not at its timeout
    assert got["lease"].source == ["miss"]  # its version again, in a fresh slot
    for lease in (writer, newer, got["lease"]):
        store.release(lease)
    stats = store.stats()
    assert (stats["pinned_entries"], stats["device_pages_used"]) == (0, 0), stats


def test_leases_are_released_once_and_written_once(store):
    with acquired(store, [(7, 0, 3)]) as lease:
        with raises("RA223", "twice"):
            write_rows(store, lease, CONFIG)
    with raises("RA223", "already released"):
        store.release(lease)
    lease = store.acquire([7], [0], [5])
    with raises("RA223", "[2, 1, >= 5, 1, 4]"):
        store.write(lease, np.zeros((2, 1, 1, 1, 4), np.float32), np.zeros((2, 1, 1, 1, 4)))
    with store.reading():
        with raises("RA223", "inside store.reading()"):
            store.release(lease)
    store.release(lease)


@pytest.mark.parametrize("kwargs, fragment", [
    (dict(device_pages=0), "device_pages=0"),
    (dict(history="sliding"), "history='sliding'"),
    (dict(max_pages_per_user=9), "exceeds device_pages=8"),
    (dict(host_pages=-1), "host_pages=-1"),
    (dict(policy="lfu"), "policy='lfu'; pass one of ['lru', 's3fifo']"),
    # Regression (review): these were empty_cache's RA213 / RA212, naming its arguments.
    (dict(dtype=np.int32), "HistoryStore cannot build its cache (empty_cache dtype=int32"),
    (dict(device_pages=2**31, max_pages_per_user=1), "device_pages and max_pages_per_user"),
])
def test_bad_options_raise_ra219(kwargs, fragment):
    with raises("RA219", fragment):
        serving.HistoryStore(**{**CONFIG, **kwargs})


def test_bad_rows_name_the_call_they_were_given_to(store):
    """Regression (review): unwritten()'s bad rows were reported as acquire's."""
    for call in (store.acquire, store.unwritten):
        with raises("RA220", f"{call.__name__}: lengths holds [-1]"):
            call([1], [0], [-1])


def test_warmup_compiles_every_program_once():
    store = serving.HistoryStore(**{**CONFIG, "max_batch": 2, "max_pages_per_user": 2})
    count = store.warmup()
    assert count == store.buckets.programs() == 2 * 2 + 2 + 2 * 2
    lease = acquired(store, [(1, 0, 8), (2, 0, 3)])
    check_rows(store, lease, {**CONFIG, "max_pages_per_user": 2})
    store.release(lease)
    assert store.stats()["compiled_programs"] == count


def test_threads_acquire_write_and_release_overlapping_users(store):
    """8 threads, 6 users over 4 slots: hits, misses, evictions, spills and restores race;
    every lease's rows equal their current history, and the store ends consistent."""
    errors, done, refused = [], [], []
    lock = threading.Lock()
    versions = {u: 0 for u in range(6)}

    def worker(seed):
        rng = np.random.default_rng(seed)
        try:
            for step in range(6):
                users = [int(u) for u in rng.choice(6, 2, replace=False)]
                with lock:
                    if rng.random() < 0.2:
                        versions[users[0]] += 1
                    rows = [(u, versions[u], 3 + (u + versions[u]) % 10) for u in users]
                # What a client does with a 503 and Retry-After, for as long as the other
                # threads may hold every slot on a loaded machine (1000 tries were not enough).
                deadline = time.monotonic() + 60
                while True:
                    try:
                        lease = store.acquire(*map(list, zip(*rows)), timeout=30)
                        break
                    except rankattn.RankattnError as e:
                        assert e.code == "RA222", str(e)  # all pinned by the other threads
                        assert time.monotonic() < deadline, f"refused for 60 s: {e}"
                        refused.append(e)
                        time.sleep(0.002)
                with lease:
                    if lease.missing.any():
                        write_rows(store, lease, CONFIG)
                    check_rows(store, lease, CONFIG, seed=seed * 10 + step)
                done.append(lease.source)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert not errors, errors[0]
    stats = store.stats()
    assert stats["pinned_entries"] == 0 and len(done) == 8 * 6 and refused
    sources = {s for row in done for s in row}
    assert {"device", "miss"} <= sources, sources
    # clear() frees every entry no lease pins: a pin leaked on any entry, a replaced one
    # included, would keep its pages.
    store.clear()
    stats = store.stats()
    assert (stats["device_pages_used"], stats["host_pages_used"]) == (0, 0), stats


def test_write_takes_only_the_rows_that_miss(store):
    """rows= names the lease rows k / v hold: a history pass runs only on what misses."""
    first = acquired(store, [(1, 0, 6)])
    lease = store.acquire([1, 2, 3, 2], [0, 0, 0, 0], [6, 5, 9, 5])
    assert lease.source == ["device", "miss", "miss", "miss"]
    with raises("RA223", "rows [2]", "rows=[1]"):
        store.write(lease, np.zeros((2, 1, 9, 1, 4), np.float32),
                    np.zeros((2, 1, 9, 1, 4), np.float32), rows=[1])
    k, v = (np.zeros((2, 2, 9, 1, 4), np.float32) for _ in range(2))
    for i, (u, n) in enumerate([(2, 5), (3, 9)]):
        hk, hv = history_kv(2, 1, 4, u, 0, n, 0, n, causal=False)
        k[:, i, :n], v[:, i, :n] = hk, hv
    store.write(lease, k, v, rows=[3, 2])  # row 3 repeats row 1's user: one of them suffices
    check_rows(store, lease, CONFIG)
    for held in (first, lease):
        store.release(held)


@pytest.mark.parametrize("policy, kept", [("lru", False), ("s3fifo", True)])
def test_a_scan_of_new_users_flushes_lru_but_not_s3fifo(policy, kept):
    """Four users requested twice each, then a scan of eight one-off users through a store of
    five slots: LRU loses all four; S3-FIFO keeps them in its main queue and evicts the scan
    from its small one."""
    config = {**CONFIG, "device_pages": 40, "max_users": 5, "max_pages_per_user": 1,
              "host_pages": 0}
    store = serving.HistoryStore(**config, policy=policy)
    for user in [0, 1, 2, 3] * 2 + list(range(100, 108)):
        with acquired(store, [(user, 0, 3)], config=config):
            pass
    with store.acquire([0, 1, 2, 3], [0] * 4, [3] * 4) as lease:
        assert lease.source == (["device"] * 4 if kept else ["miss"] * 4), lease.source
