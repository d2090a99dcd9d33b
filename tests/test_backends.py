"""Every backend, the reference included, against the float64 oracle (tests/oracle.py).

`BackendTests` holds the comparisons; each subclass names one implementation
and the configurations it runs. Compiling is what costs (each shape or static
option is a new XLA program), so the shapes come from a fixed matrix,
CONFIGS, chosen to cover every axis the spec names at least once:
sequence lengths 1, 2, odd, one below / at / one past a block (7/8/9 and
15/16/17 for 16x8 blocks) and ~70, batch 1..3, head dims 8..200, GQA ratios
1, 2, 4, 5, 8, Dv != D, causal, both soft caps with small caps, scale
overrides, caps of 30 and 50 (near the identity, where a cap's formula can cancel),
logit multipliers, segment ids, row-wise and broadcast bounds, no mask (and
cross-attention), float32 and bfloat16, and two sequences past 1000. Each
backend's class may run its own list.
Hypothesis then draws, for each configuration, the *values*: segment-id rows
(contiguous runs of history / candidates / padding for several sessions, or
fully interleaved), bounds (unaligned, reversed, empty) and the q, k, v seed;
values never change the compiled program, so every example after the first is
cheap, and the block planner sees many masks per shape.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import SMALL_BLOCKS, SMALL_CPU, SMALL_TRITON, needs_cpu_kernel
from helpers import FIELDS, Case, bounds, case_id, check_against_oracle, run, segment_ids
import rankattn
from rankattn.backends import BlockSizes, Cpu, PallasTriton, Xla, xla

C = Case
SEG, ROWS, BCAST = "segment_ids", "bounds_rows", "bounds_broadcast"
CONFIGS = [
    C(batch=2, seq=1, heads_q=2, heads_kv=1, dim=8, mask=SEG),
    C(batch=3, seq=2, heads_q=4, heads_kv=1, dim=48, dim_v=24, mask=SEG, causal=True, softcap=2.0),
    C(batch=1, seq=7, heads_q=5, heads_kv=1, dim=80, mask=SEG, softcap=2.0,
      softcap_method="soft_sign", multiplier="heads"),
    C(batch=2, seq=9, heads_q=8, heads_kv=1, dim=8, mask=SEG, causal=True, scale=0.3),
    C(batch=3, seq=15, heads_q=4, heads_kv=2, dim=96, mask=SEG, softcap=5.0, multiplier="rows"),
    C(batch=2, seq=17, heads_q=3, heads_kv=3, dim=128, dim_v=24, mask=SEG, causal=True,
      softcap=2.0, softcap_method="soft_sign"),
    C(batch=1, seq=33, heads_q=2, heads_kv=1, dim=200, mask=SEG, softcap=50.0),
    C(batch=2, seq=70, heads_q=4, heads_kv=1, dim=48, mask=SEG, causal=True),
    C(batch=3, seq=16, heads_q=2, heads_kv=2, dim=80, mask=ROWS, causal=True, softcap=2.0,
      multiplier="rows"),
    C(batch=2, seq=23, heads_q=5, heads_kv=1, dim=8, dim_v=24, mask=ROWS),
    C(batch=2, seq=8, heads_q=4, heads_kv=2, dim=48, mask=BCAST, softcap=2.0,
      softcap_method="soft_sign"),
    C(batch=1, seq=70, heads_q=8, heads_kv=1, dim=96, mask=BCAST, causal=True),
    C(batch=2, seq=5, heads_q=2, heads_kv=1, dim=8, causal=True),
    C(batch=1, seq=17, kv_seq=9, heads_q=4, heads_kv=2, dim=80, dim_v=24, softcap=2.0,
      multiplier="heads"),
    C(batch=2, seq=1, kv_seq=70, heads_q=4, heads_kv=1, dim=48, dim_v=8),
    C(batch=3, seq=3, kv_seq=40, heads_q=2, heads_kv=2, dim=8, scale=0.3),
    C(batch=1, seq=70, heads_q=1, heads_kv=1, dim=128, softcap=2.0, softcap_method="soft_sign",
      scale=0.2),
    C(batch=2, seq=16, heads_q=4, heads_kv=1, dim=48, dtype="bfloat16", mask=SEG, softcap=2.0,
      multiplier="rows"),
    C(batch=2, seq=70, heads_q=2, heads_kv=2, dim=96, dtype="bfloat16", mask=SEG, causal=True),
    C(batch=3, seq=9, heads_q=5, heads_kv=1, dim=80, dim_v=24, dtype="bfloat16", mask=ROWS,
      softcap=2.0, softcap_method="soft_sign"),
    C(batch=1, seq=33, heads_q=8, heads_kv=1, dim=8, dtype="bfloat16", causal=True),
    C(batch=2, seq=33, heads_q=10, heads_kv=2, dim=200, dtype="bfloat16", mask=SEG, softcap=30.0),
]
LONG_CONFIGS = [
    C(batch=1, seq=1100, heads_q=2, heads_kv=1, dim=32, mask=SEG, causal=True, softcap=5.0),
    C(batch=2, seq=1031, heads_q=2, heads_kv=2, dim=16, dim_v=8, dtype="bfloat16", mask=ROWS),
]


def mask_values(config: Case):
    """Hypothesis strategy for the mask values of ``config`` (None when it has no mask); a
    configuration that names its values (a production layout) keeps them."""
    if config.mask_values is not None:
        return st.just(config.mask_values)
    if config.mask == SEG:
        return segment_ids(config.batch, config.seq)
    if config.mask in (ROWS, BCAST):
        return bounds(config.batch, config.seq, broadcast=config.mask == BCAST)
    return st.none()


def pytest_generate_tests(metafunc):
    """Parametrize `config` / `long_config` from the test class's lists."""
    for name in ("config", "long_config"):
        if name in metafunc.fixturenames:
            configs = getattr(metafunc.cls, name + "s")
            metafunc.parametrize(name, configs, ids=[case_id(c) for c in configs])


