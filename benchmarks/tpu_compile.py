"""Compile the pallas_tpu kernels for real TPU generations without a TPU -> TPU_COMPILE.md.

For each generation (v5e, v6e, TPU7x) and each configuration of the axes (dtype, head
dim, GQA ratio, causal, soft cap), jit(value_and_grad) of attention with return_lse on
``PallasTpu(target=<generation>)`` is compiled for a deviceless TPU topology by libtpu,
so Mosaic's own compiler runs on the forward, dq and dk / dv kernels and checks them
against the generation's VMEM and SMEM. The report gives, per row, whether it compiled
(else Mosaic's first error line), the kernels' planned VMEM (every input and output block
double-buffered, tiles padded to (8, 128) for 32-bit and (16, 128) for 16-bit types, plus
scratch; the largest of the three kernels) and SMEM (the scalar-prefetch plan lists)
against the chip's capacity (``pltpu.get_tpu_info_for_chip``), and the block sizes.
No TPU runs anything here: speed is not measured.

A second table (issue 37) compiles the same program at production shapes, 20 / 4 heads,
D = 128, bf16, a soft cap, one session per row (history, then 64 candidates): B=16 S=1088
bidirectional and causal, B=4 S=4096 and B=1 S=32896 causal. Per row: the arguments' and
XLA's temp HBM (``memory_analysis()``) and their ratio, the per-row vectors padded to 128
lanes (distinct f32 / s32 / pred shapes ``[..., S, 1]`` in ``compiled.as_text()``), the
kernels' grid steps (all calls of the program) and the steps that compute (the plan's counts
for those segment ids, times the kv heads), and VMEM / SMEM as above.

libtpu (the version jax's ``tpu`` extra pins: 0.0.42.* for jax 0.10.2, about 680 MB
installed) is installed on first use into ``~/.cache/rankattn/libtpu-<jax version>``
with pip's ``--no-deps --target``, never into the project's environment; each
generation compiles in a child process with that folder on its path and
``JAX_PLATFORMS=cpu``.

    python benchmarks/tpu_compile.py            # every generation and configuration (~10 min)
    python benchmarks/tpu_compile.py --quick    # one configuration per generation
    python benchmarks/tpu_compile.py --before 61cac70  # memory table beside that commit's
    python benchmarks/tpu_compile.py --memory --no-write --src DIR  # another tree's src/
    python benchmarks/tpu_compile.py --render   # the report again from results/tpu_compile.json
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib.metadata
import itertools
import json
import os
import re
import subprocess
import sys
import tempfile

import user_cache

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
REPORT = os.path.join(HERE, "TPU_COMPILE.md")
RESULTS = os.path.join(HERE, "results", "tpu_compile.json")

# generation -> (deviceless topology name, pltpu.ChipVersion member)
GENERATIONS = {"v5e": ("v5e:2x2", "TPU_V5E"), "v6e": ("v6e:2x2", "TPU_V6E"),
               "tpu7x": ("tpu7x:2x2x1", "TPU_7X")}
# The production ranker's row: 2 + 1022 history tokens and 64 candidates; 2 rows, 4 kv heads.
BATCH, SEQ, KV_HEADS, HISTORY = 2, 1088, 4, 1024
# The memory table: (B, S, causal) at 20 / 4 heads, D = 128, bf16, cap 30; every row one
# session of S - CANDIDATES history tokens and CANDIDATES candidates.
MEMORY_SHAPES = [(16, 1088, False), (16, 1088, True), (4, 4096, True), (1, 32896, True)]
MEMORY_HEADS, CANDIDATES = (20, 4), 64
# A per-row vector in a compiled program's text: an f32 / s32 / pred array whose last dim is
# 1 after a sequence-sized one (TPU tiles the last two dims (8, 128): 128 times its bytes).
PADDED_ROW = re.compile(r"\b(?:f32|s32|pred)\[(?:[0-9]+,)*[0-9]{3,},1\]")


@dataclasses.dataclass(frozen=True)
class Config:
    dtype: str
    head_dim: int
    group: int
    causal: bool
    softcap: float | None

    def label(self) -> str:
        return (f"{self.dtype} D={self.head_dim} G={self.group} "
                f"{'causal' if self.causal else 'full'} "
                f"{'tanh cap' if self.softcap else 'no cap'}")


def configs(quick: bool = False) -> list[Config]:
    """The Targets of issue 32: dtype x D x GQA x causal x soft cap (one with --quick)."""
    if quick:
        return [Config("bfloat16", 128, 5, True, 30.0)]
    return [Config(*axes) for axes in itertools.product(
        ("float32", "bfloat16"), (64, 128, 256), (1, 5), (False, True), (None, 30.0))]


# --- libtpu, in a user cache folder. -------------------------------------------------


def libtpu_requirement() -> str:
    """The libtpu requirement of the installed jax's ``tpu`` extra, e.g. 'libtpu==0.0.42.*'."""
    for requirement in importlib.metadata.requires("jax") or []:
        name, _, marker = requirement.partition(";")
        if name.strip().startswith("libtpu") and "tpu" in marker:
            return name.strip().replace(" ", "")
    raise RuntimeError("the installed jax names no libtpu in its 'tpu' extra")


