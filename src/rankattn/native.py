"""Building and loading rankattn's C++ kernels (``jax.ffi``), on first use, like Triton.

The C++ source ships inside the package. The first call that needs a kernel
compiles it for this machine's CPU (``-march=native``) into a per-user cache and
loads it with ctypes; later processes load the cached library. The cache key
holds the source, the compiler and its version, the flags, jaxlib's version (its
FFI headers) and the host's instruction-set flags, so a home directory shared
between an AVX-512 and an AVX2 machine never runs one's code on the other.
Several processes may start at once: a lock serialises the compile, and the
library appears by an atomic rename.

Environment:
  RANKATTN_CPU_KERNEL=0     do not build or use the kernel (``impl='auto'`` takes ``xla``).
  RANKATTN_CXX              the compiler command (default: $CXX, g++, c++, clang++, then
                            ``python -m ziglang c++`` if the ziglang package is installed).
  RANKATTN_CXXFLAGS         extra compiler flags, after -march=native (part of the cache key),
                            e.g. ``-mno-amx-tile`` to keep bfloat16 dots off AMX.
  RANKATTN_CACHE_DIR        where libraries go (default $XDG_CACHE_HOME/rankattn or
                            ~/.cache/rankattn).
  RANKATTN_CPU_KERNEL_SANITIZE=1  build with AddressSanitizer and UBSan (tests only: the
                            process must preload libasan).
  RANKATTN_CPU_THREADS=n    at most n threads per kernel call (default: XLA's CPU pool).
  RANKATTN_CPU_BACKWARD_MB=n  memory the backward keeps dS in (default 1024 MiB): longer
                            sequences run in chunks of key blocks that fit it.

Failing to build is not an error here: :func:`load` returns the reasons, which
the ``cpu`` backend reports through ``not_supported_reasons`` while ``auto``
falls back to ``xla``.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import hashlib
import importlib.util
import os
import platform
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import jax

SOURCE_DIR = Path(__file__).parent / "backends"
OPTIMIZE = ["-O3", "-march=native"]
SANITIZE = ["-O1", "-g", "-march=native", "-fno-omit-frame-pointer",
            "-fsanitize=address,undefined", "-fno-sanitize-recover=all"]
# Warnings are errors for rankattn's own code; JAX's headers are system headers.
COMMON = ["-std=c++17", "-shared", "-fPIC", "-Wall", "-Wextra", "-Werror"]
COMPILE_TIMEOUT_S = 300


@dataclasses.dataclass(frozen=True)
class Library:
    """A loaded kernel library, or why there is none."""

    handle: ctypes.CDLL | None
    reasons: tuple[str, ...] = ()
    path: Path | None = None
    compile_seconds: float | None = None  # None: loaded from the cache


def disabled() -> bool:
    return os.environ.get("RANKATTN_CPU_KERNEL", "1").strip().lower() in ("0", "off", "false", "no")


def sanitized() -> bool:
    return os.environ.get("RANKATTN_CPU_KERNEL_SANITIZE", "0").strip() == "1"


def compiler() -> list[str] | None:
    """The C++ compiler command, or None when this machine has none."""
    for variable in ("RANKATTN_CXX", "CXX"):
        if os.environ.get(variable):
            return shlex.split(os.environ[variable])
    for name in ("g++", "c++", "clang++"):
        if shutil.which(name):
            return [name]
    if importlib.util.find_spec("ziglang") is not None:
        return [sys.executable, "-m", "ziglang", "c++"]
    return None


def host_isa() -> str:
    """The host CPU's instruction-set flags (what -march=native compiles for)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return " ".join(sorted(line.split(":", 1)[1].split()))
    except OSError:
        pass
    return f"{platform.machine()} {platform.processor()}"


def cache_dir() -> Path:
    if os.environ.get("RANKATTN_CACHE_DIR"):
        return Path(os.environ["RANKATTN_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "rankattn"


def build_command(cxx: list[str], source: Path, output: Path) -> list[str]:
    flags = SANITIZE if sanitized() else OPTIMIZE
    flags = flags + shlex.split(os.environ.get("RANKATTN_CXXFLAGS", ""))
    return cxx + flags + COMMON + ["-isystem", jax.ffi.include_dir(), str(source), "-o",
                                   str(output)]


def first_error(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    errors = [line for line in lines if "error" in line.lower()]
    return (errors or lines or ["(no output)"])[0][:300]


def _version(cxx: list[str]) -> str:
    try:
        result = subprocess.run(cxx + ["--version"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"unknown ({e})"
    return result.stdout.strip().splitlines()[0] if result.stdout.strip() else "unknown"


@functools.cache
def load(name: str) -> Library:
    """The library built from ``backends/<name>.cc``: from the cache, or compiled now."""
    if disabled():
        return Library(None, ("the C++ kernel is turned off (RANKATTN_CPU_KERNEL=0)",))
    source = SOURCE_DIR / f"{name}.cc"
    cxx = compiler()
    if cxx is None:
        return Library(None, ("no C++ compiler found (tried $RANKATTN_CXX, $CXX, g++, c++, "
                              "clang++ and the ziglang package); install g++ or "
                              "`pip install ziglang`",))
    target = target_path(source, cxx)
    seconds = None
    if not target.exists():
        try:
            seconds = _compile(cxx, source, target)
        except RuntimeError as e:
            return Library(None, (str(e),))
    try:
        handle = ctypes.CDLL(str(target))
    except OSError as e:
        return Library(None, (f"the compiled kernel {target} does not load: {e}",))
    return Library(handle, (), target, seconds)


def target_path(source: Path, cxx: list[str]) -> Path:
    """Where the library built from ``source`` by ``cxx`` is cached, for this host and jaxlib."""
    key = hashlib.sha256()
    for part in (source.read_bytes(), " ".join(build_command(cxx, source, Path("out"))),
                 _version(cxx), jax.__version__, host_isa(), "sanitize" if sanitized() else ""):
        key.update(part if isinstance(part, bytes) else part.encode())
    return cache_dir() / f"{source.stem}-{key.hexdigest()[:20]}.so"


def _compile(cxx: list[str], source: Path, target: Path) -> float:
    """Compile ``source`` to ``target`` unless another process did meanwhile; the seconds taken."""
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise RuntimeError(f"cannot create the kernel cache {target.parent}: {e}; set "
                           "RANKATTN_CACHE_DIR to a writable folder") from e
    with _locked(target.with_suffix(".lock")):
        if target.exists():
            return 0.0
        fd, scratch = tempfile.mkstemp(suffix=".so", dir=target.parent)
        os.close(fd)
        start = time.perf_counter()
        try:
            result = subprocess.run(build_command(cxx, source, Path(scratch)), capture_output=True,
                                    text=True, timeout=COMPILE_TIMEOUT_S)
        except (OSError, subprocess.TimeoutExpired) as e:
            os.unlink(scratch)
            raise RuntimeError(f"compiling {source.name} with {shlex.join(cxx)} failed: {e}") from e
        if result.returncode != 0:
            os.unlink(scratch)
            raise RuntimeError(f"compiling {source.name} with {shlex.join(cxx)} failed: "
                               f"{first_error(result.stderr + result.stdout)}")
        os.replace(scratch, target)
        return time.perf_counter() - start


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
