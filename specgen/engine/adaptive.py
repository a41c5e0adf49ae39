"""Adaptive speculation: how many drafts each slot verifies this step, from measured costs and acceptance.

A slot with acceptance estimate a that verifies k drafts emits (1 - a^(k+1)) / (1 - a) tokens on average
(Leviathan et al., 2023). A step that feeds T tokens costs c(T), measured on this machine at this batch size
(a table over T, interpolated, scaled online by the ratio of measured to predicted step times). Each step
picks per-slot k_s (0 = no drafts) maximising emitted tokens per second, sum_s E_s(k_s) / c(sum_s (1 + k_s)),
by Dinkelbach iteration: each slot maximises E_s(k) - rate * c'(T) * k, and rate is re-estimated (with one
decoding slot every k is tried instead).
k = 0 for every slot is plain decoding, so the choice can only be slower than plain when the cost model is wrong.
The drafter's own time per step (an MTP head's pass: its KV catch-up and chained drafts) is charged too: a step
that speculates costs c(T) + d, with d the measured drafting time, while plain decoding costs c(n) alone (a
slot left at k = 0 is detached from the drafter after DETACH_AFTER steps, so plain decoding stops paying d).
A guard checks the model against reality: it keeps the measured throughput (emitted tokens per second of
decode-only steps, as decayed sums of tokens over decayed sums of seconds) of steps that speculated and of
steps that did not, forces a plain step now and then to keep
the second one current, and decodes plainly while speculating measures slower.
"""
from __future__ import annotations

import numpy as np

PRIOR_ACCEPTED = 1.0  # acceptance prior: 1 accepted of 2 drafted, until a slot has history
PRIOR_DRAFTED = 2.0


def expected_emitted(alpha: np.ndarray, k: np.ndarray) -> np.ndarray:
    """E[tokens per step] = 1 + a + ... + a^k, elementwise."""
    alpha = np.minimum(np.maximum(alpha, 0.0), 0.999)  # np.clip's value, at a third of its call cost
    return (1 - alpha ** (k + 1)) / (1 - alpha)


def _bracket(x: list[float], t: float) -> tuple[int, float]:
    """(j, lam) with x[j] <= t <= x[j + 1] and t = x[j] + lam (x[j + 1] - x[j]), for x[0] <= t <= x[-1] and at
    least two points."""
    j = next(i for i in range(len(x) - 1) if t <= x[i + 1])
    return j, (t - x[j]) / (x[j + 1] - x[j])


def _interp(x: list[float], y: list[float], slope: float, t: float) -> float:
    """np.interp(t, x, y) for one t in plain Python (the same formula, so the same value), and beyond x's ends
    the line of the given slope through the end point."""
    if len(x) == 1:
        return y[0]
    if t > x[-1]:
        return y[-1] + slope * (t - x[-1])
    if t < x[0]:
        return y[0] + slope * (t - x[0])
    j, _ = _bracket(x, t)
    if t == x[j + 1]:
        return y[j + 1]
    return (y[j + 1] - y[j]) / (x[j + 1] - x[j]) * (t - x[j]) + y[j]


