"""A ranking request: its JSON, the checks that turn a bad one into a 400, and the answer.

POST /v1/rank takes one JSON object::

    {"user": int, "context": int, "history_version": int (optional),
     "history_item": [int], "history_author": [int], "history_actions": [[0/1 per action]],
     "cand_item": [int], "cand_author": [int], "request_id": str (optional),
     "deadline_ms": number (optional)}

A request that breaks a rule gets HTTP 400 (413 for a body over the limit) and
``{"error": {"kind", "field", "message", "fix"}}``, kind one of :data:`KINDS`. The store
key's version is the server's own digest of the context and the history arrays
(:func:`serve.history_digest`); ``history_version`` is hashed into it as a hint (a new hint
forces a recomputation) and never trusted alone.

A request's deadline (:func:`deadline`) is the nearest of the ``X-Request-Deadline-Ms``
header, the ``deadline_ms`` field and the server's ``--deadline-ms`` (the default, and the
longest a request may ask for), counted from its first byte; past it the server answers
504 deadline.

A request may name its user in the ``X-User-Id`` header too, as a client of a proxy that
routes by it does (examples/ranker/cluster.py: consistent hashing on that header): the
header must then equal the body's ``user`` (:func:`check_user_header`), or the request is
refused 400 naming both, since a mismatch would put the user's history on the wrong
replica.
"""

from __future__ import annotations

import dataclasses
import json
import threading
import time
from typing import Callable

import numpy as np

from examples.ranker import serve
from examples.ranker.config import ACTIONS, SCORE_WEIGHTS

KINDS = ("bad_json", "missing_field", "bad_value", "too_large")
ID_LIMIT = 2**31          # user, item and author ids are in [1, ID_LIMIT)
VERSION_LIMIT = 2**63     # history_version is in [0, VERSION_LIMIT)
REQUEST_ID_CHARS = 200
REQUIRED = ("user", "context", "history_item", "history_author", "history_actions",
            "cand_item", "cand_author")
OPTIONAL = ("history_version", "request_id", "deadline_ms")
DEADLINE_HEADER = "X-Request-Deadline-Ms"
USER_HEADER = "X-User-Id"
WEIGHTS = np.array([SCORE_WEIGHTS[a] for a in ACTIONS])
_ANSWERING = threading.Lock()  # Request.answer's check and set, one request at a time


class BadRequest(Exception):
    """A request the server refuses with HTTP ``status`` (400, or 413 for a body over the
    limit): what was wrong and what to send instead."""

    def __init__(self, kind: str, field: str, message: str, fix: str, status: int = 400):
        super().__init__(message)
        self.kind, self.field, self.message, self.fix = kind, field, message, fix
        self.status = status

    def body(self) -> dict:
        return {"error": {"kind": self.kind, "field": self.field, "message": self.message,
                          "fix": self.fix}}


@dataclasses.dataclass(frozen=True)
class Limits:
    """What a request may hold: contexts in [0, contexts), at most ``max_history`` events and
    ``max_candidates`` candidates, a body of at most ``max_body`` bytes, a deadline of at
    most ``deadline_ms`` (also the default)."""

    contexts: int
    max_history: int
    max_candidates: int
    max_body: int
    deadline_ms: float = 5000.0

    @staticmethod
    def body_bytes(max_history: int, max_candidates: int) -> int:
        """The default body limit: twice the JSON of the largest valid request (10-digit ids,
        an action list of 0/1 per event), written with spaces."""
        event = 2 * 12 + 3 * len(ACTIONS) + 4  # two ids, the action list
        return 2 * (1024 + event * max_history + 24 * max_candidates)


