"""Synthetic long histories with planted relevant items, for Quest tests and benchmarks.

Every history key and value is standard Gaussian noise, except one planted item
per candidate: for candidate t of user u, a random query head h* gets the history
key ``margin * q / |q|`` (q: that head's query) and a marker value. With the
default scale 1 / sqrt(D), head h's noise logits are N(0, sigma_h^2) with
sigma_h = |q_h| / sqrt(D), and the planted logit is ``margin * sigma_h``: it
stands ``margin`` noise standard deviations above the noise (for a head of
unit scale, ``margin`` logits). Query heads have different norms
(:func:`head_scales`, spread inside every GQA group), which is what makes the
group rule matter: a rule that lets the largest-norm head decide misses items
planted for the small-norm heads.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np


@dataclasses.dataclass(frozen=True)
class Planted:
    """Host (numpy) arrays of one synthetic workload."""

    k_hist: np.ndarray    # [U, S, Hkv, D] float32
    v_hist: np.ndarray    # [U, S, Hkv, D] float32
    q: np.ndarray         # [U, T, Hq, D] float32
    position: np.ndarray  # [U, T] int: the planted token of candidate t (-1: none planted)
    head: np.ndarray      # [U, T] int: the query head it is aligned with
    marker: np.ndarray    # [D] float32: the planted value

    def page_hits(self, pages: np.ndarray, page_size: int) -> np.ndarray:
        """bool [U, T]: whether ``pages`` [U, T, Hq, n] (select_pages) holds each planted page."""
        u, t = np.indices(self.position.shape)
        chosen = pages[u, t, self.head]                       # [U, T, n]
        return (chosen == (self.position // page_size)[..., None]).any(-1)


def head_scales(q_heads: int, kv_heads: int, spread: float = 4.0) -> np.ndarray:
    """Query head norms, log-spaced over [1/sqrt(spread), sqrt(spread)] inside every group."""
    group = q_heads // kv_heads
    within = np.geomspace(1 / math.sqrt(spread), math.sqrt(spread), group) if group > 1 else [1.0]
    return np.tile(np.asarray(within, np.float32), kv_heads)


def planted_history(seed: int, *, users: int, history: int, candidates: int, q_heads: int,
                    kv_heads: int, head_dim: int, margin: float | None = 12.0,
                    spread: float = 4.0, avoid: int = 0) -> Planted:
    """Gaussian histories [U, S=history] with one planted item per candidate (margin=None: none).

    ``avoid`` tokens at both ends of each history get no planted item (so that
    sink / recent pages, which are always kept, do not find it for free).
    """
    rng = np.random.default_rng(seed)
    g = q_heads // kv_heads
    k = rng.standard_normal((users, history, kv_heads, head_dim), np.float32)
    v = rng.standard_normal((users, history, kv_heads, head_dim), np.float32)
    q = rng.standard_normal((users, candidates, q_heads, head_dim), np.float32)
    q *= head_scales(q_heads, kv_heads, spread)[:, None]
    marker = np.full(head_dim, 4.0, np.float32)
    position = np.full((users, candidates), -1)
    head = rng.integers(0, q_heads, (users, candidates))
    if margin is not None:
        for u in range(users):
            position[u] = avoid + rng.choice(history - 2 * avoid, candidates, replace=False)
            for t in range(candidates):
                h, p = head[u, t], position[u, t]
                k[u, p, h // g] = margin * q[u, t, h] / np.linalg.norm(q[u, t, h])
                v[u, p, h // g] = marker
    return Planted(k, v, q, position, head, marker)
