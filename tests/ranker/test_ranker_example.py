"""The reference ranker example (examples/ranker) at a micro size: packing, serving, training."""

from __future__ import annotations

import dataclasses
import json
import os

import numpy as np
import pytest
from tolerances import RANKER_CACHED_TOL

from examples.ranker import __main__ as cli
from examples.ranker import evaluate, serve
from examples.ranker.config import ACTIONS, PRESETS, ModelConfig, TrainConfig, WorldConfig, Preset
from examples.ranker.model import init
from examples.ranker.packing import CANDIDATE, HISTORY, USER, efficiency, pack, unpack
from examples.ranker.world import World, auc

MICRO = Preset(WorldConfig(users=500, items=200, authors=20, history_median=12, history_max=60,
                           candidates=4),
               ModelConfig(width=32, layers=2, q_heads=4, kv_heads=2, head_dim=8,
                           hash_buckets=257, hash_dim=8, max_position=128),
               TrainConfig(row_tokens=96, rows=4, steps=40, learning_rate=3e-3, warmup=5,
                           eval_sessions=64, eval_every=20, log_every=5, checkpoint_every=10,
                           keep_checkpoints=2))
ANCHOR = MICRO.model.max_position


@pytest.fixture(scope="module")
def world():
    return World(MICRO.world)


@pytest.fixture(scope="module")
def sessions(world):
    return world.sample(np.random.default_rng(0), 24)


def test_world_is_deterministic_and_labels_follow_probs(world):
    a, b = (World(MICRO.world).sample(np.random.default_rng(7), 8) for _ in range(2))
    for f in dataclasses.fields(a):
        np.testing.assert_array_equal(getattr(a, f.name), getattr(b, f.name))
    big = world.sample(np.random.default_rng(1), 2000)
    # Labels are Bernoulli(probs): their means agree per action within sampling noise.
    n = big.labels[..., 0].size
    for i in range(len(ACTIONS)):
        p, y = big.probs[..., i].mean(), big.labels[..., i].mean()
        assert abs(p - y) < 5 * np.sqrt(p * (1 - p) / n), ACTIONS[i]
    assert (big.history_len <= MICRO.world.history_max).all()
    assert big.history_len.max() == MICRO.world.history_max  # some histories were cut


def test_auc_matches_pairwise_count_with_ties():
    rng = np.random.default_rng(0)
    labels = rng.random(300) < 0.3
    scores = rng.integers(0, 10, 300).astype(float)  # many ties
    pos, neg = scores[labels], scores[~labels]
    expected = ((pos[:, None] > neg[None]).sum() + 0.5 * (pos[:, None] == neg[None]).sum()) / (
        len(pos) * len(neg))
    assert auc(labels, scores) == pytest.approx(expected, abs=1e-12)


def test_packing_round_trip_and_layout(sessions):
    row_tokens = 24  # shorter than some sessions: their histories are cut to the newest events
    batch, packed = pack(sessions, row_tokens, ANCHOR)
    np.testing.assert_array_equal(packed, np.arange(len(sessions)))
    c = sessions.cand_item.shape[1]
    assert 0 < efficiency(batch) <= 1
    cut = 0
    for s, got in enumerate(unpack(batch)):
        n = sessions.history_len[s]
        keep = min(n, row_tokens - 1 - c)
        cut += keep < n
        newest = slice(n - keep, n)
        assert (got["user"], got["context"]) == (sessions.user[s], sessions.context[s])
        np.testing.assert_array_equal(got["history_item"], sessions.history_item[s, newest])
        np.testing.assert_array_equal(got["history_author"], sessions.history_author[s, newest])
        np.testing.assert_array_equal(got["history_actions"], sessions.history_actions[s, newest])
        np.testing.assert_array_equal(got["cand_item"], sessions.cand_item[s])
        np.testing.assert_array_equal(got["labels"], sessions.labels[s])
    assert cut > 0
    for row in range(batch.kind.shape[0]):
        seg, kind, pos = batch.segment_ids[row], batch.kind[row], batch.positions[row]
        for s in set(np.abs(seg[seg != 0])):
            hist, cand = seg == s, seg == -s
            assert (kind[cand] == CANDIDATE).all() and (pos[cand] == ANCHOR).all()
            assert kind[hist][0] == USER and (kind[hist][1:] == HISTORY).all()
            np.testing.assert_array_equal(pos[hist], ANCHOR - np.arange(hist.sum(), 0, -1))


@pytest.mark.parametrize("softcap", [None, 5.0])
def test_cached_scores_equal_full_forward_and_are_isolated(sessions, world, softcap):
    preset = dataclasses.replace(MICRO, model=dataclasses.replace(MICRO.model, softcap=softcap))
    graphdef, params = init(preset.model, len(ACTIONS), MICRO.world.contexts, seed=3)
    full = evaluate.full_logits(graphdef, params, sessions, 96, 4, ANCHOR)
    caches = serve.build_caches(graphdef, params, sessions, ANCHOR)
    cached = np.asarray(serve.cached_logits(graphdef, params, sessions, ANCHOR, caches=caches))
    np.testing.assert_allclose(cached, full, atol=RANKER_CACHED_TOL, rtol=0)
    assert np.abs(full).max() > 0.1  # a real comparison, not of zeros

    # Replace every other candidate: candidate 0's logits stay bit for bit, in both paths.
    items = sessions.cand_item.copy()
    items[:, 1:] = (items[:, 1:] % MICRO.world.items) + 1
    swapped = dataclasses.replace(sessions, cand_item=items, cand_author=world.item_author[items])
    full2 = evaluate.full_logits(graphdef, params, swapped, 96, 4, ANCHOR)
    cached2 = np.asarray(serve.cached_logits(graphdef, params, swapped, ANCHOR, caches=caches))
    np.testing.assert_array_equal(full2[:, 0], full[:, 0])
    np.testing.assert_array_equal(cached2[:, 0], cached[:, 0])
    assert not np.array_equal(full2[:, 1:], full[:, 1:])


