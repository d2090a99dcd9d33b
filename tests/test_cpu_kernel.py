"""The cpu backend's build, dispatch and guarantees beyond the shared property suite.

Its numerics run in tests/test_backends.py (TestCpu, TestCpuDefaultBlocks) and every
per-backend test (conftest.BACKENDS); here: the sanitizer build, the builds for other
instruction sets (TestCpu's core cases), bit-identical results for any task order and thread
count, prepared plans, ``impl='auto'``'s choice and fallbacks. Out of memory:
tests/test_cpu_kernel_memory.py; the conversions and exp: tests/test_cpu_kernel_numerics.py.
Building, caching and loading it (rankattn.native): tests/test_native_build.py.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import platform
import re
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import rankattn
from conftest import needs_cpu_kernel
from helpers import kernel_not_first_compilers
from rankattn import api, blocks, planning, serving
from rankattn.backends import Cpu, cpu

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
@pytest.mark.parametrize("part, budget_mb, backward_pass",
                         [("chunked", "0", "blocks"), ("whole", str(10**20), "rows-by-query"),
                          ("keys", "1024", "rows-by-key")])
def test_sanitized_build_runs_odd_shapes_and_malformed_plans(part, budget_mb, backward_pass):
    """AddressSanitizer + UBSan: odd shapes (fwd + grads against the oracle), a context shard,
    and plans whose lists point outside the block grid, without one bad access; the backward's
    blocks pass with dS kept in chunks of one key block, its rows pass by query under a budget
    whose bytes overflowed an int64, and by key."""
    # Python is not linked to libstdc++: preload it after libasan, so that ASan finds the
    # __cxa_throw it wraps (jaxlib throws while it starts).
    env = {"RANKATTN_CPU_KERNEL_SANITIZE": "1", "ASAN_OPTIONS": "detect_leaks=0",
           "UBSAN_OPTIONS": "print_stacktrace=1", "RANKATTN_CPU_BACKWARD_MB": budget_mb,
           "RANKATTN_CPU_BACKWARD_PASS": backward_pass,
           "LD_PRELOAD": f"{gxx_runtime('libasan.so')} {gxx_runtime('libstdc++.so')}"}
    script = (ROOT / "tests/native/sanitized_shapes.py").read_text()
    result = python(script, env, part)
    assert result.returncode == 0 and "SANITIZED RUN PASSED" in result.stdout, (
        result.stdout[-5000:] + result.stderr[-20000:])


def host_flags() -> set[str]:
    """The host CPU's instruction-set flags (x86 Linux; empty elsewhere)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def kernel_features(case) -> set[str]:
    """The kernel paths a TestCpu configuration takes."""
    features = {"own keys" if case.mask != "none" else "no mask"}
    features |= {name for name, used in [
        ("causal", case.causal), (f"cap {case.softcap_method}", case.softcap),
        ("gqa", case.heads_q > case.heads_kv), ("dv != d", case.dim_v not in (None, case.dim)),
        ("d > 128", case.dim > 128), ("odd d", case.dim % 2), ("cross-attention", case.kv_seq),
        ("several blocks", case.seq > 16)] if used}
    return features


def core_cases(dtype: str) -> list[str]:
    """Node ids of TestCpu's property test for the first `dtype` configurations that, between
    them, take every path of kernel_features (6 in float32, 5 in bfloat16)."""
    from helpers import case_id
    from test_backends import CPU_CONFIGS

    seen, ids = set(), []
    for case in CPU_CONFIGS:
        if case.dtype == dtype and case.multiplier == "none" and not kernel_features(case) <= seen:
            seen |= kernel_features(case)
            ids.append(f"tests/test_backends.py::TestCpu::test_matches_oracle[{case_id(case)}]")
    return ids


@needs_cpu_kernel
def test_the_first_compiler_builds_the_kernel_with_warnings_as_errors():
    """The host's build is g++'s (the first compiler) with -Werror, not a fallback's; the
    other instruction sets' builds are checked the same way below."""
    assert kernel_not_first_compilers() is None, kernel_not_first_compilers()


# In a build with other flags: its vector width and bfloat16 dots, then TestCpu's core cases.
ISA_SCRIPT = textwrap.dedent("""
    import sys, pytest
    from rankattn.backends import cpu
    from helpers import kernel_not_first_compilers
    handle = cpu.library().handle
    assert handle is not None, cpu.library().reasons
    assert kernel_not_first_compilers() is None, kernel_not_first_compilers()
    built = (handle.rankattn_test_lanes(), handle.rankattn_test_bf16_dots())
    assert built == (int(sys.argv[1]), int(sys.argv[2])), built
    sys.exit(pytest.main(["-q", "-n", "0", "-p", "no:cacheprovider", *sys.argv[3:]]))
""")