class CostModel:
    """Step time as a function of the tokens fed: a start-up table, corrected online point by point.

    The table (timed at start-up, or found on disk) can be off in its shape as well as its level: one unlucky
    timing of a 2-token step, kept on disk for a week, priced it at 1.39x a 1-token step where it cost 1.15x,
    and every job that read it drafted less. So each table point keeps its own measured ratio (observed seconds
    over the table's), from the steps whose token counts fall next to it (weighted as the interpolation weighs
    it), alongside the global ratio (scale) of all steps. A point's effective ratio is its own, shrunk toward
    the global one by POINT_PRIOR observations' worth (a point no step has come near follows the global ratio,
    as the whole table did before); its evidence decays by POINT_DECAY per observed step, so a point the job
    stopped using drifts back to the global ratio as contexts grow."""

    EMA = 0.1  # weight of one observation in the global ratio
    # A step counts at most OUTLIER x the current prediction. On a shared machine a step now and then takes ~100 ms
    # more (the hypervisor takes the CPU away: /proc/stat's steal ticks grow by 10-20 in exactly those steps, ~1
    # step in 35 of a batch-1 job), 10-20x a decoding step; counted whole, one such step raised the global ratio
    # from 1 to ~2.3 and its point's ratio by ~40% for the next ~30 steps. Real errors of the table (stale, other
    # contexts) are within 2x per step, and a larger one is still followed, by up to 2x per step.
    OUTLIER = 2.0
    POINT_PRIOR = 1.0  # observations' worth of the global ratio in each point's effective ratio
    POINT_DECAY = 0.97  # per observed step: a point's evidence (a ~30-step window)

    def __init__(self, tokens: np.ndarray, seconds: np.ndarray):
        self.tokens = np.asarray(tokens, np.float64)  # [num_points] increasing
        self.seconds = np.asarray(seconds, np.float64)
        self._x = self.tokens.tolist()  # the points, in plain Python for at()
        self._table = self.seconds.tolist()
        self._table_slope = (self._table[-1] - self._table[0]) / max(self._x[-1] - self._x[0], 1.0)
        # [num_points] decayed sums, over the steps next to each point, of interpolation weight x measured ratio
        # and of the weight (its evidence): their quotient is the point's own ratio
        self._sum = [0.0] * len(self._x)
        self._evidence = [0.0] * len(self._x)
        self.scale = 1.0  # the global ratio (a setter: the effective table follows it)

    @property
    def scale(self) -> float:
        return self._scale

    @scale.setter
    def scale(self, value: float) -> None:
        self._scale = float(value)
        self._refresh()

    def _refresh(self) -> None:
        """The effective table: each point's seconds times its effective ratio, and the end-to-end slope."""
        prior, g = self.POINT_PRIOR, self._scale
        self._y = [s * (v + prior * g) / (e + prior) for s, v, e in zip(self._table, self._sum, self._evidence)]
        x, y = self._x, self._y
        self._slope = (y[-1] - y[0]) / max(x[-1] - x[0], 1.0)

    def __call__(self, num_tokens: np.ndarray) -> np.ndarray:
        """at() elementwise."""
        t = np.asarray(num_tokens, np.float64)
        x, y, slope = self.tokens, np.array(self._y), self._slope
        inside = np.interp(t, x, y)
        beyond = y[-1] + slope * (t - x[-1])
        below = y[0] + slope * (t - x[0])
        return np.where(t > x[-1], beyond, np.where(t < x[0], below, inside))

    def _weights(self, t: float) -> list[tuple[int, float]]:
        """(point, interpolation weight) pairs of a token count: its bracketing points, or the nearest end."""
        x = self._x
        if t >= x[-1]:
            return [(len(x) - 1, 1.0)]
        if t <= x[0]:
            return [(0, 1.0)]
        j, lam = _bracket(x, t)
        return [(j, 1.0 - lam), (j + 1, lam)]

    def at(self, num_tokens: int) -> float:
        """The predicted seconds of a step feeding num_tokens, in plain Python (the controller asks a few times per
        step; a numpy call costs ~10 us): the same interpolation formula as np.interp, so the same value as
        __call__."""
        return _interp(self._x, self._y, self._slope, float(num_tokens))

    def table_at(self, num_tokens: int) -> float:
        """The uncorrected table's seconds at num_tokens (interpolated; beyond its ends, its end-to-end slope)."""
        return _interp(self._x, self._table, self._table_slope, float(num_tokens))

    def observe(self, num_tokens: int, seconds: float) -> None:
        """One step's measured seconds: into the global ratio and the ratios of the points next to its count."""
        predicted = self.table_at(num_tokens)
        if predicted <= 0:
            return
        r = min(seconds, self.OUTLIER * self.at(num_tokens)) / predicted
        decay = self.POINT_DECAY
        self._sum = [decay * v for v in self._sum]
        self._evidence = [decay * e for e in self._evidence]
        for i, w in self._weights(float(num_tokens)):
            self._sum[i] += w * r
            self._evidence[i] += w
        self.scale = (1 - self.EMA) * self._scale + self.EMA * r  # refreshes the effective table


