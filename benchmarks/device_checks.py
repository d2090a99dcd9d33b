"""Correctness of rankattn backends on a device against the reference: the (a) section of
the one-command device checks (benchmarks/gpu.py, benchmarks/tpu.py)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

import rankattn


def packed_rows(rng, batch: int, seq: int) -> np.ndarray:
    """Segment ids: consecutive sessions (history, candidates, then 0-2 padding tokens)."""
    rows = []
    for _ in range(batch):
        row, session = [], 1
        while len(row) < seq:
            history, candidates = rng.integers(1, 200), rng.integers(0, 40)
            row += [session] * history + [-session] * candidates + [0] * rng.integers(0, 3)
            session += 1
        rows.append(row[:seq])
    return np.array(rows, np.int32)


def first_line(error: Exception) -> str:
    """An exception as one report line: its type and the first 200 characters of its first
    line."""
    return f"{type(error).__name__}: {str(error).strip().splitlines()[0][:200]}"


def relative_errors(got: list, want: list) -> dict[str, float]:
    """Max error / max(1, max |reference|) of out, lse, dq, dk, dv (inf where non-finite
    entries differ or a NaN appears)."""
    errors = {}
    for field, g, r in zip(("out", "lse", "dq", "dk", "dv"), got, want):
        finite = np.isfinite(r)
        same_inf = np.array_equal(np.isfinite(g), finite) and np.array_equal(g[~finite],
                                                                               r[~finite])
        scale = max(1.0, float(np.abs(r[finite]).max(initial=0)))
        err = float(np.abs(g[finite] - r[finite]).max(initial=0)) / scale
        errors[field] = err if same_inf and not np.isnan(g).any() else float("inf")
    return errors


def correctness(case, impls: dict, tolerance: dict, impl_tolerance: dict | None = None
                ) -> list[dict]:
    """Each implementation's max error relative to max(1, max |reference|) per result (out,
    lse, dq, dk, dv of a loss with an lse term), whether rows that see nothing are exact
    zeros, and the verdict against ``tolerance`` (by dtype), or ``impl_tolerance`` (by
    impl name) where that is larger. ``case``: (B, S, Hq, Hkv, D, Dv, dtype, causal,
    softcap, softcap_method) on packed rows (:func:`packed_rows`)."""
    b, s, hq, hkv, d, dv, dtype, causal, softcap, method = case
    rng = np.random.default_rng(s)
    q, k = rng.normal(0, 1.5, (b, s, hq, d)), rng.normal(0, 1, (b, s, hkv, d))
    v = rng.normal(0, 1, (b, s, hkv, dv))
    w = jnp.asarray(rng.normal(0, 1, (b, s, hq, dv)), jnp.float32)
    seg = jnp.asarray(packed_rows(rng, b, s))

    @functools.partial(jax.jit, static_argnums=3)
    def results(q, k, v, impl):
        def loss(q, k, v):
            out, lse = rankattn.attention(q, k, v, segment_ids=seg, causal=causal,
                                          softcap=softcap, softcap_method=method,
                                          return_lse=True, impl=impl)
            finite = jnp.where(jnp.isfinite(lse), lse, 0.0)
            return jnp.sum(out.astype(jnp.float32) * w) + 0.1 * jnp.sum(finite ** 2), (out, lse)

        (_, (out, lse)), grads = jax.value_and_grad(loss, (0, 1, 2), has_aux=True)(q, k, v)
        return (out, lse, *grads)

    q, k, v = (jnp.asarray(x, dtype) for x in (q, k, v))
    want = [np.asarray(x, np.float32)
            for x in results(*(x.astype(jnp.float32) for x in (q, k, v)), "reference")]
    label = (f"B={b} S={s} H={hq}/{hkv} D={d}{f' Dv={dv}' if dv != d else ''} {dtype}"
             f"{' causal' if causal else ''}"
             f"{f' {method} {softcap}' if softcap else ''}")
    rows = []
    for name, impl in impls.items():
        row = dict(case=label, impl=name)
        try:
            got = [np.asarray(x, np.float32) for x in results(q, k, v, impl)]
        except Exception as e:  # noqa: BLE001 - reported in the table
            rows.append(dict(row, ok=False, error=f"{type(e).__name__}: {str(e)[:200]}"))
            continue
        errors = relative_errors(got, want)
        blind_ok = bool(np.all(got[0][np.asarray(seg == 0)] == 0))
        allowed = max(tolerance[dtype], (impl_tolerance or {}).get(name, 0.0))
        rows.append(dict(row, errors=errors, blind_ok=blind_ok,
                         ok=blind_ok and max(errors.values()) <= allowed))
    return rows


def markdown(checks: list[dict], tolerance: dict) -> list[str]:
    """The correctness section's lines: a table of :func:`correctness` rows."""
    out = ["## (a) Correctness against the reference", "",
           "Max error / max(1, max |reference|) over out, lse, dq, dk, dv; blind = rows that "
           "see nothing give exactly 0. Tolerance: "
           + ", ".join(f"{k} {v:g}" for k, v in tolerance.items()) + ".", "",
           "| case | impl | out | lse | dq | dk | dv | blind | verdict |",
           "|---|---|---:|---:|---:|---:|---:|---|---|"]
    for c in checks:
        if "errors" not in c:
            out.append(f"| {c['case']} | {c['impl']} | | | | | | | FAILED: {c['error']} |")
            continue
        out.append(f"| {c['case']} | {c['impl']} | " + " | ".join(
            f"{c['errors'][f]:.1e}" for f in ("out", "lse", "dq", "dk", "dv"))
            + f" | {'ok' if c['blind_ok'] else 'NOT ZERO'} | {'pass' if c['ok'] else 'FAIL'} |")
    return out
