"""Benchmarks of the example, side by side in one process (interleaved rounds, median ratios).

* Train step: the model with rankattn against the same model whose attention is
  ``jax.nn.dot_product_attention`` with the equivalent dense mask, on the
  preset's packed rows (soft cap off in both: jax.nn has none).
* Serving: one request of 1022 history events and 64 candidates, scored
  against the cached history against the full forward pass over all 1087 tokens.

``smoke_preset`` and SMOKE_SERVING are the smallest shapes, for checking the benchmark
end to end (``python -m examples.ranker bench --smoke``).
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from rankattn import peers

from examples.ranker import serve, train
from examples.ranker.config import ACTIONS, Preset
from examples.ranker.evaluate import _logits
from examples.ranker.model import init
from examples.ranker.packing import pack
from examples.ranker.world import World

SERVING_HISTORY, SERVING_CANDIDATES = 1022, 64
SMOKE_SERVING = dict(history=30, candidates=4)


def smoke_preset(preset: Preset) -> Preset:
    """``preset`` with one layer and one short packed row per train step."""
    return dataclasses.replace(preset, model=dataclasses.replace(preset.model, layers=1),
                               train=dataclasses.replace(preset.train, rows=1, row_tokens=128))


def _ratios(times: dict, ours: str) -> dict:
    """Per implementation: median ms, and the median over rounds of its time / ours."""
    return {name: dict(ms=1e3 * float(np.median(t)), ratio=float(np.median(t / times[ours])))
            for name, t in times.items()}


def train_step(preset: Preset, repeats: int) -> dict:
    """Train-step times of rankattn and jax.nn (dense mask) on the same packed batch."""
    preset = dataclasses.replace(preset, model=dataclasses.replace(preset.model, softcap=None))
    world = World(preset.world)
    batch = jax.device_put(train.training_batch(world, preset, 0))
    graphdef, params = init(preset.model, len(ACTIONS), preset.world.contexts, 0)
    tx = train.optimizer(preset)
    opt_state = tx.init(params)
    dense = lambda q, k, v, seg: peers.jax_nn_attention(q, k, v, seg)  # noqa: E731
    steps = {"rankattn": train.make_step(graphdef, tx),
             "jax.nn dense mask": train.make_step(graphdef, tx, attention=dense)}
    fns = {name: (lambda s=s: s(params, opt_state, batch)) for name, s in steps.items()}
    times = peers.interleaved_times(fns, repeats)
    out = _ratios(times, "rankattn")
    out["shape"] = dict(rows=int(batch.kind.shape[0]), row_tokens=int(batch.kind.shape[1]),
                        sessions_per_row=float((batch.session.max() + 1) / batch.kind.shape[0]))
    return out


def serving(preset: Preset, repeats: int, history: int = SERVING_HISTORY,
            candidates: int = SERVING_CANDIDATES) -> dict:
    """Per-request latency: cached scoring against the full forward pass."""
    cfg = dataclasses.replace(preset.world, history_min=history, history_median=history,
                              history_max=history, candidates=candidates)
    world = World(cfg)
    request = world.sample(np.random.default_rng(0), 1)
    anchor = preset.model.max_position
    graphdef, params = init(preset.model, len(ACTIONS), cfg.contexts, 0)
    tokens = 1 + history + candidates
    full_batch = jax.device_put(pack(request, tokens, anchor)[0])
    caches = serve.build_caches(graphdef, params, request, anchor)
    candidates = jax.device_put(serve.candidate_batch(request, anchor))
    users = jax.numpy.arange(1)
    fns = {"cached": lambda: serve.score(graphdef, params, candidates, caches, users, None,
                                         "group"),
           "full forward": lambda: _logits(graphdef, params, full_batch),
           "history forward (once per user)":
               lambda: serve.build_caches(graphdef, params, request, anchor)}
    out = _ratios(peers.interleaved_times(fns, repeats), "cached")
    out["shape"] = dict(history=cfg.history_max, candidates=cfg.candidates)
    return out
