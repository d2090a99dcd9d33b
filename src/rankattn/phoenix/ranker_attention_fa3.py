"""Drop-in for Phoenix's ``ranker_attention_fa3`` (phoenix/xrex/pallas/ranker_attention_fa3.py at
x-algorithm 28e414f): the names Phoenix's own model code uses from it, computed by
:func:`rankattn.attention`."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from rankattn.api import attention as rankattn_attention
from rankattn.errors import fail
from rankattn.phoenix._shared import scalar_options, with_z_loss
from rankattn.validate import (BOUNDS_FORM, as_array, check_tensor, clamped_positions,
                                concrete, int32_array)

__all__ = ["TuningConfig", "attention", "_attention_forward_inference", "_normalize_bound"]


@dataclasses.dataclass(frozen=True)
class TuningConfig:
    """Phoenix's fa3 tuning fields (ranker_attention_fa3.py:43-75), for source compatibility.

    :func:`attention` and :func:`_attention_forward_inference` accept and ignore it: the fields
    size Phoenix's Hopper warpgroup tiles, and rankattn chooses its tiles per backend and GPU.
    (Phoenix also checks the block sizes in ``__post_init__``; nothing here depends on them.)
    """

    block_q: int
    block_kv: int
    max_concurrent_steps: int
    use_schedule_barrier: bool = True
    causal: bool = False
    compute_wgs_bwd: int = 1
    block_q_dkv: int | None = None
    block_kv_dkv: int | None = None
    block_q_dq: int | None = None
    block_kv_dq: int | None = None

    @property
    def has_backward_blocks(self) -> bool:
        """Whether the backward block sizes were given (Phoenix's property of that name)."""
        return self.block_q_dkv is not None


def _normalize_bound(bound, batch_size, seq_len):
    """Phoenix's bound as one int32 row per batch row: [batch_size, 4].

    As Phoenix (ranker_attention_fa3.py:406-412, called by its inference model at
    phoenix/xrex/models/recsys_attention.py:127): ``None`` becomes
    ``(0, seq_len + 1, seq_len + 1, seq_len + 1)`` (every token history), and a bound of shape
    ``(4,)`` (a tuple, or an integer array, concrete or traced under ``jax.jit``) is cast to
    int32 and broadcast; values are not clamped (the attention functions clamp them to
    [0, S]). Any other shape raises RA108, as does a non-integer array (Phoenix raises a plain
    ``ValueError`` for the shape and truncates floats).
    """
    for name, value in (("batch_size", batch_size), ("seq_len", seq_len)):
        if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1:
            raise fail("RA116", f"_normalize_bound got {name}={value!r}; it must be a positive "
                                "Python int (the batch size and sequence length of q).")
    if bound is None:
        bound = (0, seq_len + 1, seq_len + 1, seq_len + 1)
    bound = as_array("bound", bound, "RA108", BOUNDS_FORM)
    if tuple(bound.shape) != (4,):
        raise fail("RA108", f"bound has shape {tuple(bound.shape)}; _normalize_bound takes one "
                            "(hist_lo, hist_hi, cand_lo, cand_hi) of shape (4,) (or None) and "
                            f"broadcasts it to ({batch_size}, 4). Pass a 4-tuple, or give a "
                            "[B, 4] array straight to _attention_forward_inference / attention.")
    _check_integer(bound)
    return jnp.broadcast_to(int32_array(
        "bound", bound, "RA109", "bounds are positions (hist_lo, hist_hi, cand_lo, cand_hi) in "
        "[0, S]"), (batch_size, 4))


def attention(q, k, v, config=None, save_residuals=False, bound=None, sm_scale=1.0, cap=-1.0,
              cap_method="tanh", z_loss_weight=0.0, *, impl="auto"):
    """Phoenix's fa3 ranker attention: one (history, candidate) range pair for the batch.

    Args:
      q: [B, Sq, Hq, D]; k, v: [B, Skv, Hkv, D]; float32, bfloat16 or float16 (Phoenix:
        16-bit only), any D (Phoenix: multiple of 64), Hq a multiple of Hkv (query head h
        reads kv head h // (Hq // Hkv), ranker_attention_fa3.py:315).
      config: Phoenix's :class:`TuningConfig` (or None); accepted and ignored.
      save_residuals: also return ``(lse,)``, lse [B, Hq, Sq] float32 in base 2
        (``log2 sum_j 2 ** (s_ij * log2 e)``, ranker_attention_fa3.py:386-401), -inf for
        rows that see nothing. Differentiable here (Phoenix's VJP returns ``out`` only).
      bound: ``(hist_lo, hist_hi, cand_lo, cand_hi)``, half-open ranges for every batch
        row (ranker_attention_fa3.py:406-412); an int array [4] or [B, 4] (one row per batch
        row) works too, concrete or traced under ``jax.jit`` (Phoenix's ``attention`` takes a
        static tuple only). None is Phoenix's ``(0, S + 1, S + 1, S + 1)``: every token
        history, full attention (no mask; no phantom key past the end). Values are clamped to
        [0, S], and a range with hi < lo is empty. The mask is Phoenix's
        ``history_candidate_mask`` (ranker_attention_utils.py:16-56): key j is visible to
        query i iff j is history and i is in either range, or i == j is a candidate; a token
        in both ranges is history, and a query in neither sees nothing (out 0, where
        Phoenix's kernel can give NaN). A bound needs Sq == Skv.
      sm_scale: multiplies q . k before the cap (default 1.0: no 1 / sqrt(D)).
      cap, cap_method: ``cap <= 0`` or ``"none"``: no cap; ``"tanh"``:
        ``cap * tanh(s / cap)``; ``"soft_sign"``: ``s / (1 + |s| / cap)``.
      z_loss_weight: w > 0 adds the gradient of ``w / 2 * sum(lse ** 2)`` (natural-log lse,
        every batch row, head and query) to dq and dk (ranker_attention_fa3.py:661-663);
        w <= 0 adds nothing.
      impl: rankattn's backend choice, as in :func:`rankattn.attention`.

    Returns:
      out [B, Sq, Hq, D] in q's dtype, or ``(out, (lse,))`` with ``save_residuals``.
    """
    del config
    check_tensor("q", q, "[B, Sq, Hq, D]")  # before their lengths clamp the bound
    check_tensor("k", k, "[B, Skv, Hkv, D]")
    scalars, z_loss_weight = scalar_options(sm_scale, cap, cap_method, z_loss_weight)
    options = dict(impl=impl, **scalars)

    def outputs(q, k, v, bounds):
        return rankattn_attention(q, k, v, bounds=bounds, return_lse=True, **options)

    out, lse = with_z_loss(outputs, z_loss_weight, q, k, v,
                           _clamped(bound, *q.shape[:2], k.shape[1]))
    if save_residuals:
        return out, (lse * (1 / math.log(2)),)
    return out


def _attention_forward_inference(q, k, v, config, bound=None, sm_scale=1.0, cap=-1.0,
                                 cap_method="tanh", *, impl="auto"):
    """Phoenix's fa3 inference forward (ranker_attention_fa3.py:1242-1508): out only.

    Phoenix's inference model calls it on H100 with the ``[B, 4]`` array of
    :func:`_normalize_bound` (phoenix/xrex/models/recsys_attention.py:126-137).

    Args:
      q, k, v, config, sm_scale, cap, cap_method, impl: as :func:`attention` (config is
        accepted and ignored; Phoenix's kernel also needs Skv a multiple of block_kv and Sq
        of 2 * block_q, which rankattn does not).
      bound: an int array [B, 4] (what :func:`_normalize_bound` returns) or [4], or a
        4-tuple, concrete or traced under ``jax.jit``; None is every token history (Phoenix's
        kernel cannot take None). Clamped to [0, S] as in :func:`attention`.

    Returns:
      out [B, Sq, Hq, D] in q's dtype: Phoenix's mask function computed exactly, as
      :func:`attention` computes it (differentiable here; Phoenix's kernel has no VJP).

    Where Phoenix's kernel differs: it visits the history key blocks (``block_kv`` = 128 in
    its model) without a mask, so when ``hist_hi`` is not a multiple of the block, every query
    of a 128-row tile holding any history or candidate row also sees the keys from ``hist_hi``
    to the end of that block (candidates), and a candidate there counts its own key twice
    (once unmasked, once on the diagonal); rows in neither range inside such a tile see the
    history instead of nothing. Its model puts ``hist_hi`` at 1 + 1024 (user prefix + history)
    in 1152 tokens: the last block is key 1024 and all 127 candidates, so there every
    candidate sees every other. rankattn computes the mask function exactly, here too.
    """
    del config
    return attention(q, k, v, None, False, bound, sm_scale, cap, cap_method, impl=impl)


def _check_integer(bound):
    if not jnp.issubdtype(bound.dtype, jnp.integer):
        raise fail("RA108", f"bound has dtype {bound.dtype}; it must be integer positions "
                            "(hist_lo, hist_hi, cand_lo, cand_hi). Pass ints, or cast with "
                            ".astype(jnp.int32).")


def _clamped(bound, batch: int, seq_len: int, kv_len: int):
    """bound as rankattn's ``bounds=``: None when every token is history (concrete only), else
    an int array [4] or [B, 4] clamped to [0, seq_len] with each hi raised to its lo (an empty
    range). Concrete bounds stay numpy (rankattn checks their values); traced ones use jnp.
    Its shape and q's and k's lengths (one, concrete or traced) are checked here, so that an
    error names ``bound`` (rankattn's would name ``bounds``)."""
    if bound is None:
        return None
    bound = as_array("bound", bound, "RA108", BOUNDS_FORM)
    if bound.ndim not in (1, 2) or bound.shape[-1] != 4 or bound.shape[:-1] not in ((), (batch,)):
        raise fail("RA108", f"bound has shape {tuple(bound.shape)}; it must be (hist_lo, "
                            "hist_hi, cand_lo, cand_hi), shape (4,), or one such row per batch "
                            f"row, [B, 4] = ({batch}, 4) for this q.")
    if kv_len != seq_len:
        raise fail("RA106", f"bound describes self-attention, but q has length {seq_len} and "
                            f"k has length {kv_len}. Pass q, k, v of one sequence, or "
                            "bound=None (every token history).")
    _check_integer(bound)
    values = concrete(bound)
    if values is None:  # traced under jit: the same arithmetic in jnp
        lo = clamped_positions(bound[..., 0::2], seq_len)
        hi = jnp.maximum(clamped_positions(bound[..., 1::2], seq_len), lo)
        return jnp.stack([lo, hi], axis=-1).reshape(bound.shape)
    if values.dtype == np.uint64:  # int64 would wrap those >= 2**63
        values = np.minimum(values, np.uint64(seq_len))
    bound = np.clip(values.astype(np.int64), 0, seq_len)
    # Phoenix's ranges are lo <= x < hi: one with hi < lo is empty (rankattn refuses it).
    bound[..., 1::2] = np.maximum(bound[..., 1::2], bound[..., 0::2])
    if ((bound[..., 0] == 0) & (bound[..., 1] == seq_len)).all():
        return None  # every token is history (a token in both ranges is history)
    return bound.astype(np.int32)
