"""An open-loop load generator for the ranking server (``python -m examples.ranker loadtest``).

Requests arrive on a Poisson clock at ``--qps`` for ``--duration`` seconds, whatever the
server answers: a slow server cannot slow the client down and hide its queue (a closed
loop would). Latency counts from each request's scheduled time, so a late send is the
server's delay too. Every request is built and encoded before the clock starts.

The trace (:class:`Trace`): ``--users`` users of the preset's world with its histories
(at most ``--max-history`` events, the newest), chosen with Zipf(``--zipf``) popularity;
before a request, with probability ``--change-share``, its user's history gains one event
(so the server must recompute it, never serve the old one). Each request ranks
``--candidates`` random items of the world, and names its user in the ``X-User-Id`` header
too (what a proxy routing by user reads: ``python -m examples.ranker cluster``). The client
sends only to 127.0.0.1, and stops by itself: after the last arrival it waits at most
``--grace`` seconds for answers (the rest count as errors of kind ``no_answer``).

The report (``--report FILE``, JSON): offered and achieved rate (overall, and within the
arrival window: ``window_qps``, the server's capacity when the offer exceeds it), p50 / p95 /
p99 latency of the 200s (all, and by cache source), errors by kind, cache sources, and the
client's own CPU use (it shares the machine's cores with the server).
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import dataclasses
import json
import time
import urllib.parse

import numpy as np

from examples.ranker.config import ACTIONS, PRESETS
from examples.ranker.server.schema import USER_HEADER
from examples.ranker.world import World

MAX_CONNECTIONS = 1000  # requests in flight at most; past it a request counts as client_limit


@dataclasses.dataclass
class Load:
    """Requests ready to send: ``at`` [n] seconds after the start, ``requests`` their bytes."""

    at: np.ndarray
    requests: list[bytes]


class Trace:
    """Users with histories and a Zipf popularity; each call of :meth:`load` continues from
    the histories the previous one left (a changed history stays changed)."""

    def __init__(self, preset, *, users: int, zipf: float, change_share: float, seed: int,
                 candidates: int = 64, max_history: int | None = None):
        world = self.world = World(preset.world)
        self.rng = np.random.default_rng(seed)
        self.change_share, self.candidates = change_share, candidates
        cap = min(max_history or preset.world.history_max, preset.world.history_max)
        sessions = world.sample(self.rng, users)
        self.users = self.rng.permutation(world.config.users)[:users] + 1  # distinct ids
        self.contexts = sessions.context
        self.histories = []  # per user: [items, authors, actions] lists, oldest first
        for i in range(users):
            kept = slice(max(0, sessions.history_len[i] - cap), sessions.history_len[i])
            self.histories.append([sessions.history_item[i, kept].tolist(),
                                   sessions.history_author[i, kept].tolist(),
                                   sessions.history_actions[i, kept].astype(int).tolist()])
        self.cap = cap
        self.changes = np.zeros(users, np.int64)  # the hint each user's client sends
        popularity = 1.0 / np.arange(1, users + 1) ** zipf
        self.popularity = popularity / popularity.sum()
        self.rank = self.rng.permutation(users)  # popularity rank -> user index

    def fork(self) -> "Trace":
        """A copy whose requests continue from this trace's state independently of it (the
        same requests this trace would send next), sharing its world."""
        twin = copy.copy(self)
        twin.rng = copy.deepcopy(self.rng)
        # Events are appended and dropped, never changed: copies of each user's lists do.
        twin.histories = [[list(part) for part in history] for history in self.histories]
        twin.changes = self.changes.copy()
        return twin

    def load(self, qps: float, duration: float, path: str = "/v1/rank") -> Load:
        """Poisson arrivals at ``qps`` for ``duration`` seconds, each an encoded request."""
        gaps = self.rng.exponential(1.0 / qps, size=int(qps * duration * 1.5) + 16)
        at = np.cumsum(gaps)
        at = at[at < duration]
        who = self.rank[self.rng.choice(len(self.rank), size=len(at), p=self.popularity)]
        return Load(at, [self._request(int(i), path) for i in who])

    def _request(self, i: int, path: str) -> bytes:
        items, authors, actions = self.histories[i]
        if self.rng.random() < self.change_share:  # one new event, the oldest dropped at cap
            item = int(self.rng.integers(1, self.world.config.items + 1))
            items.append(item)
            authors.append(int(self.world.item_author[item]))
            actions.append((self.rng.random(len(ACTIONS)) < 0.3).astype(int).tolist())
            if len(items) > self.cap:
                del items[0], authors[0], actions[0]
            self.changes[i] += 1
        cand = self.rng.integers(1, self.world.config.items + 1, size=self.candidates)
        body = json.dumps({"user": int(self.users[i]), "context": int(self.contexts[i]),
                           "history_version": int(self.changes[i]), "history_item": items,
                           "history_author": authors, "history_actions": actions,
                           "cand_item": cand.tolist(),
                           "cand_author": self.world.item_author[cand].tolist()},
                          separators=(",", ":")).encode()
        return (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json"
                f"\r\n{USER_HEADER}: {self.users[i]}\r\nContent-Length: {len(body)}\r\n\r\n"
                ).encode() + body


def local_address(url: str) -> tuple[str, int, str]:
    """(host, port, path) of an http://127.0.0.1:PORT/... URL; anything else is refused."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme != "http" or parts.hostname not in ("127.0.0.1", "localhost") \
            or parts.port is None:
        raise ValueError(f"--url {url}: the load generator sends only to this machine; use "
                         "http://127.0.0.1:PORT (the server's --port)")
    return "127.0.0.1", parts.port, parts.path or "/v1/rank"


