"""pallas_triton's tuned table (rankattn.backends.gpu_config): the configurations
benchmarks/gpu.py --tune timed on a GPU are what calls on that GPU use; a missing table is
silent, a malformed one costs one warning and nothing else; a rewritten table is read again."""

from __future__ import annotations

import json
import os
import re
import warnings

import jax
import jax.numpy as jnp
import pytest

import rankattn
from rankattn.backends import BlockSizes, PallasTriton, gpu_config
from rankattn.backends.gpu_config import KernelConfig, TunedEntry, parse_table

from helpers import lower_for_cuda

ENTRY = {"compute_capability": "9.0", "dtype": "bfloat16", "precision": "highest",
         "head_dim": [65, 128], "group": [3, 8],
         "config": {"block_q": 128, "block_k": 64, "num_warps": 4, "num_stages": 3,
                    "split_dkv": True, "key_major": True}}
TUNED = KernelConfig(BlockSizes(128, 64), True, 4, key_major=True, num_stages=3)


def write_table(path, *entries, **extra):
    path.write_text(json.dumps({"schema": 1, "entries": list(entries), **extra}))
    return path


def test_an_entry_sets_the_configuration_of_the_calls_it_matches(tmp_path):
    table = write_table(tmp_path / "t.json", ENTRY)
    impl = PallasTriton(target="sm_90", tuned=table)
    builtin = PallasTriton(target="sm_90", tuned=False)
    assert impl.config(jnp.bfloat16, 128, group=5) == TUNED
    assert impl.config(jnp.bfloat16, 80, group=3) == TUNED   # D=80 runs as 128: in range
    assert builtin.config(jnp.bfloat16, 128, group=5) != TUNED
    for dtype, head_dim, group in ((jnp.bfloat16, 128, 2),   # group out of range
                                   (jnp.bfloat16, 256, 5),   # head dim out of range
                                   (jnp.float16, 128, 5)):   # another dtype
        assert impl.config(dtype, head_dim, group) == builtin.config(dtype, head_dim, group)
    # Any GPU of that compute capability: a named target, a GpuTarget, not another one.
    assert PallasTriton(target=(9, 0), tuned=table).config(jnp.bfloat16, 128, 5) == TUNED
    assert (PallasTriton(target="sm_80", tuned=table).config(jnp.bfloat16, 128, 5)
            == PallasTriton(target="sm_80", tuned=False).config(jnp.bfloat16, 128, 5))
    # Options given to the instance still win over the table.
    forced = PallasTriton(BlockSizes(32, 32), num_warps=8, target="sm_90", tuned=table)
    assert forced.config(jnp.bfloat16, 128, 5) == KernelConfig(BlockSizes(32, 32), True, 8,
                                                               key_major=True, num_stages=3)


def test_float32_entries_are_per_dot_precision(tmp_path):
    entry = dict(ENTRY, dtype="float32", precision="high", group=[1, 8])
    table = write_table(tmp_path / "t.json", entry)
    assert PallasTriton(target="sm_90", precision="high", tuned=table).config(
        jnp.float32, 128) == TUNED
    assert PallasTriton(target="sm_90", tuned=table).config(jnp.float32, 128) == \
        PallasTriton(target="sm_90", tuned=False).config(jnp.float32, 128)  # "highest"


def test_the_first_matching_entry_wins(tmp_path):
    second = dict(ENTRY, config=dict(ENTRY["config"], block_q=32))
    table = write_table(tmp_path / "t.json", ENTRY, second)
    assert PallasTriton(target="sm_90", tuned=table).config(jnp.bfloat16, 128, 5) == TUNED


def test_the_kernels_are_launched_with_the_tuned_warps_and_stages(tmp_path):
    """Not only config(): the lowered kernels carry the entry's launch options."""
    entry = dict(ENTRY, head_dim=[16, 64], group=[2, 2],
                 config=dict(ENTRY["config"], block_q=32, block_k=16, num_warps=2, num_stages=3))
    impl = PallasTriton(target="sm_90", tuned=write_table(tmp_path / "t.json", entry))
    args = [jax.ShapeDtypeStruct(s, jnp.bfloat16) for s in ((1, 70, 4, 64), (1, 70, 2, 64),
                                                           (1, 70, 2, 64))]
    loss = lambda q, k, v: rankattn.attention(q, k, v, impl=impl).astype(jnp.float32).sum()
    text = lower_for_cuda(jax.grad(loss, (0, 1, 2)), *args).as_text()
    launches = re.findall(r"num_stages = (\d+) : i32, num_warps = (\d+)", text)
    assert len(launches) == 4 and set(launches) == {("3", "2")}, launches  # fwd, dq, dk, dv


