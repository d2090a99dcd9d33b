"""benchmarks/bench.py's generated reports: the targets it calls met or missed, and the files.

RESULTS.md, SWEEP.md and the README's results block are generated from saved
runs only; these tests feed hand-made runs with known ratios and check what
the report concludes from them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "benchmarks"))
import bench  # noqa: E402

SDPA, REF, FLEX = "torch sdpa (dense mask)", "dense reference", bench.FLEX


def row(workload, impl, ratio, ms=100.0, mm=0.5):
    return dict(workload=workload, impl=impl, ms=ms, ratio=ratio, ratio_q1=ratio - 0.01,
                ratio_q3=ratio + 0.01, rounds=5, mm=mm, temp_mib=None)


def run(sdpa_nano: float, note: str = "", machine: str = "Test CPU (AVX2), 2 cores",
        date: str = "2026-11-30 00:00") -> dict:
    rows = [row("nano-fwd", bench.OURS, 1.0, mm=0.72), row("nano-fwd", SDPA, sdpa_nano),
            row("nano-fwd", REF, 1.5),
            row("packed-fwd", bench.OURS, 1.0), row("packed-fwd", SDPA, 6.0),
            row("packed-fwd", FLEX, 1.1),
            row("packed-fwd-bf16", bench.OURS, 1.0), row("packed-fwd-bf16", bench.OURS_F32, 0.9),
            row("packed-fwd-bf16", FLEX, 1.2),
            row("packed-fwd-bf16", bench.OURS_XLA, 0.7),
            row("short-fwd", bench.OURS, 1.0), row("short-fwd", SDPA, 0.85)]
    meta = dict(date=date, jax="0", machine=machine, backend="cpu", torch="0", cpu="test cpu",
                cores=2, rate=1e11, notes=[note] if note else [])
    return dict(meta=meta, rows=rows, primitives=[dict(op="exp", xla_ms=2.0, torch_ms=1.0,
                                                         ratio=0.5)])


def sweep(date: str = "2026-11-30 01:00") -> dict:
    cells = []
    for value, ratio, direction in (("32", 1.3, "fwd"), ("64", 0.7, "fwd"), ("32", 1.1, "fwdbwd")):
        name = f"head dim={value} {direction}"
        cells.append(dict(dim="head dim", value=value, direction=direction, workload=name,
                          rows=[row(name, bench.OURS, 1.0), row(name, SDPA, ratio),
                                row(name, REF, ratio + 1)]))
    return dict(meta=dict(date=date, machine="Test CPU (AVX2), 2 cores", notes=[]), cells=cells)


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


def test_a_range_over_runs_names_each_runs_best_peer_where_they_differ():
    # Regression: the peer of run 1 was named for the whole range ("1.61-3.02x (jax.nn.dpa)"
    # on the Xeon's short-fwd, whose 1.61x was torch SDPA's in run 2).
    got = verdicts([run(1.7), run(1.2)])  # nano-fwd: the dense reference (1.5x) best in run 1
    assert got["nano-fwd >= 1.0x the best peer"] == (
        f"1.20-1.50x (run 1: {REF} 1.50x; run 2: {SDPA} 1.20x)", True)
    assert bench.best_peer_names([(None, None), (SDPA, row("nano-fwd", SDPA, 1.2))]) == SDPA


def test_rankattn_in_float32_and_its_xla_backend_are_not_peers_but_the_bf16_check():
    got = verdicts([run(1.0)])
    # 0.9 or 0.7 would be the best "peer" if rankattn's own float32 or xla runs counted.
    assert got["packed-fwd-bf16 >= 1.0x the best peer"] == (f"1.20x ({FLEX})", True)
    key = "packed-fwd-bf16: bf16 >= 1.3x faster than float32 (f32 time / bf16 time)"
    assert got[key] == ("0.90x", False)


def test_sweep_target_counts_cells_and_names_the_worst():
    got = verdicts([run(1.0)], sweep())
    assert got["every sweep cell, fwd, >= 1.0x the best peer"] == (
        f"1 of 2 shapes (the base cell, in every dimension, once); lowest 0.70x "
        f"(head dim=64, {SDPA})", False)
    assert got["every sweep cell, fwdbwd, >= 1.0x the best peer"][1] is True


def test_the_sweeps_base_cell_counts_once_regression():
    """Review: every dimension repeats the one measurement of the base cell (head dim 128,
    4/2 heads, batch 2, ...), so a miss there counted 7 times among "30 of 30 cells"."""
    cells = [dict(dim=dim, value=value, direction="fwd")
             for dim, values in bench.SWEEP_DIMENSIONS.items() for value in values]
    base = [c for c in cells if bench.is_base_cell(c["dim"], c["value"])]
    assert [(c["dim"], c["value"]) for c in base] == [
        ("head dim", "128"), ("q/kv heads", "4/2"), ("batch", "2"), ("history", "1024"),
        ("candidates", "64"), ("row", "1 session"), ("dtype", "float32")]
    kept = bench.distinct_cells(cells)
    assert len(kept) == len(cells) - 6 and base[0] in kept
    # The README's block counts each direction's base cell once too (it counted the forward
    # one only, so fwd+bwd lost its base cell: "20 of 23" for 21 of 24).
    rows = []
    for direction in ("fwd", "fwdbwd"):
        for dim, value, ratio in (("head dim", "128", 0.9), ("batch", "2", 0.9),
                                  ("head dim", "64", 1.2)):
            name = f"{dim}={value} {direction}"
            rows.append(dict(dim=dim, value=value, direction=direction, workload=name,
                             rows=[row(name, bench.OURS, 1.0), row(name, SDPA, ratio)]))
    machine = bench.Machine("M", [], dict(meta=dict(date="2026-12-07 00:00"), cells=rows))
    block = bench.readme_sweep_block([machine])
    assert ("| M | 2026-12-07 00:00 | 1 of 2; lowest 0.90x (head dim=128) | 1 of 2; lowest "
            "0.90x (head dim=128) | not run, not run |") in block, block


def test_round_orders_never_time_a_function_right_after_its_own_call_regression():
    """Review: reversing every other round timed the first and last names (rankattn among
    them) right after their own calls in half the rounds, the others never. Each round now
    holds every name once, no round starts with the name the last ended with, and every name
    comes after each of the others."""
    names = ["rankattn", "xla", "dense", "jax.nn", "sdpa", "flex"]
    orders = bench.peers.round_orders(names, 40)
    assert all(sorted(order) == sorted(names) for order in orders)
    calls = [name for order in orders for name in order]
    assert all(a != b for a, b in zip(calls, calls[1:]))
    for name in names:
        before = {calls[i - 1] for i in range(1, len(calls)) if calls[i] == name}
        assert before == set(names) - {name}, (name, before)
    pair = bench.peers.round_orders(["a", "b"], 3)
    assert pair[0] == pair[1] == pair[2]  # two names alternate
    seen = []
    bench.peers.interleaved_times({n: (lambda n=n: seen.append(n)) for n in names}, 5,
                                  warm_up=False, settle_s=0.0)
    assert seen == [name for order in bench.peers.round_orders(names, 5) for name in order]


class BusyUntil:
    """A stand-in for peers' clock: the process uses one core until ``busy_s`` of wall time
    (never idle when None), then none; sleep advances the clock, as a loaded machine might,
    by more than it was asked."""

    def __init__(self, busy_s):
        self.now, self.cpu, self.busy_s = 0.0, 0.0, busy_s

    def perf_counter(self):
        return self.now

    def process_time(self):
        return self.cpu

    def sleep(self, seconds):
        end = self.now + 1.5 * seconds
        busy_end = end if self.busy_s is None else min(end, max(self.now, self.busy_s))
        self.cpu += busy_end - self.now
        self.now = end


def test_settle_waits_for_work_left_running_after_a_call_regression(monkeypatch):
    """Stop 72: the dense reference's memory was returned on a background thread for up to
    half a second after its call, which ran into the next call's time. settle() waits past
    its pause until the process is quiet (busy for 0.3 s here), gives up after its limit
    (busy for good), waits for nothing without a pause, and off the CPU backend for the
    pause only. (A clock of its own: a spinning thread could lose a whole window to the
    scheduler on a loaded 2-core machine.)"""
    for busy_s, pause, limit, backend, low, high in [
            (0.3, 0.02, 5.0, "cpu", 0.3, 0.32), (None, 0.02, 0.1, "cpu", 0.12, 0.15),
            (None, 0.0, 5.0, "cpu", 0.0, 0.0), (None, 0.02, 5.0, "gpu", 0.02, 0.035),
            (0.0, 0.02, 5.0, "cpu", 0.02, 0.04)]:
        clock = BusyUntil(busy_s)
        monkeypatch.setattr(bench.peers, "time", clock)
        monkeypatch.setattr(bench.peers.jax, "default_backend", lambda: backend)
        bench.peers.settle(pause, limit_s=limit)
        assert low <= clock.now <= high, (busy_s, pause, limit, backend, clock.now)


@pytest.mark.parametrize("sessions", [((1024, 128),), ((960, 64),) * 3, ((5, 0), (1, 7))])
def test_visible_pairs_count_the_oracles_mask(sessions):
    """The FLOP count behind "% mm": visible (query, key) pairs of candidate isolation,
    against the float64 oracle's mask of the same segment ids."""
    import oracle

    w = bench.Workload("w", 2, sessions, 4, 2, 64)
    assert w.visible_pairs * w.batch == oracle.mask_dense(w.segment_ids(), False).sum()
    assert w.flops == 4 * 64 * 4 * w.visible_pairs * w.batch


