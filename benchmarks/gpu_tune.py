"""The tune phase of benchmarks/gpu.py: pallas_triton configurations timed on this GPU.

For each call class (dtype, head dim, GQA; ``gpu_compile.TUNE_CLASSES``) it takes the
candidates of ``gpu_compile.tune_candidates`` that the deviceless compile
(``results/gpu_candidates.json``, from ``gpu_compile.py --candidates``) showed to compile
with at most SPILL_LIMIT bytes of spills per thread, compiles them ahead of time in
parallel on the machine's cores, checks each against the reference (out, lse, dq, dk, dv
of a vjp with both cotangents), and times the ones that pass forward + backward against
the built-in default (interleaved medians of the pair, so each line is a ratio measured
side by side). Every candidate's result is appended to a JSONL file as soon as it is
known, so a run cut off keeps what it measured. The budget is re-checked before each
candidate; candidates not reached are listed as skipped.

The class's winner becomes a tuned-table entry (``rankattn/backends/gpu_config.py``)
when it beats the default by MIN_GAIN; entries for other compute capabilities already in
the table are kept.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import datetime
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

import bench
import device_checks
import gpu_compile
import rankattn
from bench import NANO, Workload, smoke_version
from gpu_compile import option
from rankattn import peers
from rankattn.backends import BlockSizes, PallasTriton, gpu_config

TUNE_BATCH = 32        # rows of the nano layout (1024 history + 128 candidates) a class is timed on
SPILL_LIMIT = 600      # bytes per thread a candidate's kernels may spill (deviceless compile)
MIN_GAIN = 0.03        # an entry only where the best candidate is 3% faster than the default
# --smoke: CPU, interpret mode, one class (gpu.py's smoke workloads' shape) and two
# candidates; the faster candidate is entered whatever its gain, so the table path runs.
SMOKE_CLASSES = (("bfloat16", 128, 4, 2),)
SMOKE_CANDIDATES = [option(32, 16, 4), option(16, 32, 4, None, True, True)]
# Dry-run estimate: what the deviceless compile here does not see (XLA's own programs, the
# reference, jax 0.11 on another host) and the GPU's start-up, stated, not measured.
HOST_MARGIN = 2.0
STARTUP_SECONDS = 40.0
PARALLEL_COMPILES = 4
XLA_COMPILE_SECONDS = 2.0  # a reference or xla-backend program (not in the deviceless report)


@dataclasses.dataclass(frozen=True)
class TuneClass:
    """Calls of one dtype, head dim and GQA that one configuration is tuned for."""

    dtype: str
    head_dim: int
    q_heads: int
    kv_heads: int

    @property
    def name(self) -> str:
        return f"{self.dtype} D={self.head_dim} {self.q_heads}/{self.kv_heads}"

    @property
    def group(self) -> int:
        return self.q_heads // self.kv_heads

    def workload(self, smoke: bool) -> Workload:
        w = Workload(f"tune {self.name}", TUNE_BATCH, NANO, self.q_heads, self.kv_heads,
                     self.head_dim, backward=True, dtype=self.dtype)
        return smoke_version(w) if smoke else w


def classes(smoke: bool) -> list[TuneClass]:
    return [TuneClass(*c) for c in (SMOKE_CLASSES if smoke else gpu_compile.TUNE_CLASSES)]


def impl_of(options: dict, interpret: bool) -> PallasTriton:
    """The backend a candidate's options describe (never reading a tuned table)."""
    kwargs = dict(options, block_sizes=BlockSizes(*options["block_sizes"]))
    return PallasTriton(**kwargs, tuned=False, interpret=interpret)


def default_options(cls: TuneClass, capability) -> dict:
    """The built-in (spill-free) configuration of ``cls`` on this GPU, as options."""
    c = PallasTriton(target=capability, tuned=False).config(cls.dtype, cls.head_dim, cls.group)
    return option(c.block_sizes.block_q, c.block_sizes.block_k, c.num_warps, c.num_stages,
                  c.split_dkv, c.key_major)


def compile_report() -> dict | None:
    """results/gpu_candidates.json (the deviceless compile of the candidates), if present."""
    try:
        with open(gpu_compile.CANDIDATES_JSON) as f:
            return json.load(f)
    except FileNotFoundError:
        return None


def max_spill(result: dict) -> int:
    return max((k.get("spill_stores", 0) + k.get("spill_loads", 0)
                for k in result["kernels"].values()), default=0)


