"""Drop-in for Phoenix's ``ranker_attention_v2.mha`` (phoenix/xrex/pallas/ranker_attention_v2.py
at x-algorithm 28e414f), computed by :func:`rankattn.attention`."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from rankattn.errors import fail
from rankattn.phoenix._shared import attend, scalar_options, with_z_loss
from rankattn.validate import as_array, check_static_bool, check_tensor, concrete

__all__ = ["mha", "mha_inference_gqa"]


def mha(q, k, v, temp, segment_ids, sm_scale=1.0, cap=-1.0, cap_method="tanh", causal=True,
        window_len=-1, z_loss_weight=0.0, block_q_fwd=128, block_k_fwd=128,
        block_q_bwd_dq=128, block_k_bwd_dq=16, block_q_bwd_dkv=16, block_k_bwd_dkv=128,
        backward_pass_impl="triton_split", num_warps=None, num_stages=2, grid=None,
        interpret=False, debug=False, *, impl="auto"):
    """Phoenix's v2 ranker attention: per-token ids, one session per row.

    Args:
      q: [B, S, Hq, D]; k, v: [B, S, Hkv, D], float32 / bfloat16 / float16, any S and D.
        Hq a multiple of Hkv (Phoenix's v2 needs Hq == Hkv and the model repeats K/V;
        repeated K/V give the same result here).
      temp: real [B, S] (int or float, concrete or traced), per query: multiplies the
        logits after the cap, on every key the query sees, its own included (v2:117-138,
        as rankattn's ``logit_multiplier``); no gradient (v2:934). The model passes int32
        ones (phoenix/xrex/models/layers.py:300). Any values, with any cap; a non-finite
        one makes its row NaN. Another shape or dtype raises RA124.
      segment_ids: int [B, S]: 1 history, 0 padding, any other value a candidate
        (v2:24-26, 41-48). Key j is visible to query i iff i is not padding, and j is
        history or j == i, and with ``causal`` j <= i (v2:117-138): ``causal`` applies to
        candidates too, unlike rankattn's own ``causal``. A padding row outputs 0.
      sm_scale, cap, cap_method, z_loss_weight: see :mod:`rankattn.phoenix`.
      causal: default True, as in Phoenix (the model passes False).
      window_len: ignored, as Phoenix deletes it (v2:85).
      block_*, backward_pass_impl, num_warps, num_stages, grid, interpret, debug: Phoenix's
        kernel options; accepted and ignored (rankattn picks its own tiles).
      impl: rankattn's backend choice, as in :func:`rankattn.attention` (every backend
        applies the temp in its kernels). With ``causal`` the history part runs on a
        backend taking split query / key ids (cpu, xla or reference). A temp known to be all
        ones is dropped (no multiplier to apply).

    Returns:
      out [B, S, Hq, D] in q's dtype (only ``out``, as Phoenix).
    """
    del (window_len, block_q_fwd, block_k_fwd, block_q_bwd_dq, block_k_bwd_dq, block_q_bwd_dkv,
         block_k_bwd_dkv, backward_pass_impl, num_warps, num_stages, grid, interpret, debug)
    return _attend(q, k, v, temp, segment_ids, sm_scale, cap, cap_method, causal,
                   z_loss_weight, impl)


def mha_inference_gqa(q, k, v, temp, segment_ids, sm_scale=1.0, cap=-1.0, cap_method="tanh",
                      block_q=128, block_k=128, num_warps=None, num_stages=2, interpret=False,
                      debug=False, *, impl="auto"):
    """Phoenix's v2 inference forward with grouped K/V (ranker_attention_v2.py:328-412).

    Phoenix's inference model calls it off H100 (phoenix/xrex/models/recsys_attention.py:
    140-151) with K/V not repeated: query head h reads kv head h // (Hq // Hkv), as here.

    Args:
      q: [B, S, Hq, D]; k, v: [B, S, Hkv, D] with Hq a multiple of Hkv; float32 / bfloat16 /
        float16, any S and D (Phoenix: S a multiple of its blocks).
      temp, segment_ids, sm_scale, cap, cap_method: as :func:`mha`. The mask is :func:`mha`'s
        with ``causal=False`` (Phoenix's function has no ``causal``): key j is visible to
        query i iff i is not padding and j is history (id 1) or j == i.
      block_q, block_k, num_warps, num_stages, interpret, debug: Phoenix's kernel options;
        accepted and ignored.
      impl: rankattn's backend choice, as in :func:`rankattn.attention`.

    Returns:
      out [B, S, Hq, D] in q's dtype (only ``out``, as Phoenix; differentiable here, where
      Phoenix's kernel has no VJP).

    Where Phoenix's kernel differs: it visits every key block up to the last one holding a
    history token (``block_k`` = 128) without a key mask, so every non-padding query also
    sees the candidate and padding keys inside those blocks: candidates in the last history
    block see the other candidates there (in its model, 1 + 1024 history tokens in 1152, that
    block holds every candidate), and left padding in those blocks is seen by everyone.
    rankattn computes the mask above exactly.
    """
    del block_q, block_k, num_warps, num_stages, interpret, debug
    return _attend(q, k, v, temp, segment_ids, sm_scale, cap, cap_method, False, 0.0, impl)


def _attend(q, k, v, temp, segment_ids, sm_scale, cap, cap_method, causal, z_loss_weight, impl):
    """out of Phoenix's v2 mask function, ``temp`` multiplying the capped logits per query."""
    causal = check_static_bool("causal", causal)  # a truthy "False" must not run causal
    check_tensor("q", q, "[B, S, Hq, D]")  # before temp is checked against its shape
    _check_temp(temp, q.shape[:2])
    form = "[B, S] of Phoenix's ids (1 history, 0 padding, any other a candidate)"
    segment_ids = as_array("segment_ids", segment_ids, "RA107", form)
    if not jnp.issubdtype(segment_ids.dtype, jnp.integer):  # a float 0.5 was a candidate
        raise fail("RA107", f"segment_ids has dtype {segment_ids.dtype}; pass an int array "
                            f"{form}, e.g. ids.astype(jnp.int32).")
    # Concrete ids are compared as they are: cast to int32 first, 2**32 + 1 (a candidate)
    # would wrap to 1 (history).
    known = concrete(segment_ids)
    ids = jnp.asarray(segment_ids) if known is None else known
    ids = jnp.where(ids == 1, 1, jnp.where(ids == 0, 0, -1)).astype(jnp.int32)
    values = concrete(temp)  # all ones, known now: no multiplier (every backend runs that)
    multiplier = None if values is not None and (values == 1).all() else temp
    scalars, z_loss_weight = scalar_options(sm_scale, cap, cap_method, z_loss_weight)
    options = dict(causal=causal, impl=impl, **scalars)

    def outputs(q, k, v, ids, multiplier):
        return attend(q, k, v, ids, logit_multiplier=multiplier, **options)

    return with_z_loss(outputs, z_loss_weight, q, k, v, ids, multiplier)[0]


def _check_temp(temp, shape):
    """RA124 unless temp is a real array [B, S] (concrete or traced)."""
    temp = as_array("temp", temp, "RA124", f"it must be a real array [B, S] = {tuple(shape)}, "
                                           "one value per query (Phoenix's model passes ones).")
    if tuple(temp.shape) != tuple(shape):
        raise fail("RA124", f"temp has shape {tuple(temp.shape)}; it must be [B, S] = "
                            f"{tuple(shape)}, one value per query (Phoenix's model passes "
                            "jnp.ones(segment_ids.shape)).")
    if not (jnp.issubdtype(temp.dtype, jnp.integer) or jnp.issubdtype(temp.dtype, jnp.floating)):
        raise fail("RA124", f"temp has dtype {temp.dtype}; it must be a real array [B, S] "
                            "(int or float), one value per query. Cast it with "
                            ".astype(jnp.float32).")