def test_a_peer_that_computes_something_else_is_caught():
    """Review: nothing compared a peer's output with rankattn's. disagreement() measures it
    (torch's [B, H, S, D] results transposed), and run_workload drops a peer past AGREEMENT."""
    rng = np.random.default_rng(0)
    out = rng.normal(size=(2, 8, 4, 16)).astype(np.float32)
    off = out.copy()
    off[0, 3] += 0.5  # one row another mask would move
    results = {bench.OURS: out, "same": out + 1e-7, "other": off,
               bench.OURS_F32: rng.normal(size=out.shape)}
    got = bench.disagreement(results)
    assert got["same"] < 1e-6 and got["other"] > bench.AGREEMENT["float32"]
    assert bench.OURS_F32 not in got  # other inputs: not compared


def write_records(folder, runs=(), sweep_=None) -> None:
    folder.mkdir(parents=True)
    for i, record in enumerate(runs):
        (folder / f"run-{i + 1}.json").write_text(json.dumps(record))
    if sweep_:
        (folder / "sweep.json").write_text(json.dumps(sweep_))


def test_reports_are_written_from_the_saved_runs_only(tmp_path):
    results = tmp_path / "results"
    write_records(results / "test-cpu-avx2-2-cores",
                  [run(ratio, note=f"note {i}") for i, ratio in enumerate((0.8, 0.9))], sweep())
    readme = tmp_path / "README.md"
    readme.write_text(f"intro\n{bench.README_BEGIN}\nstale numbers\n{bench.README_END}\n"
                      f"{bench.SWEEP_BEGIN}\nstale sweep\n{bench.SWEEP_END}\nend\n")
    bench.write_reports(str(results), str(tmp_path), str(readme), draw=False)

    text = (tmp_path / "RESULTS.md").read_text()
    assert "| nano-fwd >= 1.0x the best peer | 0.80-0.90x" in text and "MISSED" in text
    assert "- note 0" in text and "- note 1" in text
    assert "| exp | 2.00 | 1.00 | 0.50 |" in text
    rows = [line for line in text.splitlines() if line.startswith("| nano-fwd | ")]
    # one row per implementation over both runs, and the machines' table
    assert len(rows) == len(set(rows)) == 4 and "| nano-fwd | 0.80-0.90 | 72% |" in rows

    block = readme.read_text()
    assert "stale numbers" not in block and block.startswith("intro\n") and block.endswith("end\n")
    assert f"| Test CPU (AVX2), 2 cores | nano-fwd | 100 | {SDPA} | 0.80-0.90 |" in block
    assert "stale sweep" not in block and ("| Test CPU (AVX2), 2 cores | 2026-11-30 01:00 | "
                                           "1 of 2; lowest 0.70x (head dim=64) | 1 of 1; lowest "
                                           "1.10x (head dim=32) | not run, not run |") in block

    sweep_md = (tmp_path / "SWEEP.md").read_text()
    assert f"| head dim | 64 | fwd | 100.0 | {SDPA} | 100.0 | 0.70 | 0.69-0.71 |" in sweep_md


