"""What a dataset job's sampling features cost (issue 58): log-probabilities and penalties against plain
decoding, and whether speculation keeps its gain under them.

    python benchmarks/dataset_sampling.py --batch-sizes 1 32 --max-tokens 64 --repeats 2

1. Plain decoding on the default model (fused backend), Spec-Bench prompts, exactly --max-tokens tokens each
   (ignore_eos): greedy; greedy with logprobs and 5 top_logprobs; greedy with repetition_penalty 1.1, presence
   0.3, frequency 0.3; each as tok/s and as a ratio to greedy, arms alternated within each repeat (medians of
   the repeats' ratios; the first repeat a warm-up).
2. MBPP code rewrites at batch 1: ngram (k 5) over plain decoding, without and with the penalties (the same
   penalties in both arms of each ratio), so the two speedups compare.
"""
from __future__ import annotations

import argparse

import numpy as np
from common import load_sets, machine, print_table, timed
from plain import prompts

PENALTIES = dict(repetition_penalty=1.1, presence_penalty=0.3, frequency_penalty=0.3)


def alternated(lm, ids, arms: dict, repeats: int) -> dict[str, list[float]]:
    """tok/s of each arm (name -> (SamplingParams, EngineConfig, SpecConfig)) per repeat, alternated."""
    from specgen import generate

    tok_s: dict[str, list[float]] = {a: [] for a in arms}
    for rep in range(repeats + 1):
        for name, (sp, engine, spec) in arms.items():
            outs, wall = timed(lambda: generate(ids, model=lm, sampling=sp, engine=engine,
                                                speculative=spec))
            if rep:
                tok_s[name].append(sum(len(o.token_ids) for o in outs) / wall)
    return tok_s


def ratio(tok_s: dict[str, list[float]], a: str, b: str) -> float:
    return float(np.median([x / y for x, y in zip(tok_s[a], tok_s[b])]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--mbpp", type=int, default=4)
    args = ap.parse_args()
    from specgen import EngineConfig, SamplingParams, SpecConfig, load_model

    print(machine())
    lm = load_model(None, backend="fused")
    base = dict(max_tokens=args.max_tokens, ignore_eos=True)
    plain, ngram = SpecConfig(), SpecConfig(method="ngram", num_speculative_tokens=5)
    rows = []
    for bs in args.batch_sizes:
        n = 4 if bs == 1 else bs
        ids = [list(lm.tokenizer.encode_chat(m)) for m in prompts(n)]
        engine = EngineConfig(batch_size=bs, max_prefill_tokens=8192)
        arms = {"greedy": (SamplingParams(**base), engine, plain),
                "logprobs": (SamplingParams(**base, logprobs=True, top_logprobs=5), engine, plain),
                "penalties": (SamplingParams(**base, **PENALTIES), engine, plain)}
        tok_s = alternated(lm, ids, arms, args.repeats)
        rows.append([bs, n, float(np.median(tok_s["greedy"])), ratio(tok_s, "logprobs", "greedy"),
                     ratio(tok_s, "penalties", "greedy")])
    print_table(["batch", "requests", "greedy tok/s", "logprobs / greedy", "penalties / greedy"], rows, 3)
    print(flush=True)
    code = [list(lm.tokenizer.encode_chat(m)) for m in load_sets(0, args.mbpp)["code_rewrite"]]
    engine = EngineConfig(batch_size=1)
    sp = SamplingParams(max_tokens=args.max_tokens)
    pen = SamplingParams(max_tokens=args.max_tokens, **PENALTIES)
    tok_s = alternated(lm, code, {"plain": (sp, engine, plain), "ngram": (sp, engine, ngram),
                                  "plain+pen": (pen, engine, plain), "ngram+pen": (pen, engine, ngram)},
                       args.repeats)
    print_table(["code rewrite, batch 1", "plain tok/s", "ngram / plain"],
                [["no penalties", float(np.median(tok_s["plain"])), ratio(tok_s, "ngram", "plain")],
                 ["penalties", float(np.median(tok_s["plain+pen"])),
                  ratio(tok_s, "ngram+pen", "plain+pen")]], 3)


if __name__ == "__main__":
    main()