def libtpu_folder() -> str:
    """The cache folder's name: libtpu-<jax version>."""
    import jax
    return f"libtpu-{jax.__version__}"


def libtpu_dir(install: bool = True) -> str | None:
    """The folder holding libtpu (user_cache), installed there on first use with ``install``;
    without, None when absent. Raises RuntimeError with pip's last lines when it cannot be
    had."""
    if not install:
        return user_cache.installed(libtpu_folder())
    return user_cache.install_once(libtpu_folder(), [libtpu_requirement()])


def child_env(libtpu: str, src: str | None = None) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [libtpu, src or os.path.join(ROOT, "src")]
        + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    # libtpu holds /tmp/libtpu_lockfile for the life of a process that loads it: without
    # ALLOW_MULTIPLE_LIBTPU_LOAD a second child (a test worker, another user's run) aborts.
    env.update(JAX_PLATFORMS="cpu", TF_CPP_MIN_LOG_LEVEL="3", ALLOW_MULTIPLE_LIBTPU_LOAD="1")
    env.pop("XLA_FLAGS", None)
    return env


def compile_generation(generation: str, cfgs: list[Config] | None, libtpu: str,
                       timeout: int = 1800, src: str | None = None,
                       memory_shapes=MEMORY_SHAPES) -> list[dict]:
    """Rows of one generation, compiled in a child process (libtpu on its path): one per
    configuration, or with ``cfgs`` None the memory table's (``memory_shapes``, (B, S,
    causal) each). ``src``: the folder to import rankattn from (default this checkout's)."""
    what = (json.dumps({"memory": memory_shapes}) if cfgs is None
            else json.dumps([dataclasses.asdict(c) for c in cfgs]))
    expected = len(memory_shapes) if cfgs is None else len(cfgs)
    result = subprocess.run(
        [sys.executable, __file__, "--child", generation, what],
        env=child_env(libtpu, src), capture_output=True, text=True, timeout=timeout)
    lines = [line for line in result.stdout.splitlines() if line.startswith("ROW ")]
    if result.returncode or len(lines) != expected:
        tail = "\n".join(result.stderr.strip().splitlines()[-15:])
        raise RuntimeError(f"the {generation} child failed (exit {result.returncode}):\n{tail}")
    return [json.loads(line[4:]) for line in lines]


# --- One generation, in the child. ----------------------------------------------------


