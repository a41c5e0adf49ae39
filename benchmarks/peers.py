"""specgen side by side with llama.cpp and transformers: tokens/s at batch 1, greedy, plain and prompt lookup.

    OMP_NUM_THREADS=2 python benchmarks/peers.py --sets code_rewrite summarization qa --prompts 4 \
        --max-tokens 128 --repeats 2

Every tool gets the same token ids (each chat encoded once with specgen's tokenizer) and runs each prompt set
as one job, its requests one after another (batch 1), greedy, stopping a request at specgen's EOS ids (the EOS
counted and kept, as specgen keeps it) or after --max-tokens. tok/s is a job's generated tokens over its wall
time, prefills included. The methods:

    specgen plain / ngram        SpecConfig() / SpecConfig(method="ngram", num_speculative_tokens=--k)
    llama.cpp plain / lookup     llama-cpp-python's Llama.generate; lookup: LlamaPromptLookupDecoding drafts
    transformers plain / lookup  model.generate(do_sample=False); lookup: prompt_lookup_num_tokens

Each lookup runs with every --lookup-tokens value; per set the best (by median tok/s) is compared, and named.
Each tool's model is loaded once and warmed up with one short generation. The methods alternate within a
round (every set once per method) and --repeats rounds give the medians: identical runs on a shared machine
differ by up to 15%. A peer that is not installed is skipped with a note.

The arithmetic differs between the tools. The GGUF's weights are Q4_1 / Q8_0 blocks: specgen multiplies by
them in float32 (each weight rebuilt from its block, float32 products and sums); llama.cpp quantizes the
activations to 8 bits and takes its own quantized dot products with the blocks; transformers dequantizes the
whole GGUF to float32 at load and runs float32 PyTorch. Greedy outputs can therefore differ, so the number of
requests whose outputs are token-identical to specgen plain's is reported, not asserted.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

import common

# (prompts' token ids, max_tokens) -> each prompt's generated token ids
Run = Callable[[list[list[int]], int], list[list[int]]]
COMPARED = [("specgen plain", "llama.cpp plain"), ("specgen plain", "transformers plain"),
            ("specgen ngram", "llama.cpp lookup"), ("specgen ngram", "transformers lookup")]


@dataclass(frozen=True)
class Method:
    column: str  # what it is compared as, e.g. "llama.cpp lookup"
    run: Run
    lookup_tokens: int | None = None  # draft tokens per step of a peer's lookup; one column, one value each

    @property
    def name(self) -> str:
        return self.column if self.lookup_tokens is None else f"{self.column} {self.lookup_tokens}"


@dataclass(frozen=True)
class Timing:
    outputs: list[list[int]]  # per request, its generated token ids
    seconds: float
    load: float  # the machine's 1-minute load average after the run: other processes take cores from it

    @property
    def tokens(self) -> int:
        return sum(len(o) for o in self.outputs)

    @property
    def tok_s(self) -> float:
        return self.tokens / self.seconds


def specgen_methods(model, k: int) -> list[Method]:
    from specgen import EngineConfig, SamplingParams, SpecConfig, generate

    def runner(spec: SpecConfig) -> Run:
        def run(prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
            outs = generate(prompts, model=model, sampling=SamplingParams(max_tokens=max_tokens),
                            engine=EngineConfig(batch_size=1), speculative=spec)
            return [list(o.token_ids) for o in outs]
        return run

    return [Method("specgen plain", runner(SpecConfig())),
            Method("specgen ngram", runner(SpecConfig(method="ngram", num_speculative_tokens=k)))]


def llama_cpp_methods(gguf: Path, eos_ids: tuple[int, ...], n_ctx: int, threads: int,
                      lookups: list[int]) -> list[Method]:
    try:
        from llama_cpp import Llama
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
    except ImportError as e:
        print(f"llama.cpp skipped: {e}")
        return []

    def runner(draft: LlamaPromptLookupDecoding | None) -> Run:
        # A draft model makes Llama keep every position's logits, but 0.3.36 sizes their buffer from the
        # logits_all argument (n_batch rows) and fails on a prompt longer than n_batch unless it is given.
        llm = Llama(model_path=str(gguf), n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads,
                    n_batch=512, draft_model=draft, logits_all=draft is not None, verbose=False)

        def run(prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
            outs = []
            for ids in prompts:
                # Forget the previous request: llama-cpp-python would otherwise reuse its KV cache for a
                # common prefix, while specgen prefills every request of these sets whole.
                llm.reset()
                out: list[int] = []
                for token in llm.generate(ids, temp=0.0, top_k=1, repeat_penalty=1.0):
                    out.append(token)
                    if token in eos_ids or len(out) == max_tokens:
                        break
                outs.append(out)
            return outs
        return run

    return [Method("llama.cpp plain", runner(None))] + [
        Method("llama.cpp lookup", runner(LlamaPromptLookupDecoding(num_pred_tokens=n)), n) for n in lookups]


def transformers_methods(gguf: Path, eos_ids: tuple[int, ...], threads: int,
                         lookups: list[int]) -> list[Method]:
    try:
        import torch
        import transformers
    except ImportError as e:
        print(f"transformers skipped: {e}")
        return []
    torch.set_num_threads(threads)
    transformers.utils.logging.disable_progress_bar()
    model = transformers.AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                                              dtype=torch.float32)

    def runner(lookup: int | None) -> Run:
        extra = {"prompt_lookup_num_tokens": lookup} if lookup else {}

        def run(prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
            outs = []
            with torch.inference_mode():
                for ids in prompts:
                    x = torch.tensor([ids])  # [1, prompt_len]
                    y = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False,
                                       max_new_tokens=max_tokens, eos_token_id=list(eos_ids),
                                       pad_token_id=eos_ids[0], **extra)  # [1, prompt_len + generated]
                    outs.append(y[0, len(ids):].tolist())
            return outs
        return run

    return [Method("transformers plain", runner(None))] + [
        Method("transformers lookup", runner(n), n) for n in lookups]


def versions() -> str:
    found = []
    for package in ("specgen", "paddlepaddle", "llama-cpp-python", "torch", "transformers"):
        try:
            found.append(f"{package} {metadata.version(package)}")
        except metadata.PackageNotFoundError:
            found.append(f"{package} not installed")
    return ", ".join(found)


def measure(methods: list[Method], prompts: dict[str, list[list[int]]], max_tokens: int,
            repeats: int) -> dict[str, dict[str, list[Timing]]]:
    """Per set and method name, one Timing per round; within a round every set runs once with every method."""
    timings: dict[str, dict[str, list[Timing]]] = {s: {m.name: [] for m in methods} for s in prompts}
    for round_ in range(1, repeats + 1):
        for set_name, ids in prompts.items():
            for m in methods:
                outputs, seconds = common.timed(functools.partial(m.run, ids, max_tokens))
                t = Timing(outputs, seconds, os.getloadavg()[0])
                timings[set_name][m.name].append(t)
                print(f"round {round_}/{repeats}  {set_name:<14} {m.name:<22} {t.tok_s:7.1f} tok/s  "
                      f"{t.tokens:5d} tokens {seconds:7.1f} s  load {t.load:.2f}", flush=True)
    return timings


def report_set(set_name: str, ids: list[list[int]], methods: list[Method],
               timings: dict[str, list[Timing]]) -> dict:
    """Print one set's table and ratios; return its figures."""
    median = {m.name: statistics.median(t.tok_s for t in timings[m.name]) for m in methods}
    best: dict[str, Method] = {}  # column -> the method compared for it (the best lookup value)
    for m in methods:
        if m.column not in best or median[m.name] > median[best[m.column].name]:
            best[m.column] = m
    reference = timings["specgen plain"][0].outputs
    same = {m.name: sum(a == b for a, b in zip(timings[m.name][0].outputs, reference, strict=True))
            for m in methods}
    rounds = len(timings["specgen plain"])
    lengths = [len(p) for p in ids]
    print(f"\n{set_name}: {len(ids)} prompts of {min(lengths)}-{max(lengths)} tokens")
    headers = ["method", "tok/s", *(f"round {r + 1}" for r in range(rounds)), "tokens",
               f"= specgen plain (of {len(ids)})", "compared"]
    common.print_table(headers, [[m.name, median[m.name], *(t.tok_s for t in timings[m.name]),
                                  timings[m.name][0].tokens, same[m.name], "*" if best[m.column] is m else ""]
                                 for m in methods], digits=1)
    ratios = {f"{a} / {b}": median[best[a].name] / median[best[b].name]
              for a, b in COMPARED if a in best and b in best}
    for label, value in ratios.items():
        print(f"  {label}: {value:.2f}")
    return {"prompt_tokens": lengths, "ratios": ratios,
            "compared": {column: m.name for column, m in best.items()},
            "methods": {m.name: {"column": m.column, "lookup_tokens": m.lookup_tokens,
                                 "tok_s": median[m.name],
                                 "tok_s_rounds": [t.tok_s for t in timings[m.name]],
                                 "seconds_rounds": [t.seconds for t in timings[m.name]],
                                 "tokens_rounds": [t.tokens for t in timings[m.name]],
                                 "load_rounds": [t.load for t in timings[m.name]],
                                 "identical_to_specgen_plain": same[m.name]} for m in methods}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sets", nargs="+", default=["code_rewrite", "summarization", "qa"],
                    choices=[*common.CATEGORIES, "code_rewrite"])
    ap.add_argument("--prompts", type=int, default=4, help="prompts per set")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=2,
                    help="rounds of every set with every method; medians are reported")
    ap.add_argument("--k", type=int, default=5, help="specgen ngram's num_speculative_tokens")
    ap.add_argument("--lookup-tokens", type=int, nargs="+", default=[2, 10],
                    help="the peers' draft tokens per lookup step, each tried; the best per set is compared")
    ap.add_argument("--threads", type=int, default=2, help="CPU threads of every tool")
    ap.add_argument("--json", default=None, help="also write every figure here")
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))  # before Paddle or PyTorch is imported
    machine = common.machine()
    print(machine)
    print(f"command: OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']} python {' '.join(sys.argv)}")
    print(versions(), flush=True)

    from specgen import load_model
    from specgen.models.default_model import default_gguf_path

    model = load_model(None, threads=args.threads)
    chats = common.load_sets(args.prompts, args.prompts)
    prompts = {s: [list(model.tokenizer.encode_chat(c)) for c in chats[s]] for s in args.sets}
    eos_ids = tuple(model.config.eos_token_ids)
    gguf = default_gguf_path()
    # Room for the longest prompt, its output and the drafts of its last step.
    n_ctx = max(len(p) for ps in prompts.values() for p in ps) + args.max_tokens + max(args.lookup_tokens) + 1
    methods = (specgen_methods(model, args.k)
               + llama_cpp_methods(gguf, eos_ids, n_ctx, args.threads, args.lookup_tokens)
               + transformers_methods(gguf, eos_ids, args.threads, args.lookup_tokens))
    warm = next(iter(prompts.values()))[:1]
    for m in methods:
        _, seconds = common.timed(functools.partial(m.run, warm, 4))
        print(f"warm-up {m.name}: {seconds:.2f} s", flush=True)

    timings = measure(methods, prompts, args.max_tokens, args.repeats)
    results = {s: report_set(s, prompts[s], methods, timings[s]) for s in prompts}
    print("\nratios of median tok/s (the peer's lookup at its best value per set)")
    labels = list(next(iter(results.values()))["ratios"])
    common.print_table(["ratio", *results], [[label, *(r["ratios"][label] for r in results.values())]
                                             for label in labels])
    print(common.machine())  # the end's time and load, beside the start's
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": machine, "command": sys.argv,
                                               "versions": versions(), "args": vars(args), "sets": results},
                                              indent=2))


if __name__ == "__main__":
    main()
