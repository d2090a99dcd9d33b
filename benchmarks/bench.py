"""rankattn against what a user would run instead, on ranking-attention workloads (CPU).

    .venv/bin/python benchmarks/bench.py                  # 2 full runs -> results/, RESULTS.md
    .venv/bin/python benchmarks/bench.py --sweep          # the shape sweep -> SWEEP.md, sweep.png
    .venv/bin/python benchmarks/bench.py --report         # rewrite the reports from results/
    .venv/bin/python benchmarks/bench.py --only nano-fwd  # print one workload, write nothing
    .venv/bin/python benchmarks/bench.py --smoke [--sweep] --out DIR  # the same, tiny (CI)

Every implementation of a workload runs in this process, round-robin, each
round in a shuffled order that never times one right after its own call,
each call after a pause and then until the process is quiet
(rankattn.peers.interleaved_times, settle); a peer whose result differs from rankattn's
by more than AGREEMENT is dropped with a note.
The ratio "peer / rankattn" (> 1 means rankattn is faster) is taken per round
and its median over rounds reported, with the quartiles: both sides of a
ratio ran under the same machine state, so the ratio is much steadier than
either time on this noisy 2-core machine. Peers: the dense reference,
jax.nn.dot_product_attention (XLA) with the equivalent dense mask, and when
PyTorch is installed (pip install '.[bench]' torch) torch SDPA with a dense
boolean mask and compiled FlexAttention with a mask_mod and block mask
(forward only: its CPU backward is not supported).

"% mm" is the achieved fraction of this machine's fp32 matmul rate: XLA's 2048^3
float32 matmul, timed in every round of the workload's rounds, the ratio taken per
round and its median shown (the header's rates, XLA's and torch's, fp32 and bf16,
are one measurement at the start of the run). It counts only visible query-key
pairs (forward 4*D flops per pair and head; forward+backward 3.5x that, counting the
recomputed logits, as FlashAttention's papers do). "temp MiB"
is XLA's compiled scratch memory for the JAX implementations; the cpu kernel
allocates its own buffers outside it, so the memory note measures a process
that runs only rankattn (its peak resident memory).

Every process runs with glibc's default heap settings, as users get them. (An
earlier version turned heap trimming off and padded the heap top by 1 GiB:
that made torch SDPA about 5x slower on short-fwd, 3.4 -> 16 ms, and
rankattn 1.5x slower, which flattered rankattn's ratios.)

Each machine keeps its own records, in benchmarks/results/<machine>/ (the
folder named after peers.machine_description(): model, generation, vector
ISA, cores): a full run writes its run-*.json there, replacing that
machine's earlier runs only; the sweep writes its sweep.json. RESULTS.md
(every machine side by side, then each in full), SWEEP.md (a table per
machine), the two PNGs (the machine measured last) and the README's results
block are generated from those files only (--report redoes it), so no
number in them is typed by hand.

--smoke checks the whole script in seconds (tests/test_benchmark_smoke.py runs it):
the same path at tiny shapes (smoke_version), one round, one full run of the
SMOKE_WORKLOADS (every kind: forward and backward, bfloat16 with its float32
twin, one session and packed), the sweep's base cell in every dimension, and
results/ and the reports written under --out (default: a new temporary folder),
with a copy of the README: never the committed ones.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import glob
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

import rankattn
from rankattn import peers

try:
    if "--no-torch" in sys.argv:  # not even imported: its thread pools stay out of the process
        raise ImportError
    import torch
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
except ImportError:  # the torch peers are optional
    torch = None

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS_DIR = os.path.join(HERE, "results")
README = os.path.join(os.path.dirname(HERE), "README.md")
COMMAND = ".venv/bin/python benchmarks/bench.py"


@dataclasses.dataclass(frozen=True)
class Workload:
    name: str
    batch: int
    sessions: tuple[tuple[int, int], ...]  # (history incl. prefix, candidates) packed per row
    q_heads: int
    kv_heads: int
    head_dim: int
    backward: bool = False
    dtype: str = "float32"

    @property
    def seq_len(self) -> int:
        return sum(h + c for h, c in self.sessions)

    @property
    def visible_pairs(self) -> int:
        """Per row and head: history sees its history, a candidate its history and itself."""
        return sum(h * h + c * (h + 1) for h, c in self.sessions)

    @property
    def flops(self) -> float:
        """On visible pairs: forward 4 * D per pair and head, forward + backward 3.5x that."""
        pairs = self.visible_pairs * self.batch * self.q_heads
        return 4 * self.head_dim * pairs * (3.5 if self.backward else 1)

    def segment_ids(self) -> np.ndarray:
        row = np.concatenate([np.r_[np.full(h, i + 1), np.full(c, -(i + 1))]
                              for i, (h, c) in enumerate(self.sessions)]).astype(np.int32)
        return np.tile(row, (self.batch, 1))


NANO = ((1024, 128),)  # 2 prefix + 1022 history, 128 candidates
SHORT = ((256, 64),)   # 2 prefix + 254 history, 64 candidates: a short call
PACKED = tuple((960, 64) for _ in range(8))  # 8 sessions of 1024 tokens in one 8192-token row
WORKLOADS = [
    Workload("nano-fwd", 8, NANO, 4, 2, 128),
    Workload("nano-fwd-bf16", 8, NANO, 4, 2, 128, dtype="bfloat16"),
    Workload("nano-fwdbwd", 4, NANO, 4, 2, 128, backward=True),
    Workload("nano-fwdbwd-bf16", 4, NANO, 4, 2, 128, backward=True, dtype="bfloat16"),
    Workload("prod-heads-fwd", 2, NANO, 20, 4, 128),
    Workload("short-fwd", 2, SHORT, 4, 2, 128),
    Workload("short-fwdbwd", 2, SHORT, 4, 2, 128, backward=True),
    Workload("packed-fwd", 1, PACKED, 4, 2, 128),
    Workload("packed-fwd-bf16", 1, PACKED, 4, 2, 128, dtype="bfloat16"),
    Workload("packed-fwdbwd", 1, PACKED, 4, 2, 128, backward=True),
    Workload("long-history-fwd", 1, ((32768, 128),), 4, 2, 64),
    Workload("long-history-fwdbwd", 1, ((32768, 128),), 4, 2, 64, backward=True),
]
# What --smoke runs: every kind of workload (forward / backward, bf16 / float32, packed) once.
SMOKE_WORKLOADS = ("nano-fwd-bf16", "packed-fwdbwd")
GEMM_SIZE, SMOKE_GEMM_SIZE = 2048, 128  # the matmul whose rate "% mm" divides by
# Dense-mask XLA peers form B x H x S x S float32 logits; they are skipped past this size.
DENSE_LIMIT_BYTES = 6 << 30
# Rounds stop early once a workload's implementations have used this much time in total.
ROUND_BUDGET_S = 60.0


def smoke_version(w: Workload) -> Workload:
    """A tiny workload of the same kind (heads, head dim, dtype, direction, one session or
    packed), for checking a script end to end (--smoke)."""
    sessions = ((24, 8),) * 2 if len(w.sessions) > 1 else ((40, 8),)
    return dataclasses.replace(w, batch=1, sessions=sessions)


def workloads(smoke: bool = False) -> dict[str, Workload]:
    """WORKLOADS by name; with ``smoke`` their smoke_version."""
    return {w.name: smoke_version(w) if smoke else w for w in WORKLOADS}


# --- Implementations. ---------------------------------------------------------------


def inputs(w: Workload, seed: int = 0):
    keys = jax.random.split(jax.random.PRNGKey(seed), 4)
    s = w.seq_len
    q = jax.random.normal(keys[0], (w.batch, s, w.q_heads, w.head_dim), w.dtype)
    k = jax.random.normal(keys[1], (w.batch, s, w.kv_heads, w.head_dim), w.dtype)
    v = jax.random.normal(keys[2], (w.batch, s, w.kv_heads, w.head_dim), w.dtype)
    d_out = jax.random.normal(keys[3], q.shape, w.dtype)
    return q, k, v, jnp.asarray(w.segment_ids()), d_out


def jax_runner(w: Workload, attend):
    """A jitted zero-argument callable: forward, or forward + backward (vjp with a fixed d_out)."""
    q, k, v, seg, d_out = inputs(w)
    if w.backward:
        def step(q, k, v, seg, d_out):
            out, vjp = jax.vjp(lambda q, k, v: attend(q, k, v, seg), q, k, v)
            return vjp(d_out)
    else:
        def step(q, k, v, seg, d_out):
            return attend(q, k, v, seg)
    compiled = jax.jit(step).lower(q, k, v, seg, d_out).compile()
    temp = compiled.memory_analysis().temp_size_in_bytes
    return (lambda: compiled(q, k, v, seg, d_out)), temp


def rankattn_with(impl="auto"):
    """rankattn with one plan per call, as a model would build it once per batch."""
    def attend(q, k, v, seg):
        return rankattn.attention(q, k, v, plan=rankattn.plan(segment_ids=seg, impl=impl),
                                  impl=impl)
    return attend


ours = rankattn_with("auto")


def reference(q, k, v, seg):
    return rankattn.attention(q, k, v, segment_ids=seg, impl="reference")


def torch_inputs(w: Workload, device: str = "cpu"):
    q, k, v, seg, d_out = (np.asarray(x.astype(jnp.float32)) for x in inputs(w))
    dtype = getattr(torch, w.dtype)

    def t(x, grad=False):  # [B, S, H, D] -> [B, H, S, D]
        x = torch.from_numpy(x.copy()).to(device=device, dtype=dtype)
        return x.transpose(1, 2).contiguous().requires_grad_(grad)

    return (t(q, w.backward), t(k, w.backward), t(v, w.backward),
            torch.from_numpy(np.array(seg)).to(device), t(d_out))


def torch_runner(w: Workload, attend, q, k, v, d_out):
    """A zero-argument callable: attend() forward, or forward + backward; waits for the device."""
    def run():
        out = attend()
        if w.backward:
            out = torch.autograd.grad(out, (q, k, v), d_out)
        if q.is_cuda:
            torch.cuda.synchronize()
        return out
    return run


def torch_sdpa(w: Workload, device: str = "cpu"):
    q, k, v, seg, d_out = torch_inputs(w, device)
    seg_j = jnp.asarray(seg.cpu().numpy())
    mask = torch.from_numpy(np.array(rankattn.semantics.dense_mask(seg_j, seg_j, False)))
    mask = mask[:, None].to(device)
    return torch_runner(w, lambda: torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, enable_gqa=True), q, k, v, d_out)


def torch_flex(w: Workload, device: str = "cpu"):
    q, k, v, seg, d_out = torch_inputs(w, device)

    def mask_mod(b, h, qi, ki):
        sq, sk = seg[b, qi], seg[b, ki]
        return ((sq.abs() == sk) & (sk > 0)) | ((sq < 0) & (qi == ki))

    block_mask = create_block_mask(mask_mod, w.batch, None, w.seq_len, w.seq_len, device=device)
    flex = torch.compile(flex_attention)
    return torch_runner(w, lambda: flex(q, k, v, block_mask=block_mask, enable_gqa=True),
                        q, k, v, d_out)


OURS = "rankattn"
OURS_F32 = "rankattn, float32 inputs"  # beside a bf16 workload: how much faster is bf16?
OURS_XLA = "rankattn, xla backend"  # the plain-JAX fallback, beside the fused cpu kernel
OWN = (OURS, OURS_F32, OURS_XLA)  # rankattn's own rows, never a peer
DENSE_MASK_PEERS = ("dense reference", "jax.nn.dpa (xla, dense mask)", "torch sdpa (dense mask)")
FLEX = "torch flex (compiled)"


def runners(w: Workload, dense_limit: int, failures: list[str]) -> tuple[dict, dict]:
    """{name: zero-argument callable} of every implementation that runs on ``w``, and temps."""
    fns, temps = {}, {}
    fns[OURS], temps[OURS] = jax_runner(w, ours)
    if w.dtype != "float32":
        f32 = dataclasses.replace(w, dtype="float32")
        fns[OURS_F32], temps[OURS_F32] = jax_runner(f32, ours)
    if rankattn.available_impls()[0] == "cpu":
        fns[OURS_XLA], temps[OURS_XLA] = jax_runner(w, rankattn_with(rankattn.backends.Xla()))
    if w.batch * w.q_heads * w.seq_len ** 2 * 4 <= dense_limit:
        fns["dense reference"], temps["dense reference"] = jax_runner(w, reference)
        fns[DENSE_MASK_PEERS[1]], temps[DENSE_MASK_PEERS[1]] = jax_runner(
            w, peers.jax_nn_attention)
    if torch is not None and w.batch * w.seq_len ** 2 <= dense_limit:  # SDPA: a bool mask
        fns["torch sdpa (dense mask)"] = torch_sdpa(w)
    if torch is not None and not w.backward:  # block-sparse, so no dense-size limit
        fns[FLEX] = torch_flex(w)
    for name in [n for n in fns if n.startswith("torch")]:
        try:  # a peer that fails to compile is reported, not fatal
            fns[name]()
        except Exception as e:  # noqa: BLE001
            del fns[name]
            failures.append(f"{w.name}: {name} failed: {type(e).__name__}: "
                            f"{str(e).strip().splitlines()[0][:160]}")
            print(failures[-1], flush=True)
    return fns, temps


def cpu_seconds() -> tuple[float, float, float]:
    """CPU seconds since boot: busy (all processes), this process's own, and stolen by the host.

    Steal is time the hypervisor gave this VM's cores to other guests.
    """
    fields = [int(x) for x in open("/proc/stat").readline().split()[1:9]]
    tick = os.sysconf("SC_CLK_TCK")
    busy = sum(fields[:7]) - fields[3] - fields[4]  # without idle and iowait
    return busy / tick, sum(os.times()[:2]), fields[7] / tick


MATMUL = "xla float32 matmul"  # timed in every round, for "% mm"; not a row


def xla_matmul(size: int, dtype: str = "float32"):
    """A zero-argument size^3 matmul on XLA (``dtype`` inputs, float32 results)."""
    a = jax.random.normal(jax.random.PRNGKey(0), (size, size), dtype)
    mm = jax.jit(lambda a: jnp.matmul(a, a, preferred_element_type=jnp.float32))
    return lambda: mm(a).block_until_ready()


# The largest |peer - rankattn| a peer may show, as a fraction of rankattn's largest entry
# (forward: out; forward + backward: dq, dk, dv), before it is dropped as computing something
# else: float32 sums in another order differ by ~1e-6, bf16 operands rounded in another place
# by ~1e-2; a candidate that sees another candidate moves its row by ~1e-1.
AGREEMENT = {"float32": 1e-3, "bfloat16": 5e-2}


def as_arrays(result) -> list[np.ndarray]:
    """A runner's result (out, or dq, dk, dv) as float32 numpy [B, S, H, D] arrays: torch's
    tensors are [B, H, S, D]."""
    parts = result if isinstance(result, (tuple, list)) else [result]
    if torch is not None and isinstance(parts[0], torch.Tensor):
        return [x.detach().float().transpose(1, 2).cpu().numpy() for x in parts]
    return [np.asarray(x, np.float32) for x in parts]


def disagreement(results: dict) -> dict[str, float]:
    """Per implementation, the largest |its result - rankattn's| over rankattn's largest entry,
    in each of the result's arrays (not OURS_F32's: its float32 inputs are other numbers)."""
    ours = as_arrays(results[OURS])
    out = {}
    for name, result in results.items():
        if name == OURS_F32:
            continue
        theirs = as_arrays(result)
        # A NaN anywhere is an infinite disagreement (np.max would return NaN, which no
        # tolerance test catches).
        out[name] = max(float(np.abs(a - b).max()) / max(float(np.abs(b).max()), 1e-30)
                        if np.isfinite(a).all() and np.isfinite(b).all() else np.inf
                        for a, b in zip(theirs, ours))
    return out


def run_workload(w: Workload, repeats: int, gemm_size: int, failures: list[str],
                 dense_limit: int = DENSE_LIMIT_BYTES) -> list[dict]:
    """One row per implementation: medians, per-round ratios to rankattn and their quartiles,
    and rankattn's "% mm": its FLOP rate over XLA's float32 gemm_size^3 matmul rate, per round
    (the matmul is timed in the same rounds, so drift between workloads cannot move it: with
    one rate per run, nano-fwd at 99.5 and 99.6 ms read 108% and 95% in two runs)."""
    fns, temps = runners(w, dense_limit, failures)
    fns[MATMUL] = xla_matmul(gemm_size)
    start = time.perf_counter()
    results = {name: jax.block_until_ready(fn()) for name, fn in fns.items()}  # warm-up, and
    one_round = time.perf_counter() - start  # the time one round takes
    del results[MATMUL]
    differences = disagreement(results)
    for name, difference in differences.items():
        if difference > AGREEMENT[w.dtype]:
            del fns[name]
            failures.append(f"{w.name}: {name} disagrees with rankattn (largest difference "
                            f"{difference:.2g} of the result's largest entry); not timed")
            print(failures[-1], flush=True)
    rounds = int(np.clip(ROUND_BUDGET_S // max(one_round, 1e-9), 3, repeats))
    (busy0, own0, steal0), wall0 = cpu_seconds(), time.perf_counter()
    times = peers.interleaved_times(fns, rounds, warm_up=False)
    (busy1, own1, steal1), wall1 = cpu_seconds(), time.perf_counter()
    # The share of the machine that other processes (or, as steal, other guests of the host)
    # took while this workload was timed: torch's OpenMP pools stall when a core is taken
    # from them, so its times suffer most from it.
    core_seconds = (wall1 - wall0) * os.cpu_count()
    others = max(0.0, (busy1 - busy0) - (own1 - own0)) / core_seconds
    steal = (steal1 - steal0) / core_seconds
    matmul = times.pop(MATMUL)
    rows = []
    for name, t in times.items():
        ratios = t / times[OURS]
        mm = w.flops * matmul / (2 * gemm_size ** 3 * t)  # per round: its rate / the matmul's
        rows.append(dict(workload=w.name, impl=name, ms=float(np.median(t)) * 1e3,
                         ratio=float(np.median(ratios)),
                         ratio_q1=float(np.percentile(ratios, 25)),
                         ratio_q3=float(np.percentile(ratios, 75)), rounds=rounds,
                         mm=float(np.median(mm)), others=others, steal=steal,
                         difference=differences.get(name, 0.0),
                         temp_mib=temps[name] / 2 ** 20 if name in temps else None))
    # Its programs are not run again, and a cached XLA:CPU program keeps memory mappings: a
    # process past vm.max_map_count segfaults in its next compile (README, the tests' note).
    jax.clear_caches()
    return rows


def gemm_rates(repeats: int, torch_dtypes: tuple[str, ...] | None = None,
               size: int = GEMM_SIZE) -> dict[str, float]:
    """FLOP/s of a size^3 matmul (2048^3): XLA and torch (in ``torch_dtypes``), float32 and bf16
    x bf16 -> float32. torch's bfloat16 is timed by default only where the CPU has bfloat16
    dot instructions (AVX-512 BF16 or AMX): without them one call took 63 s, 10 minutes of
    a full run, for a rate no report uses there."""
    if torch_dtypes is None:
        bf16_dots = {"avx512_bf16", "amx_bf16"} & peers.cpu_flags()
        torch_dtypes = ("float32", "bfloat16") if bf16_dots else ("float32",)
    fns = {}
    for dtype in ("float32", "bfloat16"):
        fns[f"xla {dtype}"] = xla_matmul(size, dtype)
        if torch is not None and dtype in torch_dtypes:
            a = np.asarray(jax.random.normal(jax.random.PRNGKey(0), (size, size)))
            ta = torch.from_numpy(a).to(getattr(torch, dtype))
            fns[f"torch {dtype}"] = lambda ta=ta: ta @ ta
    times = peers.interleaved_medians(fns, repeats)
    return {name: 2 * size ** 3 / t for name, t in times.items()}


def matmul_rate(rates: dict[str, float], dtype: str = "float32") -> float:
    """The machine's matmul rate for ``dtype`` inputs: the faster of XLA's and torch's."""
    return max(r for name, r in rates.items() if name.endswith(dtype))