@dataclasses.dataclass(eq=False)
class Request:
    """One accepted ranking request (host arrays) and how to answer it.

    ``version`` is the server's digest (the store key's version); ``reply`` is set by the
    HTTP layer and called once, from any thread, with an :class:`Answer`; ``timings`` holds
    the seconds each stage took for this request (metrics.STAGES); ``batch_had_misses``
    whether the acquire that placed it also placed misses; ``shapes`` the bucket shapes of
    the programs that computed its answer (the X-Ranker-Shapes header). ``deadline_ms`` is
    the body's field; ``deadline`` the ``time.perf_counter()`` the answer is due by (set by
    the HTTP layer, :func:`deadline`), ``cancelled`` why the HTTP layer stopped waiting
    ("deadline": it answered 504 itself; "disconnected": the client went away), after which
    the engine drops the request.
    """

    user: int
    context: int
    history_item: np.ndarray     # int64 [n]
    history_author: np.ndarray   # int64 [n]
    history_actions: np.ndarray  # bool [n, A]
    cand_item: np.ndarray        # int64 [c]
    cand_author: np.ndarray      # int64 [c]
    request_id: str | None
    version: int
    arrival: float = dataclasses.field(default_factory=time.perf_counter)
    reply: Callable[["Answer"], None] | None = None
    timings: dict = dataclasses.field(default_factory=dict)
    batch_had_misses: bool = False
    shapes: list = dataclasses.field(default_factory=list)
    answered: bool = False
    deadline_ms: float | None = None
    deadline: float = float("inf")
    cancelled: str | None = None

    def answer(self, answer: "Answer") -> None:
        """Reply, once: later calls do nothing (a failed batch answers what it left), from
        whichever thread comes first (the stages and the event loop's deadline may race)."""
        with _ANSWERING:
            if self.answered:
                return
            self.answered = True
        self.reply(answer)

    @property
    def key(self) -> tuple[int, int, int]:
        """The store key: (user, version, length in tokens: the user token and the history)."""
        return self.user, self.version, 1 + len(self.history_item)


@dataclasses.dataclass
class Answer:
    """An HTTP answer: status, JSON body, extra headers; ``cache`` is the history's source
    (200) and ``kind`` the error kind (4xx / 5xx), for the metrics."""

    status: int
    body: dict
    headers: tuple = ()
    cache: str | None = None
    kind: str | None = None


def ranked(request: Request, logits: np.ndarray, cache: str, model_step: int) -> Answer:
    """The 200 answer: logits [c, A] of the request's candidates, their weighted scores."""
    scores = (WEIGHTS / (1.0 + np.exp(-logits.astype(np.float64)))).sum(-1)
    return Answer(200, {"logits": logits.tolist(), "scores": scores.tolist(),
                        "actions": list(ACTIONS), "cache": cache, "model_step": model_step,
                        "request_id": request.request_id},
                  headers=((b"x-ranker-shapes", ", ".join(request.shapes).encode()),),
                  cache=cache)


def error(status: int, kind: str, field: str | None, message: str, fix: str,
          *headers) -> Answer:
    """An error answer: ``{"error": {"kind", "field", "message", "fix"}}``."""
    return Answer(status, {"error": {"kind": kind, "field": field, "message": message,
                                     "fix": fix}}, headers=headers, kind=kind)


def unavailable(kind: str, message: str, fix: str, retry_after: int = 1) -> Answer:
    """A 503 (the server cannot take the request now; retrying later can work)."""
    return error(503, kind, None, message, fix, (b"retry-after", str(retry_after).encode()))


def expired(request: Request) -> Answer:
    """The 504 of a request whose deadline passed before its answer was computed."""
    return Answer(504, {"error": {
        "kind": "deadline", "field": None, "message": "the request's deadline passed before "
        "the server could answer it.", "fix": f"Send a later deadline ({DEADLINE_HEADER} or "
        "deadline_ms, at most the server's --deadline-ms), or retry on a less loaded "
        "replica."}}, kind="deadline")


def deadline(start: float, header: bytes | None, request: Request | None,
             limits: Limits) -> float:
    """The ``time.perf_counter()`` a request that arrived at ``start`` is due by: the nearest
    of its ``X-Request-Deadline-Ms`` header, its ``deadline_ms`` field (None: before its body
    is read) and the server's ``limits.deadline_ms``; raises :class:`BadRequest` for a header
    that is not a positive number of milliseconds."""
    budgets = [limits.deadline_ms]
    if request is not None and request.deadline_ms is not None:
        budgets.append(request.deadline_ms)
    if header is not None:
        try:
            budgets.append(float(header.decode("latin-1")))
        except ValueError:
            budgets.append(float("nan"))
        if not 0 < budgets[-1] < float("inf"):
            raise BadRequest("bad_value", DEADLINE_HEADER, f"the {DEADLINE_HEADER} header is "
                             f"{header.decode('latin-1')[:60]!r}.", "Send the milliseconds the "
                             "server may take as a positive number, e.g. 250.")
    return start + min(budgets) / 1e3


def check_user_header(header: bytes | None, request: Request) -> None:
    """Raises :class:`BadRequest` when the ``X-User-Id`` header is present and is not the
    body's ``user``: a proxy routes by the header and the store keys by the body, so the two
    must name one user."""
    if header is None:
        return
    text = header.decode("latin-1")
    # Bytes, stripped of HTTP's whitespace only: str.strip() also took \xa0 or \x85, so a
    # header HAProxy hashed as another user's passed.
    if header.strip(b" \t") != str(request.user).encode():
        raise BadRequest("bad_value", USER_HEADER, f"the {USER_HEADER} header is "
                         f"{text[:60]!r} and the body's user is {request.user}.",
                         f"Send the body's user in {USER_HEADER} (the proxy routes by it), "
                         "or leave the header out.")


