"""The step-cost table of a model at a batch size: timed at start-up, or found on disk."""
from __future__ import annotations

import time
import weakref

import numpy as np

from specgen.backends.base import RowSampling
from specgen.config import EngineConfig, SamplingParams
from specgen.engine.adaptive import costs
from specgen.engine.adaptive.controller import Controller
from specgen.runtime.batch import build_forward_batch

REPEATS = 5  # timings per point of the table (round robin over the points), at most
BUDGET = 0.15  # seconds of timed forwards after which fewer repeats are taken (large batches)
# ... but never fewer than this: with one round, one stalled forward (1.2 s where a step took 5 ms, the
# machine busy) became the whole table, stored for a week
MIN_REPEATS = 3
CHECKS = 3  # timings of a stored table's first point that check it against the machine as it is now
ANCHOR_SLOTS = 8  # from this many slots on, the table also times one slot's single token
# What the timed blocks hold, part of a stored table's key: distinct random token ids. A block of one repeated
# id routes every token of a mixture-of-experts block to the same experts, while a real verify block's tokens
# spread over several (6 tokens: 21.6 experts of 64 per block instead of 6), so such a table priced an MoE
# model's 6-token block at 1.7x one token where it cost 2.5x, and the controller verified drafts that could
# not pay.
TIMED_TOKENS = "random-ids"

# tables measured in this process, per model: {(num_slots, max_draft): (tokens, seconds)}; a later engine on
# the same model (e.g. `specgen bench`) reuses them
_measured: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def measured(model) -> dict:
    return _measured.setdefault(model, {})


def controller_for(model, cache, max_draft: int, engine: EngineConfig, num_slots: int | None = None,
                   sampling: SamplingParams | None = None) -> Controller:
    """A controller whose cost table is this model's at num_slots slots (all the cache's by default): found in
    this process or on disk, else timed: forwards feeding 1, 2 and max_draft + 1 tokens to each slot (their
    cache rows are overwritten later by prefill), and with ANCHOR_SLOTS or more one slot's token; the median
    of up to REPEATS timings per point, taken round robin (one timing of a 6 ms step can be off by 50% on a
    shared machine, and one bad point skews every choice). The one-token point anchors steps of fewer slots,
    once slots drain at a job's end (without it an 8-token step of 32 slots' table was extrapolated to 2 ms
    instead of the 18 ms it took). The forwards are greedy steps', or with `sampling` (a sampled job's
    settings) its steps': logits for every row, sampled by the model's sampler (or a forward sampling its
    rows, as the engine's step samples unfiltered ones), so the controller prices the steps the job runs."""
    num_slots = cache.num_slots if num_slots is None else num_slots
    sampled = None if sampling is None else _sampled(sampling)
    key = (num_slots, max_draft) if sampled is None else (num_slots, max_draft, sampled)
    table = measured(model).get(key)
    path = None
    if table is None and engine.cost_cache:
        from specgen.kernels.build import build_key

        loaded = model.backend.engine  # the threads and kernels the model runs with
        path = costs.table_path(engine.cache_root(), [model.cost_key(), cache.dtype, str(num_slots),
                                                      str(max_draft), str(loaded.num_threads()),
                                                      build_key(loaded.cpu_target), TIMED_TOKENS]
                                 + ([] if sampled is None else [f"sampled {sampled}"]))
        table = costs.load(path)
        if table is not None and not _still_fits(model, cache, max_draft, num_slots, table, sampled):
            table = None
    if table is None:
        table = _time_table(model, cache, max_draft, num_slots, sampled)
        costs.store(path, *table)
    measured(model)[key] = table
    return Controller(costs.CostModel(*table), max_draft, cache.num_slots)


# a sampled step's timed settings (_sampled)
Sampled = tuple[float, int, float, float, bool]


