"""Write the prompts `specgen train-mtp` trains the default head on, disjoint from the evaluation prompts.

    python scripts/make_mtp_train_prompts.py -o mtp_train_prompts.jsonl [--tinystories] [--stdlib-code N]
        [--stdlib-prose N] [--variants N]

Evaluation (benchmarks/speculation.py, through benchmarks/common.py) uses the first EVAL_PER_CATEGORY
Spec-Bench prompts of each category and the first EVAL_MBPP MBPP items; training uses Spec-Bench items at
index >= EVAL_PER_CATEGORY within their category (first turn), MBPP items from TRAIN_MBPP_FROM on, with the
same code-rewriting prompt, and optionally the TinyStories sample (each story's first sentences, to continue).

The shared data holds only 400 prompts outside the evaluation slices. `--stdlib-code N` adds N code-rewriting
prompts (the same wording as the MBPP ones) built from functions of Python's own standard library, and
`--stdlib-prose N` adds N "Summarize:" prompts (Spec-Bench's wording) built from passages of its prose
documentation (`pydoc_data.topics`) and module docstrings. Both are on every machine that runs Python,
disjoint from the evaluation prompts, and chosen deterministically (sorted files, evenly spaced picks).

`--variants N` adds N prompts per training Spec-Bench item, derived from that item so that the model writes
new text of the same kind: a summarization article's sentences cut to a different span, a RAG item's passages
rotated and one left out, a math problem's numbers changed, two translation sentences joined, a QA question
asked with another instruction (the first variant of each QA item asks a RAG training item's question alone;
both sets come from Natural Questions). Variants use training items only, so they stay disjoint from the
evaluation prompts; the same data gives the same variants.
"""
from __future__ import annotations

import argparse
import ast
import functools
import json
import random
import re
import sysconfig
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT.parent / "shared" / "data"
EVAL_PER_CATEGORY = 40
EVAL_MBPP = 200
TRAIN_MBPP_FROM = 227
SUMMARIZE = "Summarize: {text}"
CODE_LINES = (6, 40)  # standard-library functions of this many lines make code-rewriting prompts
PROSE_CHARS = (800, 3500)  # prose passages of this many characters make summarization prompts
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


def _training_items(path: Path) -> dict[str, list[dict]]:
    """Spec-Bench's training items (index >= EVAL_PER_CATEGORY within their category), by category."""
    out: dict[str, list[dict]] = {}
    for q in (json.loads(x) for x in path.read_text().splitlines() if x.strip()):
        out.setdefault(q["category"], []).append(q)
    return {c: qs[EVAL_PER_CATEGORY:] for c, qs in out.items() if len(qs) > EVAL_PER_CATEGORY}


QA_ASKS = ("Answer in one sentence: {q}", "Explain in detail: {q}",
           "{q} Give the answer and the reason for it.")


