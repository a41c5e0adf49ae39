"""Penalties, logit bias and min_tokens: each logit row processed with the tokens before it, before the row's
token is chosen (greedy or sampled).

A verified position sees the committed tokens and the drafts on its path (a chain: the drafts up to it; a tree
node: itself and its ancestors), so its row is processed exactly as plain decoding processes that position's
row once those drafts are its tokens: speculation changes no token. Order (vLLM's): min_tokens (EOS masked),
logit bias, repetition penalty (transformers': over prompt and output), then OpenAI's frequency and presence
penalties (over the output), in float64.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class RowPenalties:
    """What each processed row needs: [n] per row unless noted."""

    repetition: np.ndarray  # float64, 1 = off
    presence: np.ndarray  # float64
    frequency: np.ndarray  # float64
    no_eos: np.ndarray  # bool: the output is shorter than min_tokens
    bias_ids: np.ndarray  # [n, width] int64 (-1: no entry)
    bias: np.ndarray  # [n, width] float64
    out_counts: np.ndarray  # [n, vocab] float64 each token's count in the output before the row
    in_prompt: np.ndarray  # [n, vocab] bool the token is in the prompt


def apply(x: np.ndarray, p: RowPenalties, eos_ids: np.ndarray) -> np.ndarray:
    """Rows x [n, vocab] (any float dtype) -> the processed rows, float64."""
    x = x.astype(np.float64)
    rows = np.arange(len(x))
    if p.no_eos.any():
        x[np.ix_(rows[p.no_eos], eos_ids)] = -np.inf
    has = p.bias_ids >= 0
    if has.any():
        np.add.at(x, (np.nonzero(has)[0], p.bias_ids[has]), p.bias[has])
    rep = p.repetition[:, None]
    if (rep != 1).any():
        seen = p.in_prompt | (p.out_counts > 0)
        x = np.where(seen, np.where(x > 0, x / rep, x * rep), x)
    if (p.frequency != 0).any() or (p.presence != 0).any():
        x -= p.frequency[:, None] * p.out_counts + p.presence[:, None] * (p.out_counts > 0)
    return x


def slot_counts(tokens: np.ndarray, start: np.ndarray, end: np.ndarray, vocab: int) -> np.ndarray:
    """Counts [n, vocab] float64 of tokens[i, start[i]:end[i]] for each row i of tokens [n, capacity]."""
    col = np.arange(tokens.shape[1])[None, :]
    inside = (col >= start[:, None]) & (col < end[:, None])
    flat = (np.nonzero(inside)[0] * vocab + tokens[inside]).astype(np.int64)
    return np.bincount(flat, minlength=len(tokens) * vocab).reshape(len(tokens), vocab).astype(np.float64)


def on_path(num_draft: np.ndarray, parents: np.ndarray | None, width: int) -> np.ndarray:
    """[num_dec, width + 1, width + 1] bool: block position a (a >= 1, a draft) is on the path from the root
    to block position b, b itself included (a chain: 1 <= a <= b; a tree: b and its ancestors): the drafts
    before the token b's row chooses. Positions past num_draft are False."""
    n = len(num_draft)
    out = np.zeros((n, width + 1, width + 1), bool)
    seqs = np.arange(n)
    for b in range(1, width + 1):  # over block positions, every slot at once; parents come first
        parent = np.full(n, b - 1) if parents is None else parents[:, b - 1]  # block index of b's parent
        out[:, b] = out[seqs, parent]
        out[:, b, b] = True
    fed = np.arange(width + 1)[None, :] <= num_draft[:, None]  # [n, width + 1]
    return out & fed[:, :, None] & fed[:, None, :]
