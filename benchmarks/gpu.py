"""One-command GPU check of rankattn: correctness on the GPU, then bf16 timings beside the peers.

On a CUDA machine with jax (CUDA plugin), torch and triton installed; no network needed:

    PYTHONPATH=src python benchmarks/gpu.py --out "$OUT"

(a) checks pallas_triton and xla against the reference on the GPU: out, lse and the
    gradients of a loss with an lse term, float32 / bfloat16 / float16, odd shapes, packed
    rows with padding;
(b) times bf16 forward and forward+backward of the nano, production-heads, packed and
    long-history workloads for every rankattn backend and, interleaved in the same process,
    jax.nn.dot_product_attention with the dense mask (cuDNN where it takes the mask, else
    XLA), torch SDPA with a boolean mask and compiled FlexAttention with the same mask_mod
    (skipped with a note when torch is missing).

It prints TFLOP/s on visible pairs, peer / pallas_triton ratios and the fraction of the bf16
matmul rate measured in the same run, progress as it goes, and writes benchmarks/GPU.md
(and a copy under --out). A step that fails is reported, not fatal; past --budget seconds
the remaining workloads are skipped and listed.

    .venv/bin/python benchmarks/gpu.py --smoke

runs the whole script on CPU with tiny shapes (bench.smoke_version) and the kernels in Pallas
interpret mode, timing SMOKE_WORKLOADS only, to check it before spending GPU time (it writes
no GPU.md unless --md is given).
"""

from __future__ import annotations

import argparse
import datetime
import functools
import os
import sys
import time

# JAX would otherwise take 75% of the GPU's memory up front, leaving torch's peers little.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench  # noqa: E402  (the workloads and the torch peers)
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


def packed_segments(rng, batch: int, seq: int) -> np.ndarray:
    """Rows of consecutive sessions (history, then candidates) with padding between and after."""
    rows = []
    for _ in range(batch):
        row, session = [], 1
        while len(row) < seq:
            history, candidates, gap = rng.integers(1, 200), rng.integers(0, 40), rng.integers(0, 3)
            row += [session] * history + [-session] * candidates + [0] * gap
            session += 1
        rows.append(row[:seq])
    return np.array(rows, np.int32)


def check(case, impls: dict) -> list[dict]:
    b, s, hq, hkv, d, dv, dtype, causal, softcap, method = case
    rng = np.random.default_rng(s)
    q = rng.normal(0, 1.5, (b, s, hq, d))
    k, v = rng.normal(0, 1, (b, s, hkv, d)), rng.normal(0, 1, (b, s, hkv, dv))
    w = jnp.asarray(rng.normal(0, 1, (b, s, hq, dv)), jnp.float32)
    q, k, v = (jnp.asarray(x, dtype) for x in (q, k, v))
    seg = jnp.asarray(packed_segments(rng, b, s))

    @functools.partial(jax.jit, static_argnums=3)
    def outputs_and_grads(q, k, v, impl):
        def loss(q, k, v):
            out, lse = rankattn.attention(q, k, v, segment_ids=seg, causal=causal,
                                          softcap=softcap, softcap_method=method,
                                          return_lse=True, impl=impl)
            finite = jnp.where(jnp.isfinite(lse), lse, 0.0)
            return jnp.sum(out.astype(jnp.float32) * w) + 0.1 * jnp.sum(finite ** 2), (out, lse)

        (_, (out, lse)), grads = jax.value_and_grad(loss, (0, 1, 2), has_aux=True)(q, k, v)
        return (out, lse, *grads)

    up = (x.astype(jnp.float32) for x in (q, k, v))
    want = [np.asarray(x, np.float32) for x in outputs_and_grads(*up, "reference")]
    blind = np.asarray(seg == 0)
    rows = []
    for name, impl in impls.items():
        row = dict(case=f"B={b} S={s} H={hq}/{hkv} D={d} Dv={dv} {dtype}"
                        f"{' causal' if causal else ''}{f' {method} {softcap}' if softcap else ''}",
                   impl=name)
        try:
            got = [np.asarray(x, np.float32) for x in outputs_and_grads(q, k, v, impl)]
        except Exception as e:  # noqa: BLE001 - reported in GPU.md
            row.update(ok=False, error=f"{type(e).__name__}: {str(e).strip().splitlines()[0][:200]}")
            rows.append(row)
            continue
        errors = {}
        for field, a, e in zip(("out", "lse", "dq", "dk", "dv"), got, want):
            finite = np.isfinite(e)
            same_inf = np.array_equal(np.isfinite(a), finite) and np.array_equal(a[~finite],
                                                                                   e[~finite])
            err = np.abs(a[finite] - e[finite]).max(initial=0) / max(1.0, np.abs(e[finite]).max(
                initial=0))
            errors[field] = err if same_inf and not np.isnan(a).any() else float("inf")
        blind_ok = bool(np.all(got[0][blind] == 0))
        tolerance = max(TOLERANCE[dtype],
                        PRECISION_TOLERANCE.get(getattr(impl, "precision", None), 0.0))
        row.update(errors=errors, blind_ok=blind_ok,
                   ok=blind_ok and max(errors.values()) <= tolerance)
        rows.append(row)
    return rows


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
            failures.append(f"{w.name}: {name} failed: {type(e).__name__}: "
                            f"{str(e).strip().splitlines()[0][:200]}")
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


