"""Attention on a device mesh: ``rankattn.attention(..., sharding=rankattn.Sharding(...))``.

q / k / v [B, S, H, D] are split over mesh axes: B over ``batch``, H over
``heads``, S over ``context``. Every backend runs unchanged as the per-shard
kernel inside an explicit ``shard_map``:

* batch and heads: each device runs the whole mask on its rows / heads. No
  collective inside attention (query and kv heads are split together, so a
  GQA group never straddles devices).
* context (the sequence): each device keeps the queries of its slice of the
  sequence and needs the keys of every slice. Two strategies:
  - ``all_gather``: K, V and their segment ids are all-gathered; autodiff
    transposes the gather into a reduce-scatter of dK / dV.
  - ``ring``: K / V blocks travel one hop per step with ``ppermute``; each
    step's partial result is merged into a running one. A custom VJP runs the
    ring again backwards with the dK / dV accumulators travelling with their
    block, so no device ever holds more than two K / V blocks (O(S / N)). The
    backward's n steps each end with a hop, so blocks and accumulators end at
    home together: one K / V hop more than needed, for one loop with no
    step outside it (that measured 7% less scratch memory at 1M tokens).

Exactness across shard edges. The kernel sees one shard of the sequence, so it
gets a :class:`rankattn.semantics.ShardMask`: the keys' own segment ids and
every token's position in the whole sequence. Causal history compares global
positions; sessions may span any number of shards. The kernel computes only
the history part of the mask; a candidate's own key always sits on the
candidate's own shard, so :func:`own_key_partial` computes that one logit per
candidate locally, and :func:`merge_partials` (the one log-sum-exp merge, also
used by the ring and by serving) combines it with the history part.

Causal load balance. With contiguous slices device i does work ~ 2i + 1. When
causal and S is a multiple of 2N, queries are moved to the dual-chunk order
(2N chunks; device i holds chunks i and 2N - 1 - i) by two collective-permutes
at the start of the call and the results moved back at its end (the ring moves
K / V too, so each ring step is balanced). Positions carry the original order,
so results are identical; the user never sees the reorder. A model can instead
reorder its tokens once per batch (``x[:, balanced_order(S, N)]``) and pass
``Sharding(..., balanced_layout=True)``, so that no layer moves them again.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from rankattn import semantics
from rankattn.backends.base import first_derivatives_only
from rankattn.errors import fail
from rankattn.validate import AttentionCall

STRATEGIES = ("auto", "all_gather", "ring")

# strategy="auto" all-gathers K / V when the gathered K / V (and their gradients, as large)
# take at most this fraction of one device's memory, else passes them around a ring.
# Without a memory figure (CPU) it assumes 8 GiB: all_gather up to 1 GiB of K / V per device.
AUTO_ALL_GATHER_FRACTION = 1 / 8
ASSUMED_DEVICE_BYTES = 8 << 30

if hasattr(jax, "shard_map"):  # jax >= 0.7
    _shard_map_impl, _CHECK = jax.shard_map, "check_vma"
else:
    from jax.experimental.shard_map import shard_map as _shard_map_impl
    _CHECK = "check_rep"


def _shard_map(f, mesh, in_specs, out_specs):
    # Replication / varying-axis checking is off: the ring's scan carries are created inside
    # the map and would need jax.lax.pcast (formerly pvary, renamed across the jax versions
    # we support) to type-check, and the custom VJP's outputs are per-device by construction.
    # The tests compare every sharded result with a single-device run instead.
    mapped = _shard_map_impl(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                             **{_CHECK: False})

    def placed(*args):  # called under jit
        return mapped(*jax.tree.map(lambda spec, x: _place(x, mesh, spec), in_specs, args,
                                    is_leaf=lambda spec: isinstance(spec, P)))
    return placed


def _place(x, mesh: Mesh, spec: P):
    """``x`` laid out as ``spec`` says, under jit. A mesh with Explicit axes (the default of
    ``jax.make_mesh`` since jax 0.7) makes shard_map refuse inputs laid out otherwise;
    reshard is the only move allowed there, and with_sharding_constraint on Auto axes."""
    explicit = getattr(getattr(jax.sharding, "AxisType", None), "Explicit", None)
    if explicit is not None and explicit in getattr(mesh, "axis_types", ()):
        return jax.sharding.reshard(x, jax.sharding.NamedSharding(mesh, spec))
    return jax.lax.with_sharding_constraint(x, jax.sharding.NamedSharding(mesh, spec))


Axes = tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class Sharding:
    """How :func:`rankattn.attention` splits its arrays over a device mesh.

    Args:
      mesh: a ``jax.sharding.Mesh``.
      batch: mesh axis name (or tuple of names) splitting B of q / k / v [B, S, H, D],
        segment ids [B, S] and bounds [B, 4].
      heads: mesh axes splitting the head axis; Hq and Hkv are split together, so both
        must be divisible by the axes' total size.
      context: mesh axes splitting the sequence S (self-attention only); segment ids are
        split the same way.
      strategy: how context shards see each other's keys: 'all_gather', 'ring' or
        'auto' (all_gather while the gathered K / V take at most 1/8 of a device's
        memory, else ring; see :func:`choose_strategy`).
      balanced_layout: the sequence axis of q, k, v and the segment ids is already in
        the dual-chunk order, ``x[:, balanced_order(S, N)]`` (N = the context shards),
        and out / lse come back in that order. A model reorders its tokens once per
        batch this way; every causal layer then skips the in-call reorder (two
        collective-permutes of q and the segment ids in, of out and lse out).

    Results come back split the same way: out [B, S, Hq, Dv] as q, lse [B, Hq, S] over
    (batch, heads, context). Inputs may be sharded any way or not at all.
    """

    mesh: Mesh
    batch: str | Axes | None = None
    heads: str | Axes | None = None
    context: str | Axes | None = None
    strategy: str = "auto"
    balanced_layout: bool = False

    def __post_init__(self):
        if not isinstance(self.mesh, Mesh):
            raise fail("RA119", f"Sharding(mesh=...) needs a jax.sharding.Mesh; got "
                                f"{type(self.mesh).__name__}. Build one with "
                                "jax.make_mesh((2, 4), ('data', 'seq')).")
        seen: dict[str, str] = {}
        for role in ("batch", "heads", "context"):
            axes = _as_axes(getattr(self, role), role)
            for name in axes:
                if name not in self.mesh.axis_names:
                    raise fail("RA119", f"Sharding({role}={getattr(self, role)!r}): the mesh "
                                        f"has no axis {name!r}; its axes are "
                                        f"{tuple(self.mesh.axis_names)}.")
                if name in seen:
                    raise fail("RA119", f"mesh axis {name!r} is given as both {seen[name]}= "
                                        f"and {role}=; each mesh axis can split one dimension.")
                seen[name] = role
            object.__setattr__(self, role, axes)
        # Shard i of the context axes is the i-th in their listed order for axis_index and the
        # data, but ppermute numbers the shards in the mesh's order: listed otherwise, the
        # dual-chunk reorder's permutes moved chunks to the wrong shards (wrong causal results).
        in_mesh_order = tuple(a for a in self.mesh.axis_names if a in self.context)
        if self.context != in_mesh_order:
            raise fail("RA119", f"Sharding(context={self.context!r}) lists the mesh axes in "
                                f"another order than the mesh's {tuple(self.mesh.axis_names)}; "
                                f"pass context={in_mesh_order!r}.")
        if not isinstance(self.strategy, str) or self.strategy not in STRATEGIES:
            raise fail("RA121", f"Sharding(strategy={self.strategy!r}); use one of "
                                f"{', '.join(map(repr, STRATEGIES))}.")
        if not isinstance(self.balanced_layout, bool):
            raise fail("RA116", f"Sharding(balanced_layout={self.balanced_layout!r}); pass "
                                "True or False.")
        if self.balanced_layout and not self.context:
            raise fail("RA121", "Sharding(balanced_layout=True) without context axes: the "
                                "dual-chunk order is an order of context shards. Add "
                                "context='<axis>' or drop balanced_layout.")
        if self.strategy != "auto" and not self.context:
            raise fail("RA121", f"Sharding(strategy={self.strategy!r}) without context axes: "
                                "the strategy says how sequence shards exchange keys, and "
                                "nothing is split over the sequence. Add context='<axis>' or "
                                "leave strategy='auto'.")

    def size(self, axes: Axes) -> int:
        """The number of shards along ``axes`` (1 for none)."""
        return math.prod(self.mesh.shape[a] for a in axes)


def _as_axes(value, role: str) -> Axes:
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,)
    if isinstance(value, (tuple, list)) and all(isinstance(a, str) for a in value):
        return tuple(value)
    raise fail("RA119", f"Sharding({role}={value!r}); give a mesh axis name, a tuple of names "
                        "or None.")


def _spec(*dims: Axes) -> P:
    """A PartitionSpec from one tuple of mesh axes per array dimension."""
    return P(*[None if not axes else axes[0] if len(axes) == 1 else axes for axes in dims])


# --- Checks, before anything is traced. ----------------------------------------------


def check_sharding(call: AttentionCall, sharding) -> None:
    """Raise RA119-RA121 for a sharding this call cannot use."""
    if not isinstance(sharding, Sharding):
        raise fail("RA119", f"sharding must be a rankattn.Sharding; got "
                            f"{type(sharding).__name__}. Pass "
                            "sharding=rankattn.Sharding(mesh, batch='data').")
    (b, sq, hq, _), (skv, hkv) = call.q.shape, call.k.shape[1:3]
    dims = [("batch", sharding.batch, "B", [b])]
    dims.append(("heads", sharding.heads, "Hq and Hkv", [hq, hkv]))
    dims.append(("context", sharding.context, "S", [sq]))
    for role, axes, what, sizes in dims:
        n = sharding.size(axes)
        for size in sizes:
            if size % n:
                fix = {"batch": f"pad the batch with all-padding rows to {-(-b // n) * n}",
                       "heads": "use head counts divisible by it (Hq and Hkv both)",
                       "context": f"pad the sequence with segment id 0 to {-(-sq // n) * n} "
                                  f"(a multiple of {n})"}[role]
                raise fail("RA120", f"{role}={axes!r} has {n} shards ("
                                    + " x ".join(f"{a}={sharding.mesh.shape[a]}" for a in axes)
                                    + f"), which does not divide {what} = "
                                    f"{', '.join(map(str, sizes))}: {fix}.")
    n = sharding.size(sharding.context)
    if sharding.balanced_layout and sq % (2 * n):
        raise fail("RA120", f"balanced_layout=True splits S into 2 x {n} chunks, but S = {sq}: "
                            f"pad the sequence with segment id 0 to {-(-sq // (2 * n)) * 2 * n} "
                            f"(a multiple of {2 * n}) before reordering it.")
    if sharding.context and sq != skv:
        raise fail("RA121", f"context={sharding.context!r} splits one sequence, but q has "
                            f"length {sq} and k {skv}. Context sharding is for self-attention; "
                            "shard cross-attention over batch or heads.")


def choose_strategy(call: AttentionCall, sharding: Sharding) -> str:
    """'all_gather' or 'ring' for a context-sharded call (the strategy, or auto's choice).

    auto: all_gather while one device's gathered K / V, whose gradients take as much
    again, fit in AUTO_ALL_GATHER_FRACTION of its memory; ring beyond.
    """
    if sharding.strategy != "auto":
        return sharding.strategy
    b, s, hkv, d = call.k.shape
    gathered = (b // sharding.size(sharding.batch)) * s * (hkv // sharding.size(sharding.heads))
    gathered *= (d + call.v.shape[3]) * call.k.dtype.itemsize
    stats = sharding.mesh.devices.flat[0].memory_stats() or {}
    limit = stats.get("bytes_limit", ASSUMED_DEVICE_BYTES) * AUTO_ALL_GATHER_FRACTION
    return "all_gather" if gathered <= limit else "ring"


def local_call(call: AttentionCall, sharding: Sharding, strategy: str | None) -> AttentionCall:
    """The call one device's kernel sees (shapes only), to choose and check the backend."""
    def local(x, key_length=None):
        b, s, h, *d = x.shape
        s = s // sharding.size(sharding.context) if key_length is None else key_length
        return jax.ShapeDtypeStruct((b // sharding.size(sharding.batch), s,
                                     h // sharding.size(sharding.heads), *d), x.dtype)

    multiplier = None if call.logit_multiplier is None else local(call.logit_multiplier)
    if not sharding.context:
        return dataclasses.replace(call, q=local(call.q), k=local(call.k), v=local(call.v),
                                   logit_multiplier=multiplier)
    key_length = call.k.shape[1] if strategy == "all_gather" else None  # gathered: all of S
    q, k = local(call.q), local(call.k, key_length)
    queries = jax.ShapeDtypeStruct(q.shape[:2], jnp.int32)
    keys = jax.ShapeDtypeStruct(k.shape[:2], jnp.int32)
    return dataclasses.replace(call, q=q, k=k, v=local(call.v, k.shape[1]),
                               segment_ids=queries, plan=None, logit_multiplier=multiplier,
                               shard_mask=semantics.ShardMask(keys, queries, keys))


# --- The one merge of partial results. ------------------------------------------------


def merge_partials(parts):
    """Combine (out [B, S, H, Dv], lse [B, H, S]) pairs computed over disjoint key sets.

    m = max lse_i, w_i = exp(lse_i - m): out = sum w_i out_i / sum w_i and lse = m +
    log(sum w_i). A part whose lse is -inf (its keys are all masked for that query)
    gets weight 0; a query no part sees gets out 0 and lse -inf, with zero gradients.
    A query poisoned in any part (lse NaN: it saw a non-finite input, see
    rankattn.semantics) gets out and lse NaN and passes no gradient to any part.
    Returns float32 (float64 for float64 parts) out and lse.
    """
    acc = jnp.promote_types(parts[0][0].dtype, jnp.float32)
    lse = jnp.stack([lse for _, lse in parts]).astype(acc)
    poisoned = jnp.isnan(lse).any(0)                      # [B, H, S]
    # Poisoned rows are merged as if they saw nothing, then set to NaN by a where, so no
    # NaN reaches another row or any gradient.
    lse = jnp.where(poisoned, -jnp.inf, lse)
    # m only shifts the exponentials; its own gradient cancels, so it is stopped.
    m = jax.lax.stop_gradient(lse.max(0))
    m = jnp.where(jnp.isfinite(m), m, 0)
    weights = jnp.exp(lse - m)                            # [P, B, H, S], 0 where lse = -inf
    total = weights.sum(0)
    seen = total > 0
    safe = jnp.where(seen, total, 1)
    out = sum(_rows(w) * jnp.where(_rows(poisoned), 0, o.astype(acc))
              for w, (o, _) in zip(weights, parts)) / _rows(safe)
    lse = jnp.where(seen, m + jnp.log(safe), -jnp.inf)
    return jnp.where(_rows(poisoned), jnp.nan, out), jnp.where(poisoned, jnp.nan, lse)


def _rows(x):
    """[B, H, S] -> [B, S, H, 1], to scale out [B, S, H, Dv] row by row."""
    return jnp.swapaxes(x, 1, 2)[..., None]


def own_key_partial(call, q, k, v, segment_ids, multiplier=None):
    """Each candidate's logit on its own key, as a partial (out, lse) for merge_partials.

    ``call`` gives scale, softcap and softcap_method (an AttentionCall, or serving's
    plan for a candidate's self term); ``multiplier``: the queries' logit multiplier
    (float32 [B, S, Hq], finite) or None.

    q [B, S, Hq, D], k / v [B, S, Hkv, D / Dv] of the same tokens. For a candidate
    (segment id < 0) out = its own v and lse = its capped, scaled logit; other tokens
    get out 0 and lse -inf (the history part covers them). A candidate whose q (in
    that head), own k or own v holds a non-finite value gets lse NaN (poisoned, see
    rankattn.semantics); the math runs on finite values, so gradients stay finite.
    """
    b, s, hq, d = q.shape
    hkv, group = k.shape[2], hq // k.shape[2]
    acc = jnp.promote_types(q.dtype, jnp.float32)
    (q, q_bad), (k, k_bad), (v, v_bad) = (
        (semantics.finite(x).astype(acc), semantics.nonfinite(x)) for x in (q, k, v))
    grouped = q.reshape(b, s, hkv, group, d)
    logits = (grouped * k[:, :, :, None]).sum(-1).reshape(b, s, hq) * call.scale
    logits = semantics.softcap(logits, call.softcap, call.softcap_method)
    if multiplier is not None:
        logits = logits * multiplier.astype(acc)
    bad = q_bad | jnp.repeat(k_bad | v_bad, group, axis=2)          # [B, S, Hq]
    is_cand = (segment_ids < 0)[:, :, None]
    lse = jnp.where(is_cand, jnp.where(bad, jnp.nan, logits), -jnp.inf).transpose(0, 2, 1)
    own_v = jnp.repeat(v, group, axis=2)  # [B, S, Hq, Dv]: one row per token
    return jnp.where(is_cand[..., None], own_v, 0), lse


# --- Causal load balance: the dual-chunk order. -----------------------------------------


def _contiguous_home(chunk: int, n: int):
    """(device, slot) of chunk c of 2n when each device holds two consecutive chunks."""
    return chunk // 2, chunk % 2


def _balanced_home(chunk: int, n: int):
    """(device, slot) of chunk c of 2n in the dual-chunk order: device i holds i, 2n - 1 - i."""
    return (chunk, 0) if chunk < n else (2 * n - 1 - chunk, 1)


def balanced_order(seq_len: int, n: int):
    """int numpy [seq_len]: the dual-chunk order of a sequence split over n devices.

    ``x[:, balanced_order(S, n)]`` puts chunk i and chunk 2n - 1 - i of 2n on device
    i; ``np.argsort`` of it restores the original order. For
    ``Sharding(..., balanced_layout=True)``.
    """
    c = seq_len // (2 * n)
    chunks = [[i, 2 * n - 1 - i] for i in range(n)]
    return np.concatenate([np.arange(j * c, (j + 1) * c) for pair in chunks for j in pair])


def balanced_positions(index, n: int, local_len: int):
    """Global positions [local_len] of device ``index``'s tokens in the dual-chunk order."""
    c = local_len // 2
    chunk = jnp.arange(c, dtype=jnp.int32)
    return jnp.concatenate([index * c + chunk, (2 * n - 1 - index) * c + chunk])


def _move_chunks(x, axes: Axes, n: int, axis: int, source, target):
    """Rearrange the 2n chunks of a sequence split over ``axes`` from one layout to another.

    Each device holds two chunks (slots) of ``x`` along ``axis``; ``source`` and
    ``target`` map a chunk to its (device, slot). The 2n moves are split into two
    rounds in which every device sends one chunk and receives one, so each round is
    one collective-permute; a table indexed by the device says which slot to send
    and where to put what arrives.
    """
    moves = [source(c, n) + target(c, n) for c in range(2 * n)]  # (from, slot, to, slot)
    halves = jnp.split(x, 2, axis=axis)
    index = jax.lax.axis_index(axes)
    arrived, arrival_slot = [], []
    for round_moves in _two_rounds(moves, n):
        send_slot, recv_slot = [0] * n, [0] * n
        for src, src_slot, dst, dst_slot in round_moves:
            send_slot[src], recv_slot[dst] = src_slot, dst_slot
        piece = jnp.where(jnp.asarray(send_slot)[index] == 0, halves[0], halves[1])
        arrived.append(jax.lax.ppermute(piece, axes, [(m[0], m[2]) for m in round_moves]))
        arrival_slot.append(jnp.asarray(recv_slot)[index])
    first_is_0 = arrival_slot[0] == 0
    return jnp.concatenate([jnp.where(first_is_0, arrived[0], arrived[1]),
                            jnp.where(first_is_0, arrived[1], arrived[0])], axis=axis)


def _two_rounds(moves, n: int):
    """Split moves (each device sends two and receives two) into two rounds of one each.

    A perfect matching of the 2-regular bipartite (sender, receiver) multigraph, by
    augmenting paths; the moves left over form the other round.
    """
    receiver_move: dict[int, int] = {}  # receiver -> index of the move matched to it

    def augment(src, visited):
        for i, move in enumerate(moves):
            if move[0] != src or move[2] in visited:
                continue
            visited.add(move[2])
            if move[2] not in receiver_move or augment(moves[receiver_move[move[2]]][0], visited):
                receiver_move[move[2]] = i
                return True
        return False

    for src in range(n):
        assert augment(src, set()), "every device sends and receives two chunks"
    first = set(receiver_move.values())
    return ([moves[i] for i in sorted(first)],
            [m for i, m in enumerate(moves) if i not in first])


def to_balanced(x, axes: Axes, n: int, axis: int = 1):
    """Contiguous slices -> dual-chunk order (inside shard_map over ``axes``)."""
    return _move_chunks(x, axes, n, axis, _contiguous_home, _balanced_home)


def from_balanced(x, axes: Axes, n: int, axis: int = 1):
    """Dual-chunk order -> contiguous slices (inside shard_map over ``axes``)."""
    return _move_chunks(x, axes, n, axis, _balanced_home, _contiguous_home)


# --- The per-shard history kernel, and the ring. ---------------------------------------


def _history_kernel(backend, call: AttentionCall):
    """kernel(q, mult, seg_q, pos_q, k, v, seg_k, pos_k) -> (out, lse): the history part on a
    shard (mult: the queries' logit multiplier or None)."""
    def kernel(q, mult, seg_q, pos_q, k, v, seg_k, pos_k):
        shard = dataclasses.replace(call, q=q, k=k, v=v, segment_ids=seg_q, plan=None,
                                    logit_multiplier=mult,
                                    shard_mask=semantics.ShardMask(seg_k, pos_q, pos_k))
        return backend(shard)
    return kernel


def ring_history(kernel, axes: Axes, n: int, q, mult, seg_q, pos_q, k, v, seg_k, pos_k, *,
                 backend_name: str):
    """History part of this device's queries against every device's keys, passed in a ring.

    Step t computes against the block of device (i - t) mod n while the next block is
    already on its way, and merges into the running result. Returns float32 (out, lse).
    Its custom VJP's rules call ``kernel`` (its backward through ``jax.vjp``), which only the
    reference backend's plain jnp lets JAX differentiate again: on the others a second
    derivative raises RA130 (a kernel's custom VJP has no forward mode).
    """
    ring = [(i, (i + 1) % n) for i in range(n)]

    def send(tree):
        return jax.tree.map(lambda x: jax.lax.ppermute(x, axes, ring), tree)

    def forward(q, mult, seg_q, pos_q, k, v, seg_k, pos_k):
        def step(carry, _):
            block, running = carry
            block = send(block)
            return (block, merge_partials([running, kernel(q, mult, seg_q, pos_q, *block)])), None

        first = merge_partials([kernel(q, mult, seg_q, pos_q, k, v, seg_k, pos_k)])
        (_, result), _ = jax.lax.scan(step, ((k, v, seg_k, pos_k), first), None, length=n - 1)
        return result

    @jax.custom_vjp
    def history(q, mult, seg_q, pos_q, k, v, seg_k, pos_k):
        return forward(q, mult, seg_q, pos_q, k, v, seg_k, pos_k)

    def history_fwd(q, mult, seg_q, pos_q, k, v, seg_k, pos_k):
        out, lse = forward(q, mult, seg_q, pos_q, k, v, seg_k, pos_k)
        return (out, lse), (q, mult, seg_q, pos_q, k, v, seg_k, pos_k, out, lse)

    def history_bwd(residuals, cotangents):
        q, mult, seg_q, pos_q, k, v, seg_k, pos_k, out, lse = residuals
        d_out, d_lse = cotangents
        # <d_out, out> per row, once: the steps then need no [B, S, H, Dv] copy of out.
        d_out_dot_out = jnp.swapaxes(semantics.row_dot(d_out, out), 1, 2)

        def pull(block):
            """(dq, dk, dv) of one block: its partial's cotangents, through the kernel.

            With w = exp(lse_t - lse) the merge gives d out_t = w d_out and d lse_t =
            w (d_lse + <d_out, out_t - out>); the kernel's backward then equals a flash
            backward with the global lse. It recomputes the block's forward (one extra
            forward per block) so that no step's residuals outlive the step.
            """
            k_b, v_b, seg_b, pos_b = block
            (out_t, lse_t), pullback = jax.vjp(
                lambda q, k, v: kernel(q, mult, seg_q, pos_q, k, v, seg_b, pos_b), q, k_b, v_b)
            # Rows that see nothing here (lse_t -inf) or are poisoned (lse NaN: they pass
            # no gradient) get weight 0, and where() keeps their NaNs out of the products.
            used = (lse_t != -jnp.inf) & ~jnp.isnan(lse)
            w = jnp.where(used, jnp.exp(jnp.where(used, lse_t - lse, 0)), 0.0)
            d_out_t = jnp.where(_rows(used), _rows(w) * d_out, 0)
            d_out_dot_out_t = jnp.swapaxes(semantics.row_dot(d_out, out_t), 1, 2)
            d_lse_t = jnp.where(used, w * (d_lse + d_out_dot_out_t - d_out_dot_out), 0)
            return pullback((d_out_t.astype(out_t.dtype), d_lse_t))

        acc = jnp.promote_types(k.dtype, jnp.float32)

        def step(carry, _):
            block, (dk, dv), dq = carry
            dq_t, dk_t, dv_t = pull(block)
            grads = (dk + dk_t.astype(acc), dv + dv_t.astype(acc))
            # dK / dV travel with their block; after n hops both are home again.
            block, grads = send((block, grads))
            return (block, grads, dq + dq_t.astype(acc)), None

        zeros = lambda x: jnp.zeros(x.shape, acc)
        carry = ((k, v, seg_k, pos_k), (zeros(k), zeros(v)), zeros(q))
        (_, (dk, dv), dq), _ = jax.lax.scan(step, carry, None, length=n)
        return (dq.astype(q.dtype), None, None, None, dk.astype(k.dtype), dv.astype(v.dtype),
                None, None)

    def first_order(rule):  # the rule, refusing to be differentiated (see the docstring)
        if backend_name == "reference":
            return rule
        refusing = first_derivatives_only(
            backend_name, reached=f"context sharding's ring strategy on {backend_name!r}, "
                                  "whose rules call the kernel's custom VJP (first derivatives "
                                  "only; on 'xla', strategy='all_gather' takes jax.jvp of "
                                  "jax.grad)",
        )(lambda _, *args: rule(*args))
        return functools.partial(refusing, None)

    history.defvjp(first_order(history_fwd), first_order(history_bwd))
    return history(q, mult, seg_q, pos_q, k, v, seg_k, pos_k)


def gathered_history(kernel, axes: Axes, n: int, q, mult, seg_q, pos_q, k, v, seg_k, pos_k):
    """History part against K / V all-gathered over ``axes`` (autodiff reduce-scatters dK / dV)."""
    def gather(x):
        return jax.lax.all_gather(x, axes, axis=1, tiled=True)

    out, lse = kernel(q, mult, seg_q, pos_q, gather(k), gather(v), gather(seg_k), gather(pos_k))
    return merge_partials([(out, lse)])


# --- The sharded call. --------------------------------------------------------------


# The arrays of a call (pytrees of them, or None); the rest of it, with these None, is static.
CALL_ARRAYS = ("q", "k", "v", "segment_ids", "plan", "logit_multiplier", "shard_mask")


def sharded_attention(backend, call: AttentionCall, sharding: Sharding, strategy: str | None):
    """(out, lse) of ``call`` on ``sharding``'s mesh, ``backend`` running on every shard.

    Jitted on the call's static part (called eagerly, a shard_map would run its body op by
    op; and a jit of a closure made here would compile again at every call)."""
    static = dataclasses.replace(call, **dict.fromkeys(CALL_ARRAYS))
    return _sharded_attention(*(getattr(call, name) for name in CALL_ARRAYS), backend=backend,
                              static=static, sharding=sharding, strategy=strategy)


@functools.partial(jax.jit, static_argnames=("backend", "static", "sharding", "strategy"))
def _sharded_attention(*arrays, backend, static: AttentionCall, sharding: Sharding,
                       strategy: str | None):
    call = dataclasses.replace(static, **dict(zip(CALL_ARRAYS, arrays)))
    batch, heads, context = sharding.batch, sharding.heads, sharding.context
    qkv_spec = _spec(batch, context, heads, ())
    lse_spec = _spec(batch, heads, context)
    multiplier = call.logit_multiplier  # [B, S, Hq], split like q
    mult_spec = None if multiplier is None else _spec(batch, context, heads)
    if not context:
        # Every device runs the whole mask on its rows and heads; a plan's lists are
        # per row, so they are split over the batch like everything else.
        def body(q, k, v, segment_ids, plan, mult):
            return backend(dataclasses.replace(call, q=q, k=k, v=v, segment_ids=segment_ids,
                                               plan=plan, logit_multiplier=mult))

        row_spec = _spec(batch)
        plan_spec = None if call.plan is None else jax.tree.map(lambda _: row_spec, call.plan)
        seg_spec = None if call.segment_ids is None else row_spec
        mapped = _shard_map(body, sharding.mesh, (qkv_spec, qkv_spec, qkv_spec, seg_spec,
                                                  plan_spec, mult_spec), (qkv_spec, lse_spec))
        return mapped(call.q, call.k, call.v, call.segment_ids, call.plan, multiplier)

    n = sharding.size(context)
    b, s = call.q.shape[:2]
    # Reorder inside this call: causal, divisible, and not already in the balanced order.
    balance = (call.causal and n > 1 and s % (2 * n) == 0 and not sharding.balanced_layout)
    kernel = _history_kernel(backend, call)
    history = (functools.partial(ring_history, backend_name=backend.name)
               if strategy == "ring" else gathered_history)
    segment_ids = call.segment_ids
    if segment_ids is None:  # no mask: every token is history of one session
        segment_ids = jnp.ones((b, s), jnp.int32)

    def body(q, k, v, seg, mult):
        index = jax.lax.axis_index(context)
        local = q.shape[1]
        rows = lambda pos: jnp.broadcast_to(pos, seg.shape)
        contiguous = rows(index * local + jnp.arange(local, dtype=jnp.int32))
        if not balance:  # each device's tokens sit where the layout says
            pos = rows(balanced_positions(index, n, local)) if sharding.balanced_layout \
                else contiguous
            part = history(kernel, context, n, q, mult, seg, pos, k, v, seg, pos)
            return add_own_keys(call, part, q, k, v, seg, mult)
        q_b, seg_b = to_balanced(q, context, n), to_balanced(seg, context, n)
        mult_b = None if mult is None else to_balanced(mult, context, n)
        pos_b = rows(balanced_positions(index, n, local))
        if strategy == "ring":  # K / V in the same order, so every ring step is balanced too
            part = history(kernel, context, n, q_b, mult_b, seg_b, pos_b,
                           to_balanced(k, context, n), to_balanced(v, context, n), seg_b, pos_b)
        else:  # the gathered keys' order does not matter: positions say where they are
            part = history(kernel, context, n, q_b, mult_b, seg_b, pos_b, k, v, seg, contiguous)
        part = (from_balanced(part[0], context, n), from_balanced(part[1], context, n, axis=2))
        return add_own_keys(call, part, q, k, v, seg, mult)

    seg_spec = _spec(batch, context)
    mapped = _shard_map(body, sharding.mesh, (qkv_spec, qkv_spec, qkv_spec, seg_spec, mult_spec),
                        (qkv_spec, lse_spec))
    return mapped(call.q, call.k, call.v, segment_ids, multiplier)


def add_own_keys(call: AttentionCall, history, q, k, v, segment_ids, multiplier=None):
    """The final (out in q's dtype, lse float32 or float64): the history part merged with the
    own keys (``multiplier``: the queries' logit multiplier or None).

    Under jax.checkpoint, so the backward recomputes these elementwise terms instead of
    keeping them: otherwise autodiff would save the own-key partial's out, a
    [B, S, Hq, Dv] float32 copy of v, per layer.
    """
    @jax.checkpoint
    def merged(history, q, k, v, segment_ids, multiplier):
        own = own_key_partial(call, q, k, v, segment_ids, multiplier)
        out, lse = merge_partials([history, own])
        return out.astype(call.q.dtype), lse.astype(jnp.promote_types(call.q.dtype, jnp.float32))

    return merged(history, q, k, v, segment_ids, multiplier)


def compiled_collectives(hlo_text: str) -> dict[str, int]:
    """How many of each collective a compiled program (``.compile().as_text()``) runs."""
    kinds = ("all-gather", "all-reduce", "reduce-scatter", "collective-permute", "all-to-all")
    counts = {}
    for kind in kinds:
        counts[kind] = len([line for line in hlo_text.splitlines()
                            if f" {kind}(" in line or f" {kind}-start(" in line])
    return counts


__all__ = [
    "Sharding",
    "balanced_order",
    "choose_strategy",
    "compiled_collectives",
    "from_balanced",
    "merge_partials",
    "own_key_partial",
    "to_balanced",
]
