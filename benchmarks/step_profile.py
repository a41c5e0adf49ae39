"""Where a decoding step's time goes: plain and n-gram decoding at batch 1, 32 and 256 on the default model.

    python benchmarks/step_profile.py --batch-sizes 1 32 256 --methods none ngram --max-tokens 48

Fills every slot with a Spec-Bench summarization or RAG prompt and runs the job; the engine's step phases are
timed (wrapped, the same calls): planning (the proposer's drafts and the controller's choice), the forward
(one operator on the fused backend), sampling and verification, committing and the proposer's observe, and the
rest of the step (batch layout, stops). Steps that prefill are left out: ms per decoding step, and each
phase's share.
"""
from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict

from common import DATA, machine, print_table

PHASES = ("_plan", "forward", "_sample", "_commit", "_observe")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 32, 256])
    ap.add_argument("--methods", nargs="+", default=["none", "ngram"])
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    from specgen import EngineConfig, SamplingParams, SpecConfig, generate, load_model
    from specgen.engine.engine import Engine
    from specgen.models.model import Model

    print(machine())
    lm = load_model(None, threads=args.threads)
    questions = [json.loads(x) for x in (DATA / "spec_bench" / "question.jsonl").read_text().splitlines()
                 if x.strip()]
    texts = [q["turns"][0] for q in questions if q["category"] in ("summarization", "rag")]
    seconds: dict[str, float] = defaultdict(float)
    prefilling = [True]  # or outside a step

    def timed(cls, name):
        original = getattr(cls, name)

        def wrapper(*a, **kw):
            start = time.perf_counter()
            try:
                return original(*a, **kw)
            finally:
                if not prefilling[0]:
                    seconds[name.strip("_")] += time.perf_counter() - start

        setattr(cls, name, wrapper)

    step = Engine.step

    def counted_step(self):
        prefilling[0] = bool((self.table.active & ~self.table.prefilled).any())
        start = time.perf_counter()
        try:
            return step(self)
        finally:
            if not prefilling[0]:
                seconds["step"] += time.perf_counter() - start
                seconds["steps"] += 1
            prefilling[0] = True  # forwards outside steps (the cost table's) are not counted

    Engine.step = counted_step
    for name in PHASES:
        timed(Model if name == "forward" else Engine, name)
    rows = []
    for bs in args.batch_sizes:
        prompts = [list(lm.tokenizer.encode_chat([{"role": "user", "content": texts[i % len(texts)][:1500]}]))
                   for i in range(bs)]
        for method in args.methods:
            spec = SpecConfig() if method == "none" else SpecConfig(method=method, num_speculative_tokens=5)
            sp = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
            generate(prompts, model=lm, sampling=SamplingParams(max_tokens=4), speculative=spec,
                     engine=EngineConfig(batch_size=bs))  # the job's start-up (its cost table), not timed
            seconds.clear()
            generate(prompts, model=lm, sampling=sp, engine=EngineConfig(batch_size=bs), speculative=spec)
            n, total = seconds.pop("steps"), seconds.pop("step")
            parts = {k: seconds.get(k, 0.0) for k in ("plan", "forward", "sample", "commit", "observe")}
            rest = total - sum(parts.values())
            rows.append([bs, method, int(n), 1e3 * total / n]
                        + [f"{1e3 * v / n:.2f} ({v / total:.0%})" for v in [*parts.values(), rest]])
        print_table(["batch", "method", "steps", "ms/step", "plan", "forward", "sample", "commit", "observe",
                     "rest"], rows)
        print(flush=True)


if __name__ == "__main__":
    main()
