"""scripts/make_mtp_train_prompts.py: the extra standard-library prompts are deterministic, well-formed and
disjoint from the prompts the benchmarks evaluate on."""
from __future__ import annotations

import ast
import importlib.util
import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT.parent / "shared" / "data"


@pytest.fixture(scope="module")
def script():
    spec = importlib.util.spec_from_file_location("make_mtp_train_prompts", ROOT / "scripts" /
                                                  "make_mtp_train_prompts.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _code(prompt: dict) -> str:
    text = prompt["messages"][0]["content"]
    return re.search(r"```python\n(.*)\n```", text, re.S).group(1)


def test_stdlib_code_prompts_are_deterministic_functions_without_docstrings(script):
    first, again = script.stdlib_code_prompts(40), script.stdlib_code_prompts(40)
    assert first == again and len(first) == 40
    assert len({p["id"] for p in first}) == 40
    lo, hi = script.CODE_LINES
    for prompt in first:
        assert prompt["messages"][0]["content"] == script.REWRITE.format(code=_code(prompt))
        code = _code(prompt)
        assert lo <= len(code.splitlines()) <= hi
        (fn,) = ast.parse(code).body  # one whole function, as the MBPP prompts hold
        assert isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef))
        assert ast.get_docstring(fn) is None
    # spread over the library, not the first files only
    assert len({p["id"].split("-")[1].split(".")[0] for p in first}) > 20


def test_stdlib_prose_prompts_are_deterministic_passages(script):
    first = script.stdlib_prose_prompts(30)
    assert first == script.stdlib_prose_prompts(30) and len(first) == 30
    assert len({p["id"] for p in first}) == 30
    lo, hi = script.PROSE_CHARS
    for prompt in first:
        text = prompt["messages"][0]["content"]
        assert text.startswith("Summarize: ")
        assert lo <= len(text) - len("Summarize: ") <= hi


def test_evenly_spreads_and_keeps_short_lists(script):
    assert script._evenly(list(range(10)), 3) == [0, 3, 6]
    assert script._evenly([1, 2], 5) == [1, 2]


def test_extra_prompts_are_disjoint_from_the_evaluation_prompts(script):
    questions = DATA / "spec_bench" / "question.jsonl"
    mbpp = DATA / "mbpp" / "sanitized-mbpp.json"
    if not questions.exists() or not mbpp.exists():
        pytest.skip("shared data sets not laid out beside the project")
    seen: dict[str, int] = {}
    evaluated = set()
    for line in questions.read_text().splitlines():
        q = json.loads(line)
        index = seen.get(q["category"], 0)
        seen[q["category"]] = index + 1
        if index < script.EVAL_PER_CATEGORY:
            evaluated.add(q["turns"][0])
    eval_code = {" ".join(m["code"].split()) for m in json.loads(mbpp.read_text())[:script.EVAL_MBPP]}
    extra = script.stdlib_code_prompts(300) + script.stdlib_prose_prompts(100)
    assert not {p["messages"][0]["content"] for p in extra} & evaluated
    assert not {" ".join(_code(p).split()) for p in extra[:300]} & eval_code


def _spec_bench(tmp_path: Path, per_category: int) -> Path:
    """A Spec-Bench-shaped file: per_category items of each kind the variants derive from."""
    lines, qid = [], 0
    for i in range(per_category):
        sentences = " ".join(f"Sentence {i}.{s} tells of the town's {s}th mayor." for s in range(9))
        docs = "\n".join(f"Passage {i}.{d} about river number {d}." for d in range(5))
        items = {"summarization": f"Summarize: {sentences}",
                 "rag": f"{docs}\nWhich river is number {i}?",
                 "math_reasoning": f"Ann has {i + 3} apples and buys 12 more at 1.5 dollars. How many now?",
                 "translation": f"Translate German to English: Satz Nummer {i} .",
                 "qa": f"Who was person number {i}?"}
        for category, text in items.items():
            qid += 1
            lines.append(json.dumps({"question_id": qid, "category": category, "turns": [text]}))
    path = tmp_path / "question.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_variants_derive_new_prompts_of_each_kind_from_training_items_only(script, tmp_path):
    path = _spec_bench(tmp_path, script.EVAL_PER_CATEGORY + 4)
    out = script.spec_bench_variants(path, 3)
    assert out == script.spec_bench_variants(path, 3)
    assert len({p["id"] for p in out}) == len(out)
    items, index, seen = {}, {}, {}
    for line in path.read_text().splitlines():
        q = json.loads(line)
        items[q["question_id"]] = q
        index[q["question_id"]] = seen.get(q["category"], 0)
        seen[q["category"]] = index[q["question_id"]] + 1
    originals = {q["turns"][0] for q in items.values()}
    by_kind: dict[str, list[str]] = {}
    for p in out:
        qid = int(p["id"].split("-")[1])
        assert index[qid] >= script.EVAL_PER_CATEGORY  # training items only
        item, text = items[qid], p["messages"][0]["content"]
        assert text not in originals
        by_kind.setdefault(item["category"], []).append(text)
        original = item["turns"][0]
        if item["category"] == "summarization":
            assert text.startswith("Summarize: ") and text.removeprefix("Summarize: ") in original
        elif item["category"] == "rag":
            lines = text.split("\n")
            assert lines[-1] == original.split("\n")[-1] and len(lines) == 5
            assert set(lines[:-1]) < set(original.split("\n")[:-1])
        elif item["category"] == "math_reasoning":
            assert re.sub(r"\d+", "N", text) == re.sub(r"\d+", "N", original) and "1.5 dollars" in text
        elif item["category"] == "translation":
            assert text.startswith(original + " Satz Nummer ")
    assert set(by_kind) == {"summarization", "rag", "math_reasoning", "translation", "qa"}
    assert len(by_kind["translation"]) == len(by_kind["qa"]) == 3 * 4
    assert all(len(v) <= 3 * 4 for v in by_kind.values())
    # the first QA variant asks a RAG training item's question alone; the others ask with another instruction
    assert by_kind["qa"][0] == "Which river is number 40?"
    assert by_kind["qa"][1] == script.QA_ASKS[0].format(q="Who was person number 40?")
