"""The ranking server under load (``python -m examples.ranker serverbench``): benchmarks/SERVER.md.

One run starts three servers in turn (random weights, one persistent compilation cache) on
the same trace: ``--no-cache`` with ``--max-batch 8`` (the baseline), the history store with
``--max-batch 8``, and the store with ``--max-batch 1``. The store holds 10% of the trace's
users (their longest histories); the trace is Zipf(1.1) over the users with 10% of requests
carrying a changed history (loadtest.Trace). Each server first serves a warm-up stretch
(unmeasured: the store fills), then open-loop load (loadtest.run) at a low rate and up a
ladder of rates (x1.5 until the p99 bound or 1% errors is broken, then two bisections).

* The p99 bound: 4x the --no-cache p50 at the low rate.
* Throughput at the bound: the highest answered rate among the points within it.
* s, h, m: the store run's scoring and history-pass seconds per request at the low rate
  (the server's /metrics) and its miss share over the measured points; the analytic bound
  on the store's gain, (s + h) / (s + m h).
* Where the time goes: the server's per-request stages (metrics.STAGES) at each
  configuration's highest rate within the bound.

``--smoke`` runs the same path at the smallest shapes (short histories, a few users, 2 s
points) and writes into ``--out``; the full run writes benchmarks/SERVER.md, its plot and
benchmarks/results/server.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from examples.ranker import loadtest, serve
from examples.ranker.config import PRESETS
from examples.ranker.server.metrics import STAGES

ROOT = Path(__file__).resolve().parents[2]
BENCHMARKS = ROOT / "benchmarks"
COMMAND = ".venv/bin/python -m examples.ranker serverbench --preset small --out runs/serverbench"
CONFIGS = {"no cache, batch 8": ["--no-cache", "--max-batch", "8"],
           "store, batch 8": ["--max-batch", "8"],
           "store, batch 1": ["--max-batch", "1"]}
BASELINE, STORE, UNBATCHED = CONFIGS
ZIPF, CHANGED, STORE_SHARE, BOUND_FACTOR, MAX_ERRORS = 1.1, 0.10, 0.10, 4.0, 0.01


@dataclasses.dataclass(frozen=True)
class Size:
    users: int            # in the trace; the store holds STORE_SHARE of them
    candidates: int
    max_history: int | None  # None: the world's history_max
    low_qps: float        # the low rate
    low_requests: int     # requests at the low rate at least
    seconds: float        # per point of the ladder
    max_points: int       # per configuration, bisections included
    warm_requests: int    # per store user, before measuring


FULL = Size(users=2000, candidates=64, max_history=None, low_qps=2.0, low_requests=100,
            seconds=20.0, max_points=10, warm_requests=3)
SMOKE = Size(users=240, candidates=8, max_history=32, low_qps=5.0, low_requests=10,
             seconds=2.0, max_points=5, warm_requests=2)


class LocalServer:
    """A ``python -m examples.ranker server`` process on a free port of 127.0.0.1, ready
    (GET /healthz 200) when built; its output goes to ``log``."""

    def __init__(self, out: str, args: list[str], log: str, env: dict | None = None,
                 ready_within: float = 1200.0):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        self.process = subprocess.Popen(
            [sys.executable, "-m", "examples.ranker", "server", "--out", out, "--port",
             str(self.port), *args], cwd=ROOT, env=env, stdout=open(log, "w"),
            stderr=subprocess.STDOUT)
        deadline = time.monotonic() + ready_within
        while self.get("/healthz")[0] != 200:
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.process.kill()
                raise RuntimeError(f"the server did not become ready:\n{open(log).read()}")
            time.sleep(0.2)

    def get(self, path: str) -> tuple[int, bytes]:
        """(status, body); status 0 when nothing answers."""
        try:
            with urllib.request.urlopen(self.url + path, timeout=30) as response:
                return response.status, response.read()
        except urllib.error.HTTPError as err:
            return err.code, err.read()
        except OSError:
            return 0, b""

    def metrics(self) -> dict:
        """{(sample name, sorted labels): value} of GET /metrics."""
        text = self.get("/metrics")[1].decode()
        return {(s.name, tuple(sorted(s.labels.items()))): s.value
                for family in text_string_to_metric_families(text) for s in family.samples}

    def stop(self, timeout: float = 10.0) -> int:
        """SIGTERM; the exit status (a server that does not exit in time is killed)."""
        self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            raise


def _delta(after: dict, before: dict, name: str, **labels) -> float:
    """The growth of every sample ``name`` whose labels include ``labels``."""
    def total(samples):
        return sum(v for (n, ls), v in samples.items()
                   if n == name and set(labels.items()) <= set(ls))
    return total(after) - total(before)


def server_view(before: dict, after: dict) -> dict:
    """What the server saw between two scrapes: 200s, mean ms per request of each stage
    (over every 200), mean latency by cache source and batch kind, store misses."""
    answered = _delta(after, before, "ranker_requests_total")

    def per_request(name, **labels):  # mean ms per answered request
        return 1e3 * _delta(after, before, name, **labels) / max(answered, 1)

    stages = {stage: per_request("ranker_stage_seconds_sum", stage=stage) for stage in STAGES}
    latency = {}
    for cache in ("device", "host", "miss", "off"):
        for batch in ("hits_only", "with_misses"):
            count = _delta(after, before, "ranker_request_seconds_count", cache=cache,
                           batch=batch)
            if count:
                latency[f"{cache}, {batch}"] = 1e3 * _delta(
                    after, before, "ranker_request_seconds_sum", cache=cache,
                    batch=batch) / count
    calls = {}
    for call in ("score", "history"):
        count = max(_delta(after, before, "ranker_call_rows_count", call=call), 1)
        rows = _delta(after, before, "ranker_call_rows_sum", call=call)
        seconds = _delta(after, before, "ranker_call_seconds_sum", call=call)
        calls[call] = dict(rows_per_call=rows / count, ms_per_call=1e3 * seconds / count,
                           ms_per_row=1e3 * seconds / max(rows, 1))
    return dict(answered=answered, stages_ms=stages, latency_ms=latency, calls=calls,
                mean_ms=per_request("ranker_request_seconds_sum"),
                batch_requests=_delta(after, before, "ranker_batch_requests_sum")
                / max(_delta(after, before, "ranker_batch_requests_count"), 1))


def measure(server: LocalServer, trace: loadtest.Trace, qps: float, seconds: float) -> dict:
    """One load point: the client's report and the server's view of it."""
    before = server.metrics()
    report = loadtest.run(trace.load(qps, seconds), server.url)
    return dict(qps=qps, client=report, server=server_view(before, server.metrics()))


def within(point: dict, bound_ms: float) -> bool:
    client = point["client"]
    return (client["error_share"] <= MAX_ERRORS
            and client["latency"].get("p99_ms", float("inf")) <= bound_ms)


def sweep(server: LocalServer, trace: loadtest.Trace, size: Size, low: dict,
          bound_ms: float) -> list[dict]:
    """The ladder above the low point: rates up by 1.5x from 0.4 / (the low p50) while
    within the bound, then two bisections between the last within and the first beyond."""
    points = [low]
    qps = max(2 * low["qps"], 0.4e3 / low["client"]["latency"]["p50_ms"])
    inside, beyond = low["qps"] if within(low, bound_ms) else None, None
    while len(points) < size.max_points - 2 and beyond is None:
        points.append(measure(server, trace, qps, size.seconds))
        if within(points[-1], bound_ms):
            inside, qps = qps, 1.5 * qps
        else:
            beyond = qps
    for _ in range(2):
        if inside is None or beyond is None or len(points) >= size.max_points:
            break
        qps = float(np.sqrt(inside * beyond))
        points.append(measure(server, trace, qps, size.seconds))
        inside, beyond = (qps, beyond) if within(points[-1], bound_ms) else (inside, qps)
    return sorted(points, key=lambda p: p["qps"])


def run(preset_name: str, out: str, size: Size) -> dict:
    """Every configuration's points, and the figures the report derives from them."""
    preset = PRESETS[preset_name]
    max_history = size.max_history or preset.world.history_max
    per_user = -(-(1 + max_history) // serve.PAGE_SIZE)
    store_users = max(1, int(STORE_SHARE * size.users))
    common = ["--preset", preset_name, "--random-weights", "--max-history", str(max_history),
              "--max-candidates", str(size.candidates), "--max-users", str(store_users),
              "--device-pages", str(store_users * per_user)]
    env = dict(os.environ, JAX_COMPILATION_CACHE_DIR=str(Path(out) / "jax_cache"),
               JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
               JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
    results = dict(preset=preset_name, size=dataclasses.asdict(size), max_history=max_history,
                   store_users=store_users, configs={})
    bound_ms = None
    for name, flags in CONFIGS.items():
        started = time.perf_counter()
        server = LocalServer(out, common + flags, str(Path(out) / f"server-{name}.log"), env)
        ready = time.perf_counter() - started
        try:
            trace = loadtest.Trace(preset, users=size.users, zipf=ZIPF, change_share=CHANGED,
                                   seed=0, candidates=size.candidates, max_history=max_history)
            if name != BASELINE:  # fill the store, at a rate the baseline served easily
                warm = size.warm_requests * store_users
                rate = 0.3e3 / results["configs"][BASELINE]["points"][0]["client"]["latency"][
                    "p50_ms"]
                loadtest.run(trace.load(rate, warm / rate), server.url)
            low = measure(server, trace, size.low_qps,
                          max(size.seconds, size.low_requests / size.low_qps))
            if bound_ms is None:
                bound_ms = BOUND_FACTOR * low["client"]["latency"]["p50_ms"]
            points = sweep(server, trace, size, low, bound_ms)
            compiles = server.metrics()[("ranker_compiles_after_warmup", ())]
        finally:
            status = server.stop()
        best = max((p for p in points if within(p, bound_ms)), default=None,
                   key=lambda p: p["client"]["throughput_qps"])
        results["configs"][name] = dict(
            flags=flags, ready_seconds=ready, exit_status=status, points=points,
            compiles_after_warmup=compiles,
            throughput_at_bound=best["client"]["throughput_qps"] if best else 0.0,
            best=best)
    results["bound_ms"] = bound_ms
    results.update(derived(results))
    return results


def derived(results: dict) -> dict:
    """s, h, m, the analytic bound and the targets' figures."""
    configs = results["configs"]
    store = configs[STORE]
    low = store["points"][0]
    sources = {}
    for point in store["points"]:
        for source, lat in point["client"]["by_cache"].items():
            sources[source] = sources.get(source, 0) + lat["count"]
    m = sources.get("miss", 0) / max(sum(sources.values()), 1)
    s, h = (low["server"]["calls"][call]["ms_per_row"] for call in ("score", "history"))
    gain = store["throughput_at_bound"] / max(configs[BASELINE]["throughput_at_bound"], 1e-9)
    by_cache = low["client"]["by_cache"]
    return dict(s_ms=s, h_ms=h, m=m, sources=sources, analytic_gain=(s + h) / (s + m * h),
                gain=gain, batching_gain=store["throughput_at_bound"]
                / max(configs[UNBATCHED]["throughput_at_bound"], 1e-9),
                hit_p50_ms=by_cache.get("device", {}).get("p50_ms", float("nan")),
                miss_p50_ms=by_cache.get("miss", {}).get("p50_ms", float("nan")))


def machine() -> str:
    """The CPU's model name, its vector extensions, and the core count."""
    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    fields = dict(line.split(":", 1) for line in info.splitlines() if ":" in line)
    flags = fields.get("flags\t\t", fields.get("flags", "")).split()
    isa = "AMX" if "amx_tile" in flags else "AVX-512" if "avx512f" in flags else "AVX2"
    name = fields.get("model name\t", "unknown CPU").strip()
    return f"{name} ({isa}), {os.cpu_count()} cores"


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    for (name, config), color in zip(results["configs"].items(), ("C3", "C0", "C2")):
        points = [p for p in config["points"] if p["client"]["latency"].get("count")]
        qps = [p["qps"] for p in points]
        ax.plot(qps, [p["client"]["latency"]["p99_ms"] for p in points], "o-", color=color,
                label=f"{name}: p99")
        ax.plot(qps, [p["client"]["latency"]["p50_ms"] for p in points], "x--", color=color,
                alpha=0.6, label=f"{name}: p50")
    ax.axhline(results["bound_ms"], color="k", lw=0.8, ls=":", label="p99 bound")
    ax.set_xlabel("offered load (requests / s, Poisson)")
    ax.set_ylabel("latency (ms)")
    ax.set_yscale("log")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def report(results: dict, plot_name: str) -> str:
    r, c = results, results["configs"]
    size = r["size"]
    met = lambda ok: "yes" if ok else "no"  # noqa: E731
    lines = [
        "# The ranking server under load",
        "",
        f"Generated by `{COMMAND}`{' (--smoke)' if r['smoke'] else ''} on {r['date']}: "
        f"{r['machine']}, jax {r['jax']}. Preset `{r['preset']}` with random weights (speed "
        f"does not depend on them): histories of up to {r['max_history']} events, "
        f"{size['candidates']} candidates per request. The load generator "
        "(`python -m examples.ranker loadtest`, open loop, Poisson arrivals) runs on the same "
        "cores as the server. Do not edit by hand.",
        "",
        f"Trace: {size['users']} users, Zipf({ZIPF}) popularity, {int(100 * CHANGED)}% of "
        f"requests carry a changed history (one new event); the store holds "
        f"{r['store_users']} users ({int(100 * STORE_SHARE)}%, room for each one's longest "
        "history). Each server first serves a warm-up stretch that is not measured.",
        "",
        "## Targets",
        "",
        "| target | measured | met |",
        "|---|---|---|",
        f"| store throughput at the p99 bound >= 0.8 x the analytic bound (s + h) / (s + m h) "
        f"over --no-cache | {r['gain']:.2f}x against a bound of {r['analytic_gain']:.2f}x "
        f"({r['gain'] / r['analytic_gain']:.2f} of it) | "
        f"{met(r['gain'] >= 0.8 * r['analytic_gain'])} |",
        f"| a hit's p50 at low load <= 1/2 a miss's | {r['hit_p50_ms']:.1f} ms against "
        f"{r['miss_p50_ms']:.1f} ms | {met(r['hit_p50_ms'] <= 0.5 * r['miss_p50_ms'])} |",
        f"| --max-batch 8 >= 1.3x --max-batch 1 in throughput at the p99 bound | "
        f"{r['batching_gain']:.2f}x | {met(r['batching_gain'] >= 1.3)} |",
        "| no program compiled after warm-up | "
        + ", ".join(f"{int(v['compiles_after_warmup'])}" for v in c.values())
        + f" | {met(all(v['compiles_after_warmup'] == 0 for v in c.values()))} |",
        "",
        f"The p99 bound is {BOUND_FACTOR:g}x the --no-cache p50 at {size['low_qps']:g} "
        f"requests / s: **{r['bound_ms']:.1f} ms**. Throughput at the bound: the highest "
        f"answered rate among the points with p99 within it and at most {100 * MAX_ERRORS:g}% "
        "errors.",
        "",
        "| configuration | throughput at the bound (requests / s) | server ready after (s) |",
        "|---|---:|---:|",
    ]
    lines += [f"| {name} | {v['throughput_at_bound']:.1f} | {v['ready_seconds']:.0f} |"
              for name, v in c.items()]
    lines += [
        "",
        f"**s, h, m** (the store run): scoring {r['s_ms']:.2f} ms per request and the "
        f"history pass {r['h_ms']:.2f} ms per miss at {size['low_qps']:g} requests / s (the "
        f"server's call metrics; batches of about one request), miss share m = {r['m']:.3f} "
        "over the "
        f"measured points ({', '.join(f'{k} {v}' for k, v in sorted(r['sources'].items()))})."
        f" Bound (s + h) / (s + m h) = {r['analytic_gain']:.2f}x.",
        "",
        "## Latency against offered load",
        "",
        f"![latency against offered load]({plot_name})",
        "",
        "| configuration | offered / s | answered / s | p50 ms | p95 ms | p99 ms | errors | "
        "hits | mean batch | client CPU |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, v in c.items():
        for p in v["points"]:
            cl, lat = p["client"], p["client"]["latency"]
            hits = sum(s["count"] for k, s in cl["by_cache"].items() if k in ("device", "host"))
            errors = ", ".join(f"{k} {n}" for k, n in cl["errors"].items()) or "0"
            lines.append(
                f"| {name} | {cl['offered_qps']:.1f} | {cl['throughput_qps']:.1f} | "
                f"{lat.get('p50_ms', float('nan')):.1f} | {lat.get('p95_ms', float('nan')):.1f}"
                f" | {lat.get('p99_ms', float('nan')):.1f} | {errors} | "
                f"{hits / max(cl['answered_ok'], 1):.2f} | "
                f"{p['server']['batch_requests']:.1f} | "
                f"{100 * cl['client_cpu_share']:.0f}% |")
    lines += [
        "",
        "## Where the time goes",
        "",
        "Mean milliseconds per answered request at each configuration's highest rate within "
        "the bound (the server's stage metrics; a stage a request skips counts 0 for it: "
        "only misses have a history pass). parse: reading, JSON and checks; queue: until its "
        "batch was taken; store: the batch's acquire; history_wait / history: a miss waiting "
        "for the history stage, and the batched history pass with the store write; score: "
        "the scoring call that held it; serialize: the answer's JSON and sending it. The rest "
        "of the server's latency is uvicorn and the event loop; the client measures "
        "connection and its own scheduling on top.",
        "",
        *_table_head("stage", c),
    ]
    bests = [v["best"] or v["points"][0] for v in c.values()]
    for stage in STAGES:
        lines.append(f"| {stage} | " + " | ".join(f"{b['server']['stages_ms'][stage]:.2f}"
                                                    for b in bests) + " |")
    lines += [
        "| server latency (mean) | " + " | ".join(f"{b['server']['mean_ms']:.2f}"
                                                  for b in bests) + " |",
        "| client latency (mean) | " + " | ".join(
            f"{b['client']['latency'].get('mean_ms', float('nan')):.2f}" for b in bests) + " |",
        "| at requests / s | " + " | ".join(f"{b['qps']:.1f}" for b in bests) + " |",
        "",
        "What batching buys on these cores, at the same points: rows per model call, and "
        "its cost per call and per row (batching pays only as far as the cost per row falls "
        "with more rows):",
        "",
        *_table_head("call", c),
    ]
    for call in ("score", "history"):
        lines.append(f"| {call}: rows per call / ms per call / ms per row | " + " | ".join(
            "{rows_per_call:.1f} / {ms_per_call:.1f} / {ms_per_row:.2f}".format(
                **b["server"]["calls"][call]) for b in bests) + " |")
    lines += [
        "",
        "**Do hits wait for misses?** No: the front stage scores a batch's hits and answers "
        "them before the history stage runs its misses (engine.py); the two stages share "
        "the CPU cores and nothing else. Mean server latency by cache source and by whether "
        "the request's batch also held misses, at the same points:",
        "",
    ]
    kinds = sorted({k for b in bests for k in b["server"]["latency_ms"]})
    lines += _table_head("configuration", kinds)
    for name, b in zip(c, bests):
        lines.append(f"| {name} | " + " | ".join(
            f"{b['server']['latency_ms'][k]:.1f}" if k in b["server"]["latency_ms"] else "-"
            for k in kinds) + " |")
    lines.append("")
    return "\n".join(lines)


def _table_head(first: str, columns) -> list[str]:
    return ["| " + " | ".join([first, *columns]) + " |", "|---|" + "---:|" * len(columns)]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", choices=sorted(PRESETS), default="small")
    parser.add_argument("--out", required=True, help="run directory: the servers' logs and "
                        "compilation cache (and, with --smoke, the report)")
    parser.add_argument("--smoke", action="store_true", help="the smallest shapes and 2 s "
                        "points, to check the path end to end; the report goes to --out")


def main(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from examples.ranker.__main__ import meta

    os.makedirs(args.out, exist_ok=True)
    started = time.perf_counter()
    results = run(args.preset, args.out, SMOKE if args.smoke else FULL)
    results.update(meta(), machine=machine(), smoke=args.smoke,
                   seconds=time.perf_counter() - started)
    folder = Path(args.out) if args.smoke else BENCHMARKS
    data = folder / "server.json" if args.smoke else BENCHMARKS / "results" / "server.json"
    data.write_text(json.dumps(results, indent=1))
    plot(results, folder / "server_latency.png")
    (folder / "SERVER.md").write_text(report(results, "server_latency.png"))
    print(f"wrote {folder / 'SERVER.md'} in {results['seconds'] / 60:.1f} min")
    return 0
