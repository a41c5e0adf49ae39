"""The packed batch of one forward: every participating slot's new tokens, their positions and cache rows."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class ForwardBatch:
    """One packed forward: every participating slot's new tokens, in slot-block order."""

    token_ids: np.ndarray  # [num_tokens] int64
    positions: np.ndarray  # [num_tokens] int64
    token_slots: np.ndarray  # [num_tokens] int64 cache row of each token
    logit_rows: np.ndarray  # [num_logits] int64 packed-token indices that need logits
    max_position: int  # 1 + the largest position written (the cache must hold it)
    block_slots: np.ndarray  # [num_seqs] int64 cache row of each block
    block_starts: np.ndarray  # [num_seqs] int64 position of each block's first token
    block_lens: np.ndarray  # [num_seqs] int64 tokens in each block
    # shared-prefix positions of each token's slot
    token_prefix_len: np.ndarray | None = None  # [num_tokens] int64
    # Token trees (engine/tree.py): `positions` are then the cache rows the tokens are written to (a tree
    # block's root row plus the node's index in the block), rope_positions the positions the model sees
    # (root + depth), and tree_mask which earlier rows of its block each token attends to. None: a row is its
    # position, causal.
    rope_positions: np.ndarray | None = None  # [num_tokens] int64
    tree_mask: np.ndarray | None = None  # [num_tokens] int64 bit b: the key b rows back is visible (keys 64
    # or more rows back always are); CAUSAL (all bits) for every token outside a tree

    @property
    def model_positions(self) -> np.ndarray:  # [num_tokens] int64 the positions RoPE and sampling see
        return self.positions if self.rope_positions is None else self.rope_positions


def build_forward_batch(
    slots: np.ndarray,  # [num_seqs] int64 cache row of each block
    starts: np.ndarray,  # [num_seqs] int64 position of each block's first token
    lens: np.ndarray,  # [num_seqs] int64 tokens in each block (>= 1)
    token_ids: np.ndarray,  # [num_tokens] int64 the blocks' tokens, packed in block order
    logits_all: np.ndarray,  # [num_seqs] bool: logits for every row of the block (verify) or only the last
    # no logits at all (a prompt chunk that is not the last)
    no_logits: np.ndarray | None = None,  # [num_seqs] bool
    # positions each slot reads from the shared prefix
    prefix_lens: np.ndarray | None = None,  # [num_seqs] int64
    # each token's depth in its tree (engine/tree.py)
    tree_depth: np.ndarray | None = None,  # [num_tokens] int64
    tree_mask: np.ndarray | None = None,  # [num_tokens] int64 ForwardBatch.tree_mask
) -> ForwardBatch:
    """Pack blocks one after the other."""
    cu = np.zeros(len(lens) + 1, dtype=np.int64)
    np.cumsum(lens, out=cu[1:])
    num_tokens = int(cu[-1])
    seq_of_token = np.repeat(np.arange(len(lens)), lens)  # [num_tokens]
    offset = np.arange(num_tokens) - cu[:-1][seq_of_token]  # [num_tokens]
    positions = starts[seq_of_token] + offset
    need = logits_all[seq_of_token].copy()
    need[cu[1:] - 1] = True
    if no_logits is not None:
        need[no_logits[seq_of_token]] = False
    return ForwardBatch(
        token_ids=np.asarray(token_ids, dtype=np.int64),
        positions=positions.astype(np.int64, copy=False),
        token_slots=slots[seq_of_token].astype(np.int64, copy=False),
        logit_rows=np.nonzero(need)[0].astype(np.int64, copy=False),
        max_position=int(positions.max()) + 1 if num_tokens else 0,
        block_slots=np.array(slots, np.int64),  # copies: the caller's arrays may change after the call
        block_starts=np.array(starts, np.int64),
        block_lens=np.array(lens, np.int64),
        token_prefix_len=None if prefix_lens is None or not prefix_lens.any()
        else prefix_lens[seq_of_token].astype(np.int64),
        rope_positions=None if tree_depth is None else (starts[seq_of_token] + tree_depth).astype(np.int64),
        tree_mask=tree_mask,
    )
