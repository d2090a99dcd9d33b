"""rankattn.serving keeps users apart: other users' pages, stale slots and non-finite values.

Expected values: the clean run (bit-identical where the spec promises it) or the core
rankattn.attention on the same tokens; never the serving path compared with itself.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import rankattn
from conftest import needs_cpu_kernel
from helpers import assert_explained
from tolerances import FEW_KEYS_TOL, assert_close_f32
from rankattn import serving

P, HKV, HQ, D = 4, 2, 4, 8


def _queries(seed, b, t):
    rng = np.random.default_rng(seed)
    q = rng.normal(0, 1, (b, t, HQ, D)).astype(np.float32)
    k_self = rng.normal(0, 1, (b, t, HKV, D)).astype(np.float32)
    v_self = rng.normal(0, 1, (b, t, HKV, D)).astype(np.float32)
    return q, k_self, v_self


def _history(seed, users, length):
    rng = np.random.default_rng(seed)
    return (rng.normal(0, 1, (users, length, HKV, D)).astype(np.float32),
            rng.normal(0, 1, (users, length, HKV, D)).astype(np.float32))


def _core_candidates(k_hist, v_hist, q, k_self, v_self):
    """The candidate rows of one rankattn.attention call: history [L] + candidates [T]."""
    length, t = k_hist.shape[0], q.shape[0]
    cat = lambda h, c: jnp.concatenate([jnp.asarray(h)[None], jnp.asarray(c)[None]], 1)
    seg = jnp.asarray([[1] * length + [-1] * t], jnp.int32)
    q_full = cat(np.zeros((length, HQ, D), np.float32), q)
    out = rankattn.attention(q_full, cat(k_hist, k_self), cat(v_hist, v_self), segment_ids=seg,
                             impl="reference")
    return np.asarray(out)[0, length:]


@pytest.mark.parametrize("budget, impl", [(None, "auto"), (None, "xla"), (3 * P, "auto"),
                                          (3 * P, "xla"),
                                          pytest.param(None, "cpu", marks=needs_cpu_kernel)])
@pytest.mark.parametrize("value", [np.nan, np.inf])
def test_a_bad_history_value_stays_with_its_user(budget, impl, value):
    """User 0's page 0 holds a bad key; user 1's history is shorter, so its missing page-table
    entries are read as physical page 0 too. User 1 must not notice. (budget 3 * P: 3 of user
    0's 5 pages, Quest selects; "auto" and "cpu" run the cpu kernel, which reads the pages in
    place, "xla" gathers them first.)"""
    k, v = _history(0, 2, 5 * P)
    lengths = np.array([5 * P, P + 1], np.int32)            # user 1: one full + one partial page
    q, k_self, v_self = _queries(1, 2, 3)
    users = np.array([0, 1], np.int32)

    def run(k, v):
        cache = serving.cache_from_history(jnp.asarray(k), jnp.asarray(v), lengths, page_size=P)
        assert int(np.asarray(cache.page_table)[0, 0]) == 0, "user 0 should own page 0"
        return np.asarray(serving.attend(q, cache, users, self_kv=(k_self, v_self), budget=budget,
                                         impl=impl))

    clean = run(k, v)
    k_bad = k.copy()
    k_bad[0, 1, 0, 2] = value      # user 0, token 1 (the sink page, always kept), kv head 0
    got = run(k_bad, v)
    np.testing.assert_array_equal(got[1], clean[1])
    assert np.isnan(got[0, :, :HQ // HKV]).all()            # kv head 0's query heads see it
    np.testing.assert_array_equal(got[0, :, HQ // HKV:], clean[0, :, HQ // HKV:])


@pytest.mark.parametrize("impl", ["auto", "xla", pytest.param("cpu", marks=needs_cpu_kernel)])
def test_a_released_pages_stale_values_are_never_read(impl):
    """A page released by one user and reused by another keeps the old values in the slots
    the new owner has not filled; those (inf and NaN here) must not reach its scores."""
    k, v = _history(2, 1, 2 * P)
    k[0, P + 1:] = np.inf
    v[0, P + 1:] = np.nan
    cache = serving.empty_cache(num_users=2, num_pages=2, page_size=P, kv_heads=HKV,
                                head_dim=D)
    cache = serving.append(cache, np.array([0]), k, v, np.array([2 * P]))
    cache = serving.release(cache, np.array([0]))
    k1, v1 = _history(3, 1, P + 1)
    cache = serving.append(cache, np.array([1]), k1, v1, np.array([P + 1]))  # reuses both pages
    q, k_self, v_self = _queries(4, 1, 2)
    got = np.asarray(serving.attend(q, cache, np.array([1]), self_kv=(k_self, v_self),
                                    impl=impl))
    want = _core_candidates(k1[0], v1[0], q[0], k_self[0], v_self[0])
    assert np.isfinite(got).all()
    assert_close_f32(got[0], want, "reused pages", tol=FEW_KEYS_TOL)


def test_a_bad_self_key_or_query_poisons_only_its_row():
    k, v = _history(5, 2, 2 * P)
    cache = serving.cache_from_history(jnp.asarray(k), jnp.asarray(v), np.array([2 * P, P]),
                                       page_size=P)
    q, k_self, v_self = _queries(6, 2, 3)
    users = np.array([0, 1], np.int32)
    clean = np.asarray(serving.attend(q, cache, users, self_kv=(k_self, v_self)))
    q_bad, v_bad = q.copy(), v_self.copy()
    q_bad[0, 1, 3, 0] = np.nan                              # row (0, 1), query head 3
    v_bad[1, 2, 1, 4] = np.inf                              # row (1, 2)'s own value, kv head 1
    got = np.asarray(serving.attend(q_bad, cache, users, self_kv=(k_self, v_bad)))
    hit = np.zeros(got.shape[:3], bool)
    hit[0, 1, 3] = True
    hit[1, 2, 2:] = True                                    # query heads 2, 3 use kv head 1
    assert np.isnan(got[hit]).all()
    np.testing.assert_array_equal(got[~hit], clean[~hit])


def test_append_reports_each_user_under_jit():
    """Per row: appended, skipped for room, or skipped for a value float16 cannot hold."""
    cache = serving.empty_cache(num_users=3, num_pages=3, page_size=2, kv_heads=1, head_dim=1,
                                max_pages=2, dtype=jnp.float16)
    k = np.ones((3, 5, 1, 1), np.float32)
    v = np.ones((3, 5, 1, 1), np.float32)
    v[2, 1] = 70000.0                                       # past float16's 65504
    step = jax.jit(lambda c, *a: serving.append(c, *a, return_status=True))
    # user 0: 5 tokens > max_pages * P = 4; user 1: 3 tokens, fits; user 2: out of range.
    cache, status = step(cache, jnp.array([0, 1, 2]), k, v, jnp.array([5, 3, 2]))
    assert np.asarray(status.appended).tolist() == [False, True, False]
    assert np.asarray(status.no_room).tolist() == [True, False, False]
    assert np.asarray(status.out_of_range).tolist() == [False, False, True]
    assert bool(cache.overflow) and np.asarray(cache.lengths).tolist() == [0, 3, 0]
    assert np.isfinite(np.asarray(cache.v_pages, np.float32)).all()
    # The out-of-range value past counts is not appended, so it is no problem.
    cache, status = step(cache, jnp.array([2]), k[2:], v[2:], jnp.array([1]))
    assert np.asarray(status.appended).tolist() == [True]


def test_append_rejects_a_value_the_cache_dtype_cannot_hold():
    cache = serving.empty_cache(num_users=1, num_pages=2, page_size=2, kv_heads=1, head_dim=1,
                                dtype=jnp.float16)
    k = np.full((1, 2, 1, 1), 1e5, np.float32)
    with pytest.raises(rankattn.RankattnValueError, match="RA214") as err:
        serving.append(cache, np.array([0]), k, np.ones_like(k), np.array([2]))
    assert "100000" in str(err.value) and "float16" in str(err.value)
    assert_explained(err.value)


@pytest.mark.parametrize("gqa, group_rule", [("per_head", "standardised"), ("mean", "standardised"),
                                             *[("group", r) for r in serving.GROUP_RULES]])
def test_a_page_with_a_bad_key_is_selected_first(gqa, group_rule):
    """Quest ranks a page whose key stats are not finite above every scored page: its bound is
    unknown, and skipping it would hide the bad value from exact-path semantics. The bad key
    sits on page 4 of 10, neither sink nor recent, under a budget of 3 pages (sink + recent +
    one scored); every other page outranks page 4 on its finite keys, so without the rule
    page 4 would never be read."""
    k, v = _history(5, 1, 10 * P)
    q, _, _ = _queries(6, 1, 2)
    k[0, 4 * P:5 * P] *= 0.01                    # page 4 alone would score last
    k[0, 4 * P + 1, 0, 3] = np.nan               # kv head 0 only
    cache = serving.cache_from_history(k, v, np.array([10 * P]), page_size=P)
    kw = dict(budget=3 * P, gqa=gqa, group_rule=group_rule, sink_pages=1, recent_pages=1)
    pages = np.asarray(serving.select_pages(q, cache, np.array([0]), **kw))  # [1, T, Hq, 3]
    g = HQ // HKV
    assert (pages[0, :, :g] == 4).any(-1).all(), pages[0, :, :g]      # kv head 0 reads page 4
    out = np.asarray(serving.attend(q, cache, np.array([0]), **kw))
    assert np.isnan(out[0, :, :g]).all() and np.isfinite(out[0, :, g:]).all()
    # Kv head 1 never saw the bad value: bit-identical to the run without it.
    k_clean = k.copy()
    k_clean[0, 4 * P + 1, 0, 3] = 0.0
    clean = serving.cache_from_history(k_clean, v, np.array([10 * P]), page_size=P)
    np.testing.assert_array_equal(out[0, :, g:],
                                  np.asarray(serving.attend(q, clean, np.array([0]), **kw))[0, :, g:])
    clean_pages = np.asarray(serving.select_pages(q, clean, np.array([0]), **kw))
    assert not (clean_pages[0, :, :g] == 4).any(), "page 4 is chosen on its finite keys anyway"
