"""Speculative vs plain decoding on Spec-Bench categories and an MBPP code-rewriting set, measured side by side.

    python benchmarks/spec_bench.py --batch-sizes 1 32 --per-category 4 --max-tokens 128

Prints, per prompt set and batch size: tokens/s of each method, speedup over `none` measured in the same run,
acceptance rate, mean accepted length, whether outputs were token-identical to `none`, and the n-gram ceiling
(n-gram drafting replayed teacher-forced on the plain outputs: tokens per step if verification were free; with
the job's pool of finished requests for rows that use it, the requests replayed in order),
the bound (tokens per step x c(1) / c(k + 1) from the step costs measured at start-up) and the efficiency
(speedup / bound: how much of what the forward's cost allows the whole step loop achieves). With --repeats N
every method runs N times, alternated with the others; tok/s and speedups are medians (the per-run speedups
follow each row). With --prefill each repeat also times the job's prefill alone (max_tokens = 1): "dec" is the
speedup of the time past it (the decoding steps, which the bound is about), "dec-eff" that over the bound.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT.parent / "shared" / "data"
CATEGORIES = ["summarization", "rag", "translation", "math_reasoning", "qa", "writing"]


def load_sets(per_category: int, mbpp_count: int) -> dict[str, list[list[dict]]]:
    sets: dict[str, list[list[dict]]] = {}
    lines = [json.loads(x) for x in (DATA / "spec_bench" / "question.jsonl").read_text().splitlines() if x.strip()]
    for cat in CATEGORIES:
        items = [q for q in lines if q["category"] == cat][:per_category]
        sets[cat] = [[{"role": "user", "content": q["turns"][0]}] for q in items]
    mbpp = json.loads((DATA / "mbpp" / "sanitized-mbpp.json").read_text())[:mbpp_count]
    sets["code_rewrite"] = [[{"role": "user", "content": "Rewrite this function with type hints and a docstring:\n\n"
                              f"```python\n{m['code']}\n```"}] for m in mbpp]
    return sets


def replay_ceiling(prompts: list[list[int]], outputs: list[list[int]], k: int, n_min: int, n_max: int,
                   pool: int = 0) -> float:
    """Tokens per step if every n-gram draft were verified for free, teacher-forced on the plain outputs. With
    pool > 0 the job's pool holds the requests replayed before (in order), as if they had finished earlier."""
    emitted = replay_steps(prompts, outputs, k, n_min, n_max, pool)
    return sum(emitted) / max(len(emitted), 1)


def replay_steps(prompts: list[list[int]], outputs: list[list[int]], k: int, n_min: int, n_max: int,
                 pool: int = 0) -> list[int]:
    """replay_ceiling's steps, request after request: the tokens each step emits (1 + the drafts that match),
    each request's prefill step (its first token) included."""
    from specgen.engine.proposers.base import SlotView
    from specgen.engine.proposers.ngram import NgramProposer
    from specgen.engine.types import StepUpdate

    proposer = NgramProposer(k, n_min, n_max, pool)
    steps: list[int] = []
    for p, out in zip(prompts, outputs):
        seq = np.array([p + out], np.int64)
        pos = len(p)
        steps.append(1)  # the first output token comes from the prefill step
        pos += 1
        while pos < seq.shape[1]:
            d = proposer.propose(SlotView(np.zeros(1, np.int64), seq, np.array([pos]), np.array([k])))
            drafts = d.draft_ids[0, : d.num_draft[0]].tolist()
            acc = 0
            while acc < len(drafts) and pos + acc < seq.shape[1] and drafts[acc] == seq[0, pos + acc]:
                acc += 1
            emitted = min(acc + 1, seq.shape[1] - pos)
            steps.append(emitted)
            pos += emitted
            one = np.zeros(1, np.int64)  # the step's outcome, as the engine reports it to the proposer
            proposer.observe(StepUpdate(one, one, np.array([pos - emitted - 1]), np.array([emitted]),
                                        np.array([pos == seq.shape[1]]), seq, None, seq_lens=np.array([pos])))
    return steps


def run_method(model, prompts, sp, batch_size, spec):
    from specgen import EngineConfig, generate

    start = time.perf_counter()
    outs = generate(prompts, model=model, sampling=sp, engine=EngineConfig(batch_size=batch_size), speculative=spec)
    wall = time.perf_counter() - start
    n_out = sum(len(o.token_ids) for o in outs)
    drafted = sum(o.stats.num_draft_tokens for o in outs)
    accepted = sum(o.stats.num_accepted_tokens for o in outs)
    steps = sum(o.stats.num_steps for o in outs)
    return outs, {"wall_s": wall, "tokens": n_out, "tok_s": n_out / wall, "steps": steps, "drafted": drafted,
                  "acceptance": accepted / drafted if drafted else None, "mean_accepted_length": n_out / steps}


