"""The server's metrics, in Prometheus' text format (GET /metrics).

Counters and histograms are recorded as requests are answered; the queue depth, the model
step, readiness, the stages' mean batch times, the store's stats (counts since warm-up,
exported once warm-up has ended) and the programs compiled after warm-up are read when
/metrics is scraped, with the process, platform and garbage collector metrics of
prometheus_client's default collectors. Every count is a counter (``_total``).
"""

from __future__ import annotations

import threading

from prometheus_client import (CollectorRegistry, Counter, GCCollector, Histogram,
                               PlatformCollector, ProcessCollector, generate_latest)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
SECONDS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.035, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5,
           0.75, 1.0, 2.0, 5.0, 10.0)
# A request's stages, in order (Engine and the HTTP layer time them):
STAGES = ("parse",         # JSON, checks, the history digest
          "queue",         # accepted .. taken into a batch
          "store",         # the batch's acquire (hits pinned, room made for misses)
          "history_wait",  # misses: handed to the history stage .. that stage starts on them
          "history",       # misses: the batch's history pass and store.write
          "score",         # the scoring call that held the request
          "serialize")     # the answer's JSON, and sending it
# HistoryStore.stats() entries that count events (exported as counters, since warm-up).
STORE_COUNTS = ("hits", "host_hits", "prefix_hits", "misses", "invalidations", "evictions",
                "host_evictions", "clears")


class Metrics:
    """Every metric of one server; ``engine`` is read at scrape time."""

    def __init__(self, engine, max_batch: int):
        self.engine = engine
        registry = self.registry = CollectorRegistry()
        for collector in (ProcessCollector, PlatformCollector, GCCollector):
            collector(registry=registry)
        self.responses = Counter("ranker_responses", "HTTP answers by route (the path, or "
                                 "\"other\" when no route has it) and status",
                                 ["route", "status"], registry=registry)
        self.requests = Counter("ranker_requests", "Ranking requests answered 200, by where "
                                "the history came from (device, host, miss, off)", ["cache"],
                                registry=registry)
        self.errors = Counter("ranker_errors", "Requests answered with an error, by kind",
                              ["kind"], registry=registry)
        self.dropped = Counter("ranker_dropped", "Accepted requests dropped before a stage "
                               "(queue: the acquire; history: the history pass; score: a "
                               "scoring call), by reason (deadline: past it, answered 504; "
                               "disconnected: the client went away)", ["stage", "reason"],
                               registry=registry)
        self.reloads = Counter("ranker_reloads", "Hot model swaps by outcome (swapped; "
                               "failed: the served model stayed, the log has why)",
                               ["outcome"], registry=registry)
        self.disconnects = Counter("ranker_client_disconnects", "Ranking requests whose "
                                   "client went away before their answer", registry=registry)
        self.latency = Histogram("ranker_request_seconds", "Seconds from a ranking request's "
                                 "first byte to its answer sent, 200s only, by cache source and "
                                 "by whether its batch held misses (hits do not wait for them)",
                                 ["cache", "batch"], buckets=SECONDS, registry=registry)
        self.stage = Histogram("ranker_stage_seconds", "Seconds a 200 request spent per stage "
                               "(" + ", ".join(STAGES) + ")", ["stage"], buckets=SECONDS,
                               registry=registry)
        rows = tuple(float(1 << i) for i in range(max_batch.bit_length() + 1))
        self.batch = Histogram("ranker_batch_requests", "Requests per batch taken from the "
                               "queue", buckets=rows, registry=registry)
        # By the stage thread that made the call too (front, history): serverbench's
        # per-thread s (the front scores hits, the history stage misses).
        self.call_rows = Histogram("ranker_call_rows", "Rows per model call: requests per "
                                   "scoring call, histories per history pass (the misses of "
                                   "one acquire), by call and stage thread", ["call", "thread"],
                                   buckets=rows, registry=registry)
        self.call_seconds = Histogram("ranker_call_seconds", "Seconds per model call (score, "
                                      "history: the pass and the store write), by call and "
                                      "stage thread", ["call", "thread"], buckets=SECONDS,
                                      registry=registry)
        registry.register(self)

    def collect(self):
        """The metrics read at scrape time (prometheus_client calls this)."""
        engine = self.engine
        yield GaugeMetricFamily("ranker_queue_depth", "Requests accepted and not yet taken "
                                "into a batch", value=len(engine.queue))
        yield GaugeMetricFamily("ranker_history_jobs", "Jobs (a batch's misses) handed to "
                                "the history stage and not yet started", value=engine.jobs)
        yield GaugeMetricFamily("ranker_model_step", "The checkpoint step served (the "
                                "next batch's: a hot swap changes it)",
                                value=engine.model_step)
        yield GaugeMetricFamily("ranker_ready", "1 while /readyz answers 200 (warm, every "
                                "stage thread alive, not draining)",
                                value=float(engine.health()[0] == "serving"))
        service = GaugeMetricFamily("ranker_service_seconds", "Each stage's mean seconds per "
                                    "batch (exponentially weighted), which admission uses",
                                    labels=["stage"])
        for stage, time in engine.service.items():
            service.add_metric([stage], time.mean)
        yield service
        yield CounterMetricFamily("ranker_compiles_after_warmup", "Programs built after "
                                  "warm-up (0: warm-up compiled every shape traffic uses)",
                                  value=engine.compiles_after_warmup)
        stats = engine.store_stats()
        for name, value in (stats or {}).items():
            family = CounterMetricFamily if name in STORE_COUNTS else GaugeMetricFamily
            yield family(f"ranker_store_{name}", f"HistoryStore.stats()['{name}']"
                         + (" since warm-up" if name in STORE_COUNTS else ""), value=value)

    def answered(self, answer, request=None, seconds: float = 0.0) -> None:
        """Count an answer: an error's kind, or a ranking 200's cache source, latency and
        stages (``request``: the ranking request it answers)."""
        if answer.status != 200:
            if answer.kind:
                self.errors.labels(answer.kind).inc()
            return
        if request is None:
            return
        self.requests.labels(answer.cache).inc()
        batch = "with_misses" if request.batch_had_misses else "hits_only"
        self.latency.labels(answer.cache, batch).observe(seconds)
        for stage, spent in request.timings.items():
            self.stage.labels(stage).observe(spent)

    def call(self, name: str, rows: int, seconds: float) -> None:
        """Count one model call ("score" or "history") of ``rows`` rows, made by the
        calling stage thread."""
        thread = threading.current_thread().name
        self.call_rows.labels(name, thread).observe(rows)
        self.call_seconds.labels(name, thread).observe(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)
