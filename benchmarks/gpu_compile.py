"""Deviceless compile report: the pallas_triton and mosaic_gpu kernels compiled for real NVIDIA
GPUs, no GPU.

    .venv/bin/python benchmarks/gpu_compile.py            # every target and axis -> GPU_COMPILE.md
    .venv/bin/python benchmarks/gpu_compile.py --targets sm_90 --axes default causal --print
    .venv/bin/python benchmarks/gpu_compile.py --smoke --out DIR  # sm_90, pallas_triton's default
    .venv/bin/python benchmarks/gpu_compile.py --candidates   # gpu.py's tune candidates, sm_90

Lowering a Pallas kernel stops at Triton IR, which cannot show registers or shared
memory. XLA's GPU compiler can finish the compile on a CPU-only machine, given
jax's CUDA plugin, ptxas (PyPI's nvidia-cuda-nvcc-cu12) and a description of the
target GPU (``gpu_targets/*.txtpb``, one per target). The first run installs those
three packages, at the installed jax's version (jax itself is never touched), into
``~/.cache/rankattn/cuda-compiler-<jax version>`` (about 600 MB; pip's --no-deps,
so no CUDA runtime), and every compile runs in a child process with that folder on
its path, so this process and the test suite's stay CPU-only.

For each target and configuration it compiles ``jax.value_and_grad`` of a loss with
an lse term (so the forward, dq and dk / dv kernels) and reads, per kernel:
registers, spill stores / loads and stack (``ptxas -v``, logged by XLA),
threads and dynamic shared memory (XLA's thunk sequence), the tensor-core
instruction family in its PTX (wgmma, mma.sync or none) and the occupancy those
imply (resident warps per SM out of the SM's maximum). Configurations vary one
axis at a time around the default (bfloat16, D=128, 4 query / 2 kv heads, S=1031,
no cap): S does not change the kernels' resources. mosaic_gpu's kernels (sm_90 only: wgmma,
which ptxas rejects for sm_100a) are compiled by the plugin's Mosaic GPU custom call, whose
PTX, ptxas report (registers, spills, barriers) and pass log (shared memory) it writes under
``MOSAIC_GPU_DUMP_TO``; their registers are the launch's (168 for 384 threads), which the
kernels rebalance at run time (setmaxnreg: 240 for each compute warpgroup, 24 for the memory
warpgroup).

It writes benchmarks/GPU_COMPILE.md (generated: never edit it by hand), with the
versions of jax, the plugin and ptxas it used: register allocation changes
between CUDA toolkits.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import user_cache  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
TARGETS_DIR = os.path.join(HERE, "gpu_targets")
COMMAND = ".venv/bin/python benchmarks/gpu_compile.py"
# target -> (description file, GPUs it stands for, warps an SM holds at most)
TARGETS = {
    "sm_90": ("h100.txtpb", "H100 / H200", 64),
    "sm_80": ("a100.txtpb", "A100", 64),
    "sm_89": ("l4.txtpb", "L4; like every 99 KB part: RTX 3090 / 4090, A10, L40S", 48),
}
KERNELS = ("rankattn_forward", "rankattn_dq", "rankattn_dkv", "rankattn_dk", "rankattn_dv")
MOSAIC_SUFFIX = "_mosaic_gpu_kernel"  # of a Mosaic GPU kernel's PTX entry
# mosaic_gpu's kernels are for sm_90a (wgmma); ptxas rejects wgmma for sm_100a.
MOSAIC_TARGETS = ("sm_90",)
# Shared memory the driver reserves per resident block.
RESERVED_SHARED_PER_BLOCK = 1024


@dataclasses.dataclass(frozen=True)
class Config:
    """One compiled configuration: the default, with one axis changed."""

    axis: str
    dtype: str = "bfloat16"
    head_dim: int = 128
    q_heads: int = 4
    kv_heads: int = 2
    seq_len: int = 1031
    causal: bool = False
    softcap_method: str | None = None
    multiplier: bool = False  # a logit multiplier per query (Phoenix's temperatures)
    precision: str = "highest"  # of float32 dots (PallasTriton's option)
    impl: str = "pallas_triton"  # or "mosaic_gpu" (sm_90 only: wgmma)

    @property
    def label(self) -> str:
        parts = [self.dtype, f"D={self.head_dim}", f"{self.q_heads}/{self.kv_heads} heads"]
        if self.impl != "pallas_triton":
            parts.insert(0, f"**{self.impl}**")
        if self.seq_len != Config.seq_len:
            parts.append(f"S={self.seq_len}")
        if self.precision != "highest":
            parts.append(f"precision {self.precision}")
        if self.causal:
            parts.append("causal")
        if self.softcap_method:
            parts.append(f"softcap {self.softcap_method}")
        if self.multiplier:
            parts.append("multiplier")
        return ", ".join(parts)


def configs(axes: list[str] | None = None) -> list[Config]:
    """The default and each axis varied on its own (``axes`` picks by axis name)."""
    out = [Config("default")]
    out += [Config("dtype", dtype=d) for d in ("float16", "float32")]
    out += [Config("precision", dtype="float32", precision=p) for p in ("high", "default")]
    out += [Config("head_dim", head_dim=d) for d in (32, 64, 96, 192, 256)]
    out += [Config("gqa", q_heads=h, kv_heads=kv) for h, kv in ((4, 4), (20, 4), (8, 1))]
    out += [Config("causal", causal=True)]
    out += [Config("softcap", softcap_method=m) for m in ("tanh", "soft_sign")]
    out += [Config("causal+softcap", causal=True, softcap_method="tanh")]
    return [c for c in out if axes is None or c.axis in axes]


def mosaic_configs(axes: list[str] | None = None) -> list[Config]:
    """mosaic_gpu's: its 16-bit dtypes and head dims, GQA groups 1-8, causal and not, with and
    without a cap, and a sequence of at most 64 tokens (one 64-row warpgroup a block)."""
    mosaic = lambda axis, **kw: Config(axis, impl="mosaic_gpu", **kw)  # noqa: E731
    out = [mosaic("default"), mosaic("dtype", dtype="float16"), mosaic("head_dim", head_dim=64)]
    out += [mosaic("gqa", q_heads=h, kv_heads=kv) for h, kv in ((4, 4), (20, 4), (8, 1))]
    out += [mosaic("causal", causal=True)]
    out += [mosaic("softcap", softcap_method=m) for m in ("tanh", "soft_sign")]
    out += [mosaic("causal+softcap", causal=True, softcap_method="tanh"),
            mosaic("causal+softcap", causal=True, softcap_method="tanh", head_dim=64,
                   q_heads=20, kv_heads=4),
            mosaic("causal+softcap+multiplier", causal=True, softcap_method="tanh",
                   multiplier=True, q_heads=20, kv_heads=4)]
    out += [mosaic("seq_len", seq_len=40)]
    return [c for c in out if axes is None or c.axis in axes]


# --- The candidates of benchmarks/gpu.py's tune phase. -----------------------------

# (dtype, head dim, query heads, kv heads): the calls gpu.py --tune times candidates for, in
# order of value (a run cut short keeps the first): Phoenix's production heads first.
TUNE_CLASSES = (("bfloat16", 128, 20, 4), ("bfloat16", 128, 4, 2), ("bfloat16", 64, 4, 2),
                ("bfloat16", 64, 20, 4), ("float32", 128, 4, 2))
CANDIDATES_JSON = os.path.join(HERE, "results", "gpu_candidates.json")


def option(block_q: int, block_k: int, warps: int, stages: int | None = None,
           split_dkv: bool = False, key_major: bool = False) -> dict:
    """PallasTriton's keyword arguments for one candidate, as JSON (block_sizes a list)."""
    return dict(block_sizes=[block_q, block_k], num_warps=warps, num_stages=stages,
                split_dkv=split_dkv, key_major=key_major)