def test_every_machine_keeps_its_own_section_the_newest_first(tmp_path):
    """Two machines' records: RESULTS.md's first table has a pair of columns per machine
    (the newest first), then a section each with its own runs' verdicts; SWEEP.md a table per
    machine with a sweep; the README block a row per machine and workload."""
    results, zen, xeon = tmp_path / "results", "Zen (AVX2), 2 cores", "Xeon (AMX), 2 cores"
    write_records(results / "zen", [run(1.2, machine=zen, date="2026-12-03 10:00")])
    write_records(results / "xeon", [run(0.8, machine=xeon), run(0.9, machine=xeon)], sweep())
    readme = tmp_path / "README.md"
    readme.write_text(f"{bench.README_BEGIN}\n{bench.README_END}\n")
    bench.write_reports(str(results), str(tmp_path), str(readme), draw=False)

    text = (tmp_path / "RESULTS.md").read_text()
    assert f"| workload | {zen}: peer / rankattn | % mm | {xeon}: peer / rankattn | % mm |" in text
    assert "| nano-fwd | 1.20 | 72% | 0.80-0.90 | 72% |" in text
    zen_part, xeon_part = text.split(f"## {zen}\n")[1].split(f"## {xeon}\n")
    assert "| nano-fwd >= 1.0x the best peer | 1.20x" in zen_part and "sweep" not in zen_part
    assert "| nano-fwd >= 1.0x the best peer | 0.80-0.90x" in xeon_part
    assert "every sweep cell, fwd" in xeon_part
    sweep_md = (tmp_path / "SWEEP.md").read_text()
    assert f"## {xeon}" in sweep_md and f"## {zen}" not in sweep_md
    assert f"are of {xeon}" in sweep_md
    block = readme.read_text()
    assert block.index(f"| {zen} | nano-fwd | 100 | {SDPA} | 1.20 |") < block.index(
        f"| {xeon} | nano-fwd | 100 | {SDPA} | 0.80-0.90 |")


