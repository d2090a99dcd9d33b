"""What the three Phoenix drop-ins share: cap options, the z-loss gradient, and attention
with Phoenix's causal rule (which, unlike rankattn's, also applies to candidates)."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from rankattn import distributed, semantics
from rankattn.api import BACKENDS, attention, resolve_impls, select_backend
from rankattn.errors import fail
from rankattn.validate import (check_attention_args, check_scale, check_softcap, concrete,
                               static_float)


def cap_options(cap, cap_method) -> dict:
    """rankattn's softcap options for Phoenix's ``cap`` / ``cap_method``: ``cap <= 0`` or
    ``"none"`` is no cap (ranker_attention_fa3.py:31-40). Checked here, so that an error names
    Phoenix's arguments and choices (rankattn's own would name softcap and softcap_method)."""
    cap = static_float("cap (the softcap)", cap, "RA111")
    methods = (*semantics.SOFTCAP_METHODS, "none")
    if not isinstance(cap_method, str) or cap_method not in methods:
        raise fail("RA112", f"cap_method={cap_method!r}; use one of "
                            f"{', '.join(map(repr, methods))} ('none': no cap).")
    if cap_method == "none" or cap <= 0.0:
        return dict(softcap=None, softcap_method="tanh")
    cap = check_softcap("cap", cap, "or cap <= 0 (or cap_method='none') for no cap")
    return dict(softcap=cap, softcap_method=cap_method)


def scalar_options(sm_scale, cap, cap_method, z_loss_weight) -> tuple[dict, float]:
    """(rankattn's scale and cap options, the z-loss weight) from Phoenix's arguments, each a
    Python number (they select the compiled program, as rankattn's scale does): RA113
    (sm_scale), RA111 / RA112 (cap, cap_method) or RA129 (z_loss_weight) naming the argument
    for a string, a bool, None, a traced array, an overflowing int or a value no kernel can
    use (a scale of 0 or inf, an infinite cap, a weight that is not finite)."""
    scale = check_scale("sm_scale", static_float("sm_scale (the scale)", sm_scale, "RA113"),
                        "e.g. Phoenix's sqrt(128) / key_size.")
    options = dict(scale=scale, **cap_options(cap, cap_method))
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
    if not any(backend.takes_shard_mask for backend in resolve_impls(impl)):
        able = [name for name, backend in BACKENDS.items() if backend.takes_shard_mask]
        raise fail("RA115", f"impl={impl!r} cannot run Phoenix's causal=True, under which "
                            "candidates are causal too: rankattn runs it as a history part "
                            "whose queries and keys carry different segment ids, which only "
                            f"{', '.join(map(repr, able))} take. Pass causal=False, as "
                            "Phoenix's model does, or impl='auto' or one of those.")
    positions = jnp.broadcast_to(jnp.arange(q.shape[1], dtype=jnp.int32), segment_ids.shape)
    history_keys = jnp.where(segment_ids > 0, segment_ids, 0).astype(jnp.int32)
    history_call = dataclasses.replace(
        call, shard_mask=semantics.ShardMask(history_keys, positions, positions))
    history = select_backend(impl, history_call)(history_call)
    return distributed.add_own_keys(call, history, call.q, call.k, call.v, segment_ids,
                                    call.logit_multiplier)


def with_z_loss(f, weight: float, q, k, v, *masks):
    """``f(q, k, v, *masks) -> (out, lse)``, whose backward also adds the gradient of
    ``weight / 2 * sum(lse ** 2)`` (rows with lse -inf add nothing), whatever the cotangents;
    ``weight <= 0`` adds nothing, as Phoenix's kernels test ``z_loss_weight > 0``.

    ``masks`` (bounds, ids, ``temp``, or None) are tracers when the layer runs inside
    ``lax.scan``, ``jax.checkpoint`` or a ``jit`` that takes them as arguments. A custom VJP
    may not close over a tracer, so traced ones are its inputs (with no gradient, as without
    the z-loss); concrete ones stay closed over, so their blocks are planned now."""
    if weight <= 0:
        return f(q, k, v, *masks)
    traced = [i for i, m in enumerate(masks) if m is not None and concrete(m) is None]

    def with_traced(values):
        return [values[traced.index(i)] if i in traced else m for i, m in enumerate(masks)]

    @jax.custom_vjp
    def g(q, k, v, *values):
        return f(q, k, v, *with_traced(values))

    def forward(q, k, v, *values):
        (out, lse), pullback = jax.vjp(lambda q, k, v: f(q, k, v, *with_traced(values)), q, k, v)
        return (out, lse), (pullback, lse, values)

    def backward(residuals, cotangents):
        pullback, lse, values = residuals
        d_out, d_lse = cotangents
        grads = pullback((d_out, d_lse + weight * jnp.where(jnp.isfinite(lse), lse, 0)))
        return (*grads, *(None for _ in values))

    g.defvjp(forward, backward)
    return g(q, k, v, *(masks[i] for i in traced))
