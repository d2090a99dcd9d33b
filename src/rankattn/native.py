"""Building and loading rankattn's C++ kernels (``jax.ffi``), on first use, like Triton.

The C++ source ships inside the package. The first call that needs a kernel
compiles it for this machine's CPU (``-march=native``) into a cache folder and
loads it with ctypes; later processes load the cached library.

Compilers. ``$RANKATTN_CXX``, when set, is the only one tried. Otherwise the
candidates are ``$CXX``, ``g++``, ``c++``, ``clang++`` and zig's clang
(``python -m ziglang c++``, when the ziglang package is installed), in that
order. The cached libraries of every candidate are looked up before anything
compiles; then the candidates compile in order until one builds. The kernel
needs GCC >= 11 (tested: 11, Ubuntu 22.04's default, and 12) or a C++17 clang (its
builtins date from clang 3.4, C++17 from clang 5; tested: clang 22, ziglang 0.17's).
Warnings are errors only with ``RANKATTN_CXX_WERROR=1`` (the test
suite and CI set it), never in a user's first build: a newer compiler's new
warning must not cost users the kernel.

The cache key holds the source and every header below ``SOURCE_DIR`` (it may
include any of them), the compiler's command and version, the flags
(``-Werror`` and ``RANKATTN_CXXFLAGS`` included), jaxlib's version (which fixes
its FFI headers, so their content is not hashed) and the macros
``-march=native`` predefines with that compiler (exactly the instruction sets it
compiles for on this host, on any OS), so a home directory shared between an
AVX-512 and an AVX2 machine never runs one's code on the other. Computing it
runs the compiler twice (``--version`` and the preprocessor): about 40 ms with
g++, 0.2 s with zig's clang.

Several processes may start at once: a lock serialises each user's build of a
key and the library appears by an atomic rename. A cache folder may be shared by
several users, and then a library built once serves them all (rather than one
subfolder, and one build, per user): libraries are published readable by all
(mode 755: they hold nothing private), and each user takes a lock file of their
own (another user's lock file cannot be opened for writing, nor, in a sticky
folder, even created). Two users starting at once may both build the same
library; either copy serves. A user who may only read the folder loads the
libraries already in it (say, built into a container image). Loading a library
runs its code, so whoever can write a shared folder is trusted by all its users.

Failing to build is not an error here: :func:`load` returns the reasons, which
the ``cpu`` backend reports through ``not_supported_reasons`` while ``auto``
falls back to ``xla``. A compiler that fails (on the source, or its assembler or
linker on this host) is recorded in ``<library>.user<uid>.failed`` so that none of
this user's processes tries it on that key again (its message stays in the reasons;
delete the file to retry); a failure the machine caused is not recorded (the
compiler killed, say for memory, a full disk, a header missing or unreadable).
A cached library that is damaged (truncated, not ELF) is rebuilt once; one that does
not load for another reason (a cache folder on a filesystem mounted ``noexec``) is a
reason, as a rebuild would not load either. A cache folder that cannot be written
(read-only, another user's, a full disk) or no home directory is a reason too, and
so is a setting below with a value it does not take (with a warning, as ``auto``
then runs ``xla``).

Environment:
  RANKATTN_CPU_KERNEL=0     do not build or use the kernel (``impl='auto'`` takes ``xla``).
  RANKATTN_CXX              the one compiler command to try (default: the candidates above).
  RANKATTN_CXX_WERROR=1     warnings are errors (tests and CI; part of the cache key).
  RANKATTN_CXXFLAGS         extra compiler flags, after -march=native (part of the cache key),
                            e.g. ``-mno-amx-tile`` to keep bfloat16 dots off AMX.
  RANKATTN_CACHE_DIR        where libraries go (default $XDG_CACHE_HOME/rankattn or
                            ~/.cache/rankattn).
  RANKATTN_CPU_KERNEL_SANITIZE=1  build with AddressSanitizer and UBSan (tests only: the
                            process must preload libasan).
  RANKATTN_CPU_THREADS=n    at most n threads per kernel call (default: XLA's CPU pool).
  RANKATTN_CPU_BACKWARD_MB=n  memory the backward's blocks pass keeps dS in (default 1024
                            MiB): longer sequences run in chunks of key blocks that fit it.
  RANKATTN_CPU_BACKWARD_PASS=rows|blocks  force one of the backward's two passes (default:
                            rows where the batch rows x kv heads fill the threads; the same
                            bits either way; for tests and measurements); rows-by-key or
                            rows-by-query also forces the rows pass's order.
  RANKATTN_CPU_MOVE_WORKERS=0  a pool worker that Linux woke onto its caller's CPU stays
                            there (default: it moves to the caller's other CPUs for that
                            call; benchmarks/CALL_COSTS.md measures both).
  RANKATTN_CPU_TRACE=1      each parallel region prints, per thread, when it started, on which
                            CPU and how many tasks it ran in how long (stderr; for a slow call).
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import hashlib
import importlib.util
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import jax
import jaxlib.version

SOURCE_DIR = Path(__file__).parent / "backends"
OPTIMIZE = ["-O3", "-march=native"]
# -O0: the build in half the time of -O1 (21 s against 46 s on a 2-core Zen 3; the
# sanitizers check every access at any level). -g1: line tables only, enough for the
# sanitizers' stack traces; -g's variable tracking doubled the build (105 s against 57 s).
SANITIZE = ["-O0", "-g1", "-march=native", "-fno-omit-frame-pointer",
            "-fsanitize=address,undefined", "-fno-sanitize-recover=all"]
# Warnings for rankattn's own code (errors with RANKATTN_CXX_WERROR=1); JAX's headers are
# system headers.
COMMON = ["-std=c++17", "-shared", "-fPIC", "-Wall", "-Wextra"]
COMPILE_TIMEOUT_S = 300


@dataclasses.dataclass(frozen=True)
class Library:
    """A loaded kernel library, or why there is none."""

    handle: ctypes.CDLL | None
    reasons: tuple[str, ...] = ()
    path: Path | None = None
    compile_seconds: float | None = None  # None: loaded from the cache


class BuildFailed(Exception):
    """One compiler could not give a library that loads; the message is the reason."""


OFF, ON = ("0", "off", "false", "no"), ("1", "on", "true", "yes")


def disabled() -> bool:
    return os.environ.get("RANKATTN_CPU_KERNEL", "1").strip().lower() in OFF


# The kernel's own settings, which its C++ reads (cpu_kernel/runtime.h, Settings): what each
# takes, checked here because C++'s strtoll reads "auto" as 0 and a misspelled word as unset.
def _whole(low: int):
    return lambda text: bool(re.fullmatch(r"\s*[0-9]+\s*", text)) and int(text) >= low


SETTINGS = {
    "RANKATTN_CPU_KERNEL": (lambda text: text.strip().lower() in OFF + ON + ("",),
                            "one of " + ", ".join(OFF + ON)),
    "RANKATTN_CPU_THREADS": (_whole(1), "a whole number >= 1"),
    "RANKATTN_CPU_BACKWARD_MB": (_whole(0), "a whole number of MiB >= 0"),
    "RANKATTN_CPU_BACKWARD_PASS": (
        lambda text: text in ("auto", "rows", "rows-by-key", "rows-by-query", "blocks"),
        "auto, rows, rows-by-key, rows-by-query or blocks"),
    "RANKATTN_CPU_MOVE_WORKERS": (lambda text: text in ("0", "1"), "0 or 1"),
    "RANKATTN_CPU_TRACE": (lambda text: text in ("0", "1"), "0 or 1"),
}


def bad_settings() -> list[str]:
    """A sentence for each of SETTINGS set to a value it does not take."""
    return [f"{name}={os.environ[name]!r} is not {takes}: set {takes}, or unset it"
            for name, (valid, takes) in SETTINGS.items()
            if name in os.environ and not valid(os.environ[name])]


def sanitized() -> bool:
    return os.environ.get("RANKATTN_CPU_KERNEL_SANITIZE", "0").strip() == "1"


def werror() -> bool:
    return os.environ.get("RANKATTN_CXX_WERROR", "0").strip() == "1"


def words(variable: str) -> list[str]:
    """The words of environment ``variable`` (shell quoting; [] when unset)."""
    try:
        return shlex.split(os.environ.get(variable, ""))
    except ValueError as e:
        raise ValueError(f"{variable}={os.environ[variable]!r} is not a command line: {e}") from e


def compilers() -> list[list[str]]:
    """The C++ compiler commands to try, in order (empty: this machine has none)."""
    if words("RANKATTN_CXX"):
        return [words("RANKATTN_CXX")]
    found = [words("CXX")] if words("CXX") else []
    found += [[name] for name in ("g++", "c++", "clang++") if shutil.which(name)]
    if importlib.util.find_spec("ziglang") is not None:
        found.append([sys.executable, "-m", "ziglang", "c++"])
    return [cxx for i, cxx in enumerate(found) if cxx not in found[:i]]


def compiler() -> list[str] | None:
    """The first compiler :func:`load` tries, or None when this machine has none."""
    return next(iter(compilers()), None)


def cache_dir() -> Path:
    """The folder of built libraries, absolute: dlopen searches the library path, not the
    working folder, for a name without a slash (RANKATTN_CACHE_DIR=. built and never loaded)."""
    if os.environ.get("RANKATTN_CACHE_DIR"):
        return Path(os.environ["RANKATTN_CACHE_DIR"]).absolute()
    if os.environ.get("XDG_CACHE_HOME"):
        return (Path(os.environ["XDG_CACHE_HOME"]) / "rankattn").absolute()
    try:
        home = Path.home()
    except RuntimeError as e:  # no HOME and no password entry: a cache folder problem too
        raise OSError(f"{e} (HOME is not set)") from e
    return (home / ".cache" / "rankattn").absolute()


def build_command(cxx: list[str], source: Path, output: Path) -> list[str]:
    flags = SANITIZE if sanitized() else OPTIMIZE
    flags = flags + words("RANKATTN_CXXFLAGS")
    warnings = ["-Werror"] if werror() else []
    return cxx + flags + COMMON + warnings + ["-isystem", jax.ffi.include_dir(), str(source),
                                              "-o", str(output)]


# A compiler's error at a line of a file ("probe.cc:1:1: error: ...", "x.h:12: fatal error:");
# GCC first prints a context line ("cpu_attention.cc: In function '...':") that names no error.
LOCATED_ERROR = re.compile(r":\d+(?::\d+)?: (?:fatal )?error:")
# What the machine, not the source, made a compile fail with: the compiler proper killed (the
# OOM killer: g++ exits 4 with "internal compiler error: Killed signal") or out of memory
# under an address-space limit (ulimit -v: "virtual memory exhausted: Cannot allocate
# memory"), a full disk or quota, a process limit (fork: "Resource temporarily
# unavailable"), a header or program missing or unreadable. It may not recur, so it is not
# recorded; any other failure (an error in the source, or the assembler's or linker's on
# this host) recurs on this key.
MACHINE_FAILURE = re.compile(r"internal compiler error|\bKilled\b|No space left|"
                             r"Disk quota exceeded|virtual memory exhausted|"
                             r"Cannot allocate memory|Resource temporarily unavailable|"
                             r"cannot execute|No such file or directory|Permission denied|"
                             r"out of memory", re.I)


def first_error(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    located = [line for line in lines if LOCATED_ERROR.search(line)]
    errors = [line for line in lines if "error" in line.lower()]
    return (located or errors or lines or ["(no output)"])[0][:300]


def failure_recurs(text: str) -> bool:
    """Whether a failed compile's output says the build is wrong for this compiler and host
    (which recurs), not that the machine failed it."""
    return not MACHINE_FAILURE.search(text)


def _ask(cxx: list[str], *args: str) -> str:
    """What ``cxx args`` prints (for the cache key), or why it cannot run."""
    try:
        result = subprocess.run(cxx + list(args), capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"unknown ({e})"
    return result.stdout + result.stderr


def compiler_version(cxx: list[str]) -> str:
    return (_ask(cxx, "--version").strip().splitlines() or ["unknown"])[0]


def native_macros(cxx: list[str]) -> str:
    """The macros ``-march=native`` predefines with ``cxx``: the instruction sets it compiles
    for on this host (``__AVX512F__``, ``__AMX_TILE__``, ``__ARM_FEATURE_SVE`` ...)."""
    return _ask(cxx, "-march=native", "-dM", "-E", "-x", "c++", os.devnull)


def source_digest(source: Path) -> str:
    """A hash of ``source`` and of every header below its folder, which it may include."""
    digest = hashlib.sha256()
    for path in [source, *sorted(source.parent.rglob("*.h"))]:
        digest.update(str(path.relative_to(source.parent)).encode() + b"\0")
        digest.update(path.read_bytes())
    return digest.hexdigest()


def target_path(source: Path, cxx: list[str], digest: str) -> Path:
    """Where the library built from ``source`` (of :func:`source_digest` ``digest``) by ``cxx``
    is cached, for this host and jaxlib."""
    key = hashlib.sha256()
    for part in (digest, shlex.join(build_command(cxx, source, Path("out"))),
                 compiler_version(cxx), native_macros(cxx), jaxlib.version.__version__):
        key.update(part.encode() + b"\0")
    return cache_dir() / f"{source.stem}-{key.hexdigest()[:20]}.so"


def users_file(target: Path, suffix: str) -> Path:
    """This user's ``suffix`` file beside ``target``: its build lock (``.lock``; another user's
    lock file cannot be opened for writing, nor, in a sticky folder, created) and its record of
    a failed build (``.failed``; another user's could not be deleted to retry)."""
    user = os.getuid() if hasattr(os, "getuid") else "any"
    return target.with_name(f"{target.stem}.user{user}{suffix}")


@functools.cache
def load(name: str) -> Library:
    """The library built from ``backends/<name>.cc``: from the cache, or compiled now."""
    bad = bad_settings()
    if bad:
        warnings.warn(f"rankattn: the cpu kernel is not used: {'; '.join(bad)} "
                      "(impl='auto' runs xla instead)", stacklevel=2)
        return Library(None, tuple(bad))
    if disabled():
        return Library(None, ("the C++ kernel is turned off (RANKATTN_CPU_KERNEL=0)",))
    if sanitized() and "asan" not in os.environ.get("LD_PRELOAD", ""):
        # Loading a sanitized library into a process whose ASan runtime was not loaded first
        # ends the process ("ASan runtime does not come first"), with no reason to return.
        return Library(None, ("RANKATTN_CPU_KERNEL_SANITIZE=1 needs AddressSanitizer's runtime "
                              "preloaded, and the C++ runtime after it (jaxlib throws while "
                              "starting): LD_PRELOAD=\"$(g++ -print-file-name=libasan.so) "
                              "$(g++ -print-file-name=libstdc++.so)\" (tests only; unset it "
                              "for the fast kernel)",))
    try:
        candidates = compilers()
        words("RANKATTN_CXXFLAGS")  # every build command parses it again
    except ValueError as e:
        return Library(None, (str(e),))
    if not candidates:
        return Library(None, ("no C++ compiler found (tried $RANKATTN_CXX, $CXX, g++, c++, "
                              "clang++ and the ziglang package); install g++ >= 11 or "
                              "`pip install ziglang`",))
    source = SOURCE_DIR / f"{name}.cc"
    try:
        digest = source_digest(source)
    except OSError as e:
        return Library(None, (f"the kernel's source cannot be read ({e}): a broken install?",))
    try:
        return _load(source, digest, candidates)
    except OSError as e:
        return Library(None, (f"the kernel cache cannot be used ({e}); set RANKATTN_CACHE_DIR "
                              "to a folder this user can write",))


def _load(source: Path, digest: str, candidates: list[list[str]]) -> Library:
    """The first candidate's cached library that loads, else the first that builds and loads.
    Raises OSError when the cache folder cannot be used."""
    targets, reasons = [], []
    for cxx in candidates:
        target = target_path(source, cxx, digest)
        if not target.exists():
            targets.append((cxx, target, False))
            continue
        try:
            handle = _open(cxx, target)
        except BuildFailed as e:
            reasons.append(str(e))
            continue
        if handle is not None:
            return Library(handle, (), target)
        targets.append((cxx, target, True))  # e.g. truncated by a full disk: rebuilt below
    for cxx, target, damaged in targets:
        try:
            return _build_and_load(cxx, source, target, rebuild=damaged)
        except BuildFailed as e:
            reasons.append(str(e))
    return Library(None, tuple(reasons))


# dlopen's words for a file that is not a whole library (a build or copy cut short).
DAMAGED = re.compile(r"invalid ELF header|file too short|ELF load command|ELF file")


def _open(cxx: list[str], target: Path) -> ctypes.CDLL | None:
    """The library at ``target``, or None when the file is damaged (to be rebuilt). Raises
    BuildFailed when it does not load for a reason a rebuild would not change."""
    try:
        return ctypes.CDLL(str(target))
    except OSError as e:
        if DAMAGED.search(str(e)):
            return None
        raise BuildFailed(
            f"the kernel {shlex.join(cxx)} built, {target}, does not load: {e}. A rebuild would "
            "not load either; where the cache folder is on a filesystem mounted noexec, set "
            "RANKATTN_CACHE_DIR to a folder on one that allows running code") from e


def _build_and_load(cxx: list[str], source: Path, target: Path, rebuild: bool) -> Library:
    """Build ``target`` (again, with ``rebuild``) and load it; one that is damaged is rebuilt
    once."""
    seconds = _build(cxx, source, target, rebuild)
    handle = _open(cxx, target)
    if handle is not None:
        return Library(handle, (), target, seconds)
    if rebuild:
        raise BuildFailed(f"the kernel {shlex.join(cxx)} built, {target}, is damaged after a "
                          "rebuild: is the cache folder's disk full?")
    return _build_and_load(cxx, source, target, rebuild=True)


def _build(cxx: list[str], source: Path, target: Path, rebuild: bool) -> float | None:
    """Compile ``source`` into ``target`` unless another process did meanwhile (unless
    ``rebuild``: then None); the seconds taken. Raises BuildFailed, and a failure the machine
    did not cause is recorded (:func:`failure_recurs`) so that none of this user's processes
    runs this compiler on this key again."""
    failed = users_file(target, ".failed")
    target.parent.mkdir(parents=True, exist_ok=True)
    with _locked(users_file(target, ".lock")):
        if failed.exists():
            raise BuildFailed(f"{failed.read_text()} (recorded in {failed}; delete it to retry)")
        if target.exists() and not rebuild:
            return None
        # A private folder: the compiler and linker may write files of their own beside the output.
        with tempfile.TemporaryDirectory(prefix=f".{target.stem}-", dir=target.parent) as scratch:
            built = Path(scratch) / target.name
            start = time.perf_counter()
            try:
                result = subprocess.run(build_command(cxx, source, built), capture_output=True,
                                        text=True, timeout=COMPILE_TIMEOUT_S)
            except (OSError, subprocess.TimeoutExpired) as e:
                raise BuildFailed(f"compiling {source.name} with {shlex.join(cxx)} failed: "
                                  f"{e}") from e
            seconds = time.perf_counter() - start
            if result.returncode != 0:
                message = (f"compiling {source.name} with {shlex.join(cxx)} failed: "
                           f"{first_error(result.stderr + result.stdout)}")
                if result.returncode > 0 and failure_recurs(result.stderr + result.stdout):
                    note = Path(scratch) / failed.name
                    note.write_text(message)
                    _publish(note, failed, 0o644)
                raise BuildFailed(message)
            _publish(built, target, 0o755)
            return seconds


def _publish(file: Path, path: Path, mode: int) -> None:
    """Move ``file`` to ``path`` atomically, with ``mode`` (readable by every user, whatever the
    umask: a cache folder may be shared)."""
    file.chmod(mode)
    try:
        os.replace(file, path)
    except OSError:
        # In a sticky folder another user's file cannot be replaced: that user's process,
        # which held its own lock, published the same build first.
        if not path.exists():
            raise


class _locked:
    """An exclusive lock on a file (POSIX flock; elsewhere no lock: the rename stays atomic)."""

    def __init__(self, path: Path):
        self.path = path

    def __enter__(self):
        self.file = open(self.path, "a")
        try:
            import fcntl
            fcntl.flock(self.file, fcntl.LOCK_EX)
        except ImportError:
            pass
        return self

    def __exit__(self, *exc):
        self.file.close()  # closing releases the lock


@functools.cache
def register(name: str, symbols: tuple[str, ...]) -> Library:
    """Load ``name`` and register each of its FFI handler ``symbols`` as a CPU target of the
    same name in snake case (``RankattnCpuForward`` -> ``rankattn_cpu_forward``)."""
    library = load(name)
    if library.handle is not None:
        for symbol in symbols:
            jax.ffi.register_ffi_target(target_name(symbol),
                                        jax.ffi.pycapsule(getattr(library.handle, symbol)),
                                        platform="cpu")
    return library


def target_name(symbol: str) -> str:
    return "".join(f"_{c.lower()}" if c.isupper() else c for c in symbol).lstrip("_")
