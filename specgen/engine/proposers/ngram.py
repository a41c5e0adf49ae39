"""n-gram drafting (prompt lookup): continue the text the way an earlier occurrence of its tail continued.

For each decoding slot, the last n tokens (n from ngram_max down to ngram_min) are searched for in the
slot's prompt + output. Among several occurrences the most recent wins (the one starting latest), since
recent text predicts the next tokens best; a longer n wins over a shorter one. The draft is the up-to-k
tokens that followed the occurrence; they may run into the tail itself (overlap is allowed).

With the job's pool on (SpecConfig.ngram_pool, ngram_pool.py), the same tail is also looked up in the text of
requests that finished earlier in the job. Which draft a slot gets when both offer one is learnt while the job
runs: the source and match length whose first drafts were accepted more often. In a job of similar
requests (code rewritten to one pattern) the pool's longer matches win; where each request copies from its own
input (summarization) the slot's own text does.
"""
from __future__ import annotations

import numpy as np

from specgen.engine.adaptive.estimator import PRIOR_HITS, PRIOR_SEEN, AcceptanceEstimator
from specgen.engine.proposers.base import Drafting, SlotView
from specgen.engine.proposers.ngram_pool import NgramPool
from specgen.engine.proposers.ngram_tree import ngram_tree, path_keys
from specgen.engine.types import DraftTokens, StepUpdate
from specgen.kernels import host


def ngram_match_native(
    lib,  # ngram.cc's library (specgen.kernels.host)
    tokens: np.ndarray,  # [num_slots, capacity] int64 the engine's token table
    slots: np.ndarray,  # [num_seqs] int64 rows of the slots to draft for
    seq_lens: np.ndarray,  # [num_seqs] int64
    k: int,
    n_min: int,
    n_max: int,
) -> tuple[DraftTokens, np.ndarray]:
    """ngram_match over rows `slots` of the table, in ngram.cc (reads the table in place: no copy of the
    rows)."""
    text, _keep = host.SlotText.of(tokens, slots, seq_lens)
    draft, num_draft, match_len = host.ngram_match(lib, text, host.NgramRule(k, n_min, n_max))
    return DraftTokens(draft, num_draft), match_len


def ngram_propose(tokens: np.ndarray, seq_lens: np.ndarray, k: int, n_min: int, n_max: int) -> DraftTokens:
    """ngram_match's drafts alone."""
    return ngram_match(tokens, seq_lens, k, n_min, n_max)[0]


def ngram_match(
    tokens: np.ndarray,  # [num_seqs, width] int64 each slot's prompt + output (valid up to seq_lens)
    seq_lens: np.ndarray,  # [num_seqs] int64
    k: int,
    n_min: int,
    n_max: int,
) -> tuple[DraftTokens, np.ndarray]:
    """Drafts and the length n of each slot's match ([num_seqs] int64, 0 where none). Vectorized over slots;
    the reference for any native kernel."""
    num_seqs, width = tokens.shape
    draft = np.zeros((num_seqs, k), np.int64)
    num_draft = np.zeros(num_seqs, np.int64)
    match_len = np.zeros(num_seqs, np.int64)
    if num_seqs == 0 or width < 2:
        return DraftTokens(draft, num_draft), match_len
    rows = np.arange(num_seqs)
    found = np.zeros(num_seqs, bool)
    match_end = np.zeros(num_seqs, np.int64)  # index just past the matched occurrence
    for n in range(n_max, n_min - 1, -1):
        if n >= width:
            continue
        need = ~found & (seq_lens > n)  # a tail of n tokens and something before it
        if not need.any():
            continue
        tail_start = seq_lens - n  # [num_seqs]
        starts = np.arange(width - n)  # candidate occurrence starts i: tokens[i : i + n]
        hit = np.ones((num_seqs, width - n), bool)
        for j in range(n):
            tail_j = tokens[rows, np.maximum(tail_start + j, 0)]  # [num_seqs]
            hit &= tokens[:, j : j + width - n] == tail_j[:, None]
        # An occurrence must end before the tail ends and be followed by a token: i + n <= seq_len - 1.
        hit &= starts[None, :] + n <= (seq_lens - 1)[:, None]
        has = hit.any(axis=1) & need
        last = (width - n - 1) - np.argmax(hit[:, ::-1], axis=1)  # most recent start
        match_end = np.where(has, last + n, match_end)
        match_len = np.where(has, n, match_len)
        found |= has
    avail = np.where(found, seq_lens - match_end, 0)  # tokens that follow the occurrence
    num_draft = np.minimum(avail, k).astype(np.int64)
    idx = np.minimum(match_end[:, None] + np.arange(k)[None, :], width - 1)
    draft = np.where(np.arange(k)[None, :] < num_draft[:, None], tokens[rows[:, None], idx], 0)
    return DraftTokens(draft.astype(np.int64), num_draft), np.where(num_draft > 0, match_len, 0)


