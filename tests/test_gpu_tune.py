"""benchmarks/gpu_tune.py's decisions that need no GPU: which candidates a class times, the
GQA ranges its entries cover, and how a run's table merges into the committed one (the
whole phase runs end to end in tests/test_benchmark_smoke.py's gpu.py --smoke --tune)."""

from __future__ import annotations

import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "benchmarks"))
import gpu_compile  # noqa: E402
import gpu_tune  # noqa: E402
from gpu_compile import option  # noqa: E402
from gpu_tune import TuneClass  # noqa: E402
from rankattn.backends import BlockSizes, gpu_config  # noqa: E402

SM90 = (9, 0)
BF16_128 = TuneClass("bfloat16", 128, 4, 2)


def test_gqa_classes_split_the_groups_between_them():
    ranges = gpu_tune.group_ranges(gpu_tune.classes(smoke=False))
    assert ranges[TuneClass("bfloat16", 128, 4, 2)] == (1, 3)
    assert ranges[TuneClass("bfloat16", 128, 20, 4)] == (4, 64)
    assert ranges[TuneClass("float32", 128, 4, 2)] == (1, 64)  # alone at its dtype


def test_the_candidates_are_those_that_compiled_without_spilling_much():
    """From the committed deviceless compile: the 128 x 128 tiles (1460 bytes of dk
    spills at D=128) are left out, the 64 x 64 single dk / dv kernel (272 bytes) stays,
    and the default is never a candidate of its own."""
    report = gpu_tune.compile_report()
    assert report is not None, "benchmarks/results/gpu_candidates.json is committed"
    chosen = [c["options"] for c in gpu_tune.planned(BF16_128, SM90, False, report)]
    assert gpu_tune.default_options(BF16_128, SM90) not in chosen
    assert option(128, 128, 8, None, True) not in chosen
    assert option(64, 64, 8) in chosen
    spilled = {json.dumps(r["options"]): gpu_tune.max_spill(r) for r in report["candidates"]
               if r["config"]["dtype"] == "bfloat16" and r["config"]["head_dim"] == 128}
    assert 0 < spilled[json.dumps(option(64, 64, 8))] <= gpu_tune.SPILL_LIMIT
    assert all(spilled[json.dumps(o)] <= gpu_tune.SPILL_LIMIT for o in chosen)
    # Every class has something to time; without the report, every candidate is tried.
    for cls in gpu_tune.classes(smoke=False):
        assert gpu_tune.planned(cls, SM90, False, report), cls
    assert len(gpu_tune.planned(BF16_128, SM90, False, None)) == \
        len(gpu_compile.tune_candidates("bfloat16")) - 1  # less the default itself


def summary(cls: TuneClass, options: dict, ms: float, default_ms: float) -> dict:
    row = dict(options=options, ms=ms, default_ms=default_ms, ratio=ms / default_ms)
    return dict(cls=cls, best=row, rows=[row])


def test_a_winner_becomes_an_entry_for_its_head_dims_and_groups():
    classes = gpu_tune.classes(smoke=False)
    winner = option(128, 32, 8)
    [entry] = gpu_tune.table_entries(
        [summary(TuneClass("bfloat16", 128, 20, 4), winner, 1.0, 1.2),
         dict(cls=BF16_128, rows=[])],  # no winner: no entry
        SM90, classes)
    [parsed] = gpu_config.parse_table({"schema": 1, "entries": [entry]})
    assert (parsed.compute_capability, parsed.dtype, parsed.head_dim, parsed.group) == \
        (SM90, "bfloat16", (65, 128), (4, 64))
    assert parsed.config.block_sizes == BlockSizes(128, 32)
    assert entry["measured"]["ms"] == 1.0 and entry["measured"]["default_ms"] == 1.2


def test_a_run_replaces_its_gpus_entries_and_keeps_the_others(tmp_path):
    path = str(tmp_path / "table.json")
    classes = gpu_tune.classes(smoke=False)
    a100 = gpu_tune.table_entries([summary(BF16_128, option(64, 64, 8), 1.0, 2.0)], (8, 0),
                                  classes)
    gpu_tune.write_table(path, a100, (8, 0), {"device": "A100"})
    first = gpu_tune.table_entries([summary(BF16_128, option(128, 32, 8), 1.0, 2.0)], SM90,
                                   classes)
    gpu_tune.write_table(path, first, SM90, {"device": "H200"})
    second = gpu_tune.table_entries([summary(BF16_128, option(128, 64, 8), 1.0, 2.0)], SM90,
                                    classes)
    table = gpu_tune.write_table(path, second, SM90, {"device": "H200"})
    with open(path) as f:
        assert json.load(f) == table
    entries = gpu_config.parse_table(table)
    assert [(e.compute_capability, e.config.block_sizes.block_q) for e in entries] == \
        [((8, 0), 64), (SM90, 128)] and entries[1].config.block_sizes.block_k == 64
    assert set(table["measured"]) == {"8.0", "9.0"}


def test_a_malformed_table_on_disk_is_replaced_not_merged(tmp_path):
    path = tmp_path / "table.json"
    path.write_text("{broken")
    table = gpu_tune.write_table(str(path), [], SM90, {})
    assert table["entries"] == [] and gpu_config.parse_table(json.loads(path.read_text())) == ()


def test_an_entry_the_library_would_ignore_is_never_written(tmp_path):
    entry = gpu_tune.table_entries([summary(BF16_128, option(64, 32, 8), 1.0, 2.0)], SM90,
                                   gpu_tune.classes(smoke=False))[0]
    entry["config"]["block_q"] = 48  # not a power of two
    with pytest.raises(ValueError, match="block_q"):
        gpu_tune.write_table(str(tmp_path / "t.json"), [entry], SM90, {})
    assert not (tmp_path / "t.json").exists()


def test_past_its_budget_the_phase_skips_and_says_so(tmp_path):
    logged = []
    summaries = gpu_tune.run((8, 0), budget=0.0, smoke=True, repeats=1,
                             tolerances={"bfloat16": 2e-2}, jsonl=str(tmp_path / "t.jsonl"),
                             log=logged.append)
    assert [s.get("skipped") for s in summaries] == [True]
    assert "past the 0 s tune budget" in logged[0]
    assert gpu_tune.table_entries(summaries, (8, 0), gpu_tune.classes(smoke=True)) == []
