"""benchmarks/gpu.py, the one-command GPU check, keeps running: its CPU smoke mode, checks only.

The GPU session gets one prepared command; this is what proves on every CI run that the
script still imports, checks pallas_triton and xla against the reference (interpret mode,
tiny shapes) and writes its report, so that GPU time is not spent on a broken script.
"""

from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_gpu_script_smoke_run_writes_its_report(tmp_path):
    report = tmp_path / "GPU.md"
    subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "gpu.py"), "--smoke",
                    "--budget", "0", "--repeats", "1", "--md", str(report)],
                   check=True, capture_output=True, text=True, timeout=600, cwd=ROOT)
    text = report.read_text()
    assert "## (a) Correctness against the reference" in text
    verdicts = [line.rsplit("|", 2)[-2].strip() for line in text.splitlines()
                if line.startswith("| B=")]
    assert len(verdicts) == 4 and set(verdicts) == {"pass"}, verdicts
    assert "nano-fwd: skipped, past the 0 s budget" in text
