"""What one step runs: its plan (decoding slots with their drafts, prefilling slots with a chunk) and its
packed forward's blocks."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from specgen.engine.types import DraftTokens
from specgen.runtime.batch import ForwardBatch


@dataclass(frozen=True)
class StepPlan:
    """Who takes part in a step and with what: decoding slots with their drafts, prefilling slots
    with a chunk."""

    dec: np.ndarray  # [num_dec] int64 decoding slots
    new: np.ndarray  # [num_new] int64 slots prefilling this step
    chunk: np.ndarray  # [num_new] int64 prompt tokens each feeds
    final: np.ndarray  # [num_new] bool the chunk ends the prompt: its last row is sampled
    room: np.ndarray  # [num_slots] int64 tokens each slot may still emit (>= 1 while active)
    drafts: DraftTokens  # what the proposer offers the decoding slots
    num_avail: np.ndarray  # [num_dec] int64 drafts offered, capped by room
    num_draft: np.ndarray  # [num_dec] int64 drafts verified (a tree's nodes)
    draft_seconds: float  # the proposer's propose
    depth: np.ndarray | None = None  # [num_dec, width + 1] int64 a tree block's depths (tree.tree_layout);
    # None: chains
    mask: np.ndarray | None = None  # [num_dec, width + 1] int64 a tree block's attention masks
    forced: np.ndarray | None = None  # [num_dec] int64 leading drafts a grammar forced (None: none)
    # a plain step, the proposer's propose and the controller not called: speculation ruled out for good
    # (Controller.off), or every slot detached from a drafter idle for detached slots
    # (Proposer.idle_when_detached), or a step between the controller's probes (Controller.probing: quiet)
    idle: bool = False
    quiet: bool = False  # a step between probes: the proposer is told only of requests that finished


@dataclass(frozen=True)
class StepBlocks:
    """The step's packed forward and where its blocks are: decoding slots first, then prefilling ones."""

    batch: ForwardBatch
    slots: np.ndarray  # [num_seqs] int64 each block's slot
    starts: np.ndarray  # [num_seqs] int64 position of each block's first token
    lens: np.ndarray  # [num_seqs] int64 tokens in each block
    dec_mask: np.ndarray  # [num_dec, width + 1] bool the rows of each decoding block that are fed


def in_blocks(plan: StepPlan, blocks: StepBlocks, rows: np.ndarray) -> np.ndarray:
    """A value per logit row [num_logits] -> [num_seqs, width + 1] in block order (decoding blocks' rows
    in the block's order, a prompt's final chunk's one row first; 0 where a block has no row)."""
    num_dec, dec_mask = len(plan.dec), blocks.dec_mask
    out = np.zeros((len(blocks.slots), dec_mask.shape[1]), rows.dtype)
    num_dec_rows = int(dec_mask.sum())  # decode rows are the first sum(num_draft + 1) logit rows
    out[:num_dec][dec_mask] = rows[:num_dec_rows]
    out[num_dec:, 0][plan.final] = rows[num_dec_rows:]
    return out
