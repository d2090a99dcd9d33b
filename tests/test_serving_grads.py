"""jax.grad through rankattn.serving.attend: with respect to the queries, the self keys and
values, and the cache's pages, in float32, bfloat16 and float16, exact and under a Quest
budget, on every backend serving attends with (cpu, xla, reference).

The expectation is the float64 oracle (tests/oracle.py), run per query row over exactly the
keys that row attends: its user's history in the exact path, or the pages ``select_pages``
reports under a budget (the page choice itself carries no gradient, so near-ties in the
bounds cannot make the two disagree), plus the row's self key. Each row's dk / dv are summed
into the pages they came from, with their error bounds (tests/tolerances.py).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import oracle
from conftest import needs_cpu_kernel
from rankattn import serving
from tolerances import assert_matches

U, S, HKV, D, DV, P = 3, 45, 2, 8, 6, 8
B, T, HQ = 3, 3, 4
USERS = np.array([2, 0, 2])  # a repeat; user 1 (empty) is not read
LENGTHS = np.array([45, 0, 19])
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
IMPLS = ["xla", "reference", pytest.param("cpu", marks=needs_cpu_kernel)]


def rounded(x, dtype):
    return np.asarray(jnp.asarray(x, dtype).astype(jnp.float32), np.float64)


def problem(dtype, seed=0):
    rng = np.random.default_rng(seed)
    normal = lambda *shape, std=1.0: rounded(rng.normal(0, std, shape), dtype)
    k, v = normal(U, S, HKV, D), normal(U, S, HKV, DV)
    q, ks, vs = normal(B, T, HQ, D, std=1.5), normal(B, T, HKV, D), normal(B, T, HKV, DV)
    w = normal(B, T, HQ, DV)
    cache = serving.cache_from_history(jnp.asarray(k, dtype), jnp.asarray(v, dtype),
                                       jnp.asarray(LENGTHS), page_size=P)
    return cache, q, ks, vs, w


def grads(cache, q, ks, vs, w, dtype, impl, **options):
    """(out, d q, d k_self, d v_self, d k_pages, d v_pages) of sum(out * w), under jit."""
    def loss(q, ks, vs, kp, vp):
        view = cache._replace(k_pages=kp, v_pages=vp)
        out = serving.attend(q, view, jnp.asarray(USERS), self_kv=(ks, vs), impl=impl,
                             **options)
        return (out.astype(jnp.float32) * w).sum(), out

    cast = lambda x: jnp.asarray(x, dtype)
    (_, out), g = jax.jit(jax.value_and_grad(loss, (0, 1, 2, 3, 4), has_aux=True))(
        cast(q), cast(ks), cast(vs), cache.k_pages, cache.v_pages)
    for x in (out, *g):
        assert x.dtype == dtype
    return [np.asarray(x.astype(jnp.float32), np.float64) for x in (out, *g)]


def expected(cache, q, ks, vs, w, pages, softcap):
    """Per query row (b, t, h): oracle attention over its pages' tokens and its self key.
    pages [B, T, Hq, n]: logical pages per row (-1: none). Returns the results in the layout
    of ``grads`` and their two error magnitudes, each summed like the results."""
    table, kp, vp = (np.asarray(x) for x in (cache.page_table, cache.k_pages, cache.v_pages))
    kp, vp = kp.astype(np.float64), vp.astype(np.float64)
    fields = ("out", "dq", "dk_self", "dv_self", "dk_pages", "dv_pages")
    shapes = ((B, T, HQ, DV), q.shape, ks.shape, vs.shape, kp.shape, vp.shape)
    want = {kind: {f: np.zeros(s) for f, s in zip(fields, shapes)}
            for kind in ("value", "terms", "amplified")}
    n_terms = 1
    for b in range(B):
        u = USERS[b]
        for t in range(T):
            for h in range(HQ):
                kv = h // (HQ // HKV)
                slots = [(table[u, j], i) for j in sorted(pages[b, t, h][pages[b, t, h] >= 0])
                         for i in range(P) if j * P + i < LENGTHS[u]]
                keys = np.array([kp[n, kv, i] for n, i in slots] + [ks[b, t, kv]])
                values = np.array([vp[n, kv, i] for n, i in slots] + [vs[b, t, kv]])
                n_terms = max(n_terms, len(keys))
                res = oracle.attention(q[b, t, h][None, None, None], keys[None, :, None],
                                       values[None, :, None], np.ones((1, 1, len(keys)), bool),
                                       w=w[b, t, h][None, None, None], softcap_value=softcap,
                                       scale=1 / np.sqrt(D), magnitudes=True)
                for kind, got in (("value", res), ("terms", res["terms"]),
                                  ("amplified", res["amplified"])):
                    into = want[kind]
                    into["out"][b, t, h] += got["out"][0, 0, 0]
                    into["dq"][b, t, h] += got["dq"][0, 0, 0]
                    into["dk_self"][b, t, kv] += got["dk"][0, -1, 0]
                    into["dv_self"][b, t, kv] += got["dv"][0, -1, 0]
                    for (n, i), dk, dv in zip(slots, got["dk"][0, :-1, 0], got["dv"][0, :-1, 0]):
                        into["dk_pages"][n, kv, i] += dk
                        into["dv_pages"][n, kv, i] += dv
    return fields, want, n_terms


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("budget", [None, 24])
def test_gradients_through_attend_match_the_oracle(dtype, budget, impl):
    """Regressions: on the cpu kernel, bf16 / f16 caches raised a dtype mismatch in the
    backward (the paged forward returned q's dtype, its VJP float32), and a Quest budget
    raised "the FFI call rankattn_cpu_page_bounds cannot be differentiated" in any dtype."""
    softcap = 4.0 if budget else None
    cache, q, ks, vs, w = problem(DTYPES[dtype], seed=len(dtype) + (budget or 0))
    options = dict(softcap=softcap)
    if budget:
        options.update(budget=budget, sink_pages=1, recent_pages=1)
        pages = np.asarray(serving.select_pages(jnp.asarray(q, DTYPES[dtype]), cache,
                                                jnp.asarray(USERS), budget=budget,
                                                sink_pages=1, recent_pages=1))
        assert (pages[0] >= 0).sum(-1).max() == budget // P < -(-S // P), "vacuous budget"
    else:
        pages = np.broadcast_to(np.arange(-(-S // P)), (B, T, HQ, -(-S // P)))
    got = grads(cache, q, ks, vs, w, DTYPES[dtype], impl, **options)
    fields, want, n_terms = expected(cache, q, ks, vs, w, pages, softcap)
    for name, actual in zip(fields, got):
        assert np.abs(want["value"][name]).max() > 1e-3, f"{name}: vacuous"
        assert_matches(name, actual, want["value"][name], DTYPES[dtype], want["terms"][name],
                       want["amplified"][name], n_terms)