class BackendTests:
    """Comparisons of `impl` with the float64 oracle on `configs` and `long_configs`."""

    impl = None
    configs = CONFIGS
    long_configs = LONG_CONFIGS

    # Per configuration; the profile's count (conftest.py) scales all of them.
    @settings(max_examples=settings.default.max_examples // 2)
    @given(data=st.data())
    def test_matches_oracle(self, config, data):
        case = dataclasses.replace(config, mask_values=data.draw(mask_values(config), "mask"),
                                   seed=data.draw(st.integers(0, 2**16), "seed"))
        check_against_oracle(case, self.impl)

    @settings(max_examples=max(1, settings.default.max_examples // 3))
    @given(data=st.data())
    def test_long_sequence_matches_oracle(self, long_config, data):
        case = dataclasses.replace(long_config, mask_values=data.draw(mask_values(long_config)))
        check_against_oracle(case, self.impl)


class TestReference(BackendTests):
    """The dense reference: the other backends' tests once compared with it, now all with the
    oracle directly."""

    impl = "reference"


class TestXla(BackendTests):
    """Small blocks: short sequences already span many blocks and ragged ends."""

    impl = SMALL_BLOCKS


class TestXlaDefaultBlocks(BackendTests):
    """Default blocks (128 x 512): one block for short calls, several for the long ones."""

    impl = Xla()
    configs = CONFIGS[5::3]


# Lengths around the default blocks (128 queries x 512 keys): one below, at and one past a
# query block and a key block, and past two key blocks.
DEFAULT_BLOCK_LENGTHS = [
    C(batch=1, seq=127, heads_q=2, heads_kv=1, dim=8, mask=SEG),
    C(batch=1, seq=128, heads_q=2, heads_kv=1, dim=8, mask=SEG, causal=True),
    C(batch=2, seq=129, heads_q=2, heads_kv=1, dim=8, mask=ROWS, softcap=2.0),
    C(batch=1, seq=511, heads_q=4, heads_kv=2, dim=16, mask=SEG),
    C(batch=1, seq=512, heads_q=4, heads_kv=2, dim=16, mask=SEG, causal=True),
    C(batch=1, seq=513, heads_q=4, heads_kv=2, dim=16, dtype="bfloat16", mask=SEG),
    C(batch=1, seq=1025, heads_q=2, heads_kv=1, dim=8, mask=SEG, causal=True, softcap=5.0),
]


class TestXlaDefaultBlockEdges(BackendTests):
    """Default blocks at their edges, as users get them."""

    impl = Xla()
    configs = DEFAULT_BLOCK_LENGTHS[:-1]
    long_configs = DEFAULT_BLOCK_LENGTHS[-1:]


class TestXlaSmallSlab(BackendTests):
    """Default blocks with scan steps of at most 1.2 MB of logits. 896 tokens make 7 query
    blocks of 512 KB: 7 is prime, so they run as 3 steps of 3 units, the last with 2 padded
    (empty) units. 1025 and 1100 tokens make 10 blocks of 104 and 112 queries, 5 steps of 2;
    512 tokens one block of 4 MiB, a step to itself."""

    impl = Xla(step_logits_bytes=1_200_000)
    configs = DEFAULT_BLOCK_LENGTHS[4:5]
    long_configs = DEFAULT_BLOCK_LENGTHS[-1:] + LONG_CONFIGS[:1] + [
        C(batch=1, seq=896, heads_q=2, heads_kv=1, dim=8, mask=SEG, softcap=2.0)]


@pytest.mark.parametrize("q_len, block", [(1088, 136), (1152, 128), (1025, 104), (8192, 128),
                                          (32896, 128)])
def test_xla_query_blocks_pad_least(q_len, block):
    """2 + 1022 history + 64 candidates took 9 blocks of 128 (64 padded queries); a length
    that 128 divides keeps 128."""
    assert xla.plan_sizes(None, q_len, q_len) == BlockSizes(block, 512)


@given(q_len=st.integers(xla.SHORT_QUERY_LEN + 1, 40_000))
def test_xla_query_block_is_near_the_target_and_pads_no_more_than_it(q_len):
    block = xla.query_block(q_len, 128)
    assert block % 8 == 0 and 96 <= block <= 160
    assert xla.round_up(q_len, block) <= xla.round_up(q_len, 128)


@pytest.mark.parametrize("units, group, per_step", [
    (18, 2, 2), (17, 2, 1), (18, 1, 1), (1, 2, 1), (64, 5, 2)])
def test_xla_units_per_step_never_pads_a_step_with_a_divisor_at_hand(units, group, per_step):
    """GQA runs two units (query blocks) per scan step, MHA one; an odd count runs one at a
    time rather than a padded last step."""
    assert xla.units_per_step(units, 1 << 20, 9, group, None) == per_step


def test_xla_units_per_step_pads_only_a_prime_count():
    """7 units under a 3-unit budget: 3 steps of 3, as even as possible (no divisor >= 2)."""
    assert xla.units_per_step(7, 1 << 20, 7, 2, 3 << 20) == 3
    assert xla.units_per_step(8, 1 << 20, 8, 2, 3 << 20) == 2


class TestXlaMixedPrecision(BackendTests):
    """The GPU / TPU numerics of the xla backend (bf16 / f16 operands into the dots), on CPU."""

    impl = Xla(BlockSizes(16, 8), mixed_precision=True)
    configs = [c for c in CONFIGS if c.dtype != "float32"] + CONFIGS[2:3]
    long_configs = LONG_CONFIGS[1:]


@pytest.mark.parametrize("platform, dtype, mixed", [
    ("cpu", "bfloat16", True), ("cpu", "float16", False), ("gpu", "bfloat16", True),
    ("gpu", "float16", True)])
def test_xla_picks_mixed_precision_per_platform_and_dtype(monkeypatch, platform, dtype, mixed):
    """Xla() feeds bf16 / f16 to the dots as they are, except f16 on CPU, which it up-casts:
    each path where it measured faster (see the Xla docstring)."""
    monkeypatch.setattr(jax, "default_backend", lambda: platform)
    # The choice is made when a call is traced, and equal backends share traced programs: one
    # traced under another parametrization's fake platform would be reused (a real process's
    # platform does not change).
    jax.clear_caches()
    case = dataclasses.replace(CONFIGS[17], dtype=dtype,
                               mask_values=((1,) * 12 + (-1,) * 4,) * 2)
    auto = run(case, Xla(BlockSizes(16, 8)))
    forced = run(case, Xla(BlockSizes(16, 8), mixed_precision=mixed))
    other = run(case, Xla(BlockSizes(16, 8), mixed_precision=not mixed))
    for name in FIELDS:
        np.testing.assert_array_equal(auto[name], forced[name], name)
    assert any(not np.array_equal(auto[n], other[n]) for n in FIELDS), "the paths agree: vacuous"


def test_backward_rows_takes_delta_as_a_float32_dot():
    """Regression: delta = rowsum(dO * O), written (dO * O).sum(-1), was fused by XLA's CPU
    compiler into a reduce that took 51 ms for one 8192-token row [1, 8192, 4, 128] (a
    seventh of packed-fwdbwd; 0.9 ms as a dot). Every fused backend takes its delta from
    semantics.backward_rows: a dot at HIGHEST precision, summed in float32 for bfloat16
    inputs, whose poisoned rows (lse NaN) still pass nothing (lse +inf, d_out and delta 0)."""
    import jax.numpy as jnp

    from rankattn import semantics

    rng = np.random.default_rng(0)
    out, d_out = (jnp.asarray(rng.normal(0, 1, (1, 24, 4, 48)), jnp.bfloat16) for _ in range(2))
    # Row (5, 2) poisoned as poison_rows leaves it (out and lse NaN), with an inf in its d_out.
    out, d_out = out.at[0, 5, 2].set(jnp.nan), d_out.at[0, 5, 2, 0].set(jnp.inf)
    lse = jnp.asarray(rng.normal(0, 1, (1, 24, 4)), jnp.float32).at[0, 5, 2].set(jnp.nan)
    d_lse = jnp.asarray(rng.normal(0, 1, (1, 24, 4)), jnp.float32)
    jaxpr = jax.make_jaxpr(semantics.backward_rows)(out, d_out, lse, d_lse).jaxpr
    names = {e.primitive.name for e in jaxpr.eqns}
    dots = [e for e in jaxpr.eqns if e.primitive.name == "dot_general"]
    assert "reduce_sum" not in names and len(dots) == 1, names
    assert dots[0].params["precision"] == (jax.lax.Precision.HIGHEST,) * 2
    assert all(x.aval.dtype == jnp.float32 for x in dots[0].invars)

    lse_rows, d_out_rows, delta = jax.jit(semantics.backward_rows)(out, d_out, lse, d_lse)
    want = (np.einsum("bshd,bshd->bsh", np.asarray(out, np.float64),
                      np.asarray(d_out, np.float64)) - np.asarray(d_lse, np.float64))
    want[0, 5, 2] = 0.0
    # 48 float32 products of bfloat16 values (exact) summed in float32: within 48 u |terms|.
    terms = np.einsum("bshd,bshd->bsh", np.abs(np.asarray(out, np.float64)),
                      np.abs(np.asarray(d_out, np.float64))) + np.abs(np.asarray(d_lse))
    terms[0, 5, 2] = 0.0
    assert np.all(np.abs(np.asarray(delta, np.float64) - want) <= 48 * 2.0**-24 * terms)
    assert np.isposinf(lse_rows[0, 5, 2]) and np.all(np.asarray(d_out_rows[0, 5, 2]) == 0)
    assert np.isfinite(np.asarray(lse_rows)).sum() == lse.size - 1


# The Triton kernels in Pallas interpret mode: with 16 x 16 tiles, CONFIGS' 15/16/17 are a
# tile -1/at/+1; these add 31/33, float16, GQA 5 with a cap in bf16, and cross-attention.
TRITON_CONFIGS = CONFIGS + [
    C(batch=2, seq=31, heads_q=5, heads_kv=1, dim=80, dtype="bfloat16", mask=SEG, causal=True,
      softcap=2.0),
    C(batch=2, seq=33, heads_q=4, heads_kv=2, dim=96, mask=ROWS, causal=True),
    C(batch=1, seq=17, heads_q=5, heads_kv=5, dim=8, dtype="float16", mask=ROWS,
      softcap=2.0, softcap_method="soft_sign"),
    C(batch=1, seq=9, kv_seq=40, heads_q=4, heads_kv=2, dim=48, dim_v=8),
    # Odd head dims in bfloat16: the dots' pair panels pair d with a zero past the last one.
    C(batch=2, seq=23, heads_q=6, heads_kv=2, dim=33, dim_v=17, dtype="bfloat16", mask=SEG,
      softcap=2.0),
]
TRITON_LONG_CONFIGS = [
    C(batch=1, seq=1031, heads_q=5, heads_kv=1, dim=32, dtype="bfloat16", mask=SEG,
      causal=True, softcap=5.0),
]


class TestPallasTriton(BackendTests):
    """The Triton kernels (forward, dq, dk/dv) in interpret mode, with 16 x 16 tiles."""

    impl = SMALL_TRITON
    configs = TRITON_CONFIGS
    long_configs = TRITON_LONG_CONFIGS


class TestPallasTritonDefaultBlocks(BackendTests):
    """Default tiles, which interpret mode takes from PORTABLE_TARGET (no GPU to read):
    16 x 16 in float32 (dk and dv apart), 32 x 32 in 16-bit dtypes up to D = 128, each cut
    to the sequence's next power of two: one tile for the bf16 call of 16 tokens, several
    for the float32 ones and the long one."""

    impl = PallasTriton(interpret=True)
    configs = TRITON_CONFIGS[5::6]
    long_configs = TRITON_LONG_CONFIGS


class TestPallasTritonUnequalTiles(BackendTests):
    """sm_90's 16-bit tiles, 64 queries x 32 keys with q k^T logits in dk / dv (the spill-free
    rules'), where every other class runs square tiles: 70 tokens are 2 ragged query tiles
    over 3 key tiles."""

    impl = PallasTriton(target="sm_90", tuned=False, interpret=True)
    configs = [C(batch=1, seq=70, heads_q=4, heads_kv=2, dim=64, dtype="bfloat16", mask=SEG,
                 causal=True, softcap=2.0)]
    test_long_sequence_matches_oracle = None


class TestPallasTritonSplitGrads(BackendTests):
    """dk and dv in two kernels (float32 and D > 128 take it on GPUs), with 16 x 16 tiles."""

    impl = PallasTriton(BlockSizes(16, 16), split_dkv=True, interpret=True)
    configs = TRITON_CONFIGS[1::5]
    # The split changes which kernel accumulates dk and dv, not how lengths are tiled (the
    # long configurations run in TestPallasTriton), and interpret mode is slow.
    test_long_sequence_matches_oracle = None


class TestPallasTritonQueryMajor(BackendTests):
    """The dk / dv kernel with q k^T logits, as sm_90 runs 16-bit D <= 128 (interpret mode
    elsewhere takes the key-major k q^T of PORTABLE_TARGET), with 16 x 16 tiles."""

    impl = PallasTriton(BlockSizes(16, 16), key_major=False, interpret=True)
    configs = TRITON_CONFIGS[2::5]
    test_long_sequence_matches_oracle = None


# The fused C++ kernel (cpu): with 16 x 8 blocks every configuration has ragged last blocks,
# blocks of one token and mixed full / partial visits; float16 joins bf16 and f32.
CPU_CONFIGS = CONFIGS + [
    C(batch=1, seq=17, heads_q=5, heads_kv=5, dim=8, dtype="float16", mask=ROWS,
      softcap=2.0, softcap_method="soft_sign"),
    C(batch=2, seq=31, heads_q=5, heads_kv=1, dim=80, dtype="float16", mask=SEG, causal=True,
      softcap=2.0),
    C(batch=1, seq=9, kv_seq=40, heads_q=4, heads_kv=2, dim=48, dim_v=8),
    # Odd head dims in bfloat16: the dots' pair panels pair d with a zero past the last one.
    C(batch=2, seq=23, heads_q=6, heads_kv=2, dim=33, dim_v=17, dtype="bfloat16", mask=SEG,
      softcap=2.0),
]


@needs_cpu_kernel
class TestCpu(BackendTests):
    """The fused kernel with 16 x 8 blocks."""

    impl = SMALL_CPU
    configs = CPU_CONFIGS


# Lengths around the cpu kernel's default blocks (64 queries x 128 keys), and the production
# bf16 shape: D = Dv = 128 and key blocks its tokens fill (no padding to clear, AMX tiles or
# VDPBF16PS pairs over whole blocks), history of 256 then 64 candidates, GQA 20 / 4.
CPU_DEFAULT_BLOCK_LENGTHS = [
    C(batch=1, seq=63, heads_q=2, heads_kv=1, dim=8, mask=SEG),
    C(batch=2, seq=65, heads_q=4, heads_kv=2, dim=48, mask=ROWS, causal=True, softcap=2.0),
    C(batch=1, seq=129, heads_q=2, heads_kv=2, dim=16, dtype="bfloat16", mask=SEG),
    C(batch=1, seq=320, heads_q=20, heads_kv=4, dim=128, dtype="bfloat16", mask=BCAST,
      softcap=30.0, mask_values=(0, 256, 256, 320)),
]


@needs_cpu_kernel
class TestCpuDefaultBlocks(BackendTests):
    """Default blocks, as users get them: one block for short calls, several past 64 / 128."""

    impl = Cpu()
    configs = CPU_DEFAULT_BLOCK_LENGTHS + CONFIGS[5::3]


@pytest.mark.parametrize("dtype, declined", [("float32", False), ("float64", True)])
def test_the_references_logits_limit_counts_their_bytes_regression(dtype, declined):
    """24000^2 logits take 2.1 GiB in float32, 4.3 GiB in float64, over the 4 GiB limit: it
    counted 4 bytes a logit in every dtype."""
    from rankattn.backends import Reference
    from rankattn.validate import AttentionCall
    x = jax.ShapeDtypeStruct((1, 24000, 1, 8), np.dtype(dtype))  # shapes only: no memory
    call = AttentionCall(x, x, x, None, False, 1.0, None, "tanh")
    reasons = Reference().not_supported_reasons(call)
    assert bool(reasons) == declined, reasons
    assert not declined or "x 8 bytes" in reasons[0]


def test_an_eager_xla_call_compiles_once_regression():
    """The xla backend called eagerly (no jax.jit around it) traced and compiled its loops at
    every call, 0.7 s each at B=2, S=64; the second of two same calls adds no program."""
    q = jax.numpy.asarray(np.random.default_rng(0).normal(size=(2, 9, 2, 8)), np.float32)
    seg = np.ones((2, 9), np.int32)
    outs, sizes = [], []
    for _ in range(2):
        outs.append(np.asarray(rankattn.attention(q, q, q, segment_ids=seg, impl="xla")))
        sizes.append(xla.flash_attention._cache_size())
    assert sizes[1] == sizes[0], sizes
    np.testing.assert_array_equal(outs[0], outs[1])