def _variant(category: str, text: str, j: int, n: int, items: list[dict], i: int,
             rng: random.Random) -> str | None:
    """Variant j (1..n) of training item i of `category` (its first turn `text`), or None where it has
    none."""
    if category == "summarization":
        body = text.removeprefix("Summarize: ")
        sentences = re.split(r"(?<=[.!?]) ", body)
        span = max(4, (2 * len(sentences)) // 3)
        if len(sentences) <= span:
            return None
        start = round(j * (len(sentences) - span) / n)
        return SUMMARIZE.format(text=" ".join(sentences[start:start + span]))
    if category == "rag":
        lines = text.split("\n")
        docs, question = lines[:-1], lines[-1]
        if len(docs) < 3:
            return None
        r = j % len(docs)
        return "\n".join((docs[r:] + docs[:r])[:-1] + [question])
    if category == "math_reasoning":
        def change(m: re.Match) -> str:
            x = int(m.group())
            return str(max(2, round(x * rng.uniform(0.5, 1.5)))) if x > 1 else m.group()
        new = re.sub(r"(?<![\d.])\d+(?![\d.])", change, text)
        return new if new != text else None
    if category == "translation":
        other = items[(i + j) % len(items)]["turns"][0].split(": ", 1)[-1]
        return f"{text} {other}"
    return None


def spec_bench_variants(path: Path, n: int) -> list[dict]:
    """n prompts per training Spec-Bench item, derived from it (module docstring, `--variants`)."""
    items = _training_items(path)
    rag_questions = [q["turns"][0].split("\n")[-1] for q in items.get("rag", [])]
    # every first turn of the file, evaluation items included: a variant never repeats a prompt there
    out, seen = [], {json.loads(x)["turns"][0] for x in path.read_text().splitlines() if x.strip()}
    for category, qs in sorted(items.items()):
        for i, q in enumerate(qs):
            rng, text = random.Random(f"{q['question_id']}"), q["turns"][0]
            for j in range(1, n + 1):
                # first a RAG training item's question alone, then this one asked other ways
                if category == "qa":
                    new = rag_questions[i] if j == 1 and i < len(rag_questions) else \
                        QA_ASKS[(j - 2) % len(QA_ASKS)].format(q=text)
                else:
                    new = _variant(category, text, j, n, qs, i, rng)
                if new and new not in seen:
                    seen.add(new)
                    out.append({"id": f"specbench-{q['question_id']}-v{j}",
                                "messages": [{"role": "user", "content": new}]})
    return out


def mbpp_prompts(path: Path) -> list[dict]:
    items = json.loads(path.read_text())
    return [{"id": f"mbpp-{m['task_id']}",
             "messages": [{"role": "user", "content": REWRITE.format(code=m["code"])}]}
            for m in items[TRAIN_MBPP_FROM:]]


def tinystories_prompts(path: Path) -> list[dict]:
    stories = [s.strip() for s in path.read_text().split("<|endoftext|>") if s.strip()]
    out = []
    for i, story in enumerate(stories):
        opening = ". ".join(story.split(". ")[:2]).strip()
        out.append({"id": f"tinystories-{i}",
                    "messages": [{"role": "user", "content": f"Continue this story:\n\n{opening}"}]})
    return out


def _evenly(items: list, n: int) -> list:
    """n items spread evenly over the list (all of them when it is shorter)."""
    if n >= len(items):
        return items
    return [items[i * len(items) // n] for i in range(n)]


_STDLIB = Path(sysconfig.get_paths()["stdlib"])
_SKIP = ("test", "idlelib", "lib2to3", "site-packages", "turtledemo", "ensurepip")  # tests, tools, vendored


def _stdlib_files() -> list[Path]:
    return [p for p in sorted(_STDLIB.rglob("*.py"))
            if not any(part.startswith(_SKIP) for part in p.relative_to(_STDLIB).parts)]


def _functions(lines: list[str], tree: ast.Module) -> list[tuple[str, str]]:
    """(name, code) of the module's top-level functions of CODE_LINES lines, their docstrings dropped
    (the MBPP functions have none, and the prompt asks for one)."""
    out = []
    for node in tree.body:
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        body = node.body[0]
        has_doc = (isinstance(body, ast.Expr) and isinstance(body.value, ast.Constant)
                   and isinstance(body.value.value, str) and len(node.body) > 1)
        kept = [ln for i, ln in enumerate(lines[node.lineno - 1:node.end_lineno], node.lineno)
                if not (has_doc and body.lineno <= i <= body.end_lineno)]
        if CODE_LINES[0] <= len(kept) <= CODE_LINES[1]:
            out.append((f"{node.name}-{node.lineno}", "\n".join(kept)))
    return out


@functools.cache
def _stdlib_candidates() -> tuple[tuple[tuple[str, str], ...], tuple[tuple[str, str], ...]]:
    """(id, code) of every function and (id, passage) of every module docstring, one parse per file."""
    code, prose = [], []
    for path in _stdlib_files():
        try:
            source = path.read_text(encoding="utf-8")
            tree = ast.parse(source)
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        name = ".".join(path.relative_to(_STDLIB).with_suffix("").parts)
        code += [(f"stdlib-{name}-{key}", text) for key, text in _functions(source.splitlines(), tree)]
        doc = ast.get_docstring(tree)
        prose += [(f"doc-{name}-{i}", p) for i, p in enumerate(_passages(doc))] if doc else []
    return tuple(code), tuple(prose)


def stdlib_code_prompts(n: int) -> list[dict]:
    """Code-rewriting prompts from the standard library's top-level functions, their docstrings dropped."""
    return [{"id": key, "messages": [{"role": "user", "content": REWRITE.format(code=code)}]}
            for key, code in _evenly(list(_stdlib_candidates()[0]), n)]


def _passages(text: str) -> list[str]:
    """Runs of whole paragraphs, each closed once it reaches PROSE_CHARS[0] characters and kept only if it
    stays within PROSE_CHARS[1] (one very long paragraph is dropped, not cut)."""
    out, current = [], ""
    for para in (p.strip() for p in text.split("\n\n")):
        if not para:
            continue
        current = f"{current}\n\n{para}" if current else para
        if len(current) >= PROSE_CHARS[0]:
            if len(current) <= PROSE_CHARS[1]:
                out.append(current)
            current = ""
    return out


@functools.cache
def _prose_candidates() -> tuple[tuple[str, str], ...]:
    import pydoc_data.topics

    topics = pydoc_data.topics.topics
    found = [(f"pydoc-{name}-{i}", p)
             for name in sorted(topics) for i, p in enumerate(_passages(topics[name]))]
    return tuple(found) + _stdlib_candidates()[1]


def stdlib_prose_prompts(n: int) -> list[dict]:
    """Summarization prompts from the standard library's prose documentation and module docstrings."""
    return [{"id": key, "messages": [{"role": "user", "content": SUMMARIZE.format(text=text)}]}
            for key, text in _evenly(list(_prose_candidates()), n)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-o", "--output", type=Path, required=True)
    ap.add_argument("--data", type=Path, default=DATA, help="the shared data folder")
    ap.add_argument("--tinystories", action="store_true", help="add the TinyStories sample")
    ap.add_argument("--stdlib-code", type=int, default=0, metavar="N",
                    help="add N code-rewriting prompts from the Python standard library's functions")
    ap.add_argument("--stdlib-prose", type=int, default=0, metavar="N",
                    help="add N summarization prompts from the standard library's prose documentation")
    ap.add_argument("--variants", type=int, default=0, metavar="N",
                    help="add N prompts per training Spec-Bench item, derived from it (see above)")
    args = ap.parse_args()
    records = spec_bench_prompts(args.data / "spec_bench" / "question.jsonl")
    records += (spec_bench_variants(args.data / "spec_bench" / "question.jsonl", args.variants)
                if args.variants else [])
    records += mbpp_prompts(args.data / "mbpp" / "sanitized-mbpp.json")
    if args.tinystories:
        records += tinystories_prompts(args.data / "tinystories" / "tinystories_sample.txt")
    records += stdlib_code_prompts(args.stdlib_code) if args.stdlib_code else []
    records += stdlib_prose_prompts(args.stdlib_prose) if args.stdlib_prose else []
    args.output.write_text("".join(json.dumps(r) + "\n" for r in records))
    print(f"wrote {len(records)} prompts to {args.output}")


if __name__ == "__main__":
    main()
