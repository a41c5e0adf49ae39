"""Plain decoding throughput of the default model across batch sizes, on each backend asked for.

    python benchmarks/plain.py --batch-sizes 1 32 256 --max-tokens 128 --backends fused reference

Prompts are Spec-Bench questions (the chat template applied, cut to 400 characters); every request generates
exactly --max-tokens tokens (ignore_eos), so every run does the same work. Per batch size and backend: the
median tok/s of --repeats runs (the backends alternated within each repeat) and the ratio to the first
backend. The first run of each (batch size, backend) is a warm-up and is not counted.
"""
from __future__ import annotations

import argparse
import json

import numpy as np
from common import DATA, machine, print_table, timed


def prompts(n: int) -> list[list[dict]]:
    lines = [json.loads(x) for x in (DATA / "spec_bench" / "question.jsonl").read_text().splitlines()
             if x.strip()]
    picked = [lines[(i * 37) % len(lines)] for i in range(n)]
    return [[{"role": "user", "content": q["turns"][0][:400]}] for q in picked]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 32, 256])
    ap.add_argument("--prompts", type=int, default=0,
                    help="requests per job [default: 2 at batch 1, else the batch]")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--backends", nargs="+", default=["fused"], help="fused, reference")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    from specgen import EngineConfig, SamplingParams, generate, load_model

    print(machine())
    models = {b: load_model(None, threads=args.threads, backend=b) for b in args.backends}
    sp = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    rows = []
    for bs in args.batch_sizes:
        n = args.prompts or (2 if bs == 1 else bs)
        ids = [list(models[args.backends[0]].tokenizer.encode_chat(m)) for m in prompts(n)]
        tok_s: dict[str, list[float]] = {b: [] for b in args.backends}
        for rep in range(args.repeats + 1):
            for b, lm in models.items():
                engine = EngineConfig(batch_size=bs, max_prefill_tokens=8192, backend=b)
                outs, wall = timed(lambda: generate(ids, model=lm, sampling=sp, engine=engine))
                if rep:
                    tok_s[b].append(sum(len(o.token_ids) for o in outs) / wall)
        first = tok_s[args.backends[0]]
        for b in args.backends:
            ratio = float(np.median([x / y for x, y in zip(tok_s[b], first)]))
            rows.append([bs, n, b, float(np.median(tok_s[b])), ratio])
        print_table(["batch", "requests", "backend", "tok/s", "vs first"], rows, digits=2)
        print(flush=True)


if __name__ == "__main__":
    main()
