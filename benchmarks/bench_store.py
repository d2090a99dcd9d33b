"""History store benchmark: the reference ranker served through serving.HistoryStore.

    .venv/bin/python benchmarks/bench_store.py                  # writes benchmarks/STORE.md
    .venv/bin/python benchmarks/bench_store.py --smoke --out DIR  # tiny, DIR/STORE.md

Three measurements on the reference ranker's small preset (examples/ranker; freshly
initialised weights: speed does not depend on them), 64 candidates per request:

1. A request stream: Zipf(1.1) popularity over ten times more users than the store's
   device slots, with fewer device pages than the slots' longest histories need and a host
   tier, 10% of requests carrying a changed history (one new event), served one request at
   a time through the store. Each request's source (device hit, host restore, miss) is
   compared with an offline simulation of the same trace (a model of the store's rules,
   run sequentially, so the two must agree request by request), and the hit rate with
   Belady's MIN (evict the entry used furthest in the future; optimal only for entries of
   equal size). Per-request latency by source, and the compiled programs.
2. Per-request time, interleaved rounds on one user: a hit, a miss (history pass + write),
   and the store turned off (history pass + a fresh cache every request).
3. A host-tier restore against recomputing the same user's history (history pass + write),
   interleaved rounds. On a CPU-only machine both tiers are RAM: this measures the mechanism
   (copy and scatter), not a PCIe transfer.
4. Eviction policies: each of serving.EVICTION_POLICIES replays four traces through a real
   HistoryStore (the store's own code; K/V of one head of 8 dims, since hit rates depend only
   on the keys and sizes), beside Belady's MIN: measurement 1's trace, a Zipf trace with
   scans of one-off users, a short cold-start Zipf trace (about two requests per user) and
   MovieLens-100K's user visits. The MovieLens files come from the `recbole` wheel, fetched
   at run time into ~/.cache/rankattn (its license forbids redistributing the data: never
   committed); without it that row says why.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import datetime
import json
import os
import sys
import time
from pathlib import Path

import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # examples/ from the repository
import user_cache  # noqa: E402
from examples.ranker import serve  # noqa: E402
from examples.ranker.server import engine  # noqa: E402
from rankattn import peers, serving  # noqa: E402
from examples.ranker.config import ACTIONS, PRESETS  # noqa: E402
from examples.ranker.model import init  # noqa: E402
from examples.ranker.world import World  # noqa: E402

COMMAND = ".venv/bin/python benchmarks/bench_store.py  # from the repository root"
OUT = Path(__file__).with_name("STORE.md")
# device_pages: a quarter (smoke: half) of the room for every slot's longest history, so pages
# run out before slots do; host_pages: a host tier that fills and drops its oldest spills.
SMOKE = dict(users=40, device_users=4, device_pages=8, host_pages=8, requests=48, rounds=1,
             history=60, candidates=4)
FULL = dict(users=1000, device_users=100, device_pages=1600, host_pages=3200, requests=2000,
            rounds=15, history=None, candidates=64)
ZIPF, CHANGED = 1.1, 0.10
# Measurement 4's synthetic traces (users, requests; one page per user, a store of 10% of the
# users) and seeds; SMOKE_POLICIES is the smoke run's.
POLICY_TRACES = dict(scan=(1000, 4000), cold=(1000, 2000))
SCAN_EVERY, SCAN_LENGTH = 400, 100  # one-off users: a run of 100 after every 400 requests
POLICY_SEEDS = 5
SMOKE_POLICIES = dict(scan=(100, 450), cold=(100, 200))
MOVIELENS = ("recbole-1.2.1", "recbole==1.2.1", "recbole/dataset_example/ml-100k/ml-100k.inter")
VISIT_GAP_S = 1800  # MovieLens: a user's ratings less than 30 minutes apart are one visit


@dataclasses.dataclass
class Setup:
    preset: object
    world: World
    graphdef: object
    params: object
    anchor: int


def setup(smoke: bool, candidates: int, history: int | None) -> Setup:
    preset = PRESETS["small"]
    world_cfg = dataclasses.replace(preset.world, candidates=candidates)
    model = preset.model
    if smoke:  # a tiny model and world with the same code paths
        world_cfg = dataclasses.replace(world_cfg, users=200, items=300, authors=30,
                                        history_median=20, history_max=history)
        model = dataclasses.replace(model, width=32, layers=2, q_heads=4, kv_heads=2,
                                    head_dim=8, hash_buckets=257, hash_dim=8)
    preset = dataclasses.replace(preset, world=world_cfg, model=model)
    graphdef, params = init(model, len(ACTIONS), world_cfg.contexts, seed=0)
    return Setup(preset, World(world_cfg), graphdef, params, model.max_position)


# --- The trace and its offline simulations. ----------------------------------------------------


def make_trace(s: Setup, users: int, requests: int, seed: int = 0):
    """(sessions: one per user, the request order of user indices, and per request whether its
    user's history changed first). Popularity is Zipf over a random ranking of the users."""
    rng = np.random.default_rng(seed)
    sessions = s.world.sample(rng, users)
    sessions = dataclasses.replace(sessions, user=np.arange(1, users + 1))  # distinct users
    weights = 1.0 / np.arange(1, users + 1) ** ZIPF
    order = rng.permutation(users)[rng.choice(users, requests, p=weights / weights.sum())]
    return sessions, order, rng.random(requests) < CHANGED


def new_event(sessions, i: int, rng) -> None:
    """User i's history gains one event (its oldest dropped when full): a changed history."""
    n, cap = int(sessions.history_len[i]), sessions.history_item.shape[1]
    for field in ("history_item", "history_author", "history_actions"):
        row = getattr(sessions, field)[i]
        if n == cap:
            row[:-1] = row[1:].copy()
    at = min(n, cap - 1)
    sessions.history_item[i, at] = sessions.cand_item[i, 0]
    sessions.history_author[i, at] = sessions.cand_author[i, 0]
    sessions.history_actions[i, at] = rng.random(sessions.history_actions.shape[-1]) < 0.3
    sessions.history_len[i] = min(n + 1, cap)


def keys_of(sessions, order, changed, seed: int = 1):
    """The (user, version, length) of each request, applying the changes in order; the
    sessions end in their final state (a copy is changed)."""
    sessions = dataclasses.replace(sessions, **{
        f: getattr(sessions, f).copy() for f in ("history_item", "history_author",
                                                 "history_actions", "history_len")})
    rng = np.random.default_rng(seed)
    keys = []
    for i, change in zip(order, changed):
        if change:
            new_event(sessions, i, rng)
        keys.append((int(sessions.user[i]), serve.history_version(sessions, i),
                     1 + int(sessions.history_len[i])))
    return keys


def simulate(keys, slots: int, pages: int, page_size: int, policy: str,
             host_pages: int = 0) -> dict:
    """Each request's source ("device", "host" or "miss") in a store of ``slots`` entries,
    ``pages`` device pages and ``host_pages`` host pages serving ``keys`` one at a time, by a
    model of the policy written here from its rules (docs/serving.md), not from the store's
    code: a changed history drops the user's entry; room is made by evicting "lru" (the
    store's rule: the least recently used) or "min" (Belady: the entry next used furthest
    away) until a slot and the pages are free; an evicted entry moves to the host tier when
    it fits beside the entry this request restores, which drops its oldest spills for it;
    the same key comes back from there. Also counts the evictions made while a slot was
    free (the pages ran out)."""
    device: dict[int, tuple] = {}  # user -> (version, length); dict order: least recent first
    host: dict[int, tuple] = {}    # user -> (version, length); dict order: oldest spill first
    next_use = collections.defaultdict(collections.deque)
    for t, key in enumerate(keys):
        next_use[key].append(t)

    def size(entries) -> int:
        return sum(-(-length // page_size) for _, length in entries.values())

    sources, page_evictions = [], 0
    for user, version, length in keys:
        next_use[(user, version, length)].popleft()
        if device.get(user) == (version, length):
            sources.append("device")
            device[user] = device.pop(user)  # the most recent
            continue
        device.pop(user, None)  # a changed history: dropped, never spilled
        restoring = host.get(user) == (version, length)
        if not restoring:
            host.pop(user, None)
        need = -(-length // page_size)
        kept = need if restoring else 0  # host pages the restore holds until it is placed
        while len(device) + 1 > slots or size(device) + need > pages:
            page_evictions += len(device) < slots
            if policy == "lru":
                victim = next(iter(device))
            else:
                victim = max(device, key=lambda u: (next_use[(u, *device[u])] or [len(keys)])[0])
            spilled = device.pop(victim)
            pages_of = -(-spilled[1] // page_size)
            if pages_of <= host_pages - kept:
                while size(host) + pages_of > host_pages:
                    del host[next(u for u in host if u != user)]
                host[victim] = spilled
        if restoring:
            del host[user]
        device[user] = (version, length)
        sources.append("host" if restoring else "miss")
    counts = collections.Counter(sources)
    return dict(sources=sources, hits=counts["device"], host_hits=counts["host"],
                misses=counts["miss"], hit_rate=counts["device"] / len(keys),
                page_evictions=page_evictions)


# --- Measurements. -----------------------------------------------------------------------------


class Compiles:
    """Programs JAX has built in this process, so that a request which built one is left out
    of the latencies: the first requests build the ranker's, and the store builds some of its
    own during the stream (a token bucket's). Counted by the event the store and the server
    count theirs by (one lowering per program built, compilation cache or not)."""

    def __init__(self):
        self.count = 0
        jax.monitoring.register_event_duration_secs_listener(self._event)

    def _event(self, name: str, seconds: float, **kwargs):
        if name == engine.LOWERING_EVENT:
            self.count += 1


COMPILES = Compiles()


def stream(s: Setup, cfg: dict) -> dict:
    """Measurement 1: the trace through a store of cfg["device_users"] slots."""
    sessions, order, changed = make_trace(s, cfg["users"], cfg["requests"])
    keys = keys_of(sessions, order, changed)
    history_max = s.preset.world.history_max
    store = serve.make_store(s.preset.model, history_max, users=cfg["device_users"],
                             device_pages=cfg["device_pages"], host_pages=cfg["host_pages"])
    warm = store.warmup()
    live = dataclasses.replace(sessions, **{
        f: getattr(sessions, f).copy() for f in ("history_item", "history_author",
                                                 "history_actions", "history_len")})
    rng = np.random.default_rng(1)
    times = collections.defaultdict(list)
    sources = []
    compiled = 0  # requests that built a program: untimed
    for i, change in zip(order, changed):
        if change:
            new_event(live, i, rng)
        one = live.take(np.array([i]))
        built = COMPILES.count
        start = time.perf_counter()
        _, got = serve.store_logits(store, s.graphdef, s.params, one, s.anchor)
        elapsed = time.perf_counter() - start
        sources.append(got[0])
        if COMPILES.count != built:
            compiled += 1
            continue
        times[got[0]].append(elapsed)
    stats = store.stats()
    args = (cfg["device_users"], store.num_pages, serve.PAGE_SIZE)
    lru = simulate(keys, *args, "lru", store.host_capacity)
    differ = [i for i, (a, b) in enumerate(zip(sources, lru["sources"])) if a != b]
    return dict(requests=len(keys), users=cfg["users"], device_users=cfg["device_users"],
                device_pages=store.num_pages, room=cfg["device_users"] * store.max_pages,
                host_pages=store.host_capacity, hits=stats["hits"],
                host_hits=stats["host_hits"], misses=stats["misses"],
                invalidations=stats["invalidations"], evictions=stats["evictions"],
                host_evictions=stats["host_evictions"], hit_rate=stats["hits"] / len(keys),
                sources=sources, lru=lru, agree=len(keys) - len(differ),
                first_difference=differ[0] if differ else None,
                belady=simulate(keys, *args, "min", store.host_capacity),
                median_ms={k: 1e3 * float(np.median(v)) for k, v in times.items()},
                timed={k: len(v) for k, v in times.items()}, compiled=compiled,
                programs_after_warmup=warm, programs_after_stream=stats["compiled_programs"],
                program_bound=store.buckets.programs())


def per_request(s: Setup, cfg: dict) -> dict:
    """Measurement 2: a hit, a miss and the store turned off, interleaved, on one user with the
    world's longest history. Each timed call comes right after an untimed one of its own kind
    (for a hit, the call that caches the user's current version again after the last miss),
    so that all three find their programs and data equally warm; the ratios are per round."""
    sessions = s.world.sample(np.random.default_rng(5), 1, long=True)
    store = serve.make_store(s.preset.model, s.preset.world.history_max, users=2)
    store.warmup()
    version = [0]

    def hit():
        return serve.store_logits(store, s.graphdef, s.params, sessions, s.anchor)[0]

    def miss():  # a new context: another version of the same user's history
        version[0] += 1
        changed = dataclasses.replace(sessions, context=sessions.context + version[0])
        return serve.store_logits(store, s.graphdef, s.params, changed, s.anchor)[0]

    def off():
        caches = serve.build_caches(s.graphdef, s.params, sessions, s.anchor)
        return serve.cached_logits(s.graphdef, s.params, sessions, s.anchor, caches=caches)[0]

    times = peers.interleaved_times(dict(hit=hit, miss=miss, off=off), cfg["rounds"],
                                    settle_s=0.0, warm_calls=1)
    ms = {k: 1e3 * float(np.median(v)) for k, v in times.items()}
    return dict(median_ms=ms, rounds=cfg["rounds"], history=int(sessions.history_len[0]),
                miss_over_hit=float(np.median(times["miss"] / times["hit"])),
                off_over_hit=float(np.median(times["off"] / times["hit"])))


def restore_vs_recompute(s: Setup, cfg: dict) -> dict:
    """Measurement 3: a restore from the host tier against the history pass + write of the
    same user, interleaved. Each round first pushes the user to the host tier (another user's
    miss, released unwritten, so the slot is free again)."""
    sessions = s.world.sample(np.random.default_rng(6), 1, long=True)
    other = dataclasses.replace(sessions, user=sessions.user + 1)
    history_max = s.preset.world.history_max
    pages = -(-(1 + history_max) // serve.PAGE_SIZE)
    store = serve.make_store(s.preset.model, history_max, users=1, host_pages=2 * pages)
    store.warmup()
    user, length = int(sessions.user[0]), 1 + int(sessions.history_len[0])
    versions = iter(range(10**9))
    current = next(versions)

    def to_host():
        lease = store.acquire([int(other.user[0])], [next(versions)], [length])
        store.release(lease)  # unwritten: dropped, its slot free again

    def restore():
        with store.acquire([user], [current], [length]) as lease:
            assert lease.source == ["host"], lease.source

    def recompute():
        nonlocal current
        current = next(versions)
        with store.acquire([user], [current], [length]) as lease:
            serve.fill_misses(store, lease, s.graphdef, s.params, sessions, s.anchor)
            jax.block_until_ready(store.cache.k_pages)

    recompute()
    to_host()
    restore()  # compiles nothing new (warmup), but warms the copies
    times = collections.defaultdict(list)
    for r in range(cfg["rounds"]):
        for name, fn in ((("restore", restore), ("recompute", recompute)) if r % 2 == 0
                         else (("recompute", recompute), ("restore", restore))):
            to_host()
            start = time.perf_counter()
            fn()
            jax.block_until_ready(store.cache.k_pages)
            times[name].append(time.perf_counter() - start)
    ratios = np.array(times["recompute"]) / np.array(times["restore"])
    ms = {k: 1e3 * float(np.median(v)) for k, v in times.items()}
    return dict(median_ms=ms, speedup=float(np.median(ratios)), rounds=cfg["rounds"],
                history=length, pages=-(-length // serve.PAGE_SIZE))


def zipf_users(users: int, requests: int, rng) -> np.ndarray:
    """Zipf(ZIPF) popularity over a random ranking of ``users``."""
    weights = 1.0 / np.arange(1, users + 1) ** ZIPF
    return rng.permutation(users)[rng.choice(users, requests, p=weights / weights.sum())]


def scan_trace(users: int, requests: int, seed: int) -> list:
    """Zipf users with a scan of SCAN_LENGTH one-off users after every SCAN_EVERY requests."""
    out, one_off = [], users
    for i, user in enumerate(zipf_users(users, requests, np.random.default_rng(seed)).tolist()):
        out.append(user)
        if i % SCAN_EVERY == SCAN_EVERY - 1:
            out += range(one_off, one_off + SCAN_LENGTH)
            one_off += SCAN_LENGTH
    return out


def movielens_visits() -> tuple[list | None, str]:
    """MovieLens-100K's users in the order of their visits (a user's ratings less than
    VISIT_GAP_S apart are one visit), or (None, why not)."""
    name, requirement, path = MOVIELENS
    try:
        data = np.loadtxt(os.path.join(user_cache.install_once(name, [requirement]), path),
                          skiprows=1, dtype=np.int64)
    except (RuntimeError, OSError) as error:
        return None, f"not measured: the {requirement} wheel could not be fetched ({error})"
    users, times = data[:, 0], data[:, 3]
    order = np.lexsort((users, times))
    last, visits = {}, []
    for user, t in zip(users[order].tolist(), times[order].tolist()):
        if user not in last or t - last[user] > VISIT_GAP_S:
            visits.append(user)
        last[user] = t
    return visits, f"{len(data)} ratings of {len(set(users.tolist()))} users"


def replay(keys, policy: str, slots: int, pages: int, host_pages: int) -> dict:
    """Each request of ``keys`` through a HistoryStore of this policy and size, one at a
    time (acquire, write what is missing, release): the store's own sources."""
    max_pages = max(-(-n // serve.PAGE_SIZE) for _, _, n in keys)
    store = serving.HistoryStore(num_layers=1, kv_heads=1, head_dim=8,
                                 page_size=serve.PAGE_SIZE, device_pages=pages,
                                 max_users=slots, max_pages_per_user=max_pages,
                                 host_pages=host_pages, max_batch=1, policy=policy)
    zeros = np.zeros((1, 1, max_pages * serve.PAGE_SIZE, 1, 8), np.float32)
    sources = []
    for user, version, length in keys:
        with store.acquire([user], [version], [length]) as lease:
            if lease.missing[0]:
                store.write(lease, zeros, zeros)
            sources.append(lease.source[0])
    return dict(hit_rate=sources.count("device") / len(keys), sources=sources)


def policies(stream_keys, cfg: dict, smoke: bool) -> dict:
    """Measurement 4: every policy's device hit rate on each trace, and Belady's MIN."""
    sizes = SMOKE_POLICIES if smoke else POLICY_TRACES
    seeds = 1 if smoke else POLICY_SEEDS
    one_page = lambda users: [(u, 0, serve.PAGE_SIZE) for u in users]  # noqa: E731
    traces = {"zipf": [(stream_keys, cfg["device_users"], cfg["device_pages"],
                        cfg["host_pages"])]}
    for name, make in (("scan", scan_trace), ("cold", None)):
        users, requests = sizes[name]
        traces[name] = []
        for seed in range(seeds):
            order = (make(users, requests, seed) if make else
                     zipf_users(users, requests, np.random.default_rng(seed)).tolist())
            traces[name].append((one_page(order), users // 10, users // 10, 0))
    visits, movielens = (None, "not measured in a smoke run") if smoke else movielens_visits()
    traces["movielens"] = []
    if visits is not None:
        slots = len(set(visits)) // 10
        traces["movielens"] = [(one_page(visits), slots, slots, 0)]
    out = {}
    for name, runs in traces.items():
        rows = []
        for keys, slots, pages, host in runs:
            row = {policy: replay(keys, policy, slots, pages, host)["hit_rate"]
                   for policy in serving.EVICTION_POLICIES}
            row["min"] = simulate(keys, slots, pages, serve.PAGE_SIZE, "min", host)["hit_rate"]
            rows.append(dict(row, requests=len(keys), users=len({k[0] for k in keys}),
                             slots=slots, pages=pages, host_pages=host))
        out[name] = rows
    out["movielens_note"] = movielens
    return out


# --- The report. ---------------------------------------------------------------------------


def report(results: dict) -> str:
    a, b, c = results["stream"], results["per_request"], results["restore"]
    lines = [
        "# History store: the reference ranker served through serving.HistoryStore",
        "",
        f"Generated by `{COMMAND}` on {results['date']}: {results['machine']}, jax "
        f"{results['jax']}. Small preset of examples/ranker (history up to "
        f"{results['history_max']} events, {results['candidates']} candidates per request, "
        f"{results['layers']} layers), freshly initialised weights (speed does not depend on "
        "them). Do not edit by hand.",
        "",
        "## 1. A request stream",
        "",
        f"{a['requests']} requests, one at a time, Zipf({ZIPF}) popularity over {a['users']} "
        f"users, {int(CHANGED * 100)}% of requests carrying a changed history (one new "
        f"event). A store of {a['device_users']} device slots and {a['device_pages']} device "
        f"pages ({a['device_pages'] / a['room']:.0%} of the {a['room']} that every slot's "
        f"longest history needs: {a['lru']['page_evictions']} of the {a['evictions']} "
        "evictions were made with a slot free, because the pages ran out), and a host tier "
        f"of {a['host_pages']} pages.",
        "",
        "| | device hits | host restores | misses | device hit rate |",
        "|---|---|---|---|---|",
    ]
    for name, r in (("the store", a), ("offline simulation of the store's rules", a["lru"]),
                    ("Belady's MIN (the bound on device hits for equal sizes)", a["belady"])):
        lines.append(f"| {name} | {r['hits']} | {r['host_hits']} | {r['misses']} | "
                     f"{r['hit_rate']:.3f} |")
    differ = ("" if a["first_difference"] is None else
              f" (the first that differs: request {a['first_difference']}, the store "
              f"{a['sources'][a['first_difference']]}, the simulation "
              f"{a['lru']['sources'][a['first_difference']]})")
    lines += [
        "",
        f"Request by request, the store's source (device, host or miss) equals the "
        f"simulation's for **{a['agree']} of {a['requests']}** requests{differ}. "
        f"Invalidations (changed histories dropped): {a['invalidations']}; evictions: "
        f"{a['evictions']}; host-tier evictions: {a['host_evictions']}.",
        "",
        f"Median latency per request by source (the {a['compiled']} requests during which JAX "
        "traced or compiled a program, the ranker's or the store's, untimed):",
        "",
        "| source | requests timed | median ms |",
        "|---|---|---|",
    ]
    lines += [f"| {k} | {a['timed'][k]} | {v:.1f} |" for k, v in sorted(a["median_ms"].items())]
    lines += [
        "",
        f"Programs JAX built for the store's calls (`stats()[\"compiled_programs\"]`): "
        f"{a['programs_after_warmup']} after `warmup()` (its device updates: at most "
        f"{a['program_bound']}), {a['programs_after_stream']} after the stream. Those built "
        "during the stream take the rows of the history pass's K/V, a jax array, on the "
        "device (one small program per token bucket: shapes warm-up cannot know); the "
        "ranker's history pass and scoring take one shape each here (one request at a time).",
        "",
        "## 2. Per request: a hit, a miss, the store turned off",
        "",
        f"One user ({b['history']} history events), {b['rounds']} interleaved rounds; a miss is "
        "acquire + the history pass + write + scoring, 'off' builds a fresh cache every request "
        "(history pass + cache_from_history + scoring). Each timed call follows an untimed one "
        "of its own kind.",
        "",
        "| | median ms | / hit (median of per-round ratios) |",
        "|---|---|---|",
    ]
    over_hit = dict(hit=1.0, miss=b["miss_over_hit"], off=b["off_over_hit"])
    for name in ("hit", "miss", "off"):
        lines.append(f"| {name} | {b['median_ms'][name]:.1f} | {over_hit[name]:.2f}x |")
    lines += [
        "",
        "## 3. Host-tier restore against recomputing the history",
        "",
        f"One user's {c['history']}-token history ({c['pages']} pages, every layer), "
        f"{c['rounds']} interleaved rounds: the acquire that restores it from the host tier "
        "(copy to the device, scatter into the cache) against the acquire + history pass + "
        "write that recompute it.",
        "",
        "| | median ms |",
        "|---|---|",
        f"| restore | {c['median_ms']['restore']:.2f} |",
        f"| recompute | {c['median_ms']['recompute']:.2f} |",
        "",
        f"Restore is **{c['speedup']:.1f}x** faster (median of per-round ratios; target >= 5x). "
        "On this CPU-only machine both tiers are RAM: this is the mechanism (copy and "
        "scatter), not a PCIe transfer.",
        "",
    ]
    return "\n".join(lines + policy_report(results["policies"]))


TRACE_NAMES = {
    "zipf": "Zipf(1.1), measurement 1's trace (sizes vary, pages run out, a host tier)",
    "scan": f"Zipf(1.1) with scans: {SCAN_LENGTH} one-off users after every {SCAN_EVERY} "
            "requests",
    "cold": "cold start: Zipf(1.1), about 2 requests per user",
    "movielens": "MovieLens-100K: users in the order of their visits",
}


def policy_report(p: dict) -> list:
    others = [name for name in serving.EVICTION_POLICIES if name != "lru"]
    lines = [
        "## 4. Eviction policies",
        "",
        "Each policy of `serving.EVICTION_POLICIES` (`HistoryStore(..., policy=)`) replays each "
        "trace through a real `HistoryStore`, one request at a time (acquire, write what is "
        "missing, release): the hit rates are the store's own, not a simulation's. Every trace "
        "but the first gives each user one page and a store of 10% of the users it draws from "
        "(slots and "
        "pages alike, no host tier), so Belady's MIN (evict the entry next used furthest "
        "away) is the optimum there; with measurement 1's sizes it is a bound for equal "
        "sizes only. Synthetic traces: the mean over their seeds, and the smallest gain over "
        f"LRU among them. MovieLens-100K: {p['movielens_note']}; a visit is a user's ratings "
        f"less than {VISIT_GAP_S // 60} minutes apart (the data come from the `recbole` wheel, "
        "fetched at run time, never committed).",
        "",
        "| trace | seeds | requests | users requested | store (slots / pages) | lru | "
        + " | ".join(f"{o} | {o} - lru (smallest)" for o in others) + " | Belady's MIN |",
        "|---|---|---|---|---|---|" + "---|---|" * len(others) + "---|",
    ]
    for name, rows in p.items():
        if name == "movielens_note" or not rows:
            continue
        mean = lambda key: float(np.mean([r[key] for r in rows]))  # noqa: E731
        cells = [TRACE_NAMES[name], str(len(rows)), str(rows[0]["requests"]),
                 str(rows[0]["users"]), f"{rows[0]['slots']} / {rows[0]['pages']}",
                 f"{mean('lru'):.3f}"]
        for o in others:
            gains = [r[o] - r["lru"] for r in rows]
            cells += [f"{mean(o):.3f}", f"{np.mean(gains):+.3f} ({min(gains):+.3f})"]
        lines.append("| " + " | ".join(cells + [f"{mean('min'):.3f}"]) + " |")
    return lines + [""]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, 2 rounds")
    parser.add_argument("--out", help="write STORE.md and store.json here (default: "
                                      "benchmarks/STORE.md and benchmarks/results/store.json)")
    args = parser.parse_args(argv)
    cfg = SMOKE if args.smoke else FULL
    s = setup(args.smoke, cfg["candidates"], cfg["history"])
    results = dict(date=datetime.date.today().isoformat(), machine=peers.machine_description(),
                   jax=jax.__version__, history_max=s.preset.world.history_max,
                   candidates=s.preset.world.candidates, layers=s.preset.model.layers,
                   smoke=args.smoke)
    results["stream"] = stream(s, cfg)
    results["per_request"] = per_request(s, cfg)
    results["restore"] = restore_vs_recompute(s, cfg)
    results["policies"] = policies(keys_of(*make_trace(s, cfg["users"], cfg["requests"])),
                                   cfg, args.smoke)
    out = Path(args.out) if args.out else OUT.parent
    md = out / "STORE.md" if args.out else OUT
    data = out / "store.json" if args.out else OUT.parent / "results" / "store.json"
    out.mkdir(parents=True, exist_ok=True)
    data.write_text(json.dumps(results, indent=1))
    md.write_text(report(results))
    print(report(results))


if __name__ == "__main__":
    main()
