"""Two replicas behind HAProxy against one server: benchmarks/CLUSTER.md.

    flock /tmp/rankattn-cpu.lock .venv/bin/python benchmarks/bench_cluster.py   # CLUSTER.md
    .venv/bin/python benchmarks/bench_cluster.py --smoke --out DIR   # small and short, DIR/

The reference ranker's tiny preset (random weights: speed does not depend on them), 64
candidates per request, on one trace (examples/ranker/loadtest.py's: Zipf(1.1) over the
users, 10% of requests carrying a changed history, each naming its user in X-User-Id), in
three configurations, each started for it (one compilation cache for all):

* **one server** with a store of C histories (its longest), asked directly;
* **2 replicas, affinity**: ``python -m examples.ranker cluster``'s Cluster, 2 replicas of
  C / 2 each behind HAProxy routing by X-User-Id on a consistent-hash ring;
* **2 replicas, round robin**: the same with ``--no-affinity``.

Per configuration (examples/ranker/serverbench.py's load points, open loop): a fill (not
measured), then the hit-rate window at the same rate for every configuration, where each
replica's store counts (its /metrics: ``ranker_store_{hits,host_hits,prefix_hits,misses}``)
give the hit rate, and whose p50 sets, for the first configuration, the p99 bound
(serverbench's rule: 4x); the capacity (open-loop overload); the throughput at the p99 bound
(bisection between the window's rate and the capacity). Then, on the affinity cluster at a
low rate, HAProxy's added latency: windows of one cached request sent straight to the replica
that holds it and through HAProxy, interleaved, their p50 and p99 compared by medians over
the rounds.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # examples/ from the repository
from examples.ranker import loadtest, serve, serverbench  # noqa: E402
from examples.ranker.cluster import Cluster  # noqa: E402
from examples.ranker.config import PRESETS  # noqa: E402
from rankattn import peers  # noqa: E402

COMMAND = "flock /tmp/rankattn-cpu.lock .venv/bin/python benchmarks/bench_cluster.py"
OUT = Path(__file__).resolve().parent
ONE, AFFINITY, ROUND_ROBIN = "one server", "2 replicas, affinity", "2 replicas, round robin"
PRESET = "tiny"
HIT_TARGET, GAP_TARGET, PROXY_P50_TARGET_MS = 0.03, 0.10, 1.0


@dataclasses.dataclass(frozen=True)
class Size:
    users: int              # in the trace
    store_users: int        # C: the one server's store; each replica holds C / 2
    candidates: int
    max_history: int | None  # None: the world's history_max
    qps: float              # the fill and the hit-rate window
    fill_seconds: float
    window_seconds: float   # the hit-rate window
    low_qps: float          # the low rate: its p50 sets the p99 bound
    low_seconds: float
    overload_seconds: float
    seconds: float          # each point of the bisection
    bisections: int
    settle: float
    proxy_qps: float        # the proxy's latency: one request, this rate ...
    proxy_seconds: float    # ... windows of this long, direct and through HAProxy in turn
    proxy_rounds: int

    def serverbench_size(self) -> serverbench.Size:
        """The same points in serverbench's terms (its capacity and bisection use them)."""
        return serverbench.Size(
            users=self.users, candidates=self.candidates, max_history=self.max_history,
            runs=1, low_qps=self.low_qps, low_seconds=self.low_seconds,
            fill_seconds=self.fill_seconds, overload_seconds=self.overload_seconds,
            seconds=self.seconds, bisections=self.bisections, settle=self.settle)


FULL = Size(users=2000, store_users=200, candidates=64, max_history=None, qps=100.0,
            fill_seconds=25.0, window_seconds=25.0, low_qps=20.0, low_seconds=10.0,
            overload_seconds=6.0, seconds=5.0, bisections=4, settle=1.0, proxy_qps=40.0,
            proxy_seconds=3.0, proxy_rounds=8)
SMOKE = Size(users=200, store_users=20, candidates=8, max_history=12, qps=40.0,
             fill_seconds=2.0, window_seconds=2.0, low_qps=20.0, low_seconds=1.0,
             overload_seconds=1.0, seconds=0.5, bisections=1, settle=0.2, proxy_qps=40.0,
             proxy_seconds=0.5, proxy_rounds=2)