async def _send_all(load: Load, host: str, port: int, grace: float) -> tuple[list, float]:
    """Send every request at its time; (per request (latency s or None, status, what), the
    seconds from the first scheduled send to the last answer)."""
    loop = asyncio.get_running_loop()
    idle: list[tuple] = []  # open keep-alive connections
    results: list = [None] * len(load.requests)
    in_flight = set()

    async def one(i: int, scheduled: float):
        if len(in_flight) > MAX_CONNECTIONS:
            results[i] = (None, 0, "client_limit")
            return
        reader = writer = None
        try:
            reader, writer = idle.pop() if idle else await asyncio.open_connection(host, port)
            writer.write(load.requests[i])
            head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
            status = int(head[0].split()[1])
            fields = dict(line.lower().split(": ", 1) for line in head[1:] if ": " in line)
            body = await reader.readexactly(int(fields.get("content-length", 0)))
            latency = loop.time() - scheduled
            what = json.loads(body).get("cache") if status == 200 else error_kind(status, body)
            results[i] = (latency, status, what)
            if fields.get("connection") != "close":
                idle.append((reader, writer))
                writer = None
        except (OSError, asyncio.IncompleteReadError, ValueError, AttributeError) as err:
            results[i] = (None, 0, f"connection: {type(err).__name__}")
        finally:
            if writer is not None:
                writer.close()

    def spawn(i: int, scheduled: float):
        task = loop.create_task(one(i, scheduled))
        in_flight.add(task)
        task.add_done_callback(in_flight.discard)

    start = loop.time() + 0.05
    for i, t in enumerate(load.at):
        loop.call_at(start + t, spawn, i, start + t)
    end = start + (load.at[-1] if len(load.at) else 0.0)
    await asyncio.sleep(max(0.0, end - loop.time()) + 0.01)
    deadline = loop.time() + grace
    while in_flight and loop.time() < deadline:
        await asyncio.wait(set(in_flight), timeout=deadline - loop.time())
    for task in list(in_flight):
        task.cancel()
    finished = loop.time()
    for _, writer in idle:
        writer.close()
    return [r or (None, 0, "no_answer") for r in results], finished - start


def error_kind(status: int, body: bytes) -> str:
    """The kind a non-200 answer counts under: the server's error kind, or ``HTTP <status>``
    for a body that is not the server's JSON error (a proxy's own page, e.g. HAProxy's 503
    when no replica is up)."""
    try:
        return str(json.loads(body)["error"]["kind"])
    except (ValueError, KeyError, TypeError):
        return f"HTTP {status}"


