"""Token trees against chains (issue 44): n-gram drafting as a chain of k and as a tree of the best distinct
continuations, and the learned heads (the MTP head's chain, Medusa's and Hydra's static trees), against plain
decoding; and what moving a tree's accepted path costs.

    python benchmarks/trees.py --sets summarization rag code_rewrite --batch-sizes 1 8 --repeats 2
    python benchmarks/trees.py --sets summarization rag translation math_reasoning qa writing \
        --batch-sizes 1 --arms none ngram mtp medusa hydra --fixed medusa hydra --fixed-nodes 3

--fixed KIND...: the same heads at one verify budget, chain against tree, every node verified (no controller):
a chain of --fixed-nodes N first guesses (0,0,...) against a tree of as many nodes (the chain one shorter, and
the first head's second guess); tokens per step only. N at most the heads' count (a deeper node is cut).
`--medusa DIR` / `--hydra DIR`: other heads than the package's.

Greedy, the default model, float32, the fused backend, the adaptive controller on (it picks each slot's k or
node budget). Arms alternate within each repeat; tok/s are the best of the repeats. Per row: tokens per step
(accepted path + 1), nodes (drafts) verified per step, whether outputs equal `none`'s.
"""
from __future__ import annotations

import argparse
import time

import numpy as np
from common import load_sets, machine, print_table, timed

ARMS = {  # label -> (method, k, branches, static shape)
    "none": ("none", 3, 1, ()),
    "ngram chain k3": ("ngram", 3, 1, ()),
    "ngram tree 3x3": ("ngram", 3, 3, ()),
    "ngram tree 4x4": ("ngram", 4, 4, ()),
    "ngram static": ("ngram", 4, 3, ("0,0,0,0", "1", "1,0", "2", "0,1")),
    "ngram": ("ngram", 3, 1, ()),
    "mtp": ("mtp", 3, 1, ()),  # the shipped head's chain (with its copies)
    "medusa": ("medusa", 5, 1, ()),  # the default static tree (MedusaConfig)
    "hydra": ("hydra", 5, 1, ()),
}

def fixed_shapes(nodes: int) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(chain, tree) of `nodes` nodes each: 0,0,..,0 against 0,..,0 one shorter plus 1."""
    return (",".join("0" * nodes),), (",".join("0" * (nodes - 1)), "1")

HEADS: dict[str, str | None] = {"medusa": None, "hydra": None}  # --medusa / --hydra (None: the package's)


def spec_of(arm: str, shape: tuple[str, ...] | None = None, adaptive: bool = True):
    from specgen import NgramConfig, SpecConfig
    from specgen.config import MedusaConfig

    method, k, branches, ngram_shape = ARMS[arm]
    heads = {"draft_model": HEADS[method]} if method in HEADS else {}
    medusa = MedusaConfig(tree_choices=shape) if shape else MedusaConfig()
    return SpecConfig(method=method, num_speculative_tokens=k, adaptive=adaptive, medusa=medusa,
                      ngram=NgramConfig(branches=branches, tree_choices=ngram_shape), **heads)


def fixed_budget(model, sets: dict, names: list[str], kinds: list[str], max_tokens: int, nodes: int) -> None:
    """Chain against tree of the same head at `nodes` verified nodes per step, batch 1, greedy."""
    from specgen import EngineConfig, SamplingParams, generate

    rows = []
    for name in names:
        for kind in kinds:
            per_step = []
            for shape in fixed_shapes(nodes):
                out = generate(sets[name], model=model, sampling=SamplingParams(max_tokens=max_tokens),
                               speculative=spec_of(kind, shape, adaptive=False),
                               engine=EngineConfig(batch_size=1))
                per_step.append(sum(len(o.token_ids) for o in out) / sum(o.stats.num_steps for o in out))
            rows.append([name, kind, nodes, per_step[0], per_step[1], per_step[1] / per_step[0]])
    print_table(["set", "heads", "nodes", "chain tok/step", "tree tok/step", "tree / chain"], rows)


def move_cost(model, slots: int, rows: int, repeats: int = 50) -> float:
    """Seconds of one KVCache.move_rows of `rows` rows in each of `slots` slots (every layer, K and V)."""
    cache = model.model.new_cache(slots, 512)
    cache.reserve(512)
    s = np.repeat(np.arange(slots), rows)
    src = np.tile(np.arange(rows) + 200, slots)
    start = time.perf_counter()
    for _ in range(repeats):
        cache.move_rows(s, src + 3, src)
    return (time.perf_counter() - start) / repeats


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--sets", nargs="+", default=["summarization", "rag", "code_rewrite"])
    p.add_argument("--per-set", type=int, default=4)
    p.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 8])
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--arms", nargs="*", default=list(ARMS)[:5])
    p.add_argument("--fixed", nargs="*", default=[], choices=list(HEADS))
    p.add_argument("--fixed-nodes", type=int, default=3)
    p.add_argument("--medusa", default=None)
    p.add_argument("--hydra", default=None)
    p.add_argument("--no-move-cost", action="store_true")
    args = p.parse_args()
    HEADS.update(medusa=args.medusa, hydra=args.hydra)
    from specgen import SamplingParams, generate, load_model
    from specgen.engine.engine import EngineConfig

    print(machine())
    model = load_model(None)
    sets = load_sets(args.per_set, args.per_set)
    sampling = SamplingParams(max_tokens=args.max_tokens)
    rows = []
    for name in args.sets if args.arms else []:
        prompts = sets[name]
        for batch in args.batch_sizes:
            best: dict[str, float] = {}
            outs = {}
            for _ in range(args.repeats):
                for arm in args.arms:
                    out, wall = timed(lambda: generate(prompts, model=model, sampling=sampling,
                                                       speculative=spec_of(arm),
                                                       engine=EngineConfig(batch_size=batch)))
                    tokens = sum(len(o.token_ids) for o in out)
                    best[arm] = max(best.get(arm, 0.0), tokens / wall)
                    outs[arm] = out
            for arm in args.arms:
                out = outs[arm]
                steps = sum(o.stats.num_steps for o in out)
                rows.append([name, batch, arm, best[arm],
                             best[arm] / best["none"] if "none" in best else None,
                             sum(len(o.token_ids) for o in out) / steps,
                             sum(o.stats.num_draft_tokens for o in out) / steps,
                             [o.token_ids for o in out] == [o.token_ids for o in outs[args.arms[0]]]])
            print_table(["set", "batch", "arm", "tok/s", "x none", "tok/step", "nodes/step", "identical"],
                        rows[-len(args.arms):])
            print(machine())
    if args.fixed:
        print()
        fixed_budget(model, sets, args.sets, args.fixed, args.max_tokens, args.fixed_nodes)
        print(machine())
    if args.no_move_cost:
        return
    print()
    for slots, n in ((1, 3), (8, 3), (32, 4)):
        print(f"move_rows: {slots} slots x {n} rows: {move_cost(model, slots, n) * 1e6:.0f} us")
    print(machine())


if __name__ == "__main__":
    main()
