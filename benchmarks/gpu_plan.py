"""The cost model and the budget of a GPU run (benchmarks/gpu.py).

A GPU machine is lent for minutes at a time, start-up included, and one command may run at
most 10 of them; so a run plans its phases to fit one command (``COMMAND_S``, 9 minutes)
and, when a phase would not fit what is left, skips it and says so. Every estimate comes
from stated costs, never from a guess per phase:

- compiling a pallas_triton program (forward + backward): the deviceless compile seconds
  of ``results/gpu_candidates.json`` (``gpu_compile.py --candidates``, a CPU-only machine
  with jax 0.10.2) times ``COMPILE_FACTOR`` for another host and jax version; any other
  XLA program (the reference, the xla backend, jax.nn's attention) ``XLA_COMPILE_S``;
  torch's FlexAttention ``FLEX_COMPILE_S`` per workload (torch.compile), SDPA
  ``TORCH_SETUP_S``;
- running a call: its flops at a stated share of the bf16 peak of an H100 / H200
  (``KERNEL_SHARE`` of ``PEAK_FLOPS`` on the visible pairs for rankattn and FlexAttention,
  ``DENSE_SHARE`` on all S^2 pairs for the dense-mask peers), at least ``CALL_FLOOR_S``,
  times the calls the phase makes.

The dry run prints each phase's estimate and their sum; a run checks each phase's
estimate against the budget before starting it and reports the estimate beside the
measured time (:class:`Phases`), so the first GPU run calibrates this model.
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import time

import gpu_compile
from rankattn import peers
from rankattn.backends.gpu_config import padded_head_dim

COMMAND_S = 540.0        # the run's default budget: 9 of the 10 minutes one command may take
STARTUP_S = 40.0         # interpreter, JAX, CUDA and torch initialisation (stated)
# Deviceless compile seconds in results/*.json -> on the GPU host with jax 0.11: stated as 2.0
# against the report of commit 67bebf9; the report regenerated since (issue 38) came from a
# 2-core AMD EPYC Zen 3 that compiled the same 17 sm_90 configurations in 42 s against 25 s
# (1.58 s against 2.54 s for the default alone, run quiet), so 2.0 x 0.6.
COMPILE_FACTOR = 1.2
XLA_COMPILE_S = 2.0      # one XLA program that is no pallas_triton kernel
FLEX_COMPILE_S = 25.0    # torch.compile of FlexAttention with a block mask: forward (x2 with
                         # its backward), per workload
TORCH_SETUP_S = 2.0      # torch SDPA: inputs, the dense mask, the first call
UNKNOWN_COMPILE_S = 10.0  # a pallas_triton program the deviceless report does not list
PEAK_FLOPS = 989e12      # dense bf16 tensor-core peak of an H100 / H200 SXM (data sheet)
KERNEL_SHARE = 0.2       # of PEAK_FLOPS, on visible pairs: rankattn's kernels, FlexAttention
DENSE_SHARE = 0.3        # of PEAK_FLOPS, on all pairs: the dense-mask peers
CALL_FLOOR_S = 2e-4      # launch and dispatch of one call, however small
PARALLEL_COMPILES = 4    # the tune phase's compile threads (XLA's compile drops the GIL)
PTXAS_CHILD_S = 15.0     # starting the child that compiles for ptxas' report
MATMUL_S = 5.0           # the bf16 matmul rate: an 8192^3 compile and its timed calls
SAMPLE_S = 0.02          # a tune sample: back-to-back calls lasting at least this long


def compile_report() -> dict | None:
    """results/gpu_candidates.json (the deviceless compile of the candidates), if present."""
    return _json(gpu_compile.CANDIDATES_JSON)


def _json(path: str) -> dict | None:
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        return None


class Costs:
    """Estimated seconds of the run's steps, from the deviceless compile reports: the tune
    candidates' (``compile_report``) and the built-in configurations' for sm_90
    (results/gpu_compile.json, ``gpu_compile.py``)."""

    def __init__(self, candidates: dict | None,
                 builtin: dict | None = _json(os.path.join(gpu_compile.HERE, "results",
                                                           "gpu_compile.json"))):
        self.candidates = {}  # (dtype, head dim, options JSON) -> deviceless seconds
        for r in (candidates or {}).get("candidates", []):
            if r["error"] is None:
                key = (r["config"]["dtype"], r["config"]["head_dim"], json.dumps(r["options"]))
                self.candidates[key] = r["seconds"]
        # The median compile of each kind: the configurations of one dtype and head dim vary a
        # feature each (a cap, causal, the heads), and on a 2-core machine the slowest of them
        # moves by a second between reports (mosaic_gpu's: 8.9 s, then 9.8 s, for the same
        # kernels), the median by a tenth.
        samples = {}  # (mosaic_gpu?, (dtype, padded head dim[, precision])) -> seconds
        for r in (builtin or {}).get("results", {}).get("sm_90", []):
            c = r["config"]
            if r["error"] is None and r.get("seconds") is not None:
                mosaic = c.get("impl") == "mosaic_gpu"
                key = (c["dtype"], padded_head_dim(c["head_dim"])) + ((c["precision"],)
                                                                     if not mosaic else ())
                samples.setdefault((mosaic, key), []).append(r["seconds"])
        self.builtin, self.mosaic = ({key: statistics.median(s) for (m, key), s in samples.items()
                                      if m == mosaic} for mosaic in (False, True))

    def pallas_compile(self, dtype: str, head_dim: int, options: dict | None = None,
                       precision: str = "highest") -> float:
        """One pallas_triton forward + backward program on the GPU host, times
        COMPILE_FACTOR: ``options``' deviceless compile (None: the built-in configurations'
        median at ``precision``), else the slowest compile of that dtype and head dim, else of
        that dtype, else UNKNOWN_COMPILE_S. ``head_dim``: padded to a power of two."""
        if options is None:
            known = self.builtin.get((dtype, head_dim, precision))
        else:
            known = self.candidates.get((dtype, head_dim, json.dumps(options)))
        every = {**{(d, h): s for (d, h, _), s in self.candidates.items()},
                 **{(d, h): s for (d, h, _), s in self.builtin.items()}}
        alike = [s for (d, h), s in every.items() if d == dtype and h == head_dim]
        same_dtype = [s for (d, _), s in every.items() if d == dtype]
        return COMPILE_FACTOR * (known or max(alike or same_dtype or [UNKNOWN_COMPILE_S]))

    def mosaic_compile(self, dtype: str, head_dim: int) -> float:
        """One mosaic_gpu forward + backward program, as :meth:`pallas_compile` prices
        pallas_triton's: the median deviceless compile at that dtype and head dim, else the
        slowest such median, else UNKNOWN_COMPILE_S."""
        known = self.mosaic.get((dtype, head_dim)) or max(self.mosaic.values(),
                                                          default=UNKNOWN_COMPILE_S)
        return COMPILE_FACTOR * known

    def compile(self, dtype: str, head_dim: int, options: dict | None = None) -> float:
        """A tune candidate's program (``options``: pallas_triton's, or mosaic_gpu's with
        "backend")."""
        if options is not None and options.get("backend") == "mosaic_gpu":
            return self.mosaic_compile(dtype, head_dim)
        return self.pallas_compile(dtype, head_dim, options)

    @staticmethod
    def call(flops: float, share: float = KERNEL_SHARE) -> float:
        """One call of ``flops`` at ``share`` of the peak."""
        return max(CALL_FLOOR_S, flops / (share * PEAK_FLOPS))

    def correctness(self, programs: list[tuple[str, int, None, str]], others: int,
                    mosaic: list[tuple[str, int]] = ()) -> float:
        """The correctness phase: its pallas_triton programs as (dtype, padded head dim,
        None, precision), built-in configurations, its mosaic_gpu programs as (dtype, padded
        head dim), and ``others`` XLA programs (the xla backend's, the reference's); the
        calls are negligible beside the compiles."""
        return (sum(self.pallas_compile(*p) for p in programs)
                + sum(self.mosaic_compile(*p) for p in mosaic) + others * XLA_COMPILE_S)

    def tune_class(self, dtype: str, head_dim: int, candidates: list[dict], default: dict,
                   step_flops: float, rounds: int) -> float:
        """One tune class: its candidates and the default compiled PARALLEL_COMPILES at a
        time (never faster than the slowest), the reference's compile, then per candidate
        ``rounds`` rounds of three samples (default, candidate, default again)."""
        times = [self.compile(dtype, head_dim, c) for c in candidates + [default]]
        compiling = max(sum(times) / PARALLEL_COMPILES, max(times)) + XLA_COMPILE_S
        sample = max(SAMPLE_S, self.call(step_flops))
        return compiling + len(candidates) * (rounds * 3 * sample + 3 * self.call(step_flops))

    def ptxas(self, programs: list[tuple[str, int, dict | None]]) -> float:
        """ptxas' report: a child process compiling each (dtype, head dim, options)."""
        return PTXAS_CHILD_S + sum(self.pallas_compile(*p) for p in programs)

    def workload(self, w, impls: list[str], repeats: int) -> float:
        """One workload: each implementation's compile and first call, then ``repeats``
        interleaved rounds, each call after peers.SETTLE_S of idling. ``impls`` are the
        names gpu.py times, which say what each is."""
        dense_flops = (4 * w.head_dim * w.batch * w.q_heads * w.seq_len ** 2
                       * (3.5 if w.backward else 1))
        total = 0.0
        for name in impls:
            if name.startswith("pallas_triton"):
                setup, call = self.pallas_compile(w.dtype, w.head_dim), self.call(w.flops)
            elif name.startswith("mosaic_gpu"):
                setup, call = self.mosaic_compile(w.dtype, w.head_dim), self.call(w.flops)
            elif name.startswith("torch flex"):
                setup = FLEX_COMPILE_S * (2 if w.backward else 1)
                call = self.call(w.flops)
            elif "dense mask" in name:
                setup = TORCH_SETUP_S if name.startswith("torch") else XLA_COMPILE_S
                call = self.call(dense_flops, DENSE_SHARE)
            else:  # the xla backend: blocked, visible blocks only
                setup, call = XLA_COMPILE_S, self.call(w.flops)
            total += setup + (1 + repeats) * (call + peers.SETTLE_S)
        return total


