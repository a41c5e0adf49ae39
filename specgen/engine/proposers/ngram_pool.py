"""The job's n-gram pool: finished requests' text, looked up when a slot's own text has no (or a
shorter) match.

In a batch job the requests resemble each other (the same instruction over many inputs; code rewritten into
the same shape), so a slot's next tokens often continue the way another request's text continued. The pool
keeps the prompt + output of the last `capacity` tokens of finished requests in a ring buffer, and for each
n-gram length a direct-mapped hash table from an n-gram to where its latest occurrence ends. A table entry
another n-gram overwrote, or one pointing at text the ring has since overwritten, is simply a miss: drafts are
only guesses, verification keeps the output exact.

Everything is vectorized: lookups over slots, insertion over the positions of the requests that finished in a
step.
"""
from __future__ import annotations

import numpy as np

from specgen.kernels import host

_MULT = np.uint64(0x9E3779B97F4A7C15)  # odd 64-bit multiplier (golden ratio), for hashing and table indices
_SEP = -1  # between sequences in the ring: a draft stops there


def ngram_hashes(windows: np.ndarray) -> np.ndarray:
    """[num, n] int64 token windows -> [num] uint64 hashes (polynomial in the multiplier, wrapping)."""
    h = np.zeros(windows.shape[0], np.uint64)
    with np.errstate(over="ignore"):
        for j in range(windows.shape[1]):
            h = (h + windows[:, j].astype(np.uint64) + np.uint64(1)) * _MULT
    return h


class NgramPool:
    """Ring of finished text plus one hash table per n in [n_min, n_max]."""

    def __init__(self, capacity: int, n_min: int, n_max: int, table_bits: int = 18):
        self.capacity, self.n_min, self.n_max, self.table_bits = capacity, n_min, n_max, table_bits
        self.ring = np.full(capacity, _SEP, np.int64)  # [capacity] token ids, _SEP between sequences
        size = 1 << table_bits
        self.keys = np.zeros((n_max + 1, size), np.uint64)  # [n_max + 1, table_size] full hash of the n-gram
        self.ends = np.full((n_max + 1, size), -1, np.int64)  # [n_max + 1, table_size] stream position
        # after it
        # the pool for ngram.cc, by address (its arrays are only ever updated in place), and
        # the tokens written
        self.view = host.PoolView(self.ring.ctypes.data, capacity, self.keys.ctypes.data,
                                  self.ends.ctypes.data, table_bits, 0)

    @property
    def written(self) -> int:
        """Tokens ever written: stream position p lives at ring[p % capacity] while
        p >= written - capacity."""
        return self.view.written

    def _slot(self, h: np.ndarray) -> np.ndarray:
        with np.errstate(over="ignore"):
            return ((h * _MULT) >> np.uint64(64 - self.table_bits)).astype(np.int64)

    def add(self, seq: np.ndarray) -> None:
        """Append one finished request's prompt + output ([seq_len] int64)."""
        self.add_batch(seq[None, :], np.array([len(seq)]))

    def add_batch(self, tokens: np.ndarray, seq_lens: np.ndarray) -> None:
        """Append the requests that finished in one step and index their n-grams.

        tokens: [num_seqs, width] int64 each request's prompt + output, valid up to seq_lens
        ([num_seqs] int64)
        """
        col = np.arange(tokens.shape[1] + 1)[None, :]  # [1, width + 1]
        padded = np.concatenate([tokens, np.full((len(tokens), 1), _SEP, np.int64)], axis=1)
        padded = np.where(col < seq_lens[:, None], padded, _SEP)  # [num_seqs, width + 1] a separator
        # after each
        stream = padded[col <= seq_lens[:, None]][-self.capacity:]  # [num_stream] in order, at most the ring
        start = self.written
        self.ring[(start + np.arange(len(stream))) % self.capacity] = stream
        self.view.written += len(stream)
        for n in range(self.n_min, self.n_max + 1):
            if len(stream) <= n:
                continue
            windows = np.lib.stride_tricks.sliding_window_view(stream, n + 1)  # [num_windows, n + 1]
            # n-grams followed by a token of the same request
            at = np.nonzero((windows != _SEP).all(axis=1))[0]
            h = ngram_hashes(windows[at, :n])  # [num_ngrams]
            slot = self._slot(h)
            # Later occurrences win: keep the last write to each table slot.
            last = len(slot) - 1 - np.unique(slot[::-1], return_index=True)[1]
            self.keys[n, slot[last]] = h[last]
            self.ends[n, slot[last]] = start + at[last] + n

    def lookup(self, tails: np.ndarray, tail_lens: np.ndarray, k: int,
               lib=None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """lookup_reference's result, from ngram.cc when `lib` (specgen.kernels.host_lib()) is given."""
        if lib is None:
            return self.lookup_reference(tails, tail_lens, k)
        return host.pool_lookup(lib, tails, tail_lens, host.NgramRule(k, self.n_min, self.n_max), self.view)

    def lookup_reference(self, tails: np.ndarray, tail_lens: np.ndarray,
                         k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Drafts for the slots whose last tokens are `tails`.

        tails: [num_seqs, n_max] int64, each slot's last n_max tokens, right-aligned
        tail_lens: [num_seqs] int64 tokens of the slot's text (a tail longer than it is not looked up)
        Returns draft_ids [num_seqs, k] int64, num_draft [num_seqs] int64, match_len [num_seqs] int64
        (0: none).
        """
        num_seqs = tails.shape[0]
        end = np.full(num_seqs, -1, np.int64)
        match_len = np.zeros(num_seqs, np.int64)
        oldest = self.written - self.capacity
        for n in range(self.n_max, self.n_min - 1, -1):
            need = (match_len == 0) & (tail_lens >= n)
            if not need.any():
                continue
            h = ngram_hashes(tails[:, self.n_max - n:])  # [num_seqs]
            slot = self._slot(h)
            e = self.ends[n, slot]  # [num_seqs]
            hit = need & (self.keys[n, slot] == h) & (e >= 0) & (e - n >= oldest)
            end = np.where(hit, e, end)
            match_len = np.where(hit, n, match_len)
        pos = end[:, None] + np.arange(k)[None, :]  # [num_seqs, k] stream positions of the draft
        draft = self.ring[pos % self.capacity]
        ok = (match_len > 0)[:, None] & (pos < self.written) & (draft != _SEP)
        num_draft = np.cumprod(ok, axis=1).sum(axis=1).astype(np.int64)  # stop at the first separator
        draft_ids = np.where(np.arange(k)[None, :] < num_draft[:, None], draft, 0)
        return draft_ids, num_draft, np.where(num_draft > 0, match_len, 0)