def tune_candidates(dtype: str) -> list[dict]:
    """The configurations the tune phase may time for ``dtype`` at D <= 128.

    16-bit: around the spill-free sm_90 default (64 x 32, 8 warps, one dk / dv kernel),
    larger query tiles (FlashAttention-2's kernels take 128 query rows at D = 128, JAX's
    Pallas attention defaults to 128 x 128), tiles that spill a little (64 x 64 in one dk / dv
    kernel), 4 warps, three stages, dk and dv apart, key-major dk / dv (sm_80's default).
    Exact float32 (no tensor cores; registers bound it): 16-32 row / key tiles, 2 or 4 warps.
    Which of them compile, and their registers and spills, are in CANDIDATES_JSON
    (``--candidates``).
    """
    if dtype == "float32":
        return [option(16, 16, 4, None, True, True), option(32, 16, 4, None, True, True),
                option(16, 32, 4, None, True, True), option(32, 32, 4, None, True, True),
                option(16, 16, 2, None, True, True), option(16, 16, 4, 3, True, True)]
    return [option(64, 32, 8), option(64, 32, 8, 3), option(64, 32, 4),
            option(64, 64, 8), option(64, 64, 8, None, True),
            option(128, 32, 8), option(128, 64, 8), option(128, 64, 8, None, True),
            option(128, 128, 8, None, True), option(32, 32, 4, None, False, True),
            option(64, 32, 8, None, False, True)]


