"""A bf16 checkpoint (what most HF models ship) on 16-bit panels against float32 panels, in one process:

    python benchmarks/half_weights.py [--batch-sizes 1 32] [--max-tokens 64] [--repeats 3] [--methods none ngram]

The checkpoint: the default model's weights rounded to bfloat16 (round to nearest even), held in memory as an HF
checkpoint would load (float32 arrays, no GGUF blocks). Two models of it: one packs its projections and LM head
as 16-bit panels (the default: every weight is exactly a bfloat16), one as float32 panels
(SPECGEN_HALF_WEIGHTS=0); the same bits either way. Each job (Spec-Bench chat prompts, --max-tokens each with
ignore_eos, greedy) runs on both, alternated --repeats times; tok/s is generated tokens over generate()'s wall
time, and the outputs are compared token for token.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import time

import numpy as np


def bf16(a: np.ndarray) -> np.ndarray:
    bits = np.ascontiguousarray(a, np.float32).view(np.uint32).astype(np.uint64)
    return (((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint32) << 16).view(np.float32)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--methods", nargs="+", default=["none", "ngram"])
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    from plain import chat_prompts

    from specgen import EngineConfig, SamplingParams, SpecConfig, generate
    from specgen.api import LoadedModel, set_threads
    from specgen.engine.model import Model
    from specgen.models import load_checkpoint

    set_threads(args.threads)
    ckpt = load_checkpoint(None)
    ckpt = dataclasses.replace(ckpt, weights={k: bf16(w) for k, w in ckpt.weights.items()}, quantized={})
    models = {}
    for name, flag in (("16-bit", "1"), ("float32", "0")):
        os.environ["SPECGEN_HALF_WEIGHTS"] = flag
        m = Model(ckpt)
        models[name] = LoadedModel(model=m, tokenizer=ckpt.tokenizer, config=ckpt.config, source="bf16")
        packed = [L[key] for L in m.w.layers for key in ("w_qkv", "w_o", "w_gate_up", "w_down")] + [m.w.lm_head]
        kinds = sorted({w.kind for w in packed[:-1]})
        size = sum(int(np.prod(w.panels.shape)) * w.panels.element_size() for w in packed)
        print(f"{name} panels: {', '.join(kinds)} (LM head {m.w.lm_head.kind}); {size / 2**20:.0f} MiB per step")
    os.environ.pop("SPECGEN_HALF_WEIGHTS")
    print(f"{'batch':>6} {'method':<7}{'16-bit tok/s':>13}{'float32 tok/s':>14}{'ratio':>8}  runs{'':<18}same tokens")
    for bs in args.batch_sizes:
        prompts = [list(ckpt.tokenizer.encode_chat(m)) for m in chat_prompts(max(bs, 2))]
        sp = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
        for method in args.methods:
            spec = SpecConfig(method=method)
            rates: dict[str, list[float]] = {name: [] for name in models}
            outs = {}
            for rep in range(args.repeats):
                for name in (list(models) if rep % 2 == 0 else list(models)[::-1]):
                    start = time.perf_counter()
                    res = generate(prompts, model=models[name], sampling=sp, speculative=spec,
                                   engine=EngineConfig(batch_size=bs, max_prefill_tokens=8192))
                    rates[name].append(sum(len(o.token_ids) for o in res) / (time.perf_counter() - start))
                    outs.setdefault(name, [o.token_ids for o in res])
            ratios = [a / b for a, b in zip(rates["16-bit"], rates["float32"])]
            med = {k: statistics.median(v) for k, v in rates.items()}
            print(f"{bs:>6} {method:<7}{med['16-bit']:>13.1f}{med['float32']:>14.1f}{statistics.median(ratios):>7.2f}x"
                  f"  ({', '.join(f'{r:.2f}' for r in ratios)})    {'yes' if outs['16-bit'] == outs['float32'] else 'NO'}",
                  flush=True)


if __name__ == "__main__":
    main()