def parse(body: bytes, limits: Limits) -> Request:
    """The request in ``body``, checked; raises :class:`BadRequest` naming the first problem."""
    return checked(decoded(body, limits), limits)


def decoded(body: bytes, limits: Limits) -> dict:
    """The JSON object ``body`` holds; raises :class:`BadRequest` (too_large, bad_json)."""
    if len(body) > limits.max_body:
        raise too_large_body(limits)
    try:
        data = json.loads(body, object_pairs_hook=fields_once)
    except (ValueError, UnicodeDecodeError) as err:
        raise BadRequest("bad_json", "body", f"the body is not valid JSON: {err}.",
                         "Send one JSON object in UTF-8, e.g. " + EXAMPLE) from None
    except RecursionError:
        raise BadRequest("bad_json", "body", "the body nests arrays or objects deeper than "
                         "the server parses.", "Send one JSON object whose values nest at "
                         "most two levels (history_actions), e.g. " + EXAMPLE) from None
    if not isinstance(data, dict):
        raise BadRequest("bad_json", "body", f"the body is a JSON {type(data).__name__}, not "
                         "an object.", "Send one JSON object, e.g. " + EXAMPLE)
    return data


def fields_once(pairs: list[tuple[str, object]]) -> dict:
    """A JSON object's fields; one sent twice is refused: json.loads kept the last, where a
    proxy or a log reading the first would see another user (kserve.py refuses an input
    sent twice too)."""
    data = {}
    for name, value in pairs:
        if name in data:
            raise BadRequest("bad_value", name, f"the body has {name!r} twice.",
                             "Send each field once.")
        data[name] = value
    return data


def checked(data: dict, limits: Limits) -> Request:
    """The request whose fields ``data`` holds (a decoded body, or what kserve.py reads from
    an Open Inference request's inputs), checked; raises :class:`BadRequest` naming the first
    problem."""
    for name in data:
        if name not in REQUIRED + OPTIONAL:
            raise BadRequest("bad_value", name, f"unknown field {name!r}.",
                             "Send only " + ", ".join(REQUIRED + OPTIONAL) + ".")
    for name in REQUIRED:
        if name not in data:
            raise BadRequest("missing_field", name, f"the request has no {name!r}.",
                             f"Add {name!r}; every request needs " + ", ".join(REQUIRED) + ".")
    user = _integer(data, "user", 1, ID_LIMIT)
    context = _integer(data, "context", 0, limits.contexts)
    hint = _integer(data, "history_version", 0, VERSION_LIMIT) if "history_version" in data \
        else None
    request_id = data.get("request_id")
    if request_id is not None and not (isinstance(request_id, str)
                                       and len(request_id) <= REQUEST_ID_CHARS):
        raise BadRequest("bad_value", "request_id", f"request_id is {_show(request_id)}.",
                         f"Send a string of at most {REQUEST_ID_CHARS} characters, or leave "
                         "it out.")
    items = _ids(data, "history_item", limits.max_history, "--max-history", empty_ok=True)
    authors = _ids(data, "history_author", limits.max_history, "--max-history", empty_ok=True)
    _same_length("history_author", authors, "history_item", items)
    actions = _actions(data, len(items))
    cand_item = _ids(data, "cand_item", limits.max_candidates, "--max-candidates")
    cand_author = _ids(data, "cand_author", limits.max_candidates, "--max-candidates")
    _same_length("cand_author", cand_author, "cand_item", cand_item)
    deadline_ms = data.get("deadline_ms")
    if deadline_ms is not None and not (isinstance(deadline_ms, (int, float))
                                        and not isinstance(deadline_ms, bool)
                                        and 0 < deadline_ms < float("inf")):
        raise BadRequest("bad_value", "deadline_ms", f"deadline_ms is {_show(deadline_ms)}.",
                         "Send the milliseconds the server may take as a positive number, "
                         "or leave it out (the server's --deadline-ms).")
    version = serve.history_digest(context, items, authors, actions, hint)
    return Request(user, context, items, authors, actions, cand_item, cand_author, request_id,
                   version, deadline_ms=deadline_ms)


