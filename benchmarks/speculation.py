"""Speculation against plain decoding, and against what it could reach here: methods x prompt sets x batch
sizes.

    python benchmarks/speculation.py --sets summarization rag code_rewrite --batch-sizes 1 32 \
        --methods none ngram mtp

Greedy, the default model. Every method of a set and batch size runs --repeats times, alternated with the
others (identical runs on these shared machines differ by up to 15%), in one process; tok/s are medians, and
speedup is the median of the per-repeat ratios to `none`. Per row: acceptance (accepted / verified drafts),
tokens per step, whether the outputs were token-identical to `none`, and for n-gram:
- ceiling: n-gram drafting replayed teacher-forced on the plain outputs (tokens per step if verifying were
  free);
- oracle: the speedup if exactly the drafts that will be accepted were verified, at the step costs measured
  here (specgen/app/bounds.py), with the job's prefill share p added back;
- of oracle: speedup / oracle.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import numpy as np
from common import load_sets, machine, print_table, timed


def run(model, prompts, sampling, batch_size, spec):
    """One job: (outputs, wall seconds)."""
    from specgen import EngineConfig, generate

    return timed(lambda: generate(prompts, model=model, sampling=sampling,
                                  engine=EngineConfig(batch_size=batch_size), speculative=spec))


def counts(outs) -> dict:
    tokens = sum(len(o.token_ids) for o in outs)
    drafted = sum(o.stats.num_draft_tokens for o in outs)
    return {"tokens": tokens,
            "acceptance": sum(o.stats.num_accepted_tokens for o in outs) / drafted if drafted else None,
            "tok_per_step": tokens / max(1, sum(o.stats.num_steps for o in outs))}


def oracle(model, prompts, plain_outs, sampling, batch_size, k, plain_wall, spec):
    """(ceiling, oracle job speedup, prefill share) of n-gram drafting with `spec`'s rule on this job: the
    same figures as `specgen bench` (specgen/app/bounds.py), the prefill share from the job run to its first
    token."""
    from specgen import SpecConfig
    from specgen.app import bounds
    from specgen.engine.proposers import build_proposer

    _, pre_wall = run(model, prompts, dataclasses.replace(sampling, max_tokens=1), batch_size, SpecConfig())
    got = bounds.possible(model.model, build_proposer(spec, model.model), prompts,
                          [o.token_ids for o in plain_outs], k, batch_size,
                          bounds.prefill_share(pre_wall, plain_wall))
    return got.ceiling, got.oracle, got.prefill_share


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sets", nargs="+", default=["summarization", "rag", "math_reasoning", "code_rewrite"])
    ap.add_argument("--per-category", type=int, default=4, help="Spec-Bench prompts per category")
    ap.add_argument("--mbpp", type=int, default=4, help="MBPP prompts (code_rewrite)")
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1])
    ap.add_argument("--methods", nargs="+", default=["none", "ngram"], help="none first; ngram, mtp")
    ap.add_argument("--k", type=int, default=5, help="num_speculative_tokens (mtp: at most 2)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--no-oracle", action="store_true", help="skip the ceiling and the oracle bound")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", type=Path, default=None, help="also write every figure here")
    args = ap.parse_args()
    from specgen import SamplingParams, SpecConfig, load_model

    print(machine())
    model = load_model(None, threads=args.threads)
    sets = load_sets(args.per_category, args.mbpp)
    sampling = SamplingParams(max_tokens=args.max_tokens)
    specs = {m: SpecConfig() if m == "none" else SpecConfig(method=m, num_speculative_tokens=min(args.k, 2)
                                                             if m == "mtp" else args.k) for m in args.methods}
    out = []
    for name in args.sets:
        prompts = [list(model.tokenizer.encode_chat(m)) for m in sets[name]]
        for bs in args.batch_sizes:
            # the job's start-up (the cost table at bs slots, the head), not timed
            for spec in specs.values():
                run(model, prompts[:bs], dataclasses.replace(sampling, max_tokens=4), bs, spec)
            runs: dict[str, list] = {m: [] for m in specs}
            for _ in range(args.repeats):
                for m, spec in specs.items():
                    runs[m].append(run(model, prompts, sampling, bs, spec))
            base = runs["none"]
            plain_outs = base[0][0]
            rows = []
            for m, spec in specs.items():
                outs = runs[m][0][0]
                tok_s = [counts(o)["tokens"] / w for o, w in runs[m]]
                ratios = [t / (counts(b[0])["tokens"] / b[1]) for t, b in zip(tok_s, base)]
                c = counts(outs)
                same = all([o.token_ids for o in r[0]] == [o.token_ids for o in plain_outs] for r in runs[m])
                ceiling = bound = share = None
                if spec.method.value == "ngram" and not args.no_oracle:
                    ceiling, bound, share = oracle(model, prompts, plain_outs, sampling, bs,
                                                   spec.num_speculative_tokens,
                                                   float(np.median([w for _, w in base])), spec)
                speedup = float(np.median(ratios))
                row = {"set": name, "batch": bs, "method": m, "tok_s": float(np.median(tok_s)),
                       "speedup": speedup, **c, "identical": same, "ceiling": ceiling, "oracle": bound,
                       "prefill_share": share,
                       "of_oracle": speedup / bound if bound else None, "speedups": ratios}
                out.append(row)
                rows.append([name, bs, m, row["tok_s"], speedup, c["acceptance"], c["tok_per_step"], ceiling,
                             bound, row["of_oracle"], "yes" if same else "NO"])
            print_table(["set", "batch", "method", "tok/s", "speedup", "accept", "tok/step", "ceiling",
                         "oracle", "of oracle", "identical"], rows)
            print(flush=True)
    if args.json:
        args.json.write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
