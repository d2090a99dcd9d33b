"""Every error path of rankattn.serving: its code, its type, and a message that names the values."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import rankattn
from helpers import assert_explained
from rankattn import errors, serving

HKV, D, DV, P = 2, 8, 6, 4


@pytest.fixture(scope="module")
def cache():
    k = jnp.ones((3, 10, HKV, D))
    v = jnp.ones((3, 10, HKV, DV))
    return serving.cache_from_history(k, v, jnp.array([10, 5, 0]), page_size=P, num_pages=12,
                                      max_pages=4)


def q4(b=2, t=3, hq=4, d=D, dtype=jnp.float32):
    return jnp.ones((b, t, hq, d), dtype)


USERS = jnp.array([0, 1])


def raises(code, *fragments):
    """Context manager: the call raises rankattn error ``code`` whose message holds ``fragments``."""
    kind = errors.CATALOG[code].kind
    return _Raises(kind, code, fragments)


class _Raises:
    def __init__(self, kind, code, fragments):
        self.ctx = pytest.raises(kind)
        self.code, self.fragments = code, fragments

    def __enter__(self):
        self.info = self.ctx.__enter__()
        return self.info

    def __exit__(self, *exc):
        out = self.ctx.__exit__(*exc)
        err = self.info.value
        assert err.code == self.code, str(err)
        assert isinstance(err, rankattn.RankattnError)
        for fragment in self.fragments:
            assert fragment in str(err), f"{fragment!r} not in {str(err)!r}"
        assert_explained(err)
        return out


def test_codes_are_registered_and_documented():
    codes = [c for c in errors.CATALOG if c.startswith("RA2")]
    assert codes == [f"RA2{i:02d}" for i in range(1, len(codes) + 1)]
    for code in codes:
        assert errors.explain(code).startswith(code)


# --- attend / select_pages / page_bounds. ------------------------------------------------------


def test_not_a_cache():
    with raises("RA201", "PagedKVCache", "dict"):
        serving.attend(q4(), {"k": 1}, USERS)


def test_inconsistent_cache(cache):
    broken = cache._replace(k_min=cache.k_min[:, :1])
    with raises("RA201", "cache.k_min", "(12, 1, 8)", "(12, 2, 8)"):
        serving.attend(q4(), broken, USERS)


@pytest.mark.parametrize("name, dtype", [("page_table", jnp.float32), ("lengths", jnp.float32),
                                         ("free", jnp.int32), ("overflow", jnp.int32)])
def test_cache_indices_and_flags_of_another_dtype(cache, name, dtype):
    """Regression: a float page table failed deep in an indexing op ("Indexer must have integer
    or boolean type")."""
    broken = cache._replace(**{name: getattr(cache, name).astype(dtype)})
    with raises("RA201", f"cache.{name}", jnp.dtype(dtype).name):
        serving.attend(q4(), broken, USERS)


@pytest.mark.parametrize("shape", [(2,), (2, 1, 3, 4, D), ()])
def test_unsupported_query_rank(cache, shape):
    with raises("RA202", str(tuple(shape)), "[B, T, Hq, D]", "[B, Hq*D]"):
        serving.attend(jnp.ones(shape), cache, USERS)


def test_query_not_an_array(cache):
    with raises("RA202", "list"):
        serving.attend([[1.0]], cache, USERS)


def test_empty_query_axis(cache):
    with raises("RA202", "(2, 0, 4, 8)", ">= 1", "scored query"):
        serving.attend(q4(t=0), cache, USERS)


def test_flat_query_not_multiple_of_head_dim(cache):
    with raises("RA203", "hidden size 30", "head dim 8", "[B, Hq*8]"):
        serving.attend(jnp.ones((2, 30)), cache, USERS)


@pytest.mark.parametrize("q", [jnp.ones((2, 3, 4, 8)), jnp.ones((2, 3, 8)), jnp.ones((2, 24))])
def test_query_heads_not_multiple_of_kv_heads(cache, q):
    # 3 query heads (in every layout) over 2 kv heads.
    q = q[:, :, :3] if q.ndim == 4 else q[:, :3] if q.ndim == 3 else q
    with raises("RA204", "3 query heads", "2 kv heads", "divide 3: 1, 3"):
        serving.attend(q, cache, USERS)


def test_head_dim_mismatch(cache):
    with raises("RA205", "head dim 16", "head dim 8"):
        serving.attend(q4(d=16), cache, USERS)


@pytest.mark.parametrize("users, fragment", [
    (jnp.array([[0, 1]]), "int array [B]"),
    (jnp.array([0.0, 1.0]), "float32"),
    (jnp.array([], jnp.int32), "non-empty"),
    (jnp.array([0, 3]), "[3]"),
    (jnp.array([0, -1]), "[-1]"),
    (jnp.array([0, 1, 2]), "3 ids but q has batch 2"),
])
def test_bad_users(cache, users, fragment):
    with raises("RA206", fragment):
        serving.attend(q4(), cache, users)


@pytest.mark.parametrize("make_self, fragment", [
    (lambda: jnp.ones((2, 3, HKV, D)), "pair"),
    (lambda: (jnp.ones((2, 3, HKV, D)),), "length 1"),
    (lambda: (jnp.ones((2, 3, HKV, D)), jnp.ones((2, 3, HKV, D))), "(2, 3, 2, 6)"),
    (lambda: (jnp.ones((2, 3, 4, D)), jnp.ones((2, 3, HKV, DV))), "(2, 3, 2, 8)"),
    (lambda: (jnp.ones((2, 3, HKV, D), jnp.int32), jnp.ones((2, 3, HKV, DV))), "int32"),
])
def test_bad_self_kv(cache, make_self, fragment):
    code = "RA213" if fragment == "int32" else "RA207"
    with raises(code, fragment):
        serving.attend(q4(), cache, USERS, self_kv=make_self())


def test_self_kv_in_the_flat_layout_must_be_flat(cache):
    with raises("RA207", f"({2}, {HKV * D})"):
        serving.attend(jnp.ones((2, 4 * D)), cache, USERS, self_kv=(jnp.ones((2, HKV, D)),) * 2)


def test_integer_query(cache):
    with raises("RA213", "int32"):
        serving.attend(jnp.ones((2, 3, 4, D), jnp.int32), cache, USERS)


@pytest.mark.parametrize("kwargs, fragment", [
    (dict(budget=4), "budget=4"),                              # 1 page < sink + recent
    (dict(budget=7, sink_pages=4, recent_pages=4), "budget >= 32"),
    (dict(budget=0), "budget=0"),
    (dict(budget=2.5), "budget=2.5"),
    (dict(budget=512.0), "budget=512.0 (float): the budget is a token count"),  # was "buys 0"
    (dict(budget=-5), "buys 0 pages"),
    (dict(budget=64, sink_pages=-1), "sink_pages=-1"),
    (dict(budget=64, recent_pages=True), "recent_pages=True"),
    (dict(budget=64, recent_pages=1.0), "recent_pages=1.0"),
])
def test_bad_budget_or_kept_pages(cache, kwargs, fragment):
    with raises("RA208", fragment):
        serving.attend(q4(), cache, USERS, **kwargs)


def test_select_pages_needs_a_budget(cache):
    with raises("RA208", "budget=None"):
        serving.select_pages(q4(), cache, USERS, budget=None)


@pytest.mark.parametrize("kwargs, fragment", [
    (dict(budget=64, gqa="heads"), "gqa='heads'"),
    (dict(budget=64, group_rule="avg"), "group_rule='avg'"),
    (dict(budget=64, selection="per_user"), "selection='per_user'"),
])
def test_bad_gqa_mode(cache, kwargs, fragment):
    listed = {"gqa": "'per_head'", "group_rule": "'standardised'", "selection": "'per_request'"}
    with raises("RA209", fragment, *[v for k, v in listed.items() if k in kwargs]):
        serving.attend(q4(), cache, USERS, **kwargs)


@pytest.mark.parametrize("kwargs, code", [
    (dict(scale=0.0), "RA113"),
    (dict(scale=jnp.float32(0.5) * jnp.ones(2)), "RA113"),
    (dict(softcap=-1.0), "RA111"),
    (dict(softcap=1.0, softcap_method="clip"), "RA112"),
])
def test_scale_and_softcap_use_the_core_checks(cache, kwargs, code):
    with raises(code):
        serving.attend(q4(), cache, USERS, **kwargs)


# --- append / release / construction. ----------------------------------------------------------


def test_append_over_user_capacity_changes_nothing(cache):
    new = jnp.ones((1, 7, HKV, D))
    with raises("RA210", "user 0 holds 10 tokens and appends 7", "4 * 4 = 16"):
        serving.append(cache, jnp.array([0]), new, jnp.ones((1, 7, HKV, DV)), jnp.array([7]))


def test_append_out_of_free_pages(cache):
    # 12 pages, 3 + 2 used: user 2 asks for 16 tokens = 4 pages (fits its max), 7 free... then
    # users 1 and 2 together need 2 + 4 = 6 <= 7; ask for 8 with a smaller cache instead.
    small = serving.cache_from_history(jnp.ones((2, 8, HKV, D)), jnp.ones((2, 8, HKV, DV)),
                                       jnp.array([8, 0]), page_size=P, num_pages=3, max_pages=4)
    with raises("RA210", "needs 2 new pages but only 1 of 3 are free"):
        serving.append(small, jnp.array([1]), jnp.ones((1, 8, HKV, D)), jnp.ones((1, 8, HKV, DV)),
                       jnp.array([8]))


@pytest.mark.parametrize("args, fragment", [
    (dict(k_new=jnp.ones((1, 2, HKV, D + 1))), "(1, 2, 2, 8)"),
    (dict(k_new=jnp.ones((1, 2, D))), "4-D"),
    (dict(v_new=jnp.ones((1, 3, HKV, DV))), "(1, 2, 2, 6)"),
    (dict(counts=jnp.array([1, 1])), "shape (1,)"),
    (dict(counts=jnp.array([1.0])), "float32"),
    (dict(counts=jnp.array([3])), "[0, T=2]"),
    (dict(users=jnp.array([1, 1]), k_new=jnp.ones((2, 2, HKV, D)),
          v_new=jnp.ones((2, 2, HKV, DV)), counts=jnp.array([1, 1])), "repeats an id"),
])
def test_malformed_append(cache, args, fragment):
    call = dict(users=jnp.array([1]), k_new=jnp.ones((1, 2, HKV, D)),
                v_new=jnp.ones((1, 2, HKV, DV)), counts=jnp.array([2]))
    call.update(args)
    with raises("RA211", fragment):
        serving.append(cache, **call)


def test_append_integer_keys(cache):
    with raises("RA213", "k_new", "int32"):
        serving.append(cache, jnp.array([1]), jnp.ones((1, 2, HKV, D), jnp.int32),
                       jnp.ones((1, 2, HKV, DV)), jnp.array([2]))


def test_release_checks_users(cache):
    with raises("RA206", "release", "[5]"):
        serving.release(cache, jnp.array([5]))
    with raises("RA201"):
        serving.release(None, jnp.array([0]))


@pytest.mark.parametrize("call, fragment", [
    (lambda: serving.cache_from_history(jnp.ones((2, 8, D)), jnp.ones((2, 8, HKV, D)),
                                        jnp.array([8, 8])), "k_hist must be a non-empty 4-D"),
    (lambda: serving.cache_from_history(jnp.ones((2, 8, HKV, D)), jnp.ones((2, 7, HKV, D)),
                                        jnp.array([8, 8])), "(2, 7, 2, 8)"),
    (lambda: serving.cache_from_history(jnp.ones((2, 8, HKV, D)), jnp.ones((2, 8, HKV, D)),
                                        jnp.array([8])), "shape (2,)"),
    (lambda: serving.cache_from_history(jnp.ones((2, 8, HKV, D)), jnp.ones((2, 8, HKV, D)),
                                        jnp.array([8, 9])), "[0, S=8]"),
    (lambda: serving.cache_from_history(jnp.ones((2, 8, HKV, D)), jnp.ones((2, 8, HKV, D)),
                                        jnp.array([8, 8]), page_size=0), "page_size=0"),
    (lambda: serving.cache_from_history(jnp.ones((2, 8, HKV, D)), jnp.ones((2, 8, HKV, D)),
                                        jnp.array([8, 8]), max_pages=1.5), "max_pages=1.5"),
    (lambda: serving.empty_cache(num_users=2, num_pages=0, page_size=4, kv_heads=1, head_dim=4),
     "num_pages=0"),
])
def test_malformed_history_or_layout(call, fragment):
    with raises("RA212", fragment):
        call()


def test_non_float_cache_dtype():
    with raises("RA213", "int32"):
        serving.empty_cache(num_users=1, num_pages=1, page_size=4, kv_heads=1, head_dim=4,
                            dtype=jnp.int32)
    with raises("RA213", "k_hist", "int32"):
        serving.cache_from_history(jnp.ones((1, 4, 1, 2), jnp.int32),
                                   jnp.ones((1, 4, 1, 2), jnp.int32), np.array([4]))


@pytest.mark.parametrize("kwargs, code", [
    (dict(sink_pages=np.array([1, 2])), "RA208"),
    (dict(recent_pages=jnp.array(1)), "RA208"),
    (dict(gqa=np.array(["group"])), "RA209"),
    (dict(group_rule=jnp.array([0])), "RA209"),
    (dict(selection=np.array(["per_request"])), "RA209"),
    (dict(scale=1 + 2j), "RA113"),
])
def test_array_or_complex_options_are_rankattn_errors(cache, kwargs, code):
    """Regression (found by tests/test_fuzz_args.py): arrays where a Python value belongs raised
    numpy's 'truth value is ambiguous', and a complex scale lost its imaginary part silently."""
    with raises(code):
        serving.attend(q4(), cache, USERS, **kwargs)


def test_impl_containers_are_checked_before_jit(cache):
    """Regression: impl={} or a nested list reached jax.jit as a static argument ('Non-hashable
    static arguments are not supported'); a numpy array of names raised 'truth value is
    ambiguous'. Nested lists are names tried in order, as rankattn.attention takes them."""
    for impl in ({}, np.array(["xla", "cpu"])):
        with raises("RA114", "impl="):
            serving.attend(q4(), cache, USERS, impl=impl)
    with raises("RA114", "impl="):
        rankattn.attention(q4(t=4), q4(t=4, hq=HKV), q4(t=4, hq=HKV),
                           impl=np.array(["xla", "cpu"]))
    nested = serving.attend(q4(), cache, USERS, impl=["xla", ["reference"]])
    np.testing.assert_array_equal(np.asarray(nested),
                                  np.asarray(serving.attend(q4(), cache, USERS, impl="xla")))


# --- attend(..., sharding=): checked before anything runs (RA216 needs real shards and is
# tested in tests/distributed/test_mesh_serving.py). ---------------------------------------------


def _sharding(**roles):
    """A mesh of the one CPU device repeated: enough for checks that run before any trace."""
    devices = np.array([jax.devices()[0]] * 4, dtype=object).reshape(2, 2)
    return rankattn.Sharding(jax.sharding.Mesh(devices, ("data", "ctx")), **roles)


@pytest.mark.parametrize("roles, kwargs, fragments", [
    (dict(batch="data"), {}, ["sharded cache", "(2, 1)", "(12, 2, 4, 8)"]),
    (dict(batch="data", heads="ctx"), {}, ["heads=('ctx',)"]),
])
def test_sharded_attend_arguments(cache, roles, kwargs, fragments):
    with raises("RA215", *fragments):
        serving.attend(q4(), cache, USERS, sharding=_sharding(**roles), **kwargs)


def test_sharded_attend_budget_across_context_shards(cache):
    sharded_view = jax.tree.map(lambda x: jnp.broadcast_to(x, (2, 2) + x.shape), cache)
    with raises("RA215", "budget=8", "context"):
        serving.attend(q4(), sharded_view, USERS, budget=8,
                       sharding=_sharding(batch="data", context="ctx"))


def test_shard_cache_checks_its_caches(cache):
    """Regression (review): shard_cache checked only the counts, with len(row), and a
    PagedKVCache is a tuple of 8: caches of other shapes failed inside jnp.stack, a bfloat16
    shard was silently promoted to float32, arrays failed with AttributeError, and a flat
    list of caches passed where the context shards were 8."""
    sharding = _sharding(batch="data")
    other_pages = serving.cache_from_history(jnp.ones((3, 10, HKV, D)), jnp.ones((3, 10, HKV, DV)),
                                             jnp.array([10, 5, 0]), page_size=P, num_pages=16,
                                             max_pages=4)
    with raises("RA201", "caches[1][0].k_pages", "(16,", "caches[0][0].k_pages"):
        serving.shard_cache([[cache], [other_pages]], sharding=sharding)
    bf16 = jax.tree.map(lambda x: x.astype(jnp.bfloat16) if x.dtype == jnp.float32 else x, cache)
    with raises("RA201", "caches[1][0].k_pages is bfloat16", "float32"):
        serving.shard_cache([[cache], [bf16]], sharding=sharding)
    with raises("RA215", "2 lists of 1 caches", "['PagedKVCache', 'PagedKVCache']"):
        serving.shard_cache([cache, cache], sharding=sharding)
    with raises("RA215", "caches[0][0] is ArrayImpl", "not a PagedKVCache"):
        serving.shard_cache([[cache.k_pages], [cache.k_pages]], sharding=sharding)


# --- Keyword-only options (RA217), stacked caches and layer= (RA218, RA201). --------------------


@pytest.mark.parametrize("call, fragments", [
    (lambda c: serving.attend(q4(), c, USERS, (jnp.ones((2, 3, HKV, D)),) * 2),
     ["attend takes 3 positional arguments (q, cache, users)", "got 4",
      "attend(q, cache, users, self_kv=<tuple>)"]),
    (lambda c: serving.attend(q4(), c, USERS, None, 64),
     ["got 5", "pass each option by its name"]),
    (lambda c: serving.cache_from_history(jnp.ones((2, 8, HKV, D)), jnp.ones((2, 8, HKV, D)),
                                          jnp.array([8, 8]), 4),
     ["cache_from_history(k_hist, v_hist, lengths, page_size=<int>)"]),
    (lambda c: serving.sharded_cache_from_history(jnp.ones((2, 8, HKV, D)),
                                                  jnp.ones((2, 8, HKV, D)), jnp.array([8, 8]),
                                                  _sharding(batch="data"), 4),
     ["sharding=<Sharding>, page_size=<int>"]),
    (lambda c: serving.shard_cache([[c]], _sharding(batch="data")),
     ["shard_cache(caches, sharding=<Sharding>)"]),
])
def test_options_passed_positionally_name_the_keyword(cache, call, fragments):
    """Regression: attend's self_kv, cache_from_history's page_size and
    sharded_cache_from_history's sharding were positional; passing them so now names the
    keyword spelling instead of raising Python's TypeError or reading them differently."""
    with raises("RA217", *fragments):
        call(cache)


def test_return_lse_must_be_a_bool(cache):
    with raises("RA116", "return_lse", "int"):
        serving.attend(q4(), cache, USERS, return_lse=1)


@pytest.fixture(scope="module")
def stacked(cache):
    return serving.stack_caches([cache, cache])


@pytest.mark.parametrize("call", [
    lambda s: serving.attend(q4(), s, USERS),
    lambda s: serving.select_pages(q4(), s, USERS, budget=64),
    lambda s: serving.page_bounds(q4(), s, USERS),
    lambda s: serving.append(s, jnp.array([1]), jnp.ones((1, 2, HKV, D)),
                             jnp.ones((1, 2, HKV, DV)), jnp.array([2])),
    lambda s: serving.release(s, jnp.array([1])),
], ids=["attend", "select_pages", "page_bounds", "append", "release"])
def test_a_stacked_cache_needs_a_layer(stacked, call):
    with raises("RA218", "stack of 2 layers", "(2, 12, 2, 4, 8)", "layer=i", "jax.lax.scan"):
        call(stacked)


@pytest.mark.parametrize("layer, fragments", [
    (2, ["layer=2", "outside the stack's 2 layers", "0 <= layer < 2"]),
    (-1, ["layer=-1", "0 <= layer < 2"]),
    (1.0, ["layer=1.0", "float", "int index"]),
    (True, ["layer=True", "int index"]),
    (jnp.array([0, 1]), ["int32 array of shape (2,)", "integer scalar"]),
])
def test_a_bad_layer_index(stacked, layer, fragments):
    with raises("RA218", *fragments):
        serving.attend(q4(), stacked, USERS, layer=layer)


def test_a_layer_of_a_cache_without_layers(cache):
    with raises("RA218", "layer=0", "no layer axis", "(12, 2, 4, 8)", "stack_caches"):
        serving.append(cache, jnp.array([1]), jnp.ones((1, 2, HKV, D)),
                       jnp.ones((1, 2, HKV, DV)), jnp.array([2]), layer=0)


def test_a_sharded_or_stacked_cache_passed_as_one_layer(cache):
    """Regression: a cache with extra leading axes reached check_cache's 4-way unpacking and
    raised Python's ValueError; it is RA201 naming sharding= and layer=."""
    sharded = jax.tree.map(lambda x: x[None, None], cache)
    with raises("RA201", "(1, 1, 12, 2, 4, 8)", "sharding=", "layer="):
        serving.attend(q4(), sharded, USERS)


@pytest.mark.parametrize("caches, fragments", [
    ([], ["non-empty list", "got a list of []"]),
    (lambda c: c, ["got PagedKVCache"]),
    (lambda c: [c, {"k": 1}], ["dict"]),
    (lambda c: [c, c._replace(k_pages=c.k_pages[:6], v_pages=c.v_pages[:6])],
     ["caches[1].k_pages", "(6, 2, 4, 8)", "(12, 2, 4, 8)"]),
    (lambda c: [c, c._replace(k_pages=c.k_pages.astype(jnp.bfloat16))], ["bfloat16"]),
    (lambda c: [serving.stack_caches([c])], ["already stacked"]),
])
def test_stack_caches_needs_equal_single_layer_caches(cache, caches, fragments):
    with raises("RA201", *fragments):
        serving.stack_caches(caches(cache) if callable(caches) else caches)


@pytest.mark.parametrize("call, fragment", [
    (lambda: serving.empty_cache(num_users=2, num_pages=4, page_size=4, kv_heads=1, head_dim=4,
                                 num_layers=0), "num_layers=0"),
    (lambda: serving.cache_from_history(jnp.ones((2, 3, 8, HKV, D)), jnp.ones((3, 3, 8, HKV, D)),
                                        jnp.array([8, 8, 8])), "(3, 3, 8, 2, 8)"),
    (lambda: serving.cache_from_history(jnp.ones((2, 3, 8, HKV, D)), jnp.ones((3, 8, HKV, D)),
                                        jnp.array([8, 8, 8])), "every axis but the last"),
])
def test_malformed_stacked_history_or_layout(call, fragment):
    with raises("RA212", fragment):
        call()


def test_a_sharded_cache_outside_attend_says_how_to_take_one_shard(cache):
    """Review (stop 72): select_pages and page_bounds said a sharded cache "needs sharding=",
    an argument they do not have, and a stack of sharded caches with layer= had "no layer
    axis"."""
    with raises("RA201", "select_pages and page_bounds score one shard's cache"):
        serving.select_pages(q4(), jax.tree.map(lambda x: x[None, None], cache), USERS,
                             budget=64)
    stack = jax.tree.map(lambda x: x[None, None, None], cache)
    with raises("RA218", "a stack of sharded caches", "x[:, i, j]"):
        serving.page_bounds(q4(), stack, USERS, layer=0)
    with raises("RA218", "a stack of sharded caches", "pass sharding= with it"):
        serving.attend(q4(), stack, USERS, layer=0)
