"""Regression (CI's recurring worker crash, stops 47-57): compiled programs hold memory maps.

An xdist worker that keeps every XLA:CPU program of its tests cached nears vm.max_map_count,
where XLA's compile fails and segfaults. conftest.py counts compiles, and every 50 drops the
cached programs once the worker has a quarter of the limit; this checks what that relies on.
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import rankattn
import conftest
from conftest import memory_maps, release_compiled_programs
from rankattn.backends import BlockSizes, Xla

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="reads /proc/self/maps")


def test_cached_programs_hold_memory_maps_until_released():
    x = np.ones((8, 8), np.float32)
    jax.block_until_ready(jnp.sin(x))  # JAX's own start-up mappings, before the baseline
    release_compiled_programs(above=0)
    baseline = memory_maps()
    q = np.ones((1, 40, 2, 16), np.float32)
    for i in range(3):  # gradients through the xla backend, as the suite compiles them
        impl = Xla(BlockSizes(16, 8 + i))
        loss = jax.jit(jax.grad(lambda q: rankattn.attention(q, q, q, impl=impl).sum()))
        jax.block_until_ready(loss(q))
    held = memory_maps()
    assert held > baseline + 30, (baseline, held)  # measured: about 70 per program
    assert not release_compiled_programs(above=held)  # under the bound: nothing dropped
    assert release_compiled_programs(above=0)
    assert memory_maps() < baseline + (held - baseline) // 2, (baseline, held, memory_maps())


def test_compiles_are_counted_for_the_check():
    before = conftest.compiles_since_check
    jax.block_until_ready(jax.jit(lambda y: y * 3.5 + 1)(np.arange(7.0)))  # a new program
    assert conftest.compiles_since_check == before + 1
