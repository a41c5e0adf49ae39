"""Training windows over the cached sequences, the held-out split, the label shortlist, and batches.

A training example is a position i of a sequence: inputs (hidden state of i, token i + 1), label the main
model's greedy choice at i + 2 given tokens [0, i + 2), which is exactly what verification accepts. In the
continuation (i >= prompt_len - 1) that is token i + 2 itself; inside the prompt it is the recorded greedy
choice (`CachedData.targets`), and prompt positions are examples only with `prompt_examples` (held-out
evaluation never uses them). A window is `seq_len` consecutive positions of one sequence; the head attends
causally within it. Windows tile each sequence's examples; each repeats the last `overlap` positions of the
one before it (or the prompt positions before the first example) as context only, so every example carries a
loss in exactly one window.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from specgen.train.data import CachedData


@dataclass(frozen=True)
class Windows:
    """Window w covers positions [start[w], start[w] + length[w]) of sequence seq[w]; loss from
    loss_from[w]."""

    seq: np.ndarray  # [num_windows] int64
    start: np.ndarray  # [num_windows] int64
    length: np.ndarray  # [num_windows] int64 <= seq_len
    loss_from: np.ndarray  # [num_windows] int64

    def subset(self, keep: np.ndarray) -> Windows:
        return Windows(self.seq[keep], self.start[keep], self.length[keep], self.loss_from[keep])

    def __len__(self) -> int:
        return len(self.seq)


def make_windows(data: CachedData, seq_len: int, overlap: int, prompt_examples: bool,
                 from_end: bool = False) -> Windows:
    """Windows over every sequence's examples. from_end: tiled back from each sequence's end instead of
    forward from its start, so the last window (the continuation, and as much of the prompt before it as fits)
    is a whole seq_len: a continuation then attends to up to seq_len positions of its prompt, as it does at
    inference, instead of to the `overlap` positions a window that starts inside it repeats."""
    assert 0 <= overlap < seq_len
    rows = []
    for s in range(len(data.ids)):
        first = int(data.first_pos[s])
        end = first + int(data.num_rows[s]) - 1  # positions [.., end) have a label (token i + 2 exists)
        loss_from = first if prompt_examples else max(first, int(data.prompt_len[s]) - 1)
        if from_end:
            mine, stop = [], end
            while stop > loss_from:
                start = max(first, stop - seq_len)
                # the window's first `overlap` positions are context only, unless it
                # starts at the sequence's start
                lo = max(loss_from, start + overlap) if start > first else loss_from
                mine.append((s, start, stop - start, lo))
                stop = lo
            rows += mine[::-1]
            continue
        start = max(first, loss_from - overlap)
        while loss_from < end:
            stop = min(start + seq_len, end)
            rows.append((s, start, stop - start, loss_from))
            loss_from, start = stop, stop - overlap
    seq, start, length, loss_from = ((np.array(c, np.int64) for c in zip(*rows)) if rows
                                     else [np.zeros(0, np.int64)] * 4)
    return Windows(seq, start, length, loss_from)


def split_sequences(groups: np.ndarray, eval_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(train, held-out) sequence indices. groups: [num_seqs] int64 the prompt of each sequence (0, 1, ... in
    order of first appearance); a prompt's continuations go to the same side. The held-out share of prompts is
    seeded and at least one when asked for any."""
    num_groups = int(groups.max()) + 1
    order = np.random.default_rng(seed).permutation(num_groups)
    num_eval = min(num_groups - 1, max(1, round(eval_fraction * num_groups))) if eval_fraction > 0 else 0
    held = np.isin(groups, order[:num_eval])
    return np.nonzero(~held)[0], np.nonzero(held)[0]


def label_counts(data: CachedData, windows: Windows, vocab_size: int) -> np.ndarray:
    """[vocab_size] how often each token is a label in `windows`."""
    counts = np.zeros(vocab_size, np.int64)
    for w in range(len(windows)):
        s = windows.seq[w]
        lo, hi = windows.loss_from[w], windows.start[w] + windows.length[w]
        base = data.tok_start[s] - data.first_pos[s]
        np.add.at(counts, data.targets[base + lo + 2: base + hi + 2], 1)
    return counts


def shortlist(counts: np.ndarray, size: int) -> np.ndarray:
    """The `size` most frequent labels (ties: lower id first), sorted by id; size 0: the whole vocabulary."""
    if size == 0 or size >= len(counts):
        return np.arange(len(counts), dtype=np.int64)
    seen = np.nonzero(counts)[0]
    top = seen[np.argsort(-counts[seen], kind="stable")[:size]]
    return np.sort(top).astype(np.int64)


@dataclass(frozen=True)
class Ahead:
    """Module m's inputs and labels (multi-layer MTP, m >= 2): at position i it reads token i + 1 + m and
    module m - 1's output, and predicts the greedy choice at i + 2 + m."""

    ids: np.ndarray  # [batch, seq_len] int64 token i + 1 + m (0 past the sequence's end and on padding)
    rows: np.ndarray  # [num] int64 flat loss rows (into batch * seq_len) with a label at i + 2 + m
    labels: np.ndarray  # [num] int64 greedy choice at i + 2 + m, as a vocabulary index
    teacher_rows: np.ndarray  # [num] int64 row of CachedData.hidden at i + 1 + m


