"""Collectives in the compiled programs of sharded attention (forward, and backward via jax.vjp).

Batch and head sharding must need no collective at all; the ring passes K / V with
collective-permutes and never all-gathers; all_gather gathers (and reduce-scatters
dK / dV backwards) and never permutes. Counted in the optimised HLO of jit(...).compile().
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

import rankattn
from rankattn.distributed import compiled_collectives

S, HQ, HKV, D = 64, 4, 2, 8


def mesh(**axes):
    return Mesh(np.array(jax.devices()).reshape(tuple(axes.values())), tuple(axes))


def census(sharding, batch: int, causal: bool, backward: bool) -> dict[str, int]:
    q = jax.ShapeDtypeStruct((batch, S, HQ, D), jnp.float32)
    kv = jax.ShapeDtypeStruct((batch, S, HKV, D), jnp.float32)
    seg = jax.ShapeDtypeStruct((batch, S), jnp.int32)
    lse = jax.ShapeDtypeStruct((batch, HQ, S), jnp.float32)

    def attend(q, k, v, seg):
        return rankattn.attention(q, k, v, segment_ids=seg, causal=causal, return_lse=True,
                                  sharding=sharding)

    def forward(q, k, v, seg):
        return attend(q, k, v, seg)

    def gradients(q, k, v, seg, d_out, d_lse):
        return jax.vjp(lambda q, k, v: attend(q, k, v, seg), q, k, v)[1]((d_out, d_lse))

    f, args = (gradients, (q, kv, kv, seg, q, lse)) if backward else (forward, (q, kv, kv, seg))
    return compiled_collectives(jax.jit(f).lower(*args).compile().as_text())


@pytest.mark.parametrize("backward", [False, True], ids=["forward", "backward"])
@pytest.mark.parametrize("axes", [dict(batch="data"), dict(batch="data", heads="heads")],
                         ids=["batch", "batch-heads"])
def test_batch_and_head_sharding_need_no_collective(axes, backward):
    m = mesh(data=8) if "heads" not in axes else mesh(data=4, heads=2)
    counts = census(rankattn.Sharding(m, **axes), 8, causal=True, backward=backward)
    assert sum(counts.values()) == 0, counts


@pytest.mark.parametrize("backward", [False, True], ids=["forward", "backward"])
def test_ring_permutes_and_never_gathers(backward):
    sharding = rankattn.Sharding(mesh(ctx=8), context="ctx", strategy="ring")
    counts = census(sharding, 2, causal=False, backward=backward)
    assert counts["collective-permute"] > 0, counts
    assert counts["all-gather"] == counts["all-reduce"] == counts["all-to-all"] == 0, counts


@pytest.mark.parametrize("backward", [False, True], ids=["forward", "backward"])
def test_all_gather_gathers_and_never_permutes(backward):
    sharding = rankattn.Sharding(mesh(ctx=8), context="ctx", strategy="all_gather")
    counts = census(sharding, 2, causal=False, backward=backward)
    assert counts["all-gather"] > 0, counts
    assert counts["collective-permute"] == counts["all-to-all"] == 0, counts
    if backward:  # dK / dV come home summed
        assert counts["reduce-scatter"] + counts["all-reduce"] > 0, counts
