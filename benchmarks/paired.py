"""Whole generation jobs with every forward run two ways, in turn first, so both are timed under the same load.

On this shared 2-core machine two runs of one job differ by 10-30%, which hides a few percent. Here each
forward of one job runs twice, once per variant (a forward rewrites the same K/V rows with the same bits, so the
job's tokens do not depend on which runs last); the variants' outputs are checked equal. A second, ordinary
run of the job gives the rest of a step's time (drafting, sampling, bookkeeping: its wall time less its
forwards). The job's ratio counts decode steps as measured, prefill steps (prompt tokens) at their mean
both ways, and the rest the same both ways.
"""
from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np

Forward = Callable  # (batch, cache, logits=True) -> (logits, hidden, greedy tokens)

HEADER = (f"{'set':<15}{'bs':>4} {'method':<7}{'steps':>6}{'A ms/step':>11}{'B ms/step':>11}{'ratio':>8}"
          f"{'median':>8}{'prefill steps':>15}{'rest ms/step':>14}{'job ratio':>11}")


def paired_job(model, run: Callable[[], tuple], a: Forward, b: Forward, same: Callable[[tuple, tuple], bool]) -> dict:
    """Runs `run` (one job, returning spec_bench.run_method's (outputs, counts)) twice with model.forward_greedy replaced:
    first by both variants in turn (a and b), then by a alone, timed. Returns per-step timings and the ratios."""
    original = model.forward_greedy
    steps: list[tuple[float, float, bool]] = []  # (a s, b s, any prompt tokens)

    def both(batch, cache, logits=True):
        out, took = {}, {}
        for name, fn in (("a", a), ("b", b)) if len(steps) % 2 else (("b", b), ("a", a)):
            start = time.perf_counter()
            out[name] = fn(batch, cache, logits=logits)
            took[name] = time.perf_counter() - start
        assert same(out["a"], out["b"]), "the two variants gave different results"
        steps.append((took["a"], took["b"], len(batch.token_ids) > len(batch.logit_rows)))
        return out["a"]

    fwd = [0.0]

    def counted(batch, cache, logits=True):
        start = time.perf_counter()
        out = a(batch, cache, logits=logits)
        fwd[0] += time.perf_counter() - start
        return out

    try:
        model.forward_greedy = both
        run()
        model.forward_greedy = counted
        r = run()[1]
    finally:
        model.forward_greedy = original
    t = np.array([(x, y) for x, y, _ in steps])
    pre = np.array([p for *_, p in steps])
    dec = t[~pre]
    rest = (r["wall_s"] - fwd[0]) / len(steps)
    prefill = t[pre].mean() * pre.sum() if pre.any() else 0.0
    whole = [dec[:, i].sum() + prefill + rest * len(steps) for i in (0, 1)]
    return {"decode_steps": len(dec), "a_ms": float(dec[:, 0].mean() * 1e3), "b_ms": float(dec[:, 1].mean() * 1e3),
            "ratio": float(dec[:, 0].mean() / dec[:, 1].mean()), "median": float(np.median(dec[:, 0] / dec[:, 1])),
            "prefill_steps": int(pre.sum()), "rest_ms": float(rest * 1e3), "job_ratio": float(whole[0] / whole[1])}


def alternated_forward(model, step: str, a: Forward, b: Forward) -> tuple[float, float]:
    """One forward of SLOTSxTOKENS ("32x1": 32 slots feeding 1 token each, from position 0), each variant in
    turn first, 20 times each (8 for 100 tokens and more): median ms of a and of b."""
    from specgen.engine.types import build_forward_batch

    slots, per = map(int, step.split("x"))
    ids = (np.arange(slots * per, dtype=np.int64) * 7919 + 100) % 40000
    batch = build_forward_batch(np.arange(slots), np.zeros(slots, np.int64), np.full(slots, per, np.int64), ids,
                                np.ones(slots, bool))
    cache = model.new_cache(slots, 64)
    res: dict[int, list[float]] = {0: [], 1: []}
    for i in range(20 if slots * per < 100 else 8):
        for j in (0, 1) if i % 2 else (1, 0):
            start = time.perf_counter()
            (a, b)[j](batch, cache, logits=False)
            res[j].append(time.perf_counter() - start)
    return float(np.median(res[0]) * 1e3), float(np.median(res[1]) * 1e3)


def row(name: str, bs: int, method: str, r: dict) -> str:
    return (f"{name:<15}{bs:>4} {method:<7}{r['decode_steps']:>6}{r['a_ms']:>11.2f}{r['b_ms']:>11.2f}"
            f"{r['ratio']:>7.3f}x{r['median']:>7.3f}x{r['prefill_steps']:>15}{r['rest_ms']:>14.2f}"
            f"{r['job_ratio']:>10.3f}x")


def paired_jobs(lm, sets: dict, jobs: list[str], min_prompts: int, a: Forward, b: Forward,
                same: Callable[[tuple, tuple], bool]) -> None:
    """paired_job for each "SET:BATCH" of `jobs` (its first max(min_prompts, BATCH) prompts of `sets`), greedy,
    128 tokens, `none` and `ngram` k=5; prints a row per job and method."""
    from functools import partial

    from spec_bench import run_method

    from specgen import SamplingParams, SpecConfig

    sp = SamplingParams(max_tokens=128)
    methods = {"none": SpecConfig(), "ngram": SpecConfig(method="ngram", num_speculative_tokens=5)}
    print(HEADER, flush=True)
    for job in jobs:
        name, bs = job.split(":")
        prompts = [list(lm.tokenizer.encode_chat(m)) for m in sets[name][:max(min_prompts, int(bs))]]
        for mname, spec in methods.items():
            r = paired_job(lm.model, partial(run_method, lm, prompts, sp, int(bs), spec), a, b, same)
            print(row(name, int(bs), mname, r), flush=True)