def markdown(header: list[str], checks: list[dict], rows: list[dict], goals: list[str],
             failures: list[str]) -> str:
    out = ["# rankattn on a GPU", "", *header, "", "## (a) Correctness against the reference",
           "", "Max error / max(1, max |reference|) over out, lse, dq, dk, dv; blind = rows "
           "that see nothing give exactly 0. Tolerance: " +
           ", ".join(f"{k} {v:g}" for k, v in TOLERANCE.items()) + ".", "",
           "| case | impl | out | lse | dq | dk | dv | blind | verdict |",
           "|---|---|---:|---:|---:|---:|---:|---|---|"]
    for c in checks:
        if "errors" not in c:
            out.append(f"| {c['case']} | {c['impl']} | | | | | | | FAILED: {c['error']} |")
            continue
        e = c["errors"]
        out.append(f"| {c['case']} | {c['impl']} | " + " | ".join(
            f"{e[f]:.1e}" for f in ("out", "lse", "dq", "dk", "dv")) +
            f" | {'ok' if c['blind_ok'] else 'NOT ZERO'} | {'pass' if c['ok'] else 'FAIL'} |")
    out += ["", "## (b) bf16 timings, interleaved medians", "",
            "TFLOP/s count visible query-key pairs only (forward 4 * D flops per pair and "
            "head, forward + backward 3.5x that); % mm is the share of the bf16 matmul rate "
            "measured in this run; ratio = time / pallas_triton's time (> 1: slower than "
            "pallas_triton).", "",
            "| workload | impl | median ms | TFLOP/s | % mm | ratio |",
            "|---|---|---:|---:|---:|---:|"]
    out += [f"| {r['workload']} | {r['impl']} | {r['ms']:.2f} | {r['tflops']:.1f} | "
            f"{r['mm']:.0%} | {r['ratio']:.2f} |" for r in rows]
    out += ["", "## Targets", "", *goals]
    if failures:
        out += ["", "## Failures and skips", "", *(f"- {f}" for f in failures)]
    return "\n".join(out) + "\n"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true",
                        help="tiny shapes on CPU, kernels in interpret mode")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--budget", type=float, default=330.0,
                        help="seconds after which the remaining workloads are skipped")
    parser.add_argument("--md", help="where to write the report (default benchmarks/GPU.md, "
                                     "none with --smoke)")
    parser.add_argument("--out", help="also copy the report into this folder")
    args = parser.parse_args()
    md_path = args.md or (None if args.smoke else "benchmarks/GPU.md")

    platform = jax.default_backend()
    device = "cuda" if platform == "gpu" else "cpu"
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = "not installed"
    torch_version = bench.torch.__version__ if bench.torch is not None else "not installed"
    header = [f"Measured {datetime.date.today()} on {jax.devices()[0].device_kind} "
              f"({platform}) with jax {jax.__version__}, torch {torch_version}, triton "
              f"{triton_version}; command: `PYTHONPATH=src python benchmarks/gpu.py"
              f"{' --smoke' if args.smoke else ''}`."]
    failures: list[str] = []
    impls = {"pallas_triton": PallasTriton(interpret=args.smoke), "xla": Xla()}
    # float32 on tensor cores: "high" three bf16 passes, "default" one tf32 pass.
    precisions = {f"pallas_triton precision={p}": PallasTriton(precision=p, interpret=args.smoke)
                  for p in ("high", "default")}
    if pallas_triton.IMPORT_ERROR is not None:
        del impls["pallas_triton"]
        precisions = {}
        failures.append(f"pallas_triton not measured: this JAX has no Pallas Triton lowering "
                        f"({pallas_triton.IMPORT_ERROR})")
    log(header[0])
    log(f"rankattn.available_impls() = {rankattn.available_impls()}")
    if platform != "gpu" and not args.smoke:
        log("no GPU here: run with --smoke to check the script on CPU")

    checks = []
    for case in CHECKS[-2:] if args.smoke else CHECKS:
        if args.smoke:  # short and narrow enough for interpret mode
            case = (case[0], min(case[1], 40), *case[2:])
        case_impls = {**impls, **(precisions if case[6] == "float32" else {})}
        checks += check(case, case_impls)
        for c in checks[-len(case_impls):]:
            verdict = "pass" if c["ok"] else f"FAIL {c.get('errors') or c.get('error')}"
            log(f"check {c['case']} {c['impl']}: {verdict}")

    rate = bf16_matmul_rate(256 if args.smoke else 8192, args.repeats)
    header.append(f"bf16 matmul rate in this run ({256 if args.smoke else 8192}^3, XLA): "
                  f"{rate / 1e12:.1f} TFLOP/s.")
    log(header[-1])
    rows = []
    for w in WORKLOADS:
        if args.smoke:
            if w.name not in SMOKE_WORKLOADS:
                continue
            w = smoke_version(w)
        if time.perf_counter() - START > args.budget:
            failures.append(f"{w.name}: skipped, past the {args.budget:.0f} s budget")
            log(failures[-1])
            continue
        rows += time_workload(w, impls, device, args.repeats, rate, failures)
        for r in rows:
            if r["workload"] == w.name:
                log(f"{w.name} {r['impl']}: {r['ms']:.2f} ms, {r['tflops']:.1f} TFLOP/s, "
                    f"{r['mm']:.0%} mm, ratio {r['ratio']:.2f}")
    goals = targets(rows)
    report = markdown(header, checks, rows, goals, failures)
    print("\n" + report, flush=True)
    for path in filter(None, [md_path, args.out and os.path.join(args.out, "GPU.md")]):
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        with open(path, "w") as f:
            f.write(report)
        log(f"wrote {path}")
    if not all(c["ok"] for c in checks):
        sys.exit(1)


if __name__ == "__main__":
    main()