def peak_rss_gib(name: str, smoke: bool = False) -> float | None:
    """Peak resident memory of a fresh process that runs only rankattn on one workload (inputs,
    the interpreter and jax included; torch not imported); None where the system does not
    report it (own_peak_rss_bytes)."""
    out = subprocess.run([sys.executable, __file__, "--rss-child", name, "--no-torch",
                          *(["--smoke"] if smoke else [])], check=True,
                         capture_output=True, text=True).stdout
    value = out.strip().splitlines()[-1]
    return None if value == "unknown" else float(value)


def own_peak_rss_bytes() -> int | None:
    """This process's own peak resident memory, VmHWM of /proc/self/status (Linux; else None).

    Not getrusage's ru_maxrss: Linux keeps that across exec, and a child forked from a larger
    process starts with the parent's pages mapped, so a child of this script reported the
    script's own 13-14 GiB (after the dense peers) as rankattn's (RUSAGE_NOTE).
    """
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


RSS_NOTE = "peak resident memory (VmHWM) of a process running only rankattn"
# What earlier runs recorded instead, from ru_maxrss: the parent's size (above).
RUSAGE_NOTE = re.compile(r"^(?P<workload>\S+): peak RSS of a process running only rankattn "
                         r"\(inputs included\) (?P<gib>[\d.]+) GiB in this run; (?P<rest>.*)$")


