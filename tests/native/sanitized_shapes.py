"""Odd shapes through the cpu kernel built with AddressSanitizer and UBSan (a script).

tests/test_cpu_kernel.py runs it in a fresh interpreter with
RANKATTN_CPU_KERNEL_SANITIZE=1 and libasan preloaded: any read or write outside a
buffer, or undefined behaviour, aborts the process. It checks forward and
gradients against the reference on shapes chosen to break tiling (one token,
odd lengths, one past a block, head dims 1 / 8 / 33 / 200, GQA 5, cross-attention,
a context shard), then runs plans whose lists point outside the block grid.

The kernel reads its settings once per process, so the test runs the script twice, with
half of the cases each (argv[1]): "chunked" takes the backward's blocks pass and keeps dS in
chunks of one key block (RANKATTN_CPU_BACKWARD_PASS=blocks, budget 0: the path of long
sequences on many threads), "whole" its rows pass by query (each dq term added at once, query
blocks outer; RANKATTN_CPU_BACKWARD_PASS=rows-by-query) under a budget too large for its bytes
to fit an int64 (it is clamped: shifting it was undefined behaviour), "keys" the malformed
plans through its rows pass by key.
"""

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

import rankattn
from rankattn import semantics
from rankattn.backends import BlockSizes, Cpu
from rankattn.blocks import BlockPlan
from rankattn.planning import Plan
from rankattn.validate import AttentionCall
import oracle  # tests/oracle.py (on PYTHONPATH): float64 numpy, no XLA compile under ASan

library = rankattn.backends.cpu.library()
assert library.handle is not None, library.reasons
print("library:", library.path)

# Each XLA compile is slow under ASan (it intercepts its every allocation), so few shapes, and
# every call jitted: one compile per program, not one per operation (2.5x faster).
SHAPES = [  # (B, Sq, Skv, Hq, Hkv, D, Dv, blocks, mask, dtype)
    (1, 1, 1, 1, 1, 1, 1, (16, 8), "seg", jnp.float32),
    (2, 9, 9, 5, 1, 33, 7, (4, 8), "seg", jnp.bfloat16),
    (1, 17, 17, 4, 2, 200, 24, (16, 16), "causal", jnp.float16),
    (2, 65, 65, 2, 2, 8, 8, None, "seg", jnp.float32),
    (1, 7, 40, 8, 1, 48, 80, (3, 5), "none", jnp.float32),
]


def inputs(b, sq, skv, hq, hkv, d, dv, dtype, seed=0):
    keys = jax.random.split(jax.random.PRNGKey(seed), 4)
    return (jax.random.normal(keys[0], (b, sq, hq, d), dtype),
            jax.random.normal(keys[1], (b, skv, hkv, d), dtype),
            jax.random.normal(keys[2], (b, skv, hkv, dv), dtype),
            jax.random.normal(keys[3], (b, sq, hq, dv), dtype))


def run(impl, q, k, v, d_out, **kw):
    """[out, dq, dk, dv] of the loss oracle.loss(out, lse, d_out, 0.5), in one program."""
    def loss(q, k, v):
        out, lse = rankattn.attention(q, k, v, impl=impl, return_lse=True, **kw)
        finite = jnp.where(jnp.isfinite(lse), lse, 0)
        return (out.astype(jnp.float32) * d_out).sum() + 0.5 * (finite ** 2).sum(), out
    grads, out = jax.jit(jax.grad(loss, (0, 1, 2), has_aux=True))(q, k, v)
    return [out, *grads]


PART = sys.argv[1]
SETTINGS = {"chunked": ("0", "blocks"), "whole": (str(10**20), "rows-by-query"),
            "keys": ("1024", "rows-by-key")}
assert (os.environ["RANKATTN_CPU_BACKWARD_MB"],
        os.environ["RANKATTN_CPU_BACKWARD_PASS"]) == SETTINGS[PART]

