"""The engine's time per step outside the model's forward, as a real job spends it (fused forward, adaptive
n-gram), split into drafting (propose + observe), the controller (choose + update) and the rest of the step:

    python benchmarks/step_overhead.py [--sets writing code_rewrite] [--per-category 8] [--repeats 2] \
        [--methods none ngram mtp]

Batch 1, greedy, 128 tokens per prompt. Each repeat runs the methods in turn over the set (`ngram` with k = 5,
`mtp` with k = 3 and the shipped head, its pass counted as drafting; each --mtp-model DIR is one more `mtp`
row); the table shows the medians over repeats, in ms per step, and the speedup (tok/s over the first method's
in the same repeat). The time outside the forward runs after the forward has
streamed ~92 MB of weights through the caches, so Python there is several times slower than in a
micro-benchmark; this script measures it where it is spent.
"""
from __future__ import annotations

import argparse
import os
import time
from collections import defaultdict


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sets", nargs="+", default=["writing", "code_rewrite"])
    ap.add_argument("--per-category", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--methods", nargs="+", default=["none", "ngram"], choices=["none", "ngram", "mtp"])
    ap.add_argument("--mtp-model", nargs="+", default=[None], metavar="DIR",
                    help="heads for `mtp` (each a row, mtp:DIR's name) [default: the shipped head]")
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    import numpy as np
    from spec_bench import load_default, load_sets

    from specgen import EngineConfig, SamplingParams, SpecConfig, generate
    from specgen.engine import adaptive, runner
    from specgen.engine.proposers import mtp, ngram

    seconds: dict[str, float] = defaultdict(float)
    calls: dict[str, int] = defaultdict(int)

    def timed(owner, attr: str, label: str) -> None:
        f = getattr(owner, attr)

        def g(*a, **kw):
            start = time.perf_counter()
            try:
                return f(*a, **kw)
            finally:
                seconds[label] += time.perf_counter() - start
                calls[label] += 1
        setattr(owner, attr, g)

    loaded = load_default(args.threads)
    model_cls = type(loaded.model)
    # the forward as the runner calls it (forward_greedy where the forward also returns the greedy tokens)
    timed(model_cls, "forward_greedy" if hasattr(model_cls, "forward_greedy") else "forward", "forward")
    timed(runner.Engine, "step", "step")
    timed(ngram.NgramProposer, "propose", "drafting")
    timed(ngram.NgramProposer, "observe", "drafting")
    timed(mtp.MtpProposer, "propose", "drafting")
    timed(mtp.MtpProposer, "observe", "drafting")
    timed(adaptive.Controller, "choose", "controller")
    timed(adaptive.Controller, "update", "controller")

    sets = load_sets(args.per_category, args.per_category)
    every = {"none": SpecConfig(), "ngram": SpecConfig(method="ngram", num_speculative_tokens=5),
             "mtp": SpecConfig(method="mtp", num_speculative_tokens=3)}
    methods = {m: every[m] for m in args.methods if m != "mtp"}
    if "mtp" in args.methods:
        for d in args.mtp_model:
            methods["mtp" if d is None else f"mtp:{os.path.basename(d.rstrip('/'))}"] = SpecConfig(
                method="mtp", num_speculative_tokens=3, mtp_model=d)
    sp = SamplingParams(max_tokens=args.max_tokens)
    print(f"{'set':<14} {'method':<10} {'tok/s':>7} {'speedup':>8} {'tok/step':>8} {'forward':>8} {'outside':>8} "
          f"{'drafting':>9} {'controller':>10} {'rest':>7}   (ms per step, medians of {args.repeats})")
    for name in args.sets:
        prompts = sets[name]
        rows: dict[str, list[dict[str, float]]] = defaultdict(list)
        for mname, spec in methods.items():  # start-up (calibration) outside the timing
            generate(prompts[:1], model=loaded, sampling=SamplingParams(max_tokens=4),
                     engine=EngineConfig(batch_size=1), speculative=spec)
        for _ in range(args.repeats):
            for mname, spec in methods.items():
                seconds.clear()
                calls.clear()
                start = time.perf_counter()
                outs = generate(prompts, model=loaded, sampling=sp, engine=EngineConfig(batch_size=1),
                                speculative=spec)
                wall = time.perf_counter() - start
                steps = calls["step"]
                outside = (seconds["step"] - seconds["forward"]) / steps
                rows[mname].append({
                    "tok/s": sum(len(o.token_ids) for o in outs) / wall,
                    "tok/step": sum(len(o.token_ids) for o in outs) / steps,
                    "forward": seconds["forward"] / steps, "outside": outside,
                    "drafting": seconds["drafting"] / steps, "controller": seconds["controller"] / steps,
                    "rest": outside - (seconds["drafting"] + seconds["controller"]) / steps})
        first = rows[next(iter(methods))]
        for mname, rs in rows.items():
            med = {k: float(np.median([r[k] for r in rs])) for k in rs[0]}
            ms = {k: v * 1e3 for k, v in med.items()}
            # over the first method's tok/s in the same repeat (median of the repeats)
            ratio = float(np.median([r["tok/s"] / b["tok/s"] for r, b in zip(rs, first)]))
            print(f"{name:<14} {mname:<10} {med['tok/s']:>7.1f} {ratio:>7.2f}x {med['tok/step']:>8.2f} "
                  f"{ms['forward']:>8.2f} {ms['outside']:>8.3f} {ms['drafting']:>9.3f} {ms['controller']:>10.3f} "
                  f"{ms['rest']:>7.3f}", flush=True)


if __name__ == "__main__":
    main()
