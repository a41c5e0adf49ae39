"""--method draft_model with drafts cut from the default model (`specgen make-draft --layers L`), against
plain decoding and n-gram speculation, at batch 1, side by side in one run.

    python benchmarks/draft_model.py --layers 2 4 6 --sets code_rewrite qa summarization --prompts 6

Per set and drafter: output tok/s (median of --repeats, arms alternated in each repeat), the speedup over
plain decoding, tokens per step, and how often each verified draft position was accepted. Outputs are checked
to be identical to plain decoding's. The drafts are untrained (no self-distillation): what a cut alone gives.
"""
from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import numpy as np
from common import load_sets, machine, print_table, timed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, nargs="+", default=[2, 4, 6])
    ap.add_argument("--sets", nargs="+", default=["code_rewrite", "qa", "summarization"])
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--adaptive", choices=["on", "off"], default="on")
    args = ap.parse_args()
    from specgen import EngineConfig, Method, SamplingParams, SpecConfig, generate, load_model
    from specgen.models import load_checkpoint
    from specgen.models.export import first_layers, save_hf

    print(machine())
    lm = load_model(None)
    work = Path(tempfile.mkdtemp(prefix="specgen-drafts-"))
    main_ckpt = load_checkpoint(None)
    arms = {"none": SpecConfig(), "ngram": SpecConfig(method=Method.NGRAM, num_speculative_tokens=args.k)}
    for layers in args.layers:
        save_hf(first_layers(main_ckpt, layers), work / f"L{layers}")
        arms[f"draft L{layers}"] = SpecConfig(method=Method.DRAFT_MODEL, draft_model=str(work / f"L{layers}"),
                                              num_speculative_tokens=args.k, adaptive=args.adaptive == "on")
    sets = load_sets(args.prompts, args.prompts)
    sp = SamplingParams(max_tokens=args.max_tokens)
    engine = EngineConfig(batch_size=1)
    for name in args.sets:
        ids = [list(lm.tokenizer.encode_chat(m)) for m in sets[name]]
        tok_s: dict[str, list[float]] = {a: [] for a in arms}
        outs: dict[str, list] = {}
        for rep in range(args.repeats + 1):
            for arm, spec in arms.items():
                got, wall = timed(lambda: generate(ids, model=lm, sampling=sp, engine=engine,
                                                   speculative=spec))
                outs[arm] = got
                if rep:  # the first round warms each arm up (kernels, the draft's load, the cost table)
                    tok_s[arm].append(sum(len(o.token_ids) for o in got) / wall)
        ref = [o.token_ids for o in outs["none"]]
        rows = []
        for arm in arms:
            o = outs[arm]
            steps = sum(x.stats.num_steps for x in o)
            drafted = np.sum([x.stats.drafted_per_position or [0] * args.k for x in o], axis=0)
            accepted = np.sum([x.stats.accepted_per_position or [0] * args.k for x in o], axis=0)
            per_pos = " / ".join(f"{a / d:.2f}" if d else "-" for a, d in zip(accepted, drafted))
            speed = float(np.median([x / y for x, y in zip(tok_s[arm], tok_s["none"])]))
            rows.append([arm, float(np.median(tok_s[arm])), speed, sum(len(x.token_ids) for x in o) / steps,
                         per_pos, [x.token_ids for x in o] == ref])
        print(f"set {name}: {len(ids)} prompts, batch 1, k = {args.k}")
        print_table(["drafter", "tok/s", "vs none", "tok/step", "accepted per position", "identical"], rows)
        print(flush=True)


if __name__ == "__main__":
    main()
