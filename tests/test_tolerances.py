"""The rules of tests/tolerances.py have room for correct backends and teeth for broken ones.

Room: correct backends stay inside the bounds over 20 seeds per configuration (values only
change between seeds, so each configuration compiles once).

Teeth: each of four defects, injected into a real backend by monkeypatching (or, for the
bf16 softmax, computed by a test-only all-bf16 attention), fails the check on every field
it changes:

* dk / dv accumulated in bf16 over query blocks (the mixed-precision xla path);
* the softmax in bf16 (logits, exp and sums in the inputs' dtype);
* the candidates' own-key term dropped (xla);
* the scale rounded to bf16 before use.

Each defect runs on a case built to show it (long rows for accumulation, logits of Phoenix's
size for the rounded scale), as a user's shapes would.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import SMALL_CPU, SMALL_TRITON, needs_cpu_kernel
from helpers import Case, n_terms, oracle_results, random_segments, run, run_naive
from rankattn.backends import BlockSizes, Xla
from rankattn.backends import xla as xla_backend
from tolerances import FIELDS, error_ratio


def ratios(case: Case, got: dict) -> dict[str, float]:
    """Per field: max error / bound against the oracle (> 1 fails the check)."""
    want = oracle_results(case)
    return {name: error_ratio(name, got[name], want[name], case.dtype, want["terms"][name],
                              want["amplified"][name], n_terms(case))
            for name in FIELDS}


def packed(case: Case, seed: int = 0) -> Case:
    return dataclasses.replace(case.with_mask(random_segments(seed, case.batch, case.seq,
                                                              "packed")), seed=seed)


# --- Room. -------------------------------------------------------------------------------------

SEEDS = range(20)
STABILITY = [
    Case(batch=2, seq=70, heads_q=4, heads_kv=1, dim=48, mask="segment_ids", causal=True),
    Case(batch=2, seq=33, heads_q=10, heads_kv=2, dim=200, dtype="bfloat16", mask="segment_ids",
         softcap=2.0),
    Case(batch=1, seq=40, heads_q=5, heads_kv=1, dim=80, dtype="float16", mask="segment_ids",
         softcap=2.0, softcap_method="soft_sign"),
]
STABILITY_IMPLS = [
    pytest.param("reference", id="reference"),
    pytest.param(Xla(BlockSizes(16, 8)), id="xla-16x8"),
    pytest.param(Xla(BlockSizes(16, 8), mixed_precision=True), id="xla-mixed"),
    pytest.param(SMALL_TRITON, id="pallas_triton-16x16"),
    pytest.param(SMALL_CPU, id="cpu-16x8", marks=needs_cpu_kernel),  # CI's default backend
]


@pytest.mark.parametrize("impl", STABILITY_IMPLS)
@pytest.mark.parametrize("config", STABILITY, ids=lambda c: c.dtype)
def test_tolerance_has_room_for_correct_backends(config, impl):
    worst = {name: 0.0 for name in FIELDS}
    for seed in SEEDS:
        case = packed(config, seed)
        for name, r in ratios(case, run(case, impl)).items():
            worst[name] = max(worst[name], r)
    assert max(worst.values()) <= 1, f"a correct backend fails the rule: {worst}"


# --- Teeth. ------------------------------------------------------------------------------------

# One long session (history, then candidates) with positive q and loss weight, so that each
# key's dk and dv add up 65 query blocks of 16 without cancelling (with cancellation, the
# partial sums are small next to the terms and their rounding hides), one block per scan step.
LONG_BF16 = Case(batch=1, seq=1031, heads_q=2, heads_kv=1, dim=16, dtype="bfloat16",
                 mask="bounds_rows", mask_values=((0, 931, 931, 1031),), positive=True)


@pytest.fixture
def patch_xla(monkeypatch, request):
    """patch_xla(name, value) replaces a function of the xla backend for this test. The
    backend's programs are jitted on its static options, so JAX's caches are cleared after
    the patch (else an equal call would reuse a program traced without it) and when the test
    ends (else a later test's equal call would reuse one traced with it)."""
    def patch(name, value):
        monkeypatch.setattr(xla_backend, name, value)
        jax.clear_caches()

    request.addfinalizer(jax.clear_caches)
    return patch


def assert_fails_on(got_ratios: dict, fields) -> None:
    passed = [name for name in fields if got_ratios[name] <= 1]
    assert not passed, f"the defect passes the rule on {passed}: {got_ratios}"


@pytest.mark.filterwarnings("ignore:scatter inputs have incompatible types")
def test_bf16_key_accumulators_fail(patch_xla):
    impl = Xla(BlockSizes(16, 8), mixed_precision=True, step_logits_bytes=1024)
    assert max(ratios(LONG_BF16, run(LONG_BF16, impl)).values()) <= 1, "the correct path fails"
    patch_xla("_key_grad_accumulators", lambda static, kb, vb: (jnp.zeros(kb.shape, kb.dtype),
                                                                jnp.zeros(vb.shape, vb.dtype)))
    assert_fails_on(ratios(LONG_BF16, run(LONG_BF16, impl)), ("dk", "dv"))


@pytest.mark.parametrize("config", [
    Case(batch=2, seq=40, heads_q=4, heads_kv=2, dim=48, dtype=dtype, mask="segment_ids",
         scale=4 / np.sqrt(48)) for dtype in ("bfloat16", "float16")], ids=lambda c: c.dtype)
def test_low_precision_softmax_fails(config):
    assert_fails_on(ratios(packed(config), run_naive(packed(config))), FIELDS)


def test_dropped_own_key_term_fails(patch_xla):
    case = packed(Case(batch=2, seq=40, heads_q=4, heads_kv=2, dim=16, mask="segment_ids"))
    original = xla_backend._own_logits

    def no_own_key(static, q, own_kv, seg_q):
        capped, raw, is_cand = original(static, q, own_kv, seg_q)
        return capped, raw, is_cand & False

    patch_xla("_own_logits", no_own_key)
    assert_fails_on(ratios(case, run(case, Xla(BlockSizes(16, 8)))), FIELDS)


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_bf16_scale_fails(dtype):
    """2 / sqrt(58) rounds to bf16 with a relative error of 3.4e-3 (near the most bf16 can
    lose, 2**-8), which moves each logit by 3.4e-3 of itself. With bf16 inputs dq is the one
    field it cannot move past the rule: dq sums ds_ij k_j with much cancellation, so its
    change (3.4e-3 of dq) stays under what rounding each ds to bf16 legitimately costs (up
    to 2**-8 of each term)."""
    case = packed(Case(batch=2, seq=40, heads_q=4, heads_kv=2, dim=58, dtype=dtype,
                       mask="segment_ids", scale=2 / np.sqrt(58)))
    rounded = float(jnp.asarray(case.scale, jnp.bfloat16))
    assert abs(rounded / case.scale - 1) > 3e-3
    got = run(dataclasses.replace(case, scale=rounded), Xla(BlockSizes(16, 8)))
    touched = [f for f in FIELDS if not (dtype == "bfloat16" and f == "dq")]
    assert_fails_on(ratios(case, got), touched)
