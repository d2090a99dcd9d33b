"""The pallas_tpu backend: the shared property suite in interpret mode, and what it adds.

* TestPallasTpu / TestPallasTpuDefaultBlocks: tests/test_backends.py's comparisons with the
  float64 oracle, on the kernels in Pallas' generic interpreter (``interpret=True``) with
  16 x 16 blocks (the suite's short sequences span several blocks with ragged ends and
  skipped blocks; interpret mode does not enforce TPU's (8, 128) block rule) and with the
  table's blocks. conftest.BACKENDS adds it to every per-backend named test too.
* Dispatch and options: by name it needs a TPU, first under impl='auto' on one; the
  generation from the device; float16 / float64 and an over-budget block list declined
  with the fix; RA116 for bad options.
* SMEM: calls split over batch rows and block ranges give the same bits.
* Lowering for TPU without a TPU, at the table's blocks, every generation x dtype x head
  dim (and the per-shard kernels); the float32 dots ask Mosaic for fp32 precision; no
  kernel operand is a per-row vector padded to 128 lanes and no product contracts a
  transposed lhs (issue 37); the lowering rejects what interpret mode accepts.
* Block skipping: the forward's visit counter equals the plan's counts; DMA blocks gather
  the lists' blocks with their kinds, and the schedule (the grid's scalar prefetch) visits
  each list in order and repeats its last step; a prepared plan's grid is its visits; DMA
  blocks of several compute blocks give the same bits as one; the kernels read q, k, v and
  dO unpadded and uncleaned. The
  TPU simulator's race detector on two cores finds nothing in the forward, dq and dk / dv
  kernels.
* The per-shard kernel of context sharding and Phoenix's causal drop-in against the
  reference backend.
tests/test_tpu_compile.py compiles for real generations where libtpu is installed.
"""

from __future__ import annotations

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import rankattn
from conftest import SMALL_TPU
from helpers import random_qkv, random_segments
from rankattn import semantics
from rankattn.backends import BACKENDS, BlockSizes, PallasTpu
from rankattn.backends.pallas_tpu import (FIRST, FULL, KIND_BITS, KIND_SHIFT, LAST, OVERFLOW,
                                          PARTIAL, TARGETS, TpuTarget, call_ranges, dma_lists,
                                          list_dtype, pltpu, rows_per_call, schedule,
                                          tpu_attention)
from rankattn.blocks import segments_and_plan
from rankattn.validate import AttentionCall
from tolerances import FIELDS, assert_close_f32
from test_backends import CONFIGS, BackendTests, C, ROWS, SEG
from test_backends import pytest_generate_tests  # noqa: F401  (parametrizes config)

# CONFIGS but four whose axes others cover (interpret mode compiles each configuration for
# about 1.7 s): cross-attention 3 x 40 (1 x 70 and 17 x 9 stay), broadcast bounds at 70 tokens
# (at 8 stays; 70 tokens stay with segment ids), unmasked soft_sign at 70 (soft_sign stays with
# a mask), bf16 unmasked causal GQA 8 (bf16 causal stays); plus GQA 5 in bf16 with a cap at 31
# tokens and float32 bounds with a per-head multiplier one past two blocks.
TPU_CONFIGS = [c for n, c in enumerate(CONFIGS) if n not in (11, 15, 16, 20)] + [
    C(batch=2, seq=31, heads_q=5, heads_kv=1, dim=80, dtype="bfloat16", mask=SEG, causal=True,
      softcap=2.0),
    C(batch=2, seq=33, heads_q=4, heads_kv=2, dim=96, mask=ROWS, causal=True,
      multiplier="heads"),
]
# Several blocks at the table's 128-token blocks: 3 x 3, the last one ragged (300 = 2 * 128 +
# 44), GQA 5 in bf16, causal with a cap. (1031 tokens, 9 x 9 blocks, took 8.5 s for no new path.)
TPU_LONG_CONFIGS = [
    C(batch=1, seq=300, heads_q=5, heads_kv=1, dim=32, dtype="bfloat16", mask=SEG,
      causal=True, softcap=5.0),
]


class TestPallasTpu(BackendTests):
    """The Mosaic TPU kernels (forward, dq, dk / dv) in interpret mode, with 16 x 16 blocks."""

    impl = SMALL_TPU
    configs = TPU_CONFIGS
    # The long configuration runs at the table's blocks (below): in 16-token blocks it is 19 x 19
    # grid steps per kernel, for no path the short ones miss.
    test_long_sequence_matches_oracle = None


class TestPallasTpuDefaultBlocks(BackendTests):
    """The table's blocks (v5e's 128 x 128 without a TPU): one block of round_up(S, 8) for
    short calls, several for the long one (3 x 3 blocks, a ragged last one)."""

    impl = PallasTpu(interpret=True)
    configs = TPU_CONFIGS[5::12]
    long_configs = TPU_LONG_CONFIGS


# --- Dispatch and options. -----------------------------------------------------------


def test_by_name_it_needs_a_tpu(monkeypatch):
    monkeypatch.setattr(jax, "default_backend", lambda: "cpu")
    q, k, v, _ = random_qkv(0, 1, 8, 2, 1, 8)
    with pytest.raises(rankattn.RankattnValueError, match="RA115") as err:
        rankattn.attention(q, k, v, impl="pallas_tpu")
    assert "needs a TPU" in str(err.value) and "PallasTpu(interpret=True)" in str(err.value)
    assert "rankattn[tpu]" in str(err.value)
    assert "pallas_tpu" not in rankattn.available_impls()


