"""One-command TPU check of rankattn: correctness on the TPU, then bf16 timings beside the peers.

On a TPU machine with jax[tpu] installed; no network needed:

    PYTHONPATH=src python benchmarks/tpu.py --out "$OUT"

(a) checks pallas_tpu and xla against the reference on the TPU: out, lse and the gradients
    of a loss with an lse term, float32 and bfloat16, odd lengths and head dims, GQA 1 and
    5, packed rows with padding between sessions, causal, both soft caps;
(b) times bf16 forward and forward + backward of the nano, production-heads, packed and
    long-history workloads (benchmarks/bench.py's layouts) for pallas_tpu and xla and,
    interleaved in the same process, jax.nn.dot_product_attention with the dense mask and
    splash attention (jax.experimental.pallas.ops.tpu) with the workload's layout as one
    static mask (every row of a workload has the same layout, so one static mask is exact
    there; splash cannot take per-row layouts, which is why pallas_tpu exists), and
    splash with each row's own dense mask through its private dynamic-mask route
    (splash_dynamic_attention; reported as failed where this jax lacks it).

It prints TFLOP/s on visible pairs and the fraction of the chip's bf16 peak
(``pltpu.get_tpu_info()``), writes benchmarks/TPU.md and a JSON of the rows (and copies
under --out) after each phase, so a run cut off keeps what it measured. A step that fails
is reported, not fatal; past --budget seconds (default 420, so that the run, the workload
under way at the budget included, fits one 10-minute command) the remaining workloads are
skipped and listed.

    .venv/bin/python benchmarks/tpu.py --smoke

runs the whole script on CPU with tiny shapes (bench.smoke_version) and every Pallas kernel
(pallas_tpu's and splash's) in interpret mode, to check it before spending TPU time; it
writes no TPU.md unless --md is given. Its timings mean nothing.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench  # noqa: E402  (the workloads)
import device_checks  # noqa: E402
from bench import NANO, PACKED, Workload, smoke_version  # noqa: E402
from rankattn import peers, semantics  # noqa: E402
from rankattn.backends import PallasTpu, Xla  # noqa: E402
from rankattn.backends.pallas_tpu import pltpu  # noqa: E402

START = time.perf_counter()
HERE = os.path.dirname(os.path.abspath(__file__))
BF16 = "bfloat16"
WORKLOADS = [  # in order of importance: the budget cuts from the end
    Workload("nano-fwd", 64, NANO, 4, 2, 128, dtype=BF16),
    Workload("nano-fwdbwd", 64, NANO, 4, 2, 128, backward=True, dtype=BF16),
    Workload("prod-heads-fwd", 64, NANO, 20, 4, 128, dtype=BF16),
    Workload("prod-heads-fwdbwd", 64, NANO, 20, 4, 128, backward=True, dtype=BF16),
    Workload("packed-fwd", 8, PACKED, 4, 2, 128, dtype=BF16),
    Workload("packed-fwdbwd", 8, PACKED, 4, 2, 128, backward=True, dtype=BF16),
    Workload("long-history-fwd", 1, ((32768, 128),), 4, 2, 128, dtype=BF16),
    Workload("long-history-fwdbwd", 1, ((32768, 128),), 4, 2, 128, backward=True, dtype=BF16),
]
SMOKE_WORKLOADS = ("nano-fwd", "packed-fwdbwd")
# device_checks.correctness cases (B, S, Hq, Hkv, D, Dv, dtype, causal, softcap, method):
# odd lengths and head dims.
CHECKS = [
    (2, 333, 10, 2, 80, 80, "bfloat16", False, 30.0, "tanh"),
    (1, 1031, 5, 1, 128, 128, "float32", True, None, "tanh"),
    (2, 77, 8, 8, 200, 200, "float32", False, 5.0, "soft_sign"),
    (3, 1, 2, 2, 64, 64, "bfloat16", False, None, "tanh"),
    (2, 513, 4, 4, 256, 256, "bfloat16", True, None, "tanh"),
    (2, 130, 6, 3, 48, 24, "float32", True, 2.0, "tanh"),
]
SMOKE_CHECKS = [(2, 45, 10, 2, 80, 80, "bfloat16", False, 30.0, "tanh"),
                (1, 37, 5, 1, 64, 32, "float32", True, 5.0, "soft_sign")]
# Max error / max(1, max |reference|) allowed: float32 math on both sides, or bf16 operands
# and outputs (a real mask, scale or gradient bug moves results by O(1)).
TOLERANCE = {"float32": 1e-4, "bfloat16": 2e-2}
DENSE_LIMIT_BYTES = 24 << 30  # dense-mask peers' float32 logits
SPLASH_MASK_LIMIT = 8192      # splash's static numpy mask is S x S bools, processed at trace time


def tpu_smoke_version(w: Workload) -> Workload:
    """bench.smoke_version at 128 tokens a row, the shortest length splash takes (its key
    blocks are multiples of 128, in interpret mode too)."""
    sessions = ((56, 8),) * 2 if len(w.sessions) > 1 else ((112, 16),)
    return dataclasses.replace(smoke_version(w), sessions=sessions)


def log(message: str) -> None:
    print(f"[{time.perf_counter() - START:6.1f} s] {message}", flush=True)


# --- (b) timings. ----------------------------------------------------------------------


def splash_attention(w: Workload, interpret: bool):
    """attend(q, k, v, seg) by splash attention's MQA kernel per kv head (vmapped over batch
    and kv heads, no K / V repeated), the workload's layout as one static NumpyMask."""
    from jax.experimental.pallas.ops.tpu.splash_attention import (
        splash_attention_kernel as splash, splash_attention_mask as masks)

    seg = w.segment_ids()[:1]
    dense = np.asarray(semantics.dense_mask(seg, seg, False))[0]
    group, s = w.q_heads // w.kv_heads, w.seq_len
    block = min(512, s)
    kernel = splash.make_splash_mqa(
        masks.MultiHeadMask([masks.NumpyMask(dense)] * group),
        block_sizes=splash.BlockSizes(block_q=block, block_kv=block, block_kv_compute=block,
                                      block_q_dkv=block, block_kv_dkv=block,
                                      block_kv_dkv_compute=block, use_fused_bwd_kernel=True),
        head_shards=1, q_seq_shards=1, interpret=interpret)
    per_kv_head = jax.vmap(jax.vmap(kernel))  # over batch, then kv heads

    def attend(q, k, v, seg):
        b, _, hq, d = q.shape
        heads = q.reshape(b, s, w.kv_heads, group, d).transpose(0, 2, 3, 1, 4) * d ** -0.5
        out = per_kv_head(heads, k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3))
        return out.transpose(0, 3, 1, 2, 4).reshape(b, s, hq, d)
    return attend