def compile_candidates(target: str, packages: str | None) -> dict:
    """Every tune candidate compiled for ``target`` (at 4 / 2 heads: the group changes no
    kernel's resources, GPU_COMPILE.md's gqa rows), with compile seconds, as one report."""
    shapes = dict.fromkeys((dtype, head_dim) for dtype, head_dim, _, _ in TUNE_CLASSES)
    cfgs, options = [], []
    for dtype, head_dim in shapes:
        for candidate in tune_candidates(dtype):
            cfgs.append(Config("tune", dtype=dtype, head_dim=head_dim))
            options.append(candidate)
    print(f"{target}: compiling {len(cfgs)} tune candidates ...", file=sys.stderr, flush=True)
    results = compile_in_child(target, cfgs, packages, options)
    import jax
    return dict(target=target, jax=jax.__version__,
                ptxas=next((r["ptxas"] for r in results if r["ptxas"]), None),
                date=datetime.datetime.now().strftime("%Y-%m-%d %H:%M"),
                candidates=[dict(r, options=o) for r, o in zip(results, options)])


# --- The compiler packages. --------------------------------------------------------


def compiler_packages() -> list[str]:
    import jax
    return [f"jax-cuda12-plugin=={jax.__version__}", f"jax-cuda12-pjrt=={jax.__version__}",
            "nvidia-cuda-nvcc-cu12"]


def compiler_folder() -> str:
    """The user-cache folder name of the CUDA plugin and ptxas for the installed jax."""
    import jax
    return f"cuda-compiler-{jax.__version__}"


def compiler_dir() -> str:
    """The folder holding the CUDA plugin and ptxas, installed there on first use
    (benchmarks/user_cache.py). Raises RuntimeError with pip's last lines when the packages
    cannot be had."""
    return user_cache.install_once(compiler_folder(), compiler_packages())


def child_env(packages: str | None) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [p for p in (packages, os.path.join(os.path.dirname(HERE), "src")) if p]
        + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    env.update(JAX_SKIP_CUDA_CONSTRAINTS_CHECK="1",  # no CUDA runtime: nothing to check
               TF_CPP_MIN_LOG_LEVEL="0", TF_CPP_VMODULE="subprocess_compilation=3")
    env.pop("XLA_FLAGS", None)
    return env


# --- One target, in a child process. ----------------------------------------------


def target_limits(target: str) -> dict:
    """Numbers of the target description that occupancy and the report need."""
    text = open(os.path.join(TARGETS_DIR, TARGETS[target][0])).read()
    number = lambda key: int(re.search(rf"\b{key}: (\d+)", text).group(1))
    return dict(shared_per_sm=number("shared_memory_per_core"),
                shared_per_block=number("shared_memory_per_block_optin"),
                registers_per_sm=number("registers_per_core_limit"),
                max_warps=TARGETS[target][2])


