"""Structured output (issue 59): valid JSON, the grammar's cost, and what grammar-forced drafts gain.

    python benchmarks/structured.py --repeats 2

A set of 60 extraction and classification prompts in five groups of 12 (news articles -> headline, people,
topic, sentiment; GSM8K problems -> numbers, unit, operation; MBPP functions -> name, arguments, return type;
Spec-Bench questions -> category, answer type, difficulty; Spec-Bench RAG passages -> answer, support),
each a chat prompt with its JSON schema as the request's response_format, on the default model, greedy.

1. Validity: every output that stops parses and validates against its schema (the jsonschema package); how
   many reached --max-tokens instead.
2. Speed at batch 1, each group's arms back to back in each repeat (medians of the repeats' ratios):
   constrained plain decoding (method none, no forced drafts), forced drafts alone (none), ngram without them,
   ngram with them (the default), as tok/s per group and over the set; every arm's tokens must equal plain's.
   The prompts' prefill is timed alone (max_tokens 1): the decode ratio is each job's less it, and the bound
   is the whole-job ratio decoding in no time would reach (these jobs' prompts are long, their outputs short).
3. The grammar's share of the job at batch 1 and 32 (ngram with forced drafts, and plain): seconds in the
   matchers (masks, forced tokens, draft cuts, commits) and in processing the rows (copied out of the logits,
   masked), over the job's wall time. Not counted: the LM head's full logits, which a greedy job without a
   grammar skips (a screened head gives the argmax).
"""
from __future__ import annotations

import argparse
import json
import time

import numpy as np
from common import DATA, machine, print_table, timed

TEXT = {"type": "string", "maxLength": 80}
GROUPS = {
    "news": ("Read this news article and extract its headline (your own, short), up to three people it "
             "names, its topic and its sentiment as JSON.\n\n", {
                 "type": "object", "properties": {
                     "headline": TEXT,
                     "people": {"type": "array", "items": {"type": "string", "maxLength": 40}, "maxItems": 3},
                     "topic": {"enum": ["politics", "sports", "business", "science", "entertainment", "crime",
                                        "health", "other"]},
                     "sentiment": {"enum": ["positive", "neutral", "negative"]}},
                 "required": ["headline", "people", "topic", "sentiment"], "additionalProperties": False}),
    "math": ("Extract the numbers in this math problem, the unit of its answer and the main operation it "
             "needs, as JSON.\n\n", {
                 "type": "object", "properties": {
                     "numbers": {"type": "array", "items": {"type": "number"}, "maxItems": 6},
                     "unit": {"type": "string", "maxLength": 20},
                     "operation": {"enum": ["add", "subtract", "multiply", "divide", "mixed"]}},
                 "required": ["numbers", "unit", "operation"], "additionalProperties": False}),
    "code": ("Describe this Python function as JSON: its name, how many arguments it takes, what it returns "
             "and whether it loops.\n\n", {
                 "type": "object", "properties": {
                     "function_name": {"type": "string", "pattern": "^[a-z_][a-z0-9_]{0,39}$"},
                     "num_arguments": {"type": "integer", "minimum": 0, "maximum": 9},
                     "returns": {"enum": ["int", "float", "str", "bool", "list", "dict", "tuple", "None",
                                          "other"]},
                     "uses_loop": {"type": "boolean"}},
                 "required": ["function_name", "num_arguments", "returns", "uses_loop"],
                 "additionalProperties": False}),
    "qa": ("Classify this question as JSON: its category, the type of answer it asks for and how hard it "
           "is.\n\n", {
               "type": "object", "properties": {
                   "category": {"enum": ["science", "history", "geography", "culture", "technology", "sports",
                                         "other"]},
                   "answer_type": {"enum": ["person", "place", "date", "number", "thing", "explanation"]},
                   "difficulty": {"enum": ["easy", "medium", "hard"]}},
               "required": ["category", "answer_type", "difficulty"], "additionalProperties": False}),
    "rag": ("Answer the question from the passage, as JSON with a short answer and whether the passage "
            "supports it.\n\n", {
                "type": "object", "properties": {"answer": TEXT, "supported": {"type": "boolean"}},
                "required": ["answer", "supported"], "additionalProperties": False}),
}


def extraction_set(per_group: int) -> dict[str, list[tuple[list[dict], dict]]]:
    """{group: [(chat messages, schema)]}: per_group items of each group, from the shared data sets."""
    spec = [json.loads(line) for line in (DATA / "spec_bench" / "question.jsonl").read_text().splitlines()
            if line.strip()]
    texts = {
        "news": [q["turns"][0].split("\n", 1)[-1][:1500] for q in spec if q["category"] == "summarization"],
        "math": [json.loads(line)["question"] for line in
                 (DATA / "gsm8k" / "train.jsonl").read_text().splitlines()[:per_group]],
        "code": [f["code"] for f in json.loads((DATA / "mbpp" / "sanitized-mbpp.json").read_text())],
        "qa": [q["turns"][0] for q in spec if q["category"] == "qa"],
        "rag": [q["turns"][0][:1500] for q in spec if q["category"] == "rag"],
    }
    out = {}
    for group, (ask, schema) in GROUPS.items():
        out[group] = [([{"role": "user", "content": ask + text}], schema)
                      for text in texts[group][:per_group]]
    return out


def run(lm, items, batch: int, method: str, forced: bool, max_tokens: int):
    from specgen import EngineConfig, SamplingParams, SpecConfig, generate

    ids = [lm.tokenizer.encode_chat(msgs) for msgs, _ in items]
    sp = [SamplingParams(max_tokens=max_tokens, response_format=schema) for _, schema in items]
    return generate(ids, model=lm, sampling=sp, engine=EngineConfig(batch_size=batch, forced_drafts=forced),
                    speculative=SpecConfig(method=method))


