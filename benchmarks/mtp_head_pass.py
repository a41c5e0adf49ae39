"""The MTP head's pass per step, three ways, against plain decoding, interleaved and repeated in one run:

    python benchmarks/mtp_head_pass.py [--sets code_rewrite math_reasoning] [--prompts 16] [--repeats 3] [--k 1]
        [--variants "fused int8" "fused q8_0"]

- `fused int8`: the default on a CPU with AVX-512 VNNI: one specgen_mtp_draft op per step, the head's
  projections as Q8_0 blocks with integer products (the inputs quantized to int8 per block);
- `fused q8_0`: the same blocks with float32 products (SPECGEN_INT8_HEAD=0; the default without VNNI);
- `fused f32`:  the same op over float32 projections (SPECGEN_QUANTIZED_HEAD=0);
- `op-by-op f32`: the head's Paddle ops one by one over float32 projections (SPECGEN_FUSED_MTP=0 and
  SPECGEN_QUANTIZED_HEAD=0; the path before the fused op).

Batch 1, greedy, k drafts verified every step (adaptive speculation off, so every variant verifies the same
drafts, except where Q8_0 or int8 products change a draft), the head shipped for the default model. Each repeat runs none and the
variants back to back; the table gives the median over repeats of tok/s, of the ratio to the none run of the
same repeat, and of the head's time per step (MtpProposer.observe, timed).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

ALL_VARIANTS = {"fused int8": {}, "fused q8_0": {"SPECGEN_INT8_HEAD": "0"},
                "fused f32": {"SPECGEN_QUANTIZED_HEAD": "0"},
                "op-by-op f32": {"SPECGEN_QUANTIZED_HEAD": "0", "SPECGEN_FUSED_MTP": "0"}}
SWITCHES = ("SPECGEN_QUANTIZED_HEAD", "SPECGEN_FUSED_MTP", "SPECGEN_INT8_HEAD")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sets", nargs="+", default=["code_rewrite", "math_reasoning"])
    ap.add_argument("--prompts", type=int, default=16, help="prompts per set (held-out slice)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--k", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--variants", nargs="+", default=list(ALL_VARIANTS), choices=list(ALL_VARIANTS))
    args = ap.parse_args()
    VARIANTS = {v: ALL_VARIANTS[v] for v in args.variants}
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    from mtp_bench import EVAL_PER_CATEGORY, setup
    from spec_bench import run_method, warm_up

    from specgen import SpecConfig
    from specgen.engine.proposers import mtp

    ns = argparse.Namespace(batch_sizes=[1], per_category=min(args.prompts, EVAL_PER_CATEGORY), mbpp=args.prompts,
                            max_tokens=args.max_tokens, ks=[args.k], mtp_model=None, no_adaptive=True,
                            sets=args.sets, threads=args.threads, json=None)
    model, sets, sp = setup(ns)
    spec = SpecConfig(method="mtp", num_speculative_tokens=args.k, adaptive=False)
    observe_seconds = [0.0, 0]
    original = mtp.MtpProposer.observe

    def timed(self, update):
        start = time.perf_counter()
        original(self, update)
        observe_seconds[0] += time.perf_counter() - start
        observe_seconds[1] += 1

    mtp.MtpProposer.observe = timed
    heads = {}  # variant -> the model's head cache built under that variant's switches

    def use(variant: str) -> None:
        for name in SWITCHES:
            os.environ.pop(name, None)
        os.environ.update(VARIANTS[variant])
        model.model.heads = heads.setdefault(variant, {})

    first = list(model.tokenizer.encode_chat(next(iter(sets.values()))[0]))
    for variant in VARIANTS:  # builds each variant's head and the cost calibration outside the timed runs
        use(variant)
        warm_up(model, first, [1], {variant: spec})
    warm_up(model, first, [1], {"none": SpecConfig()})
    print(f"{'set':<15}{'variant':<14}{'tok/s':>8}{'vs none':>9}{'head ms/step':>14}{'tok/step':>10}{'acceptance':>12}", flush=True)
    for name, msgs in sets.items():
        prompts = [list(model.tokenizer.encode_chat(m)) for m in msgs]
        rows = {v: {"tok_s": [], "ratio": [], "head": [], "tps": [], "acc": []} for v in ["none", *VARIANTS]}
        for _ in range(args.repeats):
            base = run_method(model, prompts, sp, 1, SpecConfig())[1]
            rows["none"]["tok_s"].append(base["tok_s"])
            for variant in VARIANTS:
                use(variant)
                observe_seconds[:] = [0.0, 0]
                r = run_method(model, prompts, sp, 1, spec)[1]
                row = rows[variant]
                row["tok_s"].append(r["tok_s"])
                row["ratio"].append(r["tok_s"] / base["tok_s"])
                row["head"].append(1000 * observe_seconds[0] / max(observe_seconds[1], 1))
                row["tps"].append(r["mean_accepted_length"])
                row["acc"].append(r["acceptance"] or 0.0)
        for variant, row in rows.items():
            med = {key: statistics.median(v) for key, v in row.items() if v}
            print(f"{name:<15}{variant:<14}{med['tok_s']:>8.1f}{med.get('ratio', 1.0):>8.2f}x"
                  f"{med.get('head', 0.0):>14.2f}{med.get('tps', 1.0):>10.2f}{med.get('acc', 0.0):>12.3f}", flush=True)


if __name__ == "__main__":
    main()
