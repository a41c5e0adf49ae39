"""Steps the machine stalled in, counted whole or capped at CostModel.OUTLIER x their prediction, side by side.

    python benchmarks/stall_ab.py --sets code_rewrite summarization --repeats 5 [--batch-size 1] [--methods ngram mtp]

On a shared virtual machine a step now and then takes ~100 ms more: the hypervisor runs another guest (the
`steal` column of /proc/stat grows by 10-20 ticks in exactly those steps). The adaptive controller's cost model,
its guard and its estimate of the drafter's time used to take such a step whole; now each counts it at most
CostModel.OUTLIER (Controller.DRAFT_OUTLIER for the drafter) x its prediction. This script runs `none`, then each
method with the caps off ("whole", both set to infinity) and on ("capped"), alternated, --repeats times, and
prints per set and method: the median wall time, the median speedup over `none` of the same repeat (and its
range), tokens per step (mean and standard deviation over repeats), the guard's vetoes (median; PROBE_EVERY's
scheduled plain steps count among them) and the steal ticks of /proc/stat during the runs (median). Outputs
must be identical to `none` in every run (checked).

    python benchmarks/stall_ab.py --steal-trace --sets code_rewrite --methods mtp

instead runs the first method once per set and prints its decode steps slower than 3x their median, with the
steal ticks /proc/stat counted during each, against the ticks during all other steps.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from spec_bench import load_sets, run_method


def steal_ticks() -> int:
    """The machine's steal ticks so far (/proc/stat's cpu line, 8th value; 0 where there is none)."""
    try:
        fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()
        return int(fields[8]) if len(fields) > 8 else 0
    except OSError:
        return 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sets", nargs="+", default=["code_rewrite", "summarization"])
    ap.add_argument("--methods", nargs="+", default=["ngram", "mtp"])
    ap.add_argument("--batch-size", type=int, default=1)
    ap.add_argument("--per-category", type=int, default=6)
    ap.add_argument("--mbpp", type=int, default=12)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steal-trace", action="store_true", help="per-step steal ticks of one run (see above)")
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    import specgen.engine.adaptive as adaptive
    from specgen import SamplingParams, SpecConfig, load_model

    vetoes = [0]
    guard = adaptive.Controller._guard

    def counting_guard(self, speculate: bool) -> bool:
        allowed = guard(self, speculate)
        vetoes[0] += int(speculate and not allowed)
        return allowed

    adaptive.Controller._guard = counting_guard
    caps = {"whole": (float("inf"), float("inf")),
            "capped": (adaptive.CostModel.OUTLIER, adaptive.Controller.DRAFT_OUTLIER)}
    loaded = load_model(None, threads=args.threads)
    sets = load_sets(args.per_category, args.mbpp)
    sp = SamplingParams(max_tokens=args.max_tokens)
    if args.steal_trace:
        steal_trace(loaded, sets, sp, args)
        return
    print(f"batch {args.batch_size}, k = {args.k}, {args.repeats} alternated repeats; caps: OUTLIER "
          f"{caps['capped'][0]}, DRAFT_OUTLIER {caps['capped'][1]}")
    print(f"{'set':<15}{'method':<8}{'caps':<8}{'time':>8}{'speedup (range)':>22}{'tok/step (sd)':>16}"
          f"{'vetoes':>8}{'steal':>7}")
    specs = {m: SpecConfig(method=m, num_speculative_tokens=args.k) for m in args.methods}
    specs["none"] = SpecConfig()
    for name in args.sets:
        prompts = [list(loaded.tokenizer.encode_chat(m)) for m in sets[name]]
        runs: dict[tuple[str, str], list[tuple[float, float, int, int]]] = {}
        ref = None
        for _ in range(args.repeats):
            for method in ["none"] + args.methods:
                for label in (["-"] if method == "none" else list(caps)):
                    if method != "none":
                        adaptive.CostModel.OUTLIER, adaptive.Controller.DRAFT_OUTLIER = caps[label]
                    vetoes[0], s0 = 0, steal_ticks()
                    outs, r = run_method(loaded, prompts, sp, args.batch_size, specs[method])
                    ids = [o.token_ids for o in outs]
                    ref = ids if ref is None else ref
                    if ids != ref:
                        raise SystemExit(f"{name} {method} {label}: outputs differ from none's")
                    runs.setdefault((method, label), []).append((r["wall_s"], r["mean_accepted_length"], vetoes[0],
                                                                 steal_ticks() - s0))
        adaptive.CostModel.OUTLIER, adaptive.Controller.DRAFT_OUTLIER = caps["capped"]
        base = np.array([r[0] for r in runs[("none", "-")]])
        for (method, label), rows in runs.items():
            r = np.array(rows)
            speedup = base / r[:, 0]
            print(f"{name:<15}{method:<8}{label:<8}{np.median(r[:, 0]):>7.2f}s"
                  f"{np.median(speedup):>9.3f}x ({speedup.min():.2f}-{speedup.max():.2f})"
                  f"{r[:, 1].mean():>10.2f} ({r[:, 1].std():.2f}){np.median(r[:, 2]):>8.0f}{np.median(r[:, 3]):>7.0f}",
                  flush=True)


def steal_trace(loaded, sets, sp, args) -> None:
    """One run of args.methods[0] per set: /proc/stat's steal ticks during each decode step (read as the guard
    records the step), for the steps slower than 3x the median and for the others."""
    import specgen.engine.adaptive as adaptive
    from specgen import SpecConfig

    steps: list[tuple[float, int]] = []  # (seconds, steal ticks so far) per recorded step
    record = adaptive.Controller.record

    def tracing_record(self, num_emitted, seconds, speculated, num_tokens=None):
        steps.append((seconds, steal_ticks()))
        return record(self, num_emitted, seconds, speculated, num_tokens)

    adaptive.Controller.record = tracing_record
    for name in args.sets:
        steps.clear()
        prompts = [list(loaded.tokenizer.encode_chat(m)) for m in sets[name]]
        before = steal_ticks()
        run_method(loaded, prompts, sp, args.batch_size,
                   SpecConfig(method=args.methods[0], num_speculative_tokens=args.k))
        seconds = np.array([x[0] for x in steps])
        ticks = np.diff(np.array([before] + [x[1] for x in steps]))  # ticks since the step before's record
        slow = seconds > 3 * np.median(seconds)
        print(f"{name} {args.methods[0]}: {len(seconds)} decode steps, median {np.median(seconds) * 1e3:.1f} ms; "
              f"{int(slow.sum())} slower than 3x ({', '.join(f'{x * 1e3:.0f}' for x in seconds[slow])} ms) with "
              f"steal ticks {ticks[slow].tolist()}; the other {int((~slow).sum())} steps: {int(ticks[~slow].sum())} "
              "ticks in all")
    adaptive.Controller.record = record


if __name__ == "__main__":
    main()
