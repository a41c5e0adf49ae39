"""A float16 KV cache against the float32 one, side by side in one run, on the default model:

    python benchmarks/kv_cache_dtype.py [--batch-sizes 1 32] [--sets summarization rag writing code_rewrite]
                                        [--per-category 32] [--mbpp 32] [--methods none ngram] [--repeats 2]

The set "mixed" takes Spec-Bench's six categories in turn (--per-category 43 fills 256 slots).

For each batch size, set and method, the two caches run alternately --repeats times each (these machines are
shared and noisy); the table shows median tokens per second, float16 / float32, and whether the float16 run's
outputs equal the float32 run's token for token (they need not: the cache rounds keys and values to halves),
and, for speculative methods, whether they equal float16 plain decoding (they must). Greedy, 128 tokens.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--sets", nargs="+", default=["summarization", "rag", "writing", "code_rewrite"])
    ap.add_argument("--per-category", type=int, default=32)
    ap.add_argument("--mbpp", type=int, default=32)
    ap.add_argument("--methods", nargs="+", default=["none", "ngram"])
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    from spec_bench import CATEGORIES, load_sets

    from specgen import EngineConfig, SamplingParams, SpecConfig, generate, load_model

    lm = load_model(None, threads=args.threads)
    sets = load_sets(args.per_category, args.mbpp)
    # "mixed": every category in turn (enough prompts to fill 256 slots with --per-category 43 or more)
    sets["mixed"] = [p for group in zip(*(sets[c] for c in CATEGORIES)) for p in group]
    sp = SamplingParams(max_tokens=args.max_tokens)
    print(f"{'set':<15}{'bs':>4} {'method':<7}{'f32 tok/s':>11}{'f16 tok/s':>11}{'f16/f32':>9}"
          f"{'same as f32':>13}{'same as f16 none':>18}")
    for bs in args.batch_sizes:
        for name in args.sets:
            prompts = sets[name][: bs if bs > 1 else 8]  # one batch; 8 prompts in turn at batch 1
            plain16 = None
            for method in args.methods:
                spec = SpecConfig(method=method, num_speculative_tokens=5)
                rates: dict[str, list[float]] = {"auto": [], "float16": []}
                outs = {}
                for _ in range(args.repeats):
                    for kv in ("auto", "float16"):
                        start = time.perf_counter()
                        res = generate(prompts, model=lm, sampling=sp, speculative=spec,
                                       engine=EngineConfig(batch_size=bs, kv_cache_dtype=kv))
                        wall = time.perf_counter() - start
                        rates[kv].append(sum(len(o.token_ids) for o in res) / wall)
                        outs[kv] = [o.token_ids for o in res]
                if method == "none":
                    plain16 = outs["float16"]
                f32, f16 = statistics.median(rates["auto"]), statistics.median(rates["float16"])
                same16 = "-" if method == "none" or plain16 is None else str(outs["float16"] == plain16)
                print(f"{name:<15}{bs:>4} {method:<7}{f32:>11.1f}{f16:>11.1f}{f16 / f32:>8.2f}x"
                      f"{str(outs['float16'] == outs['auto']):>13}{same16:>18}", flush=True)


if __name__ == "__main__":
    main()
