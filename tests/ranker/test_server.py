"""The ranking server (examples/ranker/server) as a client sees it: three server processes.

Server A (module fixture) serves a saved checkpoint of the tiny model with small limits, a
store of 8 pages (two histories of 60 events) and, through the test entry point
(server_hooks.py, --history-delay-ms), a history stage that holds its pins for 150 ms per
job, so that requests in flight, a busy history stage and a store full of pinned entries can
be caught on purpose. Its tests: answers equal to the full forward pass, batch and candidate
invariance, a reused history_version with a changed history, malformed requests of every
kind, a flood past the queue, a store full of pins, hits answered while the history stage is
busy, deadlines (admission, 504, a client that leaves), the Open Inference Protocol, the
metrics, and last SIGTERM with requests in flight. Server B (server_hooks.py, --hold-warmup)
restarts on the same checkpoint (in a run directory of its own): probes while its warm-up
holds the store, an empty cache with the same answers, serverbench's smoke size (its store
configuration; server C its baseline), an acquire that waits for a leaked pin, a hot model
swap under load (a second checkpoint saved into its run directory), and last a stage thread
that dies. Server C runs the production command with --no-cache and the load generator
against it. The servers share a persistent compilation cache; each test bounds its requests
and waits. Two tests call the reload route and Engine.swap without a server.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import http.client
import json
import os
import pathlib
import re
import signal
import threading
import time
from types import SimpleNamespace

import numpy as np
import orbax.checkpoint as ocp
import pytest

from examples.ranker import evaluate, loadtest, serverbench, train
from examples.ranker.config import ACTIONS, PRESETS, SCORE_WEIGHTS
from examples.ranker.model import init
from examples.ranker.packing import pack
from examples.ranker.server.metrics import STORE_COUNTS
from examples.ranker.world import Sessions, World

ROOT = str(serverbench.ROOT)
PRESET = PRESETS["tiny"]
MAX_HISTORY, MAX_CANDIDATES, STEP = 60, 8, 7
LIMITS = ["--preset", "tiny", "--max-history", str(MAX_HISTORY), "--max-candidates",
          str(MAX_CANDIDATES), "--max-batch", "4", "--max-wait-ms", "30"]
SMALL_STORE = ["--device-pages", "8", "--max-queue", "8"]  # two histories of 60 events
DELAY_MS = 150
ROW = 1 + MAX_HISTORY + MAX_CANDIDATES  # the full forward pass's row (padding past a request)
HOOKS = ("tests/ranker/server_hooks.py",)  # the test entry point (fault hooks)
PROBE_SECONDS = 6  # a probe must answer within 2 s, with the 3x allowance for a busy machine
READY_SECONDS = 180  # 3x the first server's start (model load and warm-up) on 2 busy cores


class Server(serverbench.LocalServer):
    """A server process (ready within READY_SECONDS unless ``ready`` is False) and the
    requests the tests send it; ``hooks``: through the test entry point, server_hooks.py."""

    def __init__(self, out: str, args: list[str], env: dict, log: str, hooks: bool = False,
                 ready: bool = True):
        super().__init__(out, args, log, env, ready_within=READY_SECONDS if ready else None,
                         **({"command": HOOKS} if hooks else {}))

    def request(self, method: str, path: str, body: bytes | None = None, headers=None,
                ready: threading.Barrier | None = None, timeout: float = 20):
        """(status, headers, body bytes); status 0 when no connection could be made. With
        ``ready``, the request goes once the connection is open and every party is ready."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            conn.connect()
            if ready is not None:
                ready.wait()
            conn.request(method, path, body=body, headers=headers or {})
            response = conn.getresponse()
            return response.status, dict(response.getheaders()), response.read()
        except ConnectionError:
            return 0, {}, b""
        finally:
            conn.close()

    def rank(self, body, ready: threading.Barrier | None = None,
             headers: dict | None = None) -> tuple[int, dict, dict]:
        """POST /v1/rank of a dict (or raw bytes), with ``headers`` too: (status, headers,
        JSON answer)."""
        raw = body if isinstance(body, bytes) else json.dumps(body).encode()
        status, headers, answer = self.request(
            "POST", "/v1/rank", raw, {"Content-Type": "application/json", **(headers or {})},
            ready)
        return status, headers, json.loads(answer) if answer else {}

    def rank_all(self, bodies: list, stagger: float = 0.0) -> list:
        """(status, headers, answer, seconds, finished: time.monotonic() then) of each body,
        sent at once on connections of their own (``stagger`` seconds apart)."""
        ready = threading.Barrier(len(bodies))

        def send(i, body):
            if stagger:
                ready.wait()
                time.sleep(i * stagger)
            start = time.monotonic()
            answer = self.rank(body, None if stagger else ready)
            finished = time.monotonic()
            return *answer, finished - start, finished

        with concurrent.futures.ThreadPoolExecutor(len(bodies)) as pool:
            return list(pool.map(send, range(len(bodies)), bodies))

@pytest.fixture(scope="module")
def model():
    """(graphdef, params) of the checkpoint the servers load: step 7, its own weights."""
    return init(PRESET.model, len(ACTIONS), PRESET.world.contexts, seed=11)


@pytest.fixture(scope="module")
def next_model():
    """(graphdef, params) of the checkpoint a hot swap loads: step STEP + 1, other weights."""
    return init(PRESET.model, len(ACTIONS), PRESET.world.contexts, seed=12)


def save(out: str, step: int, params) -> None:
    """Save a checkpoint of ``params`` at ``step`` into the run directory ``out``, as train
    does."""
    manager = train.checkpoints(PRESET, out)
    manager.save(step, args=ocp.args.StandardSave(
        dict(params=params, opt_state=train.optimizer(PRESET).init(params))))
    manager.wait_until_finished()


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, model):
    out = str(tmp_path_factory.mktemp("run"))
    save(out, STEP, model[1])
    return out


