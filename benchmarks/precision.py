"""Accuracy of the float32 backends (pallas_triton's precision modes, the cpu kernel, xla),
against a float64 oracle.

    .venv/bin/python benchmarks/precision.py        # -> benchmarks/PRECISION.md
    .venv/bin/python benchmarks/precision.py --smoke --out DIR  # tiny sessions -> DIR/PRECISION.md

``PallasTriton(precision=...)`` takes JAX's names for its float32 dots: "highest"
(exact float32, no tensor cores), "high" (three bf16 tensor-core passes) and
"default" (one tf32 pass). The kernels run here in Pallas interpret mode, which
emulates the tensor-core modes' operand rounding (``pallas_triton._dot``), and every
result is compared with rankattn's reference in float64 on the same inputs. The
``xla`` backend in float32 is the yardstick of plain float32 math, beside which the
``cpu`` kernel (where it builds) is measured too, and one more order of the same float32
sums: Q K^T as one float32 einsum with the rest in float64 (``float32_logits``).

Errors are max |result - float64| / max |float64| per output and gradient (of a
loss with an lse term), over a ranking mask (packed sessions, history and
candidates) at three logit scales: q ~ N(0, 1) (logit std about 1 at the default
scale), q ~ N(0, 16^2) (logit std about 16) and q ~ N(0, 1000^2), where the softmax is
nearly each row's argmax: there the rounding of the largest logits (a float32's ulp is at
most 2^-23 of it) decides the error of a backend whose products are exact float32, and
the rounding of the dots' operands that of the tensor-core modes. A GPU's own tensor
cores may round differently in the last bit; benchmarks/gpu.py checks the modes there.
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
from rankattn import peers
from rankattn.backends import Backend, Cpu, PallasTriton, Xla

HERE = os.path.dirname(os.path.abspath(__file__))
COMMAND = ".venv/bin/python benchmarks/precision.py"
# Two sessions of history + candidates, then one padding token.
SHAPE = dict(batch=1, history=120, candidates=30, q_heads=4, kv_heads=2, head_dim=128)
SMOKE_SHAPE = dict(SHAPE, history=16, candidates=4)  # --smoke: and the first logit scale only
LOGIT_SCALES = (1.0, 16.0, 1000.0)
FIELDS = ("out", "lse", "dq", "dk", "dv")
YARDSTICK = "float32 Q K^T (one einsum), the rest float64"


def inputs(logit_scale: float, shape: dict):
    rng = np.random.default_rng(0)
    b, h, c, hq, hkv, d = (shape[n] for n in ("batch", "history", "candidates", "q_heads",
                                               "kv_heads", "head_dim"))
    seg = np.array([1] * h + [-1] * c + [2] * h + [-2] * c + [0])[None]
    s = seg.shape[1]
    q = rng.standard_normal((b, s, hq, d)) * logit_scale
    k, v = rng.standard_normal((2, b, s, hkv, d))
    return q, k, v, seg


def float32_logits(q, k, v, seg):
    """out, lse of float32 q, k, v with only the logits' dot Q K^T (and so its gradients'
    dots) in float32, one einsum, and the rest in float64 (under jax.enable_x64): one order
    of a float32 backend's sums of products, beside which the backends' own orders show
    (none errs least at every input)."""
    groups, f64 = q.shape[2] // k.shape[2], jnp.float64
    s = jnp.einsum("bqhd,bkhd->bhqk", q, jnp.repeat(k, groups, axis=2),
                   precision="highest").astype(f64) / q.shape[-1] ** 0.5
    mask = rankattn.semantics.dense_mask(seg, seg, False)[:, None]
    seen = mask.any(-1)  # the padding token's row sees no key: out 0, lse -inf
    s = jnp.where(mask, s, -1e30)  # finite, so that no gradient meets inf - inf
    lse = jax.nn.logsumexp(s, axis=-1)
    out = jnp.einsum("bhqk,bkhd->bqhd", jnp.exp(s - lse[..., None]),
                     jnp.repeat(v, groups, axis=2).astype(f64))
    return (jnp.where(seen.transpose(0, 2, 1)[..., None], out, 0),
            jnp.where(seen, lse, -jnp.inf))


def is_function(impl) -> bool:
    """Whether impl is a function of (q, k, v, seg) like float32_logits, run under
    jax.enable_x64, rather than a backend (or its name) for rankattn.attention."""
    return callable(impl) and not isinstance(impl, Backend)


def results(impl, q, k, v, seg):
    """out, lse and the gradients of out . w + sum(lse) (w fixed), as float64 numpy; impl a
    Backend of rankattn.attention or a function of (q, k, v, seg) like float32_logits."""
    w = jnp.asarray(np.random.default_rng(1).standard_normal(q.shape[:3] + v.shape[-1:]),
                    q.dtype)

    def loss(q, k, v):
        if is_function(impl):
            out, lse = impl(q, k, v, seg)
        else:
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
    cpu_reasons = Cpu().platform_reasons()
    if cpu_reasons:
        print("cpu kernel left out: " + "; ".join(cpu_reasons), flush=True)
    else:
        impls["cpu, float32"] = Cpu()
    impls[YARDSTICK] = float32_logits
    rows = []
    for logit_scale in LOGIT_SCALES[:1] if args.smoke else LOGIT_SCALES:
        q, k, v, seg = inputs(logit_scale, shape)
        with jax.enable_x64(True):
            want = results("reference", *(jnp.asarray(x, jnp.float64) for x in (q, k, v)), seg)
        for name, impl in impls.items():
            with jax.enable_x64(is_function(impl)):
                got = results(impl, *(jnp.asarray(x, jnp.float32) for x in (q, k, v)), seg)
            errors = relative_errors(got, want)
            rows.append((logit_scale, name, errors))
            print(f"logit scale {logit_scale:6}: {name:45} "
                  + " ".join(f"{n} {e:.1e}" for n, e in errors.items()), flush=True)
    write(rows, shape, out)


def write(rows, shape: dict, out: str) -> None:
    h, c = shape["history"], shape["candidates"]
    sessions = f"two packed sessions of {h} history + {c} candidates"
    shape = (f"batch={shape['batch']}, seq={2 * (h + c) + 1}, q_heads={shape['q_heads']}, "
             f"kv_heads={shape['kv_heads']}, head_dim={shape['head_dim']}")
    lines = ["# Accuracy of the float32 backends: pallas_triton's precision modes, the cpu "
             "kernel and xla", "",
             "Generated by `benchmarks/precision.py`; do not edit by hand. Reproduce with", "",
             f"    {COMMAND}", "",
             f"{datetime.datetime.now():%Y-%m-%d %H:%M}: jax {jax.__version__}, "
             f"{peers.machine_description()}; pallas_triton in Pallas interpret mode "
             "(tensor-core rounding emulated); float32 inputs.", "",
             f"{shape}; {sessions} and one padding "
             "token. Each cell is max |error| / max |float64 result| over the output, the "
             "natural-log lse and the gradients of `sum(out * w) + sum(lse)`. 'logit std' is "
             "the standard deviation of q's entries (k ~ N(0, 1), default scale 1 / sqrt(D)), "
             "so about the logits' too. The row '" + YARDSTICK + "' rounds only the logits' "
             "dot (one jnp.einsum, and its gradients' dots) to float32: one more order of the "
             "same float32 sums. At logit std 1000 a row's softmax is nearly its argmax: there "
             "the rounding of its largest logits (a float32's ulp is at most 2^-23 of it) "
             "decides the error of the backends whose products are exact float32, and the "
             "order in which a dot adds them matters more than the backend; the tensor-core "
             "modes' rounding of the dots' operands decides theirs.", "",
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
