"""The HTTP side: one ASGI application (no framework) run by uvicorn.

Routes (:attr:`App.routes`: path -> method -> handler, and :attr:`App.subtrees`: a path and
everything under it -> handler; ``serve(route_sets=...)`` adds more): ``POST /v1/rank``
(schema.py); ``GET /livez`` (200 while the process serves HTTP, warming and draining
included; 503 once a stage thread has died); ``GET /readyz`` and its older name
``GET /healthz`` (200 when warm, every stage thread alive and not draining; else 503 with
the state and reason); ``GET /metrics`` (Prometheus' text format); under /v2 the Open
Inference Protocol (kserve.py), whose infer requests are served as /v1/rank's are;
``POST /admin/reload`` (with a reloader: reload.py's hot model swap, answered only to
clients on a loopback address, others 403 ``forbidden``; SIGHUP does the same). A ranking
request's ``X-User-Id`` header, when present, must name the body's user (400 otherwise:
schema.check_user_header). A server started with ``--replica-index I`` (as cluster.py starts
its replicas) sends ``X-Ranker-Replica: I`` with every answer, so that a client behind the
proxy sees which replica answered; without it, no such header.

The event loop reads and checks requests, queues them (Engine.submit) and awaits their
answers, which the engine's threads hand back with ``call_soon_threadsafe``; it never runs
the model and never waits on a lock: probes read the engine's state (Engine.health), and
/metrics renders in a thread of its own. Every answer is counted by route and status
(``ranker_responses_total``), 404, 405, 413 and 500 included: an exception a handler lets
through is logged and answered 500 ``internal`` (JSON) when no answer has started.

Deadlines and cancellation (:meth:`App.answer`): the app waits for a request's answer until
its deadline (schema.deadline), then answers 504 ``deadline`` itself; a client that goes
away meanwhile (``http.disconnect``) gets nothing. Either way the request is marked
cancelled and the engine drops it at its next stage.

Start-up: uvicorn listens at once and warm-up runs in a thread (``/livez`` 200, ``/readyz``
503 meanwhile); the engine takes requests once every program is compiled. SIGTERM (or
SIGINT): the engine refuses new requests (503 draining), uvicorn stops accepting
connections and waits for the requests in flight (at most the longest deadline and a
margin: every accepted request, queued ones included, is answered by its deadline), the
engine answers every queued one, and the process exits 0.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import logging
import math
import signal
import threading
import time
import types

import uvicorn

from examples.ranker.server import kserve
from examples.ranker.server.engine import Engine
from examples.ranker.server.metrics import CONTENT_TYPE
from examples.ranker.server.schema import (DEADLINE_HEADER, USER_HEADER, Answer, BadRequest,
                                           Limits, Request, byte_count, check_user_header,
                                           deadline, error, expired, late_body, parse,
                                           too_large_body)

log = logging.getLogger("examples.ranker.server")
DRAIN_MARGIN = 2  # seconds uvicorn waits past the longest deadline for answers to go out
JSON = (b"content-type", b"application/json")
CLOSE = (b"connection", b"close")
# How POST /v1/rank reads a request and writes its answer (App._rank takes a protocol's;
# kserve.Infer is the other).
RANK_V1 = types.SimpleNamespace(parse=parse, render=lambda answer: answer)


class Disconnected(Exception):
    """The client went away before its request was read."""


class App:
    """The ASGI application over one :class:`Engine`.

    ``route_sets``: functions of the app returning more routes ({path: {method: handler}},
    a handler ``async (scope, receive, send)``), added to the table after the app's own.
    ``reloader`` (a reload.Reloader) serves ``POST /admin/reload``; without one there is no
    such route. ``replica``: the index every answer names in ``X-Ranker-Replica`` (None: no
    such header).
    """

    def __init__(self, engine: Engine, limits: Limits, on_failure, route_sets=(),
                 reloader=None, replica: int | None = None):
        self.engine, self.limits, self.on_failure = engine, limits, on_failure
        self.reloader = reloader
        self.replica_header = () if replica is None else (
            (b"x-ranker-replica", str(replica).encode()),)
        self.routes = {"/v1/rank": {"POST": self._rank}, "/livez": {"GET": self._livez},
                       "/readyz": {"GET": self._readyz}, "/healthz": {"GET": self._readyz},
                       "/metrics": {"GET": self._metrics}}
        if reloader is not None:
            self.routes["/admin/reload"] = {"POST": self._reload}
        self.subtrees = {"/v2": self._open_inference}
        for routes in route_sets:
            self.routes.update(routes(self))

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

    # --- Routing and counting. ------------------------------------------------------------

    async def _http(self, scope, receive, send) -> None:
        """Route the request; count its answer by route and status, name the replica in its
        headers, and answer an exception that escapes the handler before its answer started
        with a 500."""
        route = self._route_name(scope["path"])
        status = None

        async def counted(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                if self.replica_header:
                    message = dict(message, headers=[*message["headers"],
                                                     *self.replica_header])
            await send(message)

        try:
            await self._route(scope, receive, counted)
        except Exception:  # noqa: BLE001 - logged and answered; the server goes on
            log.exception("%s %s failed", scope["method"], scope["path"])
            if status is None:
                await self.reply(counted, error(
                    500, "internal", None, "the server failed on this request.", "Retry; the "
                    "server's log has the traceback (a bug: please report it)."))
        finally:
            if status is not None:
                self.engine.metrics.responses.labels(route, str(status)).inc()

    def _route_name(self, path: str) -> str:
        """The route ``path`` takes, for the metrics: itself, its subtree, or "other"."""
        if path in self.routes:
            return path
        return next((tree for tree in self.subtrees
                     if path == tree or path.startswith(tree + "/")), "other")

    async def _route(self, scope, receive, send) -> None:
        path, method = scope["path"], scope["method"]
        methods = self.routes.get(path)
        if methods is None and self._route_name(path) in self.subtrees:
            await self.subtrees[self._route_name(path)](scope, receive, send)
        elif methods is None:
            listed = ", ".join(f"{m} {p}" for p, ms in self.routes.items() for m in ms)
            await self.reply(send, error(404, "not_found", "path", f"no route {path}.",
                                          f"Use {listed}."))
        elif method not in methods:
            allowed = ", ".join(methods)
            await self.reply(send, error(405, "bad_method", "method", f"{path} takes "
                                          f"{allowed}, not {method}.", f"Send {allowed} "
                                          f"{path}.", (b"allow", allowed.encode())))
        else:
            await methods[method](scope, receive, send)

    async def reply(self, send, answer: Answer) -> None:
        """Send ``answer`` as JSON, counting an error's kind (a ranking 200 is counted by
        the caller, with its request)."""
        await _send(send, answer)
        self.engine.metrics.answered(answer)

    # --- Ranking. -------------------------------------------------------------------------

    async def _open_inference(self, scope, receive, send) -> None:
        """A path under /v2: kserve.route's answer, or an infer request served as /v1/rank
        is, read and answered by a kserve.Infer."""
        answer = kserve.route(scope["method"], scope["path"], self.engine)
        if answer is None:
            await self._rank(scope, receive, send, kserve.Infer(scope["headers"]))
        else:
            await self.reply(send, answer)

    async def _rank(self, scope, receive, send, protocol=RANK_V1) -> None:
        """A ranking request, read and its answer written by ``protocol`` (RANK_V1 or a
        kserve.Infer): checked, its deadline set, queued, answered."""
        start = time.perf_counter()
        try:
            # The body must arrive in time too: uvicorn waits for it without a limit. (A bad
            # deadline header is refused once the body is read, as a body's errors are.)
            try:
                due = deadline(start, header(scope, DEADLINE_HEADER), None, self.limits)
            except BadRequest:
                due = start + self.limits.deadline_ms / 1e3
            try:
                body = await asyncio.wait_for(read_body(scope, receive, self.limits),
                                              max(0.0, due - time.perf_counter()))
            except asyncio.TimeoutError:
                raise late_body((due - start) * 1e3) from None
            request = protocol.parse(body, self.limits)
            request.deadline = deadline(start, header(scope, DEADLINE_HEADER), request,
                                        self.limits)
            check_user_header(header(scope, USER_HEADER), request)
        except BadRequest as err:
            await self.reply(send, protocol.render(bad_request(err)))
            return
        except Disconnected:
            self.engine.metrics.disconnects.inc()
            return
        request.timings["parse"] = time.perf_counter() - start
        answer = await self.answer(request, receive)
        if answer is None:
            return
        sent = time.perf_counter()
        await _send(send, protocol.render(answer))
        done = time.perf_counter()
        request.timings["serialize"] = done - sent
        self.engine.metrics.answered(answer, request, done - start)

    async def answer(self, request: Request, receive) -> Answer | None:
        """Submit a parsed request (its ``deadline`` set) and wait for its answer: the
        engine's (200, or an error it decided), a refusal (503), 504 deadline once the
        deadline passes, or None once the client has gone. In the last two the request is
        marked cancelled, and the engine drops it at its next stage."""
        loop = asyncio.get_running_loop()
        answered = loop.create_future()
        request.reply = lambda answer: loop.call_soon_threadsafe(_settle, answered, answer)
        refused = self.engine.submit(request)
        if refused is not None:
            return refused
        gone = loop.create_task(_disconnect(receive))
        try:
            done, _ = await asyncio.wait(
                (answered, gone), timeout=max(0.0, request.deadline - time.perf_counter()),
                return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
        if answered in done:
            return answered.result()
        if gone in done:
            request.cancelled = "disconnected"
            self.engine.metrics.disconnects.inc()
            return None
        request.cancelled = "deadline"
        return expired(request)

    # --- Probes and metrics. --------------------------------------------------------------

    async def _livez(self, scope, receive, send) -> None:
        await self._probe(send, alive_only=True)

    async def _readyz(self, scope, receive, send) -> None:
        await self._probe(send, alive_only=False)

    async def _probe(self, send, alive_only: bool) -> None:
        """200 or 503 with ``{"status": state, "reason", "model_step"}``: liveness fails
        only when broken, readiness whenever the engine is not serving."""
        state, reason = self.engine.health()
        ok = state != "broken" if alive_only else state == "serving"
        await self.reply(send, Answer(200 if ok else 503, {
            "status": state, "reason": reason, "model_step": self.engine.model_step}))

    # --- Administration. ------------------------------------------------------------------

    async def _reload(self, scope, receive, send) -> None:
        """POST /admin/reload: the reloader's answer, for a client on a loopback address
        only (the TCP peer: a proxy on this machine must not forward /admin)."""
        client = (scope.get("client") or (None,))[0]
        if not loopback(client):
            await self.reply(send, error(
                403, "forbidden", None, f"/admin/reload answers only clients on this "
                f"machine (a loopback address); this one is {client}.", "Send it from the "
                "server's machine to 127.0.0.1 (or send the process SIGHUP)."))
            return
        await self.reply(send, await off_loop(self.reloader.request))

    async def _metrics(self, scope, receive, send) -> None:
        body = await off_loop(self.engine.metrics.render)
        await send({"type": "http.response.start", "status": 200, "headers": [
            (b"content-type", CONTENT_TYPE.encode()),
            (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})


def loopback(host: str | None) -> bool:
    """Whether ``host`` (an ASGI scope's client address) is a loopback address (an IPv4
    one mapped into IPv6 included)."""
    try:
        address = ipaddress.ip_address(host or "")
    except ValueError:
        return False
    return (getattr(address, "ipv4_mapped", None) or address).is_loopback


def header(scope, name: str) -> bytes | None:
    """The value of request header ``name`` (any case), or None."""
    wanted = name.lower().encode()
    return next((value for key, value in scope["headers"] if key.lower() == wanted), None)


async def read_body(scope, receive, limits: Limits) -> bytes:
    """The request body, refused (413 too_large) as soon as it passes the limit; raises
    :class:`Disconnected` when the client goes away first."""
    declared = byte_count(header(scope, "content-length"))
    if declared is not None and declared > limits.max_body:
        raise too_large_body(limits)
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise Disconnected
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limits.max_body:
            raise too_large_body(limits)
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


def bad_request(err: BadRequest) -> Answer:
    """The answer to a refused request; a body error closes the connection (its body may
    be unread)."""
    return Answer(err.status, err.body(), kind=err.kind,
                  headers=(CLOSE,) if err.field == "body" else ())


async def off_loop(function):
    """``function()``, run in a daemon thread of its own: the event loop goes on meanwhile,
    whatever locks it waits for, and the process's exit never waits for it."""
    loop = asyncio.get_running_loop()
    result = loop.create_future()

    def run():
        try:
            value = function()
        except BaseException as err:  # noqa: BLE001 - raised in the awaiting coroutine
            loop.call_soon_threadsafe(_settle_error, result, err)
        else:
            loop.call_soon_threadsafe(_settle, result, value)
    threading.Thread(target=run, name=getattr(function, "__name__", "off_loop"),
                     daemon=True).start()
    return await result


