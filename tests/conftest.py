"""Suite-wide settings: Hypothesis profiles and the backends every per-backend test runs on.

Tolerances live in tests/tolerances.py; shared helpers in tests/helpers.py and
the float64 oracle in tests/oracle.py.
"""

from __future__ import annotations

import os
import sys

# Warnings are errors in the suite's kernel builds (and so in CI's), never in users' (native.py).
os.environ.setdefault("RANKATTN_CXX_WERROR", "1")

# The suite is compile-bound (every shape is a new XLA program) and runs tiny
# tensors, so LLVM's optimisation level buys nothing at run time and halves
# compile time. It does not change floating-point semantics (no fast-math on
# CPU). Set before JAX starts its backend; pass your own XLA_FLAGS to override.
if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_backend_optimization_level=0").strip()

# tests/distributed/ needs 8 devices, and JAX fixes the device count when it starts:
# tests/test_distributed.py runs that folder in a subprocess with
# XLA_FLAGS=--xla_force_host_platform_device_count=8 and RANKATTN_MESH_TESTS=1; this
# process, which sees one device, leaves it alone. (No conftest.py in that folder: its
# module name would shadow this one for the tests that import from it.)
# tests/ranker/ (the example's tests) imports flax, optax and orbax, which start threads
# and an event loop of their own; tests/test_ranker.py runs it in a subprocess so that
# nothing of theirs stays in this process.
if os.environ.get("RANKATTN_MESH_TESTS") != "1":
    collect_ignore_glob = ["distributed/*"]
if os.environ.get("RANKATTN_RANKER_TESTS") != "1":
    collect_ignore_glob = [*globals().get("collect_ignore_glob", []), "ranker/*"]
# tests/mosaic/ runs the Mosaic GPU interpreter (threads, patched internals):
# tests/test_mosaic_gpu.py runs it in a subprocess with RANKATTN_MOSAIC_TESTS=1.
if os.environ.get("RANKATTN_MOSAIC_TESTS") != "1":
    collect_ignore_glob = [*globals().get("collect_ignore_glob", []), "mosaic/*"]
# tests/x64/ needs jax_enable_x64, fixed when JAX starts: tests/test_float64.py runs it.
if os.environ.get("RANKATTN_X64_TESTS") != "1":
    collect_ignore_glob = [*globals().get("collect_ignore_glob", []), "x64/*"]

import jax  # noqa: E402
import pytest  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

from rankattn.backends import BlockSizes, Cpu, PallasTpu, PallasTriton, Xla  # noqa: E402
from rankattn import native  # noqa: E402
from rankattn.backends.cpu import library  # noqa: E402

# The fused C++ kernel is built on first use. Where a compiler exists, a failed build fails the
# run (CI included) rather than skipping the kernel's tests; only without one (or with the
# kernel turned off, RANKATTN_CPU_KERNEL=0) are they skipped, with the reason.
CPU_KERNEL_REASONS = library().reasons
if CPU_KERNEL_REASONS and native.compiler() is not None and not native.disabled():
    raise RuntimeError("the cpu kernel does not build here: " + "; ".join(CPU_KERNEL_REASONS))
needs_cpu_kernel = pytest.mark.skipif(bool(CPU_KERNEL_REASONS),
                                      reason="; ".join(CPU_KERNEL_REASONS) or "available")

