"""float64 inputs against the float64 oracle at 2**-40 of each element's magnitude (well past
1e-10), forward and gradients. Runs with x64 enabled, in its own process (tests/test_float64.py):
JAX fixes x64 when it starts.

A float64 call whose math silently ran in float32 is off by about 1e-7 of the magnitude, far
outside the rule (test_float32_math_fails_the_float64_rule runs it).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from helpers import (Case, case_id, check_against_oracle, n_terms, oracle_results,
                     random_segments, run)
from rankattn.backends import BlockSizes, Xla
from tolerances import FIELDS, error_ratio

assert jax.config.jax_enable_x64, "run through tests/test_float64.py (JAX_ENABLE_X64=1)"

SEG = "segment_ids"


def packed(case: Case) -> Case:
    return case.with_mask(random_segments(case.seed, case.batch, case.seq, "packed"))


CASES = [
    packed(Case(batch=2, seq=17, heads_q=5, heads_kv=1, dim=8, dtype="float64", mask=SEG,
                softcap=2.0)),
    packed(Case(batch=2, seq=33, heads_q=8, heads_kv=1, dim=48, dim_v=24, dtype="float64",
                mask=SEG, causal=True, softcap=2.0, softcap_method="soft_sign", seed=1)),
    packed(Case(batch=1, seq=70, heads_q=4, heads_kv=2, dim=80, dtype="float64", mask=SEG,
                causal=True, seed=2)),
    Case(batch=2, seq=9, kv_seq=20, heads_q=2, heads_kv=2, dim=200, dtype="float64", seed=3),
    Case(batch=2, seq=40, heads_q=2, heads_kv=1, dim=16, dtype="float64", mask="bounds_rows",
         mask_values=((0, 30, 30, 40), (5, 20, 0, 5)), seed=4),
]
IMPLS = [pytest.param("reference", id="reference"),
         pytest.param(Xla(BlockSizes(16, 8)), id="xla-16x8"),
         pytest.param(Xla(), id="xla-default")]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_float64_matches_the_oracle(case, impl):
    check_against_oracle(case, impl)


@pytest.mark.parametrize("impl", IMPLS[:2])
def test_float32_math_fails_the_float64_rule(monkeypatch, request, impl):
    """The defect this module exists for: compute_dtype giving float32 for float64 inputs."""
    for module in ("rankattn.backends.reference", "rankattn.backends.xla"):
        monkeypatch.setattr(f"{module}.compute_dtype", lambda dtype: jnp.float32)
    jax.clear_caches()  # trace anew, with the defect
    request.addfinalizer(jax.clear_caches)  # and drop what was traced with it
    case = CASES[0]
    got = run(case, impl, check_dtypes=False)  # the defect also makes lse float32
    want = oracle_results(case)
    worst = {f: error_ratio(f, got[f], want[f], case.dtype, want["terms"][f],
                            want["amplified"][f], n_terms(case)) for f in FIELDS}
    assert all(r > 1 for r in worst.values()), worst
