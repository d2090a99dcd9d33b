"""The mosaic_gpu backend: lowering for CUDA without a GPU, declines and options, and its
interpret-mode suite (tests/mosaic/, the kernel against the float64 oracle) in a process of
its own.
"""

from __future__ import annotations

import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import rankattn
from helpers import lower_for_cuda, run_suite
from rankattn import api
from rankattn.backends import BlockSizes, MosaicGpu, Xla, mosaic_gpu_interpret
from rankattn.validate import AttentionCall


def test_the_interpret_suite_in_its_own_process():
    run_suite("mosaic", dict(RANKATTN_MOSAIC_TESTS="1"), timeout=180)


def test_it_lowers_for_cuda_without_a_gpu():
    """jit(value_and_grad) lowered for CUDA on this CPU machine: three Mosaic GPU custom calls
    (forward, dq, dk / dv) and no Triton kernel."""
    args = [jax.ShapeDtypeStruct((2, 300, 20, 128), jnp.bfloat16),
            jax.ShapeDtypeStruct((2, 300, 4, 128), jnp.bfloat16),
            jax.ShapeDtypeStruct((2, 300, 4, 128), jnp.bfloat16),
            jax.ShapeDtypeStruct((2, 300), jnp.int32)]

    def loss(q, k, v, seg):
        out, lse = rankattn.attention(q, k, v, segment_ids=seg, causal=True, softcap=30.0,
                                      return_lse=True, impl=MosaicGpu())
        return out.astype(jnp.float32).sum() + jnp.where(jnp.isfinite(lse), lse, 0).sum()

    text = lower_for_cuda(jax.value_and_grad(loss, (0, 1, 2)), *args).as_text()
    assert len(re.findall(r"custom_call @mosaic_gpu", text)) == 3, "forward, dq, dk / dv"
    assert "__gpu$xla.gpu.triton" not in text
    assert all(f"rankattn_{k}" in text for k in ("forward", "dq", "dkv")), "the kernels' names"