def tile_bytes(shape, dtype) -> int:
    """Bytes of a VMEM buffer of ``shape``: the last dim padded to 128 lanes, the one before
    to 8 sublanes of 32 bits (16 rows for 16-bit types, 32 for 8-bit)."""
    import numpy as np
    itemsize = np.dtype(dtype).itemsize
    dims = list(shape) or [1]
    if len(dims) == 1:
        dims = [1] + dims
    rows = -(-dims[-2] // (8 * 4 // itemsize)) * (8 * 4 // itemsize)
    lanes = -(-dims[-1] // 128) * 128
    return int(np.prod(dims[:-2], dtype=np.int64)) * rows * lanes * itemsize


def kernel_memory(jaxpr) -> list[dict]:
    """Per pallas_call in ``jaxpr`` (any depth): its name, planned VMEM bytes (blocks
    double-buffered, plus scratch), SMEM bytes (the scalar-prefetch operands) and grid
    steps."""
    import numpy as np
    kernels = []

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "pallas_call":
                mapping = eqn.params["grid_mapping"]
                vmem = 0
                for block in mapping.block_mappings:
                    shape = [getattr(d, "block_size", 1) for d in block.block_shape]
                    vmem += 2 * tile_bytes(shape, block.array_aval.dtype)
                vmem += sum(tile_bytes(a.shape, a.dtype) for a in mapping.scratch_avals)
                smem = sum(int(np.prod(v.aval.shape)) * v.aval.dtype.itemsize
                           for v in eqn.invars[:mapping.num_index_operands])
                name = eqn.params["jaxpr"].debug_info.func_src_info.split(" ")[0]
                kernels.append(dict(kernel=name, vmem=vmem, smem=smem,
                                    steps=int(np.prod(mapping.grid, dtype=np.int64))))
            for param in eqn.params.values():
                for sub in (param if isinstance(param, (list, tuple)) else [param]):
                    inner = getattr(sub, "jaxpr", sub)
                    if hasattr(inner, "eqns"):
                        walk(inner)

    walk(jaxpr)
    return kernels


def attention_grad(impl, causal: bool, softcap: float | None, plan=None):
    """value_and_grad over q, k, v of issue 37's program: sum(out as float32) plus 1e-3 times
    the sum of the finite lse, with segment ids as a fourth argument, or with ``plan`` (a
    prepared ``rankattn.plan``, closed over) and no fourth argument."""
    import jax
    import jax.numpy as jnp

    import rankattn

    def loss(q, k, v, seg=None):
        mask = dict(plan=plan) if plan is not None else dict(segment_ids=seg, causal=causal)
        out, lse = rankattn.attention(q, k, v, softcap=softcap, return_lse=True, impl=impl,
                                      **mask)
        return out.astype(jnp.float32).sum() + 1e-3 * jnp.where(jnp.isfinite(lse), lse, 0).sum()

    return jax.value_and_grad(loss, (0, 1, 2))


def grid_steps(jaxpr) -> dict:
    """Grid steps per kernel name, summed over the program's calls of it."""
    steps = {}
    for k in kernel_memory(jaxpr):
        steps[k["kernel"]] = steps.get(k["kernel"], 0) + k["steps"]
    return steps


def compile_row(generation: str, impl, grad, args, info) -> dict:
    """One compiled program's row: Mosaic's verdict, planned VMEM / SMEM and grid steps per
    kernel, and XLA's HBM (arguments, temp) and padded per-row vectors where it compiles."""
    import jax

    jaxpr = jax.make_jaxpr(grad)(*args).jaxpr
    kernels = kernel_memory(jaxpr)
    steps = grid_steps(jaxpr)
    row = dict(generation=generation, vmem=max(k["vmem"] for k in kernels),
               smem=max(k["smem"] for k in kernels), vmem_capacity=info.vmem_capacity_bytes,
               smem_capacity=info.smem_capacity_bytes, kernels=sorted(steps), grid_steps=steps)
    try:
        compiled = jax.jit(grad).trace(*args).lower().compile()
        memory = compiled.memory_analysis()
        row.update(compiles=True, error=None, hbm_temp=memory.temp_size_in_bytes,
                   hbm_args=memory.argument_size_in_bytes,
                   padded_rows=sorted(set(PADDED_ROW.findall(compiled.as_text()))))
    except Exception as error:  # noqa: BLE001 - the report records Mosaic's verdict
        first = next((line for line in str(error).splitlines() if line.strip()), "")
        row.update(compiles=False, error=first[:200], hbm_temp=None)
    return row


def phoenix_rows(batch: int, seq: int):
    """Segment ids [B, S]: one session a row, S - CANDIDATES history tokens, then candidates."""
    import numpy as np
    return np.broadcast_to(np.where(np.arange(seq) < seq - CANDIDATES, 1, -1).astype(np.int32),
                           (batch, seq))


def visits(impl, seg, causal: bool, kv_heads: int) -> dict:
    """For concrete segment ids, per kernel, times the kv heads: ``visited_steps``, the
    compute block pairs the plan visits (forward and dq over key blocks, dk / dv over query
    blocks), ``dma_visits``, the DMA blocks holding them (what the pipeline fetches), and
    ``dma_blocks``, the DMA blocks' tokens (queries for dk / dv, keys for the others)."""
    import numpy as np

    from rankattn.backends import pallas_tpu
    from rankattn.blocks import segments_and_plan

    batch, seq = seg.shape
    sizes = impl.sizes(seq)
    _, _, plan = segments_and_plan(seg, batch, seq, seq, sizes, causal)
    n_q, n_k = plan.kv_index.shape[1:]
    q_sub = pallas_tpu.sub_blocks(impl.dma(), sizes.block_q, n_q)
    k_sub = pallas_tpu.sub_blocks(impl.dma(), sizes.block_k, n_k)
    per_query, per_key = (int(np.asarray(c).sum()) * kv_heads for c in (plan.count, plan.q_count))
    dma_query, dma_key = (
        int(np.asarray(pallas_tpu.dma_lists(index, full, count, sub)[2]).sum()) * kv_heads
        for index, full, count, sub in ((plan.kv_index, plan.full_count, plan.count, k_sub),
                                        (plan.q_index, plan.q_full_count, plan.q_count, q_sub)))

    def per_kernel(query_side, key_side):
        return dict(rankattn_tpu_forward=query_side, rankattn_tpu_dq=query_side,
                    rankattn_tpu_dkv=key_side)

    return dict(visited_steps=per_kernel(per_query, per_key),
                dma_visits=per_kernel(dma_query, dma_key),
                dma_blocks=per_kernel(k_sub * sizes.block_k, q_sub * sizes.block_q))


def splash_row(batch: int, seq: int, causal: bool, sizes, dma: dict, sharding) -> dict:
    """JAX's splash attention compiled beside it (issue 37, item 6): jit(value_and_grad) of
    sum(out) over q, k, v (its lse has no backward), 20 / 4 heads (GQA native), D=128, bf16,
    cap 30, the closest static mask (causal, or full for the bidirectional rows: splash has
    no dynamic candidate isolation), vmapped over the batch, at S rounded up to its blocks
    (it takes no ragged length) with our compute blocks, and as its DMA blocks (block_kv,
    block_q_dkv) the largest multiple of them up to ours that divides its S. Its temp and
    argument HBM and grid steps."""
    import jax
    import jax.numpy as jnp
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm

    hq, hkv = MEMORY_HEADS
    bq, bk = sizes.block_q, sizes.block_k
    length = -(-seq // max(bq, bk)) * max(bq, bk)

    def dma_block(block, ours):
        return max(m for m in range(block, ours + 1, block) if length % m == 0)

    block_kv = dma_block(bk, dma["rankattn_tpu_forward"])
    one = sm.CausalMask((length, length)) if causal else sm.FullMask((length, length))
    kernel = sk.make_splash_mha(
        sm.MultiHeadMask([one] * hq), head_shards=1, q_seq_shards=1, attn_logits_soft_cap=30.0,
        block_sizes=sk.BlockSizes(block_q=bq, block_kv=block_kv, block_kv_compute=bk,
                                  block_q_dkv=dma_block(bq, dma["rankattn_tpu_dkv"]),
                                  block_kv_dkv=bk, block_kv_dkv_compute=bk,
                                  block_q_dq=bq, block_kv_dq=block_kv))

    def loss(q, k, v):
        return jax.vmap(kernel)(q, k, v).astype(jnp.float32).sum()

    args = [jax.ShapeDtypeStruct((batch, h, length, 128), jnp.bfloat16, sharding=sharding)
            for h in (hq, hkv, hkv)]
    grad = jax.value_and_grad(loss, (0, 1, 2))
    steps = grid_steps(jax.make_jaxpr(grad)(*args).jaxpr)
    try:
        memory = jax.jit(grad).trace(*args).lower().compile().memory_analysis()
        return dict(seq=length, compiles=True, hbm_temp=memory.temp_size_in_bytes,
                    hbm_args=memory.argument_size_in_bytes, grid_steps=steps)
    except Exception as error:  # noqa: BLE001 - the report records the verdict
        first = next((line for line in str(error).splitlines() if line.strip()), "")
        return dict(seq=length, compiles=False, error=first[:200], grid_steps=steps)


def child(generation: str, what: str) -> None:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.experimental import topologies
    from jax.experimental.pallas import tpu as pltpu
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    import rankattn
    from rankattn.backends import PallasTpu

    topology, chip = GENERATIONS[generation]
    topo = topologies.get_topology_desc(topology_name=topology, platform="tpu",
                                        chip_config_name="default",
                                        chips_per_host_bounds=(2, 2, 1), num_slices=1,
                                        wrap=(False, False, False))
    info = pltpu.get_tpu_info_for_chip(getattr(pltpu.ChipVersion, chip), 1)
    one_chip = NamedSharding(Mesh(np.array(topo.devices[:1]), ("x",)), PartitionSpec())
    impl = PallasTpu(target=generation)

    def arguments(batch, seq, hq, hkv, d, dtype):
        shapes = [(batch, seq, hq, d), (batch, seq, hkv, d), (batch, seq, hkv, d)]
        return [jax.ShapeDtypeStruct(s, dtype, sharding=one_chip) for s in shapes] + [
            jax.ShapeDtypeStruct((batch, seq), jnp.int32, sharding=one_chip)]

    what = json.loads(what)
    if isinstance(what, dict):
        hq, hkv = MEMORY_HEADS
        for batch, seq, causal in what["memory"]:
            args = arguments(batch, seq, hq, hkv, 128, jnp.bfloat16)
            row = compile_row(generation, impl, attention_grad(impl, causal, 30.0), args, info)
            seg = phoenix_rows(batch, seq)
            plan = rankattn.plan(segment_ids=jnp.asarray(seg), causal=causal, impl=impl)
            prepared = grid_steps(jax.make_jaxpr(attention_grad(impl, causal, 30.0, plan))(
                *args[:3]).jaxpr)
            row.update(batch=batch, seq=seq, causal=causal,
                       blocks=list(dataclasses.astuple(impl.sizes(seq))),
                       prepared_grid_steps=prepared)
            if hasattr(impl, "dma"):  # not in a --before revision's src
                row.update(visits(impl, seg, causal, hkv))
                row.update(splash=splash_row(batch, seq, causal, impl.sizes(seq),
                                             row["dma_blocks"], one_chip))
            print("ROW " + json.dumps(row), flush=True)
        return
    for cfg in (Config(**c) for c in what):
        hq = KV_HEADS * cfg.group
        args = arguments(BATCH, SEQ, hq, KV_HEADS, cfg.head_dim, jnp.dtype(cfg.dtype))
        row = compile_row(generation, impl, attention_grad(impl, cfg.causal, cfg.softcap),
                          args, info)
        row.update(config=dataclasses.asdict(cfg),
                   blocks=list(dataclasses.astuple(impl.sizes(SEQ))))
        print("ROW " + json.dumps(row), flush=True)


# --- The report. ----------------------------------------------------------------------


def run(generations: list[str], quick: bool, memory_only: bool = False,
        src: str | None = None, before: str | None = None) -> dict:
    """The report: the configurations' rows (none with ``memory_only``) and the memory
    table's, per generation, importing rankattn from ``src`` (default this checkout's); with
    ``before`` (a git revision) also the memory table of that revision's src."""
    import jax
    libtpu = libtpu_dir()
    rows = [] if memory_only else [
        row for g in generations for row in compile_generation(g, configs(quick), libtpu, src=src)]
    memory = [row for g in generations for row in compile_generation(g, None, libtpu, src=src)]
    report = dict(jax=jax.__version__, libtpu=libtpu_requirement(),
                  date=datetime.date.today().isoformat(), batch=BATCH, seq=SEQ,
                  kv_heads=KV_HEADS, rows=rows, memory=memory)
    if before:
        with tempfile.TemporaryDirectory() as tree:
            archive = subprocess.run(["git", "-C", ROOT, "archive", before, "src"],
                                     capture_output=True, check=True).stdout
            subprocess.run(["tar", "-x", "-C", tree], input=archive, check=True)
            report["before"] = dict(revision=before, memory=[
                row for g in generations
                for row in compile_generation(g, None, libtpu, src=os.path.join(tree, "src"))])
    return report


def mib(x: int) -> str:
    return f"{x / 2**20:.2f} MiB"


KERNEL_ORDER = ("rankattn_tpu_forward", "rankattn_tpu_dq", "rankattn_tpu_dkv")


def memory_markdown(rows: list[dict], before: dict | None = None) -> list[str]:
    """The memory table (issue 37): HBM, padded per-row vectors and grid steps per shape;
    with ``before`` (run's) that revision's temp / args and padded row vectors beside."""
    then = {(r["generation"], r["batch"], r["seq"], r["causal"]): r
            for r in (before or {}).get("memory", [])}
    hq, hkv = MEMORY_HEADS
    lines = [
        "## HBM and grid steps at production shapes",
        "",
        f"jit(value_and_grad) of sum(out) + 1e-3 sum(lse) over q, k, v; {hq} / {hkv} heads, "
        f"D=128, bf16, cap 30, segment ids (one session a row: S - {CANDIDATES} history "
        f"tokens, then {CANDIDATES} candidates). HBM from `compiled.memory_analysis()`; "
        "padded row vectors: distinct f32 / s32 / pred shapes `[..., S, 1]` in "
        "`compiled.as_text()` (TPU tiles them (8, 128): 128 times their bytes). Grid steps: "
        "every step of the program's forward / dq / dk-dv calls, each step fetching one "
        "DMA block (keys for the forward and dq, queries for dk / dv: the DMA column, key / "
        "query tokens) and computing the compute blocks (q x k) in it that its plan visits, "
        "with the segment ids traced (the worst case, every pair of an own block and a DMA "
        "block: the steps past a row's visits issue no DMA but pay the pipeline's per-step "
        "overhead) and with the same segment ids' plan prepared by `rankattn.plan` and "
        "closed over (a step per visited DMA block, plus one per own block that visits "
        "nothing, for the longest batch row); computing: the compute block pairs the plan "
        "visits for those segment ids, all rows. Splash: JAX's splash attention compiled "
        "alike (sum(out) only: its lse has no backward) with the closest static mask (causal, "
        "or full for the bidirectional rows), at S rounded up to the blocks, our compute "
        "blocks, and as DMA blocks (its block_kv, block_q_dkv) the largest multiple of them "
        "up to ours that divides its S; its grid has a step per query head, ours per kv head "
        "(G = 5 heads a step).",
        "",
        "| generation | B | S | mask | blocks (q x k), DMA | compiles | args | HBM temp "
        "| temp / args "
        "| padded row vectors | grid steps fwd / dq / dkv, traced | prepared plan "
        "| computing fwd / dq / dkv | VMEM | SMEM | splash: S, temp / args, grid steps "
        "fwd / dq / dkv |"
        + (f" before ({before['revision']}): temp / args, padded |" if before else ""),
        "| --- " * (16 + bool(before)) + "|",
    ]
    for r in rows:
        steps = " / ".join(f"{r['grid_steps'][k]:,}" for k in KERNEL_ORDER)
        prepared = " / ".join(f"{r['prepared_grid_steps'][k]:,}" for k in KERNEL_ORDER)
        visited = " / ".join(f"{r['visited_steps'][k]:,}" for k in KERNEL_ORDER)
        if r["compiles"]:
            hbm = (f"yes | {mib(r['hbm_args'])} | {mib(r['hbm_temp'])} | "
                   f"{r['hbm_temp'] / r['hbm_args']:.2f} | {len(r['padded_rows'])}")
        else:
            hbm = f"no: {r['error']} | | | |"
        lines.append(
            f"| {r['generation']} | {r['batch']} | {r['seq']} | "
            f"{'causal' if r['causal'] else 'full'} | {r['blocks'][0]} x {r['blocks'][1]}, "
            f"{r['dma_blocks']['rankattn_tpu_forward']} / {r['dma_blocks']['rankattn_tpu_dkv']} | "
            f"{hbm} | {steps} | {prepared} | {visited} | {mib(r['vmem'])} | "
            f"{r['smem'] / 1024:.1f} KiB | {splash_cell(r.get('splash'))} |"
            + (f" {before_cell(then.get((r['generation'], r['batch'], r['seq'], r['causal'])))} |"
               if before else ""))
    return lines + [""]


def splash_cell(splash: dict | None) -> str:
    """Splash attention's figures beside a memory-table row (splash_row)."""
    if splash is None:
        return "-"
    if not splash["compiles"]:
        return f"S={splash['seq']}: did not compile ({splash['error']})"
    steps = " / ".join(f"{splash['grid_steps'][k]:,}" for k in SPLASH_KERNELS)
    return f"S={splash['seq']}, {splash['hbm_temp'] / splash['hbm_args']:.2f}, {steps}"


# Splash attention's kernels, in KERNEL_ORDER's order (forward, dq, dk / dv).
SPLASH_KERNELS = ("splash_mha_fwd_residuals", "splash_mha_dq_no_residuals",
                  "splash_mha_dkv_no_residuals")


def before_cell(row: dict | None) -> str:
    """An earlier revision's temp / args ratio and padded row vectors (memory table)."""
    if row is None or not row["compiles"]:
        return "did not compile" if row else "-"
    return f"{row['hbm_temp'] / row['hbm_args']:.2f}, {len(row['padded_rows'])}"


# --- Estimated time per kernel (no TPU has run them). ----------------------------------

# The cost model's constants. MXU peak and HBM bandwidth per TensorCore are JAX's own table
# (pltpu.get_tpu_info_for_chip: bf16_ops_per_second, mem_bw_bytes_per_second); the fixed
# cost of a grid step is an assumption (TPU_NOTES: "a few tenths of a microsecond"), not a
# measurement.
STEP_SECONDS = 0.35e-6
# Matmuls per visited block pair: forward q k^T and p v; dq adds dO v^T and ds k; dk / dv
# k q^T, p^T dO, v dO^T and ds^T q.
MATMULS = {"rankattn_tpu_forward": 2, "rankattn_tpu_dq": 3, "rankattn_tpu_dkv": 4}


def kernel_bytes(kernel: str, row: dict, group: int, d: int = 128) -> int:
    """HBM bytes one kernel moves (bf16 blocks, f32 / s32 rows): each visited DMA block
    the visited side's blocks and rows, each own block (per batch row and kv head) its own
    side's once. A block repeated on consecutive steps is not fetched again (the
    pipeline's rule)."""
    bq, bk = row["blocks"]
    visits, dma = row["dma_visits"][kernel], row["dma_blocks"][kernel]
    own_q = row["batch"] * MEMORY_HEADS[1] * -(-row["seq"] // bq)
    own_k = row["batch"] * MEMORY_HEADS[1] * -(-row["seq"] // bk)
    if kernel == "rankattn_tpu_forward":  # visits: k, v, poison and segment rows
        return (visits * (2 * 2 * dma * d + 8 * dma)
                + own_q * (2 * 2 * group * bq * d + 4 * group * bq + 2 * 2 * bq * d + 8 * bq))
    if kernel == "rankattn_tpu_dq":       # visits: k, v, segment row
        return (visits * (2 * 2 * dma * d + 4 * dma)
                + own_q * (3 * 2 * group * bq * d + 8 * group * bq + 2 * 2 * bq * d + 4 * bq))
    # dk / dv, visits: q, dO, lse, delta, segment row; own: k, v, dk, dv and the own-key
    # term's queries and dO at the key block's positions
    return (visits * (2 * 2 * group * dma * d + 8 * group * dma + 4 * dma)
            + own_k * (4 * 2 * bk * d + 2 * 2 * group * bk * d + 8 * group * bk))


def estimates(row: dict) -> dict:
    """Per kernel: MXU and HBM seconds and the step overhead of the traced and the prepared
    grid; the estimate of each grid is max(MXU, HBM) + steps x STEP_SECONDS (the DMAs
    overlap the compute; a step's fixed cost does not)."""
    from jax.experimental.pallas import tpu as pltpu
    chip = getattr(pltpu.ChipVersion, GENERATIONS[row["generation"]][1])
    info = pltpu.get_tpu_info_for_chip(chip, 1)
    hq, hkv = MEMORY_HEADS
    group, (bq, bk) = hq // hkv, row["blocks"]
    out = {}
    for kernel in KERNEL_ORDER:
        visits = row["visited_steps"][kernel]  # visited block pairs, all rows and kv heads
        mxu = visits * MATMULS[kernel] * 2 * group * bq * bk * 128 / info.bf16_ops_per_second
        hbm = kernel_bytes(kernel, row, group) / info.mem_bw_bytes_per_second
        out[kernel] = {grid: max(mxu, hbm) + row[steps][kernel] * STEP_SECONDS
                       for grid, steps in (("traced", "grid_steps"),
                                           ("prepared", "prepared_grid_steps"))}
        out[kernel].update(mxu=mxu, hbm=hbm)
    return out


def estimate_markdown(rows: list[dict]) -> list[str]:
    """The estimates' table (issue 37, item 6): per production shape, MXU and HBM time and
    the estimate of each grid, per kernel (forward / dq / dk-dv)."""
    hq, hkv = MEMORY_HEADS
    lines = [
        "## Estimated time per kernel: a model, not a measurement",
        "",
        "**Estimates only: no TPU has run these kernels.** The shapes of the table above. Per "
        "kernel: MXU time = visited block pairs x its matmuls (forward 2, dq 3, dk / dv 4) x "
        "2 G bq bk D flops at the chip's bf16 peak; HBM time = the bytes its blocks move (each "
        "visited DMA block the visited side's blocks and rows, each own block its own side's "
        "once) at the "
        "chip's HBM bandwidth, both per TensorCore from JAX's `pltpu.get_tpu_info_for_chip`; "
        f"an estimate = max(MXU, HBM) + grid steps x {STEP_SECONDS * 1e6:.2f} us, the fixed "
        "cost of a pipeline step (an assumption: TPU_NOTES puts it at a few tenths of a "
        "microsecond; unmeasured). Traced: segment ids traced under jit (every block pair "
        "a step); prepared: the plan prepared by `rankattn.plan` and closed over. Milliseconds, "
        "forward / dq / dk-dv.",
        "",
        "| generation | B | S | mask | MXU | HBM | estimate, traced grid "
        "| estimate, prepared plan | prepared / traced, all three "
        "| splash's grid steps x the step cost, all three |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        e = estimates(r)

        def ms(field):
            return " / ".join(f"{e[k][field] * 1e3:.2f}" for k in KERNEL_ORDER)

        ratio = (sum(e[k]["prepared"] for k in KERNEL_ORDER)
                 / sum(e[k]["traced"] for k in KERNEL_ORDER))
        splash = r.get("splash")
        overhead = ("-" if splash is None else
                    f"{sum(splash['grid_steps'].values()) * STEP_SECONDS * 1e3:.2f}")
        lines.append(f"| {r['generation']} | {r['batch']} | {r['seq']} | "
                     f"{'causal' if r['causal'] else 'full'} | {ms('mxu')} | {ms('hbm')} | "
                     f"{ms('traced')} | {ms('prepared')} | {ratio:.2f} | {overhead} |")
    return lines + [""]


def markdown(report: dict) -> str:
    rows = report["rows"]
    ok = sum(r["compiles"] for r in rows)
    lines = [
        "# pallas_tpu: deviceless compiles for TPU generations",
        "",
        f"Generated by `python benchmarks/tpu_compile.py` on {report['date']} (jax "
        f"{report['jax']}, {report['libtpu']} in a user cache folder, no TPU). Each row compiles "
        f"jit(value_and_grad) of `rankattn.attention(..., return_lse=True, "
        f"impl=PallasTpu(target=...))` for one chip of the generation's deviceless topology: "
        f"B={report['batch']}, S={report['seq']}, {report['kv_heads']} kv heads x G query "
        "heads each, segment ids; the forward, dq and dk / dv kernels all go through Mosaic's "
        "compiler, which checks VMEM and SMEM against the generation.",
        "",
        f"**{ok} of {len(rows)} compile.** VMEM is the kernels' plan (every block double-"
        "buffered, tiles padded to (8, 128) / (16, 128), plus scratch; the largest of the three "
        "kernels) against the chip's VMEM; SMEM is the scalar-prefetch plan lists of one call. "
        "HBM temp is XLA's `memory_analysis()` of the whole program. The scoped VMEM limit is "
        "the backend table's: 32 MiB on v5e (its 16 MiB default fails float32 D=256 GQA 5 with "
        "512-token DMA blocks), Mosaic's default on v6e and TPU7x. "
        "No TPU has run these kernels: nothing here measures speed.",
        "",
        "| generation | dtype | D | G | mask | cap | blocks (q x k) | compiles "
        "| VMEM (of capacity) | SMEM (of capacity) | HBM temp |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        c = r["config"]
        verdict = "yes" if r["compiles"] else f"no: {r['error']}"
        temp = "" if r["hbm_temp"] is None else mib(r["hbm_temp"])
        lines.append(
            f"| {r['generation']} | {c['dtype']} | {c['head_dim']} | {c['group']} | "
            f"{'causal' if c['causal'] else 'full'} | {c['softcap'] or '-'} | "
            f"{r['blocks'][0]} x {r['blocks'][1]} | {verdict} | {mib(r['vmem'])} "
            f"({100 * r['vmem'] / r['vmem_capacity']:.1f}%) | {r['smem'] / 1024:.1f} KiB "
            f"({100 * r['smem'] / r['smem_capacity']:.1f}%) | {temp} |")
    lines += ["", "Head dims run unpadded (a block spans the whole head dim; Mosaic pads lanes in "
              "VMEM only, which the VMEM column counts). float16 is declined by the backend: "
              "Mosaic fails to compile its kernels on every generation here (`Invalid vector "
              "type for load`).", ""]
    return "\n".join(lines + memory_markdown(report["memory"], report.get("before"))
                     + estimate_markdown([r for r in report["memory"] if r["compiles"]]))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--generations", nargs="+", default=list(GENERATIONS),
                        choices=list(GENERATIONS))
    parser.add_argument("--quick", action="store_true", help="one configuration per generation")
    parser.add_argument("--memory", action="store_true",
                        help="only the memory table (with --no-write: a before / after check)")
    parser.add_argument("--src", help="import rankattn from this folder (another tree's src/, "
                                      "e.g. `git archive REF src | tar -x -C DIR`); --no-write")
    parser.add_argument("--before", metavar="REVISION",
                        help="also compile the memory table of this git revision's src, "
                             "shown beside (before / after)")
    parser.add_argument("--child", nargs=2, metavar=("GENERATION", "CONFIGS_JSON"),
                        help=argparse.SUPPRESS)
    parser.add_argument("--render", action="store_true",
                        help=f"rewrite the report from {os.path.relpath(RESULTS, ROOT)} "
                             "without compiling (after a change to the report's text)")
    parser.add_argument("--no-write", action="store_true",
                        help="print the report instead of writing TPU_COMPILE.md and the JSON")
    args = parser.parse_args()
    if args.child:
        return child(*args.child)
    if (args.memory or args.src) and not args.no_write:
        parser.error("--memory and --src make a partial report: pass --no-write")
    if args.render:
        with open(RESULTS) as f:
            report = json.load(f)
    else:
        report = run(args.generations, args.quick, args.memory, args.src, args.before)
    text = markdown(report) if not args.memory else "\n".join(
        memory_markdown(report["memory"], report.get("before")))
    if args.no_write:
        print(text)
        return
    os.makedirs(os.path.dirname(RESULTS), exist_ok=True)
    with open(RESULTS, "w") as f:
        json.dump(report, f, indent=1)
    with open(REPORT, "w") as f:
        f.write(text)
    print(f"wrote {REPORT}: {sum(r['compiles'] for r in report['rows'])} of "
          f"{len(report['rows'])} compile")


if __name__ == "__main__":
    sys.exit(main())
