"""Values wider than the kernels' int32 and float32, and options of the wrong kind: refused
with a rankattn error, never wrapped into range, turned into NaN, a deep exception or a dead
process (regressions found by probing the public functions with such values)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

import rankattn
from rankattn import serving
from rankattn.phoenix import ranker_attention_fa3, ranker_attention_v2
from test_serving_errors import raises

WIDE = 2**32 + 2  # int32 would read it as 2


@pytest.fixture(scope="module")
def qkv():
    rng = np.random.default_rng(0)
    return tuple(rng.normal(size=(1, 4, h, 4)).astype(np.float32) for h in (2, 1, 1))


def test_wide_bounds_are_refused_not_wrapped(qkv):
    """bounds (4,) of (0, 2**32 + 2, 2, 4) ran as (0, 2, 2, 4); the [B, 4] form was refused."""
    for bounds in (np.array([0, WIDE, 2, 4]), np.array([[0, WIDE, 2, 4]])):
        with raises("RA109", str(WIDE)):
            rankattn.attention(*qkv, bounds=bounds, impl="xla")
    with raises("RA109", str(WIDE)):
        ranker_attention_fa3._normalize_bound((0, WIDE, 2, 4), 1, 4)


def test_wide_cu_seqlens_are_refused_not_wrapped():
    """cu_seqlens [0, 2**32 + 2, 4] (decreasing) gave segment ids [1, 1, -2, -2]."""
    with raises("RA123", "cu_seqlens", str(WIDE)):
        rankattn.segment_ids_from_cu_seqlens(np.array([0, WIDE, 4]), np.array([1, 1, -1, -1]))


def test_phoenix_v2_reads_a_wide_segment_id_as_a_candidate(qkv):
    """Phoenix's v2 ids: 1 history, 0 padding, anything else a candidate; 2**32 + 1 wrapped to
    1 and ran as history."""
    q, k, v = qkv
    temp = np.ones((1, 4), np.float32)
    wide = ranker_attention_v2.mha(q, k, v, temp, np.array([[1, 1, 2**32 + 1, 2**32 + 1]]),
                                   causal=False)
    candidates = ranker_attention_v2.mha(q, k, v, temp, np.array([[1, 1, 2, 2]]), causal=False)
    np.testing.assert_array_equal(np.asarray(wide), np.asarray(candidates))


def test_wide_append_counts_are_refused_not_wrapped():
    """counts 2**32 + 1 appended 1 token."""
    cache = serving.empty_cache(num_users=1, num_pages=4, page_size=2, kv_heads=1, head_dim=2)
    new = jnp.ones((1, 2, 1, 2))
    with raises("RA211", "counts", str(2**32 + 1)):
        serving.append(cache, np.array([0]), new, new, np.array([2**32 + 1]))


def test_sizes_past_int32_are_refused_not_a_dead_process():
    """plan(seq_len=2**62) and empty_cache(page_size=2**62) aborted the process in XLA
    (absl::BadStatusOrAccess); seq_len=2.5 was reported as a bounds error."""
    for seq_len in (2**62, 2.5, 0):
        with raises("RA117", "seq_len"):
            rankattn.plan(bounds=np.array([0, 0, 0, 0]), seq_len=seq_len)
    with raises("RA212", "too large", "(num_pages + 1) * kv_heads * page_size"):
        serving.empty_cache(num_users=1, num_pages=2**62, page_size=2**62, kv_heads=1,
                            head_dim=1)
    # Regression (review): the pages' rows (page, kv head, token; a write's padding goes to
    # one page past the last) are int32 indices of the store's writes; 2**31 or more of them
    # wrapped (a write into another row), unrefused.
    with raises("RA212", "too large", "(num_pages + 1) * kv_heads * page_size = 2147483648"):
        serving.empty_cache(num_users=1, num_pages=2**20 - 1, page_size=2**9, kv_heads=4,
                            head_dim=1)
    with raises("RA212", "too large", "elements"):
        serving.empty_cache(num_users=1, num_pages=2**10, page_size=2**10, kv_heads=2**10,
                            head_dim=2**19)


@pytest.mark.parametrize("kwargs, code", [
    (dict(scale=1e39), "RA113"), (dict(scale=1e-40), "RA113"), (dict(scale=10**400), "RA113"),
    (dict(softcap=1e39), "RA111"), (dict(softcap=1e-40), "RA111"),
    (dict(softcap=10**400), "RA111")])
def test_scale_and_softcap_must_be_float32_normals(qkv, kwargs, code):
    """1e39 is finite in Python and inf in float32 (every output NaN); a subnormal softcap was
    ignored by the cpu kernel and applied by xla; 10**400 raised OverflowError."""
    with raises(code):
        rankattn.attention(*qkv, **kwargs)


def test_a_store_acquire_timeout_must_be_a_number():
    """timeout=nan waited forever at full CPU; 'x' raised TypeError; inf OverflowError."""
    store = serving.HistoryStore(num_layers=1, kv_heads=1, head_dim=2, page_size=2,
                                 device_pages=4, max_users=2, max_pages_per_user=2)
    with store.acquire([0], [0], [2], timeout=float("inf")) as lease:
        assert lease.source == ["miss"]
        for timeout in (float("nan"), -1, "x", True):
            with raises("RA223", "timeout"):
                store.acquire([0], [0], [2], timeout=timeout)


def test_options_of_the_wrong_kind_are_rankattn_errors(qkv):
    """Regressions: Xla('x') or Cpu(64) failed later with AttributeError 'block_q'; plan='x'
    with AttributeError 'shape'; HistoryStore(policy=['lru']) with 'unhashable type';
    dtype='nope' with numpy's 'data type not understood'."""
    from rankattn.backends import Cpu, Xla
    from rankattn.backends.pallas_triton import PallasTriton

    for make in (lambda: Xla("x"), lambda: Cpu(64),
                 lambda: PallasTriton((16, 16), interpret=True)):
        with raises("RA116", "block_sizes="):
            make()
    with raises("RA117", "plan="):
        rankattn.attention(*qkv, plan="x")
    config = dict(num_layers=1, kv_heads=1, head_dim=2, page_size=2, device_pages=4,
                  max_users=2, max_pages_per_user=2)
    for options in (dict(policy=["lru"]), dict(history=["causal"])):
        with raises("RA219"):
            serving.HistoryStore(**config, **options)
    with raises("RA219", "HistoryStore", "'nope'"):
        serving.HistoryStore(**config, dtype="nope")
