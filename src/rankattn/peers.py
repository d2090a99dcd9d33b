"""What a user would run instead of rankattn, for side-by-side timing (demo, benchmarks)."""

from __future__ import annotations

import time

import jax
import numpy as np

from rankattn import semantics


def jax_nn_attention(q, k, v, segment_ids, causal: bool = False, implementation: str = "xla"):
    """jax.nn.dot_product_attention with the equivalent dense boolean mask [B, 1, S, S]."""
    mask = semantics.dense_mask(segment_ids, segment_ids, causal)[:, None]
    return jax.nn.dot_product_attention(q, k, v, mask=mask, implementation=implementation)


def interleaved_medians(fns: dict, repeats: int) -> dict[str, float]:
    """Median wall time (s) of each zero-argument function, run round-robin so drift hits all alike.

    Each function is called once first to compile; results are waited for with block_until_ready.
    """
    for fn in fns.values():
        jax.block_until_ready(fn())
    times = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            jax.block_until_ready(fn())
            times[name].append(time.perf_counter() - start)
    return {name: float(np.median(t)) for name, t in times.items()}
