"""A backend module at another git revision against the working tree's, interleaved (CPU).

    .venv/bin/python benchmarks/compare_revision.py REV [--backend xla] [--repeats 9] WORKLOAD...
    .venv/bin/python benchmarks/compare_revision.py HEAD --smoke   # bench.SMOKE_WORKLOADS, tiny

Loads ``src/rankattn/backends/<backend>.py`` as it was at ``REV`` beside today's,
runs each workload of benchmarks/bench.py (plus the named extras below) with
both and with torch SDPA when installed, round-robin, and prints the medians and
the median of per-round ratios "REV time / working tree time" (> 1: the
working tree is faster). Only that one module changes; everything it imports
(plans, semantics) is today's, so REV must be close enough to import them.
--smoke runs the workloads (default bench.SMOKE_WORKLOADS) at bench.smoke_version's
tiny shapes, one round.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys
import tempfile

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench  # noqa: E402
from rankattn import peers  # noqa: E402

# Shapes beside bench.py's: the base cell (2 + 1022 history + 64 candidates, 1088
# tokens, which 128-query blocks pad) and its MHA twin.
EXTRAS = [
    bench.Workload("base-fwd", 2, ((1024, 64),), 4, 2, 128),
    bench.Workload("base-fwdbwd", 2, ((1024, 64),), 4, 2, 128, backward=True),
    bench.Workload("mha-fwd", 2, ((1024, 64),), 4, 4, 128),
    bench.Workload("mha-fwdbwd", 2, ((1024, 64),), 4, 4, 128, backward=True),
]


def module_at(rev: str, path: str, name: str):
    """The module at ``path`` (from the repository root) as it was at ``rev``, as ``name``."""
    source = subprocess.run(["git", "show", f"{rev}:{path}"], check=True, capture_output=True,
                            text=True, cwd=ROOT).stdout
    file = os.path.join(tempfile.mkdtemp(), f"{name}.py")
    with open(file, "w") as f:
        f.write(source)
    spec = importlib.util.spec_from_file_location(name, file)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def backend_at(rev: str, backend: str):
    """The backend class of ``rankattn.backends.<backend>`` as it was at ``rev``."""
    name = f"{backend}_at_rev"
    module = module_at(rev, f"src/rankattn/backends/{backend}.py", name)
    from rankattn.backends.base import Backend
    return next(v for v in vars(module).values()
                if isinstance(v, type) and issubclass(v, Backend) and v.__module__ == name)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("rev")
    parser.add_argument("workloads", nargs="*",
                        help="bench.py's or EXTRAS' names (with --smoke, default "
                             "bench.SMOKE_WORKLOADS)")
    parser.add_argument("--backend", default="xla")
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--smoke", action="store_true",
                        help="check the script: tiny shapes (bench.smoke_version), one round")
    args = parser.parse_args()
    if args.smoke:
        args.repeats, args.workloads = 1, args.workloads or list(bench.SMOKE_WORKLOADS)
    if not args.workloads:
        parser.error("name at least one workload")
    workloads = {w.name: bench.smoke_version(w) if args.smoke else w
                 for w in bench.WORKLOADS + EXTRAS}
    if bench.torch is None:
        print("torch is not installed: no torch sdpa column", flush=True)
    then = backend_at(args.rev, args.backend)
    now = getattr(importlib.import_module(f"rankattn.backends.{args.backend}"), then.__name__)
    for name in args.workloads:
        w = workloads[name]
        fns = {"rev": bench.jax_runner(w, bench.rankattn_with(then()))[0],
               "now": bench.jax_runner(w, bench.rankattn_with(now()))[0]}
        if bench.torch is not None:
            fns["torch"] = bench.torch_sdpa(w)
        t = peers.interleaved_times(fns, args.repeats)
        line = (f"{name}: {args.rev} {np.median(t['rev']) * 1e3:.1f} ms, working tree "
                f"{np.median(t['now']) * 1e3:.1f} ms, {args.rev} / working tree "
                f"{np.median(t['rev'] / t['now']):.2f}")
        if "torch" in t:
            line += (f"; torch sdpa {np.median(t['torch']) * 1e3:.1f} ms, torch / working tree "
                     f"{np.median(t['torch'] / t['now']):.2f}")
        print(line, flush=True)


if __name__ == "__main__":
    main()
