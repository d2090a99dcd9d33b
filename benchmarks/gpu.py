"""One-command GPU check of rankattn: correctness, the tune phase, then bf16 timings beside the peers.

On a CUDA machine with jax (its CUDA plugin), torch and triton installed; no network and
no install step (the package is read from src/):

    PYTHONPATH=src python3 benchmarks/gpu.py --out "$OUT"

The run is a list of phases in order of value, each admitted only when its estimate
(benchmarks/gpu_plan.py: stated compile and run costs) fits what is left of --budget
(default 540 s from the process's start: one 10-minute command with a margin); a phase that
would not fit is skipped and listed, and GPU.md shows every phase's estimate beside its
measured time:

(a) correctness: pallas_triton (and its float32 tensor-core precisions on one case),
    mosaic_gpu (on sm_90, the 16-bit cases it takes) and xla against the reference on the
    GPU: out, lse and the gradients of a loss with an lse term, float32 / bfloat16 /
    float16, odd shapes, packed rows with padding;
(t) the tune phase (--tune, on by default on a GPU), one phase per call class, Phoenix's
    production heads (bf16, 20 / 4, D = 128) first: candidate configurations (on sm_90,
    mosaic_gpu's first) checked against the reference, then timed forward + backward in
    rounds interleaved with the built-in default (benchmarks/gpu_tune.py); a mosaic_gpu
    entry makes impl='auto' take it for that class; every result is appended to tune.jsonl under
    --out as it comes, and the tuned table (src/rankattn/backends/gpu_tuned.json and a
    copy under --out) is rewritten after each class;
(b) bf16 forward and forward + backward timings, the production-heads workloads first, then
    nano, packed and long history: every rankattn backend (mosaic_gpu on sm_90, with its
    targets: 1.3x pallas_triton and cuDNN's speed at the production shape, 45% of the
    matmul rate on long histories) and, interleaved in the same
    process, jax.nn.dot_product_attention with the dense mask (cuDNN where it takes the
    mask, else XLA), torch SDPA with a boolean mask and compiled FlexAttention with the same
    mask_mod (skipped with a note when torch is missing). pallas_triton reads the tuned
    table as written by this run and, where that changes its configuration, runs again
    with the built-in default beside it;
(r) ptxas -v registers and spills of the default and tuned configurations for sm_90,
    compiled by this machine's own CUDA plugin in a child process.

It prints progress as it goes and rewrites benchmarks/GPU.md and benchmarks/results/gpu.json
(and copies under --out) after every phase, so a run cut off keeps what it measured.

    .venv/bin/python benchmarks/gpu.py --dry-run [--md benchmarks/GPU.md]

prints the plan: each phase's estimate, their sum, and whether it fits --budget; with --md
it writes that plan as the pending GPU.md.

    .venv/bin/python benchmarks/gpu.py --smoke [--tune]

runs the whole script on CPU with tiny shapes (bench.smoke_version) and the kernels in Pallas
interpret mode, timing SMOKE_WORKLOADS only, to check it before spending GPU time (it writes
no GPU.md unless --md is given); --tune adds the tune phase on one class and two
candidates, writing its table under --out only.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import functools
import json
import os
import sys
import time

START = time.perf_counter()  # before JAX's import: the start-up phase counts it

# JAX would otherwise take 75% of the GPU's memory up front, leaving torch's peers little.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench  # noqa: E402  (the workloads and the torch peers)
import device_checks  # noqa: E402
import gpu_compile  # noqa: E402
import gpu_plan  # noqa: E402
import gpu_tune  # noqa: E402
import rankattn  # noqa: E402
from bench import NANO, PACKED, Workload, smoke_version  # noqa: E402
from rankattn import peers  # noqa: E402
from rankattn.backends import (MosaicGpu, PallasTriton, Xla, gpu_config,  # noqa: E402
                               mosaic_gpu, pallas_triton)
from rankattn.validate import AttentionCall  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS_JSON = os.path.join(HERE, "results", "gpu.json")
COMMAND = 'PYTHONPATH=src python3 benchmarks/gpu.py --out "$OUT"'
BF16 = "bfloat16"
WORKLOADS = [  # in order of value: the budget cuts from the end
    Workload("prod-heads-fwd", 64, NANO, 20, 4, 128, dtype=BF16),
    Workload("prod-heads-fwdbwd", 64, NANO, 20, 4, 128, backward=True, dtype=BF16),
    Workload("nano-fwd", 64, NANO, 4, 2, 128, dtype=BF16),
    Workload("nano-fwdbwd", 64, NANO, 4, 2, 128, backward=True, dtype=BF16),
    Workload("packed-fwd", 8, PACKED, 4, 2, 128, dtype=BF16),
    Workload("packed-fwdbwd", 8, PACKED, 4, 2, 128, backward=True, dtype=BF16),
    Workload("long-history-fwd", 1, ((32768, 128),), 4, 2, 128, dtype=BF16),
    Workload("long-history-fwdbwd", 1, ((32768, 128),), 4, 2, 128, backward=True, dtype=BF16),
]
# FlexAttention's compile (about 75 s of the budget for both directions) is spent only where
# a target compares against it; the long-history targets are shares of the matmul rate.
NO_TORCH_PEERS = ("long-history-fwd", "long-history-fwdbwd")
# FlexAttention only where a target compares against it (nano, packed): its compile is the
# largest cost of a workload, and the production-heads workloads' targets are mosaic_gpu's.
NO_FLEX = ("prod-heads-fwd", "prod-heads-fwdbwd")
# mosaic_gpu is timed where its targets are, and beside FlexAttention on nano-fwdbwd (its
# compile costs about 3 pallas_triton ones: the budget allows no more).
MOSAIC_WORKLOADS = ("prod-heads-fwd", "prod-heads-fwdbwd", "nano-fwdbwd", "long-history-fwd",
                    "long-history-fwdbwd")
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
PRECISION_CASE = CHECKS[1]  # the one case those two precisions are checked on
# Dense-mask peers are skipped when their float32 logits alone would exceed this.
DENSE_LIMIT_BYTES = 24 << 30


def log(message: str) -> None:
    print(f"[{time.perf_counter() - START:6.1f} s] {message}", flush=True)


# --- (b) timings. -------------------------------------------------------------------


def bf16_matmul_rate(n: int, repeats: int) -> float:
    a = jax.random.normal(jax.random.PRNGKey(0), (n, n), jnp.bfloat16)
    mm = jax.jit(lambda a: a @ a)
    return 2 * n ** 3 / peers.interleaved_medians({"mm": lambda: mm(a)}, repeats)["mm"]


def makers(w: Workload, impls: dict, device: str, failures: list[str],
           with_torch: bool = bench.torch is not None) -> dict:
    """{name: a maker of the zero-argument callable} of every implementation timed on ``w``
    (nothing is built yet; the names also price the workload in gpu_plan.Costs.workload);
    torch's peers ``with_torch``, except on NO_TORCH_PEERS (and FlexAttention on NO_FLEX);
    mosaic_gpu, when ``impls`` has it, on MOSAIC_WORKLOADS only."""
    with_torch = with_torch and w.name not in NO_TORCH_PEERS
    out = {name: functools.partial(bench.jax_runner, w, bench.rankattn_with(impl))
           for name, impl in impls.items()
           if name != "mosaic_gpu" or w.name in MOSAIC_WORKLOADS}
    if w.name == "nano-fwd":  # what the xla backend did on GPUs before: float32 "highest" dots
        out["xla (float32 highest)"] = functools.partial(
            bench.jax_runner, w, bench.rankattn_with(Xla(mixed_precision=False)))
    if w.batch * w.q_heads * w.seq_len ** 2 * 4 <= DENSE_LIMIT_BYTES:
        for implementation in ("cudnn", "xla"):
            out[f"jax.nn.dpa ({implementation}, dense mask)"] = functools.partial(
                bench.jax_runner, w, functools.partial(peers.jax_nn_attention,
                                                       implementation=implementation))
        if with_torch:
            out["torch sdpa (dense mask)"] = functools.partial(bench.torch_sdpa, w, device)
    else:
        failures.append(f"{w.name}: dense-mask peers skipped (logits over "
                        f"{DENSE_LIMIT_BYTES >> 30} GiB)")
    if with_torch and w.name not in NO_FLEX:
        out["torch flex (compiled)"] = functools.partial(bench.torch_flex, w, device)
    return out


def priced(names: list[str]) -> list[str]:
    """The names a run builds: jax.nn's XLA path only as cuDNN's fallback, so it is not
    priced beside cuDNN."""
    return [n for n in names if not (n.startswith("jax.nn.dpa (xla")
                                     and "jax.nn.dpa (cudnn, dense mask)" in names)]


def runners(w: Workload, impls: dict, device: str, failures: list[str]) -> dict:
    """Zero-argument callables for every implementation that compiles and runs on ``w``."""
    fns = {}
    for name, make in makers(w, impls, device, failures).items():
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


def same_configuration_dropped(impls: dict, w: Workload) -> dict:
    """The built-in default only where the tuned table changes the workload's configuration."""
    name = "pallas_triton (built-in default)"
    if name not in impls:
        return impls
    args = (w.dtype, w.head_dim, w.q_heads // w.kv_heads)
    if impls["pallas_triton"].config(*args) == impls[name].config(*args):
        return {k: v for k, v in impls.items() if k != name}
    return impls


def mosaic_runs(capability, smoke: bool) -> bool:
    """Whether mosaic_gpu is checked and timed: on sm_90 (its kernels' only GPU), not in
    --smoke (its interpret mode runs eagerly only, and the checks and timings jit)."""
    return (tuple(capability) == gpu_tune.MOSAIC_CAPABILITY and not smoke
            and mosaic_gpu.IMPORT_ERROR is None)


def timed_impls(table: str | None, tune: bool, smoke: bool, capability=(0, 0)) -> dict:
    """The rankattn rows of (b): pallas_triton reading ``table`` (the tuned table this run
    wrote; None: the table it reads by default), the built-in default beside it when the
    tune phase ran, mosaic_gpu (reading the same table) where it runs, and the xla backend.
    The table is read when a call is configured, so what the tune phase wrote is what runs
    (gpu_config.load_table reads a rewritten file again)."""
    impls = {"pallas_triton": PallasTriton(tuned=table, interpret=smoke)}
    if tune:
        impls["pallas_triton (built-in default)"] = PallasTriton(tuned=False, interpret=smoke)
    if mosaic_runs(capability, smoke):
        impls["mosaic_gpu"] = MosaicGpu(tuned=table)
    impls["xla"] = Xla()
    return impls

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
    # mosaic_gpu (issue 38): at Phoenix's production shape against pallas_triton and cuDNN's
    # dense-mask attention, and on long histories as a share of the matmul rate.
    mosaic = lambda workload: by.get((workload, "mosaic_gpu"))  # noqa: E731
    for peer, need in (("pallas_triton", 1.3), ("jax.nn.dpa (cudnn, dense mask)", 1.0)):
        mine, theirs = mosaic("prod-heads-fwdbwd"), by.get(("prod-heads-fwdbwd", peer))
        verdict(f"prod-heads-fwdbwd: mosaic_gpu vs {peer}",
                theirs["ms"] / mine["ms"] if mine and theirs else None, need)
    for workload in ("long-history-fwd", "long-history-fwdbwd"):
        verdict(f"{workload}: mosaic_gpu share of the bf16 matmul rate",
                mosaic(workload)["mm"] if mosaic(workload) else None, 0.45, "%")
    fast, slow = by.get(("nano-fwd", "xla")), by.get(("nano-fwd", "xla (float32 highest)"))
    verdict("nano-fwd: xla bf16 dots vs its float32 'highest' path",
            slow["ms"] / fast["ms"] if fast and slow else None, 3.0)
    return lines


def case_call(case) -> AttentionCall:
    """The shapes and dtype of a CHECKS case, as a backend's not_supported_reasons takes."""
    b, s, hq, hkv, d, dv, dtype, causal, softcap, method = case
    shape = lambda h, dim: jax.ShapeDtypeStruct((b, s, h, dim), dtype)  # noqa: E731
    return AttentionCall(q=shape(hq, d), k=shape(hkv, d), v=shape(hkv, dv), segment_ids=None,
                         causal=causal, scale=1.0, softcap=softcap, softcap_method=method)


# --- Report. ------------------------------------------------------------------------


def tune_section(summaries: list[dict], table: dict | None, paths: list[str]) -> list[str]:
    """GPU.md's tune phase: every candidate's result and the table written."""
    out = ["## (t) Tune phase", "",
           "Forward + backward of the nano layout (1024 history + 128 candidates per row, "
           f"B={gpu_tune.TUNE_BATCH}) per class; each candidate checked against the reference "
           "first, then timed in rounds interleaved with the built-in default run twice (a "
           "sample: back-to-back calls lasting at least "
           f"{gpu_plan.SAMPLE_S * 1e3:.0f} ms). ratio = median over rounds of candidate / "
           "default (< 1: faster); spread = median |default again / default - 1|; a candidate "
           "enters the table when it beats both runs of the default in most rounds and its "
           f"gain exceeds the spread (and {gpu_tune.MIN_GAIN:.0%}). Candidates: "
           "benchmarks/gpu_compile.py tune_candidates, less those spilling over "
           f"{gpu_tune.SPILL_LIMIT} bytes per thread in the deviceless compile.", "",
           "| class | configuration | compile s | max error | ms | default ms | ratio | spread "
           "| wins | status |",
           "|---|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for summary in summaries:
        for r in summary["rows"]:
            name = gpu_tune.describe(r["options"]) + (" (default)" if r["default"] else "")
            cells = [f"{r[k]:.3g}" if isinstance(r.get(k), float) else "" for k in
                     ("compile_s", "max_error", "ms", "default_ms", "ratio", "spread")]
            wins = f"{r['wins']}/{r['rounds']}" if "wins" in r else ""
            status = r["status"] if len(r["status"]) < 80 else r["status"][:77] + "..."
            if summary.get("best") is r:
                status += ", entered"
            elif r.get("enters"):
                status += ", beaten by another"
            out.append(f"| {r['tune_class']} | {name} | " + " | ".join(cells)
                       + f" | {wins} | {status} |")
    out += ["", f"Tuned table written ({', '.join(paths) or 'nowhere'}):", ""]
    if table and table["entries"]:
        out += ["| compute capability | dtype | head dim | group | configuration | ms | "
                "default ms |", "|---|---|---|---|---|---:|---:|"]
        for e in table["entries"]:
            c, m = e["config"], e.get("measured", {})
            opts = gpu_compile.option(c["block_q"], c["block_k"], c["num_warps"],
                                      c["num_stages"], c["split_dkv"], c["key_major"])
            if e.get("backend") == "mosaic_gpu":
                opts = dict(backend="mosaic_gpu", block_sizes=[c["block_q"], c["block_k"]],
                            pipeline_depth=c["num_stages"] or mosaic_gpu.PIPELINE_DEPTH)
            out.append(f"| {e['compute_capability']} | {e['dtype']} | {e['head_dim']} | "
                       f"{e['group']} | {gpu_tune.describe(opts)} | {m.get('ms', '')} | "
                       f"{m.get('default_ms', '')} |")
    else:
        out.append("- no entry: no candidate beat the built-in default by more than its "
                   "spread (or none was timed)")
    return out + [""]


def ptxas_programs(summaries: list[dict], capability, dry: bool) -> list[tuple]:
    """(Config, options): the built-in default of the first (production) class, the
    baseline on this machine's ptxas (every default's deviceless report is in
    GPU_COMPILE.md), and the tuned configuration of each class with an entry, once per
    dtype, head dim and configuration (GQA changes no kernel's resources: GPU_COMPILE.md's
    gqa rows). A dry run assumes every class has an entry (options unknown: None)."""
    variants = {}
    for i, summary in enumerate(summaries):
        cls = summary["cls"]
        chosen = [("default", gpu_tune.default_options(cls, capability))] if i == 0 else []
        if "best" in summary or dry:
            chosen.append(("tuned", None if dry else summary["best"]["options"]))
        for label, o in chosen:
            if o is not None and gpu_tune.is_mosaic(o):  # its sm_90a report: GPU_COMPILE.md
                continue
            key = (cls.dtype, cls.head_dim, label if dry else json.dumps(o))
            variants.setdefault(key, (gpu_compile.Config(
                label, dtype=cls.dtype, head_dim=cls.head_dim, q_heads=cls.q_heads,
                kv_heads=cls.kv_heads), o))
    return list(variants.values())


def registers_section(programs: list[tuple], smoke: bool) -> list[str]:
    """ptxas -v of ``programs`` for sm_90, compiled in a child by this machine's own CUDA
    plugin (nothing installed)."""
    out = ["## (r) Registers and spills (ptxas -v, sm_90, this machine's CUDA plugin)", ""]
    if smoke:
        return out + ["- not measured in --smoke (no CUDA plugin)"]
    cfgs, options = [c for c, _ in programs], [o for _, o in programs]
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


# What was checked of the JAX API this script and pallas_triton use, against jax 0.11's
# changelogs (jax 0.11 cannot be installed on the CPU machines; the GPU machine has it).
JAX_VERSIONS = [
    "Runs on jax 0.10.2 (CI, pip's newest here) and is written for jax 0.11 (the GPU "
    "machine's 0.11.2); pyproject pins no exact version. 0.11 was read, not run: its "
    "changelogs, Pallas changelog and source at jax-v0.11.0 and a main snapshot of 2026-08.",
    "Unchanged in 0.11 (name and signature), as used by pallas_triton, gpu_config, gpu.py and "
    "gpu_tune.py: jax.experimental.pallas (pallas_call with name / interpret / "
    "compiler_params, BlockSpec, program_id, ds, multiple_of), jax.experimental.pallas.triton "
    "(CompilerParams(num_warps, num_stages); the module still imports), lax.dot_general "
    "precisions and DotAlgorithmPreset.BF16_BF16_F32_X3, fori_loop, custom_vjp with "
    "nondiff_argnums, jit(...).trace(...).lower(lowering_platforms=...).compile(), "
    "Device.compute_capability (a string like \"9.0\"), ShapeDtypeStruct(sharding=), "
    "topologies.get_topology_desc, SingleDeviceSharding; interpret=True still runs on CPU.",
    "Changed in 0.11: the Pallas Triton lowering is deprecated (a DeprecationWarning, "
    "jax-pallas-triton, once per kernel lowered for CUDA; Python hides it by default; it "
    "still lowers). Lowering for CUDA without a GPU no longer assumes compute capability 9.0 "
    "(pull request #38762, not in the changelog): it raises \"No supported GPU devices "
    "found\" unless an abstract mesh names the GPU; gpu_config.lowering_without_gpu() "
    "provides one (used by the tests and gpu_compile.py; jax 0.10 ignores it, checked: the "
    "same kernels and registers). Python 3.11 support was dropped (the GPU machine has 3.12).",
    "mosaic_gpu against jax-v0.11.0's source (read, not run; issue 38): plgpu.kernel (the "
    "kernel's name still from the body's __name__), CompilerParams(approx_math, "
    "lowering_semantics; its default becomes Warpgroup, which mosaic_gpu sets explicitly), "
    "emit_pipeline_warp_specialized (same body and compute_context signatures; a new "
    "manual_ready_barriers=False), BlockSpec (squeezed None dims; a new oob_fill_mode "
    "defaulting to zeros, as before), copy_gmem_to_smem (a new impl defaulting to TMA), "
    "wgmma, transpose_ref, ACC / ACC.init, run_scoped / run_state, SMEM, Barrier, "
    "barrier_arrive / wait, copy_smem_to_gmem, commit_smem, wait_smem_to_gmem: unchanged or "
    "only new defaulted arguments. Its interpret mode is not: 0.11 rewrote the interpreter's "
    "threads, so rankattn's fixes of it apply to jax 0.10 only, and MosaicGpu(interpret=True) "
    "declines there with the reason.",
]


class Run:
    """One GPU run: its phases (gpu_plan.Phases) and everything they measured, written as
    GPU.md and results/gpu.json after every phase."""

    def __init__(self, args, dry: bool = False):
        self.args, self.smoke, self.dry = args, args.smoke, dry
        self.md_path = args.md or (None if args.smoke or dry else os.path.join(HERE, "GPU.md"))
        self.json_path = None if args.smoke or dry else RESULTS_JSON
        self.costs = gpu_plan.Costs(gpu_plan.compile_report())
        self.phases = gpu_plan.Phases(args.budget, START)
        self.failures: list[str] = []
        self.checks: list[dict] = []
        self.summaries: list[dict] = []
        self.rows: list[dict] = []
        self.registers: list[str] = []
        self.table, self.table_paths = None, []
        self.rate = None
        if dry:
            self.capability, self.platform, self.tune = (9, 0), "gpu", True
            self.header = []
            return
        self.platform = jax.default_backend()
        self.device = "cuda" if self.platform == "gpu" else "cpu"
        self.tune = args.tune if args.tune is not None else self.platform == "gpu"
        if pallas_triton.IMPORT_ERROR is not None:
            self.tune = False
            self.failures.append(f"pallas_triton not measured: this JAX has no Pallas Triton "
                                 f"lowering ({pallas_triton.IMPORT_ERROR})")
        self.capability = PallasTriton().gpu_target().compute_capability
        try:
            import triton
            triton_version = triton.__version__
        except ImportError:
            triton_version = "not installed"
        torch_version = bench.torch.__version__ if bench.torch is not None else "not installed"
        command = COMMAND if not self.smoke else (
            f"python benchmarks/gpu.py --smoke{' --tune' if self.tune else ''}")
        self.command = command
        self.header = [f"Measured {datetime.date.today()} on {jax.devices()[0].device_kind} "
                       f"({self.platform}) with jax {jax.__version__}, torch {torch_version}, "
                       f"triton {triton_version}; command: `{command}`."]

    # --- The plan: (name, estimate, body) in order of value. ----------------------------

    def plan(self) -> list[tuple]:
        steps = [("(a) correctness", self.correctness_estimate, self.correctness)]
        if self.tune:
            for cls in gpu_tune.classes(self.smoke):
                steps.append((f"(t) tune {cls.name}",
                              functools.partial(self.tune_estimate, cls),
                              functools.partial(self.tune_class, cls)))
        steps.append(("bf16 matmul rate", lambda: gpu_plan.MATMUL_S, self.matmul_rate))
        for w in self.workloads():
            steps.append((f"(b) {w.name}", functools.partial(self.workload_estimate, w),
                          functools.partial(self.workload, w)))
        if self.tune:
            steps.append(("(r) ptxas registers", self.registers_estimate, self.ptxas))
        return steps

    def workloads(self) -> list[Workload]:
        if not self.smoke:
            return WORKLOADS
        return [smoke_version(w) for w in WORKLOADS if w.name in SMOKE_WORKLOADS]

    def check_impls(self, case) -> tuple[dict, dict]:
        """(a)'s implementations of ``case`` and their own tolerances: pallas_triton with the
        configurations before this run's tuning, its float32 tensor-core precisions on
        PRECISION_CASE, mosaic_gpu where it runs and takes the case, and xla."""
        impls, tolerances = {}, {}
        if mosaic_runs(self.capability, self.smoke) and not MosaicGpu().not_supported_reasons(
                case_call(case)):
            impls["mosaic_gpu"] = MosaicGpu(tuned=False)
        if pallas_triton.IMPORT_ERROR is None:
            impls["pallas_triton"] = PallasTriton(interpret=self.smoke)
            if case == PRECISION_CASE:
                for p in ("high", "default"):  # "high" three bf16 passes, "default" one tf32
                    name = f"pallas_triton precision={p}"
                    impls[name] = PallasTriton(precision=p, interpret=self.smoke)
                    tolerances[name] = PRECISION_TOLERANCE[p]
        impls["xla"] = Xla()
        return impls, tolerances

    def check_cases(self) -> list[tuple]:
        if not self.smoke:
            return CHECKS
        # short and narrow enough for interpret mode
        return [(c[0], min(c[1], 40), *c[2:]) for c in CHECKS[-2:]]

    def correctness_estimate(self) -> float:
        programs, mosaic, others = [], [], 0
        for case in self.check_cases():
            impls, _ = self.check_impls(case)
            pallas = [impl for impl in impls.values() if isinstance(impl, PallasTriton)]
            head_dim = gpu_config.padded_head_dim(max(case[4], case[5]))
            programs += [(case[6], head_dim, None, impl.precision) for impl in pallas]
            checks_mosaic = "mosaic_gpu" in impls
            mosaic += [(case[6], head_dim)] if checks_mosaic else []
            others += len(impls) - len(pallas) - checks_mosaic + 1  # + the reference
        return self.costs.correctness(programs, others, mosaic)

    def tune_candidates(self, cls) -> list[dict]:
        report = None if self.smoke else gpu_plan.compile_report()
        if report is None and not self.smoke:
            log("results/gpu_candidates.json is missing: every candidate is tried")
        return gpu_tune.planned(cls, self.capability, self.smoke, report)

    def tune_estimate(self, cls) -> float:
        return self.costs.tune_class(
            cls.dtype, cls.head_dim, [c["options"] for c in self.tune_candidates(cls)],
            gpu_tune.default_options(cls, self.capability), cls.workload(self.smoke).flops,
            self.args.repeats)

    def workload_impls(self, w: Workload) -> dict:
        impls = timed_impls(self.table_paths[0] if self.table_paths else None, self.tune,
                            self.smoke, self.capability)
        return impls if self.dry else same_configuration_dropped(impls, w)

    def workload_estimate(self, w: Workload) -> float:
        # A dry run prices torch's peers: the GPU machine has torch.
        names = list(makers(w, self.workload_impls(w), "cpu", [],
                            with_torch=self.dry or bench.torch is not None))
        return self.costs.workload(w, priced(names), self.args.repeats)

    def registers_estimate(self) -> float:
        summaries = self.summaries or [dict(cls=c) for c in gpu_tune.classes(self.smoke)]
        return self.costs.ptxas([(c.dtype, c.head_dim, o) for c, o in
                                 ptxas_programs(summaries, self.capability, self.dry)])

    # --- The phases' bodies. ---------------------------------------------------------

    def correctness(self) -> None:
        for case in self.check_cases():
            impls, tolerances = self.check_impls(case)
            self.checks += device_checks.correctness(case, impls, TOLERANCE, tolerances)
            for c in self.checks[-len(impls):]:
                verdict = "pass" if c["ok"] else f"FAIL {c.get('errors') or c.get('error')}"
                log(f"check {c['case']} {c['impl']}: {verdict}")

    def tune_class(self, cls) -> None:
        jsonl = os.path.join(self.args.out or os.path.join(HERE, "out"), "tune.jsonl")
        if not self.summaries:
            log(f"tune phase: results appended to {jsonl}")
            os.makedirs(os.path.dirname(os.path.abspath(jsonl)), exist_ok=True)

        def record(row):
            with open(jsonl, "a") as f:
                f.write(json.dumps(row) + "\n")

        summary = gpu_tune.tune_class(
            cls, self.tune_candidates(cls), self.capability,
            deadline=time.perf_counter() + self.phases.left(), smoke=self.smoke,
            rounds=self.args.repeats, tolerance=TOLERANCE[cls.dtype], pool=self.pool(),
            record=record, log=log)
        self.summaries.append(summary)
        self.write_table()

    def pool(self) -> concurrent.futures.ThreadPoolExecutor:
        """The tune phase's compile threads (XLA's compile drops the GIL), made once."""
        if not hasattr(self, "_pool"):
            workers = 2 if self.smoke else max(1, min(8, (os.cpu_count() or 2) - 1))
            self._pool = concurrent.futures.ThreadPoolExecutor(workers)
        return self._pool

    def write_table(self) -> None:
        """The tuned table from every class so far, to the package's table (or --table) and
        under --out; a smoke run writes under --out only."""
        entries = gpu_tune.table_entries(self.summaries, self.capability,
                                         gpu_tune.classes(self.smoke))
        paths = [self.args.table or (None if self.smoke else str(gpu_config.table_path()))]
        paths.append(self.args.out and os.path.join(self.args.out, "gpu_tuned.json"))
        if self.smoke and not any(paths):
            paths = [os.path.join(HERE, "out", "gpu_tuned.json")]
        self.table_paths = list(filter(None, paths))
        for path in self.table_paths:
            self.table = gpu_tune.write_table(path, entries, self.capability, gpu_tune.provenance(
                jax.devices()[0].device_kind, self.command))
            log(f"wrote {path} ({len(entries)} entries for compute capability "
                f"{'.'.join(map(str, self.capability))})")

    def matmul_rate(self) -> None:
        n = 256 if self.smoke else 8192
        self.rate = bf16_matmul_rate(n, self.args.repeats)
        self.header.append(f"bf16 matmul rate in this run ({n}^3, XLA): "
                           f"{self.rate / 1e12:.1f} TFLOP/s.")
        log(self.header[-1])

    def workload(self, w: Workload) -> None:
        rows = time_workload(w, self.workload_impls(w), self.device, self.args.repeats,
                             self.rate or float("nan"), self.failures)
        for r in rows:
            log(f"{w.name} {r['impl']}: {r['ms']:.2f} ms, {r['tflops']:.1f} TFLOP/s, "
                f"{r['mm']:.0%} mm, ratio {r['ratio']:.2f}")
        self.rows += rows

    def ptxas(self) -> None:
        self.registers = registers_section(
            ptxas_programs(self.summaries, self.capability, False), self.smoke)

    # --- Running and reporting. -------------------------------------------------------

    def run(self) -> None:
        self.phases.record("start-up", gpu_plan.STARTUP_S, time.perf_counter() - START)
        log(self.header[0])
        log(f"rankattn.available_impls() = {rankattn.available_impls()}")
        if self.platform != "gpu" and not self.smoke:
            log("no GPU here: run with --smoke to check the script on CPU")
        try:
            for name, estimate, body in self.plan():
                self.phases.run(name, estimate(), body, log)
                self.write(final=False)
        finally:
            if hasattr(self, "_pool"):  # compiles past a deadline are not waited for
                self._pool.shutdown(wait=False, cancel_futures=True)
        self.write(final=True)

    def markdown(self) -> str:
        out = ["# rankattn on a GPU", "", *self.header, "",
               "## Phases: estimated (benchmarks/gpu_plan.py) and measured", "",
               *self.phases.markdown(), "", *device_checks.markdown(self.checks, TOLERANCE), ""]
        if self.tune:
            out += tune_section(self.summaries, self.table, self.table_paths)
        out += ["## (b) bf16 timings, interleaved medians", "",
                "TFLOP/s count visible query-key pairs only (forward 4 * D flops per pair and "
                "head, forward + backward 3.5x that); % mm is the share of the bf16 matmul rate "
                "measured in this run; ratio = time / pallas_triton's time (> 1: slower than "
                "pallas_triton). pallas_triton reads the tuned table this run wrote; "
                "\"pallas_triton (built-in default)\" is the configuration before tuning, run "
                "where the two differ.", "",
                "| workload | impl | median ms | TFLOP/s | % mm | ratio |",
                "|---|---|---:|---:|---:|---:|"]
        out += [f"| {r['workload']} | {r['impl']} | {r['ms']:.2f} | {r['tflops']:.1f} | "
                f"{r['mm']:.0%} | {r['ratio']:.2f} |" for r in self.rows]
        out += ["", "## Targets", "", *targets(self.rows)]
        if self.registers:
            out += ["", *self.registers]
        out += ["", "## JAX versions", "", *(f"- {line}" for line in JAX_VERSIONS)]
        if self.failures:
            out += ["", "## Failures and skips", "", *(f"- {f}" for f in self.failures)]
        return "\n".join(out) + "\n"

    def to_json(self) -> dict:
        return dict(header=self.header, phases=self.phases.to_json(), checks=self.checks,
                    tune=[r for s in self.summaries for r in s["rows"]], table=self.table,
                    rows=self.rows, targets=targets(self.rows), failures=self.failures)

    def write(self, final: bool) -> None:
        """GPU.md and the JSON (and copies under --out); the final report is printed too."""
        report = self.markdown()
        if final:
            print("\n" + report, flush=True)
        out = self.args.out
        texts = {self.md_path: report, out and os.path.join(out, "GPU.md"): report,
                 self.json_path: None, out and os.path.join(out, "gpu.json"): None}
        for path, text in texts.items():
            if not path:
                continue
            os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
            with open(path, "w") as f:
                f.write(text if text is not None
                        else json.dumps(self.to_json(), indent=1, default=str) + "\n")
            if final:
                log(f"wrote {path}")

    def dry_run(self) -> None:
        """What a GPU run would do, and each phase's estimate, without running it."""
        lines = ["| phase | estimated s |", "|---|---:|",
                 f"| start-up | {gpu_plan.STARTUP_S:.1f} |"]
        total, cut = gpu_plan.STARTUP_S, []
        for name, estimate, _ in self.plan():
            seconds = estimate()
            total += seconds
            lines.append(f"| {name} | {seconds:.1f} |")
            if total > self.args.budget:
                cut.append(name)
        lines += [f"| **total** | {total:.1f} |", "",
                  f"Estimated: {total:.0f} s ({total / 60:.1f} min) of the {self.args.budget:.0f} s "
                  "budget (one command may run 600 s); "
                  + (f"past the budget, these would be skipped: {', '.join(cut)}." if cut
                     else "every phase fits.")]
        report = "\n".join([
            "# rankattn on a GPU", "",
            "**Pending: no GPU has run this check yet.** Every figure awaits one run of", "",
            "```", COMMAND, "```", "",
            "on a CUDA machine with jax (its CUDA plugin), torch and triton installed; it needs "
            "no network and no install step. That run replaces this file with its measured "
            "report: every phase's estimate beside its measured time, (a) correctness of "
            "pallas_triton, mosaic_gpu (on sm_90) and xla against the reference on the GPU, "
            "(t) the tune phase's candidates (mosaic_gpu's among the production class's), "
            "checked and timed against the built-in default, and the tuned table it writes "
            "(src/rankattn/backends/gpu_tuned.json), (b) bf16 timings beside "
            "jax.nn.dot_product_attention with the dense mask (cuDNN, else XLA), torch SDPA and "
            "compiled FlexAttention, the targets, each MET or MISSED, and (r) ptxas' registers "
            "for sm_90.", "",
            "## The plan of that run on an H100 / H200 (sm_90), estimated", "",
            f"Generated by `.venv/bin/python benchmarks/gpu.py --dry-run` on "
            f"{datetime.date.today()} (benchmarks/gpu_plan.py): compile seconds from the "
            "deviceless compile of benchmarks/results/gpu_candidates.json (and "
            f"gpu_compile.json for mosaic_gpu) x{gpu_plan.COMPILE_FACTOR:g}, other XLA programs {gpu_plan.XLA_COMPILE_S:g} s, "
            f"FlexAttention's torch.compile {gpu_plan.FLEX_COMPILE_S:g} s a workload, calls at "
            f"{gpu_plan.KERNEL_SHARE:.0%} (dense-mask peers {gpu_plan.DENSE_SHARE:.0%} of all "
            f"pairs) of {gpu_plan.PEAK_FLOPS / 1e12:.0f} TFLOP/s; the tune phase assumes every "
            "class's default is beaten (so the built-in default is timed beside the tuned "
            "table in every workload).", "", *lines, "",
            "## JAX versions", "", *(f"- {line}" for line in JAX_VERSIONS), "",
            "Checked without a GPU: the kernels give the reference's results in Pallas "
            "interpret mode and mosaic_gpu's in JAX's Mosaic GPU interpreter (the test suite), "
            "compile for sm_80 / sm_89 / sm_90 (GPU_COMPILE.md; mosaic_gpu for sm_90a), and "
            "this script, tune phase included, runs end to end on CPU: "
            "`.venv/bin/python benchmarks/gpu.py --smoke --tune`.", ""])
        print(report)
        for path in filter(None, [self.args.md, self.args.out and
                                  os.path.join(self.args.out, "GPU.md")]):
            os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
            with open(path, "w") as f:
                f.write(report)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true",
                        help="tiny shapes on CPU, kernels in interpret mode")
    parser.add_argument("--repeats", type=int, default=9,
                        help="timing rounds of every workload and tune candidate")
    parser.add_argument("--budget", type=float, default=gpu_plan.COMMAND_S,
                        help="seconds from the start a run may take; a phase whose estimate "
                             "does not fit what is left is skipped (default %(default)s)")
    parser.add_argument("--tune", action=argparse.BooleanOptionalAction, default=None,
                        help="run the tune phase (default: on a GPU)")
    parser.add_argument("--table", help="where the tune phase writes its table (default "
                                        "the one pallas_triton reads: $RANKATTN_GPU_TUNED, "
                                        "else src/rankattn/backends/gpu_tuned.json; with "
                                        "--smoke only under --out)")
    parser.add_argument("--dry-run", action="store_true",
                        help="print the plan and each phase's estimate; run nothing")
    parser.add_argument("--md", help="where to write the report (default benchmarks/GPU.md, "
                                     "none with --smoke)")
    parser.add_argument("--out", help="also copy the report and its JSON into this folder; "
                                      "tune.jsonl and gpu_tuned.json go there too")
    args = parser.parse_args()
    run = Run(args, dry=args.dry_run)
    if args.dry_run:
        return run.dry_run()
    run.run()
    if not all(c["ok"] for c in run.checks):
        sys.exit(1)


if __name__ == "__main__":
    main()
