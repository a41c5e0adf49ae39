"""Speculation on a mixture-of-experts model: a random ERNIE-4.5-MoE shaped like ERNIE-4.5-21B-A3B (its
ratios: 64 experts, top-6, 2 shared experts, the first layer dense, 5 query heads per KV head, expert width
0.6 x hidden, vocabulary 40 x hidden), scaled to hidden 320 and 6 layers, against a dense model of the same
active size (each layer's MLP as wide as the 6 routed + 2 shared experts together), side by side in one run.

    OMP_NUM_THREADS=2 python benchmarks/moe.py --repeats 2

1. The verify cost c(T) / c(1): one forward of T tokens per slot (T = 1 + drafts) at batch 1 and 32, after a
   64-token prefill, the fastest of --timings (other processes on a shared machine only add time), the arms
   alternated; and how many distinct experts a routed block touches (a verify block routes each token on its
   own, so it reads more experts than one token does). Beside it, the same MoE forward with every token of the
   block one id ("one id"), as the adaptive controller's cost table used to be timed: such a block routes all
   its tokens alike and reads as few experts as one token.
2. Output tokens/s of none / ngram / mtp (a random head over the MoE model, with its copies) at batch 1 and
   32, adaptive (the default), medians of --repeats with the arms alternated; outputs checked identical to
   none's.
   "vs none (CPU s)": the same ratio per second of this process's CPU time, steadier than wall time where
   other processes share the cores (run it with OMP_NUM_THREADS=1: spinning OpenMP threads count as CPU time
   too).
   The head's block is dense, --head-width wide: "active" (default) the MoE block's active MLP width
   (6 routed + 2 shared experts, 1,536), "dense" the model's intermediate_size (its dense first layer's,
   6,144: 4x that).
   Random weights predict nothing, so drafts are rarely accepted: this measures what failed speculation costs.
   A second MoE model ("repeating": the blocks' output projections scaled by 0.02, so the embedding dominates
   and the model repeats its last token) accepts nearly every draft: the other end, the most speculation can
   gain at this verify cost.
Weights are random, rounded to bfloat16 (the fused backend packs them as 16-bit panels, as a bf16 checkpoint).
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
from common import machine, print_table, timed

SHAPE = dict(hidden_size=320, num_attention_heads=5, num_key_value_heads=1, head_dim=64, num_hidden_layers=6,
             vocab_size=12800, rms_norm_eps=1e-5, rope_theta=500000.0, max_position_embeddings=1024,
             tie_word_embeddings=True, use_bias=False)
MOE = dict(moe_num_experts=64, moe_k=6, moe_intermediate_size=192, moe_num_shared_experts=2,
           moe_layer_start_index=1, moe_layer_interval=1, moe_norm_min=1e-12)
# the active width
DENSE_INTER = (MOE["moe_k"] + MOE["moe_num_shared_experts"]) * MOE["moe_intermediate_size"]


def bf16(rng: np.random.Generator, shape: tuple[int, ...], std: float) -> np.ndarray:
    """Random float32 values that are exactly bfloat16 (the low 16 bits cleared)."""
    x = (rng.standard_normal(shape) * std).astype(np.float32)
    return (x.view(np.uint32) & np.uint32(0xFFFF0000)).view(np.float32)


def write_model(out: Path, moe: bool, seed: int = 0, out_scale: float = 1.0) -> Path:
    """A random ERNIE-4.5 checkpoint (MoE or dense) in HF layout; o_proj and down_proj weights times
    out_scale."""
    from safetensors.numpy import save_file

    rng = np.random.default_rng(seed)
    h, hd = SHAPE["hidden_size"], SHAPE["head_dim"]
    q, kv = SHAPE["num_attention_heads"] * hd, SHAPE["num_key_value_heads"] * hd
    w = {"model.embed_tokens.weight": bf16(rng, (SHAPE["vocab_size"], h), 0.02),
         "model.norm.weight": np.ones(h, np.float32)}

    def mlp(p: str, inter: int) -> None:
        w[p + "gate_proj.weight"] = bf16(rng, (inter, h), h ** -0.5)
        w[p + "up_proj.weight"] = bf16(rng, (inter, h), h ** -0.5)
        w[p + "down_proj.weight"] = bf16(rng, (h, inter), out_scale * inter ** -0.5)

    for i in range(SHAPE["num_hidden_layers"]):
        p = f"model.layers.{i}."
        for name, shape in (("q", (q, h)), ("k", (kv, h)), ("v", (kv, h)), ("o", (h, q))):
            w[f"{p}self_attn.{name}_proj.weight"] = bf16(rng, shape,
                                                         (out_scale if name == "o" else 1.0) * h ** -0.5)
        w[p + "input_layernorm.weight"] = w[p + "post_attention_layernorm.weight"] = np.ones(h, np.float32)
        if moe and i >= MOE["moe_layer_start_index"]:
            E, inter = MOE["moe_num_experts"], MOE["moe_intermediate_size"]
            w[p + "mlp.gate.weight"] = bf16(rng, (E, h), 1.0)
            w[p + "mlp.moe_statics.e_score_correction_bias"] = np.zeros((1, E), np.float32)
            for e in range(E):
                mlp(f"{p}mlp.experts.{e}.", inter)
            mlp(p + "mlp.shared_experts.", MOE["moe_num_shared_experts"] * inter)
        else:
            mlp(p + "mlp.", SHAPE["intermediate_size"] if moe else DENSE_INTER)
    out.mkdir(parents=True, exist_ok=True)
    save_file(w, str(out / "model.safetensors"))
    cfg = dict(SHAPE, architectures=["Ernie4_5_MoeForCausalLM" if moe else "Ernie4_5ForCausalLM"],
               intermediate_size=SHAPE["intermediate_size"] if moe else DENSE_INTER, **(MOE if moe else {}))
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    return out


SHAPE["intermediate_size"] = 4 * DENSE_INTER  # the dense first layer (21B-A3B: 12288 = 4.8 x hidden)


def verify_costs(models: dict, batches: list[int], max_t: int, timings: int) -> list[list]:
    """Per batch and T: each model's c(T) / c(1), and the MoE model's distinct experts per routed block."""
    from specgen.runtime.batch import build_forward_batch

    rng = np.random.default_rng(1)
    rows = []
    for B in batches:
        caches = {}
        for name, m in models.items():
            caches[name] = m.new_cache(B, 128)
            m.forward(build_forward_batch(np.arange(B), np.zeros(B, np.int64), np.full(B, 64),
                                          rng.integers(0, SHAPE["vocab_size"], 64 * B), np.zeros(B, bool)),
                      caches[name])
        cost: dict[tuple[str, int], list[float]] = {}
        touched: dict[tuple[str, int], float] = {}
        for _ in range(timings):
            for T in range(1, max_t + 1):
                toks = rng.integers(0, SHAPE["vocab_size"], T * B)
                one_id = np.repeat(toks[::T], T)  # each slot's block: its first token T times
                for name, ids in (("moe", toks), ("one id", one_id), ("dense", toks)):
                    m = models["dense" if name == "dense" else "moe"]
                    batch = build_forward_batch(np.arange(B), np.full(B, 64), np.full(B, T), ids,
                                                np.ones(B, bool))
                    out, wall = timed(lambda: m.forward(batch, caches["dense" if name == "dense" else "moe"]))
                    cost.setdefault((name, T), []).append(wall)
                    if out.expert_counts is not None:
                        touched[name, T] = float((out.expert_counts > 0).sum(axis=1).mean())
        med = {key: min(v) for key, v in cost.items()}  # the fastest: other processes only ever add time
        for T in range(1, max_t + 1):
            rows.append([B, T, touched["moe", T], med["moe", T] * 1e3, med["moe", T] / med["moe", 1],
                         touched["one id", T], med["one id", T] / med["one id", 1],
                         med["dense", T] * 1e3, med["dense", T] / med["dense", 1]])
    return rows


def speeds(lm, head_dir: str, batches: list[int], k: int, max_tokens: int, repeats: int) -> list[list]:
    """tok/s of none / ngram / mtp per batch size (medians, arms alternated), checked identical to none's."""
    from specgen import EngineConfig, Method, MtpConfig, SamplingParams, SpecConfig, generate

    arms = {"none": SpecConfig(), "ngram": SpecConfig(method=Method.NGRAM, num_speculative_tokens=k),
            "mtp": SpecConfig(method=Method.MTP, num_speculative_tokens=k, mtp=MtpConfig(model=head_dir))}
    rng = np.random.default_rng(2)
    rows = []
    for B in batches:
        # prompts that repeat a phrase: what n-gram drafting and the head's copies feed on
        prompts = [np.tile(rng.integers(0, SHAPE["vocab_size"], 12), 4).tolist() for _ in range(max(B, 4))]
        sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        tok_s: dict[str, list[float]] = {a: [] for a in arms}
        cpu_s: dict[str, list[float]] = {a: [] for a in arms}  # per CPU-second of this process (load-robust)
        outs: dict[str, list] = {}
        for rep in range(repeats + 1):
            for arm, spec in arms.items():
                cpu = time.process_time()
                got, wall = timed(lambda: generate(prompts, model=lm, sampling=sp, speculative=spec,
                                                   engine=EngineConfig(batch_size=B)))
                cpu = time.process_time() - cpu
                outs[arm] = got
                if rep:  # the first round warms each arm up (its cost table, the head's load)
                    tok_s[arm].append(sum(len(o.token_ids) for o in got) / wall)
                    cpu_s[arm].append(sum(len(o.token_ids) for o in got) / cpu)
        base, cpu_base = statistics.median(tok_s["none"]), statistics.median(cpu_s["none"])
        for arm in arms:
            o = outs[arm]
            drafted = sum(x.stats.num_draft_tokens for x in o)
            accepted = sum(x.stats.num_accepted_tokens for x in o)
            rows.append([B, arm, statistics.median(tok_s[arm]), statistics.median(tok_s[arm]) / base,
                         statistics.median(cpu_s[arm]) / cpu_base, accepted / drafted if drafted else None,
                         drafted / sum(len(x.token_ids) for x in o),
                         "yes" if [x.token_ids for x in o] == [x.token_ids for x in outs["none"]] else "NO"])
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--max-t", type=int, default=6, help="verify blocks of 1 .. T tokens")
    ap.add_argument("--timings", type=int, default=7, help="forwards timed per (model, batch, T)")
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--head-width", choices=["active", "dense"], default="active")
    ap.add_argument("--skip-costs", action="store_true", help="tok/s only")
    ap.add_argument("--models", nargs="*", default=["moe", "repeating"], choices=["moe", "repeating"],
                    help="whose tok/s to measure (none: verify costs only)")
    args = ap.parse_args()
    import dataclasses

    from specgen import load_model
    from specgen.drafters.mtp import random_mtp_weights, save_mtp

    print(machine())
    work = Path(tempfile.mkdtemp(prefix="specgen-moe-"))
    start = time.perf_counter()
    lms = {name: load_model(write_model(work / name, name == "moe")) for name in ("moe", "dense")}
    models = {name: lm.model for name, lm in lms.items()}
    cfg = models["moe"].config
    total = sum(np.prod(lin.weight.dense().shape) for b in models["moe"].weights.blocks
                for lin in b.linears())
    print(f"MoE: {cfg.num_layers} layers ({len(cfg.moe.layers)} routed), hidden {cfg.hidden_size}, "
          f"{cfg.moe.num_experts} experts top-{cfg.moe.top_k} of width {cfg.moe.intermediate_size} + "
          f"{cfg.moe.num_shared_experts} shared, {total / 1e6:.1f}M block weights; "
          f"dense: MLP width {DENSE_INTER}; "
          f"{models['moe'].backend.name} backend, {models['moe'].dtype}; built and loaded in "
          f"{time.perf_counter() - start:.1f} s")
    if not args.skip_costs:
        print("\nverify cost: one forward of T tokens per slot (ms, fastest), c(T) / c(1); one id: the "
              "block's tokens all one id")
        print_table(["batch", "T", "experts/block", "MoE ms", "MoE c(T)/c(1)", "one id: experts",
                     "one id: c(T)/c(1)", "dense ms", "dense c(T)/c(1)"],
                    verify_costs(models, args.batches, args.max_t, args.timings))
    head_cfg = dataclasses.replace(cfg, intermediate_size=DENSE_INTER) if args.head_width == "active" else cfg
    save_mtp(work / "head", random_mtp_weights(head_cfg, seed=0, std=0.02))
    print(f"\nMTP head: one dense block of MLP width {head_cfg.intermediate_size} ({args.head_width})")
    if "repeating" in args.models:
        lms["repeating"] = load_model(write_model(work / "repeating", True, out_scale=0.02))
    for name in args.models:
        print(f"\n{'random' if name == 'moe' else 'repeating'} MoE model: output tokens/s, k = {args.k}, "
              f"adaptive, {args.max_tokens} tokens per request")
        print_table(["batch", "method", "tok/s", "vs none", "vs none (CPU s)", "acceptance", "verified/token",
                     "identical"],
                    speeds(lms[name], str(work / "head"), args.batches, args.k, args.max_tokens,
                           args.repeats))
    print(machine())


if __name__ == "__main__":
    main()