def test_quest_with_every_page_kept_is_exact(sessions):
    graphdef, params = init(MICRO.model, len(ACTIONS), MICRO.world.contexts, seed=4)
    caches = serve.build_caches(graphdef, params, sessions, ANCHOR)
    exact = serve.cached_logits(graphdef, params, sessions, ANCHOR, caches=caches)
    pages = int(np.ceil((1 + MICRO.world.history_max) / serve.PAGE_SIZE))
    budget = pages * serve.PAGE_SIZE
    assert serve.pages_kept(sessions, budget) == 1.0
    kept = serve.cached_logits(graphdef, params, sessions, ANCHOR, budget, caches=caches)
    np.testing.assert_allclose(np.asarray(kept), np.asarray(exact), atol=RANKER_CACHED_TOL, rtol=0)
    fewer = serve.cached_logits(graphdef, params, sessions, ANCHOR, serve.PAGE_SIZE * 3,
                                caches=caches)
    assert not np.allclose(np.asarray(fewer), np.asarray(exact), atol=RANKER_CACHED_TOL)


def test_train_cli_loss_decreases_resumes_and_serves(tmp_path, monkeypatch):
    monkeypatch.setitem(PRESETS, "micro", MICRO)
    out = str(tmp_path / "run")
    cli.main(["train", "--preset", "micro", "--out", out, "--steps", "30", "--no-progress"])
    cli.main(["train", "--preset", "micro", "--out", out, "--no-progress"])  # resumes at 30
    records = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    losses = [r["loss"] for r in records if "loss" in r]
    steps = [r["step"] for r in records if "loss" in r]
    assert steps == list(range(5, 31, 5)) + list(range(35, 41, 5))
    assert np.mean(losses[-2:]) < 0.9 * np.mean(losses[:2])
    checkpoints = sorted(int(d) for d in os.listdir(os.path.join(out, "checkpoints")))
    assert checkpoints == [30, 40]
    metrics = json.load(open(os.path.join(out, "metrics.json")))
    for key in ("auc", "oracle_auc"):
        assert set(metrics[key]) == set(ACTIONS)
    assert metrics["cached_vs_full_max_abs_diff"] < 1e-5
    assert 0.5 < metrics["oracle_auc"]["like"] <= 1

    # The resumed run equals an uninterrupted one: batches are a function of the step.
    straight = str(tmp_path / "straight")
    cli.main(["train", "--preset", "micro", "--out", straight, "--no-progress"])
    again = json.load(open(os.path.join(straight, "metrics.json")))
    assert again["auc"] == pytest.approx(metrics["auc"], abs=1e-6)

    cli.main(["serve", "--preset", "micro", "--out", out])
    serving = json.load(open(os.path.join(out, "serving.json")))
    assert serving["isolation_bit_identical"] and serving["cached_vs_full_max_abs_diff"] < 1e-5
    assert [q["budget"] for q in serving["quest"]] == [None, 48]


def test_serving_through_the_history_store_is_exact_and_never_stale(sessions, world):
    """A store smaller than the sessions (8 slots for 24 users: evictions every batch), fed by
    the history pass of what it misses: every logit equals the full forward pass, a repeated
    request hits, and a changed history or context (same user, same length) is recomputed."""
    graphdef, params = init(MICRO.model, len(ACTIONS), MICRO.world.contexts, seed=5)
    store = serve.make_store(MICRO.model, MICRO.world.history_max, users=8)
    full = evaluate.full_logits(graphdef, params, sessions, 96, 4, ANCHOR)
    for lo in range(0, len(sessions), 8):
        batch = sessions.take(np.arange(lo, lo + 8))
        logits, sources = serve.store_logits(store, graphdef, params, batch, ANCHOR)
        np.testing.assert_allclose(logits, full[lo:lo + 8], atol=RANKER_CACHED_TOL, rtol=0)
        assert sources == ["miss"] * 8
    again, sources = serve.store_logits(store, graphdef, params, batch, ANCHOR)
    assert sources == ["device"] * 8
    np.testing.assert_array_equal(again, logits)
    assert store.stats()["evictions"] == 16

    actions = batch.history_actions.copy()
    actions[0, 0] = ~actions[0, 0]                        # one action of session 0 changed
    contexts = batch.context.copy()
    contexts[1] = (contexts[1] + 1) % MICRO.world.contexts  # session 1's context changed
    changed = dataclasses.replace(batch, history_actions=actions, context=contexts)
    logits, sources = serve.store_logits(store, graphdef, params, changed, ANCHOR)
    assert sources == ["miss", "miss"] + ["device"] * 6
    want = evaluate.full_logits(graphdef, params, changed, 96, 4, ANCHOR)
    np.testing.assert_allclose(logits, want, atol=RANKER_CACHED_TOL, rtol=0)
    assert np.abs(want[:2] - full[16:18]).max() > 1e-3   # the change mattered