# "ci" (the default) is deterministic and sized so the whole suite runs in a few
# minutes on two CPU cores: every new shape compiles a fresh XLA program, so the
# cost is compilation, and the property tests draw from small sets of shapes.
# "dev" explores more: HYPOTHESIS_PROFILE=dev pytest tests.
settings.register_profile(
    "ci",
    deadline=None,
    derandomize=True,
    max_examples=10,
    print_blob=True,
    # differing_executors: pytest makes a new instance of a test class per
    # parametrized call; the backend test classes keep no state on `self`.
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                           HealthCheck.differing_executors],
)
settings.register_profile(
    "dev",
    parent=settings.get_profile("ci"),
    derandomize=False,
    max_examples=60,
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

# Small blocks make short sequences span many blocks, ragged last blocks and
# "one past a block"; the default blocks are what users get. The Triton kernels run
# in Pallas interpret mode (their smallest legal tiles are 16 x 16).
SMALL_BLOCKS = Xla(BlockSizes(16, 8))
SMALL_TRITON = PallasTriton(BlockSizes(16, 16), interpret=True)
SMALL_CPU = Cpu(BlockSizes(16, 8))
# The Mosaic TPU kernels in Pallas' generic interpreter, which does not enforce TPU's (8, 128)
# block rule: 16 x 16 blocks make block skipping visible at the named tests' lengths. One
# compute block per DMA block: the interpreter runs each DMA block's compute blocks unrolled
# (11 s more of this suite at 4); tests/test_pallas_tpu.py checks DMA blocks of several.
SMALL_TPU = PallasTpu(BlockSizes(16, 16), interpret=True, dma_block=16)
# (Default xla blocks are one block at the named tests' lengths, S <= 40, so "xla" there would
# repeat what "xla-16x8" checks at more block edges; TestXlaDefaultBlocks* run the defaults.)
BACKENDS = [
    pytest.param("reference", id="reference"),
    pytest.param(SMALL_BLOCKS, id="xla-16x8"),
    pytest.param(SMALL_TRITON, id="pallas_triton-16x16"),
    pytest.param(SMALL_TPU, id="pallas_tpu-16x16"),
    pytest.param(SMALL_CPU, id="cpu-16x8", marks=needs_cpu_kernel),
]


def skip_if_float16_declined(impl, dtype) -> None:
    """pallas_tpu declines float16 (Mosaic rejects float16 vector loads on v5e, v6e and TPU7x:
    benchmarks/TPU_COMPILE.md); tests/test_pallas_tpu.py checks its reason instead."""
    if isinstance(impl, PallasTpu) and str(dtype) == "float16":
        pytest.skip("pallas_tpu declines float16 (Mosaic cannot load float16 vectors)")


@pytest.fixture(params=BACKENDS)
def impl(request):
    """Every backend (the reference included) for the per-backend named tests."""
    return request.param


# Suites that run in their own interpreter take 15-100 s each. Collected first, xdist's two
# workers share them out at the start instead of one worker finishing them alone at the end.
SLOW_FIRST = ("test_distributed.py", "test_ranker.py", "test_float64.py", "test_multiprocess.py",
              "test_benchmark_smoke.py")


def pytest_collection_modifyitems(items):
    items.sort(key=lambda item: item.path.name not in SLOW_FIRST)


# Each XLA:CPU executable keeps memory mappings for its compiled code while JAX's caches hold
# it (70-330 for the gradients of one attention call), and an xdist worker's caches held every
# program of its 600 tests: test_backends.py alone left 22,000 on one worker. Near the kernel's
# limit (vm.max_map_count, 65530 by default) a compile fails ("LLVM compilation error: Cannot
# allocate memory") and XLA then segfaults: CI's recurring worker crash inside
# backend_compile_and_load, reproduced with the limit lowered to 6000. So every
# COMPILES_PER_CHECK compiles, a test's teardown counts the mappings (a read of
# /proc/self/maps: 40 ms at 20,000), and past a quarter of the limit drops the cached programs:
# at most 16,000 + 50 x 330 mappings, a half of the limit (tests/test_memory_maps.py).
COMPILES_PER_CHECK = 50
compiles_since_check = 0


def count_compile(event: str, duration_secs: float, **_) -> None:
    global compiles_since_check
    if event == "/jax/core/compile/backend_compile_duration":
        compiles_since_check += 1


jax.monitoring.register_event_duration_secs_listener(count_compile)


def memory_maps() -> int:
    with open("/proc/self/maps", "rb") as f:
        return f.read().count(b"\n")


def memory_map_limit() -> int:
    with open("/proc/sys/vm/max_map_count") as f:
        return int(f.read())


def release_compiled_programs(above: int) -> bool:
    """Drops JAX's cached programs if this process has more than `above` memory mappings."""
    if memory_maps() <= above:
        return False
    jax.clear_caches()
    return True


@pytest.fixture(autouse=True)
def bounded_compiled_programs():
    global compiles_since_check
    yield
    if sys.platform == "linux" and compiles_since_check >= COMPILES_PER_CHECK:
        compiles_since_check = 0
        release_compiled_programs(memory_map_limit() // 4)


# A test process that dies prints what it was doing at the end of the run (crash_report.py).
from crash_report import pytest_configure, pytest_unconfigure  # noqa: E402, F401
