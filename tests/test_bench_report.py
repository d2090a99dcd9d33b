"""benchmarks/bench.py's generated reports: the targets it calls met or missed, and the files.

RESULTS.md, SWEEP.md and the README's results block are generated from saved
runs only; these tests feed hand-made runs with known ratios and check what
the report concludes from them.
"""

from __future__ import annotations

import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "benchmarks"))
import bench  # noqa: E402

SDPA, REF, FLEX = "torch sdpa (dense mask)", "dense reference", bench.FLEX


def row(workload, impl, ratio, ms=100.0, mm=0.5):
    return dict(workload=workload, impl=impl, ms=ms, ratio=ratio, ratio_q1=ratio - 0.01,
                ratio_q3=ratio + 0.01, rounds=5, mm=mm, temp_mib=None)


def run(sdpa_nano: float, note: str = "") -> dict:
    rows = [row("nano-fwd", bench.OURS, 1.0, mm=0.72), row("nano-fwd", SDPA, sdpa_nano),
            row("nano-fwd", REF, 1.5),
            row("packed-fwd", bench.OURS, 1.0), row("packed-fwd", SDPA, 6.0),
            row("packed-fwd", FLEX, 1.1),
            row("packed-fwd-bf16", bench.OURS, 1.0), row("packed-fwd-bf16", bench.OURS_F32, 0.9),
            row("packed-fwd-bf16", FLEX, 1.2),
            row("packed-fwd-bf16", bench.OURS_XLA, 0.7),
            row("short-fwd", bench.OURS, 1.0), row("short-fwd", SDPA, 0.85)]
    meta = dict(date="2026-11-30 00:00", jax="0", backend="cpu", torch="0", cpu="test cpu",
                cores=2, rate=1e11, notes=[note] if note else [])
    return dict(meta=meta, rows=rows, primitives=[dict(op="exp", xla_ms=2.0, torch_ms=1.0,
                                                         ratio=0.5)])


def sweep() -> dict:
    cells = []
    for value, ratio, direction in (("32", 1.3, "fwd"), ("64", 0.7, "fwd"), ("32", 1.1, "fwdbwd")):
        name = f"head dim={value} {direction}"
        cells.append(dict(dim="head dim", value=value, direction=direction, workload=name,
                          rows=[row(name, bench.OURS, 1.0), row(name, SDPA, ratio),
                                row(name, REF, ratio + 1)]))
    return dict(meta=dict(date="2026-11-30 01:00", notes=[]), cells=cells)


def verdicts(runs, sweep_=None) -> dict[str, tuple[str, bool | None]]:
    return {target: (measured, met) for target, measured, met in bench.targets(runs, sweep_)}


def test_targets_take_the_worst_run_and_the_best_peer():
    got = verdicts([run(0.8), run(0.9)])
    assert got["nano-fwd >= 1.0x the best peer"] == (f"0.80-0.90x ({SDPA})", False)
    assert got["nano-fwd >= 70% of the matmul rate"] == ("72%", True)
    assert got["packed-fwd >= 1.0x the best peer"] == (f"1.10x ({FLEX})", True)
    assert got["packed-fwd >= 2x the best dense-mask peer"] == ("6.00x", True)
    assert got["short-fwd >= 1.0x the best peer"] == (f"0.85x ({SDPA})", False)
    assert got["nano-fwd >= 1.0x the best peer"] != verdicts([run(1.2), run(1.0)])[
        "nano-fwd >= 1.0x the best peer"]


def test_rankattn_in_float32_and_its_xla_backend_are_not_peers_but_the_bf16_check():
    got = verdicts([run(1.0)])
    # 0.9 or 0.7 would be the best "peer" if rankattn's own float32 or xla runs counted.
    assert got["packed-fwd-bf16 >= 1.0x the best peer"] == (f"1.20x ({FLEX})", True)
    key = "packed-fwd-bf16: bf16 >= 1.3x faster than float32 (f32 time / bf16 time)"
    assert got[key] == ("0.90x", False)


def test_sweep_target_counts_cells_and_names_the_worst():
    got = verdicts([run(1.0)], sweep())
    assert got["every sweep cell, fwd, >= 1.0x the best peer"] == (
        f"1 of 2 cells; lowest 0.70x (head dim=64, {SDPA})", False)
    assert got["every sweep cell, fwdbwd, >= 1.0x the best peer"][1] is True


def test_reports_are_written_from_the_saved_runs_only(tmp_path):
    results = tmp_path / "results"
    results.mkdir()
    for i, ratio in enumerate((0.8, 0.9)):
        (results / f"run-{i + 1}.json").write_text(json.dumps(run(ratio, note=f"note {i}")))
    (results / "sweep.json").write_text(json.dumps(sweep()))
    readme = tmp_path / "README.md"
    readme.write_text(f"intro\n{bench.README_BEGIN}\nstale numbers\n{bench.README_END}\nend\n")
    bench.write_reports(str(results), str(tmp_path), str(readme), draw=False)

    text = (tmp_path / "RESULTS.md").read_text()
    assert "| nano-fwd >= 1.0x the best peer | 0.80-0.90x" in text and "MISSED" in text
    assert "- note 0" in text and "- note 1" in text
    assert "| exp | 2.00 | 1.00 | 0.50 |" in text
    rows = [line for line in text.splitlines() if line.startswith("| nano-fwd | ")]
    assert len(rows) == len(set(rows)) == 3  # one row per implementation, over both runs

    block = readme.read_text()
    assert "stale numbers" not in block and block.startswith("intro\n") and block.endswith("end\n")
    assert f"| nano-fwd | 100 | {SDPA} | 0.80-0.90 |" in block

    sweep_md = (tmp_path / "SWEEP.md").read_text()
    assert f"| head dim | 64 | fwd | 100.0 | {SDPA} | 100.0 | 0.70 | 0.69-0.71 |" in sweep_md


@pytest.mark.parametrize("values, shown", [([1.0, 1.0], "1.00"), ([0.8, 1.2], "0.80-1.20"),
                                           ([None, 2.0], "2.00"), ([None], "")])
def test_span(values, shown):
    assert bench.span(values) == shown
