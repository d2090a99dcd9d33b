"""A Phoenix-style ranking transformer in Flax NNX, with attention by rankattn.

Tokens (see packing.py): one user token (user id + request context), history
tokens (item, author and the actions taken, reduced to one vector) and
candidate tokens (item and author). Ids enter through hash embeddings: two
hashes per id into one table, concatenated; id 0 is padding and embeds to zero.
Blocks are pre-norm (RMSNorm) with GQA attention (qk-norm, rotary positions,
optional tanh soft cap) and a SwiGLU feed-forward. Sigmoid heads on the
candidate tokens give one logit per action.

One ``rankattn.plan`` is built per batch and used by every layer. Serving uses
the same blocks in two halves: :meth:`Ranker.history_kv` runs the history alone
and returns each layer's K/V for a ``rankattn.serving`` cache (with candidate
isolation, history states never depend on candidates), and
:meth:`Ranker.score_cached` runs only the candidate tokens through the
layers, each attending to its layer of a stacked cache plus the candidate's
own key.
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

import rankattn
from rankattn import serving

from examples.ranker.config import ModelConfig
from examples.ranker.packing import CANDIDATE, HISTORY, USER, Batch

# Two multiplicative hashes (odd 32-bit constants); each id reads two rows of its table.
HASH_MULTIPLIERS = (0x9E3779B1, 0x85EBCA77)


class HashEmbedding(nnx.Module):
    """Two hashed lookups per id into one table, concatenated: [...] -> [..., 2 * dim]."""

    def __init__(self, buckets: int, dim: int, *, rngs: nnx.Rngs):
        self.buckets = buckets
        self.table = nnx.Embed(buckets, dim, rngs=rngs,
                               embedding_init=nnx.initializers.normal(0.1))

    def __call__(self, ids):
        u = ids.astype(jnp.uint32)
        rows = [((u * jnp.uint32(m)) >> 7) % (self.buckets - 1) + 1 for m in HASH_MULTIPLIERS]
        out = jnp.concatenate([self.table(r.astype(jnp.int32)) for r in rows], axis=-1)
        return jnp.where((ids > 0)[..., None], out, 0.0)


def rotary(x, positions, base: float):
    """Rotary position embedding of x [B, S, H, D] (D even) at int positions [B, S]."""
    half = x.shape[-1] // 2
    freq = base ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angle = positions[..., None, None].astype(jnp.float32) * freq
    cos, sin = jnp.cos(angle), jnp.sin(angle)
    x1, x2 = x[..., :half], x[..., half:]
    return jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)


class Block(nnx.Module):
    """Pre-norm block: x + attention(norm(x)), then x + SwiGLU(norm(x))."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        w, d = config.width, config.head_dim
        self.config = config
        linear = lambda i, o: nnx.Linear(i, o, use_bias=False, rngs=rngs)  # noqa: E731
        self.attn_norm, self.ffn_norm = nnx.RMSNorm(w, rngs=rngs), nnx.RMSNorm(w, rngs=rngs)
        self.q, self.k, self.v = (linear(w, config.q_heads * d), linear(w, config.kv_heads * d),
                                  linear(w, config.kv_heads * d))
        self.q_norm, self.k_norm = nnx.RMSNorm(d, rngs=rngs), nnx.RMSNorm(d, rngs=rngs)
        self.out = linear(config.q_heads * d, w)
        hidden = config.ffn_mult * w
        self.gate, self.up, self.down = linear(w, hidden), linear(w, hidden), linear(hidden, w)

    def qkv(self, x, positions):
        """q [B, S, Hq, D], k and v [B, S, Hkv, D] of tokens x [B, S, W] at positions [B, S]."""
        c = self.config
        h = self.attn_norm(x)
        heads = lambda proj, n: proj(h).reshape(*x.shape[:-1], n, c.head_dim)  # noqa: E731
        q = rotary(self.q_norm(heads(self.q, c.q_heads)), positions, c.rope_base)
        k = rotary(self.k_norm(heads(self.k, c.kv_heads)), positions, c.rope_base)
        return q, k, heads(self.v, c.kv_heads)

    def finish(self, x, attended):
        """The block's output from its input x and the attention output [B, S, Hq, D]."""
        x = x + self.out(attended.reshape(*x.shape[:-1], -1))
        h = self.ffn_norm(x)
        return x + self.down(nnx.silu(self.gate(h)) * self.up(h))