async def _disconnect(receive) -> None:
    """Returns once the client has gone (uvicorn's receive, after the body, waits for it)."""
    while (await receive())["type"] != "http.disconnect":
        pass


def _settle(future: asyncio.Future, value) -> None:
    if not future.done():
        future.set_result(value)


def _settle_error(future: asyncio.Future, err: BaseException) -> None:
    if not future.done():
        future.set_exception(err)


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
        if sig == signal.SIGINT and self.should_exit:
            super().handle_exit(sig, frame)  # a second Ctrl-C forces the exit
        else:
            # Not recorded as uvicorn does: it raises a recorded signal again once shut
            # down, which would end the process by SIGTERM or SIGINT (status 143 or 130)
            # instead of 0.
            self.should_exit = True

    def fail(self) -> None:
        self.failed = True
        self.should_exit = True


def drain_seconds(limits: Limits) -> int:
    """How long uvicorn waits for the requests in flight on SIGTERM: the longest deadline
    (every accepted request is answered by its deadline however long the queue) and a
    margin."""
    return math.ceil(limits.deadline_ms / 1e3) + DRAIN_MARGIN


def serve(engine: Engine, limits: Limits, host: str, port: int, route_sets=(),
          reloader=None, replica: int | None = None) -> int:
    """Serve on ``host``:``port`` until SIGTERM / SIGINT; the exit status (0, or 1 when
    warm-up failed). ``route_sets``, ``reloader`` and ``replica``: as :class:`App`'s; with a
    reloader SIGHUP reloads too (in a thread: a signal handler must not wait)."""
    app = App(engine, limits, on_failure=lambda: server.fail(), route_sets=route_sets,
              reloader=reloader, replica=replica)
    if reloader is not None:
        signal.signal(signal.SIGHUP, lambda sig, frame: threading.Thread(
            target=reloader.on_signal, name="sighup", daemon=True).start())
    config = uvicorn.Config(app, host=host, port=port, lifespan="on", access_log=False,
                            log_level="warning", timeout_keep_alive=30,
                            timeout_graceful_shutdown=drain_seconds(limits))
    server = _Server(config, engine)
    server.run()
    return 1 if server.failed else 0