def run(load: Load, url: str, grace: float = 10.0, settle: float = 0.0) -> dict:
    """Send ``load`` to ``url`` (127.0.0.1 only); the report (see the module docstring).

    ``window_qps`` counts the 200s answered from ``settle`` seconds after the first
    scheduled arrival to the last one, per second: under a load past what the server can
    answer, its capacity (the answers the queue drains after the last arrival, and the
    ramp-up of the first ``settle`` seconds, left out)."""
    host, port, _ = local_address(url)
    cpu, wall = time.process_time(), time.perf_counter()
    results, seconds = _event_loop_run(_send_all(load, host, port, grace))
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    ok = [(latency, what) for latency, status, what in results if status == 200]
    errors: dict[str, int] = {}
    for latency, status, what in results:
        if status != 200:
            errors[str(what)] = errors.get(str(what), 0) + 1
    window = float(load.at[-1]) if len(load.at) else 0.0
    settle = min(settle, window / 2)
    answered_at = [at + latency for at, (latency, status, _) in zip(load.at, results)
                   if status == 200]  # seconds after the first scheduled arrival
    in_window = sum(settle <= t <= window for t in answered_at)
    by_source = {}
    for source in sorted({what for _, what in ok}):
        by_source[source] = _latency([t for t, what in ok if what == source])
    return dict(requests=len(results), offered_qps=len(results) / window if window else 0.0,
                answered_ok=len(ok), throughput_qps=len(ok) / seconds if seconds else 0.0,
                window_qps=in_window / (window - settle) if window > settle else 0.0,
                settle=settle, seconds=seconds, latency=_latency([t for t, _ in ok]),
                by_cache=by_source, errors=errors,
                error_share=1 - len(ok) / max(1, len(results)),
                client_cpu_seconds=cpu, client_cpu_share=cpu / wall)


def _event_loop_run(coroutine):
    """Run on uvloop where it is installed (less of the shared CPU for the client)."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coroutine)
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(coroutine)


def _latency(seconds: list[float]) -> dict:
    if not seconds:
        return dict(count=0)
    p50, p95, p99 = np.percentile(seconds, [50, 95, 99]) * 1e3
    return dict(count=len(seconds), p50_ms=p50, p95_ms=p95, p99_ms=p99,
                mean_ms=1e3 * float(np.mean(seconds)))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", choices=sorted(PRESETS), default="tiny",
                        help="the world whose users, histories and items the trace uses")
    parser.add_argument("--url", required=True, help="http://127.0.0.1:PORT (only)")
    parser.add_argument("--qps", type=float, required=True, help="offered requests per second")
    parser.add_argument("--duration", type=float, required=True, help="seconds of arrivals")
    parser.add_argument("--users", type=int, default=1000)
    parser.add_argument("--zipf", type=float, default=1.1, help="popularity exponent")
    parser.add_argument("--change-share", type=float, default=0.1,
                        help="share of requests whose user's history gains an event first")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--report", required=True, help="the JSON report's path")
    parser.add_argument("--candidates", type=int, default=64, help="candidates per request")
    parser.add_argument("--max-history", type=int, help="history events per request at most "
                        "(the newest; default the world's history_max)")
    parser.add_argument("--grace", type=float, default=10.0, help="seconds to wait for the "
                        "last answers")


def main(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    try:
        local_address(args.url)
    except ValueError as err:
        parser.error(str(err))
    if args.qps <= 0 or args.duration <= 0 or args.users <= 0:
        parser.error("--qps, --duration and --users must be positive")
    trace = Trace(PRESETS[args.preset], users=args.users, zipf=args.zipf,
                  change_share=args.change_share, seed=args.seed, candidates=args.candidates,
                  max_history=args.max_history)
    load = trace.load(args.qps, args.duration)
    report = run(load, args.url, args.grace)
    report.update(preset=args.preset, url=args.url, qps=args.qps, duration=args.duration,
                  users=args.users, zipf=args.zipf, change_share=args.change_share,
                  seed=args.seed, candidates=args.candidates)
    with open(args.report, "w") as f:
        json.dump(report, f, indent=1)
    lat = report["latency"]
    print(f"{report['answered_ok']}/{report['requests']} ok, {report['throughput_qps']:.1f} "
          f"req/s; p50 {lat.get('p50_ms', float('nan')):.1f} ms, p99 "
          f"{lat.get('p99_ms', float('nan')):.1f} ms; errors {report['errors']}; client CPU "
          f"{100 * report['client_cpu_share']:.0f}% of a core")
    return 0