class Front:
    """A cluster as serverbench's load points see a server: the front's URL, and the
    replicas' /metrics summed (every figure it reads is a count or a sum)."""

    def __init__(self, cluster: Cluster):
        self.url, self.replicas = cluster.url, cluster.replicas

    def metrics(self) -> dict:
        total = collections.Counter()
        for replica in self.replicas:
            total.update(replica.metrics())
        return dict(total)


def server_flags(size: Size, store_users: int) -> list[str]:
    """A server's (or each replica's) flags: a store of ``store_users`` longest histories."""
    max_history = size.max_history or PRESETS[PRESET].world.history_max
    per_user = -(-(1 + max_history) // serve.PAGE_SIZE)
    return ["--preset", PRESET, "--random-weights", "--max-history", str(max_history),
            "--max-candidates", str(size.candidates), "--max-users", str(store_users),
            "--device-pages", str(store_users * per_user)]


def counts(samples: dict) -> dict:
    """A replica's store counts (HistoryStore.stats(), rows acquired by source) and its
    ranking requests answered 200, from its /metrics ``samples``."""
    out = {name: samples.get((f"ranker_store_{name}_total", ()), 0.0)
           for name in ("hits", "host_hits", "prefix_hits", "misses")}
    out["answered"] = sum(v for (n, _), v in samples.items() if n == "ranker_requests_total")
    return out


def scrape(replicas) -> list[dict]:
    """Each replica's :func:`counts` now."""
    return [counts(replica.metrics()) for replica in replicas]


def hit_rate(rows: dict) -> float:
    """Rows whose whole history the store held (device or host tier) over every row."""
    held = rows["hits"] + rows["host_hits"]
    return held / max(held + rows["prefix_hits"] + rows["misses"], 1.0)


def measure(name: str, server, replicas, trace: loadtest.Trace, size: Size,
            bound_ms: float | None) -> dict:
    """One configuration's points: fill; the hit-rate window (each replica's store counts
    and answers over it); the low rate (``bound_ms`` None: the bound is 4x its p50); the
    capacity; the throughput at the p99 bound."""
    small = size.serverbench_size()
    fill = serverbench.measure(server, trace, size.qps, size.fill_seconds, size.settle, "fill")
    before = scrape(replicas)
    window = serverbench.measure(server, trace, size.qps, size.window_seconds, size.settle,
                                 "hit-rate window")
    rows = [{k: a[k] - b[k] for k in a} for b, a in zip(before, scrape(replicas))]
    low = serverbench.measure(server, trace, size.low_qps, size.low_seconds, size.settle,
                              "low")
    bound_ms = bound_ms or serverbench.BOUND_FACTOR * low["client"]["latency"]["p50_ms"]
    # The first overload offers OVERLOAD x the window's answered rate (serverbench offers it
    # x its analytic capacity, which assumes a core per stage thread: far beyond what these
    # processes answer on 2 cores, an overload that costs them more in refusals than a
    # smaller one).
    offer = dict(window, model=dict(window["model"],
                                    capacity=window["client"]["window_qps"]))
    capacity = serverbench.saturate(server, trace, small, offer)
    start = window if serverbench.within(window, bound_ms) else low
    bisection, inside, bracket = serverbench.search_bound(
        server, trace, small, start, capacity[-1]["client"]["window_qps"], bound_ms)
    total = {k: sum(r[k] for r in rows) for k in rows[0]}
    hits = sum(s["count"] for k, s in window["client"]["by_cache"].items()
               if k in serverbench.HITS)
    return dict(name=name, bound_ms=bound_ms, counts=rows, hit_rate=hit_rate(total),
                replica_hit_rates=[hit_rate(r) for r in rows],
                requests_by_replica=[r["answered"] for r in rows],
                answer_hit_share=hits / max(window["client"]["answered_ok"], 1),
                points=[fill, window, low, *capacity, *bisection], window=window,
                capacity=capacity[-1], at_bound=inside, bracket=bracket,
                ready_seconds=[getattr(r, "ready_seconds", None) for r in replicas])


def proxy_latency(cluster: Cluster, trace: loadtest.Trace, size: Size) -> dict:
    """HAProxy's added latency at a low rate: one request (a hit once cached), sent in
    windows straight to the replica that holds it and through the front, in turn (which
    goes first alternates), p50 and p99 per window."""
    request = trace.load(1.0, 2.0).requests[0]
    before = scrape(cluster.replicas)
    loadtest.run(loadtest.Load(np.zeros(1), [request]), cluster.url)  # cached where it lands
    holder = next(i for i, (b, a) in enumerate(zip(before, scrape(cluster.replicas)))
                  if a["answered"] > b["answered"])
    rng = np.random.default_rng(1)
    rounds = []
    for number in range(size.proxy_rounds):
        paths = [("direct", cluster.replicas[holder].url), ("proxy", cluster.url)]
        measured = {}
        for path, url in paths[::1 if number % 2 else -1]:
            at = np.cumsum(rng.exponential(1 / size.proxy_qps,
                                           int(size.proxy_qps * size.proxy_seconds)))
            report = loadtest.run(loadtest.Load(at, [request] * len(at)), url)
            measured[path] = dict(report["latency"], errors=report["errors"])
        rounds.append(measured)
    median = lambda path, key: float(np.median([r[path][key] for r in rounds]))  # noqa: E731
    added = lambda key: float(np.median([r["proxy"][key] - r["direct"][key]  # noqa: E731
                                         for r in rounds]))
    return dict(replica=holder, rounds=rounds, direct_p50_ms=median("direct", "p50_ms"),
                direct_p99_ms=median("direct", "p99_ms"), proxy_p50_ms=median("proxy", "p50_ms"),
                proxy_p99_ms=median("proxy", "p99_ms"), added_p50_ms=added("p50_ms"),
                added_p99_ms=added("p99_ms"))


def run(out: Path, size: Size) -> dict:
    """Every configuration, then the proxy's latency; the results."""
    env = dict(os.environ, JAX_COMPILATION_CACHE_DIR=str(out / "jax_cache"),
               JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
               JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
    max_history = size.max_history or PRESETS[PRESET].world.history_max
    trace = loadtest.Trace(PRESETS[PRESET], users=size.users, zipf=serverbench.ZIPF,
                           change_share=serverbench.CHANGED, seed=0,
                           candidates=size.candidates, max_history=max_history)
    one_flags = server_flags(size, size.store_users)
    replica_flags = server_flags(size, size.store_users // 2)
    results = dict(size=dataclasses.asdict(size), preset=PRESET, max_history=max_history,
                   top_user_share=float(trace.popularity.max()),
                   flags={ONE: one_flags, AFFINITY: replica_flags, ROUND_ROBIN: replica_flags},
                   configs={})
    server = serverbench.LocalServer(str(out), one_flags, str(out / "one-server.log"), env)
    try:
        results["configs"][ONE] = measure(ONE, server, [server], trace.fork(), size, None)
    finally:
        server.stop()
    bound_ms = results["configs"][ONE]["bound_ms"]
    for name, affinity in ((AFFINITY, True), (ROUND_ROBIN, False)):
        directory = out / name.replace(", ", "-").replace(" ", "-")
        port = serverbench.free_ports(1)[0]
        with Cluster(str(directory), port, 2, replica_flags, affinity=affinity,
                     env=env) as cluster:
            results["configs"][name] = measure(name, Front(cluster), cluster.replicas,
                                               trace.fork(), size, bound_ms)
            if affinity:
                results["proxy"] = proxy_latency(cluster, trace.fork(), size)
    return results


# --- The report. -------------------------------------------------------------------------


def targets(r: dict) -> list[tuple[str, str, bool]]:
    c, proxy = r["configs"], r["proxy"]
    one, aff, rr = (c[n]["hit_rate"] for n in (ONE, AFFINITY, ROUND_ROBIN))
    return [(f"{AFFINITY} within {HIT_TARGET} hit rate of {ONE} (same total store)",
             f"{aff:.3f} against {one:.3f} ({aff - one:+.3f})", abs(aff - one) <= HIT_TARGET),
            (f"{AFFINITY} at least {GAP_TARGET} above {ROUND_ROBIN} in hit rate",
             f"{aff:.3f} against {rr:.3f} ({aff - rr:+.3f})", aff - rr >= GAP_TARGET),
            (f"HAProxy adds at most {PROXY_P50_TARGET_MS:g} ms to the p50 at a low rate",
             f"{proxy['added_p50_ms']:+.2f} ms ({proxy['proxy_p50_ms']:.2f} against "
             f"{proxy['direct_p50_ms']:.2f})", proxy["added_p50_ms"] <= PROXY_P50_TARGET_MS)]


def report(r: dict) -> str:
    """CLUSTER.md's text."""
    size, c, proxy = r["size"], r["configs"], r["proxy"]
    names = list(c)
    fmt = lambda x, spec=".1f": "-" if x is None else format(x, spec)  # noqa: E731
    lines = [
        "# Two replicas behind HAProxy against one server",
        "",
        f"Generated by `{COMMAND}{' --smoke' if r['smoke'] else ''}` on {r['date']} in "
        f"{r['seconds'] / 60:.1f} min: {r['machine']}, jax {r['jax']}, HAProxy "
        f"{r['haproxy']}. Preset `{r['preset']}` with random weights (speed does not depend on "
        f"them): histories of up to {r['max_history']} events, {size['candidates']} "
        "candidates per request. Servers, replicas, HAProxy and the load generator share the "
        "machine's cores. Do not edit by hand.",
        "",
        f"Trace (examples/ranker/loadtest.py): {size['users']} users, Zipf({serverbench.ZIPF}) "
        f"popularity, {serverbench.CHANGED:.0%} of requests carry a changed history (one new "
        "event); every request names its user in `X-User-Id`. Every configuration gets the "
        "same requests in the same order, each in servers started for it.",
        "",
        "## Targets",
        "",
        "| target | measured | met |",
        "|---|---|---|",
        *(f"| {t} | {m} | {'yes' if ok else 'no'} |" for t, m, ok in targets(r)),
        "",
        "## Method",
        "",
        f"- **{ONE}**: `python -m examples.ranker server` with a store of C = "
        f"{size['store_users']} histories (each of the longest length), requests sent to it "
        "directly.",
        f"- **{AFFINITY}**: `python -m examples.ranker cluster --replicas 2`: two servers "
        f"with a store of C / 2 = {size['store_users'] // 2} histories each behind HAProxy, "
        "which routes by `X-User-Id` on a consistent-hash ring (each user on one replica).",
        f"- **{ROUND_ROBIN}**: the same with `--no-affinity`: HAProxy routes round robin "
        "(each user's requests on both replicas in turn).",
        "",
        f"Each gets, in order: a fill of {size['fill_seconds']:g} s at {size['qps']:g} "
        f"requests / s (not measured); the **hit-rate window**, {size['window_seconds']:g} s "
        f"more at {size['qps']:g} / s, over which each replica's store counts (its /metrics: "
        "`ranker_store_{hits,host_hits,prefix_hits,misses}_total`, rows acquired by source) "
        "give the hit rate, rows whose whole history its store held over all rows (requests "
        "of one key in one batch share a row; the answers' `cache` gives the share of "
        f"requests, beside it); the **low rate**, {size['low_qps']:g} / s for "
        f"{size['low_seconds']:g} s; the **capacity**, the answered rate under open-loop "
        f"overload ({size['overload_seconds']:g} s at {serverbench.OVERLOAD:g}x the window's "
        "rate, and twice that if it kept up); the **throughput at the p99 bound**, "
        f"{size['bisections']} bisection steps of {size['seconds']:g} s between the window's "
        "rate (the low rate where the window was beyond the bound) and the capacity "
        "(examples/ranker/serverbench.py's points: the answered rate at the last rate within "
        f"the bound). The bound is {serverbench.BOUND_FACTOR:g}x {ONE}'s p50 at the low rate: "
        f"**{c[ONE]['bound_ms']:.1f} ms**, for all three.",
        "",
        "## Hit rate and throughput",
        "",
        "| configuration | store per replica | hit rate (store rows) | each replica's | "
        "requests answered by each replica | hits among the answers | capacity / s | "
        "throughput at the bound / s (search's bracket) | p99 there ms | p50 / p99 in the "
        "window ms |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name in names:
        m = c[name]
        at = m["at_bound"]
        share = sum(m["requests_by_replica"]) or 1
        lines.append(
            f"| {name} | {size['store_users'] // (1 if name == ONE else 2)} | "
            f"{m['hit_rate']:.3f} | {' / '.join(f'{x:.3f}' for x in m['replica_hit_rates'])} | "
            + " / ".join(f"{x / share:.0%}" for x in m["requests_by_replica"])
            + f" | {m['answer_hit_share']:.3f} | {serverbench.capacity_shown(m['capacity'])} | "
            f"{fmt(at and at['client']['window_qps'])} ({m['bracket'][0]:.0f}-"
            f"{m['bracket'][1]:.0f}) | {fmt(at and at['client']['latency']['p99_ms'])} | "
            f"{m['window']['client']['latency']['p50_ms']:.1f} / "
            f"{m['window']['client']['latency']['p99_ms']:.1f} |")
    lines += [
        "",
        "What a miss costs here, from the servers' own call metrics over the window "
        "(serverbench's s, h and m, summed over the replicas): s, the scoring seconds per "
        "request scored on the front stage (hits) and on the history stage (misses); h, the "
        "history pass and store write per miss; m, the share of answers that missed. The "
        "model time per request, (1 - m) s_front + m (h + s_history), is what the hit rate "
        "changes:",
        "",
        "| configuration | m | s_front ms | h ms | s_history ms | model ms per request |",
        "|---|---:|---:|---:|---:|---:|",
        *(f"| {name} | {m['m']:.3f} | {m['s_front_ms']:.2f} | {m['h_ms']:.2f} | "
          f"{m['s_history_ms']:.2f} | {m['front_ms'] + m['history_ms']:.2f} |"
          for name, m in ((n, c[n]["window"]["model"]) for n in names)),
        "",
        "Load points (the window, the low rate, capacity, bisection), as serverbench reports "
        "them:",
        "",
        "| configuration | point | offered / s | answered / s | p50 ms | p99 ms | requests | "
        "errors | hits |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name in names:
        for p in c[name]["points"]:
            cl, lat = p["client"], p["client"]["latency"]
            hits = sum(s["count"] for k, s in cl["by_cache"].items() if k in serverbench.HITS)
            errors = ", ".join(f"{k} {n}" for k, n in cl["errors"].items()) or "0"
            lines.append(f"| {name} | {serverbench.point_kind(p)} | {cl['offered_qps']:.1f} | "
                         f"{cl['window_qps']:.1f} | {fmt(lat.get('p50_ms'))} | "
                         f"{fmt(lat.get('p99_ms'))} | {cl['requests']} | {errors} | "
                         f"{hits / max(cl['answered_ok'], 1):.2f} |")
    lines += [
        "",
        "## HAProxy's added latency",
        "",
        f"One request (its history cached: a hit), {size['proxy_qps']:g} / s open loop, in "
        f"windows of {size['proxy_seconds']:g} s sent straight to the replica that holds it "
        f"and through HAProxy, in turn, {size['proxy_rounds']} rounds (which goes first "
        "alternates); medians over the rounds of each window's p50 and p99, and of the "
        "difference within a round:",
        "",
        "| path | p50 ms | p99 ms |",
        "|---|---:|---:|",
        f"| straight to replica {proxy['replica']} | {proxy['direct_p50_ms']:.2f} | "
        f"{proxy['direct_p99_ms']:.2f} |",
        f"| through HAProxy | {proxy['proxy_p50_ms']:.2f} | {proxy['proxy_p99_ms']:.2f} |",
        f"| added (median of the rounds' differences) | {proxy['added_p50_ms']:+.2f} | "
        f"{proxy['added_p99_ms']:+.2f} |",
        "",
        "## What two cores show, and what they predict",
        "",
        *prediction(r),
    ]
    return "\n".join(lines)


def capacity_ratio(point: dict, base: dict) -> str:
    """point's capacity over base's, as "1.3x"; a server that kept up with its offer has a
    lower bound for a capacity, so the ratio is "at least" (point's) or "at most" (base's),
    and unknown where both did."""
    ratio = point["client"]["window_qps"] / base["client"]["window_qps"]
    saturated = serverbench.saturated(point), serverbench.saturated(base)
    if not any(saturated):
        return "an unknown multiple (neither was saturated) of"
    return {(True, True): "", (False, True): "at least ", (True, False): "at most "}[
        saturated] + f"{ratio:.1f}x"


def prediction(r: dict) -> list[str]:
    """The report's last section: what this machine can show, and what it predicts."""
    c, size, proxy = r["configs"], r["size"], r["proxy"]
    at_bound = {n: c[n]["at_bound"]["client"]["window_qps"] if c[n]["at_bound"] else 0.0
                for n in c}
    model = {n: c[n]["window"]["model"] for n in c}
    per_request = {n: m["front_ms"] + m["history_ms"] for n, m in model.items()}
    hit = {n: c[n]["hit_rate"] for n in c}
    top = r["top_user_share"]
    return [
        f"Everything here ran on the same {r['cpus']} cores: the one server, both replicas, "
        "HAProxy and the load generator. So this machine shows what routing does to the "
        "stores (the hit rates depend on the trace and the routing, not on the cores) and "
        "HAProxy's cost per request (above); it cannot show what more machines add, since "
        "the two replicas split the cores the one server had to itself. The capacities "
        "differ for a reason of their own: one server is one Python process, whose event "
        "loop (reading, parsing, answering) and two stage threads share one interpreter "
        f"lock, and two replicas are two processes: under overload {AFFINITY} answered "
        f"{capacity_ratio(c[AFFINITY]['capacity'], c[ONE]['capacity'])} {ONE}'s rate on the "
        "same cores. At the "
        f"p99 bound the three answered {at_bound[ONE]:.0f}, {at_bound[AFFINITY]:.0f} and "
        f"{at_bound[ROUND_ROBIN]:.0f} / s (the searches' brackets above give their "
        f"resolution). At this preset a miss adds a history pass and write, h = "
        f"{model[ONE]['h_ms']:.1f} ms, to the scoring a hit costs, s = "
        f"{model[ONE]['s_front_ms']:.1f} ms (on {ONE}), so round robin's extra misses cost "
        f"{per_request[ROUND_ROBIN] - per_request[AFFINITY]:.2f} ms more model time per "
        "request than affinity's, a small part of a request's latency (its p50 in the "
        f"window: {c[ROUND_ROBIN]['window']['client']['latency']['p50_ms']:.1f} ms).",
        "",
        "On N machines, one replica each, behind HAProxy on a core or machine of its own:",
        "",
        f"- **With affinity** each replica's store holds its own users: the hit rate stays "
        f"that of one store of the total size (measured for N = 2: {hit[AFFINITY]:.3f} "
        f"against {hit[ONE]:.3f}), and each machine takes 1 / N of the users at one "
        "server's cost per request, so the throughput at the bound is about N times one "
        f"machine's, HAProxy adding {proxy['added_p50_ms']:.2f} ms at the p50 per request. "
        "What limits it is the hottest user: all of a user's requests go to one replica, and "
        f"in this trace the most popular user alone sends {top:.0%} of the requests "
        f"(Zipf({serverbench.ZIPF}) over {size['users']} users), so from N = "
        f"{math.ceil(1 / top)} on, the replica that holds it takes more than 1 / N of the "
        "requests whatever the ring does (a hot user would need replicas of its own).",
        f"- **Round robin** sends every user to every replica: each store of C / N holds the "
        f"same popular users, so the hit rate is about that of one store of C / N (here "
        f"{hit[ROUND_ROBIN]:.3f} at N = 2, {hit[AFFINITY] - hit[ROUND_ROBIN]:.3f} below "
        "affinity), falls further with every machine added, and a changed history is "
        "computed again on each replica that sees the user. Each hit lost costs a history "
        "pass: the model time per request, (1 - m) s_front + m (h + s_history), rose from "
        f"{per_request[AFFINITY]:.2f} to {per_request[ROUND_ROBIN]:.2f} ms here, and grows "
        "with h where a history pass costs more than scoring (at the small preset, several "
        "times: examples/ranker/README.md, serving latency).",
        "",
    ]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="small and short: the path end "
                        "to end, into --out")
    parser.add_argument("--out", help="servers' logs, compilation cache, and with --smoke the "
                        "report (default: runs/bench_cluster)")
    parser.add_argument("--report-only", action="store_true", help="measure nothing: write "
                        "CLUSTER.md again from the last run's benchmarks/results/cluster.json")
    args = parser.parse_args(argv)
    if args.report_only:
        (OUT / "CLUSTER.md").write_text(report(json.loads(
            (OUT / "results" / "cluster.json").read_text())))
        return 0
    from examples.ranker.__main__ import meta
    from examples.ranker.cluster import haproxy_binary

    version = subprocess.run([haproxy_binary(), "-v"], capture_output=True,
                             text=True).stdout.split()[2]
    out = Path(args.out or serverbench.ROOT / "runs" / "bench_cluster").resolve()
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    results = run(out, SMOKE if args.smoke else FULL)
    results.update(meta(), machine=peers.machine_description(), haproxy=version, smoke=args.smoke,
                   seconds=time.perf_counter() - started)
    folder = out if args.smoke else OUT
    data = folder / "cluster.json" if args.smoke else OUT / "results" / "cluster.json"
    data.write_text(json.dumps(results, indent=1))
    (folder / "CLUSTER.md").write_text(report(results))
    print(f"wrote {folder / 'CLUSTER.md'} in {results['seconds'] / 60:.1f} min")
    for target, measured, met in targets(results):
        print(f"{'met' if met else 'NOT MET'}: {target}: {measured}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