def test_the_blocks_launched_together_share_a_row_and_head(monkeypatch):
    """Mosaic GPU makes a grid's last axis CUDA's x, launched fastest (jax's
    pallas/mosaic_gpu/lowering.py, _program_id): every kernel's grid ends with its block axis
    and starts with the batch, so blocks launched together read one row's K / V (or Q / dO)
    through L2. (The batch last launched different rows together, sharing nothing.)"""
    from rankattn.backends import mosaic_gpu
    launched = {}
    real_kernel = mosaic_gpu.plgpu.kernel

    def kernel(body, **kw):
        launched[body.__name__] = dict(zip(kw["grid_names"], kw["grid"]))
        return real_kernel(body, **kw)

    monkeypatch.setattr(mosaic_gpu.plgpu, "kernel", kernel)
    q = jax.ShapeDtypeStruct((3, 300, 4, 64), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((3, 300, 2, 64), jnp.bfloat16)

    def loss(q, k, v):
        return rankattn.attention(q, k, v, impl=MosaicGpu()).astype(jnp.float32).sum()

    lower_for_cuda(jax.grad(loss, (0, 1, 2)), q, kv, kv)
    assert launched == {"rankattn_forward": dict(batch=3, heads=4, q_block=3),
                        "rankattn_dq": dict(batch=3, heads=4, q_block=3),
                        "rankattn_dkv": dict(batch=3, heads=2, k_block=3)}
    assert all(list(grid)[0] == "batch" and list(grid)[-1].endswith("_block")
               for grid in launched.values())


def call_of(dtype=jnp.bfloat16, d=128, dv=None, shard_mask=None, batch=1) -> AttentionCall:
    shape = jax.ShapeDtypeStruct
    return AttentionCall(q=shape((batch, 64, 2, d), dtype), k=shape((batch, 64, 1, d), dtype),
                         v=shape((batch, 64, 1, dv or d), dtype), segment_ids=None,
                         causal=False, scale=1.0, softcap=None, softcap_method="tanh",
                         shard_mask=shard_mask)


@pytest.mark.parametrize("call, fragment", [
    (call_of(jnp.float32), "float32"),
    (call_of(d=200), "head dim 200"),
    (call_of(d=128, dv=32), "v head dim 32"),
    (call_of(batch=65536), "batch 65536"),  # CUDA's grid z: at most 65535
])
def test_what_it_cannot_run_is_declined_with_the_fix(call, fragment):
    (reason,) = MosaicGpu().not_supported_reasons(call)
    assert fragment in reason and "impl='pallas_triton'" in reason
    assert MosaicGpu().not_supported_reasons(call_of()) == []


def test_by_name_it_needs_a_hopper_gpu():
    (reason,) = MosaicGpu().platform_reasons()
    assert "mosaic_gpu needs a GPU" in reason
    assert MosaicGpu(interpret=True).platform_reasons() == []
    assert mosaic_gpu_interpret.IMPORT_ERROR is None  # the interpreter's fixes apply here


@pytest.mark.parametrize("options, fragment", [
    (dict(interpret="yes"), "interpret='yes'"),
    (dict(block_sizes=BlockSizes(128, 32)), "block_sizes=BlockSizes(block_q=128, block_k=32)"),
    (dict(pipeline_depth=1), "pipeline_depth=1"),
    (dict(pipeline_depth=True), "pipeline_depth=True"),
    # Regressions: these named PallasTriton (the one it makes), or raised ValueError.
    (dict(tuned=True), "MosaicGpu tuned=True; pass None"),
    (dict(target="h100"), "MosaicGpu target='h100' names no GPU; pass one of 'sm_80'"),
    (dict(target="sm_75"), "MosaicGpu target='sm_75': compute capability (7, 5)"),
])
def test_options_are_checked(options, fragment):
    with pytest.raises(rankattn.RankattnTypeError, match="RA116") as error:
        MosaicGpu(**options)
    assert fragment in str(error.value)


MOSAIC_ENTRY = {"backend": "mosaic_gpu", "compute_capability": "9.0", "dtype": "bfloat16",
                "precision": "highest", "head_dim": [65, 128], "group": [1, 8],
                "config": {"block_q": 64, "block_k": 128, "num_warps": 4, "num_stages": 3,
                           "split_dkv": False, "key_major": False}}
TRITON_ENTRY = dict({k: v for k, v in MOSAIC_ENTRY.items() if k != "backend"},
                    config=dict(MOSAIC_ENTRY["config"], block_q=32, num_warps=8))


def table(tmp_path, *entries):
    path = tmp_path / f"table-{len(list(tmp_path.iterdir()))}.json"
    path.write_text(json.dumps({"schema": 1, "entries": list(entries)}))
    return path


def test_the_tuned_table_sets_blocks_and_pipeline_depth(tmp_path):
    tuned = MosaicGpu(tuned=table(tmp_path, TRITON_ENTRY, MOSAIC_ENTRY), target="sm_90")
    assert tuned.choices(jnp.bfloat16, 128, 5) == (BlockSizes(64, 128), 3)
    assert tuned.choices(jnp.float16, 128, 5) == (BlockSizes(128, 128), 2)  # no entry
    assert MosaicGpu(tuned=False).choices(jnp.bfloat16, 128, 5) == (BlockSizes(128, 128), 2)
    forced = MosaicGpu(BlockSizes(128, 64), pipeline_depth=4,
                       tuned=table(tmp_path, MOSAIC_ENTRY), target="sm_90")
    assert forced.choices(jnp.bfloat16, 128, 5) == (BlockSizes(128, 64), 4)
    assert BlockSizes(64, 128) in tuned.plan_sizes(1000)  # a plan prepares the entry's lists


def test_auto_takes_it_only_where_the_gpu_check_timed_it_fastest(tmp_path, monkeypatch):
    """The first table entry matching the call names the backend impl='auto' takes on this
    GPU; by name, mosaic_gpu runs whatever the table says."""
    q = jnp.zeros((1, 40, 2, 128), jnp.bfloat16)
    kv = jnp.zeros((1, 40, 1, 128), jnp.bfloat16)
    call = AttentionCall(q=q, k=kv, v=kv, segment_ids=None, causal=False, scale=1.0,
                         softcap=None, softcap_method="tanh")
    for entries, takes in [((MOSAIC_ENTRY,), True), ((TRITON_ENTRY, MOSAIC_ENTRY), False),
                           ((), False)]:
        mosaic = MosaicGpu(tuned=table(tmp_path, *entries), target="sm_90", interpret=True)
        assert (mosaic.auto_reasons(call) == []) == takes
        monkeypatch.setattr(api, "BACKENDS", {"mosaic_gpu": mosaic, "xla": Xla()})
        assert api.select_backend("auto", call).name == ("mosaic_gpu" if takes else "xla")
        assert api.select_backend([mosaic, "xla"], call) is mosaic
    (reason,) = mosaic.auto_reasons(call)
    assert "gpu.py --tune" in reason and "impl='mosaic_gpu'" in reason


@pytest.mark.parametrize("impl", ["auto", None, ["auto"], ["auto", "xla"], [None, "xla"]])
def test_auto_inside_a_list_passes_it_over_as_auto_alone_does(tmp_path, monkeypatch, impl):
    """Regression: auto_reasons were consulted for impl='auto' (or None) alone, so ["auto"] or
    ["auto", "xla"] took mosaic_gpu on a Hopper GPU whose table has no entry for it. Named
    (an instance), it runs whatever the table says, in a list with 'auto' too."""
    mosaic = MosaicGpu(tuned=table(tmp_path), target="sm_90", interpret=True)
    monkeypatch.setattr(api, "BACKENDS", {"mosaic_gpu": mosaic, "xla": Xla()})
    assert api.select_backend(impl, call_of()).name == "xla"
    assert api.select_backend([mosaic, impl], call_of()) is mosaic


def test_interpret_mode_is_declined_where_the_interpreter_fixes_do_not_apply(monkeypatch):
    """jax 0.11's interpreter imports the same modules but threads its state differently:
    the backend then declines interpret mode with the reason, never a deep AttributeError."""
    monkeypatch.setattr(mosaic_gpu_interpret, "IMPORT_ERROR", "JAX 0.11's interpreter")
    (reason,) = MosaicGpu(interpret=True).not_supported_reasons(call_of())
    assert "JAX 0.11's interpreter" in reason and "PallasTriton(interpret=True)" in reason
    assert MosaicGpu().not_supported_reasons(call_of()) == []


# --- The dk / dv kernel's logit gradients (flash_math.logit_grad_factor). -----------------


@pytest.mark.parametrize("method", ["tanh", "soft_sign"])
def test_the_caps_derivative_of_the_capped_logit_is_its_derivative(method):
    """semantics.softcap_grad_of_capped(softcap(s)) == softcap_grad(s), from logits well
    inside the cap to far past it (where both derivatives fall towards 0)."""
    from rankattn import semantics
    s = jnp.asarray(np.concatenate([np.linspace(-400, 400, 2001), [0.0, 1e-3, -1e-3]]),
                    jnp.float64 if jax.config.x64_enabled else jnp.float32)
    want = semantics.softcap_grad(s, 20.0, method)
    got = semantics.softcap_grad_of_capped(semantics.softcap(s, 20.0, method), 20.0, method)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0, atol=2e-5)