def alternated(model, prompts, sp, batch_size: int, methods: dict, repeats: int,
               prefill: bool = False) -> dict:
    """Every method run `repeats` times, alternated (none, ngram, none, ngram, ...: on a shared machine two runs
    of one command can differ by 20%). Per method: the outputs and counts of its first run, with tok_s the median
    over its runs, speedups the per-repeat ratios of its tok/s to the first method's in the same repeat, and
    speedup their median; repeats_identical tells whether every run gave the same tokens.

    With `prefill`, each repeat also runs the job with max_tokens = 1 (its prefills and first tokens, which
    speculation cannot shorten), and decode_speedup is the median per-repeat ratio of the first method's wall
    time past that to this method's: the speedup of the decoding steps alone, which the bound describes."""
    from dataclasses import replace

    runs: dict[str, list] = {name: [] for name in methods}
    pre: list[float] = []
    for _ in range(repeats):
        if prefill:
            pre.append(run_method(model, prompts, replace(sp, max_tokens=1), batch_size,
                                  next(iter(methods.values())))[1]["wall_s"])
        for name, spec in methods.items():
            runs[name].append(run_method(model, prompts, sp, batch_size, spec))
    first = runs[next(iter(methods))]
    out = {}
    for name, rs in runs.items():
        outs, r = rs[0]
        ratios = [x[1]["tok_s"] / b[1]["tok_s"] for x, b in zip(rs, first)]
        same = all(o.token_ids == p.token_ids for x in rs[1:] for o, p in zip(x[0], outs))
        dec = [(b[1]["wall_s"] - p) / (x[1]["wall_s"] - p) * x[1]["tokens"] / b[1]["tokens"]
               for x, b, p in zip(rs, first, pre)]
        out[name] = (outs, {**r, "tok_s": float(np.median([x[1]["tok_s"] for x in rs])), "speedups": ratios,
                            "speedup": float(np.median(ratios)), "repeats_identical": same,
                            "prefill_s": float(np.median(pre)) if pre else None,
                            "decode_speedup": float(np.median(dec)) if dec else None})
    return out


def warm_up(model, prompt: list[int], batch_sizes: list[int], methods: dict) -> None:
    """One short run per batch size and method before timing: the one-time start-up of a job (the adaptive
    controller's cost calibration, loading an MTP head) is paid here, once, as a real job pays it once, and
    printed instead of being spread over a few timed prompts."""
    from specgen import EngineConfig, SamplingParams, generate

    for bs in batch_sizes:
        for mname, spec in methods.items():
            start = time.perf_counter()
            generate([prompt], model=model, sampling=SamplingParams(max_tokens=4),
                     engine=EngineConfig(batch_size=bs), speculative=spec)
            print(f"start-up (one short run) bs {bs} {mname}: {time.perf_counter() - start:.2f} s", flush=True)


def speedup_bound(model, batch_size: int, k: int, r: dict) -> float | None:
    """(tokens emitted per step) x c(1 token per slot) / c(tokens fed per slot), with c the step costs measured at
    start-up on this machine and batch size (the adaptive controller's table): the speedup if nothing but the
    forward's cost counted."""
    from specgen.engine.adaptive import CostModel

    table = model.model.calibrations.get((batch_size, k))
    if table is None or not r["steps"]:
        return None
    cost = CostModel(*table)
    fed = 1 + r["drafted"] / r["steps"]  # tokens each slot feeds per step, on average
    return r["mean_accepted_length"] * float(cost(batch_size) / cost(batch_size * fed))


def load_default(threads: int, **env: str):
    """The default model, built with these environment settings (e.g. SPECGEN_PACKED_LINEAR="0"), which are
    read when a model is made and restored afterwards."""
    from specgen import load_model

    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        return load_model(None, threads=threads)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k)
            else:
                os.environ[k] = v


