"""The adaptive controller's MIN_GAIN (speculate only where the cost model predicts at least that much over plain
decoding) against no margin, side by side: per repeat, one `none` run and one n-gram run with each margin (in
one order on even repeats, the other on odd ones).

    python benchmarks/min_gain.py SET BATCH_SIZE PROMPTS REPEATS
    python benchmarks/min_gain.py code_rewrite 32 32 2

Prints each repeat's n-gram / none ratios for MIN_GAIN 0 and 0.05, then their medians.
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("OMP_NUM_THREADS", "2")


def main() -> None:
    import numpy as np
    from spec_bench import load_sets, run_method, warm_up

    from specgen import SamplingParams, SpecConfig, load_model
    from specgen.engine.adaptive import Controller

    name, bs, n, repeats = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    model = load_model(None, threads=2)
    sp = SamplingParams(max_tokens=128)
    prompts = [list(model.tokenizer.encode_chat(m)) for m in load_sets(n, n)[name]]
    ngram = SpecConfig(method="ngram", num_speculative_tokens=5)
    warm_up(model, prompts[0], [bs], {"none": SpecConfig(), "ngram": ngram})
    ratios: dict[float, list[float]] = {0.0: [], 0.05: []}
    default = Controller.MIN_GAIN
    try:
        for rep in range(repeats):
            _, base = run_method(model, prompts, sp, bs, SpecConfig())
            for gain in sorted(ratios, reverse=rep % 2 == 1):  # the two orders in turn
                Controller.MIN_GAIN = gain
                _, r = run_method(model, prompts, sp, bs, ngram)
                ratios[gain].append(r["tok_s"] / base["tok_s"])
            print(name, bs, f"none {base['tok_s']:.1f} tok/s", {g: [round(x, 3) for x in v] for g, v in ratios.items()},
                  flush=True)
    finally:
        Controller.MIN_GAIN = default
    print("medians", name, bs, {g: round(float(np.median(v)), 3) for g, v in ratios.items()})


if __name__ == "__main__":
    main()