@pytest.mark.parametrize("softcap, method", [(None, "tanh"), (5.0, "tanh"), (2.0, "soft_sign")])
@pytest.mark.parametrize("multiplied", [False, True])
def test_the_gradient_factor_from_p_and_lse_matches_logit_grads(softcap, method, multiplied):
    """factor * (dp - delta) == logit_grads(p, dp, delta, scaled logits) on float32 blocks of
    [queries, keys] with masked keys, an empty row, a poisoned row (lse +inf) and multipliers
    of 1e-8, 0, negative and past 1 (given the scaled logits), or none (the cap's derivative
    recovered from p and the lse alone), each row to 2e-5 of its own largest value: the
    capped logit comes back as log2(p) + lse2, off by a few float32 ulps of lse2 (|lse2| < 40
    here: ~1e-5), which moves the derivative by ~1e-5 / cap."""
    from types import SimpleNamespace

    from rankattn.backends import flash_math
    st = SimpleNamespace(scale=0.3, softcap=softcap, softcap_method=method)
    rng = np.random.default_rng(3)
    qk = jnp.asarray(rng.normal(0, 8, (6, 40)), jnp.float32)
    s2, s_scaled = flash_math.capped_logits(st, qk)
    mult = jnp.asarray([1e-8, 0.0, -0.7, 2.0, 1.3, 1.0], jnp.float32)[:, None] if multiplied \
        else None
    seen = jnp.asarray(rng.random((6, 40)) < 0.7).at[4].set(False)  # row 4 sees nothing
    s2 = jnp.where(seen, flash_math.times(s2, mult), -jnp.inf)
    # Rows 4 (it sees nothing) and 5 (poisoned) arrive as +inf, as semantics.backward_rows
    # hands them to the kernels.
    lse2 = flash_math.lse2(jax.nn.logsumexp(s2 * flash_math.LN2, axis=1, keepdims=True)
                           ).at[4:].set(jnp.inf)
    p = jnp.exp2(s2 - lse2)
    dp = jnp.asarray(rng.normal(0, 1, (6, 40)), jnp.float32)
    delta = jnp.asarray(rng.normal(0, 1, (6, 1)), jnp.float32)
    want = flash_math.logit_grads(st, p, dp, delta, s_scaled, mult)
    if multiplied:  # the scaled logits given: the cap's derivative at them
        factor = flash_math.logit_grad_factor(st, p, mult, s=s_scaled)
    else:  # recovered from p and lse
        factor = flash_math.logit_grad_factor(st, p, lse2=lse2 if softcap else None)
    got = factor * (dp - delta)
    assert bool(jnp.isfinite(got).all())
    assert bool((got[~seen] == 0).all()) and bool((got[4:] == 0).all())
    per_row = np.abs(np.asarray(want)).max(axis=1, keepdims=True)  # each row at its own scale
    assert np.all(np.abs(np.asarray(got) - np.asarray(want)) <= 2e-5 * per_row), (got, want)