def test_on_a_tpu_auto_tries_it_first(monkeypatch):
    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
    assert rankattn.available_impls() == ["pallas_tpu", "xla", "reference"]
    assert rankattn.api.resolve_impls("auto")[0].name == "pallas_tpu"


@pytest.mark.parametrize("kind, name", [("TPU v5 lite", "v5e"), ("TPU v6 lite", "v6e"),
                                        ("TPU7x", "tpu7x"), ("TPU v4", "v5e")])
def test_on_a_tpu_the_generation_is_read_from_the_device(monkeypatch, kind, name):
    class Device:
        device_kind = kind
    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
    monkeypatch.setattr(jax, "devices", lambda: [Device()])
    assert PallasTpu().tpu_target() == TARGETS[name]


@pytest.mark.parametrize("dtype, fragment", [(np.float16, "bfloat16"), (np.float64, "float64")])
def test_float16_and_float64_are_declined_with_the_fix(dtype, fragment):
    """float16: Mosaic rejects float16 vector loads on v5e, v6e and TPU7x (TPU_COMPILE.md)."""
    with jax.enable_x64(dtype == np.float64):
        q, k, v, _ = (x.astype(dtype) for x in random_qkv(2, 1, 8, 2, 1, 8))
        with pytest.raises(rankattn.RankattnValueError, match="RA115") as err:
            rankattn.attention(q, k, v, impl=SMALL_TPU)
    assert fragment in str(err.value) and "impl='xla'" in str(err.value)


def test_only_a_block_list_over_the_smem_budget_is_declined():
    """A row of 131072 tokens in 128-token blocks and v5e's 512-token DMA blocks has a
    schedule of up to 1024 x 256 steps (three int16 arrays: 1.5 MiB), over v5e's 512 KiB
    budget: it runs as calls over ranges of blocks. Declined only where one block's steps
    exceed the budget: 1024 steps (6144 bytes) at DMA blocks of 128 tokens, not 256 steps
    (1536 bytes) at 512."""
    call = AttentionCall(
        q=jax.ShapeDtypeStruct((1, 131072, 2, 128), jnp.bfloat16),
        k=jax.ShapeDtypeStruct((1, 131072, 1, 128), jnp.bfloat16),
        v=jax.ShapeDtypeStruct((1, 131072, 1, 128), jnp.bfloat16), segment_ids=None,
        causal=False, scale=1.0, softcap=None, softcap_method="tanh")
    assert PallasTpu(target="v5e").not_supported_reasons(call) == []
    tiny = TpuTarget("tiny", BlockSizes(128, 128), smem_budget=6000)
    assert PallasTpu(target=tiny).not_supported_reasons(call) == []
    (reason,) = PallasTpu(target=tiny, dma_block=128).not_supported_reasons(call)
    assert "6144 bytes" in reason and "6000-byte budget" in reason
    assert "block_sizes or dma_block" in reason


@pytest.mark.parametrize("kwargs, fragment", [
    (dict(block_sizes=BlockSizes(12, 16)), "(12, 16)"),
    (dict(block_sizes=BlockSizes(16, 24)), "(16, 24)"),
    (dict(interpret="yes"), "interpret='yes'"),
    (dict(target="v4"), "target='v4'"),
    (dict(target=["v5e"]), "target=['v5e']; pass one of 'v5e'"),  # regression: TypeError
    (dict(max_visits=0), "max_visits=0"),
    (dict(max_visits=2.5), "max_visits=2.5"),
    (dict(dma_block=100), "dma_block=100"),
    (dict(dma_block=True), "dma_block=True"),
])
def test_options_are_checked(kwargs, fragment):
    with pytest.raises(rankattn.RankattnTypeError, match="RA116") as err:
        PallasTpu(**kwargs)
    assert fragment in str(err.value)


@pytest.mark.parametrize("fields, fragment", [
    (dict(block_sizes=(16, 16)), "block_sizes=(16, 16)"),
    (dict(block_sizes=BlockSizes(16, 24)), "(16, 24)"),
    (dict(dma_block=12), "dma_block=12"),
    (dict(dma_block=0), "dma_block=0"),
    (dict(smem_budget=0), "smem_budget=0"),
    (dict(vmem_limit_bytes=-1), "vmem_limit_bytes=-1"),
])
def test_a_target_is_checked_like_the_backends_options_regression(fields, fragment):
    """Review (stop 75): a TpuTarget's fields were taken as given: blocks of a tuple built
    the backend and every call failed with AttributeError, and blocks PallasTpu(block_sizes=)
    refuses were accepted."""
    with pytest.raises(rankattn.RankattnTypeError, match="RA116") as err:
        TpuTarget(**{"name": "mine", "block_sizes": BlockSizes(16, 16), "smem_budget": 1000,
                     **fields})
    assert fragment in str(err.value) and "TpuTarget('mine', ...)" in str(err.value)


