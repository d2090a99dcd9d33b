"""Full-forward predictions on packed rows, and the metrics per action head."""

from __future__ import annotations

import jax
import numpy as np
from flax import nnx

from examples.ranker.config import ACTIONS, SCORE_WEIGHTS
from examples.ranker.packing import Batch, pack
from examples.ranker.world import Sessions, World, auc


@jax.jit
def _logits(graphdef, params, batch: Batch):
    return nnx.merge(graphdef, params)(batch)


def full_logits(graphdef, params, sessions: Sessions, row_tokens: int, rows: int, anchor: int):
    """Logits [N, C, A] of every session's candidates from the full forward pass on packed rows.

    All sessions are packed first-fit into rows of ``row_tokens``, then run
    ``rows`` rows at a time (one compiled shape; the last chunk is padded).
    """
    batch, packed = pack(sessions, row_tokens, anchor)
    total = -(-batch.kind.shape[0] // rows) * rows
    batch = Batch(*(_pad_rows(name, a, total) for name, a in zip(Batch._fields, batch)))
    n, c = sessions.cand_item.shape
    out = np.zeros((n, c, len(ACTIONS)), np.float32)
    for lo in range(0, total, rows):
        chunk = Batch(*(a[lo:lo + rows] for a in batch))
        logits = np.asarray(_logits(graphdef, params, chunk))
        where = chunk.candidate >= 0
        out[packed[chunk.session[where]], chunk.candidate[where]] = logits[where]
    return out


def _pad_rows(name: str, a, rows: int):
    """Field ``name`` of a batch, [r, ...], padded with empty rows to [rows, ...]."""
    fill = -1 if name in ("session", "candidate") else 0
    return np.concatenate([a, np.full((rows - a.shape[0],) + a.shape[1:], fill, a.dtype)])


def sigmoid(x):
    return 1.0 / (1.0 + np.exp(-np.asarray(x, np.float64)))


def head_metrics(sessions: Sessions, logits, world: World) -> dict:
    """Per action: AUC, log-loss and calibration of the model, beside the oracle's AUC.

    ``oracle_auc`` scores with the generator's true probabilities (the best any
    model can do on these labels); ``impersonal_auc`` with the true model minus
    the user's taste (what popularity and context alone reach).
    """
    probs = np.clip(sigmoid(logits), 1e-7, 1 - 1e-7)
    impersonal = world.impersonal_probs(sessions)
    out = {}
    for a, name in enumerate(ACTIONS):
        y, p = sessions.labels[..., a], probs[..., a]
        out[name] = dict(
            auc=auc(y, p), oracle_auc=auc(y, sessions.probs[..., a]),
            impersonal_auc=auc(y, impersonal[..., a]),
            log_loss=float(-(y * np.log(p) + (1 - y) * np.log(1 - p)).mean()),
            calibration=float(p.mean() / max(y.mean(), 1e-12)))  # mean predicted / mean observed
    weights = np.array([SCORE_WEIGHTS[a] for a in ACTIONS])
    out["final_score_corr"] = float(np.corrcoef((probs * weights).sum(-1).ravel(),
                                                (sessions.probs * weights).sum(-1).ravel())[0, 1])
    return out