def test_this_machines_records_go_to_the_folder_named_after_it(tmp_path, monkeypatch):
    monkeypatch.setattr(bench.peers, "machine_description",
                        lambda: "AMD EPYC (Zen 3, AVX2), 2 cores")
    assert bench.machine_folder(str(tmp_path)) == str(tmp_path / "amd-epyc-zen-3-avx2-2-cores")
    assert bench.peers.machine_slug("Intel(R) Xeon(R) Processor (AMX), 2 cores") == (
        "intel-xeon-processor-amx-2-cores")


@pytest.mark.parametrize("model, family, flags, described", [
    ("AMD EPYC", 25, "sse avx2", "AMD EPYC (Zen 3, AVX2)"),
    ("AMD EPYC", 25, "avx2 avx512f", "AMD EPYC (Zen 4, AVX-512)"),
    ("AMD EPYC 9B45", 26, "avx2 avx512f", "AMD EPYC 9B45 (Zen 5, AVX-512)"),
    ("AMD EPYC 7B12", 23, "avx2", "AMD EPYC 7B12 (Zen / Zen 2, AVX2)"),
    ("Intel(R) Xeon(R) Processor", 6, "avx2 avx512f amx_bf16",
     "Intel(R) Xeon(R) Processor (AMX)"),
])
def test_machine_description_names_the_vector_isa_and_an_amd_generation(
        monkeypatch, model, family, flags, described):
    """A KVM guest shows "AMD EPYC" alone: the Zen generation comes from the CPU family (and
    AVX-512, which Zen 3 lacks and Zen 4 has)."""
    lscpu = f"Architecture: x86_64\nModel name:  {model}\nCPU family:  {family}\nFlags: {flags}\n"
    monkeypatch.setattr(bench.peers.subprocess, "run",
                        lambda *a, **k: subprocess.CompletedProcess(a, 0, lscpu, ""))
    monkeypatch.setattr(bench.peers.os, "cpu_count", lambda: 2)
    assert bench.peers.machine_description() == f"{described}, 2 cores"


