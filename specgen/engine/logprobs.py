"""Log-probabilities of the output tokens: computed from the step's logit rows, kept per slot and position.

A token's log-probability is the model's raw log-softmax at the row the token was chosen from (vLLM's
default), in float64. Plain decoding and speculation choose each token from the same row (a verified draft's
row is the row plain decoding would have run), so the values do not depend on the method, the batch or the
slot.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import paddle


def row_logprobs(
    logits: paddle.Tensor,  # [num_logits, vocab]
    rows: np.ndarray,  # [n] int64 the rows wanted
    tokens: np.ndarray,  # [n] int64 the token chosen at each of them
    top: int,  # most likely tokens wanted per row (0: none)
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(logprob [n] float64 of each chosen token, top_ids [n, top] int64, top_logprobs [n, top] float64): the
    log-softmax in float64, its normalizer in numpy, whose reductions along a row do not depend on the other
    rows (Paddle's logsumexp gave the same row other bits at batch 1 than at batch 4). The top tokens come
    most likely first, the lower id first on a tie: Paddle's top-k of the logits (the log-softmax keeps their
    order), re-sorted here; a full sort of the rows when a tie reaches past the top."""
    picked = paddle.gather(logits, paddle.to_tensor(rows))  # [n, vocab]
    x = picked.numpy().astype(np.float64)
    peak = x.max(axis=-1, keepdims=True)
    lse = peak + np.log(np.exp(x - peak).sum(axis=-1, keepdims=True))  # [n, 1]
    logprob = np.take_along_axis(x, tokens[:, None], axis=-1)[:, 0] - lse[:, 0]
    if top == 0:
        return logprob, np.zeros((len(rows), 0), np.int64), np.zeros((len(rows), 0))
    k = min(top + 1, x.shape[-1])
    vals, ids = (a.numpy() for a in paddle.topk(picked, k, axis=-1))
    ids = ids.astype(np.int64)
    if k > top and (vals[:, top] == vals[:, top - 1]).any():  # a tie at the edge: tokens past the k returned
        ids = np.argsort(-x, axis=-1, kind="stable")[:, :k]  # by value, the lower id first
    vals = np.take_along_axis(x, ids, -1) - lse
    order = np.lexsort((ids, -vals), axis=-1)[:, :top]  # by value, then id
    return logprob, np.take_along_axis(ids, order, -1), np.take_along_axis(vals, order, -1)


@dataclass
class LogprobTable:
    """Each slot's output log-probabilities by position (the same positions as SlotTable.tokens); made by the
    engine when a request first asks for them."""

    logprob: np.ndarray  # [num_slots, capacity] float64
    top_ids: np.ndarray  # [num_slots, capacity, width] int64
    top_logprobs: np.ndarray  # [num_slots, capacity, width] float64

    @classmethod
    def empty(cls, num_slots: int, capacity: int, width: int) -> "LogprobTable":
        return cls(np.zeros((num_slots, capacity)), np.zeros((num_slots, capacity, width), np.int64),
                   np.zeros((num_slots, capacity, width)))

    def fit(self, capacity: int, width: int) -> None:
        """Room for `capacity` positions and `width` top tokens (grown, never shrunk)."""
        n, c, w = self.top_ids.shape
        if capacity <= c and width <= w:
            return
        c, w = max(capacity, c), max(width, w)
        old = self.logprob, self.top_ids, self.top_logprobs
        self.logprob, self.top_ids, self.top_logprobs = (
            np.zeros((n, c)), np.zeros((n, c, w), np.int64), np.zeros((n, c, w)))
        self.logprob[:, : old[0].shape[1]] = old[0]
        self.top_ids[:, : old[1].shape[1], : old[1].shape[2]] = old[1]
        self.top_logprobs[:, : old[2].shape[1], : old[2].shape[2]] = old[2]

    def write(self, slots: np.ndarray, positions: np.ndarray, logprob: np.ndarray, top_ids: np.ndarray,
              top_logprobs: np.ndarray) -> None:
        """Entries [n] at (slots[i], positions[i]); top_* [n, top] with top <= width."""
        self.logprob[slots, positions] = logprob
        top = top_ids.shape[1]
        self.top_ids[slots, positions, :top] = top_ids
        self.top_logprobs[slots, positions, :top] = top_logprobs

    def entries(self, slot: int, start: int, token_ids: list[int], top: int,
                piece: Callable[[int], str]) -> list[dict]:
        """The output record's `logprobs` (docs/output-schema.md) of `slot`'s tokens `token_ids`, which sit
        from position `start` on; `piece(id)` is a token's text."""
        out = []
        for j, tok in enumerate(token_ids):
            p = start + j
            tops = [{"token_id": int(i), "token": piece(int(i)), "logprob": float(v)}
                    for i, v in zip(self.top_ids[slot, p, :top], self.top_logprobs[slot, p, :top])]
            out.append({"token_id": int(tok), "token": piece(int(tok)),
                        "logprob": float(self.logprob[slot, p]), "top_logprobs": tops})
        return out