def shown_note(note: str) -> str:
    """A run's note as the report shows it: an RSS figure from ru_maxrss says what it measured."""
    old = RUSAGE_NOTE.match(note)
    if old is None:
        return note
    return (f"{old['workload']}: no peak memory of rankattn alone in this run: its {old['gib']} "
            f"GiB was getrusage's ru_maxrss of a child process, which Linux carries over from "
            f"the parent across fork and exec: this script's own resident size when it started "
            f"the child ({old['rest']})")


# --- What limits the small shapes: XLA:CPU's primitives against torch's. -------------


def primitives(repeats: int) -> list[dict]:
    """Per-round ratios torch / XLA of the operations rankattn's programs are made of.

    The batched matmul of one nano-fwd step, then at the short-fwd shape (B=2,
    4 heads, S=320, D=128): the logits matmul,
    exp over the logits, and unmasked dense softmax attention (two matmuls and
    a softmax) against torch SDPA without a mask. These bound what any XLA
    program can do at that shape, rankattn's included.
    """
    if torch is None:
        return []
    b, h, s, d = 2, 4, 320, 128
    keys = jax.random.split(jax.random.PRNGKey(0), 3)
    q, k, v = (jax.random.normal(key, (b, h, s, d)) for key in keys)
    tq, tk, tv = (torch.from_numpy(np.array(x)) for x in (q, k, v))
    logits = jax.jit(lambda q, k: jnp.einsum("bhqd,bhkd->bhqk", q, k, precision="highest"))
    s0 = logits(q, k)
    ts0 = torch.from_numpy(np.array(s0))
    exp = jax.jit(jnp.exp)

    def dense(q, k, v):
        p = jax.nn.softmax(jnp.einsum("bhqd,bhkd->bhqk", q, k, precision="highest"), -1)
        return jnp.einsum("bhqk,bhkd->bhqd", p, v, precision="highest")

    dense = jax.jit(dense)
    # nano-fwd's block matmul: 4 units x 2 kv heads, (2 query heads x 128 queries) x 512 keys.
    a_blk, b_blk = (jax.random.normal(key, (8, n, d)) for key, n in zip(keys[:2], (256, 512)))
    ta_blk, tb_blk = torch.from_numpy(np.array(a_blk)), torch.from_numpy(np.array(b_blk))
    block = jax.jit(lambda a, b: jnp.einsum("crd,ckd->crk", a, b, precision="highest"))
    pairs = [("block matmul [8,256,128] x [8,128,512] (nano's step)",
              lambda: block(a_blk, b_blk), lambda: torch.bmm(ta_blk, tb_blk.transpose(1, 2))),
             ("logits matmul [2,4,320,128] x [2,4,128,320]", lambda: logits(q, k),
              lambda: tq @ tk.transpose(-1, -2)),
             ("exp over [2,4,320,320]", lambda: exp(s0), lambda: torch.exp(ts0)),
             ("dense attention, no mask (XLA softmax vs torch SDPA)", lambda: dense(q, k, v),
              lambda: torch.nn.functional.scaled_dot_product_attention(tq, tk, tv))]
    rows = []
    for name, xla_fn, torch_fn in pairs:
        t = peers.interleaved_times({"xla": xla_fn, "torch": torch_fn}, repeats)
        rows.append(dict(op=name, xla_ms=float(np.median(t["xla"])) * 1e3,
                         torch_ms=float(np.median(t["torch"])) * 1e3,
                         ratio=float(np.median(t["torch"] / t["xla"]))))
    return rows