def test_calls_split_to_fit_the_smem_budget_give_the_same_bits():
    """Rows of 40 tokens in 16-token blocks, DMA blocks of one block: int16 schedules of at
    most 3 x 3 steps, three arrays, 54 bytes a row and 18 a block. A 110-byte budget takes
    2 rows a call; 20 bytes takes one row a call, each over query block 0, 1 or 2 (forward,
    dq) and key blocks alike (dk / dv). Out, lse and the gradients equal those of one call,
    bit for bit."""
    assert list_dtype(3, 3) == jnp.int16 and list_dtype(40000, 3) == jnp.int32
    assert rows_per_call(3, [(3, 3)] * 2, 110) == 2 and rows_per_call(2, [(3, 3)] * 2, 20) == 1
    assert rows_per_call(3, [(3, 1), (3, 3)], 110) == 2 and rows_per_call(3, [(3, 1)], 40) == 2
    assert [list(r) for r in call_ranges(1, 3, 3, 20)] == [[0], [1], [2]]
    q, k, v, w = random_qkv(3, 2, 40, 2, 1, 8)
    seg = jnp.asarray(random_segments(4, 2, 40, "packed"))
    options = dict(causal=True, scale=0.5, softcap=None, softcap_method="tanh",
                   block_sizes=BlockSizes(16, 16), dma_block=16, interpret=True)

    def results(smem_budget):
        def f(q, k, v):
            return tpu_attention(q, k, v, seg, smem_budget=smem_budget, **options)
        (out, lse), pullback = jax.vjp(f, q, k, v)
        return [out, lse, *pullback((jnp.asarray(w), jnp.ones_like(lse)))]

    whole, split = (jax.jit(results, static_argnums=0)(budget) for budget in (1 << 20, 20))
    for name, a, b in zip(FIELDS, whole, split):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), name)


# --- Lowering for TPU (no TPU, no libtpu). -------------------------------------------


def lower_for_tpu(impl, b, s, hq, hkv, d, dtype, causal=False, softcap=None, masked=True):
    """jax.jit(value_and_grad) of a loss on out and lse, lowered for TPU."""
    args = [jax.ShapeDtypeStruct((b, s, hq, d), dtype), jax.ShapeDtypeStruct((b, s, hkv, d), dtype),
            jax.ShapeDtypeStruct((b, s, hkv, d), dtype), jax.ShapeDtypeStruct((b, s), jnp.int32)]

    def loss(q, k, v, seg):
        out, lse = rankattn.attention(q, k, v, segment_ids=seg if masked else None, causal=causal,
                                      softcap=softcap, return_lse=True, impl=impl)
        return out.astype(jnp.float32).sum() + jnp.where(jnp.isfinite(lse), lse, 0).sum()

    return jax.jit(jax.value_and_grad(loss, (0, 1, 2))).trace(*args).lower(
        lowering_platforms=("tpu",))


def mosaic_modules(lowered) -> list[str]:
    """The Mosaic MLIR of each TPU kernel in a lowered program, as text (the custom calls
    carry it as base64 bytecode; Mosaic's dialect is registered to print it)."""
    import base64
    import json

    from jax._src.interpreters import mlir
    from jax._src.lib import tpu
    from jaxlib.mlir import ir
    from jaxlib.mlir.passmanager import PassManager

    modules = []
    for config in re.findall(r'tpu_custom_call.*?backend_config = "(.*?)"', lowered.as_text()):
        text = re.sub(r"\\([0-9A-Fa-f]{2})", lambda m: chr(int(m.group(1), 16)), config)
        body = base64.b64decode(json.loads(text)["custom_call_config"]["body"])
        context = mlir.make_ir_context()
        tpu.register_dialect(context)
        with context, ir.Location.unknown():
            context.allow_unregistered_dialects = True  # the serialized form's stable_mosaic
            module = ir.Module.parse(body)
            PassManager.parse("builtin.module(mosaic-serde{serialize=false})").run(
                module.operation)
            modules.append(str(module))
    return modules


