"""What a test process that died was doing, printed where a CI log's tail keeps it.

A fatal signal in an xdist worker prints the worker's faulthandler dump (which thread
crashed, in which Python frames) to stderr mid-run, long before the summary, and a CI log
that keeps only its tail loses it; the native frames it never had. So each worker writes its
dump to a file of its own and may leave a core file (where the kernel writes cores to the
working directory), and at the very end the controller prints, per worker that died, its
faulthandler dump (test runner frames dropped, the crashing thread last) and gdb's backtrace
of the crashing thread from the core. conftest.py installs the two hooks.
"""

from __future__ import annotations

import faulthandler
import os
import re
import resource
import shutil
import subprocess
import sys
import tempfile

import pytest

CRASH_DIR = "RANKATTN_TEST_CRASH_DIR"
_dump_file = pytest.StashKey()


@pytest.hookimpl(trylast=True)  # after pytest's faulthandler plugin, which writes to stderr
def pytest_configure(config):
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if worker is None:
        if config.pluginmanager.hasplugin("xdist") and config.getoption("numprocesses", None):
            os.environ[CRASH_DIR] = tempfile.mkdtemp(prefix="rankattn-crashes-")
    elif os.environ.get(CRASH_DIR):
        dump = open(os.path.join(os.environ[CRASH_DIR], f"{worker}-{os.getpid()}.txt"), "w")
        faulthandler.enable(file=dump, all_threads=True)
        config.stash[_dump_file] = dump
        if _cores_written_here():
            hard = resource.getrlimit(resource.RLIMIT_CORE)[1]
            resource.setrlimit(resource.RLIMIT_CORE, (hard, hard))


def pytest_unconfigure(config):
    dump = config.stash.get(_dump_file, None)
    if dump is not None:  # a worker that ends normally leaves no file
        faulthandler.disable()
        dump.close()
        os.unlink(dump.name)
    elif os.environ.get("PYTEST_XDIST_WORKER") is None and os.environ.get(CRASH_DIR):
        folder = os.environ.pop(CRASH_DIR)
        for name in sorted(os.listdir(folder)):
            worker, pid = name[:-4].rsplit("-", 1)
            text = open(os.path.join(folder, name)).read().strip()
            if not text:  # killed (SIGKILL, a timeout): no fatal error to report
                continue
            print(f"\n==== xdist worker {worker} (pid {pid}) died; its faulthandler dump, "
                  f"the crashing thread last:\n{_crashing_thread_last(text)}", flush=True)
            core = _core_of(int(pid), str(config.rootpath))
            if core:
                print(f"\n==== gdb's backtrace of the crashing thread ({core}):\n"
                      f"{_backtrace(core)}", flush=True)
                os.unlink(core)
        shutil.rmtree(folder, ignore_errors=True)


def _crashing_thread_last(dump: str) -> str:
    """faulthandler's dump without the test runner's frames, the threads that did not crash
    first (it lists them newest first), then the one that did, then the line that names the
    signal."""
    runner = re.compile(r'/(_pytest|pluggy|execnet|xdist)/|"<string>"')
    dump = "\n".join(line for line in dump.splitlines() if not runner.search(line))
    blocks = [b.strip() for b in re.split(r"\n\s*\n", dump) if b.strip()]
    threads = [b for b in blocks if b.startswith(("Thread 0x", "Current thread 0x"))]
    crashed = [b for b in threads if b.startswith("Current")]
    others = [b for b in threads if not b.startswith("Current")]
    signal = [b for b in blocks if b.startswith("Fatal Python error")]
    return "\n\n".join(others + crashed + signal)


def _cores_written_here() -> bool:
    """Whether the kernel writes a crashing process's core to its working directory as core
    or core.<pid> (not to a pipe or a path of its own), and gdb is there to read one."""
    try:
        with open("/proc/sys/kernel/core_pattern") as f:
            pattern = f.read().strip()
    except OSError:
        return False
    return pattern == "core" and shutil.which("gdb") is not None


def _core_of(pid: int, folder: str) -> str | None:
    for name in (f"core.{pid}", "core"):
        path = os.path.join(folder, name)
        if os.path.isfile(path):
            return path
    return None


def _backtrace(core: str) -> str:
    """The crashing thread's innermost 20 native frames, one short line each, outermost first
    (so the crash point is the log's last line)."""
    return _frames_of(_gdb(["-ex", "bt 20", sys.executable, core], timeout=300))


def _gdb(arguments: list[str], timeout: float) -> str:
    """gdb's output in batch mode; if it runs past `timeout`, what it printed by then (loading
    the core it prints the crashing thread's frame 0), then the reason. No scripts auto-loaded
    beside the libraries (libpython's walks Python's frames, which a crash may have left
    corrupted) and no debuginfod downloads (CI hosts have no network but package
    registries)."""
    command = ["gdb", "-batch", "-nx", "-q", "-iex", "set auto-load off",
               "-iex", "set debuginfod enabled off", *arguments]
    try:
        run = subprocess.run(command, capture_output=True, timeout=timeout)
        return (run.stdout + run.stderr).decode(errors="replace")
    except subprocess.TimeoutExpired as e:
        printed = ((e.stdout or b"") + (e.stderr or b"")).decode(errors="replace")
        return printed + f"\n(gdb ran past {timeout:.0f} s and was stopped: above, what it printed)"
    except OSError as e:
        return f"(gdb failed: {e})"


def _frames_of(output: str) -> str:
    """gdb's backtrace, one short line per frame, outermost first (so the crash point is the
    log's last line), then the line naming the signal; gdb's raw output where it has none."""
    frame = re.compile(r"#(\d+)\s+(?:0x[0-9a-f]+ in )?(<signal handler called>|\S+ \(.*?\)"
                       r"(?: (?:at|from) \S+)?)$")
    lines = []  # gdb prints frame 0 once as it loads the core, then the backtrace
    for m in map(frame.match, output.splitlines()):
        line = m and f"#{m[1]} " + re.sub(r" \(.*?\)(?: (?:at|from))?", " ", m[2], count=1)
        if line and line not in lines:
            lines.append(line)
    tail = [line for line in output.splitlines()
            if line.startswith(("Program terminated", "(gdb ran past"))]
    return "\n".join(lines[::-1] + tail) or output[-5000:]
