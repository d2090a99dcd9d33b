"""The Open Inference Protocol (KServe v2, as Triton's and KServe's clients speak it) beside
POST /v1/rank: the same model, checks, engine and statuses.

The app hands every path under /v2 to :func:`route`:

* ``GET /v2``: the server's metadata;
* ``GET /v2/health/live`` and ``GET /v2/health/ready``: as ``/livez`` and ``/readyz``
  (:func:`live`, :func:`ready`): 200 or 503, from ``Engine.health``;
* ``GET /v2/models/ranker[/versions/STEP]``: the model's metadata (:data:`INPUTS`,
  :data:`OUTPUTS`; -1 marks a variable dimension); STEP is the checkpoint step served;
* ``GET /v2/models/ranker[/versions/STEP]/ready``;
* ``POST /v2/models/ranker[/versions/STEP]/infer``: one user per request. App._rank serves it
  as it serves /v1/rank, with an :class:`Infer` to read the request and write the answer.

Infer reads the inputs into the fields a /v1/rank body holds and checks them with
``schema.checked``: every 400 of /v1/rank, with its kind and message. Errors are the
protocol's ``{"error": "KIND: message fix"}``, with the status /v1/rank would answer. A
request's deadline is the ``X-Request-Deadline-Ms`` header, as for /v1/rank, or Triton's
``timeout`` parameter (microseconds; /v1/rank's ``deadline_ms``), and the server's default.

Tensor data: ``data`` flat (row-major) or nested, or binary (Triton's binary tensor data
extension, what tritonclient sends by default: the JSON's length in the
``Inference-Header-Content-Length`` header, each input's ``binary_data_size`` bytes after it,
little-endian). Outputs are always JSON: a request for binary outputs is accepted and answered
in JSON, which Triton's clients read alike.
"""

from __future__ import annotations

import dataclasses
import math
import re

import numpy as np

import rankattn
from examples.ranker.config import ACTIONS
from examples.ranker.server.schema import (REQUEST_ID_CHARS, Answer, BadRequest, Limits, Request,
                                           _show, byte_count, checked, decoded)

MODEL = "ranker"
SERVER = "rankattn-ranker"


@dataclasses.dataclass(frozen=True)
class Tensor:
    """An input or output: its name, the datatypes it takes (the first is the one metadata
    shows) and its shape (-1: variable)."""

    name: str
    datatypes: tuple[str, ...]
    shape: tuple[int, ...]

    def metadata(self) -> dict:
        return {"name": self.name, "datatype": self.datatypes[0], "shape": list(self.shape)}


# The fields of a /v1/rank body, as tensors; history_version may be left out.
INPUTS = (Tensor("user", ("INT64",), (1,)), Tensor("context", ("INT64",), (1,)),
          Tensor("history_item", ("INT64",), (-1,)), Tensor("history_author", ("INT64",), (-1,)),
          Tensor("history_actions", ("BOOL", "INT64"), (-1, len(ACTIONS))),
          Tensor("cand_item", ("INT64",), (-1,)), Tensor("cand_author", ("INT64",), (-1,)),
          Tensor("history_version", ("INT64",), (1,)))
OUTPUTS = (Tensor("logits", ("FP32",), (-1, len(ACTIONS))), Tensor("scores", ("FP32",), (-1,)))
BINARY = {"INT64": np.dtype("<i8"), "BOOL": np.dtype(np.uint8)}  # BOOL: one byte, 0 or 1
MODEL_PATH = re.compile(r"/v2/models/(?P<model>[^/]+)(?:/versions/(?P<version>[^/]+))?"
                        r"(?P<action>/ready|/infer)?")
EXAMPLE = ('{"id": "1", "inputs": [{"name": "user", "datatype": "INT64", "shape": [1], '
           '"data": [7]}, {"name": "context", "datatype": "INT64", "shape": [1], "data": [0]}, '
           '{"name": "history_item", "datatype": "INT64", "shape": [1], "data": [3]}, '
           '{"name": "history_author", "datatype": "INT64", "shape": [1], "data": [1]}, '
           '{"name": "history_actions", "datatype": "BOOL", "shape": [1, ' + str(len(ACTIONS))
           + '], "data": [' + ", ".join(["false"] * len(ACTIONS)) + ']}, '
           '{"name": "cand_item", "datatype": "INT64", "shape": [2], "data": [4, 5]}, '
           '{"name": "cand_author", "datatype": "INT64", "shape": [2], "data": [1, 1]}]}')


