"""How close correct backends come to the bounds of tests/tolerances.py: the worst error / bound
per backend, dtype and field over every configuration of tests/test_backends.py and N seeds.

    .venv/bin/python tests/tolerance_report.py --seeds 20 [--backends reference,xla-16x8,...]

Not a test (it takes minutes); tests/test_tolerances.py runs a smaller version in CI.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

import conftest  # noqa: F401  (the suite's XLA flags)
from helpers import n_terms, oracle_results, random_segments, run
from rankattn.backends import BlockSizes, PallasTriton, Xla
from test_backends import BCAST, CONFIGS, LONG_CONFIGS, ROWS, SEG, TRITON_CONFIGS
from tolerances import FIELDS, error_ratio

import numpy as np

BACKENDS = {
    "reference": ("reference", CONFIGS + LONG_CONFIGS),
    "xla-16x8": (Xla(BlockSizes(16, 8)), CONFIGS + LONG_CONFIGS),
    "xla-mixed": (Xla(BlockSizes(16, 8), mixed_precision=True), CONFIGS + LONG_CONFIGS),
    "pallas_triton-16x16": (PallasTriton(BlockSizes(16, 16), interpret=True), TRITON_CONFIGS),
}


def with_mask(config, seed: int):
    """The config with seeded mask values (packed or interleaved segments, random bounds)."""
    rng = np.random.default_rng(seed)
    if config.mask == SEG:
        layout = "packed" if seed % 2 else "interleaved"
        config = config.with_mask(random_segments(seed, config.batch, config.seq, layout))
    elif config.mask in (ROWS, BCAST):
        rows = [tuple(sorted(rng.integers(0, config.seq + 1, 4).tolist()))
                for _ in range(1 if config.mask == BCAST else config.batch)]
        config = config.with_mask(rows[0] if config.mask == BCAST else rows)
    return dataclasses.replace(config, seed=seed)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seeds", type=int, default=20)
    parser.add_argument("--backends", default="reference,xla-16x8,xla-mixed")
    args = parser.parse_args(argv)
    print("| backend | dtype | " + " | ".join(FIELDS) + " |")
    print("|---|---|" + "---:|" * len(FIELDS))
    for name in args.backends.split(","):
        impl, configs = BACKENDS[name]
        worst = {}
        for config in configs:
            for seed in range(args.seeds):
                case = with_mask(config, seed)
                got, want = run(case, impl), oracle_results(case)
                for f in FIELDS:
                    r = error_ratio(f, got[f], want[f], case.dtype, want["terms"][f],
                                    want["amplified"][f], n_terms(case))
                    worst[case.dtype, f] = max(worst.get((case.dtype, f), 0.0), r)
        for dtype in sorted({d for d, _ in worst}):
            print(f"| {name} | {dtype} | "
                  + " | ".join(f"{worst[dtype, f]:.3f}" for f in FIELDS) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
