"""How many n-gram drafts to verify per step: the controller's rule against one that also knows each draft's match
length, replayed on the model's own greedy outputs (no forwards timed: a cost model prices each step).

    python benchmarks/draft_policy.py [--per-category 40] [--mbpp 60] [--betas 0.12 0.2 0.5 0.9] [--outputs F]

1. Plain greedy outputs (256 tokens at most, batch 32) of the first prompts of each set; --outputs caches them
   in a JSON file (read back when it exists).
2. At every position of every output: the k=5 n-gram draft (n from 3 down to 1, most recent match), its match
   length m and how many of its tokens the output continues with (L).
3. Each rule walks every output as the engine would (a step verifies k drafts, emits min(L, k) + 1 tokens) and
   pays 1 + beta k per step (beta: one verified token's cost relative to a one-token step; ~0.12 at batch 1 on
   this CPU, ~0.9 per slot at 32 slots). Printed: tokens per unit of cost, i.e. the decode speedup over plain
   decoding under that cost model, for
   - k5: every draft verified;
   - current: the controller's rule (adaptive.py): per-request decayed acceptance a, k maximising
     E(k) / (1 + beta k) with E(k) = 1 + a + ... + a^k, plain unless 5% better;
   - match-length: the same, with the chance that draft i is accepted given the ones before it from a table
     over (m, i) learnt on the other sets, blended with the request's own counts;
   - oracle: k = L (knows the future; the most any rule could get).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

K = 5
M = 4  # match-length buckets: 1, 2, 3+ (index 0 unused)


def plain_outputs(per_category: int, mbpp: int, path: str | None) -> dict[str, list[tuple[list[int], list[int]]]]:
    if path and Path(path).exists():
        return {k: [tuple(x) for x in v] for k, v in json.loads(Path(path).read_text()).items()}
    from spec_bench import load_sets

    from specgen import EngineConfig, SamplingParams, generate, load_model

    lm = load_model(None, threads=int(os.environ.get("OMP_NUM_THREADS", "2")))
    out = {}
    for name, msgs in load_sets(per_category, mbpp).items():
        res = generate(msgs, model=lm, sampling=SamplingParams(max_tokens=256), engine=EngineConfig(batch_size=32))
        out[name] = [(list(lm.tokenizer.encode_chat(m)), list(o.token_ids)) for m, o in zip(msgs, res)]
        print(f"plain outputs: {name} {len(msgs)} prompts, {sum(len(o) for _, o in out[name])} tokens", flush=True)
    if path:
        Path(path).write_text(json.dumps(out))
    return out


def draft_steps(prompt: list[int], out: list[int]) -> list[tuple[int, int, int]]:
    """(match length, tokens of the draft the output continues with, drafts offered) at each output position."""
    from specgen.engine.proposers.ngram import ngram_match

    seq = np.array([prompt + out], np.int64)
    res = []
    for j in range(len(out)):
        pos = len(prompt) + j
        d, ml = ngram_match(seq, np.array([pos]), K, 1, 3)
        nd = int(d.num_draft[0])
        truth = seq[0, pos:pos + nd]  # the output may end before the draft does
        agree = d.draft_ids[0, :len(truth)] == truth
        res.append((int(ml[0]), int(np.cumprod(agree).sum()) if nd else 0, nd))
    return res


def walk(reqs, choose, beta: float) -> float:
    """Tokens per unit of cost when each step verifies choose(state, m, offered) drafts."""
    tokens = cost = 0.0
    for r in reqs:
        st = {"hits": 0.0, "seen": 0.0, "h": np.zeros((M, K)), "s": np.zeros((M, K))}
        j, tokens = 1, tokens + 1  # the first token comes from prefill
        while j < len(r):
            m, L, nd = r[j]
            k = choose(st, m, nd, beta)
            emit = min(min(L, k) + 1, len(r) - j)
            tokens, cost = tokens + emit, cost + 1 + beta * k
            known = min(nd, k + 1) if k else min(nd, 1)  # drafts whose fate the step reveals
            hits = min(L, known)
            st["hits"] = 0.9 * st["hits"] + hits
            st["seen"] = 0.9 * st["seen"] + hits + (hits < known)
            if nd:
                b = min(m, M - 1)
                st["h"] *= 0.98
                st["s"] *= 0.98
                st["s"][b, :known] += 1
                st["h"][b, :min(L, known)] += 1
            j += emit
    return tokens / cost


def current(st, m, nd, beta):
    if nd == 0:
        return 0
    a = min((st["hits"] + 1) / (st["seen"] + 2), 0.999)
    e = [(1 - a ** (k + 1)) / (1 - a) / (1 + beta * k) for k in range(nd + 1)]
    k = int(np.argmax(e))
    return k if e[k] > 1.05 else 0


def by_match_length(table):
    def choose(st, m, nd, beta):
        if nd == 0:
            return 0
        b = min(m, M - 1)
        best, value, p, e = 0, 1.0, 1.0, 1.0
        for i in range(nd):
            p *= (st["h"][b, i] + 4 * table[b, i]) / (st["s"][b, i] + 4)
            e += p
            if e / (1 + beta * (i + 1)) > value:
                best, value = i + 1, e / (1 + beta * (i + 1))
        return best if value > 1.05 else 0
    return choose


def conditional_table(reqs_lists) -> tuple[np.ndarray, np.ndarray]:
    """P(draft i accepted | drafts < i accepted) per match-length bucket [M, K], with its counts."""
    h, s = np.zeros((M, K)), np.zeros((M, K))
    for reqs in reqs_lists:
        for r in reqs:
            for m, L, nd in r:
                b = min(m, M - 1)
                s[b, :min(nd, L + 1)] += 1
                h[b, :min(nd, L)] += 1
    return (h + 1) / (s + 2), s


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--per-category", type=int, default=40)
    ap.add_argument("--mbpp", type=int, default=60)
    ap.add_argument("--betas", type=float, nargs="+", default=[0.12, 0.2, 0.5, 0.9])
    ap.add_argument("--outputs", default=None, help="JSON cache of the plain outputs")
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "2")
    data = plain_outputs(args.per_category, args.mbpp, args.outputs)
    steps = {name: [draft_steps(p, o) for p, o in v] for name, v in data.items()}
    table, counts = conditional_table(steps.values())
    print("P(draft i accepted | drafts before it accepted), rows: match length 1, 2, 3; columns: i = 1..5")
    for b in range(1, M):
        print(f"  m={b}  {' '.join(f'{x:.2f}' for x in table[b])}   ({int(counts[b, 0])} first drafts)")
    for beta in args.betas:
        print(f"\nbeta {beta}: decode speedup under the cost model")
        print(f"  {'set':<15}{'k5':>8}{'current':>9}{'match-length':>14}{'oracle':>8}")
        for name, reqs in steps.items():
            others, _ = conditional_table([v for n, v in steps.items() if n != name])
            tokens = cost = 0.0
            for r in reqs:  # the oracle verifies exactly the drafts that will be accepted
                j, tokens = 1, tokens + 1
                while j < len(r):
                    emit = min(r[j][1] + 1, len(r) - j)
                    tokens, cost, j = tokens + emit, cost + 1 + beta * r[j][1], j + emit
            oracle = tokens / cost
            print(f"  {name:<15}{walk(reqs, lambda st, m, nd, b: nd, beta):>8.3f}{walk(reqs, current, beta):>9.3f}"
                  f"{walk(reqs, by_match_length(others), beta):>14.3f}{oracle:>8.3f}", flush=True)


if __name__ == "__main__":
    main()