def live(engine) -> bool:
    """Whether the process can serve (/livez's 200): every stage thread alive."""
    return engine.health()[0] != "broken"


def ready(engine) -> bool:
    """Whether the engine takes requests (/readyz's 200): warm, whole, not draining."""
    return engine.health()[0] == "serving"


def route(method: str, path: str, engine) -> Answer | None:
    """The answer to ``method path`` (a path under /v2), or None for an infer request
    (App._rank serves it with an :class:`Infer`)."""
    if path in ("/v2", "/v2/health/live", "/v2/health/ready"):
        if method != "GET":
            return _bad_method(method, path, "GET")
        if path == "/v2":
            return Answer(200, {"name": SERVER, "version": rankattn.__version__,
                                "extensions": []})
        if path == "/v2/health/live":
            return _probe(live(engine), {"live": live(engine)})
        return _probe(ready(engine), {"ready": ready(engine)})
    match = MODEL_PATH.fullmatch(path)
    if match is None:
        return _error(404, "not_found", f"no route {path}.", "Use GET /v2, GET "
                      "/v2/health/live, GET /v2/health/ready, GET /v2/models/ranker, GET "
                      "/v2/models/ranker/ready or POST /v2/models/ranker/infer.")
    model, version, action = match["model"], match["version"], match["action"]
    step = str(engine.model_step)
    if model != MODEL:
        return _error(404, "not_found", f"no model {model!r}.", f"This server serves one "
                      f"model, {MODEL!r}: use /v2/models/{MODEL}.")
    if version is not None and version != step:
        return _error(404, "not_found", f"no version {version!r} of {MODEL!r}.", f"This "
                      f"server serves version {step} (the checkpoint step): use /versions/"
                      f"{step}, or leave /versions/... out.")
    if action == "/infer":
        return None if method == "POST" else _bad_method(method, path, "POST")
    if method != "GET":
        return _bad_method(method, path, "GET")
    if action == "/ready":
        return _probe(ready(engine), {"name": MODEL, "ready": ready(engine)})
    return Answer(200, {"name": MODEL, "versions": [step], "platform": "jax",
                        "inputs": [t.metadata() for t in INPUTS],
                        "outputs": [t.metadata() for t in OUTPUTS]})


