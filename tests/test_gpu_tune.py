"""benchmarks/gpu.py's tune phase and plan, decided without a GPU: which candidates a class
times, when a timed candidate enters the table, the GQA ranges its entries cover, how a
run's table merges into the committed one, that the timing phase runs the table the tune
phase wrote, and that phases run only within the budget (the whole script runs end to end
in tests/test_benchmark_smoke.py's gpu.py --smoke --tune, and its dry run there)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import jax.numpy as jnp
import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "benchmarks"))
import gpu  # noqa: E402
import gpu_compile  # noqa: E402
import gpu_plan  # noqa: E402
import gpu_tune  # noqa: E402
from gpu_compile import option  # noqa: E402
from gpu_tune import TuneClass  # noqa: E402
from rankattn.backends import BlockSizes, MosaicGpu, PallasTriton, gpu_config  # noqa: E402

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
    report = gpu_plan.compile_report()
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
    row = dict(options=options, ms=ms, default_ms=default_ms, ratio=ms / default_ms,
               spread=0.01, wins=9, rounds=9, enters=True)
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


def test_mosaic_gpu_candidates_come_first_on_sm_90_for_the_production_class():
    report = gpu_plan.compile_report()
    mosaic = gpu_tune.MOSAIC_CANDIDATES
    prod = gpu_tune.MOSAIC_CLASS
    assert prod == TuneClass("bfloat16", 128, 20, 4)
    assert [c["options"] for c in gpu_tune.planned(prod, SM90, False, report)][:2] == mosaic
    for cls, capability, smoke in ((BF16_128, SM90, False), (prod, (8, 0), False),
                                   (prod, SM90, True)):
        assert not any(gpu_tune.is_mosaic(c["options"])
                       for c in gpu_tune.planned(cls, capability, smoke, report))
    impl = gpu_tune.impl_of(mosaic[1], interpret=False)
    assert isinstance(impl, MosaicGpu) and impl.choices(jnp.bfloat16, 128, 5) == (
        BlockSizes(128, 128), 3)
    assert gpu_tune.describe(mosaic[1]) == "mosaic_gpu 128x128 depth 3"


def test_a_mosaic_gpu_winner_is_entered_before_pallas_tritons_best(tmp_path):
    """The class's best overall first (what impl='auto' takes on this GPU), then
    pallas_triton's best (what impl='pallas_triton' reads)."""
    cls = TuneClass("bfloat16", 128, 20, 4)
    triton = summary(cls, option(128, 32, 8), 1.1, 1.2)["best"]
    mosaic = summary(cls, gpu_tune.MOSAIC_CANDIDATES[0], 0.8, 1.2)["best"]
    entries = gpu_tune.table_entries([dict(cls=cls, best=mosaic, best_triton=triton,
                                           rows=[mosaic, triton])], SM90,
                                     gpu_tune.classes(smoke=False))
    assert [e.get("backend", "pallas_triton") for e in entries] == ["mosaic_gpu",
                                                                      "pallas_triton"]
    path = tmp_path / "t.json"
    gpu_tune.write_table(str(path), entries, SM90, {})
    assert PallasTriton(target="sm_90", tuned=path).config(jnp.bfloat16, 128, 5).block_sizes \
        == BlockSizes(128, 32)
    assert MosaicGpu(tuned=path, target="sm_90").choices(jnp.bfloat16, 128, 5) == (
        BlockSizes(128, 128), 2)


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