def _sampled(p: SamplingParams) -> Sampled:
    """The settings a sampled step is timed with: (temperature, top_k, top_p, min_p, whether its rows need
    their logits whatever the filters: log-probabilities, penalties, a logit bias, min_tokens or a grammar, as
    the engine's step decides)."""
    other = (p.logprobs or p.repetition_penalty != 1 or p.presence_penalty != 0 or p.frequency_penalty != 0
             or p.min_tokens > 0 or bool(p.logit_bias) or bool(p.response_format))
    return (p.temperature, p.top_k, p.top_p, p.min_p, bool(other))


def _step(model, cache, batch, sampled: Sampled | None) -> None:
    """One timed step: a greedy forward, or a sampled one: a forward with logits and the sampler over every
    logit row, or where the backend samples unfiltered rows in its forward, that forward."""
    if sampled is None:
        model.forward(batch, cache, logits=False)
        return
    n = len(batch.logit_rows)
    temperature, top_k, top_p, min_p, other = sampled
    rows = RowSampling(np.full(n, temperature), np.full(n, top_k, np.int64), np.full(n, top_p),
                       np.full(n, min_p), np.arange(n, dtype=np.uint64), np.zeros(n, np.int64))
    if model.samples_in_forward and rows.unfiltered() and not other:  # as the engine's step samples them
        model.forward(batch, cache, logits=False, sampling=rows)
        return
    out = model.forward(batch, cache, logits=True)
    model.sample(out.logits, rows, out.greedy)


def _still_fits(model, cache, max_draft: int, num_slots: int, table: tuple[np.ndarray, np.ndarray],
                sampled: Sampled | None = None) -> bool:
    """Whether a stored table's first point is within 2x of the median of CHECKS timings of its step now
    (after a warm-up forward): a table timed on a stalled or differently loaded machine is timed again."""
    first = _blocks(model, max_draft, num_slots)[1][0]
    _step(model, cache, first, sampled)  # warm-up
    times = []
    for _ in range(CHECKS):
        start = time.perf_counter()
        _step(model, cache, first, sampled)
        times.append(time.perf_counter() - start)
    return 0.5 <= float(np.median(times)) / float(table[1][0]) <= 2.0


def _blocks(model, max_draft: int, num_slots: int) -> tuple[list[int], list]:
    """The table's points: (tokens each step feeds, its ForwardBatch), fewest tokens first."""
    slots = np.arange(num_slots, dtype=np.int64)
    counts = sorted({1, 2, max_draft + 1})
    rng = np.random.default_rng(0)  # TIMED_TOKENS: each block's tokens distinct, as a verify block's are
    vocab = model.config.vocab_size
    batches = [build_forward_batch(slots, np.zeros(num_slots, np.int64), np.full(num_slots, q, np.int64),
                                   rng.integers(0, vocab, num_slots * q), np.ones(num_slots, bool))
               for q in counts]
    tokens = [q * num_slots for q in counts]
    if num_slots >= ANCHOR_SLOTS:
        batches.insert(0, build_forward_batch(slots[:1], np.zeros(1, np.int64), np.ones(1, np.int64),
                                              np.zeros(1, np.int64), np.ones(1, bool)))
        tokens.insert(0, 1)
    return tokens, batches


def _time_table(model, cache, max_draft: int, num_slots: int,
                sampled: Sampled | None = None) -> tuple[np.ndarray, np.ndarray]:
    tokens, batches = _blocks(model, max_draft, num_slots)
    _step(model, cache, batches[0], sampled)  # warm-up
    timings: list[list[float]] = [[] for _ in batches]
    spent = 0.0
    for _ in range(REPEATS):
        for batch, times in zip(batches, timings):
            start = time.perf_counter()
            _step(model, cache, batch, sampled)
            times.append(time.perf_counter() - start)
        spent += sum(times[-1] for times in timings)
        if spent > BUDGET and len(timings[0]) >= MIN_REPEATS:
            break
    seconds = np.array([np.median(times) for times in timings])
    return np.array(tokens), np.maximum.accumulate(seconds)