class NgramProposer:
    """Drafts up to k tokens per slot by n-gram lookup in its own prompt and output, and, when a pool is kept
    (pool_capacity > 0), in the text of the job's finished requests. Where both offer a draft, the one whose
    source (0: own text, 1: pool) and match length have had more first drafts accepted so far: both candidates
    are scored against the token that came out, whichever one was verified, so a source never chosen is still
    measured. Ties go to the slot's own text; a pool source that rarely hits is not used (POOL_MIN_RATE)."""

    acceptance_hint = None
    idle_when_detached = False  # drafts from the text, whatever the controller detached
    probes_when_detached = True  # every draft counts toward detaching
    copies_when_detached = False
    clone_safe = True  # its state is the slot's tokens: a sample may copy another's prompt rows
    context_only = True  # drafts from the slot's tokens (and the pool): it may draft after forced tokens
    SOURCE_DECAY = 0.998  # per step: the estimates follow a job whose kind of text changes
    POOL_MIN_RATE = 0.25  # a pool draft is offered only above this: guesses from other requests' text that
    # miss most of the time (summarization: 0.1) would lower the slot's acceptance estimate, and with it k for
    # the slot's good own-text drafts

    def __init__(self, k: int, n_min: int, n_max: int, pool_capacity: int = 0, lib=None, branches: int = 1,
                 tree_paths: tuple[tuple[int, ...], ...] = ()):
        """lib: ngram.cc's library (specgen.kernels.host_lib()); None runs the numpy reference. branches > 1:
        token trees of that many continuations (ngram_tree.py), shaped by tree_paths when given."""
        self.k, self.n_min, self.n_max = k, n_min, n_max
        self.branches = branches
        self.tree_choices = path_keys(tree_paths) if tree_paths else None
        self.pool = NgramPool(pool_capacity, n_min, n_max) if pool_capacity > 0 else None
        # keyed by match length; its arrays are only ever updated in place: ngram.cc reads them by address
        self.sources = AcceptanceEstimator(2, n_max + 1, self.SOURCE_DECAY)
        # candidates of the last propose, scored in observe: slots, first draft and match length per source
        # [num_seqs], [2, num_seqs] x 2
        self._pending: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None = None
        self._lib = lib if max(k, n_max) <= host.NATIVE_MAX else None
        self._rule = host.NgramRule(k, n_min, n_max)
        self._rates = host.SourceRates(self.sources.hits.ctypes.data, self.sources.seen.ctypes.data,
                                       self.POOL_MIN_RATE, PRIOR_HITS, PRIOR_SEEN)

    def _rate(self, source: int, match_len: np.ndarray) -> np.ndarray:
        """[num_seqs] estimated acceptance of the first draft of `source` (0 where there is no match)."""
        return np.where(match_len > 0, self.sources.rate(source, match_len), 0.0)

    def propose(self, view: SlotView) -> DraftTokens:
        self._pending = None
        if len(view.slots) == 0:
            return DraftTokens(np.zeros((0, self.k), np.int64), np.zeros(0, np.int64))
        if self.branches > 1:
            width = int(view.seq_lens.max())
            return ngram_tree(view.tokens[view.slots, :width], view.seq_lens, view.max_draft, self.k,
                              self.n_min, self.n_max, self.branches, self.tree_choices)
        if self._lib is None:
            return self.propose_reference(view)
        if self.pool is None or not self.pool.written:
            own, _ = ngram_match_native(self._lib, view.tokens, view.slots, view.seq_lens, self.k, self.n_min,
                                        self.n_max)
            return DraftTokens(own.draft_ids, np.minimum(own.num_draft, view.max_draft))
        # own match, pool lookup and the choice between them in one call (propose_reference is the reference)
        text, _keep = host.SlotText.of(view.tokens, view.slots, view.seq_lens)
        out = host.ngram_propose(self._lib, text, view.max_draft, self._rule, self.pool.view, self._rates)
        k = self.k
        self._pending = (view.slots.copy(), out[:, [k + 1, k + 3]].T, out[:, [k + 2, k + 4]].T,
                         view.seq_lens.copy())
        return DraftTokens(out[:, :k], out[:, k])

    def propose_reference(self, view: SlotView) -> DraftTokens:
        """propose in numpy: the reference for ngram.cc's specgen_ngram_propose, and the path without it."""
        width = int(view.seq_lens.max())
        own, own_len = ngram_match(view.tokens[view.slots, :width], view.seq_lens, self.k, self.n_min,
                                   self.n_max)
        draft_ids, num_draft = own.draft_ids, own.num_draft
        if self.pool is not None and self.pool.written:
            cols = view.seq_lens[:, None] - self.n_max + np.arange(self.n_max)[None, :]  # [num_seqs, n_max]
            tails = view.tokens[view.slots[:, None], np.maximum(cols, 0)]  # [num_seqs, n_max] right-aligned
            pool_ids, pool_num, pool_len = self.pool.lookup_reference(tails, view.seq_lens, self.k)
            pool_rate = self._rate(1, pool_len)  # [num_seqs]
            take = (pool_rate > self._rate(0, own_len)) & (pool_rate >= self.POOL_MIN_RATE)
            draft_ids = np.where(take[:, None], pool_ids, draft_ids)
            num_draft = np.where(take, pool_num, num_draft)
            self._pending = (view.slots.copy(), np.stack([own.draft_ids[:, 0], pool_ids[:, 0]]),
                             np.stack([own_len, pool_len]), view.seq_lens.copy())
        return DraftTokens(draft_ids, np.minimum(num_draft, view.max_draft))

    def observe(self, update: StepUpdate) -> None:
        if self.pool is None:
            return  # the token buffer is all the state lookup in a slot's own text needs
        if self._pending is not None:
            self._score(update)
            self._pending = None  # (a step between the controller's probes observes without a propose)
        if update.finished.any():
            lens = update.seq_lens[update.finished]  # [num_finished]
            self.pool.add_batch(update.tokens[update.slots[update.finished], : lens.max()], lens)

    def _score(self, update: StepUpdate) -> None:
        """Both candidates' first drafts against the token the step committed at their position (the slot's
        length as the proposer saw it: past a grammar's forced tokens, engine/grammar.py), where it did."""
        # [num_seqs], [2, num_seqs], [2, num_seqs], [num_seqs]
        slots, first, match_len, at = self._pending
        n = len(slots)
        assert (update.slots[:n] == slots).all(), "decode blocks come first in a step"
        known = (update.num_valid[:n] >= 1) & (update.seq_lens[:n] > at)  # [num_seqs]
        truth = update.tokens[slots, np.minimum(at, update.tokens.shape[1] - 1)]  # [num_seqs]
        scored = (match_len > 0) & known[None, :]  # [2, num_seqs]
        source = np.broadcast_to(np.arange(2)[:, None], scored.shape)
        self.sources.add(source[scored], match_len[scored], (first == truth[None, :])[scored])


def build_ngram_proposer(d: Drafting) -> NgramProposer:
    """--method ngram (d: base.Drafting, its section an NgramConfig)."""
    c = d.section
    return NgramProposer(d.k, c.min, c.max, c.pool, d.lib, c.branches, c.tree_paths())
