"""The learned drafters against plain decoding, n-gram and their oracle bounds: Spec-Bench categories and MBPP
rewriting, side by side in one run.

    python benchmarks/learned.py --mtp-multi DIR --draft DIR [DIR ...] [--sets ...] [--batch-sizes 1 32]

Arms: none, ngram (k = --k), mtp (the shipped head, chained, k = 2), mtp-N (a multi-layer head, `specgen
train-mtp --num-layers N`; k = N), draft NAME (draft models, `specgen make-draft --data`; k = --k). Greedy,
the default model. Per set and batch size every arm runs --repeats times, alternated with the others after a
warm-up; tok/s are medians and speedup the median of the per-repeat ratios to `none`; outputs are checked
identical to `none`'s.

For each learned arm a second run with every draft verified (adaptive off) gives:
- acceptance per draft position (accepted / verified there: the share of steps whose drafts 1..i were all
  right);
- the drafter's share of the run's time (its propose and observe calls, timed around the proposer);
- at batch 1, the oracle bound: each step of that run costs c(tokens it emits) at the step costs measured here
  plus the drafter's measured cost per draft for the drafts it accepted only (nothing for rejected drafts or
  catch-up passes), the job's prefill share added back (specgen/app/bounds.py); "of oracle" = speedup /
  oracle;
- at batch 1, the best fixed k: what verifying j drafts every step reaches for the best j, at the acceptance
  per position measured and the same step and drafter costs (the drafter charged for the j drafts it makes):
  what a controller knowing the job's acceptance, but not which step's drafts will be right, gets without
  adapting.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

import numpy as np
from common import load_sets, machine, print_table, timed


class TimedProposer:
    """A proposer whose propose and observe calls are timed (everything else delegated)."""

    def __init__(self, inner):
        self.inner, self.seconds = inner, 0.0

    def propose(self, view):
        start = time.perf_counter()
        out = self.inner.propose(view)
        self.seconds += time.perf_counter() - start
        return out

    def observe(self, update):
        start = time.perf_counter()
        self.inner.observe(update)
        self.seconds += time.perf_counter() - start

    def __getattr__(self, name):
        return getattr(self.inner, name)


def requests(prompts, sampling):
    from specgen.engine.types import Request

    return [Request(str(i), i, tuple(p), sampling) for i, p in enumerate(prompts)]


def run_job(lm, prompts, sampling, batch, spec, timed_drafter=False):
    """(outputs in input order, wall seconds, drafter seconds or None)."""
    from specgen import EngineConfig
    from specgen.api import make_engine

    eng = make_engine(lm, EngineConfig(batch_size=batch), spec)
    if timed_drafter:
        eng.proposer = TimedProposer(eng.proposer)
    outs, wall = timed(lambda: sorted(eng.run(requests(prompts, sampling)), key=lambda o: o.index))
    return outs, wall, eng.proposer.seconds if timed_drafter else None


def per_position(outs, k):
    drafted = np.sum([o.stats.drafted_per_position or [0] * k for o in outs], axis=0)[:k]
    accepted = np.sum([o.stats.accepted_per_position or [0] * k for o in outs], axis=0)[:k]
    return [float(a / d) if d else None for a, d in zip(accepted, drafted)], accepted, drafted


def emitted_per_step(outs, accepted):
    """Tokens each decoding step emitted, from the counts of a run that verified k drafts every step
    (acceptance stops at the first wrong draft: accepted[i] steps accepted at least i + 1 drafts)."""
    # decoding steps (each request's prefill step apart)
    steps = sum(o.stats.num_steps for o in outs) - len(outs)
    at_least = [steps] + [int(a) for a in accepted]
    return sum(([i + 1] * (at_least[i] - (at_least[i + 1] if i + 1 < len(at_least) else 0))
                for i in range(len(at_least))), [])


def oracle_bound(lm, prompts, outs, accepted, draft_seconds, share):
    """The batch-1 oracle of a learned drafter (see the module's docstring)."""
    from specgen.app import bounds

    steps = emitted_per_step(outs, accepted)
    drafts = sum(o.stats.num_draft_tokens for o in outs)
    per_draft = draft_seconds / max(drafts, 1)
    position = int(np.median([len(p) for p in prompts]))
    costs = bounds.step_costs(lm.model, position, sorted(set(steps) | {1}))
    decode = sum(steps) * costs[1] / sum(costs[e] + (e - 1) * per_draft for e in steps)
    return bounds.job_bound(decode, share)


def fixed_k_bound(lm, prompts, outs, accepted, draft_seconds, share):
    """The batch-1 speedup of the best fixed draft count j (see the module's docstring)."""
    from specgen.app import bounds

    steps = len(emitted_per_step(outs, accepted))
    drafts = sum(o.stats.num_draft_tokens for o in outs)
    per_draft = draft_seconds / max(drafts, 1)
    position = int(np.median([len(p) for p in prompts]))
    k = len(accepted)
    costs = bounds.step_costs(lm.model, position, list(range(1, k + 2)))
    # [k + 1]
    emitted = 1 + np.concatenate([[0.0], np.cumsum(np.asarray(accepted, np.float64) / max(steps, 1))])
    decode = max(emitted[j] * costs[1] / (costs[1 + j] + j * per_draft) for j in range(k + 1))
    return bounds.job_bound(decode, share)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sets", nargs="+", default=["summarization", "rag", "translation", "math_reasoning",
                                                  "qa", "writing", "code_rewrite"])
    ap.add_argument("--per-category", type=int, default=4,
                    help="Spec-Bench prompts per category (MBPP: as many)")
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--prompts-at-batch", type=int, default=32, help="prompts per set at batch sizes above 1")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--max-tokens-at-batch", type=int, default=64)
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--mtp-multi", type=Path, default=None,
                    help="a multi-layer MTP head (train-mtp --num-layers)")
    ap.add_argument("--draft", type=Path, nargs="*", default=[], help="draft models (make-draft)")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    from specgen import Method, SamplingParams, SpecConfig, load_model
    from specgen.app import bounds
    from specgen.drafters.mtp import load_mtp_weights

    print(machine())
    lm = load_model(None)
    arms = {"none": SpecConfig(), "ngram": SpecConfig(method=Method.NGRAM, num_speculative_tokens=args.k),
            "mtp": SpecConfig(method=Method.MTP, num_speculative_tokens=2)}
    if args.mtp_multi:
        n = len({k for k in load_mtp_weights(args.mtp_multi) if k.endswith("eh_proj.weight")})
        arms[f"mtp-{n}"] = SpecConfig(method=Method.MTP, num_speculative_tokens=n,
                                      draft_model=str(args.mtp_multi))
    for path in args.draft:
        arms[f"draft {path.name}"] = SpecConfig(method=Method.DRAFT_MODEL, num_speculative_tokens=args.k,
                                                draft_model=str(path))
    learned = [a for a in arms if a not in ("none", "ngram")]
    biggest = max(args.per_category, args.prompts_at_batch if max(args.batch_sizes) > 1 else 0)
    sets = load_sets(biggest, biggest)
    out = []
    for name in args.sets:
        for bs in args.batch_sizes:
            count = args.per_category if bs == 1 else args.prompts_at_batch
            prompts = [list(lm.tokenizer.encode_chat(m)) for m in sets[name][:count]]
            sp = SamplingParams(max_tokens=args.max_tokens if bs == 1 else args.max_tokens_at_batch)
            for spec in arms.values():  # warm-up: kernels, heads, drafts, the cost table
                run_job(lm, prompts[:bs], dataclasses.replace(sp, max_tokens=4), bs, spec)
            runs: dict[str, list] = {a: [] for a in arms}
            for _ in range(args.repeats):
                for a, spec in arms.items():
                    runs[a].append(run_job(lm, prompts, sp, bs, spec))
            ref = [o.token_ids for o in runs["none"][0][0]]
            tokens = sum(len(t) for t in ref)
            base = [tokens / w for _, w, _ in runs["none"]]
            share = None
            if bs == 1:
                _, pre_wall, _ = run_job(lm, prompts, dataclasses.replace(sp, max_tokens=1), bs, SpecConfig())
                share = bounds.prefill_share(pre_wall, float(np.median([w for _, w, _ in runs["none"]])))
            rows = []
            for a, spec in arms.items():
                tok_s = [tokens / w for _, w, _ in runs[a]]
                speedup = float(np.median([t / b for t, b in zip(tok_s, base)]))
                same = all([o.token_ids for o in r[0]] == ref for r in runs[a])
                outs = runs[a][0][0]
                steps = sum(o.stats.num_steps for o in outs)
                row = {"set": name, "batch": bs, "arm": a, "tok_s": float(np.median(tok_s)),
                       "speedup": speedup, "tok_per_step": tokens / steps, "identical": same,
                       "per_position": None, "draft_share": None, "oracle": None, "of_oracle": None,
                       "fixed_k": None}
                if a in learned:
                    off, wall, drafter = run_job(lm, prompts, sp, bs,
                                                 dataclasses.replace(spec, adaptive=False), True)
                    k = spec.num_speculative_tokens
                    pos, accepted, _ = per_position(off, k)
                    row.update(per_position=pos, draft_share=drafter / wall)
                    if bs == 1:
                        row["oracle"] = oracle_bound(lm, prompts, off, accepted, drafter, share)
                        row["of_oracle"] = speedup / row["oracle"]
                        row["fixed_k"] = fixed_k_bound(lm, prompts, off, accepted, drafter, share)
                out.append(row)
                acc = " / ".join("-" if p is None else f"{p:.2f}" for p in row["per_position"] or [])
                rows.append([name, bs, a, row["tok_s"], speedup, row["tok_per_step"], acc or "-",
                             row["draft_share"], row["oracle"], row["of_oracle"], row["fixed_k"],
                             "yes" if same else "NO"])
            print_table(["set", "batch", "arm", "tok/s", "speedup", "tok/step",
                         "accepted per position (all drafts)", "draft share", "oracle", "of oracle",
                         "best fixed k", "identical"], rows)
            print(flush=True)
    if args.json:
        args.json.write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
