"""Typed batch state shared by the engine, the model and the proposers.

Dimension vocabulary (used in every shape comment):
  num_tokens   all query tokens of one forward, packed slot after slot
  num_seqs     query blocks (one per participating slot) in one forward
  num_slots    static batch size (cache rows)
  max_q        longest query block of an attention group; max_kv its longest key range
  num_wanted   sequences an MTP head drafts for in one pass
  num_logits   rows that need logits (a prefill's last token, every verify position)
  max_draft    the largest number of draft tokens any slot proposes this step (k)
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


def sample_key(request_id: str, sample_index: int | None) -> str:
    """Sample j's name: its random stream's (with the seed) and its key in an output's done ids; sample 0's is
    the request's id, so n = 1 is the request as it always was."""
    return request_id if not sample_index else f"{request_id}\x1f{sample_index}"


@dataclass(frozen=True)
class Request:
    """One prompt to complete. `index` is its place in the input; `id` names it in the output."""

    id: str
    index: int
    prompt_ids: tuple[int, ...]
    params: "SamplingParams"
    api: str = "text"  # "chat" for messages: the body an OpenAI output line gives it (io/openai_output.py)
    openai: bool = False  # it came as an OpenAI Batch line
    sample_index: int = 0  # which of the record's params.n samples (its own random stream)


@dataclass(frozen=True)
class DraftTokens:
    """What a proposer offers for the decoding slots of one step."""

    draft_ids: np.ndarray  # [num_seqs, max_draft] int64 (entries past num_draft are ignored)
    num_draft: np.ndarray  # [num_seqs] int64
    source: np.ndarray | None = None  # [num_seqs] int64 which of the proposer's ways drafted each slot's
    # tokens (MTP and EAGLE: 0 the head or layer, 1 a copy; EAGLE's copied rows are chains with scores 0); the
    # controller keeps an acceptance estimate per source. None: all 0
    # A token tree (engine/tree.py): node i sits at block index i + 1 (index 0 is the root, the last committed
    # token) and its parent at parents[:, i] in [0, i]: parents come first, so the first n nodes of a tree are
    # a tree too (a smaller node budget keeps a prefix). None: a chain (parents[:, i] = i).
    parents: np.ndarray | None = None  # [num_seqs, max_draft] int64
    # A tree's nodes as the drafter rates them: its probability that each node is on the accepted path (the
    # product of its own probabilities along the node's path; EAGLE's), non-increasing along a row. The
    # controller prices nodes from them, calibrated by how many such drafts were accepted. None: it prices
    # them from the slot's acceptance so far (tree.node_gains).
    scores: np.ndarray | None = None  # [num_seqs, max_draft] float64

    @classmethod
    def none(cls, num_seqs: int, width: int) -> "DraftTokens":
        """No drafts for any of num_seqs slots."""
        return cls(np.zeros((num_seqs, width), np.int64), np.zeros(num_seqs, np.int64))


@dataclass(frozen=True)
class StepUpdate:
    """What a step committed, for proposers that keep state (the MTP head's cache)."""

    slots: np.ndarray  # [num_seqs] int64 cache rows that took part in the forward
    block_start: np.ndarray  # [num_seqs] int64 packed row of each block's first token
    first_pos: np.ndarray  # [num_seqs] int64 position of each block's first token
    num_valid: np.ndarray  # [num_seqs] int64 leading block positions whose input was right and
    # whose next token is known
    finished: np.ndarray  # [num_seqs] bool
    tokens: np.ndarray  # [num_slots, capacity] int64 after the commit
    hidden: object  # paddle.Tensor [num_tokens, hidden] final normed hidden states of the forward
    # A slot's first block after a shared prefix: positions [first_pos - prefix_len, first_pos) were computed
    # once for every slot; their hidden states are rows of prefix_hidden [prefix_tokens, hidden].
    prefix_len: np.ndarray | None = None  # [num_seqs] int64 (0: nothing before first_pos to catch up)
    prefix_hidden: object = None
    max_draft_next: int = 5  # drafts worth preparing for the next step (the adaptive controller's hint)
    detached: np.ndarray | None = None  # [num_seqs] bool: stop drafting for these slots
    # (drafts stopped paying)
    seq_lens: np.ndarray | None = None  # [num_seqs] int64 valid tokens of each slot after the commit
    prompt_lens: np.ndarray | None = None  # [num_seqs] int64 each slot's prompt length
    broken: np.ndarray | None = None  # [num_seqs] bool went non-finite (finished too):
    # a drafter clears its rows
    sampling: "SlotSampling | None" = None  # each sequence's sampling, for a drafter that samples
    # as the main model
    # A token-tree step: block index of the j-th accepted position of each decode block (the first num_dec
    # sequences), j < num_valid; the hidden state of that position is row block_start + tree_path[i, j]. None:
    # every block's positions are in block order (row block_start + j).
    tree_path: np.ndarray | None = None  # [num_dec, width + 1] int64


@dataclass(frozen=True)
class SlotSampling:
    """Each sequence's sampling settings, as the main model samples its tokens (layers/sampling.py): a
    drafter that samples its drafts with the same noise proposes the main model's token whenever its
    distribution is close enough."""

    temperature: np.ndarray  # [num_seqs] float64, 0 = greedy
    top_k: np.ndarray  # [num_seqs] int64, 0 = off
    top_p: np.ndarray  # [num_seqs] float64, 1 = off
    rng_key: np.ndarray  # [num_seqs] uint64 the request's key
    min_p: np.ndarray | None = None  # [num_seqs] float64, 0 = off; None: off everywhere


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
    num_forced_tokens: int = 0  # accepted drafts its response_format's grammar forced (no drafter call)

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
    # with SamplingParams.logprobs: one entry per output token (docs/output-schema.md, `logprobs`)
    logprobs: list[dict] | None = None
    # with SamplingParams.prompt_logprobs: one per prompt token, the same entries (None for the first)
    prompt_logprobs: list[dict | None] | None = None
    api: str = "text"  # the request's (Request.api, Request.openai, Request.sample_index, params.n)
    openai: bool = False
    sample_index: int = 0
    num_samples: int = 1


from specgen.config import SamplingParams  # noqa: E402  (type used in annotations above)
