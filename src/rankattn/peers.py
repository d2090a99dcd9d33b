"""What a user would run instead of rankattn, for side-by-side timing (demo, benchmarks)."""

from __future__ import annotations

import os
import platform
import re
import subprocess
import time

import jax
import numpy as np

from rankattn import semantics


def jax_nn_attention(q, k, v, segment_ids, causal: bool = False, implementation: str = "xla"):
    """jax.nn.dot_product_attention with the equivalent dense boolean mask [B, 1, S, S]."""
    mask = semantics.dense_mask(segment_ids, segment_ids, causal)[:, None]
    return jax.nn.dot_product_attention(q, k, v, mask=mask, implementation=implementation)


SETTLE_S = 0.02
# settle()'s test for a quiet process: under QUIET_SHARE of one core's time used in a window of
# QUIET_WINDOW_S, waited for QUIET_LIMIT_S at most.
QUIET_WINDOW_S, QUIET_SHARE, QUIET_LIMIT_S = 0.005, 0.1, 5.0


def settle(pause_s: float, limit_s: float = QUIET_LIMIT_S) -> None:
    """Idles ``pause_s``, then until this process is quiet: under QUIET_SHARE of one core's
    time used (by any of its threads) in a QUIET_WINDOW_S window, or ``limit_s`` at most. A
    call's cleanup can outlive it: after the dense reference's 4 GB of XLA scratch, 0.36-0.52
    s of the process's system time followed on a background thread (returning the pages), and
    on 2 cores the call timed next ran up to 1.5x as long (packed-fwdbwd's rankattn call 615
    ms 20 ms after the dense reference, 446 ms after 1.5 s, 400 ms after itself). No pause
    (0) waits for nothing: back-to-back timing. Off the CPU backend the pause alone: the
    timed work runs on the device, and a GPU runtime's host threads need never be idle."""
    if pause_s <= 0:
        return
    time.sleep(pause_s)
    if jax.default_backend() != "cpu":
        return
    deadline = time.perf_counter() + limit_s
    while time.perf_counter() < deadline:
        used, start = time.process_time(), time.perf_counter()
        time.sleep(QUIET_WINDOW_S)  # on a loaded machine, often longer: the share is of its span
        if time.process_time() - used < QUIET_SHARE * (time.perf_counter() - start):
            return


def round_orders(names: list[str], rounds: int, seed: int = 0) -> list[list[str]]:
    """The order of each round of :func:`interleaved_times`: every name once per round, the
    rounds shuffled (seeded, so a run can be repeated) so that each name follows every other
    alike, and no round starts with the name the previous one ended with: a name timed
    right after its own call would find its data in cache and its threads awake. (Reversing
    every other round, as before, did that for the first and last names only, rankattn
    among them.) Two names simply alternate."""
    rng = np.random.default_rng(seed)
    orders = []
    for _ in range(rounds):
        order = [names[i] for i in rng.permutation(len(names))]
        if orders and len(order) > 1 and order[0] == orders[-1][-1]:
            order[0], order[-1] = order[-1], order[0]
        orders.append(order)
    return orders


