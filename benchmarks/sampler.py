"""What sampling costs: the sampler against a plain decoding step, sampled plain decoding against greedy.

    python benchmarks/sampler.py --batch-sizes 1 32 --max-tokens 128 --repeats 3

1. The sampler on the default model's own logits (a Spec-Bench prompt's next-token rows): the fused operator
   (kernels/sampling.cc) as the engine calls it, alone (its settings already a tensor), and that call with
   every row greedy (Paddle's cost of a call, no row's work), and the Paddle reference
   (layers/sampling.py), at 1 and 32 rows, T --temperature, top-p --top-p; beside a greedy decoding step's
   time at that batch (one token a slot), as a share of it; and that step computing every row's logits (a
   sampled step's forward: the greedy one's screened LM head skips them), which with the sampler bounds
   sampled against greedy plain decoding at that batch. With --top-p 1 (no filter) also the step that samples
   its rows in the forward, from the LM head's screen (the engine's path for such rows), and its bound.
2. Whole jobs on the fused backend: sampled (T --temperature, top-p --top-p) against greedy plain decoding, at
   each batch size, the same prompts and exactly --max-tokens tokens each (ignore_eos); the two arms
   alternated within each repeat, the ratio the median of the repeats' ratios. The first repeat is a warm-up.
"""
from __future__ import annotations

import argparse

import numpy as np
from common import machine, print_table, repeat_times, timed
from plain import prompts


def median_us(f, n: int) -> float:
    return float(np.median(repeat_times(f, n))) * 1e6


def sampler_costs(lm, temperature: float, top_p: float, repeats: int) -> list[list]:
    """Rows: (sampler, rows, us, share of a greedy one-token-a-slot step at that batch)."""
    import paddle

    from specgen.backends.base import RowSampling
    from specgen.kernels import args
    from specgen.layers.sampling import sample
    from specgen.runtime.batch import build_forward_batch

    model = lm.model
    ids = np.array(lm.tokenizer.encode_chat(prompts(1)[0]), np.int64)
    rows = []
    for n in (1, 32):
        cache = model.new_cache(n, 1024)
        slots = np.arange(n, dtype=np.int64)
        prompt = build_forward_batch(slots, np.zeros(n, np.int64), np.full(n, len(ids)), np.tile(ids, n),
                                     np.zeros(n, bool))
        out = model.forward(prompt, cache, logits=True)  # logits [n, vocab]: each slot's next-token row
        step = build_forward_batch(slots, np.full(n, len(ids)), np.ones(n, np.int64), out.greedy,
                                   np.zeros(n, bool))
        s = RowSampling(np.full(n, temperature), np.zeros(n, np.int64), np.full(n, top_p), np.zeros(n),
                        np.arange(n, dtype=np.uint64), np.full(n, 7))
        # a greedy step (a screened LM head: no logits), the same step with every row's logits (a sampled
        # step's forward), and, where the rows have no filter and the backend can, the step sampling its rows
        # from the screen's bounds (no logits), alternated
        in_forward = model.samples_in_forward and s.unfiltered()
        greedy_s, logits_s, drawn_s = [], [], []
        for _ in range(repeats):
            greedy_s += repeat_times(lambda: model.forward(step, cache, logits=False), 5)
            logits_s += repeat_times(lambda: model.forward(step, cache, logits=True), 5)
            if in_forward:
                drawn_s += repeat_times(lambda: model.forward(step, cache, logits=False, sampling=s), 5)
        step_us, logits_us = float(np.median(greedy_s)) * 1e6, float(np.median(logits_s)) * 1e6
        # the operator alone, its settings already a tensor; that call with every row greedy (no row's work)
        params = [paddle.to_tensor(np.stack(args.sample_rows(args.SampleArgs(
            s.temperature * on, s.top_k, s.top_p, s.min_p, s.key, s.position, out.greedy))).astype(
            np.float64)) for on in (1.0, 0.0)]
        ops = model.backend.ops
        arms = {"fused": lambda: model.sample(out.logits, s, out.greedy),
                "fused operator alone": lambda: ops.specgen_sample(out.logits, params[0]),
                "its call, rows greedy": lambda: ops.specgen_sample(out.logits, params[1]),
                "reference": lambda: sample(out.logits, s.temperature, s.top_k, s.top_p, s.streams(),
                                            out.greedy, s.min_p)}
        for name, f in arms.items():
            us = median_us(f, 10 * repeats)
            rows.append([name, n, us, us / step_us])
            if name == "fused":
                fused_us = us
        rows.append(["greedy step", n, step_us, 1.0])
        rows.append(["step with logits", n, logits_us, logits_us / step_us])
        if in_forward:
            drawn_us = float(np.median(drawn_s)) * 1e6
            rows.append(["step sampling in the forward", n, drawn_us, drawn_us / step_us])
            rows.append(["bound: greedy / that step", n, None, step_us / drawn_us])
        # what sampled plain decoding could reach against greedy at this batch, the host aside
        rows.append(["bound: greedy / (logits + fused)", n, None, step_us / (logits_us + fused_us)])
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--top-p", type=float, default=0.95)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    from specgen import EngineConfig, SamplingParams, generate, load_model

    print(machine())
    lm = load_model(None, threads=args.threads, backend="fused")
    print_table(["sampler", "rows", "us", "of a greedy step"], sampler_costs(lm, args.temperature, args.top_p,
                                                                            args.repeats), digits=3)
    print(flush=True)
    arms = {"greedy": SamplingParams(max_tokens=args.max_tokens, ignore_eos=True),
            "sampled": SamplingParams(max_tokens=args.max_tokens, ignore_eos=True,
                                      temperature=args.temperature, top_p=args.top_p, seed=1)}
    rows = []
    for bs in args.batch_sizes:
        n = 2 if bs == 1 else bs
        ids = [list(lm.tokenizer.encode_chat(m)) for m in prompts(n)]
        engine = EngineConfig(batch_size=bs, max_prefill_tokens=8192, backend="fused")
        tok_s: dict[str, list[float]] = {a: [] for a in arms}
        for rep in range(args.repeats + 1):
            for name, sp in arms.items():
                outs, wall = timed(lambda: generate(ids, model=lm, sampling=sp, engine=engine))
                if rep:
                    tok_s[name].append(sum(len(o.token_ids) for o in outs) / wall)
        ratio = float(np.median([s / g for s, g in zip(tok_s["sampled"], tok_s["greedy"])]))
        rows.append([bs, n, float(np.median(tok_s["greedy"])), float(np.median(tok_s["sampled"])), ratio])
    print_table(["batch", "requests", "greedy tok/s", "sampled tok/s", "sampled / greedy"], rows, digits=3)


if __name__ == "__main__":
    main()
