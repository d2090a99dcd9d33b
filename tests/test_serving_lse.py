"""serving.attend(..., return_lse=True) against a float64 numpy softmax over each row's visible keys.

A row's lse is the natural-log log-sum-exp of its scaled (and capped) logits over every key it
attended: its user's history (or the pages Quest selected) and its self key. The reference
below recomputes both out and lse in float64 from the dense histories, key by key.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from tolerances import FEW_KEYS_TOL, TOL64, assert_close_f32
from rankattn import serving

U, S, HKV, HQ, D, DV, P, B, T = 3, 21, 2, 4, 8, 6, 4, 3, 2


def reference(q, k_hist, v_hist, lengths, users, self_kv=None, pages=None, *, scale=None,
              softcap=None):
    """(out [B, T, Hq, Dv], lse [B, T, Hq]) in float64.

    Row (b, t) head h sees user users[b]'s first lengths[u] history keys of kv head h // G
    (only the tokens of the logical pages pages[b, t, h] when given, -1 = none) and, with
    self_kv, its own key (b, t); out 0 and lse -inf when it sees nothing.
    """
    q = np.asarray(q, np.float64)
    b, t, hq, d = q.shape
    g = hq // k_hist.shape[2]
    scale = 1 / math.sqrt(d) if scale is None else scale
    out = np.zeros((b, t, hq, v_hist.shape[-1]))
    lse = np.full((b, t, hq), -np.inf)
    for i, j, h in np.ndindex(b, t, hq):
        u, n = users[i], lengths[users[i]]
        tokens = np.arange(n) if pages is None else np.concatenate(
            [np.arange(p * P, min((p + 1) * P, n)) for p in pages[i, j, h] if p >= 0] + [[]])
        tokens = tokens.astype(int)
        keys = np.asarray(k_hist, np.float64)[u, tokens, h // g]
        values = np.asarray(v_hist, np.float64)[u, tokens, h // g]
        if self_kv is not None:
            keys = np.concatenate([keys, np.asarray(self_kv[0], np.float64)[i, j, h // g][None]])
            values = np.concatenate([values,
                                     np.asarray(self_kv[1], np.float64)[i, j, h // g][None]])
        if not len(keys):
            continue
        s = scale * keys @ q[i, j, h]
        if softcap is not None:
            s = softcap * np.tanh(s / softcap)
        m = s.max()
        w = np.exp(s - m)
        lse[i, j, h] = m + np.log(w.sum())
        out[i, j, h] = w @ values / w.sum()
    return out, lse


def data(seed, lengths, dtype=np.float32):
    rng = np.random.default_rng(seed)
    k = rng.normal(size=(U, S, HKV, D)).astype(dtype)
    v = rng.normal(size=(U, S, HKV, DV)).astype(dtype)
    q = rng.normal(0, 1.5, (B, T, HQ, D)).astype(dtype)
    self_kv = (rng.normal(size=(B, T, HKV, D)).astype(dtype),
               rng.normal(size=(B, T, HKV, DV)).astype(dtype))
    cache = serving.cache_from_history(jnp.asarray(k), jnp.asarray(v), np.asarray(lengths),
                                       page_size=P)
    return cache, k, v, q, self_kv


@given(seed=st.integers(0, 2**31 - 1),
       lengths=st.lists(st.integers(0, S), min_size=U, max_size=U),
       users=st.lists(st.integers(0, U - 1), min_size=B, max_size=B),
       with_self=st.booleans(), softcap=st.sampled_from([None, 2.0]))
def test_exact_lse_is_the_float64_logsumexp_of_the_visible_logits(seed, lengths, users,
                                                                   with_self, softcap):
    cache, k, v, q, self_kv = data(seed, lengths)
    self_kv = self_kv if with_self else None
    users = np.array(users)
    out, lse = serving.attend(jnp.asarray(q), cache, jnp.asarray(users), self_kv=self_kv,
                              softcap=softcap, return_lse=True)
    assert lse.shape == (B, T, HQ) and lse.dtype == jnp.float32
    want_out, want_lse = reference(q, k, v, np.array(lengths), users, self_kv, softcap=softcap)
    assert_close_f32(lse, want_lse, "lse", tol=FEW_KEYS_TOL)   # -inf where a row saw nothing
    assert_close_f32(out, want_out, "out", tol=FEW_KEYS_TOL)


@pytest.mark.parametrize("gqa", serving.GQA_MODES)
@pytest.mark.parametrize("with_self", [False, True])
def test_budget_lse_covers_the_selected_pages_and_the_self_key(gqa, with_self):
    """3 pages of users with up to 6: the lse is over the pages select_pages reports."""
    lengths = np.array([S, 9, 0])
    cache, k, v, q, self_kv = data(5, lengths)
    self_kv = self_kv if with_self else None
    users = np.array([0, 1, 2])
    pages = np.asarray(serving.select_pages(jnp.asarray(q), cache, jnp.asarray(users),
                                            budget=3 * P, gqa=gqa))
    out, lse = serving.attend(jnp.asarray(q), cache, jnp.asarray(users), self_kv=self_kv,
                              budget=3 * P, gqa=gqa, return_lse=True)
    want_out, want_lse = reference(q, k, v, lengths, users, self_kv, pages)
    assert_close_f32(lse, want_lse, "lse", tol=FEW_KEYS_TOL)
    assert_close_f32(out, want_out, "out", tol=FEW_KEYS_TOL)
    # Fewer keys than the whole history: the budget's lse is below the exact one for user 0.
    _, exact = serving.attend(jnp.asarray(q), cache, jnp.asarray(users), self_kv=self_kv,
                              return_lse=True)
    assert (np.asarray(lse)[0] < np.asarray(exact)[0]).all()


def test_lse_follows_the_query_layout():
    """[B, T, Hq, D] -> [B, T, Hq]; [B, Hq, D] and [B, Hq*D] -> [B, Hq]; the same values."""
    cache, _, _, q, (ks, vs) = data(7, [S, 3, 0])
    users = jnp.array([0, 1, 2])
    q3, ks3, vs3 = q[:, 0], ks[:, 0], vs[:, 0]
    _, four = serving.attend(jnp.asarray(q3[:, None]), cache, users,
                             self_kv=(ks3[:, None], vs3[:, None]), return_lse=True)
    _, three = serving.attend(jnp.asarray(q3), cache, users, self_kv=(ks3, vs3), return_lse=True)
    _, two = serving.attend(jnp.asarray(q3.reshape(B, -1)), cache, users,
                            self_kv=(ks3.reshape(B, -1), vs3.reshape(B, -1)), return_lse=True)
    assert four.shape == (B, 1, HQ) and three.shape == two.shape == (B, HQ)
    np.testing.assert_array_equal(four[:, 0], three)
    np.testing.assert_array_equal(three, two)


def test_return_lse_under_jit_and_a_row_that_sees_nothing():
    cache, _, _, q, _ = data(8, [S, 0, 5])
    attend = jax.jit(serving.attend, static_argnames=("return_lse",))
    out, lse = attend(jnp.asarray(q), cache, jnp.array([1, 1, 2]), return_lse=True)
    assert np.isneginf(np.asarray(lse)[:2]).all() and (np.asarray(out)[:2] == 0).all()
    assert np.isfinite(np.asarray(lse)[2]).all()
    np.testing.assert_array_equal(attend(jnp.asarray(q), cache, jnp.array([1, 1, 2])), out)


def test_lse_of_a_poisoned_row_is_nan_and_stays_in_it():
    lengths = np.array([S, S, 4])
    cache, k, v, q, _ = data(9, lengths)
    k[0, 3, 1, 2] = np.nan                                   # user 0, kv head 1
    cache = serving.cache_from_history(jnp.asarray(k), jnp.asarray(v), lengths, page_size=P)
    _, lse = serving.attend(jnp.asarray(q), cache, jnp.array([0, 1, 2]), return_lse=True)
    lse = np.asarray(lse)
    assert np.isnan(lse[0, :, 2:]).all() and np.isfinite(lse[0, :, :2]).all()
    assert np.isfinite(lse[1:]).all()


def test_regression_float64_lse_is_not_rounded_to_float32():
    """The partial (out, lse) once cast lse to float32 whatever the inputs; float64 caches and
    queries get a float64 lse, equal to the reference at float64 precision."""
    with jax.enable_x64(True):
        lengths = np.array([S, 6, 0])
        cache, k, v, q, self_kv = data(10, lengths, np.float64)
        assert cache.k_pages.dtype == jnp.float64
        users = np.array([0, 1, 2])
        for budget in (None, 2 * P):
            out, lse = serving.attend(jnp.asarray(q), cache, jnp.asarray(users), self_kv=self_kv,
                                      budget=budget, return_lse=True)
            assert lse.dtype == out.dtype == jnp.float64
            pages = None if budget is None else np.asarray(serving.select_pages(
                jnp.asarray(q), cache, jnp.asarray(users), budget=budget))
            want_out, want_lse = reference(q, k, v, lengths, users, self_kv, pages)
            assert_close_f32(lse, want_lse, f"lse, budget {budget}", tol=TOL64)
            assert_close_f32(out, want_out, f"out, budget {budget}", tol=TOL64)