def interleaved_times(fns: dict, repeats: int, warm_up: bool = True,
                      settle_s: float = SETTLE_S, warm_calls: int = 0) -> dict[str, np.ndarray]:
    """Wall times (s) per round of each zero-argument function, run round-robin.

    Each function is called once first to compile and warm up (unless the
    caller already did: ``warm_up=False``). Every round runs each function once, in
    the order :func:`round_orders` gives, so that drift and whatever one function
    leaves behind (a peer's spinning thread pool, a freed heap, warm caches) hit all
    alike. Results are waited for with
    block_until_ready. Before each call the machine idles ``settle_s``, then until the
    process is quiet (:func:`settle`): torch's
    OpenMP threads spin for milliseconds after a call, and on 2 cores they took
    the cores of whatever ran next (short-fwdbwd: rankattn 13.1 ms right after
    torch, 11.4 ms after a 20 ms pause; torch itself 9.4 -> 10.2 ms, as it lost
    its warm threads); a call's memory is returned after it, for up to half a
    second. Returns one array of ``repeats`` times per name; the
    ratio of two functions is best taken per round (same machine state), then
    its median over rounds.

    ``warm_calls``: untimed calls of the same function between the pause and
    the timed call, so that the timed one finds its own threads awake and its
    data in cache, as calls arriving back to back at a busy server do. (After
    the pause alone, a 2-core KVM guest took 1.4x (torch) and 1.7-2x
    (rankattn) as long for a 1-user 64-candidate request as back to back,
    and 3.4x for a rankattn call with almost no work: the idle cores'
    caches and threads are cold.)
    """
    if warm_up:
        for fn in fns.values():
            jax.block_until_ready(fn())
    times = {name: [] for name in fns}
    for order in round_orders(list(fns), repeats):
        for name in order:
            settle(settle_s)
            for _ in range(warm_calls):
                jax.block_until_ready(fns[name]())
            start = time.perf_counter()
            jax.block_until_ready(fns[name]())
            times[name].append(time.perf_counter() - start)
    return {name: np.array(t) for name, t in times.items()}


def interleaved_medians(fns: dict, repeats: int) -> dict[str, float]:
    """Median wall time (s) of each function, from :func:`interleaved_times`."""
    return {name: float(np.median(t)) for name, t in interleaved_times(fns, repeats).items()}


def machine_description() -> str:
    """'model (generation, widest vector ISA: AMX, AVX-512, AVX2, else the architecture), N
    cores' of this machine, for a report's header; the generation only for AMD CPUs
    (:func:`amd_generation`)."""
    try:
        fields = lscpu()
        model, flags = fields["Model name"].strip(), fields["Flags"].split()
        isa = ("AMX" if "amx_bf16" in flags else "AVX-512" if "avx512f" in flags
               else "AVX2" if "avx2" in flags else platform.machine())
        family = int(fields.get("CPU family", "0").strip() or 0)
        generation = amd_generation(family, flags) if "AMD" in model else None
    except (KeyError, ValueError):
        model, isa, generation = platform.processor() or platform.machine(), "?", None
    return f"{model} ({f'{generation}, ' if generation else ''}{isa}), {os.cpu_count()} cores"


def lscpu() -> dict[str, str]:
    """lscpu's fields ("Model name", "CPU family", "Flags", ...; in English whatever the
    locale); empty where lscpu is missing."""
    try:
        lines = subprocess.run(["lscpu"], capture_output=True, text=True,
                               env=dict(os.environ, LC_ALL="C")).stdout.splitlines()
    except OSError:
        return {}
    return {key.strip(): value for key, value in (line.split(":", 1) for line in lines
                                                  if ":" in line)}


def cpu_flags() -> set[str]:
    """This CPU's feature flags (lscpu's "Flags"); empty where lscpu does not say."""
    return set(lscpu().get("Flags", "").split())


def amd_generation(family: int, flags: list[str]) -> str | None:
    """The Zen generation of an AMD x86 CPU from its family (a virtual machine often shows
    only "AMD EPYC" as the model): 23 Zen / Zen 2, 25 Zen 3, or Zen 4 where it has AVX-512
    (Zen 3 has none), 26 Zen 5; None for other families."""
    if family == 25:
        return "Zen 4" if "avx512f" in flags else "Zen 3"
    return {23: "Zen / Zen 2", 26: "Zen 5"}.get(family)


def machine_slug(description: str) -> str:
    """A folder name for a machine_description(): "AMD EPYC (Zen 3, AVX2), 2 cores" ->
    "amd-epyc-zen-3-avx2-2-cores" (trademark signs dropped)."""
    plain = re.sub(r"\((R|TM)\)", "", description, flags=re.I).lower()
    return re.sub(r"[^a-z0-9]+", "-", plain).strip("-")
