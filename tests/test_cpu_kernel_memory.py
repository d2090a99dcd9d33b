"""The cpu kernel out of memory: RA126 as the call's error, and the process carries on.

Each case runs in a fresh interpreter: the kernel reads its environment once per process, and
before these fixes a failed allocation ended the process (std::bad_alloc on a pool worker
terminates it) or crashed the next call (a buffer recorded as grown that was never allocated).
Allocations fail for real under ``RLIMIT_AS``, and by the test-only knob
``RANKATTN_CPU_FAIL_ALLOC=caller:<n> | pool:<n>`` (the n-th allocation of the kernel's buffers
on the thread that calls it, or on XLA's pool workers, fails once).
"""

from __future__ import annotations

import os
import re
import textwrap

import pytest

from conftest import needs_cpu_kernel
from test_cpu_kernel import python



def ra126(digits: str) -> str:
    """The kernel's RA126 message, asking for a number of bytes that matches ``digits``."""
    return (r"RESOURCE_EXHAUSTED: \[RA126\] the cpu kernel could not allocate memory: it asked "
            rf"for {digits} bytes \(.+\)\. Lower RANKATTN_CPU_BACKWARD_MB")

# A forward and backward that fails, then the same call again on the same thread, against xla.
INJECTED = textwrap.dedent("""
    import jax, jax.numpy as jnp, numpy as np, rankattn

    def grads(impl, q, k, v, seg):
        def loss(q, k, v):
            out = rankattn.attention(q, k, v, segment_ids=seg, causal=True, impl=impl)
            return out.sum(), out
        grads, out = jax.jit(jax.grad(loss, (0, 1, 2), has_aux=True))(q, k, v)
        return [np.asarray(x) for x in (out, *grads)]

    keys = jax.random.split(jax.random.PRNGKey(0), 3)
    b, s = 2, 600  # 20 key blocks and 40 query blocks: every thread runs tasks
    q = jax.random.normal(keys[0], (b, s, 4, 64))
    k, v = (jax.random.normal(key, (b, s, 2, 64)) for key in keys[1:])
    seg = jnp.asarray(np.tile(np.r_[np.ones(500), -np.ones(100)], (b, 1)), jnp.int32)
    try:
        grads("cpu", q, k, v, seg)
        print("no error")
    except Exception as e:
        print("error:", type(e).__name__, e)
    ok = all(np.allclose(x, y, atol=1e-4)
             for x, y in zip(grads("cpu", q, k, v, seg), grads("xla", q, k, v, seg)))
    print("next call matches xla:", ok)
""")


def one_pool_thread() -> bool:
    """Whether XLA's CPU pool has one thread here (it has one per schedulable core)."""
    return len(os.sched_getaffinity(0)) < 2


@needs_cpu_kernel
@pytest.mark.parametrize("knob", [
    # The calling thread's first: its key panels' buffer, before any task. The next call on
    # that thread must not believe a size whose buffer was never allocated.
    "caller:1",
    # The calling thread's third (the second: the key blocks' packing states): in its first
    # task that allocates, while pool workers run others, which parallel_for must wait for
    # before the error leaves the frame they use.
    "caller:3",
    # A pool worker's first, in a task: caught there, not the end of the process.
    "pool:1",
])
def test_a_failed_allocation_is_RA126_and_the_next_call_works(knob):
    if knob.startswith("pool") and one_pool_thread():
        pytest.skip("XLA's CPU pool has one thread here: no pool worker runs a task")
    run = python(INJECTED, {"RANKATTN_CPU_FAIL_ALLOC": knob})
    assert run.returncode == 0, run.stdout + run.stderr[-5000:]
    assert re.search("error: JaxRuntimeError " + ra126(r"\d+"), run.stdout), run.stdout
    assert "next call matches xla: True" in run.stdout, run.stdout


# 256K keys in float16, which the kernel packs as float32 panels (about 310 MiB), under an
# address-space limit 128 MiB above what the process has mapped once its inputs exist.
RLIMIT = textwrap.dedent("""
    import resource
    import jax, jax.numpy as jnp, numpy as np, rankattn

    rng = np.random.default_rng(0)
    q = rng.standard_normal((1, 65, 1, 128), np.float32).astype(np.float16)
    k = rng.standard_normal((1, 1 << 18, 1, 128), np.float32).astype(np.float16)
    args = [jax.device_put(x) for x in (q, k, k[..., ::-1].copy())]
    call = jax.jit(lambda q, k, v: rankattn.attention(q, k, v, impl="cpu"))
    call = call.lower(*args).compile()
    mapped = int(open("/proc/self/statm").read().split()[0]) * resource.getpagesize()
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (mapped + (128 << 20), hard))
    try:
        jax.block_until_ready(call(*args))
        print("no error")
    except Exception as e:
        print("error:", type(e).__name__, e)
    resource.setrlimit(resource.RLIMIT_AS, (hard, hard))
    got = call(*args)[0, :, 0]
    want = jax.nn.dot_product_attention(*(x.astype(jnp.float32) for x in args))[0, :, 0]
    print("next call matches:", float(jnp.abs(got - want).max()) < 1e-3)
""")


@needs_cpu_kernel
def test_out_of_memory_under_an_address_space_limit_is_RA126():
    run = python(RLIMIT, {})
    assert run.returncode == 0, run.stdout + run.stderr[-5000:]
    assert re.search("error: JaxRuntimeError " + ra126(r"\d{9}"), run.stdout), run.stdout
    assert "next call matches: True" in run.stdout, run.stdout