@dataclass(frozen=True)
class Batch:
    """Windows padded to seq_len. `label_ids` index the training vocabulary (the shortlist)."""

    hidden: np.ndarray  # [batch, seq_len, hidden] float32 main-model hidden state at each position
    next_ids: np.ndarray  # [batch, seq_len] int64 token i + 1 (0 on padding)
    after_ids: np.ndarray  # [batch, seq_len] int64 token i + 2 (the second draft's input token; 0 on padding)
    positions: np.ndarray  # [batch, seq_len] int64 i (0 on padding)
    loss_rows: np.ndarray  # [num_loss] int64 flat indices into batch * seq_len of the positions with a loss
    label_ids: np.ndarray  # [num_loss] int64 greedy choice at i + 2 of each loss row, as a vocabulary index
    chain_rows: np.ndarray  # [num_chain] int64 loss rows with a position i + 3 (second-draft loss)
    chain_ids: np.ndarray  # [num_chain] int64 greedy choice at i + 3, as a vocabulary index
    teacher_rows: np.ndarray  # [num_loss] int64 row of CachedData.hidden at i + 1: the main model's state
    # whose logits are its distribution over the label at i + 2
    chain_teacher_rows: np.ndarray  # [num_chain] int64 row at i + 2, for the label at i + 3
    ahead: tuple[Ahead, ...] = ()  # modules 2, 3, ... of a multi-layer head


def make_batch(data: CachedData, windows: Windows, picks: np.ndarray, seq_len: int,
               vocab_index: np.ndarray, modules: int = 2) -> Batch:
    """vocab_index: [vocab_size] training-vocabulary index of each token, -1 outside it (no loss there);
    modules: the head's modules (the inputs and labels of modules 2.. are `ahead`)."""
    B, h = len(picks), data.hidden.shape[1]
    hidden = np.zeros((B, seq_len, h), np.float32)
    next_ids = np.zeros((B, seq_len), np.int64)
    after_ids = np.zeros((B, seq_len), np.int64)
    positions = np.zeros((B, seq_len), np.int64)
    labels = np.full((B, seq_len), -1, np.int64)
    chain = np.full((B, seq_len), -1, np.int64)
    rows = np.zeros((B, seq_len), np.int64)  # row of CachedData.hidden at each position
    for b, w in enumerate(picks.tolist()):
        s, start, n, loss_from = (int(x[w]) for x in (windows.seq, windows.start, windows.length,
                                                      windows.loss_from))
        r0 = data.row_start[s] + start - data.first_pos[s]
        t0 = data.tok_start[s] + start - data.first_pos[s]
        seq_end = data.tok_start[s] + data.num_rows[s] + 1  # one past sequence s's last token
        hidden[b, :n] = data.hidden[r0:r0 + n]
        rows[b, :n] = np.arange(r0, r0 + n)
        next_ids[b, :n] = data.tokens[t0 + 1:t0 + 1 + n]
        after_ids[b, :n] = data.tokens[t0 + 2:t0 + 2 + n]  # exists: a window's positions are < T - 2
        positions[b, :n] = np.arange(start, start + n)
        k = loss_from - start
        labels[b, k:n] = vocab_index[data.targets[t0 + 2 + k:t0 + 2 + n]]
        m = min(n, seq_end - t0 - 3)  # position i + 3 exists for offsets [0, m)
        if m > k:
            chain[b, k:m] = vocab_index[data.targets[t0 + 3 + k:t0 + 3 + m]]
    flat, cflat = labels.reshape(-1), chain.reshape(-1)
    loss_rows = np.nonzero(flat >= 0)[0]
    chain_rows = np.nonzero(cflat >= 0)[0]
    # rows i + 1 and i + 2 exist wherever a label at i + 2 (i + 3) does: a sequence stores rows up to T - 2
    flat_rows = rows.reshape(-1)
    ahead = tuple(_ahead(data, windows, picks, seq_len, vocab_index, m, flat_rows) for m in range(2, modules))
    return Batch(hidden, next_ids, after_ids, positions, loss_rows, flat[loss_rows], chain_rows,
                 cflat[chain_rows], flat_rows[loss_rows] + 1, flat_rows[chain_rows] + 2, ahead)


def _ahead(data: CachedData, windows: Windows, picks: np.ndarray, seq_len: int, vocab_index: np.ndarray,
           m: int, flat_rows: np.ndarray) -> Ahead:
    B = len(picks)
    ids = np.zeros((B, seq_len), np.int64)
    labels = np.full((B, seq_len), -1, np.int64)
    for b, w in enumerate(picks.tolist()):
        s, start, n, loss_from = (int(x[w]) for x in (windows.seq, windows.start, windows.length,
                                                      windows.loss_from))
        t0 = data.tok_start[s] + start - data.first_pos[s]
        seq_end = data.tok_start[s] + data.num_rows[s] + 1  # one past sequence s's last token
        num_ids = max(0, min(n, seq_end - t0 - 1 - m))  # token i + 1 + m exists for offsets [0, num_ids)
        ids[b, :num_ids] = data.tokens[t0 + 1 + m:t0 + 1 + m + num_ids]
        k, num_labels = loss_from - start, min(n, seq_end - t0 - 2 - m)
        if num_labels > k:
            labels[b, k:num_labels] = vocab_index[data.targets[t0 + 2 + m + k:t0 + 2 + m + num_labels]]
    flat = labels.reshape(-1)
    rows = np.nonzero(flat >= 0)[0]
    return Ahead(ids, rows, flat[rows], flat_rows[rows] + 1 + m)
