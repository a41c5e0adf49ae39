"""--quantization none / wint8 / wint4 on the default model: memory, speed, quality, side by side in one run.

    python benchmarks/quantization.py                       # everything
    python benchmarks/quantization.py --only quality --agreement-prompts 64

The default model's GGUF stores its projections as Q4_1 blocks: `none` runs their dequantized float32 values
(the float model they stand for, and the reference here), `wint8` their Q8_0 quantization, `wint4` (Q4_1) the
blocks as stored, which is also what `auto` runs (its tied head / embedding is Q8_0 in all three but none).

- memory: per mode, a fresh process loads the model (VmRSS after load minus before: the resident weights) and
  runs 2 requests (VmHWM: peak RSS); after a first process has filled the cache, as a rerun loads.
- speed: plain decoding tok/s at each batch size (Spec-Bench prompts, --max-tokens each, ignore_eos), and
  n-gram speculation at batch 1 on MBPP code rewriting; the modes alternated in each repeat, medians, ratio to
  none.
- quality: greedy agreement with none (per prompt, the share of the first --agreement-tokens tokens before the
  first difference, over --agreement-prompts Spec-Bench prompts) and the perplexity of each mode on held-out
  text the model did not generate (../shared/data: TinyStories, then GSM8K problems with their answers; the
  first --ppl-tokens tokens, windows of --ppl-window).
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys

import numpy as np
from common import DATA, load_sets, machine, print_table, timed

MODES = ["none", "wint8", "wint4"]


def rss_kib(field: str) -> int:
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def child_memory(mode: str, threads: int) -> None:
    """Runs in a fresh process: prints {"weights_mib", "peak_mib"} as JSON."""
    import specgen  # noqa: F401  (paddle imported: the baseline holds the runtime, not the weights)
    from specgen import SamplingParams, generate, load_model

    before = rss_kib("VmRSS")
    lm = load_model(None, quantization=mode, threads=threads)
    after = rss_kib("VmRSS")
    generate(["Write a haiku about the sea.", "Explain photosynthesis briefly."], model=lm,
             sampling=SamplingParams(max_tokens=32))
    print(json.dumps({"weights_mib": (after - before) / 1024, "peak_mib": rss_kib("VmHWM") / 1024}))


def memory(threads: int) -> list[list]:
    rows = []
    for mode in MODES:
        for _ in range(2):  # the first may quantize and fill the cache: the second loads as a rerun does
            out = subprocess.run([sys.executable, __file__, "--child-memory", mode,
                                  "--threads", str(threads)],
                                 capture_output=True, text=True, check=True).stdout
        m = json.loads(out.strip().splitlines()[-1])
        rows.append([mode, m["weights_mib"], m["peak_mib"]])
    return rows


def spec_prompts(n: int) -> list[list[dict]]:
    lines = [json.loads(x) for x in (DATA / "spec_bench" / "question.jsonl").read_text().splitlines()
             if x.strip()]
    picked = [lines[(i * 37) % len(lines)] for i in range(n)]
    return [[{"role": "user", "content": q["turns"][0][:400]}] for q in picked]


def speed(models: dict, batch_sizes: list[int], max_tokens: int, repeats: int) -> list[list]:
    from specgen import EngineConfig, Method, SamplingParams, SpecConfig, generate

    tok = models["none"].tokenizer
    sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    jobs = []  # (label, batch, ids, sampling, spec)
    for bs in batch_sizes:
        n = 2 if bs == 1 else bs
        jobs.append((f"plain b{bs}", bs, [list(tok.encode_chat(m)) for m in spec_prompts(n)], sp,
                     SpecConfig()))
    code = [list(tok.encode_chat(m)) for m in load_sets(0, 6)["code_rewrite"]]
    jobs.append(("ngram b1 (code)", 1, code, SamplingParams(max_tokens=max_tokens),
                 SpecConfig(method=Method.NGRAM)))
    rows = []
    for label, bs, ids, sampling, spec in jobs:
        tok_s: dict[str, list[float]] = {m: [] for m in MODES}
        outputs = {}
        for rep in range(repeats + 1):
            for mode, lm in models.items():
                engine = EngineConfig(batch_size=bs, max_prefill_tokens=8192)
                outs, wall = timed(lambda: generate(ids, model=lm, sampling=sampling, engine=engine,
                                                    speculative=spec))
                outputs[mode] = [o.token_ids for o in outs]
                if rep:
                    tok_s[mode].append(sum(len(o.token_ids) for o in outs) / wall)
        for mode in MODES:
            ratio = float(np.median([x / y for x, y in zip(tok_s[mode], tok_s["none"])]))
            rows.append([label, mode, float(np.median(tok_s[mode])), ratio])
        print_table(["job", "mode", "tok/s", "vs none"], rows[-len(MODES):])
        print(flush=True)
    return rows


def agreement(models: dict, n: int, max_tokens: int) -> dict[str, float]:
    from specgen import EngineConfig, SamplingParams, generate

    tok = models["none"].tokenizer
    ids = [list(tok.encode_chat(m)) for m in spec_prompts(n)]
    sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    runs = {m: [o.token_ids for o in generate(ids, model=lm, sampling=sp, engine=EngineConfig(batch_size=32))]
            for m, lm in models.items()}
    out = {}
    for mode in MODES:
        shares = []
        for a, b in zip(runs["none"], runs[mode]):
            same = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            shares.append(same / max_tokens)
        out[mode] = float(np.mean(shares))
    return out


def perplexity(lm, ids: list[int], window: int) -> float:
    """exp(mean NLL) of each token given the ones before it in its window (teacher-forced, one forward
    each)."""
    import paddle

    from specgen.runtime.batch import build_forward_batch

    nll, count = 0.0, 0
    for start in range(0, len(ids) - 1, window):
        chunk = np.asarray(ids[start: start + window + 1], dtype=np.int64)
        n = len(chunk) - 1
        if n < 2:
            break
        batch = build_forward_batch(np.zeros(1, np.int64), np.zeros(1, np.int64), np.array([n]), chunk[:-1],
                                    np.zeros(1, bool))
        hidden = lm.model.forward(batch, lm.model.new_cache(1, n + 1)).hidden  # [n, hidden]
        logits = lm.model.logits(hidden)  # [n, vocab]
        lse = paddle.logsumexp(logits, axis=-1).numpy().astype(np.float64)  # [n]
        target = logits.numpy()[np.arange(n), chunk[1:]].astype(np.float64)  # [n]
        nll += float((lse - target).sum())
        count += n
    return float(np.exp(nll / count))


def held_out_text() -> str:
    """Text written by people, not by the model: the TinyStories sample, then GSM8K training problems with
    their worked answers."""
    parts = [(DATA / "tinystories" / "tinystories_sample.txt").read_text(encoding="utf-8")]
    for line in (DATA / "gsm8k" / "train.jsonl").read_text(encoding="utf-8").splitlines()[:200]:
        item = json.loads(line)
        parts.append(f"{item['question']}\n{item['answer']}")
    return "\n\n".join(parts)


def quality(models: dict, prompts: int, tokens: int, window: int, max_ppl_tokens: int) -> list[list]:
    ids = list(models["none"].tokenizer.encode(held_out_text()))[:max_ppl_tokens]
    agree = agreement(models, prompts, tokens)
    ppl = {m: perplexity(lm, ids, window) for m, lm in models.items()}
    return ([[m, agree[m], ppl[m], ppl[m] / ppl["none"] - 1] for m in MODES]
            + [[f"({len(ids)} tokens)", None, None, None]])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", choices=["memory", "speed", "quality"], nargs="+",
                    default=["memory", "speed", "quality"])
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 32, 256])
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--agreement-prompts", type=int, default=64)
    ap.add_argument("--agreement-tokens", type=int, default=128)
    ap.add_argument("--ppl-window", type=int, default=512)
    ap.add_argument("--ppl-tokens", type=int, default=8192, help="held-out tokens scored")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--child-memory", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child_memory:
        child_memory(args.child_memory, args.threads)
        return
    print(machine())
    if "memory" in args.only:
        print_table(["mode", "resident weights (MiB)", "peak RSS (MiB)"], memory(args.threads), digits=1)
        print(flush=True)
    if {"speed", "quality"} & set(args.only):
        from specgen import load_model

        models = {m: load_model(None, quantization=m, threads=args.threads) for m in MODES}
        if "quality" in args.only:
            rows = quality(models, args.agreement_prompts, args.agreement_tokens, args.ppl_window,
                           args.ppl_tokens)
            print_table(["mode", "greedy agreement", "perplexity", "vs none"], rows, digits=4)
            print(flush=True)
        if "speed" in args.only:
            speed(models, args.batch_sizes, args.max_tokens, args.repeats)


if __name__ == "__main__":
    main()
