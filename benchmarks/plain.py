"""Plain decoding throughput on the default model, and the ratio to transformers' greedy generate (if installed).

    python benchmarks/plain.py --batch-sizes 1 16 64 256 --max-tokens 128 [--reference]

Prompts are Spec-Bench questions (chat template applied). Every request generates exactly --max-tokens tokens
(ignore_eos), so both tools do the same work. transformers runs on the same GGUF (dequantized to float32),
with left padding for batches, in the same process, one after the other. --reference also runs specgen's Paddle
reference path (the forward before the fused CPU kernels: SPECGEN_KERNELS=0) in the same process: "before/after";
--unpacked the fused kernels with MKL's sgemm for the weights (SPECGEN_PACKED_LINEAR=0); --op-by-op the packed
kernels called op by op instead of one fused op per decoder block (SPECGEN_FUSED_LAYER=0); --dequantized the
packed kernels over the dequantized float32 weights instead of the GGUF file's Q4_1 / Q8_0 blocks
(SPECGEN_QUANTIZED_WEIGHTS=0); --unfused-forward the blocks in one op but the embedding, final norm and LM head
as separate ops around it, instead of the whole forward as one op (SPECGEN_FUSED_FORWARD=0).
"""
from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT.parent / "shared" / "data"


def chat_prompts(n: int) -> list[list[dict]]:
    lines = [json.loads(x) for x in (DATA / "spec_bench" / "question.jsonl").read_text().splitlines() if x.strip()]
    picked = [lines[(i * 37) % len(lines)] for i in range(n)]
    return [[{"role": "user", "content": q["turns"][0][:400]}] for q in picked]


def run_specgen(model, prompts, batch_size, max_tokens):
    from specgen import EngineConfig, SamplingParams, generate

    start = time.perf_counter()
    outs = generate(prompts, model=model, sampling=SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                    engine=EngineConfig(batch_size=batch_size, max_prefill_tokens=8192))
    wall = time.perf_counter() - start
    return sum(len(o.token_ids) for o in outs) / wall, [o.token_ids for o in outs]


def run_transformers(prompts_ids, batch_size, max_tokens, threads):
    try:
        import torch
        from transformers import AutoModelForCausalLM
    except ImportError:
        return None, None
    from specgen.models.default_model import default_gguf_path

    torch.set_num_threads(threads)
    path = default_gguf_path()
    hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, torch_dtype=torch.float32)
    hf.generation_config.pad_token_id = 2
    tokens, outs = 0, []
    start = time.perf_counter()
    for i in range(0, len(prompts_ids), batch_size):
        chunk = prompts_ids[i: i + batch_size]
        width = max(map(len, chunk))
        ids = torch.tensor([[2] * (width - len(p)) + p for p in chunk])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk])
        with torch.no_grad():
            gen = hf.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=max_tokens,
                              min_new_tokens=max_tokens)
        new = gen[:, width:]
        tokens += new.numel()
        outs.extend(new.tolist())
    return tokens / (time.perf_counter() - start), outs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16, 64, 256])
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-transformers", action="store_true")
    ap.add_argument("--reference", action="store_true", help="also time the Paddle reference path (no kernels)")
    ap.add_argument("--unpacked", action="store_true",
                    help="also time the fused kernels with MKL's matmul instead of the packed linear kernel")
    ap.add_argument("--op-by-op", action="store_true",
                    help="also time the packed kernels called op by op instead of one op per decoder block")
    ap.add_argument("--dequantized", action="store_true",
                    help="also time the packed kernels over float32 weights instead of the GGUF file's quantized "
                         "blocks (SPECGEN_QUANTIZED_WEIGHTS=0)")
    ap.add_argument("--unfused-forward", action="store_true",
                    help="also time the forward with embedding, final norm and LM head as separate ops around the "
                         "blocks (SPECGEN_FUSED_FORWARD=0)")
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    from spec_bench import load_default

    model = load_default(args.threads)
    reference = load_default(args.threads, SPECGEN_KERNELS="0") if args.reference else None
    unpacked = load_default(args.threads, SPECGEN_PACKED_LINEAR="0") if args.unpacked else None
    by_op = load_default(args.threads, SPECGEN_FUSED_LAYER="0") if args.op_by_op else None
    deq = load_default(args.threads, SPECGEN_QUANTIZED_WEIGHTS="0") if args.dequantized else None
    unf = load_default(args.threads, SPECGEN_FUSED_FORWARD="0") if args.unfused_forward else None
    print(f"{'batch':>6}{'prompts':>9}{'reference tok/s':>17}{'unpacked tok/s':>16}{'op-by-op tok/s':>16}"
          f"{'float32 w tok/s':>17}{'unfused fwd tok/s':>19}"
          f"{'specgen tok/s':>15}"
          f"{'after/before':>14}{'transformers tok/s':>20}{'ratio':>8}{'same greedy':>13}")
    for bs in args.batch_sizes:
        n = max(bs, 2) if bs > 1 else 2
        msgs = chat_prompts(n)
        ids = [list(model.tokenizer.encode_chat(m)) for m in msgs]
        ref = run_specgen(reference, ids, bs, args.max_tokens)[0] if reference else None
        unp = run_specgen(unpacked, ids, bs, args.max_tokens)[0] if unpacked else None
        byop = run_specgen(by_op, ids, bs, args.max_tokens)[0] if by_op else None
        dq = run_specgen(deq, ids, bs, args.max_tokens)[0] if deq else None
        uf = run_specgen(unf, ids, bs, args.max_tokens)[0] if unf else None
        sg, sg_out = run_specgen(model, ids, bs, args.max_tokens)
        hf, hf_out = (None, None) if args.no_transformers else run_transformers(ids, bs, args.max_tokens, args.threads)
        same = "-" if hf_out is None else f"{sum(a == b for a, b in zip(sg_out, hf_out))}/{len(ids)}"
        ratio = f"{sg / hf:.2f}x" if hf else "-"
        hf_s = f"{hf:.1f}" if hf else "-"
        ref_s, gain = (f"{ref:.1f}", f"{sg / ref:.2f}x") if ref else ("-", "-")
        unp_s = f"{unp:.1f}" if unp else "-"
        byop_s = f"{byop:.1f}" if byop else "-"
        dq_s = f"{dq:.1f}" if dq else "-"
        uf_s = f"{uf:.1f}" if uf else "-"
        print(f"{bs:>6}{n:>9}{ref_s:>17}{unp_s:>16}{byop_s:>16}{dq_s:>17}{uf_s:>19}{sg:>15.1f}{gain:>14}{hf_s:>20}{ratio:>8}"
              f"{same:>13}", flush=True)


if __name__ == "__main__":
    main()
