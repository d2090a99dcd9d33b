"""Scoring queries against the paged history cache, exactly or with Quest page selection.

A query row b belongs to cached user ``users[b]``. It attends to that user's
cached history and, optionally, to its own key/value (``self_kv``: a
candidate's self term). That is exactly what a candidate row of
:func:`rankattn.attention` sees with candidate isolation, so with no budget the
two agree to float32 rounding.

Quest (Tang et al., 2024) bounds the logit of query q on any key of page j by
``U_j(q) = sum_i max(q_i * M_j[i], q_i * m_j[i])`` (M, m: the page's channel-wise
key max / min, q: the *scaled* query, so the bound holds for any sign of
``scale``). Since ``max(q M, q m) = max(q, 0) M + min(q, 0) m`` the scores of all
pages are two matrix products. With a budget, each query keeps ``budget // P``
pages: the ``sink_pages`` first and ``recent_pages`` last pages always, the rest
by score, and attends to those pages only.

Selection is *per query row* by default: each candidate's pages depend on its own
query only, so isolation holds for the selection too (one candidate's presence
never changes another's pages or score). ``selection='per_request'`` shares one
page set among a request's rows instead, read once for all of them. The page axis
is a static ``budget // P`` (top-k) so shapes never depend on lengths.

Attention over the pages (every page in order for the exact path, the selected
ones under a budget) is one call of rankattn's core kernels with a row per page
list (_attend_rows): on CPU the fused kernel reads the pages in place.
"""

from __future__ import annotations

import dataclasses
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from rankattn import distributed, semantics
from rankattn.api import resolve_impls, select_backend
from rankattn.backends.base import Backend, compute_dtype, first_derivatives_only
from rankattn.backends.cpu import Cpu, paged_candidates_forward, paged_forward
from rankattn.backends.cpu import page_bounds as kernel_page_bounds
from rankattn.errors import fail
from rankattn.serving import sharded
from rankattn.serving.cache import (PagedKVCache, _describe, _positive_int, check_cache,
                                    check_float, check_users, keyword_options, layer_view,
                                    read_layer)
from rankattn.validate import AttentionCall, check_logit_options, check_static_bool

GQA_MODES = ("per_head", "group", "mean")
SELECTIONS = ("per_query", "per_request")


# --- How "group" merges the page scores of its query heads. ------------------------------------
#
# Each rule maps bounds u [B, Hkv, T, G, M] (-inf on missing pages; `valid` marks
# real pages) to one score per page [B, Hkv, T, 1, M]. benchmarks/SERVING.md
# measures them on planted keys; DEFAULT_GROUP_RULE is the winner.


def _masked_mean(x, valid):
    count = jnp.maximum(valid.sum(-1, keepdims=True), 1)
    return jnp.where(valid, x, 0).sum(-1, keepdims=True) / count


def _rule_max(u, valid):
    """Plain max of the raw bounds: the head with the largest query norm decides."""
    return u.max(3, keepdims=True)


def _rule_standardised(u, valid):
    """Max over heads of each head's z-score over the user's pages."""
    mean = _masked_mean(u, valid)
    var = _masked_mean(jnp.square(jnp.where(valid, u - mean, 0)), valid)
    return ((u - mean) * jax.lax.rsqrt(var + 1e-12)).max(3, keepdims=True)


def _rule_gap(u, valid):
    """Max over heads of the bound minus the head's best page bound (logit units)."""
    return (u - u.max(-1, keepdims=True)).max(3, keepdims=True)


def _rule_share(u, valid):
    """Max over heads of the bound minus its logsumexp over pages: a softmax-share estimate."""
    return (u - jax.nn.logsumexp(u, axis=-1, keepdims=True)).max(3, keepdims=True)


def _rule_rank(u, valid):
    """Best rank any head gives the page (a round-robin union of the heads' lists)."""
    rank = jnp.argsort(jnp.argsort(-u, axis=-1), axis=-1)
    return -rank.min(3, keepdims=True).astype(u.dtype)


GROUP_RULES = {"max": _rule_max, "standardised": _rule_standardised, "gap": _rule_gap,
               "share": _rule_share, "rank": _rule_rank}
DEFAULT_GROUP_RULE = "standardised"


# --- Public functions. -------------------------------------------------------------------------


