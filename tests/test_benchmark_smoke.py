"""Every benchmark script runs: its --smoke mode, end to end, on every CI run (issue 28).

A smoke mode is the script's normal path at its smallest shapes and one round: every kind
of workload, every peer that is installed (torch's are skipped, saying so, where torch is
missing), and the report, written into a temporary folder instead of the committed ones
(benchmarks/*.md, benchmarks/results/, examples/ranker/results/). The revision comparisons
run against HEAD.

The scripts are compile-bound, so to keep CI short they run in two processes side by side
(``python tests/test_benchmark_smoke.py NAME...`` runs the named smokes one after another in
one process, which pays JAX's start-up once), and share a persistent compilation cache: a
program one script compiled (bench.py's tiny workloads, which compare_revision.py and gpu.py
time too) is loaded by the next.
"""

from __future__ import annotations

import glob
import importlib.util
import json
import os
import re
import runpy
import subprocess
import sys
import time
import traceback

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import gpu_compile  # noqa: E402  (imports nothing heavy: jax only when it compiles)

TORCH = importlib.util.find_spec("torch") is not None  # the scripts' optional peer
# bench.py rewrites the README between these lines
README_BEGIN, README_END = "<!-- bench.py results: begin -->", "<!-- bench.py results: end -->"

# name: the command after the interpreter ({out}: this run's temporary folder).
SMOKES = {
    "bench.py": ["benchmarks/bench.py", "--smoke", "--out", "{out}/bench"],
    "bench.py --sweep": ["benchmarks/bench.py", "--smoke", "--sweep", "--out", "{out}/bench"],
    "compare_revision.py": ["benchmarks/compare_revision.py", "HEAD", "--smoke"],
    "precision.py": ["benchmarks/precision.py", "--smoke", "--out", "{out}/precision"],
    "gpu.py": ["benchmarks/gpu.py", "--smoke", "--tune", "--repeats", "1", "--out", "{out}/gpu"],
    "gpu.py --dry-run": ["benchmarks/gpu.py", "--dry-run", "--md", "{out}/gpu-plan/GPU.md"],
    "bench_distributed.py": ["benchmarks/bench_distributed.py", "--smoke", "--out",
                             "{out}/distributed"],
    "bench_serving.py": ["benchmarks/bench_serving.py", "--smoke", "--out", "{out}/serving"],
    "compare_serving_revision.py": ["benchmarks/compare_serving_revision.py", "HEAD", "--smoke"],
    "ranker bench": ["-m", "examples.ranker", "bench", "--smoke", "--out", "{out}/ranker"],
    "bench_store.py": ["benchmarks/bench_store.py", "--smoke", "--out", "{out}/store"],
    "call_costs.py": ["benchmarks/call_costs.py", "--smoke", "--out", "{out}/call_costs"],
    "profile_cpu.py": ["benchmarks/profile_cpu.py", "history=128 fwd", "--calls", "2",
                       "--pause-ms", "1", "--plan-outside"],
}
# One process each, side by side; bench_distributed.py needs 8 (fake CPU) devices, which JAX
# fixes when it starts, so its process has them. The ranker's flax / orbax imports go last.
GROUPS = {
    "one device": ["bench.py", "bench.py --sweep", "compare_revision.py", "precision.py",
                   "gpu.py", "gpu.py --dry-run", "compare_serving_revision.py", "call_costs.py"],
    "eight devices": ["bench_distributed.py", "bench_serving.py", "profile_cpu.py", "ranker bench",
                      "bench_store.py"],
}
EIGHT_DEVICES = "--xla_force_host_platform_device_count=8"
BEGIN, END = "@@ smoke {} @@", "@@ smoke {} exit {} ({:.1f} s, {:.1f} s CPU) @@"


def run_smokes(names: list[str], out: str) -> None:
    """Run the named smokes one after another in this process, each as its own __main__,
    between BEGIN and END lines; END carries its exit status."""
    os.chdir(ROOT)
    sys.path.insert(0, ROOT)  # for python -m examples.ranker
    for name in names:
        argv = [a.format(out=out) for a in SMOKES[name]]
        print(BEGIN.format(name), flush=True)
        start, cpu = time.perf_counter(), sum(os.times()[:4])
        try:
            if argv[0] == "-m":
                sys.argv = argv[1:]
                runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
            else:
                sys.argv = argv
                runpy.run_path(argv[0], run_name="__main__")
            status = 0
        except SystemExit as e:
            status = e.code if isinstance(e.code, int) else int(e.code is not None)
        except BaseException:  # noqa: BLE001 - reported, and the next smoke still runs
            traceback.print_exc()
            status = 1
        sys.stdout.flush()
        sys.stderr.flush()
        print(END.format(name, status, time.perf_counter() - start,
                         sum(os.times()[:4]) - cpu), flush=True)


