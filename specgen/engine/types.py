"""Typed batch state shared by the runner, the model and the proposers.

Dimension vocabulary (used in every shape comment):
  num_tokens   all query tokens of one forward, packed slot after slot
  num_seqs     query blocks (one per participating slot) in one forward
  num_slots    static batch size (cache rows)
  max_q        longest query block of an attention group; max_kv its longest key range
  num_logits   rows that need logits (a prefill's last token, every verify position)
  max_draft    the largest number of draft tokens any slot proposes this step (k)
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class AttnGroup:
    """Query blocks of similar length that share one padded attention computation ("virtual padding")."""

    seq_slots: np.ndarray  # [num_seqs_g] int64 cache row of each block
    pad_token_index: np.ndarray  # [num_seqs_g, max_q] int64 packed-token index, or num_tokens for padding
    pad_positions: np.ndarray  # [num_seqs_g, max_q] int64 position of each padded query (0 for padding)
    max_kv: int  # keys attended: positions [0, max_kv) of each block's slot
    token_rows: np.ndarray  # [num_tokens_g] int64 packed-token indices of this group's tokens, in order
    token_pad_index: np.ndarray  # [num_tokens_g] int64 flat index into [num_seqs_g * max_q] of each token


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
    token_prefix_len: np.ndarray | None = None  # [num_tokens] int64 shared-prefix positions of each token's slot
    prefill_group_threshold: int = 16
    prefill_group_budget: int = 1 << 19

    @functools.cached_property
    def groups(self) -> tuple[AttnGroup, ...]:
        """The attention groups, built on first use: only the per-layer (unfused) forward reads them, so the fused
        step does not pay for them."""
        return attention_groups(self.block_slots, self.block_starts, self.block_lens, self.prefill_group_threshold,
                                self.prefill_group_budget)


def attention_groups(
    slots: np.ndarray,  # [num_seqs] int64 cache row of each block
    starts: np.ndarray,  # [num_seqs] int64 position of each block's first token
    lens: np.ndarray,  # [num_seqs] int64 tokens in each block (>= 1)
    prefill_group_threshold: int,
    prefill_group_budget: int,
) -> tuple[AttnGroup, ...]:
    """Short blocks (decode/verify) in one group; long ones (prefill) sorted by length and split so that each
    group's padded num_seqs * max_q * max_kv stays within prefill_group_budget (padding a 30-token prompt to a
    1,000-token one costs 30x)."""
    cu = np.zeros(len(lens) + 1, dtype=np.int64)
    np.cumsum(lens, out=cu[1:])
    num_tokens = int(cu[-1])
    groups = []
    is_long = lens > prefill_group_threshold
    members = [np.nonzero(~is_long)[0]] if (~is_long).any() else []
    long_seqs = np.nonzero(is_long)[0]
    long_seqs = long_seqs[np.argsort(lens[long_seqs], kind="stable")]
    start = 0
    while start < len(long_seqs):
        end = start + 1
        while end < len(long_seqs):
            q = lens[long_seqs[end]]
            if (end - start + 1) * q * (starts[long_seqs[start:end + 1]] + q).max() > prefill_group_budget:
                break
            end += 1
        members.append(long_seqs[start:end])
        start = end
    for seqs in members:
        max_q = int(lens[seqs].max())
        col = np.arange(max_q)
        valid = col[None, :] < lens[seqs][:, None]  # [num_seqs_g, max_q]
        pad_index = np.where(valid, cu[seqs][:, None] + col[None, :], num_tokens)
        pad_pos = np.where(valid, starts[seqs][:, None] + col[None, :], 0)
        groups.append(
            AttnGroup(
                seq_slots=slots[seqs].astype(np.int64),
                pad_token_index=pad_index.astype(np.int64),
                pad_positions=pad_pos.astype(np.int64),
                max_kv=int((starts[seqs] + lens[seqs]).max()),
                token_rows=pad_index[valid].astype(np.int64),
                token_pad_index=np.nonzero(valid.reshape(-1))[0].astype(np.int64),
            )
        )
    return tuple(groups)


def build_forward_batch(
    slots: np.ndarray,  # [num_seqs] int64 cache row of each block
    starts: np.ndarray,  # [num_seqs] int64 position of each block's first token
    lens: np.ndarray,  # [num_seqs] int64 tokens in each block (>= 1)
    token_ids: np.ndarray,  # [num_tokens] int64 the blocks' tokens, packed in block order
    logits_all: np.ndarray,  # [num_seqs] bool: logits for every row of the block (verify) or only the last
    prefill_group_threshold: int = 16,
    no_logits: np.ndarray | None = None,  # [num_seqs] bool: no logits at all (a prompt chunk that is not the last)
    prefix_lens: np.ndarray | None = None,  # [num_seqs] int64 positions each slot reads from the shared prefix
    prefill_group_budget: int = 1 << 19,
) -> ForwardBatch:
    """Pack blocks; their attention groups (attention_groups) are built when first asked for."""
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
        block_slots=np.array(slots, np.int64),  # copies: groups are built later
        block_starts=np.array(starts, np.int64),  # copies: groups are built later
        block_lens=np.array(lens, np.int64),  # copies: groups are built later
        token_prefix_len=None if prefix_lens is None or not prefix_lens.any()
        else prefix_lens[seq_of_token].astype(np.int64),
        prefill_group_threshold=prefill_group_threshold,
        prefill_group_budget=prefill_group_budget,
    )


@dataclass(frozen=True)
class Request:
    """One prompt to complete. `index` is its place in the input; `id` names it in the output."""

    id: str
    index: int
    prompt_ids: tuple[int, ...]
    params: "SamplingParams"


@dataclass(frozen=True)
class DraftTokens:
    """What a proposer offers for the decoding slots of one step."""

    draft_ids: np.ndarray  # [num_seqs, max_draft] int64 (entries past num_draft are ignored)
    num_draft: np.ndarray  # [num_seqs] int64
    source: np.ndarray | None = None  # [num_seqs] int64 which of the proposer's ways drafted each slot's tokens
    # (MTP: 0 the head, 1 a copy); the controller keeps an acceptance estimate per source. None: all 0


@dataclass(frozen=True)
class StepUpdate:
    """What a step committed, for proposers that keep state (the MTP head's cache)."""

    slots: np.ndarray  # [num_seqs] int64 cache rows that took part in the forward
    block_start: np.ndarray  # [num_seqs] int64 packed row of each block's first token
    first_pos: np.ndarray  # [num_seqs] int64 position of each block's first token
    num_valid: np.ndarray  # [num_seqs] int64 leading block positions whose input was right and whose next token is known
    finished: np.ndarray  # [num_seqs] bool
    tokens: np.ndarray  # [num_slots, capacity] int64 after the commit
    hidden: object  # paddle.Tensor [num_tokens, hidden] final normed hidden states of the forward
    # A slot's first block after a shared prefix: positions [first_pos - prefix_len, first_pos) were computed
    # once for every slot; their hidden states are rows of prefix_hidden [prefix_tokens, hidden].
    prefix_len: np.ndarray | None = None  # [num_seqs] int64 (0: nothing before first_pos to catch up)
    prefix_hidden: object = None
    max_draft_next: int = 5  # drafts worth preparing for the next step (the adaptive controller's hint)
    detached: np.ndarray | None = None  # [num_seqs] bool: stop drafting for these slots (drafts stopped paying)
    seq_lens: np.ndarray | None = None  # [num_seqs] int64 valid tokens of each slot after the commit
    prompt_lens: np.ndarray | None = None  # [num_seqs] int64 each slot's prompt length


@dataclass
class RequestStats:
    """Speculation statistics of one request (definitions in the README's output schema)."""

    num_steps: int = 0  # forward passes that produced its tokens (its prefill included)
    num_draft_tokens: int = 0  # draft tokens verified
    num_accepted_tokens: int = 0  # emitted tokens that were drafts (emitted minus one per step)
    num_emitted_tokens: int = 0  # output tokens = accepted + steps
    accepted_per_position: list[int] | None = None  # [max_draft] how often draft position i was accepted
    drafted_per_position: list[int] | None = None  # [max_draft] how often a draft at position i was verified
    num_prefill_chunks: int = 0  # forwards its prompt was prefilled in (1 without chunking)
    num_cached_prompt_tokens: int = 0  # prompt tokens read from the shared prefix instead of prefilled

    @property
    def acceptance_rate(self) -> float | None:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None

    @property
    def mean_accepted_length(self) -> float | None:
        return self.num_emitted_tokens / self.num_steps if self.num_steps else None


@dataclass
class RequestOutput:
    """A finished request (or one rejected with `error`)."""

    id: str
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop" | "length" | None when error
    num_prompt_tokens: int
    stats: RequestStats
    error: str | None = None


from specgen.config import SamplingParams  # noqa: E402  (type used in annotations above)
