"""The MTP head's prompt window (`mtp.prompt_window`: 256 for the shipped head) set in turn, against plain
decoding, in one run:

    python benchmarks/mtp_window.py --sets rag summarization --batch-size 32 --per-category 32 --max-tokens 96
    python benchmarks/mtp_window.py --sets rag summarization --batch-size 1 --per-category 6 --max-tokens 128

Each repeat runs `none`, then `mtp` (k = 3, the shipped head) with each --windows value (0: the whole prompt),
alternated. Prints per set and window: the median speedup over `none` of the same repeat (the runs in brackets),
tokens per step, the head's seconds per job (`MtpProposer.observe`: its catch-up and chained drafts) and the
rows its fused operator processed per job (catch-up tokens and chained drafts), and whether every run's outputs
equal `none`'s.
"""
from __future__ import annotations

import argparse
import os
import time

import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sets", nargs="+", default=["rag", "summarization"])
    ap.add_argument("--windows", type=int, nargs="+", default=[0, 256])
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--per-category", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    from spec_bench import load_sets, run_method

    from specgen import SamplingParams, SpecConfig, load_model
    from specgen.engine.proposers import mtp as mtp_module
    from specgen.engine.proposers.mtp import MtpProposer

    model = load_model(None, threads=args.threads)
    head = {"seconds": 0.0, "rows": 0}
    observe, op = MtpProposer.observe, model.model.ops.specgen_mtp_draft if model.model.ops else None

    def timed_observe(self, update):
        start = time.perf_counter()
        observe(self, update)
        head["seconds"] += time.perf_counter() - start

    def counted_op(*a):
        head["rows"] += int(a[0].shape[0])  # its first argument: the catch-up tokens' ids
        return op(*a)

    MtpProposer.observe = timed_observe
    if op is not None:
        model.model.ops.specgen_mtp_draft = counted_op
    sets = load_sets(args.per_category, args.per_category)
    mtp = SpecConfig(method="mtp", num_speculative_tokens=3)
    sp = SamplingParams(max_tokens=args.max_tokens)
    names = ["none"] + [f"window {w}" for w in args.windows]
    for name in args.sets:
        prompts = sets[name]
        for spec in (SpecConfig(), mtp):  # start-up (calibration, loading the head) outside the timing
            run_method(model, prompts[:1], SamplingParams(max_tokens=4), args.batch_size, spec)
        runs: dict[str, list] = {n: [] for n in names}
        for _ in range(args.repeats):
            for n in names:
                if n != "none":
                    window = int(n.split()[1])
                    mtp_module.prompt_window = lambda directory, w=window: w  # what build_mtp_proposer asks
                head["seconds"], head["rows"] = 0.0, 0
                outs, r = run_method(model, prompts, sp, args.batch_size, SpecConfig() if n == "none" else mtp)
                runs[n].append((r, head["seconds"], head["rows"], [o.token_ids for o in outs]))
        plain = runs["none"]
        for n, rs in runs.items():
            ratios = [b[0]["wall_s"] / x[0]["wall_s"] * x[0]["tokens"] / b[0]["tokens"] for x, b in zip(rs, plain)]
            same = all(x[3] == plain[0][3] for x in rs)
            per_step = np.median([x[0]["mean_accepted_length"] for x in rs])
            print(f"{name:<14} bs {args.batch_size:<3} {n:<11} {np.median(ratios):.2f}x "
                  f"({', '.join(f'{v:.2f}' for v in ratios)})  tok/step {per_step:.3f}"
                  f"  head s/job {np.median([x[1] for x in rs]):.3f}  head rows/job {rs[0][2]}  identical {same}",
                  flush=True)


if __name__ == "__main__":
    main()