class GrammarClock:
    """Seconds spent in the grammar's work: the matchers' calls, and processing the constrained rows
    (engine/rows.py `processed`: the rows copied out of the logits, masked, scattered back for sampling; no
    penalties in this job)."""

    def __init__(self):
        import specgen.engine.engine as engine
        from specgen.engine.grammar import Grammars

        self.seconds = 0.0
        self.patched = [(Grammars, n) for n in ("forced", "cut", "commit", "place")]
        self.patched.append((engine, "processed"))
        self.saved = [getattr(cls, n) for cls, n in self.patched]
        for (cls, name), fn in zip(self.patched, self.saved):
            setattr(cls, name, self._timed(fn))

    def _timed(self, fn):
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start
        return wrapper

    def close(self):
        for (cls, name), fn in zip(self.patched, self.saved):
            setattr(cls, name, fn)


ARMS = {"plain": ("none", False), "forced": ("none", True), "ngram": ("ngram", False),
        "ngram+forced": ("ngram", True)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--per-group", type=int, default=12)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 32])
    args = ap.parse_args()
    import jsonschema

    from specgen import load_model

    print(machine())
    lm = load_model(None)
    sets = extraction_set(args.per_group)
    everything = [item for items in sets.values() for item in items]
    print(f"{len(everything)} prompts in {len(sets)} groups, max_tokens {args.max_tokens}, greedy")

    # 1. validity (plain constrained decoding's outputs; every arm's equal them, checked below)
    plain = {g: run(lm, items, 1, "none", False, args.max_tokens) for g, items in sets.items()}
    rows = []
    for g, outs in plain.items():
        stopped = [(o, schema) for o, (_, schema) in zip(outs, sets[g]) if o.finish_reason == "stop"]
        valid = 0
        for o, schema in stopped:
            try:
                jsonschema.validate(json.loads(o.text), schema)
                valid += 1
            except (json.JSONDecodeError, jsonschema.ValidationError):
                pass
        rows.append([g, len(outs), len(stopped), valid, len(outs) - len(stopped),
                     np.mean([len(o.token_ids) for o in outs])])
    print("\n1. validity (plain constrained decoding, batch 1)")
    print_table(["group", "prompts", "stopped", "valid JSON of its schema", "reached max_tokens",
                 "mean tokens"], rows, digits=1)

    # 2. speed at batch 1: each group's arms back to back in each repeat (the machine's drift between them
    # small), the prompts' prefill timed alone (max_tokens 1) to split each job into prefill and decode
    wall = {(a, g): [] for a in (*ARMS, "prefill") for g in sets}
    tokens = {}
    forced_share = {}
    for rep in range(args.repeats + 1):
        for g, items in sets.items():
            for arm, (method, forced) in (*ARMS.items(), ("prefill", ("none", False))):
                max_tokens = 1 if arm == "prefill" else args.max_tokens
                outs, seconds = timed(lambda: run(lm, items, 1, method, forced, max_tokens))
                if arm == "prefill":
                    if rep:
                        wall[(arm, g)].append(seconds)
                    continue
                assert [o.token_ids for o in outs] == [o.token_ids for o in plain[g]], (arm, g)
                n = sum(len(o.token_ids) for o in outs)
                tokens[g] = n
                if rep:
                    wall[(arm, g)].append(seconds)
                forced_share[(arm, g)] = (sum(o.stats.num_forced_tokens for o in outs) / n,
                                          n / sum(o.stats.num_steps for o in outs))
    print("\n2. batch 1: tok/s (median of repeats), whole-job ratio to constrained plain decoding (median of "
          "the repeats' ratios), decode ratio (each job less its prompts' prefill, timed alone), bound (the "
          "whole-job ratio if decoding took no time); ngram+forced: share of output tokens that were forced "
          "drafts, tokens per step")

    def med(values):
        return float(np.median(values))

    rows = []
    for g in [*sets, "all"]:
        groups = list(sets) if g == "all" else [g]
        per_rep = {a: [sum(wall[(a, h)][r] for h in groups) for r in range(args.repeats)]
                   for a in (*ARMS, "prefill")}
        n = sum(tokens[h] for h in groups)
        row = [g]
        for arm in ARMS:
            row += [n / med(per_rep[arm]), med([p / a for p, a in zip(per_rep["plain"], per_rep[arm])]),
                    med([(p - f) / (a - f) for p, a, f in zip(per_rep["plain"], per_rep[arm],
                                                               per_rep["prefill"])])]
        row.append(med([p / f for p, f in zip(per_rep["plain"], per_rep["prefill"])]))
        row += list(forced_share[("ngram+forced", g)]) if g != "all" else [None, None]
        rows.append(row)
    print_table(["group"] + [f"{a} {c}" for a in ARMS for c in ("tok/s", "x", "decode x")]
                + ["bound", "forced", "tok/step"], rows)

    # 3. the grammar's share of the job
    print("\n3. the grammar's share of the job's wall time (matchers + masking rows)")
    rows = []
    for batch in args.batch_sizes:
        for arm in ("plain", "ngram+forced"):
            method, forced = ARMS[arm]
            run(lm, everything[:batch], batch, method, forced, 8)  # warm
            clock = GrammarClock()
            try:
                outs, wall = timed(lambda: run(lm, everything, batch, method, forced, args.max_tokens))
            finally:
                clock.close()
            rows.append([batch, arm, wall, clock.seconds, clock.seconds / wall,
                         sum(len(o.token_ids) for o in outs) / wall])
    print_table(["batch", "arm", "wall s", "grammar s", "share", "tok/s"], rows, digits=3)


if __name__ == "__main__":
    main()
