"""EAGLE (issue 44): the EAGLE layer's chain, static tree and dynamic tree against plain decoding, n-gram and the
MTP head on Spec-Bench's categories and MBPP rewriting; and the tree against the chain of the same layer at the same
verify budget (every node verified).

    python benchmarks/eagle.py [--eagle DIR] [--sets ...] [--per-set 3] [--max-tokens 64] [--repeats 2]
                               [--batch-size 1]

Greedy (or --temperature T, seed 0), the default model, float32, the fused backend, batch --batch-size (1). Speed
arms run with the adaptive controller (it picks each slot's k or node budget); they alternate within each repeat,
tok/s are the best of the repeats and "x none" its ratio to plain decoding's. tok/step = tokens emitted per step
(accepted + 1), nodes/step = drafts verified per step. Budget arms verify every node offered: a chain of B drafts
against a tree of B nodes (EAGLE-2's most probable B) of the same layer, without copies. The EAGLE speed arms copy
where the text repeats (--eagle-copy 2, the default) but for `eagle dynamic no copy`. Outputs are checked identical
to `none`'s.
"""
from __future__ import annotations

import argparse

import numpy as np

from common import CATEGORIES, load_sets, machine, print_table, timed

STATIC = ("0", "1", "2", "0,0", "0,1", "1,0", "0,0,0", "0,0,1", "0,0,0,0")  # 9 nodes, depth 4


def arms(eagle: str | None, budgets: list[int]) -> dict:
    """label -> (SpecConfig, speed arm?)"""
    from specgen import SpecConfig
    from specgen.config import EagleConfig

    def e(k, adaptive=True, **kw):
        return SpecConfig(method="eagle", draft_model=eagle, num_speculative_tokens=k, adaptive=adaptive,
                          eagle=EagleConfig(**kw))

    out = {"none": (SpecConfig(), True), "ngram k3": (SpecConfig(method="ngram"), True),
           "mtp k2": (SpecConfig(method="mtp", num_speculative_tokens=2), True),
           "eagle chain k4": (e(4, topk=1), True), "eagle static 9": (e(4, topk=3, tree_choices=STATIC), True),
           "eagle dynamic 4x4": (e(4, topk=4, nodes=16), True),
           "eagle dynamic no copy": (e(4, topk=4, nodes=16, copy=0), True)}
    for b in budgets:  # the layer alone (no copies)
        out[f"chain B={b}"] = (e(b, adaptive=False, topk=1, copy=0), False)
        out[f"tree B={b}"] = (e(min(b, 5), adaptive=False, topk=4, nodes=b, copy=0), False)
    return out


def per_depth(outs) -> str:
    """Accepted / verified at depths 1..4 (a chain's positions): the share of steps whose path reached depth i
    among those that verified a node there."""
    acc = np.zeros(5)
    drafted = np.zeros(5)
    for o in outs:
        if o.stats.accepted_per_position:
            acc += np.array(o.stats.accepted_per_position[:5])
            drafted += np.array(o.stats.drafted_per_position[:5])
    return " ".join(f"{a / d:.2f}" if d else "-" for a, d in zip(acc[:4], drafted[:4]))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--eagle", default=None, help="EAGLE layer directory [default: the shipped one]")
    p.add_argument("--sets", nargs="+", default=CATEGORIES)
    p.add_argument("--per-set", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--budgets", nargs="+", type=int, default=[3, 5])
    p.add_argument("--arms", nargs="+", default=None)
    p.add_argument("--batch-size", type=int, default=1, help="engine slots (use --per-set >= it)")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (0: greedy); seed 0")
    args = p.parse_args()
    from specgen import EngineConfig, SamplingParams, generate, load_model

    print(machine())
    model = load_model(None)
    sets = load_sets(args.per_set, args.per_set)
    all_arms = arms(args.eagle, args.budgets)
    names = args.arms or list(all_arms)
    sampling = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=0)
    rows = []
    for name in args.sets:
        prompts = sets[name]
        best: dict[str, float] = {}
        outs = {}
        for repeat in range(args.repeats):
            for arm in names:
                spec, speed = all_arms[arm]
                if not speed and repeat:  # budget arms: counts only
                    continue
                out, wall = timed(lambda: generate(prompts, model=model, sampling=sampling, speculative=spec,
                                                   engine=EngineConfig(batch_size=args.batch_size)))
                best[arm] = max(best.get(arm, 0.0), sum(len(o.token_ids) for o in out) / wall)
                outs[arm] = out
        for arm in names:
            out = outs[arm]
            steps = sum(o.stats.num_steps for o in out)
            speed = all_arms[arm][1]
            rows.append([name, arm, best[arm] if speed else None,
                         best[arm] / best["none"] if speed and "none" in best else None,
                         sum(len(o.token_ids) for o in out) / steps,
                         sum(o.stats.num_draft_tokens for o in out) / steps,
                         per_depth(out), [o.token_ids for o in out] == [o.token_ids for o in outs[names[0]]]])
        print_table(["set", "arm", "tok/s", "x none", "tok/step", "nodes/step", "accepted per depth", "identical"],
                    rows[-len(names):])
        print(machine(), flush=True)


if __name__ == "__main__":
    main()