def setup(args):
    """The default model, the prompt sets picked by --per-category / --mbpp / --sets, and greedy sampling with
    --max-tokens (shared with benchmarks/mtp_bench.py)."""
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    from specgen import SamplingParams, load_model

    model = load_model(None, threads=args.threads)
    sets = load_sets(args.per_category, args.mbpp)
    if args.sets:
        sets = {k: v for k, v in sets.items() if k in args.sets}
    return model, sets, SamplingParams(max_tokens=args.max_tokens)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--per-category", type=int, default=4)
    ap.add_argument("--mbpp", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--k", type=int, default=5)
    ap.add_argument("--mtp-model", default=None, help="MTP head directory; mtp is skipped without one")
    ap.add_argument("--sets", nargs="*", default=None)
    ap.add_argument("--fixed", action="store_true", help="also run ngram with adaptive speculation off (k drafts "
                    "whenever a match offers them): row 'fixed'")
    ap.add_argument("--own-only", action="store_true", help="also run ngram without the job's pool (lookup in each "
                    "request's own text only): row 'own'")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=1, help="runs per method, alternated; medians are reported")
    ap.add_argument("--prefill", action="store_true",
                    help="also time each job's prefill (max_tokens = 1) in every repeat and report the decoding "
                    "steps' own speedup and efficiency (columns dec, dec-eff)")
    ap.add_argument("--json", default=None, help="also write the results here")
    args = ap.parse_args()
    model, sets, sp = setup(args)
    from specgen import SpecConfig

    methods = {"none": SpecConfig(), "ngram": SpecConfig(method="ngram", num_speculative_tokens=args.k)}
    if args.fixed:
        methods["fixed"] = SpecConfig(method="ngram", num_speculative_tokens=args.k, adaptive=False)
    if args.own_only:
        methods["own"] = SpecConfig(method="ngram", num_speculative_tokens=args.k, ngram_pool=0)
    if args.mtp_model:
        methods["mtp"] = SpecConfig(method="mtp", num_speculative_tokens=min(args.k, 2), mtp_model=args.mtp_model)
    first = next(iter(sets.values()))[0]
    warm_up(model, list(model.tokenizer.encode_chat(first)), args.batch_sizes, methods)
    results = []
    print(f"{'set':<15}{'bs':>4} {'method':<6}{'tok/s':>8}{'speedup':>9}{'accept':>8}{'tok/step':>9}"
          f"{'ceiling':>9}{'of ceil':>8}{'bound':>7}{'eff':>6}"
          + (f"{'dec':>7}{'dec-eff':>8}" if args.prefill else "")
          + " identical"
          + (" per-run" if args.repeats > 1 else ""))
    for name, msgs in sets.items():
        prompts = [list(model.tokenizer.encode_chat(m)) for m in msgs]
        for bs in args.batch_sizes:
            base_outs = None
            measured = alternated(model, prompts, sp, bs, methods, args.repeats, args.prefill)
            for mname, spec in methods.items():
                outs, r = measured[mname]
                if mname == "none":
                    base_outs = outs
                    plain_outs = [o.token_ids for o in outs]
                    ceilings = {pool: replay_ceiling(prompts, plain_outs, args.k, 1, 3, pool)
                                for pool in {0, SpecConfig().ngram_pool}}
                ceiling = ceilings[spec.ngram_pool]  # the replay of the lookup this method uses
                same = all(a.token_ids == b.token_ids for a, b in zip(base_outs, outs)) and r["repeats_identical"]
                speedup = r["speedup"]
                of_ceiling = (speedup - 1) / (ceiling - 1) if spec.method.value == "ngram" and ceiling > 1 else None
                bound = speedup_bound(model, bs, spec.num_speculative_tokens, r) if mname != "none" else None
                row = {"set": name, "batch_size": bs, "method": mname, **r, "speedup": speedup,
                       "ngram_ceiling": ceiling, "bound": bound, "efficiency": speedup / bound if bound else None,
                       "identical": same}
                results.append(row)
                acc = f"{r['acceptance']:.2f}" if r["acceptance"] is not None else "-"
                oc = f"{of_ceiling:.2f}" if of_ceiling is not None else "-"
                bd = f"{bound:.2f}" if bound else "-"
                ef = f"{speedup / bound:.2f}" if bound else "-"
                runs = " " + " ".join(f"{x:.2f}" for x in r["speedups"]) if args.repeats > 1 else ""
                dec = ""
                if args.prefill:
                    ds = r["decode_speedup"]
                    dec = f"{ds:>6.2f}x" + (f"{ds / bound:>8.2f}" if bound else f"{'-':>8}")
                    row["decode_efficiency"] = ds / bound if bound else None
                print(f"{name:<15}{bs:>4} {mname:<6}{r['tok_s']:>8.1f}{speedup:>8.2f}x{acc:>8}"
                      f"{r['mean_accepted_length']:>9.2f}{ceiling:>9.2f}{oc:>8}{bd:>7}{ef:>6}{dec}"
                      f" {same}{runs}",
                      flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    sys.exit(main())
