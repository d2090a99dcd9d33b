"""The ranking server under load (``python -m examples.ranker serverbench``): benchmarks/SERVER.md.

Three configurations on one trace (random weights, one persistent compilation cache):
``--no-cache`` with ``--max-batch 8`` (the baseline), the history store with ``--max-batch
8``, and the store with ``--max-batch 1``. The store holds 10% of the trace's users (their
longest histories); the trace is Zipf(1.1) over the users with 10% of requests carrying a
changed history (loadtest.Trace). The whole measurement runs ``Size.runs`` times, the
configurations interleaved, each in a server started for it, run k on the trace of seed k.

Per server (measure_configuration), open-loop load (loadtest.run) in this order:

* fill (store configurations; not measured): offered above the baseline's capacity, so
  the store fills at the server's own pace;
* the low rate: hit and miss p50; run 1's baseline p50 sets the p99 bound (4x);
* capacity (saturate): offered at OVERLOAD x the analytic capacity at the low rate (again
  at twice that if the server kept up): the 200s answered per second while it saturates;
* throughput at the p99 bound (search_bound): bisection between the low rate (within the
  bound) and the capacity (beyond it) for ``Size.bisections`` steps; its resolution is the
  gap left between the last rate within and the first beyond.

At every point, s, h and m are measured under that load (analytic): scoring seconds per
request on each stage thread, history-pass seconds per miss (the server's call metrics,
labelled by thread) and the miss share (the client's cache sources); the analytic capacity
is the bottleneck stage thread's, 1 / max((1 - m) s_front, m (h + s_history)) (m = 1
with --no-cache, where the history thread does all the model work).

``--smoke`` runs the same path at the smallest shapes (short histories, a few users, short
points) and writes into ``--out``; the full run writes benchmarks/SERVER.md, its plot and
benchmarks/results/server.json. tests/ranker/test_server.py runs the smoke size on the test
servers it already has (``run``'s ``configs`` and ``launch``).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import itertools
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from examples.ranker import loadtest, serve
from examples.ranker.config import PRESETS
from examples.ranker.server.metrics import STAGES
from rankattn import peers

ROOT = Path(__file__).resolve().parents[2]
BENCHMARKS = ROOT / "benchmarks"
COMMAND = ".venv/bin/python -m examples.ranker serverbench --preset small --out runs/serverbench"
BASELINE, STORE, UNBATCHED = "no cache, batch 8", "store, batch 8", "store, batch 1"
BATCH_FLAGS = {BASELINE: ["--no-cache", "--max-batch", "8"], STORE: ["--max-batch", "8"],
               UNBATCHED: ["--max-batch", "1"]}
ZIPF, CHANGED, STORE_SHARE, BOUND_FACTOR, MAX_ERRORS = 1.1, 0.10, 0.10, 4.0, 0.01
OVERLOAD = 2.0     # the capacity point offers this times the capacity expected
SATURATED = 0.9    # ... and saturates when it answers less than this share of the offer
HITS, MISSES = ("device", "host"), ("miss", "off")  # cache sources; "off": --no-cache


@dataclasses.dataclass(frozen=True)
class Size:
    users: int               # in the trace; the store holds STORE_SHARE of them
    candidates: int
    max_history: int | None  # None: the world's history_max
    runs: int                # repetitions of the whole measurement
    low_qps: float           # the low rate ...
    low_seconds: float       # ... for this long
    fill_seconds: float      # store configurations, before measuring
    overload_seconds: float  # the capacity point
    seconds: float           # each point of the bisection
    bisections: int
    settle: float            # each point's first seconds, left out of its answered rate


FULL = Size(users=2000, candidates=64, max_history=None, runs=2, low_qps=3.0,
            low_seconds=12.0, fill_seconds=10.0, overload_seconds=8.0, seconds=8.0,
            bisections=4, settle=1.0)
SMOKE = Size(users=240, candidates=8, max_history=12, runs=2, low_qps=30.0, low_seconds=0.3,
             fill_seconds=0.2, overload_seconds=0.4, seconds=0.3, bisections=1, settle=0.1)


class LocalServer:
    """A ``python -m examples.ranker server`` process (or ``command``'s, with the same flags)
    on ``port`` of 127.0.0.1 (default a free one), ready (GET /healthz 200) when built,
    ``ready_seconds`` after its start, unless ``ready_within`` is None (then
    :meth:`wait_ready`); its output goes to ``log``, its flags are ``args``. With
    ``own_session`` it runs in a session of its own: a Ctrl-C in the terminal reaches only
    whoever started it (cluster.py, which then stops it in order). It gets this process as
    ``--parent-pid``: killed outright, this process leaves no server running."""

    def __init__(self, out: str, args: list[str], log: str, env: dict | None = None,
                 ready_within: float | None = 1200.0,
                 command: tuple[str, ...] = ("-m", "examples.ranker", "server"),
                 port: int | None = None, own_session: bool = False):
        self.port = port or free_ports(1)[0]
        self.url = f"http://127.0.0.1:{self.port}"
        self.log, self.args = log, args
        self.started = time.perf_counter()
        self.process = subprocess.Popen(
            [sys.executable, *command, "--out", out, "--port", str(self.port), *args,
             "--parent-pid", str(os.getpid())],
            cwd=ROOT, env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT,
            start_new_session=own_session)
        if ready_within is not None:
            self.wait_ready(ready_within)

    def wait_ready(self, within: float) -> None:
        """Wait until GET /healthz answers 200; a server that exits or is not ready within
        ``within`` seconds is killed, and its log raised."""
        deadline = time.monotonic() + within
        while self.get("/healthz")[0] != 200:
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.process.kill()
                raise RuntimeError(f"the server did not become ready:\n{open(self.log).read()}")
            time.sleep(0.2)
        self.ready_seconds = time.perf_counter() - self.started

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

    def stop(self, timeout: float = 10.0, sig: int = signal.SIGTERM) -> int:
        """SIGTERM (or ``sig``); the exit status (a server that does not exit in time is
        killed)."""
        self.process.send_signal(sig)
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            raise


def free_ports(count: int) -> list[int]:
    """``count`` distinct ports of 127.0.0.1 that nothing listens on now (each held until all
    are chosen, so that none is chosen twice)."""
    with contextlib.ExitStack() as stack:
        sockets = [stack.enter_context(socket.socket()) for _ in range(count)]
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]


# --- What one load point measures. -------------------------------------------------------


def _total(samples: dict, name: str, **labels) -> float:
    """The sum of every sample ``name`` (or ``name_total``: a counter under either name)
    whose labels include ``labels``."""
    return sum(v for (n, ls), v in samples.items()
               if n in (name, f"{name}_total") and set(labels.items()) <= set(ls))


def _value(samples: dict, name: str) -> float | None:
    """The unlabelled sample ``name`` (or ``name_total``); None when the server has none."""
    found = [v for (n, ls), v in samples.items() if n in (name, f"{name}_total") and not ls]
    return found[0] if found else None


def _labelled(samples: dict, name: str, label: str) -> bool:
    """Whether some sample ``name`` carries the label ``label``."""
    return any(n == name and label in dict(ls) for n, ls in samples)


def server_view(before: dict, after: dict, answered: int) -> dict:
    """What the server saw between two scrapes around ``answered`` 200s: mean ms per 200 of
    each stage, mean latency per label set of ranker_request_seconds (cache source, batch
    kind), model calls (rows, seconds, by thread where the metrics say), requests per
    batch."""
    def delta(name, **labels):
        return _total(after, name, **labels) - _total(before, name, **labels)

    stages = {stage: 1e3 * delta("ranker_stage_seconds_sum", stage=stage) / max(answered, 1)
              for stage in STAGES}
    latency = {}
    for labels in sorted({ls for n, ls in after if n == "ranker_request_seconds_count"}):
        count = delta("ranker_request_seconds_count", **dict(labels))
        if count:
            latency[", ".join(v for _, v in labels)] = 1e3 * delta(
                "ranker_request_seconds_sum", **dict(labels)) / count
    by_thread = _labelled(after, "ranker_call_seconds_sum", "thread")
    calls = {}
    for call in ("score", "history"):
        for thread in ("front", "history") if by_thread else ("all",):
            labels = dict(call=call, **({"thread": thread} if by_thread else {}))
            count = delta("ranker_call_rows_count", **labels)
            if count:
                rows, seconds = (delta(f"ranker_call_{what}_sum", **labels)
                                 for what in ("rows", "seconds"))
                calls[f"{call}, {thread}"] = dict(calls=count, rows=rows, seconds=seconds,
                                                  rows_per_call=rows / count,
                                                  ms_per_call=1e3 * seconds / count)
    return dict(answered=answered, stages_ms=stages, latency_ms=latency, calls=calls,
                by_thread=by_thread, mean_ms=1e3 * delta("ranker_request_seconds_sum")
                / max(answered, 1),
                batch_requests=delta("ranker_batch_requests_sum")
                / max(delta("ranker_batch_requests_count"), 1))


def analytic(client: dict, server: dict) -> dict:
    """s, h and m over one point's requests, and the capacities they imply (module
    docstring). Without the metrics' thread label, both threads' s is the mean of every
    scoring call."""
    count = lambda sources: sum(client["by_cache"].get(s, {}).get("count", 0)  # noqa: E731
                                for s in sources)
    hits, misses = count(HITS), count(MISSES)
    answered = max(hits + misses, 1)
    calls = server["calls"]
    seconds = lambda key: calls.get(key, {}).get("seconds", 0.0)  # noqa: E731
    if server["by_thread"]:
        s_front = seconds("score, front") / max(hits, 1)
        s_history = seconds("score, history") / max(misses, 1)
        history = seconds("history, history")
    else:
        s_front = s_history = seconds("score, all") / answered
        history = seconds("history, all")
    m, h = misses / answered, history / max(misses, 1)
    front, back = (1 - m) * s_front, m * (h + s_history)  # seconds per request, per thread
    if hits + misses and not front + back:
        raise RuntimeError(f"the server answered {hits + misses} requests and its /metrics "
                           "shows no model call: serverbench reads ranker_call_seconds and "
                           "ranker_call_rows {call, thread}; update server_view to the "
                           "names metrics.py exports")
    return dict(s_front_ms=1e3 * s_front, s_history_ms=1e3 * s_history, h_ms=1e3 * h, m=m,
                front_ms=1e3 * front, history_ms=1e3 * back,
                capacity=1 / max(front, back, 1e-9), one_core=1 / max(front + back, 1e-9))


def measure(server: LocalServer, trace: loadtest.Trace, qps: float, seconds: float,
            settle: float, kind: str) -> dict:
    """One load point: the client's report, the server's view of it, and s, h, m."""
    before = server.metrics()
    client = loadtest.run(trace.load(qps, seconds), server.url, settle=settle)
    view = server_view(before, server.metrics(), client["answered_ok"])
    return dict(kind=kind, qps=qps, client=client, server=view, model=analytic(client, view))


def within(point: dict, bound_ms: float) -> bool:
    """p99 within the bound and at most MAX_ERRORS of the requests refused or failed."""
    client = point["client"]
    return (client["error_share"] <= MAX_ERRORS
            and client["latency"].get("p99_ms", float("inf")) <= bound_ms)


def saturated(point: dict) -> bool:
    """Whether the server answered (inside the arrival window) less than SATURATED of the
    rate offered: it could not keep up."""
    return point["client"]["window_qps"] < SATURATED * point["client"]["offered_qps"]


def saturate(server, trace, size: Size, low: dict) -> list[dict]:
    """The capacity point (last), offered at OVERLOAD x the analytic capacity at the low
    rate, and once more at twice that if the server kept up with it. Where it kept up with
    the last too, that point's answered rate is a lower bound of the capacity (point_kind,
    capacity_shown)."""
    points = [measure(server, trace, OVERLOAD * low["model"]["capacity"],
                      size.overload_seconds, size.settle, "capacity")]
    if not saturated(points[0]):
        points.append(measure(server, trace, 2 * points[0]["qps"], size.overload_seconds,
                              size.settle, "capacity"))
    return points


def point_kind(point: dict) -> str:
    """A load point's kind as the reports show it: a capacity point the server kept up with
    says so."""
    kind = point["kind"]
    if kind.startswith("capacity") and not saturated(point):
        return "capacity, not saturated"
    return "capacity" if kind.startswith("capacity") else kind


def capacity_shown(point: dict, spec: str = ".1f") -> str:
    """A capacity point's answered rate, as ">= rate" where the server kept up with what was
    offered: the capacity is then at least that, and unknown."""
    return ("" if saturated(point) else ">= ") + format(point["client"]["window_qps"], spec)


def search_bound(server, trace, size: Size, low: dict, capacity: float,
                 bound_ms: float) -> tuple[list[dict], dict | None, list[float]]:
    """Bisection for the highest rate within the p99 bound, between the low rate (within
    it, or there is nothing to search) and the capacity (beyond it: at capacity the queue
    has no slack): (its points, the last point within, [last rate within, first beyond])."""
    inside = low if within(low, bound_ms) else None
    lo = low["qps"]
    hi = max(capacity, lo)  # a capacity at or below the low rate leaves nothing to search
    points = []
    for _ in range(size.bisections if inside is not None and hi > lo else 0):
        qps = (lo + hi) / 2
        points.append(measure(server, trace, qps, size.seconds, size.settle, "bisection"))
        if within(points[-1], bound_ms):
            lo, inside = qps, points[-1]
        else:
            hi = qps
    return points, inside, [lo, hi]


def measure_configuration(server: LocalServer, trace: loadtest.Trace, size: Size, cache: bool,
                          fill_qps: float | None, bound_ms: float | None) -> dict:
    """Every point of one configuration in one run (the module docstring's order);
    ``bound_ms`` None: 4x this configuration's p50 at the low rate."""
    fill = (measure(server, trace, fill_qps, size.fill_seconds, size.settle, "fill")
            if cache else None)
    low = measure(server, trace, size.low_qps, size.low_seconds, size.settle, "low")
    if not low["client"]["answered_ok"]:
        raise RuntimeError(f"no request at the low rate ({size.low_qps:g} / s) was answered "
                           f"200: errors {low['client']['errors']}; see the server's log")
    bound_ms = bound_ms or BOUND_FACTOR * low["client"]["latency"]["p50_ms"]
    capacity = saturate(server, trace, size, low)
    bisection, inside, bracket = search_bound(server, trace, size, low,
                                              capacity[-1]["client"]["window_qps"], bound_ms)
    compiles = _value(server.metrics(), "ranker_compiles_after_warmup")
    return dict(ready_seconds=server.ready_seconds, bound_ms=bound_ms,
                compiles_after_warmup=compiles,
                points=[p for p in [fill, low, *capacity, *bisection] if p is not None],
                low=low, capacity=capacity[-1], at_bound=inside, bracket=bracket)


# --- A run of every configuration, and the figures. --------------------------------------


def server_flags(preset_name: str, size: Size) -> dict[str, list[str]]:
    """Each configuration's server flags: the store sized for STORE_SHARE of the users."""
    max_history = size.max_history or PRESETS[preset_name].world.history_max
    per_user = -(-(1 + max_history) // serve.PAGE_SIZE)
    store_users = max(1, int(STORE_SHARE * size.users))
    common = ["--preset", preset_name, "--random-weights", "--max-history", str(max_history),
              "--max-candidates", str(size.candidates), "--max-users", str(store_users),
              "--device-pages", str(store_users * per_user)]
    return {name: common + flags for name, flags in BATCH_FLAGS.items()}


def run(preset_name: str, out: str, size: Size, configs: dict[str, list[str]] | None = None,
        launch=None) -> dict:
    """Every run's points and figures. ``configs``: {name: server flags}, the baseline
    (BASELINE, whose capacity sets the store's fill rate) first; default server_flags.
    ``launch(name, flags)``: a context manager holding a ready LocalServer; default one
    started for it (its compilation cache under ``out``) and stopped after."""
    configs = configs or server_flags(preset_name, size)
    if next(iter(configs)) != BASELINE:
        raise ValueError(f"configs {list(configs)}: the first must be {BASELINE!r}, the "
                         "baseline the others' fill rate and gains are measured against")
    launch = launch or _launcher(out)
    preset = PRESETS[preset_name]
    max_history = size.max_history or preset.world.history_max
    results = dict(preset=preset_name, size=dataclasses.asdict(size), max_history=max_history,
                   configs=configs, runs=[])
    bound_ms = None
    for number in range(size.runs):
        measured = {}
        trace = loadtest.Trace(preset, users=size.users, zipf=ZIPF, change_share=CHANGED,
                               seed=number, candidates=size.candidates, max_history=max_history)
        for name, flags in configs.items():
            fill = (OVERLOAD * max(measured[BASELINE]["capacity"]["client"]["window_qps"],
                                   size.low_qps) if measured else None)
            with launch(name, flags) as server:
                measured[name] = measure_configuration(server, trace.fork(), size,
                                                       "--no-cache" not in flags, fill,
                                                       bound_ms)
            bound_ms = bound_ms or measured[name]["bound_ms"]
        results["runs"].append(dict(configs=measured, figures=figures(measured)))
    results["bound_ms"] = bound_ms
    return results


def _launcher(out: str):
    """run's default launch: a LocalServer of its own per call, its log numbered in order
    under ``out``, with the run's compilation cache (the first server's programs load in
    the next ones), stopped after."""
    env = dict(os.environ, JAX_COMPILATION_CACHE_DIR=str(Path(out) / "jax_cache"),
               JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
               JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
    numbers = itertools.count(1)

    @contextlib.contextmanager
    def launch(name: str, flags: list[str]):
        log = Path(out) / f"server-{next(numbers)}-{name.replace(', ', '-')}.log"
        server = LocalServer(out, flags, str(log), env)
        try:
            yield server
        finally:
            server.stop()
    return launch


def figures(measured: dict) -> dict:
    """One run's headline figures: capacities and throughputs at the bound, the store's
    gains over the baseline, measured and analytic, and the low rate's hit and miss p50."""
    capacity = {n: c["capacity"]["client"]["window_qps"] for n, c in measured.items()}
    analytic_capacity = {n: c["capacity"]["model"]["capacity"] for n, c in measured.items()}
    at_bound = {n: c["at_bound"]["client"]["window_qps"] if c["at_bound"] else 0.0
                for n, c in measured.items()}
    ratio = lambda d, a, b: d[a] / max(d[b], 1e-9) if a in d and b in d else None  # noqa: E731
    by_cache = measured[STORE]["low"]["client"]["by_cache"] if STORE in measured else {}
    return dict(capacity=capacity, analytic_capacity=analytic_capacity, at_bound=at_bound,
                gain=ratio(capacity, STORE, BASELINE),
                analytic_gain=ratio(analytic_capacity, STORE, BASELINE),
                bound_gain=ratio(at_bound, STORE, BASELINE),
                batching_gain=ratio(at_bound, STORE, UNBATCHED),
                hit_p50_ms=by_cache.get("device", {}).get("p50_ms", float("nan")),
                miss_p50_ms=by_cache.get("miss", {}).get("p50_ms", float("nan")))


# --- The report. -------------------------------------------------------------------------


def plot(results: dict, path: Path) -> None:
    """p99 against offered load below capacity, each run's capacity a dashed line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    for name, color in zip(results["configs"], ("C3", "C0", "C2")):
        for number, (one_run, marker) in enumerate(zip(results["runs"], "os^v")):
            measured, alpha = one_run["configs"][name], 1.0 if number == 0 else 0.5
            points = sorted((p for p in measured["points"]  # below capacity
                             if p["kind"] in ("low", "bisection")
                             and p["client"]["latency"].get("count")),
                            key=lambda p: p["client"]["offered_qps"])
            ax.plot([p["client"]["offered_qps"] for p in points],
                    [p["client"]["latency"]["p99_ms"] for p in points], marker + "-",
                    color=color, alpha=alpha, ms=4, label=f"{name}, run {number + 1}: p99")
            ax.axvline(measured["capacity"]["client"]["window_qps"], color=color, alpha=alpha,
                       lw=0.8, ls="--")
    ax.axhline(results["bound_ms"], color="k", lw=0.8, ls=":", label="p99 bound")
    ax.plot([], [], color="k", lw=0.8, ls="--", label="capacity (answered / s, saturated)")
    ax.set_xlabel("offered load (requests / s, Poisson)")
    ax.set_ylabel("p99 latency (ms)")
    ax.set_yscale("log")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _each(values, spec: str = ".1f") -> str:
    """Every run's value, run 1 first."""
    return " / ".join("-" if v is None else format(v, spec) for v in values)


def _table_head(first: str, columns) -> list[str]:
    return ["| " + " | ".join([first, *columns]) + " |", "|---|" + "---:|" * len(columns)]


def threads(flags: list[str]) -> tuple[str, str, str]:
    """(the front thread's work, the history thread's, the analytic capacity)."""
    if "--no-cache" in flags:
        return ("acquire and hand-over (no model work)", "history pass and scoring of every "
                "request", "1 / (h + s_history) (m = 1)")
    return ("acquire, scoring of hits", "history pass and scoring of misses",
            "1 / max((1 - m) s_front, m (h + s_history))")


def report(results: dict, plot_name: str) -> str:
    """SERVER.md's text."""
    r, size, runs = results, results["size"], results["runs"]
    names = list(r["configs"])
    each = lambda fn, spec=".1f": _each([fn(run) for run in runs], spec)  # noqa: E731
    config = lambda name: lambda run: run["configs"][name]  # noqa: E731
    fig = lambda key: [run["figures"][key] for run in runs]  # noqa: E731
    met = lambda oks: "yes" if all(oks) else "no"  # noqa: E731
    lines = [
        "# The ranking server under load",
        "",
        f"Generated by `{COMMAND}`{' (--smoke)' if r['smoke'] else ''} on {r['date']} in "
        f"{r['seconds'] / 60:.1f} min: {r['machine']}, jax {r['jax']}. Preset `{r['preset']}` "
        f"with random weights (speed does not depend on them): histories of up to "
        f"{r['max_history']} events, {size['candidates']} candidates per request. The load "
        "generator (`python -m examples.ranker loadtest`, open loop, Poisson arrivals) runs "
        "on the same cores as the server. Do not edit by hand.",
        "",
        f"Trace: {size['users']} users, Zipf({ZIPF}) popularity, {int(100 * CHANGED)}% of "
        "requests carry a changed history (one new event). Every figure is given for each "
        f"of the {len(runs)} runs, run 1 first (`a / b`): the whole measurement was repeated, "
        "the configurations interleaved, each in a server of its own, run k on the trace of "
        "seed k.",
        "",
        "## Targets",
        "",
        "| target | measured, each run | met in every run |",
        "|---|---|---|",
    ]
    if r["runs"][0]["figures"]["gain"] is not None:
        gains = list(zip(fig("gain"), fig("analytic_gain")))
        lines.append(
            f"| {STORE} capacity over {BASELINE} >= 0.8 x the analytic ratio (each one's "
            f"bottleneck thread at its capacity point) | "
            + "; ".join(f"{g:.2f}x against {a:.2f}x ({g / a:.2f} of it)" for g, a in gains)
            + f" | {met(g >= 0.8 * a for g, a in gains)} |")
        p50s = list(zip(fig("hit_p50_ms"), fig("miss_p50_ms")))
        lines.append("| a hit's p50 at the low rate <= 1/2 a miss's | "
                     + "; ".join(f"{h:.1f} ms against {m:.1f} ms" for h, m in p50s)
                     + f" | {met(h <= 0.5 * m for h, m in p50s)} |")
    if r["runs"][0]["figures"]["batching_gain"] is not None:
        lines.append(f"| --max-batch 8 >= 1.3x --max-batch 1 in throughput at the p99 bound "
                     f"| {_each(fig('batching_gain'), '.2f')} (x) | "
                     f"{met(g >= 1.3 for g in fig('batching_gain'))} |")
    compiles = [c["compiles_after_warmup"] for run in runs for c in run["configs"].values()]
    lines += [
        "| no program compiled after warm-up (every server) | "
        + ", ".join("not exported" if c is None else f"{c:g}" for c in compiles)
        + f" | {met(c == 0 for c in compiles)} |",
        "",
        "## Method",
        "",
        "Each server runs two stage threads beside uvicorn's event loop (which parses and "
        "serialises): the **front** thread takes batches from the queue and acquires their "
        "rows in the store, the **history** thread runs the history passes (examples/ranker/"
        "server/engine.py). Which model work each does, and the analytic capacity that "
        "follows:",
        "",
        "| configuration | server flags | front thread | history thread | analytic capacity "
        "| ready after (s) |",
        "|---|---|---|---|---|---:|",
    ]
    for name, flags in r["configs"].items():
        lines.append(f"| {name} | `{' '.join(flags)}` | " + " | ".join(threads(flags))
                     + f" | {each(lambda run: config(name)(run)['ready_seconds'], '.0f')} |")
    lines += [
        "",
        "**s, h, m** are measured at every load point, over its own requests: s_front and "
        "s_history, the scoring calls' seconds per request they scored on the front and on "
        "the history thread (the server's `ranker_call_seconds{call=\"score\",thread=...}`); "
        "h, the history passes' seconds (the pass and the store write) per miss; m, the "
        "share of the 200s whose history was computed (the answers' `cache`: `miss`, or "
        "`off` with --no-cache, where m = 1). Per request, the front thread's model work is "
        "(1 - m) s_front and the history thread's m (h + s_history). **The analytic "
        "capacity** is the busier thread's limit, 1 / max((1 - m) s_front, m (h + s_history))"
        ", as if each thread had a core of its own; **one core**, 1 / ((1 - m) s_front + m "
        "(h + s_history)) (= 1 / (s + m h) when both threads' s are equal), as if the two "
        "took turns on one. The machine has "
        f"{os.cpu_count()} cores, which XLA's calls (each across its own thread pool), the "
        "event loop and the load generator share: s and h measured under load include that "
        "contention.",
        "",
        "Per server, in this order:",
        "",
        f"1. **Fill** (store configurations, not measured): {size['fill_seconds']:g} s "
        f"offered at {OVERLOAD:g}x the same run's {BASELINE} capacity, so the store fills at "
        "the server's own pace.",
        f"2. **The low rate**: {size['low_qps']:g} requests / s for {size['low_seconds']:g} s. "
        f"The p99 bound is {BOUND_FACTOR:g}x run 1's {BASELINE} p50 here: "
        f"**{r['bound_ms']:.1f} ms** (the same bound in every run).",
        f"3. **Capacity**: open-loop overload, offered at {OVERLOAD:g}x the analytic capacity "
        f"at the low rate for {size['overload_seconds']:g} s (at twice that once more if the "
        f"server answered more than {SATURATED:.0%} of it); the capacity is the 200s answered "
        f"per second from {size['settle']:g} s after the first arrival to the last (what the "
        "queue drains after it left out), while the rest of the offer is refused (503 "
        "`queue_full`) or waits.",
        f"4. **Throughput at the p99 bound**: {size['bisections']} bisection steps of "
        f"{size['seconds']:g} s between the low rate (within the bound) and the capacity "
        "(beyond it: at capacity the queue has no slack). A point is within the bound when "
        f"its p99 is and at most {100 * MAX_ERRORS:g}% of its requests failed. Throughput at "
        "the bound: the answered rate at the last rate within; the search's resolution is "
        "the gap left between that and the first rate beyond, at most (capacity - low rate) "
        f"/ {2 ** size['bisections']}. A p99 over n requests rests on its n / 100 slowest, "
        "and a search assumes that a rate beyond the bound is beyond it at every higher "
        "rate: the runs' spread shows how far a point's noise moves the result.",
        "",
        "## Capacity",
        "",
        "The highest answered rate, saturating, beside its analytic counterpart from s, h and "
        "m measured at the same point (each run: `run 1 / run 2`):",
        "",
        "| configuration | capacity (answered / s) | offered / s | refused or failed | "
        "analytic (busier thread) / s | capacity / analytic | one core / s |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name in names:
        point = lambda run: config(name)(run)["capacity"]  # noqa: E731
        lines.append(
            f"| {name} | {' / '.join(capacity_shown(point(run)) for run in runs)} | "
            f"{each(lambda run: point(run)['client']['offered_qps'])} | "
            f"{each(lambda run: point(run)['client']['error_share'], '.0%')} | "
            f"{each(lambda run: point(run)['model']['capacity'])} | "
            + each(lambda run: point(run)['client']['window_qps']
                   / point(run)['model']['capacity'], '.2f')
            + f" | {each(lambda run: point(run)['model']['one_core'])} |")
    lines += [
        "",
        "## Throughput at the p99 bound",
        "",
        f"The answered rate at the highest rate found within the bound ({r['bound_ms']:.1f} "
        "ms), beside the analytic capacity with s, h and m measured at that point; their "
        "ratio is the busier thread's share of its capacity in use there (what the p99 "
        "leaves of it).",
        "",
        "| configuration | throughput at the bound (answered / s) | last rate within / first "
        "beyond (offered / s, the search's) | resolution / s | p99 ms there | analytic "
        "capacity there / s | throughput / analytic |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name in names:
        best = lambda run: config(name)(run)["at_bound"] or {}  # noqa: E731
        value = lambda fn: lambda run: fn(best(run)) if best(run) else None  # noqa: E731
        bracket = lambda run: config(name)(run)["bracket"]  # noqa: E731
        lines.append(
            f"| {name} | {each(value(lambda p: p['client']['window_qps']))} | "
            + " / ".join(f"{b[0]:.1f}-{b[1]:.1f}" for b in map(bracket, runs))
            + f" | {each(lambda run: bracket(run)[1] - bracket(run)[0])} | "
            f"{each(value(lambda p: p['client']['latency']['p99_ms']))} | "
            f"{each(value(lambda p: p['model']['capacity']))} | "
            + each(value(lambda p: p['client']['window_qps'] / p['model']['capacity']),
                   '.2f') + " |")
    if r["runs"][0]["figures"]["bound_gain"] is not None:
        lines += ["", f"{STORE} over {BASELINE} at the bound: "
                  f"{_each(fig('bound_gain'), '.2f')} (x); in capacity: "
                  f"{_each(fig('gain'), '.2f')} (x)."]
    lines += [
        "",
        "## s, h and m by load",
        "",
        "Milliseconds per request (each run: `run 1 / run 2`); the thread columns are each "
        "stage thread's model work per answered request, (1 - m) s_front and m (h + "
        "s_history).",
        "",
        "| configuration | point | requests / s | s_front | s_history | h | m | front thread "
        "| history thread |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name in names:
        for label, key in (("low rate", "low"), ("at the bound", "at_bound"),
                           ("capacity", "capacity")):
            point = lambda run: config(name)(run)[key]  # noqa: E731
            model = lambda field, spec=".2f": each(  # noqa: E731
                lambda run: point(run)["model"][field] if point(run) else None, spec)
            lines.append(
                f"| {name} | {label} | "
                + each(lambda run: point(run)["client"]["window_qps"] if point(run) else None)
                + f" | {model('s_front_ms')} | {model('s_history_ms')} | {model('h_ms')} | "
                f"{model('m', '.3f')} | {model('front_ms')} | {model('history_ms')} |")
    lines += [
        "",
        "## Latency against offered load",
        "",
        f"![p99 latency against offered load]({plot_name})",
        "",
        "| configuration | run | point | offered / s | answered / s | p50 ms | p95 ms | "
        "p99 ms | requests | errors | hits | mean batch | client CPU |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name in names:
        for number, one_run in enumerate(runs):
            for p in one_run["configs"][name]["points"]:
                cl, lat = p["client"], p["client"]["latency"]
                hits = sum(s["count"] for k, s in cl["by_cache"].items() if k in HITS)
                errors = ", ".join(f"{k} {n}" for k, n in cl["errors"].items()) or "0"
                lines.append(
                    f"| {name} | {number + 1} | {point_kind(p)} | {cl['offered_qps']:.1f} | "
                    f"{cl['window_qps']:.1f} | {lat.get('p50_ms', float('nan')):.1f} | "
                    f"{lat.get('p95_ms', float('nan')):.1f} | "
                    f"{lat.get('p99_ms', float('nan')):.1f} | {cl['requests']} | {errors} | "
                    f"{hits / max(cl['answered_ok'], 1):.2f} | "
                    f"{p['server']['batch_requests']:.1f} | "
                    f"{100 * cl['client_cpu_share']:.0f}% |")
    at = lambda name: lambda run: (config(name)(run)["at_bound"]  # noqa: E731
                                   or config(name)(run)["low"])
    lines += [
        "",
        "## Where the time goes",
        "",
        "Mean milliseconds per answered request at each configuration's point at the bound "
        "(its low rate where none was within), from the server's stage metrics (a stage a "
        "request skips counts 0 for it: only misses have a history pass). parse: reading, "
        "JSON and checks; queue: until its batch was taken; store: the batch's acquire; "
        "history_wait / history: a miss waiting for the history thread, and the batched "
        "history pass with the store write; score: the scoring call that held it; "
        "serialize: the answer's JSON and sending it. The rest of the server's latency is "
        "uvicorn and the event loop; the client measures connection and its own scheduling "
        "on top.",
        "",
        *_table_head("stage", names),
    ]
    server = lambda name, fn, spec=".2f": each(lambda run: fn(at(name)(run)), spec)  # noqa: E731
    for stage in STAGES:
        lines.append(f"| {stage} | " + " | ".join(
            server(n, lambda p: p["server"]["stages_ms"].get(stage)) for n in names) + " |")
    lines += [
        "| server latency (mean) | " + " | ".join(
            server(n, lambda p: p["server"]["mean_ms"]) for n in names) + " |",
        "| client latency (mean) | " + " | ".join(
            server(n, lambda p: p["client"]["latency"].get("mean_ms")) for n in names) + " |",
        "| at requests / s | " + " | ".join(
            server(n, lambda p: p["client"]["window_qps"], ".1f") for n in names) + " |",
        "",
        "Model calls at the same points, by call and thread: rows per call and milliseconds "
        "per call (batching pays only as far as the cost per row falls with more rows):",
        "",
        *_table_head("call, thread", names),
    ]
    calls = sorted({k for run in runs for n in names for k in at(n)(run)["server"]["calls"]})
    for call in calls:
        cell = lambda name, field: server(  # noqa: E731
            name, lambda p: p["server"]["calls"].get(call, {}).get(field))
        lines.append(f"| {call}: rows per call; ms per call | " + " | ".join(
            f"{cell(n, 'rows_per_call')}; {cell(n, 'ms_per_call')}" for n in names) + " |")
    kinds = sorted({k for run in runs for n in names for k in at(n)(run)["server"]["latency_ms"]})
    lines += [
        "",
        "**Do hits wait for misses?** Mean server latency (ms) by the labels of "
        "`ranker_request_seconds` (the answer's cache source, and whether the request's batch "
        "also held misses), at the same points:",
        "",
        *_table_head("configuration", kinds),
    ]
    for name in names:
        lines.append(f"| {name} | " + " | ".join(
            server(name, lambda p: p["server"]["latency_ms"].get(kind), ".1f")
            for kind in kinds) + " |")
    lines.append("")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", choices=sorted(PRESETS), default="small")
    parser.add_argument("--out", required=True, help="run directory: the servers' logs and "
                        "compilation cache (and, with --smoke, the report)")
    parser.add_argument("--smoke", action="store_true", help="the smallest shapes and short "
                        "points, to check the path end to end; the report goes to --out")


def main(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    os.makedirs(args.out, exist_ok=True)
    results = write(args.preset, args.out, SMOKE if args.smoke else FULL, args.smoke)
    print(f"wrote {results['report']} in {results['seconds'] / 60:.1f} min")
    return 0


def write(preset_name: str, out: str, size: Size, smoke: bool, configs=None,
          launch=None) -> dict:
    """Run, then write the JSON, the plot and SERVER.md: into ``out`` when ``smoke``, else
    benchmarks/ (the JSON in benchmarks/results/). The results, with the report's path."""
    from examples.ranker.__main__ import meta

    started = time.perf_counter()
    results = run(preset_name, out, size, configs, launch)
    results.update(meta(), machine=peers.machine_description(), smoke=smoke,
                   seconds=time.perf_counter() - started)
    folder = Path(out) if smoke else BENCHMARKS
    data = folder / "server.json" if smoke else BENCHMARKS / "results" / "server.json"
    data.write_text(json.dumps(results, indent=1))
    plot(results, folder / "server_latency.png")
    (folder / "SERVER.md").write_text(report(results, "server_latency.png"))
    return dict(results, report=str(folder / "SERVER.md"))
