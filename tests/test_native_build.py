"""Building, caching and loading the C++ kernel (rankattn.native), and every way it can fail.

Most tests build a tiny stand-in source (well under a second a build), often through a
stand-in compiler: a shell script that logs each compile and then runs the real one, so a
test can count compiles. One builds the real kernel, with g++-11 where it is installed (zig's
clang builds it in tests/test_cpu_kernel.py, as the AVX2 build of the core cases). The
multi-user tests run as root only (a forked child becomes user nobody); the suite runs as root
in CI.
"""

from __future__ import annotations

import errno
import importlib.util
import os
import shlex
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import textwrap
import traceback
from ast import literal_eval
from pathlib import Path

import jax
import jaxlib.version
import pytest

from rankattn import native

ROOT = Path(__file__).resolve().parents[1]
TINY_SOURCE = 'extern "C" int rankattn_probe(void) { return 42; }\n'
NOBODY = 65534

needs_compiler = pytest.mark.skipif(native.compiler() is None,
                                    reason="no C++ compiler on this machine")
needs_root = pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0,
                                reason="running a process as another user needs root")


def readable_by_others(path: Path) -> bool:
    """Whether another user can read ``path``: every folder above it searchable by others."""
    return all(p.stat().st_mode & 0o001 for p in path.parents) and bool(
        path.stat().st_mode & 0o004)


# Building as user nobody reads the kernel's source and jax's FFI headers from this checkout
# and venv: a checkout in a private folder (mktemp -d makes it 0700) hides them from nobody.
OTHERS_CAN_BUILD = all(readable_by_others(p) for p in (Path(native.__file__).parent / "backends",
                                                       Path(jax.ffi.include_dir())))
needs_readable_checkout = pytest.mark.skipif(
    hasattr(os, "geteuid") and os.geteuid() == 0 and not OTHERS_CAN_BUILD,
    reason="this checkout or its venv sits in a folder other users cannot read, so user nobody "
           "cannot build the kernel; clone into a world-readable folder to run this test")


def python(script: str, env: dict[str, str], timeout: int = 600) -> subprocess.CompletedProcess:
    """Run ``script`` in a fresh interpreter with ``env`` added."""
    env = dict(os.environ, **env)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), str(ROOT / "tests"),
                                         os.environ.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)


@pytest.fixture
def tiny_source(monkeypatch):
    """native.load('probe') builds <folder>/src/probe.cc into <folder>/cache. The folder is
    readable by every user (user nobody builds from it in the multi-user tests)."""
    folder = Path(tempfile.mkdtemp(prefix="rankattn-native-"))
    folder.chmod(0o755)
    (folder / "src").mkdir(mode=0o755)
    (folder / "src" / "probe.cc").write_text(TINY_SOURCE)
    monkeypatch.setattr(native, "SOURCE_DIR", folder / "src")
    monkeypatch.setenv("RANKATTN_CACHE_DIR", str(folder / "cache"))
    monkeypatch.delenv("RANKATTN_CPU_KERNEL", raising=False)
    yield folder
    for path in folder.rglob("*"):  # a read-only folder of a test must not stop the clean-up
        if path.is_dir():
            path.chmod(0o755)
    shutil.rmtree(folder)


def load_uncached(name: str) -> native.Library:
    return native.load.__wrapped__(name)


def stand_in(folder: Path, name: str, before: str = "", after: str = "") -> list[str]:
    """A compiler command: a script that answers --version and -dM with the real compiler,
    and for a compile (-o, in $out) logs a line to <folder>/<name>.log, runs the shell lines
    ``before``, the real compiler, then ``after``."""
    script = folder / name
    script.write_text(textwrap.dedent(f"""\
        #!/bin/sh
        for a in "$@"; do [ "$prev" = -o ] && out="$a"; prev="$a"; done
        [ -z "$out" ] && exec {shlex.join(native.compiler())} "$@"
        echo compile >> {folder / name}.log
        {before}
        {shlex.join(native.compiler())} "$@" || exit $?
        {after}
    """))
    script.chmod(0o755)
    return [str(script)]


def compiles(folder: Path, name: str) -> int:
    log = folder / f"{name}.log"
    return len(log.read_text().splitlines()) if log.exists() else 0


