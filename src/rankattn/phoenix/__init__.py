"""Drop-ins for the Phoenix ranker's attention kernels, computed by rankattn.

The Phoenix ranker (xai-org/x-algorithm; conventions below cite the mirror
szq0017/x-algorithm at commit 28e414f) calls three Pallas kernels from
``phoenix/xrex/pallas/``. Each has a module here of the same name, whose function
has the same positional order, keyword names and defaults, so that porting a
Phoenix model is an import change::

    from phoenix.xrex.pallas import ranker_attention_fa3      # before
    from rankattn.phoenix import ranker_attention_fa3         # after

* :mod:`.ranker_attention_fa3` ``attention(q, k, v, config, ...)``: one static
  ``bound = (hist_lo, hist_hi, cand_lo, cand_hi)`` for the batch, base-2 lse
  residuals, z-loss.
* :mod:`.ranker_attention_v2` ``mha(q, k, v, temp, segment_ids, ...)``: ids 1 /
  -1 / 0 per token, one session per row, ``causal`` on every query, ``temp``.
* :mod:`.ranker_attention_varlen` ``mha(q, k, v, temp, segment_ids, cu_seqlens_q,
  cu_seqlens_k, max_seqlen_q, max_seqlen_k, ...)``: sessions packed end to end in
  ``[total, H, D]``.

What each computes is Phoenix's mask function and reference semantics, not its
kernels' accidents: no tile counted twice at unaligned or overlapping bounds
(fa3's kernels do), 0 (never NaN) for rows that see nothing, no key read past
the end for ``bound=None``. Underneath is :func:`rankattn.attention`: any shape
and head dim, float32 / bfloat16 / float16, GQA everywhere, any backend (each
function takes a keyword-only ``impl=``, as :func:`rankattn.attention` does).
Tuning options (Phoenix's ``TuningConfig``, block sizes, warps, stages, grids) are
accepted and ignored: they size Phoenix's own Hopper / Triton tiles, and rankattn
chooses its tiles per backend and GPU (``rankattn.backends.PallasTriton``), so
mapping them over would only pick worse tiles.

Conventions shared by the three (Phoenix file and line at 28e414f):

* logits ``s = cap(sm_scale * q . k)``: no hidden ``1 / sqrt(D)`` (the model passes
  ``sm_scale = sqrt(128) / key_size``, phoenix/xrex/models/scaling.py:40-41);
* ``cap <= 0`` or ``cap_method == "none"`` means no cap; ``"tanh"`` is
  ``cap * tanh(s / cap)``, ``"soft_sign"`` is ``s / (1 + |s| / cap)``
  (ranker_attention_fa3.py:31-40; v2 and varlen raise for ``"none"`` with a cap,
  which is accepted here);
* ``z_loss_weight = w`` adds the gradient of ``w / 2 * sum(lse ** 2)`` (natural-log
  lse of every query row and head, summed, independent of the output's
  cotangent) to q and k, and nothing to the outputs (ranker_attention_fa3.py:661-663,
  890-894; v2:718-719; varlen:809-810). Rows that see nothing add 0, where
  Phoenix's v2 / varlen kernels give NaN;
* ``temp`` gets no gradient, as in Phoenix (v2:934, varlen:1094).
"""

from rankattn.phoenix import ranker_attention_fa3, ranker_attention_v2, ranker_attention_varlen

__all__ = ["ranker_attention_fa3", "ranker_attention_v2", "ranker_attention_varlen"]
