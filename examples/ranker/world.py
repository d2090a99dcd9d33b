"""A synthetic interaction world whose engagement probabilities are known exactly.

Users have latent tastes; items have a latent vector, an author and a
popularity; authors have a latent vector. The probability that user u takes
action a on item i in request context c is a known logistic model:

    affinity(u, i) = (taste_u . item_i + 0.5 * taste_u . author_{author(i)}) / sqrt(d)
    P(a | u, i, c) = sigmoid(bias_a + context_bias[c, a]
                             + affinity_weight[a] * affinity(u, i)
                             + popularity_weight[a] * popularity_i)

A user's history is what they were shown before, drawn from the exposure
distribution P(i | u) ∝ exp(2.5 * affinity(u, i) + 0.5 * popularity_i), with the
actions they took on each event drawn from the same model. Half of a session's
candidates come from that distribution, half uniformly from the catalogue; their
labels are drawn from the model too. Because the generator knows every
probability, ``oracle`` AUCs (scoring with the true probabilities) are the best
any model can reach on the same labels; a model only sees ids and histories, so
it must infer each user's taste from the history.

Every draw takes a ``numpy.random.Generator``; the world itself is fixed by
``WorldConfig.seed``. Ids start at 1: id 0 is padding everywhere.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from examples.ranker.config import ACTIONS, WorldConfig

# Per action: base logit, weight of the user-item affinity, weight of the item's popularity.
BIAS = np.array([-1.0, -3.0, -2.5, 0.0, -3.0])
AFFINITY_WEIGHT = np.array([2.0, 1.5, 1.5, 1.0, -2.0])
POPULARITY_WEIGHT = np.array([0.5, 0.3, 0.8, 0.3, -0.3])
EXPOSURE_AFFINITY, EXPOSURE_POPULARITY = 2.5, 0.5
HISTORY_SIGMA = 0.8  # log-normal spread of history lengths


@dataclasses.dataclass(frozen=True)
class Sessions:
    """N ranking sessions (host arrays). History rows run oldest to newest, left-aligned."""

    user: np.ndarray             # int [N]
    context: np.ndarray          # int [N]
    history_len: np.ndarray      # int [N], kept events (the most recent ones when cut)
    history_item: np.ndarray     # int [N, H], 0 past history_len
    history_author: np.ndarray   # int [N, H]
    history_actions: np.ndarray  # bool [N, H, A]
    cand_item: np.ndarray        # int [N, C]
    cand_author: np.ndarray      # int [N, C]
    labels: np.ndarray           # float32 [N, C, A], drawn from probs
    probs: np.ndarray            # float32 [N, C, A], the true P(action)

    def __len__(self):
        return len(self.user)

    def take(self, index) -> Sessions:
        return Sessions(**{f.name: getattr(self, f.name)[index] for f in dataclasses.fields(self)})


class World:
    """The latent state of one synthetic world (see the module docstring)."""

    def __init__(self, config: WorldConfig):
        self.config = config
        rng = np.random.default_rng(config.seed)
        d = config.latent_dim
        self.taste = rng.standard_normal((config.users + 1, d))
        self.item_vec = rng.standard_normal((config.items + 1, d))
        # Zipf-like authorship: a few prolific authors, many occasional ones.
        author_weight = 1.0 / np.arange(1, config.authors + 1) ** 0.8
        self.item_author = 1 + rng.choice(config.authors, size=config.items + 1,
                                          p=author_weight / author_weight.sum())
        self.author_vec = rng.standard_normal((config.authors + 1, d))
        self.popularity = rng.standard_normal(config.items + 1)
        self.context_bias = 0.5 * rng.standard_normal((config.contexts, len(ACTIONS)))
        self.item_author[0] = 0

    def item_vectors(self, items):
        """float [..., d]: what an item offers a taste: its own vector and half its author's."""
        return self.item_vec[items] + 0.5 * self.author_vec[self.item_author[items]]

    def affinity(self, users, items):
        """float [...]: affinity of users to items, for broadcastable int arrays."""
        dot = (self.taste[users] * self.item_vectors(items)).sum(-1)
        return dot / np.sqrt(self.config.latent_dim)

    def logits(self, users, items, contexts, personal: bool = True):
        """float [..., A]: the true logit of every action (broadcastable int arrays in).

        ``personal=False`` leaves out the user's taste: popularity and context only.
        """
        out = BIAS + self.context_bias[contexts] + POPULARITY_WEIGHT * self.popularity[items][..., None]
        if personal:
            out = out + AFFINITY_WEIGHT * self.affinity(users, items)[..., None]
        return out

    def _exposed(self, rng, users, count: int):
        """int [N, count]: distinct items drawn from each user's exposure distribution."""
        all_items = np.arange(1, self.config.items + 1)
        vectors = self.item_vectors(all_items).T / np.sqrt(self.config.latent_dim)
        out = np.empty((len(users), count), np.int64)
        for lo in range(0, len(users), 256):  # [256, items] scores at a time
            score = (EXPOSURE_AFFINITY * (self.taste[users[lo:lo + 256]] @ vectors)
                     + EXPOSURE_POPULARITY * self.popularity[all_items])
            score += rng.gumbel(size=score.shape)  # Gumbel top-k: sampling without replacement
            top = np.argpartition(-score, count - 1, axis=1)[:, :count]
            out[lo:lo + 256] = all_items[rng.permuted(top, axis=1)]  # in random (time) order
        return out

    def sample(self, rng: np.random.Generator, n: int, long: bool = False) -> Sessions:
        """``n`` sessions of random users, with histories, candidates, labels and true probabilities.

        ``long``: histories of at least half ``history_max`` events, median
        ``history_max`` (before the cut), for serving with Quest.
        """
        c = self.config
        if long:
            c = dataclasses.replace(c, history_min=c.history_max // 2, history_median=c.history_max)
        users = rng.integers(1, c.users + 1, size=n)
        contexts = rng.integers(0, c.contexts, size=n)
        # Natural history lengths run past history_max; a session keeps its most recent events.
        natural = np.exp(np.log(c.history_median) + HISTORY_SIGMA * rng.standard_normal(n))
        natural = np.clip(np.round(natural), c.history_min, min(4 * c.history_max, c.items // 2))
        natural = natural.astype(np.int64)
        kept = np.minimum(natural, c.history_max)
        events = self._exposed(rng, users, int(natural.max()))
        hist_item = np.zeros((n, c.history_max), np.int64)
        for s in range(n):  # the last kept[s] of the natural[s] events, oldest first
            hist_item[s, :kept[s]] = events[s, natural[s] - kept[s]:natural[s]]
        event_context = rng.integers(0, c.contexts, size=hist_item.shape)
        p_hist = _sigmoid(self.logits(users[:, None], hist_item, event_context))
        hist_actions = (rng.random(p_hist.shape) < p_hist) & (hist_item > 0)[..., None]

        n_relevant = c.candidates // 2
        cand_item = np.concatenate(
            [self._exposed(rng, users, n_relevant),
             rng.integers(1, c.items + 1, size=(n, c.candidates - n_relevant))], axis=1)
        cand_item = rng.permuted(cand_item, axis=1)
        probs = _sigmoid(self.logits(users[:, None], cand_item, contexts[:, None]))
        labels = (rng.random(probs.shape) < probs)
        return Sessions(user=users, context=contexts, history_len=kept, history_item=hist_item,
                        history_author=self.item_author[hist_item], history_actions=hist_actions,
                        cand_item=cand_item, cand_author=self.item_author[cand_item],
                        labels=labels.astype(np.float32), probs=probs.astype(np.float32))

    def impersonal_probs(self, sessions: Sessions) -> np.ndarray:
        """float [N, C, A]: the true model without the user's taste (popularity and context only)."""
        return _sigmoid(self.logits(sessions.user[:, None], sessions.cand_item,
                                    sessions.context[:, None], personal=False))


def _sigmoid(x):
    return (1.0 / (1.0 + np.exp(-x))).astype(np.float32)


def auc(labels, scores) -> float:
    """Area under the ROC curve (ties count one half); NaN when one class is absent."""
    labels, scores = np.asarray(labels).ravel() > 0.5, np.asarray(scores, np.float64).ravel()
    positives, negatives = labels.sum(), (~labels).sum()
    if positives == 0 or negatives == 0:
        return float("nan")
    order = np.argsort(scores, kind="stable")
    sorted_scores = scores[order]
    ranks = np.empty(len(scores))
    ranks[order] = np.arange(1, len(scores) + 1)
    # Average ranks over runs of equal scores.
    _, first, counts = np.unique(sorted_scores, return_index=True, return_counts=True)
    average = first + (counts + 1) / 2.0
    ranks[order] = np.repeat(average, counts)
    return float((ranks[labels].sum() - positives * (positives + 1) / 2) / (positives * negatives))