def start_child(function, user: int | None = None) -> tuple[int, int]:
    """Fork a child that runs ``function()`` as ``user`` (None: this user) and writes what it
    returns, or its traceback, to a pipe: (its pid, the pipe's end to read). Forked, not a new
    interpreter: it starts at once, and user nobody may not be able to reach this one's files."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child, which never returns into pytest
        try:
            os.close(read)
            signal.alarm(120)  # never outlive the test
            if user is not None:
                os.setgroups([])
                os.setgid(user)
                os.setuid(user)
            out = function()
        except BaseException:
            out = traceback.format_exc()
        try:
            with os.fdopen(write, "w") as pipe:
                pipe.write(out)
        finally:
            os._exit(0)
    os.close(write)
    return pid, read


def child_result(pid: int, read: int) -> str:
    """What the child returned; its traceback fails the test."""
    with os.fdopen(read) as pipe:
        out = pipe.read()
    os.waitpid(pid, 0)
    if out.startswith("Traceback") or not out:
        pytest.fail(f"the child failed:\n{out}")
    return out


def in_child(function, user: int | None = None) -> str:
    return child_result(*start_child(function, user))


# --- The cache. ----------------------------------------------------------------------------


@needs_compiler
def test_compiles_once_then_loads_from_the_cache(tiny_source):
    """Later loads take the cached library. It is published readable by all whatever the umask
    (mkstemp's 0600 made it 0711: no other user could load it), beside this user's lock."""
    umask = os.umask(0o077)
    try:
        first = load_uncached("probe")
    finally:
        os.umask(umask)
    assert first.handle is not None, first.reasons
    assert first.compile_seconds is not None and first.handle.rankattn_probe() == 42
    assert stat.S_IMODE(first.path.stat().st_mode) == 0o755
    lock = native.users_file(first.path, ".lock")
    assert lock.name == f"{first.path.stem}.user{os.getuid()}.lock" and lock.exists()
    second = load_uncached("probe")
    assert second.compile_seconds is None and second.path == first.path
    assert {p.name for p in first.path.parent.iterdir()} == {first.path.name, lock.name}


def test_cache_key_holds_sources_headers_compiler_flags_jaxlib_and_host(tiny_source, monkeypatch):
    source, cxx = tiny_source / "src" / "probe.cc", ["g++"]
    monkeypatch.setattr(native, "compiler_version", lambda cxx: "g++ 12")
    monkeypatch.setattr(native, "native_macros", lambda cxx: "#define __AVX512F__ 1")
    monkeypatch.setenv("RANKATTN_CXX_WERROR", "1")

    def key() -> Path:
        return native.target_path(source, cxx, native.source_digest(source))

    keys = [key()]
    monkeypatch.setattr(native, "native_macros", lambda cxx: "#define __AVX2__ 1")
    keys.append(key())
    monkeypatch.setattr(native, "compiler_version", lambda cxx: "g++ 13")
    keys.append(key())
    keys.append(native.target_path(source, ["clang++"], native.source_digest(source)))
    monkeypatch.setattr(jaxlib.version, "__version__", "0.10.1")  # jax 0.10.2 accepts it
    keys.append(key())
    monkeypatch.setenv("RANKATTN_CXX_WERROR", "0")
    keys.append(key())
    monkeypatch.setenv("RANKATTN_CXXFLAGS", "-mno-amx-tile")
    keys.append(key())
    monkeypatch.setenv("RANKATTN_CPU_KERNEL_SANITIZE", "1")
    keys.append(key())
    source.write_text(TINY_SOURCE + "// changed\n")
    keys.append(key())
    (source.parent / "cpu_kernel").mkdir()
    (source.parent / "cpu_kernel" / "tiles.h").write_text("// a header the source may include\n")
    keys.append(key())
    (source.parent / "cpu_kernel" / "tiles.h").write_text("// changed\n")
    keys.append(key())
    (source.parent / "cpu_kernel" / "tiles.h").rename(source.parent / "tiles.h")
    keys.append(key())
    assert len(set(keys)) == len(keys), keys
    assert all(k.parent == tiny_source / "cache" and k.name.startswith("probe-") for k in keys)


@needs_compiler
def test_processes_starting_at_once_share_one_build(tiny_source, monkeypatch):
    """Four processes load the same library into an empty cache at once, through a compiler
    that takes a second: one compiles, the others wait on the lock and load its library.
    Without the lock all four compile."""
    cxx = stand_in(tiny_source, "cxx", before="sleep 1")
    monkeypatch.setattr(native, "compilers", lambda: [cxx])

    def child() -> str:
        library = load_uncached("probe")
        return str(library.handle.rankattn_probe() if library.handle else library.reasons)

    children = [start_child(child) for _ in range(4)]
    assert [child_result(*c) for c in children] == ["42"] * 4
    assert compiles(tiny_source, "cxx") == 1
    assert len(list((tiny_source / "cache").glob("probe-*.so"))) == 1


@needs_compiler
def test_a_library_that_does_not_load_is_rebuilt_once(tiny_source, monkeypatch):
    source = tiny_source / "src" / "probe.cc"
    target = native.target_path(source, native.compiler(), native.source_digest(source))
    target.parent.mkdir()
    target.write_bytes(b"truncated by a full disk")
    rebuilt = load_uncached("probe")
    assert rebuilt.handle is not None and rebuilt.handle.rankattn_probe() == 42, rebuilt.reasons
    assert rebuilt.compile_seconds is not None and rebuilt.path == target

    garbage = stand_in(tiny_source, "garbage", after='echo "not a library" > "$out"')
    monkeypatch.setattr(native, "compilers", lambda: [garbage])
    never = load_uncached("probe")
    assert never.handle is None and "damaged after a rebuild" in never.reasons[0], never.reasons
    assert compiles(tiny_source, "garbage") == 2  # built, then rebuilt once


@needs_compiler
def test_a_library_that_loads_nowhere_is_a_reason_not_a_rebuild_regression(tiny_source,
                                                                          monkeypatch):
    """Review (stop 72): every dlopen failure counted as a damaged file, so a cache folder on a
    filesystem mounted noexec ("failed to map segment from shared object") had every process
    build the kernel again, and the first twice, before falling back to xla. Only a damaged
    file is rebuilt now; any other failure is a reason naming RANKATTN_CACHE_DIR."""
    cxx = stand_in(tiny_source, "cxx")
    monkeypatch.setattr(native, "compilers", lambda: [cxx])
    assert load_uncached("probe").handle is not None
    real = native.ctypes.CDLL

    def noexec(path, *args, **kwargs):
        if "probe-" in str(path):
            raise OSError(f"{path}: failed to map segment from shared object")
        return real(path, *args, **kwargs)

    monkeypatch.setattr(native.ctypes, "CDLL", noexec)
    cached = load_uncached("probe")
    assert cached.handle is None and "failed to map segment" in cached.reasons[0]
    assert "noexec" in cached.reasons[0] and "RANKATTN_CACHE_DIR" in cached.reasons[0]
    for library in (tiny_source / "cache").glob("probe-*.so"):
        library.unlink()
    fresh = load_uncached("probe")  # built into the folder, then refused the same way
    assert fresh.handle is None and "RANKATTN_CACHE_DIR" in fresh.reasons[0], fresh.reasons
    assert compiles(tiny_source, "cxx") == 2  # the first build, then one: never a rebuild


@needs_compiler
@pytest.mark.parametrize("output", [
    "cc1plus: internal compiler error: Killed signal terminated program cc1plus",
    "probe.cc:1:10: fatal error: header.h: No such file or directory",
    "probe.cc:1:1: error: cannot write: No space left on device",
    # Review (stop 75): under ulimit -v g++ exits 1 with this (checked with g++ 12 on the
    # kernel); a disk quota; a process limit.
    "virtual memory exhausted: Cannot allocate memory",
    "/usr/bin/ld: final link failed: Disk quota exceeded",
    "g++: fatal error: cannot execute 'cc1plus': vfork: Resource temporarily unavailable"])
def test_a_failure_of_the_machine_is_not_recorded_regression(tiny_source, monkeypatch, output):
    """Review (stop 72): any failed compile with a positive exit was recorded for good, so a
    compiler killed for memory (g++ exits 4), a full disk or a missing header kept every
    later process (and every user) off the kernel after the cause was gone. Only a failure
    that recurs is recorded, and per user."""
    cause = tiny_source / "cause"
    cause.touch()
    flaky = stand_in(tiny_source, "flaky",
                     before=f'[ -e {cause} ] && {{ echo "{output}" >&2; exit 4; }}')
    monkeypatch.setattr(native, "compilers", lambda: [flaky])
    failed = load_uncached("probe")
    assert failed.handle is None and output.split(": ", 1)[1] in failed.reasons[0]
    assert not list((tiny_source / "cache").glob("*.failed"))
    cause.unlink()  # the same compiler, the cause gone: it builds
    assert load_uncached("probe").handle is not None


@needs_compiler
def test_a_relative_cache_folder_loads_regression(tiny_source, monkeypatch):
    """Review (stop 75): RANKATTN_CACHE_DIR=. built the library, then handed dlopen a name
    without a slash, which it looks up on the library path, not in the working folder: the
    kernel never loaded, blamed on a noexec mount."""
    monkeypatch.chdir(tiny_source)
    monkeypatch.setenv("RANKATTN_CACHE_DIR", ".")
    library = load_uncached("probe")
    assert library.handle is not None, library.reasons
    assert library.path.parent == tiny_source


def test_a_sanitized_build_without_its_runtime_preloaded_is_a_reason_regression(tiny_source,
                                                                                 monkeypatch):
    """Review (stop 72): RANKATTN_CPU_KERNEL_SANITIZE=1 without libasan in LD_PRELOAD built the
    library, and loading it ended the process (ASan's runtime must come first)."""
    monkeypatch.setenv("RANKATTN_CPU_KERNEL_SANITIZE", "1")
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    library = load_uncached("probe")
    assert library.handle is None and "LD_PRELOAD" in library.reasons[0], library.reasons
    assert not (tiny_source / "cache").exists()  # refused before building


def test_the_first_error_is_the_compilers_located_one_regression():
    """Review (stop 72): GCC's context line before an error in a function returning
    ffi::Error ("In function 'xla::ffi::Error ...'") was taken for the error."""
    text = ("cpu_attention.cc: In function 'xla::ffi::Error {anonymous}::forward(int)':\n"
            "cpu_attention.cc:42:7: error: 'Foo' was not declared in this scope\n")
    assert native.first_error(text).startswith("cpu_attention.cc:42:7: error: 'Foo'")
    assert native.first_error("ld: error: something\n") == "ld: error: something"
    assert native.failure_recurs(text)
    assert native.failure_recurs("/tmp/cc.s:12: Error: no such instruction: `tdpbf16ps'")
    assert not native.failure_recurs("cc1plus: internal compiler error: Killed signal")


@pytest.mark.parametrize("name, value", [
    ("RANKATTN_CPU_THREADS", "auto"), ("RANKATTN_CPU_THREADS", "0"),
    ("RANKATTN_CPU_MOVE_WORKERS", "yes"), ("RANKATTN_CPU_BACKWARD_MB", "1G"),
    ("RANKATTN_CPU_BACKWARD_PASS", "row"), ("RANKATTN_CPU_TRACE", "on"),
    ("RANKATTN_CPU_KERNEL", "disable"), ("RANKATTN_CPU_THREADS", "\u00b2")])
def test_a_setting_the_kernel_would_misread_is_a_reason_and_a_warning_regression(
        tiny_source, monkeypatch, name, value):
    """Review (stop 72): the kernel's C++ read its settings with strtoll, so THREADS=auto ran
    one thread, MOVE_WORKERS=yes turned moving off, BACKWARD_MB=1G kept 1 MiB, and a
    misspelled word was ignored. Such a value now keeps the kernel off, saying which and what
    it takes."""
    monkeypatch.setenv(name, value)
    with pytest.warns(UserWarning, match=name):
        library = load_uncached("probe")
    assert library.handle is None and f"{name}={value!r} is not" in library.reasons[0]
    monkeypatch.setenv(name, {"RANKATTN_CPU_BACKWARD_PASS": "auto",
                              "RANKATTN_CPU_KERNEL": ""}.get(name, "1"))
    assert native.bad_settings() == []


# --- Compilers. ----------------------------------------------------------------------------


def test_candidates_in_order_and_rankattn_cxx_alone(monkeypatch):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: object() if name == "ziglang" else find_spec(name, *a))
    monkeypatch.setattr(shutil, "which", lambda name: f"/usr/bin/{name}")
    monkeypatch.delenv("RANKATTN_CXX", raising=False)
    monkeypatch.setenv("CXX", "ccache g++")
    zig = [sys.executable, "-m", "ziglang", "c++"]
    assert native.compilers() == [["ccache", "g++"], ["g++"], ["c++"], ["clang++"], zig]
    monkeypatch.setenv("CXX", "g++")
    assert native.compilers() == [["g++"], ["c++"], ["clang++"], zig]
    monkeypatch.setenv("RANKATTN_CXX", "clang++-18 -fcolor-diagnostics")
    assert native.compilers() == [["clang++-18", "-fcolor-diagnostics"]]


@needs_compiler
def test_a_compiler_that_fails_is_recorded_and_the_next_one_builds(tiny_source, monkeypatch):
    bad = stand_in(tiny_source, "bad",
                   before='echo "probe.cc:1:1: error: stand-in rejects it" >&2; exit 1')
    good = stand_in(tiny_source, "good")
    monkeypatch.setattr(native, "compilers", lambda: [bad, good])
    library = load_uncached("probe")
    assert library.handle is not None and library.reasons == (), library.reasons
    assert (compiles(tiny_source, "bad"), compiles(tiny_source, "good")) == (1, 1)

    monkeypatch.setattr(native, "compilers", lambda: [bad])
    again = load_uncached("probe")  # not run again: the failure is read back
    assert compiles(tiny_source, "bad") == 1
    assert again.handle is None and "stand-in rejects it" in again.reasons[0], again.reasons
    assert "recorded in" in again.reasons[0] and ".failed" in again.reasons[0]


@needs_compiler
def test_every_candidates_cached_library_is_looked_up_before_compiling(tiny_source, monkeypatch):
    first, second = stand_in(tiny_source, "first"), stand_in(tiny_source, "second")
    monkeypatch.setattr(native, "compilers", lambda: [second])
    built = load_uncached("probe")
    monkeypatch.setattr(native, "compilers", lambda: [first, second])
    cached = load_uncached("probe")
    assert cached.path == built.path and cached.compile_seconds is None
    assert compiles(tiny_source, "first") == 0


@needs_compiler
def test_warnings_are_errors_only_with_rankattn_cxx_werror(tiny_source, monkeypatch):
    (tiny_source / "src" / "probe.cc").write_text(
        'extern "C" int rankattn_probe(void) { int unused; return 42; }\n')
    monkeypatch.delenv("RANKATTN_CXX_WERROR")  # set by conftest.py for the suite
    # The first compiler only: the strict build's failure would otherwise move on to zig's
    # clang, whose first build on a machine compiles its libc++ (a minute of this test in CI).
    first = native.compiler()
    monkeypatch.setattr(native, "compilers", lambda: [first])
    assert "-Werror" not in native.build_command(["c++"], Path("x.cc"), Path("x.so"))
    lenient = load_uncached("probe")
    assert lenient.handle is not None and lenient.handle.rankattn_probe() == 42, lenient.reasons
    monkeypatch.setenv("RANKATTN_CXX_WERROR", "1")
    strict = load_uncached("probe")
    assert strict.handle is None and "unused" in strict.reasons[0], strict.reasons


def test_a_failed_compile_is_a_reason_with_the_first_error_line(tiny_source):
    (tiny_source / "src" / "probe.cc").write_text("this is not C++\n")
    library = load_uncached("probe")
    if native.compiler() is None:
        assert "no C++ compiler found" in library.reasons[0]
    else:
        assert library.handle is None and "failed" in library.reasons[0]
        assert "error" in library.reasons[0].lower(), library.reasons


def test_no_compiler_is_a_reason_naming_the_fix(tiny_source, monkeypatch):
    monkeypatch.setattr(native, "compilers", lambda: [])
    library = load_uncached("probe")
    assert library.handle is None and "pip install ziglang" in library.reasons[0]


def test_a_setting_that_is_not_a_command_line_is_a_reason(tiny_source, monkeypatch):
    monkeypatch.setenv("RANKATTN_CXXFLAGS", '-DNAME="unclosed')
    library = load_uncached("probe")
    assert library.handle is None and "RANKATTN_CXXFLAGS" in library.reasons[0], library.reasons


# --- A cache folder that cannot be used, and one shared by several users. ------------------


@needs_compiler
def test_a_full_disk_or_no_home_is_a_reason(tiny_source, monkeypatch):
    def no_space(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    with monkeypatch.context() as patch:
        patch.setattr(os, "replace", no_space)
        full = load_uncached("probe")
    assert full.handle is None and "No space left" in full.reasons[0], full.reasons
    assert "RANKATTN_CACHE_DIR" in full.reasons[0]

    def no_home(cls):
        raise RuntimeError("Could not determine home directory.")

    monkeypatch.delenv("RANKATTN_CACHE_DIR")
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setattr(Path, "home", classmethod(no_home))
    homeless = load_uncached("probe")
    assert homeless.handle is None and "home directory" in homeless.reasons[0]


@needs_compiler
@needs_readable_checkout
def test_a_folder_this_user_cannot_write_is_a_reason_and_auto_runs_xla(tiny_source):
    """The real kernel, an empty read-only cache: a reason (no traceback, no compile), and
    available_impls() leaves cpu out. Root ignores modes, so it runs this as user nobody."""
    folder = tiny_source / "cache"
    folder.mkdir(mode=0o555)
    folder.chmod(0o555)

    def child() -> str:
        import rankattn
        native.load.cache_clear()
        native.register.cache_clear()
        native.SOURCE_DIR = Path(native.__file__).parent / "backends"
        return repr((native.load("cpu_attention").reasons, rankattn.available_impls()))

    reasons, impls = literal_eval(in_child(child, NOBODY if os.geteuid() == 0 else None))
    assert "cannot be used" in reasons[0] and str(folder) in reasons[0], reasons
    assert "cpu" not in impls and impls[0] == "xla", impls


@needs_root
@needs_compiler
@needs_readable_checkout
def test_a_cache_shared_by_users(tiny_source):
    """Root builds into a shared (sticky, world-writable) folder; nobody loads root's library.
    With it deleted (root's lock file stays), nobody builds one with a lock of its own."""
    folder = tiny_source / "cache"
    folder.mkdir()
    folder.chmod(0o1777)

    def child() -> str:  # each in a child: a library this process loaded, dlopen returns again
        library = load_uncached("probe")
        answer = library.handle.rankattn_probe() if library.handle else None
        return repr((answer, library.reasons, library.compile_seconds, str(library.path)))

    answer, reasons, seconds, path = literal_eval(in_child(child))
    assert (answer, reasons) == (42, ()) and seconds is not None
    assert literal_eval(in_child(child, NOBODY)) == (42, (), None, path)
    Path(path).unlink()
    answer, reasons, seconds, path = literal_eval(in_child(child, NOBODY))
    assert (answer, reasons) == (42, ()) and seconds is not None
    assert Path(path).stat().st_uid == NOBODY
    locks = {f"{Path(path).stem}.user{user}.lock" for user in (os.getuid(), NOBODY)}
    assert locks <= {entry.name for entry in folder.iterdir()}


# --- The real kernel with other compilers. -------------------------------------------------

KERNEL_CHECK = textwrap.dedent("""
    import time
    start = time.perf_counter()
    import jax, jax.numpy as jnp, numpy as np
    import oracle, tolerances
    import rankattn
    from rankattn.backends import BlockSizes, Cpu
    from rankattn.backends.cpu import library
    lib = library()
    assert lib.handle is not None, lib.reasons
    print("built", lib.path.name, "in", lib.compile_seconds, "s")
    b, s, hq, hkv, d = 2, 37, 4, 2, 16
    seg = np.tile(np.r_[np.ones(25), -np.ones(9), np.zeros(3)], (b, 1)).astype(np.int32)
    rng = np.random.default_rng(0)
    q, w = (rng.standard_normal((b, s, hq, d), np.float32) for _ in range(2))
    k, v = (rng.standard_normal((b, s, hkv, d), np.float32) for _ in range(2))

    def loss(q, k, v):
        out = rankattn.attention(q, k, v, segment_ids=seg, impl=Cpu(BlockSizes(16, 8)))
        return (out * w).sum(), out

    grads, out = jax.grad(loss, (0, 1, 2), has_aux=True)(q, k, v)
    want = oracle.attention(q, k, v, oracle.mask_dense(seg, False), w=w, magnitudes=True)
    for name, got in zip(("out", "dq", "dk", "dv"), (out, *grads)):
        tolerances.assert_matches(name, np.asarray(got, np.float64), want[name], jnp.float32,
                                  want["terms"][name], want["amplified"][name], 2 * s)
    print(f"KERNEL CHECK PASSED in {time.perf_counter() - start:.1f} s")
""")


@pytest.mark.skipif(shutil.which("g++-11") is None, reason="g++-11 is not installed")
def test_gcc_11_builds_the_kernel(tmp_path):
    """GCC 11 (Ubuntu 22.04's default) has no __builtin_shufflevector; the kernel takes its
    __builtin_shuffle instead there, builds with -Werror and passes the kernel check."""
    result = python(KERNEL_CHECK, {"RANKATTN_CXX": "g++-11", "RANKATTN_CACHE_DIR": str(tmp_path)})
    assert result.returncode == 0 and "KERNEL CHECK PASSED" in result.stdout, (
        result.stdout[-3000:] + result.stderr[-5000:])
