"""Shared prefix and chunked prefill on the default model, each measured against its absence in one run.

    python benchmarks/prefix_chunk.py --requests 256 --prefix-tokens 1000 --max-tokens 16 --chunk 256

1. Shared prefix: --requests chat requests whose system prompt is the same --prefix-tokens tokens of text
   (Spec-Bench summarization articles), each with its own question; batch = --batch-size slots. Prints prefill
   time (to every request's first token... measured as the time of the first step that emits for all admitted
   requests), total time, output tokens/s and KV cache bytes, with `--shared-prefix auto` and `off`.
2. Chunked prefill: one 4,000-token prompt and one short request admitted together; time to the short request's
   first token (it asks for one token, so its finishing time is its TTFT) with whole-prompt prefill and with
   --chunk-token chunks. Outputs of each pair are compared token for token.
"""
from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT.parent / "shared" / "data"


def articles() -> list[str]:
    lines = [json.loads(x) for x in (DATA / "spec_bench" / "question.jsonl").read_text().splitlines() if x.strip()]
    return [q["turns"][0] for q in lines if q["category"] == "summarization"]


def text_of_tokens(tok, texts: list[str], n: int) -> list[int]:
    ids: list[int] = []
    for t in texts:
        ids += tok.encode(t, add_special_tokens=False)
        if len(ids) >= n:
            break
    return ids[:n]


def run(lm, reqs, engine_cfg):
    from specgen.api import make_engine
    from specgen.config import SpecConfig

    eng = make_engine(lm, engine_cfg, SpecConfig())
    start = time.perf_counter()
    first_done, outs = None, []
    for out in eng.run(reqs):
        outs.append(out)
        first_done = first_done or time.perf_counter() - start
    total = time.perf_counter() - start
    return outs, total, first_done, eng.memory()


def shared_prefix(lm, args):
    from specgen import EngineConfig, SamplingParams
    from specgen.engine.types import Request

    tok = lm.tokenizer
    system = tok.tokenizer.decode(text_of_tokens(tok, articles(), args.prefix_tokens))
    questions = [json.loads(x)["turns"][0][:200] for x in
                 (DATA / "spec_bench" / "question.jsonl").read_text().splitlines() if x.strip()]
    sp = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    reqs = [Request(str(i), i, tuple(tok.encode_chat([{"role": "system", "content": system},
                                                       {"role": "user", "content": questions[i % len(questions)]}])),
                    sp) for i in range(args.requests)]
    prompt_tokens = sum(len(r.prompt_ids) for r in reqs)
    print(f"shared prefix: {args.requests} requests, {prompt_tokens} prompt tokens, batch {args.batch_size}, "
          f"{args.max_tokens} output tokens each")
    print(f"{'sharing':>8}{'first output s':>16}{'total s':>9}{'out tok/s':>11}{'KV MiB':>9}{'cached tokens':>15}")
    results = {}
    for mode in ("auto", "off"):
        cfg = EngineConfig(batch_size=args.batch_size, shared_prefix=mode, max_prefill_tokens=1 << 20)
        outs, total, first, mem = run(lm, reqs, cfg)
        results[mode] = sorted((o.id, o.token_ids) for o in outs)
        n_out = sum(len(o.token_ids) for o in outs)
        cached = sum(o.stats.num_cached_prompt_tokens for o in outs)
        print(f"{mode:>8}{first:>16.1f}{total:>9.1f}{n_out / total:>11.1f}{mem['kv_cache_bytes'] / 2**20:>9.1f}"
              f"{cached:>15}", flush=True)
    same = sum(a == b for a, b in zip(results["auto"], results["off"]))
    print(f"identical outputs: {same}/{len(reqs)}")


def chunked(lm, args):
    from specgen import EngineConfig, SamplingParams
    from specgen.engine.types import Request

    tok = lm.tokenizer
    long_ids = tuple(tok.encode_chat([{"role": "user", "content": tok.tokenizer.decode(
        text_of_tokens(tok, articles(), args.long_tokens)) + "\nSummarize the articles above."}]))
    short_ids = tuple(tok.encode_chat([{"role": "user", "content": "What is the capital of France?"}]))
    reqs = [Request("long", 0, long_ids, SamplingParams(max_tokens=8, ignore_eos=True)),
            Request("short", 1, short_ids, SamplingParams(max_tokens=1))]
    print(f"\nchunked prefill: a {len(long_ids)}-token prompt and a {len(short_ids)}-token one admitted together")
    print(f"{'chunk':>8}{'short TTFT s':>14}{'long done s':>13}")
    results = {}
    for chunk in (0, args.chunk):
        cfg = EngineConfig(batch_size=2, prefill_chunk=chunk, shared_prefix="off", max_prefill_tokens=8192)
        outs, total, first, _ = run(lm, reqs, cfg)
        results[chunk] = {o.id: o.token_ids for o in outs}
        print(f"{chunk or 'whole':>8}{first:>14.2f}{total:>13.2f}", flush=True)
    print(f"identical outputs: {results[0] == results[args.chunk]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--prefix-tokens", type=int, default=1000)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--long-tokens", type=int, default=4000)
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--only", choices=["prefix", "chunk"], default=None)
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    from specgen import load_model

    lm = load_model(None, threads=args.threads)
    if args.only in (None, "prefix"):
        shared_prefix(lm, args)
    if args.only in (None, "chunk"):
        chunked(lm, args)


if __name__ == "__main__":
    main()