def load_sensitivity(by_name: dict[str, Workload], repeats: int) -> list[dict]:
    """rankattn and torch SDPA on short-fwd and nano-fwd, alone and beside one busy process.

    What makes full runs vary: another process taking a core slows torch's
    OpenMP kernels far more than XLA's thread pool, so the ratios move with
    the machine's background load. Measured here, both ways, in one run.
    """
    if torch is None:
        return []
    out = []
    for w in (by_name["nano-fwd"], by_name["short-fwd"]):
        fns = {OURS: jax_runner(w, ours)[0], "torch sdpa (dense mask)": torch_sdpa(w)}
        for label in ("alone", "beside one busy process"):
            spinner = None
            if label != "alone":
                spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
            try:
                t = peers.interleaved_times(fns, repeats)
            finally:
                if spinner is not None:
                    spinner.kill()
                    spinner.wait()
            ours_ms, sdpa_ms = (float(np.median(x)) * 1e3 for x in t.values())
            out.append(dict(workload=w.name, load=label, ours_ms=ours_ms, sdpa_ms=sdpa_ms,
                            ratio=float(np.median(t["torch sdpa (dense mask)"] / t[OURS]))))
    return out


# --- The shape sweep. ----------------------------------------------------------------


SWEEP_BASE = Workload("base", 2, ((1024, 64),), 4, 2, 128)
# One dimension varies at a time around SWEEP_BASE; values as shown in the table.
SWEEP_DIMENSIONS = {
    "head dim": {str(d): dict(head_dim=d) for d in (32, 64, 80, 96, 128, 192, 256)},
    "q/kv heads": {f"{q}/{kv}": dict(q_heads=q, kv_heads=kv)
                   for q, kv in ((4, 4), (4, 2), (8, 2), (10, 2), (16, 2), (8, 1))},
    "batch": {str(b): dict(batch=b) for b in (1, 2, 8, 32)},
    "history": {str(h): dict(sessions=((h, 64),)) for h in (128, 256, 1024, 2048, 8192)},
    "candidates": {str(c): dict(sessions=((1024, c),)) for c in (1, 16, 64, 256)},
    "row": {"1 session": {}, "4 packed": dict(sessions=((256, 16),) * 4)},
    "dtype": {"float32": {}, "bfloat16": dict(dtype="bfloat16")},
}
SWEEP_REPEATS = 5
SWEEP_DENSE_LIMIT = 1 << 30  # keeps the sweep's dense XLA peers to minutes


def sweep_cells(directions=("fwd", "fwdbwd"), smoke: bool = False):
    """(dimension, value, workload) for every cell of ``directions``, forward first; with
    ``smoke`` only the base cell's value of each dimension, at its smoke_version."""
    for backward in [d == "fwdbwd" for d in directions]:
        for dim, values in SWEEP_DIMENSIONS.items():
            for value, change in values.items():
                if smoke and dataclasses.replace(SWEEP_BASE, **change) != SWEEP_BASE:
                    continue
                name = f"{dim}={value} {'fwdbwd' if backward else 'fwd'}"
                w = dataclasses.replace(SWEEP_BASE, name=name, backward=backward, **change)
                yield dim, value, smoke_version(w) if smoke else w


def best_peer(rows: list[dict], workload: str, peers_: tuple[str, ...] | None = None):
    """(name, row) of the peer with the smallest peer / rankattn ratio, or (None, None)."""
    candidates = [r for r in rows if r["workload"] == workload and r["impl"] not in OWN
                  and (peers_ is None or r["impl"] in peers_)]
    if not candidates:
        return None, None
    row = min(candidates, key=lambda r: r["ratio"])
    return row["impl"], row


def best_peer_names(best: list[tuple[str | None, dict | None]]) -> str:
    """Who the best peer was over runs (best_peer of each): one name where every run had the
    same one, else each run's with its ratio, so that a range is not put on one peer."""
    found = [(i, peer, row) for i, (peer, row) in enumerate(best) if row]
    if len({peer for _, peer, _ in found}) <= 1:
        return found[0][1] if found else "none ran"
    return "; ".join(f"run {i + 1}: {peer} {row['ratio']:.2f}x" for i, peer, row in found)


# --- Reports, generated from results/*.json only. ------------------------------------


def load_runs(folder: str) -> list[dict]:
    return [json.load(open(p)) for p in sorted(glob.glob(os.path.join(folder, "run-*.json")))]


def load_sweep(folder: str) -> dict | None:
    path = os.path.join(folder, "sweep.json")
    return json.load(open(path)) if os.path.exists(path) else None


def machine_folder(results_dir: str) -> str:
    """Where this machine's records go: results/<machine_slug(machine_description())>/."""
    return os.path.join(results_dir, peers.machine_slug(peers.machine_description()))


@dataclasses.dataclass
class Machine:
    """One machine's records: its full runs (one invocation's) and its sweep."""

    name: str
    runs: list[dict]
    sweep: dict | None

    @property
    def latest(self) -> str:
        """The newest date ("YYYY-MM-DD HH:MM") in its records."""
        return max(d for record in self.runs + [self.sweep] if record
                   for d in dates(record["meta"]["date"]))

    @property
    def swept(self) -> str:
        """The newest date of its sweep ("" without one)."""
        return max(dates(self.sweep["meta"]["date"])) if self.sweep else ""


def dates(text: str) -> list[str]:
    """The dates ("YYYY-MM-DD HH:MM", local time of the machine that ran) in a record's
    meta["date"]: one, or one per direction ("fwd DATE; fwdbwd DATE") of a merged sweep."""
    return re.findall(r"\d{4}-\d\d-\d\d \d\d:\d\d", text)


def load_machines(results_dir: str = RESULTS_DIR) -> list[Machine]:
    """Every machine's records (results/<machine>/run-*.json and sweep.json), the machine
    measured most recently first. A machine is named by its records' meta["machine"]."""
    machines = []
    for folder in sorted(glob.glob(os.path.join(results_dir, "*", ""))):
        runs, sweep = load_runs(folder), load_sweep(folder)
        if runs or sweep:
            m = (runs[0] if runs else sweep)["meta"]
            name = m.get("machine") or f"{m['cpu']}, {m['cores']} cores"
            machines.append(Machine(name, runs, sweep))
    return sorted(machines, key=lambda m: m.latest, reverse=True)


def span(values, fmt="{:.2f}") -> str:
    """'a' or 'a-b' (min-max over runs)."""
    values = [v for v in values if v is not None]
    if not values:
        return ""
    lo, hi = min(values), max(values)
    return fmt.format(lo) if fmt.format(lo) == fmt.format(hi) else f"{fmt.format(lo)}-{fmt.format(hi)}"


