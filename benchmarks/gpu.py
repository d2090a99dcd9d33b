"""One-command GPU check of rankattn: correctness on the GPU, then bf16 timings beside the peers.

On a CUDA machine with jax (CUDA plugin), torch and triton installed; no network needed:

    PYTHONPATH=src python benchmarks/gpu.py --out "$OUT"

(a) checks pallas_triton and xla against the reference on the GPU: out, lse and the
    gradients of a loss with an lse term, float32 / bfloat16 / float16, odd shapes, packed
    rows with padding;
(t) tunes pallas_triton (--tune, on by default on a GPU; within --tune-budget seconds):
    candidate configurations per dtype, head dim and GQA, each checked against the
    reference, then timed forward + backward beside the built-in default
    (benchmarks/gpu_tune.py); every result is appended to tune.jsonl under --out as it
    comes, and the winners become src/rankattn/backends/gpu_tuned.json (and a copy under
    --out), the table pallas_triton reads; then ptxas -v registers and spills of the
    default and tuned configurations for sm_90, compiled by this machine's own CUDA plugin;
(b) times bf16 forward and forward+backward of the nano, production-heads, packed and
    long-history workloads for every rankattn backend and, interleaved in the same process,
    jax.nn.dot_product_attention with the dense mask (cuDNN where it takes the mask, else
    XLA), torch SDPA with a boolean mask and compiled FlexAttention with the same mask_mod
    (skipped with a note when torch is missing).

    pallas_triton runs with the tuned table and, where that changes its configuration,
    again with the built-in default beside it.

It prints TFLOP/s on visible pairs, peer / pallas_triton ratios and the fraction of the bf16
matmul rate measured in the same run, progress as it goes, and writes benchmarks/GPU.md
(and a copy under --out). A step that fails is reported, not fatal; past --budget seconds
(counted from after the imports) the remaining workloads are skipped and listed.

    .venv/bin/python benchmarks/gpu.py --dry-run [--md benchmarks/GPU.md]

prints what a GPU run would do and its estimated device time (gpu_tune.dry_run), from the
deviceless compile times of results/gpu_candidates.json; with --md it writes that plan as
the pending GPU.md.

    .venv/bin/python benchmarks/gpu.py --smoke

runs the whole script on CPU with tiny shapes (bench.smoke_version) and the kernels in Pallas
interpret mode, timing SMOKE_WORKLOADS only, to check it before spending GPU time (it writes
no GPU.md unless --md is given); --smoke --tune also runs the tune phase on one class and
two candidates, writing its table under --out only.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import sys
import time

# JAX would otherwise take 75% of the GPU's memory up front, leaving torch's peers little.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench  # noqa: E402  (the workloads and the torch peers)
import device_checks  # noqa: E402
import gpu_compile  # noqa: E402
import gpu_tune  # noqa: E402
import rankattn  # noqa: E402
from bench import NANO, PACKED, Workload, smoke_version  # noqa: E402
from rankattn import peers  # noqa: E402
from rankattn.backends import PallasTriton, Xla, pallas_triton  # noqa: E402

START = time.perf_counter()
BF16 = "bfloat16"
WORKLOADS = [  # in order of importance: the budget cuts from the end
    Workload("nano-fwd", 64, NANO, 4, 2, 128, dtype=BF16),
    Workload("nano-fwdbwd", 64, NANO, 4, 2, 128, backward=True, dtype=BF16),
    Workload("packed-fwd", 8, PACKED, 4, 2, 128, dtype=BF16),
    Workload("packed-fwdbwd", 8, PACKED, 4, 2, 128, backward=True, dtype=BF16),
    Workload("long-history-fwd", 1, ((32768, 128),), 4, 2, 128, dtype=BF16),
    Workload("long-history-fwdbwd", 1, ((32768, 128),), 4, 2, 128, backward=True, dtype=BF16),
    Workload("prod-heads-fwd", 64, NANO, 20, 4, 128, dtype=BF16),
    Workload("prod-heads-fwdbwd", 64, NANO, 20, 4, 128, backward=True, dtype=BF16),
]
# What --smoke times: forward (with the xla float32 row) and backward, one session and packed.
SMOKE_WORKLOADS = ("nano-fwd", "packed-fwdbwd")
# (B, S, Hq, Hkv, D, Dv, dtype, causal, softcap, softcap_method)
CHECKS = [
    (2, 333, 10, 2, 80, 80, "bfloat16", False, 30.0, "tanh"),
    (1, 1031, 5, 1, 128, 128, "float32", True, None, "tanh"),
    (2, 77, 8, 1, 200, 200, "float32", False, 5.0, "soft_sign"),
    (3, 1, 2, 2, 8, 8, "bfloat16", False, None, "tanh"),
    (2, 513, 4, 4, 256, 256, "bfloat16", True, None, "tanh"),
    (2, 130, 6, 3, 48, 24, "float16", True, 2.0, "tanh"),
]
# Max error / max(1, max |reference|) allowed: float32 math on both sides, or bf16 / f16
# operands and outputs (a real mask, scale or gradient bug moves results by O(1)).
TOLERANCE = {"float32": 1e-4, "bfloat16": 2e-2, "float16": 2e-2}
# PallasTriton(precision="default") rounds float32 operands to tf32 (10-bit mantissas), "high"
# to three bf16 products: up to 5.2e-3 and 5.9e-5 in interpret mode's emulation
# (benchmarks/PRECISION.md); the GPU's own rounding is checked here with that much margin again.
PRECISION_TOLERANCE = {"default": 1e-2, "high": 5e-4}
# Dense-mask peers are skipped when their float32 logits alone would exceed this.
DENSE_LIMIT_BYTES = 24 << 30


def log(message: str) -> None:
    print(f"[{time.perf_counter() - START:6.1f} s] {message}", flush=True)


# --- (a) correctness. --------------------------------------------------------------


# --- (b) timings. -------------------------------------------------------------------


def bf16_matmul_rate(n: int, repeats: int) -> float:
    a = jax.random.normal(jax.random.PRNGKey(0), (n, n), jnp.bfloat16)
    mm = jax.jit(lambda a: a @ a)
    return 2 * n ** 3 / peers.interleaved_medians({"mm": lambda: mm(a)}, repeats)["mm"]


def runners(w: Workload, impls: dict, device: str, failures: list[str]) -> dict:
    """Zero-argument callables for every implementation that compiles and runs on ``w``."""
    makers = {name: functools.partial(bench.jax_runner, w, bench.rankattn_with(impl))
              for name, impl in impls.items()}
    if w.name == "nano-fwd":  # what the xla backend did on GPUs before: float32 "highest" dots
        makers["xla (float32 highest)"] = functools.partial(
            bench.jax_runner, w, bench.rankattn_with(Xla(mixed_precision=False)))
    if w.batch * w.q_heads * w.seq_len ** 2 * 4 <= DENSE_LIMIT_BYTES:
        for implementation in ("cudnn", "xla"):
            makers[f"jax.nn.dpa ({implementation}, dense mask)"] = functools.partial(
                bench.jax_runner, w, functools.partial(peers.jax_nn_attention,
                                                       implementation=implementation))
        if bench.torch is not None:
            makers["torch sdpa (dense mask)"] = functools.partial(bench.torch_sdpa, w, device)
    else:
        failures.append(f"{w.name}: dense-mask peers skipped (logits over "
                        f"{DENSE_LIMIT_BYTES >> 30} GiB)")
    if bench.torch is not None:
        makers["torch flex (compiled)"] = functools.partial(bench.torch_flex, w, device)
    fns = {}
    for name, make in makers.items():
        if name.startswith("jax.nn.dpa (xla") and any(n.startswith("jax.nn") for n in fns):
            continue  # cuDNN took the mask: XLA's dense path is only the fallback
        try:
            fn = make()
            fn = fn[0] if isinstance(fn, tuple) else fn
            jax.block_until_ready(fn())  # compile and run once
            fns[name] = fn
        except Exception as e:  # noqa: BLE001 - a peer that cannot run is reported
            failures.append(f"{w.name}: {name} failed: {device_checks.first_line(e)}")
            log(failures[-1])
    return fns


def time_workload(w: Workload, impls: dict, device: str, repeats: int, rate: float,
                  failures: list[str]) -> list[dict]:
    fns = runners(w, impls, device, failures)
    times = peers.interleaved_medians(fns, repeats) if fns else {}
    base = times.get("pallas_triton") or times.get("xla")
    return [dict(workload=w.name, impl=name, ms=t * 1e3, tflops=w.flops / t / 1e12,
                 mm=w.flops / t / rate, ratio=t / base if base else float("nan"))
            for name, t in times.items()]


def targets(rows: list[dict]) -> list[str]:
    """The GPU issue's targets, met or not, from this run's rows."""
    by = {(r["workload"], r["impl"]): r for r in rows}
    lines = []

    def ratio(workload, peer):
        mine, theirs = by.get((workload, "pallas_triton")), by.get((workload, peer))
        return theirs["ms"] / mine["ms"] if mine and theirs else None

    def verdict(name, value, need, unit="x"):
        if value is None:
            lines.append(f"- {name}: not measured")
        else:
            shown = f"{value:.0%}" if unit == "%" else f"{value:.2f}x"
            target = f"{need:.0%}" if unit == "%" else f"{need}x"
            lines.append(f"- {name}: {shown} (target >= {target}) {'MET' if value >= need else 'MISSED'}")

    flex = "torch flex (compiled)"
    for workload in ("nano-fwd", "packed-fwd", "nano-fwdbwd", "packed-fwdbwd"):
        verdict(f"{workload}: pallas_triton vs FlexAttention", ratio(workload, flex), 1.0)
    for workload in ("nano-fwd", "packed-fwd"):
        dense = [ratio(workload, r["impl"]) for r in rows if r["workload"] == workload
                 and ("dense mask" in r["impl"])]
        dense = [x for x in dense if x is not None]
        verdict(f"{workload}: pallas_triton vs the best dense-mask peer",
                min(dense) if dense else None, 3.0)
    for workload, need in (("long-history-fwd", 0.45), ("long-history-fwdbwd", 0.30)):
        mine = by.get((workload, "pallas_triton"))
        verdict(f"{workload}: pallas_triton share of the bf16 matmul rate",
                mine["mm"] if mine else None, need, "%")
    fast, slow = by.get(("nano-fwd", "xla")), by.get(("nano-fwd", "xla (float32 highest)"))
    verdict("nano-fwd: xla bf16 dots vs its float32 'highest' path",
            slow["ms"] / fast["ms"] if fast and slow else None, 3.0)
    return lines


# --- Report. ------------------------------------------------------------------------


def markdown(header: list[str], checks: list[dict], tuned: list[str], rows: list[dict],
             goals: list[str], failures: list[str]) -> str:
    out = ["# rankattn on a GPU", "", *header, "", *device_checks.markdown(checks, TOLERANCE)]
    out += ["", *tuned, "## (b) bf16 timings, interleaved medians", "",
            "TFLOP/s count visible query-key pairs only (forward 4 * D flops per pair and "
            "head, forward + backward 3.5x that); % mm is the share of the bf16 matmul rate "
            "measured in this run; ratio = time / pallas_triton's time (> 1: slower than "
            "pallas_triton). pallas_triton reads the tuned table; \"pallas_triton (built-in "
            "default)\" is the configuration before tuning, run where the two differ.", "",
            "| workload | impl | median ms | TFLOP/s | % mm | ratio |",
            "|---|---|---:|---:|---:|---:|"]
    out += [f"| {r['workload']} | {r['impl']} | {r['ms']:.2f} | {r['tflops']:.1f} | "
            f"{r['mm']:.0%} | {r['ratio']:.2f} |" for r in rows]
    out += ["", "## Targets", "", *goals]
    if failures:
        out += ["", "## Failures and skips", "", *(f"- {f}" for f in failures)]
    return "\n".join(out) + "\n"


def tune_section(summaries: list[dict], table: dict | None, paths: list[str],
                 registers: list[str]) -> list[str]:
    """GPU.md's tune phase: every candidate's result, the table written, the registers."""
    out = ["## (t) Tune phase", "",
           "Forward + backward of the nano layout (1024 history + 128 candidates per row, "
           f"B={gpu_tune.TUNE_BATCH}) per class; each candidate checked against the reference "
           "first, then timed as an interleaved pair with the built-in default. ratio = "
           "candidate / default (< 1: faster). Candidates: benchmarks/gpu_compile.py "
           f"tune_candidates, less those spilling over {gpu_tune.SPILL_LIMIT} bytes per thread "
           "in the deviceless compile.", "",
           "| class | configuration | compile s | max error | ms | default ms | ratio | status |",
           "|---|---|---:|---:|---:|---:|---:|---|"]
    for summary in summaries:
        for r in summary["rows"]:
            name = gpu_tune.describe(r["options"]) + (" (default)" if r["default"] else "")
            cells = [f"{r[k]:.3g}" if isinstance(r.get(k), float) else "" for k in
                     ("compile_s", "max_error", "ms", "default_ms", "ratio")]
            status = r["status"] if len(r["status"]) < 80 else r["status"][:77] + "..."
            out.append(f"| {r['tune_class']} | {name} | " + " | ".join(cells) + f" | {status} |")
        if summary.get("skipped"):
            out.append(f"| {summary['cls'].name} | | | | | | | skipped: past the tune budget |")
    out += ["", f"Tuned table written ({', '.join(paths) or 'nowhere'}):", ""]
    if table and table["entries"]:
        out += ["| compute capability | dtype | head dim | group | configuration | ms | "
                "default ms |", "|---|---|---|---|---|---:|---:|"]
        for e in table["entries"]:
            c, m = e["config"], e.get("measured", {})
            opts = gpu_compile.option(c["block_q"], c["block_k"], c["num_warps"],
                                      c["num_stages"], c["split_dkv"], c["key_major"])
            out.append(f"| {e['compute_capability']} | {e['dtype']} | {e['head_dim']} | "
                       f"{e['group']} | {gpu_tune.describe(opts)} | {m.get('ms', '')} | "
                       f"{m.get('default_ms', '')} |")
    else:
        out.append("- no entry: no candidate beat the built-in default by "
                   f"{gpu_tune.MIN_GAIN:.0%} (or none was timed)")
    return out + ["", *registers, ""]


def registers_section(summaries: list[dict], capability, smoke: bool) -> list[str]:
    """ptxas -v of the default and tuned configurations for sm_90, compiled in a child by
    this machine's own CUDA plugin (nothing installed)."""
    out = ["### Registers and spills (ptxas -v, sm_90, this machine's CUDA plugin)", ""]
    if smoke:
        return out + ["- not measured in --smoke (no CUDA plugin)"]
    variants = {}  # one compile per dtype, head dim and configuration (GQA changes no kernel's
    for summary in summaries:  # resources: GPU_COMPILE.md's gqa rows)
        cls = summary["cls"]
        chosen = [("default", gpu_tune.default_options(cls, capability))]
        if "best" in summary:
            chosen.append(("tuned", summary["best"]["options"]))
        for label, o in chosen:
            variants.setdefault((cls.dtype, cls.head_dim, json.dumps(o)), (
                gpu_compile.Config(label, dtype=cls.dtype, head_dim=cls.head_dim,
                                   q_heads=cls.q_heads, kv_heads=cls.kv_heads), o))
    cfgs, options = [c for c, _ in variants.values()], [o for _, o in variants.values()]
    try:
        results = gpu_compile.compile_in_child("sm_90", cfgs, None, options)
    except RuntimeError as e:
        return out + [f"- not measured: {str(e).splitlines()[0]}"]
    out += ["| class | variant | configuration | kernel | regs | spill | smem KB | MMA |",
            "|---|---|---|---|---:|---:|---:|---|"]
    for cfg, o, r in zip(cfgs, options, results):
        name = f"{cfg.dtype} D={cfg.head_dim} {cfg.q_heads}/{cfg.kv_heads}"
        if r["error"]:
            out.append(f"| {name} | {cfg.axis} | {gpu_tune.describe(o)} | compile failed: "
                       f"{r['error'][:100]} | | | | |")
        for kernel, k in r["kernels"].items():
            spill = k.get("spill_stores", 0) + k.get("spill_loads", 0)
            out.append(f"| {name} | {cfg.axis} | {gpu_tune.describe(o)} | "
                       f"{kernel.removeprefix('rankattn_')} | {k.get('registers', '?')} | "
                       f"{spill if 'registers' in k else '?'} | {k.get('shared', 0) / 1024:.1f} | "
                       f"{k.get('mma', '?')} |")
    ptxas = next((r["ptxas"] for r in results if r["ptxas"]), None)
    return out + ["", f"ptxas {ptxas or 'version not logged'}; '?' where this XLA did not "
                      "log ptxas' report."]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true",
                        help="tiny shapes on CPU, kernels in interpret mode")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--budget", type=float, default=480.0,
                        help="seconds after which the remaining steps are skipped")
    parser.add_argument("--tune", action=argparse.BooleanOptionalAction, default=None,
                        help="run the tune phase (default: on a GPU)")
    parser.add_argument("--tune-budget", type=float, default=200.0,
                        help="seconds the tune phase may take, within --budget")
    parser.add_argument("--table", help="where the tune phase writes its table (default "
                                        "src/rankattn/backends/gpu_tuned.json; with --smoke "
                                        "only under --out)")
    parser.add_argument("--dry-run", action="store_true",
                        help="print the plan and its estimated device time; run nothing")
    parser.add_argument("--md", help="where to write the report (default benchmarks/GPU.md, "
                                     "none with --smoke)")
    parser.add_argument("--out", help="also copy the report into this folder; tune.jsonl "
                                      "and gpu_tuned.json go there too")
    args = parser.parse_args()
    md_path = args.md or (None if args.smoke or args.dry_run else "benchmarks/GPU.md")
    if args.dry_run:
        return dry_run(args, md_path)

    platform = jax.default_backend()
    device = "cuda" if platform == "gpu" else "cpu"
    tune = args.tune if args.tune is not None else platform == "gpu"
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = "not installed"
    torch_version = bench.torch.__version__ if bench.torch is not None else "not installed"
    command = (f"PYTHONPATH=src python benchmarks/gpu.py{' --smoke' if args.smoke else ''}"
               f"{' --tune' if tune and args.smoke else ''}")
    header = [f"Measured {datetime.date.today()} on {jax.devices()[0].device_kind} "
              f"({platform}) with jax {jax.__version__}, torch {torch_version}, triton "
              f"{triton_version}; command: `{command}`."]
    failures: list[str] = []
    smoke = args.smoke
    capability = PallasTriton().gpu_target().compute_capability
    log(header[0])
    log(f"rankattn.available_impls() = {rankattn.available_impls()}")
    if platform != "gpu" and not smoke:
        log("no GPU here: run with --smoke to check the script on CPU")

    # (a) correctness, with the configurations used before this run's tuning.
    impls = {"pallas_triton": PallasTriton(interpret=smoke), "xla": Xla()}
    # float32 on tensor cores: "high" three bf16 passes, "default" one tf32 pass.
    precisions = {f"pallas_triton precision={p}": PallasTriton(precision=p, interpret=smoke)
                  for p in ("high", "default")}
    if pallas_triton.IMPORT_ERROR is not None:
        del impls["pallas_triton"]
        precisions = {}
        tune = False
        failures.append(f"pallas_triton not measured: this JAX has no Pallas Triton lowering "
                        f"({pallas_triton.IMPORT_ERROR})")
    checks = []
    for case in CHECKS[-2:] if smoke else CHECKS:
        if smoke:  # short and narrow enough for interpret mode
            case = (case[0], min(case[1], 40), *case[2:])
        case_impls = {**impls, **(precisions if case[6] == "float32" else {})}
        checks += device_checks.correctness(case, case_impls, TOLERANCE, {
            name: PRECISION_TOLERANCE[impl.precision] for name, impl in precisions.items()})
        for c in checks[-len(case_impls):]:
            verdict = "pass" if c["ok"] else f"FAIL {c.get('errors') or c.get('error')}"
            log(f"check {c['case']} {c['impl']}: {verdict}")

    # (t) the tune phase, its table, the registers of what it chose.
    tuned_section, table_path = [], None
    if tune:
        budget = min(args.tune_budget, max(0.0, args.budget - (time.perf_counter() - START)))
        jsonl = os.path.join(args.out or "benchmarks/out", "tune.jsonl")
        log(f"tune phase: within {budget:.0f} s; results appended to {jsonl}")
        summaries = gpu_tune.run(capability, budget=budget, smoke=smoke, repeats=args.repeats,
                                 tolerances=TOLERANCE, jsonl=jsonl, log=log)
        entries = gpu_tune.table_entries(summaries, capability, gpu_tune.classes(smoke))
        paths = [args.table or (None if smoke else str(gpu_config_path()))]
        paths.append(args.out and os.path.join(args.out, "gpu_tuned.json"))
        if smoke and not any(paths):
            paths = [os.path.join("benchmarks", "out", "gpu_tuned.json")]
        table, paths = None, list(filter(None, paths))
        for path in paths:
            table = gpu_tune.write_table(path, entries, capability,
                                         gpu_tune.provenance(jax.devices()[0].device_kind,
                                                             command))
            table_path = table_path or path
            log(f"wrote {path} ({len(entries)} entries for compute capability "
                f"{'.'.join(map(str, capability))})")
        tuned_section = tune_section(summaries, table, paths,
                                     registers_section(summaries, capability, smoke))
        write_report(markdown(header, checks, tuned_section, [], [], failures), md_path,
                     args.out, final=False)
    impls = {"pallas_triton": PallasTriton(tuned=table_path, interpret=smoke)}
    if tune:
        impls["pallas_triton (built-in default)"] = PallasTriton(tuned=False, interpret=smoke)
    impls["xla"] = Xla()

    rate = bf16_matmul_rate(256 if smoke else 8192, args.repeats)
    header.append(f"bf16 matmul rate in this run ({256 if smoke else 8192}^3, XLA): "
                  f"{rate / 1e12:.1f} TFLOP/s.")
    log(header[-1])
    rows = []
    for w in WORKLOADS:
        if smoke:
            if w.name not in SMOKE_WORKLOADS:
                continue
            w = smoke_version(w)
        if time.perf_counter() - START > args.budget:
            failures.append(f"{w.name}: skipped, past the {args.budget:.0f} s budget")
            log(failures[-1])
            continue
        rows += time_workload(w, same_configuration_dropped(impls, w), device, args.repeats,
                              rate, failures)
        for r in rows:
            if r["workload"] == w.name:
                log(f"{w.name} {r['impl']}: {r['ms']:.2f} ms, {r['tflops']:.1f} TFLOP/s, "
                    f"{r['mm']:.0%} mm, ratio {r['ratio']:.2f}")
        # The report so far after each workload: a run cut off keeps what it measured.
        write_report(markdown(header, checks, tuned_section, rows, targets(rows), failures),
                     md_path, args.out, final=False)
    report = markdown(header, checks, tuned_section, rows, targets(rows), failures)
    write_report(report, md_path, args.out)
    if not all(c["ok"] for c in checks):
        sys.exit(1)


