"""Real model sizes: random llama-shaped checkpoints of 1.1B and 7B parameters, loaded and decoded by specgen
and by llama.cpp on the same GGUF file.

    OMP_NUM_THREADS=2 python benchmarks/big_models.py --sizes 1.1b 7b --formats q4_1 bf16 --tokens 32
    OMP_NUM_THREADS=2 python benchmarks/big_models.py --sizes 1.1b --formats q4_k --matmul float32 int8 \
        --rates

Each checkpoint is made once in --dir (random weights: the speed and memory of a real model of that shape,
not its text): a GGUF whose projections and embedding are Q4_1 and whose LM head is Q8_0 (q4_1), or Q4_K
with a Q6_K head (q4_k; random K-quant blocks), or llama.cpp's Q4_K_M mix (q4_k_m: as q4_k, with attn_v and
ffn_down in Q6_K in the layers llama.cpp gives more bits: the first and last eighth, and every third
between), with SmolLM2's tokenizer (49,152 tokens), and an HF directory of
BF16 safetensors loaded with --quantization wint4 (bf16). Every
measurement runs in a fresh process of its own, one at a time:
- load: seconds to a loaded model, peak and resident memory (RSS; the process's baseline after importing
  Paddle and specgen given apart), the first run with none of the checkpoint's entries in the cache (its
  kernels built) and a later run reusing them; the OS page cache is warm in both (the file was just read).
- decode: greedy plain decoding at batch 1 from an 8-token prompt: decode tok/s = (N - 1) / (t(N) - t(1)), and
  the whole job's N / t(N), medians of --repeats; llama.cpp (llama-cpp-python) the same on the same file.
- step costs c(T) / c(1) for T tokens fed in one step (specgen.app.bounds.step_costs), and the speedup the
  n-gram oracle bound would reach at those costs, with the accepted-token steps the default model's plain
  outputs replay on the Spec-Bench sets and MBPP rewriting (--bound-prompts per set, k = 5).
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import common
import numpy as np

SHAPES = {  # TinyLlama-1.1B and Llama-2-7B, with SmolLM2's vocabulary
    "1.1b": dict(hidden=2048, inter=5632, layers=22, heads=32, kv_heads=4),
    "7b": dict(hidden=4096, inter=11008, layers=32, heads=32, kv_heads=32),
}
PROMPT = [1, 504, 3458, 282, 260, 1789, 30, 198]


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


# ---- making the checkpoints ----

def layer_tensors(shape: dict) -> dict[str, tuple[int, int]]:
    """HF name (within a layer) -> [out, in]."""
    h, i, hd = shape["hidden"], shape["inter"], shape["hidden"] // shape["heads"]
    kv = shape["kv_heads"] * hd
    return {"self_attn.q_proj": (h, h), "self_attn.k_proj": (kv, h), "self_attn.v_proj": (kv, h),
            "self_attn.o_proj": (h, h), "mlp.gate_proj": (i, h), "mlp.up_proj": (i, h),
            "mlp.down_proj": (h, i)}


def q4_1_blocks(rng: np.random.Generator, out: int, inp: int) -> np.ndarray:
    """Random Q4_1 blocks [out, in / 32 * 20]: d in [0.002, 0.01), m = -8 d, random nibbles."""
    nb = inp // 32
    d = rng.uniform(0.002, 0.01, (out, nb)).astype(np.float16)
    b = np.empty((out, nb, 20), np.uint8)
    b[..., 0:2] = d.view(np.uint8).reshape(out, nb, 2)
    b[..., 2:4] = (-8 * d).astype(np.float16).view(np.uint8).reshape(out, nb, 2)
    b[..., 4:] = rng.integers(0, 256, (out, nb, 16), dtype=np.uint8)
    return b.reshape(out, -1)


def k_blocks(rng: np.random.Generator, qtype, out: int, inp: int) -> np.ndarray:
    """Random K-quant blocks [out, in / 256 * bytes]: random bytes, the super-block scale (and minimum) a sane
    float16 (0.002)."""
    import gguf

    size = gguf.GGML_QUANT_SIZES[qtype][1]
    b = rng.integers(0, 256, (out, inp // 256, size), dtype=np.uint8)
    scale = slice(208, 210) if qtype == gguf.GGMLQuantizationType.Q6_K else slice(0, 4)
    b[..., scale] = np.full((scale.stop - scale.start) // 2, 0.002, np.float16).view(np.uint8)
    return b.reshape(out, -1)


def more_bits(i: int, layers: int) -> bool:
    """Whether llama.cpp's Q4_K_M stores layer i's attn_v and ffn_down in Q6_K (its use_more_bits)."""
    return i < layers // 8 or i >= 7 * layers // 8 or (i - layers // 8) % 3 == 2


def make_gguf(path: Path, shape: dict, k_quants: bool = False, mix: bool = False) -> None:
    """Q4_1 projections and embedding with a Q8_0 LM head; or (k_quants) Q4_K ones with a Q6_K head, as
    llama.cpp's Q4_K_M keeps its output, and (mix) its attn_v and ffn_down in Q6_K where it gives more
    bits."""
    import gguf

    from specgen.models import default_model
    from specgen.models.gguf_header import read_header
    from specgen.models.gguf_loader import _Metadata

    src = default_model.default_gguf_path()
    meta = _Metadata(read_header(src).fields, src)
    tokens = meta.require("tokenizer.ggml.tokens")
    vocab, h = len(tokens), shape["hidden"]
    w = gguf.GGUFWriter(path, "llama")
    w.add_context_length(4096)
    w.add_embedding_length(h)
    w.add_feed_forward_length(shape["inter"])
    w.add_block_count(shape["layers"])
    w.add_head_count(shape["heads"])
    w.add_head_count_kv(shape["kv_heads"])
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types(meta.require("tokenizer.ggml.token_type"))
    w.add_token_merges(meta.require("tokenizer.ggml.merges"))
    w.add_bos_token_id(meta.require("tokenizer.ggml.bos_token_id"))
    w.add_eos_token_id(meta.require("tokenizer.ggml.eos_token_id"))
    T = gguf.GGMLQuantizationType
    Q41, Q80, F32 = (T.Q4_K, T.Q6_K, T.F32) if k_quants else (T.Q4_1, T.Q8_0, T.F32)
    names = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down"}
    plan = [("token_embd.weight", (vocab, h), Q41)]
    for i in range(shape["layers"]):
        plan += [(f"blk.{i}.attn_norm.weight", (h,), F32), (f"blk.{i}.ffn_norm.weight", (h,), F32)]
        more = {"attn_v", "ffn_down"} if mix and more_bits(i, shape["layers"]) else set()
        plan += [(f"blk.{i}.{names[n]}.weight", s, Q80 if names[n] in more else Q41)
                 for n, s in layer_tensors(shape).items()]
    plan += [("output_norm.weight", (h,), F32), ("output.weight", (vocab, h), Q80)]
    rng = np.random.default_rng(0)
    for name, s, t in plan:
        if t == F32:
            w.add_tensor_info(name, s, np.dtype(np.float32), 4 * s[0])
        else:
            block, size = gguf.GGML_QUANT_SIZES[t]
            row = s[1] // block * size
            w.add_tensor_info(name, (s[0], row), np.dtype(np.uint8), s[0] * row, raw_dtype=t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for name, s, t in plan:
        if t == F32:
            w.write_tensor_data(np.ones(s, np.float32))
        elif t == T.Q4_1:
            w.write_tensor_data(q4_1_blocks(rng, *s))
        elif k_quants:
            w.write_tensor_data(k_blocks(rng, t, *s))
        else:
            x = rng.uniform(-0.05, 0.05, s).astype(np.float32)
            w.write_tensor_data(gguf.quants.quantize(x, t))
    w.close()


def make_bf16(directory: Path, shape: dict) -> None:
    """An HF LlamaForCausalLM directory of random BF16 weights (|w| in [2^-12, 2^-5), random signs), with the
    default model's tokenizer."""

    from specgen.models import default_model
    from specgen.models.checkpoint import write_safetensors
    from specgen.models.gguf_header import read_header
    from specgen.models.gguf_loader import _build_tokenizer, _Metadata

    directory.mkdir(parents=True, exist_ok=True)
    vocab, h = 49152, shape["hidden"]
    specs = {"model.embed_tokens.weight": (vocab, h), "lm_head.weight": (vocab, h), "model.norm.weight": (h,)}
    for i in range(shape["layers"]):
        p = f"model.layers.{i}."
        specs |= {p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,)}
        specs |= {p + n + ".weight": s for n, s in layer_tensors(shape).items()}
    rng = np.random.default_rng(0)

    def read(name: str) -> np.ndarray:
        s = specs[name]
        if len(s) == 1:
            return np.full(s, 0x3F80, np.uint16)  # 1.0
        bits = rng.integers(0, 1 << 16, s, dtype=np.uint16)
        return (bits & 0x807F) | (((bits >> 7) & 7) + 115).astype(np.uint16) << 7

    write_safetensors(directory / "model.safetensors", {n: ("BF16", s) for n, s in specs.items()}, read)
    cfg = {"architectures": ["LlamaForCausalLM"], "hidden_size": h, "intermediate_size": shape["inter"],
           "num_hidden_layers": shape["layers"], "num_attention_heads": shape["heads"],
           "num_key_value_heads": shape["kv_heads"], "vocab_size": vocab, "rms_norm_eps": 1e-5,
           "max_position_embeddings": 4096, "tie_word_embeddings": False, "eos_token_id": 2,
           "bos_token_id": 1}
    (directory / "config.json").write_text(json.dumps(cfg))
    src = default_model.default_gguf_path()
    meta = _Metadata(read_header(src).fields, src)
    meta_tok = _build_tokenizer(meta, src)
    meta_tok.tokenizer.save(str(directory / "tokenizer.json"))


