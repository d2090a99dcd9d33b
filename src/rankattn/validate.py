"""Argument checking for :func:`rankattn.attention`.

Turns the user's arguments into an :class:`AttentionCall` whose fields every
backend can trust: shapes agree, the mask is canonical segment ids (or None),
static options have Python types. Anything wrong raises a catalogued error
(see :mod:`rankattn.errors`) before JAX ever sees it.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from rankattn import semantics
from rankattn.errors import fail

FLOAT_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16, jnp.float64)


@dataclasses.dataclass(frozen=True)
class AttentionCall:
    """A checked attention call. Arrays may be traced; everything else is static."""

    q: jax.Array            # [B, S, Hq, D]
    k: jax.Array            # [B, S, Hkv, D]
    v: jax.Array            # [B, S, Hkv, Dv]
    segment_ids: jax.Array | None  # int32 [B, S]; None = every token is history of one session
    causal: bool
    scale: float
    softcap: float | None
    softcap_method: str
    plan: Any = None  # rankattn.planning.Plan; its segment_ids and causal fill the two fields above
    # Set only by rankattn.distributed for the per-shard kernel: the keys' segment ids and
    # global positions; the call then computes the history part of the mask only.
    shard_mask: semantics.ShardMask | None = None
    # float32 [B, Sq, Hq], finite, no gradient: each query's factor on its logits after the
    # cap (semantics.logits); None = 1.
    logit_multiplier: jax.Array | None = None


def concrete(x) -> np.ndarray | None:
    """x as numpy if its values are known now, else None (traced under jit/vmap)."""
    try:
        return np.asarray(x)
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        return None


def check_tensor(name: str, x, layout: str):
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise fail("RA101", f"{name} must be an array shaped {layout}; got {type(x).__name__}.")
    if x.ndim != 4:
        raise fail("RA101", f"{name} must be 4-D {layout}; got shape {tuple(x.shape)} ({x.ndim}-D). "
                            f"Reshape it to {layout}.")
    if 0 in x.shape:
        raise fail("RA105", f"{name} has shape {tuple(x.shape)}; every axis of {layout} must be >= 1.")


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def check_static_bool(name: str, value) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise fail("RA116", f"{name} must be a Python bool; got {type(value).__name__} {value!r}.")
    return bool(value)


def check_optional_bool(name: str, value) -> bool | None:
    """A backend's on / off option: None (chosen per call) or a bool; RA116 otherwise (a string
    such as 'no' would count as on)."""
    if value is not None and not isinstance(value, (bool, np.bool_)):
        raise fail("RA116", f"{name}={value!r}; pass True, False or None (chosen per call).")
    return None if value is None else bool(value)


def is_positive_int(value) -> bool:
    """Whether a static option is a positive Python int (a bool is not a count)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def check_attention_args(q, k, v, *, segment_ids, bounds, causal, scale, softcap,
                         softcap_method, plan=None, logit_multiplier=None) -> AttentionCall:
    check_tensor("q", q, "[B, Sq, Hq, D]")
    check_tensor("k", k, "[B, Skv, Hkv, D]")
    check_tensor("v", v, "[B, Skv, Hkv, Dv]")
    causal = check_static_bool("causal", causal)

    dtypes = {str(x.dtype) for x in (q, k, v)}
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not any(x.dtype == d for d in FLOAT_DTYPES):
            raise fail("RA104", f"{name} has dtype {x.dtype}; attention inputs must be float32, "
                                f"bfloat16 or float16. Cast with {name}.astype(jnp.float32).")
        if x.dtype == jnp.float64 and not jax.config.jax_enable_x64:
            # JAX would silently compute in float32 and return float32.
            raise fail("RA104", f"{name} is float64 but JAX's x64 mode is off, so it would be "
                                f"truncated to float32. Cast with {name}.astype(np.float32), or "
                                "enable x64 with jax.config.update('jax_enable_x64', True).")
    if len(dtypes) > 1:
        raise fail("RA104", f"q, k and v must share one dtype; got q {q.dtype}, k {k.dtype}, "
                            f"v {v.dtype}. Cast them to one, e.g. .astype(jnp.bfloat16).")

    (b, sq, hq, d), (bk, skv, hkv, dk), (bv, sv, hv, _) = q.shape, k.shape, v.shape
    if not b == bk == bv:
        raise fail("RA102", f"batch sizes differ: q {b}, k {bk}, v {bv}. Pass the same batch to all three.")
    if (skv, hkv) != (sv, hv):
        raise fail("RA102", f"k is {tuple(k.shape)} and v is {tuple(v.shape)}: they must agree on "
                            "sequence length and kv heads (axes 1 and 2).")
    if d != dk:
        raise fail("RA102", f"q has head dim {d} and k has head dim {dk}; q . k needs them equal.")
    if hq % hkv:
        options = ", ".join(map(str, _divisors(hq)))
        raise fail("RA103", f"q has {hq} heads and k has {hkv}; {hq} is not a multiple of {hkv}. "
                            f"Use a kv head count that divides {hq}: {options}.")

    mask_given = [n for n, x in (("segment_ids", segment_ids), ("bounds", bounds), ("plan", plan))
                  if x is not None]
    if causal:
        mask_given.append("causal=True")
    if mask_given and sq != skv:
        raise fail("RA106", f"{' and '.join(mask_given)} describe self-attention, but q has length "
                            f"{sq} and k has length {skv}. Pass q, k, v of one sequence.")
    if plan is not None:
        from rankattn.planning import Plan  # planning imports this module

        if not isinstance(plan, Plan):
            raise fail("RA117", f"plan={type(plan).__name__} {plan!r:.60}; pass what "
                                "rankattn.plan(...) returns, or leave plan out.")
        if len(mask_given) > 1:
            others = ", ".join(n for n in mask_given if n != "plan")
            raise fail("RA117", f"plan was given together with {others}; the "
                                "plan already holds the mask. Pass only plan=.")
        if plan.shape not in ((b, sq), (1, sq)):
            raise fail("RA117", f"plan was made for (B, S) = {plan.shape}, but q has B={b}, S={sq}. "
                                "Make the plan from this batch's segment ids (a plan of one row "
                                "broadcasts over any batch).")
        plan = plan.broadcast_to(b)
        segment_ids, causal = plan.segment_ids, plan.causal
    else:
        segment_ids, causal = check_mask_args(segment_ids, bounds, causal, b, sq)

    scale, softcap = check_logit_options(scale, softcap, softcap_method, d)
    multiplier = None
    if logit_multiplier is not None:
        q, multiplier = semantics.poison_multiplied_rows(
            q, _check_logit_multiplier(logit_multiplier, b, sq, hq))
    return AttentionCall(q=q, k=k, v=v, segment_ids=segment_ids, causal=causal, scale=scale,
                         softcap=softcap, softcap_method=softcap_method, plan=plan,
                         logit_multiplier=multiplier)


