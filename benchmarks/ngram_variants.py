"""Which n-gram draft to take when the text offers several: the engine's rule (the most recent occurrence of the
longest tail of n_max .. n_min tokens) against longer tails and a vote among occurrences, replayed teacher-forced
on the model's own greedy outputs (no forwards: what each rule's drafts would have had accepted).

    python benchmarks/ngram_variants.py --outputs /tmp/plain.json [--k 5] [--beta 0.2]

--outputs: the plain outputs cached by `benchmarks/draft_policy.py --outputs F` (generated there if absent).
Per set and rule, at every step of every output (the step emits the accepted drafts and one token more):
- tok/step: tokens per step if all k drafts were verified for free (the replay ceiling of spec_bench.py);
- acc@1: how often the first draft is right, where a rule offers one;
- speedup at beta: tokens per unit of cost when a step that verifies d drafts costs 1 + beta d (beta: one verified
  token's cost over a one-token step; ~0.2 at batch 1 on this CPU, `benchmarks/context_cost.py`), every offered
  draft verified.
Rules:
- recent n..m: the most recent occurrence of the longest matching tail, n down to m tokens (the engine's numpy
  reference, ngram_match; the engine uses 3..1);
- vote n..m: among all occurrences of that longest tail, draft by draft the token that most of the occurrences
  still agreeing with the draft so far continue with (ties: the most recent), so a continuation the text repeats
  wins over a one-off.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

from specgen.engine.proposers.ngram import ngram_match

sys.path.insert(0, str(Path(__file__).resolve().parent))


def occurrences(seq: np.ndarray, pos: int, n: int) -> np.ndarray:
    """Starts i of seq[pos - n: pos] in seq[:pos] with i + n <= pos - 1 (a known token follows), ascending."""
    if pos - n < 1:
        return np.zeros(0, np.int64)
    tail = seq[pos - n: pos]
    last = pos - 1 - n  # the latest start whose occurrence is followed by a known token
    hit = np.ones(last + 1, bool)
    for j in range(n):
        hit &= seq[j: j + last + 1] == tail[j]
    return np.nonzero(hit)[0]


def draft(seq: np.ndarray, pos: int, k: int, n_max: int, n_min: int, vote: bool) -> list[int]:
    if not vote:  # the engine's rule: its numpy reference (specgen/engine/proposers/ngram.py)
        d, _ = ngram_match(seq[None, :pos], np.array([pos]), k, n_min, n_max)
        return d.draft_ids[0, : d.num_draft[0]].tolist()
    for n in range(n_max, n_min - 1, -1):
        starts = occurrences(seq, pos, n)
        if len(starts) == 0:
            continue
        conts = starts + n  # where each occurrence's continuation starts
        out: list[int] = []
        alive = conts
        for j in range(k):
            alive = alive[alive + j < pos]
            if len(alive) == 0:
                break
            toks = seq[alive + j]
            values, counts = np.unique(toks, return_counts=True)
            best = counts.max()
            # ties: the token of the most recent occurrence among the most frequent ones
            tied = set(values[counts == best].tolist())
            tok = next(int(t) for t in toks[::-1] if int(t) in tied)
            out.append(tok)
            alive = alive[toks == tok]
        return out
    return []


def replay(pairs: list[tuple[list[int], list[int]]], k: int, n_max: int, n_min: int, vote: bool, beta: float):
    steps = tokens = cost = first = first_hit = 0
    for prompt, out in pairs:
        seq = np.array(prompt + out, np.int64)
        pos = len(prompt) + 1  # the first output token comes from the prefill step
        steps, tokens, cost = steps + 1, tokens + 1, cost + 1
        while pos < len(seq):
            d = draft(seq, pos, k, n_max, n_min, vote)
            acc = 0
            while acc < len(d) and pos + acc < len(seq) and d[acc] == seq[pos + acc]:
                acc += 1
            if d:
                first += 1
                first_hit += acc > 0
            emitted = min(acc + 1, len(seq) - pos)
            steps, tokens, cost = steps + 1, tokens + emitted, cost + 1 + beta * len(d)
            pos += emitted
    return tokens / steps, first_hit / max(first, 1), tokens / cost


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--outputs", required=True)
    ap.add_argument("--per-category", type=int, default=20)
    ap.add_argument("--mbpp", type=int, default=30)
    ap.add_argument("--k", type=int, default=5)
    ap.add_argument("--beta", type=float, default=0.2)
    ap.add_argument("--rules", nargs="+", default=["recent:3:1", "recent:5:1", "recent:8:1", "vote:3:1", "vote:5:1"])
    args = ap.parse_args()
    from draft_policy import plain_outputs

    sets = plain_outputs(args.per_category, args.mbpp, args.outputs)
    rules = [(r.split(":")[0], int(r.split(":")[1]), int(r.split(":")[2])) for r in args.rules]
    print(f"k = {args.k}; tok/step (free verification) / acc@1 / speedup at beta {args.beta}")
    print("set".ljust(16) + "".join(f"{kind} {hi}..{lo}".rjust(24) for kind, hi, lo in rules))
    for name, pairs in sets.items():
        cells = []
        for kind, hi, lo in rules:
            t, a, s = replay(pairs, args.k, hi, lo, kind == "vote", args.beta)
            cells.append(f"{t:.3f} / {a:.2f} / {s:.3f}".rjust(24))
        print(name.ljust(16) + "".join(cells), flush=True)


if __name__ == "__main__":
    main()