@keyword_options("self_kv")
def attend(q, cache: PagedKVCache, users, *, self_kv=None, budget=None, gqa="group",
           selection="per_query", sink_pages=1, recent_pages=1, scale=None, softcap=None,
           softcap_method="tanh", group_rule=DEFAULT_GROUP_RULE, sharding=None, layer=None,
           return_lse=False, impl="auto"):
    """Attention of queries to their users' cached history (+ optional self term).

    q, cache and users are positional; every option is keyword-only (a fourth
    positional argument, the old spelling of self_kv, raises RA217).

    Args:
      q: queries, one of [B, T, Hq, D] (T candidates of one request, or T=1 for a
        decode step), [B, Hq, D] or [B, Hq*D]; any float dtype. Hq must be a
        multiple of the cache's Hkv (query head h reads kv head h // (Hq // Hkv)).
      cache: PagedKVCache holding k/v pages [N, Hkv, P, D] / [N, Hkv, P, Dv].
      users: int [B] in [0, U); row b attends to the history of cached user
        users[b] (RA206 outside [0, U) where concrete; a traced id outside is clamped).
      self_kv: optional (k_self, v_self), each query's own key and value in the
        query's layout: [B, T, Hkv, D] and [B, T, Hkv, Dv] (or [B, Hkv, D],
        or [B, Hkv*D]). Query (b, t) sees key (b, t) and no other self key.
      budget: None for exact attention over the whole history, or a token
        budget (Python int): each query row attends to budget // P pages
        chosen by Quest's bound. Users with no more pages than that are
        attended densely.
      gqa: how a budget is shared by the query heads of a kv head:
        'per_head' (each query head picks its own pages; most precise),
        'group' (one page set per kv head, scored by ``group_rule``; the
        default) or 'mean' (the group's mean query is scored, SGLang's rule,
        whose score no longer bounds each head's logit).
      selection: who shares a page set under a budget. 'per_query' (default):
        each query row (candidate) selects its own pages, so candidates stay
        isolated in the selection too. 'per_request': the T query rows of a
        batch row share one page set (per kv head, or per query head with
        gqa='per_head'), merged from their page scores by ``group_rule`` (the
        max over the rows of each row's standardised bound, by default). The
        history's selected pages are then gathered once per request instead of
        once per candidate (measured faster at many candidates per request, see
        benchmarks/SERVING.md), but a candidate's pages, and so its score,
        depend on the other candidates of its request.
      sink_pages, recent_pages: the first / last pages of each history that
        every query keeps (they count against the budget).
      scale: logit scale (default 1 / sqrt(D)); softcap, softcap_method: as
        :func:`rankattn.attention` (the cap applies to history and self logits).
      group_rule: how page scores are merged where several queries share a page set:
        the query heads of a kv head under gqa='group', and under
        selection='per_request' a request's rows (with any gqa). A key of
        GROUP_RULES (default chosen by measurement, see benchmarks/SERVING.md); the
        others kept for comparison.
      sharding: a rankattn.Sharding(mesh, batch=..., context=...) to score on a
        device mesh, with ``cache`` a sharded cache (arrays [nb, nc, ...]: batch
        shards of users x context shards of each history; see
        rankattn.serving.sharded and sharded_cache_from_history). q, users and
        self_kv rows are split over the batch axes and row b's user (a global
        id) must be cached on row b's batch shard. Results equal one device's;
        ``budget`` needs no context axes.
      layer: with a stacked cache (a leading [L] axis on every array, see
        rankattn.serving.cache; [L, nb, nc, ...] when sharded), the layer to
        read: a Python int or an int32 scalar, traced or not (a fori_loop
        index). None for one layer's cache (what jax.lax.scan over a stacked
        cache hands its body).
      impl: the core attention backend that attends to the pages: 'auto'
        (default: the fused 'cpu' kernel where it builds, else 'xla'; None means
        the same), a backend
        name ('cpu', 'xla', 'reference'), an instance, or a list (the first
        that can run the call; one that takes the keys' own segment ids,
        rankattn.semantics.ShardMask). The 'cpu' kernel reads the cache's pages
        in place, a block at a time, and adds each query's self key itself;
        any other backend first gathers each row's pages into one contiguous
        history (a copy of K and V) and merges the self key by log-sum-exp.
      return_lse: also return the log-sum-exp of each query row and head.

    Returns:
      out in q's layout with D replaced by Dv ([B, T, Hq, Dv], [B, Hq, Dv] or
      [B, Hq*Dv]), in q's dtype. A row whose user has no history and no self
      term gets zeros. With return_lse, (out, lse): lse is the natural-log
      log-sum-exp of the row's (scaled, capped) logits over every key it
      attended (its user's history, or the pages selected under a budget, plus
      its self key), shaped like out without its last axis ([B, T, Hq] for 4-D
      q, [B, Hq] for 3-D and 2-D q), float32 (float64 for float64 inputs); -inf
      where the row saw no key, NaN where a non-finite input poisoned it. (The
      core's rankattn.attention returns lse head-major, [B, Hq, S].)

    Without a budget this equals the candidate rows of
    ``rankattn.attention(concat([history, candidates]), segment_ids=[1]*S + [-1]*T)``.
    Math in float32 (float64 for float64 inputs). Traced users / cache values
    are fine under jit; budget, gqa, pages, scale and softcap are static.
    Cost: exact, O(T * Hq * S * D), reading the whole history once per request
    and kv head; with a budget, O(T * Hq * (S/P + budget) * D), reading only
    the selected pages (once per page list: per candidate, or per request with
    selection='per_request').
    """
    return_lse = check_static_bool("return_lse", return_lse)
    view, layer = layer_view(cache, layer, "attend", lead=0 if sharding is None else 2)
    if sharding is not None:  # checked on one shard's view, with the users' local ids
        view = sharded.local_view(view, sharding)
        if sharding.context and budget is not None:
            raise fail("RA215", f"budget={budget} with context={sharding.context!r}: Quest page "
                                "selection does not run across context shards yet. Shard users "
                                "with batch= only, or pass budget=None (exact).")
        users = sharded.local_users(users, np.shape(q)[0] if np.ndim(q) else 0, view.num_users,
                                    sharding)
    query, users, plan = _check("attend", q, view, users, self_kv, budget=budget, gqa=gqa,
                                selection=selection, sink_pages=sink_pages,
                                recent_pages=recent_pages, scale=scale, softcap=softcap,
                                softcap_method=softcap_method, group_rule=group_rule)
    plan = _with_impl(plan, impl)
    k_self, v_self = query.self_kv
    if sharding is not None:
        out, lse = sharded.attend(plan, query, cache, users, sharding, layer, _attend_partial,
                                  _attend)
    else:
        out, lse = _attend(plan, query.q, cache, users, k_self, v_self, layer)
    out = query.restore(out)
    return (out, query.restore_lse(lse)) if return_lse else out


