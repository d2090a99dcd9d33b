"""``rankattn demo``: candidate isolation on a Phoenix-shaped batch, checked and timed."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import rankattn
from rankattn import peers, semantics
from rankattn.api import select_backend
from rankattn.backends import BACKENDS
from rankattn.validate import check_attention_args

PREFIX, HISTORY, CANDIDATES = 2, 1022, 64
Q_HEADS, KV_HEADS, HEAD_DIM = 4, 2, 128


def phoenix_segment_ids(batch: int, prefix: int, history: int, candidates: int):
    """User prefix + history = segment 1, candidates = segment -1, one session per row."""
    row = np.concatenate([np.ones(prefix + history, np.int32), -np.ones(candidates, np.int32)])
    return jnp.asarray(np.tile(row, (batch, 1)))


def draw_mask(segment_ids, causal: bool = False) -> str:
    """The mask of one row as text: rows are queries, columns keys, '#' = visible."""
    mask = np.asarray(semantics.dense_mask(segment_ids[None], segment_ids[None], causal)[0])
    names = {0: "pad"}
    labels = [names.get(int(s), f"{'hist' if s > 0 else 'cand'}{abs(int(s))}") for s in segment_ids]
    lines = ["          " + "".join(str(j % 10) for j in range(len(labels)))]
    for i, label in enumerate(labels):
        lines.append(f"{label:>6} {i:2} " + "".join("#" if m else "." for m in mask[i]))
    return "\n".join(lines)


def chosen_backend(q, k, v, segment_ids) -> str:
    """The backend impl='auto' picks for this call; on CPU, why the fused kernel was not it."""
    call = check_attention_args(q, k, v, segment_ids=segment_ids, bounds=None, causal=False,
                                scale=None, softcap=None, softcap_method="tanh", plan=None)
    chosen = select_backend("auto", call).name
    why = BACKENDS["cpu"].platform_reasons() or BACKENDS["cpu"].not_supported_reasons(call)
    if chosen != "cpu" and jax.default_backend() == "cpu" and why:
        return f"{chosen!r} ({'; '.join(why)})"
    return repr(chosen)


def run(batch: int = 4, repeats: int = 5) -> int:
    print("rankattn demo: candidate-isolation attention\n")
    print("The mask, on a small packed row (2 sessions: history, then candidates; then padding):")
    print(draw_mask(jnp.array([1, 1, 1, 1, -1, -1, -1, 2, 2, -2, -2, 0], jnp.int32)))
    print("History sees its session's history; each candidate sees that history and itself only.\n")

    seq = PREFIX + HISTORY + CANDIDATES
    print(f"Phoenix-shaped batch: B={batch}, {PREFIX} prefix + {HISTORY} history + {CANDIDATES} "
          f"candidates = S {seq}, {Q_HEADS} q / {KV_HEADS} kv heads, head dim {HEAD_DIM}, float32, "
          f"backend {jax.default_backend()}.")
    keys = jax.random.split(jax.random.PRNGKey(0), 3)
    q = jax.random.normal(keys[0], (batch, seq, Q_HEADS, HEAD_DIM), jnp.float32)
    k = jax.random.normal(keys[1], (batch, seq, KV_HEADS, HEAD_DIM), jnp.float32)
    v = jax.random.normal(keys[2], (batch, seq, KV_HEADS, HEAD_DIM), jnp.float32)
    seg = phoenix_segment_ids(batch, PREFIX, HISTORY, CANDIDATES)

    print(f"impl='auto' runs the {chosen_backend(q, k, v, seg)} backend here.")
    fast = jax.jit(lambda q, k, v, seg: rankattn.attention(q, k, v, segment_ids=seg, impl="auto"))
    ref = jax.jit(lambda q, k, v, seg: rankattn.attention(q, k, v, segment_ids=seg,
                                                          impl="reference"))
    dense = jax.jit(peers.jax_nn_attention)
    out, want = fast(q, k, v, seg), ref(q, k, v, seg)
    err = float(jnp.abs(out - want).max())
    ok = err < 1e-4
    print(f"\n1. Matches the dense reference: max |error| = {err:.2e} "
          f"({'ok' if ok else 'FAILED'}, tolerance 1e-4).")

    # Candidate isolation: rewrite every candidate but the first; the first
    # candidate's output (and every history output) must not move at all.
    first = PREFIX + HISTORY
    noise = jax.random.normal(jax.random.PRNGKey(1), q[:, first + 1:].shape)
    q2 = q.at[:, first + 1:].set(noise)
    k2 = k.at[:, first + 1:].set(noise[:, :, :KV_HEADS])
    v2 = v.at[:, first + 1:].set(-noise[:, :, :KV_HEADS])
    out2 = fast(q2, k2, v2, seg)
    moved = float(jnp.abs(out2[:, :first + 1] - out[:, :first + 1]).max())
    others = float(jnp.abs(out2[:, first + 1:] - out[:, first + 1:]).max())
    isolated = moved == 0.0 and others > 0
    print(f"2. Candidate isolation: after rewriting the other {CANDIDATES - 1} candidates, the first "
          f"candidate and all history outputs moved by {moved:.1e} "
          f"({'ok' if isolated else 'FAILED'}; the rewritten candidates moved by {others:.2f}).")

    times = peers.interleaved_medians({
        "rankattn (auto)": lambda: fast(q, k, v, seg),
        "dense reference": lambda: ref(q, k, v, seg),
        "jax.nn.dot_product_attention + dense mask": lambda: dense(q, k, v, seg),
    }, repeats)
    ours = times["rankattn (auto)"]
    print(f"3. Forward time, median of {repeats} interleaved runs:")
    for name, t in times.items():
        ratio = "" if name.startswith("rankattn") else f"  ({t / ours:.2f}x rankattn's time)"
        print(f"   {name:44s} {t * 1e3:8.1f} ms{ratio}")
    return 0 if ok and isolated else 1