def planned(cls: TuneClass, capability, smoke: bool, report: dict | None) -> list[dict]:
    """The candidates to time for ``cls``: (options, deviceless compile seconds or None).

    Candidates that failed the deviceless compile or spilled past SPILL_LIMIT are left out;
    ones that resolve to the default are timed as the default already.
    """
    default = default_options(cls, capability)
    if smoke:
        chosen = [dict(options=o, compile_s=None) for o in SMOKE_CANDIDATES]
    elif report is None:  # no deviceless compile to go by: every candidate, compile unknown
        chosen = [dict(options=o, compile_s=None) for o in gpu_compile.tune_candidates(cls.dtype)]
    else:
        chosen = [dict(options=r["options"], compile_s=r["seconds"])
                  for r in report["candidates"]
                  if (r["config"]["dtype"], r["config"]["head_dim"]) == (cls.dtype, cls.head_dim)
                  and r["error"] is None and max_spill(r) <= SPILL_LIMIT]
    return [c for c in chosen if c["options"] != default]


# --- Timing on the device. ------------------------------------------------------------


def step_for(impl):
    """Jitted forward + backward of one call: (out, lse, dq, dk, dv) for cotangents
    (d_out, d_lse), the plan built inside as a model builds one per batch."""
    def step(q, k, v, seg, d_out, d_lse):
        def attend(q, k, v):
            plan = rankattn.plan(segment_ids=seg, impl=impl)
            return rankattn.attention(q, k, v, plan=plan, impl=impl, return_lse=True)
        (out, lse), vjp = jax.vjp(attend, q, k, v)
        return (out, lse, *vjp((d_out.astype(out.dtype), d_lse.astype(lse.dtype))))
    return jax.jit(step)


def compiled(impl, args) -> tuple:
    """(the compiled step, compile seconds): lowering and compiling ahead of time."""
    start = time.perf_counter()
    executable = step_for(impl).lower(*args).compile()
    return executable, time.perf_counter() - start


def class_inputs(w: Workload):
    q, k, v, seg, d_out = bench.inputs(w)
    d_lse = 0.1 * jax.random.normal(jax.random.PRNGKey(7), (w.batch, w.q_heads, w.seq_len))
    return q, k, v, seg, d_out, d_lse


def tune_class(cls: TuneClass, candidates: list[dict], capability, *, deadline: float,
               smoke: bool, repeats: int, tolerance: float, pool, record, log) -> dict:
    """Check and time ``candidates`` of ``cls`` against the default; ``record(line)`` gets
    each candidate's result as soon as it is known. Returns the class's summary."""
    w = cls.workload(smoke)
    args = class_inputs(w)
    default = default_options(cls, capability)
    summary = dict(cls=cls, default=default, rows=[])
    up = [x.astype(jnp.float32) for x in args[:3]]
    want = [np.asarray(x, np.float32) for x in step_for("reference")(*up, *args[3:])]
    jobs = {}  # submitted in order; the default first
    for c in [dict(options=default, compile_s=None)] + candidates:
        key = json.dumps(c["options"])
        jobs[key] = (c, pool.submit(compiled, impl_of(c["options"], smoke), args))
    # Every compile finishes (or the budget ends) before the first timing, so no compile
    # thread competes with the timed calls for the host.
    concurrent.futures.wait([job for _, job in jobs.values()],
                            timeout=max(0.0, deadline - time.perf_counter()))
    default_fn = None
    for c, job in jobs.values():
        is_default = c["options"] == default
        row = dict(tune_class=cls.name, options=c["options"], default=is_default,
                   deviceless_compile_s=c["compile_s"])
        if time.perf_counter() > deadline or not job.done():
            job.cancel()
            row.update(status="skipped: past the tune budget")
        else:
            try:
                fn, seconds = job.result()
                got = [np.asarray(x, np.float32) for x in fn(*args)]
                errors = device_checks.relative_errors(got, want)
                row.update(compile_s=round(seconds, 2), max_error=max(errors.values()))
                if row["max_error"] > tolerance:
                    row.update(status=f"wrong: {errors}")
                elif is_default:  # the baseline of every ratio
                    default_fn = fn
                    row.update(status="ok")
                else:
                    t = peers.interleaved_medians({"default": lambda: default_fn(*args),
                                                   "candidate": lambda: fn(*args)}, repeats)
                    row.update(status="ok", ms=t["candidate"] * 1e3,
                               default_ms=t["default"] * 1e3,
                               ratio=t["candidate"] / t["default"])
            except Exception as e:  # noqa: BLE001 - a candidate that fails is a result
                row.update(status=f"failed: {device_checks.first_line(e)}")
        summary["rows"].append(row)
        record(row)
        log(f"tune {cls.name} {describe(c['options'])}{' (default)' if is_default else ''}: "
            f"{row['status']}" + (f", {row['ms']:.3f} ms against the default's "
                                  f"{row['default_ms']:.3f} ms ({row['ratio']:.2f}x)"
                                  if "ratio" in row else ""))
        if is_default and default_fn is None:  # no baseline: nothing else can be compared
            for _, rest in jobs.values():
                rest.cancel()
            break
    timed = [r for r in summary["rows"] if "ratio" in r]
    best = min(timed, key=lambda r: r["ratio"], default=None)
    if best is not None and (smoke or best["ratio"] <= 1 - MIN_GAIN):
        summary["best"] = best
    return summary