def late_body(budget_ms: float) -> BadRequest:
    """The 408 of a body that did not arrive within the request's deadline."""
    return BadRequest("body_timeout", "body", f"the body did not arrive within the request's "
                      f"deadline ({budget_ms:g} ms from its first byte).",
                      "Send the whole body at once, or a longer X-Request-Deadline-Ms (up to "
                      "the server's --deadline-ms).", status=408)


def too_large_body(limits: Limits) -> BadRequest:
    """The 413 of a body over ``limits.max_body``."""
    return BadRequest("too_large", "body", f"the body is longer than {limits.max_body} bytes.",
                      f"Send at most {limits.max_history} history events and "
                      f"{limits.max_candidates} candidates (the server's --max-history and "
                      "--max-candidates).", status=413)


EXAMPLE = ('{"user": 7, "context": 0, "history_item": [3, 9], "history_author": [1, 2], '
           '"history_actions": [' + ", ".join([str([0] * len(ACTIONS))] * 2) + '], '
           '"cand_item": [4, 5], "cand_author": [1, 1]}')


def _show(x) -> str:
    """x as an error message shows it: its JSON (bytes: their repr), cut to 60 characters."""
    try:
        text = repr(x) if isinstance(x, bytes) else json.dumps(x)
    except RecursionError:  # nested a little less deeply than json.loads refuses
        text = "[[[[... (nested too deeply to show)"
    return text if len(text) <= 60 else text[:57] + "..."


def byte_count(header: bytes | None) -> int | None:
    """The count a Content-Length style header holds (decimal digits, leading zeros allowed),
    or None when it holds something else. A count of more than 18 digits comes back as
    10**18, past every limit: Python refuses int() of more than 4300 digits."""
    if header is None or not header.isdigit():
        return None
    digits = header.lstrip(b"0")
    return int(digits or b"0") if len(digits) <= 18 else 10**18


def _integer(data: dict, name: str, low: int, high: int) -> int:
    x = data[name]
    if not isinstance(x, int) or isinstance(x, bool) or not low <= x < high:
        raise BadRequest("bad_value", name, f"{name} is {_show(x)}.",
                         f"Send {name} as an integer in [{low}, {high - 1}].")
    return x


def _ids(data: dict, name: str, limit: int, flag: str, empty_ok: bool = False) -> np.ndarray:
    """A list of ids in [1, ID_LIMIT), at most ``limit`` long, as int64."""
    x = data[name]
    if not isinstance(x, list):
        raise BadRequest("bad_value", name, f"{name} is {_show(x)}, not a list.",
                         f"Send {name} as a list of integers in [1, {ID_LIMIT - 1}].")
    if len(x) > limit:
        raise BadRequest("too_large", name, f"{name} has {len(x)} entries; this server takes "
                         f"at most {limit} ({flag}).",
                         f"Send at most {limit} (the newest), or start the server with a "
                         f"larger {flag}.")
    if not x and not empty_ok:
        raise BadRequest("bad_value", name, f"{name} is empty.",
                         "Send at least one candidate.")
    for i in x:
        if not isinstance(i, int) or isinstance(i, bool) or not 1 <= i < ID_LIMIT:
            raise BadRequest("bad_value", name, f"{name} holds {_show(i)}.",
                             f"Send ids as integers in [1, {ID_LIMIT - 1}] (0 is padding).")
    return np.array(x, np.int64)


def _same_length(name: str, x: np.ndarray, other: str, y: np.ndarray) -> None:
    if len(x) != len(y):
        raise BadRequest("bad_value", name, f"{name} has {len(x)} entries and {other} "
                         f"{len(y)}.", f"Send one {name} per {other} entry.")


def _actions(data: dict, events: int) -> np.ndarray:
    """history_actions: one list of len(ACTIONS) 0/1 per history event, as bool [n, A]."""
    x, a = data["history_actions"], len(ACTIONS)
    fix = (f"Send one list of {a} zeros and ones per history event, in the order "
           f"{list(ACTIONS)}.")
    if not isinstance(x, list) or len(x) != events:
        raise BadRequest("bad_value", "history_actions", f"history_actions is "
                         f"{_show(x) if not isinstance(x, list) else f'{len(x)} lists'} for "
                         f"{events} history events.", fix)
    for event in x:
        if not (isinstance(event, list) and len(event) == a
                and all(v in (0, 1) and not isinstance(v, float) for v in event)):
            raise BadRequest("bad_value", "history_actions",
                             f"history_actions holds {_show(event)}.", fix)
    return np.array(x, dtype=bool).reshape(events, a)