@pytest.mark.parametrize("values, shown", [([1.0, 1.0], "1.00"), ([0.8, 1.2], "0.80-1.20"),
                                           ([None, 2.0], "2.00"), ([None], "")])
def test_span(values, shown):
    assert bench.span(values) == shown


def test_serving_records_of_every_machine_side_by_side(tmp_path):
    """bench_serving's section-1b table of every machine: this run first, then the other
    machines' records under results/, the newest first; this machine's old record left out."""
    import bench_serving

    def record(machine, date, ratio):
        return dict(machine=machine, date=date, cells=[
            dict(shape=[4, 1022, 64, 4, 2, "float32", None], ratio=[ratio, ratio + 0.1],
                 ratio_warm=[ratio + 0.2, ratio + 0.3])])

    old_here, xeon = record("Here", "2026-12-01", 0.5), record("Xeon", "2026-12-02", 0.9)
    xeon["cells"].append(dict(shape=[1, 16384, 64, 4, 2, "float32", 2048], ratio=[2.0, 2.0],
                              ratio_warm=[3.0, 3.0]))
    write_records(tmp_path / "here")
    (tmp_path / "here" / "serving.json").write_text(json.dumps(old_here))
    write_records(tmp_path / "xeon")
    (tmp_path / "xeon" / "serving.json").write_text(json.dumps(xeon))
    records = bench_serving.machine_records(str(tmp_path), record("Here", "2026-12-03", 1.2))
    text = bench_serving.machines_table(records)
    assert "| shape | Here, 2026-12-03 | Xeon, 2026-12-02 |" in text
    assert "| 4 x 1022 x 64, 4/2, float32 | 1.20x 1.30x / 1.40x 1.50x | 0.90x 1.00x / 1.10x 1.20x |" in text
    assert "| 1 x 16384 x 64, 4/2, float32, Quest 2048 |  | 2.00x 2.00x / 3.00x 3.00x |" in text
    assert "0.50x" not in text


def test_a_sweep_of_one_direction_leaves_the_other_not_measured():
    """(A machine's first `--sweep --direction fwd`: no fwdbwd cell at all.)"""
    one = sweep()
    one["cells"] = [c for c in one["cells"] if c["direction"] == "fwd"]
    got = verdicts([run(1.0)], one)
    assert got["every sweep cell, fwdbwd, >= 1.0x the best peer"] == ("no cell with a peer", None)
    assert got["every sweep cell, fwd, >= 1.0x the best peer"][1] is False


