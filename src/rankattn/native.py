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
falls back to ``xla``. A compiler that rejects the source (a non-zero exit) is
recorded in ``<library>.failed`` so that no process tries it on that key again
(its message stays in the reasons; delete the file to retry). A cached library
that does not load (a truncated file) is rebuilt once. A cache folder that
cannot be written (read-only, another user's, a full disk) or no home directory
is a reason too.

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
                            bits either way; for tests and measurements).
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
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
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


def disabled() -> bool:
    return os.environ.get("RANKATTN_CPU_KERNEL", "1").strip().lower() in ("0", "off", "false", "no")


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
    if os.environ.get("RANKATTN_CACHE_DIR"):
        return Path(os.environ["RANKATTN_CACHE_DIR"])
    if os.environ.get("XDG_CACHE_HOME"):
        return Path(os.environ["XDG_CACHE_HOME"]) / "rankattn"
    try:
        home = Path.home()
    except RuntimeError as e:  # no HOME and no password entry: a cache folder problem too
        raise OSError(f"{e} (HOME is not set)") from e
    return home / ".cache" / "rankattn"


def build_command(cxx: list[str], source: Path, output: Path) -> list[str]:
    flags = SANITIZE if sanitized() else OPTIMIZE
    flags = flags + words("RANKATTN_CXXFLAGS")
    warnings = ["-Werror"] if werror() else []
    return cxx + flags + COMMON + warnings + ["-isystem", jax.ffi.include_dir(), str(source),
                                              "-o", str(output)]


def first_error(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    errors = [line for line in lines if "error" in line.lower()]
    return (errors or lines or ["(no output)"])[0][:300]


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


def lock_path(target: Path) -> Path:
    """This user's lock on building ``target``: one per user, since another user's lock file
    cannot be opened for writing (nor, in a sticky folder, created)."""
    user = os.getuid() if hasattr(os, "getuid") else "any"
    return target.with_name(f"{target.stem}.user{user}.lock")


@functools.cache
def load(name: str) -> Library:
    """The library built from ``backends/<name>.cc``: from the cache, or compiled now."""
    if disabled():
        return Library(None, ("the C++ kernel is turned off (RANKATTN_CPU_KERNEL=0)",))
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
    targets = []
    for cxx in candidates:
        target = target_path(source, cxx, digest)
        broken = False
        if target.exists():
            try:
                return Library(ctypes.CDLL(str(target)), (), target)
            except OSError:
                broken = True  # e.g. truncated by a full disk: rebuilt below
        targets.append((cxx, target, broken))
    reasons = []
    for cxx, target, broken in targets:
        try:
            return _build_and_load(cxx, source, target, rebuild=broken)
        except BuildFailed as e:
            reasons.append(str(e))
    return Library(None, tuple(reasons))


def _build_and_load(cxx: list[str], source: Path, target: Path, rebuild: bool) -> Library:
    """Build ``target`` (again, with ``rebuild``) and load it; one that does not load is
    rebuilt once."""
    seconds = _build(cxx, source, target, rebuild)
    try:
        return Library(ctypes.CDLL(str(target)), (), target, seconds)
    except OSError as e:
        if rebuild:
            raise BuildFailed(f"the kernel {shlex.join(cxx)} built, {target}, does not load: "
                              f"{e}") from e
    return _build_and_load(cxx, source, target, rebuild=True)


def _build(cxx: list[str], source: Path, target: Path, rebuild: bool) -> float:
    """Compile ``source`` into ``target`` unless another process did meanwhile (unless
    ``rebuild``); the seconds taken. Raises BuildFailed, and a compiler's rejection is
    recorded in ``<target>.failed`` so that no process runs this compiler on this key again."""
    failed = target.with_suffix(".failed")
    target.parent.mkdir(parents=True, exist_ok=True)
    with _locked(lock_path(target)):
        if failed.exists():
            raise BuildFailed(f"{failed.read_text()} (recorded in {failed}; delete it to retry)")
        if target.exists() and not rebuild:
            return 0.0
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
                if result.returncode > 0:  # the compiler's verdict; a kill (< 0) may not recur
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
