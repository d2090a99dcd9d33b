"""Two processes on 127.0.0.1, each with 2 CPU devices, run one sharded attention and its
gradients over the 4-device mesh (CPU collectives through gloo), exact against one device.

The recipe a user follows is the worker, tests/distributed/multiprocess_worker.py.
"""

from __future__ import annotations

import os
import pathlib
import socket
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "distributed" / "multiprocess_worker.py"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_match_one_device():
    port = free_port()
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2 "
                                     + os.environ.get("XLA_FLAGS", ""),
               PYTHONPATH=os.pathsep.join([str(ROOT / "src"), str(ROOT / "tests"),
                                           os.environ.get("PYTHONPATH", "")]))
    workers = [subprocess.Popen([sys.executable, str(WORKER), str(i), str(port)], cwd=ROOT,
                                env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True) for i in range(2)]
    outputs = []
    try:
        for worker in workers:
            outputs.append(worker.communicate(timeout=300)[0])
    finally:
        for worker in workers:  # a hung peer must not outlive the test
            if worker.poll() is None:
                worker.kill()
                outputs.append(worker.communicate()[0])
    report = "\n".join(f"--- process {i} (exit {w.returncode}) ---\n{out[-6000:]}"
                       for i, (w, out) in enumerate(zip(workers, outputs)))
    assert all(w.returncode == 0 for w in workers), report
    for i in range(2):
        for strategy in ("ring", "all_gather"):
            assert f"ok process {i} {strategy}" in report, report