def test_a_merged_sweep_keeps_each_directions_own_date():
    merged = dict(meta=dict(date="fwd 2026-12-01 10:00; fwdbwd 2026-12-02 11:00"))
    assert bench.direction_date(merged, "fwd") == "2026-12-01 10:00"
    assert bench.direction_date(merged, "fwdbwd") == "2026-12-02 11:00"
    assert bench.direction_date(sweep(), "fwd") == "2026-11-30 01:00"
    machine = bench.Machine("m", [run(1.0, date="2026-11-30 09:00")], merged)
    assert (machine.latest, machine.swept) == ("2026-12-02 11:00", "2026-12-02 11:00")


CHILD_PEAKS = ("import resource, sys; sys.path.insert(0, sys.argv[1]); import bench; "
               "print(bench.own_peak_rss_bytes(), "
               "resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)")


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="VmHWM is Linux's")
def test_the_memory_note_measures_the_child_not_the_process_that_started_it():
    # Regression: the RSS child printed ru_maxrss, which Linux carries over from the parent
    # across fork and exec: RESULTS.md said 13-14 GiB for a call that peaks under 1 GiB.
    parent = bytearray(768 * 2 ** 20)  # touched: resident in this process
    parent[::4096] = b"x" * len(parent[::4096])
    out = subprocess.run([sys.executable, "-c", CHILD_PEAKS, os.path.dirname(bench.__file__),
                          "--no-torch"],  # bench.py then leaves torch out, as its child does
                         capture_output=True, text=True, check=True).stdout.split()
    own, inherited = int(out[0]), int(out[1])
    assert inherited >= len(parent), "ru_maxrss no longer inherits: the test shows nothing"
    assert own < len(parent) // 2, f"own peak {own / 2 ** 20:.0f} MiB: the parent's pages"


def test_memory_notes_from_getrusage_say_what_they_measured(tmp_path):
    old = ("long-history-fwdbwd: peak RSS of a process running only rankattn (inputs included) "
           "13.22 GiB in this run; one dense float32 [S, S] tensor is 4.0 GiB per head")
    new = (f"long-history-fwdbwd: {bench.RSS_NOTE}, inputs included: 0.96 GiB in this run; one "
           "dense float32 [S, S] tensor is 4.0 GiB per head")
    assert bench.shown_note(new) == new
    shown = bench.shown_note(old)
    assert shown.startswith("long-history-fwdbwd: no peak memory of rankattn alone")
    assert "13.22 GiB was getrusage's ru_maxrss" in shown and "4.0 GiB per head" in shown
    assert bench.shown_note("prod-heads-fwd: torch flex failed") == "prod-heads-fwd: torch flex failed"


def load_point(kind: str, offered: float, answered: float) -> dict:
    return dict(kind=kind, client=dict(offered_qps=offered, window_qps=answered))


def test_a_capacity_point_the_server_kept_up_with_is_a_lower_bound():
    # Regression: CLUSTER.md called the affinity cluster's 414.3 / s its capacity, and 1.3x
    # one server's, though it had answered all 402.2 / s offered (not saturated).
    import bench_cluster
    from examples.ranker import serverbench

    kept_up = load_point("capacity", 402.2, 414.3)
    full = load_point("capacity", 402.2, 317.2)
    assert serverbench.point_kind(kept_up) == "capacity, not saturated"
    assert serverbench.capacity_shown(kept_up) == ">= 414.3"
    assert (serverbench.point_kind(full), serverbench.capacity_shown(full)) == ("capacity", "317.2")
    assert serverbench.point_kind(load_point("low", 20.0, 20.0)) == "low"
    assert bench_cluster.capacity_ratio(kept_up, full) == "at least 1.3x"
    assert bench_cluster.capacity_ratio(full, full) == "1.0x"
    assert bench_cluster.capacity_ratio(full, kept_up) == "at most 0.8x"
    assert "unknown" in bench_cluster.capacity_ratio(kept_up, kept_up)
