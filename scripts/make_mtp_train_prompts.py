"""Write the prompts `specgen train-mtp` trains the default head on, disjoint from the evaluation prompts.

    python scripts/make_mtp_train_prompts.py -o mtp_train_prompts.jsonl [--tinystories]

Evaluation (benchmarks/mtp_bench.py, benchmarks/spec_bench.py) uses the first EVAL_PER_CATEGORY Spec-Bench
prompts of each category and the first EVAL_MBPP MBPP items; training uses Spec-Bench items at index
>= EVAL_PER_CATEGORY within their category (first turn), MBPP items from TRAIN_MBPP_FROM on, with the same
code-rewriting prompt, and optionally the TinyStories sample (each story's first sentences, to continue).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT.parent / "shared" / "data"
EVAL_PER_CATEGORY = 40
EVAL_MBPP = 200
TRAIN_MBPP_FROM = 227
REWRITE = "Rewrite this function with type hints and a docstring:\n\n```python\n{code}\n```"


def spec_bench_prompts(path: Path) -> list[dict]:
    lines = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    seen: dict[str, int] = {}
    out = []
    for q in lines:
        index = seen.get(q["category"], 0)
        seen[q["category"]] = index + 1
        if index >= EVAL_PER_CATEGORY:
            out.append({"id": f"specbench-{q['question_id']}",
                        "messages": [{"role": "user", "content": q["turns"][0]}]})
    return out


def mbpp_prompts(path: Path) -> list[dict]:
    items = json.loads(path.read_text())
    return [{"id": f"mbpp-{m['task_id']}", "messages": [{"role": "user", "content": REWRITE.format(code=m["code"])}]}
            for m in items[TRAIN_MBPP_FROM:]]


def tinystories_prompts(path: Path) -> list[dict]:
    stories = [s.strip() for s in path.read_text().split("<|endoftext|>") if s.strip()]
    out = []
    for i, story in enumerate(stories):
        opening = ". ".join(story.split(". ")[:2]).strip()
        out.append({"id": f"tinystories-{i}",
                    "messages": [{"role": "user", "content": f"Continue this story:\n\n{opening}"}]})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-o", "--output", type=Path, required=True)
    ap.add_argument("--data", type=Path, default=DATA, help="the shared data folder")
    ap.add_argument("--tinystories", action="store_true", help="add the TinyStories sample")
    args = ap.parse_args()
    records = spec_bench_prompts(args.data / "spec_bench" / "question.jsonl")
    records += mbpp_prompts(args.data / "mbpp" / "sanitized-mbpp.json")
    if args.tinystories:
        records += tinystories_prompts(args.data / "tinystories" / "tinystories_sample.txt")
    args.output.write_text("".join(json.dumps(r) + "\n" for r in records))
    print(f"wrote {len(records)} prompts to {args.output}")


if __name__ == "__main__":
    main()
