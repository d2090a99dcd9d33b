"""The pallas_triton kernels' configuration per GPU: tiles, warps, stages, kernel split.

Two sources, in this order (:func:`default_config`):

1. The tuned table, ``gpu_tuned.json`` beside this module (package data), written by
   ``benchmarks/gpu.py --tune`` on a GPU: configurations timed there, forward + backward,
   after each was checked against the reference. It is keyed by compute capability, dtype
   (with the float32 dot precision), the padded head dim's range and the GQA group's
   range; the first matching entry wins. ``RANKATTN_GPU_TUNED=/path/table.json`` reads
   another table. The file is read again whenever it changes (:func:`load_table`). A
   missing table is silent; a malformed one is ignored with one warning (the built-in
   rules then serve every call).
2. Built-in rules (:func:`spill_free_config`): the configurations that compile without
   register spills in the deviceless compile of ``benchmarks/gpu_compile.py``.

One configuration serves the three kernels of a call (forward, dq, dk / dv), because one
block plan serves them: the forward and dq kernels read its lists, dk / dv its transposed
lists. Tiles per kernel would need a second plan per call (and per prepared
:class:`rankattn.Plan`); the tuner therefore picks the configuration whose forward +
backward time is least.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import re
import warnings
from pathlib import Path

import jax.numpy as jnp

from rankattn.blocks import BlockSizes
from rankattn.errors import fail

MIN_BLOCK = 16  # Triton's dot needs every dimension >= 16, and its loads power-of-two shapes.
PRECISIONS = ("highest", "high", "default")  # of float32 dots (PallasTriton's precision=)


@dataclasses.dataclass(frozen=True)
class GpuTarget:
    """The GPU the kernels are compiled for, as far as their configuration depends on it."""

    compute_capability: tuple[int, int]
    shared_memory_per_block: int  # bytes one block may opt into

    @classmethod
    def of(cls, spec, owner: str = "PallasTriton") -> "GpuTarget":
        """A GpuTarget from itself, "sm_90" ("sm_90a"), "9.0" or (9, 0) (shared memory by
        architecture); RA116 naming ``owner``, the class whose ``target=`` it is, otherwise."""
        if isinstance(spec, GpuTarget):
            return spec
        capability = _capability(spec)
        if capability is None:
            names = ", ".join(f"'sm_{major}{minor}'"
                              for major, minor in SHARED_MEMORY_PER_BLOCK)
            raise fail("RA116", f"{owner} target={spec!r} names no GPU; pass one of {names} "
                                "(or the compute capability as '9.0' or (9, 0)), or "
                                "GpuTarget(compute_capability, shared_memory_per_block) for "
                                "another GPU.")
        known = SHARED_MEMORY_PER_BLOCK.get(capability)
        if known is None:
            raise fail("RA116", f"{owner} target={spec!r}: compute capability {capability} "
                                f"is not one of {sorted(SHARED_MEMORY_PER_BLOCK)}; pass "
                                "GpuTarget(compute_capability, shared_memory_per_block) for "
                                "another GPU.")
        return cls(capability, known)

    @property
    def name(self) -> str:
        return f"sm_{self.compute_capability[0]}{self.compute_capability[1]}"


def _capability(spec) -> tuple[int, int] | None:
    """(major, minor) of a target spelled "sm_90" / "sm_90a" (NVIDIA's names: the last digit
    the minor), "9.0" (JAX's compute_capability) or (9, 0); None for anything else."""
    if isinstance(spec, str):
        named = re.fullmatch(r"sm_(\d+)(\d)a?|(\d+)\.(\d+)", spec)
        return None if named is None else tuple(int(x) for x in named.groups() if x is not None)
    if (isinstance(spec, (tuple, list)) and len(spec) == 2
            and all(isinstance(x, int) and not isinstance(x, bool) for x in spec)):
        return tuple(spec)
    return None


# Opt-in shared memory per block (CUDA programming guide, compute capabilities table).
SHARED_MEMORY_PER_BLOCK = {(8, 0): 166912, (8, 6): 101376, (8, 7): 166912, (8, 9): 101376,
                           (9, 0): 232448, (10, 0): 232448, (12, 0): 101376}
# Lowering for CUDA without a GPU and without a named target: settings that compile on every
# supported GPU (the 99 KB parts' shared memory, no Hopper-only instructions).
PORTABLE_TARGET = GpuTarget((8, 0), 101376)


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """Tiles and launch options of the three kernels for one (target, dtype, head dim)."""

    block_sizes: BlockSizes
    split_dkv: bool  # dk and dv in two kernels: half the accumulators, p computed twice
    num_warps: int
    # The dk / dv kernel's logits as [block_k, block_q] (k q^T), so dk += ds q and dv += p dO
    # need no transposed operand; query-major keeps q k^T, whose block_q rows let sm_90 use
    # wgmma (64-row tiles) where block_k is 32.
    key_major: bool
    num_stages: int | None = None  # None: two pipeline stages when they fit (_default_stages)


def lowering_without_gpu(device_kind: str = "NVIDIA H100 80GB HBM3"):
    """A context in which a machine without a GPU lowers pallas_triton's kernels for CUDA:
    ``with lowering_without_gpu(): jax.jit(f).trace(*args).lower(lowering_platforms=
    ("cuda",))``.

    jax 0.10 lowers a Triton kernel for compute capability 9.0 when no GPU is present; jax
    0.11 (pull request #38762, not in its changelog) reads the GPU from the default device or
    from the abstract mesh's abstract device, and without either raises RuntimeError("No
    supported GPU devices found, please specify an abstract GPU device ..."). An abstract
    mesh with no axes whose abstract device is ``device_kind`` (a name jax 0.11 knows:
    "NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-80GB", "NVIDIA L4", ...) serves both: jax
    0.10 ignores it (checked: the same kernels, no warning).
    """
    from jax.sharding import AbstractDevice, AbstractMesh, use_abstract_mesh
    return use_abstract_mesh(AbstractMesh((), (), abstract_device=AbstractDevice(
        device_kind=device_kind, num_cores=None, platform="gpu")))


def spill_free_config(target: GpuTarget, dtype, head_dim: int,
                      precision: str = "highest") -> KernelConfig:
    """The configuration with no register spills, from benchmarks/GPU_COMPILE.md: what runs
    where the tuned table has no entry.

    ``head_dim``: the larger of D and Dv after padding to a power of two. What the
    deviceless compile showed (ptxas 12.9, bf16, 4/2 heads; regs / spill bytes per thread):
    - 64 x 64 tiles, one dk / dv kernel: dk / dv at 255 registers, spilling 136-568 bytes on
      sm_90 and more on sm_80, and dq at 255 with causal + softcap.
    - 64 x 32 on sm_90 (wgmma): no spills at D <= 128, causal and caps included (dk / dv
      197-254 registers). On sm_80 / sm_89 (mma.sync) its dk / dv spills 96-136 bytes with a cap.
    - 32 x 32 on sm_80 / sm_89: no spills at D <= 128 (dk / dv 204). On sm_90 it loses wgmma.
    - D = 256: every tile with one dk / dv kernel spills 424-1008 bytes; 32 x 32 with dk and dv
      in two kernels spills none on sm_80 / sm_90 (24 bytes in the sm_89 forward).
      On the 99 KB parts (sm_89) that config's forward spills 24 bytes; 32 x 16 spills
      nothing on any target.
    - float32 ("ieee" dots, no tensor cores): with 64 x 32 tiles ptxas gives dk / dv 32
      registers and 57-72 KB of spill traffic per thread. 16 x 16 tiles, dk and dv apart and
      4 warps bring it to 2.1 KB (dk) and 0.5 KB (dv); computing the dk / dv kernels' logits
      key-major (k q^T, no transposed operand in dk += ds q) to none. Larger float32 tiles
      spill 0.3-36 KB.
    - Key-major dk / dv kernels on sm_80 / sm_89 also take 150-190 registers where
      query-major took 196-204. On sm_90 at D <= 128 query-major stays: with 32-key tiles
      key-major loses wgmma, and 64 x 64 tiles spill 72-360 bytes (96-120 with dk, dv apart).
    - float32 on tensor cores (``precision`` "high" / "default"): the 16-bit tiles spill
      0.4-3 KB in dk / dv; 32 x 32 with dk and dv apart spill nothing with tf32 and 56-104
      bytes with three bf16 passes (dq 64).
    """
    f32 = jnp.dtype(dtype) == jnp.float32
    if f32 and precision == "highest":
        return KernelConfig(BlockSizes(16, 16), True, 4, key_major=True)
    warps = 8 if head_dim > 64 else 4
    if head_dim > 128:
        small_smem = target.shared_memory_per_block <= PORTABLE_TARGET.shared_memory_per_block
        return KernelConfig(BlockSizes(32, 16 if small_smem else 32), True, warps,
                            key_major=True)
    if f32:
        return KernelConfig(BlockSizes(32, 32), True, warps, key_major=True)
    if target.compute_capability >= (9, 0):
        return KernelConfig(BlockSizes(64, 32), False, warps, key_major=False)
    return KernelConfig(BlockSizes(32, 32), False, warps, key_major=True)


def next_power_of_2(x: int) -> int:
    return 1 << max(0, x - 1).bit_length()


def padded_head_dim(size: int) -> int:
    """A head dim as the kernels see it: a power of two >= 16 (zeros pad the rest)."""
    return max(MIN_BLOCK, next_power_of_2(size))


def _is_tile(value) -> bool:
    return (isinstance(value, int) and not isinstance(value, bool) and value >= MIN_BLOCK
            and not value & (value - 1))


NUM_WARPS = (1, 2, 4, 8, 16)  # warps per Triton program: Triton needs a power of two
NUM_WARPS_TEXT = f"{', '.join(map(str, NUM_WARPS[:-1]))} or {NUM_WARPS[-1]}"


def is_num_warps(value) -> bool:
    """Whether ``value`` is a warp count Triton takes: an int (not a bool, not 4.0, which
    ``in NUM_WARPS`` alone would pass) of :data:`NUM_WARPS`."""
    return isinstance(value, int) and not isinstance(value, bool) and value in NUM_WARPS


# --- The tuned table. ----------------------------------------------------------------


TUNED_TABLE = Path(__file__).with_name("gpu_tuned.json")
TUNED_TABLE_ENV = "RANKATTN_GPU_TUNED"
TABLE_SCHEMA = 1
DTYPES = ("bfloat16", "float16", "float32")
CONFIG_FIELDS = ("block_q", "block_k", "num_warps", "num_stages", "split_dkv", "key_major")
BACKEND_NAMES = ("pallas_triton", "mosaic_gpu")  # of an entry's "backend" (default the first)
MOSAIC_TILES = (64, 128)  # mosaic_gpu's block_q / block_k: one or two 64-row warpgroups
MOSAIC_DEPTHS = (2, 3, 4)  # mosaic_gpu's pipeline depths (see MosaicGpu)


@dataclasses.dataclass(frozen=True)
class TunedEntry:
    """One row of the tuned table: the configuration for calls that match its key."""

    compute_capability: tuple[int, int]
    dtype: str             # of q, k, v
    precision: str         # of float32 dots; "highest" for 16-bit dtypes
    head_dim: tuple[int, int]  # inclusive range of the padded head dim (a power of two >= 16)
    group: tuple[int, int]     # inclusive range of query heads per kv head
    config: KernelConfig
    # The backend whose kernels the entry configures, of BACKEND_NAMES. The first entry that
    # matches a call also says which of them impl='auto' takes on this GPU (mosaic_gpu only
    # where benchmarks/gpu.py checked and timed it). For mosaic_gpu, config's block_q and
    # block_k (64 or 128) and num_stages (its pipeline depth) are read, nothing else.
    backend: str = "pallas_triton"

    def matches(self, capability, dtype: str, precision: str, head_dim: int, group: int) -> bool:
        return (self.compute_capability == tuple(capability) and self.dtype == dtype
                and (dtype != "float32" or self.precision == precision)
                and self.head_dim[0] <= head_dim <= self.head_dim[1]
                and self.group[0] <= group <= self.group[1])

    def to_json(self) -> dict:
        c = self.config
        backend = {} if self.backend == BACKEND_NAMES[0] else dict(backend=self.backend)
        return dict(**backend, compute_capability=".".join(map(str, self.compute_capability)),
                    dtype=self.dtype, precision=self.precision, head_dim=list(self.head_dim),
                    group=list(self.group),
                    config=dict(block_q=c.block_sizes.block_q, block_k=c.block_sizes.block_k,
                                num_warps=c.num_warps, num_stages=c.num_stages,
                                split_dkv=c.split_dkv, key_major=c.key_major))


def parse_table(data) -> tuple[TunedEntry, ...]:
    """The entries of a table's JSON value; ValueError saying what is wrong otherwise.

    Format: ``{"schema": 1, "entries": [entry, ...]}`` plus any other top-level keys (its
    provenance). An entry is ``{"compute_capability": "9.0", "dtype": "bfloat16",
    "precision": "highest", "head_dim": [65, 128], "group": [1, 8], "config": {"block_q":
    64, "block_k": 32, "num_warps": 8, "num_stages": 2, "split_dkv": false, "key_major":
    false}}`` and may hold a "measured" object (the tuner's timings), which is not read,
    and a "backend" (default "pallas_triton"; "mosaic_gpu": block_q and block_k 64 or 128,
    num_stages its pipeline depth).
    """
    if not isinstance(data, dict) or data.get("schema") != TABLE_SCHEMA:
        raise ValueError(f"expected an object with \"schema\": {TABLE_SCHEMA}")
    if not isinstance(data.get("entries"), list):
        raise ValueError("\"entries\" must be a list")
    return tuple(_parse_entry(i, e) for i, e in enumerate(data["entries"]))


def _parse_entry(index: int, entry) -> TunedEntry:
    def bad(what):
        return ValueError(f"entries[{index}]: {what}")

    def int_range(key):
        value = entry.get(key)
        if not (isinstance(value, list) and len(value) == 2
                and all(isinstance(x, int) and not isinstance(x, bool) for x in value)
                and 1 <= value[0] <= value[1]):
            raise bad(f"{key} must be [low, high] with 1 <= low <= high, not {value!r}")
        return tuple(value)

    if not isinstance(entry, dict):
        raise bad(f"an object, not {entry!r}")
    missing = {"compute_capability", "dtype", "precision", "head_dim", "group",
               "config"} - entry.keys()
    if missing:
        raise bad(f"missing {sorted(missing)}")
    try:
        capability = tuple(int(x) for x in str(entry["compute_capability"]).split("."))
        assert len(capability) == 2
    except (ValueError, AssertionError):
        raise bad(f"compute_capability must be like \"9.0\", not "
                  f"{entry['compute_capability']!r}") from None
    if entry["dtype"] not in DTYPES:
        raise bad(f"dtype must be one of {DTYPES}, not {entry['dtype']!r}")
    if entry["precision"] not in PRECISIONS:
        raise bad(f"precision must be one of {PRECISIONS}, not {entry['precision']!r}")
    backend = entry.get("backend", BACKEND_NAMES[0])
    if backend not in BACKEND_NAMES:
        raise bad(f"backend must be one of {BACKEND_NAMES}, not {backend!r}")
    config = entry["config"]
    if not isinstance(config, dict) or set(config) != set(CONFIG_FIELDS):
        raise bad(f"config must have exactly the keys {CONFIG_FIELDS}")
    for key in ("block_q", "block_k"):
        if backend == "mosaic_gpu" and config[key] not in MOSAIC_TILES:
            raise bad(f"config.{key} of a mosaic_gpu entry must be one of {MOSAIC_TILES}, not "
                      f"{config[key]!r}")
        if not _is_tile(config[key]):
            raise bad(f"config.{key} must be a power of two >= {MIN_BLOCK}, not {config[key]!r}")
    if not is_num_warps(config["num_warps"]):
        raise bad(f"config.num_warps must be {NUM_WARPS_TEXT}, not {config['num_warps']!r}")
    stages = config["num_stages"]
    if stages is not None and not (isinstance(stages, int) and not isinstance(stages, bool)
                                   and 1 <= stages <= 8):
        raise bad(f"config.num_stages must be null or 1 to 8, not {stages!r}")
    if backend == "mosaic_gpu" and stages is not None and stages not in MOSAIC_DEPTHS:
        raise bad(f"config.num_stages (the pipeline depth) of a mosaic_gpu entry must be null "
                  f"or one of {MOSAIC_DEPTHS}, not {stages!r}")
    for key in ("split_dkv", "key_major"):
        if not isinstance(config[key], bool):
            raise bad(f"config.{key} must be true or false, not {config[key]!r}")
    return TunedEntry(capability, entry["dtype"], entry["precision"], int_range("head_dim"),
                      int_range("group"),
                      KernelConfig(BlockSizes(config["block_q"], config["block_k"]),
                                   config["split_dkv"], config["num_warps"], config["key_major"],
                                   stages), backend)


def check_tuned(tuned, owner: str):
    """``tuned`` (a backend's option: which table it reads) if it is one, else RA116 naming
    ``owner``, the backend's class."""
    if not (tuned is None or tuned is False or isinstance(tuned, (str, os.PathLike))):
        raise fail("RA116", f"{owner} tuned={tuned!r}; pass None (the shipped table), a path "
                            "to a table written by benchmarks/gpu.py --tune, or False (the "
                            "built-in configurations only).")
    return tuned


def table_path() -> Path:
    """The table pallas_triton reads: $RANKATTN_GPU_TUNED, else the one shipped."""
    return Path(os.environ.get(TUNED_TABLE_ENV) or TUNED_TABLE)


def load_table(path: Path) -> tuple[TunedEntry, ...]:
    """The entries of the table at ``path`` as the file is now.

    Parsed once per version of the file: the cache is keyed by the file's modification
    time, size and inode, so a table rewritten in place or replaced (``save_table``, an
    editor, another process) is read again, never served stale. A missing file is an empty
    table; an unreadable or malformed one is an empty table with one warning per version
    (a broken table must not cost users the kernels).
    """
    try:
        stat = path.stat()
    except FileNotFoundError:
        return ()
    except OSError as error:
        return _ignored(path, f"it cannot be read: {error}")
    return _parsed_table(path, stat.st_mtime_ns, stat.st_size, stat.st_ino)


@functools.lru_cache(maxsize=64)
def _parsed_table(path: Path, mtime_ns: int, size: int, inode: int) -> tuple[TunedEntry, ...]:
    """The table at ``path`` in the version the last three arguments name (the cache key)."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:  # removed since its stat
        return ()
    except OSError as error:
        return _ignored(path, f"it cannot be read: {error}")
    try:  # decoded here, so a table that is not UTF-8 is malformed like any other
        return parse_table(json.loads(data.decode("utf-8")))
    # UnicodeDecodeError and json.JSONDecodeError are ValueErrors; json.loads raises
    # RecursionError on arrays or objects nested past the interpreter's recursion limit.
    except (ValueError, RecursionError) as error:
        return _ignored(path, str(error))


def save_table(path: Path, table: dict) -> None:
    """Write ``table`` (a table's JSON value) to ``path`` atomically, after checking that
    :func:`parse_table` takes it (never a table the library would ignore).

    A temporary file beside it replaces the old one, so a reader sees the old table or the
    new one, never half of one; and the parsed-table cache is dropped, so the next
    ``load_table`` in this process reads what was written even when the file system's
    timestamps are too coarse to tell the two versions apart.
    """
    parse_table(table)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    temporary.write_text(json.dumps(table, indent=1) + "\n")
    os.replace(temporary, path)
    _parsed_table.cache_clear()


def _ignored(path: Path, reason: str) -> tuple:
    warnings.warn(f"rankattn: the tuned GPU table {path} is ignored ({reason}); pallas_triton "
                  "uses its built-in configurations. Rewrite it with benchmarks/gpu.py --tune, "
                  f"or unset {TUNED_TABLE_ENV} / delete the file.", RuntimeWarning, stacklevel=3)
    return ()


def tuned_entry(capability, dtype, head_dim: int, precision: str = "highest", group: int = 1,
                table: tuple[TunedEntry, ...] = (), backend: str | None = None
                ) -> TunedEntry | None:
    """The first entry of ``table`` for this call (of ``backend``'s entries; None: any), or
    None. ``head_dim``: the larger of D and Dv padded to a power of two >= 16; ``group``:
    query heads per kv head."""
    name = jnp.dtype(dtype).name
    return next((e for e in table if (backend is None or e.backend == backend)
                 and e.matches(capability, name, precision, head_dim, group)), None)


def default_config(target: GpuTarget, dtype, head_dim: int, precision: str = "highest",
                   group: int = 1, table: tuple[TunedEntry, ...] = ()) -> KernelConfig:
    """pallas_triton's configuration for this call: the tuned table's (``table``, from
    :func:`load_table`; arguments as :func:`tuned_entry`'s), else the spill-free rules'."""
    entry = tuned_entry(target.compute_capability, dtype, head_dim, precision, group, table,
                        backend="pallas_triton")
    return entry.config if entry else spill_free_config(target, dtype, head_dim, precision)