@dataclasses.dataclass
class Phase:
    name: str
    estimate_s: float
    measured_s: float | None = None
    status: str = "planned"


class Phases:
    """The run's phases in order: each admitted by its estimate against the budget, timed,
    and listed with estimate and measured time side by side (GPU.md's first table)."""

    def __init__(self, budget_s: float, start: float):
        self.budget_s, self.start = budget_s, start
        self.done: list[Phase] = []

    def left(self) -> float:
        return self.budget_s - (time.perf_counter() - self.start)

    def run(self, name: str, estimate_s: float, body, log) -> bool:
        """``body()`` when ``estimate_s`` fits what is left of the budget, else a skip;
        True when it ran. An exception in ``body`` is recorded as the phase's status and
        logged, and the run goes on."""
        phase = Phase(name, estimate_s)
        self.done.append(phase)
        left = self.left()
        if estimate_s > left:
            phase.status = (f"skipped: estimated {estimate_s:.0f} s, {max(0.0, left):.0f} s "
                            f"of the {self.budget_s:.0f} s budget left")
            log(f"{name}: {phase.status}")
            return False
        begun = time.perf_counter()
        try:
            body()
            phase.status = "done"
        except Exception as e:  # noqa: BLE001 - one phase's failure is a result, not the end
            phase.status = f"failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}"
            log(f"{name}: {phase.status}")
        phase.measured_s = time.perf_counter() - begun
        return True

    def record(self, name: str, estimate_s: float, measured_s: float) -> None:
        """A phase timed elsewhere (start-up, before this object existed)."""
        self.done.append(Phase(name, estimate_s, measured_s, "done"))

    def to_json(self) -> list[dict]:
        return [dataclasses.asdict(p) for p in self.done]

    def markdown(self) -> list[str]:
        lines = ["| phase | estimated s | measured s | status |", "|---|---:|---:|---|"]
        for p in self.done:
            measured = "" if p.measured_s is None else f"{p.measured_s:.1f}"
            lines.append(f"| {p.name} | {p.estimate_s:.1f} | {measured} | {p.status} |")
        ran = [p for p in self.done if p.measured_s is not None]
        lines.append(f"| **total** | {sum(p.estimate_s for p in ran):.1f} (of what ran) | "
                     f"{sum(p.measured_s for p in ran):.1f} | budget {self.budget_s:.0f} s |")
        return lines
