"""What a dataset job's sampling features cost (issue 58): log-probabilities and penalties against plain
decoding, and whether speculation keeps its gain under them.

    python benchmarks/dataset_sampling.py --batch-sizes 1 32 --max-tokens 64 --repeats 2

1. Plain decoding on the default model (fused backend), Spec-Bench prompts, exactly --max-tokens tokens each
   (ignore_eos): greedy; greedy with logprobs and 5 top_logprobs; greedy with repetition_penalty 1.1, presence
   0.3, frequency 0.3; each as tok/s and as a ratio to greedy; and sampled (T 0.8, top-p 0.95) with and
   without logprobs (what they cost where the logits are computed anyway); arms alternated within each
   repeat (medians of the repeats' ratios; the first repeat a warm-up). Then one decode step of that many
   slots at position 300: the forward without logits (greedy's screened LM head) and with them, and the
   log-probabilities operator (top 5) on its rows: what log-probabilities add to a step.
2. MBPP code rewrites at batch 1: ngram (k 5) over plain decoding, without and with the penalties (the same
   penalties in both arms of each ratio), so the two speedups compare.
3. n samples (--samples, T 0.8, ignore_eos) of each Spec-Bench summarization and RAG prompt (--per-set each)
   at batch n: one record with n against the same job written as n copies of each prompt (n prefills), for
   each of --sample-methods (the shipped drafters: their state of the prompt is copied with the KV rows).
4. Scoring prompts: --per-set Spec-Bench prompts of every set, one output token each at batch 8, with
   prompt_logprobs 5 and 0 against none (the LM head over every prompt row is what scoring costs).
"""
from __future__ import annotations

import argparse

import numpy as np
from common import load_sets, machine, print_table, timed
from plain import prompts

PENALTIES = dict(repetition_penalty=1.1, presence_penalty=0.3, frequency_penalty=0.3)
SAMPLED = dict(temperature=0.8, top_p=0.95, seed=1)


def alternated(lm, ids, arms: dict, repeats: int) -> dict[str, list[float]]:
    """tok/s of each arm (name -> (SamplingParams, EngineConfig, SpecConfig[, its own prompts])) per repeat,
    alternated."""
    from specgen import generate

    tok_s: dict[str, list[float]] = {a: [] for a in arms}
    for rep in range(repeats + 1):
        for name, (sp, engine, spec, *own) in arms.items():
            prompts_ = own[0] if own else ids
            outs, wall = timed(lambda: generate(prompts_, model=lm, sampling=sp, engine=engine,
                                                speculative=spec))
            if rep:
                tok_s[name].append(sum(len(o.token_ids) for o in outs) / wall)
    return tok_s


def step_costs(lm, batch: int, repeats: int, position: int = 300) -> list:
    """[batch, decode step ms (no logits), + logits ms, + operator ms, share]: medians over alternated
    repeats of one decode step of `batch` slots at `position`."""
    import time

    from specgen.runtime.batch import build_forward_batch

    m, rng = lm.model, np.random.default_rng(0)
    cache = m.new_cache(batch, position + 16)
    slots = np.arange(batch)
    prompts = rng.integers(0, m.config.vocab_size, batch * position)
    m.forward(build_forward_batch(slots, np.zeros(batch, np.int64), np.full(batch, position), prompts,
                                  np.zeros(batch, bool)), cache, logits=False)
    step = build_forward_batch(slots, np.full(batch, position), np.ones(batch, np.int64),
                               rng.integers(0, m.config.vocab_size, batch), np.zeros(batch, bool))
    times: dict[str, list[float]] = {"plain": [], "logits": [], "op": []}
    for _ in range(repeats):
        for name in ("plain", "logits"):
            start = time.perf_counter()
            out = m.forward(step, cache, logits=name == "logits")
            times[name].append(time.perf_counter() - start)
        start = time.perf_counter()
        m.logprobs(out.logits, slots, out.greedy, 5)
        times["op"].append(time.perf_counter() - start)
    plain, logits, op = (1e3 * float(np.median(times[k])) for k in ("plain", "logits", "op"))
    return [batch, plain, logits - plain, op, (logits - plain + op) / plain]


