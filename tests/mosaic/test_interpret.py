"""The mosaic_gpu kernels (forward, dq, dk / dv) in JAX's Mosaic GPU interpreter, with the race
detector, against the float64 oracle: out, lse and the three gradients. Run by
tests/test_mosaic_gpu.py in a process of its own (RANKATTN_MOSAIC_TESTS=1): the interpreter
runs each warpgroup as a thread compiling and running jitted code, and rankattn patches the
interpreter (rankattn.backends.mosaic_gpu_interpret), so none of that stays in the main
test process.

Interpret mode runs a kernel's grid blocks one after another, each in two or three threads
(about 2.5 s a block here), so CI runs one compact case (35 s quiet); the rest carry the
``mosaic_interpret`` marker (``RANKATTN_MOSAIC_TESTS=1 pytest -m mosaic_interpret tests/mosaic``,
130 s here). Each test dumps every thread's stack and exits past a timeout (an exception in one
warpgroup leaves the others waiting at a barrier). Interpret mode runs eagerly: under jit
it is refused (RA128, tests/test_errors.py).
"""

from __future__ import annotations

import dataclasses
import faulthandler

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import rankattn
from helpers import Case, check_results, objective, random_segments, rounded_values
from rankattn.backends import BlockSizes, MosaicGpu, mosaic_gpu_interpret

INTERPRETER = MosaicGpu(interpret=True)
TIMEOUT_S = 120  # about three times the slowest case's time in CI here (40 s; 30 s quiet)


def segments(case: Case, seed: int, empty_rows=()):
    """Packed sessions; ``empty_rows`` all padding (rows that see nothing)."""
    rows = random_segments(seed, case.batch, case.seq, "packed")
    rows[list(empty_rows)] = 0
    return tuple(map(tuple, rows.tolist()))


def eager_results(case: Case, impl) -> dict:
    """Out, lse and the gradients of the oracle tests' objective, computed eagerly."""
    q, k, v, w = (jnp.asarray(x).astype(case.dtype) for x in rounded_values(case))
    mask_kw, mask = case.mask_arg()

    def loss(q, k, v):
        out, lse = rankattn.attention(q, k, v, **({mask_kw: mask} if mask_kw else {}),
                                      **case.options(),
                                      logit_multiplier=case.logit_multiplier(),
                                      return_lse=True, impl=impl)
        return objective(out, lse, jnp.asarray(w)), (out, lse)

    (_, (out, lse)), grads = jax.value_and_grad(loss, (0, 1, 2), has_aux=True)(q, k, v)
    return {name: np.asarray(x).astype(np.float64)
            for name, x in zip(("out", "lse", "dq", "dk", "dv"), (out, lse, *grads))}


def check_interpreted(case: Case, impl=INTERPRETER) -> None:
    faulthandler.dump_traceback_later(TIMEOUT_S, exit=True)
    try:
        got = eager_results(case, impl)
    finally:
        faulthandler.cancel_dump_traceback_later()
    assert not mosaic_gpu_interpret.races_found()
    check_results(case, got)
    blind = ~case.dense_mask().any(-1)  # rows that see nothing: exactly 0 and -inf
    assert np.all(got["out"][blind] == 0) and np.all(np.isneginf(
        got["lse"].transpose(0, 2, 1)[blind]))


# 150 tokens: two query blocks of 128 (the second ragged) over four key blocks of 64; packed
# sessions with candidates and padding, causal history with a cap (the dk / dv kernel takes
# its derivative from p and lse), GQA 2, D=96 (padded to 128).
COMPACT = Case(batch=1, seq=150, heads_q=2, heads_kv=1, dim=96, dtype="bfloat16",
               mask="segment_ids", causal=True, softcap=5.0, seed=5)
