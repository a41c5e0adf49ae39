"""Log-probabilities of the output tokens (and of the prompt's, where asked), kept per slot and position (the
backend computes them from the
step's logit rows: layers/logprobs.py, kernels/sampling.cc).

A token's log-probability is the model's raw log-softmax at the row the token was chosen from (vLLM's
default), in float64. Plain decoding and speculation choose each token from the same row (a verified draft's
row is the row plain decoding would have run), so the values do not depend on the method, the batch or the
slot.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np


@dataclass
class LogprobTable:
    """Each slot's output log-probabilities by position (the same positions as SlotTable.tokens); made by the
    engine when a request first asks for them."""

    logprob: np.ndarray  # [num_slots, capacity] float64
    top_ids: np.ndarray  # [num_slots, capacity, width] int64
    top_logprobs: np.ndarray  # [num_slots, capacity, width] float64
    rank: np.ndarray  # [num_slots, capacity] int64 the token's rank in its row (1: the most likely; ties
    # share one), kept for prompt tokens (prompt_logprobs, vLLM's)

    @classmethod
    def empty(cls, num_slots: int, capacity: int, width: int) -> "LogprobTable":
        return cls(np.zeros((num_slots, capacity)), np.zeros((num_slots, capacity, width), np.int64),
                   np.zeros((num_slots, capacity, width)), np.zeros((num_slots, capacity), np.int64))

    def fit(self, capacity: int, width: int) -> None:
        """Room for `capacity` positions and `width` top tokens (grown, never shrunk)."""
        n, c, w = self.top_ids.shape
        if capacity <= c and width <= w:
            return
        c, w = max(capacity, c), max(width, w)
        old = self.logprob, self.top_ids, self.top_logprobs, self.rank
        self.logprob, self.top_ids, self.top_logprobs, self.rank = (
            np.zeros((n, c)), np.zeros((n, c, w), np.int64), np.zeros((n, c, w)), np.zeros((n, c), np.int64))
        self.logprob[:, : old[0].shape[1]] = old[0]
        self.top_ids[:, : old[1].shape[1], : old[1].shape[2]] = old[1]
        self.top_logprobs[:, : old[2].shape[1], : old[2].shape[2]] = old[2]
        self.rank[:, : old[3].shape[1]] = old[3]

    def write(self, slots: np.ndarray, positions: np.ndarray, logprob: np.ndarray, top_ids: np.ndarray,
              top_logprobs: np.ndarray, rank: np.ndarray | None = None) -> None:
        """Entries [n] at (slots[i], positions[i]); top_* [n, top] with top <= width; rank [n] where known."""
        self.logprob[slots, positions] = logprob
        top = top_ids.shape[1]
        self.top_ids[slots, positions, :top] = top_ids
        self.top_logprobs[slots, positions, :top] = top_logprobs
        if rank is not None:
            self.rank[slots, positions] = rank

    def copy(self, src: int, dst: int, start: int, stop: int) -> None:
        """Positions [start, stop) of slot `src` into slot `dst` (a sample given its sample 0's prompt)."""
        for a in (self.logprob, self.top_ids, self.top_logprobs, self.rank):
            a[dst, start:stop] = a[src, start:stop]

    def entries(self, slot: int, start: int, token_ids: list[int], top: int,
                piece: Callable[[int], str], ranked: bool = False) -> list[dict]:
        """The output record's `logprobs` (docs/output-schema.md) of `slot`'s tokens `token_ids`, which sit
        from position `start` on; `piece(id)` is a token's text; `ranked`: with each token's rank (the
        prompt's entries)."""
        out = []
        for j, tok in enumerate(token_ids):
            p = start + j
            tops = [{"token_id": int(i), "token": piece(int(i)), "logprob": float(v)}
                    for i, v in zip(self.top_ids[slot, p, :top], self.top_logprobs[slot, p, :top])
                    if np.isfinite(v)]  # (processed: tokens the filters left out are not listed)
            entry = {"token_id": int(tok), "token": piece(int(tok)), "logprob": float(self.logprob[slot, p])}
            if ranked:
                entry["rank"] = int(self.rank[slot, p])
            out.append({**entry, "top_logprobs": tops})
        return out
