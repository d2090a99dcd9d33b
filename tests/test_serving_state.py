"""The paged cache as a state machine: random appends, releases and attends against a plain model.

Hypothesis drives sequences of append / release / attend on one small cache (page sizes 1,
3 and 4, so pages fill partly and are recycled) and checks after every step that each
user's tokens, page min/max and the free list match a plain-Python model of each user's
history, and that attend (exact, or Quest with a budget of fewer pages than the history
holds) equals a float64 numpy softmax over that model history (over the selected pages) plus
the self key.
"""

from __future__ import annotations

import math

import numpy as np
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

import rankattn
from rankattn import serving
from test_serving import assert_cache_matches, quest_bounds
from tolerances import FEW_KEYS_TOL, assert_close_f32

USERS, PAGES, MAX_PAGES, HKV, HQ, D, T = 3, 8, 5, 1, 2, 2, 4
# Subnormals excluded: XLA:CPU flushes them to 0 in the min/max scatter (a bound error
# under 1e-38).
tokens = st.lists(st.floats(-3, 3, allow_nan=False, allow_subnormal=False, width=32), min_size=T * HKV * D,
                  max_size=T * HKV * D).map(lambda x: np.array(x, np.float32).reshape(1, T, HKV, D))


class CacheMachine(RuleBasedStateMachine):
    @initialize(page_size=st.sampled_from([1, 3, 4]), seed=st.integers(0, 2 ** 16))
    def start(self, page_size, seed):
        """An empty cache, then user 0's history of MAX_PAGES whole pages: the random appends
        alone (a few tokens each, shrunk towards none) left every history under a page, so
        no attend with a budget ever selected (the first state of every run checks one)."""
        self.p = page_size
        self.cache = serving.empty_cache(num_users=USERS, num_pages=PAGES, page_size=page_size,
                                         kv_heads=HKV, head_dim=D, max_pages=MAX_PAGES)
        self.model = {u: (np.zeros((0, HKV, D), np.float32),) * 2 for u in range(USERS)}
        rng = np.random.default_rng(seed)
        k, v = (rng.normal(0, 1, (1, MAX_PAGES * page_size, HKV, D)).astype(np.float32)
                for _ in range(2))
        self.cache = serving.append(self.cache, np.array([0]), k, v, np.array([k.shape[1]]))
        self.model[0] = (k[0], v[0])
        assert self.check_attend([0, 1], seed, pages=2, gqa="per_head"), "no selection ran"

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
          seed=st.integers(0, 2 ** 16), pages=st.none() | st.integers(2, MAX_PAGES),
          gqa=st.sampled_from(serving.GQA_MODES))
    def attend(self, users, seed, pages, gqa):
        self.check_attend(users, seed, pages, gqa)

    def check_attend(self, users, seed, pages, gqa) -> bool:
        """Exact (pages None) or Quest with a budget of ``pages`` pages (recent_pages=1, no
        sink): fewer pages than a long history holds, so selection runs. The expected value is a
        float64 softmax over the model's tokens on the pages select_pages reports (all pages
        when exact) plus the self key; with gqa='per_head' those pages must also be the recent
        page plus the best Quest bounds, recomputed here from the model's keys. Returns
        whether that order was checked (a history longer than the budget, per_head)."""
        ordered = False
        rng = np.random.default_rng(seed)
        q = rng.normal(0, 1, (2, 1, HQ, D)).astype(np.float32)
        ks, vs = (rng.normal(0, 1, (2, 1, HKV, D)).astype(np.float32) for _ in range(2))
        kw = dict(budget=None if pages is None else pages * self.p, gqa=gqa, sink_pages=0,
                  recent_pages=1)
        users = np.array(users)
        got = np.asarray(serving.attend(q, self.cache, users, self_kv=(ks, vs), **kw))
        chosen = None
        if pages is not None:
            chosen = np.asarray(serving.select_pages(q, self.cache, users, **kw))  # [2, 1, HQ, n]
        for b, u in enumerate(users):
            hk, hv = self.model[u]
            n_pages = -(-len(hk) // self.p)
            page_of = np.arange(len(hk)) // self.p
            for h in range(HQ):
                kv = h // (HQ // HKV)
                logits_hist = hk[:, kv].astype(np.float64) @ q[b, 0, h] / math.sqrt(D)
                if chosen is None:
                    read = np.ones(len(hk), bool)
                else:
                    picked = set(chosen[b, 0, h][chosen[b, 0, h] >= 0].tolist())
                    assert picked <= set(range(n_pages)), (picked, n_pages)
                    assert len(picked) == min(pages, n_pages), (picked, pages, n_pages)
                    if n_pages:
                        assert n_pages - 1 in picked, "the recent page is always kept"
                    if gqa == "per_head" and n_pages > pages:
                        bound = quest_bounds(hk[:, kv:kv + 1], q[b, :1, h:h + 1], self.p,
                                             1 / math.sqrt(D))[0][0, 0]
                        scored = [j for j in range(n_pages - 1)]
                        kept = [j for j in scored if j in picked]
                        dropped = [j for j in scored if j not in picked]
                        assert min(bound[kept]) >= max(bound[dropped]) - 1e-5, (bound, picked)
                        ordered = True
                    read = np.isin(page_of, sorted(picked))
                keys = np.concatenate([logits_hist[read],
                                       [ks[b, 0, kv].astype(np.float64) @ q[b, 0, h] / math.sqrt(D)]])
                vals = np.concatenate([hv[read, kv], vs[b, 0, kv][None]])
                w = np.exp(keys - keys.max())
                assert_close_f32(got[b, 0, h], w @ vals / w.sum(), f"user {u} head {h} pages {pages}",
                                 tol=FEW_KEYS_TOL)
        return ordered

    @invariant()
    def cache_matches_the_model(self):
        if hasattr(self, "cache"):
            assert_cache_matches(self.cache, {u: kv for u, kv in self.model.items() if len(kv[0])})
            assert not bool(self.cache.overflow)


CacheMachine.TestCase.settings = settings(
    max_examples=2 * settings.default.max_examples, stateful_step_count=20,
    deadline=None)
TestCacheMachine = CacheMachine.TestCase
