"""The pallas_triton backend beyond the shared property suite (tests/test_backends.py).

* Dispatch: by name it needs a GPU (RA115 says how to run it on CPU); an
  explicit instance is never platform-checked, so it lowers for CUDA here.
* Lowering for CUDA on a CPU-only machine, forward and backward, over shapes
  Triton is picky about (non-power-of-two head dims and GQA ratios, lengths
  over 1000, bf16 / f16, soft caps): this is what catches unsupported
  primitives and non-power-of-two tiles without a GPU. It cannot catch
  register or shared-memory limits; tests/test_gpu_compile.py compiles for real targets.
* The configuration per GPU, dtype and head dim, and plans that prepare all of them.
* Options are checked (RA116), float64 is declined with a reason.
* The scale is applied to float32 logits, never rounded into bf16 q first
  (also for the xla backend's mixed-precision path).
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import rankattn
from conftest import CPU_KERNEL_REASONS, SMALL_TRITON
from helpers import attention_jit, lower_for_cuda, random_qkv, random_segments
from rankattn.backends import BlockSizes, GpuTarget, PallasTriton, Xla
from rankattn.backends.pallas_triton import (PORTABLE_TARGET, SHARED_MEMORY_PER_BLOCK,
                                             KernelConfig)
from tolerances import assert_close_f32


def test_by_name_it_needs_a_gpu(monkeypatch):
    monkeypatch.setattr(jax, "default_backend", lambda: "cpu")
    q, k, v, _ = random_qkv(0, 1, 8, 2, 1, 8)
    with pytest.raises(rankattn.RankattnValueError, match="RA115") as err:
        rankattn.attention(q, k, v, impl="pallas_triton")
    assert "needs a GPU" in str(err.value) and "rankattn[cuda13]" in str(err.value)
    assert "PallasTriton(interpret=True)" in str(err.value)
    assert "pallas_triton" not in rankattn.available_impls()
    assert rankattn.available_impls()[0] == ("xla" if CPU_KERNEL_REASONS else "cpu")


def test_on_a_gpu_auto_tries_it_first(monkeypatch):
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert rankattn.available_impls() == ["pallas_triton", "xla", "reference"]
    assert rankattn.api.resolve_impls("auto")[0].name == "pallas_triton"


def test_interpret_mode_runs_by_instance_on_cpu():
    q, k, v, _ = random_qkv(1, 1, 12, 2, 1, 8)
    seg = np.array([[1] * 8 + [-1] * 4], np.int32)
    got = rankattn.attention(q, k, v, segment_ids=seg, impl=PallasTriton(interpret=True))
    want = rankattn.attention(q, k, v, segment_ids=seg, impl="reference")
    assert_close_f32(got, want, "out")


# (B, S, Hq, Hkv, D, Dv, dtype, causal, softcap, mask)
LOWERING_GRID = [
    (2, 1088, 4, 2, 128, 128, jnp.bfloat16, False, None, True),     # the nano shape
    (1, 1088, 20, 4, 128, 128, jnp.bfloat16, False, 30.0, True),    # production heads, GQA 5
    (1, 1031, 6, 2, 80, 80, jnp.float16, True, 2.0, True),          # odd length, D=80, GQA 3
    (2, 37, 5, 1, 200, 24, jnp.float32, True, None, True),          # D=200, Dv != D, GQA 5
    (1, 1, 8, 1, 8, 8, jnp.bfloat16, False, None, True),            # length 1, D=8, GQA 8
    (1, 300, 2, 2, 48, 48, jnp.float32, False, 5.0, False),         # no mask, soft_sign below
]


@pytest.mark.parametrize("shape", LOWERING_GRID, ids=lambda s: "B{}-S{}-H{}/{}-D{}-Dv{}".format(*s))
def test_forward_and_backward_lower_for_cuda_on_cpu(shape):
    b, s, hq, hkv, d, dv, dtype, causal, softcap, masked = shape
    args = [jax.ShapeDtypeStruct((b, s, hq, d), dtype), jax.ShapeDtypeStruct((b, s, hkv, d), dtype),
            jax.ShapeDtypeStruct((b, s, hkv, dv), dtype), jax.ShapeDtypeStruct((b, s), jnp.int32)]
    method = "soft_sign" if not masked else "tanh"

    def loss(q, k, v, seg):
        out, lse = rankattn.attention(q, k, v, segment_ids=seg if masked else None, causal=causal,
                                      softcap=softcap, softcap_method=method, return_lse=True,
                                      impl=PallasTriton())
        return out.astype(jnp.float32).sum() + jnp.where(jnp.isfinite(lse), lse, 0).sum()

    lowered = lower_for_cuda(jax.value_and_grad(loss, (0, 1, 2)), *args)
    kernels = re.findall(r'name = "(rankattn_\w+)"', lowered.as_text())
    split = PallasTriton().config(dtype, max(d, dv)).split_dkv  # float32 and D > 128
    grads = ["rankattn_dk", "rankattn_dv"] if split else ["rankattn_dkv"]
    assert sorted(kernels) == sorted(grads + ["rankattn_dq", "rankattn_forward"])


def test_lowering_catches_what_triton_rejects():
    """The lowering test has teeth: a non-power-of-two tile fails to lower, on CPU."""
    from rankattn.backends.pallas_triton import triton_attention

    q = jax.ShapeDtypeStruct((1, 96, 2, 128), jnp.bfloat16)
    seg = jax.ShapeDtypeStruct((1, 96), jnp.int32)

    def f(q, seg):
        return triton_attention(q, q, q, seg, causal=False, scale=1.0, softcap=None,
                                softcap_method="tanh",
                                config=KernelConfig(BlockSizes(48, 48), False, 8, key_major=True))

    with pytest.raises(ValueError, match="power of 2"):
        lower_for_cuda(f, q, seg)


@pytest.mark.parametrize("kwargs, fragment", [
    (dict(block_sizes=BlockSizes(48, 64)), "block_q=48"),
    (dict(block_sizes=BlockSizes(64, 8)), "block_k=8"),
    (dict(num_warps=0), "num_warps=0"),
    (dict(num_stages=2.0), "num_stages=2.0"),
    # Regressions: warps that Triton refuses (a power of two) or that are not ints.
    (dict(num_warps=3), "num_warps=3; pass 1, 2, 4, 8 or 16"),
    (dict(num_warps=4.0), "num_warps=4.0"),
    (dict(num_warps=True), "num_warps=True"),
])
def test_options_are_checked(kwargs, fragment):
    with pytest.raises(rankattn.RankattnTypeError, match="RA116") as err:
        PallasTriton(**kwargs)
    assert fragment in str(err.value)


def test_float64_is_declined_with_a_reason():
    with jax.enable_x64(True):
        q, k, v, _ = (x.astype(np.float64) for x in random_qkv(2, 1, 8, 2, 1, 8))
        with pytest.raises(rankattn.RankattnValueError, match="RA115") as err:
            rankattn.attention(q, k, v, impl=SMALL_TRITON)
    assert "float64" in str(err.value) and "impl='xla'" in str(err.value)


def test_one_plan_serves_both_blocked_backends():
    """A plan made for xla and pallas_triton holds one block plan per backend's sizes;
    each backend reads its own and gives the results (and gradients) of passing the mask."""
    seg = jnp.asarray(random_segments(3, 2, 45, "packed"))
    xla = Xla(BlockSizes(16, 8))
    plan = rankattn.plan(segment_ids=seg, causal=True, impl=[xla, SMALL_TRITON])
    assert plan.block_sizes == (BlockSizes(16, 8), BlockSizes(16, 16))
    q, k, v, _ = random_qkv(4, 2, 45, 4, 2, 16)

    def loss(q, k, v, mask, impl, use_plan):
        mask = dict(plan=mask) if use_plan else dict(segment_ids=mask, causal=True)
        out, lse = rankattn.attention(q, k, v, impl=impl, return_lse=True, **mask)
        return (out ** 2).sum() + jnp.where(jnp.isfinite(lse), lse, 0).sum()

    grad = jax.jit(jax.value_and_grad(loss, (0, 1, 2)), static_argnums=(4, 5))
    for impl in (xla, SMALL_TRITON):
        with_plan = grad(q, k, v, plan, impl, True)
        without = grad(q, k, v, seg, impl, False)
        for a, b in zip(jax.tree.leaves(with_plan), jax.tree.leaves(without)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("target, dtype, head_dim, sizes, split, key_major", [
    ("sm_90", jnp.bfloat16, 128, BlockSizes(64, 32), False, False),  # wgmma, no spills
    ("sm_90", jnp.float16, 80, BlockSizes(64, 32), False, False),    # D=80 runs as 128
    ("sm_80", jnp.bfloat16, 128, BlockSizes(32, 32), False, True),   # mma.sync: 64 x 32 spilled
    ("sm_89", jnp.bfloat16, 64, BlockSizes(32, 32), False, True),
    ("sm_90", jnp.bfloat16, 200, BlockSizes(32, 32), True, True),    # D=256: dk, dv apart
    ("sm_89", jnp.bfloat16, 192, BlockSizes(32, 16), True, True),    # 32 x 32 fwd spilled
    ("sm_89", jnp.float32, 128, BlockSizes(16, 16), True, True),     # no tensor cores: 4 warps
])
def test_the_configuration_follows_the_gpu_dtype_and_head_dim(target, dtype, head_dim, sizes,
                                                               split, key_major):
    """The no-spill choices of benchmarks/GPU_COMPILE.md (test_gpu_compile checks them)."""
    config = PallasTriton(target=target).config(dtype, head_dim)
    assert (config.block_sizes, config.split_dkv, config.key_major) == (sizes, split, key_major)
    forced = PallasTriton(BlockSizes(16, 16), split_dkv=False, num_warps=2, target=target)
    assert forced.config(dtype, head_dim) == KernelConfig(BlockSizes(16, 16), False, 2,
                                                          key_major)


@pytest.mark.parametrize("precision", ["high", "default"])
def test_float32_on_tensor_cores_lowers_and_takes_its_own_tiles(precision):
    """"high" (three bf16 passes) and "default" (tf32) feed tensor cores: 32 x 32 tiles with
    dk and dv apart (no spills with tf32; 56-104 bytes with three passes), not the exact
    path's 16 x 16 (benchmarks/GPU_COMPILE.md shows their kernels use wgmma / mma.sync)."""
    impl = PallasTriton(target="sm_90", precision=precision)
    assert impl.config(jnp.float32, 128) == KernelConfig(BlockSizes(32, 32), True, 8,
                                                         key_major=True)
    assert impl.config(jnp.bfloat16, 128).block_sizes == BlockSizes(64, 32)  # 16-bit unchanged
    args = [jax.ShapeDtypeStruct(shape, jnp.float32) for shape in ((1, 70, 4, 64),
                                                                   (1, 70, 2, 64), (1, 70, 2, 64))]
    lowered = lower_for_cuda(jax.grad(lambda q, k, v: rankattn.attention(q, k, v, impl=impl).sum(),
                                      (0, 1, 2)), *args)
    assert len(re.findall(r'name = "rankattn_\w+"', lowered.as_text())) == 4  # fwd, dq, dk, dv


