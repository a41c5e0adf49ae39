"""n-gram drafting (prompt lookup): continue the text the way an earlier occurrence of its tail continued.

For each decoding slot, the last n tokens (n from ngram_max down to ngram_min) are searched for in the
slot's prompt + output. Among several occurrences the most recent wins (the one starting latest), since
recent text predicts the next tokens best; a longer n wins over a shorter one. The draft is the up-to-k
tokens that followed the occurrence; they may run into the tail itself (overlap is allowed).
"""
from __future__ import annotations

import numpy as np

from specgen.engine.proposers.base import SlotView
from specgen.engine.types import DraftTokens, StepUpdate


def ngram_propose(
    tokens: np.ndarray,  # [num_seqs, width] int64 each slot's prompt + output (valid up to seq_lens)
    seq_lens: np.ndarray,  # [num_seqs] int64
    k: int,
    n_min: int,
    n_max: int,
) -> DraftTokens:
    """Vectorized over slots; the reference for any native kernel."""
    num_seqs, width = tokens.shape
    draft = np.zeros((num_seqs, k), np.int64)
    num_draft = np.zeros(num_seqs, np.int64)
    if num_seqs == 0 or width < 2:
        return DraftTokens(draft, num_draft)
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
        found |= has
    avail = np.where(found, seq_lens - match_end, 0)  # tokens that follow the occurrence
    num_draft = np.minimum(avail, k).astype(np.int64)
    idx = np.minimum(match_end[:, None] + np.arange(k)[None, :], width - 1)
    draft = np.where(np.arange(k)[None, :] < num_draft[:, None], tokens[rows[:, None], idx], 0)
    return DraftTokens(draft.astype(np.int64), num_draft)


class NgramProposer:
    """Drafts up to k tokens per slot by n-gram lookup in its own prompt and output."""

    def __init__(self, k: int, n_min: int, n_max: int):
        self.k, self.n_min, self.n_max = k, n_min, n_max

    def propose(self, view: SlotView) -> DraftTokens:
        if len(view.slots) == 0:
            return DraftTokens(np.zeros((0, self.k), np.int64), np.zeros(0, np.int64))
        width = int(view.seq_lens.max())
        drafts = ngram_propose(view.tokens[view.slots, :width], view.seq_lens, self.k, self.n_min, self.n_max)
        return DraftTokens(drafts.draft_ids, np.minimum(drafts.num_draft, view.max_draft))

    def observe(self, update: StepUpdate) -> None:
        return None  # the token buffer is all the state n-gram lookup needs