def select_pages(q, cache: PagedKVCache, users, *, budget, gqa="group", selection="per_query",
                 sink_pages=1, recent_pages=1, scale=None, group_rule=DEFAULT_GROUP_RULE,
                 layer=None, impl="auto"):
    """The history pages each query head attends to under ``attend(..., budget=budget)``.

    Arguments as :func:`attend` (budget required; ``layer`` for a stacked cache; ``impl``
    runs the page bounds on the cpu kernel when it names that first, as 'auto' does where it
    builds).
    Returns int32 [B, T, Hq, n] (or [B, Hq, n] for 3-D / 2-D queries), n =
    min(budget // P, max_pages): logical page numbers (page j holds tokens
    [j*P, (j+1)*P) of the user's history), -1 where the user has fewer pages
    than n. Order is by score: first, by index, the kept sink / recent pages and
    the pages whose key stats are not finite (whose rows are NaN anyway), then
    the rest. With selection='per_request' the rows of a request hold the same
    pages. The pages are those ``attend`` reads with the same ``impl`` (bounds
    rounded apart could break a near-tie differently).
    """
    if budget is None:
        raise fail("RA208", "select_pages needs budget=<tokens>; budget=None means no selection.")
    view, layer = layer_view(cache, layer, "select_pages")
    query, users, plan = _check("select_pages", q, view, users, None, budget=budget, gqa=gqa,
                                selection=selection, sink_pages=sink_pages,
                                recent_pages=recent_pages, scale=scale, softcap=None,
                                softcap_method="tanh", group_rule=group_rule)
    pages = _select_public(_with_impl(plan, impl), query.q, cache, users, layer)
    return pages if query.has_t else pages[:, 0]


def page_bounds(q, cache: PagedKVCache, users, *, scale=None, layer=None, impl="auto"):
    """Quest's upper bound of every query head's (uncapped, scaled) logit, per page.

    Arguments as :func:`attend` (``layer`` for a stacked cache, ``impl`` as in
    :func:`select_pages`). Returns float32
    [B, T, Hq, max_pages] (or [B, Hq, max_pages] for 3-D / 2-D queries): entry j
    bounds ``scale * q . k`` for every key k of the user's page j, is -inf
    where the user has no page j, and +inf where the page's key stats are not
    finite (a key holding inf or NaN: attend keeps such a page). A soft cap is monotone, so capped logits are
    bounded by the capped bound.
    """
    view, layer = layer_view(cache, layer, "page_bounds")
    query, users, plan = _check("page_bounds", q, view, users, None, budget=None,
                                gqa="per_head", selection="per_query", sink_pages=0,
                                recent_pages=0, scale=scale, softcap=None,
                                softcap_method="tanh", group_rule=DEFAULT_GROUP_RULE)
    bounds = _bounds_public(_with_impl(plan, impl), query.q, cache, users, layer)
    return bounds if query.has_t else bounds[:, 0]


# --- Argument checks. --------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Plan:
    """Everything static: it selects the compiled program."""

    pages: int | None        # pages per query (budget // P), None = exact
    gqa: str
    selection: str
    group_rule: str
    sink_pages: int
    recent_pages: int
    scale: float
    softcap: float | None
    softcap_method: str
    impl: object = "auto"    # the core backend of the exact path (rankattn.attention's impl)


@dataclasses.dataclass(frozen=True)
class _Query:
    q: jax.Array              # [B, T, Hq, D]
    self_kv: tuple            # ([B, T, Hkv, D], [B, T, Hkv, Dv]) or (None, None)
    has_t: bool               # the caller's layout had a T axis
    flat: bool                # the caller's layout was [B, Hq*D]

    def restore(self, out):
        """[B, T, Hq, Dv] -> the caller's layout."""
        if self.has_t:
            return out
        out = out[:, 0]
        return out.reshape(out.shape[0], -1) if self.flat else out

    def restore_lse(self, lse):
        """[B, T, Hq] -> [B, T, Hq] for 4-D queries, [B, Hq] for 3-D and 2-D ones."""
        return lse if self.has_t else lse[:, 0]