def splash_dynamic_attention(w: Workload, interpret: bool):
    """attend(q, k, v, seg) by splash attention with each row's own mask, built under jit
    from the traced segment ids as a dense [G, S, S] boolean mask (vmapped over batch, MQA
    per kv head): the exact route through splash for per-row layouts. Its public builder
    (make_splash_mqa) cannot take a traced mask in jax 0.10 (TracerBoolConversionError), so
    this goes through the private mask-info functions and SplashAttentionKernel; where they
    moved or changed (a version guard, checked by building one here) it raises, and the
    peer is reported as failed. It materialises the mask, and its lse has no backward."""
    from jax.experimental.pallas.ops.tpu.splash_attention import (
        splash_attention_kernel as splash, splash_attention_mask_info as mask_info)

    group, s = w.q_heads // w.kv_heads, w.seq_len
    block = min(512, s)
    sizes = splash.BlockSizes(block_q=block, block_kv=block, block_kv_compute=block,
                              block_q_dkv=block, block_kv_dkv=block,
                              block_kv_dkv_compute=block, use_fused_bwd_kernel=True)
    shards = dict(downcast_smem_data=True, head_shards=1, q_seq_shards=1)

    def row_kernel(seg_row):
        mask = jnp.broadcast_to(semantics.dense_mask(seg_row[None], seg_row[None], False)[0],
                                (group, s, s))
        fwd, _ = mask_info.process_dynamic_mask(mask, (block, block), **shards)
        dkv, _ = mask_info.process_dynamic_mask_dkv(mask, (block, block), shrink_grid=False,
                                                    **shards)
        return splash.SplashAttentionKernel(
            mask_info.MaskInfo(*fwd), None, mask_info.MaskInfo(*dkv), block_sizes=sizes,
            is_mqa=True, save_residuals=False, mask_value=splash.DEFAULT_MASK_VALUE,
            attn_logits_soft_cap=None, residual_checkpoint_name=None, mask_function=None,
            interpret=interpret)

    jax.eval_shape(row_kernel, jax.ShapeDtypeStruct((s,), jnp.int32))  # the version guard

    def attend(q, k, v, seg):
        b, _, hq, d = q.shape
        heads = q.reshape(b, s, w.kv_heads, group, d).transpose(0, 2, 3, 1, 4) * d ** -0.5
        out = jax.vmap(lambda q, k, v, seg_row: jax.vmap(row_kernel(seg_row))(q, k, v))(
            heads, k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3), seg)
        return out.transpose(0, 3, 1, 2, 4).reshape(b, s, hq, d)
    return attend


