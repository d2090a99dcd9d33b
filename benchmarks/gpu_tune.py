"""The tune phase of benchmarks/gpu.py: pallas_triton configurations timed on this GPU.

For each call class (dtype, head dim, GQA; ``gpu_compile.TUNE_CLASSES``, the production
class first) it takes the candidates of ``gpu_compile.tune_candidates`` that the deviceless
compile (``results/gpu_candidates.json``, from ``gpu_compile.py --candidates``) showed to
compile with at most SPILL_LIMIT bytes of spills per thread, compiles them ahead of time in
parallel on the machine's cores, checks each against the reference (out, lse, dq, dk, dv of
a vjp with both cotangents), and times the ones that pass forward + backward against the
built-in default (:func:`decide`). Every candidate's result is appended to a JSONL file as
soon as it is known, so a run cut off keeps what it measured; gpu.py writes the tuned table
after each class. Compile waits end at the phase's deadline; candidates not reached are
listed as skipped.

A candidate is entered (a tuned-table entry, ``rankattn/backends/gpu_config.py``) only
when it wins most rounds against the default and by more than the spread between two runs
of the default measured in the same rounds; entries for other compute capabilities already
in the table are kept.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import datetime
import json
import math
import time

import jax
import jax.numpy as jnp
import numpy as np

import bench
import device_checks
import gpu_compile
import gpu_plan
import rankattn
from bench import NANO, Workload, smoke_version
from gpu_compile import option
from rankattn.backends import BlockSizes, MosaicGpu, PallasTriton, gpu_config

TUNE_BATCH = 32        # rows of the nano layout (1024 history + 128 candidates) a class is timed on
SPILL_LIMIT = 600      # bytes per thread a candidate's kernels may spill (deviceless compile)
MIN_GAIN = 0.01        # the least gain entered, however quiet the default's two runs were
# --smoke: CPU, interpret mode, one class (gpu.py's smoke workloads' shape) and two
# candidates; the faster candidate is entered whatever its gain, so the table path runs.
SMOKE_CLASSES = (("bfloat16", 128, 4, 2),)
SMOKE_CANDIDATES = [option(32, 16, 4), option(16, 32, 4, None, True, True)]
# mosaic_gpu's candidates, timed first on sm_90 (its kernels' only GPU) for the production class
# only (its compile costs about 3 pallas_triton ones; the run's budget): its default blocks at
# pipeline depths 2 and 3 (3 fits the forward at D = 128; GPU_COMPILE.md). One entering the
# table makes impl='auto' take mosaic_gpu for that class on this GPU.
MOSAIC_CAPABILITY = (9, 0)
MOSAIC_CANDIDATES = [dict(backend="mosaic_gpu", block_sizes=[128, 128], pipeline_depth=depth)
                     for depth in (2, 3)]


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


MOSAIC_CLASS = TuneClass(*gpu_compile.TUNE_CLASSES[0])  # Phoenix's production heads


def classes(smoke: bool) -> list[TuneClass]:
    return [TuneClass(*c) for c in (SMOKE_CLASSES if smoke else gpu_compile.TUNE_CLASSES)]


def is_mosaic(options: dict) -> bool:
    return options.get("backend") == "mosaic_gpu"


def impl_of(options: dict, interpret: bool) -> PallasTriton | MosaicGpu:
    """The backend a candidate's options describe (never reading a tuned table)."""
    if is_mosaic(options):
        return MosaicGpu(BlockSizes(*options["block_sizes"]),
                         pipeline_depth=options["pipeline_depth"], tuned=False,
                         interpret=interpret)
    kwargs = dict(options, block_sizes=BlockSizes(*options["block_sizes"]))
    return PallasTriton(**kwargs, tuned=False, interpret=interpret)


def default_options(cls: TuneClass, capability) -> dict:
    """The built-in (spill-free) configuration of ``cls`` on this GPU, as options."""
    c = PallasTriton(target=capability, tuned=False).config(cls.dtype, cls.head_dim, cls.group)
    return option(c.block_sizes.block_q, c.block_sizes.block_k, c.num_warps, c.num_stages,
                  c.split_dkv, c.key_major)