def _check(where, q, cache, users, self_kv, *, budget, gqa, selection, sink_pages,
           recent_pages, scale, softcap, softcap_method,
           group_rule) -> tuple[_Query, jax.Array, _Plan]:
    check_cache(cache)
    users = check_users(users, cache, where)
    hkv, d, dv = cache.kv_heads, cache.head_dim, cache.v_head_dim
    if not hasattr(q, "shape") or not hasattr(q, "dtype"):
        raise fail("RA202", f"q must be an array; got {type(q).__name__}.")
    check_float("q", q)
    shape = tuple(q.shape)
    if len(shape) == 2:
        if shape[1] % d:
            raise fail("RA203", f"q has shape {shape}: its hidden size {shape[1]} is not a "
                                f"multiple of the cache's head dim {d}. Pass [B, Hq*{d}] or "
                                f"[B, Hq, {d}].")
        q4 = q.reshape(shape[0], 1, shape[1] // d, d)
    elif len(shape) == 3:
        q4 = q[:, None]
    elif len(shape) == 4:
        q4 = q
    else:
        raise fail("RA202", f"q has shape {shape} ({len(shape)}-D); use [B, T, Hq, D], [B, Hq, D] "
                            f"or [B, Hq*D] with D = {d} (the cache's head dim).")
    b, t, hq, dq = q4.shape
    if 0 in q4.shape:
        raise fail("RA202", f"{where}: the query q has shape {shape}; every axis of a scored "
                            "query must be >= 1 (skip requests with no candidates).")
    if dq != d:
        raise fail("RA205", f"q has head dim {dq} (shape {shape}) but the cache holds keys of "
                            f"head dim {d}. Pass queries of the cache's layer.")
    if hq % hkv:
        options = ", ".join(str(x) for x in range(1, hq + 1) if hq % x == 0)
        raise fail("RA204", f"q has {hq} query heads and the cache has {hkv} kv heads; {hq} is not "
                            f"a multiple of {hkv}. kv head counts that divide {hq}: {options}.")
    if users.shape[0] != b:
        raise fail("RA206", f"{where}: users has {users.shape[0]} ids but q has batch {b} (shape "
                            f"{shape}); give one user id per query row.")

    self4 = (None, None)
    if self_kv is not None:
        self4 = _check_self_kv(self_kv, len(shape), b, t, hkv, d, dv)

    # Scale and soft cap mean exactly what they mean in rankattn.attention, so the
    # core's own checks (codes RA111-RA113) judge them.
    scale, softcap = check_logit_options(scale, softcap, softcap_method, d)

    for name, value in (("sink_pages", sink_pages), ("recent_pages", recent_pages)):
        if not (_positive_int(value) or (isinstance(value, (int, np.integer))
                                         and not isinstance(value, bool) and value == 0)):
            raise fail("RA208", f"{name}={value!r}; pass a non-negative Python int.")
    pages = None
    if budget is not None:
        p = cache.page_size
        # Exactly the kept pages is StreamingLLM's window (sink + recent), which users run on
        # purpose; fewer would drop a page that is always kept.
        least = max(sink_pages + recent_pages, 1)
        if not isinstance(budget, (int, np.integer)) or isinstance(budget, bool):
            raise fail("RA208", f"budget={budget!r} ({type(budget).__name__}): the budget is a "
                                "token count fixed at trace time; pass a Python int "
                                f"(int(budget), static under jit) of at least {least * p}, or "
                                "budget=None for exact attention.")
        if budget // p < least:
            raise fail("RA208", f"budget={budget!r} tokens buys {max(budget // p, 0)} "
                                f"pages of P={p}, but sink_pages={sink_pages} + recent_pages="
                                f"{recent_pages} are always kept (and at least one page is "
                                f"attended). Pass budget >= {least * p}, or budget=None for "
                                "exact attention.")
        pages = budget // p
    if not isinstance(gqa, str) or gqa not in GQA_MODES:
        raise fail("RA209", f"gqa={gqa!r}; use one of {', '.join(map(repr, GQA_MODES))}.")
    if not isinstance(selection, str) or selection not in SELECTIONS:
        raise fail("RA209", f"selection={selection!r}; use one of "
                            f"{', '.join(map(repr, SELECTIONS))}.")
    if not isinstance(group_rule, str) or group_rule not in GROUP_RULES:
        raise fail("RA209", f"group_rule={group_rule!r}; use one of "
                            f"{', '.join(map(repr, GROUP_RULES))}.")
    plan = _Plan(pages=pages, gqa=gqa, selection=selection, group_rule=group_rule,
                 sink_pages=int(sink_pages), recent_pages=int(recent_pages), scale=scale,
                 softcap=softcap, softcap_method=softcap_method)
    return _Query(q4, self4, has_t=len(shape) == 4, flat=len(shape) == 2), users, plan


def _with_impl(plan: _Plan, impl) -> _Plan:
    """The plan with ``impl`` (lists as tuples: the plan is a static, hashable argument). A
    container is checked here (an unhashable one would fail as JAX's static argument, not as
    RA114); a name or a backend is checked where the call is traced."""
    if impl is not None and not isinstance(impl, (str, Backend)):
        resolve_impls(impl)

    def hashable(x):
        return tuple(map(hashable, x)) if isinstance(x, (list, tuple)) else x

    return dataclasses.replace(plan, impl=hashable(impl))


def _check_self_kv(self_kv, ndim: int, b: int, t: int, hkv: int, d: int, dv: int):
    layouts = {4: lambda e: (b, t, hkv, e), 3: lambda e: (b, hkv, e), 2: lambda e: (b, hkv * e)}
    want_k, want_v = layouts[ndim](d), layouts[ndim](dv)
    if not isinstance(self_kv, (tuple, list)) or len(self_kv) != 2:
        raise fail("RA207", f"self_kv must be a pair (k_self, v_self); got {type(self_kv).__name__}"
                            f"{' of length ' + str(len(self_kv)) if isinstance(self_kv, (tuple, list)) else ''}.")
    out = []
    for name, x, want in (("k_self", self_kv[0], want_k), ("v_self", self_kv[1], want_v)):
        if not hasattr(x, "shape") or tuple(x.shape) != want:
            raise fail("RA207", f"self_kv's {name} is {_describe(x)}; for q in the {ndim}-D layout "
                                f"and a cache of {hkv} kv heads it must have shape {want}.")
        check_float(name, x)
        out.append(x.reshape(b, t, hkv, -1))
    return tuple(out)


# --- Selection. --------------------------------------------------------------------------------
#
# Inside, queries are head-major, [B, Hkv, T, G, D]: the kv head and the batch are
# the batch axes of every product, so (T, G) rows form one matrix per kv head.


def _user_pages(cache: PagedKVCache, users):
    """(page table rows [B, M], lengths [B], real-page mask [B, M]) of the selected users."""
    # jnp.take clamps: no arithmetic per user to wrap negative ids, which would count
    # against the flops below which XLA runs an exact request on the calling thread
    # (paged_candidates_forward). Ids are checked to lie in [0, U) where concrete.
    length = jnp.take(cache.lengths, users, mode="clip")
    npages = -(-length // cache.page_size)
    table = jnp.take(cache.page_table, users, axis=0, mode="clip")
    return table, length, jnp.arange(cache.max_pages)[None, :] < npages[:, None]


def _head_major(q, hkv: int):
    """[B, T, Hq, D] -> float [B, Hkv, T, G, D] (query head h = kv head * G + g)."""
    b, t, hq, d = q.shape
    q = q.astype(compute_dtype(q.dtype)).reshape(b, t, hkv, hq // hkv, d)
    return q.transpose(0, 2, 1, 3, 4)


def _token_major(x):
    """[B, Hkv, T, G, ...] -> [B, T, Hkv * G, ...]."""
    x = jnp.moveaxis(x, 2, 1)
    return x.reshape(*x.shape[:2], -1, *x.shape[4:])


def _bounds(plan: _Plan, qs, cache: PagedKVCache, table, valid):
    """(Quest bounds [B, Hkv, T, G, M] of scaled queries qs [B, Hkv, T, G, D], -inf
    off-history; bool [B, Hkv, 1, 1, M]: real pages whose key stats are not finite).

    The bounds carry no gradient: they only choose pages (a discrete choice), so their
    inputs are cut from autodiff here, and jax.grad through attend(budget=...) differentiates
    the attention over the chosen pages alone (the kernel's bounds have no VJP either).

    A page holding a non-finite key has no finite bound: its bound here is computed as if
    those stats were 0, and callers rank it first (selecting it poisons the rows that read
    it, as exact attention would) or report +inf.

    Float32 bounds run on the cpu kernel when ``plan.impl`` would attend with it (one
    product of [q+, q-] with the pages' [max; min], read in place: page_bounds at 64K
    tokens, 4 users x 12 candidates, 8 / 2 heads, D = 64 measured 16.9 ms with XLA's two
    narrow products, 8.8 ms on the kernel), else in XLA.
    """
    qs = jax.lax.stop_gradient(qs)
    cache = cache._replace(k_max=jax.lax.stop_gradient(cache.k_max),
                           k_min=jax.lax.stop_gradient(cache.k_min))
    if qs.dtype == cache.k_max.dtype == jnp.float32 and _on_cpu_kernel(plan):
        b, h, t, g, d = qs.shape
        u, bad = kernel_page_bounds(qs.reshape(b, h, t * g, d), cache.k_max, cache.k_min,
                                    jnp.maximum(table, 0), valid.sum(-1))
        return u.reshape(b, h, t, g, -1), (bad != 0)[:, :, None, None]
    idx = jnp.maximum(table, 0)
    # Missing pages hold +-inf (or another user's stats); zero them before the
    # product so no inf * 0 = NaN appears, then mask the result.
    keep = valid[:, :, None, None]
    hi, lo = cache.k_max[idx], cache.k_min[idx]                      # [B, M, Hkv, D]
    bad = keep[..., 0] & ~(jnp.isfinite(hi) & jnp.isfinite(lo)).all(-1)
    hi = jnp.where(keep & jnp.isfinite(hi), hi, 0).astype(qs.dtype)
    lo = jnp.where(keep & jnp.isfinite(lo), lo, 0).astype(qs.dtype)
    # Pages as the row axis of the product, then the (smaller) result moved: XLA
    # keeps the page stats d-minor, which measured 1.4-2.4x faster on CPU than
    # asking for pages last (that transposes every page's D stats).
    u = (jnp.einsum("bmhd,bhtgd->bhmtg", hi, jnp.maximum(qs, 0), precision="highest")
         + jnp.einsum("bmhd,bhtgd->bhmtg", lo, jnp.minimum(qs, 0), precision="highest"))
    u = jnp.where(valid[:, None, None, None, :], jnp.moveaxis(u, 2, -1), -jnp.inf)
    return u, jnp.moveaxis(bad, 1, -1)[:, :, None, None]


def _on_cpu_kernel(plan: _Plan) -> bool:
    """Whether the first backend ``plan.impl`` names is the cpu kernel, built."""
    first = resolve_impls(plan.impl)[0]
    return isinstance(first, Cpu) and not first.platform_reasons()


def _select_pages(plan: _Plan, qf, cache: PagedKVCache, table, valid):
    """Logical pages [B, Hkv, T', G', n], best first: G' = G for per_head, else 1; T' = T
    per query, 1 per request."""
    qs = qf * plan.scale
    if plan.gqa == "mean":
        qs = qs.mean(3, keepdims=True)
    u, bad = _bounds(plan, qs, cache, table, valid)
    valid5 = valid[:, None, None, None, :]

    def merge(u):  # the rule's merge over axis 3, -inf off-history
        return jnp.where(valid5, GROUP_RULES[plan.group_rule](u, valid5), -jnp.inf)

    per_request = plan.selection == "per_request"
    if plan.gqa == "group":  # over G, or over (T, G) at once per request
        u = merge(u.reshape(*u.shape[:2], 1, -1, u.shape[-1]) if per_request else u)
    elif per_request:  # over T, per query head (G' = 1 for mean)
        u = jnp.swapaxes(merge(jnp.swapaxes(u, 2, 3)), 2, 3)
    u = jnp.where(bad, jnp.inf, u)
    j = jnp.arange(cache.max_pages)
    npages = valid.sum(-1, keepdims=True)
    kept = valid & ((j < plan.sink_pages) | (j >= npages - plan.recent_pages))
    u = jnp.where(kept[:, None, None, None, :], jnp.inf, u)
    return jax.lax.top_k(u, min(plan.pages, cache.max_pages))[1].astype(jnp.int32)


@partial(jax.jit, static_argnums=0)
def _select_public(plan: _Plan, q, cache: PagedKVCache, users, layer):
    cache = read_layer(cache, layer)
    table, _, valid = _user_pages(cache, users)
    qf = _head_major(q, cache.kv_heads)
    pages = _select_pages(plan, qf, cache, table, valid)
    pages = jnp.broadcast_to(pages, qf.shape[:-1] + pages.shape[-1:])
    real = jnp.take_along_axis(valid[:, None, None, None, :], pages, axis=-1)
    return _token_major(jnp.where(real, pages, -1))


@partial(jax.jit, static_argnums=0)
def _bounds_public(plan: _Plan, q, cache: PagedKVCache, users, layer):
    cache = read_layer(cache, layer)
    table, _, valid = _user_pages(cache, users)
    qs = _head_major(q, cache.kv_heads) * plan.scale
    u, bad = _bounds(plan, qs, cache, table, valid)
    return _token_major(jnp.where(bad, jnp.inf, u)).astype(jnp.float32)


# --- Attention over pages. ---------------------------------------------------------------------


@partial(jax.jit, static_argnums=0)
def _attend(plan: _Plan, q, cache: PagedKVCache, users, k_self, v_self, layer):
    """(out [B, T, Hq, Dv] in q's dtype, lse [B, T, Hq]) of layer ``layer`` (None: one layer)."""
    out, lse = _attend_partial(plan, q, read_layer(cache, layer), users, k_self, v_self)
    return out.astype(q.dtype), jnp.swapaxes(lse, 1, 2)


def _attend_partial(plan: _Plan, q, cache: PagedKVCache, users, k_self, v_self):
    """(out [B, T, Hq, Dv], lse [B, Hq, T]), float32 (float64 for float64 inputs): attention
    over the cached history (+ self term), as a partial result that
    rankattn.distributed.merge_partials can combine with others over disjoint keys (e.g.
    other context shards of the history)."""
    b, t, hq, d = q.shape
    hkv, g, p = cache.kv_heads, hq // cache.kv_heads, cache.page_size
    dtype = jnp.promote_types(q.dtype, cache.k_pages.dtype)
    table, length, valid = _user_pages(cache, users)
    # The pages in the request's dtype, and the table rows that address them (``table``
    # still addresses the cache, whose key stats Quest reads).
    k_pages, v_pages, pages_table = _pages_in(dtype, cache.k_pages, cache.v_pages, table)
    self_kv = None if k_self is None else (k_self.astype(dtype), v_self.astype(dtype))
    if plan.pages is None or plan.pages >= cache.max_pages:
        # Exact: a row per request, every page in order, q and the pages in their own layouts
        # (transposing q, the self keys and the result measured 3-7% of a 64-candidate
        # request, benchmarks/CPU_KERNEL.md). Slots past the user's length (a missing page
        # read as page 0, a released page's stale tail) are never seen.
        # The table goes as it is (a missing page's -1 included): the cpu kernel clamps its
        # entries itself, and a program of the kernel call alone runs on the calling thread
        # (paged_candidates_forward).
        seen = jnp.arange(cache.max_pages * p)[None, :] < length[:, None]
        return _attend_rows(plan, q.astype(dtype), k_pages, v_pages, pages_table, seen,
                            self_kv, seen_lengths=length)
    logical = _select_pages(plan, _head_major(q, hkv), cache, table, valid)
    logical = jnp.broadcast_to(logical, (b, hkv, *logical.shape[2:]))
    # One row of the kernel call per page list: (b, kv head, candidate if per query, query
    # head if per head), holding the queries that share the list ([t_in, g_in]).
    t_sel, g_sel, n = logical.shape[2:]
    t_in, g_in = t // t_sel, g // g_sel
    rows = b * hkv * t_sel * g_sel

    def to_rows(x, inner):  # [B, Hkv, t_sel * t_in, G_x, E] -> [rows, t_in, inner, E]
        x = x.reshape(b, hkv, t_sel, t_in, g_sel, -1, x.shape[-1]).transpose(0, 1, 2, 4, 3, 5, 6)
        return x.reshape(rows, t_in, inner, x.shape[-1])

    q_rows = to_rows(q.astype(dtype).reshape(b, t, hkv, g, d).transpose(0, 2, 1, 3, 4), g_in)
    self_rows = None
    if self_kv is not None:  # [B, T, Hkv, E] -> [rows, t_in, 1, E], one per query head list
        self_rows = tuple(
            to_rows(jnp.broadcast_to(x.transpose(0, 2, 1, 3)[:, :, :, None],
                                     (b, hkv, t, g_sel, x.shape[-1])), 1)
            for x in self_kv)
    # Kernel row r reads pages of one kv head: the cache's pages [N, Hkv, P, E] seen as
    # [N * Hkv, 1, P, E] (no copy), page (physical page) * Hkv + kv head.
    phys = jnp.maximum(pages_table[jnp.arange(b)[:, None, None, None, None], logical], 0)
    head = jnp.arange(hkv, dtype=jnp.int32)[None, :, None, None, None]
    row_pages = (phys * hkv + head).reshape(rows, n)
    # Slots past the user's length (as above, or a selected page that does not exist) are
    # never seen.
    pos = logical[..., None] * p + jnp.arange(p)
    seen = (pos < length[:, None, None, None, None, None]).reshape(rows, n * p)
    k_pages, v_pages = (x.reshape(-1, 1, p, x.shape[-1]) for x in (k_pages, v_pages))
    out, lse = _attend_rows(plan, q_rows, k_pages, v_pages, row_pages, seen, self_rows)
    # [rows, t_in, g_in, Dv] -> [B, T, Hq, Dv]; lse [rows, g_in, t_in] -> [B, Hq, T].
    out = out.reshape(b, hkv, t_sel, g_sel, t_in, g_in, -1).transpose(0, 2, 4, 1, 3, 5, 6)
    lse = lse.reshape(b, hkv, t_sel, g_sel, g_in, t_in).transpose(0, 1, 3, 4, 2, 5)
    return out.reshape(b, t, hq, -1), lse.reshape(b, hq, t)


def _pages_in(dtype, k_pages, v_pages, table):
    """(k_pages, v_pages, table) with the pages in ``dtype``. Where that is not the cache's
    dtype (float32 queries over a bfloat16 cache: the cpu kernel's call takes one dtype),
    the request's table rows [B, M] are what is converted where they are fewer than the
    cache's N pages: their pages gathered in table order ([B * M, ...], a missing page's -1
    reading page 0 as the kernel's clamp does) and the table renumbered to them, instead of
    every page of the cache on every call. Converted before the gather, so that XLA fuses
    the two and the pages' gradient adds up in ``dtype`` before one rounding, as the whole
    cache's did."""
    if k_pages.dtype == v_pages.dtype == dtype:
        return k_pages, v_pages, table
    b, m = table.shape
    if b * m >= k_pages.shape[0]:
        return k_pages.astype(dtype), v_pages.astype(dtype), table
    listed = table.reshape(-1)
    gathered = (jnp.take(x.astype(dtype), listed, axis=0, mode="clip") for x in (k_pages, v_pages))
    return (*gathered, jnp.arange(b * m, dtype=jnp.int32).reshape(b, m))


def _attend_rows(plan: _Plan, q, k_pages, v_pages, table, seen, self_kv, seen_lengths=None):
    """Rows of queries over their own pages, on rankattn's core attention kernels.

    q [R, T, Hq, D]; k_pages / v_pages [N, Hkv, P, D / Dv] (Hq a multiple of Hkv); table
    int32 [R, n]: row r's keys are pages table[r] in order (S = n * P), every kv head of
    them (entries outside [0, N) read a clamped page, so mask them); seen bool [R, S]: which
    of them row r sees; seen_lengths None, or int32 [R] where row r sees exactly its first
    seen_lengths[r] keys (the cpu kernel then builds the mask from them);
    self_kv None or (k_self, v_self) [R, T, Hkv, D / Dv], each query's own key. Returns
    (out [R, T, Hq, Dv], lse [R, Hq, T]) float32 (float64 for float64 inputs).

    The queries attend to the row's keys as candidates of a history:
    rankattn.semantics.ShardMask gives the keys their own segment ids (0 where not seen,
    so blocks of unseen keys are skipped and their values never read) and every token a
    position, as context sharding does. The backend is ``plan.impl`` ('auto': the fused
    cpu kernel where it builds, else xla). The cpu kernel reads the pages in place and adds
    the own key itself; any other backend gets each row's pages gathered into one
    contiguous history [R, S, 1, D] and the own key merged by log-sum-exp.
    """
    # The contiguous call only chooses the backend when the cpu kernel runs: its unused
    # gather is dead code to XLA.
    backend = select_backend(plan.impl, _contiguous_call(plan, q, k_pages, v_pages, table, seen))
    if isinstance(backend, Cpu):
        return _paged_cpu(plan, backend, q, k_pages, v_pages, table, seen, self_kv,
                          seen_lengths)
    return _contiguous(plan, backend, q, k_pages, v_pages, table, seen, self_kv)


def _candidates(q, seen):
    """(segment ids [R, T], ShardMask) of queries that are candidates of S keys, those seen
    [R, S] being the row's history."""
    r, t = q.shape[:2]
    s = seen.shape[1]
    key_pos = jnp.arange(s, dtype=jnp.int32)
    mask = semantics.ShardMask(seen.astype(jnp.int32),
                               jnp.broadcast_to(s + jnp.arange(t, dtype=jnp.int32), (r, t)),
                               jnp.broadcast_to(key_pos, (r, s)))
    return jnp.full((r, t), -1, jnp.int32), mask


def _contiguous_call(plan: _Plan, q, k_pages, v_pages, table, seen) -> AttentionCall:
    """_attend_rows' attention as one rankattn.attention call over contiguous keys."""
    def keys(pages):  # [N, Hkv, P, E] -> [R, n * P, Hkv, E]
        x = pages[jnp.maximum(table, 0)].transpose(0, 1, 3, 2, 4)
        return x.reshape(q.shape[0], -1, *pages.shape[1:2], pages.shape[-1])

    segment_ids, mask = _candidates(q, seen)
    return AttentionCall(q=q, k=keys(k_pages), v=keys(v_pages), segment_ids=segment_ids,
                         causal=False, scale=plan.scale, softcap=plan.softcap,
                         softcap_method=plan.softcap_method, shard_mask=mask)


def _contiguous(plan: _Plan, backend, q, k_pages, v_pages, table, seen, self_kv):
    call = _contiguous_call(plan, q, k_pages, v_pages, table, seen)
    out, lse = backend(call)
    acc = jnp.promote_types(q.dtype, jnp.float32)
    parts = [(out.astype(acc), lse.astype(acc))]
    if self_kv is None:
        return parts[0]
    parts.append(distributed.own_key_partial(plan, q, *self_kv, call.segment_ids))
    return distributed.merge_partials(parts)


@partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _paged_cpu(plan: _Plan, backend, q, k_pages, v_pages, table, seen, self_kv, seen_lengths):
    """_attend_rows on the cpu kernel, pages read in place. Its gradients are those of the
    equivalent contiguous call (the kernel's backward takes contiguous keys), whose results it
    returns in the same dtypes (float32 for 16-bit inputs)."""
    return _paged_cpu_forward((plan, backend), q, k_pages, v_pages, table, seen, self_kv,
                              seen_lengths)


@first_derivatives_only("cpu")
def _paged_cpu_forward(static, q, k_pages, v_pages, table, seen, self_kv, seen_lengths):
    plan, backend = static
    options = dict(scale=plan.scale, softcap=plan.softcap, softcap_method=plan.softcap_method,
                   block_sizes=backend.block_sizes)
    if seen_lengths is None:
        segment_ids, mask = _candidates(q, seen)
        out, lse = paged_forward(q, k_pages, v_pages, table, self_kv, segment_ids,
                                 shard_mask=mask, **options)
    else:
        out, lse = paged_candidates_forward(q, k_pages, v_pages, table, self_kv, seen_lengths,
                                            **options)
    acc = jnp.promote_types(q.dtype, jnp.float32)
    return out.astype(acc), lse.astype(acc)


def _paged_cpu_fwd(plan, backend, *args):
    return _paged_cpu_forward((plan, backend), *args), args[:-1]


def _paged_cpu_bwd(plan, backend, args, cotangents):  # none for seen_lengths (integers)
    _, vjp = jax.vjp(partial(_contiguous, plan, backend), *args)
    return (*vjp(cotangents), None)


_paged_cpu.defvjp(_paged_cpu_fwd, _paged_cpu_bwd)