def compile_in_child(target: str, cfgs: list[Config], packages: str | None,
                     options: dict | list[dict] | None = None) -> list[dict]:
    """Compile ``cfgs`` for ``target`` in a child process; one result dict per config.

    ``options``: PallasTriton's keyword arguments (block_sizes as [block_q, block_k]), for
    every config, or a list with one dict per config. ``packages``: the folder of
    :func:`compiler_dir`, or None for the CUDA plugin this Python already has (a GPU
    machine's own; nothing is installed).
    """
    result = subprocess.run(
        [sys.executable, os.path.abspath(__file__), "--child", target,
         json.dumps([dataclasses.asdict(c) for c in cfgs]), json.dumps(options or {})],
        env=child_env(packages), capture_output=True, text=True)
    lines = [l for l in result.stdout.splitlines() if l.startswith("{")]
    if result.returncode or len(lines) != len(cfgs):
        tail = "\n".join(result.stderr.strip().splitlines()[-8:])
        raise RuntimeError(f"the compile worker for {target} failed:\n{tail}")
    return [json.loads(l) for l in lines]


def child(target: str, cfgs_json: str, options_json: str):
    """Runs in the child: compile each config, print one JSON line each."""
    import jax
    import jax.numpy as jnp
    from jax.experimental import topologies
    from jax.sharding import SingleDeviceSharding

    import rankattn
    from rankattn.backends import BlockSizes, MosaicGpu, PallasTriton
    from rankattn.backends.gpu_config import lowering_without_gpu

    cfgs = json.loads(cfgs_json)
    options = json.loads(options_json)
    per_config = options if isinstance(options, list) else [options] * len(cfgs)

    text = open(os.path.join(TARGETS_DIR, TARGETS[target][0])).read()
    device_kind = re.search(r'device_description_str: "([^"]+)"', text)[1]
    topology = topologies.get_topology_desc(platform="cuda", target_config=text,
                                            topology="1x1x1")
    sharding = SingleDeviceSharding(topology.devices[0])
    for fields, options in zip(cfgs, per_config):
        cfg = Config(**fields)
        if "block_sizes" in options:
            options = dict(options, block_sizes=BlockSizes(*options["block_sizes"]))
        dtype = jnp.dtype(cfg.dtype)
        spec = lambda *shape, dt=dtype: jax.ShapeDtypeStruct(shape, dt, sharding=sharding)
        b, s, d = 1, cfg.seq_len, cfg.head_dim

        if cfg.impl == "mosaic_gpu":  # defaults only; an instance is not checked against
            impl = MosaicGpu()          # this process's (CPU) backend
        else:
            impl = PallasTriton(target=target, precision=cfg.precision, **options)

        def loss(q, k, v, seg, cfg=cfg, impl=impl):
            out, lse = rankattn.attention(
                q, k, v, segment_ids=seg, causal=cfg.causal,
                softcap=None if cfg.softcap_method is None else 20.0,
                softcap_method=cfg.softcap_method or "tanh", return_lse=True, impl=impl,
                logit_multiplier=(1 + seg / 8).astype(jnp.float32) if cfg.multiplier else None)
            return out.astype(jnp.float32).sum() + jnp.where(jnp.isfinite(lse), lse, 0).sum()

        dump = tempfile.mkdtemp(prefix="gpu-compile-")
        # Mosaic GPU kernels are compiled by the plugin, which writes their PTX and ptxas
        # report here (XLA's own dump does not hold them).
        os.environ["MOSAIC_GPU_DUMP_TO"] = dump
        log = os.path.join(dump, "stderr.txt")
        saved = os.dup(2)
        error = None
        start = time.perf_counter()
        with open(log, "w") as sink:
            os.dup2(sink.fileno(), 2)
            try:
                with lowering_without_gpu(device_kind):  # jax 0.11: the GPU to lower for
                    lowered = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2))).trace(
                        spec(b, s, cfg.q_heads, d), spec(b, s, cfg.kv_heads, d),
                        spec(b, s, cfg.kv_heads, d), spec(b, s, dt=jnp.int32)).lower()
                lowered.compile(compiler_options={"xla_dump_to": dump})
            except Exception as e:  # a kernel that does not fit: reported, not fatal
                error = str(e).strip().splitlines()[0][:300]
            finally:
                os.dup2(saved, 2)
                os.close(saved)
        text = open(log).read() + "".join(
            open(p).read() for p in glob.glob(os.path.join(dump, "*.ptxas")))  # Mosaic GPU's
        if "Function properties for" not in text:  # an XLA that runs ptxas in-process
            text += ptxas_on_dump(dump)
        print(json.dumps(dict(config=fields, error=error, kernels=read_kernels(dump, text),
                              ptxas=ptxas_version(text),
                              seconds=round(time.perf_counter() - start, 2))), flush=True)
        shutil.rmtree(dump, ignore_errors=True)


