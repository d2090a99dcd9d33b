"""What a test process that died was doing, printed where a CI log's tail keeps it.

A fatal signal in an xdist worker prints the worker's faulthandler dump (which thread
crashed, in which Python frames) to stderr mid-run, long before the summary, and a CI log
that keeps only its tail loses it; the native frames it never had. So each worker writes its
dump to a file of its own, and before it the crashing thread's native frames
(tests/native/crash_frames.c, built by the controller where a C compiler exists); at the very
end the controller prints, per worker that died, its faulthandler dump (test runner frames
dropped, the crashing thread last) and the native frames, named by addr2line. Without them (no
compiler), gdb's backtrace of the crashing thread from the core, where the kernel writes cores
to the working directory. conftest.py installs the two hooks.
"""

from __future__ import annotations

import ctypes
import faulthandler
import os
import re
import resource
import shutil
import signal as _signals
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

CRASH_DIR = "RANKATTN_TEST_CRASH_DIR"
_dump_file = pytest.StashKey()
NATIVE_FRAMES_SOURCE = Path(__file__).parent / "native" / "crash_frames.c"
NATIVE_FRAMES_LIBRARY = "crash_frames.so"  # in CRASH_DIR
C_COMPILER = shutil.which("cc") or shutil.which("gcc")


@pytest.hookimpl(trylast=True)  # after pytest's faulthandler plugin, which writes to stderr
def pytest_configure(config):
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if worker is None:
        if config.pluginmanager.hasplugin("xdist") and config.getoption("numprocesses", None):
            os.environ[CRASH_DIR] = tempfile.mkdtemp(prefix="rankattn-crashes-")
            build_native_frames(os.environ[CRASH_DIR])
    elif os.environ.get(CRASH_DIR):
        dump = open(os.path.join(os.environ[CRASH_DIR], f"{worker}-{os.getpid()}.txt"), "w")
        faulthandler.enable(file=dump, all_threads=True)
        library = os.path.join(os.environ[CRASH_DIR], NATIVE_FRAMES_LIBRARY)
        if os.path.exists(library):  # after faulthandler, which its handler hands the signal on to
            ctypes.CDLL(library).crash_frames_install(dump.fileno())
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
        for name in sorted(n for n in os.listdir(folder) if n.endswith(".txt")):
            worker, pid = name[:-4].rsplit("-", 1)
            text = open(os.path.join(folder, name)).read().strip()
            if not text:  # killed (SIGKILL, a timeout): no fatal error to report
                continue
            print(f"\n==== xdist worker {worker} (pid {pid}) died; its faulthandler dump, "
                  f"the crashing thread last:\n{_crashing_thread_last(text)}", flush=True)
            native = native_frames(text)
            if native:
                print(f"\n==== the crashing thread's native frames (named by addr2line), the "
                      f"crash point last:\n{native}", flush=True)
            core = _core_of(int(pid), str(config.rootpath))
            if core and native:
                os.unlink(core)  # gdb on a JAX worker's core took over 300 s
            elif core:
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


def build_native_frames(folder: str) -> None:
    """Builds tests/native/crash_frames.c into `folder`, warnings as errors (nothing where no
    C compiler works: the report then falls back to gdb; test_crash_report.py fails)."""
    if C_COMPILER:
        subprocess.run([C_COMPILER, "-shared", "-fPIC", "-O1", "-Wall", "-Wextra", "-Werror", "-o",
                        os.path.join(folder, NATIVE_FRAMES_LIBRARY), str(NATIVE_FRAMES_SOURCE),
                        "-ldl"], capture_output=True, timeout=120)


def native_frames(dump: str) -> str:
    """The native frames crash_frames.c wrote to a worker's dump, one line each, outermost
    first: '#i function (library)', the function named by addr2line from the library's symbol
    table where it can (else the nearest exported symbol the process saw)."""
    block = re.search(r"^Native frames .*?\n(.*?)(?:\n\s*\n|\Z)", dump, re.S | re.M)
    if not block:
        return ""
    frames = [m.groups() for m in map(re.compile(r"#(\d+) (.+)\+(0x[0-9a-f]+) (\S+)$").match,
                                      block[1].splitlines()) if m]
    named = {}
    for library in {library for _, library, _, _ in frames if library != "?"}:
        offsets = [offset for _, lib, offset, _ in frames if lib == library]
        named.update(zip(((library, o) for o in offsets), _addr2line(library, offsets)))
    lines = []
    for index, library, offset, symbol in frames:
        name = named.get((library, offset)) or symbol
        name = name if len(name) <= 160 else name[:157] + "..."  # C++ templates run long
        lines.append(f"#{index} {name} ({os.path.basename(library)}+{offset})")
    signal, address = re.search(r"signal (\d+), address (\S+)", block[0]).groups()
    try:
        signal = f"{signal} ({_signals.Signals(int(signal)).name})"
    except ValueError:
        pass
    return "\n".join(lines[::-1] + [f"signal {signal}, address {address}"])


def _addr2line(library: str, offsets: list[str]) -> list[str | None]:
    """The function at each offset of `library` (None where addr2line cannot tell)."""
    try:
        run = subprocess.run(["addr2line", "-f", "-C", "-e", library, *offsets],
                             capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired):
        return [None] * len(offsets)
    names = run.stdout.splitlines()[::2]  # a function's line, then its file's
    return [None if name == "??" else name for name in names] + [None] * (len(offsets) - len(names))


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