class Ranker(nnx.Module):
    """The ranking model. ``__call__`` gives action logits [B, S, A] for every token."""

    def __init__(self, config: ModelConfig, actions: int, contexts: int, *, rngs: nnx.Rngs):
        self.config = config
        w, e = config.width, config.hash_dim
        self.users = HashEmbedding(config.hash_buckets, e, rngs=rngs)
        self.items = HashEmbedding(config.hash_buckets, e, rngs=rngs)
        self.authors = HashEmbedding(config.hash_buckets, e, rngs=rngs)
        self.context = nnx.Embed(contexts, w, rngs=rngs)
        self.user_proj = nnx.Linear(2 * e, w, rngs=rngs)
        self.history_proj = nnx.Linear(4 * e + actions, w, rngs=rngs)
        self.candidate_proj = nnx.Linear(4 * e, w, rngs=rngs)
        self.blocks = nnx.List([Block(config, rngs=rngs) for _ in range(config.layers)])
        self.final_norm = nnx.RMSNorm(w, rngs=rngs)
        self.heads = nnx.Linear(w, actions, rngs=rngs)

    def embed(self, batch: Batch):
        """Token vectors [B, S, W]: each token reduces its own features (zero for padding)."""
        item = jnp.concatenate([self.items(batch.item), self.authors(batch.author)], axis=-1)
        user = self.user_proj(self.users(batch.user)) + self.context(batch.context)
        history = self.history_proj(jnp.concatenate([item, batch.actions], axis=-1))
        candidate = self.candidate_proj(item)
        kind = batch.kind[..., None]
        return jnp.where(kind == USER, user, jnp.where(
            kind == HISTORY, history, jnp.where(kind == CANDIDATE, candidate, 0.0)))

    def layers(self, batch: Batch, attention=None):
        """(x, kv): the last block's output [B, S, W] and every layer's (k, v) [B, S, Hkv, D].

        ``attention(q, k, v, segment_ids)`` replaces rankattn (benchmarks); by
        default one ``rankattn.plan`` of the batch serves every layer.
        """
        if attention is None:
            plan = rankattn.plan(segment_ids=batch.segment_ids)
            attention = lambda q, k, v, _: rankattn.attention(  # noqa: E731
                q, k, v, plan=plan, softcap=self.config.softcap)
        x, kv = self.embed(batch), []
        for block in self.blocks:
            q, k, v = block.qkv(x, batch.positions)
            kv.append((k, v))
            x = block.finish(x, attention(q, k, v, batch.segment_ids))
        return x, kv

    def __call__(self, batch: Batch, attention=None):
        """Logits [B, S, A] of every token (see :meth:`layers` for ``attention``)."""
        return self.heads(self.final_norm(self.layers(batch, attention)[0]))

    def history_kv(self, batch: Batch):
        """Per layer, (k, v) [B, S, Hkv, D] of a batch holding one history per row.

        Each row is [user, history...] with segment id 1 (0 padding, at the end);
        the keys and values are exactly those the full forward pass computes for
        these tokens, since history never sees candidates.
        """
        return self.layers(batch)[1]

    def score_cached(self, candidates: Batch, cache, users, budget: int | None = None,
                     gqa: str = "group"):
        """Logits [B, C, A] of candidate tokens [B, C] against cached histories.

        ``cache`` is a stacked rankattn.serving cache, layer l of it holding layer
        l's history K/V, and row b reads the history of cache user ``users[b]``.
        Each block attends to its layer with ``layer=l``, which reads the stack's
        pages in place (scanning over the stack would hand each layer a slice of
        its pages, which XLA copies for the cpu kernel on every call). The blocks
        run one after another, unrolled: a ``jax.lax.scan`` over them would stack
        their weights on every call (2.5 of the 4 ms a small-preset request of 8
        candidates took). ``budget`` (tokens) turns on Quest page selection in
        every layer.
        """
        x = self.embed(candidates)
        for layer, block in enumerate(self.blocks):
            q, k, v = block.qkv(x, candidates.positions)
            out = serving.attend(q, cache, users, self_kv=(k, v), budget=budget, gqa=gqa,
                                 softcap=self.config.softcap, layer=layer)
            x = block.finish(x, out)
        return self.heads(self.final_norm(x))


def candidate_loss(logits, batch: Batch):
    """Mean binary cross-entropy over candidate tokens and actions."""
    mask = (batch.kind == CANDIDATE)[..., None].astype(logits.dtype)
    losses = jnp.logaddexp(0.0, logits) - logits * batch.labels  # BCE with logits
    return (losses * mask).sum() / jnp.maximum(mask.sum() * logits.shape[-1], 1.0)


def init(config: ModelConfig, actions: int, contexts: int, seed: int):
    """(graphdef, params): the model split for jax.jit (rebuild with nnx.merge)."""
    return nnx.split(Ranker(config, actions, contexts, rngs=nnx.Rngs(seed)))