class Infer:
    """One infer request, as App._rank serves it: :meth:`parse` reads the body into a
    ``schema.Request``, :meth:`render` writes the engine's answer in this protocol (the
    outputs the request asked for)."""

    def __init__(self, headers):
        """``headers``: the request's (name, value) byte pairs, as ASGI gives them."""
        self.header_length = dict(headers).get(b"inference-header-content-length")
        self.outputs = [t.name for t in OUTPUTS]

    def parse(self, body: bytes, limits: Limits) -> Request:
        """The request, checked as /v1/rank checks its body; raises :class:`BadRequest`."""
        header, binary = self._split(body)
        try:
            data = decoded(header, limits)
        except BadRequest as err:
            if err.kind != "bad_json":
                raise
            raise BadRequest(err.kind, err.field, err.message, "Send one inference request "
                             "object (JSON, UTF-8), e.g. " + EXAMPLE) from None
        _only(data, "the request", ("id", "parameters", "inputs", "outputs"))
        request_id = data.get("id")
        if request_id is not None and not (isinstance(request_id, str)
                                           and len(request_id) <= REQUEST_ID_CHARS):
            raise BadRequest("bad_value", "id", f"id is {_show(request_id)}.", f"Send a "
                             f"string of at most {REQUEST_ID_CHARS} characters, or leave it "
                             "out.")
        # binary_data_output (tritonclient sends it): answered in JSON all the same.
        parameters = _only(_object(data.get("parameters", {}), "parameters"), "parameters",
                           ("binary_data_output", "timeout"))
        if "outputs" in data:
            self.outputs = _requested(data["outputs"])
        inputs = data.get("inputs")
        if not isinstance(inputs, list):
            raise BadRequest("missing_field" if inputs is None else "bad_value", "inputs",
                             f"inputs is {_show(inputs)}, not a list.", "Send inputs as a "
                             "list of {name, datatype, shape, data} objects, e.g. " + EXAMPLE)
        fields, offset = {}, 0
        for spec in inputs:
            name, value, offset = _input(spec, binary, offset)
            if name in fields:
                raise BadRequest("bad_value", name, f"the request has two inputs {name!r}.",
                                 "Send each input once.")
            fields[name] = value
        if "timeout" in parameters:
            fields["deadline_ms"] = _timeout(parameters["timeout"]) / 1e3
        if offset != len(binary):
            raise BadRequest("bad_value", "binary_data_size", f"the body has {len(binary)} "
                             f"bytes after its JSON; the inputs' binary_data_size take "
                             f"{offset}.", "Send each binary input's bytes, in the order of "
                             "inputs, and nothing else after the JSON.")
        request = checked(fields, limits)
        request.request_id = request_id
        return request

    def render(self, answer: Answer) -> Answer:
        """``answer`` (a /v1/rank answer) in this protocol: the outputs asked for and the
        parameters cache, model_step and actions (the order of the logits' columns); an
        error as {"error": "..."}; status and headers unchanged."""
        body = answer.body
        if answer.status != 200:
            error = body["error"]
            return dataclasses.replace(answer, body={"error": _text(error["kind"],
                                                                    error["message"],
                                                                    error["fix"])})
        values = {"logits": np.asarray(body["logits"], np.float32),
                  "scores": np.asarray(body["scores"], np.float32)}
        out = {"model_name": MODEL, "model_version": str(body["model_step"])}
        if body["request_id"] is not None:
            out["id"] = body["request_id"]
        out["parameters"] = {"cache": body["cache"], "model_step": body["model_step"],
                             "actions": ",".join(body["actions"])}
        out["outputs"] = [{"name": name, "datatype": "FP32", "shape": list(values[name].shape),
                           "data": values[name].ravel().tolist()} for name in self.outputs]
        return dataclasses.replace(answer, body=out)

    def _split(self, body: bytes) -> tuple[bytes, bytes]:
        """(the JSON, the binary tensor data after it)."""
        if self.header_length is None:
            return body, b""
        length = byte_count(self.header_length)
        if length is None or length > len(body):
            raise BadRequest("bad_value", "Inference-Header-Content-Length", "the header "
                             f"Inference-Header-Content-Length is {_show(self.header_length)} "
                             f"for a body of {len(body)} bytes.", "Send the length in bytes of "
                             "the body's JSON, or no such header when the body is all JSON.")
        return body[:length], body[length:]


def _input(spec, binary: bytes, offset: int) -> tuple[str, object, int]:
    """(name, value as a /v1/rank body holds it, the binary offset after it) of one input."""
    if not (isinstance(spec, dict) and isinstance(spec.get("name"), str)):
        raise BadRequest("bad_value", "inputs", f"inputs holds {_show(spec)}.", "Send each "
                         "input as an object with name, datatype, shape and data.")
    name = spec["name"]
    tensor = next((t for t in INPUTS if t.name == name), None)
    if tensor is None:
        raise BadRequest("bad_value", name, f"unknown input {name!r}.", "Send only the inputs "
                         "GET /v2/models/ranker lists: " + ", ".join(t.name for t in INPUTS)
                         + ".")
    _only(spec, f"input {name}", ("name", "datatype", "shape", "parameters", "data"))
    datatype, shape = spec.get("datatype"), spec.get("shape")
    if datatype not in tensor.datatypes:
        raise BadRequest("bad_value", name, f"input {name} has datatype {_show(datatype)}.",
                         f"Send {name} as {' or '.join(tensor.datatypes)}.")
    declared = "[" + ", ".join("-1 (any)" if d < 0 else str(d) for d in tensor.shape) + "]"
    if not (isinstance(shape, list) and len(shape) == len(tensor.shape)
            and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)
            and all(d == want for d, want in zip(shape, tensor.shape) if want >= 0)):
        raise BadRequest("bad_value", name, f"input {name} has shape {_show(shape)}.",
                         f"Send {name} with shape {declared}.")
    size = math.prod(shape)
    parameters = _only(_object(spec.get("parameters", {}), f"input {name}'s parameters"),
                       f"input {name}'s parameters", ("binary_data_size",))
    if "binary_data_size" in parameters:
        dtype, length = BINARY[datatype], parameters["binary_data_size"]
        if ("data" in spec or not isinstance(length, int) or isinstance(length, bool)
                or length != size * dtype.itemsize or offset + length > len(binary)):
            raise BadRequest("bad_value", name, f"input {name} has binary_data_size "
                             f"{_show(length)}{' and data' if 'data' in spec else ''}; the "
                             f"body has {len(binary) - offset} binary bytes left.", f"Send "
                             f"shape {shape} of {datatype} as {size * dtype.itemsize} bytes "
                             "after the JSON (or as data, without binary_data_size).")
        flat = np.frombuffer(binary, dtype, size, offset).tolist()
        offset += length
    elif "data" in spec:
        flat = _flat(name, spec["data"], shape)
    else:
        raise BadRequest("missing_field", name, f"input {name} has no data.", f"Send {name}'s "
                         "values as data (a list), or as binary data.")
    if len(flat) != size:
        raise BadRequest("bad_value", name, f"input {name} has {len(flat)} values for shape "
                         f"{shape}.", f"Send {size} values, row-major, or shape the input "
                         "as its values.")
    if tensor.shape == (1,):
        return name, flat[0], offset
    if len(shape) == 2:
        return name, [flat[i * shape[1]:(i + 1) * shape[1]] for i in range(shape[0])], offset
    return name, flat, offset


