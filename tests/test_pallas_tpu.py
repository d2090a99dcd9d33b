"""The pallas_tpu backend: the shared property suite in interpret mode, and what it adds.

* TestPallasTpu: tests/test_backends.py's comparisons with the float64 oracle, on the
  kernels in Pallas' generic interpreter (``interpret=True``) with 16 x 16 blocks, so
  the suite's short sequences span several blocks with ragged ends and skipped blocks
  (interpret mode does not enforce TPU's (8, 128) block rule).
"""

from __future__ import annotations

import pytest

from conftest import SMALL_TPU
from rankattn.backends import PallasTpu
from test_backends import CONFIGS, BackendTests, C, ROWS, SEG
from test_backends import pytest_generate_tests  # noqa: F401  (parametrizes config)

# CONFIGS plus GQA 5 in bf16 with a cap at 31 tokens, cross-attention with a longer key
# sequence, and float32 packed rows with a multiplier one past two blocks.
TPU_CONFIGS = CONFIGS + [
    C(batch=2, seq=31, heads_q=5, heads_kv=1, dim=80, dtype="bfloat16", mask=SEG, causal=True,
      softcap=2.0),
    C(batch=1, seq=9, kv_seq=40, heads_q=4, heads_kv=2, dim=48, dim_v=8),
    C(batch=2, seq=33, heads_q=4, heads_kv=2, dim=96, mask=ROWS, causal=True,
      multiplier="heads"),
]
TPU_LONG_CONFIGS = [
    C(batch=1, seq=1031, heads_q=5, heads_kv=1, dim=32, dtype="bfloat16", mask=SEG,
      causal=True, softcap=5.0),
]


class TestPallasTpu(BackendTests):
    """The Mosaic TPU kernels (forward, dq, dk / dv) in interpret mode, with 16 x 16 blocks."""

    impl = SMALL_TPU
    configs = TPU_CONFIGS
    # 1031 tokens in 16-token blocks are 65 x 65 grid steps per kernel (90 s interpreted);
    # the default blocks' class below runs the long configuration.
    test_long_sequence_matches_oracle = None


class TestPallasTpuDefaultBlocks(BackendTests):
    """The table's blocks (v5e's 128 x 128 without a TPU): one block of round_up(S, 8) for
    short calls, several for the long one (9 x 9 blocks, a ragged last one)."""

    impl = PallasTpu(interpret=True)
    configs = TPU_CONFIGS[5::8]
    long_configs = TPU_LONG_CONFIGS
