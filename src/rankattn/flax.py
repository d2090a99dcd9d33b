"""rankattn as the ``attention_fn`` of Flax NNX attention layers (needs ``rankattn[flax]``).

::

    import rankattn
    import rankattn.flax
    from flax import nnx

    layer = nnx.MultiHeadAttention(num_heads=4, num_kv_heads=2, in_features=64, decode=False,
                                   attention_fn=rankattn.flax.attention_fn(softcap=30.0),
                                   rngs=nnx.Rngs(0))
    plan = rankattn.plan(segment_ids=segment_ids)  # int [B, S], once per batch
    y = layer(x, mask=plan)                        # x [B, S, 64]; every layer takes the same plan

**The mask travels per call, as a plan, through** ``mask=``. Flax models pass each batch's
mask to every attention layer as ``layer(x, mask=...)``, and ``nnx.MultiHeadAttention``
forwards it to its ``attention_fn`` unchanged. With this adapter that argument is a
:class:`rankattn.Plan` (or None) instead of a boolean ``[batch..., heads, Sq, Skv]`` array:
the model builds one plan per batch from the segment ids (inside or outside ``nnx.jit``;
a plan is a pytree) and threads it where it would thread a dense mask, so no ``S x S``
mask is ever built and every layer reuses the plan's block lists. Options that are the
same for every batch (soft cap, scale, backend) belong to the layer, in
:func:`attention_fn`. A boolean mask is refused (``RA301``): a rankattn mask is segment
ids, and an arbitrary boolean matrix has no segment-id spelling.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

try:
    from flax.nnx.nn import dtypes
except ImportError as e:  # flax is an optional extra
    raise ImportError("rankattn.flax needs Flax; install it with pip install 'rankattn[flax]' "
                      "(or 'rankattn[ranker]', which includes it).") from e

from rankattn.api import attention, resolve_impls
from rankattn.errors import fail
from rankattn.planning import Plan
from rankattn.validate import check_logit_options

__all__ = ["AttentionFn", "attention_fn"]


def attention_fn(*, scale: float | None = None, softcap: float | None = None,
                 softcap_method: str = "tanh", impl="auto") -> AttentionFn:
    """An ``attention_fn`` for ``nnx.MultiHeadAttention`` that runs :func:`rankattn.attention`.

    Args:
      scale: logit scale, default ``1 / sqrt(head_dim)`` (what
        ``nnx.dot_product_attention`` uses).
      softcap: optional positive cap of the logits, applied after scaling.
      softcap_method: ``'tanh'`` or ``'soft_sign'``, as in :func:`rankattn.attention`.
      impl: the backend, as in :func:`rankattn.attention`.

    Returns:
      An :class:`AttentionFn`, a frozen (hashable, comparable) callable with the signature
      of ``nnx.dot_product_attention``. The options are checked here, so a bad one fails
      when the layer is built.
    """
    # Kept as the checked floats: a jnp scalar would make the function unhashable.
    scale, softcap = check_logit_options(scale, softcap, softcap_method, head_dim=None)
    resolve_impls(impl)
    impl = tuple(impl) if isinstance(impl, list) else impl  # a list would not hash
    return AttentionFn(scale=scale, softcap=softcap, softcap_method=softcap_method, impl=impl)


@dataclasses.dataclass(frozen=True)
class AttentionFn:
    """``nnx.dot_product_attention``'s signature, computed by :func:`rankattn.attention`.

    Build it with :func:`attention_fn`; ``nnx.MultiHeadAttention`` calls it as
    ``fn(query, key, value, mask=..., dropout_rng=..., dropout_rate=..., broadcast_dropout=...,
    deterministic=..., dtype=..., precision=..., module=..., is_causal=...)``.
    """

    scale: float | None = None
    softcap: float | None = None
    softcap_method: str = "tanh"
    impl: Any = "auto"

    def __call__(self, query, key, value, bias=None, mask=None, broadcast_dropout=True,
                 dropout_rng=None, dropout_rate=0.0, deterministic=False, dtype=None,
                 precision=None, module=None, promote_dtype=dtypes.promote_dtype,
                 is_causal=False):
        """Attention over query [batch..., Sq, Hq, D], key [batch..., Skv, Hkv, D] and value
        [batch..., Skv, Hkv, Dv]; returns [batch..., Sq, Hq, Dv] in the promoted dtype.

        The batch axes are any number (none included) shared by the three; they are
        flattened into one axis of ``prod(batch)`` rows for rankattn and restored after.
        Hq must be a multiple of Hkv (GQA, as ``nnx.MultiHeadAttention(num_kv_heads=)``).

        Args:
          mask: None, or a :class:`rankattn.Plan` of this batch: segment ids
            ``[prod(batch), S]`` (0 padding, +s history of session s, -s candidate of
            session s; see :func:`rankattn.attention`), built with ``rankattn.plan``
            (its ``causal=`` makes history causal). Needs Sq == Skv == S. A query that sees
            no key (padding) gets 0, where ``nnx.dot_product_attention`` would average
            every value. A boolean mask raises ``RA301``.
          is_causal: with ``mask=None``, plain causal attention (query i sees keys
            j <= i; Sq == Skv), equal to Flax's. With a plan it raises ``RA302``: build the
            plan with ``causal=True`` instead (a causal plan keeps candidates seeing their
            whole history, which Flax's causal overlay would not).
          dtype, promote_dtype: q, k and v are cast to one dtype as Flax does
            (``promote_dtype((query, key, value), dtype=dtype)``).
          precision: accepted and not used; rankattn's numerics are its own (float32
            softmax and accumulation; ``impl=rankattn.backends.PallasTriton(precision=...)``
            picks the GPU kernels' dot precision).
          bias: must be None (``RA303``).
          dropout_rate, deterministic, dropout_rng, broadcast_dropout: dropout of the
            attention weights is refused (``RA304``) unless ``dropout_rate == 0`` or
            ``deterministic``.
          module: must be None: attention weights are never formed, so they cannot be sown
            (``sow_weights=True``, ``RA305``).
        """
        del broadcast_dropout, dropout_rng, precision  # meaningful only with dropout / XLA dots
        if bias is not None:
            raise fail("RA303", f"bias of shape {_shape(bias)} was given to the rankattn "
                                "attention_fn; rankattn adds no bias to the logits. Pass "
                                "bias=None (use rotary positions instead of a relative bias), "
                                "or keep nnx.dot_product_attention for this layer.")
        if dropout_rate and not deterministic:
            raise fail("RA304", f"attention dropout is on (dropout_rate={dropout_rate}, "
                                "deterministic=False); rankattn never forms the attention "
                                "weights, so it cannot drop them. Build the layer with "
                                "dropout_rate=0.0 (drop the layer's output instead, with "
                                "nnx.Dropout) or call it with deterministic=True.")
        if module is not None:
            raise fail("RA305", "sow_weights=True asks for the attention weights, which rankattn "
                                "never forms (that is what keeps it O(S) in memory). Call the "
                                "layer with sow_weights=False; to inspect weights, run "
                                "nnx.dot_product_attention_weights on the same query and key.")
        if mask is not None and not isinstance(mask, Plan):
            raise fail("RA301", f"mask has type {type(mask).__name__} and shape {_shape(mask)}; the "
                                "rankattn attention_fn takes mask=None or a rankattn.Plan. Build "
                                "one per batch, plan = rankattn.plan(segment_ids=segment_ids), "
                                "and call the layer with mask=plan. (With decode=True, "
                                "nnx.MultiHeadAttention makes a boolean cache mask itself: "
                                "score against cached history with rankattn.serving instead.)")
        if mask is not None and is_causal:
            raise fail("RA302", "is_causal=True was given together with a plan as mask; the "
                                "plan holds the whole mask. Build the plan with "
                                "rankattn.plan(segment_ids=..., causal=True) and call the "
                                "layer with is_causal=False.")
        query, key, value = promote_dtype((query, key, value), dtype=dtype)
        batch = query.shape[:-3]
        if query.ndim >= 3 and key.shape[:-3] == value.shape[:-3] == batch:
            query, key, value = (x.reshape(math.prod(batch), *x.shape[-3:])
                                 for x in (query, key, value))
        out = attention(query, key, value, plan=mask, causal=is_causal if mask is None else False,
                        scale=self.scale, softcap=self.softcap,
                        softcap_method=self.softcap_method, impl=self.impl)
        return out.reshape(*batch, *out.shape[-3:])


def _shape(x) -> tuple | str:
    return tuple(x.shape) if hasattr(x, "shape") else "(no shape)"
