"""One workload on the cpu kernel, called back to back for a while: a target for a sampling
profiler, to see where a call's time goes.

    perf record -F 2000 -g -o /tmp/perf.data -- \\
        .venv/bin/python benchmarks/profile_cpu.py serving-64 --seconds 10
    perf report -i /tmp/perf.data --no-children -g none --sort dso,sym

WORKLOAD: a workload of bench.py (nano-fwd, nano-fwdbwd, short-fwd, short-fwdbwd, ...), a cell
of its shape sweep by its name in sweep.json (quoted: "head dim=80 fwdbwd"), or serving-64:
bench_serving.py's exact 64-candidate request (4 users x 1022 history events x 64 candidates,
4 / 2 heads, D=128) through `jax.jit(serving.attend)`, what the ranking server runs on every
hit (--users 1: one user's request). --dtype bfloat16 for either; --block-sizes 64,128 runs a
workload at other block sizes than the default (`Cpu(BlockSizes(64, 128))`); --pause-ms 20 idles
before each call, as bench.py times calls (with RANKATTN_CPU_TRACE=1: when the pool's workers
start after a pause). Prints the calls made and the median ms per call (the first call, which
compiles, untimed). CPU_KERNEL.md's profiles came from it, and its instruction counts of the
kernel alone (one thread, so that every task runs inside the FFI handler; the first call
included):

    RANKATTN_CPU_THREADS=1 valgrind --tool=callgrind --toggle-collect=RankattnCpuForward \
        --toggle-collect=RankattnCpuPagedCandidatesForward \
        .venv/bin/python benchmarks/profile_cpu.py serving-64 --calls 1
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench  # noqa: E402
import bench_serving  # noqa: E402
import rankattn  # noqa: E402
from rankattn import serving  # noqa: E402
from rankattn.backends import BlockSizes  # noqa: E402
from rankattn.backends.cpu import Cpu  # noqa: E402

SERVING = "serving-64"


def serving_call(dtype: str, users: int = 4):
    """A zero-argument call of serving.attend at the 64-candidate request of ``users`` users."""
    _, (cache, q, k_self, v_self), _ = bench_serving.peer_inputs(users, 1022, 64, 4, 2, dtype)
    attend = jax.jit(lambda cache, q, k, v: serving.attend(q, cache, jnp.arange(users),
                                                           self_kv=(k, v)))
    return lambda: attend(cache, q, k_self, v_self)


def sweep_cells() -> dict[str, bench.Workload]:
    return {w.name: w for _, _, w in bench.sweep_cells()}


def workload_call(name: str, dtype: str, block_sizes: BlockSizes | None = None,
                  plan_outside: bool = False):
    """A zero-argument call of a bench.py workload or sweep cell on the cpu kernel; with
    ``plan_outside`` a forward whose plan was built once, outside the jitted call."""
    w = bench.workloads().get(name) or sweep_cells()[name]
    if dtype:
        w = dataclasses.replace(w, dtype=dtype)
    impl = Cpu(block_sizes)
    if not plan_outside:
        call, _ = bench.jax_runner(w, bench.rankattn_with(impl))
        return call
    q, k, v, seg, _ = bench.inputs(w)
    plan = rankattn.plan(segment_ids=seg, impl=impl)
    attend = jax.jit(lambda q, k, v, plan: rankattn.attention(q, k, v, plan=plan, impl=impl))
    return lambda: attend(q, k, v, plan)


def block_sizes_arg(text: str) -> BlockSizes:
    try:
        block_q, block_k = (int(x) for x in text.split(","))
        return BlockSizes(block_q, block_k)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r}: give two sizes, BLOCK_Q,BLOCK_K (64,256)") from None


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("workload", metavar="WORKLOAD",
                        choices=[SERVING, *bench.workloads(), *sweep_cells()],
                        help=f"{SERVING}, a bench.py workload or a sweep cell")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default=None,
                        help="the inputs' dtype (default: the workload's; serving-64: float32)")
    parser.add_argument("--block-sizes", type=block_sizes_arg, default=None, metavar="BQ,BK",
                        help="a workload's block sizes (default: the cpu backend's)")
    parser.add_argument("--seconds", type=float, default=10.0, help="how long to call it")
    parser.add_argument("--calls", type=int, default=None,
                        help="make exactly this many calls instead (for an instruction count, "
                             "which unlike seconds does not vary with the machine's load)")
    parser.add_argument("--pause-ms", type=float, default=0.0,
                        help="idle this long before each call, as bench.py does before every "
                             "timed call (its threads asleep: what a call costs after a pause)")
    parser.add_argument("--plan-outside", action="store_true",
                        help="a forward workload with its plan built once, outside the jitted "
                             "call (bench.py builds it in the call, as a model does per batch)")
    parser.add_argument("--users", type=int, default=4,
                        help=f"{SERVING}: the request's users (default 4)")
    args = parser.parse_args(argv)
    if args.users < 1:
        parser.error(f"--users {args.users}: give 1 or more users")
    if args.plan_outside and (args.workload == SERVING or "bwd" in args.workload):
        parser.error(f"--plan-outside: {args.workload} is not a forward workload of bench.py")
    call = (serving_call(args.dtype or "float32", args.users) if args.workload == SERVING
            else workload_call(args.workload, args.dtype, args.block_sizes, args.plan_outside))
    jax.block_until_ready(call())  # compiles
    times, end = [], time.perf_counter() + args.seconds
    while len(times) < args.calls if args.calls else time.perf_counter() < end:
        time.sleep(args.pause_ms / 1e3)
        start = time.perf_counter()
        jax.block_until_ready(call())
        times.append(time.perf_counter() - start)
    print(f"{args.workload}: {len(times)} calls, median {np.median(times) * 1e3:.3f} ms per call")


if __name__ == "__main__":
    main()
