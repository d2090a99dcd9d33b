"""The pallas_triton kernels compiled by XLA:GPU for real NVIDIA GPUs, on this CPU-only machine.

benchmarks/gpu_compile.py installs jax's CUDA plugin and ptxas at the installed jax's
version (once, into ~/.cache/rankattn, about 600 MB) and compiles in a child process, so
this process stays CPU-only. Checked, per target (sm_80 A100, sm_89 99 KB parts, sm_90
H100): every kernel compiles; no register spills at bfloat16 D = 128 (causal and soft cap
included) and D = 192; exact float32 (no tensor cores) spills at most 1 KB per thread;
shared memory within the target's limit at D = 256; and mosaic_gpu's kernels for sm_90a
without spills. Where the package index cannot serve the packages, the tests skip and say so.
"""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "benchmarks"))
import gpu_compile  # noqa: E402
from gpu_compile import Config  # noqa: E402

GRID = [Config("default"), Config("causal+softcap", causal=True, softcap_method="tanh"),
        Config("head_dim", head_dim=192), Config("head_dim", head_dim=256),
        Config("dtype", dtype="float32")]


@pytest.fixture(scope="module")
def packages():
    try:
        return gpu_compile.compiler_dir()
    except RuntimeError as error:
        pytest.skip("the CUDA compiler packages could not be installed, so the kernels were "
                    f"not compiled for real GPUs: {error}")


def spill(kernel: dict) -> int:
    return kernel["spill_stores"] + kernel["spill_loads"]


@pytest.mark.parametrize("target", ["sm_80", "sm_89", "sm_90"])
def test_kernels_compile_without_spills_within_shared_memory(target, packages):
    limits = gpu_compile.target_limits(target)
    for result in gpu_compile.compile_in_child(target, GRID, packages):
        config = Config(**result["config"])
        assert result["error"] is None, f"{target}, {config.label}: {result['error']}"
        kernels = result["kernels"]
        grads = {"rankattn_dkv"} if "rankattn_dkv" in kernels else {"rankattn_dk", "rankattn_dv"}
        assert set(kernels) == {"rankattn_forward", "rankattn_dq"} | grads, kernels
        for name, kernel in kernels.items():
            where = f"{target}, {config.label}, {name}"
            assert kernel["shared"] <= limits["shared_per_block"], where
            if config.dtype == "float32":
                assert spill(kernel) <= 1024, f"{where}: {kernel}"
            elif config.head_dim <= 192:
                assert spill(kernel) == 0, f"{where}: {kernel}"


def test_mosaic_gpu_compiles_for_sm_90a_without_spills(packages):
    """MosaicGpu() as impl= on this CPU-only process (not declined for its CPU backend):
    forward, dq and dk / dv of Phoenix's heads (20 / 4, D=128, causal, tanh cap) compile for
    sm_90a with wgmma, no register spills and shared memory within the H100's limit. (dk / dv
    with a cap at D=128 spilled 48-52 bytes while it kept the scaled logits for the cap's
    derivative.)"""
    config = Config("gqa", q_heads=20, kv_heads=4, causal=True, softcap_method="tanh",
                    impl="mosaic_gpu")
    [result] = gpu_compile.compile_in_child("sm_90", [config], packages)
    assert result["error"] is None, result["error"]
    kernels = result["kernels"]
    assert set(kernels) == {"rankattn_forward", "rankattn_dq", "rankattn_dkv"}, kernels
    limit = gpu_compile.target_limits("sm_90")["shared_per_block"]
    for name, kernel in kernels.items():
        assert spill(kernel) == 0 and kernel["mma"] == "wgmma", (name, kernel)
        assert kernel["threads"] == 384 and kernel["barriers"] > 0, (name, kernel)
        assert 0 < kernel["shared"] <= limit, (name, kernel)


def test_the_spill_check_sees_the_64x64_tiles_spill(packages):
    """The check has teeth: the old 64 x 64 tiles with one dk / dv kernel spilled on sm_90."""
    [result] = gpu_compile.compile_in_child("sm_90", GRID[:1], packages,
                                            dict(block_sizes=[64, 64], split_dkv=False))
    assert spill(result["kernels"]["rankattn_dkv"]) > 0
