"""n-gram drafting as a token tree: the few most likely distinct continuations of the text's tail
become branches.

Occurrences of the tail are ranked as the chain drafter ranks them (a longer match first, then the most
recent), and the first `branches` distinct continuations (up to k tokens each) are merged into a trie:
continuations that start alike share their first nodes. Nodes are numbered continuation by continuation, so a
node budget keeps the best continuation whole first (the chain drafter's draft) and the others' branches after
it. A static shape (Medusa's choices) keeps only the nodes whose path, as the rank of each node among its
siblings, is listed. Vectorized over slots (numpy): the loops run over match lengths, continuations and
depths.
"""
from __future__ import annotations

import numpy as np

from specgen.engine.types import DraftTokens

# a path of sibling ranks as one integer: sum of (rank + 1) * RANK_BASE^i (ranks < RANK_BASE - 1)
RANK_BASE = 64


def path_keys(choices: tuple[tuple[int, ...], ...]) -> np.ndarray:
    """The integer key of every listed path and of every prefix of one ([num_keys] int64)."""
    keys = {0}
    for path in choices:
        key = 0
        for rank in path:
            key = key * RANK_BASE + rank + 1
            keys.add(key)
    return np.array(sorted(keys), np.int64)


def continuations(tokens: np.ndarray, seq_lens: np.ndarray, k: int, n_min: int, n_max: int,
                  branches: int) -> tuple[np.ndarray, np.ndarray]:
    """(ids [num_seqs, branches, k] int64, lens [num_seqs, branches] int64): the first `branches` distinct
    continuations of each slot's tail (tokens [num_seqs, width], valid up to seq_lens), best first."""
    num_seqs, width = tokens.shape
    prio = np.full((num_seqs, width), -1, np.int64)  # [num_seqs, width] rank of an occurrence ending at e
    for n in range(n_max, n_min - 1, -1):
        if n >= width:
            continue
        tail = tokens[np.arange(num_seqs)[:, None],
                      np.maximum(seq_lens[:, None] - n + np.arange(n), 0)]  # [S, n]
        hit = np.ones((num_seqs, width - n), bool)  # occurrence starting at i
        for j in range(n):
            hit &= tokens[:, j: j + width - n] == tail[:, j: j + 1]
        ends = np.arange(n, width)  # [width - n] index just past the occurrence
        hit &= (ends[None, :] <= seq_lens[:, None] - 1) & (seq_lens[:, None] > n)  # followed by a token
        prio[:, n:] = np.maximum(prio[:, n:], np.where(hit, n * width + ends[None, :], -1))
    cand = min(4 * branches, width)
    order = np.argsort(-prio, axis=1, kind="stable")[:, :cand]  # [S, cand] best occurrences first
    found = np.take_along_axis(prio, order, axis=1) >= 0
    idx = order[:, :, None] + np.arange(k)[None, None, :]  # [S, cand, k]
    ids = np.take_along_axis(tokens[:, None, :], np.minimum(idx, width - 1), axis=2)
    lens = np.where(found, np.minimum(seq_lens[:, None] - order, k), 0)  # [S, cand]
    ids = np.where(np.arange(k)[None, None, :] < lens[:, :, None], ids, -1)
    # a continuation equal to a better one adds nothing
    same = (ids[:, :, None, :] == ids[:, None, :, :]).all(axis=3) & (lens[:, :, None] == lens[:, None, :])
    dup = np.tril(same, k=-1).any(axis=2) | (lens == 0)  # [S, cand]
    pick = np.argsort(dup, axis=1, kind="stable")[:, :branches]  # the first `branches` distinct ones
    ids, lens = np.take_along_axis(ids, pick[:, :, None], axis=1), np.take_along_axis(lens, pick, axis=1)
    lens = np.where(np.take_along_axis(dup, pick, axis=1), 0, lens)
    return ids, lens


