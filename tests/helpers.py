"""Shared test helpers: random inputs, segment layouts, a jitted runner and the naive baseline."""

from __future__ import annotations

import dataclasses
import functools
import os
import pathlib
import subprocess
import sys
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import strategies as st

import oracle
import rankattn
from rankattn import errors
from tolerances import FIELDS, assert_matches

LSE_WEIGHT = 0.1  # loss = sum(out * w) + LSE_WEIGHT * sum(finite(lse) ** 2)
LOW_PRECISION = {"bfloat16": jnp.bfloat16, "float16": jnp.float16}


# --- Suites that need their own interpreter. ---------------------------------------

ROOT = pathlib.Path(__file__).resolve().parents[1]


def run_suite(folder: str, env: dict[str, str], timeout: int = 600) -> None:
    """Run ``pytest tests/<folder>`` in a fresh interpreter with ``env`` added; its failures
    fail the caller, with their output, and its skips (pyproject's -rs lines) become warnings
    in the caller's summary, where CI's log shows them. ``-n 0``: the suite runs in one
    process, whatever the parent's xdist workers."""
    env = dict(os.environ, **env)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), str(ROOT),
                                         os.environ.get("PYTHONPATH", "")])
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-n", "0", "-p", "no:cacheprovider",
         f"tests/{folder}"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, (f"tests/{folder} failed (exit {result.returncode}):\n"
                                    + result.stdout[-20000:] + result.stderr[-5000:])
    assert " passed" in result.stdout
    for line in result.stdout.splitlines():
        if line.startswith("SKIPPED "):
            warnings.warn(f"tests/{folder}, in its own process: {line}", stacklevel=2)


# --- The cpu kernel's build. ---------------------------------------------------------


def kernel_not_first_compilers() -> str | None:
    """Why the loaded cpu kernel is not the first compiler's build, or None when it is.
    native.load moves on to the next compiler (zig's clang) when one fails, silently, so a
    -Werror failure of g++ (the suite's builds, conftest.py) would otherwise pass unseen:
    GCC 12 flagged its own AVX-512 intrinsics for two stops that way."""
    from rankattn import native
    from rankattn.backends import cpu
    source = native.SOURCE_DIR / f"{cpu.LIBRARY}.cc"
    first = native.target_path(source, native.compiler(), native.source_digest(source))
    if cpu.library().path == first:
        return None
    failed = native.users_file(first, ".failed")
    return (failed.read_text() if failed.exists()
            else f"loaded {cpu.library().path}, not {first}: {cpu.library().reasons}")


# --- Errors. ---------------------------------------------------------------------


def lower_for_cuda(fn, *args):
    """``fn`` jitted and lowered for CUDA on this GPU-less machine (jax 0.11 needs the
    abstract GPU device of gpu_config.lowering_without_gpu; 0.10 ignores it)."""
    from rankattn.backends.gpu_config import lowering_without_gpu
    with lowering_without_gpu():
        return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))


def message_body(err: rankattn.RankattnError) -> str:
    """The message of ``err`` as a user would paste it without its code."""
    return str(err).split("\n  (rankattn explain")[0].split("] ", 1)[1]


def assert_explained(err: rankattn.RankattnError) -> None:
    """``rankattn explain`` resolves the message of ``err``, pasted without its code, to its code."""
    got = errors.best_match(message_body(err))
    assert got == err.code, f"explain resolves {message_body(err)!r} to {got}, not {err.code}"


# --- Random values. -------------------------------------------------------------


def random_qkv(seed: int, batch: int, seq: int, heads_q: int, heads_kv: int, dim: int,
               dim_v: int | None = None, kv_seq: int | None = None, q_std: float = 1.5):
    """float32 numpy (q, k, v, w); w is the output weight of the test loss.

    q is a little wider than unit so that logits spread over a few units and a
    soft cap of 2 changes them noticeably.
    """
    rng = np.random.default_rng(seed)
    kv_seq = seq if kv_seq is None else kv_seq
    dim_v = dim if dim_v is None else dim_v
    q = rng.normal(0, q_std, (batch, seq, heads_q, dim)).astype(np.float32)
    k = rng.normal(0, 1, (batch, kv_seq, heads_kv, dim)).astype(np.float32)
    v = rng.normal(0, 1, (batch, kv_seq, heads_kv, dim_v)).astype(np.float32)
    w = rng.normal(0, 1, (batch, seq, heads_q, dim_v)).astype(np.float32)
    return q, k, v, w