def _check_logit_multiplier(x, batch: int, q_len: int, q_heads: int):
    """The multiplier as float32 [B, Sq, Hq] with no gradient, from [B, Sq] or [B, Sq, Hq]."""
    x = as_array("logit_multiplier", x, "RA127", "pass one factor per query, [B, Sq] or "
                                                 "[B, Sq, Hq].")
    real = jnp.issubdtype(x.dtype, jnp.integer) or jnp.issubdtype(x.dtype, jnp.floating)
    if not real:
        raise fail("RA127", f"logit_multiplier has dtype {x.dtype}; it must be a real array "
                            "(int or float), one factor per query. Cast it with "
                            ".astype(jnp.float32).")
    if tuple(x.shape) not in ((batch, q_len), (batch, q_len, q_heads)):
        raise fail("RA127", f"logit_multiplier has shape {tuple(x.shape)}; it must be "
                            f"[B, Sq] = ({batch}, {q_len}), one factor per query, or "
                            f"[B, Sq, Hq] = ({batch}, {q_len}, {q_heads}), one per query and "
                            "head.")
    if isinstance(x, (np.ndarray, np.generic)):  # jnp.asarray would take int64 to int32 first
        x = x.astype(np.float32)                  # (2**32 + 2 wrapped to 2), as x64 is off
    x = jax.lax.stop_gradient(jnp.asarray(x).astype(jnp.float32))
    return jnp.broadcast_to(x[:, :, None] if x.ndim == 2 else x, (batch, q_len, q_heads))


def check_logit_options(scale, softcap, softcap_method, head_dim: int | None):
    """(scale, softcap) as Python floats, checked; scale None means 1 / sqrt(head_dim) (and
    stays None where the head dim is not known yet, ``head_dim=None``)."""
    if scale is None and head_dim is not None:
        scale = 1.0 / math.sqrt(head_dim)
    if scale is not None:
        scale = check_scale("scale", static_float("scale", scale, "RA113"),
                            f"Pass scale=None for 1/sqrt({head_dim or 'D'}).")
    if not isinstance(softcap_method, str) or softcap_method not in semantics.SOFTCAP_METHODS:
        raise fail("RA112", f"softcap_method={softcap_method!r}; use one of "
                            f"{', '.join(map(repr, semantics.SOFTCAP_METHODS))}.")
    if softcap is not None:
        softcap = check_softcap("softcap", static_float("softcap", softcap, "RA111"),
                                "or None for no cap")
    return scale, softcap


