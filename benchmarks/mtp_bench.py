"""MTP drafting against plain decoding on held-out prompts, measured side by side in one run.

    python benchmarks/mtp_bench.py --batch-sizes 1 32 --per-category 8 --mbpp 16 --max-tokens 128
    python benchmarks/mtp_bench.py --mtp-model runs/mtp --ks 1 2 3 --no-adaptive    # raw per-position acceptance
    python benchmarks/mtp_bench.py --batch-sizes 1 --ks 2 --adaptive both --prefill    # the controller against
                                                                                    # verifying every draft

Prompt sets: the Spec-Bench categories and the MBPP code-rewriting set of benchmarks/spec_bench.py, taken from
the evaluation slice (the first 40 per category, the first 200 MBPP items) that
scripts/make_mtp_train_prompts.py keeps out of the head's training data.

Prints, per set and batch size: tokens/s of none and of mtp at each k, the speedup over none measured in the
same run, the acceptance rate, tokens per step, the acceptance at draft positions 1 and 2 (accepted / drafted
at that position, summed over requests: `RequestStats.accepted_per_position` / `drafted_per_position`), and
whether the outputs were token-identical to none. "bound" is the speedup the forward's measured step costs allow
at the tokens per step reached (benchmarks/spec_bench.py: the drafter's and the host's time not counted); with
--prefill, "dec" is the speedup of the decoding steps alone (the time past each job's prefill). After each set
and batch size, the step-cost table the adaptive controller timed at start-up: c(tokens) / c(one per slot).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from spec_bench import CATEGORIES, alternated, setup, speedup_bound, warm_up

EVAL_PER_CATEGORY, EVAL_MBPP = 40, 200  # the held-out slice (scripts/make_mtp_train_prompts.py)


def per_position(outs, k: int) -> list[float | None]:
    """Acceptance at draft positions 1..k: accepted / drafted there, summed over requests (None if never drafted
    there, or when the engine does not count drafts per position)."""
    acc = np.zeros(k)
    drafted = np.zeros(k)
    for o in outs:
        a = getattr(o.stats, "accepted_per_position", None)
        d = getattr(o.stats, "drafted_per_position", None)
        if a is None or d is None:
            return [None] * k
        acc += np.asarray(a, float)[:k]
        drafted += np.asarray(d, float)[:k]
    return [float(a / d) if d else None for a, d in zip(acc, drafted)]


def fmt(x, spec=".2f") -> str:
    return "-" if x is None else format(x, spec)


def print_costs(model, batch_size: int, ks: list[int]) -> None:
    """The adaptive controller's start-up step-cost tables at this batch size, relative to one token per slot."""
    from specgen.engine.adaptive import CostModel

    for k in ks:
        table = model.model.calibrations.get((batch_size, k))
        if table is not None:
            cost = CostModel(*table)
            ratios = " ".join(f"c({batch_size * (j + 1)}) {cost.at(batch_size * (j + 1)) / cost.at(batch_size):.2f}"
                              for j in range(1, k + 1))
            print(f"{'':<15}{batch_size:>4} step costs (k={k} table, x one token per slot): {ratios}; "
                  f"c({batch_size}) = {cost.at(batch_size) * 1e3:.2f} ms", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--per-category", type=int, default=8, help=f"prompts per category (<= {EVAL_PER_CATEGORY})")
    ap.add_argument("--mbpp", type=int, default=16, help=f"MBPP rewrite prompts (<= {EVAL_MBPP})")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--ks", type=int, nargs="+", default=[1, 2, 3], help="num_speculative_tokens to compare")
    ap.add_argument("--mtp-model", default=None,
                    help="head directory [default: the head shipped for the default model]")
    ap.add_argument("--mtp-copy", type=int, nargs="+", default=None,
                    help="SpecConfig.mtp_copy values to compare (0: the head's drafts only) [default: the default]")
    ap.add_argument("--ngram", action="store_true",
                    help="also run ngram at each k, for comparison (with the controller under --adaptive both)")
    ap.add_argument("--adaptive", choices=["on", "off", "both"], default="on",
                    help="the adaptive controller (on), every draft verified (off: raw acceptance), or each mtp "
                         "setting both ways (its rows labelled 'all' verify every draft)")
    ap.add_argument("--no-adaptive", action="store_true", help="the same as --adaptive off")
    ap.add_argument("--prefill", action="store_true",
                    help="also time each job's prefill (max_tokens 1) and report the decoding steps' own speedup")
    ap.add_argument("--sets", nargs="*", default=None, help=f"subset of {CATEGORIES + ['code_rewrite']}")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=1, help="runs per method, alternated; medians are reported")
    ap.add_argument("--json", default=None, help="also write the results here")
    args = ap.parse_args()
    if args.per_category > EVAL_PER_CATEGORY or args.mbpp > EVAL_MBPP:
        ap.error(f"the held-out slice is {EVAL_PER_CATEGORY} per category and {EVAL_MBPP} MBPP items")
    modes = {"on": [True], "off": [False], "both": [True, False]}["off" if args.no_adaptive else args.adaptive]
    model, sets, sp = setup(args)
    from specgen import SpecConfig

    methods = {"none": SpecConfig()}
    copies = args.mtp_copy or [SpecConfig().mtp_copy]
    for k in args.ks:
        for c in copies:
            for adaptive in modes:
                label = f"mtp k={k}" + (f" c={c}" if len(copies) > 1 else "") + ("" if adaptive or len(modes) == 1
                                                                                else " all")
                methods[label] = SpecConfig(method="mtp", num_speculative_tokens=k, mtp_model=args.mtp_model,
                                            adaptive=adaptive, mtp_copy=c)
        if args.ngram:
            methods[f"ngram k={k}"] = SpecConfig(method="ngram", num_speculative_tokens=k, adaptive=modes[0])
    warm_up(model, list(model.tokenizer.encode_chat(next(iter(sets.values()))[0])), args.batch_sizes, methods)
    results = []
    print(f"{'set':<15}{'bs':>4} {'method':<13}{'tok/s':>8}{'speedup':>9}{'accept':>8}{'tok/step':>9}"
          f"{'acc@1':>7}{'acc@2':>7}{'bound':>7}{'dec':>7} identical", flush=True)
    for name, msgs in sets.items():
        prompts = [list(model.tokenizer.encode_chat(m)) for m in msgs]
        for bs in args.batch_sizes:
            base_outs = base = None
            measured = alternated(model, prompts, sp, bs, methods, args.repeats, prefill=args.prefill)
            for mname, spec in methods.items():
                outs, r = measured[mname]
                if base is None:
                    base_outs, base = outs, r
                same = all(a.token_ids == b.token_ids for a, b in zip(base_outs, outs)) and r["repeats_identical"]
                pos = per_position(outs, max(2, spec.num_speculative_tokens)) if spec.method.value == "mtp" \
                    else [None, None]
                bound = speedup_bound(model, bs, spec.num_speculative_tokens, r) if spec.method.value != "none" \
                    else None
                row = {"set": name, "batch_size": bs, "method": mname, **r, "acceptance_per_position": pos,
                       "bound": bound, "identical": same}
                results.append(row)
                runs = " " + " ".join(f"{x:.2f}" for x in r["speedups"]) if args.repeats > 1 else ""
                dec = fmt(r["decode_speedup"]) if spec.method.value != "none" else "-"
                print(f"{name:<15}{bs:>4} {mname:<13}{r['tok_s']:>8.1f}{row['speedup']:>8.2f}x"
                      f"{fmt(r['acceptance']):>8}{r['mean_accepted_length']:>9.2f}{fmt(pos[0]):>7}{fmt(pos[1]):>7}"
                      f"{fmt(bound):>7}{dec:>7} {same}{runs}", flush=True)
            print_costs(model, bs, args.ks)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    sys.exit(main())
