"""Runs tests/distributed/ (attention and serving on 8 fake CPU devices) in a subprocess.

JAX fixes the number of CPU devices when its backend starts, so those tests run in
their own interpreter with XLA_FLAGS=--xla_force_host_platform_device_count=8; their
failures fail this test, with their output.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_distributed_suite_on_8_fake_devices():
    env = dict(os.environ, RANKATTN_MESH_TESTS="1",
               XLA_FLAGS="--xla_force_host_platform_device_count=8 "
                         + os.environ.get("XLA_FLAGS", ""),
               PYTHONPATH=os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]))
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/distributed"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, (f"tests/distributed failed (exit {result.returncode}):\n"
                                    + result.stdout[-20000:] + result.stderr[-5000:])