# Every table entry x dtype x head dim, GQA 1 / 5, causal and the cap taking turns, at the
# production length of 1088 tokens (several blocks, a ragged last one).
LOWERING_GRID = [(target, dtype, d, (1, 5)[n % 2], n % 3 == 0, (None, 30.0)[n // 2 % 2])
                 for n, (target, dtype, d) in enumerate(
                     (t, dt, d) for t in TARGETS for dt in (jnp.float32, jnp.bfloat16)
                     for d in (64, 128, 256))]


@pytest.mark.parametrize("target, dtype, d, group, causal, softcap", LOWERING_GRID,
                         ids=lambda x: getattr(x, "__name__", str(x)))
def test_forward_and_backward_lower_for_tpu_at_the_table_blocks(target, dtype, d, group,
                                                                  causal, softcap):
    """What interpret mode does not check: every block shape obeys the (8, 128) rule and
    every op has a Mosaic lowering, at the blocks each generation runs."""
    lowered = lower_for_tpu(PallasTpu(target=target), 2, 1088, 4 * group, 4, d, dtype,
                            causal, softcap)
    assert len(mosaic_modules(lowered)) == 3  # forward, dq, dk / dv


def test_the_per_shard_kernel_lowers_for_tpu():
    """Phoenix v2's causal rule runs pallas_tpu with a ShardMask (positions as two more
    inputs per kernel): forward, dq and dk / dv lower at v6e's blocks, production heads.
    (It also compiles for v5e, v6e and TPU7x with libtpu.)"""
    from rankattn.phoenix import ranker_attention_v2 as v2

    args = [jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in (
        ((2, 1088, 20, 128), jnp.bfloat16), ((2, 1088, 4, 128), jnp.bfloat16),
        ((2, 1088, 4, 128), jnp.bfloat16), ((2, 1088), jnp.float32), ((2, 1088), jnp.int32))]

    def loss(q, k, v, temp, seg):
        out = v2.mha(q, k, v, temp, seg, causal=True, cap=30.0, impl=PallasTpu(target="v6e"))
        return out.astype(jnp.float32).sum()

    lowered = jax.jit(jax.grad(loss, (0, 1, 2))).trace(*args).lower(lowering_platforms=("tpu",))
    assert len(mosaic_modules(lowered)) == 3


def kernel_operand_types(lowered) -> set[str]:
    """The tensor types among the TPU kernels' operands and results in a lowered program."""
    return {t for line in lowered.as_text().splitlines() if "tpu_custom_call" in line
            for t in re.findall(r"tensor<[^>]*>", line)}


def test_no_kernel_operand_is_a_row_vector_padded_to_128_lanes():
    """Issue 37: TPU tiles an array's last two dims by (8, 128), so a per-row vector
    [..., S, 1] (lse, delta, segment ids, positions, poison, the logit multiplier) takes 128
    times its bytes in HBM and in the kernels' buffers (v5e compile: temp HBM 9.6x the
    arguments at B=16, S=1088). Every kernel's operands and results are lane-dense rows
    [..., 1, S] / [..., G, S] instead: own keys and a multiplier, and the per-shard kernels
    (positions)."""
    from rankattn.phoenix import ranker_attention_v2 as v2

    impl = PallasTpu(target="v5e")
    args = [jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in (
        ((2, 300, 10, 128), jnp.bfloat16), ((2, 300, 2, 128), jnp.bfloat16),
        ((2, 300, 2, 128), jnp.bfloat16), ((2, 300), jnp.int32), ((2, 300, 10), jnp.float32),
        ((2, 300), jnp.float32))]

    def own_keys(q, k, v, seg, mult, temp):
        out, lse = rankattn.attention(q, k, v, segment_ids=seg, causal=True, return_lse=True,
                                      logit_multiplier=mult, impl=impl)
        return out.astype(jnp.float32).sum() + jnp.where(jnp.isfinite(lse), lse, 0).sum()

    def per_shard(q, k, v, seg, mult, temp):
        return v2.mha(q, k, v, temp, seg, causal=True, cap=30.0, impl=impl).astype(
            jnp.float32).sum()

    for loss in (own_keys, per_shard):
        lowered = jax.jit(jax.grad(loss, (0, 1, 2))).trace(*args).lower(
            lowering_platforms=("tpu",))
        types = kernel_operand_types(lowered)
        assert any("x1x300" in t or "x1x384" in t for t in types), types  # rows are there
        padded = sorted(t for t in types if re.fullmatch(r"tensor<[0-9x]*x1x(f32|i32|i1)>", t))
        assert not padded, (loss.__name__, padded)


def test_float32_dots_ask_for_full_precision_and_16_bit_dots_do_not():
    """Mosaic's default for float32 dots is one bf16 MXU pass; the kernels ask for fp32."""
    for dtype, want in ((jnp.float32, {"fp32"}), (jnp.bfloat16, set())):
        lowered = lower_for_tpu(PallasTpu(), 1, 300, 2, 1, 128, dtype, softcap=5.0)
        text = "\n".join(mosaic_modules(lowered))
        # forward 2, dq 3, dk / dv 4, each once for full and once for partial blocks, for
        # each of a DMA block's 3 compute blocks (300 tokens: 3 blocks of 128)
        assert text.count("tpu.matmul") == 3 * 2 * (2 + 3 + 4)
        assert set(re.findall(r"contract_precision<(\w+)>", text)) == want, dtype


def test_no_kernel_product_contracts_a_transposed_lhs():
    """Issue 37: the dk / dv kernel works key-major (s^T = k q^T, dv = p^T dO and dk = ds^T
    q as plain products), so no MXU product in any kernel contracts its lhs' first axis
    (a transpose per product before). 300 tokens in 128-token blocks: DMA blocks of 3,
    each compute block's products unrolled, full and masked."""
    lowered = lower_for_tpu(PallasTpu(), 1, 300, 10, 2, 128, jnp.bfloat16, causal=True,
                            softcap=5.0)
    dims = re.findall(r"tpu.matmul.*dimension_numbers = #tpu.dot_dimension_numbers<\[(\d)\]",
                      "\n".join(mosaic_modules(lowered)))
    assert len(dims) == 3 * 2 * (2 + 3 + 4) and set(dims) == {"1"}, dims


def test_lowering_catches_what_interpret_mode_accepts():
    """The lowering tests have teeth: 16 x 16 blocks (fine in interpret mode) break the (8,
    128) rule on keys once a sequence spans several blocks. Regression: the backend took
    such a call off interpret mode and Pallas failed inside; it declines it now (RA115),
    and takes what fits one block, what interpret mode runs and DMA blocks of any size."""
    shapes = [jax.ShapeDtypeStruct(s, jnp.bfloat16)
              for s in ((1, 64, 2, 128), (1, 64, 1, 128), (1, 64, 1, 128))]
    kernels = functools.partial(tpu_attention, segment_ids=None, causal=False, scale=1.0,
                                softcap=None, softcap_method="tanh",
                                block_sizes=BlockSizes(16, 16))
    with pytest.raises(ValueError, match="divisible by 8 and 128"):
        jax.jit(kernels).trace(*shapes).lower(lowering_platforms=("tpu",))
    with pytest.raises(rankattn.RankattnValueError, match="RA115") as err:
        lower_for_tpu(PallasTpu(BlockSizes(16, 16)), 1, 64, 2, 1, 128, jnp.bfloat16)
    assert "span several blocks of 16 x 16" in str(err.value)

    def reasons(impl, seq):
        q, kv = (jax.ShapeDtypeStruct((1, seq, h, 128), jnp.bfloat16) for h in (2, 1))
        return impl.not_supported_reasons(AttentionCall(
            q=q, k=kv, v=kv, segment_ids=None, causal=False, scale=1.0, softcap=None,
            softcap_method="tanh"))

    assert len(reasons(PallasTpu(BlockSizes(64, 192)), 100)) == 1  # 2 query blocks of 64
    for impl, seq in [(PallasTpu(BlockSizes(16, 16)), 16), (SMALL_TPU, 64),
                      (PallasTpu(BlockSizes(128, 128), dma_block=200), 600)]:
        assert reasons(impl, seq) == [], (impl, seq)


# --- Block skipping and the TPU simulator. -------------------------------------------


def test_each_query_block_computes_exactly_its_listed_key_blocks():
    """The forward's debug counter (interpret mode) equals the plan's list length for every
    (row, kv head, query block): packed sessions and causal history skip blocks, and the
    grid's steps past a list's count compute nothing."""
    q, k, v, _ = random_qkv(7, 2, 70, 4, 2, 8)
    seg = jnp.asarray(random_segments(8, 2, 70, "packed"))
    sizes = BlockSizes(16, 16)
    out, lse, visits = jax.jit(functools.partial(
        tpu_attention, causal=True, scale=0.5, softcap=None, softcap_method="tanh",
        block_sizes=sizes, interpret=True, count_visits=True))(q, k, v, seg)
    _, _, plan = segments_and_plan(seg, 2, 70, 70, sizes, True)
    counts = np.asarray(plan.count)
    assert counts.min() < counts.max() < 5  # some blocks skipped, the lists uneven
    np.testing.assert_array_equal(np.asarray(visits), np.repeat(counts[:, None], 2, axis=1))
    want = rankattn.attention(q, k, v, segment_ids=seg, causal=True, scale=0.5,
                              impl="reference", return_lse=True)
    assert_close_f32(out, want[0], "out")


def dma_visits(index, count, factor: int = 4):
    """Per own block, the DMA blocks (``factor`` blocks each) its list's visited blocks lie
    in: how many distinct ones (numpy, [B, nOwn])."""
    index, count = np.asarray(index), np.asarray(count)
    return np.array([[len({int(x) // factor for x in index[b, i, :count[b, i]]})
                      for i in range(index.shape[1])] for b in range(index.shape[0])])


def test_a_prepared_plan_runs_a_grid_of_its_visits():
    """Issue 37: a plan prepared from concrete segment ids and closed over has known counts,
    so each kernel's grid (b, kv head, step) has a step per visited DMA block (4 blocks of
    16 tokens) plus one per own block with an empty list, for its longest batch row (issue
    37's target: at most 1.25x the visits plus one per own block); passed as a jit argument
    (traced) it keeps the worst case, 5 own blocks x 2 DMA blocks. Results and gradients are
    the same bits either way. Regression: a plan of one row broadcast over the batch, and a
    batch run one row a call (an SMEM budget of 100 bytes, a row's lists taking 60), were
    sliced or broadcast as traced arrays under jit and took the worst case too; their grids
    are read from the jaxpr (no kernel runs)."""
    impl = PallasTpu(BlockSizes(16, 16), interpret=True, dma_block=64)
    q, k, v, w = random_qkv(17, 2, 70, 4, 2, 8)
    seg = jnp.asarray(random_segments(18, 2, 70, "packed"))
    plan = rankattn.plan(segment_ids=seg, causal=True, impl=impl)

    def dma_steps(plan):
        """Per direction (forward and dq; dk / dv), each batch row's steps over DMA blocks."""
        lists = plan.block_plan(BlockSizes(16, 16))
        visits = [dma_visits(lists.kv_index, lists.count),
                  dma_visits(lists.q_index, lists.q_count)]
        assert (visits[0] < np.asarray(lists.count)).any()  # DMA blocks of several visits
        return visits

    visits = dma_steps(plan)
    want = {int(np.maximum(n, 1).sum(1).max()) for n in visits}

    def results(q, k, v, plan, impl=impl):
        def f(q, k, v):
            return rankattn.attention(q, k, v, plan=plan, impl=impl, return_lse=True)
        (out, lse), pullback = jax.vjp(f, q, k, v)
        return [out, lse, *pullback((jnp.asarray(w), jnp.ones_like(lse)))]

    def grids(f, *args):
        return {int(n) for n in re.findall(r"grid=\(\d+, \d+, (\d+)\)",
                                           str(jax.make_jaxpr(f)(q, k, v, *args)))}

    prepared = functools.partial(results, plan=plan)
    assert [grids(prepared), grids(results, plan)] == [want, {10}], want
    for n in visits:
        assert max(want) <= 1.25 * int(n.sum(1).max()) + n.shape[1]
    one_row = rankattn.plan(segment_ids=seg[:1], causal=True, impl=impl)
    assert grids(functools.partial(results, plan=one_row)) == {
        int(np.maximum(n, 1).sum(1).max()) for n in dma_steps(one_row)}
    row_a_call = PallasTpu(interpret=True, target=TpuTarget(
        "row a call", BlockSizes(16, 16), smem_budget=100, dma_block=64))
    per_row = {int(x) for n in visits for x in np.maximum(n, 1).sum(1)}
    assert grids(functools.partial(results, plan=plan, impl=row_a_call)) == per_row
    assert max(per_row) < 10
    for name, a, b in zip(FIELDS, jax.jit(prepared)(q, k, v), jax.jit(results)(q, k, v, plan)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), name)


def test_dma_blocks_of_several_compute_blocks_give_the_same_bits():
    """Issue 37, item 3: visited blocks fetched 3 compute blocks at a time (DMA blocks of 48
    tokens over 16-token blocks: 70 tokens make 5 blocks, so the second DMA block holds 2,
    the last one ragged) compute the same block pairs in the same order as one block a
    fetch, skipping the compute blocks their plan skips: out, lse and the gradients are the
    same bits, with packed causal sessions, a cap and a per-head multiplier."""
    q, k, v, w = random_qkv(41, 2, 70, 4, 2, 8)
    seg = jnp.asarray(random_segments(42, 2, 70, "packed"))
    mult = jnp.asarray(np.random.default_rng(43).uniform(0.5, 2, (2, 70, 4)), jnp.float32)

    @functools.partial(jax.jit, static_argnums=0)
    def results(dma_block):
        def f(q, k, v):
            return rankattn.attention(
                q, k, v, segment_ids=seg, causal=True, softcap=2.0, logit_multiplier=mult,
                impl=PallasTpu(BlockSizes(16, 16), interpret=True, dma_block=dma_block),
                return_lse=True)
        (out, lse), pullback = jax.vjp(f, q, k, v)
        return [out, lse, *pullback((jnp.asarray(w), jnp.ones_like(lse)))]

    for name, a, b in zip(FIELDS, results(16), results(48)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), name)


def test_the_kernels_read_q_k_v_and_d_out_unpadded_and_uncleaned(monkeypatch):
    """Issue 37: no copy of q, k, v or dO around the kernels. They take the caller's arrays
    (head-major views: on a TPU, XLA lays [B, S, H, D] out head-major, so the view is free)
    at their own length, 45 tokens in 16-token blocks, the last block ragged (the kernels
    zero what they read past the end), and non-finite entries included (the kernels zero
    them as they read; semantics poisons the rows). Before, XLA padded each to 48 tokens
    and replaced the non-finite entries: two copies of each. Results against the reference,
    NaN rows included."""
    from rankattn.backends import pallas_tpu
    seen = {}
    for name in ("_forward", "_dq", "_dkv"):
        def spy(st, q, k, v, seg, plan, *rest, name=name, inner=getattr(pallas_tpu, name)):
            seen[name] = dict(q=q, k=k, v=v, d_out=rest[0] if name != "_forward" else None)
            return inner(st, q, k, v, seg, plan, *rest)
        monkeypatch.setattr(pallas_tpu, name, spy)
    q, k, v, w = (jnp.asarray(x) for x in random_qkv(21, 2, 45, 4, 2, 8))
    q, k = q.at[1, 7, 3, 0].set(jnp.nan), k.at[0, 30, 1, 2].set(jnp.inf)
    seg = jnp.asarray(random_segments(22, 2, 45, "packed"))

    def results(impl):
        def f(q, k, v):
            return rankattn.attention(q, k, v, segment_ids=seg, causal=True, impl=impl,
                                      return_lse=True)
        (out, lse), pullback = jax.vjp(f, q, k, v)
        return [out, lse, *pullback((w, jnp.ones_like(lse)))]

    got = results(SMALL_TPU)
    for name, operands in seen.items():
        for role, x in operands.items():
            if x is not None:
                assert x.shape[-2] == 45, (name, role, x.shape)  # [..., S, D]: not padded
        assert np.isnan(np.asarray(operands["q"])).any(), name  # not cleaned by XLA
        assert np.isinf(np.asarray(operands["k"])).any(), name
    want = results("reference")
    assert np.isnan(np.asarray(want[0])).any()
    for field, a, b in zip(FIELDS, got, want):
        nan = np.isnan(np.asarray(b))
        np.testing.assert_array_equal(np.isnan(np.asarray(a)), nan, field)
        assert_close_f32(np.where(nan, 0, a), np.where(nan, 0, b), field)


def test_dma_lists_hold_the_visited_blocks_with_their_kinds():
    """Lists over 5 blocks in DMA blocks of 2 (the last one ragged). Own block 0 visits 3
    (full), 0 and 4 (partial): DMA blocks 0 (its first block partial), 1 (its second full)
    and 2 (its first partial). Own block 1 visits nothing. Own block 2 visits 1 and 0, both
    full: DMA block 0 alone, both halves full. Visited DMA blocks come first, in order, then
    the others with code 0; the same known and traced."""
    index = jnp.array([[[3, 0, 4, 1, 2], [2, 0, 1, 3, 4], [1, 0, 2, 3, 4]]], jnp.int32)
    full, count = jnp.array([[1, 0, 2]]), jnp.array([[3, 0, 2]])
    first_partial = PARTIAL << KIND_SHIFT
    second_full = FULL << (KIND_SHIFT + KIND_BITS)
    both_full = FULL << KIND_SHIFT | second_full
    for lists in (dma_lists(index, full, count, 2), jax.jit(dma_lists, static_argnums=3)(
            index, full, count, 2)):
        dma, code, n = (np.asarray(x)[0].tolist() for x in lists)
        assert n == [3, 0, 1]
        assert [row[:c] for row, c in zip(dma, n)] == [[0, 1, 2], [], [0]]
        assert code == [[first_partial, second_full, first_partial], [0, 0, 0], [both_full, 0, 0]]


def test_the_schedule_visits_each_list_in_order_and_then_repeats_its_last_step():
    """Row 0 has three own blocks with lists [3, 1], [] and [2]; row 1 lists [0, 1, 2], [1]
    and [] (each entry a DMA block with its compute blocks' kinds, a / b below). Known
    lists: a step per visit, one step computing nothing for an empty list (it still opens
    and closes its block, so its output is written), and row 0, shorter, repeats its last
    pair with nothing to do (the same block indices: the pipeline fetches nothing). Traced
    (under jit): 3 steps per own block, those past its count repeating its last visited
    block and computing nothing."""
    a, b = FULL << KIND_SHIFT, PARTIAL << (KIND_SHIFT + KIND_BITS)
    index = jnp.array([[[3, 1, 0], [2, 0, 1], [2, 1, 0]],
                       [[0, 1, 2], [1, 0, 0], [0, 0, 0]]], jnp.int32)  # [B=2, nOwn=3, V=3]
    code = jnp.array([[[a, b, 0], [0, 0, 0], [b, 0, 0]], [[a, a, a], [b, 0, 0], [0, 0, 0]]])
    count = jnp.array([[2, 0, 1], [3, 1, 0]])
    own, visit, steps = (np.asarray(x) for x in schedule(index, code, count))
    assert own.tolist() == [[0, 0, 1, 2, 2], [0, 0, 0, 1, 2]]
    assert visit.tolist() == [[3, 1, 2, 2, 2], [0, 1, 2, 1, 0]]
    assert steps.tolist() == [
        [a | FIRST, b | LAST, FIRST | LAST, b | FIRST | LAST, 0],
        [a | FIRST, a, a | LAST, b | FIRST | LAST, FIRST | LAST]]
    own, visit, steps = (np.asarray(x)[0] for x in jax.jit(schedule)(index, code, count))
    assert own.tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    assert visit.tolist() == [3, 1, 1, 2, 2, 2, 2, 2, 2]
    assert steps.tolist() == [a | FIRST, b | LAST, 0, FIRST | LAST, 0, 0, b | FIRST | LAST, 0, 0]
    # Traced with max_visits=2: 2 steps per own block; row 1's first list (3 entries) visits
    # two and its last step carries OVERFLOW.
    own, visit, steps = (np.asarray(x)[1] for x in jax.jit(schedule, static_argnums=3)(
        index, code, count, 2))
    assert own.tolist() == [0, 0, 1, 1, 2, 2] and visit.tolist() == [0, 1, 1, 1, 0, 0]
    assert steps.tolist() == [a | FIRST, a | LAST | OVERFLOW, b | FIRST | LAST, 0,
                              FIRST | LAST, 0]


def test_max_visits_bounds_a_traced_grid_and_an_overrun_block_is_nan():
    """Under jit with traced segment ids the grid is every pair of a block and a DMA block
    (5 x 3 steps at 70 tokens in 16-token blocks, DMA blocks of 2); PallasTpu(max_visits=M)
    makes it 5 x M. With M the longest list of DMA blocks the results are the same bits.
    With one less, the blocks whose lists overran come back NaN (out and lse of their
    queries, dq of their queries, dk / dv of their keys), never a partial sum, and every
    other query's out and lse are the same bits."""
    q, k, v, w = random_qkv(31, 2, 70, 4, 2, 8)
    seg = jnp.asarray(random_segments(32, 2, 70, "packed"))
    _, _, lists = segments_and_plan(seg, 2, 70, 70, BlockSizes(16, 16), True)
    per_query, per_key = (dma_visits(index, count, 2) for index, count in (
        (lists.kv_index, lists.count), (lists.q_index, lists.q_count)))
    longest = int(max(per_query.max(), per_key.max()))

    def results(impl):
        @jax.jit
        def f(q, k, v, seg):
            def g(q, k, v):
                return rankattn.attention(q, k, v, segment_ids=seg, causal=True, impl=impl,
                                          return_lse=True)
            (out, lse), pullback = jax.vjp(g, q, k, v)
            return [out, lse, *pullback((jnp.asarray(w), jnp.ones_like(lse)))]
        steps = {int(n) for n in re.findall(r"grid=\(\d+, \d+, (\d+)\)",
                                             str(jax.make_jaxpr(f)(q, k, v, seg)))}
        return [np.asarray(x) for x in f(q, k, v, seg)], steps

    def impl(max_visits=None):
        return PallasTpu(BlockSizes(16, 16), interpret=True, dma_block=32, max_visits=max_visits)

    unbounded, steps = results(impl())
    bounded, bounded_steps = results(impl(longest))
    assert steps == {15} and bounded_steps == {5 * longest} and 1 < longest < 3
    for name, a, b in zip(FIELDS, bounded, unbounded):
        np.testing.assert_array_equal(a, b, name)

    short, _ = results(impl(longest - 1))
    over_q = np.repeat(per_query > longest - 1, 16, axis=1)[:, :70]  # [B, S]
    over_k = np.repeat(per_key > longest - 1, 16, axis=1)[:, :70]
    assert over_q.any() and not over_q.all() and over_k.any()
    out, lse, dq, dk, dv = short
    for name, x, rows in (("out", out, over_q), ("dq", dq, over_q), ("dk", dk, over_k),
                          ("dv", dv, over_k)):
        np.testing.assert_array_equal(np.isnan(x).all(axis=(2, 3)), rows, name)
    np.testing.assert_array_equal(np.isnan(lse).all(axis=1), over_q, "lse")
    np.testing.assert_array_equal(out[~over_q], unbounded[0][~over_q], "out")
    np.testing.assert_array_equal(lse.transpose(0, 2, 1)[~over_q],
                                  unbounded[1].transpose(0, 2, 1)[~over_q], "lse")

def test_the_simulated_tpu_finds_no_race(monkeypatch):
    """InterpretParams with the race detector on two simulated cores, which split the
    parallel grid dimensions between them, for the forward, dq and dk / dv kernels (each
    kernel gets its own detector, all three are kept): no two programs write one block, and
    dq and dk / dv (accumulated in VMEM scratch over the "arbitrary" visit dimension) need no
    atomics. Uninitialised memory reads as NaN, so a read of an unwritten block would show
    in the finite gradients."""
    from jax._src.pallas.mosaic.interpret import interpret_pallas_call as simulator

    detectors = []

    class Kept(simulator.RaceDetectionState):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            detectors.append(self)

    monkeypatch.setattr(simulator, "RaceDetectionState", Kept)
    params = pltpu.InterpretParams(detect_races=True, num_cores_or_threads=2)
    q, k, v, d_out = random_qkv(9, 2, 40, 4, 2, 8)
    seg = jnp.asarray(random_segments(10, 2, 40, "packed"))
    mult = jnp.asarray(np.random.default_rng(11).uniform(0.5, 2, (2, 40, 4)), jnp.float32)
    impl = PallasTpu(BlockSizes(16, 16), interpret=params)

    def f(q, k, v):
        return rankattn.attention(q, k, v, segment_ids=seg, causal=True, softcap=2.0,
                                  logit_multiplier=mult, impl=impl, return_lse=True)

    try:
        out, pullback = jax.vjp(f, q, k, v)
        grads = pullback((jnp.asarray(d_out), jnp.ones_like(out[1])))
        jax.block_until_ready(grads)
    finally:
        pltpu.reset_tpu_interpret_mode_state()
    assert len(detectors) == 3 and not any(d.races_found for d in detectors)
    assert all(np.isfinite(np.asarray(g)).all() for g in grads)


# --- The per-shard kernel (ShardMask) and the Phoenix drop-ins. ------------------------


def test_one_context_shard_matches_the_reference():
    """The per-shard call of context sharding: queries are the second half of a causal
    sequence (positions 24..53), keys the whole of it with their own segment ids; only the
    history part of the mask, positions compared instead of indices. Out, lse and the
    gradients equal the reference backend's on the same call."""
    q, k, v, w = random_qkv(12, 2, 54, 4, 2, 24)
    seg = random_segments(13, 2, 54, "packed")
    positions = np.broadcast_to(np.arange(54, dtype=np.int32), (2, 54))
    shard = semantics.ShardMask(jnp.asarray(seg), jnp.asarray(positions[:, 24:]),
                                jnp.asarray(positions))
    call = AttentionCall(q=jnp.asarray(q[:, 24:]), k=jnp.asarray(k), v=jnp.asarray(v),
                         segment_ids=jnp.asarray(seg[:, 24:]), causal=True, scale=0.4,
                         softcap=3.0, softcap_method="tanh", shard_mask=shard)

    @functools.partial(jax.jit, static_argnums=0)
    def results(backend):
        def f(q, k, v):
            return backend(dataclasses.replace(call, q=q, k=k, v=v))
        (out, lse), pullback = jax.vjp(f, call.q, call.k, call.v)
        return [out, lse, *pullback((jnp.asarray(w[:, 24:]), jnp.ones_like(lse)))]

    assert SMALL_TPU.takes_shard_mask and not SMALL_TPU.not_supported_reasons(call)
    for name, got, want in zip(FIELDS, results(SMALL_TPU), results(BACKENDS["reference"])):
        assert_close_f32(got, want, name)  # -inf lse where a row sees nothing, in both


def test_phoenix_v2_runs_on_it_with_causal_candidates():
    """Phoenix's causal rule (candidates causal too) runs the history part as a ShardMask
    call and merges the own keys: with pallas_tpu as the kernel, temp and z-loss included,
    results and gradients equal the reference backend's."""
    from rankattn.phoenix import ranker_attention_v2 as v2

    q, k, v, w = random_qkv(14, 2, 45, 4, 2, 16, q_std=3.0)
    seg = random_segments(15, 2, 45, "packed")
    temp = np.random.default_rng(16).uniform(0.5, 2.0, (2, 45)).astype(np.float32)

    def results(impl):
        def loss(q, k, v):
            out = v2.mha(q, k, v, temp, seg, sm_scale=0.3, cap=5.0, causal=True,
                         z_loss_weight=0.2, impl=impl)
            return (out * w).sum(), out
        (_, out), grads = jax.jit(jax.value_and_grad(loss, (0, 1, 2), has_aux=True))(q, k, v)
        return [out, *grads]

    for name, got, want in zip(("out", "dq", "dk", "dv"), results(SMALL_TPU),
                               results("reference")):
        assert_close_f32(got, want, name)