def peer_error(w: Workload, attend) -> float:
    """A peer's forward on the workload's first row against the reference: max error /
    max(1, max |reference|). The peers' masks are built here, so they are checked too."""
    q, k, v, seg, _ = (x[:1] for x in bench.inputs(w))
    got, want = (np.asarray(jax.jit(f)(q, k, v, seg), np.float32)
                 for f in (attend, bench.reference))
    return float(np.abs(got - want).max() / max(1.0, np.abs(want).max()))


def runners(w: Workload, impls: dict, interpret: bool, failures: list[str]) -> dict:
    """Zero-argument callables for every implementation that compiles, runs on ``w`` and,
    for a peer, matches the reference."""
    attends = {name: bench.rankattn_with(impl) for name, impl in impls.items()}
    peer_names = []
    if w.batch * w.q_heads * w.seq_len ** 2 * 4 <= DENSE_LIMIT_BYTES:
        attends["jax.nn.dpa (xla, dense mask)"] = peers.jax_nn_attention
        peer_names.append("jax.nn.dpa (xla, dense mask)")
    else:
        failures.append(f"{w.name}: the dense-mask peer skipped (logits over "
                        f"{DENSE_LIMIT_BYTES >> 30} GiB)")
    if w.seq_len <= SPLASH_MASK_LIMIT:
        attends["splash (static mask)"] = functools.partial(splash_attention, w, interpret)
        peer_names.append("splash (static mask)")
    else:
        failures.append(f"{w.name}: splash skipped (a static mask of {w.seq_len}^2 bools)")
    if w.batch * w.q_heads * w.seq_len ** 2 <= DENSE_LIMIT_BYTES:  # its boolean masks
        attends["splash (dynamic mask)"] = functools.partial(splash_dynamic_attention, w,
                                                             interpret)
        peer_names.append("splash (dynamic mask)")
    else:
        failures.append(f"{w.name}: splash's dynamic route skipped (masks over "
                        f"{DENSE_LIMIT_BYTES >> 30} GiB)")
    fns = {}
    for name, attend in attends.items():
        try:
            if name.startswith("splash"):
                attend = attend()  # builds the mask's block lists: may fail too
            error = peer_error(w, attend) if name in peer_names else 0.0
            if error > TOLERANCE[w.dtype]:
                raise ValueError(f"differs from the reference by {error:.2g}")
            fn = bench.jax_runner(w, attend)[0]
            jax.block_until_ready(fn())  # compile and run once
            fns[name] = fn
        except Exception as e:  # noqa: BLE001 - a peer that cannot run is reported
            failures.append(f"{w.name}: {name} failed: {device_checks.first_line(e)}")
            log(failures[-1])
    return fns


def time_workload(w: Workload, impls: dict, interpret: bool, repeats: int, peak: float,
                  failures: list[str]) -> list[dict]:
    fns = runners(w, impls, interpret, failures)
    times = peers.interleaved_medians(fns, repeats) if fns else {}
    base = times.get("pallas_tpu")
    return [dict(workload=w.name, impl=name, ms=t * 1e3, tflops=w.flops / t / 1e12,
                 peak=w.flops / t / peak, ratio=t / base if base else float("nan"))
            for name, t in times.items()]


# --- Report. ---------------------------------------------------------------------------