def max_spill(result: dict) -> int:
    return max((k.get("spill_stores", 0) + k.get("spill_loads", 0)
                for k in result["kernels"].values()), default=0)


def planned(cls: TuneClass, capability, smoke: bool, report: dict | None) -> list[dict]:
    """The candidates to time for ``cls``: (options, deviceless compile seconds or None).

    Candidates that failed the deviceless compile or spilled past SPILL_LIMIT are left out;
    ones that resolve to the default are timed as the default already. mosaic_gpu's come
    first where it runs (MOSAIC_CAPABILITY, 16-bit; not in --smoke: its interpret mode runs
    eagerly only).
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
    if not smoke and tuple(capability) == MOSAIC_CAPABILITY and cls == MOSAIC_CLASS:
        chosen = [dict(options=o, compile_s=None) for o in MOSAIC_CANDIDATES] + chosen
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
               smoke: bool, rounds: int, tolerance: float, pool, record, log) -> dict:
    """Check and time ``candidates`` of ``cls`` against the default; ``record(line)`` gets
    each candidate's result as soon as it is known. Compile waits end at ``deadline``
    (``time.perf_counter()``), and so does the phase. Returns the class's summary."""
    w = cls.workload(smoke)
    args = class_inputs(w)
    default = default_options(cls, capability)
    summary = dict(cls=cls, default=default, rows=[])
    jobs = {}  # submitted in order; the default first
    for c in [dict(options=default, compile_s=None)] + candidates:
        key = json.dumps(c["options"])
        jobs[key] = (c, pool.submit(compiled, impl_of(c["options"], smoke), args))
    up = [x.astype(jnp.float32) for x in args[:3]]
    want = [np.asarray(x, np.float32) for x in step_for("reference")(*up, *args[3:])]
    # Every compile finishes (or the deadline comes) before the first timing, so no compile
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
            row.update(status="skipped: past the phase's deadline")
        else:
            try:
                fn, seconds = job.result()
                got = [np.asarray(x, np.float32) for x in fn(*args)]
                errors = device_checks.relative_errors(got, want)
                row.update(compile_s=round(seconds, 2), max_error=max(errors.values()))
                if row["max_error"] > tolerance:
                    row.update(status=f"wrong: {errors}")
                elif is_default:  # the baseline of every decision
                    default_fn = fn
                    row.update(status="ok")
                else:
                    row.update(status="ok", **decide(round_times(
                        {"default": lambda: default_fn(*args), "candidate": lambda: fn(*args),
                         "default again": lambda: default_fn(*args)}, rounds)))
            except Exception as e:  # noqa: BLE001 - a candidate that fails is a result
                row.update(status=f"failed: {device_checks.first_line(e)}")
        summary["rows"].append(row)
        record(row)
        log(f"tune {cls.name} {describe(c['options'])}{' (default)' if is_default else ''}: "
            f"{row['status']}" + (f", {row['ms']:.3f} ms against the default's "
                                  f"{row['default_ms']:.3f} ms ({row['ratio']:.3f}x, wins "
                                  f"{row['wins']} of {row['rounds']} rounds, the default's "
                                  f"spread {row['spread']:.1%})" if "ratio" in row else ""))
        if is_default and default_fn is None:  # no baseline: nothing else can be compared
            for _, rest in jobs.values():
                rest.cancel()
            break
    timed = [r for r in summary["rows"] if "ratio" in r and (smoke or r["enters"])]
    best = min(timed, key=lambda r: r["ratio"], default=None)
    if best is not None:
        summary["best"] = best
    if best is not None and is_mosaic(best["options"]):  # pallas_triton's own, by name
        summary["best_triton"] = min((r for r in timed if not is_mosaic(r["options"])),
                                     key=lambda r: r["ratio"], default=None)
    return summary


# --- Timing that decides. ---------------------------------------------------------------