def test_precision_is_checked():
    with pytest.raises(rankattn.RankattnTypeError, match="RA116") as err:
        PallasTriton(precision="tf32")
    assert "'highest'" in str(err.value) and "'tf32'" in str(err.value)


def test_without_a_gpu_or_a_target_it_configures_for_every_gpu(monkeypatch):
    monkeypatch.setattr(jax, "default_backend", lambda: "cpu")
    assert PallasTriton().gpu_target() == PORTABLE_TARGET
    assert PORTABLE_TARGET.shared_memory_per_block == min(SHARED_MEMORY_PER_BLOCK.values())
    assert PallasTriton(target="sm_90").gpu_target() == GpuTarget((9, 0), 232448)


@pytest.mark.parametrize("spec, capability", [("sm_90", (9, 0)), ("sm_90a", (9, 0)),
                                              ("8.9", (8, 9)), ((8, 0), (8, 0)),
                                              ("sm_100", (10, 0))])
def test_targets_are_named_as_nvidia_and_jax_name_them(spec, capability):
    assert GpuTarget.of(spec).compute_capability == capability


@pytest.mark.parametrize("capability, target", [
    ("9.0", GpuTarget((9, 0), 232448)), ("8.6", GpuTarget((8, 6), 101376)),
    ("10.3", GpuTarget((10, 3), 101376))])  # unknown: its own instructions, 99 KB
