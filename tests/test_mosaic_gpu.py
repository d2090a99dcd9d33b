"""The mosaic_gpu backend: lowering for CUDA without a GPU, declines and options, and its
interpret-mode suite (tests/mosaic/, the kernel against the float64 oracle) in a process of
its own.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import pytest

import rankattn
from helpers import lower_for_cuda, run_suite
from rankattn.backends import MosaicGpu, mosaic_gpu_interpret
from rankattn.validate import AttentionCall


def test_the_interpret_suite_in_its_own_process():
    run_suite("mosaic", dict(RANKATTN_MOSAIC_TESTS="1"), timeout=180)


def test_it_lowers_for_cuda_without_a_gpu():
    """jit(value_and_grad) lowered for CUDA on this CPU machine: three Mosaic GPU custom calls
    (forward, dq, dk / dv) and no Triton kernel."""
    args = [jax.ShapeDtypeStruct((2, 300, 20, 128), jnp.bfloat16),
            jax.ShapeDtypeStruct((2, 300, 4, 128), jnp.bfloat16),
            jax.ShapeDtypeStruct((2, 300, 4, 128), jnp.bfloat16),
            jax.ShapeDtypeStruct((2, 300), jnp.int32)]

    def loss(q, k, v, seg):
        out, lse = rankattn.attention(q, k, v, segment_ids=seg, causal=True, softcap=30.0,
                                      return_lse=True, impl=MosaicGpu())
        return out.astype(jnp.float32).sum() + jnp.where(jnp.isfinite(lse), lse, 0).sum()

    text = lower_for_cuda(jax.value_and_grad(loss, (0, 1, 2)), *args).as_text()
    assert len(re.findall(r"custom_call @mosaic_gpu", text)) == 3, "forward, dq, dk / dv"
    assert "__gpu$xla.gpu.triton" not in text and "rankattn_dq" not in text


def call_of(dtype=jnp.bfloat16, d=128, dv=None, shard_mask=None) -> AttentionCall:
    shape = jax.ShapeDtypeStruct
    return AttentionCall(q=shape((1, 64, 2, d), dtype), k=shape((1, 64, 1, d), dtype),
                         v=shape((1, 64, 1, dv or d), dtype), segment_ids=None, causal=False,
                         scale=1.0, softcap=None, softcap_method="tanh", shard_mask=shard_mask)


@pytest.mark.parametrize("call, fragment", [
    (call_of(jnp.float32), "float32"),
    (call_of(d=200), "head dim 200"),
    (call_of(d=128, dv=32), "v head dim 32"),
])
def test_what_it_cannot_run_is_declined_with_the_fix(call, fragment):
    (reason,) = MosaicGpu().not_supported_reasons(call)
    assert fragment in reason and "impl='pallas_triton'" in reason
    assert MosaicGpu().not_supported_reasons(call_of()) == []


def test_by_name_it_needs_a_hopper_gpu():
    (reason,) = MosaicGpu().platform_reasons()
    assert "mosaic_gpu needs a GPU" in reason
    assert MosaicGpu(interpret=True).platform_reasons() == []
    assert mosaic_gpu_interpret.IMPORT_ERROR is None  # the interpreter's fixes apply here


def test_options_are_checked():
    with pytest.raises(rankattn.RankattnTypeError, match="RA116"):
        MosaicGpu(interpret="yes")
