"""The ranking server with fault hooks, for tests only: ``python tests/ranker/server_hooks.py``
takes the server's flags (``python -m examples.ranker server``'s) and these:

* ``--history-delay-ms X``: the history stage sleeps X ms before each job, its pins held
  (outside its measured job time), so that tests catch requests in flight, a busy history
  stage and a store full of pins;
* ``--hold-warmup``: warm-up holds the store's lock, as ``HistoryStore.warmup`` does through
  its compile, until ``POST /_test/release-warmup`` (at most :data:`HOLD_LIMIT` seconds).

and these routes:

* ``POST /_test/release-warmup``: ends the hold;
* ``POST /_test/hold-history``: the history stage waits before its next job's drop check, its
  pins held, until ``POST /_test/release-history`` (at most :data:`HOLD_LIMIT` seconds), so
  that a test decides what happens to the job's requests meanwhile, whatever the machine's
  load;
* ``POST /_test/leak`` (a /v1/rank body): acquires its store key and never writes or releases
  it, as a lost lease or a failed copy leaves an entry pinned and unwritten;
* ``POST /_test/kill-history``: the history stage's next job raises a BaseException, which
  ends its thread (as a bug outside the per-batch error handling would);
* ``POST /_test/fail-next-pass``: the next history pass fails with RA224, as the store's write
  does when its device update fails (e.g. out of memory);
* ``GET /_test/raise``: a handler that raises.

The production command has none of these.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import sys
import threading
import time

from rankattn.errors import fail

from examples.ranker import server
from examples.ranker.server.app import read_body
from examples.ranker.server.engine import Engine
from examples.ranker.server.schema import Answer, parse

HOLD_LIMIT = 120.0


class StageKilled(BaseException):
    """Raised in a stage thread by /_test/kill-history: not an Exception, so that it ends the
    thread instead of answering its batch 500."""


class HookedEngine(Engine):
    """The engine with the hooks above."""

    def __init__(self, *args, history_delay: float, hold_warmup: bool, **kwargs):
        super().__init__(*args, **kwargs)
        self.history_delay = history_delay
        self.warmup_released = threading.Event()
        if not hold_warmup:
            self.warmup_released.set()
        self.history_released = threading.Event()
        self.history_released.set()
        self.kill_history = False
        self.fail_next_pass = False
        self.leases = []  # leaked: never written, never released

    def warmup(self) -> int:
        with self.store._lock:  # as HistoryStore.warmup holds it through its compile
            self.warmup_released.wait(HOLD_LIMIT)
        return super().warmup()

    def _compute(self, job) -> None:
        if self.kill_history:
            raise StageKilled("killed by POST /_test/kill-history")
        self.history_released.wait(HOLD_LIMIT)
        time.sleep(self.history_delay)
        super()._compute(job)

    def _history_pass(self, lease, rows, model) -> None:
        if self.fail_next_pass:
            self.fail_next_pass = False
            raise fail("RA224", "the store's write failed (POST /_test/fail-next-pass)")
        super()._history_pass(lease, rows, model)


def hook_routes(app) -> dict:
    """The /_test routes of ``app`` (whose engine is a :class:`HookedEngine`)."""
    engine = app.engine

    async def release_warmup(scope, receive, send):
        engine.warmup_released.set()
        await app.reply(send, Answer(200, {"released": True}))

    async def hold_history(scope, receive, send):
        engine.history_released.clear()
        await app.reply(send, Answer(200, {"held": True}))

    async def release_history(scope, receive, send):
        engine.history_released.set()
        await app.reply(send, Answer(200, {"released": True}))

    async def leak(scope, receive, send):
        request = parse(await read_body(scope, receive, app.limits), app.limits)
        keys = engine.store_keys([request.key], engine.model, 0)  # as a batch's acquire
        lease = await asyncio.to_thread(engine.store.acquire, *keys)
        engine.leases.append(lease)
        await app.reply(send, Answer(200, {"source": lease.source[0]}))

    async def kill_history(scope, receive, send):
        engine.kill_history = True
        await app.reply(send, Answer(200, {"kill_history": True}))

    async def fail_next_pass(scope, receive, send):
        engine.fail_next_pass = True
        await app.reply(send, Answer(200, {"fail_next_pass": True}))

    async def raises(scope, receive, send):
        raise RuntimeError("GET /_test/raise raises")

    return {"/_test/release-warmup": {"POST": release_warmup}, "/_test/leak": {"POST": leak},
            "/_test/hold-history": {"POST": hold_history},
            "/_test/release-history": {"POST": release_history},
            "/_test/kill-history": {"POST": kill_history},
            "/_test/fail-next-pass": {"POST": fail_next_pass}, "/_test/raise": {"GET": raises}}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    server.add_arguments(parser)
    parser.add_argument("--history-delay-ms", type=float, default=0.0)
    parser.add_argument("--hold-warmup", action="store_true")
    args = parser.parse_args()
    engine = functools.partial(HookedEngine, history_delay=args.history_delay_ms / 1e3,
                               hold_warmup=args.hold_warmup)
    return server.main(args, parser, engine_class=engine, route_sets=(hook_routes,))


if __name__ == "__main__":
    sys.exit(main())