def make(kind: str, size: str, root: Path) -> Path:
    path = root / {"q4_1": f"random-{size}.Q4_1.gguf", "q4_k": f"random-{size}.Q4_K.gguf",
                   "q4_k_m": f"random-{size}.Q4_K_M.gguf", "bf16": f"random-{size}-bf16"}[kind]
    if not path.exists():
        tmp = path.with_name(path.name + ".tmp")
        if kind == "bf16":
            make_bf16(tmp, SHAPES[size])
        else:
            make_gguf(tmp, SHAPES[size], k_quants=kind.startswith("q4_k"), mix=kind == "q4_k_m")
        tmp.rename(path)
    return path


# ---- children: one measurement per process ----

def child_specgen(a: argparse.Namespace) -> dict:
    import paddle  # noqa: F401

    import specgen
    from specgen import EngineConfig, SamplingParams, SpecConfig, generate

    base = rss_mb()
    start = time.perf_counter()
    matmul = a.matmul[0]  # (one per child)
    loaded = specgen.load_model(a.path, quantization=a.quantization, matmul=matmul)
    out = {"load_s": time.perf_counter() - start, "base_mb": base, "peak_load_mb": peak_mb(),
           "rss_load_mb": rss_mb()}
    if a.tokens:
        def job(n: int) -> float:
            t = time.perf_counter()
            generate([PROMPT], model=loaded, sampling=SamplingParams(max_tokens=n),
                     engine=EngineConfig(batch_size=1, max_model_len=256, matmul=matmul),
                     speculative=SpecConfig())
            return time.perf_counter() - t
        job(4)
        t1 = statistics.median(job(1) for _ in range(a.repeats))
        tn = statistics.median(job(a.tokens) for _ in range(a.repeats))
        out |= {"decode_tok_s": (a.tokens - 1) / (tn - t1), "job_tok_s": a.tokens / tn, "peak_mb": peak_mb()}
    if a.costs:
        from specgen.app.bounds import step_costs

        out["costs"] = step_costs(loaded.model, 128, list(range(1, 7)), repeats=a.repeats * 3)
    return out


