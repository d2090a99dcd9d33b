"""The reference ranker behind HTTP: ``python -m examples.ranker server --preset P --out DIR
--port PORT``.

* schema.py: the request and answer JSON, the checks behind every 400, deadlines;
* engine.py: request batching through a ``serving.HistoryStore`` in two stages (hits are
  answered without waiting for misses), admission by deadline, bucket shapes, warm-up,
  health;
* app.py: the ASGI application run by uvicorn (its route table, probes, deadlines and
  disconnects), start-up and drain;
* metrics.py: GET /metrics;
* reload.py: hot model swaps (POST /admin/reload, SIGHUP).

examples/ranker/README.md, "The ranking server", documents it, every flag included.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import threading
import time
from typing import Callable

from rankattn import serving

from examples.ranker import serve
from examples.ranker.config import ACTIONS, PRESETS
from examples.ranker.model import init
from examples.ranker.server.engine import DEFAULT_DEVICE_PAGES, Engine, Model, Options
from examples.ranker.server.reload import Checkpoints, Reloader
from examples.ranker.server.schema import Limits

log = logging.getLogger("examples.ranker.server")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    parser.add_argument("--out", required=True, help="the run directory whose newest "
                        "checkpoint is served (as train writes them; POST /admin/reload or "
                        "SIGHUP swaps in a newer one)")
    parser.add_argument("--port", type=int, required=True, help="listens on HOST:PORT")
    parser.add_argument("--host", default="127.0.0.1", help="the address to listen on "
                        "(0.0.0.0: every interface, e.g. in a container); default "
                        "%(default)s")
    parser.add_argument("--random-weights", action="store_true", help="when DIR has no "
                        "checkpoint, serve freshly initialised weights (model_step 0) instead "
                        "of refusing to start")
    parser.add_argument("--device-pages", type=int, default=DEFAULT_DEVICE_PAGES,
                        help="pages of 16 tokens (every layer) in the history store; default "
                        "%(default)s")
    parser.add_argument("--host-pages", type=int, default=0, help="pages of the store's host "
                        "tier (evicted histories kept in host memory); default 0: none")
    parser.add_argument("--eviction-policy", choices=sorted(serving.EVICTION_POLICIES),
                        default="lru", help="which history the store evicts first: 'lru' the "
                        "least recently used, 's3fifo' one-off users before frequent ones "
                        "(benchmarks/STORE.md compares them); default lru")
    parser.add_argument("--max-users", type=int, help="histories the store holds on the "
                        "device at most; default --device-pages (pages are the limit)")
    parser.add_argument("--max-history", type=int, help="history events per request at most "
                        "(more: 400 too_large); default the preset's world's history_max")
    parser.add_argument("--max-candidates", type=int, default=64,
                        help="candidates per request at most; default %(default)s")
    parser.add_argument("--max-batch", type=int, default=8, help="requests per batch at "
                        "most; default %(default)s")
    parser.add_argument("--max-wait-ms", type=float, default=2.0, help="how long the oldest "
                        "queued request waits for a batch to fill; default %(default)s")
    parser.add_argument("--max-queue", type=int, default=64, help="requests accepted and not "
                        "yet batched at most (more: 503 queue_full); default %(default)s")
    parser.add_argument("--max-body-bytes", type=int, help="request body size limit (more: "
                        "413 too_large); default twice the largest valid request's JSON")
    parser.add_argument("--deadline-ms", type=float, default=5000.0, help="a request's "
                        "deadline when it sets none (X-Request-Deadline-Ms header or "
                        "deadline_ms field), and the longest it may set: past it 504 "
                        "deadline; default %(default)s")
    parser.add_argument("--acquire-timeout-ms", type=float, default=1000.0, help="how long "
                        "a batch's store acquire may wait for a history to be written (only "
                        "a fault makes it wait) before its requests get 503 store_timeout; "
                        "default %(default)s")
    parser.add_argument("--no-cache", action="store_true", help="recompute every history "
                        "(\"cache\": \"off\"): the baseline the store is measured against")
    parser.add_argument("--replica-index", type=int, help="send X-Ranker-Replica: I with "
                        "every answer (python -m examples.ranker cluster sets it on each "
                        "replica); default: no such header")
    parser.add_argument("--parent-pid", type=int, help="drain and exit once process PID is "
                        "no longer this one's parent (it died): a server that a cluster, a "
                        "benchmark or a test started never outlives it, even when that was "
                        "killed; default: none")


def exit_with_parent(pid: int, every: float = 0.5) -> None:
    """SIGTERM to this process (a drain, as from a terminal) once ``pid`` is no longer its
    parent: a parent killed outright (SIGKILL, a test's timeout) runs no clean-up of its own,
    and its children would otherwise serve, hold ports and spin on the CPU for good. Polled
    by a daemon thread, so it works whichever thread started this process (unlike
    PR_SET_PDEATHSIG, which fires when that thread ends)."""
    def watch() -> None:
        while os.getppid() == pid:
            time.sleep(every)
        log.warning("parent process %d is gone: stopping", pid)
        os.kill(os.getpid(), signal.SIGTERM)

    if os.getppid() != pid:
        raise SystemExit(f"--parent-pid {pid} is not this process's parent ({os.getppid()})")
    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()


def main(args: argparse.Namespace, parser: argparse.ArgumentParser,
         engine_class: Callable[..., Engine] = Engine, route_sets=()) -> int:
    """Load the model, build the engine, serve until SIGTERM; the exit status.

    ``engine_class`` builds the engine (tests pass a subclass with fault hooks) and
    ``route_sets`` adds routes (``app.App``'s); the command passes neither.
    """
    from examples.ranker.server import app  # uvicorn: only the server needs it

    handler = logging.StreamHandler()  # our own: flax / orbax configure the root logger
    handler.setFormatter(logging.Formatter("%(asctime)s ranker server: %(message)s"))
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.propagate = False
    preset = PRESETS[args.preset]
    max_history = args.max_history or preset.world.history_max
    if args.parent_pid is not None:
        exit_with_parent(args.parent_pid)
    if args.replica_index is not None and args.replica_index < 0:
        parser.error(f"--replica-index must be >= 0; got {args.replica_index}")
    for flag in ("port", "device_pages", "max_users", "max_history", "max_candidates",
                 "max_batch", "max_queue", "max_body_bytes"):
        value = getattr(args, flag)
        if value is not None and value <= 0:
            parser.error(f"--{flag.replace('_', '-')} must be positive; got {value}")
    if args.host_pages < 0:
        parser.error(f"--host-pages must be >= 0; got {args.host_pages}")
    # NaN never times out (the batcher would spin), and a wait past threading.TIMEOUT_MAX
    # raises in the stage thread.
    longest = threading.TIMEOUT_MAX * 1e3
    if not 0 <= args.max_wait_ms < longest:
        parser.error(f"--max-wait-ms must be a number of milliseconds >= 0 (and below "
                     f"{longest:.3g}); got {args.max_wait_ms}")
    for flag in ("deadline_ms", "acquire_timeout_ms"):
        value = getattr(args, flag)
        if not 0 < value < longest:
            parser.error(f"--{flag.replace('_', '-')} must be a positive number of "
                         f"milliseconds; got {value}")
    if max_history >= preset.model.max_position:
        parser.error(f"--max-history {max_history} does not fit the model's positions: use at "
                     f"most {preset.model.max_position - 1}")
    per_user = -(-(1 + max_history) // serve.PAGE_SIZE)
    if args.device_pages < per_user:
        parser.error(f"--device-pages {args.device_pages} cannot hold one history of "
                     f"--max-history {max_history} events ({per_user} pages); pass at least "
                     f"{per_user}")
    checkpoints = Checkpoints(preset, args.out)
    model = load(preset, checkpoints, args.random_weights, parser)
    options = Options(max_history=max_history, max_candidates=args.max_candidates,
                      max_batch=args.max_batch, max_wait=args.max_wait_ms / 1e3,
                      max_queue=args.max_queue, device_pages=args.device_pages,
                      host_pages=args.host_pages, max_users=args.max_users,
                      eviction_policy=args.eviction_policy,
                      cache=not args.no_cache, acquire_timeout=args.acquire_timeout_ms / 1e3)
    engine = engine_class(preset, model, options)
    if not engine.pinned_batches_fit():
        log.warning("the store holds fewer than 3 * --max-batch histories of --max-history "
                    "events: requests may get 503 cache_full while batches are in flight")
    limits = Limits(contexts=preset.world.contexts, max_history=max_history,
                    max_candidates=args.max_candidates,
                    max_body=args.max_body_bytes or Limits.body_bytes(max_history,
                                                                      args.max_candidates),
                    deadline_ms=args.deadline_ms)
    log.info("model step %d; listening on http://%s:%d (warming up: /readyz answers 503 "
             "until every program is compiled)", model.step, args.host, args.port)
    return app.serve(engine, limits, args.host, args.port, route_sets,
                     Reloader(engine, checkpoints), args.replica_index)


def load(preset, checkpoints: Checkpoints, random_weights: bool, parser) -> Model:
    """The newest of ``checkpoints``, or a fresh model (step 0) with ``random_weights``
    when there is none."""
    if checkpoints.latest() is not None:
        return checkpoints.restore()
    if not random_weights:
        parser.error(f"{checkpoints.out} has no checkpoint: train one first (python -m "
                     f"examples.ranker train --preset ... --out {checkpoints.out}), or pass "
                     "--random-weights to serve freshly initialised weights")
    graphdef, params = init(preset.model, len(ACTIONS), preset.world.contexts,
                            preset.train.seed)
    return Model(0, graphdef, params)
