"""Sessions packed into rows of a fixed token budget, with signed segment ids.

A session is one user token, its history (oldest first) and its candidates:

    [user] [h_1 ... h_L] [c_1 ... c_C]     segment ids  +s ... +s  -s ... -s

Row r holds sessions s = 1, 2, ... back to back and padding (segment id 0) at
the end, which is exactly the mask rankattn.attention takes: history tokens
(user included) see their own session's history, candidates see that history
and themselves. Rotary positions are anchored on the right: the newest history
event sits at ``anchor - 1``, older ones count down, and every candidate sits at
``anchor``. A candidate therefore sees the same relative positions whatever the
history's length, and whichever other candidates share the request.

A session longer than a row keeps its most recent history events.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from examples.ranker.world import Sessions

PAD, USER, HISTORY, CANDIDATE = 0, 1, 2, 3


class Batch(NamedTuple):
    """Packed rows [R, T] (a pytree of arrays; every field is per token)."""

    kind: np.ndarray         # int32: PAD, USER, HISTORY or CANDIDATE
    segment_ids: np.ndarray  # int32: +s history (user token included), -s candidates, 0 padding
    positions: np.ndarray    # int32: right-anchored rotary positions
    user: np.ndarray         # int32: user id on user tokens, else 0
    context: np.ndarray      # int32: request context on user tokens, else 0
    item: np.ndarray         # int32: item id on history and candidate tokens, else 0
    author: np.ndarray       # int32: the item's author, else 0
    actions: np.ndarray      # float32 [R, T, A]: a history event's action multi-hot
    labels: np.ndarray       # float32 [R, T, A]: a candidate's labels
    session: np.ndarray      # int32: index of the token's session in the packed list, -1 padding
    candidate: np.ndarray    # int32: a candidate's index within its session, -1 elsewhere


def session_tokens(sessions: Sessions, row_tokens: int) -> np.ndarray:
    """int [N]: tokens each session takes in a row of ``row_tokens`` (history cut to fit)."""
    c = sessions.cand_item.shape[1]
    if row_tokens < c + 2:
        raise ValueError(f"row_tokens={row_tokens} cannot hold a user token, one history event and "
                         f"{c} candidates; use row_tokens >= {c + 2}")
    return 1 + np.minimum(sessions.history_len, row_tokens - 1 - c) + c


def pack(sessions: Sessions, row_tokens: int, anchor: int, rows: int | None = None,
         one_per_row: bool = False):
    """Pack sessions first-fit, in order, into rows of ``row_tokens`` tokens.

    With ``rows`` the batch has exactly that many rows and sessions that find no
    room are left out; without, rows are added until every session is placed.
    ``one_per_row`` gives every session a row of its own (serving's layout).
    Returns ``(batch, packed)``: the Batch and the indices of the packed sessions,
    in the order of their ``session`` ids.
    """
    sizes = session_tokens(sessions, row_tokens)
    used = []  # tokens used per row
    placement = []  # (session index, row, offset)
    for s, size in enumerate(sizes):
        row = None if one_per_row else next(
            (r for r, u in enumerate(used) if u + size <= row_tokens), None)
        if row is None:
            if rows is not None and len(used) == rows:
                continue
            used.append(0)
            row = len(used) - 1
        placement.append((s, row, used[row]))
        used[row] += size
    n_rows = rows if rows is not None else len(used)
    n_actions = sessions.labels.shape[-1]
    shape = (n_rows, row_tokens)
    out = {name: np.zeros(shape, np.int32) for name in Batch._fields
           if name not in ("actions", "labels")}
    out["session"][:] = -1
    out["candidate"][:] = -1
    out["actions"] = np.zeros(shape + (n_actions,), np.float32)
    out["labels"] = np.zeros(shape + (n_actions,), np.float32)
    segments_in_row = [0] * n_rows
    c = sessions.cand_item.shape[1]
    for packed_index, (s, row, at) in enumerate(placement):
        segments_in_row[row] += 1
        seg = segments_in_row[row]
        n_hist = sizes[s] - 1 - c
        hist = slice(sessions.history_len[s] - n_hist, sessions.history_len[s])  # the newest n_hist
        h0, c0, end = at + 1, at + 1 + n_hist, at + sizes[s]
        out["kind"][row, at], out["kind"][row, h0:c0], out["kind"][row, c0:end] = USER, HISTORY, CANDIDATE
        out["segment_ids"][row, at:c0], out["segment_ids"][row, c0:end] = seg, -seg
        out["positions"][row, at:c0] = anchor - np.arange(n_hist + 1, 0, -1)
        out["positions"][row, c0:end] = anchor
        out["user"][row, at], out["context"][row, at] = sessions.user[s], sessions.context[s]
        out["item"][row, h0:c0], out["author"][row, h0:c0] = (sessions.history_item[s, hist],
                                                              sessions.history_author[s, hist])
        out["actions"][row, h0:c0] = sessions.history_actions[s, hist]
        out["item"][row, c0:end], out["author"][row, c0:end] = (sessions.cand_item[s],
                                                                sessions.cand_author[s])
        out["labels"][row, c0:end] = sessions.labels[s]
        out["session"][row, at:end] = packed_index
        out["candidate"][row, c0:end] = np.arange(c)
    return Batch(**out), np.array([s for s, _, _ in placement], np.int64)


def efficiency(batch: Batch) -> float:
    """Fraction of the batch's tokens that are not padding."""
    return float((np.asarray(batch.kind) != PAD).mean())


def unpack(batch: Batch) -> list[dict]:
    """The sessions of a packed batch, in ``session`` order, as dicts of host arrays.

    Keys: user, context, history_item, history_author, history_actions (the
    history as packed, oldest first), cand_item, cand_author, labels.
    """
    kind, session = np.asarray(batch.kind), np.asarray(batch.session)
    out = []
    for s in range(int(session.max()) + 1):
        here = session == s
        user_tok = here & (kind == USER)
        hist, cand = here & (kind == HISTORY), here & (kind == CANDIDATE)
        out.append(dict(user=int(np.asarray(batch.user)[user_tok][0]),
                        context=int(np.asarray(batch.context)[user_tok][0]),
                        history_item=np.asarray(batch.item)[hist],
                        history_author=np.asarray(batch.author)[hist],
                        history_actions=np.asarray(batch.actions)[hist] > 0.5,
                        cand_item=np.asarray(batch.item)[cand],
                        cand_author=np.asarray(batch.author)[cand],
                        labels=np.asarray(batch.labels)[cand]))
    return out
