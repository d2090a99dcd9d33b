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


SETTLE_S = 0.02


def interleaved_times(fns: dict, repeats: int, warm_up: bool = True,
                      settle_s: float = SETTLE_S) -> dict[str, np.ndarray]:
    """Wall times (s) per round of each zero-argument function, run round-robin.

    Each function is called once first to compile and warm up (unless the
    caller already did: ``warm_up=False``). Every round
    runs each function once, in the reverse order of the previous round, so
    drift and whatever one function leaves behind (a peer's spinning thread
    pool, a freed heap) hit all alike. Results are waited for with
    block_until_ready. Before each call the machine idles ``settle_s``: torch's
    OpenMP threads spin for milliseconds after a call, and on 2 cores they took
    the cores of whatever ran next (short-fwdbwd: rankattn 13.1 ms right after
    torch, 11.4 ms after a 20 ms pause; torch itself 9.4 -> 10.2 ms, as it lost
    its warm threads). Returns one array of ``repeats`` times per name; the
    ratio of two functions is best taken per round (same machine state), then
    its median over rounds.
    """
    if warm_up:
        for fn in fns.values():
            jax.block_until_ready(fn())
    times = {name: [] for name in fns}
    names = list(fns)
    for round_ in range(repeats):
        for name in names if round_ % 2 == 0 else names[::-1]:
            time.sleep(settle_s)
            start = time.perf_counter()
            jax.block_until_ready(fns[name]())
            times[name].append(time.perf_counter() - start)
    return {name: np.array(t) for name, t in times.items()}


def interleaved_medians(fns: dict, repeats: int) -> dict[str, float]:
    """Median wall time (s) of each function, from :func:`interleaved_times`."""
    return {name: float(np.median(t)) for name, t in interleaved_times(fns, repeats).items()}
