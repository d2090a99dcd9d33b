"""benchmarks/tpu.py --smoke: the one-command TPU check runs end to end on CPU (interpret
mode, tiny shapes), so a TPU session spends its time measuring, not debugging the script."""

from __future__ import annotations

import json
import os
import subprocess
import sys

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