def test_a_plan_prepares_the_tiles_of_every_entry_for_this_gpu(tmp_path):
    other = dict(ENTRY, compute_capability="8.0",
                 config=dict(ENTRY["config"], block_q=16, block_k=128))
    table = write_table(tmp_path / "t.json", ENTRY, other)
    impl = PallasTriton(target="sm_90", tuned=table)
    plan = rankattn.plan(segment_ids=jnp.ones((1, 300), jnp.int32), impl=[impl])
    assert BlockSizes(128, 64) in plan.block_sizes
    assert BlockSizes(16, 128) not in plan.block_sizes  # sm_80's entry: never used here
    for dtype in (jnp.bfloat16, jnp.float16, jnp.float32):
        for head_dim in (64, 128, 256):
            for group in (1, 5):
                assert impl.config(dtype, head_dim, group).block_sizes in plan.block_sizes


def test_the_environment_variable_names_the_table(tmp_path, monkeypatch):
    monkeypatch.setenv(gpu_config.TUNED_TABLE_ENV, str(write_table(tmp_path / "t.json", ENTRY)))
    assert PallasTriton(target="sm_90").config(jnp.bfloat16, 128, 5) == TUNED


def test_a_missing_table_is_silent(tmp_path, monkeypatch):
    monkeypatch.setenv(gpu_config.TUNED_TABLE_ENV, str(tmp_path / "absent.json"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert PallasTriton(target="sm_90").config(jnp.bfloat16, 128, 5) == \
            PallasTriton(target="sm_90", tuned=False).config(jnp.bfloat16, 128, 5)


@pytest.mark.parametrize("text, reason", [
    ("{not json", "Expecting property name"),
    (json.dumps({"schema": 2, "entries": []}), '"schema": 1'),
    (json.dumps({"schema": 1, "entries": [dict(ENTRY, config=dict(ENTRY["config"],
                                                                  block_q=48))]}),
     "entries[0]: config.block_q must be a power of two >= 16, not 48"),
    (json.dumps({"schema": 1, "entries": [ENTRY, {k: v for k, v in ENTRY.items()
                                                  if k != "group"}]}),
     "entries[1]: missing ['group']"),
    (json.dumps({"schema": 1, "entries": [dict(ENTRY, head_dim=[128, 64])]}),
     "head_dim must be [low, high]"),
    (json.dumps({"schema": 1, "entries": [dict(ENTRY, compute_capability="sm_90")]}),
     'compute_capability must be like "9.0"'),
    (json.dumps({"schema": 1, "entries": [dict(ENTRY, backend="cudnn")]}),
     "entries[0]: backend must be one of ('pallas_triton', 'mosaic_gpu'), not 'cudnn'"),
    (json.dumps({"schema": 1, "entries": [dict(ENTRY, backend="mosaic_gpu", config=dict(
        ENTRY["config"], block_k=32))]}),
     "entries[0]: config.block_k of a mosaic_gpu entry must be one of (64, 128), not 32"),
    (json.dumps({"schema": 1, "entries": [dict(ENTRY, backend="mosaic_gpu", config=dict(
        ENTRY["config"], num_stages=1))]}),
     "mosaic_gpu entry must be null or one of (2, 3, 4), not 1"),
    # Regressions: a table that is not UTF-8 or nests past the recursion limit raised on every
    # call, and num_warps 4.0 or true passed as 4 or 1 (then failed in Triton's lowering).
    pytest.param('{"schema": 1, "entries": []}'.encode("utf-16"),
                 "'utf-8' codec can't decode", id="utf-16"),
    pytest.param("[" * 100_000, "maximum recursion depth", id="nested-past-the-limit"),
    pytest.param(json.dumps({"schema": 1, "entries": [dict(ENTRY, config=dict(
        ENTRY["config"], num_warps=4.0))]}),
        "config.num_warps must be 1, 2, 4, 8 or 16, not 4.0", id="num_warps-4.0"),
    pytest.param(json.dumps({"schema": 1, "entries": [dict(ENTRY, config=dict(
        ENTRY["config"], num_warps=True))]}),
        "config.num_warps must be 1, 2, 4, 8 or 16, not True", id="num_warps-true"),
])
def test_a_malformed_table_falls_back_with_one_warning(tmp_path, monkeypatch, text,
                                                                    reason):
    path = tmp_path / "t.json"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    monkeypatch.setenv(gpu_config.TUNED_TABLE_ENV, str(path))
    builtin = PallasTriton(target="sm_90", tuned=False).config(jnp.bfloat16, 128, 5)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            assert PallasTriton(target="sm_90").config(jnp.bfloat16, 128, 5) == builtin
            rankattn.plan(segment_ids=jnp.ones((1, 40), jnp.int32),
                          impl=[PallasTriton(target="sm_90", interpret=True)])
    assert len(caught) == 1, [str(w.message) for w in caught]
    message = str(caught[0].message)
    assert reason in message and str(path) in message and "gpu.py --tune" in message


def test_a_table_rewritten_in_place_is_read_again(tmp_path, monkeypatch):
    """Regression (issue 35): the loader cached tables by path, so a table rewritten after a
    call had read it was never seen by that process (gpu.py's timing phase then ran the
    built-in default while saying it ran the tuned table)."""
    path = write_table(tmp_path / "t.json")
    monkeypatch.setenv(gpu_config.TUNED_TABLE_ENV, str(path))
    builtin = PallasTriton(target="sm_90", tuned=False).config(jnp.bfloat16, 128, 5)
    assert PallasTriton(target="sm_90").config(jnp.bfloat16, 128, 5) == builtin
    write_table(path, ENTRY)  # the same file, its contents replaced
    assert PallasTriton(target="sm_90").config(jnp.bfloat16, 128, 5) == TUNED
    assert PallasTriton(target="sm_90", tuned=path).config(jnp.bfloat16, 128, 5) == TUNED


def test_a_saved_table_is_read_even_where_timestamps_cannot_tell(tmp_path):
    """save_table drops the parsed tables: a table of the same size saved within one tick of
    the file system's clock (its mtime restored here to the old one) is still read anew."""
    path = tmp_path / "t.json"
    gpu_config.save_table(path, {"schema": 1, "entries": [ENTRY]})
    assert PallasTriton(target="sm_90", tuned=path).config(jnp.bfloat16, 128, 5) == TUNED
    before = path.stat()
    other = dict(ENTRY, config=dict(ENTRY["config"], block_q=256))  # the same length
    gpu_config.save_table(path, {"schema": 1, "entries": [other]})
    assert path.stat().st_size == before.st_size
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert PallasTriton(target="sm_90", tuned=path).config(
        jnp.bfloat16, 128, 5).block_sizes == BlockSizes(256, 64)


def test_save_table_refuses_what_the_library_would_ignore(tmp_path):
    path = tmp_path / "t.json"
    with pytest.raises(ValueError, match="block_q"):
        gpu_config.save_table(path, {"schema": 1, "entries": [
            dict(ENTRY, config=dict(ENTRY["config"], block_q=48))]})
    assert list(tmp_path.iterdir()) == []


def test_the_shipped_table_is_well_formed():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        entries = gpu_config.load_table(gpu_config.TUNED_TABLE)
    assert all(isinstance(e, TunedEntry) for e in entries)
    assert parse_table({"schema": 1, "entries": [e.to_json() for e in entries]}) == entries


def test_entries_round_trip_through_json():
    mosaic = dict(ENTRY, backend="mosaic_gpu")
    [entry, mosaic_entry] = parse_table({"schema": 1, "entries": [ENTRY, mosaic]})
    assert entry.config == TUNED and entry.to_json() == ENTRY and "backend" not in ENTRY
    assert entry.backend == "pallas_triton" and mosaic_entry.backend == "mosaic_gpu"
    assert mosaic_entry.to_json() == mosaic


def test_pallas_triton_reads_only_its_own_entries(tmp_path):
    """A mosaic_gpu entry before pallas_triton's configures no Triton kernel."""
    mosaic = dict(ENTRY, backend="mosaic_gpu", config=dict(ENTRY["config"], block_q=64))
    table = write_table(tmp_path / "t.json", mosaic, ENTRY)
    assert PallasTriton(target="sm_90", tuned=table).config(jnp.bfloat16, 128, 5) == TUNED
    only_mosaic = write_table(tmp_path / "m.json", mosaic)
    assert (PallasTriton(target="sm_90", tuned=only_mosaic).config(jnp.bfloat16, 128, 5)
            == PallasTriton(target="sm_90", tuned=False).config(jnp.bfloat16, 128, 5))


def test_tuned_must_be_a_path_none_or_false():
    with pytest.raises(rankattn.RankattnTypeError, match="RA116") as err:
        PallasTriton(tuned=True)
    assert "gpu.py --tune" in str(err.value) and "tuned=True" in str(err.value)