@pytest.fixture(scope="module")
def run_dir_b(tmp_path_factory, model):
    """Server B's run directory: the same checkpoint as run_dir's, and the hot swap's."""
    out = str(tmp_path_factory.mktemp("run_b"))
    save(out, STEP, model[1])
    return out


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    """The servers' environment: one compilation cache for every server and replica of the
    suite, so a program one built loads in the next."""
    cache = str(tmp_path_factory.mktemp("jax_cache"))
    return dict(os.environ, PYTHONPATH=ROOT, JAX_COMPILATION_CACHE_DIR=cache,
                JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
                JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")


@pytest.fixture(scope="module")
def server_a(run_dir, env, tmp_path_factory):
    log = str(tmp_path_factory.mktemp("logs") / "a.log")
    server = Server(run_dir, LIMITS + SMALL_STORE + ["--history-delay-ms", str(DELAY_MS)],
                    env, log, hooks=True)
    yield server
    if server.process.poll() is None:
        server.process.kill()


@pytest.fixture(scope="module")
def server_b(run_dir_b, env, tmp_path_factory):
    """Server B, started (after server A's SIGTERM: its first test comes after that one) with
    its warm-up holding the store until the first test releases it."""
    log = str(tmp_path_factory.mktemp("logs") / "b.log")
    server = Server(run_dir_b, LIMITS + SMALL_STORE + ["--hold-warmup"], env, log, hooks=True,
                    ready=False)
    yield server
    if server.process.poll() is None:
        assert server.stop() == 0


@pytest.fixture(scope="module")
def server_c(run_dir, env, tmp_path_factory):
    """Server C: the production command (no test hooks), --no-cache, an explicit --host."""
    log = str(tmp_path_factory.mktemp("logs") / "c.log")
    server = Server(run_dir, LIMITS + ["--no-cache", "--host", "127.0.0.1"], env, log)
    yield server
    if server.process.poll() is None:  # Ctrl-C drains and exits 0 too (it exited 130)
        assert server.stop(sig=signal.SIGINT) == 0


@pytest.fixture(scope="module")
def sessions():
    """Sessions of the tiny world with at least MAX_HISTORY events (requests take the newest
    ``events`` of them), candidates cut to MAX_CANDIDATES."""
    s = World(PRESET.world).sample(np.random.default_rng(0), 40, long=True)
    assert s.history_len.min() >= MAX_HISTORY
    return dataclasses.replace(s, history_len=np.minimum(s.history_len, MAX_HISTORY),
                               cand_item=s.cand_item[:, :MAX_CANDIDATES],
                               cand_author=s.cand_author[:, :MAX_CANDIDATES],
                               labels=s.labels[:, :MAX_CANDIDATES],
                               probs=s.probs[:, :MAX_CANDIDATES])


def body(sessions, i: int, events: int | None = None, candidates: int = MAX_CANDIDATES,
         user: int | None = None, **extra) -> dict:
    """Session i as a request: its newest ``events`` events, its first ``candidates``."""
    n = int(sessions.history_len[i]) if events is None else events
    hist = slice(int(sessions.history_len[i]) - n, int(sessions.history_len[i]))
    return dict(user=int(sessions.user[i]) if user is None else user,
                context=int(sessions.context[i]),
                history_item=sessions.history_item[i, hist].tolist(),
                history_author=sessions.history_author[i, hist].tolist(),
                history_actions=sessions.history_actions[i, hist].astype(int).tolist(),
                cand_item=sessions.cand_item[i, :candidates].tolist(),
                cand_author=sessions.cand_author[i, :candidates].tolist(), **extra)


def full_forward(model, request: dict) -> np.ndarray:
    """Logits [c, A] of the full forward pass over one row [user, history, candidates]."""
    n, c = len(request["history_item"]), len(request["cand_item"])
    ids = lambda name: np.asarray(request[name], np.int64).reshape(1, -1)  # noqa: E731
    zeros = np.zeros((1, c, len(ACTIONS)), np.float32)
    session = Sessions(user=np.array([request["user"]]), context=np.array([request["context"]]),
                       history_len=np.array([n]), history_item=ids("history_item"),
                       history_author=ids("history_author"),
                       history_actions=np.asarray(request["history_actions"],
                                                  bool).reshape(1, n, len(ACTIONS)),
                       cand_item=ids("cand_item"), cand_author=ids("cand_author"),
                       labels=zeros, probs=zeros)
    batch, _ = pack(session, ROW, PRESET.model.max_position)
    logits = np.asarray(evaluate._logits(*model, batch))[0]
    return logits[batch.candidate[0] >= 0]


def assert_answer(model, request: dict, status: int, answer: dict, cache: str | None = None,
                  step: int = STEP):
    """A 200 of model step ``step`` (``model``'s) whose logits equal the full forward pass
    (1e-5) and whose scores are the preset's weighted score of them."""
    assert status == 200, answer
    logits = np.asarray(answer["logits"], np.float32)
    np.testing.assert_allclose(logits, full_forward(model, request), atol=1e-5, rtol=0)
    weights = np.array([SCORE_WEIGHTS[a] for a in ACTIONS])
    scores = (weights / (1 + np.exp(-logits.astype(float)))).sum(-1)
    np.testing.assert_allclose(answer["scores"], scores, rtol=1e-6)
    assert answer["actions"] == list(ACTIONS) and answer["model_step"] == step
    if cache is not None:
        assert answer["cache"] == cache


# --- Server A. ---------------------------------------------------------------------------------


def test_answers_equal_the_full_forward_pass(server_a, model, sessions):
    """Histories of 0, some and 60 events, 1 to 8 candidates: misses, then hits."""
    requests = [body(sessions, 0, events=0, candidates=1, request_id="r0"),
                body(sessions, 1, events=5, candidates=3), body(sessions, 2, events=60)]
    for cache in ("miss", "device"):
        for request in requests:
            status, headers, answer = server_a.rank(request)
            assert_answer(model, request, status, answer, cache)
            assert answer["request_id"] == request.get("request_id")
            assert headers["x-ranker-shapes"].endswith("x8") and (
                ("history" in headers["x-ranker-shapes"]) == (cache == "miss"))


def test_batch_and_candidate_invariance(server_a, model, sessions):
    """A hit's logits are bit-identical whatever shares its batch in one bucket shape, within
    1e-6 relative across shapes, and a candidate's never depend on the other candidates."""
    target = body(sessions, 3, events=20)
    others = [body(sessions, i, events=5) for i in range(4, 10)]  # a page each: all fit
    for request in [target] + others:  # cached first: then they hit together
        assert server_a.rank(request)[0] == 200
    answers = {}
    for companions, shape in ((others[:3], "score 4x8"), (others[3:], "score 4x8"),
                              ([], "score 1x8")):
        for _ in range(3):  # until the four land in one batch
            status, headers, answer, *_ = server_a.rank_all([target] + companions)[0]
            assert status == 200 and answer["cache"] == "device"
            if headers["x-ranker-shapes"] == shape:
                break
        answers.setdefault(headers["x-ranker-shapes"], []).append(
            np.asarray(answer["logits"], np.float32))
    assert "score 4x8" in answers and len(answers["score 4x8"]) == 2, answers.keys()
    np.testing.assert_array_equal(*answers["score 4x8"])
    alone = answers["score 1x8"][0]
    assert np.abs(alone - answers["score 4x8"][0]).max() <= 1e-6 * np.abs(alone).max()

    fewer = dict(target, cand_item=target["cand_item"][:1] + target["cand_item"][5:],
                 cand_author=target["cand_author"][:1] + target["cand_author"][5:])
    status, _, answer = server_a.rank(fewer)
    assert status == 200
    np.testing.assert_array_equal(np.asarray(answer["logits"], np.float32)[0], alone[0])


def test_a_reused_history_version_with_a_changed_history_is_recomputed(server_a, model,
                                                                         sessions):
    first = body(sessions, 10, history_version=5)
    assert_answer(model, first, *server_a.rank(first)[0::2], cache="miss")
    assert_answer(model, first, *server_a.rank(first)[0::2], cache="device")
    changed = json.loads(json.dumps(first))
    changed["history_actions"][-1][0] ^= 1  # one action of the newest event
    status, _, answer = server_a.rank(changed)
    assert_answer(model, changed, status, answer, cache="miss")
    assert np.abs(np.asarray(answer["logits"]) - full_forward(model, first)).max() > 1e-4
    bumped = dict(first, history_version=6)  # a new hint alone forces a recomputation too
    assert_answer(model, bumped, *server_a.rank(bumped)[0::2], cache="miss")


def malformed(sessions) -> list[tuple[str, str, object]]:
    """(kind, field, body) of a bad request of every kind."""
    good = body(sessions, 11, events=4, candidates=2)
    a = len(ACTIONS)
    cases = [("bad_json", "body", b'{"user": 1,'), ("bad_json", "body", b"[1, 2]"),
             ("bad_json", "body", b"\xff\xfe"), ("bad_json", "body", b"[" * 5000),
             ("too_large", "body", b" " * 16384)]
    for name in ("user", "context", "history_item", "history_author", "history_actions",
                 "cand_item", "cand_author"):
        cases.append(("missing_field", name, {k: v for k, v in good.items() if k != name}))
    bad_values = [("user", 0), ("user", 2**31), ("user", "7"), ("user", True), ("user", 1.0),
                  ("context", PRESET.world.contexts), ("context", -1),
                  ("history_item", [0, 1, 2, 3]), ("history_item", [1.5, 1, 2, 3]),
                  ("history_item", 3), ("history_author", [1, 2, 3]),
                  ("history_actions", [[0] * a] * 3), ("history_actions", [[0] * (a - 1)] * 4),
                  ("history_actions", [[2] + [0] * (a - 1)] * 4), ("cand_item", []),
                  ("cand_author", [1]), ("history_version", -1), ("request_id", 5),
                  ("candidates", [1]), ("deadline_ms", 0), ("deadline_ms", "soon"),
                  ("deadline_ms", True)]
    for name, value in bad_values:
        cases.append(("bad_value", name, dict(good, **{name: value})))
    long = body(sessions, 2, events=60)
    cases += [("too_large", "history_item", dict(long, history_item=long["history_item"] + [1],
                                                 history_author=long["history_author"] + [1],
                                                 history_actions=long["history_actions"]
                                                 + [[0] * a])),
              ("too_large", "cand_item", dict(good, cand_item=[1] * 9, cand_author=[1] * 9))]
    return cases


def test_malformed_requests_get_400_and_service_continues(server_a, model, sessions):
    """Every kind of bad request gets 400 naming its field (413 for a body over the limit;
    JSON nested 5000 deep is bad_json, not a RecursionError's 500), and so does a deadline
    header that is not a number."""
    for kind, field, request in malformed(sessions):
        status, _, answer = server_a.rank(request)
        assert status == (413 if (kind, field) == ("too_large", "body") else 400), (
            kind, field, answer)
        error = answer["error"]
        assert (error["kind"], error["field"]) == (kind, field), (kind, field, error)
        assert error["message"] and error["fix"]
    status, _, answer = server_a.rank(body(sessions, 11, events=4, candidates=2),
                                      headers={"X-Request-Deadline-Ms": "soon"})
    assert status == 400 and answer["error"]["field"] == "X-Request-Deadline-Ms", answer
    assert server_a.request("GET", "/v1/rank")[0] == 405
    assert server_a.request("GET", "/nowhere")[0] == 404
    request = body(sessions, 11, events=4, candidates=2)
    assert_answer(model, request, *server_a.rank(request)[0::2])


def test_x_user_id_must_name_the_bodys_user(server_a, model, sessions):
    """The header a proxy routes by (X-User-Id) must be the body's user: otherwise 400
    bad_value naming both values; equal, the request is served. A server started without
    --replica-index sends no X-Ranker-Replica (tests/ranker/test_cluster.py: with it)."""
    request = body(sessions, 11, events=4, candidates=2)
    user = str(request["user"])
    status, _, answer = server_a.rank(request, headers={"X-User-Id": user + "0"})
    assert status == 400 and answer["error"]["field"] == "X-User-Id", answer
    assert f"'{user}0'" in answer["error"]["message"] and user in answer["error"]["message"]
    status, headers, answer = server_a.rank(request, headers={"X-User-Id": user})
    assert_answer(model, request, status, answer)
    assert "x-ranker-replica" not in {k.lower() for k in headers}


def test_a_flood_past_the_queue_gets_503_at_once_then_service_resumes(server_a, model,
                                                                      sessions):
    """60 requests of one new history at once: its first batch goes to the history stage
    (150 ms), the queue (8) fills with requests waiting for that write, the rest get 503
    queue_full without waiting; every 200 is correct, and service resumes."""
    request = body(sessions, 12, events=8, user=10**6)
    results = server_a.rank_all([request] * 60)
    assert {s for s, *_ in results} <= {200, 503}, [s for s, *_ in results]
    full = [(seconds, h, a) for s, h, a, seconds, _ in results if s == 503]
    assert 40 <= len(full) < 60
    for seconds, headers, answer in full:
        assert answer["error"]["kind"] == "queue_full" and "retry-after" in headers
        assert seconds < 1.0
    for status, _, answer, *_ in results:
        if status == 200:
            assert_answer(model, request, status, answer)
    other = body(sessions, 13)
    assert_answer(model, other, *server_a.rank(other)[0::2])


def test_a_store_full_of_pinned_entries_answers_503_never_stale(server_a, model, sessions):
    """Two 60-event misses pin all 8 pages for the history stage's 150 ms; a third user's
    request meanwhile gets 503 cache_full with Retry-After, and once the pins are gone its
    answer is correct; a changed history after it is recomputed."""
    first = [body(sessions, i, events=60, user=2 * 10**6 + i) for i in (13, 14)]
    third = body(sessions, 15, events=60, user=2 * 10**6 + 15)
    results = server_a.rank_all(first + [third], stagger=0.01)
    status, headers, answer, *_ = results[2]
    assert status == 503 and answer["error"]["kind"] == "cache_full", answer
    assert int(headers["retry-after"]) >= 1
    for request, (status, _, answer, *_) in zip(first, results):
        assert_answer(model, request, status, answer, cache="miss")
    assert_answer(model, third, *server_a.rank(third)[0::2], cache="miss")
    changed = json.loads(json.dumps(third))
    changed["history_item"][0] = changed["history_item"][1]
    assert_answer(model, changed, *server_a.rank(changed)[0::2], cache="miss")


def count(samples: dict, name: str, **labels) -> float:
    """The sum of the metric samples ``name`` whose labels include ``labels``."""
    return sum(v for (n, ls), v in samples.items()
               if n == name and set(labels.items()) <= set(ls))


def history_passes(samples: dict) -> float:
    """The history passes in the metric ``samples`` (by any stage thread)."""
    return count(samples, "ranker_call_rows_count", call="history")


def wait_for_count(server, name: str, at_least: float, seconds: float = 5.0,
                   **labels) -> dict:
    """The server's metric samples once ``count(name, labels)`` reaches ``at_least``; fails
    after ``seconds``."""
    deadline = time.monotonic() + seconds
    while count(samples := server.metrics(), name, **labels) < at_least:
        assert time.monotonic() < deadline, (name, labels, at_least)
        time.sleep(0.01)
    return samples


def test_hits_are_answered_while_the_history_stage_is_busy(server_a, model, sessions):
    """Four one-page misses 50 ms apart (a job each, 150 ms a job in the history stage), then
    a hit: the hit is answered before the second miss, which waits for the first one's job.
    (The hand-off once held one job: the front stage blocked handing over the third miss until
    the history stage took the second, so the hit waited behind it.)"""
    hit = body(sessions, 24, events=10, user=6 * 10**6)
    assert_answer(model, hit, *server_a.rank(hit)[0::2], cache="miss")
    misses = [body(sessions, 25 + i, events=10, user=6 * 10**6 + 1 + i) for i in range(4)]
    results = server_a.rank_all(misses + [hit], stagger=0.05)
    for request, (status, _, answer, *_) in zip(misses + [hit], results):
        assert_answer(model, request, status, answer, "device" if request is hit else "miss")
    finished = [r[4] for r in results]
    assert finished[4] < finished[1], finished


def test_deadlines_refuse_at_once_and_drop_late_work(server_a, model, sessions):
    """A deadline shorter than the batch wait (--max-wait-ms 30) is refused at once with 503
    overloaded; a miss whose deadline (deadline_ms 120) passes while the history stage holds
    it (150 ms) is answered 504 deadline and dropped before its history pass; the same
    request without a deadline is then computed."""
    request = body(sessions, 30, events=10, user=7 * 10**6)
    status, headers, answer = server_a.rank(request, headers={"X-Request-Deadline-Ms": "5"})
    assert status == 503 and answer["error"]["kind"] == "overloaded", answer
    assert "retry-after" in headers
    before = server_a.metrics()
    status, _, answer = server_a.rank(dict(request, deadline_ms=120))
    assert status == 504 and answer["error"]["kind"] == "deadline", answer
    dropped = count(before, "ranker_dropped_total", stage="history", reason="deadline")
    after = wait_for_count(server_a, "ranker_dropped_total", dropped + 1, stage="history",
                           reason="deadline")
    assert history_passes(after) == history_passes(before)
    assert_answer(model, request, *server_a.rank(request)[0::2], cache="miss")


def test_a_body_that_stalls_gets_408_by_its_deadline(server_a, model, sessions):
    """Regression: the body was read without a deadline (uvicorn sets none), so a client that
    sent its headers and part of its body held the request unanswered forever. It now gets
    408 body_timeout by the request's deadline, and the connection closes."""
    request = body(sessions, 36, events=10, user=7 * 10**6 + 3)
    payload = json.dumps(request).encode()
    conn = http.client.HTTPConnection("127.0.0.1", server_a.port, timeout=20)
    conn.putrequest("POST", "/v1/rank")
    for name, value in (("Content-Type", "application/json"),
                        ("Content-Length", str(len(payload))), ("X-Request-Deadline-Ms", "300")):
        conn.putheader(name, value)
    conn.endheaders(payload[:len(payload) // 2])  # the rest never comes
    start = time.monotonic()
    response = conn.getresponse()
    waited = time.monotonic() - start
    answer = json.loads(response.read())
    assert response.status == 408 and answer["error"]["kind"] == "body_timeout", answer
    assert response.getheader("connection") == "close" and waited < 10, waited
    conn.close()
    assert_answer(model, request, *server_a.rank(request)[0::2], cache="miss")


def test_a_request_whose_client_leaves_is_dropped(server_a, sessions):
    """A miss whose client closes the connection once the front stage has taken it is dropped
    before its history pass. The history stage is held (/_test/hold-history) until the server
    has counted the disconnect: a fixed margin (the stage's 150 ms delay) was too short on a
    loaded CI machine, whose history pass then ran."""
    request = body(sessions, 31, events=10, user=7 * 10**6 + 1)
    before = server_a.metrics()
    assert server_a.request("POST", "/_test/hold-history")[0] == 200
    try:
        conn = http.client.HTTPConnection("127.0.0.1", server_a.port, timeout=20)
        conn.request("POST", "/v1/rank", json.dumps(request).encode(),
                     {"Content-Type": "application/json"})
        wait_for_count(server_a, "ranker_batch_requests_sum",
                       count(before, "ranker_batch_requests_sum") + 1)
        conn.close()
        wait_for_count(server_a, "ranker_client_disconnects_total",
                       count(before, "ranker_client_disconnects_total") + 1)
    finally:
        assert server_a.request("POST", "/_test/release-history")[0] == 200
    dropped = count(before, "ranker_dropped_total", stage="history", reason="disconnected")
    after = wait_for_count(server_a, "ranker_dropped_total", dropped + 1, stage="history",
                           reason="disconnected")
    assert (count(after, "ranker_client_disconnects_total")
            == count(before, "ranker_client_disconnects_total") + 1)
    assert history_passes(after) == history_passes(before)


def test_a_failed_store_write_answers_503_and_a_retry_recomputes(server_a, model, sessions):
    """A history pass whose store write fails (RA224, as on an allocation failure; injected by
    /_test/fail-next-pass) answers its request 503 store_failed, not 500; the retry is a miss,
    recomputed and correct."""
    request = body(sessions, 35, events=10, user=7 * 10**6 + 2)
    assert server_a.request("POST", "/_test/fail-next-pass")[0] == 200
    status, headers, answer = server_a.rank(request)
    assert status == 503 and answer["error"]["kind"] == "store_failed", answer
    assert "retry-after" in headers
    assert_answer(model, request, *server_a.rank(request)[0::2], cache="miss")


def inference_request(request: dict, nested: bool = False, actions: str = "INT64",
                      **extra) -> dict:
    """``request`` (a /v1/rank body) as an Open Inference request: one input per field,
    history_actions as ``actions`` (INT64 or BOOL), data flat (row-major) or ``nested``."""
    inputs = []
    for name, value in request.items():
        array = np.atleast_1d(np.asarray(value, np.int64))
        if name == "history_actions":
            array = array.reshape(-1, len(ACTIONS)).astype(bool if actions == "BOOL" else int)
        inputs.append(dict(name=name, datatype=actions if name == "history_actions" else "INT64",
                           shape=list(array.shape),
                           data=array.tolist() if nested else array.ravel().tolist()))
    return dict(inputs=inputs, **extra)


def infer(server, request, binary: bytes = b"") -> tuple[int, dict]:
    """POST /v2/models/ranker/infer of a dict (or raw bytes), with ``binary`` (the inputs'
    binary data) after it: (status, JSON answer)."""
    raw = request if isinstance(request, bytes) else json.dumps(request).encode()
    headers = {"Content-Type": "application/json"}
    if binary:
        headers["Inference-Header-Content-Length"] = str(len(raw))
    status, _, answer = server.request("POST", "/v2/models/ranker/infer", raw + binary, headers)
    return status, json.loads(answer)


def outputs(answer: dict) -> dict:
    """{name: array} of an Open Inference answer's outputs."""
    return {o["name"]: np.asarray(o["data"], np.float32).reshape(o["shape"])
            for o in answer["outputs"]}


def test_open_inference_answers_as_v1_rank(server_a, model, sessions):
    """A miss through /v2/models/ranker/infer (data flat, actions INT64), then the same
    request through /v1/rank (a hit) and through infer again (nested, BOOL, scores only):
    the same logits, bit for bit (one scoring program, one cached history), and scores."""
    request = body(sessions, 22, events=5, candidates=3, user=4 * 10**6, history_version=3)
    status, answer = infer(server_a, inference_request(request, id="k-1"))
    assert status == 200, answer
    assert (answer["model_name"], answer["model_version"], answer["id"]) == ("ranker", "7",
                                                                          "k-1")
    assert answer["parameters"] == {"cache": "miss", "model_step": STEP,
                                    "actions": ",".join(ACTIONS)}
    first = outputs(answer)
    assert first["logits"].shape == (3, len(ACTIONS)) and first["scores"].shape == (3,)
    status, _, ranked = server_a.rank(request)
    assert_answer(model, request, status, ranked, cache="device")
    np.testing.assert_array_equal(first["logits"], np.asarray(ranked["logits"], np.float32))
    np.testing.assert_array_equal(first["scores"], np.asarray(ranked["scores"], np.float32))
    status, answer = infer(server_a, inference_request(request, nested=True, actions="BOOL",
                                                        outputs=[{"name": "scores"}]))
    assert status == 200 and answer["parameters"]["cache"] == "device" and "id" not in answer
    assert [o["name"] for o in answer["outputs"]] == ["scores"]
    np.testing.assert_array_equal(outputs(answer)["scores"], first["scores"])


def test_open_inference_metadata_and_health(server_a):
    get = lambda path: (lambda s, b: (s, json.loads(b)))(*server_a.get(path))  # noqa: E731
    assert get("/v2/health/live") == (200, {"live": True})
    assert get("/v2/health/ready") == (200, {"ready": True})
    for path in ("/v2/models/ranker/ready", f"/v2/models/ranker/versions/{STEP}/ready"):
        assert get(path) == (200, {"name": "ranker", "ready": True})
    status, server = get("/v2")
    assert status == 200 and server["name"] and server["extensions"] == []
    status, headers, _ = server_a.request("GET", "/v2/models/ranker/infer")
    allow = {name.lower(): value for name, value in headers.items()}.get("allow")
    assert status == 405 and allow == "POST", headers  # HTTP requires Allow on a 405
    status, metadata = get("/v2/models/ranker")
    assert status == 200 and metadata["versions"] == [str(STEP)], metadata
    a = len(ACTIONS)
    assert [(t["name"], t["datatype"], t["shape"]) for t in metadata["inputs"]] == [
        ("user", "INT64", [1]), ("context", "INT64", [1]), ("history_item", "INT64", [-1]),
        ("history_author", "INT64", [-1]), ("history_actions", "BOOL", [-1, a]),
        ("cand_item", "INT64", [-1]), ("cand_author", "INT64", [-1]),
        ("history_version", "INT64", [1])]
    assert metadata["outputs"] == [{"name": "logits", "datatype": "FP32", "shape": [-1, a]},
                                   {"name": "scores", "datatype": "FP32", "shape": [-1]}]
    for path, status in (("/v2/models/other", 404), (f"/v2/models/ranker/versions/{STEP + 1}",
                                                     404), ("/v2/models/ranker/infer", 405)):
        answer = get(path)
        assert answer[0] == status and set(answer[1]) == {"error"}, (path, answer)


def test_open_inference_health_follows_the_engine():
    """The v2 probes answer as /livez and /readyz in every state of Engine.health: live
    unless broken, ready only when serving."""
    from examples.ranker.server import kserve

    for state, live, ready in (("warming", 200, 503), ("serving", 200, 200),
                               ("draining", 200, 503), ("broken", 503, 503)):
        engine = SimpleNamespace(health=lambda state=state: (state, "why"), model_step=STEP)
        assert kserve.route("GET", "/v2/health/live", engine).status == live
        assert kserve.route("GET", "/v2/health/ready", engine).status == ready
        assert kserve.route("GET", "/v2/models/ranker/ready", engine).status == ready


def bad_inference_requests(sessions) -> list[tuple[str, str, object]]:
    """(kind, the input or field the error names, request) of bad Open Inference requests."""
    good = inference_request(body(sessions, 11, events=4, candidates=2), nested=True)

    def changed(name, **fields):
        return dict(good, inputs=[dict(i, **fields) if i["name"] == name else i
                                  for i in good["inputs"]])

    a = len(ACTIONS)
    nine = inference_request(dict(body(sessions, 11, events=4, candidates=2),
                                  cand_item=[1] * 9, cand_author=[1] * 9))
    return [("bad_json", "inference request", b'{"inputs": ['),
            ("bad_value", "cand_item", changed("cand_item", datatype="FP32")),
            ("bad_value", "history_actions", changed("history_actions", datatype="FP32")),
            ("bad_value", "user", changed("user", shape=[2], data=[1, 2])),
            ("bad_value", "history_actions", changed("history_actions", shape=[4, a + 1])),
            ("bad_value", "cand_author", changed("cand_author", data=[1, 2, 3])),
            ("bad_value", "history_actions", changed("history_actions",
                                                     data=[[0] * a] * 3 + [[0] * (a + 1)])),
            ("missing_field", "cand_author",
             dict(good, inputs=[i for i in good["inputs"] if i["name"] != "cand_author"])),
            ("bad_value", "candidates", dict(good, inputs=good["inputs"] + [
                dict(name="candidates", datatype="INT64", shape=[1], data=[1])])),
            ("too_large", "cand_item", nine),
            ("bad_value", "cand_item", changed("cand_item", data=[0, 1])),
            ("bad_value", "user", changed("user", data=[1.5])),
            ("bad_value", "id", dict(good, id=5)),
            ("bad_value", "inputs", dict(good, inputs={})),
            ("bad_value", "colour", dict(good, parameters={"colour": 1})),
            ("bad_value", "timeout", dict(good, parameters={"timeout": -5}))]


def test_open_inference_bad_requests_get_400_and_service_continues(server_a, model,
                                                                   sessions):
    for kind, name, request in bad_inference_requests(sessions):
        status, answer = infer(server_a, request)
        assert status == 400 and set(answer) == {"error"}, (kind, name, answer)
        assert answer["error"].startswith(kind + ": ") and name in answer["error"], (kind,
                                                                                    answer)
    request = body(sessions, 11, events=4, candidates=2)
    status, answer = infer(server_a, inference_request(request))
    assert status == 200
    np.testing.assert_allclose(outputs(answer)["logits"], full_forward(model, request),
                               atol=1e-5, rtol=0)


def test_open_inference_binary_sizes_and_timeouts_that_are_not_plain_ints(server_a, sessions):
    """Regressions: a binary_data_size of 8.0 passed the size check, and the next binary input
    then raised TypeError; a timeout of 10**400 microseconds overflowed a float: both answered
    500 internal. The first is 400 now; the second is the server's own deadline."""
    request = body(sessions, 12, events=4, candidates=2)
    good = inference_request(request)

    def binary_user_and_context(user_size) -> tuple[dict, bytes]:
        sizes = {"user": user_size, "context": 8}
        inputs = [dict({k: v for k, v in i.items() if k != "data"},
                       parameters={"binary_data_size": sizes[i["name"]]})
                  if i["name"] in sizes else i for i in good["inputs"]]
        return dict(good, inputs=inputs), np.int64(request["user"]).tobytes() + np.int64(
            request["context"]).tobytes()

    status, answer = infer(server_a, *binary_user_and_context(8.0))
    assert status == 400 and answer["error"].startswith("bad_value: input user has "
                                                        "binary_data_size 8.0"), answer
    status, answer = infer(server_a, *binary_user_and_context(8))
    assert status == 200, answer
    status, answer = infer(server_a, dict(good, parameters={"timeout": 10**400}))
    assert status == 200, answer
    status, _, raw = server_a.request(  # more digits than int() takes: 400, not 500
        "POST", "/v2/models/ranker/infer", json.dumps(good).encode(),
        {"Inference-Header-Content-Length": "9" * 5000})
    answer = json.loads(raw)
    assert status == 400 and answer["error"].startswith(
        "bad_value: the header Inference-Header-Content-Length is b'999"), answer


def test_tritonclient_ranks_through_open_inference(server_a, sessions):
    """Triton's own HTTP client (binary input data, its default), driven by the metadata:
    live, ready, an answer equal to /v1/rank's, an error as its exception with status 400, and
    its timeout as the request's deadline (1 us: refused at once, 503 overloaded)."""
    import tritonclient.http as triton
    from tritonclient.utils import InferenceServerException, triton_to_np_dtype

    client = triton.InferenceServerClient(f"127.0.0.1:{server_a.port}", network_timeout=20)
    try:
        assert client.is_server_live() and client.is_server_ready()
        assert client.is_model_ready("ranker")

        def tensors(request):
            out = []
            for spec in client.get_model_metadata("ranker")["inputs"]:
                if spec["name"] in request:
                    array = np.asarray(request[spec["name"]],
                                       triton_to_np_dtype(spec["datatype"]))
                    array = array.reshape([n if n >= 0 else -1 for n in spec["shape"]])
                    out.append(triton.InferInput(spec["name"], list(array.shape),
                                                 spec["datatype"]))
                    out[-1].set_data_from_numpy(array)
            return out

        request = body(sessions, 23, events=7, candidates=4, user=5 * 10**6)
        result = client.infer("ranker", tensors(request), request_id="t-1", timeout=10**7)
        answer = result.get_response()
        assert answer["id"] == "t-1" and answer["parameters"]["cache"] == "miss"
        status, _, ranked = server_a.rank(request)
        assert status == 200 and ranked["cache"] == "device"
        np.testing.assert_array_equal(result.as_numpy("logits"),
                                      np.asarray(ranked["logits"], np.float32))
        with pytest.raises(InferenceServerException, match="too_large: cand_item") as err:
            client.infer("ranker", tensors(dict(request, cand_item=[1] * 9,
                                                cand_author=[1] * 9)))
        assert err.value.status() == "400"
        with pytest.raises(InferenceServerException, match="overloaded") as err:
            client.infer("ranker", tensors(request), timeout=1)
        assert err.value.status() == "503"
    finally:
        client.close()


def test_metrics_are_prometheus_text_by_convention(server_a):
    """Counts are counters (``_total``; the store's too), with the default process, platform
    and garbage collector metrics; every answer is counted by route and status, 404, 405, 413
    and an unexpected exception's 500 (answered as JSON) included."""
    status, _, raw = server_a.request("GET", "/_test/raise")
    assert status == 500 and json.loads(raw)["error"]["kind"] == "internal"
    assert server_a.rank(b" " * 16384)[0] == 413
    status, text = server_a.get("/metrics")
    text = text.decode()
    assert status == 200
    for name in ("ranker_requests_total", "ranker_errors_total", "ranker_request_seconds_bucket",
                 "ranker_batch_requests_bucket", "ranker_queue_depth", "ranker_stage_seconds_sum",
                 "process_cpu_seconds_total", "process_resident_memory_bytes", "python_info",
                 "python_gc_objects_collected_total", 'ranker_service_seconds{stage="history"}'):
        assert f"\n{name}" in text, name
    for name in STORE_COUNTS:
        assert f"# TYPE ranker_store_{name}_total counter\n" in text, name
        assert f"\nranker_store_{name}_total " in text, name
    assert "\nranker_compiles_after_warmup_total 0.0" in text  # warm-up compiled every shape
    for route, status, kind in (("other", 404, "not_found"), ("/v1/rank", 405, "bad_method"),
                                ("/v1/rank", 413, "too_large"), ("/_test/raise", 500, "internal"),
                                ("/v1/rank", 400, "bad_value"), ("/v1/rank", 200, None)):
        assert f'ranker_responses_total{{route="{route}",status="{status}"}}' in text, route
        assert kind is None or f'ranker_errors_total{{kind="{kind}"}}' in text, kind


def test_sigterm_answers_every_request_in_flight_and_exits_0(server_a, model, sessions):
    """Six one-page misses (two batches of the history stage, 150 ms each) in flight when SIGTERM
    lands: each is answered, correctly, and the process exits 0 within 10 s. A loaded machine
    can take longer to see them accepted than the server takes to answer them: then another
    six go (at most three tries), since SIGTERM must land with answers owed."""
    for attempt in range(3):
        requests = [body(sessions, i, events=10, user=3 * 10**6 + 10 * attempt + i)
                    for i in range(16, 22)]
        taken = count(server_a.metrics(), "ranker_batch_requests_sum") + len(requests)
        pool = concurrent.futures.ThreadPoolExecutor(len(requests))
        futures = [pool.submit(server_a.rank, r) for r in requests]
        wait_for_count(server_a, "ranker_batch_requests_sum", taken)  # all accepted
        if not all(f.done() for f in futures):  # SIGTERM lands with answers owed
            break
        pool.shutdown()
    else:
        pytest.fail("three times, six requests were answered before the test saw them accepted")
    with pool:
        start = time.monotonic()
        assert server_a.stop() == 0
        assert time.monotonic() - start < 10
        results = [f.result() for f in futures]
    for request, (status, _, answer) in zip(requests, results):
        assert_answer(model, request, status, answer)
    assert server_a.get("/healthz")[0] == 0  # no longer listening


# --- Servers B and C. --------------------------------------------------------------------------


def probe(server, path: str) -> tuple[int, dict]:
    """(status, JSON body) of GET ``path``, which must answer within PROBE_SECONDS."""
    status, _, raw = server.request("GET", path, timeout=PROBE_SECONDS)
    return status, json.loads(raw) if raw.startswith(b"{") else {}


def test_probes_answer_while_warm_up_holds_the_store(server_a, server_b, sessions):
    """(After server A's SIGTERM; server B's warm-up holds the store's lock until released.)
    /livez and /v2/health/live answer 200 and /metrics answers, /readyz, /healthz and
    /v2/health/ready answer 503 warming, a ranking request 503 warming, each at once; released,
    the server gets ready."""
    assert server_a.process.poll() == 0
    deadline = time.monotonic() + READY_SECONDS
    while probe(server_b, "/livez")[0] == 0:  # the model loads, then uvicorn listens
        assert server_b.process.poll() is None and time.monotonic() < deadline
        time.sleep(0.2)
    for path, want in (("/livez", 200), ("/readyz", 503), ("/healthz", 503),
                       ("/v2/health/live", 200), ("/v2/health/ready", 503)):
        status, answer = probe(server_b, path)
        assert status == want and answer.get("status", "warming") == "warming", (path, answer)
    status, _, text = server_b.request("GET", "/metrics", timeout=PROBE_SECONDS)
    assert status == 200 and b"\nranker_ready 0.0" in text
    status, _, answer = server_b.rank(body(sessions, 0))
    assert status == 503 and answer["error"]["kind"] == "warming"
    assert server_b.request("POST", "/_test/release-warmup")[0] == 200
    server_b.wait_ready(READY_SECONDS)
    assert probe(server_b, "/readyz") == (200, {"status": "serving", "reason": "ready",
                                                "model_step": STEP})


def test_a_restart_starts_empty_and_answers_the_same(server_b, model, sessions):
    """Server B (the same flags on the same run directory): the first answers are misses,
    equal to the full forward pass."""
    for i in (0, 1, 2):
        request = body(sessions, i)
        assert_answer(model, request, *server_b.rank(request)[0::2], cache="miss")


def test_serverbench_measures_capacity_and_the_bound_and_reports(server_b, server_c,
                                                                   tmp_path):
    """serverbench's smoke size, two runs on server C (the --no-cache baseline) and server B
    (the store): per server a fill, the low rate, an overload, a bisection step; s, h and m
    per stage thread from /metrics; the report with each run's figures."""
    servers = {serverbench.BASELINE: server_c, serverbench.STORE: server_b}
    size = serverbench.SMOKE
    results = serverbench.write(
        "tiny", str(tmp_path), size, True, {name: s.args for name, s in servers.items()},
        lambda name, flags: contextlib.nullcontext(servers[name]))
    assert [list(run["configs"]) for run in results["runs"]] == [list(servers)] * size.runs
    for run in results["runs"]:
        for name, measured in run["configs"].items():
            capacity, low = measured["capacity"], measured["low"]
            kinds = [p["kind"] for p in measured["points"]]
            top = max(capacity["client"]["window_qps"], low["qps"])
            lo, hi = measured["bracket"]
            if serverbench.within(low, results["bound_ms"]) and top > low["qps"]:
                assert kinds.count("bisection") == size.bisections, kinds  # each halves it
                assert hi - lo == pytest.approx((top - low["qps"]) / 2**size.bisections)
            else:  # nothing to search: the low rate past the bound, or a capacity at or below
                # it (a loaded CI machine measured the baseline's at or under 30 / s)
                assert "bisection" not in kinds and (lo, hi) == (low["qps"], top), kinds
            model = capacity["model"]
            assert model["h_ms"] > 0 and model["s_history_ms"] > 0, (name, model)
            assert measured["compiles_after_warmup"] == 0
        store = run["configs"][serverbench.STORE]["capacity"]["model"]
        assert 0 < store["m"] < 1 and store["s_front_ms"] > 0, store  # hits on the front
        assert run["configs"][serverbench.BASELINE]["capacity"]["model"]["m"] == 1
    text = (tmp_path / "SERVER.md").read_text()
    for section in ("## Targets", "## Method", "## Capacity", "## Throughput at the p99 bound",
                    "## s, h and m by load", "## Where the time goes"):
        assert section in text, section
    rows = [line for line in text.splitlines() if line.startswith(f"| {serverbench.STORE} | ")]
    assert re.search(r"\| [\d.]+ / [\d.]+ \|", rows[1]), rows[1]  # capacity, both runs


def test_an_acquire_that_waits_for_a_leaked_pin_answers_503(server_b, model, sessions):
    """A lease that never writes its entry (/_test/leak, as a lost lease or a failed copy
    leaves one) makes an acquire of that key wait: after --acquire-timeout-ms (1 s) the request
    gets 503 store_timeout, and the server goes on answering and stays ready. Another user's
    hit in the same batch is answered (regression: the whole batch got store_timeout): sent
    while the front stage waits on the leaked key, it and the leaked key's next request make
    its next batch."""
    leaked = body(sessions, 32, events=10, user=8 * 10**6)
    status, _, raw = server_b.request("POST", "/_test/leak", json.dumps(leaked).encode())
    assert status == 200 and json.loads(raw) == {"source": "miss"}
    status, headers, answer = server_b.rank(leaked)
    assert status == 503 and answer["error"]["kind"] == "store_timeout", answer
    assert "retry-after" in headers
    other = body(sessions, 33, events=10, user=8 * 10**6 + 1)
    assert_answer(model, other, *server_b.rank(other)[0::2], cache="miss")
    assert probe(server_b, "/readyz")[0] == 200
    before = server_b.metrics()
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        first = pool.submit(server_b.rank, leaked)
        wait_for_count(server_b, "ranker_batch_requests_count",
                       count(before, "ranker_batch_requests_count") + 1)
        again, hit = pool.submit(server_b.rank, leaked), pool.submit(server_b.rank, other)
        for future in (first, again):
            status, _, answer = future.result()
            assert status == 503 and answer["error"]["kind"] == "store_timeout", answer
        assert_answer(model, other, *hit.result()[0::2], cache="device")
    after = server_b.metrics()
    batches = [count(after, f"ranker_batch_requests_{n}")
               - count(before, f"ranker_batch_requests_{n}") for n in ("count", "sum")]
    assert batches == [2, 3], batches  # [leaked], then [leaked, other]


def test_a_hot_swap_under_load_answers_with_one_models_forward(server_b, run_dir_b, model,
                                                              next_model, sessions):
    """Three clients send requests of two users each, one at a time; once every user has had
    a miss and a hit, a checkpoint of other weights (step STEP + 1) is saved into server B's
    run directory and POST /admin/reload (202) swaps it in under that load. /readyz answers
    200 throughout; every answer equals the full forward pass of the model of the step it
    reports; each client sees the old step, then the new one only; each user's first answer
    of the new step is a miss (no K/V of the old model serves the new one's scoring) and its
    next a hit; nothing compiles; a second reload answers 200, current, and so does SIGHUP
    (in the log)."""
    models = {STEP: model, STEP + 1: next_model}
    users = [[body(sessions, 2 * c + k, events=10, user=9 * 10**6 + 2 * c + k)
              for k in range(2)] for c in range(3)]
    sent = [[] for _ in users]  # per client: (request, status, answer), in order
    give_up = time.monotonic() + 60  # 3x a quiet run's bound; each client sends <= 300

    def client(c: int) -> None:
        for i in range(300):
            request = users[c][i % 2]
            sent[c].append((request, *server_b.rank(request)[0::2]))
            new = sum(answer.get("model_step") == STEP + 1 for _, _, answer in sent[c])
            if new >= 4 or sent[c][-1][1] != 200 or time.monotonic() > give_up:
                return

    with concurrent.futures.ThreadPoolExecutor(len(users)) as pool:
        clients = [pool.submit(client, c) for c in range(len(users))]
        while min(map(len, sent)) < 4:  # every user missed, then hit
            assert time.monotonic() < give_up and not any(f.done() for f in clients), sent
            time.sleep(0.01)
        save(run_dir_b, STEP + 1, next_model[1])
        status, _, raw = server_b.request("POST", "/admin/reload")
        assert (status, json.loads(raw)) == (202, {"model_step": STEP, "loading": STEP + 1,
                                                   "status": "loading"})
        ready = []
        while not ready or ready[-1] != (200, STEP + 1):
            assert time.monotonic() < give_up, ready[-3:]
            status, answer = probe(server_b, "/readyz")
            ready.append((status, answer.get("model_step")))
        for future in clients:
            future.result()
    assert {status for status, _ in ready} == {200}, ready
    for c, answers in enumerate(sent):
        for request, status, answer in answers:
            assert status == 200, (c, answer)
            assert_answer(models[answer["model_step"]], request, status, answer,
                          step=answer["model_step"])
        steps = [answer["model_step"] for _, _, answer in answers]
        assert steps == sorted(steps) and set(steps) == {STEP, STEP + 1}, (c, steps)
        for user in users[c]:
            caches = {step: [a["cache"] for r, _, a in answers
                             if r is user and a["model_step"] == step] for step in models}
            assert caches[STEP][:2] == ["miss", "device"], (c, caches)
            assert caches[STEP + 1][:2] == ["miss", "device"], (c, caches)
    samples = server_b.metrics()
    assert count(samples, "ranker_model_step") == STEP + 1
    assert count(samples, "ranker_reloads_total", outcome="swapped") == 1
    assert count(samples, "ranker_compiles_after_warmup_total") == 0
    status, _, raw = server_b.request("POST", "/admin/reload")
    assert (status, json.loads(raw)) == (200, {"model_step": STEP + 1, "status": "current"})
    server_b.process.send_signal(signal.SIGHUP)  # the same reload; its answer goes to the log
    deadline = time.monotonic() + PROBE_SECONDS
    while "SIGHUP: reload answered 200" not in pathlib.Path(server_b.log).read_text():
        assert server_b.process.poll() is None and time.monotonic() < deadline
        time.sleep(0.05)


class FakeReloadEngine:
    """What the app and the reloader read of an engine: health, the step, swap, metrics."""

    def __init__(self):
        from examples.ranker.server.metrics import Metrics

        self.state, self.model_step, self.metrics = "serving", STEP, Metrics(self, 4)
        self.model_checkpoint = (STEP, 0, 0)

    def health(self):
        return self.state, "why"

    def swap(self, model):
        self.model_step, self.model_checkpoint = model.step, model.checkpoint


class FakeCheckpoints:
    """A run directory whose newest step (and its folder's ``stamp``, which a rewritten run
    changes) the test sets; ``restore`` waits for ``loaded`` and raises when ``broken``."""

    out = "/runs/fake"

    def __init__(self):
        self.step, self.stamp, self.broken, self.loaded = None, 0, False, threading.Event()

    def latest(self):
        return None if self.step is None else (self.step, 0, self.stamp)

    def restore(self):
        from examples.ranker.server.engine import Model

        self.loaded.wait(10)
        if self.broken:
            raise OSError("a checkpoint that does not read")
        return Model(self.step, None, None, checkpoint=self.latest())


def test_admin_reload_answers_loopback_clients_one_reload_at_a_time():
    """POST /admin/reload through the ASGI app (no server): a client off the loopback
    addresses gets 403 forbidden; a warming engine 503; no checkpoint 404 no_checkpoint; the
    served step 200 current; a newer step 202, and 409 reload_in_progress until it is
    swapped in; the served step in a rewritten run directory 202 (regression: it was 200
    current, and the old weights stayed); a load that fails is counted and the served step
    stays."""
    import asyncio

    from examples.ranker.server.app import App
    from examples.ranker.server.reload import Reloader

    engine, checkpoints = FakeReloadEngine(), FakeCheckpoints()
    reloader = Reloader(engine, checkpoints)
    app = App(engine, None, None, reloader=reloader)

    def reload(client="127.0.0.1"):
        messages = []

        async def receive():
            return {"type": "http.request", "body": b"", "more_body": False}

        async def send(message):
            messages.append(message)

        asyncio.run(app({"type": "http", "method": "POST", "path": "/admin/reload",
                         "headers": [], "client": (client, 50000)}, receive, send))
        answer = json.loads(messages[1]["body"])
        return messages[0]["status"], answer.get("error", {}).get("kind", answer)

    def loaded():
        deadline = time.monotonic() + 10
        while reloader.loading is not None:
            assert time.monotonic() < deadline
            time.sleep(0.01)

    checkpoints.step = STEP + 1
    for client in ("10.0.0.5", "192.168.1.2", "::ffff:10.0.0.5", None):
        assert reload(client) == (403, "forbidden"), client
    engine.state = "warming"
    assert reload() == (503, "warming")
    engine.state = "serving"
    checkpoints.step = None
    assert reload("::1") == (404, "no_checkpoint")
    checkpoints.step = STEP
    assert reload() == (200, {"model_step": STEP, "status": "current"})
    checkpoints.step = STEP + 1
    assert reload() == (202, {"model_step": STEP, "loading": STEP + 1, "status": "loading"})
    assert reload("::ffff:127.0.0.1") == (409, "reload_in_progress")
    checkpoints.loaded.set()
    loaded()
    assert engine.model_step == STEP + 1
    assert reload() == (200, {"model_step": STEP + 1, "status": "current"})
    checkpoints.stamp = 1  # another run rewrote the directory, up to the same step
    assert reload() == (202, {"model_step": STEP + 1, "loading": STEP + 1, "status": "loading"})
    loaded()
    assert engine.model_checkpoint == (STEP + 1, 0, 1)
    assert reload() == (200, {"model_step": STEP + 1, "status": "current"})
    checkpoints.step, checkpoints.broken = STEP + 2, True
    assert reload()[0] == 202
    loaded()
    assert engine.model_step == STEP + 1
    reloads = {sample.labels["outcome"]: sample.value
               for sample in engine.metrics.reloads.collect()[0].samples
               if sample.name == "ranker_reloads_total"}
    assert reloads == {"swapped": 2, "failed": 1}


def test_a_swap_refuses_a_model_of_other_shapes(model):
    """Engine.swap takes only a model with the served graph, parameter shapes and dtypes
    (the compiled programs'), and says which parameters differ."""
    import jax

    from examples.ranker.server.engine import Engine, Model, Options

    engine = Engine(PRESET, Model(STEP, *model),
                    Options(max_history=MAX_HISTORY, max_candidates=MAX_CANDIDATES,
                            device_pages=8))
    graphdef, params = model
    wider = jax.tree.map(lambda x: np.zeros(x.shape[:-1] + (x.shape[-1] + 1,), x.dtype),
                         params)
    with pytest.raises(ValueError, match="differ in shape or dtype"):
        engine.swap(Model(STEP + 1, graphdef, wider))
    deeper = dataclasses.replace(PRESET.model, layers=PRESET.model.layers + 1)
    other = init(deeper, len(ACTIONS), PRESET.world.contexts, seed=11)
    with pytest.raises(ValueError, match="another model graph"):
        engine.swap(Model(STEP + 1, *other))
    assert engine.model_step == STEP


def test_a_dead_stage_thread_fails_readiness_and_liveness(server_b, sessions):
    """(Last on server B.) The history stage's thread dies on its next job: that job's request
    gets 504 at its deadline, then /readyz, /healthz and /livez answer 503 broken naming the
    stage (and /v2/health/live and /ready 503), a ranking request 503 broken at once, and
    SIGTERM still exits 0."""
    assert server_b.request("POST", "/_test/kill-history")[0] == 200
    request = body(sessions, 34, events=10, user=8 * 10**6 + 2)
    status, _, answer = server_b.rank(dict(request, deadline_ms=1000))
    assert status == 504 and answer["error"]["kind"] == "deadline", answer
    for path in ("/readyz", "/healthz", "/livez"):
        status, answer = probe(server_b, path)
        assert status == 503 and answer["status"] == "broken", (path, answer)
        assert "history stage thread died" in answer["reason"]
    for path, key in (("/v2/health/live", "live"), ("/v2/health/ready", "ready")):
        assert probe(server_b, path) == (503, {key: False})  # as /livez and /readyz
    status, _, answer = server_b.rank(request)
    assert status == 503 and answer["error"]["kind"] == "broken", answer
    assert server_b.stop() == 0


def test_no_cache_recomputes_and_the_load_generator_runs(server_c, model, sessions):
    """Server C: the production command (no test hooks), --no-cache, an explicit --host."""
    request = body(sessions, 5)
    for _ in range(2):
        assert_answer(model, request, *server_c.rank(request)[0::2], cache="off")
    trace = loadtest.Trace(PRESET, users=50, zipf=1.1, change_share=0.1, seed=0,
                           candidates=MAX_CANDIDATES, max_history=MAX_HISTORY)
    report = loadtest.run(trace.load(qps=40, duration=2.0),
                          f"http://127.0.0.1:{server_c.port}", grace=10)
    assert report["errors"] == {} and report["answered_ok"] == report["requests"] > 40
    assert set(report["by_cache"]) == {"off"} and report["latency"]["p99_ms"] < 2000
    with pytest.raises(ValueError, match="only to this machine"):
        loadtest.run(trace.load(qps=1, duration=1), "http://10.0.0.1:80")


# --- The engine's own failure paths, on its real methods with stand-in collaborators. ----


def stand_in_request(user: int) -> "object":
    from examples.ranker.server.schema import Request

    answers = []
    request = Request(user=user, context=0, history_item=np.ones(3, np.int64),
                      history_author=np.ones(3, np.int64),
                      history_actions=np.zeros((3, len(ACTIONS)), bool),
                      cand_item=np.ones(2, np.int64), cand_author=np.ones(2, np.int64),
                      request_id=None, version=0, reply=answers.append)
    return request, answers


def ra(code: str):
    from rankattn import errors

    return errors.fail(code, f"a stand-in {code}")


def test_a_field_sent_twice_and_a_user_header_padded_with_non_http_space_are_400():
    """Regressions (review of the server): {"user": 7, "user": 8} was served as user 8 (the
    last key), and an X-User-Id of b"\\xa07" or b"7\\x85" passed as user 7 (str.strip() took
    those bytes; HAProxy hashes them), routing the user's request to another replica."""
    from examples.ranker.server import schema

    limits = schema.Limits(contexts=4, max_history=8, max_candidates=8, max_body=4096,
                           deadline_ms=1000)
    with pytest.raises(schema.BadRequest) as refused:
        schema.decoded(b'{"user": 7, "history_items": [], "user": 8}', limits)
    assert refused.value.field == "user" and "twice" in refused.value.message
    request = SimpleNamespace(user=7)
    for header in (b"\xa07", b"7\x85", b"07", b"8"):
        with pytest.raises(schema.BadRequest) as refused:
            schema.check_user_header(header, request)
        assert refused.value.field == "X-User-Id", header
    for header in (b"7", b" 7\t", None):
        schema.check_user_header(header, request)


def test_counts_nesting_and_flags_past_what_python_takes_are_refused(capsys, monkeypatch):
    """Regressions (review of the server): a Content-Length or Inference-Header-Content-Length
    of more than 4300 digits made int() raise ValueError, answered 500 internal; JSON nested
    a little less deeply than the parser refuses made the message's json.dumps raise
    RecursionError, answered 500; --max-wait-ms nan started a batcher that spun without ever
    forming a batch (readiness 200, every request 504) and inf one whose wait raised."""
    from examples.ranker.__main__ import main
    from examples.ranker.server import schema

    assert schema.byte_count(b"0" * 5000 + b"11") == 11
    assert schema.byte_count(b"9" * 5000) == 10**18  # past every limit: 413 / 400
    assert schema.byte_count(b"1e3") is None and schema.byte_count(None) is None
    def too_deep(*args, **kwargs):  # how deep json.dumps goes depends on the Python version
        raise RecursionError("maximum recursion depth exceeded")

    monkeypatch.setattr(schema.json, "dumps", too_deep)
    assert "nested too deeply" in schema._show([[[7]]])
    monkeypatch.undo()
    for value in ("nan", "inf", "-1", "1e13"):  # 1e13 ms: past threading.TIMEOUT_MAX
        with pytest.raises(SystemExit) as exit_:
            main(["server", "--out", "unused", "--port", "1", "--max-wait-ms", value])
        assert exit_.value.code == 2
        assert "--max-wait-ms must be a number of milliseconds >= 0" in (
            capsys.readouterr().err)


def test_a_release_that_fails_still_frees_its_keys_in_the_queue():
    """Regression (review of issue 36): when a job's release raised (RA224, a failed drop),
    its keys stayed held in the queue, so their requests (the retry the 503 asks for
    included) waited there until their deadlines, and stop() never returned."""
    from examples.ranker.server.engine import Engine, RequestQueue, _Job

    queue = RequestQueue(4)
    request, _ = stand_in_request(1)
    queue.hold([request.key])

    def release(lease):
        raise ra("RA224")

    engine = SimpleNamespace(options=SimpleNamespace(cache=True), queue=queue,
                             store=SimpleNamespace(release=release),
                             _live=lambda requests, stage: [])  # nobody left: no pass
    with pytest.raises(Exception, match="RA224"):
        Engine._compute(engine, _Job(None, [[request]], [0], 0.0, None))
    assert not queue._held, queue._held


def test_a_split_batch_answers_only_the_half_that_failed():
    """Regression (review of issue 36): a batch split on RA222 whose second half failed was
    answered whole by the front stage's guard, the first half's misses (the history stage's
    by then) included."""
    from examples.ranker.server.engine import Engine, _guard

    (first, first_answers), (second, second_answers) = stand_in_request(1), stand_in_request(2)
    acquires, handed = [], []

    def acquire(users, versions, lengths, timeout):
        acquires.append(list(users))
        if len(users) == 2:
            raise ra("RA222")  # at once: no room for both
        if users == [2]:
            raise ra("RA224")
        return SimpleNamespace(source=["miss"], slots=np.zeros(1, np.int32))

    engine = SimpleNamespace(
        options=SimpleNamespace(acquire_timeout=1.0),
        store=SimpleNamespace(acquire=acquire, release=lambda lease: None),
        store_keys=lambda keys, model, batch: tuple(map(list, zip(*keys))),
        _hand_off=lambda lease, groups, misses, model: handed.append(groups) or True)
    engine._place = lambda *args: Engine._place(engine, *args)
    _guard([first, second], engine._place, [[first], [second]], 0, None)
    assert acquires == [[1, 2], [1], [2]] and handed == [[[first]]]
    assert first_answers == [] and not first.answered  # the history stage's to answer
    assert [a.kind for a in second_answers] == ["store_failed"]


def test_health_is_broken_when_a_stage_is_stuck_and_submit_after_stop_says_draining():
    """Review of issue 36: a stage busy for good (a hung device) left /readyz at 200, and a
    request that raced stop() was refused queue_full instead of draining."""
    from examples.ranker.server import engine as engine_module
    from examples.ranker.server.engine import Engine

    stuck = SimpleNamespace(_threads=[], _stopped=False, state="serving", _busy_since={
        "front": None, "history": time.perf_counter() - engine_module.STUCK_SECONDS - 1})
    state, reason = Engine.health(stuck)
    assert state == "broken" and "history stage has been busy" in reason
    stuck._busy_since["history"] = time.perf_counter()
    assert Engine.health(stuck)[0] == "serving"

    request, _ = stand_in_request(1)
    request.deadline = time.perf_counter() + 60
    stopping = SimpleNamespace(state="serving", health=lambda: ("serving", "ready"),
                               front_wait=lambda ahead: 0.0,
                               queue=engine_module.RequestQueue(4))

    def put(r):  # the queue was closed by stop() after the health check
        stopping.state = "draining"
        return False

    stopping.queue.put = put
    assert Engine.submit(stopping, request).kind == "draining"


def test_the_eviction_policy_flag_reaches_the_store(model):
    """--eviction-policy takes the names of rankattn.serving.EVICTION_POLICIES (others are a
    usage error naming them) and Options.eviction_policy builds the engine's store with it."""
    import argparse

    from examples.ranker import server
    from examples.ranker.server.engine import Engine, Model, Options

    parser = argparse.ArgumentParser()
    server.add_arguments(parser)
    required = ["--out", "run", "--port", "1"]
    assert parser.parse_args(required).eviction_policy == "lru"
    assert parser.parse_args(required + ["--eviction-policy", "s3fifo"]).eviction_policy \
        == "s3fifo"
    with pytest.raises(SystemExit):
        parser.parse_args(required + ["--eviction-policy", "lfu"])
    engine = Engine(PRESET, Model(STEP, *model),
                    Options(max_history=MAX_HISTORY, max_candidates=MAX_CANDIDATES,
                            device_pages=8, eviction_policy="s3fifo"))
    assert engine.store.policy == "s3fifo"


def test_a_process_whose_parent_is_killed_gets_sigterm():
    """exit_with_parent (--parent-pid, which LocalServer and the cluster command pass): a
    process whose parent is killed outright (SIGKILL: no clean-up of its own runs) is sent
    SIGTERM, here within a second, instead of running on with nobody to stop it."""
    import subprocess
    import sys

    child = ("import os, time\n"
             "from examples.ranker.server import exit_with_parent\n"
             "exit_with_parent(os.getppid(), every=0.05)\n"
             "print(os.getpid(), flush=True)\n"
             "time.sleep(60)\n")
    parent = subprocess.Popen(["bash", "-c", f'"{sys.executable}" -c "$0" & wait', child],
                              cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        pid = int(parent.stdout.readline())  # the child watches its parent (bash) now
    finally:
        parent.kill()
        parent.wait()

    def running() -> bool:
        try:
            with open(f"/proc/{pid}/status") as status:
                return "\nState:\tZ" not in status.read()  # a zombie has exited
        except FileNotFoundError:
            return False

    deadline = time.monotonic() + 3  # 3x its quiet time (1 s: the poll, exit, import done)
    while running():
        assert time.monotonic() < deadline, f"process {pid} outlived its killed parent"
        time.sleep(0.05)
