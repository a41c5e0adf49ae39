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

Pairs = tuple[np.ndarray, np.ndarray]  # (row [m] int64, token [m] int64)


@dataclass(frozen=True)
class RowPenalties:
    """What each processed row needs: [n] per row."""

    repetition: np.ndarray  # float64, 1 = off
    presence: np.ndarray  # float64
    frequency: np.ndarray  # float64


@dataclass(frozen=True)
class Touched:
    """The (row, token) entries a row's processing can change, each once, sorted by row * vocab + token: the
    tokens of its history (prompt, output, drafts on its path), its logit bias, EOS and its stop ids while
    min_tokens holds them back."""

    row: np.ndarray  # [m] int64 processed row (0..n-1)
    token: np.ndarray  # [m] int64
    out_count: np.ndarray  # [m] float64 the token's count in the output before the row (drafts included)
    in_prompt: np.ndarray  # [m] bool
    bias: np.ndarray  # [m] float64 (0: none)
    held: np.ndarray  # [m] bool EOS or a stop id the row may not choose yet (min_tokens)

    @classmethod
    def gather(cls, vocab: int, output: Pairs, prompt: Pairs, bias: tuple[np.ndarray, np.ndarray, np.ndarray],
               eos: Pairs) -> "Touched":
        """From (row, token) pairs of the output tokens before each row (repeats counted), of its prompt, of
        its logit bias (row, token, bias) and of the stop tokens it may not choose yet."""
        keys = [r * vocab + t for r, t in (output, prompt, bias[:2], eos)]
        out_keys, counts = np.unique(keys[0], return_counts=True)
        key = np.unique(np.concatenate(keys))
        out_count = np.zeros(len(key))
        out_count[np.searchsorted(key, out_keys)] = counts
        in_prompt = np.zeros(len(key), bool)
        in_prompt[np.searchsorted(key, keys[1])] = True
        bias_of = np.zeros(len(key))
        bias_of[np.searchsorted(key, keys[2])] = bias[2]
        held = np.zeros(len(key), bool)
        held[np.searchsorted(key, keys[3])] = True
        return cls(key // vocab, key % vocab, out_count, in_prompt, bias_of, held)


def apply(x: np.ndarray, touched: Touched, p: RowPenalties) -> np.ndarray:
    """The processed values, float64, of the touched entries whose logits are x [m] (every other logit of a
    row is left as it is: each step below is the identity there)."""
    x = x.astype(np.float64)
    r = touched.row
    x[touched.held] = -np.inf
    x += touched.bias
    rep = p.repetition[r]
    seen = touched.in_prompt | (touched.out_count > 0)
    x = np.where(seen & (rep != 1), np.where(x > 0, x / rep, x * rep), x)
    return x - (p.frequency[r] * touched.out_count + p.presence[r] * (touched.out_count > 0))


def row_tokens(tokens: np.ndarray, start: np.ndarray, end: np.ndarray) -> Pairs:
    """(row, token) of tokens[i, start[i]:end[i]] for each row i of tokens [n, capacity]."""
    col = np.arange(tokens.shape[1])[None, :]
    row, c = np.nonzero((col >= start[:, None]) & (col < end[:, None]))
    return row, tokens[row, c]


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