def round_times(fns: dict, rounds: int) -> dict[str, np.ndarray]:
    """Seconds per call of each zero-argument function, per round.

    A sample is ``calls`` back-to-back calls with one wait at the end (no sleep inside a
    sample: the GPU stays busy, as under load), ``calls`` chosen so that a sample of the
    slowest function lasts at least ``gpu_plan.SAMPLE_S``. Every round takes one sample of
    each function, in the dict's order and reversed every other round, so drift hits all
    alike. (peers.interleaved_times, which the CPU benchmarks use, times one call after a
    settle sleep instead: right for 2-core hosts, too noisy for a 1.5 ms GPU step.)
    """
    once = []
    for fn in fns.values():
        jax.block_until_ready(fn())  # warm
        start = time.perf_counter()
        jax.block_until_ready(fn())
        once.append(time.perf_counter() - start)
    calls = max(1, math.ceil(gpu_plan.SAMPLE_S / max(max(once), 1e-6)))
    names, times = list(fns), {name: [] for name in fns}
    for round_ in range(rounds):
        for name in names if round_ % 2 == 0 else names[::-1]:
            start = time.perf_counter()
            for _ in range(calls):
                out = fns[name]()
            jax.block_until_ready(out)
            times[name].append((time.perf_counter() - start) / calls)
    return {name: np.array(t) for name, t in times.items()}


def decide(times: dict[str, np.ndarray]) -> dict:
    """The verdict on a candidate from :func:`round_times` of the default, the candidate and
    the default again: ratio = median over rounds of candidate / default (< 1: faster);
    spread = median over rounds of |default again / default - 1|, the noise between two runs
    of one configuration; it ``enters`` the table only when it beats both runs of the
    default in most rounds and its gain 1 - ratio exceeds the spread (and MIN_GAIN)."""
    default, candidate, again = times["default"], times["candidate"], times["default again"]
    ratio = float(np.median(candidate / default))
    spread = float(np.median(np.abs(again / default - 1)))
    wins = int(np.sum((candidate < default) & (candidate < again)))
    rounds = len(candidate)
    return dict(ms=float(np.median(candidate)) * 1e3, default_ms=float(np.median(default)) * 1e3,
                ratio=ratio, spread=spread, wins=wins, rounds=rounds,
                enters=wins > rounds / 2 and 1 - ratio > max(spread, MIN_GAIN))


def describe(options: dict) -> str:
    bq, bk = options["block_sizes"]
    if is_mosaic(options):
        return f"mosaic_gpu {bq}x{bk} depth {options['pipeline_depth']}"
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
    """Entries for the classes whose best candidate beat the default: the best; after it,
    where that is mosaic_gpu's, pallas_triton's best (what impl='pallas_triton' reads)."""
    ranges = group_ranges(all_classes)
    entries = []
    for s in summaries:
        for best in (s.get("best"), s.get("best_triton")):
            if best is not None:
                entries.append(table_entry(s["cls"], best, capability, ranges[s["cls"]]))
    return entries


def table_entry(cls: TuneClass, best: dict, capability, group: tuple[int, int]) -> dict:
    """The table entry (JSON) of a timed candidate's row for ``cls``."""
    padded = gpu_config.padded_head_dim(cls.head_dim)  # a power of two >= 16
    config = impl_of(best["options"], False).config(cls.dtype, cls.head_dim, cls.group)
    entry = gpu_config.TunedEntry(tuple(capability), cls.dtype, "highest",
                                  (max(gpu_config.MIN_BLOCK, padded // 2 + 1), padded), group,
                                  config, "mosaic_gpu" if is_mosaic(best["options"])
                                  else "pallas_triton").to_json()
    entry["measured"] = dict(ms=round(best["ms"], 4), default_ms=round(best["default_ms"], 4),
                             spread=round(best["spread"], 4),
                             wins=f"{best['wins']} of {best['rounds']} rounds",
                             workload=cls.workload(False).name + f", B={TUNE_BATCH}")
    return entry


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
    gpu_config.save_table(path, table)  # never a table the library would ignore
    return table


def provenance(device: str, command: str) -> dict:
    return dict(device=device, date=str(datetime.date.today()), jax=jax.__version__,
                command=command)
