"""The paged cache as a state machine: random appends, releases and attends against a plain model.

Hypothesis drives sequences of append / release / attend on one small cache (page sizes 1,
3 and 4, so pages fill partly and are recycled) and checks after every step that each
user's tokens, page min/max and the free list match a plain-Python model of each user's
history, and that attend (exact, and with a budget covering the history) equals a float64
numpy softmax over that model history plus the self key.
"""

from __future__ import annotations

import math

import numpy as np
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

import rankattn
from rankattn import serving
from test_serving import assert_cache_matches

USERS, PAGES, MAX_PAGES, HKV, HQ, D, T = 3, 8, 5, 1, 2, 2, 4
# Subnormals excluded: XLA:CPU flushes them to 0 in the min/max scatter (a bound error
# under 1e-38).
tokens = st.lists(st.floats(-3, 3, allow_nan=False, allow_subnormal=False, width=32), min_size=T * HKV * D,
                  max_size=T * HKV * D).map(lambda x: np.array(x, np.float32).reshape(1, T, HKV, D))


class CacheMachine(RuleBasedStateMachine):
    @initialize(page_size=st.sampled_from([1, 3, 4]))
    def start(self, page_size):
        self.p = page_size
        self.cache = serving.empty_cache(num_users=USERS, num_pages=PAGES, page_size=page_size,
                                         kv_heads=HKV, head_dim=D, max_pages=MAX_PAGES)
        self.model = {u: (np.zeros((0, HKV, D), np.float32),) * 2 for u in range(USERS)}

    def pages_held(self):
        return sum(-(-len(k) // self.p) for k, _ in self.model.values())

    @rule(user=st.integers(0, USERS - 1), k=tokens, v=tokens, count=st.integers(0, T))
    def append(self, user, k, v, count):
        old = len(self.model[user][0])
        need = -(-(old + count) // self.p) - -(-old // self.p)
        fits = old + count <= MAX_PAGES * self.p and need <= PAGES - self.pages_held()
        try:
            self.cache = serving.append(self.cache, np.array([user]), k, v, np.array([count]))
        except rankattn.RankattnError as e:
            assert not fits and e.code == "RA210", str(e)
            return
        assert fits, "an append the model says does not fit went through"
        hk, hv = self.model[user]
        self.model[user] = (np.concatenate([hk, k[0, :count]]), np.concatenate([hv, v[0, :count]]))

    @rule(user=st.integers(0, USERS - 1))
    def release(self, user):
        self.cache = serving.release(self.cache, np.array([user]))
        self.model[user] = (np.zeros((0, HKV, D), np.float32),) * 2

    @rule(users=st.lists(st.integers(0, USERS - 1), min_size=2, max_size=2),
          seed=st.integers(0, 2 ** 16), budgeted=st.booleans())
    def attend(self, users, seed, budgeted):
        rng = np.random.default_rng(seed)
        q = rng.normal(0, 1, (2, 1, HQ, D)).astype(np.float32)
        ks, vs = (rng.normal(0, 1, (2, 1, HKV, D)).astype(np.float32) for _ in range(2))
        budget = MAX_PAGES * self.p if budgeted else None      # covers every history
        got = np.asarray(serving.attend(q, self.cache, np.array(users), (ks, vs), budget=budget,
                                        sink_pages=0, recent_pages=1))
        for b, u in enumerate(users):
            hk, hv = self.model[u]
            for h in range(HQ):
                keys = np.concatenate([hk[:, h // (HQ // HKV)], ks[b, 0, h // (HQ // HKV)][None]])
                vals = np.concatenate([hv[:, h // (HQ // HKV)], vs[b, 0, h // (HQ // HKV)][None]])
                logits = keys.astype(np.float64) @ q[b, 0, h] / math.sqrt(D)
                w = np.exp(logits - logits.max())
                np.testing.assert_allclose(got[b, 0, h], w @ vals / w.sum(), rtol=1e-5,
                                           atol=1e-5, err_msg=f"user {u} head {h}")

    @invariant()
    def cache_matches_the_model(self):
        if hasattr(self, "cache"):
            assert_cache_matches(self.cache, {u: kv for u, kv in self.model.items() if len(kv[0])})
            assert not bool(self.cache.overflow)


CacheMachine.TestCase.settings = settings(
    max_examples=2 * settings.default.max_examples, stateful_step_count=20,
    deadline=None)
TestCacheMachine = CacheMachine.TestCase