def ptxas_on_dump(dump: str) -> str:
    """``ptxas -v`` of the dumped PTX, for an XLA that compiles PTX in-process and so logs no
    report (a GPU machine's own plugin may): the ptxas on PATH or of an installed
    nvidia-cuda-nvcc package; "" when there is none."""
    ptxas = shutil.which("ptxas") or next(
        (p for entry in sys.path if os.path.isdir(entry)
         for p in glob.glob(os.path.join(entry, "nvidia", "**", "bin", "ptxas"), recursive=True)),
        None)
    if ptxas is None:
        return ""
    reports = [subprocess.run([ptxas, "--version"], capture_output=True, text=True).stdout]
    for path in glob.glob(os.path.join(dump, "*.ptx")):
        arch = re.search(r"^\.target (sm_\w+)", open(path).read(), re.M)
        if arch:
            result = subprocess.run([ptxas, f"-arch={arch[1]}", "-v", path, "-o", os.devnull],
                                    capture_output=True, text=True)
            reports.append(result.stdout + result.stderr)
    # The format XLA logs: "ptxas with version X", then ptxas -v's own lines.
    version = re.search(r"release [\d.]+, V([\d.]+)", reports[0])
    return (f"ptxas with version {version[1]}\n" if version else "") + "\n".join(reports[1:])


def read_kernels(dump: str, text: str) -> dict:
    """Per kernel: ptxas' registers / spills / stack / barriers (from ``text``, its report), the
    launch (XLA's thunk sequence; a Mosaic GPU kernel's PTX and pass log) and the PTX's MMA
    family. A Mosaic GPU kernel's entry is its name + ``_mosaic_gpu_kernel``."""
    kernels = {}
    for name in KERNELS:
        m = re.search(rf"Function properties for {name}(?:{MOSAIC_SUFFIX})?\n\s*(\d+) bytes stack "
                      rf"frame, (\d+) bytes spill stores, (\d+) bytes spill loads\n.*?Used (\d+) "
                      rf"registers(?:, used (\d+) barriers)?", text)
        if m:
            kernels[name] = dict(stack=int(m[1]), spill_stores=int(m[2]), spill_loads=int(m[3]),
                                 registers=int(m[4]))
            if m[5]:
                kernels[name]["barriers"] = int(m[5])
    for path in glob.glob(os.path.join(dump, "*thunk_sequence.txt")):
        for m in re.finditer(r"kCustomKernel.*? (rankattn_\w+) grid: \[([\d, ]+)\] threads: "
                             r"\[(\d+), \d+, \d+\]\s+shared_memory: (\d+) bytes", open(path).read()):
            kernels.setdefault(m[1], {}).update(threads=int(m[3]), shared=int(m[4]))
    for path in glob.glob(os.path.join(dump, "*.ptx")):
        ptx = open(path).read()
        for name in KERNELS:
            if not re.search(rf"\.entry {name}(?:{MOSAIC_SUFFIX})?\(", ptx):
                continue
            family = "wgmma" if "wgmma." in ptx else "mma.sync" if "mma.sync" in ptx else "none"
            kernels.setdefault(name, {})["mma"] = family
            log = path.removesuffix(".ptx") + ".mlir-passes.log"
            threads = re.search(r"\.maxntid (\d+),", ptx)
            if threads and os.path.exists(log):  # a Mosaic GPU kernel's launch
                shared = re.search(r"dynamic_shared_memory_size %c(\d+)_i32", open(log).read())
                kernels[name].update(threads=int(threads[1]), shared=int(shared[1]))
    return kernels