ZIG = f"{sys.executable} -m ziglang c++"


@needs_cpu_kernel
@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86 flags")
@pytest.mark.parametrize("isa, lanes, bf16_dots, dtype, cxx", [
    ("-mno-avx512f", 8, 0, "float32", None),  # AVX2: 8 lanes; bfloat16 runs float32 dots
    ("-mno-avx", 4, 0, "float32", None),      # no AVX at all: the portable 4-lane path
    ("-mno-amx-tile", 16, 1, "bfloat16", None),  # bfloat16 dots on VDPBF16PS instead of AMX
    # The host's own paths built by zig's clang (the ziglang package of the test extra, what
    # users without g++ get), so every CI run builds with clang too. zig reads -march itself
    # and takes no -mno-* flags.
    ("", None, None, "float32", ZIG),
])
def test_other_instruction_sets_pass_the_core_cases(isa, lanes, bf16_dots, dtype, cxx):
    """The paths this CPU would not take, built with RANKATTN_CXXFLAGS=<isa>, against the
    float64 oracle (and at other vector widths, serving's pages read in place against clean
    pages). An AVX2 CPU has no bfloat16 dot path at all (its bfloat16 inputs run the
    float32 dots the AVX2 case checks). zig's first build on a machine also builds its libc++
    (a minute or two, once)."""
    flags = host_flags()
    if isa == "-mno-avx512f" and "avx512f" not in flags:
        pytest.skip("no AVX-512 here: this host's own build is the AVX2 one")
    if isa == "-mno-amx-tile" and "avx512_bf16" not in flags:
        pytest.skip("no AVX-512 BF16 here: no bfloat16 dot path to test")
    if isa == "-mno-avx512f" and "avx" not in flags:
        lanes = 4
    if cxx == ZIG:
        if importlib.util.find_spec("ziglang") is None:
            pytest.skip("the ziglang package is not installed (it is in the test extra)")
        handle = cpu.library().handle  # the host's build: zig's must take the same paths
        lanes, bf16_dots = handle.rankattn_test_lanes(), handle.rankattn_test_bf16_dots()
    env = {"RANKATTN_CXXFLAGS": isa, **({"RANKATTN_CXX": cxx} if cxx else {})}
    # Serving's pages read in place, key-major, at the vector widths the host's build lacks.
    in_place = [f"tests/test_serving_in_place.py::{name}" for name in (
        "test_pages_read_in_place_match_the_oracle",
        "test_a_logit_that_overflows_from_finite_inputs_is_capped_not_poisoned",
        "test_a_stale_value_in_an_unused_slot_is_never_read",
        "test_a_seen_non_finite_value_poisons_its_row_even_at_weight_0")
    ] if isa.startswith("-mno-avx") else []
    # The vector exp, exp2 and tanh and the scalar conversions too: without AVX-512, exp and
    # exp2 scale by 2^n without VSCALEFPS (the AVX-512 hosts' CI missed the overflow that
    # ce489eb fixed there), and without FMA exp2 has a bound of its own.
    numerics = ["tests/test_cpu_kernel_numerics.py"] if isa.startswith("-mno-avx") else []
    run = python(ISA_SCRIPT, env, str(lanes), str(bf16_dots), *core_cases(dtype), *in_place,
                 *numerics)
    assert run.returncode == 0, run.stdout[-10000:] + run.stderr[-5000:]


