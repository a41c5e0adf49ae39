"""Write self-distillation prompts for draft models and heads from the shared T0 and GSM8K training sets.

    python scripts/make_distill_prompts.py -o distill_prompts.jsonl [--t0 N] [--gsm8k N] [--max-chars C]
        [--seed S]

T0 (../shared/data/t0_prompts/): N prompts spread evenly over its templates (one template's prompts are picked
before any template gets a second, templates and prompts in a seeded order), at most C characters each, so
that news articles to summarize, passages with questions, closed-book questions and dialogue all appear. GSM8K
(../shared/data/gsm8k/train.jsonl, the training split; Spec-Bench's math prompts come from its test split):
the first N problems. Each line is a chat record `{"id", "messages": [{"role": "user", "content": ...}]}`, as
`specgen run` and `specgen train-mtp` read it. The model writes the answers; the data sets' own answers are
not used. The same data and arguments give the same file.
"""
from __future__ import annotations

import argparse
import gzip
import json
import random
from collections import defaultdict
from pathlib import Path

DATA = Path(__file__).resolve().parents[2] / "shared" / "data"


def t0_prompts(path: Path, count: int, max_chars: int, seed: int) -> list[dict]:
    by_source: dict[str, list[str]] = defaultdict(list)
    with gzip.open(path, "rt") as f:
        for line in f:
            row = json.loads(line)
            if len(row["prompt"]) <= max_chars:
                by_source[row["source"]].append(row["prompt"])
    rng = random.Random(seed)
    sources = sorted(by_source)
    rng.shuffle(sources)
    for s in sources:
        rng.shuffle(by_source[s])
    out, depth = [], 0
    while len(out) < count and any(len(by_source[s]) > depth for s in sources):
        for s in sources:
            if len(out) < count and len(by_source[s]) > depth:
                out.append({"id": f"t0-{s}-{depth}",
                            "messages": [{"role": "user", "content": by_source[s][depth]}]})
        depth += 1
    return out


def gsm8k_prompts(path: Path, count: int) -> list[dict]:
    lines = [json.loads(x) for x in path.read_text().splitlines()[:count] if x.strip()]
    return [{"id": f"gsm8k-train-{i}", "messages": [{"role": "user", "content": q["question"]}]}
            for i, q in enumerate(lines)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-o", "--output", type=Path, required=True)
    p.add_argument("--t0", type=int, default=480, help="T0 prompts")
    p.add_argument("--gsm8k", type=int, default=120, help="GSM8K training problems")
    p.add_argument("--max-chars", type=int, default=3000, help="longest T0 prompt kept, in characters")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    rows = t0_prompts(DATA / "t0_prompts" / "t0_train_prompts.jsonl.gz", a.t0, a.max_chars, a.seed)
    rows += gsm8k_prompts(DATA / "gsm8k" / "train.jsonl", a.gsm8k)
    a.output.write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"wrote {len(rows)} prompts to {a.output}")


if __name__ == "__main__":
    main()