def _flat(name: str, data, shape: list[int]) -> list:
    """An input's ``data``, flat (row-major) or nested by rows, as a flat list."""
    if not isinstance(data, list):
        raise BadRequest("bad_value", name, f"input {name}'s data is {_show(data)}, not a "
                         "list.", "Send data as a list, flat (row-major) or nested.")
    if len(shape) == 2 and any(isinstance(row, list) for row in data):
        if not all(isinstance(row, list) and len(row) == shape[1] for row in data):
            raise BadRequest("bad_value", name, f"input {name}'s data is nested, not as "
                             f"{shape[0]} lists of {shape[1]} (its shape {shape}).",
                             "Send data flat (row-major) or as one list per row.")
        return [v for row in data for v in row]
    return data


def _requested(outputs) -> list[str]:
    """The names of the outputs asked for, checked."""
    names = [t.name for t in OUTPUTS]
    if not isinstance(outputs, list):
        raise BadRequest("bad_value", "outputs", f"outputs is {_show(outputs)}, not a list.",
                         f"Send outputs as a list of {{name}} objects ({', '.join(names)}), "
                         "or leave it out for all.")
    for output in outputs:
        if not (isinstance(output, dict) and output.get("name") in names):
            raise BadRequest("bad_value", "outputs", f"outputs holds {_show(output)}.",
                             f"Ask for outputs by name: {', '.join(names)}.")
        _only(output, f"output {output['name']}", ("name", "parameters"))
        # binary_data (tritonclient's default): answered in JSON all the same.
        _only(_object(output.get("parameters", {}), f"output {output['name']}'s parameters"),
              f"output {output['name']}'s parameters", ("binary_data",))
    return [name for name in names if any(o["name"] == name for o in outputs)]


def _timeout(timeout) -> int:
    """Triton's ``timeout`` parameter (microseconds), checked; past 2**53 it is 2**53 (the
    server's own deadline is shorter, and a larger int would overflow a float)."""
    if isinstance(timeout, int) and not isinstance(timeout, bool) and timeout > 0:
        return min(timeout, 2**53)
    raise BadRequest("bad_value", "timeout", f"parameters.timeout is {_show(timeout)}.",
                     "Send the microseconds the server may take as a positive integer, or "
                     "leave it out (the server's --deadline-ms).")


def _probe(ok: bool, body: dict) -> Answer:
    return Answer(200 if ok else 503, body)


def _object(x, where: str) -> dict:
    if not isinstance(x, dict):
        raise BadRequest("bad_value", where, f"{where} is {_show(x)}, not an object.",
                         f"Send {where} as a JSON object, or leave it out.")
    return x


def _only(x: dict, where: str, allowed: tuple[str, ...]) -> dict:
    """``x``, refused if it holds a key not in ``allowed``."""
    for key in x:
        if key not in allowed:
            raise BadRequest("bad_value", key, f"{where} has an unknown field {key!r}.",
                             f"Send only {', '.join(allowed)} in {where}.")
    return x


def _error(status: int, kind: str, message: str, fix: str, headers: tuple = ()) -> Answer:
    return Answer(status, {"error": _text(kind, message, fix)}, headers, kind=kind)


def _text(kind: str, message: str, fix: str) -> str:
    """An error as the protocol's one string."""
    return f"{kind}: {message} {fix}"


def _bad_method(method: str, path: str, allowed: str) -> Answer:
    return _error(405, "bad_method", f"{path} takes {allowed}, not {method}.",
                  f"Send {allowed} {path}.", ((b"allow", allowed.encode()),))