def check_scale(name: str, scale: float, hint: str) -> float:
    """``scale`` (a float, the argument ``name``) if the kernels, which scale in float32, can
    use it: a normal float32, not 0 or inf (RA113 otherwise, ending with ``hint``)."""
    if not FLOAT32_NORMAL <= abs(scale) <= FLOAT32_MAX:
        raise fail("RA113", f"{name}={scale}; it must be finite and non-zero as a float32 (a "
                            f"normal number, {FLOAT32_NORMAL:.3g} <= |{name}| <= "
                            f"{FLOAT32_MAX:.3g}). {hint}")
    return scale


def check_softcap(name: str, softcap: float, no_cap: str) -> float:
    """``softcap`` (a float, the argument ``name``) if it is a positive normal float32, as
    scale (RA111 otherwise, saying how to pass ``no_cap``)."""
    if not FLOAT32_NORMAL <= softcap <= FLOAT32_MAX:
        raise fail("RA111", f"{name}={softcap}; it must be a positive finite float32 (a normal "
                            f"number, {FLOAT32_NORMAL:.3g} to {FLOAT32_MAX:.3g}) such as 30.0, "
                            f"{no_cap}.")
    return softcap


def check_mask_args(segment_ids, bounds, causal, batch: int, seq_len: int):
    """(canonical int32 segment ids [B, S] or None, causal) from either spelling of the mask."""
    causal = check_static_bool("causal", causal)
    check_one_mask(segment_ids, bounds)
    if segment_ids is not None:
        segment_ids = _check_segment_ids(segment_ids, batch, seq_len)
    if bounds is not None:
        segment_ids = semantics.bounds_to_segment_ids(_check_bounds(bounds, batch, seq_len), seq_len)
    return segment_ids, causal


def check_one_mask(segment_ids, bounds) -> None:
    if segment_ids is not None and bounds is not None:
        raise fail("RA110", "segment_ids and bounds were both given; pass only one of them.")


def segment_ids_array(segment_ids):
    """``segment_ids`` itself if it is an array (RA107 otherwise: a list could be ragged)."""
    if not hasattr(segment_ids, "shape") or not hasattr(segment_ids, "dtype"):
        raise fail("RA107", f"segment_ids must be an int array [B, S]; got {type(segment_ids).__name__}.")
    return segment_ids


def static_float(name: str, value, code: str) -> float:
    # float() would take "0.5" and True as numbers and drop a complex value's imaginary part.
    if (isinstance(value, (str, bytes)) or getattr(value, "dtype", None) == bool
            or isinstance(value, bool) or np.iscomplexobj(value)):
        raise fail(code, f"{name} must be a real Python float; got {type(value).__name__} "
                         f"{value!r}.")
    try:
        return float(value)
    except OverflowError as e:  # an int past float64's range
        raise fail(code, f"{name}={value!r} is out of range; pass a float32-sized value.") from e
    except (TypeError, ValueError, jax.errors.ConcretizationTypeError) as e:
        raise fail(code, f"{name} must be a Python float; got {type(value).__name__} {value!r}. "
                         "It selects the compiled program, so it cannot be a traced array.") from e


INT32_MIN, INT32_MAX = int(np.iinfo(np.int32).min), int(np.iinfo(np.int32).max)
FLOAT32_NORMAL, FLOAT32_MAX = float(np.finfo(np.float32).tiny), float(np.finfo(np.float32).max)


# What a Phoenix-style bounds argument is, for the errors that name it.
BOUNDS_FORM = "pass (hist_lo, hist_hi, cand_lo, cand_hi) or an int array [B, 4]."


def as_array(name: str, x, code: str, expected: str):
    """``x`` as an array: itself if it is one (tracers included), else numpy, or jnp where a
    sequence holds traced values. A ragged nesting raises ``code`` (numpy's "inhomogeneous
    shape" ValueError otherwise), the message saying what was ``expected``."""
    if hasattr(x, "shape") and hasattr(x, "dtype"):
        return x
    try:
        return np.asarray(x)
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        return jnp.asarray(x)
    except (TypeError, ValueError):
        seen = repr(x)
        seen = seen if len(seen) <= 80 else seen[:77] + "..."
        raise fail(code, f"{name} {seen} is not a rectangular array; {expected}") from None


def clamped_positions(x, seq_len: int) -> jax.Array:
    """Integer positions ``x`` clamped to [0, seq_len], as int32: the same ranges lo <= t < hi
    over the tokens that exist. Clamped in x's own dtype where int32 cannot hold its values,
    as a cast first would wrap them (uint32 2**32 - 1, an "every token" hi, onto -1)."""
    info = jnp.iinfo(x.dtype)
    if info.min < INT32_MIN or info.max > INT32_MAX:
        x = jnp.clip(x, 0, seq_len)
    return jnp.clip(jnp.asarray(x, jnp.int32), 0, seq_len)