# Half of the odd shapes each in the two passes; the rows pass by key takes the malformed plans.
PART_SHAPES = {"chunked": SHAPES[1::2], "whole": SHAPES[0::2], "keys": []}
for b, sq, skv, hq, hkv, d, dv, blocks, mask, dtype in PART_SHAPES[PART]:
    q, k, v, d_out = inputs(b, sq, skv, hq, hkv, d, dv, dtype)
    kw = {}
    if mask != "none":
        row = np.r_[np.ones(sq - sq // 3), -np.ones(sq // 3)].astype(np.int32)
        row[-1:] = 0 if sq > 2 else row[-1:]
        kw = dict(segment_ids=jnp.asarray(np.tile(row, (b, 1))), causal=mask == "causal",
                  softcap=2.0)
    impl = Cpu(BlockSizes(*blocks) if blocks else None)
    got = run(impl, q, k, v, d_out, **kw)
    rounded = [np.asarray(x.astype(jnp.float32), np.float64) for x in (q, k, v, d_out)]
    visible = (oracle.mask_dense(kw["segment_ids"], kw["causal"]) if kw
               else oracle.no_mask(b, sq, skv, False))
    expect = oracle.attention(*rounded[:3], visible, w=rounded[3], lse_weight=0.5,
                              softcap_value=kw.get("softcap"))
    want = [expect[name] for name in ("out", "dq", "dk", "dv")]
    tol = 1e-4 if dtype == jnp.float32 else 0.1  # a smoke check; the property suite is exact
    for name, x, y in zip(("out", "dq", "dk", "dv"), got, want):
        err = float(np.abs(np.asarray(x.astype(jnp.float32)) - y).max())
        assert err < tol * max(1.0, float(np.abs(y).max())), (
            b, sq, skv, dtype, name, err)
    print("ok", (b, sq, skv, hq, hkv, d, dv, blocks, mask, dtype.__name__))


def context_shard():
    """Keys with their own segment ids and positions, history part only."""
    q, k, v, _ = inputs(1, 5, 11, 2, 1, 16, 16, jnp.float32)
    shard = semantics.ShardMask(kv_segment_ids=jnp.ones((1, 11), jnp.int32),
                                q_positions=jnp.arange(20, 25, dtype=jnp.int32)[None],
                                kv_positions=jnp.arange(11, dtype=jnp.int32)[None] * 2)
    call = AttentionCall(q, k, v, jnp.ones((1, 5), jnp.int32), causal=True, scale=0.25,
                         softcap=None, softcap_method="tanh", shard_mask=shard)
    got = jax.jit(lambda: Cpu(BlockSizes(2, 3))(call))()  # one compile each, not one per op
    want = jax.jit(lambda: rankattn.backends.Reference()(call))()
    for x, y in zip(got, want):
        assert float(jnp.max(jnp.abs(x - y))) < 1e-4  # every key is seen: no NaN, no inf


def paged():
    """Serving: paged keys read in place (packed, and key-major where dv is whole vectors:
    K's 33 and V's 32 elements a row read through pointers), ragged and empty histories, a
    self key, a page table whose entries point outside the pages (clamped; the mask hides
    those slots), and exact scoring's mask built from lengths outside [0, S]."""
    from rankattn import serving
    from rankattn.backends.cpu import paged_candidates_forward, paged_forward
    for dv, budget in ((32, None), (33, None), (33, 6)):  # the page table below: dv 33
        q, k, v, _ = inputs(3, 10, 10, 4, 2, 33, dv, jnp.float32)
        cache = jax.jit(lambda k, v: serving.cache_from_history(k, v, jnp.array([10, 4, 0]),
                                                                page_size=3))(k, v)
        self_kv = (k[:, :2], v[:, :2])
        got, want = (jax.jit(lambda q, cache, self_kv: serving.attend(
            q, cache, jnp.array([0, 1, 2]), self_kv=self_kv, budget=budget,
            selection="per_request", impl=impl))(q[:, :2], cache, self_kv)
            for impl in (Cpu(BlockSizes(2, 5)), "reference"))
        assert float(jnp.abs(got - want).max()) < 1e-4, (dv, budget)
    table = jnp.array([[0, 10**6, -5, 3]], jnp.int32)
    seen = jnp.ones((1, 12), jnp.int32)
    mask = semantics.ShardMask(seen, jnp.array([[12]], jnp.int32), jnp.arange(12)[None])
    pages = tuple(x.reshape(-1, 3, 33) for x in (cache.k_pages, cache.v_pages))
    out, lse = jax.jit(lambda q, kp, vp, ks, vs: paged_forward(
        q, kp, vp, table, (ks, vs), -jnp.ones((1, 1), jnp.int32), shard_mask=mask, scale=0.2,
        softcap=None, softcap_method="tanh"))(q[:1, :1], *pages, k[:1, :1, :1], v[:1, :1, :1])
    assert bool(jnp.isfinite(out).all() & jnp.isfinite(lse).all())
    for length in (-7, 10**6):  # exact scoring's mask from lengths outside [0, S]
        out, lse = jax.jit(lambda q, kp, vp, ks, vs: paged_candidates_forward(
            q, kp, vp, table, (ks, vs), jnp.array([length], jnp.int32), scale=0.2,
            softcap=None, softcap_method="tanh", block_sizes=BlockSizes(1, 5)))(
            q[:1, :2], *pages, k[:1, :2, :1], v[:1, :2, :1])
        assert bool(jnp.isfinite(out).all() & jnp.isfinite(lse).all()), length


def malformed_plan():
    """Block indices and counts outside the grid must never be followed, and repeated entries
    (query block 0 in every key block's list, key block 0 in every query block's) must stay
    inside the kept dS (blocks pass) and add into their blocks' dQ and dK / dV (rows pass, by
    key and by query)."""
    b, s = 2, 21
    q, k, v, d_out = inputs(b, s, s, 2, 1, 8, 8, jnp.float32)
    sizes = BlockSizes(4, 8)
    n_q, n_k = -(-s // 4), -(-s // 8)
    bad = BlockPlan(kv_index=jnp.full((b, n_q, n_k), 0, jnp.int32).at[:, :, 0].set(-7)
                    .at[:, 1:, -1].set(10**6),
                    full_count=jnp.full((b, n_q), 99, jnp.int32),
                    count=jnp.full((b, n_q), 10**4, jnp.int32),
                    q_index=jnp.full((b, n_k, n_q), -1, jnp.int32).at[:, :, ::2].set(0),
                    q_full_count=jnp.full((b, n_k), -3, jnp.int32),
                    q_count=jnp.full((b, n_k), 2**30, jnp.int32))
    plan = Plan(segment_ids=jnp.ones((b, s), jnp.int32), block_plans=(bad,), causal=False,
                block_sizes=(sizes,))
    jax.block_until_ready(run(Cpu(sizes), q, k, v, d_out, plan=plan))


for case in {"chunked": [context_shard, paged, malformed_plan], "whole": [malformed_plan],
             "keys": [malformed_plan]}[PART]:
    case()
    print("ok", case.__name__)
print("SANITIZED RUN PASSED")
sys.exit(0)
