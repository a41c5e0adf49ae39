"""Integer products (`--matmul int8`) against float32 products, side by side in one run, on the default model:

    python benchmarks/int8_matmul.py [--batch-sizes 1 32] [--sets summarization rag writing code_rewrite]
                                     [--per-category 8] [--mbpp 8] [--methods none ngram] [--repeats 2]

Speed: for each batch size, set and method, the two models run alternately --repeats times each (these machines
are shared and noisy); the table shows median tokens per second, int8 / float32, each method's speedup over
plain decoding of the same model, and whether speculative outputs equal plain decoding's (they must, in both).

Fidelity (--agreement N, per set): the float32 model's greedy outputs for N prompts, fed back teacher-forced
to both models in one forward; the share of positions where the int8 model's top token equals the float32 one's
(the float32 model's own share is 1 by construction), and the share of whole outputs the int8 model reproduces.
Greedy, 128 tokens.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time


def agreement(lm32, lm8, prompts, sp) -> tuple[float, float, int]:
    """(teacher-forced top-1 agreement of lm8 with lm32 on lm32's greedy outputs, share of identical outputs,
    positions compared)."""
    import numpy as np

    from specgen import EngineConfig, generate
    from specgen.api import encode_prompt
    from specgen.engine.types import build_forward_batch

    outs32 = generate(prompts, model=lm32, sampling=sp, engine=EngineConfig(batch_size=len(prompts)))
    outs8 = generate(prompts, model=lm8, sampling=sp, engine=EngineConfig(batch_size=len(prompts), matmul="int8"))
    same, total = 0, 0
    for prompt, o in zip(prompts, outs32):
        prompt_ids = encode_prompt(lm32, prompt)
        ids = np.array(list(prompt_ids) + list(o.token_ids), np.int64)
        n_prompt = len(prompt_ids)
        picks = []
        for lm in (lm32, lm8):
            m = lm.model
            cache = m.new_cache(1, len(ids) + 1)
            batch = build_forward_batch(np.zeros(1, np.int64), np.zeros(1, np.int64), np.array([len(ids)]), ids,
                                        np.array([True]))
            _, _, greedy = m.forward_greedy(batch, cache)
            picks.append(greedy[n_prompt - 1:-1])  # the prediction of every output token
        assert np.array_equal(picks[0], ids[n_prompt:]), "float32 teacher forcing must reproduce its own output"
        same += int((picks[1] == picks[0]).sum())
        total += len(picks[0])
    identical = sum(a.token_ids == b.token_ids for a, b in zip(outs32, outs8)) / len(outs32)
    return same / total, identical, total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch-sizes", type=int, nargs="*", default=[1, 32])
    ap.add_argument("--sets", nargs="+", default=["summarization", "rag", "writing", "code_rewrite"])
    ap.add_argument("--per-category", type=int, default=32)
    ap.add_argument("--mbpp", type=int, default=32)
    ap.add_argument("--methods", nargs="+", default=["none", "ngram"])
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--agreement", type=int, default=0, help="prompts per set for the fidelity table (0: none)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    from spec_bench import CATEGORIES, load_sets

    from specgen import EngineConfig, SamplingParams, SpecConfig, generate, load_model

    models = {"float32": load_model(None, threads=args.threads),
              "int8": load_model(None, threads=args.threads, matmul="int8")}
    sets = load_sets(args.per_category, args.mbpp)
    sets["mixed"] = [p for group in zip(*(sets[c] for c in CATEGORIES)) for p in group]
    sp = SamplingParams(max_tokens=args.max_tokens)
    if args.agreement:
        print(f"{'set':<15}{'top-1 agreement':>17}{'identical outputs':>19}{'positions':>11}")
        for name in args.sets:
            agree, identical, total = agreement(models["float32"], models["int8"], sets[name][:args.agreement], sp)
            print(f"{name:<15}{agree:>17.4f}{identical:>19.2f}{total:>11}", flush=True)
    print(f"{'set':<15}{'bs':>4} {'method':<7}{'f32 tok/s':>11}{'int8 tok/s':>12}{'int8/f32':>10}"
          f"{'f32 vs none':>13}{'int8 vs none':>14}{'same as none':>14}")
    for bs in args.batch_sizes:
        for name in args.sets:
            prompts = sets[name][: bs if bs > 1 else 8]  # one batch; 8 prompts in turn at batch 1
            plain: dict[str, float] = {}
            plain_out: dict[str, list] = {}
            for method in args.methods:
                spec = SpecConfig(method=method, num_speculative_tokens=5)
                rates: dict[str, list[float]] = {"float32": [], "int8": []}
                outs = {}
                for _ in range(args.repeats):
                    for mm, lm in models.items():
                        start = time.perf_counter()
                        res = generate(prompts, model=lm, sampling=sp, speculative=spec,
                                       engine=EngineConfig(batch_size=bs, matmul=mm))
                        wall = time.perf_counter() - start
                        rates[mm].append(sum(len(o.token_ids) for o in res) / wall)
                        outs[mm] = [o.token_ids for o in res]
                med = {mm: statistics.median(r) for mm, r in rates.items()}
                if method == "none":
                    plain, plain_out = med, outs
                vs = {mm: f"{med[mm] / plain[mm]:.2f}x" if plain else "-" for mm in med}
                same = "-" if method == "none" or not plain_out else \
                    str(all(outs[mm] == plain_out[mm] for mm in outs))
                print(f"{name:<15}{bs:>4} {method:<7}{med['float32']:>11.1f}{med['int8']:>12.1f}"
                      f"{med['int8'] / med['float32']:>9.2f}x{vs['float32']:>13}{vs['int8']:>14}{same:>14}",
                      flush=True)


if __name__ == "__main__":
    main()
