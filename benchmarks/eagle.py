"""EAGLE (issue 44): the EAGLE layer's chain, static tree and dynamic tree against plain decoding, n-gram and
the MTP head on Spec-Bench's categories and MBPP rewriting; and the tree against the chain of the same layer
at the same verify budget (every node verified).

    python benchmarks/eagle.py [--eagle DIR] [--eagle3 DIR] [--sets ...] [--per-set 3] [--max-tokens 64]
                               [--repeats 2] [--batch-size 1]

Greedy (or --temperature T, seed 0), the default model, float32, the fused backend, batch --batch-size (1).
Speed arms run with the adaptive controller (it picks each slot's k or node budget); they alternate within
each repeat, tok/s are the best of the repeats and "x none" its ratio to plain decoding's; "x none norm" the
same ratio with every arm's forwards priced at one cost per token count pooled over the set's runs, plus the
arm's own host time (common.normalized_seconds: the machine's drift between arms cancels). tok/step = tokens
emitted per step (accepted + 1), nodes/step = drafts verified per step. Budget arms (--budgets B...) verify
every node offered: a chain of B drafts against a tree of B nodes of the same layer (EAGLE-2's most probable
B, at most 32, with --budget-topk children per expanded node), without copies; past 5 drafts, the longest
chain, the chain's figure is a bound (tree_against_chain). The EAGLE speed arms copy where the text repeats
(--eagle-copy 2, the default) but for `eagle dynamic no copy`. Outputs are checked identical to `none`'s.
"""
from __future__ import annotations

import argparse

import numpy as np
from common import CATEGORIES, ForwardLog, load_sets, machine, normalized_seconds, print_table, timed

STATIC = ("0", "1", "2", "0,0", "0,1", "1,0", "0,0,0", "0,0,1", "0,0,0,0")  # 9 nodes, depth 4
MAX_CHAIN = 5  # SpecConfig.num_speculative_tokens at most


def arms(eagle: str | None, budgets: list[int], budget_topk: int = 8, eagle3: str | None = None) -> dict:
    """label -> (SpecConfig, speed arm?)"""
    from specgen import SpecConfig
    from specgen.config import EagleConfig

    def e(k, adaptive=True, **kw):
        return SpecConfig(method="eagle", draft_model=eagle, num_speculative_tokens=k, adaptive=adaptive,
                          eagle=EagleConfig(**kw))

    out = {"none": (SpecConfig(), True), "ngram k3": (SpecConfig(method="ngram"), True),
           "mtp k2": (SpecConfig(method="mtp", num_speculative_tokens=2), True),
           "eagle chain k4": (e(4, topk=1), True),
           "eagle static 9": (e(4, topk=3, tree_choices=STATIC), True),
           "eagle dynamic 4x4": (e(4, topk=4, nodes=16), True),
           "eagle dynamic no copy": (e(4, topk=4, nodes=16, copy=0), True)}
    for b in budgets:  # the layer alone (no copies); a chain is at most MAX_CHAIN long
        out[f"chain B={min(b, MAX_CHAIN)}"] = (e(min(b, MAX_CHAIN), adaptive=False, topk=1, copy=0), False)
        out[f"tree B={b}"] = (e(min(b, MAX_CHAIN), adaptive=False, topk=budget_topk, nodes=b, copy=0), False)
    if eagle3 is not None:  # an EAGLE-3 layer in the same arms
        def e3(k, adaptive=True, **kw):
            return SpecConfig(method="eagle3", draft_model=eagle3, num_speculative_tokens=k,
                              adaptive=adaptive, eagle=EagleConfig(**kw))

        out["eagle3 dynamic 4x4"] = (e3(4, topk=4, nodes=16), True)
        out["eagle3 dynamic no copy"] = (e3(4, topk=4, nodes=16, copy=0), True)
        for b in budgets:
            chain = e3(min(b, MAX_CHAIN), adaptive=False, topk=1, copy=0)
            out[f"eagle3 chain B={min(b, MAX_CHAIN)}"] = (chain, False)
            out[f"eagle3 tree B={b}"] = (e3(min(b, MAX_CHAIN), adaptive=False, topk=budget_topk, nodes=b,
                                            copy=0), False)
    return out