def markdown(header: list[str], checks: list[dict], rows: list[dict],
             failures: list[str]) -> str:
    out = ["# rankattn on a TPU", "", *header, "", *device_checks.markdown(checks, TOLERANCE)]
    out += ["", "## (b) bf16 timings, interleaved medians", "",
            "TFLOP/s count visible query-key pairs only (forward 4 * D flops per pair and "
            "head, forward + backward 3.5x that); % peak is the share of the chip's bf16 "
            "peak; ratio = time / pallas_tpu's time (> 1: slower than pallas_tpu).", "",
            "| workload | impl | median ms | TFLOP/s | % peak | ratio |",
            "|---|---|---:|---:|---:|---:|"]
    out += [f"| {r['workload']} | {r['impl']} | {r['ms']:.2f} | {r['tflops']:.2f} | "
            f"{r['peak']:.1%} | {r['ratio']:.2f} |" for r in rows]
    if failures:
        out += ["", "## Failures and skips", "", *(f"- {f}" for f in failures)]
    return "\n".join(out) + "\n"


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true",
                        help="CPU, tiny shapes, kernels in interpret mode (checks the script)")
    parser.add_argument("--out", help="folder for copies of the report and the JSON")
    parser.add_argument("--md", help="where to write the report (default benchmarks/TPU.md; "
                                     "none with --smoke)")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--budget", type=float, default=420.0,
                        help="seconds after which the remaining workloads are skipped "
                             "(default: one 10-minute command)")
    args = parser.parse_args()
    on_tpu = jax.default_backend() == "tpu"
    if not on_tpu and not args.smoke:
        parser.error(f"no TPU here (JAX's backend is {jax.default_backend()!r}); "
                     "run with --smoke to check the script on CPU")
    interpret = args.smoke
    impls = {"pallas_tpu": PallasTpu(interpret=interpret), "xla": Xla()}
    info = pltpu.get_tpu_info() if on_tpu else pltpu.get_tpu_info_for_chip(
        pltpu.ChipVersion.TPU_V5E, 1)
    device = jax.devices()[0].device_kind
    smoke_note = " (--smoke: CPU, interpret mode, tiny shapes; timings mean nothing)"
    header = [f"{datetime.date.today().isoformat()}, jax {jax.__version__}, {device}"
              f"{smoke_note if args.smoke else ''}; bf16 peak "
              f"{info.bf16_ops_per_second / 1e12:.0f} TFLOP/s"
              f"{' (v5e, for the smoke)' if not on_tpu else ''}; pallas_tpu blocks "
              f"{impls['pallas_tpu'].tpu_target().name}'s."]

    paths = [args.md] if args.md else ([] if args.smoke else [os.path.join(HERE, "TPU.md")])
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        paths.append(os.path.join(args.out, "TPU.md"))
    checks, failures, rows = [], [], []

    def write_report() -> str:
        """The report of what is measured so far, written to every path (and the JSON)."""
        text = markdown(header, checks, rows, failures)
        if args.out:
            with open(os.path.join(args.out, "tpu.json"), "w") as f:
                json.dump(dict(header=header, checks=checks, rows=rows, failures=failures), f,
                          indent=1)
        for path in paths:
            with open(path, "w") as f:
                f.write(text)
        return text

    log(f"(a) correctness on {device}")
    checks += [row for case in (SMOKE_CHECKS if args.smoke else CHECKS)
               for row in device_checks.correctness(case, impls, TOLERANCE)]
    for c in checks:
        log(f"{c['case']} {c['impl']}: {'pass' if c['ok'] else 'FAIL'}")
    write_report()

    chosen = [tpu_smoke_version(w) for w in WORKLOADS if w.name in SMOKE_WORKLOADS] \
        if args.smoke else WORKLOADS
    repeats = args.repeats or (2 if args.smoke else 20)
    for n, w in enumerate(chosen):
        if time.perf_counter() - START > args.budget:
            failures += [f"{x.name}: skipped, past the {args.budget:.0f} s budget"
                         for x in chosen[n:]]
            break
        log(f"(b) {w.name}")
        rows += time_workload(w, impls, interpret, repeats, info.bf16_ops_per_second, failures)
        write_report()

    print(write_report())
    return 0 if all(c["ok"] for c in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
