"""Dense reference: the ground truth every other backend is tested against.

It materialises the full [B, Hq, S, S] logits in float32 (float64 for float64
inputs) and differentiates by plain autodiff, so it is slow and memory-hungry
by design and simple enough to check by eye against :mod:`rankattn.semantics`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from rankattn import semantics
from rankattn.backends.base import Backend, compute_dtype
from rankattn.validate import AttentionCall

# The reference declines calls whose logits alone would exceed this.
MAX_LOGITS_BYTES = 4 << 30


def reference_attention(q, k, v, segment_ids, *, causal: bool, scale: float,
                        softcap: float | None, softcap_method: str,
                        shard_mask: semantics.ShardMask | None = None, logit_multiplier=None):
    """Dense attention. Shapes as :func:`rankattn.attention`; segment_ids int [B, S] or None;
    logit_multiplier float32 [B, Sq, Hq] (finite) or None.

    With a ``shard_mask`` (rankattn.distributed) only the history part of the mask, at the
    given positions and with the keys' own segment ids."""
    dtype = compute_dtype(q.dtype)
    groups = q.shape[2] // k.shape[2]
    (q, q_poison), (k, k_poison), (v, v_poison) = map(semantics.split_nonfinite, (q, k, v))
    qf = q.astype(dtype)
    kf = jnp.repeat(k.astype(dtype), groups, axis=2)
    vf = jnp.repeat(v.astype(dtype), groups, axis=2)
    s = jnp.einsum("bqhd,bkhd->bhqk", qf, kf, precision="highest") * scale
    s = semantics.softcap(s, softcap, softcap_method)
    if logit_multiplier is not None:
        s = s * logit_multiplier.transpose(0, 2, 1)[..., None].astype(dtype)

    if segment_ids is None:
        seg_q, seg_k = jnp.ones(q.shape[:2], jnp.int32), jnp.ones(k.shape[:2], jnp.int32)
    else:
        seg_q = seg_k = segment_ids
    if shard_mask is None:
        mask = semantics.dense_mask(seg_q, seg_k, causal)[:, None]
    else:
        mask = semantics.dense_mask(seg_q, shard_mask.kv_segment_ids, causal,
                                    shard_mask.q_positions, shard_mask.kv_positions,
                                    own_key=False)[:, None]

    # Masked logits are replaced before exp (not after) so that neither the
    # forward nor the gradient ever touches exp of a huge or -inf value.
    m = jax.lax.stop_gradient(jnp.max(jnp.where(mask, s, -jnp.inf), axis=-1, keepdims=True))
    m = jnp.where(jnp.isfinite(m), m, 0)
    p = jnp.where(mask, jnp.exp(jnp.where(mask, s, m) - m), 0)
    l = p.sum(-1, keepdims=True)
    seen = l > 0
    safe_l = jnp.where(seen, l, 1)
    # A row that sees nothing is 0 through a where, which drops its cotangent (a NaN one
    # times p = 0 would reach dv).
    out = jnp.where(seen.transpose(0, 2, 1, 3), jnp.einsum("bhqk,bkhd->bqhd", p / safe_l, vf,
                                                           precision="highest"), 0)
    lse = jnp.where(seen, m + jnp.log(safe_l), -jnp.inf)[..., 0]
    # Rows that see a key whose k or v is non-finite (in their kv head) are poisoned.
    key_poison = jnp.repeat(k_poison + v_poison, groups, axis=2).transpose(0, 2, 1)[:, :, None]
    sees_poison = (mask & jnp.isnan(key_poison)).any(-1)                  # [B, Hq, Sq]
    lse = jnp.where(sees_poison, jnp.nan, lse)
    out = jnp.where(sees_poison.transpose(0, 2, 1)[..., None], jnp.nan, out)
    return semantics.poison_rows(out.astype(q.dtype), lse.astype(dtype), q_poison)


class Reference(Backend):
    name = "reference"
    takes_shard_mask = True

    def not_supported_reasons(self, call: AttentionCall) -> list[str]:
        b, sq, hq, _ = call.q.shape
        size = jnp.dtype(compute_dtype(call.q.dtype)).itemsize  # float64 logits take 8 bytes
        nbytes = b * hq * sq * call.k.shape[1] * size
        if nbytes > MAX_LOGITS_BYTES:
            return [f"reference: the dense logits would take {nbytes / 2**30:.1f} GiB "
                    f"(B={b} x Hq={hq} x {sq} x {call.k.shape[1]} x {size} bytes), over its "
                    f"{MAX_LOGITS_BYTES / 2**30:.0f} GiB limit; use impl='xla'"]
        return []

    def __call__(self, call: AttentionCall):
        return reference_attention(call.q, call.k, call.v, call.segment_ids, causal=call.causal,
                                   scale=call.scale, softcap=call.softcap,
                                   softcap_method=call.softcap_method,
                                   shard_mask=call.shard_mask,
                                   logit_multiplier=call.logit_multiplier)