def tree_against_chain(outs: dict, budgets: list[int]) -> list[list]:
    """Per budget B: tokens per step of the tree of B nodes over the chain of B drafts. Past MAX_CHAIN drafts
    (the longest chain specgen drafts) the chain's figure is an upper bound: the chain of MAX_CHAIN plus, for
    each further draft, the share of steps that accepted all MAX_CHAIN (a draft past them adds at most
    that)."""
    rows = []
    for b in budgets:
        c, t = outs.get(f"chain B={min(b, MAX_CHAIN)}"), outs.get(f"tree B={b}")
        if c is None or t is None:
            continue
        steps = sum(o.stats.num_steps for o in c)
        chain = sum(len(o.token_ids) for o in c) / steps
        full = sum(o.stats.accepted_per_position[MAX_CHAIN - 1] for o in c
                   if o.stats.accepted_per_position) / steps
        chain_b = chain + max(0, b - MAX_CHAIN) * full
        tree = sum(len(o.token_ids) for o in t) / sum(o.stats.num_steps for o in t)
        rows.append([b, chain_b, "yes" if b > MAX_CHAIN else "no", tree, tree / chain_b])
    return rows


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
    p.add_argument("--eagle3", default=None, help="an EAGLE-3 layer directory: its arms beside EAGLE's")
    p.add_argument("--sets", nargs="+", default=CATEGORIES)
    p.add_argument("--per-set", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--budgets", nargs="+", type=int, default=[3, 5])
    p.add_argument("--budget-topk", type=int, default=8,
                   help="children per expanded node in the budget arms' trees")
    p.add_argument("--arms", nargs="+", default=None)
    p.add_argument("--batch-size", type=int, default=1, help="engine slots (use --per-set >= it)")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (0: greedy); seed 0")
    args = p.parse_args()
    from specgen import EngineConfig, SamplingParams, generate, load_model

    print(machine())
    model = load_model(None)
    sets = load_sets(args.per_set, args.per_set)
    all_arms = arms(args.eagle, args.budgets, args.budget_topk, args.eagle3)
    names = args.arms or list(all_arms)
    sampling = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=0)
    rows = []
    warm = SamplingParams(max_tokens=2, temperature=args.temperature, seed=0)
    for arm in names:  # each arm's engine times its controller's cost table once, before any timed run
        generate(sets[args.sets[0]][:1], model=model, sampling=warm, speculative=all_arms[arm][0],
                 engine=EngineConfig(batch_size=args.batch_size))
    log = ForwardLog(model)
    for name in args.sets:
        prompts = sets[name]
        best: dict[str, float] = {}
        outs = {}
        runs: dict[str, list] = {}  # speed arms: (wall, forwards) per repeat
        for repeat in range(args.repeats):
            for arm in names:
                spec, speed = all_arms[arm]
                if not speed and repeat:  # budget arms: counts only
                    continue
                log.take()
                out, wall = timed(lambda: generate(prompts, model=model, sampling=sampling, speculative=spec,
                                                   engine=EngineConfig(batch_size=args.batch_size)))
                best[arm] = max(best.get(arm, 0.0), sum(len(o.token_ids) for o in out) / wall)
                outs[arm] = out
                if speed:
                    runs.setdefault(arm, []).append((wall, log.take()))
        norm = normalized_seconds(runs) if runs else {}
        for arm in names:
            out = outs[arm]
            steps = sum(o.stats.num_steps for o in out)
            speed = all_arms[arm][1]
            rows.append([name, arm, best[arm] if speed else None,
                         best[arm] / best["none"] if speed and "none" in best else None,
                         norm["none"] / norm[arm] if speed and "none" in norm else None,
                         sum(len(o.token_ids) for o in out) / steps,
                         sum(o.stats.num_draft_tokens for o in out) / steps,
                         per_depth(out), [o.token_ids for o in out] == [o.token_ids for o in outs[names[0]]]])
        print_table(["set", "arm", "tok/s", "x none", "x none norm", "tok/step", "nodes/step",
                     "accepted per depth", "identical"], rows[-len(names):])
        budget_rows = tree_against_chain(outs, args.budgets)
        if budget_rows:
            print_table(["B", "chain tok/step", "chain bound", "tree tok/step", "tree / chain"], budget_rows)
        print(machine(), flush=True)


if __name__ == "__main__":
    main()