def run_header(run: dict) -> str:
    m = run["meta"]
    rates = ", ".join(f"{name} {r / 1e9:.0f}" for name, r in m.get("gemm_rates", {}).items())
    # Runs before the per-round matmul divided "% mm" by this one rate.
    old = "" if m.get("mm_per_round") else "; % mm against this rate"
    return (f"{m['date']}: jax {m['jax']} ({m['backend']}), torch {m['torch']}, "
            f"{m['cpu']} ({m['cores']} cores), fp32 matmul rate {m['rate'] / 1e9:.0f} GFLOP/s"
            + (f" (2048^3 matmul GFLOP/s: {rates})" if rates else "") + old
            + "".join(f"; {note}" for note in older_methods(m)))


def older_methods(meta: dict) -> list[str]:
    """What a run's timing did that the current method does not (none for a current run)."""
    notes = [] if meta.get("mm_per_round") else ["rounds in alternating order (before the "
                                                  "shuffled order)"]
    if not meta.get("settled"):
        notes.append(f"each call after a fixed {peers.SETTLE_S * 1e3:.0f} ms pause, before "
                     "waiting for a quiet process (a call after the dense reference shared a "
                     "core with its memory's return)")
    return notes


def targets(runs: list[dict], sweep: dict | None) -> list[tuple[str, str, bool | None]]:
    """(target, measured, met) for every target of the performance issues, over all runs."""
    out = []

    def per_run(fn):
        return [fn(run["rows"]) for run in runs]

    names = list(dict.fromkeys(r["workload"] for run in runs for r in run["rows"]))
    for name in names:
        best = per_run(lambda rows: best_peer(rows, name))
        values = [row["ratio"] for _, row in best if row]
        if not values:
            out.append((f"{name} >= 1.0x the best peer", "no peer ran", None))
            continue
        out.append((f"{name} >= 1.0x the best peer", f"{span(values)}x ({best_peer_names(best)})",
                    min(values) >= 1.0))
        if name.startswith("packed"):
            dense = [row["ratio"] for _, row in per_run(
                lambda rows: best_peer(rows, name, DENSE_MASK_PEERS)) if row]
            if dense:
                out.append((f"{name} >= 2x the best dense-mask peer", f"{span(dense)}x",
                            min(dense) >= 2))
        if name in ("nano-fwd", "nano-fwdbwd"):
            mm = [r["mm"] for run in runs for r in run["rows"]
                  if r["workload"] == name and r["impl"] == OURS]
            out.append((f"{name} >= 70% of the matmul rate", span(mm, "{:.0%}"), min(mm) >= 0.7))
        f32 = [r["ratio"] for run in runs for r in run["rows"]
               if r["workload"] == name and r["impl"] == OURS_F32]
        if f32:
            need = 1.5 if name.endswith("fwdbwd-bf16") else 1.3
            out.append((f"{name}: bf16 >= {need}x faster than float32 (f32 time / bf16 time)",
                        f"{span(f32)}x", min(f32) >= need))
    if sweep:
        for direction in ("fwd", "fwdbwd"):
            cells = distinct_cells([c for c in sweep_table(sweep) if c["direction"] == direction])
            rated = [c for c in cells if c["ratio"] is not None]
            if not rated:  # a --direction sweep of the other half only, or no peer ran
                out.append((f"every sweep cell, {direction}, >= 1.0x the best peer",
                            "no cell with a peer", None))
                continue
            met = [c for c in rated if c["ratio"] >= 1.0]
            worst = min(rated, key=lambda c: c["ratio"])
            out.append((f"every sweep cell, {direction}, >= 1.0x the best peer",
                        f"{len(met)} of {len(cells)} shapes (the base cell, in every dimension, "
                        f"once); lowest {worst['ratio']:.2f}x "
                        f"({worst['dim']}={worst['value']}, {worst['peer']})",
                        len(met) == len(cells)))
    return out


def is_base_cell(dim: str, value: str) -> bool:
    """Whether a sweep cell is SWEEP_BASE itself (each dimension holds it once)."""
    change = SWEEP_DIMENSIONS.get(dim, {}).get(value)
    return change is not None and dataclasses.replace(SWEEP_BASE, **change) == SWEEP_BASE


def distinct_cells(cells: list[dict]) -> list[dict]:
    """``cells`` (sweep_table's) with the base cell kept once: every dimension repeats one
    measurement of it, which would count 7 times."""
    first = next((c for c in cells if is_base_cell(c["dim"], c["value"])), None)
    return [c for c in cells if c is first or not is_base_cell(c["dim"], c["value"])]


def sweep_table(sweep: dict) -> list[dict]:
    cells = []
    for cell in sweep["cells"]:
        peer, row = best_peer(cell["rows"], cell["workload"])
        ours_row = next(r for r in cell["rows"] if r["impl"] == OURS)
        cells.append(dict(dim=cell["dim"], value=cell["value"], direction=cell["direction"],
                          ours_ms=ours_row["ms"], peer=peer, others=ours_row.get("others"),
                          peer_ms=row["ms"] if row else None,
                          ratio=row["ratio"] if row else None,
                          q1=row["ratio_q1"] if row else None, q3=row["ratio_q3"] if row else None))
    return cells


def results_markdown(machines: list[Machine]) -> str:
    """RESULTS.md: how to reproduce, every workload on every machine side by side, then each
    machine's runs in full, the most recently measured machine first."""
    lines = ["# Core attention benchmark results", "",
             "Generated by `benchmarks/bench.py` from `benchmarks/results/<machine>/*.json`; do",
             "not edit by hand (`bench.py --report` regenerates it). Each machine keeps its own",
             "records: a run replaces only the records of the machine it runs on. Reproduce with",
             "", "    .venv/bin/pip install -q -e '.[bench]' torch==2.13.0",
             f"    {COMMAND} --runs 2   # 2 full runs, each in a fresh process",
             f"    {COMMAND} --sweep    # the shape sweep", "",
             "\"peer / rankattn\" > 1 means rankattn is faster. It is the median over "
             "rounds of the per-round ratio (each round runs every implementation once, in "
             "a shuffled order that never times one right after its own call, each call "
             f"after a {peers.SETTLE_S * 1e3:.0f} ms pause and then until the process is quiet: "
             "rankattn.peers.settle), shown as "
             "the range of that median over the runs. \"% mm\" counts only visible "
             "query-key pairs, against XLA's fp32 2048^3 matmul timed in the same rounds "
             "(bf16 rows too, so they can pass 100%); \"temp MiB\" is XLA's "
             "compiled scratch memory, which does not hold the buffers the cpu kernel "
             "allocates itself (the peak of a process running it alone is in a machine's "
             "notes, where its runs measured it). \"rankattn, "
             "float32 inputs\" beside a bf16 workload is rankattn on the same shape in "
             "float32, so its ratio says how much faster bf16 is.", ""]
    lines += every_machine_table([m for m in machines if m.runs])
    for m in machines:
        lines += machine_markdown(m)
    return "\n".join(lines) + "\n"


def every_machine_table(machines: list[Machine]) -> list[str]:
    """Every workload's best peer / rankattn and % mm, a pair of columns per machine (the
    machines measured most recently first)."""
    lines = ["## Every machine", "",
             "Each workload against its best peer on each machine (the peer named in the "
             "machine's section), and rankattn's share of that machine's float32 matmul "
             "rate:", "",
             "| workload | " + " | ".join(f"{m.name}: peer / rankattn | % mm" for m in machines)
             + " |", "|---|" + "---:|---:|" * len(machines)]
    names = list(dict.fromkeys(r["workload"] for m in machines for run in m.runs
                               for r in run["rows"]))
    for name in names:
        cells = []
        for m in machines:
            ratios = [row["ratio"] for _, row in (best_peer(run["rows"], name) for run in m.runs)
                      if row]
            mm = [r["mm"] for run in m.runs for r in run["rows"]
                  if r["workload"] == name and r["impl"] == OURS]
            cells += [span(ratios), span(mm, "{:.0%}")]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines + [""]


