"""Verification of drafts against the main model's own choices: pure array functions, all slots at once."""
from __future__ import annotations

import numpy as np


def accept_lengths(
    draft_ids: np.ndarray,  # [num_seqs, max_draft] int64 (entries past num_draft are ignored)
    num_draft: np.ndarray,  # [num_seqs] int64
    target_ids: np.ndarray,  # [num_seqs, max_draft + 1] int64 the token plain decoding picks at each position
) -> np.ndarray:
    """Accepted drafts per slot: the longest prefix where draft == target; [num_seqs] int64.

    Because the target at each position is exactly what plain decoding would emit there (greedy argmax, or
    the counter-based sample), the emitted tokens target[:accepted + 1] are plain decoding's tokens.
    """
    max_draft = draft_ids.shape[1]
    if max_draft == 0:
        return np.zeros(len(num_draft), dtype=np.int64)
    col = np.arange(max_draft)[None, :]
    match = (draft_ids == target_ids[:, :max_draft]) & (col < num_draft[:, None])  # [num_seqs, max_draft]
    return np.cumprod(match, axis=1).sum(axis=1).astype(np.int64)


def first_stop(
    emitted: np.ndarray,  # [num_seqs, width] int64 tokens in emission order
    num_emitted: np.ndarray,  # [num_seqs] int64 valid tokens per row (>= 1)
    eos_ids: np.ndarray,  # [num_eos] int64
    room: np.ndarray,  # [num_seqs] int64 tokens the request may still emit (max_tokens and context)
    ignore_eos: np.ndarray,  # [num_seqs] bool
    stop_ids: np.ndarray | None = None,  # [num_seqs, width] int64 each request's stop token ids (-1: none)
) -> tuple[np.ndarray, np.ndarray]:
    """Cut each emitted run at the first EOS (unless ignore_eos) or stop token id, or when the request runs
    out of room.

    Returns (kept [num_seqs] int64, stopped_by_eos [num_seqs] bool). kept >= 1 when room >= 1.
    """
    width = emitted.shape[1]
    col = np.arange(width)[None, :]
    is_eos = (emitted[:, :, None] == eos_ids).any(axis=2)  # [num_seqs, width] (np.isin costs ~10x more here)
    is_eos &= ~ignore_eos[:, None]
    if stop_ids is not None and stop_ids.shape[1]:
        is_eos |= (emitted[:, :, None] == stop_ids[:, None, :]).any(axis=2)  # (-1 matches no token)
    is_eos &= col < num_emitted[:, None]
    has_eos = is_eos.any(axis=1)
    eos_at = np.where(has_eos, is_eos.argmax(axis=1), width)
    kept = np.minimum(np.minimum(num_emitted, eos_at + 1), room)
    stopped_by_eos = has_eos & (eos_at < kept)
    return kept.astype(np.int64), stopped_by_eos