def smoke_env(cache: str, group: str) -> dict:
    env = dict(os.environ, JAX_COMPILATION_CACHE_DIR=cache,
               JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
               JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
    if group == "eight devices":
        env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} {EIGHT_DEVICES}".strip()
    return env


def outputs(log: str) -> dict[str, tuple[int | None, str]]:
    """{name: (exit status, None if it never finished; what it printed)} from a group's log."""
    found = {}
    for name in SMOKES:
        begin = log.find(BEGIN.format(name))
        if begin < 0:
            continue
        end = re.compile(re.escape(f"@@ smoke {name} exit ") + r"(-?\d+) ").search(log, begin)
        found[name] = (int(end.group(1)) if end else None,
                       log[begin:end.start() if end else len(log)])
    return found


# --- What each smoke must have written. --------------------------------------------------


def read(path: str) -> str:
    with open(path) as f:
        return f.read()


def table_rows(text: str, first_cell: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith(f"| {first_cell} |")]


def check_bench(out: str, printed: str):
    bench = os.path.join(out, "bench")
    results = read(os.path.join(bench, "RESULTS.md"))
    for section in ("## Every machine", "### Targets", "### Every workload",
                    "### The shape sweep"):
        assert section in results, section
    for workload in ("nano-fwd-bf16", "packed-fwdbwd"):
        impls = {row.split("|")[2].strip() for row in table_rows(results, workload)}
        assert {"rankattn", "dense reference", "jax.nn.dpa (xla, dense mask)",
                *(["torch sdpa (dense mask)"] if TORCH else [])} <= impls, impls
    assert {"rankattn, float32 inputs"} <= {row.split("|")[2].strip()
                                            for row in table_rows(results, "nano-fwd-bf16")}
    assert re.search(r"long-history-fwdbwd: peak resident memory \(VmHWM\) of a process running "
                     r"only rankattn, inputs included: [\d.]+ GiB in this run", results), "RSS note"
    readme = read(os.path.join(bench, "README.md"))
    assert re.search(r"\| packed-fwdbwd \| [\d.]+ \| ", readme), "README results block"
    assert "torch" in printed  # its version, or that it is not installed


def check_sweep(out: str, printed: str):
    bench = os.path.join(out, "bench")
    sweep = read(os.path.join(bench, "SWEEP.md"))
    cells = [line for line in sweep.splitlines() if re.match(r"\| [a-z/ ]+ \| .* \| fwd(bwd)? \|",
                                                             line)]
    assert len(cells) == 14, cells  # every dimension, both directions
    for image in ("sweep.png", "time_vs_history.png"):
        assert os.path.getsize(os.path.join(bench, image)) > 0


def check_compare_revision(out: str, printed: str):
    for workload in ("nano-fwd-bf16", "packed-fwdbwd"):
        assert re.search(rf"^{workload}: HEAD [\d.]+ ms, working tree [\d.]+ ms"
                         + (r".*; torch sdpa [\d.]+ ms" if TORCH else ""), printed, re.M)


def check_precision(out: str, printed: str):
    text = read(os.path.join(out, "precision", "PRECISION.md"))
    rows = [line for line in text.splitlines() if re.match(r"\| 1 \| ", line)]
    # 3 precision modes, xla, the cpu kernel (where it builds) and the float32 logits'
    # yardstick, at the first logit scale
    backends = [row.split("|")[2].strip() for row in rows]
    assert backends == ['pallas_triton precision="highest"', 'pallas_triton precision="high"',
                        'pallas_triton precision="default"', "xla, float32",
                        *([] if "cpu kernel left out" in printed else ["cpu, float32"]),
                        "float32 Q K^T (one einsum), the rest float64"], backends