class Controller:
    """Per-step draft counts for the decoding slots, and each slot's running acceptance estimate.

    Acceptance is tracked from every draft the proposer offered whose fate is known, verified or not: a draft
    not sent to verification is still compared with the token that came out (shadow acceptance), so a slot
    whose text turns predictable is noticed. Counts decay by DECAY per step to follow changes within a request.
    """

    DECAY = 0.9
    PROBE_EVERY = 16  # steps between forced plain (or, while speculation is off, speculative) probe steps
    DETACH_AFTER = 8  # steps in a row in which drafts did not pay for a slot before its drafter stops for it
    RATE_EMA = 0.2
    RATE_DECAY = 0.97  # the guard's throughputs: decayed sums of tokens and of seconds (a ~30-step window)
    # The drafter's time per step really changes up to ~5x from one step to the next (an MTP head's pass: 0.14-0.18
    # ms catching up alone, 0.61-0.71 ms with three chained drafts); a stall (~100 ms) multiplies it by 100 or more.
    DRAFT_OUTLIER = 5.0

    HINT_HEADROOM = 1.5  # a head's held-out acceptance is an average over text; predictable text beats it
    # A step speculates only when the model predicts it MIN_GAIN faster than plain decoding: gains smaller than
    # that are within the cost model's error (its table is timed on uniform blocks at position 0), and there
    # verifying drafts measured slower than plain decoding (32 slots of code rewriting: 0.87x and 0.97x).
    MIN_GAIN = 0.05
    NUM_SOURCES = 2  # acceptance estimates per slot: one per kind of draft (DraftTokens.source)

    def __init__(self, cost: CostModel, max_draft: int, num_slots: int):
        self.cost, self.max_draft = cost, max_draft
        self.num_slots = num_slots
        self.off = False  # speculation ruled out for this engine (see rule_out): every slot stays detached
        # [NUM_SOURCES, num_slots] decayed counts of drafts that matched, and of drafts whose fate is known, per
        # source (DraftTokens.source: an MTP slot's head and its copies are judged apart); hits / seen: source 0
        self.hits_by = np.zeros((self.NUM_SOURCES, num_slots))
        self.seen_by = np.zeros((self.NUM_SOURCES, num_slots))
        self.hits, self.seen = self.hits_by[0], self.seen_by[0]  # views
        # decayed sums of (emitted tokens, seconds) of speculative and of plain decode steps: their ratio is the
        # measured throughput (a ratio of sums: one unlucky step moves it by its share of the window's time)
        self.sums = {True: np.zeros(2), False: np.zeros(2)}
        self.steps = 0
        self.idle = np.zeros(num_slots, np.int64)  # [num_slots] steps in a row the cost model chose k = 0
        self.draft_cost: float | None = None  # seconds per step the proposer takes (propose + observe), EMA

    def drafting(self, seconds: float) -> None:
        """The proposer's time in one step (drafting for the next step included), counted at most DRAFT_OUTLIER x
        the estimate (a stalled machine: CostModel.OUTLIER)."""
        old = self.draft_cost
        if old is None:
            self.draft_cost = seconds
            return
        self.draft_cost = (1 - self.RATE_EMA) * old + self.RATE_EMA * min(seconds, self.DRAFT_OUTLIER * old)

    def record(self, num_emitted: int, seconds: float, speculated: bool, num_tokens: int | None = None) -> None:
        """Throughput of one decode-only step, for the guard. num_tokens: the tokens the step fed; its seconds then
        count at most CostModel.OUTLIER x the predicted step (the cost model's, plus the drafter's time when it
        speculated), so that a step the machine stalled in does not veto speculation for hundreds of steps (the
        speculative sums are updated only every PROBE_EVERY steps while vetoing). None: as measured."""
        if num_tokens is not None:
            predicted = self.cost.at(num_tokens) + ((self.draft_cost or 0.0) if speculated else 0.0)
            seconds = min(seconds, self.cost.OUTLIER * predicted)
        s = self.sums[speculated]
        s *= self.RATE_DECAY
        s += (num_emitted, max(seconds, 1e-9))

    def rate(self, speculated: bool) -> float | None:
        """Measured tokens per second of speculative (or plain) decode steps, None before the first."""
        tokens, seconds = self.sums[speculated]
        return tokens / seconds if seconds > 0 else None

    def _guard(self, speculate: bool) -> bool:
        """Whether a step the cost model would speculate in does: not while speculation measures slower than
        plain decoding; a probe step of the other kind now and then."""
        self.steps += 1
        if not speculate:
            return False
        spec, plain = self.rate(True), self.rate(False)
        probe = self.steps % self.PROBE_EVERY == 0
        if plain is None or spec is None:
            return not (plain is None and probe)
        if spec < plain:
            return probe
        return not probe

    def reset(self, slot: int) -> None:
        self.hits_by[:, slot] = self.seen_by[:, slot] = 0.0
        self.idle[slot] = 0

    def detached(self, slots: np.ndarray) -> np.ndarray:
        """[num_seqs] bool: slots whose drafts have not paid for DETACH_AFTER steps in a row. A drafter that costs
        time per slot (the MTP head) stops drafting for them until the slot takes a new request."""
        return (self.idle[slots] >= self.DETACH_AFTER) | self.off

    def rule_out(self, acceptance_hint: float | None, active: int | None = None) -> None:
        """Before the first step: turn speculation off for good when one draft per slot, accepted with the
        drafter's own measured acceptance (with HINT_HEADROOM), could not pay for verifying it at this batch
        size: E = 1 + a tokens against c(2 n) / c(n). Where verifying is compute-bound (32 slots on this CPU:
        1.7x) an MTP head with held-out acceptance 0.41 never runs, instead of costing its passes until every
        slot detaches."""
        if acceptance_hint is None:
            return
        n = active or self.num_slots  # slots the job fills
        a = min(1.0, self.HINT_HEADROOM * acceptance_hint)
        self.off = bool(self.cost(np.array([2 * n]))[0] >= (1.0 + a) * self.cost(np.array([n]))[0])

    def alpha(self, slots: np.ndarray, source: np.ndarray | None = None) -> np.ndarray:
        """[num_seqs] acceptance estimate of each slot's drafts of `source` ([num_seqs]; None: source 0)."""
        src = 0 if source is None else source
        return (self.hits_by[src, slots] + PRIOR_ACCEPTED) / (self.seen_by[src, slots] + PRIOR_DRAFTED)

    def update(
        self,
        slots: np.ndarray,  # [num_seqs] decoding slots of the step
        draft_ids: np.ndarray,  # [num_seqs, width] what the proposer offered
        num_avail: np.ndarray,  # [num_seqs]
        emitted: np.ndarray,  # [num_seqs, >= width + 1] the tokens that came out
        kept: np.ndarray,  # [num_seqs] how many of them are real
        source: np.ndarray | None = None,  # [num_seqs] the drafts' source (None: 0)
    ) -> None:
        width = draft_ids.shape[1]
        known = np.minimum(num_avail, kept)  # drafts whose true token is known
        if width == 0:
            return
        col = np.arange(width)[None, :]
        match = (draft_ids == emitted[:, :width]) & (col < known[:, None])
        hits = np.cumprod(match, axis=1).sum(axis=1)
        seen = hits + (hits < known)
        src = 0 if source is None else source
        self.hits_by[src, slots] = self.DECAY * self.hits_by[src, slots] + hits
        self.seen_by[src, slots] = self.DECAY * self.seen_by[src, slots] + seen

    def choose(
        self,
        slots: np.ndarray,  # [num_seqs] decoding slots
        num_avail: np.ndarray,  # [num_seqs] drafts the proposer offers
        other_tokens: int,  # tokens of the step that are not decode blocks (prefills)
        source: np.ndarray | None = None,  # [num_seqs] the drafts' source (None: 0)
    ) -> np.ndarray:
        """Drafts to verify per slot, [num_seqs] int64, each in [0, num_avail]. A slot's idle count (detach) moves
        only on steps whose drafts are source 0's: the drafter that costs time per slot."""
        n = len(num_avail)
        if n == 0 or num_avail.max() == 0 or self.off:
            return np.zeros(n, np.int64)
        if n == 1:
            return self._choose_one(slots, int(num_avail[0]), other_tokens, 0 if source is None else int(source[0]))
        alpha = self.alpha(slots, source)  # [num_seqs]
        ks = np.arange(self.max_draft + 1)[None, :]  # [1, max_draft + 1]
        emit = expected_emitted(alpha[:, None], ks)  # [num_seqs, max_draft + 1] E_s(k)
        gain = np.where(ks <= num_avail[:, None], emit, -np.inf)
        rows = np.arange(n)
        k = np.zeros(n, np.int64)
        base = n + other_tokens
        d = self.draft_cost or 0.0
        for _ in range(4):
            total = base + int(k.sum())
            step = self.cost.at(total)
            rate = float(emit[rows, k].sum()) / (step + d)
            marginal = self.cost.at(total + 1) - step
            k_new = np.argmax(gain - (rate * marginal) * ks, axis=1).astype(np.int64)
            if (k_new == k).all():
                break
            k = k_new
        # Keep the choice only if it beats plain decoding under the model, and while the guard agrees.
        plain = n / self.cost.at(base)
        spec = float(emit[rows, k].sum()) / (self.cost.at(base + int(k.sum())) + d)
        if not self._guard(spec > plain * (1.0 + self.MIN_GAIN) and bool(k.any())):
            k = np.zeros(n, np.int64)
        idle = np.where(k == 0, self.idle[slots] + 1, 0)
        self.idle[slots] = idle if source is None else np.where(source == 0, idle, self.idle[slots])
        return k

    def _choose_one(self, slots: np.ndarray, avail: int, other_tokens: int, source: int = 0) -> np.ndarray:
        """choose for one decoding slot (batch 1, where the host's time per step counts most): every k in
        [0, avail] tried, in plain Python (~10 us against ~80 for the arrays' path); the exact maximum of the
        same objective that the Dinkelbach iteration approaches, with the same margin and guard."""
        s = int(slots[0])
        # alpha() for this slot with expected_emitted's clip, in Python floats (the arrays' calls cost ~10 us more)
        a = min(max((self.hits_by[source, s] + PRIOR_ACCEPTED) / (self.seen_by[source, s] + PRIOR_DRAFTED), 0.0),
                0.999)
        base, d = 1 + other_tokens, self.draft_cost or 0.0
        best_k, best, emit, p = 0, 0.0, 1.0, 1.0
        for k in range(1, min(avail, self.max_draft) + 1):
            p *= a
            emit += p  # 1 + a + ... + a^k
            rate = emit / (self.cost.at(base + k) + d)
            if rate > best:
                best_k, best = k, rate
        plain = 1.0 / self.cost.at(base)
        k = best_k if self._guard(best_k > 0 and best > plain * (1.0 + self.MIN_GAIN)) else 0
        if source == 0:
            self.idle[s] = self.idle[s] + 1 if k == 0 else 0
        return np.array([k], np.int64)
