"""The public entry point: :func:`attention`."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from rankattn import distributed, semantics
from rankattn.backends import BACKENDS, Backend
from rankattn.errors import fail
from rankattn.validate import (INT32_MAX, AttentionCall, as_array, check_attention_args,
                               check_static_bool, concrete, int32_array)


def attention(q, k, v, *, segment_ids=None, bounds=None, causal=False, scale=None, softcap=None,
              softcap_method="tanh", logit_multiplier=None, return_lse=False, impl="auto",
              plan=None, sharding=None):
    """Candidate-isolation attention for ranking transformers.

    Args:
      q: [B, Sq, Hq, D] queries; float32, bfloat16 or float16 (float64 with x64).
      k: [B, Skv, Hkv, D] keys, same dtype; Hq must be a multiple of Hkv
        (query head h uses kv head h // (Hq // Hkv); K/V are never repeated).
      v: [B, Skv, Hkv, Dv] values, same dtype.
      segment_ids: optional int [B, S] (needs Sq == Skv). 0 = padding,
        +s = user/history token of session s, -s = candidate of session s.
        Several sessions may be packed in one row, in any order. Key j is
        visible to query i iff both are non-padding, in the same session, and
        either key j is history or i == j is a candidate. So history attends
        bidirectionally within its session, each candidate sees its session's
        history and itself, and nothing crosses sessions. Ids need |s| <= 2**31 - 1
        (RA118; under jit, a traced id past that is padding).
      bounds: optional int [4] or [B, 4] = (hist_lo, hist_hi, cand_lo, cand_hi),
        half-open; the same mask as segment ids 1 on the history range, -1 on
        the candidate range, 0 elsewhere. Give segment_ids or bounds, not both.
      causal: history queries see only history keys j <= i (candidates still
        see their whole session history). With no mask, plain causal attention.
      scale: logit scale, default 1 / sqrt(D).
      softcap: optional positive cap c applied after scaling: 'tanh' gives
        c * tanh(s / c), 'soft_sign' gives s / (1 + |s| / c).
      softcap_method: 'tanh' or 'soft_sign'.
      logit_multiplier: optional real array [B, Sq] (one factor per query) or
        [B, Sq, Hq] (per query and head), any int or float dtype, used as float32:
        query i's logits become t_i * cap(scale * q_i . k_j), after the cap, on
        every key it sees (a candidate's own key included); lse includes it
        (Phoenix's per-query ``temp``). It gets no gradient (as in Phoenix); dq,
        dk and dv account for it. May be traced. A non-finite factor poisons its
        query like a non-finite q (out and lse NaN where it sees a key).
      return_lse: also return the natural-log log-sum-exp of each query row.
      plan: a rankattn.plan(...) of this batch's mask, built once and reused
        by every layer (then segment_ids, bounds and causal are not given).
        Results are bit-identical to passing the mask itself.
      impl: 'auto' (the first of rankattn.available_impls() that can run the
        call, in the order 'pallas_tpu' on a TPU, 'mosaic_gpu' on a Hopper GPU,
        'pallas_triton' on a GPU, 'cpu' (the fused C++ kernel, on CPU where it
        builds), 'xla', 'reference'), a backend
        name, a Backend instance such as
        rankattn.backends.Xla(rankattn.backends.BlockSizes(64, 64)) or
        rankattn.backends.PallasTriton(interpret=True), or a list of those,
        tried in order (the first that can run the call runs it), as
        rankattn.plan's impl= takes. None means 'auto', here and at every
        entry point that takes impl= (plan, serving, phoenix, flax). Build an
        instance once and reuse it: a program compiled for one (a jitted
        function's, or an eager call's with sharding=) serves that instance only.
      sharding: a rankattn.Sharding(mesh, batch=, heads=, context=, strategy=)
        to run on a device mesh: B over the batch axes, Hq and Hkv over the
        head axes, S (and the segment ids) over the context axes, with the
        chosen backend as each device's kernel inside a shard_map. Results are
        those of one device, sharded the same way (lse over batch, heads,
        context). Context sharding needs impl 'pallas_tpu', 'cpu', 'xla' or
        'reference' (or 'auto'): the GPU kernels take no per-shard mask.
        With a plan, batch / head sharding splits its lists over the batch;
        context sharding uses only its segment ids. See rankattn.distributed.

    Returns:
      out [B, Sq, Hq, Dv] in q's dtype, and with return_lse also
      lse [B, Hq, Sq] float32 (float64 for float64 inputs). A query that sees no key gets out = 0,
      lse = -inf and zero gradients (never NaN).

    Mask arrays may be traced (under jit the plan is rebuilt from the new
    values on device). Softmax, scale and accumulators run in float32
    (float64 for float64 inputs); bf16 / f16 operands feed the matmuls as
    they are on GPU / TPU (tensor cores); on CPU bf16 does too (the cpu
    kernel's AMX or AVX-512 BF16 dots where the CPU has them, the xla
    backend's bf16 dots) and f16 is up-cast to float32. Gradients flow to
    q, k, v, including through a cotangent on lse (write z-loss as z / 2 * lse**2 in your loss).

    Raises:
      rankattn.RankattnError (a ValueError or TypeError) naming the argument,
      the values seen and the fix; see docs/errors.md.
    """
    return_lse = check_static_bool("return_lse", return_lse)
    call = check_attention_args(q, k, v, segment_ids=segment_ids, bounds=bounds, causal=causal,
                                scale=scale, softcap=softcap, softcap_method=softcap_method,
                                plan=plan, logit_multiplier=logit_multiplier)
    if sharding is None:
        out, lse = select_backend(impl, call)(call)
    else:
        distributed.check_sharding(call, sharding)
        strategy = distributed.choose_strategy(call, sharding) if sharding.context else None
        backend = select_backend(impl, distributed.local_call(call, sharding, strategy),
                                 per_shard=True)
        out, lse = distributed.sharded_attention(backend, call, sharding, strategy)
    return (out, lse) if return_lse else out


def segment_ids_from_cu_seqlens(cu_seqlens, roles=None, *, length: int | None = None):
    """rankattn segment ids of sessions packed FlashAttention-style (varlen), by ``cu_seqlens``.

    FlashAttention's varlen functions take q [T, H, D] of N sequences packed end to end and
    ``cu_seqlens`` = [0, len_0, len_0 + len_1, ..., T']. This gives the segment ids that
    say the same to :func:`attention`, plus which tokens are history and which candidates::

        seg = rankattn.segment_ids_from_cu_seqlens(cu_seqlens, roles)   # [T]
        out = rankattn.attention(q[None], k[None], v[None], segment_ids=seg[None])[0]

    Args:
      cu_seqlens: int [N + 1], non-decreasing: session n is tokens
        ``cu_seqlens[n] <= t < cu_seqlens[n + 1]``. Tokens before ``cu_seqlens[0]`` or
        from ``cu_seqlens[-1]`` on are padding. May be traced (works under jit).
      roles: optional int [T], each token's role inside its session: > 0 history, < 0
        candidate, 0 padding (the Phoenix ranker's per-token ids 1 / -1 / 0). Default:
        every token of a session is history (plain packed self-attention).
      length: T, the packed length; needed only without ``roles``.

    Returns:
      int32 [T]: ``n + 1`` for a history token of session n, ``-(n + 1)`` for a candidate,
      0 for padding.

    Raises:
      RA123 for a cu_seqlens that is not 1-D int, decreases, starts below 0 or ends past T
      (checked when concrete), or roles that are not int [T].
    """
    if roles is None:
        if (not isinstance(length, (int, np.integer)) or isinstance(length, bool)
                or not 0 <= length <= INT32_MAX):
            raise fail("RA123", f"roles=None needs length=T, the packed length as an int "
                                f"in [0, {INT32_MAX}] (positions are int32); got "
                                f"length={length!r}.")
        roles = np.ones(length, np.int32)
    for name, x in (("cu_seqlens", cu_seqlens), ("roles", roles)):
        x = as_array(name, x, "RA123", "pass a 1-D int array.")
        if x.ndim != 1 or not jnp.issubdtype(x.dtype, jnp.integer):
            raise fail("RA123", f"{name} must be a 1-D int array; got shape {tuple(x.shape)} and "
                                f"dtype {x.dtype}.")
    sessions = "cu_seqlens are token offsets of the packed sessions, roles one sign per token"
    cu_seqlens = int32_array("cu_seqlens", cu_seqlens, "RA123", sessions)
    roles = int32_array("roles", roles, "RA123", sessions)
    if length is not None and length != roles.shape[0]:
        raise fail("RA123", f"length={length!r} but roles has {roles.shape[0]} tokens; pass one "
                            "role per packed token, or leave length out.")
    if cu_seqlens.shape[0] == 0:
        raise fail("RA123", "cu_seqlens is empty; N sessions need N + 1 offsets, e.g. [0, T].")
    values = concrete(cu_seqlens)
    if values is not None and (values[0] < 0 or (np.diff(values) < 0).any()
                               or values[-1] > roles.shape[0]):
        raise fail("RA123", f"cu_seqlens {values.tolist()[:8]}{' ...' if len(values) > 8 else ''}"
                            f" must be non-decreasing from >= 0 to <= T = {roles.shape[0]} "
                            "tokens.")
    return semantics.cu_seqlens_to_segment_ids(cu_seqlens, roles)


def available_impls() -> list[str]:
    """Names of the backends that can run on this machine, in the order impl='auto' tries them."""
    return [name for name, backend in BACKENDS.items() if not backend.platform_reasons()]


def resolve_impls(impl, argument: str = "impl") -> list[Backend]:
    """The backends ``impl`` names: 'auto', a name, a Backend instance, or a list of those.

    'auto' (or None, the same at every entry point that takes ``impl``) gives
    every backend that can run on this machine. A name whose backend cannot run
    here is passed over inside a list (an ``["pallas_triton", "xla"]`` that runs
    anywhere); alone, or where no entry of a list is left, it raises RA115 with the
    reasons. An instance is taken as it is (it may be lowered for another platform).
    """
    return [backend for backend, _ in _runnable(impl, argument)[0]]


def _runnable(impl, argument: str) -> tuple[list[tuple[Backend, bool]], list[str]]:
    """(the backends ``impl`` names that can run here, each with whether 'auto' named it; why
    each named one that cannot); RA115 where none can."""
    backends, why = _resolve(impl, argument)
    if not backends:
        raise fail("RA115", f"{argument}={impl!r} cannot run on this machine:\n    - "
                            + "\n    - ".join(why))
    return backends, why


def _resolve(impl, argument: str) -> tuple[list[tuple[Backend, bool]], list[str]]:
    """(the backends ``impl`` names that can run here, each with whether 'auto' (or None)
    named it, inside a list too; why each named one that cannot)."""
    if isinstance(impl, (list, tuple)):
        if not impl:  # else RA115 would list no reason at all
            raise fail("RA114", f"{argument}={impl!r} names no backend; use 'auto', one of "
                                f"{', '.join(map(repr, BACKENDS))} or a non-empty list.")
        found = [(item, *_resolve(item, argument)) for item in impl]
        return ([b for _, backends, _ in found for b in backends],
                [f"{item!r}: {w}" for item, _, why in found for w in why])
    if isinstance(impl, Backend):
        return [(impl, False)], []
    if impl is None or (isinstance(impl, str) and impl == "auto"):
        return [(b, True) for b in BACKENDS.values() if not b.platform_reasons()], []
    if isinstance(impl, str) and impl in BACKENDS:
        why = BACKENDS[impl].platform_reasons()
        return ([], why) if why else ([(BACKENDS[impl], False)], [])
    raise fail("RA114", f"{argument}={impl!r} is not a backend; use 'auto' or one of "
                        f"{', '.join(map(repr, BACKENDS))}.")


def select_backend(impl, call: AttentionCall, per_shard: bool = False) -> Backend:
    """The first backend of ``impl`` that can run ``call`` (one device's part of a sharded
    call when ``per_shard``: RA122 instead of RA115 when none can)."""
    backends, reasons = _runnable(impl, "impl")
    for backend, by_auto in backends:
        why = backend.not_supported_reasons(call)
        if not why and by_auto:  # 'auto' inside a list too: ["auto", "xla"] is auto first
            why = backend.auto_reasons(call)
        if not why:
            return backend
        reasons += why
    if per_shard:
        raise fail("RA122", f"impl={impl!r} cannot run one shard of this sharded call:\n    - "
                            + "\n    - ".join(reasons))
    raise fail("RA115", f"impl={impl!r} cannot run this call:\n    - " + "\n    - ".join(reasons))