def test_on_a_gpu_the_target_is_read_from_the_device(monkeypatch, capability, target):
    class Device:
        compute_capability = capability
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(jax, "devices", lambda: [Device()])
    assert PallasTriton().gpu_target() == target


def test_an_unknown_target_says_what_to_pass():
    with pytest.raises(rankattn.RankattnTypeError, match="RA116") as err:
        PallasTriton(target="sm_75")
    assert "(7, 5)" in str(err.value) and "GpuTarget(" in str(err.value)


@pytest.mark.parametrize("target", ["h100", "sm_9", "sm90", "sm_8x", "9.0.1", 90, (9, 0, 1),
                                    (9.0, 0)])
def test_a_target_that_names_no_gpu_is_ra116(target):
    """Regression: these raised ValueError or TypeError from the parsing. RA116 names the
    class, the value and the spellings (MosaicGpu's: tests/test_mosaic_gpu.py)."""
    with pytest.raises(rankattn.RankattnTypeError, match="RA116") as err:
        PallasTriton(target=target)
    message = str(err.value)
    assert f"PallasTriton target={target!r} names no GPU" in message
    assert "'sm_90'" in message and "'9.0'" in message and "GpuTarget(" in message


def test_a_plan_prepares_every_tile_pair_a_call_may_use():
    """Tiles depend on dtype and head dim, which a plan does not know: it prepares each pair
    the backend may use, so every call reads prepared lists."""
    impl = PallasTriton(target="sm_90")
    plan = rankattn.plan(segment_ids=jnp.ones((1, 300), jnp.int32), impl=[impl])
    for dtype in (jnp.bfloat16, jnp.float16, jnp.float32):
        for head_dim in (8, 64, 128, 200, 256):
            assert impl.config(dtype, head_dim).block_sizes in plan.block_sizes


