"""What the three Phoenix drop-ins share: cap options, the z-loss gradient, and attention
with Phoenix's causal rule (which, unlike rankattn's, also applies to candidates)."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from rankattn import distributed, semantics
from rankattn.api import attention, select_backend
from rankattn.errors import fail
from rankattn.validate import check_attention_args, static_float


def cap_options(cap, cap_method) -> dict:
    """rankattn's softcap options for Phoenix's ``cap`` / ``cap_method``: ``cap <= 0`` or
    ``"none"`` is no cap (ranker_attention_fa3.py:31-40)."""
    cap = static_float("cap (the softcap)", cap, "RA111")
    if cap_method == "none" or cap <= 0.0:
        return dict(softcap=None, softcap_method="tanh")
    return dict(softcap=cap, softcap_method=cap_method)


def scalar_options(sm_scale, cap, cap_method, z_loss_weight) -> tuple[dict, float]:
    """(rankattn's scale and cap options, the z-loss weight) from Phoenix's arguments, each a
    Python number (they select the compiled program, as rankattn's scale does): RA113
    (sm_scale), RA111 (cap) or RA129 (z_loss_weight) naming the argument for a string, a bool,
    None, a traced array or an overflowing int; RA129 too for a weight that is not finite."""
    options = dict(scale=static_float("sm_scale (the scale)", sm_scale, "RA113"),
                   **cap_options(cap, cap_method))
    weight = static_float("z_loss_weight", z_loss_weight, "RA129")
    if not math.isfinite(weight):  # its gradient would be NaN everywhere, without a word
        raise fail("RA129", f"z_loss_weight={weight}; it must be finite (0.0: no z-loss).")
    return options, weight


def attend(q, k, v, segment_ids, *, causal: bool, scale, softcap, softcap_method, impl,
           logit_multiplier=None):
    """(out, natural-log lse) of rankattn attention under segment ids [B, S] (or None),
    with Phoenix's ``causal``: every query, candidates included, sees only keys j <= i
    (and always itself). ``logit_multiplier`` (Phoenix's ``temp``, [B, S]) multiplies each
    query's logits after the cap, own key included, as in :func:`rankattn.attention`.

    rankattn's own ``causal`` leaves candidates their whole history, so here the history
    part runs with every non-padding query as a history query (``|id|``) against keys that
    keep their ids only where they are history (the per-shard kernel's split of query and
    key ids, :class:`rankattn.semantics.ShardMask`), and each candidate's own key is merged
    in by log-sum-exp, as context sharding does; the checked multiplier goes to both parts.
    """
    options = dict(scale=scale, softcap=softcap, softcap_method=softcap_method,
                   logit_multiplier=logit_multiplier)
    if not causal or segment_ids is None:
        return attention(q, k, v, segment_ids=segment_ids, causal=causal, return_lse=True,
                         impl=impl, **options)
    call = check_attention_args(q, k, v, segment_ids=jnp.abs(segment_ids), bounds=None,
                                causal=True, **options)
    positions = jnp.broadcast_to(jnp.arange(q.shape[1], dtype=jnp.int32), segment_ids.shape)
    history_keys = jnp.where(segment_ids > 0, segment_ids, 0).astype(jnp.int32)
    history_call = dataclasses.replace(
        call, shard_mask=semantics.ShardMask(history_keys, positions, positions))
    history = select_backend(impl, history_call)(history_call)
    return distributed.add_own_keys(call, history, call.q, call.k, call.v, segment_ids,
                                    call.logit_multiplier)


def with_z_loss(f, weight: float, q, k, v):
    """``f(q, k, v) -> (out, lse)``, whose backward also adds the gradient of
    ``weight / 2 * sum(lse ** 2)`` (rows with lse -inf add nothing), whatever the cotangents."""
    if not weight:
        return f(q, k, v)

    @jax.custom_vjp
    def g(q, k, v):
        return f(q, k, v)

    def forward(q, k, v):
        (out, lse), pullback = jax.vjp(f, q, k, v)
        return (out, lse), (pullback, lse)

    def backward(residuals, cotangents):
        pullback, lse = residuals
        d_out, d_lse = cotangents
        return pullback((d_out, d_lse + weight * jnp.where(jnp.isfinite(lse), lse, 0)))

    g.defvjp(forward, backward)
    return g(q, k, v)
