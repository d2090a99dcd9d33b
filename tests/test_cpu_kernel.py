"""The cpu backend's build, dispatch and guarantees beyond the shared property suite.

Its numerics run in tests/test_backends.py (TestCpu, TestCpuDefaultBlocks) and every
per-backend test (conftest.BACKENDS); here: the sanitizer build, bit-identical results
for any thread count, prepared plans, ``impl='auto'``'s choice and fallbacks. Building,
caching and loading it (rankattn.native): tests/test_native_build.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import rankattn
from conftest import needs_cpu_kernel
from rankattn import api, blocks, planning
from rankattn.backends import BlockSizes, Cpu

ROOT = Path(__file__).resolve().parents[1]


def python(script: str, env: dict[str, str], *args: str,
           timeout: int = 600) -> subprocess.CompletedProcess:
    """Run ``script`` with ``args`` in a fresh interpreter with ``env`` added."""
    env = dict(os.environ, **env)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), str(ROOT / "tests"),
                                         os.environ.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, "-c", script, *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


def gxx_runtime(name: str) -> str:
    return subprocess.run(["g++", f"-print-file-name={name}"], capture_output=True,
                          text=True).stdout.strip()


@needs_cpu_kernel
@pytest.mark.parametrize("part, budget_mb", [("chunked", "0"), ("whole", str(10**20))])
def test_sanitized_build_runs_odd_shapes_and_malformed_plans(part, budget_mb):
    """AddressSanitizer + UBSan: odd shapes (fwd + grads against the oracle), a context shard,
    and plans whose lists point outside the block grid, without one bad access; dS kept in
    chunks of one key block, and whole under a budget whose bytes overflowed an int64."""
    # Python is not linked to libstdc++: preload it after libasan, so that ASan finds the
    # __cxa_throw it wraps (jaxlib throws while it starts).
    env = {"RANKATTN_CPU_KERNEL_SANITIZE": "1", "ASAN_OPTIONS": "detect_leaks=0",
           "UBSAN_OPTIONS": "print_stacktrace=1", "RANKATTN_CPU_BACKWARD_MB": budget_mb,
           "LD_PRELOAD": f"{gxx_runtime('libasan.so')} {gxx_runtime('libstdc++.so')}"}
    script = (ROOT / "tests/native/sanitized_shapes.py").read_text()
    result = python(script, env, part)
    assert result.returncode == 0 and "SANITIZED RUN PASSED" in result.stdout, (
        result.stdout[-5000:] + result.stderr[-20000:])


@needs_cpu_kernel
@pytest.mark.parametrize("isa", ["-mno-amx-tile", "-mno-avx512f"])
def test_other_instruction_sets_run_odd_shapes(isa):
    """The paths this CPU would not take: bfloat16 dots on VDPBF16PS instead of AMX, and
    AVX2 (8 lanes, float32 dots for bfloat16). Where the host lacks an ISA the flag is moot."""
    script = (ROOT / "tests/native/sanitized_shapes.py").read_text()
    for part, budget_mb in (("chunked", "0"), ("whole", str(10**20))):
        result = python(script, {"RANKATTN_CXXFLAGS": isa, "RANKATTN_CPU_BACKWARD_MB": budget_mb},
                        part)
        assert result.returncode == 0 and "SANITIZED RUN PASSED" in result.stdout, (
            result.stdout[-5000:] + result.stderr[-20000:])


THREADS_SCRIPT = textwrap.dedent("""
    import sys, jax, jax.numpy as jnp, numpy as np, rankattn
    from rankattn.backends import BlockSizes, Cpu
    keys = jax.random.split(jax.random.PRNGKey(3), 4)
    b, s = 2, 150
    seg = jnp.asarray(np.tile(np.r_[np.ones(100), -np.ones(40), np.zeros(10)], (b, 1)), jnp.int32)
    impl = Cpu(BlockSizes(16, 32))
    results = {}
    for dtype in (jnp.float32, jnp.bfloat16):  # float32 dots; bfloat16 on AMX / VDPBF16PS
        q = jax.random.normal(keys[0], (b, s, 4, 40), dtype)
        k = jax.random.normal(keys[1], (b, s, 2, 40), dtype)
        v = jax.random.normal(keys[2], (b, s, 2, 24), dtype)
        w = jax.random.normal(keys[3], (b, s, 4, 24), jnp.float32)
        def loss(q, k, v):
            out = rankattn.attention(q, k, v, segment_ids=seg, softcap=3.0, impl=impl)
            return (out.astype(jnp.float32) * w).sum(), out
        grads, out = jax.jit(jax.grad(loss, (0, 1, 2), has_aux=True))(q, k, v)
        for name, x in zip(("out", "dq", "dk", "dv"), (out, *grads)):
            results[f"{name} {dtype.__name__}"] = np.asarray(x.astype(jnp.float32))
    np.savez(sys.argv[1] if len(sys.argv) > 1 else sys.stdout.buffer, **results)