def child_rates(a: argparse.Namespace) -> dict:
    """G weights/s of one row's product over Q4_K weights of 2048 x 5632 (a 1.1B gate projection; its
    super-blocks kept), float32 products (exact) and integer ones (matmul int8, with VNNI), with this
    process's threads: one weight again and again (6.6 MB: it stays in the L3 cache, so this is the kernel's
    arithmetic alone, its bound) and 16 in turn (106 MB: read from memory, as a step reads the model)."""
    import gguf
    import paddle

    from specgen.kernels import has_vnni, ops, pack_quantized

    K = ops()
    rng = np.random.default_rng(0)
    n, k = 5632, 2048
    blocks = [k_blocks(rng, gguf.GGMLQuantizationType.Q4_K, n, k).reshape(n, k // 256, -1) for _ in range(16)]
    x = paddle.to_tensor(rng.standard_normal((1, k)).astype(np.float32))
    out = {}
    for int8 in (False, True) if has_vnni() else (False,):
        weights = [pack_quantized("Q4_K", b, int8, K).panels for b in blocks]
        for place, ws in (("in cache", weights[:1] * 16), ("from memory", weights)):
            def run() -> float:
                t = time.perf_counter()
                for _ in range(4):
                    for w in ws:
                        K.specgen_linear(x, w, n)
                return (time.perf_counter() - t) / (4 * len(ws))

            run()
            best = min(run() for _ in range(a.repeats))
            out[f"{place}, {'int8' if int8 else 'float32'}"] = k * n / best / 1e9
    return out


def child_llama(a: argparse.Namespace) -> dict:
    from llama_cpp import Llama

    base = rss_mb()
    start = time.perf_counter()
    llm = Llama(model_path=str(a.path), n_ctx=256, n_threads=2, n_threads_batch=2, verbose=False)
    out = {"load_s": time.perf_counter() - start, "base_mb": base, "peak_load_mb": peak_mb(),
           "rss_load_mb": rss_mb()}

    def job(n: int) -> float:
        t = time.perf_counter()
        llm.reset()
        for i, _ in enumerate(llm.generate(PROMPT, temp=0.0, top_k=1, repeat_penalty=1.0)):
            if i + 1 == n:
                break
        return time.perf_counter() - t
    job(4)
    t1 = statistics.median(job(1) for _ in range(a.repeats))
    tn = statistics.median(job(a.tokens) for _ in range(a.repeats))
    return out | {"decode_tok_s": (a.tokens - 1) / (tn - t1), "job_tok_s": a.tokens / tn,
                  "peak_mb": peak_mb()}


def spawn(*args: str) -> dict:
    return spawn_env({}, *args)


def spawn_env(env: dict, *args: str) -> dict:
    p = subprocess.run([sys.executable, __file__, *args], capture_output=True, text=True,
                       env={**os.environ, **env})
    if p.returncode:
        return {"error": p.stderr.strip().splitlines()[-1] if p.stderr.strip() else f"exit {p.returncode}"}
    return json.loads(p.stdout.strip().splitlines()[-1])


def replayed_steps(per_set: int) -> dict[str, list[int]]:
    """Tokens per step the n-gram oracle replays (k = 5) on the default model's plain greedy outputs."""
    from common import load_sets

    from specgen import SamplingParams, SpecConfig, generate, load_model
    from specgen.app.bounds import replay_steps
    from specgen.engine.proposers import build_proposer

    loaded = load_model()
    spec = SpecConfig(method="ngram", num_speculative_tokens=5)
    steps = {}
    for name, chats in load_sets(per_set, per_set).items():
        prompts = [list(loaded.tokenizer.encode_chat(c)) for c in chats]
        outs = generate(prompts, model=loaded, sampling=SamplingParams(max_tokens=128),
                        speculative=SpecConfig())
        proposer = build_proposer(spec, loaded.model)
        steps[name] = replay_steps(prompts, [o.token_ids for o in outs], 5, proposer)
    return steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--child", choices=["specgen", "llama", "rates"])
    ap.add_argument("--path", type=Path)
    ap.add_argument("--quantization", default="auto")
    ap.add_argument("--costs", action="store_true")
    ap.add_argument("--sizes", nargs="+", default=["1.1b"], choices=sorted(SHAPES))
    ap.add_argument("--formats", nargs="+", default=["q4_1", "bf16"],
                    choices=["q4_1", "q4_k", "q4_k_m", "bf16"])
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--bound-prompts", type=int, default=0,
                    help="prompts per set for the oracle bound (0: skip)")
    ap.add_argument("--dir", type=Path, default=Path.home() / ".cache" / "specgen-bench")
    ap.add_argument("--matmul", nargs="+", default=["float32"], choices=["float32", "int8"],
                    help="specgen's products, each its own run (int8: AVX-512 VNNI, as llama.cpp)")
    ap.add_argument("--rates", action="store_true",
                    help="also the product's G weights/s over Q4_K weights in cache and from memory")
    a = ap.parse_args()
    if a.child:
        print(json.dumps({"specgen": child_specgen, "llama": child_llama, "rates": child_rates}[a.child](a)))
        return
    from specgen import EngineConfig

    root = EngineConfig().cache_root()
    print(f"# big_models: {common.machine()}")
    a.dir.mkdir(parents=True, exist_ok=True)
    steps = replayed_steps(a.bound_prompts) if a.bound_prompts else {}
    if a.rates:  # one process per thread count (OpenMP reads it at start)
        rates = {t: spawn_env({"OMP_NUM_THREADS": str(t)}, "--child", "rates", "--repeats", str(a.repeats))
                 for t in (1, 2)}
        print("\n## One row's product over Q4_K weights (2048 x 5632), G weights/s")
        common.print_table(["weight, products", "1 thread", "2 threads"],
                           [[key, rates[1].get(key), rates[2][key]] for key in rates[2] if key != "error"],
                           digits=1)
    for size in a.sizes:
        for fmt in a.formats:
            path = make(fmt, size, a.dir)
            mb = sum(p.stat().st_size for p in ([path] if path.is_file() else path.iterdir())) / 2**20
            q = "wint4" if fmt == "bf16" else "auto"
            # the first run: none of this checkpoint's entries in the cache (its kernels built already)
            for old in [*root.glob(f"{path.stem}-*"), *(root / "quantized").glob(f"{path.stem}-*")]:
                shutil.rmtree(old)
            common_args = ["--path", str(path), "--quantization", q, "--repeats", str(a.repeats)]
            first = spawn("--child", "specgen", *common_args, "--tokens", "0")
            rows = [("specgen first", first)]
            for matmul in a.matmul:
                later = spawn("--child", "specgen", *common_args, "--tokens", str(a.tokens), "--matmul",
                              matmul, *(["--costs"] if steps and matmul == a.matmul[0] else []))
                rows.append((f"specgen later, {matmul}", later))
            runs = rows[1:]
            if fmt != "bf16":
                rows.append(("llama.cpp", spawn("--child", "llama", "--path", str(path), "--tokens",
                                                str(a.tokens), "--repeats", str(a.repeats))))
            print(f"\n## {size} {fmt} ({mb:.0f} MiB on disk), --quantization {q}")
            common.print_table(
                ["run", "load s", "base MiB", "peak at load MiB", "RSS loaded MiB", "peak MiB",
                 "decode tok/s", "job tok/s"],
                [[n, r.get("load_s"), r.get("base_mb"), r.get("peak_load_mb"), r.get("rss_load_mb"),
                  r.get("peak_mb"), r.get("decode_tok_s"), r.get("job_tok_s")] if "error" not in r
                 else [n, r["error"], "", "", "", "", "", ""] for n, r in rows], digits=1)
            peer = rows[-1][1]
            for name, run in runs:
                if fmt != "bf16" and "error" not in run and "error" not in peer:
                    print(f"{name} / llama.cpp: decode {run['decode_tok_s'] / peer['decode_tok_s']:.2f}x, "
                          f"whole job {run['job_tok_s'] / peer['job_tok_s']:.2f}x")
            later = runs[0][1]
            if steps and "costs" in later:
                from specgen.app.bounds import oracle_decode_bound

                c = {int(t): v for t, v in later["costs"].items()}
                print("c(T) / c(1): " + ", ".join(f"{t}: {c[t] / c[1]:.2f}" for t in sorted(c)))
                print("n-gram oracle decode bound at these costs: " + ", ".join(
                    f"{name} {oracle_decode_bound(s, c):.2f}x" for name, s in steps.items()))


if __name__ == "__main__":
    main()
