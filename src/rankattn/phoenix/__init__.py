"""Drop-ins for the Phoenix ranker's attention kernels, computed by rankattn.

The Phoenix ranker (xai-org/x-algorithm; conventions below cite the mirror
szq0017/x-algorithm at commit 28e414f) calls three Pallas kernels from
``phoenix/xrex/pallas/``. Each has a module here of the same name, whose function
has the same positional order, keyword names and defaults, so that porting a
Phoenix model is an import change::

    from phoenix.xrex.pallas import ranker_attention_fa3      # before
    from rankattn.phoenix import ranker_attention_fa3         # after

Every name Phoenix's own code (its model, phoenix/xrex/models/recsys_attention.py, and
trainer, phoenix/xrex/train/trainer_recsys.py) takes from the three modules is here, with
Phoenix's parameters; tests/test_phoenix_names.py holds that list with each use's file and
line:

* :mod:`.ranker_attention_fa3`: ``attention(q, k, v, config, ...)`` (one ``bound =
  (hist_lo, hist_hi, cand_lo, cand_hi)`` for the batch, or ``[B, 4]``, concrete or traced;
  base-2 lse residuals; z-loss), ``_attention_forward_inference(q, k, v, config, bound,
  sm_scale, cap, cap_method)`` (the model's H100 inference path: out only),
  ``_normalize_bound(bound, batch_size, seq_len)`` (None or ``(4,)`` to int32 ``[B, 4]``)
  and ``TuningConfig``.
* :mod:`.ranker_attention_v2`: ``mha(q, k, v, temp, segment_ids, ...)`` (ids 1 / -1 / 0
  per token, one session per row, ``causal`` on every query, ``temp``) and
  ``mha_inference_gqa(q, k, v, temp, segment_ids, ...)`` (the model's inference path off
  H100: K/V not repeated, no ``causal``, out only).
* :mod:`.ranker_attention_varlen`: ``mha(q, k, v, temp, segment_ids, cu_seqlens_q,
  cu_seqlens_k, max_seqlen_q, max_seqlen_k, ...)`` (sessions packed end to end in
  ``[total, H, D]``), ``get_device_tuning_config()`` (whose ``block_q``, 128, sizes the
  trainer's seqpack layout), ``TuningConfig``, ``HOPPER_CONFIG`` and ``BLACKWELL_CONFIG``.

What each computes is Phoenix's mask function and reference semantics, not its
kernels' accidents: no tile counted twice at unaligned or overlapping bounds
(fa3's kernels do), 0 (never NaN) for rows that see nothing, no key read past
the end for ``bound=None``. The two inference forwards differ most: Phoenix's
fa3 one visits history key blocks unmasked, so at a history end off its 128-key
block the first candidates leak into every row of the tile; its v2 one visits
every key block up to the last holding history unmasked, so candidates in that
block see each other (and padding keys there are seen). rankattn computes the
mask function exactly in both. Underneath is :func:`rankattn.attention`: any shape
and head dim, float32 / bfloat16 / float16, GQA everywhere, any backend (each
function takes a keyword-only ``impl=``, as :func:`rankattn.attention` does), and
a gradient everywhere (Phoenix's inference kernels have none).
Tuning options (Phoenix's ``TuningConfig``, block sizes, warps, stages, grids) are
accepted and ignored: they size Phoenix's own Hopper / Triton tiles, and rankattn
chooses its tiles per backend and GPU (``rankattn.backends.PallasTriton``), so
mapping them over would only pick worse tiles; ``get_device_tuning_config()``
returns Phoenix's Hopper configuration without querying a GPU (Phoenix returns its
Blackwell one on GB200 / GB300, with the same ``block_q``). Wrong bounds raise
rankattn's RA108 (a ``TypeError``), where Phoenix raises a ``ValueError``.

Conventions shared by the three (Phoenix file and line at 28e414f):

* logits ``s = cap(sm_scale * q . k)``: no hidden ``1 / sqrt(D)`` (the model passes
  ``sm_scale = sqrt(128) / key_size``, phoenix/xrex/models/scaling.py:40-41);
* ``cap <= 0`` or ``cap_method == "none"`` means no cap; ``"tanh"`` is
  ``cap * tanh(s / cap)``, ``"soft_sign"`` is ``s / (1 + |s| / cap)``
  (ranker_attention_fa3.py:31-40; v2 and varlen raise for ``"none"`` with a cap,
  which is accepted here);
* ``z_loss_weight = w > 0`` adds the gradient of ``w / 2 * sum(lse ** 2)`` (natural-log
  lse of every query row and head, summed, independent of the output's
  cotangent) to q and k, and nothing to the outputs (ranker_attention_fa3.py:661-663,
  890-894; v2:718-719; varlen:809-810); ``w <= 0`` adds nothing, as Phoenix's kernels
  test ``z_loss_weight > 0``. Rows that see nothing add 0, where Phoenix's v2 / varlen
  kernels give NaN. The masks may be traced, inside ``lax.scan`` and ``jax.checkpoint``
  too; they get no gradient;
* v2's ``temp`` [B, S] multiplies each query's logits after the cap, on every key it sees
  (v2:129, 242 and 276: the inference kernel too), as ``rankattn.attention``'s
  ``logit_multiplier``: any values, int or float, concrete or traced, with any cap; lse and
  the z-loss include it; it gets no gradient, as in Phoenix (v2:934). varlen ignores its
  ``temp``, as Phoenix's does (its kernels take it but never read it; varlen:1094).
"""

from rankattn.phoenix import ranker_attention_fa3, ranker_attention_v2, ranker_attention_varlen

__all__ = ["ranker_attention_fa3", "ranker_attention_v2", "ranker_attention_varlen"]