def check_gpu(out: str, printed: str):
    text = read(os.path.join(out, "gpu", "GPU.md"))
    verdicts = [line.rsplit("|", 2)[-2].strip() for line in text.splitlines()
                if line.startswith("| B=")]
    assert len(verdicts) == 4 and set(verdicts) == {"pass"}, verdicts
    for workload in ("nano-fwd", "packed-fwdbwd"):
        impls = {row.split("|")[2].strip() for row in table_rows(text, workload)}
        assert {"pallas_triton", "xla", "jax.nn.dpa (xla, dense mask)",
                *(["torch sdpa (dense mask)"] if TORCH else [])} <= impls, impls
    assert "## Targets" in text
    # The tune phase: the default and both candidates checked and timed, one JSONL line each
    # as they came; the winner entered (whatever its gain, in a smoke run) into the table
    # under --out, which pallas_triton then reads, with the built-in default beside it.
    lines = [json.loads(line) for line in open(os.path.join(out, "gpu", "tune.jsonl"))]
    assert [(r["default"], r["status"]) for r in lines] == [(True, "ok"), (False, "ok"),
                                                            (False, "ok")], lines
    assert all(r["max_error"] <= 2e-2 and r["ratio"] > 0 for r in lines[1:])
    from rankattn.backends import gpu_config
    with open(os.path.join(out, "gpu", "gpu_tuned.json")) as f:
        [entry] = gpu_config.parse_table(json.load(f))
    assert entry.dtype == "bfloat16" and entry.head_dim == (65, 128)
    assert "## (t) Tune phase" in text and "not measured in --smoke" in text
    impls = {row.split("|")[2].strip() for row in table_rows(text, "nano-fwd")}
    assert "pallas_triton (built-in default)" in impls, impls
    # Every phase ran, each listed with its estimate and measured time; the JSON has it all.
    phases = json.loads(read(os.path.join(out, "gpu", "gpu.json")))["phases"]
    assert [p["name"] for p in phases] == [
        "start-up", "(a) correctness", "(t) tune bfloat16 D=128 4/2", "bf16 matmul rate",
        "(b) nano-fwd", "(b) packed-fwdbwd", "(r) ptxas registers"], phases
    assert all(p["status"] == "done" and p["measured_s"] >= 0 for p in phases), phases


def check_gpu_plan(out: str, printed: str):
    """The dry run's plan as the pending GPU.md: every tune class (its sum and budget are
    tests/test_gpu_tune.py's)."""
    text = read(os.path.join(out, "gpu-plan", "GPU.md"))
    assert text.count("| (t) tune ") == len(gpu_compile.TUNE_CLASSES) and "| **total** |" in text
    assert "every phase fits" in text


def check_distributed(out: str, printed: str):
    text = read(os.path.join(out, "distributed", "DISTRIBUTED.md"))
    for section in range(1, 6):
        assert f"## {section}. " in text, section
    assert table_rows(text, "ring") and table_rows(text, "dual-chunk")


def check_serving(out: str, printed: str):
    text = read(os.path.join(out, "serving", "SERVING.md"))
    for section in ("## Targets", "## 1. ", "## 1b. ", "## 2. ", "## 3. ", "## 4. ", "## 5. ",
                    "## 6. ", "## 7. ", "## Where the time goes"):
        assert section in text, section
    assert ("| 1 x 40 x 8 |" if TORCH else "torch is not installed") in text
    if TORCH:  # section 1b's record of this machine, under --out, shown beside the others
        from rankattn import peers
        machine = peers.machine_description()
        record = json.loads(read(os.path.join(out, "serving", "results",
                                              peers.machine_slug(machine), "serving.json")))
        assert record["machine"] == machine and len(record["cells"][0]["ratio"]) == 2
        assert f"| shape | {machine}, {record['date']} |" in text
        assert re.search(r"^\| 1 x 40 x 8, 4/2, float32 \| [\d.]+x [\d.]+x / [\d.]+x [\d.]+x \|$",
                         text, re.M), text


def check_compare_serving(out: str, printed: str):
    assert len(re.findall(r"^2 x 40 x \d+, \d/2 heads, D=\d+: HEAD [\d.]+ ms; now", printed,
                          re.M)) == 2, printed


def check_ranker(out: str, printed: str):
    result = json.loads(read(os.path.join(out, "ranker", "bench.json")))
    assert {"rankattn", "jax.nn dense mask"} <= set(result["train_step"])
    assert {"cached", "full forward"} <= set(result["serving"])


def check_store(out: str, printed: str):
    text = read(os.path.join(out, "store", "STORE.md"))
    for section in ("## 1. ", "## 2. ", "## 3. ", "## 4. "):
        assert section in text, section
    # Every policy replayed every synthetic trace through a store.
    policies = json.loads(read(os.path.join(out, "store", "store.json")))["policies"]
    for trace in ("zipf", "scan", "cold"):
        assert set(policies[trace][0]) >= {"lru", "s3fifo", "min"}, policies[trace]
    # Request by request, on a trace where the pages run out and the host tier restores.
    stream = json.loads(read(os.path.join(out, "store", "store.json")))["stream"]
    assert stream["lru"]["page_evictions"] and stream["host_hits"] and stream["host_evictions"]
    assert stream["sources"] == stream["lru"]["sources"], stream["first_difference"]
    assert f"**{stream['requests']} of {stream['requests']}** requests" in text