def ptxas_version(text: str) -> str | None:
    m = re.search(r"ptxas with version ([\d.]+)", text)
    return m[1] if m else None


# --- The report. -----------------------------------------------------------------


def occupancy(kernel: dict, limits: dict) -> float | None:
    """Resident warps per SM / the SM's maximum, from registers, shared memory and warps."""
    if not {"registers", "threads", "shared"} <= kernel.keys():
        return None
    warps = kernel["threads"] // 32
    per_warp = -(-kernel["registers"] * 32 // 256) * 256  # allocated per warp, 256 at a time
    blocks = min(limits["registers_per_sm"] // (per_warp * warps),
                 limits["shared_per_sm"] // (kernel["shared"] + RESERVED_SHARED_PER_BLOCK),
                 limits["max_warps"] // warps)
    return blocks * warps / limits["max_warps"]


def run(targets: list[str], axes: list[str] | None, options: dict | None = None,
        mosaic: bool = True) -> dict:
    """Compile ``configs(axes)`` for every target, and ``mosaic_configs(axes)`` for
    MOSAIC_TARGETS with ``mosaic``."""
    packages = compiler_dir()
    results = {}
    for target in targets:
        with_mosaic = mosaic and target in MOSAIC_TARGETS
        cfgs = configs(axes) + (mosaic_configs(axes) if with_mosaic else [])
        print(f"{target}: compiling {len(cfgs)} configurations ...", file=sys.stderr, flush=True)
        results[target] = compile_in_child(target, cfgs, packages, options)
    import jax
    ptxas = next((r["ptxas"] for rows in results.values() for r in rows if r["ptxas"]), None)
    return dict(results=results, jax=jax.__version__, plugin=jax.__version__, ptxas=ptxas,
                date=datetime.datetime.now().strftime("%Y-%m-%d %H:%M"))


def rows(report: dict):
    """(target, config label, kernel name, kernel dict or None, error, occupancy) per kernel."""
    for target, results in report["results"].items():
        limits = target_limits(target)
        for r in results:
            label = Config(**r["config"]).label
            if r["error"]:
                yield target, label, None, None, r["error"], None
                continue
            for name in KERNELS:
                if name not in r["kernels"]:
                    continue
                k = r["kernels"][name]
                yield target, label, name, k, None, occupancy(k, limits)


def markdown(report: dict) -> str:
    lines = [
        "# pallas_triton and mosaic_gpu compiled for real GPUs, without a GPU",
        "",
        "Generated by `benchmarks/gpu_compile.py`; do not edit by hand. Reproduce with",
        "",
        f"    {COMMAND}",
        "",
        f"{report['date']}: jax {report['jax']}, jax-cuda12-plugin {report['plugin']}, "
        f"ptxas {report['ptxas']} (a GPU machine's toolkit may allocate registers differently).",
        "",
        "Each row is one kernel of `jax.value_and_grad` of a loss with an lse term, B=1, S=1031; "
        "configurations vary one axis at a time around bfloat16, D=128, 4/2 heads. \"spill\" is "
        "ptxas' spill stores + loads per thread (bytes); \"smem\" XLA's dynamic shared memory per "
        "block (a Mosaic GPU kernel's own); \"bars\" ptxas' hardware barriers (Mosaic GPU "
        "kernels'); \"occ.\" resident warps per SM over the SM's maximum. **mosaic_gpu** rows' "
        "registers are the launch's: its warpgroups rebalance them (setmaxnreg), 240 for each "
        "compute warpgroup and 24 for the memory warpgroup.",
        "",
    ]
    spilled = [(t, label, name, k) for t, label, name, k, error, _ in rows(report)
               if not error and k.get("spill_stores", 0) + k.get("spill_loads", 0)]
    failed = [(t, label, error) for t, label, _, _, error, _ in rows(report) if error]
    lines += ["## Summary", "",
              f"- {len(failed)} configurations do not compile"
              + "".join(f"\n  - {t}, {label}: {error}" for t, label, error in failed),
              f"- {len(spilled)} kernels spill registers"
              + "".join(f"\n  - {t}, {label}, {name.removeprefix('rankattn_')}: "
                        f"{k['spill_stores'] + k['spill_loads']} bytes per thread"
                        for t, label, name, k in spilled), ""]
    for target in report["results"]:
        limits = target_limits(target)
        lines += [f"## {target} ({TARGETS[target][1]}; {limits['shared_per_block'] // 1024} KB "
                  "shared memory per block)", "",
                  "| config | kernel | regs | spill | stack | smem KB | warps | bars | MMA | occ. |",
                  "|---|---|---:|---:|---:|---:|---:|---:|---|---:|"]
        for t, label, name, k, error, occ in rows(report):
            if t != target:
                continue
            if error:
                lines.append(f"| {label} | **does not compile**: {error} | | | | | | | | |")
                continue
            spill = k.get("spill_stores", 0) + k.get("spill_loads", 0)
            lines.append(
                f"| {label} | {name.removeprefix('rankattn_')} | {k.get('registers', '?')} | "
                f"{'**' + str(spill) + '**' if spill else 0} | {k.get('stack', '?')} | "
                f"{k.get('shared', 0) / 1024:.1f} | {k.get('threads', 0) // 32} | "
                f"{k.get('barriers', '')} | {k.get('mma', '?')} | "
                f"{'' if occ is None else f'{occ:.0%}'} |")
        lines.append("")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--targets", nargs="*", choices=list(TARGETS),
                        help="default: every target; sm_90 with --candidates")
    parser.add_argument("--axes", nargs="*", help="only these axes (default: all)")
    parser.add_argument("--print", action="store_true", help="print the table; write nothing")
    parser.add_argument("--report", action="store_true",
                        help="only rewrite GPU_COMPILE.md from results/gpu_compile.json")
    parser.add_argument("--options", type=json.loads,
                        help='PallasTriton options as JSON, e.g. \'{"num_warps": 4}\'; with --print')
    parser.add_argument("--smoke", action="store_true",
                        help="check the script: sm_90, the default configuration, the report "
                             "into --out (default: a new temporary folder)")
    parser.add_argument("--out", help="write GPU_COMPILE.md and results/gpu_compile.json here, "
                                      "not into benchmarks/")
    parser.add_argument("--candidates", action="store_true",
                        help="compile gpu.py's tune candidates instead (registers, spills, "
                             "compile seconds) -> results/gpu_candidates.json")
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(*args.child)
    if args.candidates:
        [target] = args.targets or ["sm_90"]
        report = compile_candidates(target, compiler_dir())
        path = os.path.join(args.out, "gpu_candidates.json") if args.out else CANDIDATES_JSON
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            json.dump(report, f, indent=1)
        print(f"wrote {path}")
        return
    args.targets = args.targets or list(TARGETS)
    if args.smoke:
        args.targets, args.axes = ["sm_90"], ["default"]
        args.out = args.out or tempfile.mkdtemp(prefix="gpu-compile-smoke-")
    out = args.out or HERE
    if args.report:
        with open(os.path.join(out, "results", "gpu_compile.json")) as f:
            report = json.load(f)
    else:
        # --smoke checks this script; tests/test_gpu_compile.py compiles mosaic_gpu.
        report = run(args.targets, args.axes, args.options, mosaic=not args.smoke)
    text = markdown(report)
    if args.print:
        print(text)
        return
    os.makedirs(os.path.join(out, "results"), exist_ok=True)
    with open(os.path.join(out, "GPU_COMPILE.md"), "w") as f:
        f.write(text)
    with open(os.path.join(out, "results", "gpu_compile.json"), "w") as f:
        json.dump(report, f, indent=1)
    print(text)


if __name__ == "__main__":
    main()