def ratio(tok_s: dict[str, list[float]], a: str, b: str) -> float:
    return float(np.median([x / y for x, y in zip(tok_s[a], tok_s[b])]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--mbpp", type=int, default=4)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--per-set", type=int, default=2)
    ap.add_argument("--sample-methods", nargs="+", default=["none", "mtp", "eagle"])
    ap.add_argument("--parts", type=int, nargs="+", default=[1, 2, 3, 4], help="which parts to run")
    args = ap.parse_args()
    from specgen import EngineConfig, SamplingParams, SpecConfig, load_model

    print(machine())
    lm = load_model(None, backend="fused")
    base = dict(max_tokens=args.max_tokens, ignore_eos=True)
    plain, ngram = SpecConfig(), SpecConfig(method="ngram", num_speculative_tokens=5)
    rows = []
    for bs in args.batch_sizes if 1 in args.parts else []:
        n = 4 if bs == 1 else bs
        ids = [list(lm.tokenizer.encode_chat(m)) for m in prompts(n)]
        engine = EngineConfig(batch_size=bs, max_prefill_tokens=8192)
        arms = {"greedy": (SamplingParams(**base), engine, plain),
                "logprobs": (SamplingParams(**base, logprobs=True, top_logprobs=5), engine, plain),
                "penalties": (SamplingParams(**base, **PENALTIES), engine, plain),
                "sampled": (SamplingParams(**base, **SAMPLED), engine, plain),
                "sampled+lp": (SamplingParams(**base, **SAMPLED, logprobs=True, top_logprobs=5), engine,
                               plain)}
        tok_s = alternated(lm, ids, arms, args.repeats)
        rows.append([bs, n, float(np.median(tok_s["greedy"])), ratio(tok_s, "logprobs", "greedy"),
                     ratio(tok_s, "penalties", "greedy"), ratio(tok_s, "sampled+lp", "sampled")])
    print_table(["batch", "requests", "greedy tok/s", "logprobs / greedy", "penalties / greedy",
                 "sampled: logprobs / none"], rows, 3)
    print(flush=True)
    if 1 in args.parts:
        print_table(["batch", "step ms", "logits ms", "operator ms", "share of the step"],
                    [step_costs(lm, bs, 9 * args.repeats + 12) for bs in args.batch_sizes], 3)
        print(flush=True)
    if 2 not in args.parts:
        if 3 in args.parts:
            samples(lm, args)
        return scoring(lm, args) if 4 in args.parts else None
    code = [list(lm.tokenizer.encode_chat(m)) for m in load_sets(0, args.mbpp)["code_rewrite"]]
    engine = EngineConfig(batch_size=1)
    sp = SamplingParams(max_tokens=args.max_tokens)
    pen = SamplingParams(max_tokens=args.max_tokens, **PENALTIES)
    tok_s = alternated(lm, code, {"plain": (sp, engine, plain), "ngram": (sp, engine, ngram),
                                  "plain+pen": (pen, engine, plain), "ngram+pen": (pen, engine, ngram)},
                       args.repeats)
    print_table(["code rewrite, batch 1", "plain tok/s", "ngram / plain"],
                [["no penalties", float(np.median(tok_s["plain"])), ratio(tok_s, "ngram", "plain")],
                 ["penalties", float(np.median(tok_s["plain+pen"])),
                  ratio(tok_s, "ngram+pen", "plain+pen")]], 3)
    print(flush=True)
    if 3 in args.parts:
        samples(lm, args)
    if 4 in args.parts:
        scoring(lm, args)


def scoring(lm, args) -> None:
    """Part 4: prompt_logprobs against plain prefill (one output token a prompt)."""
    from specgen import EngineConfig, SamplingParams, SpecConfig

    chats = [list(lm.tokenizer.encode_chat(m)) for s in load_sets(args.per_set, 0).values() for m in s]
    engine, plain = EngineConfig(batch_size=8, max_prefill_tokens=8192), SpecConfig()
    tok_s = alternated(lm, chats, {k: (SamplingParams(max_tokens=1, prompt_logprobs=v), engine, plain)
                                   for k, v in (("plain", None), ("top 5", 5), ("top 0", 0))}, args.repeats)
    print_table(["prompts", "prompt tokens", "speed: prompt_logprobs 5 / none", "prompt_logprobs 0 / none"],
                [[len(chats), sum(map(len, chats)), ratio(tok_s, "top 5", "plain"),
                  ratio(tok_s, "top 0", "plain")]], 3)
    print(flush=True)


def samples(lm, args) -> None:
    """Part 3: n samples against n copies of each prompt, per method."""
    from specgen import EngineConfig, SamplingParams, SpecConfig

    sets = load_sets(args.per_set, 0)
    n, rows = args.samples, []
    for name in ("summarization", "rag"):
        chats = [list(lm.tokenizer.encode_chat(m)) for m in sets[name]]
        sampled = dict(max_tokens=args.max_tokens, ignore_eos=True, temperature=0.8, seed=1)
        engine = EngineConfig(batch_size=n, max_prefill_tokens=8192)
        copies = [c for c in chats for _ in range(n)]
        for method in args.sample_methods:
            spec = SpecConfig(method=method)
            tok_s = alternated(lm, chats, {"n": (SamplingParams(**sampled, n=n), engine, spec),
                                           "copies": (SamplingParams(**sampled), engine, spec, copies)},
                               args.repeats)
            rows.append([name, method, len(chats), float(np.median(tok_s["copies"])),
                         float(np.median(tok_s["n"])), ratio(tok_s, "n", "copies")])
    print_table(["set", "method", "prompts", f"{n} copies tok/s", f"n = {n} tok/s", "n / copies"], rows, 3)


if __name__ == "__main__":
    main()