def test_default_plan_prepares_what_auto_uses_here():
    seg = jnp.ones((1, 40), jnp.int32)
    assert rankattn.plan(segment_ids=seg).block_sizes == (BlockSizes(40, 40),)  # xla, clamped


@pytest.mark.parametrize("impl", [Xla(BlockSizes(16, 8), mixed_precision=True), SMALL_TRITON],
                         ids=["xla-mixed", "pallas_triton-16x16"])
def test_scale_is_applied_in_float32(impl):
    """Regression: the scale must reach the float32 logits, not bf16 q. Where bf16 operands
    feed the dots, q * scale rounded to bf16 moves large logits by ~|s| / 256 (folding the
    scale into bf16 q fails this check by 3.5x on both backends). On the same bf16 values
    they must agree with the reference's float32 math to the output's own bf16 rounding."""
    q, k, v, _ = random_qkv(5, 2, 24, 2, 1, 48, q_std=8.0)
    q, k, v = (x.astype(jnp.bfloat16) for x in (q, k, v))
    scale = 0.37  # not a power of two, so q * scale rounds in bf16
    seg = np.array([[1] * 20 + [-1] * 4] * 2, np.int32)
    got = attention_jit(q, k, v, segment_ids=seg, scale=scale, impl=impl)
    want = attention_jit(q, k, v, segment_ids=seg, scale=scale, impl="reference")
    ulp = 2.0 ** -8 * np.abs(np.asarray(want, np.float32)).max()
    assert np.abs(np.asarray(got, np.float32) - np.asarray(want, np.float32)).max() <= ulp


def test_interpret_mode_rounds_float32_operands_as_the_tensor_cores_would():
    """Interpret mode emulates "high" (3 bf16 passes) and "default" (tf32), so their accuracy
    is measured on CPU (benchmarks/PRECISION.md). Against float64: "highest" is float32-exact,
    "high" within 2^-12 of the output's scale, "default" between 2^-14 and 2^-7 (tf32 keeps
    10 mantissa bits). Were the modes computed exactly, "default" would fail its lower
    bound; the "high" - "highest" ordering checks the three passes are kept apart."""
    q, k, v, _ = random_qkv(6, 1, 40, 2, 1, 64, q_std=4.0)
    seg = np.array([[1] * 30 + [-1] * 10], np.int32)
    with jax.enable_x64(True):
        want = np.asarray(rankattn.attention(*(x.astype(np.float64) for x in (q, k, v)),
                                             segment_ids=seg, impl="reference"))
    errors = {}
    for precision in ("highest", "high", "default"):
        impl = PallasTriton(BlockSizes(16, 16), precision=precision, interpret=True)
        got = np.asarray(attention_jit(q, k, v, segment_ids=seg, impl=impl), np.float64)
        errors[precision] = np.abs(got - want).max() / np.abs(want).max()
    assert errors["highest"] < 2.0 ** -20, errors
    assert errors["highest"] < errors["high"] < 2.0 ** -12, errors
    assert 2.0 ** -14 < errors["default"] < 2.0 ** -7, errors
