"""What speculation could gain on a job, measured on this machine: the n-gram ceiling and the oracle bound.

- The ceiling: the n-gram drafting rule replayed teacher-forced on the plain run's outputs, every draft
  verified for free; tokens emitted per step (1 + the drafts that match).
- The oracle bound: a drafter that verifies exactly the drafts that will be accepted, each replayed step costing
  c(tokens fed) at the step costs measured on this machine; nothing is wasted on rejected drafts, and no policy
  choosing k per step from these drafts does better while c grows with the tokens fed. For the whole job the
  prefill share p (speculation cannot shorten it) is added back: 1 / (p + (1 - p) / decoding bound).
Host time per step (drafting, bookkeeping) is not charged, so the real ceiling is lower still.
"""
from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np

from specgen.config import NgramConfig
from specgen.engine.proposers.base import SlotView
from specgen.engine.proposers.ngram import NgramProposer
from specgen.engine.types import StepUpdate, build_forward_batch


def replay_steps(prompts: Sequence[Sequence[int]], outputs: Sequence[Sequence[int]], k: int,
                 ngram: NgramConfig) -> list[int]:
    """The tokens each step would emit if n-gram drafting (k drafts, `ngram`'s rule and pool) were verified for
    free, teacher-forced on the outputs, request after request (each request's prefill step, its first token,
    included; with a pool, the requests replayed before are in it, as if they had finished earlier)."""
    proposer = NgramProposer(k, ngram.min, ngram.max, ngram.pool)
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


def step_costs(model, position: int, tokens: Sequence[int], slots: int = 1, repeats: int = 15) -> dict[int, float]:
    """Seconds of a greedy forward feeding T tokens to each of `slots` slots at `position` (random tokens; one
    prefill up to it first): {T: the median of `repeats` timings, taken round robin over the T}. `model` is a
    specgen Model."""
    s = np.arange(slots, dtype=np.int64)
    rng = np.random.default_rng(0)
    cache = model.new_cache(slots, position + max(tokens) + 1)
    if position:
        model.forward(build_forward_batch(s, np.zeros(slots, np.int64), np.full(slots, position),
                                          rng.integers(0, 1000, slots * position), np.zeros(slots, bool)), cache,
                      logits=False)
    batches = {t: build_forward_batch(s, np.full(slots, position), np.full(slots, t),
                                      rng.integers(0, 1000, slots * t), np.ones(slots, bool)) for t in tokens}
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
    """The decoding steps' speedup over plain decoding when only accepted drafts are verified: at one slot each
    replayed step costs c(tokens it emits); at `slots` slots every step feeds slots x (mean tokens per step),
    c interpolated between the measured counts (costs keyed by tokens per slot)."""
    if slots == 1:
        return sum(steps) * costs[1] / sum(costs[e] for e in steps)
    per_step = sum(steps) / len(steps)
    ts = sorted(costs)
    return per_step * costs[1] / float(np.interp(per_step, ts, [costs[t] for t in ts]))


def job_bound(decode_bound: float, prefill_share: float) -> float:
    """The whole job's bound, its prefill (a share p of the plain job's time) not sped up."""
    return 1.0 / (prefill_share + (1.0 - prefill_share) / decode_bound)
