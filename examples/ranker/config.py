"""Presets: the synthetic world, the packing, the model and the training run, in one place."""

from __future__ import annotations

import dataclasses

ACTIONS = ("like", "reply", "repost", "dwell", "not_interested")
MAIN_ACTION = "like"
# The final ranking score: sum_a SCORE_WEIGHTS[a] * P(a). "not interested" counts against an item.
SCORE_WEIGHTS = {"like": 1.0, "reply": 2.0, "repost": 1.5, "dwell": 0.5, "not_interested": -4.0}


@dataclasses.dataclass(frozen=True)
class WorldConfig:
    users: int
    items: int
    authors: int
    contexts: int = 4            # request surfaces (home, search, ...), each with its own base rates
    latent_dim: int = 4          # taste / item / author latent dimension
    history_min: int = 4         # history lengths: log-normal, clipped to [history_min, history_max]
    history_median: int = 40
    history_max: int = 256
    candidates: int = 8          # candidates per session
    seed: int = 0


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    width: int = 64
    layers: int = 2
    q_heads: int = 4
    kv_heads: int = 2
    head_dim: int = 16
    ffn_mult: int = 4
    hash_buckets: int = 4099     # rows per hash table (row 0 = padding); two hashes per id
    hash_dim: int = 16           # width of one hash lookup
    softcap: float | None = None  # logit soft cap of every attention layer (tanh)
    max_position: int = 4096     # right anchor of the rotary positions: candidates sit here
    rope_base: float = 10000.0


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    row_tokens: int = 512        # token budget of one packed row
    rows: int = 4                # rows per step
    steps: int = 1500
    learning_rate: float = 3e-3
    warmup: int = 100
    weight_decay: float = 0.01
    eval_sessions: int = 4000
    eval_every: int = 500
    log_every: int = 25
    checkpoint_every: int = 500
    keep_checkpoints: int = 2
    seed: int = 1


@dataclasses.dataclass(frozen=True)
class Preset:
    world: WorldConfig
    model: ModelConfig
    train: TrainConfig


PRESETS = {
    "tiny": Preset(WorldConfig(users=20000, items=500, authors=50, candidates=16,
                               history_median=32, history_max=128),
                   ModelConfig(ffn_mult=2),
                   TrainConfig(row_tokens=256, steps=2800, learning_rate=5e-3, warmup=50,
                               eval_sessions=2000)),
    "small": Preset(WorldConfig(users=200000, items=20000, authors=1000, latent_dim=8,
                                history_median=200, history_max=1022, candidates=32),
                    ModelConfig(width=256, layers=4, q_heads=8, kv_heads=2, head_dim=32,
                                hash_buckets=65521, hash_dim=32, softcap=30.0),
                    TrainConfig(row_tokens=2048, rows=8, steps=6000, learning_rate=1e-3,
                                warmup=300, eval_sessions=8000, eval_every=1000,
                                checkpoint_every=1000)),
}