# Contiguous forward and backward (float32 dots; bfloat16 on AMX / VDPBF16PS), the paged
# forward with self keys and a page table with entries outside the pages, and Quest's bounds.
ORDER_SCRIPT = textwrap.dedent("""
    import sys, jax, jax.numpy as jnp, numpy as np, rankattn
    from rankattn import semantics
    from rankattn.backends import BlockSizes, Cpu, cpu
    keys = jax.random.split(jax.random.PRNGKey(3), 4)
    b, s = 2, 150
    seg = jnp.asarray(np.tile(np.r_[np.ones(100), -np.ones(40), np.zeros(10)], (b, 1)), jnp.int32)
    impl = Cpu(BlockSizes(16, 32))
    results = {}
    for dtype in (jnp.float32, jnp.bfloat16):
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
        pages = [x[0, :144, :1].reshape(9, 16, -1) for x in (k, v)]
        table = jnp.array([[4, 0, 8, 2, 99], [1, -3, 5, 7, 6]], jnp.int32)
        visible = semantics.ShardMask(jnp.ones((b, 80), jnp.int32).at[1, 50:].set(0),
                                      jnp.full((b, 20), 80, jnp.int32),
                                      jnp.broadcast_to(jnp.arange(80, dtype=jnp.int32), (b, 80)))
        for block_q in (4, 32):  # key blocks packed by their own tasks / by their one reader
            paged = jax.jit(lambda q, kp, vp, ks, vs: cpu.paged_forward(
                q, kp, vp, table, (ks, vs), -jnp.ones((b, 20), jnp.int32), shard_mask=visible,
                scale=0.2, softcap=2.0, softcap_method="tanh",
                block_sizes=BlockSizes(block_q, 16)))
            out, lse = paged(q[:, :20], *pages, k[:, :20, :1], v[:, :20, :1])
            results[f"paged out {dtype.__name__} {block_q}"] = np.asarray(out.astype(jnp.float32))
            results[f"paged lse {dtype.__name__} {block_q}"] = np.asarray(lse)
        if dtype == jnp.float32:  # one row of one kv head: one query block, split in parts
            one = jax.jit(lambda q, kp, vp, ks, vs: cpu.paged_forward(
                q, kp, vp, table[:1], (ks, vs), -jnp.ones((1, 20), jnp.int32),
                shard_mask=jax.tree.map(lambda x: x[:1], visible), scale=0.2, softcap=None,
                softcap_method="tanh", block_sizes=BlockSizes(32, 16)))
            out, _ = one(q[:1, :20], *pages, k[:1, :20, :1], v[:1, :20, :1])
            results["paged parts"] = np.asarray(out)
    stats = jax.random.normal(keys[0], (300, 2, 40))
    bounds, bad = cpu.page_bounds(jax.random.normal(keys[1], (b, 2, 6, 40)), stats, stats - 1,
                                  jax.random.randint(keys[2], (b, 300), 0, 300, jnp.int32),
                                  jnp.array([300, 170], jnp.int32))
    results["bounds"], results["bad"] = np.asarray(bounds), np.asarray(bad)
    np.savez(sys.argv[1], **results)
""")


@needs_cpu_kernel
def test_results_are_bit_identical_in_any_task_order_thread_count_backward_pass_and_memory(
        tmp_path):
    """Every output element is written by one task, in a fixed order: tasks claimed in reverse
    or shuffled order (the test-only RANKATTN_CPU_TASK_ORDER, which bites where the pool has
    one thread too), one thread or the pool (which splits a forward's query blocks among its
    threads where they are fewer, as one row of one kv head), give the same bits. The
    backward's two passes
    (RANKATTN_CPU_BACKWARD_PASS) agree bit for bit: rows (one task per batch row and kv head,
    each dq term added at once: what one thread takes, key blocks outer at these sizes; and
    query blocks outer, forced) and blocks, which keeps dS for the dq tasks in chunks of key
    blocks that fit RANKATTN_CPU_BACKWARD_MB (0: one key block per chunk); dq sums in key
    order and dk / dv in query order in every pass, order and chunking. Two runs also trace
    their threads (RANKATTN_CPU_TRACE=1), which changes no bit either."""
    runs = {"one thread": {"RANKATTN_CPU_THREADS": "1", "RANKATTN_CPU_TRACE": "1"},
            "pool, rows by query": {"RANKATTN_CPU_TRACE": "1",
                                    "RANKATTN_CPU_TASK_ORDER": "reverse",
                                    "RANKATTN_CPU_BACKWARD_PASS": "rows-by-query"},
            "pool, dS kept": {"RANKATTN_CPU_BACKWARD_PASS": "blocks"},
            "pool, shuffled, dS kept in chunks": {"RANKATTN_CPU_TASK_ORDER": "shuffle:7",
                                                  "RANKATTN_CPU_BACKWARD_PASS": "blocks",
                                                  "RANKATTN_CPU_BACKWARD_MB": "0"}}
    results, traces = {}, {}
    for name, env in runs.items():
        path = tmp_path / f"{len(results)}.npz"
        run = python(ORDER_SCRIPT, env, str(path))
        assert run.returncode == 0, run.stderr[-5000:]
        results[name] = np.load(path)
        traces[name] = trace_regions(run.stderr)
    for field in results["one thread"].files:
        bits = {name: r[field].tobytes() for name, r in results.items()}
        differ = [name for name in bits if bits[name] != bits["one thread"]]
        assert not differ, (field, differ)
    # The trace: one caller per region, which alone runs every task on one thread; with the
    # pool, no task twice (a worker that starts after the call has returned runs none, and
    # may print after the process has ended). Only a caller yields its CPU, to workers that
    # are late, and at most once per task it runs: never on one thread, which has none.
    assert traces["one thread"] and traces["pool, rows by query"] and not traces["pool, dS kept"]
    if len(os.sched_getaffinity(0)) > 1:  # the checks of workers' lines below have some
        assert any(who == "worker" for _, lines in traces["pool, rows by query"].values()
                   for who, _, _ in lines), traces["pool, rows by query"]
    for name in ("one thread", "pool, rows by query"):
        for region, (tasks, lines) in traces[name].items():
            assert [who for who, _, _ in lines].count("caller") == 1, (name, region, lines)
            ran = sum(count for _, count, _ in lines)
            assert ran == tasks if name == "one thread" else ran <= tasks, (name, region, lines)
            for who, count, yields in lines:
                most = 0 if who == "worker" or name == "one thread" else count
                assert yields <= most, (name, region, lines)


