"""The cpu kernel's exact serving path reads the cache's pages in place, key-major (forward.h's
key_major: K's and V's rows through pointers, no packed copy, non-finite values not cleared
first). Checked against the float64 oracle on shapes that break its tiling, and on the
non-finite cases that a packed copy used to clear: stale values in unused slots, a seen
non-finite key hidden by the cap, a seen non-finite value whose weight underflows to 0.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import oracle
from conftest import needs_cpu_kernel
from tolerances import FEW_KEYS_TOL, assert_close_f32, assert_matches

from rankattn import serving
from rankattn.backends import BlockSizes, Cpu

pytestmark = needs_cpu_kernel


def _oracle_rows(q, k, v, users, lengths, self_kv, **options):
    """The float64 oracle of each request row: its user's history, then its candidates, each
    seeing the history and (with self_kv) its own key."""
    rows = []
    for i, u in enumerate(users):
        n, t = int(lengths[u]), q.shape[1]
        kk, vv = k[u, :n], v[u, :n]
        mask = np.zeros((1, t, n + t), bool)
        mask[0, :, :n] = True
        if self_kv is not None:
            kk = np.concatenate([kk, self_kv[0][i]])
            vv = np.concatenate([vv, self_kv[1][i]])
            mask[0, :, n:] = np.eye(t, dtype=bool)
        else:
            mask = mask[:, :, :n]
        if not mask.any():  # nothing seen: the row is 0
            rows.append(None)
            continue
        w = np.zeros(q[i:i + 1].shape[:3] + (v.shape[-1],))  # magnitudes come with a backward
        rows.append(oracle.attention(q[i:i + 1], kk[None], vv[None], mask, w=w, magnitudes=True,
                                     **options))
    return rows


@settings(max_examples=5, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), group=st.sampled_from([1, 3]),
       hkv=st.sampled_from([1, 2]), d=st.sampled_from([8, 24, 40]),
       dv=st.sampled_from([16, 32]), t=st.integers(1, 9), page=st.sampled_from([1, 4, 16]),
       block_k=st.sampled_from([16, 32, 64]), with_self=st.booleans(),
       cap=st.sampled_from([None, ("tanh", 2.0), ("soft_sign", 3.0)]),
       scale=st.sampled_from([None, -0.4]))
def test_pages_read_in_place_match_the_oracle(seed, group, hkv, d, dv, t, page, block_k,
                                              with_self, cap, scale):
    """Rows past the register tiles (G * T not a multiple of 8), head dims past its strips,
    histories ending inside a page and inside a key block, several key blocks, an empty
    history, the scale folded into the exp or not (a negative scale, a cap)."""
    rng = np.random.default_rng(seed)
    users, s = 3, 70
    lengths = np.array([s, int(rng.integers(0, s)), 0])
    k = rng.normal(size=(users, s, hkv, d)).astype(np.float32)
    v = rng.normal(size=(users, s, hkv, dv)).astype(np.float32)
    cache = serving.cache_from_history(jnp.asarray(k), jnp.asarray(v), jnp.asarray(lengths),
                                       page_size=page)
    who = np.array([1, 0, 2, 1])
    q = rng.normal(0, 1.5, (len(who), t, group * hkv, d)).astype(np.float32)
    self_kv = None
    if with_self:
        self_kv = (rng.normal(size=(len(who), t, hkv, d)).astype(np.float32),
                   rng.normal(size=(len(who), t, hkv, dv)).astype(np.float32))
    options = {} if scale is None else dict(scale=scale)
    if cap is not None:
        options.update(softcap=cap[1], softcap_method=cap[0])
    got = np.asarray(serving.attend(jnp.asarray(q), cache, jnp.asarray(who), self_kv=self_kv,
                                    impl=Cpu(BlockSizes(16, block_k)), **options))
    oracle_options = dict(scale=scale)
    if cap is not None:
        oracle_options.update(softcap_value=cap[1], softcap_method=cap[0])
    for i, want in enumerate(_oracle_rows(q, k, v, who, lengths, self_kv, **oracle_options)):
        if want is None:
            np.testing.assert_array_equal(got[i], 0)
            continue
        n_terms = int(lengths[who[i]]) + (1 if with_self else 0)
        assert_matches(f"row {i} out", got[i], want["out"][0], jnp.float32,
                       want["terms"]["out"][0], want["amplified"]["out"][0], n_terms)


P, HKV, HQ, D = 4, 2, 4, 32   # D and Dv a whole number of vectors: the path in place


def _request(seed, users, t):
    rng = np.random.default_rng(seed)
    return (rng.normal(0, 1, (users, t, HQ, D)).astype(np.float32),
            rng.normal(0, 1, (users, t, HKV, D)).astype(np.float32),
            rng.normal(0, 1, (users, t, HKV, D)).astype(np.float32))


def _attend(cache, q, ks, vs, **options):
    return np.asarray(serving.attend(jnp.asarray(q), cache, jnp.arange(q.shape[0]),
                                     self_kv=(ks, vs), impl=Cpu(BlockSizes(16, 16)), **options))


def _run(k, v, lengths, q, ks, vs, **options):
    cache = serving.cache_from_history(jnp.asarray(k), jnp.asarray(v), jnp.asarray(lengths),
                                       page_size=P)
    return _attend(cache, q, ks, vs, **options)


@pytest.mark.parametrize("where", ["k_pages", "v_pages"])
@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf])
def test_a_stale_value_in_an_unused_slot_is_never_read(where, value):
    """The slots past each user's length, in its last page and key block, hold non-finite
    values (as a reused page can): the rows must equal those of clean slots bit for bit.
    (Read in place, V's rows of unseen keys are a zero row: a 0 weight times NaN is NaN.)"""
    rng = np.random.default_rng(0)
    k = rng.normal(size=(2, 3 * P, HKV, D)).astype(np.float32)
    v = rng.normal(size=(2, 3 * P, HKV, D)).astype(np.float32)
    lengths = np.array([2 * P + 1, P - 1])
    cache = serving.cache_from_history(jnp.asarray(k), jnp.asarray(v), jnp.asarray(lengths),
                                       page_size=P)
    q, ks, vs = _request(1, 2, 3)
    clean = _attend(cache, q, ks, vs)
    pages, table = np.array(getattr(cache, where)), np.asarray(cache.page_table)
    pages[table[0, 2], :, 1:] = value       # user 0's last page past its one token
    pages[table[1, 0], :, P - 1:] = value   # user 1's one page past its P - 1 tokens
    got = _attend(cache._replace(**{where: jnp.asarray(pages)}), q, ks, vs)
    assert np.isfinite(clean).all()
    np.testing.assert_array_equal(got, clean)


@pytest.mark.parametrize("softcap", [None, 1.0])
@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf])
def test_a_seen_non_finite_key_poisons_its_kv_heads_rows_only(softcap, value):
    """A seen key with one non-finite entry: its logits are non-finite, and the cap would turn
    +inf into a finite softcap (and -inf gives a weight of 0), so the kernel flags the logit
    before the cap. The rows of that user's kv head are NaN; the other kv head's rows and the
    other user's are unchanged, bit for bit."""
    rng = np.random.default_rng(2)
    k = rng.normal(size=(2, 3 * P, HKV, D)).astype(np.float32)
    v = rng.normal(size=(2, 3 * P, HKV, D)).astype(np.float32)
    lengths = np.array([3 * P, 2 * P])
    q, ks, vs = _request(3, 2, 5)
    options = {} if softcap is None else dict(softcap=softcap)
    clean = _run(k, v, lengths, q, ks, vs, **options)
    bad = k.copy()
    bad[0, P + 2, 1, 7] = value
    got = _run(bad, v, lengths, q, ks, vs, **options)
    g = HQ // HKV
    assert np.isnan(got[0, :, g:]).all()
    np.testing.assert_array_equal(got[0, :, :g], clean[0, :, :g])
    np.testing.assert_array_equal(got[1], clean[1])