def machine_markdown(m: Machine) -> list[str]:
    """One machine's section: its runs, targets, every workload, notes, what makes its runs
    vary, the primitives behind the misses, its sweep's summary."""
    runs, sweep = m.runs, m.sweep
    lines = [f"## {m.name}", ""]
    if not runs:
        return lines + ["No full run on this machine; its sweep: [SWEEP.md](SWEEP.md).", ""]
    lines += ["Runs:", ""] + [f"- run {i + 1}: {run_header(run)}" for i, run in enumerate(runs)]
    lines += ["", "### Targets", "", "| target | measured (range over runs) | verdict |",
              "|---|---|---|"]
    for target, measured, met in targets(runs, sweep):
        verdict = "not measured" if met is None else ("MET" if met else "MISSED")
        lines.append(f"| {target} | {measured} | {verdict} |")
    lines += ["", "### Every workload", "",
              "| workload | impl | median ms | peer / rankattn | quartiles of the ratio | % mm "
              "| temp MiB | other load | steal |", "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    keys = list(dict.fromkeys((r["workload"], r["impl"]) for run in runs for r in run["rows"]))
    for workload, impl in keys:
        rows = [r for run in runs for r in run["rows"]
                if r["workload"] == workload and r["impl"] == impl]
        ratio = "1 (ours)" if impl == OURS else span([r["ratio"] for r in rows])
        quart = "" if impl == OURS else "; ".join(f"{r['ratio_q1']:.2f}-{r['ratio_q3']:.2f}"
                                                  for r in rows)
        lines.append(f"| {workload} | {impl} | {span([r['ms'] for r in rows], '{:.1f}')} | {ratio} "
                     f"| {quart} | {span([r['mm'] for r in rows], '{:.0%}')} "
                     f"| {span([r['temp_mib'] for r in rows], '{:.0f}')} "
                     f"| {span([r.get('others') for r in rows], '{:.0%}')} "
                     f"| {span([r.get('steal') for r in rows], '{:.0%}')} |")
    notes = sorted({shown_note(n) for run in runs for n in run["meta"]["notes"]})
    if notes:
        lines += ["", "Notes from the runs:", ""] + [f"- {n}" for n in notes]
    sensitivity = [x for run in runs for x in run.get("sensitivity", [])]
    if sensitivity:
        lines += ["", "### What makes runs vary", "",
                  "\"other load\" above is the share of the machine's cores that other "
                  "processes used while a workload was timed, \"steal\" the share the host "
                  "gave to other virtual machines. torch's OpenMP kernels stall "
                  "when a core is taken from them, XLA's thread pool much less, so ratios to "
                  "torch move with that load. Each run measures it directly, alone and beside "
                  "one process spinning on a core:", "",
                  "| run | workload | load | rankattn ms | torch SDPA ms | SDPA / rankattn |",
                  "|---|---|---|---:|---:|---:|"]
        for i, run in enumerate(runs):
            lines += [f"| {i + 1} | {x['workload']} | {x['load']} | {x['ours_ms']:.1f} "
                      f"| {x['sdpa_ms']:.1f} | {x['ratio']:.2f} |"
                      for x in run.get("sensitivity", [])]
    lines += ["", "Where the fused cpu kernel's time goes, measured, and what bounds the targets "
              "it misses: [CPU_KERNEL.md](CPU_KERNEL.md)."]
    profile = runs[-1].get("primitives", [])
    if profile:
        lines += ["", "### What limits the misses", "",
                  "XLA:CPU's own primitives against torch's at the shapes of nano-fwd's steps "
                  "and of short-fwd (per-round "
                  "ratio torch / XLA; < 1 means torch is faster). Every XLA program, rankattn "
                  "and the dense peers alike, is built from these operations.", "",
                  "| operation | XLA ms | torch ms | torch / XLA |", "|---|---:|---:|---:|"]
        lines += [f"| {p['op']} | {p['xla_ms']:.2f} | {p['torch_ms']:.2f} | {p['ratio']:.2f} |"
                  for p in profile]
    if sweep:
        lines += ["", "### The shape sweep", "",
                  f"[SWEEP.md](SWEEP.md) has every cell of every machine. {sweep_base()} "
                  f"{sweep_run_line(sweep)}"]
    return lines + [""]


def sweep_base() -> str:
    b = SWEEP_BASE
    return (f"Base cell: B={b.batch}, history {b.sessions[0][0]} + {b.sessions[0][1]} candidates, "
            f"{b.q_heads}/{b.kv_heads} heads, D={b.head_dim}, float32; one dimension varies at a "
            f"time.")


def sweep_run_line(sweep: dict) -> str:
    older = "; ".join(older_methods(sweep["meta"]))
    return (f"Sweep run: {sweep['meta']['date']}, {SWEEP_REPEATS} rounds per cell (fewer past "
            f"{ROUND_BUDGET_S:.0f} s), dense XLA peers up to {SWEEP_DENSE_LIMIT >> 30} GiB of "
            f"logits. The base cell is one measurement, shown in every dimension."
            + (f" Timed with {older}." if older else ""))


def sweep_markdown(machines: list[Machine]) -> str:
    """SWEEP.md: a table per machine, the most recently swept first; the plots are of the
    first."""
    swept = sorted((m for m in machines if m.sweep), key=lambda m: m.swept, reverse=True)
    lines = ["# Shape sweep", "", "Generated by `benchmarks/bench.py --sweep` (from "
             "`benchmarks/results/<machine>/sweep.json`); do not edit by hand. A sweep "
             "replaces only the table of the machine it runs on.", "",
             f"{sweep_base()} \"best peer / rankattn\" > 1 means rankattn is faster; the "
             f"quartiles are those of the per-round ratio; \"other load\" is the share of the "
             f"cores other processes used meanwhile (torch's thread pool suffers most).", "",
             f"[sweep.png](sweep.png) (the heat map of best peer / rankattn) and "
             f"[time_vs_history.png](time_vs_history.png) are of {swept[0].name}, the machine "
             f"swept last.", "",
             "![best peer / rankattn over the sweep](sweep.png)", ""]
    for m in swept:
        lines += [f"## {m.name}", "", sweep_run_line(m.sweep), "",
                  "| dimension | value | direction | rankattn ms | best peer | its ms "
                  "| best peer / rankattn | quartiles | other load |",
                  "|---|---|---|---:|---|---:|---:|---:|---:|"]
        for c in sweep_table(m.sweep):
            if c["peer"] is None:
                lines.append(f"| {c['dim']} | {c['value']} | {c['direction']} "
                             f"| {c['ours_ms']:.1f} | none ran | | | | |")
                continue
            lines.append(f"| {c['dim']} | {c['value']} | {c['direction']} | {c['ours_ms']:.1f} | "
                         f"{c['peer']} | {c['peer_ms']:.1f} | {c['ratio']:.2f} | "
                         f"{c['q1']:.2f}-{c['q3']:.2f} | {span([c['others']], '{:.0%}')} |")
        failures = m.sweep["meta"]["notes"]
        if failures:
            lines += ["", "Peers that could not run:", ""] + [f"- {f}" for f in failures]
        lines.append("")
    return "\n".join(lines)


def sweep_heatmap(machine: Machine, path: str):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import LogNorm

    sweep = machine.sweep
    cells = sweep_table(sweep)
    dims = list(SWEEP_DIMENSIONS)
    width = max(len(v) for v in SWEEP_DIMENSIONS.values())
    fig, axes = plt.subplots(1, 2, figsize=(15, 5.2))
    norm = LogNorm(vmin=0.25, vmax=4)
    for ax, direction in zip(axes, ("fwd", "fwdbwd")):
        grid = np.full((len(dims), width), np.nan)
        for c in cells:
            if c["direction"] == direction and c["ratio"] is not None:
                i = dims.index(c["dim"])
                j = list(SWEEP_DIMENSIONS[c["dim"]]).index(c["value"])
                grid[i, j] = c["ratio"]
                ax.text(j, i, f"{c['value']}\n{c['ratio']:.2f}", ha="center", va="center",
                        fontsize=7)
        image = ax.imshow(np.clip(grid, 0.25, 4), cmap="RdYlGn", norm=norm, aspect="auto")
        ax.set_yticks(range(len(dims)), dims)
        ax.set_xticks([])
        ax.set_title(f"{'forward' if direction == 'fwd' else 'forward + backward'}: "
                     f"best peer / rankattn (> 1: rankattn faster)", fontsize=9)
    fig.colorbar(image, ax=axes, shrink=0.8)
    fig.suptitle(f"{machine.name}. {sweep_base()}", fontsize=8)
    fig.savefig(path, dpi=110)


def history_plot(machine: Machine, path: str):
    """Forward time against history length, from the sweep's history cells."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series: dict[str, list[tuple[int, float]]] = {}
    for cell in machine.sweep["cells"]:
        if cell["dim"] == "history" and cell["direction"] == "fwd":
            for r in cell["rows"]:
                series.setdefault(r["impl"], []).append((int(cell["value"]), r["ms"]))
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, points in series.items():
        xs, ys = zip(*sorted(points))
        ax.plot(xs, ys, marker="o", label=name, lw=2.5 if name == OURS else 1.2)
    histories = sorted({x for points in series.values() for x, _ in points})
    b = SWEEP_BASE
    ax.set(xscale="log", yscale="log",
           xlabel=f"history length (+64 candidates), B={b.batch}, {b.q_heads}/{b.kv_heads} "
                  f"heads, D={b.head_dim}", ylabel="forward time, median ms",
           title=f"Candidate-isolation attention on {machine.name} (bench.py --sweep)")
    ax.minorticks_off()
    ax.set_xticks(histories, [str(h) for h in histories])
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


README_BEGIN, README_END = "<!-- bench.py results: begin -->", "<!-- bench.py results: end -->"
SWEEP_BEGIN, SWEEP_END = "<!-- bench.py sweep: begin -->", "<!-- bench.py sweep: end -->"
HEADLINE = ("nano-fwd", "nano-fwdbwd", "prod-heads-fwd", "short-fwd", "packed-fwd",
            "packed-fwdbwd", "long-history-fwd")


def readme_block(machines: list[Machine]) -> str:
    """The README's headline table: HEADLINE's workloads on every machine with full runs."""
    machines = [m for m in machines if m.runs]
    lines = [README_BEGIN,
             f"Headline numbers from [benchmarks/RESULTS.md](benchmarks/RESULTS.md) (full runs "
             f"of `{COMMAND}` on each machine, the most recent first; ranges are over a "
             f"machine's runs; ratio = peer time / rankattn time, the median of per-round "
             f"ratios):", "",
             "| machine | workload | rankattn ms | best peer | peer / rankattn |",
             "|---|---|---:|---|---:|"]
    for m in machines:
        for name in HEADLINE:
            mine = [r["ms"] for run in m.runs for r in run["rows"]
                    if r["workload"] == name and r["impl"] == OURS]
            best = [best_peer(run["rows"], name) for run in m.runs]
            if not mine:
                continue
            lines.append(f"| {m.name} | {name} | {span(mine, '{:.0f}')} | "
                         f"{best_peer_names(best)} | "
                         f"{span([row['ratio'] for _, row in best if row])} |")
    lines.append(README_END)
    return "\n".join(lines)


def readme_sweep_block(machines: list[Machine]) -> str:
    """The README's sweep summary, per machine swept (the most recent first): the shapes at or
    past the best peer in each direction, the lowest, and bf16's speed-up over float32 in the
    bf16 cell, as measured: the per-round float32 / bf16 ratio of that cell's own rows."""
    swept = sorted((m for m in machines if m.sweep), key=lambda m: m.swept, reverse=True)
    lines = [SWEEP_BEGIN, f"From [benchmarks/SWEEP.md](benchmarks/SWEEP.md) (`{COMMAND} "
             f"--sweep`); {sweep_base()[len('Base cell: '):]} Per machine, the shapes at or past "
             "the best peer (the base cell counted once), the lowest best peer / rankattn, and "
             "how much faster bf16 runs the base cell than float32 (the median of per-round "
             "float32 / bf16 times):", "",
             "| machine | swept | forward | forward + backward "
             "| bf16 over float32 (fwd, fwd+bwd) |",
             "|---|---|---|---|---|"]
    for m in swept:
        cells, speedups = [], []
        for direction in ("fwd", "fwdbwd"):
            shapes = distinct_cells([c for c in sweep_table(m.sweep)
                                     if c["direction"] == direction])
            rated = [c for c in shapes if c["ratio"] is not None]
            met = sum(c["ratio"] >= 1.0 for c in rated)
            worst = min(rated, key=lambda c: c["ratio"], default=None)
            missing = len(shapes) - len(rated)
            unrated = f" ({missing} with no peer)" if missing else ""
            cells.append(f"{met} of {len(shapes)}{unrated}; lowest {worst['ratio']:.2f}x "
                         f"({worst['dim']}={worst['value']})" if worst else "no peer ran")
            f32 = [r["ratio"] for c in m.sweep["cells"] if c["direction"] == direction
                   and c["dim"] == "dtype" and c["value"] == "bfloat16"
                   for r in c["rows"] if r["impl"] == OURS_F32]
            speedups.append(f"{f32[0]:.2f}x" if f32 else "not run")
        lines.append(f"| {m.name} | {m.swept} | {cells[0]} | {cells[1]} | "
                     f"{', '.join(speedups)} |")
    lines.append(SWEEP_END)
    return "\n".join(lines)


def replace_block(text: str, begin: str, end: str, block: str) -> str:
    """``text`` with what lies between the markers ``begin`` and ``end`` replaced by ``block``
    (which holds them)."""
    return re.sub(re.escape(begin) + ".*?" + re.escape(end), lambda _: block, text, flags=re.S)


def write_reports(results_dir: str = RESULTS_DIR, out_dir: str = HERE, readme: str = README,
                  draw: bool = True):
    """RESULTS.md, SWEEP.md, the README's results block and (``draw``) the PNGs, from the
    JSON records of every machine under ``results_dir``."""
    machines = load_machines(results_dir)
    if any(m.runs for m in machines):
        with open(os.path.join(out_dir, "RESULTS.md"), "w") as f:
            f.write(results_markdown(machines))
        text = open(readme).read()
        with open(readme, "w") as f:
            f.write(replace_block(text, README_BEGIN, README_END, readme_block(machines)))
    swept = sorted((m for m in machines if m.sweep), key=lambda m: m.swept, reverse=True)
    if swept:
        with open(os.path.join(out_dir, "SWEEP.md"), "w") as f:
            f.write(sweep_markdown(machines))
        text = open(readme).read()
        with open(readme, "w") as f:
            f.write(replace_block(text, SWEEP_BEGIN, SWEEP_END, readme_sweep_block(machines)))
        if draw:
            sweep_heatmap(swept[0], os.path.join(out_dir, "sweep.png"))
            history_plot(swept[0], os.path.join(out_dir, "time_vs_history.png"))
    print(f"wrote the reports of {len(machines)} machine(s): "
          + "; ".join(f"{m.name}: {len(m.runs)} runs{', the sweep' if m.sweep else ''}"
                      for m in machines))


# --- Entry points. --------------------------------------------------------------------


def meta(rates: dict[str, float], notes: list[str]) -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                   if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return dict(date=datetime.datetime.now().strftime("%Y-%m-%d %H:%M"),
                machine=peers.machine_description(), jax=jax.__version__,
                backend=jax.default_backend(), torch=torch.__version__ if torch else "not installed",
                cpu=cpu, cores=os.cpu_count(), rate=matmul_rate(rates), gemm_rates=rates,
                mm_per_round=True, settled=True, notes=notes)


def print_rows(rows: list[dict]) -> str:
    lines = ["| workload | impl | median ms | peer / rankattn | quartiles | % mm | temp MiB "
             "| other load | steal |", "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        temp = "" if r["temp_mib"] is None else f"{r['temp_mib']:.0f}"
        lines.append(f"| {r['workload']} | {r['impl']} | {r['ms']:.1f} | {r['ratio']:.2f} | "
                     f"{r['ratio_q1']:.2f}-{r['ratio_q3']:.2f} | {r['mm']:.0%} | {temp} "
                     f"| {r['others']:.0%} | {r['steal']:.0%} |")
    return "\n".join(lines)


def full_run(chosen: list[Workload], repeats: int, save: str | None, smoke: bool = False):
    """Time ``chosen``; with ``save``, also the profile, the load sensitivity and the peak RSS,
    and save the run there. ``smoke``: workloads(smoke=True) and a tiny matmul."""
    gemm_size = SMOKE_GEMM_SIZE if smoke else GEMM_SIZE
    rates = gemm_rates(repeats, size=gemm_size)
    print(f"jax {jax.__version__} on {jax.default_backend()}, torch "
          f"{torch.__version__ if torch else 'not installed'}, matmul GFLOP/s "
          + ", ".join(f"{n} {r / 1e9:.0f}" for n, r in rates.items()) + "\n", flush=True)
    notes, rows = [], []
    for w in chosen:
        start = time.perf_counter()
        new = run_workload(w, repeats, gemm_size, notes)
        rows += new
        print(print_rows(new), f"\n({time.perf_counter() - start:.0f} s)\n", flush=True)
    if save:
        profile = primitives(repeats if smoke else max(repeats, 15))
        for p in profile:
            print(f"{p['op']}: XLA {p['xla_ms']:.2f} ms, torch {p['torch_ms']:.2f} ms", flush=True)
        sensitivity = load_sensitivity(workloads(smoke), repeats)
        for x in sensitivity:
            print(f"{x['workload']} {x['load']}: rankattn {x['ours_ms']:.1f} ms, torch SDPA "
                  f"{x['sdpa_ms']:.1f} ms, ratio {x['ratio']:.2f}", flush=True)
        w = workloads(smoke)["long-history-fwdbwd"]
        rss = peak_rss_gib(w.name, smoke)
        measured = "not reported by this system" if rss is None else f"{rss:.2f} GiB"
        notes.append(f"{w.name}: {RSS_NOTE}, inputs included: {measured} in this run; one dense "
                     f"float32 [S, S] tensor is {w.seq_len ** 2 * 4 / 2 ** 30:.1f} GiB per head")
        with open(save, "w") as f:
            json.dump(dict(meta=meta(rates, notes), rows=rows, primitives=profile,
                           sensitivity=sensitivity), f, indent=1)
        print(f"saved {save}")


def sweep_run(repeats: int, direction: str | None = None, results_dir: str = RESULTS_DIR,
              smoke: bool = False):
    """The sweep; with ``direction`` ("fwd" / "fwdbwd") only its cells, replacing them in
    sweep.json (this machine's, under ``results_dir``). ``smoke``: sweep_cells(smoke=True)
    and a tiny matmul."""
    gemm_size = SMOKE_GEMM_SIZE if smoke else GEMM_SIZE
    rates = gemm_rates(repeats, size=gemm_size)
    notes, cells, measured = [], [], {}
    for dim, value, w in sweep_cells((direction,) if direction else ("fwd", "fwdbwd"), smoke):
        start = time.perf_counter()
        shape = dataclasses.replace(w, name="")  # the base cell recurs in every dimension
        if shape not in measured:
            measured[shape] = run_workload(w, repeats, gemm_size, notes,
                                           dense_limit=SWEEP_DENSE_LIMIT)
        rows = [dict(r, workload=w.name) for r in measured[shape]]
        cells.append(dict(dim=dim, value=value, direction="fwdbwd" if w.backward else "fwd",
                          workload=w.name, rows=rows))
        peer, row = best_peer(rows, w.name)
        print(f"{w.name}: rankattn {rows[0]['ms']:.1f} ms, best peer {peer} "
              f"{row['ratio'] if row else float('nan'):.2f}x ({time.perf_counter() - start:.0f} s)",
              flush=True)
    folder = machine_folder(results_dir)
    os.makedirs(folder, exist_ok=True)
    record = dict(meta=meta(rates, notes), cells=cells)
    old = load_sweep(folder)
    if direction and old:  # keep the other direction's cells and say when each half ran
        record["cells"] = [c for c in old["cells"] if c["direction"] != direction] + cells
        record["meta"]["date"] = "; ".join(
            f"{d} {record['meta']['date'] if d == direction else direction_date(old, d)}"
            for d in ("fwd", "fwdbwd"))
        record["meta"]["notes"] = sorted(set(old["meta"]["notes"]) | set(notes))
    with open(os.path.join(folder, "sweep.json"), "w") as f:
        json.dump(record, f, indent=1)


def direction_date(sweep: dict, direction: str) -> str:
    """When ``sweep`` measured ``direction``'s cells: its own date in a merged record."""
    found = re.search(rf"\b{direction} (\d{{4}}-\d\d-\d\d \d\d:\d\d)", sweep["meta"]["date"])
    return found.group(1) if found else sweep["meta"]["date"]


def output_paths(out: str | None) -> tuple[str, str, str]:
    """(results folder, reports folder, README): benchmarks/results, benchmarks/ and the README
    without ``out``; else out/results, out and a copy of the README in out."""
    if out is None:
        return RESULTS_DIR, HERE, README
    readme = os.path.join(out, "README.md")
    if not os.path.exists(readme):
        os.makedirs(out, exist_ok=True)
        shutil.copy(README, readme)
    return os.path.join(out, "results"), out, readme


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=2,
                        help="full runs, each in a fresh process (default 2)")
    parser.add_argument("--sweep", action="store_true", help="the shape sweep")
    parser.add_argument("--direction", choices=("fwd", "fwdbwd"),
                        help="--sweep: rerun only this direction's cells")
    parser.add_argument("--report", action="store_true", help="only rewrite the reports")
    parser.add_argument("--only", nargs="*", help="print these workloads; write nothing")
    parser.add_argument("--repeats", type=int, default=9, help="rounds per workload at most")
    parser.add_argument("--no-torch", action="store_true", help="skip the PyTorch peers")
    parser.add_argument("--smoke", action="store_true",
                        help="check the script: tiny shapes, 1 round, 1 run of SMOKE_WORKLOADS, "
                             "the reports into --out (default: a new temporary folder)")
    parser.add_argument("--out", help="write results/, the reports and a copy of the README "
                                      "here, not into benchmarks/ and the README")
    parser.add_argument("--save", help=argparse.SUPPRESS)  # one full run, into this file
    parser.add_argument("--rss-child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    by_name = workloads(args.smoke)
    if args.smoke:
        args.repeats, args.runs = 1, 1

    if args.rss_child:
        run, _ = jax_runner(by_name[args.rss_child], ours)
        jax.block_until_ready(run())
        peak = own_peak_rss_bytes()
        print("unknown" if peak is None else peak / 2 ** 30)
        return
    if args.only is not None or args.save:
        unknown = set(args.only or ()) - set(by_name)
        if unknown:
            parser.error(f"unknown workloads {sorted(unknown)}; choose from {sorted(by_name)}")
        chosen = [w for w in by_name.values() if not args.only or w.name in args.only]
        full_run(chosen, args.repeats, args.save, args.smoke)
        return
    if args.smoke and not args.out:
        args.out = tempfile.mkdtemp(prefix="bench-smoke-")
    results_dir, out_dir, readme = output_paths(args.out)
    if args.sweep:
        sweep_run(min(args.repeats, SWEEP_REPEATS), args.direction, results_dir, args.smoke)
    elif not args.report:
        folder = machine_folder(results_dir)
        os.makedirs(folder, exist_ok=True)
        for old in glob.glob(os.path.join(folder, "run-*.json")):
            os.remove(old)  # a record is the runs of one invocation, never a mix
        extra = (["--no-torch"] if args.no_torch else []) + (
            ["--smoke", "--only", *SMOKE_WORKLOADS] if args.smoke else [])
        for i in range(args.runs):
            print(f"=== full run {i + 1} of {args.runs} (a fresh process) ===", flush=True)
            subprocess.run([sys.executable, __file__, "--repeats", str(args.repeats), *extra,
                            "--save", os.path.join(folder, f"run-{i + 1}.json")], check=True)
    write_reports(results_dir, out_dir, readme)
    if args.out:
        print(f"results and reports in {args.out}")


if __name__ == "__main__":
    main()