def describe(options: dict) -> str:
    bq, bk = options["block_sizes"]
    parts = [f"{bq}x{bk}", f"w{options['num_warps']}"]
    if options["num_stages"]:
        parts.append(f"s{options['num_stages']}")
    if options["split_dkv"]:
        parts.append("dk|dv")
    if options["key_major"]:
        parts.append("key-major")
    return " ".join(parts)


# --- The tuned table. ----------------------------------------------------------------


def group_ranges(all_classes: list[TuneClass]) -> dict[TuneClass, tuple[int, int]]:
    """Each class's GQA group range: classes of one dtype and head dim split the groups at
    the midpoints between theirs (4/2 and 20/4: groups 1-3 and 4-64)."""
    ranges = {}
    for cls in all_classes:
        groups = sorted({c.group for c in all_classes
                         if (c.dtype, c.head_dim) == (cls.dtype, cls.head_dim)})
        i = groups.index(cls.group)
        low = 1 if i == 0 else (groups[i - 1] + cls.group) // 2 + 1
        high = 64 if i == len(groups) - 1 else (cls.group + groups[i + 1]) // 2
        ranges[cls] = (low, high)
    return ranges


def table_entries(summaries: list[dict], capability, all_classes: list[TuneClass]) -> list[dict]:
    """Entries for the classes whose best candidate beat the default."""
    ranges = group_ranges(all_classes)
    entries = []
    for s in summaries:
        if "best" not in s:
            continue
        cls, best = s["cls"], s["best"]
        padded = gpu_config.padded_head_dim(cls.head_dim)  # a power of two >= 16
        config = impl_of(best["options"], False).config(cls.dtype, cls.head_dim, cls.group)
        entry = gpu_config.TunedEntry(tuple(capability), cls.dtype, "highest",
                                      (max(gpu_config.MIN_BLOCK, padded // 2 + 1), padded),
                                      ranges[cls], config).to_json()
        entry["measured"] = dict(ms=round(best["ms"], 4), default_ms=round(best["default_ms"], 4),
                                 workload=cls.workload(False).name + f", B={TUNE_BATCH}")
        entries.append(entry)
    return entries


def write_table(path: str, entries: list[dict], capability, provenance: dict) -> dict:
    """Merge ``entries`` into the table at ``path``: this compute capability's entries are
    replaced, the others kept. Returns the table written."""
    cc = ".".join(map(str, capability))
    try:
        with open(path) as f:
            table = json.load(f)
        gpu_config.parse_table(table)
    except (FileNotFoundError, ValueError):
        table = {"schema": gpu_config.TABLE_SCHEMA, "entries": []}
    kept = [e for e in table["entries"] if e["compute_capability"] != cc]
    table = {"schema": gpu_config.TABLE_SCHEMA,
             "about": "pallas_triton configurations timed on GPUs by benchmarks/gpu.py --tune "
                      "(rankattn/backends/gpu_config.py reads it); generated, do not edit.",
             "measured": {**table.get("measured", {}), cc: provenance},
             "entries": kept + entries}
    gpu_config.parse_table(table)  # never write a table the library would ignore
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(table, f, indent=1)
        f.write("\n")
    return table


def provenance(device: str, command: str) -> dict:
    return dict(device=device, date=str(datetime.date.today()), jax=jax.__version__,
                command=command)


# --- The whole phase, and its dry run. --------------------------------------------------


def run(capability, *, budget: float, smoke: bool, repeats: int, tolerances: dict,
        jsonl: str, log) -> list[dict]:
    """Tune every class within ``budget`` seconds; the summaries, in class order."""
    deadline = time.perf_counter() + budget
    report = None if smoke else compile_report()
    if report is None and not smoke:
        log("results/gpu_candidates.json is missing: every candidate is tried")
    os.makedirs(os.path.dirname(os.path.abspath(jsonl)), exist_ok=True)

    def record(row):
        with open(jsonl, "a") as f:
            f.write(json.dumps(row) + "\n")

    workers = 2 if smoke else max(1, min(8, (os.cpu_count() or 2) - 1))
    summaries = []
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        for cls in classes(smoke):
            if time.perf_counter() > deadline:
                log(f"tune {cls.name}: skipped, past the {budget:.0f} s tune budget")
                summaries.append(dict(cls=cls, rows=[], skipped=True))
                continue
            summaries.append(tune_class(cls, planned(cls, capability, smoke, report),
                                        capability, deadline=deadline, smoke=smoke,
                                        repeats=repeats, tolerance=tolerances[cls.dtype],
                                        pool=pool, record=record, log=log))
    return summaries


def dry_run(capability, budget: float, tune_budget: float, check_compiles: list[str],
            xla_compiles: int) -> list[str]:
    """The plan of a GPU run and its estimated device time, as markdown lines.

    ``check_compiles``: the dtype of each pallas_triton program of the correctness phase;
    ``xla_compiles``: its other programs (references, the xla backend). Compile times come
    from the deviceless compile (results/gpu_candidates.json) times HOST_MARGIN, with
    PARALLEL_COMPILES at once in the tune phase (lowering holds Python's lock, XLA's compile
    does not); kernel run times are negligible beside them (a nano forward + backward at
    B=32 is about 3e11 flops, ~1.5 ms at 200 TFLOP/s, run 2 * repeats + 2 times).
    """
    report = compile_report()
    lines = ["| phase | what | estimated s |", "|---|---|---:|",
             f"| start-up | JAX, CUDA and torch initialisation (stated, not measured) | "
             f"{STARTUP_SECONDS:.0f} |"]
    default_compile = {}  # dtype -> seconds of the built-in default's deviceless compile
    for cls in classes(False):
        default = default_options(cls, capability)
        for r in (report or {}).get("candidates", []):
            if r["options"] == default and r["config"]["dtype"] == cls.dtype:
                default_compile.setdefault(cls.dtype, r["seconds"])
    compile_s = lambda dtype: default_compile.get(dtype, default_compile.get("float32", 10.0))
    checks_s = HOST_MARGIN * (sum(map(compile_s, check_compiles))
                              + xla_compiles * XLA_COMPILE_SECONDS)
    lines.append(f"| (a) correctness | {len(check_compiles)} pallas_triton and {xla_compiles} "
                 f"other compiles of forward + backward | {checks_s:.0f} |")
    tune_total = 0.0
    for cls in classes(False):
        plan = planned(cls, capability, False, report)
        times = [c["compile_s"] or 10.0 for c in plan] + [compile_s(cls.dtype)]
        # The candidates in parallel, then the reference's compile.
        estimate = HOST_MARGIN * (max(sum(times) / PARALLEL_COMPILES, max(times))
                                  + XLA_COMPILE_SECONDS)
        tune_total += estimate
        lines.append(f"| tune {cls.name} | {len(plan)} candidates + the default: "
                     + ", ".join(describe(c["options"]) for c in plan) + f" | {estimate:.0f} |")
    tune_s = min(tune_total, tune_budget)
    lines.append(f"| tune, total | capped by --tune-budget {tune_budget:.0f} s | {tune_s:.0f} |")
    shapes = dict.fromkeys((c.dtype, c.head_dim) for c in classes(False))
    ptxas_s = 15.0 + HOST_MARGIN * 2 * sum(compile_s(dtype) for dtype, _ in shapes)
    lines.append(f"| ptxas -v | the default and tuned configuration of {len(shapes)} dtype and "
                 f"head dim pairs, sm_90, in a child process (15 s to start it) | "
                 f"{ptxas_s:.0f} |")
    rest = max(0.0, budget - checks_s - tune_s - ptxas_s)
    lines.append(f"| (b) timings | workloads in order until --budget {budget:.0f} s; a step "
                 f"started before it runs to its end (up to ~60 s: FlexAttention's compile) | "
                 f"{rest:.0f} + 60 |")
    total = STARTUP_SECONDS + budget + 60
    lines += ["", f"Estimated device time: at most {total:.0f} s ({total / 60:.1f} min) with "
              f"start-up, within the 600 s one run may take; compile times x{HOST_MARGIN:g} "
              "for another host and jax version."]
    return lines
