"""The HTTP side: one ASGI application (no framework) run by uvicorn on 127.0.0.1.

Routes: ``POST /v1/rank`` (schema.py), ``GET /healthz`` (200 once warm, 503 while warming or
draining), ``GET /metrics`` (Prometheus' text format); under /v2 the Open Inference Protocol
(kserve.py). The event loop reads and checks requests, queues them (Engine.submit) and awaits
their answers, which the engine's threads hand back with ``call_soon_threadsafe``; it never
runs the model.

Start-up: uvicorn listens at once and warm-up runs in a thread (``/healthz`` 503 meanwhile);
the engine takes requests once every program is compiled. SIGTERM (or SIGINT): the engine
refuses new requests (503 draining), uvicorn stops accepting connections and waits for the
requests in flight, the engine answers every queued one, and the process exits 0.
"""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import threading
import time
import types

import uvicorn

from examples.ranker.server import kserve
from examples.ranker.server.engine import Engine
from examples.ranker.server.metrics import CONTENT_TYPE
from examples.ranker.server.schema import Answer, BadRequest, Limits, parse, too_large_body

log = logging.getLogger("examples.ranker.server")
DRAIN_SECONDS = 8  # uvicorn's wait for requests in flight (the issue allows 10 s to exit)
JSON = (b"content-type", b"application/json")
CLOSE = (b"connection", b"close")
# How POST /v1/rank reads a request and writes its answer (App._rank takes a protocol's;
# kserve.Infer is the other).
RANK_V1 = types.SimpleNamespace(parse=parse, render=lambda answer: answer)


class App:
    """The ASGI application over one :class:`Engine`."""

    def __init__(self, engine: Engine, limits: Limits, on_failure):
        self.engine, self.limits, self.on_failure = engine, limits, on_failure

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
        elif scope["type"] == "http":
            await self._http(scope, receive, send)

    async def _lifespan(self, receive, send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                self._warm_up(asyncio.get_running_loop())
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await asyncio.to_thread(self.engine.stop)  # answers every queued request
                await send({"type": "lifespan.shutdown.complete"})
                return

    def _warm_up(self, loop) -> None:
        """Warm up in a daemon thread (an exit during warm-up does not wait for it), then
        start the engine; a failure stops the server."""
        def run():
            start = time.perf_counter()
            try:
                programs = self.engine.warmup()
            except Exception:  # noqa: BLE001 - logged, and the server exits 1
                log.exception("warm-up failed")
                loop.call_soon_threadsafe(self.on_failure)
                return
            self.engine.start()
            log.info("ready: %d programs compiled in %.1f s", programs,
                     time.perf_counter() - start)
        threading.Thread(target=run, name="warmup", daemon=True).start()

    async def _http(self, scope, receive, send) -> None:
        path, method = scope["path"], scope["method"]
        if kserve.serves(path):  # the Open Inference Protocol: kserve.py
            answer = kserve.route(method, path, self.engine)
            if answer is None:
                await self._rank(scope, receive, send, kserve.Infer(scope["headers"]))
            else:
                await _send(send, answer)
            return
        routes = {"/v1/rank": "POST", "/healthz": "GET", "/metrics": "GET"}
        if path not in routes:
            await _send(send, _error(404, "not_found", "path", f"no route {path}.",
                                     "Use POST /v1/rank, GET /healthz or GET /metrics."))
        elif method != routes[path]:
            await _send(send, _error(405, "bad_method", "method", f"{path} takes "
                                     f"{routes[path]}, not {method}.",
                                     f"Send {routes[path]} {path}."))
        elif path == "/v1/rank":
            await self._rank(scope, receive, send)
        elif path == "/healthz":
            state = self.engine.state
            await _send(send, Answer(200 if state == "serving" else 503, {
                "status": state, "model_step": self.engine.model_step}))
        else:
            body = self.engine.metrics.render()
            await send({"type": "http.response.start", "status": 200, "headers": [
                (b"content-type", CONTENT_TYPE.encode()),
                (b"content-length", str(len(body)).encode())]})
            await send({"type": "http.response.body", "body": body})

    async def _rank(self, scope, receive, send, protocol=RANK_V1) -> None:
        """A ranking request, read and its answer written by ``protocol`` (RANK_V1 or a
        kserve.Infer): checked, queued, answered."""
        start = time.perf_counter()
        try:
            request = protocol.parse(await _read_body(scope, receive, self.limits),
                                     self.limits)
        except BadRequest as err:
            answer = Answer(400, err.body(), kind=err.kind,
                            headers=(CLOSE,) if err.field == "body" else ())
            self.engine.metrics.answered(answer)
            await _send(send, protocol.render(answer))
            return
        request.timings["parse"] = time.perf_counter() - start
        loop = asyncio.get_running_loop()
        answered = loop.create_future()
        request.reply = lambda answer: loop.call_soon_threadsafe(_settle, answered, answer)
        answer = self.engine.submit(request) or await answered
        sent = time.perf_counter()
        await _send(send, protocol.render(answer))
        done = time.perf_counter()
        request.timings["serialize"] = done - sent
        self.engine.metrics.answered(answer, request, done - start)


async def _read_body(scope, receive, limits: Limits) -> bytes:
    """The request body, refused (too_large) as soon as it passes the limit."""
    declared = dict(scope["headers"]).get(b"content-length", b"0")
    if declared.isdigit() and int(declared) > limits.max_body:
        raise too_large_body(limits)
    chunks, size = [], 0
    while True:
        message = await receive()
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limits.max_body:
            raise too_large_body(limits)
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


def _settle(future: asyncio.Future, answer: Answer) -> None:
    if not future.done():
        future.set_result(answer)


def _error(status: int, kind: str, field: str, message: str, fix: str) -> Answer:
    return Answer(status, {"error": {"kind": kind, "field": field, "message": message,
                                     "fix": fix}}, kind=kind)


async def _send(send, answer: Answer) -> None:
    body = json.dumps(answer.body).encode()
    await send({"type": "http.response.start", "status": answer.status, "headers": [
        JSON, (b"content-length", str(len(body)).encode()), *answer.headers]})
    await send({"type": "http.response.body", "body": body})


class _Server(uvicorn.Server):
    """uvicorn's server, draining the engine on SIGTERM / SIGINT."""

    def __init__(self, config: uvicorn.Config, engine: Engine):
        super().__init__(config)
        self.engine = engine
        self.failed = False

    def handle_exit(self, sig, frame) -> None:
        self.engine.drain()
        if sig == signal.SIGINT:
            super().handle_exit(sig, frame)  # a second Ctrl-C forces the exit
        else:
            # Not recorded as uvicorn does: it raises a recorded signal again once shut
            # down, which would end the process by SIGTERM (status 143) instead of 0.
            self.should_exit = True

    def fail(self) -> None:
        self.failed = True
        self.should_exit = True


def serve(engine: Engine, limits: Limits, port: int) -> int:
    """Serve on 127.0.0.1:``port`` until SIGTERM / SIGINT; the exit status (0, or 1 when
    warm-up failed)."""
    app = App(engine, limits, on_failure=lambda: server.fail())
    config = uvicorn.Config(app, host="127.0.0.1", port=port, lifespan="on",
                            access_log=False, log_level="warning", timeout_keep_alive=30,
                            timeout_graceful_shutdown=DRAIN_SECONDS)
    server = _Server(config, engine)
    server.run()
    return 1 if server.failed else 0