# --- Segment layouts. -------------------------------------------------------------


def packed_row(rng, seq: int, n_sessions: int) -> np.ndarray:
    """One row of contiguous runs: [pad] (history, candidates or both, in either order) [pad] ...

    Session ids are distinct but not consecutive; some sessions have no
    candidates or no history; runs are cut off at ``seq`` and the rest is padding.
    """
    ids = rng.choice(np.arange(1, 4 * n_sessions + 1), n_sessions, replace=False)
    row: list[int] = [0] * int(rng.integers(0, 3))
    mean = max(2, seq // max(1, n_sessions))
    for s in ids:
        hist = [int(s)] * int(rng.integers(0, mean + 1))
        cand = [-int(s)] * int(rng.integers(0, mean // 2 + 2))
        runs = [hist, cand] if rng.random() < 0.7 else [cand, hist]
        if rng.random() < 0.3 and len(hist) > 1:  # history split around the candidates
            cut = int(rng.integers(1, len(hist)))
            runs = [hist[:cut], cand, hist[cut:]]
        for run in runs:
            row += run
        row += [0] * int(rng.integers(0, 3))
    row = (row + [0] * seq)[:seq]
    return np.array(row, np.int32)


def interleaved_row(rng, seq: int, n_sessions: int) -> np.ndarray:
    """One row where every token independently picks a session, a sign or padding."""
    ids = rng.choice(np.arange(1, 4 * n_sessions + 1), n_sessions, replace=False)
    values = np.concatenate([ids, -ids, [0]])
    p = np.concatenate([np.full(n_sessions, 0.5 / n_sessions), np.full(n_sessions, 0.4 / n_sessions),
                        [0.1]])
    return rng.choice(values, seq, p=p).astype(np.int32)


def random_segments(seed: int, batch: int, seq: int, layout: str) -> np.ndarray:
    """[B, S] int32 rows of `packed_row` or `interleaved_row`, 1 to 4 sessions each."""
    rng = np.random.default_rng(seed)
    make = packed_row if layout == "packed" else interleaved_row
    return np.stack([make(rng, seq, int(rng.integers(1, 5))) for _ in range(batch)])


# --- Hypothesis strategies for masks (values only: they never change a compiled shape). ----


# Listed so that Hypothesis's simplest example is history of one session, not all padding.
SESSION_IDS = [1, -1, 2, 0, -2, 3, -3, 4, -4]


def pad_blocks(seg, block):
    """[B, S] ids padded with 0 (no segment) to a multiple of ``block``."""
    return np.pad(seg, [(0, 0), (0, -seg.shape[1] % block)])


def visited_pairs(index, full_count, count):
    """{(b, row, col): full?} of a visit list [B, R, C] with its counts."""
    pairs = {}
    for b, r in np.ndindex(count.shape):
        listed = index[b, r, :count[b, r]].tolist()
        assert len(set(listed)) == len(listed), f"block listed twice in row ({b}, {r}): {listed}"
        for position, col in enumerate(listed):
            pairs[b, r, col] = position < full_count[b, r]
    return pairs


@st.composite
def segment_row(draw, seq: int):
    """Contiguous runs (history, candidates, padding; sessions may recur) or fully interleaved."""
    if draw(st.booleans()):
        runs = draw(st.lists(st.tuples(st.sampled_from(SESSION_IDS),
                                       st.integers(1, max(1, seq // 2 + 1))),
                             min_size=1, max_size=10))
        row = [sid for sid, length in runs for _ in range(length)]
        return (row + [0] * seq)[:seq]
    return draw(st.lists(st.sampled_from(SESSION_IDS[:7]), min_size=seq, max_size=seq))


def segment_ids(batch: int, seq: int):
    return st.lists(segment_row(seq), min_size=batch, max_size=batch).map(
        lambda rows: tuple(map(tuple, rows)))


@st.composite
def bounds_row(draw, seq: int):
    """Half-open ranges at any offsets: either order, gaps, empty ranges, and overlapping
    ranges (partly, or one inside the other)."""
    a, b, c, d = sorted(draw(st.lists(st.integers(0, seq), min_size=4, max_size=4)))
    history, candidates = draw(st.sampled_from([((a, b), (c, d)), ((c, d), (a, b)),
                                                ((a, a), (c, d)), ((a, b), (c, c)),
                                                ((a, c), (b, d)), ((b, d), (a, c)),
                                                ((a, d), (b, c)), ((b, c), (a, d))]))
    return history + candidates


def bounds(batch: int, seq: int, broadcast: bool):
    if broadcast:
        return bounds_row(seq)
    return st.lists(bounds_row(seq), min_size=batch, max_size=batch).map(tuple)


# --- One test case. ------------------------------------------------------------


MASKS = ("none", "segment_ids", "bounds_rows", "bounds_broadcast")
MULTIPLIERS = ("none", "rows", "heads")


@dataclasses.dataclass(frozen=True)
class Case:
    """Shapes, options and mask of one attention call; q, k, v and w come from `seed`."""

    batch: int = 1
    seq: int = 8
    heads_q: int = 2
    heads_kv: int = 1
    dim: int = 8
    dim_v: int | None = None
    kv_seq: int | None = None          # cross-attention length (mask "none", not causal)
    dtype: str = "float32"
    mask: str = "none"                 # one of MASKS
    mask_values: tuple | None = None   # segment ids [B][S] or bounds [4] / [B][4], as tuples
    causal: bool = False
    softcap: float | None = None
    softcap_method: str = "tanh"
    scale: float | None = None
    seed: int = 0
    positive: bool = False             # q and the loss weight w drawn as |N(0, std)|
    multiplier: str = "none"           # logit_multiplier: "none", "rows" [B, Sq], "heads" [B, Sq, Hq]

    def __post_init__(self):
        assert self.mask in MASKS, self.mask
        assert self.multiplier in MULTIPLIERS, self.multiplier
        assert self.mask != "none" or self.mask_values is None, "mask values without a mask"

    def with_mask(self, values) -> Case:
        values = np.asarray(values).tolist()
        to_tuple = (lambda x: tuple(map(tuple, x))) if isinstance(values[0], list) else tuple
        return dataclasses.replace(self, mask_values=to_tuple(values))

    def values(self):
        q, k, v, w = random_qkv(self.seed, self.batch, self.seq, self.heads_q, self.heads_kv,
                                self.dim, self.dim_v, self.kv_seq)
        return (np.abs(q), k, v, np.abs(w)) if self.positive else (q, k, v, w)

    def logit_multiplier(self):
        """float32 numpy [B, Sq] ("rows") or [B, Sq, Hq] ("heads") from the seed, or None:
        factors in [-1, 2] with exact 0 and 1 among them (a row of equal logits, the plain
        softmax)."""
        if self.multiplier == "none":
            return None
        shape = (self.batch, self.seq) + ((self.heads_q,) if self.multiplier == "heads" else ())
        rng = np.random.default_rng(self.seed + 7)
        t = rng.uniform(-1.0, 2.0, shape)
        t = np.where(rng.random(shape) < 0.1, 0.0, np.where(rng.random(shape) < 0.2, 1.0, t))
        return t.astype(np.float32)

    def mask_arg(self):
        """(keyword, int32 numpy array) for rankattn.attention, or (None, None)."""
        if self.mask == "none":
            return None, None
        assert self.mask_values is not None, f"{self} has a mask kind but no values"
        kw = "segment_ids" if self.mask == "segment_ids" else "bounds"
        return kw, np.array(self.mask_values, np.int32)

    def segments(self):
        """The segment ids this case means (numpy [B, S]), or None for no mask."""
        kw, arr = self.mask_arg()
        if kw == "bounds":
            return oracle.bounds_to_segments(arr, self.seq, self.batch)
        return arr

    def dense_mask(self):
        """bool [B, Sq, Skv] by the oracle's rule."""
        seg = self.segments()
        if seg is None:
            return oracle.no_mask(self.batch, self.seq, self.kv_seq or self.seq, self.causal)
        return oracle.mask_dense(seg, self.causal)

    def options(self):
        """The static options of rankattn.attention (the logit multiplier is an array)."""
        return dict(causal=self.causal, scale=self.scale, softcap=self.softcap,
                    softcap_method=self.softcap_method)


def case_id(case: Case) -> str:
    """A short test id: the fields (but the mask values) that differ from the defaults."""
    default = Case()
    return ",".join(f"{f.name}={getattr(case, f.name)}" for f in dataclasses.fields(case)
                    if f.name != "mask_values" and getattr(case, f.name) != getattr(default, f.name)
                    ) or "default"


# --- Running an implementation. -------------------------------------------------


def objective(out, lse, w):
    finite = jnp.where(jnp.isfinite(lse), lse, 0.0)
    return jnp.sum(out.astype(lse.dtype) * w) + LSE_WEIGHT * jnp.sum(finite ** 2)


@functools.partial(jax.jit, static_argnames=("impl", "mask_kw", "causal", "scale", "softcap",
                                             "softcap_method"))
def _outputs_and_grads(q, k, v, w, mask, multiplier, *, impl, mask_kw, **options):
    kwargs = {mask_kw: mask} if mask_kw else {}

    def loss(q, k, v):
        out, lse = rankattn.attention(q, k, v, **kwargs, **options, logit_multiplier=multiplier,
                                      return_lse=True, impl=impl)
        return objective(out, lse, w), (out, lse)

    (_, (out, lse)), (dq, dk, dv) = jax.value_and_grad(loss, (0, 1, 2), has_aux=True)(q, k, v)
    return dict(out=out, lse=lse, dq=dq, dk=dk, dv=dv)


@functools.partial(jax.jit, static_argnames=("impl", "causal", "scale", "softcap",
                                             "softcap_method", "return_lse"))
def attention_jit(q, k, v, segment_ids=None, bounds=None, **kwargs):
    """rankattn.attention under jit (one compile per shape instead of one per eager op)."""
    return rankattn.attention(q, k, v, segment_ids=segment_ids, bounds=bounds, **kwargs)


@functools.partial(jax.jit, static_argnames=("impl", "causal", "scale", "softcap",
                                             "softcap_method"))
def attention_vjp(q, k, v, d_out, d_lse, segment_ids=None, bounds=None, **kwargs):
    """(out, lse, dq, dk, dv) for explicit cotangents on out and lse, under jit."""
    def f(q, k, v):
        return rankattn.attention(q, k, v, segment_ids=segment_ids, bounds=bounds,
                                  return_lse=True, **kwargs)

    (out, lse), vjp = jax.vjp(f, q, k, v)
    return (out, lse, *vjp((d_out.astype(out.dtype), d_lse)))


def rounded_values(case: Case):
    """(q, k, v, w) as float32 numpy, each rounded to the case's dtype: what a backend sees."""
    case_dtype = np.dtype(jnp.dtype(case.dtype))
    wide = np.float64 if case_dtype == np.float64 else np.float32
    # Casts in numpy (ml_dtypes), so that no eager XLA op is compiled per shape.
    return tuple(x.astype(case_dtype).astype(wide) for x in case.values())


def run(case: Case, impl, dtype=None, check_dtypes: bool = True) -> dict[str, np.ndarray]:
    """out, lse and the loss gradients of ``impl`` on ``case`` (inputs cast to ``dtype``).

    The values are made in float32, rounded to the case's dtype, then cast to
    ``dtype`` (default: the case's dtype), so a float32 run on a bf16 case sees
    exactly the bf16 values. The loss weight w is rounded the same way, so the
    cotangent of out is exactly w in every dtype.
    """
    case_dtype = np.dtype(jnp.dtype(case.dtype))
    run_dtype = case_dtype if dtype is None else np.dtype(jnp.dtype(dtype))
    q, k, v, w = rounded_values(case)
    q, k, v = (x.astype(run_dtype) for x in (q, k, v))
    mask_kw, mask = case.mask_arg()
    res = _outputs_and_grads(q, k, v, w, mask, case.logit_multiplier(), impl=impl,
                             mask_kw=mask_kw, **case.options())
    for name, x in res.items():
        want = np.promote_types(run_dtype, np.float32) if name == "lse" else run_dtype
        assert x.dtype == want or not check_dtypes, f"{name} has dtype {x.dtype}, expected {want}"
    return {name: np.asarray(x).astype(np.float64) for name, x in res.items()}


@functools.lru_cache(maxsize=64)
def oracle_results(case: Case) -> dict:
    """The float64 oracle on the case's rounded values, with magnitudes (tests/tolerances.py)."""
    q, k, v, w = rounded_values(case)
    return oracle.attention(q, k, v, case.dense_mask(), w=w, lse_weight=LSE_WEIGHT,
                            scale=case.scale, softcap_value=case.softcap,
                            softcap_method=case.softcap_method,
                            logit_multiplier=case.logit_multiplier(), magnitudes=True)


def n_terms(case: Case) -> int:
    """How many terms any one result element sums, at most (tests/tolerances.py's floor)."""
    return case.seq + (case.kv_seq or case.seq)


def check_results(case: Case, got: dict, fields=FIELDS) -> None:
    """``got`` (out, lse, dq, dk, dv of ``case``) within tests/tolerances.py of the oracle."""
    want = oracle_results(case)
    for name in fields:
        assert_matches(name, got[name], want[name], case.dtype, want["terms"][name],
                       want["amplified"][name], n_terms(case))


def check_against_oracle(case: Case, impl) -> None:
    """Forward out, lse and dq, dk, dv of ``impl`` agree with the float64 oracle on ``case``."""
    got = run(case, impl)
    check_results(case, got)
    # Outputs of queries that see nothing are exactly zero, and so are their gradients.
    blind = ~case.dense_mask().any(-1)                         # [B, Sq]
    assert np.all(got["out"][blind] == 0) and np.all(got["dq"][blind] == 0)
    assert np.all(np.isneginf(got["lse"].transpose(0, 2, 1)[blind]))


# --- A naive low-precision attention: what losing the float32 math would give. ----


@functools.partial(jax.jit, static_argnames=("scale", "softcap", "softcap_method"))
def _naive(q, k, v, w, mask, *, scale, softcap, softcap_method):
    """Dense attention with every step in the inputs' dtype; masks rows with no key to 0."""
    dt = q.dtype
    group = q.shape[2] // k.shape[2]

    def attend(q, k, v):
        k, v = jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=dt) * jnp.asarray(scale, dt)
        if softcap is not None:
            c = jnp.asarray(softcap, dt)
            s = c * jnp.tanh(s / c) if softcap_method == "tanh" else s / (1 + jnp.abs(s) / c)
        m4 = mask[:, None]
        s = jnp.where(m4, s, jnp.asarray(-jnp.inf, dt))
        mx = jax.lax.stop_gradient(jnp.max(s, -1, keepdims=True))
        mx = jnp.where(jnp.isfinite(mx), mx, jnp.zeros((), dt))
        p = jnp.where(m4, jnp.exp(s - mx), jnp.zeros((), dt))
        l = p.sum(-1, keepdims=True, dtype=dt)
        safe = jnp.where(l > 0, l, jnp.ones((), dt))
        out = jnp.einsum("bhqk,bkhd->bqhd", p / safe, v, preferred_element_type=dt)
        lse = jnp.where(l > 0, mx + jnp.log(safe), jnp.asarray(-jnp.inf, dt))[..., 0]
        return objective(out, lse.astype(jnp.float32), w), (out, lse)

    (_, (out, lse)), (dq, dk, dv) = jax.value_and_grad(attend, (0, 1, 2), has_aux=True)(q, k, v)
    return dict(out=out, lse=lse, dq=dq, dk=dk, dv=dv)


def run_naive(case: Case) -> dict[str, np.ndarray]:
    q, k, v, w = rounded_values(case)
    dt = np.dtype(LOW_PRECISION[case.dtype])
    scale = case.scale if case.scale is not None else 1 / np.sqrt(case.dim)
    res = _naive(q.astype(dt), k.astype(dt), v.astype(dt), w, case.dense_mask(), scale=float(scale),
                 softcap=case.softcap, softcap_method=case.softcap_method)
    return {name: np.asarray(x).astype(np.float64) for name, x in res.items()}
