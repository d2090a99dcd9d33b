"""What a call costs beyond its arithmetic (CPU): short calls, the 64-candidate serving request
and calls with no work, each timed after the machine idled and back to back, with the fused
kernel's pool workers moved off their caller's CPU (the default) and left there
(RANKATTN_CPU_MOVE_WORKERS=0), in alternating processes.

    .venv/bin/python benchmarks/call_costs.py   # CALL_COSTS.md, results/<machine>/call_costs.json
    .venv/bin/python benchmarks/call_costs.py --smoke --out DIR   # tiny shapes, 2 processes

"After a pause": the machine idles 20 ms before each timed call, and then until the process is
quiet, as bench.py times every call (torch's threads stop spinning). "Back to back": 2 untimed calls of the same function come
first, as at a busy server. Each process times every call both ways, round-robin; the times
are medians over all rounds of a setting's processes, "stayed / moved" the median over pairs
of consecutive processes (one of each setting) of the ratio of their medians.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import glob
import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
OUT = HERE / "CALL_COSTS.md"
COMMAND = ".venv/bin/python benchmarks/call_costs.py"
MODES = {"after a pause": 0, "back to back": 2}  # untimed calls before each timed one
SETTINGS = {"moved": "1", "stayed": "0"}  # RANKATTN_CPU_MOVE_WORKERS
NOTE = """\
Why workers move: Linux may wake a pool worker onto the CPU of the thread that woke it, where
the two then share one CPU while another idles, until the scheduler's balancing separates them
(milliseconds). `RANKATTN_CPU_TRACE=1` prints, per parallel region of the kernel, when each
thread started and on which CPU: on the 2-core KVM guest this was first measured on, after a
20 ms pause the caller and its worker were on one CPU in most calls, the caller starting up
to 4 ms late or the worker finding every task taken. A worker that finds itself on its
caller's CPU with tasks left now moves to the other CPUs it may run on until its share is
done (`AwayFrom` in `cpu_kernel/runtime.h`). Such a worker cannot run, and so cannot move,
until the caller's time slice ends (2.3-3.7 ms on a 2-core Zen 4 VM), so the caller yields
its CPU before each task while a worker is late (`kWorkerLate`). "Stayed"
(`RANKATTN_CPU_MOVE_WORKERS=0`) turns off both."""

NOISE = """\
How far apart two processes land by chance: "stayed / moved" is one ratio per pair of
processes, their median shown with their range in parentheses (records before 2026-12-07
kept the median only). `RANKATTN_CPU_MOVE_WORKERS` moves only the fused kernel's pool
workers, so torch SDPA's rows measure that chance: a ratio of rankattn's no further from 1
than torch's on the same machine is not shown to be an effect of moving workers. The two
millisecond columns are medians of all rounds of a setting's processes pooled, so their
ratio can differ from the median of the per-pair ratios."""


def calls(smoke: bool) -> dict:
    """{name: (zero-argument function, FLOPs on visible pairs or None)} of this process;
    ``smoke``: one of each kind, at tiny shapes."""
    import jax
    import jax.numpy as jnp

    import bench
    import bench_serving
    from rankattn import serving

    out = {}
    x = jnp.ones((8,), jnp.float32)
    floor = jax.jit(lambda x: x + 1)
    out["a jitted x + 1 (any call's floor)"] = (lambda: floor(x), None)
    by_name = bench.workloads(smoke)
    tiny = dataclasses.replace(by_name["short-fwd"], batch=1, sessions=((6, 2),), q_heads=1,
                               kv_heads=1, head_dim=8)
    workloads = {"rankattn, almost no work (8 tokens, D 8)": tiny,
                 **{name: by_name[name] for name in ("short-fwd", "short-fwdbwd", "nano-fwd")}}
    for label, w in list(workloads.items())[:2 if smoke else None]:
        out[label] = (bench.jax_runner(w, bench.ours)[0], w.flops)
    # The machine's own rate on a call of short-fwd's size: after a pause, idle cores wake
    # slowly and run slower for a while, whatever the program.
    n = round((by_name["short-fwd"].flops / 2) ** (1 / 3))
    a = jnp.ones((n, n), jnp.float32)
    matmul = jax.jit(jnp.matmul)
    out["XLA's float32 matmul of short-fwd's FLOPs"] = (lambda: matmul(a, a), 2 * n ** 3)
    if bench.torch is not None:
        out["torch SDPA, short-fwd"] = (bench.torch_sdpa(by_name["short-fwd"]), None)
    history = 40 if smoke else 1022
    for users in (1,) if smoke else (1, 4):
        _, (cache, q, kc, vc), _ = bench_serving.peer_inputs(users, history, 64, 4, 2,
                                                             "float32")
        attend = jax.jit(lambda cache, q, kc, vc, u=users: serving.attend(
            q, cache, jnp.arange(u), self_kv=(kc, vc)))
        flops = 4 * users * 4 * 64 * (history + 1) * bench_serving.EXACT["head_dim"]
        out[f"serving.attend, {users} x {history} x 64 candidates"] = (
            lambda f=attend, a=(cache, q, kc, vc): f(*a), flops)
    return out


def child(rounds: int, smoke: bool, rate: bool) -> None:
    """One process: every call both ways; prints {name: {mode: [seconds]}}, the FLOPs, the
    versions and (``rate``) the matmul rate as JSON."""
    import jax

    import bench
    from rankattn import peers

    record = dict(jax=jax.__version__,
                  torch=bench.torch.__version__ if bench.torch else "not installed")
    if rate:
        size = bench.SMOKE_GEMM_SIZE if smoke else bench.GEMM_SIZE
        # As many rounds as bench.py's runs take (3 had read 191 GFLOP/s where they read
        # 203-210 the same day, and nano-fwd then at 104% of it).
        record["rate"] = bench.matmul_rate(bench.gemm_rates(1 if smoke else 9, size=size))
    fns = calls(smoke)
    for fn, _ in fns.values():
        jax.block_until_ready(fn())
    times = {name: {} for name in fns}
    for mode, warm_calls in MODES.items():
        t = peers.interleaved_times({n: f for n, (f, _) in fns.items()}, rounds, warm_up=False,
                                    warm_calls=warm_calls)
        for name, x in t.items():
            times[name][mode] = x.tolist()
    record.update(times=times, flops={name: f for name, (_, f) in fns.items()})
    print("RESULT " + json.dumps(record), flush=True)


def measure(processes: int, rounds: int, smoke: bool) -> dict:
    """Alternating child processes per setting: {setting: [child results]}."""
    runs = {s: [] for s in SETTINGS}
    for i in range(processes):
        setting = list(SETTINGS)[i % len(SETTINGS)]
        env = dict(os.environ, RANKATTN_CPU_MOVE_WORKERS=SETTINGS[setting])
        args = [sys.executable, __file__, "--child", "--rounds", str(rounds),
                *(["--smoke"] if smoke else []), *(["--rate"] if i == 0 else [])]
        done = subprocess.run(args, env=env, text=True, capture_output=True, check=False)
        line = next((x for x in done.stdout.splitlines() if x.startswith("RESULT ")), None)
        if done.returncode or line is None:
            raise SystemExit(f"a {setting} process failed:\n{done.stderr[-3000:]}")
        runs[setting].append(json.loads(line[len("RESULT "):]))
        print(f"process {i + 1} of {processes} ({setting}) done", flush=True)
    return runs


def summary(runs: dict) -> list[dict]:
    """Per call and mode: median ms per setting, the per-process ratio stayed / moved, and the
    share of the matmul rate."""
    import numpy as np

    first = runs["moved"][0]
    rows = []
    for name in first["times"]:
        for mode in MODES:
            ms = {s: float(np.median(np.concatenate([r["times"][name][mode] for r in rs]))) * 1e3
                  for s, rs in runs.items()}
            per = [np.median(b["times"][name][mode]) / np.median(a["times"][name][mode])
                   for a, b in zip(runs["moved"], runs["stayed"])]
            rows.append(dict(call=name, mode=mode, ms=ms, gain=float(np.median(per)),
                             gains=[float(x) for x in per], flops=first["flops"][name]))
    return rows


def report(results_dir: Path) -> str:
    """CALL_COSTS.md: every machine's table, the most recently measured first."""
    records = [json.load(open(p)) for p in glob.glob(str(results_dir / "*" / "call_costs.json"))]
    records.sort(key=lambda r: r["date"], reverse=True)
    lines = ["# What a call costs beyond its arithmetic (CPU)", "",
             f"Generated by `benchmarks/call_costs.py` from "
             f"`benchmarks/results/<machine>/call_costs.json`; do not edit by hand. Reproduce "
             f"with `{COMMAND}` (a run replaces only its own machine's record).", "",
             __doc__.split("\n\n")[2].replace("\n", " ").strip(), "", NOTE, "", NOISE, ""]
    for r in records:
        lines += [f"## {r['machine']}", "",
                  f"{r['date']}, jax {r['jax']}, torch {r['torch']}, {r['processes']} processes "
                  f"of {r['rounds']} rounds; matmul rate {r['rate'] / 1e9:.0f} GFLOP/s (the "
                  f"faster of XLA's and torch's 2048^3 float32). \"% mm\": the call's FLOPs "
                  f"on visible (query, key) pairs over its time, against that rate.", "",
                  "| call | when | workers moved (ms) | stayed (ms) | stayed / moved | % mm, "
                  "moved |", "|---|---|---:|---:|---:|---:|"]
        for row in r["rows"]:
            mm = ("" if row["flops"] is None
                  else f"{row['flops'] / (row['ms']['moved'] / 1e3) / r['rate']:.0%}")
            pairs = row.get("gains")  # (records before 2026-12-07 kept the median only)
            spread = f" ({min(pairs):.2f}-{max(pairs):.2f})" if pairs else ""
            lines.append(f"| {row['call']} | {row['mode']} | {row['ms']['moved']:.3f} | "
                         f"{row['ms']['stayed']:.3f} | {row['gain']:.2f}x{spread} | {mm} |")
        lines.append("")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--processes", type=int, default=6, help="alternating, 3 per setting")
    parser.add_argument("--rounds", type=int, default=15, help="per process and mode")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, 2 processes, 1 round")
    parser.add_argument("--out", help="write results/ and CALL_COSTS.md here")
    parser.add_argument("--report", action="store_true", help="only rewrite CALL_COSTS.md")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--rate", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.smoke:
        args.processes, args.rounds = 2, 1
    if args.child:
        sys.path.insert(0, str(HERE))
        child(args.rounds, args.smoke, args.rate)
        return 0
    from rankattn import peers  # (the children import bench, torch and the calls)

    if args.report:
        OUT.write_text(report(HERE / "results"))
        return 0
    runs = measure(args.processes, args.rounds, args.smoke)
    results_dir = Path(args.out) / "results" if args.out else HERE / "results"
    machine = peers.machine_description()
    folder = results_dir / peers.machine_slug(machine)  # as bench.machine_folder
    folder.mkdir(parents=True, exist_ok=True)
    first = runs["moved"][0]
    record = dict(machine=machine, date=datetime.datetime.now().strftime("%Y-%m-%d %H:%M"),
                  jax=first["jax"], torch=first["torch"], processes=args.processes,
                  rounds=args.rounds, rate=first["rate"], rows=summary(runs))
    (folder / "call_costs.json").write_text(json.dumps(record, indent=1) + "\n")
    text = report(results_dir)
    out = Path(args.out) / "CALL_COSTS.md" if args.out else OUT
    out.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
