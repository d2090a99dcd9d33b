"""Accuracy of pallas_triton's float32 precision modes, against a float64 oracle.

    .venv/bin/python benchmarks/precision.py        # -> benchmarks/PRECISION.md
    .venv/bin/python benchmarks/precision.py --smoke --out DIR  # tiny sessions -> DIR/PRECISION.md

``PallasTriton(precision=...)`` takes JAX's names for its float32 dots: "highest"
(exact float32, no tensor cores), "high" (three bf16 tensor-core passes) and
"default" (one tf32 pass). The kernels run here in Pallas interpret mode, which
emulates the tensor-core modes' operand rounding (``pallas_triton._dot``), and every
result is compared with rankattn's reference in float64 on the same inputs. The
``xla`` backend in float32 is the yardstick of plain float32 math.

Errors are max |result - float64| / max |float64| per output and gradient (of a
loss with an lse term), over a ranking mask (packed sessions, history and
candidates) at two logit scales: q ~ N(0, 1) (logit std about 1 at the default
scale) and q ~ N(0, 16^2) (logit std about 16, where rounding the logits' inputs
matters most). A GPU's own tensor cores may round differently in the last bit;
benchmarks/gpu.py checks the modes there.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import tempfile

import jax
import jax.numpy as jnp
import numpy as np

import rankattn
from rankattn.backends import PallasTriton, Xla

HERE = os.path.dirname(os.path.abspath(__file__))
COMMAND = ".venv/bin/python benchmarks/precision.py"
# Two sessions of history + candidates, then one padding token.
SHAPE = dict(batch=1, history=120, candidates=30, q_heads=4, kv_heads=2, head_dim=128)
SMOKE_SHAPE = dict(SHAPE, history=16, candidates=4)  # --smoke: and the first logit scale only
LOGIT_SCALES = (1.0, 16.0)
FIELDS = ("out", "lse", "dq", "dk", "dv")


def inputs(logit_scale: float, shape: dict):
    rng = np.random.default_rng(0)
    b, h, c, hq, hkv, d = (shape[n] for n in ("batch", "history", "candidates", "q_heads",
                                               "kv_heads", "head_dim"))
    seg = np.array([1] * h + [-1] * c + [2] * h + [-2] * c + [0])[None]
    s = seg.shape[1]
    q = rng.standard_normal((b, s, hq, d)) * logit_scale
    k, v = rng.standard_normal((2, b, s, hkv, d))
    return q, k, v, seg


def results(impl, q, k, v, seg):
    """out, lse and the gradients of out . w + sum(lse) (w fixed), as float64 numpy."""
    w = jnp.asarray(np.random.default_rng(1).standard_normal(q.shape[:3] + v.shape[-1:]),
                    q.dtype)

    def loss(q, k, v):
        out, lse = rankattn.attention(q, k, v, segment_ids=seg, impl=impl, return_lse=True)
        return (out * w).sum() + jnp.where(jnp.isfinite(lse), lse, 0).sum(), (out, lse)

    (_, (out, lse)), grads = jax.jit(jax.value_and_grad(loss, (0, 1, 2), has_aux=True))(q, k, v)
    return {n: np.asarray(x, np.float64) for n, x in zip(FIELDS, (out, lse) + tuple(grads))}


def relative_errors(got: dict, want: dict) -> dict:
    errors = {}
    for name in FIELDS:
        finite = np.isfinite(want[name])
        diff = np.abs(got[name][finite] - want[name][finite])
        errors[name] = float(diff.max() / max(np.abs(want[name][finite]).max(), 1e-30))
    return errors


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true",
                        help="check the script: tiny sessions, PRECISION.md into --out "
                             "(default: a new temporary folder)")
    parser.add_argument("--out", help="write PRECISION.md into this folder, not benchmarks/")
    args = parser.parse_args()
    shape = SMOKE_SHAPE if args.smoke else SHAPE
    out = args.out or (tempfile.mkdtemp(prefix="precision-smoke-") if args.smoke else HERE)
    impls = {f'pallas_triton precision="{p}"': PallasTriton(precision=p, interpret=True)
             for p in ("highest", "high", "default")}
    impls["xla, float32"] = Xla()
    rows = []
    for logit_scale in LOGIT_SCALES[:1] if args.smoke else LOGIT_SCALES:
        q, k, v, seg = inputs(logit_scale, shape)
        with jax.enable_x64(True):
            want = results("reference", *(jnp.asarray(x, jnp.float64) for x in (q, k, v)), seg)
        for name, impl in impls.items():
            got = results(impl, *(jnp.asarray(x, jnp.float32) for x in (q, k, v)), seg)
            errors = relative_errors(got, want)
            rows.append((logit_scale, name, errors))
            print(f"logit scale {logit_scale:4}: {name:36} "
                  + " ".join(f"{n} {e:.1e}" for n, e in errors.items()), flush=True)
    write(rows, shape, out)


def write(rows, shape: dict, out: str) -> None:
    h, c = shape["history"], shape["candidates"]
    sessions = f"two packed sessions of {h} history + {c} candidates"
    shape = (f"batch={shape['batch']}, seq={2 * (h + c) + 1}, q_heads={shape['q_heads']}, "
             f"kv_heads={shape['kv_heads']}, head_dim={shape['head_dim']}")
    lines = ["# Accuracy of pallas_triton's float32 precision modes", "",
             "Generated by `benchmarks/precision.py`; do not edit by hand. Reproduce with", "",
             f"    {COMMAND}", "",
             f"{datetime.datetime.now():%Y-%m-%d %H:%M}: jax {jax.__version__}, kernels in Pallas "
             "interpret mode (tensor-core rounding emulated), float32 inputs.", "",
             f"{shape}; {sessions} and one padding "
             "token. Each cell is max |error| / max |float64 result| over the output, the "
             "natural-log lse and the gradients of `sum(out * w) + sum(lse)`. 'logit std' is "
             "the standard deviation of q's entries (k ~ N(0, 1), default scale 1 / sqrt(D)), "
             "so about the logits' too.", "",
             "| logit std | backend | " + " | ".join(FIELDS) + " |",
             "|---:|---|" + "---:|" * len(FIELDS)]
    for logit_scale, name, errors in rows:
        lines.append(f"| {logit_scale:g} | {name} | "
                     + " | ".join(f"{errors[n]:.1e}" for n in FIELDS) + " |")
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "PRECISION.md"), "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    sys.exit(main())