def trie(ids: np.ndarray, lens: np.ndarray, choices: np.ndarray | None = None) -> DraftTokens:
    """Continuations ids [num_seqs, R, k] (lens [num_seqs, R]) merged into one tree per slot, numbered
    continuation by continuation; with choices (path_keys), only the listed paths' nodes."""
    S, R, k = ids.shape
    d = np.arange(k)
    live = d[None, None, :] < lens[:, :, None]  # [S, R, k]
    # prefix [0, d] of continuation r equals continuation r2's: [S, R, R2, k]
    eq = np.cumprod(ids[:, :, None, :] == ids[:, None, :, :], axis=3).astype(bool) & live[:, :, None, :] \
        & live[:, None, :, :]
    owner = eq.argmax(axis=2)  # [S, R, k] the first continuation holding this prefix (r itself at the latest)
    node = live & (owner == np.arange(R)[None, :, None])  # [S, R, k] a node of its own
    flat = node.reshape(S, R * k)
    index = np.cumsum(flat, axis=1).reshape(S, R, k)  # block index of each node (1-based: 0 is the root)
    rows = np.arange(S)[:, None, None]
    owner_prev = np.concatenate([np.zeros((S, R, 1), np.int64), owner[:, :, :-1]], axis=2)  # parent's owner
    parent = np.where(d[None, None, :] == 0, 0, index[rows, owner_prev, np.maximum(d - 1, 0)[None, None, :]])
    width = R * k
    num = flat.sum(axis=1).astype(np.int64)
    out_ids, out_par = np.zeros((S, width), np.int64), np.zeros((S, width), np.int64)
    sel = np.nonzero(node)
    out_ids[sel[0], index[sel] - 1] = ids[sel]
    out_par[sel[0], index[sel] - 1] = parent[sel]
    if choices is not None:
        out_ids, out_par, num = _keep_paths(out_ids, out_par, num, choices)
    return DraftTokens(out_ids, num, None, out_par)


def _keep_paths(ids: np.ndarray, parents: np.ndarray, num: np.ndarray, choices: np.ndarray):
    """Only the nodes whose path of sibling ranks is in `choices` (keys with every prefix), renumbered."""
    S, width = ids.shape
    col = np.arange(width)
    valid = col[None, :] < num[:, None]
    earlier = (parents[:, :, None] == parents[:, None, :]) & (col[None, None, :] < col[None, :, None]) \
        & valid[:, None, :]
    rank = earlier.sum(axis=2)  # [S, width] siblings numbered before each node
    key = np.zeros((S, width + 1), np.int64)  # block-indexed, the root's key 0
    rows = np.arange(S)
    for i in range(1, width + 1):
        key[:, i] = key[rows, parents[:, i - 1]] * RANK_BASE + rank[:, i - 1] + 1
    keep = valid & np.isin(key[:, 1:], choices)
    new_index = np.concatenate([np.zeros((S, 1), np.int64),
                                np.cumsum(keep, axis=1)], axis=1)  # [S, width + 1]
    out_ids, out_par = np.zeros_like(ids), np.zeros_like(parents)
    s, i = np.nonzero(keep)
    out_ids[s, new_index[s, i + 1] - 1] = ids[s, i]
    out_par[s, new_index[s, i + 1] - 1] = new_index[s, parents[s, i]]
    return out_ids, out_par, keep.sum(axis=1).astype(np.int64)


def ngram_tree(tokens: np.ndarray, seq_lens: np.ndarray, max_depth: np.ndarray, k: int, n_min: int,
               n_max: int, branches: int, choices: np.ndarray | None = None) -> DraftTokens:
    """A token tree per slot (tokens [num_seqs, width], seq_lens [num_seqs]; no node deeper than max_depth
    [num_seqs]) from its first `branches` distinct n-gram continuations."""
    if len(seq_lens) == 0:
        z = np.zeros((0, branches * k), np.int64)
        return DraftTokens(z, np.zeros(0, np.int64), None, z)
    ids, lens = continuations(tokens, seq_lens, k, n_min, n_max, branches)
    return trie(ids, np.minimum(lens, max_depth[:, None]), choices)
