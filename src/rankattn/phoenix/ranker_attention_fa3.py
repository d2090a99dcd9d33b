"""Drop-in for Phoenix's ``ranker_attention_fa3.attention`` (phoenix/xrex/pallas/
ranker_attention_fa3.py at x-algorithm 28e414f), computed by :func:`rankattn.attention`."""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from rankattn.api import attention as rankattn_attention
from rankattn.errors import fail
from rankattn.phoenix._shared import cap_options, with_z_loss

__all__ = ["TuningConfig", "attention"]


@dataclasses.dataclass(frozen=True)
class TuningConfig:
    """Phoenix's fa3 tuning fields (ranker_attention_fa3.py:43-75), for source compatibility.

    :func:`attention` accepts and ignores it: the fields size Phoenix's Hopper warpgroup
    tiles, and rankattn chooses its tiles per backend and GPU.
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
        row (ranker_attention_fa3.py:406-412); a [B, 4] array gives one per row. None is
        Phoenix's ``(0, S + 1, S + 1, S + 1)``: every token history, full attention (no
        mask; no phantom key past the end). Values are clamped to [0, S], and a range with hi < lo is empty. The mask is
        Phoenix's ``history_candidate_mask`` (ranker_attention_utils.py:16-56): key j is
        visible to query i iff j is history and i is in either range, or i == j is a
        candidate; a token in both ranges is history, and a query in neither sees
        nothing (out 0, where Phoenix's kernel can give NaN). A bound needs Sq == Skv.
      sm_scale: multiplies q . k before the cap (default 1.0: no 1 / sqrt(D)).
      cap, cap_method: ``cap <= 0`` or ``"none"``: no cap; ``"tanh"``:
        ``cap * tanh(s / cap)``; ``"soft_sign"``: ``s / (1 + |s| / cap)``.
      z_loss_weight: w adds the gradient of ``w / 2 * sum(lse ** 2)`` (natural-log lse,
        every batch row, head and query) to dq and dk (ranker_attention_fa3.py:661-663).
      impl: rankattn's backend choice, as in :func:`rankattn.attention`.

    Returns:
      out [B, Sq, Hq, D] in q's dtype, or ``(out, (lse,))`` with ``save_residuals``.
    """
    del config
    seq_len = q.shape[1]
    if bound is not None:
        bound = np.clip(np.array(bound), 0, seq_len)
        if bound.shape[-1:] != (4,) or bound.ndim > 2:
            raise fail("RA108", f"bound has shape {bound.shape}; it must be (hist_lo, hist_hi, "
                                "cand_lo, cand_hi), or one such row per batch row, [B, 4].")
        # Phoenix's ranges are lo <= x < hi: one with hi < lo is empty (rankattn refuses it).
        bound[..., 1::2] = np.maximum(bound[..., 1::2], bound[..., 0::2])
        if ((bound[..., 0] == 0) & (bound[..., 1] == seq_len)).all():
            bound = None  # every token is history (a token in both ranges is history)
    options = dict(scale=float(sm_scale), impl=impl, **cap_options(cap, cap_method))

    def outputs(q, k, v):
        return rankattn_attention(q, k, v, bounds=bound, return_lse=True, **options)

    out, lse = with_z_loss(outputs, float(z_loss_weight), q, k, v)
    if save_residuals:
        return out, (lse * (1 / math.log(2)),)
    return out
