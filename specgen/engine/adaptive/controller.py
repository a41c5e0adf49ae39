"""The adaptive controller: per step, how many drafts each slot verifies (0 included), from measured step
costs and each slot's running acceptance; and what it learns from each step.

Acceptance is tracked per (slot, draft source) from every draft the proposer offered whose fate is known,
verified or not: a draft not sent to verification is still compared with the token that came out (shadow
acceptance), so a slot whose text turns predictable is noticed.
Beside the choice (decide.py): a slot whose drafts have not paid for DETACH_AFTER steps in a row, the
drafter's own time counted, is detached (a drafter that costs time per slot, an MTP head or a draft model,
stops drafting for it); a new request starts detached when the drafter's acceptance over the job so far could
not pay for it at the batch's size, but for one request in EXPLORE_EVERY, which keeps that figure current (and
once the job's drafts are known not to pay, a slot that verifies nothing detaches at once, explorers aside);
and a drafter whose own measured acceptance
could not pay for one draft per slot at this batch size is ruled out before the first step. While every slot
is detached from an n-gram job whose drafts do not pay, or from an MTP head or EAGLE layer whose copies
(source 1) do not pay over the job, the drafter is asked only on probe steps (probing).
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from specgen.engine.adaptive.costs import CostModel
from specgen.engine.adaptive.decide import choose_drafts
from specgen.engine.adaptive.estimator import AcceptanceEstimator


@dataclass(frozen=True)
class StepReport:
    """What one step did and how long its parts took, for the controller after the step."""

    slots: np.ndarray  # [num_dec] int64 decoding slots
    draft_ids: np.ndarray  # [num_dec, width] what the proposer offered
    num_avail: np.ndarray  # [num_dec] int64 drafts offered
    num_draft: np.ndarray  # [num_dec] int64 drafts verified
    source: np.ndarray | None  # [num_dec] int64 the drafts' source (None: 0)
    emitted: np.ndarray  # [num_dec, >= width + 1] int64 the tokens that came out
    kept: np.ndarray  # [num_dec] int64 how many of them are real
    num_tokens: int  # tokens the forward fed
    forward_seconds: float  # from the step's start through sampling (the forward, and the planning before it)
    draft_seconds: float  # the proposer's time (propose and observe)
    rated: tuple[float, float] | None = None  # (drafts accepted, expected) of drafts the drafter
    # rated (scores)


class Controller:
    DECAY = 0.9  # per step of a slot: its acceptance counts follow changes within a request
    # steps in which a slot's drafts did not pay, the drafter's time counted, less those in which they did,
    # before its drafter stops for it (a draft model at acceptance ~0.4, choosing 1 draft one step and 0 the
    # next, ran 0.83x of plain decoding when only steps choosing 0 counted: the draft kept running beside
    # plain decoding)
    DETACH_AFTER = 8
    DRAFT_EMA = 0.2  # weight of one step in the drafter's time
    # The drafter's time per step really changes up to ~5x from one step to the next (an MTP head's pass:
    # 0.14-0.18 ms catching up alone, 0.61-0.71 ms with three chained drafts); a stall (~100 ms) multiplies it
    # by 100 or more.
    DRAFT_OUTLIER = 5.0
    HINT_HEADROOM = 1.5  # a head's held-out acceptance is an average over text; predictable text beats it
    # A step speculates only when the model predicts it MIN_GAIN faster than plain decoding: gains smaller
    # than that are within the cost model's error (its table is timed on uniform blocks at position 0), and
    # there verifying drafts measured slower than plain decoding (32 slots of code rewriting: 0.87x and
    # 0.97x).
    MIN_GAIN = 0.05
    NUM_SOURCES = 2  # acceptance estimates per slot: one per kind of draft (DraftTokens.source)
    # Per step, over every slot: the job's acceptance of source 0's drafts follows ~30 steps. At 32 slots of
    # short requests each new one drafted for its first DETACH_AFTER steps (and its prompt window) though no
    # slot's drafts had paid: the draft model ran 0.95x and the MTP head 0.92x of plain decoding (math, 64
    # tokens each).
    JOB_DECAY = 0.97
    EXPLORE_EVERY = 8  # one new request in this many drafts whatever the job's acceptance says
    # Drafts (decayed) of the job's evidence, and at least JOB_EVIDENCE_PER_SLOT per decoding slot (more than
    # one step's first drafts: one noisy step does not decide), past which, while drafts at the job-wide rate
    # could not pay, a slot that verifies nothing of a chain detaches at once, explorers aside. 32 requests
    # started together each drafted DETACH_AFTER steps before detaching: the draft model and a 3-module head
    # ran 0.95x of plain decoding at 32 slots (math, 48 tokens each). Token trees keep the DETACH_AFTER rule:
    # the job's rate prices a chain, and a tree that declines one step's nodes may pay on the next.
    JOB_EVIDENCE = 16.0
    JOB_EVIDENCE_PER_SLOT = 1.5
    # A drafter all of whose drafts count toward detaching (n-gram): while every slot is detached and the
    # job's drafts are known not to pay, the proposer and the controller run on PROBE_STEPS steps in a row of
    # every PROBE_EVERY; the other steps run as plain decoding does (their host work was ~0.3 ms of a ~6-8 ms
    # batch-1 step where drafts were rarely right: writing, 0.91-0.96x of plain decoding).
    PROBE_EVERY = 8
    PROBE_STEPS = 2

    def __init__(self, cost: CostModel, max_draft: int, num_slots: int):
        self.cost, self.max_draft, self.num_slots = cost, max_draft, num_slots
        # speculation ruled out for this engine (see rule_out): every slot stays detached. Never cleared: the
        # engine then stops calling the proposer, whose caches would be out of step if drafting resumed
        self.off = False
        self.acceptance = AcceptanceEstimator(self.NUM_SOURCES, num_slots, self.DECAY)
        self.idle = np.zeros(num_slots, np.int64)  # [num_slots] steps in a row the choice was k = 0
        self.draft_cost: float | None = None  # seconds per step the proposer takes (propose + observe), EMA
        self.job = AcceptanceEstimator(1, 1, self.JOB_DECAY)  # source 0's drafts over every slot
        # drafts accepted per draft the drafter's own probabilities expected (DraftTokens.scores),
        # over the job
        self.calibration = AcceptanceEstimator(1, 1, self.JOB_DECAY)
        self.active = num_slots  # decoding slots at the last choice
        self.requests = 0  # requests placed (reset)
        # the slot's request drafts whatever the job says
        self.explorer = np.zeros(num_slots, bool)  # [num_slots]
        # the drafter's held-out acceptance: the job's prior before its own drafts
        self.hint: float | None = None
        self.unpaying = False  # the job's drafts were known not to pay at the last choice
        # Copies (DraftTokens.source 1) of a drafter whose detached slots copy, over the job, per decoding
        # step of a detached slot: copies accepted (copy_gain) and verified (copy_verify); and whether, at
        # the last choice that offered copies, they were known not to pay for the proposer's and the
        # controller's time a step (own_seconds: choose and end_step, EMA)
        self.copy_gain = AcceptanceEstimator(1, 1, self.JOB_DECAY)
        self.copy_verify = AcceptanceEstimator(1, 1, self.JOB_DECAY)
        self.copies_unpaying = False
        self.own_seconds = 0.0
        self._choose_seconds = 0.0  # the last choice's time (counted into own_seconds by end_step)
        self.quiet = 0  # steps in a row of every slot detached from such a job (probing)

    # ---- before a step ----

    def rule_out(self, acceptance_hint: float | None, active: int | None = None) -> None:
        """Before the first step: turn speculation off for good when one draft per slot, accepted with the
        drafter's own measured acceptance (with HINT_HEADROOM), could not pay for verifying it at this batch
        size: E = 1 + a tokens against c(2 n) / c(n). Where verifying is compute-bound (32 slots on this CPU:
        1.7x) an MTP head with held-out acceptance 0.41 never runs, instead of costing its passes until every
        slot detaches."""
        self.hint = acceptance_hint
        n = active or self.num_slots  # slots the job fills
        self.active = n  # (new requests placed before the first step are judged at this size)
        if acceptance_hint is None:
            return
        a = min(1.0, self.HINT_HEADROOM * acceptance_hint)
        self.off = bool(self.cost.at(2 * n) >= (1.0 + a) * self.cost.at(n))

    def choose(self, slots: np.ndarray, num_avail: np.ndarray, other_tokens: int,
               source: np.ndarray | None = None, gains: np.ndarray | None = None) -> np.ndarray:
        """_choose, its time kept for own_seconds."""
        start = time.perf_counter()
        k = self._choose(slots, num_avail, other_tokens, source, gains)
        self._choose_seconds = time.perf_counter() - start
        return k

    def _choose(self, slots: np.ndarray, num_avail: np.ndarray, other_tokens: int,
                source: np.ndarray | None = None, gains: np.ndarray | None = None) -> np.ndarray:
        """Drafts to verify per decoding slot ([num_seqs] int64 in [0, num_avail]) this step: a token tree's
        node budget, with gains [num_seqs, width] its nodes' expected tokens (tree.node_gains). A slot's idle
        count (detach) moves only on steps whose drafts are source 0's: the drafter that costs time per slot;
        it grows where the slot verifies nothing or the step's drafts do not pay for the drafter's time, and
        shrinks by one where they do."""
        if not len(num_avail) or num_avail.max() == 0 or self.off:
            return np.zeros(len(num_avail), np.int64)
        self.active = len(slots)
        src = 0 if source is None else source
        k, pays = choose_drafts(self.rates(src, slots), num_avail, other_tokens, self.draft_cost or 0.0,
                                self.cost, self.MIN_GAIN, gains)
        # a step that pays takes one off the count, not all of it: drafts right a third of the time pay now
        # and then (a draft model at batch 1, reset on each such step, never detached: 0.85x of plain decoding
        # on math)
        idle = np.where((k == 0) | (not pays), self.idle[slots] + 1, np.maximum(self.idle[slots] - 1, 0))
        evidence = max(self.JOB_EVIDENCE, self.JOB_EVIDENCE_PER_SLOT * len(slots))
        self.unpaying = gains is None and self.job.seen[0, 0] >= evidence and not self._job_pays()
        if source is not None and (np.asarray(source) == 1).any():
            self.copies_unpaying = self.copy_gain.seen[0, 0] >= evidence and not self._copies_pay()
        if self.unpaying:
            idle = np.where((k == 0) & ~self.explorer[slots], np.maximum(idle, self.DETACH_AFTER), idle)
        self.idle[slots] = idle if source is None else np.where(source == 0, idle, self.idle[slots])
        return k

    def rates(self, source, slots: np.ndarray) -> np.ndarray:
        """[num_seqs] each slot's acceptance estimate of `source`'s drafts (scalar or [num_seqs]). A slot's
        few drafts so far are weighed against the job's acceptance of source 0's drafts (its prior), not a
        fixed 1 in 2: at batch 1 drafts are offered on a few steps of each request, and from 1 in 2 the
        estimate of drafts accepted 0.09 of the time fell through 0.2-0.45 over a whole request (n-gram on a
        random MoE, where a 2-token step costs 1.34x one), verifying drafts that did not pay. Other sources
        keep 1 in 2."""
        job = self._job_rate()
        return self.acceptance.rate(source, slots, np.where(np.asarray(source) == 0, job, 0.5))

    def calibrated(self, scores: np.ndarray) -> np.ndarray:
        """[num_seqs, width] each node's expected tokens from the drafter's probabilities
        (DraftTokens.scores), times how many of its drafts were accepted per one it expected over the job so
        far (1 before any: PRIOR_SEEN drafts' worth), at most 1 and non-increasing along a row."""
        ratio = float(self.calibration.rate(0, 0, 1.0))
        return np.minimum.accumulate(np.clip(scores * ratio, 0.0, 1.0), axis=1)

    def detached(self, slots: np.ndarray) -> np.ndarray:
        """[num_seqs] bool: slots whose drafts have not paid for DETACH_AFTER steps in a row (or speculation
        is ruled out): a drafter that costs time per slot stops drafting for them until the slot takes a new
        request."""
        return (self.idle[slots] >= self.DETACH_AFTER) | self.off

    def probing(self, all_detached: bool, copies: bool = False) -> bool:
        """Whether this step runs the proposer and the controller, for a drafter all of whose drafts count
        toward detaching (or, with `copies`, one whose detached slots still copy): always, but while every
        slot is detached from a job whose drafts (copies) do not pay, on PROBE_STEPS steps in a row of every
        PROBE_EVERY (for copies: _copies_pay)."""
        quiet = all_detached and (self.copies_unpaying if copies else self.unpaying)
        self.quiet = self.quiet + 1 if quiet else 0
        return not quiet or (self.quiet - 1) % self.PROBE_EVERY >= self.PROBE_EVERY - self.PROBE_STEPS

    def detach(self, slot: int) -> None:
        """`slot` drafts no more until it takes a new request (its drafter has no state of its prompt)."""
        self.idle[slot] = self.DETACH_AFTER

    def reset(self, slot: int) -> None:
        """A new request in `slot`: attached to the drafter unless the job's drafts so far
        could not pay for it."""
        self.acceptance.reset(slot)
        self.requests += 1
        explore = self.requests % self.EXPLORE_EVERY == 1
        self.explorer[slot] = explore
        self.idle[slot] = 0 if explore or self._job_pays() else self.DETACH_AFTER

    def _job_rate(self) -> float:
        """Source 0's acceptance over the job so far, from PRIOR_SEEN drafts' worth of the drafter's held-out
        hint when it has one (1 in 2 otherwise):
        32 requests placed before any draft is known start from it."""
        return float(self.job.rate(0, 0, self.hint))

    def _job_pays(self) -> bool:
        """Whether drafts accepted at the job's rate so far, up to max_draft per slot at the last step's batch
        size, would pay for verifying them and the drafter's time. (Measured on this job's own text, unlike a
        head's held-out hint: with HINT_HEADROOM a draft model right 0.36 of the time looked worth 0.54, and
        each request of a batch-1 job caught its prompt up and drafted until it detached: 0.93x of plain
        decoding on math.)"""
        n = max(self.active, 1)
        return choose_drafts(np.full(n, self._job_rate()), np.full(n, self.max_draft, np.int64), 0,
                             self.draft_cost or 0.0, self.cost, self.MIN_GAIN)[1]

    def _copies_pay(self) -> bool:
        """Whether a step of detached slots that copy, at the job's copies accepted and verified per slot a
        step so far, emits tokens faster than plain decoding, the proposer's and the controller's time
        counted. (QA at batch 1, T 0.8: copies, accepted 0.38 of the time where the text repeated, added
        0.03 tokens a step, and finding, offering and scoring them every step cost 0.25-0.4 ms of ~6 ms.)
        Lenient: no MIN_GAIN margin, and own_seconds leaves out the engine's own part of a drafting step (the
        report, a tree's planning), so copies within the model's error keep running every step."""
        n = max(self.active, 1)
        gain, verified = float(self.copy_gain.rate(0, 0, 0.0)), float(self.copy_verify.rate(0, 0, 0.0))
        overhead = (self.draft_cost or 0.0) + self.own_seconds  # seconds a step
        return bool(n * (1.0 + gain) / (self.cost.at(n + n * verified) + overhead) > n / self.cost.at(n))

    # ---- after a step ----

    def end_step(self, r: StepReport) -> None:
        """What the step taught: acceptance per (slot, source), the step's cost, the drafter's time (and the
        controller's own: this and the step's choice)."""
        start = time.perf_counter()
        self.cost.observe(r.num_tokens, r.forward_seconds)
        self._count(r)
        if r.rated is not None and r.rated[1] > 0:
            self.calibration.update(0, np.zeros(1, np.int64), np.array([r.rated[0]]), np.array([r.rated[1]]))
        if len(r.slots) and (not self.detached(r.slots).all() or r.num_avail.any()):
            self._drafting(r.draft_seconds)  # (detached slots that still draft: MTP's copies)
        own = time.perf_counter() - start + self._choose_seconds
        self._choose_seconds = 0.0
        old = self.own_seconds
        self.own_seconds = own if not old else \
            (1 - self.DRAFT_EMA) * old + self.DRAFT_EMA * min(own, self.DRAFT_OUTLIER * old)

    def _count(self, r: StepReport) -> None:
        """Every offered draft whose true token is known, verified or not, against the tokens
        that came out."""
        width = r.draft_ids.shape[1]
        if width == 0 or not len(r.slots):
            return
        known = np.minimum(r.num_avail, r.kept)  # [num_dec]
        col = np.arange(width)[None, :]
        match = (r.draft_ids == r.emitted[:, :width]) & (col < known[:, None])
        hits = np.cumprod(match, axis=1).sum(axis=1)
        seen = hits + (hits < known)
        self.acceptance.update(0 if r.source is None else r.source, r.slots, hits, seen)
        mine = np.ones(len(hits), bool) if r.source is None else r.source == 0  # the costly drafter's
        if seen[mine].any():
            self.job.update(0, np.zeros(1, np.int64), hits[mine].sum(keepdims=True),
                            seen[mine].sum(keepdims=True))
        if r.source is not None:  # copies of detached slots, per such slot a step
            detached = self.detached(r.slots)
            if detached.any():
                copied = detached & (r.source == 1)
                steps = np.array([float(detached.sum())])
                key = np.zeros(1, np.int64)
                self.copy_gain.update(0, key, np.minimum(hits, r.num_draft)[copied].sum(keepdims=True), steps)
                self.copy_verify.update(0, key, r.num_draft[copied].sum(keepdims=True), steps)

    def _drafting(self, seconds: float) -> None:
        """The proposer's time in one step (drafting for the next step included), counted at most
        DRAFT_OUTLIER x the estimate (a stalled machine: CostModel.OUTLIER)."""
        old = self.draft_cost
        self.draft_cost = seconds if old is None else \
            (1 - self.DRAFT_EMA) * old + self.DRAFT_EMA * min(seconds, self.DRAFT_OUTLIER * old)
