"""``impl=None`` means ``impl="auto"`` at every entry point that takes ``impl``.

One rule, applied in one place (rankattn.api.resolve_impls): each entry point gives the
same result for None as for "auto", bit for bit, and an unknown name still raises RA114.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import rankattn
from rankattn import serving
from rankattn.api import resolve_impls
from rankattn.phoenix import ranker_attention_fa3 as fa3
from rankattn.phoenix import ranker_attention_v2 as v2
from rankattn.phoenix import ranker_attention_varlen as varlen

B, S, HQ, HKV, D = 2, 12, 4, 2, 8
SEG = np.array([[1, 1, 1, 1, -1, -1, 2, 2, 2, -2, -2, 0]] * B, np.int32)
rng = np.random.default_rng(0)
Q = jnp.asarray(rng.standard_normal((B, S, HQ, D)), jnp.float32)
K, V = (jnp.asarray(rng.standard_normal((B, S, HKV, D)), jnp.float32) for _ in range(2))
CACHE = serving.cache_from_history(K, V, jnp.array([S, 7]), page_size=4)
USERS = jnp.arange(B)
CU = jnp.array([0, 5, 12])


def flax_attention(impl):
    rankattn_flax = pytest.importorskip("rankattn.flax")  # flax is optional
    return rankattn_flax.attention_fn(impl=impl)(Q, K, V)


ENTRY_POINTS = {
    "attention": lambda impl: rankattn.attention(Q, K, V, segment_ids=SEG, impl=impl),
    "attention with a plan": lambda impl: rankattn.attention(
        Q, K, V, plan=rankattn.plan(segment_ids=SEG, impl=impl), impl=impl),
    "plan": lambda impl: rankattn.plan(segment_ids=SEG, impl=impl),  # a pytree: its lists
    "serving.attend": lambda impl: serving.attend(Q[:, :3], CACHE, USERS, impl=impl),
    "serving.attend with a budget": lambda impl: serving.attend(Q[:, :3], CACHE, USERS,
                                                                budget=8, impl=impl),
    "serving.select_pages": lambda impl: serving.select_pages(Q[:, :3], CACHE, USERS,
                                                              budget=8, impl=impl),
    "serving.page_bounds": lambda impl: serving.page_bounds(Q[:, :3], CACHE, USERS, impl=impl),
    "phoenix fa3": lambda impl: fa3.attention(Q, K, V, bound=(0, 8, 8, 12), impl=impl),
    "phoenix v2": lambda impl: v2.mha(Q, K, V, jnp.ones((B, S)), np.sign(SEG), impl=impl),
    "phoenix varlen": lambda impl: varlen.mha(Q[0], K[0], V[0], jnp.ones(S), jnp.asarray(SEG[0]),
                                              CU, CU, S, S, causal=False, impl=impl),
    "flax attention_fn": flax_attention,
    "resolve_impls": lambda impl: [b.name for b in resolve_impls(impl)],
}


@pytest.mark.parametrize("entry", ENTRY_POINTS)
def test_impl_none_is_auto(entry):
    f = ENTRY_POINTS[entry]
    got, want = f(None), f("auto")
    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want),
                    strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=entry)


def test_none_inside_a_list_is_auto_and_unknown_names_still_raise():
    assert resolve_impls([None]) == resolve_impls("auto")
    with pytest.raises(ValueError, match="RA114"):
        rankattn.attention(Q, K, V, segment_ids=SEG, impl="none")