@pytest.mark.parametrize("value", [np.nan, np.inf])
def test_a_seen_non_finite_value_poisons_its_row_even_at_weight_0(value):
    """A seen key's value is non-finite, and the key's logit is 200 below the row's max (its
    weight underflows to exactly 0): the row saw a non-finite input, so it is NaN (not the
    clean row, and not inf); the other kv head's rows are unchanged."""
    rng = np.random.default_rng(4)
    k = rng.normal(size=(1, 2 * P, HKV, D)).astype(np.float32)
    v = rng.normal(size=(1, 2 * P, HKV, D)).astype(np.float32)
    q, ks, vs = _request(5, 1, 2)
    q[..., :] = 1.0
    k[0, 3] = -200.0 / D * np.sqrt(D)    # logit -200 (scale 1 / sqrt(D)) for every query
    for weight_zero in (True, False):
        bad_v = v.copy()
        key = 3 if weight_zero else 4
        bad_v[0, key, 0, 5] = value
        clean = _run(k, v, np.array([2 * P]), q, ks, vs)
        got = _run(k, bad_v, np.array([2 * P]), q, ks, vs)
        assert np.isnan(got[0, :, :HQ // HKV]).all(), weight_zero
        np.testing.assert_array_equal(got[0, :, HQ // HKV:], clean[0, :, HQ // HKV:])


def test_a_logit_that_overflows_from_finite_inputs_is_capped_not_poisoned():
    """Regression: q and k finite but their dot past float32 (1e19 * 2e19 * 32): the logit is
    inf, which the tanh cap takes to its limit, as the packed path and the float64 oracle
    do. The key-major path once took any non-finite logit for a non-finite key and returned
    a NaN row; it now checks the key itself."""
    rng = np.random.default_rng(6)
    k = rng.normal(size=(1, 2 * P, HKV, D)).astype(np.float32)
    v = rng.normal(size=(1, 2 * P, HKV, D)).astype(np.float32)
    k[0, 5] = 2e19
    q, ks, vs = _request(7, 1, 2)
    q[0, 0] = 1e19
    got = _run(k, v, np.array([2 * P]), q, ks, vs, softcap=1.0)
    kk, vv = np.concatenate([k[0], ks[0]]), np.concatenate([v[0], vs[0]])
    mask = np.zeros((1, 2, 2 * P + 2), bool)
    mask[0, :, :2 * P] = True
    mask[0, :, 2 * P:] = np.eye(2, dtype=bool)
    want = oracle.attention(q, kk[None], vv[None], mask, softcap_value=1.0)["out"]
    assert np.isfinite(got).all()
    assert_close_f32(got, want, "overflowed logit", tol=FEW_KEYS_TOL)


def test_a_page_budget_reads_its_selected_pages_in_place():
    """Quest's page selection runs the same kernel over each row's selected pages: against the
    same selection gathered into contiguous keys (impl='xla')."""
    rng = np.random.default_rng(8)
    k = rng.normal(size=(2, 40 * P, HKV, D)).astype(np.float32)
    v = rng.normal(size=(2, 40 * P, HKV, D)).astype(np.float32)
    cache = serving.cache_from_history(jnp.asarray(k), jnp.asarray(v),
                                       jnp.asarray([40 * P, 23 * P + 3]), page_size=P)
    q, ks, vs = _request(9, 2, 5)
    got, want = (np.asarray(serving.attend(jnp.asarray(q), cache, jnp.arange(2), self_kv=(ks, vs),
                                           budget=12 * P, impl=impl))
                 for impl in (Cpu(BlockSizes(16, 16)), "xla"))
    assert_close_f32(got, want, "budgeted rows", tol=FEW_KEYS_TOL)


@pytest.mark.parametrize("with_self", [True, False])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("sizes", [BlockSizes(4, 16), BlockSizes(8, 5)])
def test_the_kernels_candidates_mask_is_the_mask_it_is_given(with_self, dtype, sizes):
    """The exact path's kernel builds its mask and block plan from the lengths
    (paged_candidates_forward): bit for bit the general entry (paged_forward) given that mask
    as segment ids and a shard mask, at lengths 0, inside a key block, on interior key block
    edges (16; 10 and 20), at S, and past [0, S] both ways (clamped), with page table entries
    outside the pages. Blocks of (4, 16): 2 query blocks over 3 key blocks, the last ragged,
    packed row-major; (8, 5): 1 query block over 8 key blocks, key-major in float32."""
    from rankattn import semantics
    from rankattn.backends.cpu import paged_candidates_forward, paged_forward
    rng = np.random.default_rng(3)
    rows, t, m = 8, 5, 10
    s = m * P
    k_pages, v_pages = (jnp.asarray(rng.normal(size=(13, HKV, P, D)), dtype) for _ in range(2))
    table = jnp.asarray(rng.integers(-2, 15, (rows, m)), jnp.int32)
    lengths = np.array([0, 3, 16, 10, 20, s, s + 9, -3], np.int32)
    q, ks, vs = (jnp.asarray(x, dtype) for x in _request(4, rows, t))
    self_kv = (ks, vs) if with_self else None
    options = dict(scale=0.3, softcap=2.0, softcap_method="tanh", block_sizes=sizes)
    got = paged_candidates_forward(q, k_pages, v_pages, table, self_kv, jnp.asarray(lengths),
                                   **options)
    seen = (np.arange(s)[None] < np.clip(lengths, 0, s)[:, None]).astype(np.int32)
    mask = semantics.ShardMask(jnp.asarray(seen),
                               jnp.broadcast_to(s + jnp.arange(t, dtype=jnp.int32), (rows, t)),
                               jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (rows, s)))
    want = paged_forward(q, k_pages, v_pages, table, self_kv, -jnp.ones((rows, t), jnp.int32),
                         shard_mask=mask, **options)
    for name, x, y in zip(("out", "lse"), got, want):
        np.testing.assert_array_equal(np.asarray(x.astype(jnp.float32)),
                                      np.asarray(y.astype(jnp.float32)), err_msg=name)
    assert np.isfinite(np.asarray(got[0].astype(jnp.float32))[1:7]).all()


@given(q_len=st.sampled_from([1, 5, 64]), kv_len=st.sampled_from([7, 48]),
       block_q=st.sampled_from([4, 64]), block_k=st.sampled_from([5, 16]), data=st.data())
@settings(max_examples=20, deadline=None)
def test_the_kernels_candidates_plan_is_make_block_plans(q_len, kv_len, block_q, block_k,
                                                         data):
    """The mask and block plan the kernel builds from the lengths (CandidatesMask, read
    through the test-only rankattn_test_candidates_plan) are blocks.make_block_plan's for the
    mask _candidates gives the general entry: the same (query block, key block) pairs, full
    and partial, with lengths on block edges, inside blocks, 0, past S and negative. (Equal
    outputs could not show a block visited in vain, or a full block taken as partial.)"""
    import ctypes

    import jax
    from rankattn.backends import cpu
    from rankattn.blocks import make_block_plan
    from helpers import pad_blocks, visited_pairs
    lengths = np.array(data.draw(st.lists(st.integers(-2, kv_len + 3), min_size=3,
                                          max_size=3)), np.int32)
    sizes = BlockSizes(min(block_q, q_len), min(block_k, kv_len))
    n_q, n_k = -(-q_len // sizes.block_q), -(-kv_len // sizes.block_k)
    seg_k = np.zeros((3, kv_len), np.int32)
    kv_index = np.zeros((3, n_q, n_k), np.int32)
    full_count, count = np.zeros((3, n_q), np.int32), np.zeros((3, n_q), np.int32)
    cpu.library().handle.rankattn_test_candidates_plan(
        *(ctypes.c_int64(x) for x in (3, q_len, kv_len, sizes.block_q, sizes.block_k)),
        *(x.ctypes.data_as(ctypes.c_void_p) for x in (lengths, seg_k, kv_index, full_count,
                                                      count)))
    seen = (np.arange(kv_len)[None] < lengths[:, None]).astype(np.int32)
    np.testing.assert_array_equal(seg_k, seen)
    seg_q = pad_blocks(np.full((3, q_len), -1, np.int32), sizes.block_q)
    pos_q = pad_blocks(np.broadcast_to(kv_len + np.arange(q_len, dtype=np.int32), (3, q_len)),
                       sizes.block_q)
    pos_q[:, q_len:] = pos_q[:, q_len - 1:q_len]  # blocks.pad_positions' edge padding
    pos_k = np.pad(np.broadcast_to(np.arange(kv_len, dtype=np.int32), seen.shape),
                   [(0, 0), (0, -kv_len % sizes.block_k)], mode="edge")
    want = jax.jit(make_block_plan, static_argnums=(2, 3, 4))(
        seg_q, pad_blocks(seen, sizes.block_k), sizes, False, q_len, pos_q, pos_k)
    assert (visited_pairs(kv_index, full_count, count)
            == visited_pairs(*(np.asarray(x) for x in (want.kv_index, want.full_count,
                                                        want.count))))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_an_exact_request_compiles_to_the_kernel_call_alone(dtype):
    """An exact request's program is the kernel call and the gathers of its users' table rows
    and lengths: under the 1000 flops (XLA's cost analysis; a custom call counts -1) below which
    XLA's CPU client runs a program on the calling thread, without asynchronous dispatch's
    thread hop (60-110 us of one user's 64-candidate request, benchmarks/CPU_KERNEL.md).
    Sixteen users, traced: whatever grows with the users, the candidates or the history must
    stay out of XLA."""
    import jax
    users, t, s = 16, 64, 256
    k = jnp.zeros((users, s, HKV, D), dtype)
    cache = serving.cache_from_history(k, k, jnp.full((users,), s - 3), page_size=P)
    q = jnp.zeros((users, t, HQ, D), dtype)
    self_k = jnp.zeros((users, t, HKV, D), dtype)
    attend = jax.jit(lambda q, cache, users, ks, vs: serving.attend(
        q, cache, users, self_kv=(ks, vs), impl=Cpu()))
    compiled = attend.lower(q, cache, jnp.arange(users), self_k, self_k).compile()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    assert "rankattn_cpu_paged_candidates_forward" in compiled.as_text()
    assert cost["flops"] < 1000, (
        f"{cost['flops']} flops of XLA ops around the kernel: the request no longer runs on "
        f"the calling thread")
