"""crash_report.py: a worker that dies is reported at the end of the run, its crashing thread
and (where the kernel writes cores here and gdb exists) its native frames."""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import crash_report

TESTS = Path(__file__).parent


def test_a_worker_that_dies_is_reported_at_the_end_of_the_run(tmp_path):
    # A session of its own, without the suite's conftest (no JAX: a small core, a quick gdb).
    (tmp_path / "conftest.py").write_text(
        "from crash_report import pytest_configure, pytest_unconfigure  # noqa: F401\n")
    (tmp_path / "test_dies.py").write_text(textwrap.dedent("""\
        import ctypes, threading, time
        def test_passes():
            pass
        def test_dies():
            threading.Thread(target=time.sleep, args=(60,), daemon=True).start()
            ctypes.string_at(0)
    """))
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTEST_XDIST_WORKER", crash_report.CRASH_DIR, "PYTEST_ADDOPTS")}
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS), env.get("PYTHONPATH", "")])
    run = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-n", "1",
                          "-q", "test_dies.py"], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=120)
    out = run.stdout
    assert run.returncode == 1 and "1 failed, 1 passed" in out, out[-3000:] + run.stderr
    report = out[out.index("==== xdist worker gw0"):]
    # The sleeping thread first, then the crashing one with the test's frame, then the signal;
    # none of the runner's frames.
    crashed = report.index("Current thread")
    assert report.index("in _bootstrap") < crashed < report.index("line 6 in test_dies")
    assert report.index("Fatal Python error: Segmentation fault") > crashed
    assert "_pytest" not in report and "execnet" not in report
    if crash_report.C_COMPILER:
        # The native frames, outermost first: the interpreter, ctypes' string_at, then the
        # crash point in libc, the signal last.
        native = report.split("native frames (named by addr2line)")[1].splitlines()[1:]
        assert native[-1] == "signal 11 (SIGSEGV), address 0x0", native
        assert "libc.so" in native[-2] and "string_at" in "".join(native[-4:-1]), native
        assert "python" in native[0] or "libc.so" in native[0], native
        assert not (tmp_path / "core").exists()  # no gdb: removed unread
    elif crash_report._cores_written_here():
        assert "Program terminated with signal SIGSEGV" in report
        assert "string_at" in report.split("gdb's backtrace")[1]
        assert not (tmp_path / "core").exists()  # read and removed


HARD_CORE_LIMIT = resource.getrlimit(resource.RLIMIT_CORE)[1]


@pytest.mark.skipif(not crash_report._cores_written_here() or HARD_CORE_LIMIT == 0,
                    reason="no core is written here (core_pattern, a hard limit of 0) or no gdb")
def test_gdb_past_its_timeout_still_names_the_crash_point(tmp_path):
    """Regression (stop 51: gdb on a worker's 6.1 GB core ran past its 300 s and the report
    said only that): what gdb printed before it was stopped, frame 0 and the signal, is kept."""
    crash = ("import ctypes, resource; hard = resource.getrlimit(resource.RLIMIT_CORE)[1]; "
             "resource.setrlimit(resource.RLIMIT_CORE, (hard, hard)); ctypes.string_at(0)")
    subprocess.run([sys.executable, "-c", crash], cwd=tmp_path, capture_output=True, timeout=60)
    core = next(tmp_path.glob("core*"), None)
    assert core, "the crash left no core"
    output = crash_report._gdb(["-ex", "shell sleep 60", sys.executable, str(core)], timeout=5)
    core.unlink()
    report = crash_report._frames_of(output)
    assert report.splitlines()[-2:] == [
        "Program terminated with signal SIGSEGV, Segmentation fault.",
        "(gdb ran past 5 s and was stopped: above, what it printed)"], report
    assert report.startswith("#0 "), report