def test_the_timing_phase_runs_the_table_the_tune_phase_wrote(tmp_path, monkeypatch):
    """Regression (issue 35): the correctness phase loaded the table pallas_triton reads
    (here named by $RANKATTN_GPU_TUNED, as the shipped one is by default), the tune phase
    rewrote that file, and the timing phase got the loader's cached empty table: it ran the
    built-in default as "pallas_triton", and dropped the default row as the same."""
    table = tmp_path / "gpu_tuned.json"
    table.write_text(json.dumps({"schema": 1, "entries": []}))
    monkeypatch.setenv(gpu_config.TUNED_TABLE_ENV, str(table))
    cls = TuneClass("bfloat16", 128, 4, 2)
    w = cls.workload(smoke=True)
    builtin = PallasTriton(tuned=False).config(w.dtype, w.head_dim, cls.group)
    assert PallasTriton().config(w.dtype, w.head_dim, cls.group) == builtin  # loaded

    run = gpu.Run(argparse.Namespace(smoke=False, tune=True, table=None, md=None,
                                     out=str(tmp_path / "out"), budget=540.0, repeats=1))
    winner = option(128, 64, 4, 3, True, True)
    run.summaries = [summary(cls, winner, 1.0, 2.0)]
    run.write_table()
    assert run.table_paths == [str(table), str(tmp_path / "out" / "gpu_tuned.json")]
    impls = run.workload_impls(w)
    tuned = impls["pallas_triton"].config(w.dtype, w.head_dim, cls.group)
    assert tuned == gpu_tune.impl_of(winner, False).config(w.dtype, w.head_dim, cls.group)
    assert tuned != builtin and "pallas_triton (built-in default)" in impls
    assert PallasTriton().config(w.dtype, w.head_dim, cls.group) == tuned


def times(default, candidate, again) -> dict:
    return {"default": np.array(default), "candidate": np.array(candidate),
            "default again": np.array(again)}


def test_a_candidate_enters_only_by_winning_most_rounds_by_more_than_the_noise():
    quiet = [1.0, 1.01, 0.99, 1.0, 1.0]
    # 10% faster in every round, the default's two runs 1% apart: enters.
    verdict = gpu_tune.decide(times(quiet, [0.9] * 5, [1.01, 1.0, 1.0, 0.99, 1.01]))
    assert verdict["enters"] and verdict["wins"] == 5 and verdict["ratio"] == pytest.approx(0.9,
                                                                                          abs=0.01)
    # 3% faster, but the default's own runs differ by 5%: noise, not a win.
    verdict = gpu_tune.decide(times(quiet, [0.97] * 5, [1.05, 0.95, 1.05, 0.95, 1.05]))
    assert not verdict["enters"] and verdict["spread"] == pytest.approx(0.05, abs=0.011)
    # A faster median from two lucky rounds of five: not most rounds.
    verdict = gpu_tune.decide(times(quiet, [0.5, 0.5, 1.1, 1.1, 1.1], quiet))
    assert verdict["wins"] == 2 and not verdict["enters"]
    # Below MIN_GAIN, however quiet the default.
    assert not gpu_tune.decide(times(quiet, [0.995 * x for x in quiet], quiet))["enters"]


def test_a_sample_is_back_to_back_calls_interleaved_in_rounds(monkeypatch):
    """On a clock that only the calls advance, so the sample's size cannot depend on how
    long a sleep took on a loaded machine (a real sleep that overran made a CI run see
    three calls to a sample instead of four)."""
    now, calls = [0.0], []

    def fn(name, seconds):
        def call():
            calls.append(name)
            now[0] += seconds
            return jnp.zeros(())
        return call

    monkeypatch.setattr(gpu_tune, "time", argparse.Namespace(perf_counter=lambda: now[0]))
    monkeypatch.setattr(gpu_plan, "SAMPLE_S", 0.02)
    t = gpu_tune.round_times({"b": fn("b", 0.001), "a": fn("a", 0.005)}, rounds=2)
    timed = calls[4:]  # after two warm-up calls each
    # ceil(20 ms / 5 ms) = 4 calls of the slower (not the first) make one sample, of each
    assert timed == ["b"] * 4 + ["a"] * 4 + ["a"] * 4 + ["b"] * 4  # the second round reversed
    assert set(t) == {"a", "b"}
    np.testing.assert_allclose(t["a"], [0.005, 0.005])  # seconds per call, not per sample
    np.testing.assert_allclose(t["b"], [0.001, 0.001])


