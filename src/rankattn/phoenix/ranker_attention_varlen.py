"""Drop-in for Phoenix's ``ranker_attention_varlen.mha`` (phoenix/xrex/pallas/
ranker_attention_varlen.py at x-algorithm 28e414f), computed by :func:`rankattn.attention`."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from rankattn.api import segment_ids_from_cu_seqlens
from rankattn.errors import fail
from rankattn.phoenix._shared import attend, scalar_options, with_z_loss
from rankattn.validate import check_static_bool, concrete

__all__ = ["BLACKWELL_CONFIG", "HOPPER_CONFIG", "TuningConfig", "get_device_tuning_config", "mha"]


@dataclasses.dataclass(frozen=True)
class TuningConfig:
    """Phoenix's varlen tuning fields (ranker_attention_varlen.py:16-38), for source
    compatibility. :func:`mha` accepts and ignores it: rankattn chooses its own tiles."""

    block_q: int
    block_kv: int
    num_warps: int
    num_stages: int
    block_q_dq: int | None = None
    block_kv_dq: int | None = None
    block_q_dkv: int | None = None
    block_kv_dkv: int | None = None
    bwd_num_warps: int | None = None
    bwd_num_stages: int | None = None


# Phoenix's two named configurations (ranker_attention_varlen.py:41-65), ignored like any other.
HOPPER_CONFIG = TuningConfig(128, 128, 8, 2, 128, 16, 16, 128, 8, 4)
BLACKWELL_CONFIG = TuningConfig(128, 64, 8, 2, 128, 16, 16, 64, 8, 4)


def get_device_tuning_config() -> TuningConfig:
    """:data:`HOPPER_CONFIG`, what Phoenix's function of this name returns off Blackwell.

    Phoenix (ranker_attention_varlen.py:68-72) returns :data:`BLACKWELL_CONFIG` when
    ``xrex.utils.gpu.gpu_arch()`` is GB200 or GB300 (read from ``MACHINE_TYPE`` or the CUDA
    driver) and :data:`HOPPER_CONFIG` otherwise (H100, H200, A100, CPU). Its trainer reads
    only ``.block_q`` from it, as the seqpack block size that session lengths are padded to
    (phoenix/xrex/train/trainer_recsys.py:1694-1697); that is 128 in both configurations, so
    the data layout does not depend on the GPU. The two differ only in key block sizes,
    which :func:`mha` ignores, so this returns the Hopper one without querying a GPU.
    """
    return HOPPER_CONFIG


def mha(q, k, v, temp, segment_ids, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
        sm_scale=1.0, cap=-1.0, cap_method="tanh", causal=True, window_len=-1,
        z_loss_weight=0.0, config=HOPPER_CONFIG, backward_pass_impl="triton_split", grid=None,
        interpret=False, debug=False, *, impl="auto"):
    """Phoenix's varlen ranker attention: sessions packed end to end by ``cu_seqlens``.

    Args:
      q: [total, Hq, D]; k, v: [total, Hkv, D] (one packed length), float32 / bfloat16 /
        float16, any total and D, Hq a multiple of Hkv (varlen:422-430, 473-478).
      temp: [total]; ignored, as Phoenix ignores it (its only uses are a shape check and
        zeroing, varlen:272-292).
      segment_ids: int [total], each token's role in its session: > 0 history, < 0
        candidate, 0 padding (varlen:108-109, 284; ids are not cast to int8 here).
      cu_seqlens_q, cu_seqlens_k: int [N + 1]: session n is rows
        ``cu_seqlens[n] <= t < cu_seqlens[n + 1]`` (varlen:223-228). One array serves
        queries and keys, as the model passes (phoenix/xrex/models/recsys_attention.py:
        176-189): concrete ones that differ raise RA123; traced ones, cu_seqlens_q is used.
        Rows past ``cu_seqlens[-1]`` (or in no session) are padding and output 0 (Phoenix
        leaves them unwritten without a gradient, zeroes them with one).
      max_seqlen_q, max_seqlen_k: accepted; every session is attended in full (Phoenix
        silently truncates sessions longer than max_seqlen, varlen:82-98).
      causal: default True, as in Phoenix (the model passes False); key j is visible to
        query i iff both are in one session, i is not padding, j is history or j == i, and
        with ``causal`` j <= i, for candidates too.
      sm_scale, cap, cap_method, z_loss_weight: see :mod:`rankattn.phoenix`.
      window_len, config, backward_pass_impl, grid, interpret, debug: accepted and ignored.
      impl: rankattn's backend choice, as in :func:`rankattn.attention` (with ``causal``:
        cpu, xla or reference, as in ``ranker_attention_v2.mha``).

    Returns:
      out [total, Hq, D] in q's dtype (only ``out``, as Phoenix).
    """
    del (temp, max_seqlen_q, max_seqlen_k, window_len, config, backward_pass_impl, grid,
         interpret, debug)
    for name, x in (("q", q), ("k", k), ("v", v)):  # before x[None] meets a list
        if not (hasattr(x, "shape") and hasattr(x, "dtype")) or len(x.shape) != 3:
            seen = f"shape {tuple(x.shape)}" if hasattr(x, "shape") else type(x).__name__
            raise fail("RA101", f"{name} must be an array [total, heads, head dim] (sessions "
                                f"packed end to end); got {seen}.")
    cu_q, cu_k = concrete(cu_seqlens_q), concrete(cu_seqlens_k)
    if cu_q is not None and cu_k is not None and not np.array_equal(cu_q, cu_k):
        raise fail("RA123", f"cu_seqlens_q {cu_q.tolist()[:8]} and cu_seqlens_k "
                            f"{cu_k.tolist()[:8]} differ; Phoenix's varlen mha shares one "
                            "segment_ids array between queries and keys, so pass the same "
                            "cu_seqlens for both.")
    roles = getattr(segment_ids, "shape", None)  # RA123 below would name segment_ids' roles
    if (roles is None or tuple(roles) != (q.shape[0],)
            or not jnp.issubdtype(segment_ids.dtype, jnp.integer)):
        seen = (f"shape {tuple(roles)} and dtype {segment_ids.dtype}" if roles is not None
                else type(segment_ids).__name__)
        raise fail("RA107", f"segment_ids must be an int array [total] = ({q.shape[0]},), one "
                            f"role per packed token (> 0 history, < 0 candidate, 0 padding); "
                            f"got {seen}.")
    ids = segment_ids_from_cu_seqlens(cu_seqlens_q, segment_ids)[None]
    scalars, z_loss_weight = scalar_options(sm_scale, cap, cap_method, z_loss_weight)
    options = dict(causal=check_static_bool("causal", causal), impl=impl, **scalars)

    def outputs(q, k, v, ids):
        out, lse = attend(q[None], k[None], v[None], ids, **options)
        return out[0], lse[0]

    return with_z_loss(outputs, z_loss_weight, q, k, v, ids)[0]
