"""benchmarks/tpu.py --smoke: the one-command TPU check runs end to end on CPU (interpret
mode, tiny shapes), so a TPU session spends its time measuring, not debugging the script."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from helpers import ROOT


def test_tpu_script_smoke(tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"),
                                                       os.environ.get("PYTHONPATH", "")]))
    result = subprocess.run([sys.executable, "benchmarks/tpu.py", "--smoke", "--out",
                             str(tmp_path)], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stdout[-5000:] + result.stderr[-5000:]
    report = json.loads((tmp_path / "tpu.json").read_text())
    # (a) both rankattn backends pass every check against the reference.
    assert {c["impl"] for c in report["checks"]} == {"pallas_tpu", "xla"}
    assert all(c["ok"] for c in report["checks"]), report["checks"]
    # (b) every implementation timed on both workloads: the peers matched the reference.
    assert report["failures"] == []
    timed = {(r["workload"], r["impl"]) for r in report["rows"]}
    assert timed == {(w, i) for w in ("nano-fwd", "packed-fwdbwd")
                     for i in ("pallas_tpu", "xla", "jax.nn.dpa (xla, dense mask)",
                               "splash (static mask)", "splash (dynamic mask)")}
    assert (tmp_path / "TPU.md").exists()


def test_a_run_cut_off_keeps_the_report_of_its_finished_phases(tmp_path, monkeypatch):
    """Issue 37: tpu.py writes its report after each phase, so a run stopped by the
    device's time limit keeps what it measured. Here the second workload is interrupted:
    the report and the JSON hold the first one's row (no kernel runs: the checks and the
    timing are stubbed)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import tpu

    def time_workload(w, *args):
        if time_workload.calls:
            raise KeyboardInterrupt  # the device's limit, mid-run
        time_workload.calls += 1
        return [dict(workload=w.name, impl="pallas_tpu", ms=1.0, tflops=1.0, peak=0.1,
                     ratio=1.0)]

    time_workload.calls = 0
    monkeypatch.setattr(tpu.device_checks, "correctness", lambda *args: [])
    monkeypatch.setattr(tpu, "time_workload", time_workload)
    monkeypatch.setattr(sys, "argv", ["tpu.py", "--smoke", "--out", str(tmp_path)])
    with pytest.raises(KeyboardInterrupt):
        tpu.main()
    rows = json.loads((tmp_path / "tpu.json").read_text())["rows"]
    assert [r["workload"] for r in rows] == ["nano-fwd"]
    assert "| nano-fwd | pallas_tpu |" in (tmp_path / "TPU.md").read_text()