def test_a_phase_runs_only_when_its_estimate_fits_what_is_left():
    phases = gpu_plan.Phases(budget_s=10.0, start=time.perf_counter() - 5.0)  # 5 s spent
    ran, logged = [], []
    assert phases.run("fits", 4.0, lambda: ran.append("fits"), logged.append)
    assert not phases.run("too long", 6.0, lambda: ran.append("too long"), logged.append)

    def broken():
        raise ValueError("no such kernel")

    assert phases.run("breaks", 1.0, broken, logged.append)
    assert ran == ["fits"]
    status = {p.name: p.status for p in phases.done}
    assert status["too long"].startswith("skipped: estimated 6 s, 5 s of the 10 s budget left")
    assert status["breaks"] == "failed: ValueError: no such kernel"
    table = "\n".join(phases.markdown())
    assert "| fits | 4.0 |" in table and "| too long | 6.0 |  | skipped" in table


def test_the_dry_run_sums_its_phases_and_the_plan_fits_one_command(capsys):
    """The plan's estimate is the sum of its phases', and it fits the default budget, a
    10-minute command less a margin: adding work to gpu.py without trimming fails here."""
    run = gpu.Run(argparse.Namespace(smoke=False, tune=None, table=None, md=None, out=None,
                                     budget=gpu_plan.COMMAND_S, repeats=9), dry=True)
    run.dry_run()
    text = capsys.readouterr().out
    rows = [line.split("|") for line in text.splitlines() if line.startswith("| ")
            and not line.startswith("| phase")]
    phases = {r[1].strip(): float(r[2]) for r in rows if not r[1].strip().startswith("**")}
    total = float(next(r[2] for r in rows if r[1].strip() == "**total**"))
    assert total == pytest.approx(sum(phases.values()), abs=0.1 * len(phases))
    assert list(phases)[:3] == ["start-up", "(a) correctness",
                                "(t) tune bfloat16 D=128 20/4"]  # the production class first
    assert phases["(b) prod-heads-fwd"] and list(phases).index("(b) prod-heads-fwd") < \
        list(phases).index("(b) nano-fwd")
    assert total <= gpu_plan.COMMAND_S <= 540 and "every phase fits" in text


def test_mosaic_gpu_is_checked_and_timed_on_sm_90_only():
    assert "mosaic_gpu" in gpu.timed_impls(None, True, False, SM90)
    assert "mosaic_gpu" not in gpu.timed_impls(None, True, False, (8, 0))
    assert "mosaic_gpu" not in gpu.timed_impls(None, True, True, SM90)  # --smoke
    run = gpu.Run(argparse.Namespace(smoke=False, tune=None, table=None, md=None, out=None,
                                     budget=gpu_plan.COMMAND_S, repeats=9), dry=True)
    # bf16 D=80, bf16 D=8 and f16 D=48 / 24 it takes; float32 and D=256 it declines.
    assert [i for i, case in enumerate(gpu.CHECKS)
            if "mosaic_gpu" in run.check_impls(case)[0]] == [0, 3, 5]


def test_compiles_are_priced_at_the_median_of_their_kind():
    """The built-in configurations of one dtype and head dim price a compile at their median:
    one slow outlier of a noisy report (12 s among 7-8 s) does not move the plan."""
    def result(seconds, impl="pallas_triton", **config):
        return {"error": None, "seconds": seconds,
                "config": dict(dict(dtype="bfloat16", head_dim=128, precision="highest",
                                    impl=impl), **config)}

    report = {"results": {"sm_90": [
        result(2.0), result(3.0), result(10.0), result(5.0, head_dim=64),
        result(7.0, "mosaic_gpu"), result(8.0, "mosaic_gpu"), result(12.0, "mosaic_gpu")]}}
    costs = gpu_plan.Costs(None, report)
    factor = gpu_plan.COMPILE_FACTOR
    assert costs.pallas_compile("bfloat16", 128) == pytest.approx(3.0 * factor)
    assert costs.pallas_compile("bfloat16", 64) == pytest.approx(5.0 * factor)
    assert costs.mosaic_compile("bfloat16", 128) == pytest.approx(8.0 * factor)
    assert costs.mosaic_compile("float16", 64) == pytest.approx(8.0 * factor)  # unknown: any