MORE = [
    # GQA 5, D=64, a per-head logit multiplier (0 and negative among it) with a cap, not causal
    Case(batch=1, seq=100, heads_q=5, heads_kv=1, dim=64, dtype="float16", mask="segment_ids",
         multiplier="heads", softcap=5.0, seed=6),
    # two rows (the second empty), soft_sign cap, one block of 64 rows (at most 64 tokens)
    Case(batch=2, seq=40, heads_q=2, heads_kv=1, dim=64, dtype="bfloat16", mask="segment_ids",
         causal=True, softcap=2.0, softcap_method="soft_sign", seed=7),
    # no mask: one session, no own key, D=32 (padded to 64)
    Case(batch=1, seq=130, heads_q=2, heads_kv=2, dim=32, dtype="float16", seed=8),
]


def test_a_race_in_any_kernel_of_a_call_is_reported(monkeypatch):
    """Regression: the interpreter makes a race detector per kernel launch and keeps only the
    latest, so races_found() saw dk / dv's alone. Three launches as the interpreter makes
    them, a race planted in the first (the forward's): reported after the third, once."""
    from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks

    mosaic_gpu_interpret.interpret_params()  # rankattn's fixes, as a kernel call applies them
    mosaic_gpu_interpret.races_found()  # clears what an earlier test left unread
    launches = []
    for _ in range(3):  # each launch's _initialize_shared_memory
        launches.append(gpu_callbacks.RaceDetectionState(num_cores=3))
        monkeypatch.setattr(gpu_callbacks, "_races", launches[-1])
    launches[0].races_found = True
    assert mosaic_gpu_interpret.races_found()
    assert not mosaic_gpu_interpret.races_found()


def test_forward_and_gradients_match_the_oracle():
    check_interpreted(dataclasses.replace(COMPACT, mask_values=segments(COMPACT, 5)))


@pytest.mark.mosaic_interpret
@pytest.mark.parametrize("case", MORE, ids=lambda c: f"S{c.seq}-G{c.heads_q // c.heads_kv}"
                                                     f"-D{c.dim}")
def test_more_cases_match_the_oracle(case):
    if case.mask != "none":
        empty = [1] if case.batch > 1 else []
        case = dataclasses.replace(case, mask_values=segments(case, case.seed, empty))
    check_interpreted(case)


@pytest.mark.mosaic_interpret
@pytest.mark.parametrize("blocks, depth", [(BlockSizes(64, 128), 3), (BlockSizes(128, 64), 4)])
def test_other_blocks_and_pipeline_depths_match_the_oracle(blocks, depth):
    """One compute warpgroup in the forward and dq (two in dk / dv) and the reverse."""
    check_interpreted(dataclasses.replace(COMPACT, mask_values=segments(COMPACT, 5)),
                      MosaicGpu(blocks, pipeline_depth=depth, interpret=True))


@pytest.mark.mosaic_interpret
def test_a_non_finite_key_poisons_exactly_the_rows_that_see_it():
    """An inf in k at one history position: the rows that see it are NaN, the others as the
    reference's (finite rows compared; NaN patterns equal)."""
    q, k, v = (jnp.asarray(np.random.default_rng(9).normal(size=(1, 100, 2, 64)), jnp.bfloat16)
               for _ in range(3))
    k = k.at[0, 10, 0, 3].set(jnp.inf)
    seg = jnp.asarray(random_segments(10, 1, 100, "packed"))
    options = dict(segment_ids=seg, causal=True, return_lse=True)
    faulthandler.dump_traceback_later(TIMEOUT_S, exit=True)
    try:
        out, lse = rankattn.attention(q, k, v, impl=INTERPRETER, **options)
    finally:
        faulthandler.cancel_dump_traceback_later()
    assert not mosaic_gpu_interpret.races_found()
    want_out, want_lse = rankattn.attention(q, k, v, impl="reference", **options)
    for got, want in ((out, want_out), (lse, want_lse)):
        got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
        np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
        ok = np.isfinite(want)
        np.testing.assert_allclose(got[ok], want[ok], atol=3e-2)
    assert np.isnan(np.asarray(lse)).any()
