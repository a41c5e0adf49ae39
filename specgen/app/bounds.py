"""What speculation could gain on a job, measured on this machine: the n-gram ceiling and the oracle bound.

- The ceiling: the n-gram drafting rule replayed teacher-forced on the plain run's outputs, every draft
  verified for free; tokens emitted per step (1 + the drafts that match).
- The oracle bound: a drafter that verifies exactly the drafts that will be accepted, each replayed step
  costing c(tokens fed) at the step costs measured on this machine; nothing is wasted on rejected drafts, and
  no policy choosing k per step from these drafts does better while c grows with the tokens fed. For the whole
  job the prefill share p (speculation cannot shorten it) is added back: 1 / (p + (1 - p) / decoding bound).
Host time per step (drafting, bookkeeping) is not charged, so the real ceiling is lower still.
"""
from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence

import numpy as np

from specgen.engine.proposers.base import Proposer, SlotView
from specgen.engine.types import StepUpdate
from specgen.io.bench_rows import Possible
from specgen.runtime.batch import build_forward_batch

# (model, position, tokens, slots=, repeats=) -> {tokens per slot: seconds per step}: step_costs, or a
# test's own
MeasureCosts = Callable[..., dict[int, float]]


def replay_steps(prompts: Sequence[Sequence[int]], outputs: Sequence[Sequence[int]], k: int,
                 proposer: Proposer) -> list[int]:
    """The tokens each step would emit if `proposer`'s drafts (k at most; a model-free drafter such as n-gram,
    fresh) were verified for free, teacher-forced on the outputs, request after request (each request's
    prefill step, its first token, included; with an n-gram pool, the requests replayed before are in it, as
    if they had finished earlier)."""
    steps: list[int] = []
    one = np.zeros(1, np.int64)
    for prompt, out in zip(prompts, outputs):
        seq = np.array([list(prompt) + list(out)], np.int64)
        end = seq.shape[1]
        pos = len(prompt) + 1
        steps.append(1)  # the first output token comes from the prefill step
        while pos < end:
            d = proposer.propose(SlotView(one, seq, np.array([pos]), np.array([k])))
            drafts = d.draft_ids[0, : min(int(d.num_draft[0]), end - pos)]
            match = drafts == seq[0, pos: pos + len(drafts)]
            accepted = int(np.cumprod(match).sum()) if len(match) else 0
            emitted = min(accepted + 1, end - pos)
            steps.append(emitted)
            pos += emitted
            proposer.observe(StepUpdate(one, one, np.array([pos - emitted - 1]), np.array([emitted]),
                                        np.array([pos == end]), seq, None, seq_lens=np.array([pos])))
    return steps


def step_costs(model, position: int, tokens: Sequence[int], slots: int = 1,
               repeats: int = 15) -> dict[int, float]:
    """Seconds of a greedy forward feeding T tokens to each of `slots` slots at `position` (random tokens; one
    prefill up to it first): {T: the median of `repeats` timings, taken round robin over the T}. `model` is a
    specgen Model."""
    s = np.arange(slots, dtype=np.int64)
    rng = np.random.default_rng(0)
    vocab = min(1000, model.config.vocab_size)
    cache = model.new_cache(slots, position + max(tokens) + 1)
    if position:
        model.forward(build_forward_batch(s, np.zeros(slots, np.int64), np.full(slots, position),
                                          rng.integers(0, vocab, slots * position), np.zeros(slots, bool)),
                      cache, logits=False)
    batches = {t: build_forward_batch(s, np.full(slots, position), np.full(slots, t),
                                      rng.integers(0, vocab, slots * t), np.ones(slots, bool))
               for t in tokens}
    times: dict[int, list[float]] = {t: [] for t in tokens}
    for b in batches.values():  # warm
        model.forward(b, cache, logits=False)
    for _ in range(repeats):
        for t, b in batches.items():
            start = time.perf_counter()
            model.forward(b, cache, logits=False)
            times[t].append(time.perf_counter() - start)
    return {t: float(np.median(v)) for t, v in times.items()}


def oracle_decode_bound(steps: Sequence[int], costs: dict[int, float], slots: int = 1) -> float:
    """The decoding steps' speedup over plain decoding when only accepted drafts are verified: at one slot
    each replayed step costs c(tokens it emits); at `slots` slots every step feeds slots x (mean tokens per
    step), c interpolated between the measured counts (costs keyed by tokens per slot)."""
    if slots == 1:
        return sum(steps) * costs[1] / sum(costs[e] for e in steps)
    per_step = sum(steps) / len(steps)
    ts = sorted(costs)
    return per_step * costs[1] / float(np.interp(per_step, ts, [costs[t] for t in ts]))


def job_bound(decode_bound: float, prefill_share: float) -> float:
    """The whole job's bound, its prefill (a share p of the plain job's time) not sped up."""
    return 1.0 / (prefill_share + (1.0 - prefill_share) / decode_bound)


def prefill_share(prefill_wall: float, plain_wall: float) -> float:
    """p: the plain job's time spent prefilling, from the same job run to its first token only (capped at
    0.99: timing noise on a job of tiny outputs can put the prefill pass above the whole)."""
    return min(prefill_wall / plain_wall, 0.99)


def possible(model, proposer: Proposer, prompts: Sequence[Sequence[int]], outputs: Sequence[Sequence[int]],
             k: int, slots: int, share: float, measure: MeasureCosts = step_costs) -> Possible:
    """The ceiling and the oracle bound of `proposer`'s rule on a job (prompts and plain decoding's outputs,
    in input order) at `slots` slots (at most one per request), its step costs measured on `model` at the
    median prompt length: at one slot for each token count a replayed step emits, at several for 1 up to the
    mean tokens per step rounded up (the bound interpolates there)."""
    steps = replay_steps(prompts, outputs, k, proposer)
    per_step = sum(steps) / len(steps)
    slots = max(1, min(slots, len(prompts)))
    tokens = sorted(set(steps) | {1}) if slots == 1 else list(range(1, max(2, math.ceil(per_step)) + 1))
    position = int(np.median([len(p) for p in prompts]))
    costs = measure(model, position, tokens, slots=slots, repeats=15 if slots == 1 else 5)
    decode = oracle_decode_bound(steps, costs, slots)
    return Possible(per_step, decode, share, job_bound(decode, share), costs, slots)