""")



@needs_cpu_kernel
def test_results_are_bit_identical_for_any_thread_count_and_backward_memory(tmp_path):
    """Every output element is computed by one task in a fixed order: 1 thread = the pool.
    The backward keeps dS for the dq tasks in chunks of key blocks that fit
    RANKATTN_CPU_BACKWARD_MB (0: one key block per chunk); dq sums in key order in any
    chunking: the same bits too."""
    results = {}
    for threads, budget in (("1", "1024"), ("64", "1024"), ("64", "0")):
        path = tmp_path / f"{threads}-{budget}.npz"
        run = python(THREADS_SCRIPT.replace("sys.argv[1] if len(sys.argv) > 1 else "
                                            "sys.stdout.buffer", repr(str(path))),
                     {"RANKATTN_CPU_THREADS": threads, "RANKATTN_CPU_BACKWARD_MB": budget})
        assert run.returncode == 0, run.stderr[-5000:]
        results[threads, budget] = np.load(path)
    for name in results["1", "1024"].files:
        bits = {key: r[name].tobytes() for key, r in results.items()}
        assert len(set(bits.values())) == 1, (name, [k for k in bits])


@needs_cpu_kernel
def test_prepared_plan_is_used_not_rebuilt(monkeypatch):
    """A plan made for the cpu backend holds its block lists; the call then makes none."""
    seg = jnp.asarray(np.tile(np.r_[np.ones(150), -np.ones(50)], (2, 1)), jnp.int32)
    prepared = rankattn.plan(segment_ids=seg, impl=["cpu"])
    assert Cpu().plan_sizes(200)[0] in prepared.block_sizes

    def rebuilt(*args, **kwargs):
        raise AssertionError("the call rebuilt its block plan")

    monkeypatch.setattr(blocks, "make_block_plan", rebuilt)
    monkeypatch.setattr(planning, "self_attention_block_plan", rebuilt)
    q = jnp.ones((2, 200, 2, 8))
    out = rankattn.attention(q, q[:, :, :1], q[:, :, :1], plan=prepared, impl="cpu")
    assert out.shape == (2, 200, 2, 8)


@needs_cpu_kernel
def test_auto_prefers_the_fused_kernel_on_cpu():
    assert rankattn.available_impls()[0] == "cpu"
    q = jnp.ones((1, 5, 2, 8))
    call = rankattn.validate.check_attention_args(q, q, q, segment_ids=None, bounds=None,
                                                  causal=False, scale=None, softcap=None,
                                                  softcap_method="tanh", plan=None)
    assert api.select_backend("auto", call).name == "cpu"


def test_turned_off_falls_back_to_xla_and_says_why():
    script = textwrap.dedent("""
        import jax.numpy as jnp, rankattn
        print(rankattn.available_impls())
        try:
            rankattn.attention(jnp.ones((1, 3, 1, 8)), jnp.ones((1, 3, 1, 8)),
                               jnp.ones((1, 3, 1, 8)), impl="cpu")
        except rankattn.RankattnError as e:
            print(e.code, str(e))
    """)
    result = python(script, {"RANKATTN_CPU_KERNEL": "0"})
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    assert lines[0] == "['xla', 'reference']"
    assert lines[1].startswith("RA115") and "RANKATTN_CPU_KERNEL=0" in result.stdout


@needs_cpu_kernel
def test_float64_is_declined_with_a_reason():
    call = rankattn.validate.AttentionCall(
        jax.ShapeDtypeStruct((1, 3, 1, 8), jnp.float64), None, None, None, causal=False,
        scale=1.0, softcap=None, softcap_method="tanh")
    assert "float64" in Cpu().not_supported_reasons(call)[0]