def int32_array(name: str, x, code: str, what: str) -> jax.Array:
    """Integer array ``x`` as int32. Concrete values outside int32 raise ``code``, the message
    saying ``what`` the values are: jnp would wrap them (without x64) onto small values that
    look valid (2**32 + 2 as 2)."""
    values = concrete(x)
    if values is not None and values.size:
        low, high = int(values.min()), int(values.max())
        if low < INT32_MIN or high > INT32_MAX:
            raise fail(code, f"{name} holds values from {low} to {high}, past int32 "
                             f"[{INT32_MIN}, {INT32_MAX}]; {what}.")
    return jnp.asarray(x, jnp.int32)


def _check_segment_ids(segment_ids, batch: int, seq_len: int):
    segment_ids = segment_ids_array(segment_ids)
    if segment_ids.dtype == np.bool_:
        raise fail("RA107", "segment_ids is a bool array; segment ids are integers (0 = padding, "
                            "+s = history of session s, -s = candidate of session s). For a "
                            "padding mask (True = real token) pass mask.astype(jnp.int32): one "
                            "session of history, padding elsewhere.")
    if not jnp.issubdtype(segment_ids.dtype, jnp.integer):
        raise fail("RA107", f"segment_ids has dtype {segment_ids.dtype}; it must be an integer dtype "
                            "(0 = padding, +s = history of session s, -s = candidate of session s).")
    if tuple(segment_ids.shape) != (batch, seq_len):
        raise fail("RA107", f"segment_ids has shape {tuple(segment_ids.shape)}; q has batch {batch} "
                            f"and length {seq_len}, so it must be ({batch}, {seq_len}).")
    values = concrete(segment_ids)
    if values is None:  # traced: ids past int32's would wrap onto other sessions or roles
        return traced_ids_as_int32(jnp.asarray(segment_ids))
    if values.size:
        low, high = int(values.min()), int(values.max())
        if low < -INT32_MAX or high > INT32_MAX:
            raise fail("RA118", f"segment_ids range from {low} to {high}; ids must lie in "
                                f"[-{INT32_MAX}, {INT32_MAX}] (int32, with |s| representable). "
                                "Renumber each row's sessions 1, 2, 3, ...")
    return jnp.asarray(segment_ids).astype(jnp.int32)


def traced_ids_as_int32(ids) -> jax.Array:
    """Traced segment ids as int32, those outside [-(2**31 - 1), 2**31 - 1] (which concrete ids
    raise RA118 for) as padding: a cast would wrap uint32 2**32 - 1 onto -1, a candidate of
    session 1, and int64 2**32 + 1 onto session 1."""
    info = jnp.iinfo(ids.dtype)
    keep = ids <= INT32_MAX if info.max > INT32_MAX else None
    if info.min < -INT32_MAX:
        low = ids >= -INT32_MAX
        keep = low if keep is None else keep & low
    return (ids if keep is None else jnp.where(keep, ids, 0)).astype(jnp.int32)


def _check_bounds(bounds, batch: int, seq_len: int):
    bounds = as_array("bounds", bounds, "RA108", BOUNDS_FORM)
    if not jnp.issubdtype(bounds.dtype, jnp.integer):
        raise fail("RA108", f"bounds has dtype {bounds.dtype}; it must be integer "
                            "(hist_lo, hist_hi, cand_lo, cand_hi).")
    if tuple(bounds.shape) not in ((4,), (batch, 4)):
        raise fail("RA108", f"bounds has shape {tuple(bounds.shape)}; it must be (4,) for the whole "
                            f"batch or ({batch}, 4), one (hist_lo, hist_hi, cand_lo, cand_hi) per row.")
    values = concrete(bounds)  # before any int32 cast, which could wrap them into range
    if values is None:  # traced: used as given, positions outside [0, S) do not exist
        bounds = clamped_positions(bounds, seq_len)
    if tuple(bounds.shape) == (4,):
        bounds = jnp.broadcast_to(jnp.asarray(bounds, jnp.int32), (batch, 4))
    if values is not None:
        for row, (hl, hh, cl, ch) in enumerate(np.broadcast_to(values, (batch, 4)).tolist()):
            if not (0 <= hl <= hh <= seq_len and 0 <= cl <= ch <= seq_len):
                raise fail("RA109", f"bounds row {row} = ({hl}, {hh}, {cl}, {ch}): each range "
                                    f"needs 0 <= lo <= hi <= S = {seq_len}. Use e.g. "
                                    f"(0, h, h, {seq_len}) for h history tokens followed by "
                                    "candidates.")
    return jnp.asarray(bounds, jnp.int32)
