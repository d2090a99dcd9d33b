"""Runs tests/x64/ (float64 inputs against the float64 oracle) in a subprocess with x64 enabled.

JAX fixes jax_enable_x64 when it starts, and this process runs without it (float64 inputs are
an error there: test_errors.py), so those tests run in their own interpreter.
"""

from __future__ import annotations

from helpers import run_suite


def test_float64_suite_with_x64():
    run_suite("x64", dict(RANKATTN_X64_TESTS="1", JAX_ENABLE_X64="1"))
