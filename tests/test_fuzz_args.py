"""Fuzzing the argument checks: any mix of ranks, shapes, dtypes and Python objects given to the
public functions gives a result or a rankattn error, never another exception from deep inside
JAX or numpy, and never a crash."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import rankattn
from rankattn import serving

DTYPES = [np.float32, jnp.bfloat16, np.float16, np.float64, np.int32, np.int64, np.uint8,
          np.bool_, np.complex64]
OBJECTS = st.sampled_from([None, 0, 1, -1, 2.5, float("nan"), True, "x", "tanh", b"1", [1, 2],
                           [[1.0]], (), {}, object(), slice(1), jnp.float32])


@st.composite
def arrays(draw, max_rank=5):
    rank = draw(st.integers(0, max_rank))
    shape = tuple(draw(st.lists(st.integers(0, 3), min_size=rank, max_size=rank)))
    dtype = draw(st.sampled_from(DTYPES))
    values = np.random.default_rng(draw(st.integers(0, 99))).normal(size=shape) * 3
    x = values.astype(dtype)
    return jnp.asarray(x) if draw(st.booleans()) and dtype not in (np.float64, np.int64) else x


def anything():
    return st.one_of(arrays(), OBJECTS)


@st.composite
def good_qkv(draw):
    """Valid-looking q, k, v most of the time, so later arguments get checked too."""
    b, s, hkv, g, d = (draw(st.integers(1, 3)) for _ in range(5))
    dtype = draw(st.sampled_from([np.float32, jnp.bfloat16]))
    rng = np.random.default_rng(draw(st.integers(0, 99)))
    make = lambda *shape: rng.normal(size=shape).astype(dtype)
    return make(b, s, hkv * g, d), make(b, s, hkv, d), make(b, s, hkv, d)


def calls_cleanly(fn, *args, **kwargs):
    try:
        fn(*args, **kwargs)
    except rankattn.RankattnError:
        pass


FUZZ = settings(max_examples=6 * settings.default.max_examples, deadline=None,
                suppress_health_check=list(HealthCheck))


@FUZZ
@given(data=st.data())
def test_attention_arguments(data):
    q, k, v = data.draw(st.one_of(good_qkv(), st.tuples(anything(), anything(), anything())))
    kwargs = {}
    for name in ("segment_ids", "bounds", "causal", "scale", "softcap", "softcap_method",
                 "return_lse", "impl", "plan"):
        if data.draw(st.booleans()):
            kwargs[name] = data.draw(anything(), label=name)
    calls_cleanly(rankattn.attention, q, k, v, **kwargs)


@FUZZ
@given(data=st.data())
def test_plan_arguments(data):
    kwargs = {name: data.draw(anything(), label=name)
              for name in ("segment_ids", "bounds", "seq_len", "causal", "impls")
              if data.draw(st.booleans())}
    calls_cleanly(rankattn.plan, **kwargs)


@FUZZ
@given(data=st.data())
def test_serving_arguments(data):
    cache = serving.cache_from_history(np.ones((2, 5, 1, 2), np.float32),
                                       np.ones((2, 5, 1, 2), np.float32), np.array([5, 2]),
                                       page_size=2)
    args = [data.draw(st.one_of(st.just(np.ones((2, 1, 2, 2), np.float32)), anything()), label="q"),
            data.draw(st.one_of(st.just(cache), anything()), label="cache"),
            data.draw(st.one_of(st.just(np.array([0, 1])), anything()), label="users")]
    kwargs = {name: data.draw(anything(), label=name)
              for name in ("self_kv", "budget", "gqa", "sink_pages", "recent_pages", "scale",
                           "softcap")
              if data.draw(st.booleans())}
    calls_cleanly(serving.attend, *args, **kwargs)
    calls_cleanly(serving.append, cache, *[data.draw(anything(), label=n)
                                            for n in ("users", "k_new", "v_new", "counts")])