def trace_regions(stderr: str) -> dict[int, tuple[int, list[tuple[str, int, int]]]]:
    """RANKATTN_CPU_TRACE's lines by region: {region: (tasks, [(caller / worker, ran,
    yields)])}."""
    regions: dict = {}
    for line in stderr.splitlines():
        if line.startswith("rankattn cpu trace:"):
            match = re.fullmatch(r"rankattn cpu trace: region (\d+) of (\d+) tasks: (caller|"
                                 r"worker) started \d+ us after the call on cpu -?\d+, ran (\d+) "
                                 r"in \d+ us, yielded (\d+) times", line)
            assert match, line
            region, tasks, who, ran, yields = match.groups()
            regions.setdefault(int(region), (int(tasks), []))[1].append(
                (who, int(ran), int(yields)))
    return regions


@needs_cpu_kernel
def test_calls_from_several_python_threads_give_the_same_bits():
    """A server may run requests on several threads at once: each call's tasks, scratch and
    errors stay its own in the kernel's shared pool, so concurrent fwd + bwd calls and serving
    requests give the bits of one call alone."""
    keys = jax.random.split(jax.random.PRNGKey(0), 3)
    q = jax.random.normal(keys[0], (2, 130, 4, 33))
    k, v = (jax.random.normal(key, (2, 130, 2, 24 + 9 * (i == 0))) for i, key in
            enumerate(keys[1:]))
    seg = jnp.asarray(np.tile(np.r_[np.ones(100), -np.ones(30)], (2, 1)), jnp.int32)
    grads = jax.jit(jax.grad(lambda q, k, v: rankattn.attention(
        q, k, v, segment_ids=seg, causal=True, impl="cpu").sum(), (0, 1, 2)))
    cache = serving.cache_from_history(k[:, :100], v[:, :100], jnp.array([100, 57]), page_size=16)
    scores = jax.jit(lambda q, cache, self_kv: serving.attend(q, cache, jnp.array([0, 1]),
                                                              self_kv=self_kv, impl="cpu"))
    calls = [lambda: grads(q, k, v), lambda: (scores(q[:, 100:], cache,
                                                     (k[:, 100:], v[:, 100:])),)]
    alone = [[np.asarray(x) for x in call()] for call in calls]
    mismatches = []

    def worker(index):
        for round_ in range(6):
            which = (index + round_) % 2
            got = [np.asarray(x) for x in calls[which]()]
            if not all(np.array_equal(a, b) for a, b in zip(got, alone[which])):
                mismatches.append((index, round_, which))

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not any(thread.is_alive() for thread in threads), "a call never returned"
    assert not mismatches, mismatches


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
def test_block_attributes_past_the_sequence_are_one_block_regression():
    """Regression (review): the kernel took its block_q / block_k attributes at any size from a
    direct FFI call, and at 2^58 the panels' byte counts wrapped and the call wrote past its
    buffer (SIGSEGV). A block past its sequence is capped to it, as plan_sizes caps them: the
    same bits as the blocks of the whole sequence."""
    keys = jax.random.split(jax.random.PRNGKey(0), 3)
    q = jax.random.normal(keys[0], (2, 21, 4, 16))
    k, v = (jax.random.normal(key, (2, 21, 2, 16)) for key in keys[1:])
    seg = jnp.asarray(np.tile(np.r_[np.ones(15), -np.ones(6)], (2, 1)), jnp.int32)
    static, mask, plan = cpu._prepare(q.shape, 21, seg, False, 0.25, None, "tanh", None, None,
                                      None, None, own=True)
    assert static.sizes == blocks.BlockSizes(21, 21)  # one block each: the plan's grid fits
    want = cpu._forward(static, q, k, v, mask, plan)
    for huge in ((2**58, 2**58), (21, 2**62), (2**40, 22)):
        past = dataclasses.replace(static, sizes=blocks.BlockSizes(*huge))
        got = cpu._forward(past, q, k, v, mask, plan)
        for x, y in zip(got, want):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=str(huge))


