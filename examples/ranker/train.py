"""Training: packed batches from the synthetic world, AdamW, metrics, checkpoints, evaluation."""

from __future__ import annotations

import json
import math
import os
import time

import jax
import numpy as np
import optax
import orbax.checkpoint as ocp
from flax import nnx
from tqdm import tqdm

from examples.ranker import evaluate, serve
from examples.ranker.config import ACTIONS, MAIN_ACTION, Preset
from examples.ranker.model import candidate_loss, init
from examples.ranker.packing import efficiency, pack
from examples.ranker.world import World, auc


def training_batch(world: World, preset: Preset, step: int):
    """The packed batch of ``step`` (a pure function of the seed and step, so resumes replay it)."""
    t, w = preset.train, preset.world
    rng = np.random.default_rng([t.seed, step])
    # Enough sessions to fill every row first-fit; the ones that find no room are dropped.
    per_session = 1 + min(w.history_median * math.exp(0.32), w.history_max) + w.candidates
    sessions = world.sample(rng, int(1.5 * t.rows * t.row_tokens / per_session) + 1)
    batch, _ = pack(sessions, t.row_tokens, preset.model.max_position, rows=t.rows)
    return batch


def optimizer(preset: Preset):
    t = preset.train
    schedule = optax.warmup_cosine_decay_schedule(0.0, t.learning_rate, t.warmup, t.steps,
                                                  end_value=t.learning_rate * 0.05)
    return optax.chain(optax.clip_by_global_norm(1.0),
                       optax.adamw(schedule, weight_decay=t.weight_decay))


def make_step(graphdef, tx, attention=None):
    """The jitted train step (params, opt_state, batch) -> (params, opt_state, loss)."""
    def loss_fn(params, batch):
        return candidate_loss(nnx.merge(graphdef, params)(batch, attention), batch)

    @jax.jit
    def step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss
    return step


def checkpoints(preset: Preset, out: str) -> ocp.CheckpointManager:
    return ocp.CheckpointManager(
        os.path.abspath(os.path.join(out, "checkpoints")),
        options=ocp.CheckpointManagerOptions(max_to_keep=preset.train.keep_checkpoints,
                                             create=True))


def restore(preset: Preset, manager: ocp.CheckpointManager):
    """(step, graphdef, params, opt_state) of the newest checkpoint, or of a fresh model (step 0)."""
    graphdef, params = init(preset.model, len(ACTIONS), preset.world.contexts, preset.train.seed)
    opt_state = optimizer(preset).init(params)
    step = manager.latest_step()
    if step is None:
        return 0, graphdef, params, opt_state
    restored = manager.restore(step, args=ocp.args.StandardRestore(
        dict(params=params, opt_state=opt_state)))
    return step, graphdef, restored["params"], restored["opt_state"]


def eval_sessions(world: World, preset: Preset):
    return world.sample(np.random.default_rng([preset.train.seed, 1 << 30]),
                        preset.train.eval_sessions)


def train(preset: Preset, out: str, steps: int | None = None, progress: bool = True) -> dict:
    """Train (resuming from ``out``'s last checkpoint), evaluate, check serving; write metrics.

    Writes ``out/metrics.jsonl`` (a line per log interval and evaluation) and
    ``out/checkpoints/`` (the last ``keep_checkpoints``); returns the final
    metrics (the CLI writes them to ``out/metrics.json``).
    """
    t = preset.train
    steps = t.steps if steps is None else steps
    os.makedirs(out, exist_ok=True)
    world = World(preset.world)
    manager = checkpoints(preset, out)
    start, graphdef, params, opt_state = restore(preset, manager)
    tx = optimizer(preset)
    step_fn = make_step(graphdef, tx)
    evals = eval_sessions(world, preset)
    log = open(os.path.join(out, "metrics.jsonl"), "a")
    bar = tqdm(range(start, steps), initial=start, total=steps, disable=not progress,
               desc="train", unit="step")
    window_tokens, window_start, losses = 0, time.perf_counter(), []
    for step in bar:
        batch = training_batch(world, preset, step)
        params, opt_state, loss = step_fn(params, opt_state, batch)
        losses.append(loss)
        window_tokens += int((batch.kind != 0).sum())
        done = step + 1
        if done % t.log_every == 0 or done == steps:
            mean_loss = float(np.mean(jax.device_get(losses)))
            rate = window_tokens / (time.perf_counter() - window_start)
            bar.set_postfix(loss=f"{mean_loss:.4f}", tokens_per_s=f"{rate:,.0f}")
            _write(log, dict(step=done, loss=mean_loss, tokens_per_s=rate,
                             packing_efficiency=efficiency(batch)))
            window_tokens, window_start, losses = 0, time.perf_counter(), []
        if done % t.checkpoint_every == 0 or done == steps:
            manager.save(done, args=ocp.args.StandardSave(dict(params=params, opt_state=opt_state)))
        if done % t.eval_every == 0 and done != steps:
            _write(log, dict(step=done, eval=_main_auc(graphdef, params, evals, world, preset)))
    manager.wait_until_finished()
    metrics = final_metrics(graphdef, params, evals, world, preset)
    metrics["steps"] = steps
    _write(log, dict(step=steps, eval=metrics))
    return metrics


def _main_auc(graphdef, params, sessions, world, preset) -> dict:
    logits = _full(graphdef, params, sessions, preset)
    a = ACTIONS.index(MAIN_ACTION)
    return dict(auc=auc(sessions.labels[..., a], logits[..., a]),
                oracle_auc=auc(sessions.labels[..., a], sessions.probs[..., a]))


def _full(graphdef, params, sessions, preset):
    t = preset.train
    return evaluate.full_logits(graphdef, params, sessions, t.row_tokens, t.rows,
                                preset.model.max_position)


def final_metrics(graphdef, params, sessions, world: World, preset: Preset) -> dict:
    """Per-head metrics of the full forward pass, and the cached scores' distance to it."""
    full = _full(graphdef, params, sessions, preset)
    heads = evaluate.head_metrics(sessions, full, world)
    serving_sessions = sessions.take(slice(0, 256))
    cached = np.asarray(serve.cached_logits(graphdef, params, serving_sessions,
                                            preset.model.max_position))
    return dict(main_action=MAIN_ACTION,
                auc={a: heads[a]["auc"] for a in ACTIONS},
                oracle_auc={a: heads[a]["oracle_auc"] for a in ACTIONS},
                impersonal_auc={a: heads[a]["impersonal_auc"] for a in ACTIONS},
                log_loss={a: heads[a]["log_loss"] for a in ACTIONS},
                calibration={a: heads[a]["calibration"] for a in ACTIONS},
                final_score_corr=heads["final_score_corr"],
                cached_vs_full_max_abs_diff=float(np.abs(cached - full[:256]).max()))


def _write(log, record: dict):
    log.write(json.dumps(record) + "\n")
    log.flush()