def check_call_costs(out: str, printed: str):
    text = read(os.path.join(out, "call_costs", "CALL_COSTS.md"))
    calls = ["a jitted x + 1 (any call's floor)", "rankattn, almost no work (8 tokens, D 8)",
             "short-fwd", "XLA's float32 matmul of short-fwd's FLOPs",
             "serving.attend, 1 x 40 x 64 candidates", *(["torch SDPA, short-fwd"] if TORCH else [])]
    for call in calls:  # both ways, both settings, and their ratio
        rows = table_rows(text, call)
        when = [row.split("|")[2].strip() for row in rows]
        assert when == ["after a pause", "back to back"], rows
        for row in rows:
            assert re.fullmatch(r"[\d.]+", row.split("|")[3].strip()), row
            # the median of the per-pair ratios, and their range
            assert re.fullmatch(r"[\d.]+x \([\d.]+-[\d.]+\)", row.split("|")[5].strip()), row
    for row in table_rows(text, "XLA's float32 matmul of short-fwd's FLOPs"):  # the machine's own
        assert re.fullmatch(r"\d+%", row.split("|")[6].strip()), row
    assert len(glob.glob(os.path.join(out, "call_costs", "results", "*", "call_costs.json"))) == 1


def check_profile_cpu(out: str, printed: str):
    assert re.search(r"^history=128 fwd: 2 calls, median [\d.]+ ms per call$", printed, re.M)


CHECKS = {"bench.py": check_bench, "bench.py --sweep": check_sweep,
          "compare_revision.py": check_compare_revision, "precision.py": check_precision,
          "gpu.py": check_gpu, "gpu.py --dry-run": check_gpu_plan,
          "bench_distributed.py": check_distributed,
          "bench_serving.py": check_serving,
          "compare_serving_revision.py": check_compare_serving, "ranker bench": check_ranker,
          "bench_store.py": check_store, "call_costs.py": check_call_costs,
          "profile_cpu.py": check_profile_cpu}


def committed_reports() -> dict[str, bytes]:
    """What the benchmarks write outside a smoke run: benchmarks/*.md, *.png and results/,
    examples/ranker/results/, the tuned GPU table and the README's results block."""
    paths = [p for pattern in ("benchmarks/*.md", "benchmarks/*.png", "benchmarks/results/**",
                               "examples/ranker/results/**", "src/rankattn/backends/*.json")
             for p in glob.glob(os.path.join(ROOT, pattern), recursive=True) if os.path.isfile(p)]
    found = {p: open(p, "rb").read() for p in paths}
    readme = read(os.path.join(ROOT, "README.md"))
    found["README.md results block"] = readme[readme.find(README_BEGIN):
                                              readme.find(README_END)].encode()
    return found


def run_groups(tmp_path) -> dict[str, str]:
    """Run GROUPS side by side, each in one process; every group's log."""
    procs = {}
    try:
        for group, names in GROUPS.items():
            with open(tmp_path / f"{group}.log", "w") as log:
                procs[group] = subprocess.Popen(
                    [sys.executable, __file__, str(tmp_path / "out"), *names],
                    env=smoke_env(str(tmp_path / "jax-cache"), group), stdout=log,
                    stderr=subprocess.STDOUT)
        for proc in procs.values():
            proc.wait(timeout=600)
    finally:
        for proc in procs.values():
            proc.kill()  # only one still running, after a timeout
    return {group: (tmp_path / f"{group}.log").read_text() for group in GROUPS}


def test_every_benchmark_smoke_mode_runs_and_writes_its_report(tmp_path):
    if subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True).returncode:
        pytest.skip("not a git checkout: the revision comparisons need HEAD")
    before = committed_reports()
    failures = []
    for group, log in run_groups(tmp_path).items():
        found = outputs(log)
        for name in GROUPS[group]:
            status, printed = found.get(name, (None, log))  # it never began: the whole log
            try:
                assert status == 0, f"exit status {status}"
                CHECKS[name](str(tmp_path / "out"), printed)
            except AssertionError as e:
                failures.append(f"{name}: {e}\n{printed[-3000:]}")
    assert not failures, "\n\n".join(failures)
    assert committed_reports() == before, "a smoke run wrote a committed report"


def test_gpu_compile_smoke_mode(tmp_path):
    # Installed here too: this file runs first (conftest.SLOW_FIRST), before
    # tests/test_gpu_compile.py, so on a fresh machine waiting for that install skipped it.
    try:
        gpu_compile.compiler_dir()
    except RuntimeError as error:
        pytest.skip(f"the CUDA compiler packages could not be installed: {error}")
    subprocess.run([sys.executable, "benchmarks/gpu_compile.py", "--smoke", "--out",
                    str(tmp_path)], cwd=ROOT, check=True, capture_output=True, timeout=600)
    text = read(os.path.join(tmp_path, "GPU_COMPILE.md"))
    assert "## sm_90" in text and "- 0 configurations do not compile" in text
    assert table_rows(text, "bfloat16, D=128, 4/2 heads")
    assert os.path.exists(os.path.join(tmp_path, "results", "gpu_compile.json"))


if __name__ == "__main__":
    run_smokes(sys.argv[2:], sys.argv[1])
