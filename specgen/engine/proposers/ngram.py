"""n-gram drafting (prompt lookup): continue the text the way an earlier occurrence of its tail continued.

For each decoding slot, the last n tokens (n from ngram_max down to ngram_min) are searched for in the
slot's prompt + output. Among several occurrences the most recent wins (the one starting latest), since
recent text predicts the next tokens best; a longer n wins over a shorter one. The draft is the up-to-k
tokens that followed the occurrence; they may run into the tail itself (overlap is allowed).

With the job's pool on (SpecConfig.ngram_pool, ngram_pool.py), the same tail is also looked up in the text of
requests that finished earlier in the job; that draft replaces the slot's own only when its n is longer.
"""
from __future__ import annotations

import numpy as np

from specgen.engine.proposers.base import SlotView
from specgen.engine.proposers.ngram_pool import NgramPool
from specgen.engine.types import DraftTokens, StepUpdate


def ngram_propose(tokens: np.ndarray, seq_lens: np.ndarray, k: int, n_min: int, n_max: int) -> DraftTokens:
    """ngram_match's drafts alone."""
    return ngram_match(tokens, seq_lens, k, n_min, n_max)[0]


def ngram_match(
    tokens: np.ndarray,  # [num_seqs, width] int64 each slot's prompt + output (valid up to seq_lens)
    seq_lens: np.ndarray,  # [num_seqs] int64
    k: int,
    n_min: int,
    n_max: int,
) -> tuple[DraftTokens, np.ndarray]:
    """Drafts and the length n of each slot's match ([num_seqs] int64, 0 where none). Vectorized over slots; the
    reference for any native kernel."""
    num_seqs, width = tokens.shape
    draft = np.zeros((num_seqs, k), np.int64)
    num_draft = np.zeros(num_seqs, np.int64)
    match_len = np.zeros(num_seqs, np.int64)
    if num_seqs == 0 or width < 2:
        return DraftTokens(draft, num_draft), match_len
    rows = np.arange(num_seqs)
    found = np.zeros(num_seqs, bool)
    match_end = np.zeros(num_seqs, np.int64)  # index just past the matched occurrence
    for n in range(n_max, n_min - 1, -1):
        if n >= width:
            continue
        need = ~found & (seq_lens > n)  # a tail of n tokens and something before it
        if not need.any():
            continue
        tail_start = seq_lens - n  # [num_seqs]
        starts = np.arange(width - n)  # candidate occurrence starts i: tokens[i : i + n]
        hit = np.ones((num_seqs, width - n), bool)
        for j in range(n):
            tail_j = tokens[rows, np.maximum(tail_start + j, 0)]  # [num_seqs]
            hit &= tokens[:, j : j + width - n] == tail_j[:, None]
        # An occurrence must end before the tail ends and be followed by a token: i + n <= seq_len - 1.
        hit &= starts[None, :] + n <= (seq_lens - 1)[:, None]
        has = hit.any(axis=1) & need
        last = (width - n - 1) - np.argmax(hit[:, ::-1], axis=1)  # most recent start
        match_end = np.where(has, last + n, match_end)
        match_len = np.where(has, n, match_len)
        found |= has
    avail = np.where(found, seq_lens - match_end, 0)  # tokens that follow the occurrence
    num_draft = np.minimum(avail, k).astype(np.int64)
    idx = np.minimum(match_end[:, None] + np.arange(k)[None, :], width - 1)
    draft = np.where(np.arange(k)[None, :] < num_draft[:, None], tokens[rows[:, None], idx], 0)
    return DraftTokens(draft.astype(np.int64), num_draft), np.where(num_draft > 0, match_len, 0)


class NgramProposer:
    """Drafts up to k tokens per slot by n-gram lookup in its own prompt and output, and, when a pool is kept
    (pool_capacity > 0), in the text of the job's finished requests: the pool's draft is taken only where its
    match is longer than the slot's own (ties go to the slot's own text)."""

    def __init__(self, k: int, n_min: int, n_max: int, pool_capacity: int = 0):
        self.k, self.n_min, self.n_max = k, n_min, n_max
        self.pool = NgramPool(pool_capacity, n_min, n_max) if pool_capacity > 0 else None

    def propose(self, view: SlotView) -> DraftTokens:
        if len(view.slots) == 0:
            return DraftTokens(np.zeros((0, self.k), np.int64), np.zeros(0, np.int64))
        width = int(view.seq_lens.max())
        own, own_len = ngram_match(view.tokens[view.slots, :width], view.seq_lens, self.k, self.n_min, self.n_max)
        draft_ids, num_draft = own.draft_ids, own.num_draft
        if self.pool is not None and self.pool.written:
            cols = view.seq_lens[:, None] - self.n_max + np.arange(self.n_max)[None, :]  # [num_seqs, n_max]
            tails = view.tokens[view.slots[:, None], np.maximum(cols, 0)]  # [num_seqs, n_max] right-aligned
            pool_ids, pool_num, pool_len = self.pool.lookup(tails, view.seq_lens, self.k)
            take = pool_len > own_len  # [num_seqs]
            draft_ids = np.where(take[:, None], pool_ids, draft_ids)
            num_draft = np.where(take, pool_num, num_draft)
        return DraftTokens(draft_ids, np.minimum(num_draft, view.max_draft))

    def observe(self, update: StepUpdate) -> None:
        if self.pool is None or not update.finished.any():
            return  # the token buffer is all the state lookup in a slot's own text needs
        for slot, seq_len in zip(update.slots[update.finished], update.seq_lens[update.finished]):
            self.pool.add(update.tokens[slot, :seq_len])