@pytest.mark.parametrize("kv_len, block_k", [(40, 40), (100, 64), (128, 64), (129, 128),
                                            (192, 128), (256, 128), (257, 256), (320, 256),
                                            (1088, 256), (32896, 256)])
def test_default_key_blocks_split_the_keys(kv_len, block_k):
    """Keys in one default block of 256 were computed densely whatever the mask (issue 40:
    history 128 + 64 candidates); the default halves it, down to 64, while it holds every
    key. Sizes a user gives are kept, only shortened to the sequence."""
    assert cpu.plan_sizes(None, 300, kv_len) == blocks.BlockSizes(64, block_k)
    assert cpu.plan_sizes(blocks.BlockSizes(32, 256), 300, kv_len) == blocks.BlockSizes(
        32, min(256, kv_len))


def test_history_queries_skip_the_candidates_keys_at_128_plus_64():
    """The regression: at 2 x (128 history + 64 candidates) the history's query blocks visited
    the one key block holding every key; with the default blocks every query block visits only
    the history's keys (a candidate's own key joins its softmax apart from the blocks)."""
    seg = jnp.asarray(np.tile(np.r_[np.ones(128), -np.ones(64)], (2, 1)), jnp.int32)
    sizes = Cpu().plan_sizes(192)[0]
    plan = rankattn.plan(segment_ids=seg, impl=["cpu"]).block_plan(sizes)
    keys_seen = np.asarray(plan.count) * sizes.block_k
    assert keys_seen.tolist() == [[128, 128, 128]] * 2


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


@needs_cpu_kernel
def test_logits_past_a_billion_give_the_argmax_value_not_nan():
    """Regression: finite q and k whose logits reach 2e9. Each row's softmax is its argmax,
    which the cpu kernel gave as NaN or wrong values while its exp2's argument was
    s log2(e) - m log2(e): the rounding of m log2(e) passed 2^t's overflow. Contiguous
    (row-major) and serving's pages read in place (key-major)."""
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 200, 2, 32)).astype(np.float32) for _ in range(3))
    q, k = q * 3e4, k * 3e4
    got = np.asarray(rankattn.attention(q, k, v, segment_ids=jnp.ones((1, 200), jnp.int32),
                                        impl=Cpu(rankattn.backends.BlockSizes(64, 64))))
    logits = np.einsum("bqhd,bkhd->bhqk", q.astype(np.float64), k.astype(np.float64)) / 32 ** 0.5
    assert np.abs(logits).max() > 1e9
    want = np.take_along_axis(v.astype(np.float64).transpose(0, 2, 1, 3),
                              logits.argmax(-1)[..., None], axis=2).transpose(0, 2, 1, 3)
    np.testing.assert_allclose(got, want, atol=1e-6)
    # 64 candidates over the 200 keys as a cached history, each with its own key of size 1.
    qc = rng.standard_normal((1, 64, 2, 32)).astype(np.float32) * 3e4
    kc, vc = (rng.standard_normal((1, 64, 2, 32)).astype(np.float32) for _ in range(2))
    cache = serving.cache_from_history(k, v, jnp.array([200]), page_size=16)
    got = np.asarray(serving.attend(qc, cache, jnp.array([0]), self_kv=(kc, vc)))
    keys = np.concatenate([np.broadcast_to(k[:, None], (1, 64, 200, 2, 32)), kc[:, :, None]], 2)
    vals = np.concatenate([np.broadcast_to(v[:, None], (1, 64, 200, 2, 32)), vc[:, :, None]], 2)
    best = np.einsum("bthd,btkhd->bthk", qc.astype(np.float64), keys.astype(np.float64)).argmax(-1)
    want = np.take_along_axis(vals.transpose(0, 1, 3, 2, 4), best[..., None, None], 3)[..., 0, :]
    np.testing.assert_allclose(got, want, atol=1e-6)
