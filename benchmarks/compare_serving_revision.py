"""serving.attend without a budget at another git revision against the working tree's (CPU).

    .venv/bin/python benchmarks/compare_serving_revision.py REV [--repeats 15]
    .venv/bin/python benchmarks/compare_serving_revision.py HEAD --smoke   # tiny shapes, 1 round

Loads ``src/rankattn/serving/scoring.py`` as it was at ``REV`` beside today's and times
``attend(q, cache, users, self_kv=...)`` with both, round-robin in one process
(rankattn.peers.interleaved_times), over full float32 histories in pages of 16 at the
shapes below: few and many query rows per kv head, short and long histories. Prints
medians and the median and quartiles of per-round ratios REV / working tree (> 1: faster
than REV). Everything scoring.py imports is today's (the cpu kernel included), so REV must
be close enough: 10b2a8e, the XLA page loop's last revision, is.
"""

from __future__ import annotations

import argparse
import os
import sys
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from compare_revision import module_at  # noqa: E402
from rankattn import peers, serving  # noqa: E402

# (users, history, candidates, q heads, kv heads, head dim)
SHAPES = [(4, 1022, 4, 4, 2, 128), (4, 1022, 8, 4, 2, 128), (4, 1022, 64, 4, 2, 128),
          (4, 1022, 256, 4, 2, 128), (4, 1022, 64, 20, 4, 128), (4, 4096, 64, 4, 2, 128),
          (4, 4096, 12, 8, 2, 64), (4, 16384, 12, 8, 2, 64),
          (4, 65536, 12, 8, 2, 64)]
SMOKE_SHAPES = [(2, 40, 4, 4, 2, 128), (2, 40, 12, 8, 2, 64)]  # few and many rows per kv head


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("rev")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--smoke", action="store_true",
                        help="check the script: SMOKE_SHAPES, one round")
    args = parser.parse_args()
    then = module_at(args.rev, "src/rankattn/serving/scoring.py", "scoring_at_rev")
    repeats = 1 if args.smoke else args.repeats
    for u, s, c, hq, hkv, d in SMOKE_SHAPES if args.smoke else SHAPES:
        rng = np.random.default_rng(0)
        k, v = (jnp.asarray(rng.standard_normal((u, s, hkv, d), np.float32)) for _ in range(2))
        q = jnp.asarray(rng.standard_normal((u, c, hq, d), np.float32))
        ks, vs = (jnp.asarray(rng.standard_normal((u, c, hkv, d), np.float32)) for _ in range(2))
        cache = serving.cache_from_history(k, v, jnp.full((u,), s), page_size=16)
        variants = (("rev", then.attend, {}), ("now", serving.attend, {}))
        fns = {name: partial(jax.jit(lambda cache, q, ks, vs, f=f, kw=kw: f(
            q, cache, jnp.arange(u), self_kv=(ks, vs), **kw)), cache, q, ks, vs)
            for name, f, kw in variants}
        t = peers.interleaved_times(fns, repeats)
        line = f"{u} x {s} x {c}, {hq}/{hkv} heads, D={d}: {args.rev} {np.median(t['rev']) * 1e3:.1f} ms"
        ratio = t["rev"] / t["now"]
        line += (f"; now {np.median(t['now']) * 1e3:.1f} ms, {args.rev} / now "
                 f"{np.median(ratio):.2f} ({np.quantile(ratio, 0.25):.2f}-"
                 f"{np.quantile(ratio, 0.75):.2f})")
        print(line, flush=True)


if __name__ == "__main__":
    main()