def gpu_config_path():
    from rankattn.backends import gpu_config
    return gpu_config.TUNED_TABLE


def same_configuration_dropped(impls: dict, w: Workload) -> dict:
    """The built-in default only where the tuned table changes the workload's configuration."""
    name = "pallas_triton (built-in default)"
    if name not in impls:
        return impls
    args = (w.dtype, w.head_dim, w.q_heads // w.kv_heads)
    if impls["pallas_triton"].config(*args) == impls[name].config(*args):
        return {k: v for k, v in impls.items() if k != name}
    return impls


def write_report(report: str, md_path: str | None, out: str | None, final: bool = True) -> None:
    """Write the report to ``md_path`` and ``out``; the final one is printed too."""
    if final:
        print("\n" + report, flush=True)
    for path in filter(None, [md_path, out and os.path.join(out, "GPU.md")]):
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        with open(path, "w") as f:
            f.write(report)
        if final:
            log(f"wrote {path}")


def dry_run(args, md_path: str | None) -> None:
    """What a GPU run would do, and its estimated device time, without running it."""
    # Per case: pallas_triton (and its two float32 precisions), the xla backend, the reference.
    pallas = [case[6] for case in CHECKS for _ in range(1 + 2 * (case[6] == "float32"))]
    plan = gpu_tune.dry_run((9, 0), args.budget, args.tune_budget, pallas, 2 * len(CHECKS))
    report = "\n".join([
        "# rankattn on a GPU", "",
        "**Pending: no GPU has run this check yet.** Every figure awaits one run of", "",
        "```", "PYTHONPATH=src python benchmarks/gpu.py --out \"$OUT\"", "```", "",
        "on a CUDA machine with jax (CUDA plugin), torch and triton installed; it needs no "
        "network and no install step. That run replaces this file with its measured report: "
        "(a) correctness of pallas_triton and xla against the reference on the GPU, (t) the "
        "tune phase's candidates, checked and timed against the built-in default, the tuned "
        "table it writes (src/rankattn/backends/gpu_tuned.json) and ptxas' registers for "
        "sm_90, (b) bf16 timings beside jax.nn.dot_product_attention with the dense mask "
        "(cuDNN, else XLA), torch SDPA and compiled FlexAttention, and the targets, each MET "
        "or MISSED.", "",
        f"## The plan of that run on an H100 / H200 (sm_90), estimated", "",
        f"Generated by `.venv/bin/python benchmarks/gpu.py --dry-run` on "
        f"{datetime.date.today()} from the deviceless compile times in "
        "benchmarks/results/gpu_candidates.json (`benchmarks/gpu_compile.py --candidates`, "
        "this CPU-only machine).", "", *plan, "",
        "Checked without a GPU: the kernels give the reference's results in Pallas interpret "
        "mode (the test suite), compile for sm_80 / sm_89 / sm_90 (GPU_COMPILE.md), and this "
        "script, tune phase included, runs end to end on CPU: "
        "`.venv/bin/python benchmarks/gpu.py --smoke --tune`.", ""])
    write_report(report, md_path, args.out)

if __name__ == "__main__":
    main()
