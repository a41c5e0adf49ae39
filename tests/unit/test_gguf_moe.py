"""GGUF qwen3moe (llama.cpp's layout: ffn_gate_inp routers, ffn_{gate,up,down}_exps stacked experts) written
here from the tiny Qwen3-MoE HF fixture: the same config and, in float64, the same logits and greedy tokens as
the HF load of the same weights; stacked Q8_0 experts split into each expert's raw rows, which the fused
backend multiplies as blocks."""
from __future__ import annotations

import json

import gguf
import numpy as np
import pytest
from conftest import TINY
from gguf.quants import dequantize, quantize
from safetensors.numpy import load_file

from specgen import EngineConfig, SamplingParams, generate, load_model
from specgen.errors import CheckpointError
from specgen.models import load_checkpoint
from specgen.models.gguf_loader import load_gguf
from specgen.runtime.batch import build_forward_batch

T = gguf.GGMLQuantizationType
GLOBAL = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
          "lm_head.weight": "output.weight"}
LAYER = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
         "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
         "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate",
         "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down", "mlp.gate": "ffn_gate_inp"}


def write_qwen3moe_gguf(path, expert_type=T.F32, drop_norm_key=False) -> None:
    """llama.cpp's convert_hf_to_gguf layout of tests/fixtures/tiny/qwen3_moe (no tokenizer)."""
    cfg = json.loads((TINY / "qwen3_moe" / "config.json").read_text())
    hf = load_file(str(TINY / "qwen3_moe" / "model.safetensors"))
    w = gguf.GGUFWriter(str(path), "qwen3moe")
    add_shape(w, cfg, cfg["rope_parameters"]["rope_theta"])
    w.add_expert_count(cfg["num_local_experts"])
    w.add_expert_used_count(cfg["num_experts_per_tok"])
    w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    if not drop_norm_key:
        w.add_expert_weights_norm(cfg["norm_topk_prob"])
    w.add_bos_token_id(cfg["bos_token_id"])
    w.add_eos_token_id(cfg["eos_token_id"])
    for name, x in hf.items():
        if name in GLOBAL:
            w.add_tensor(GLOBAL[name], x)
            continue
        _, _, i, rest = name.split(".", 3)
        if ".experts." in rest:
            continue  # written stacked below
        module, kind = rest.rsplit(".", 1)
        w.add_tensor(f"blk.{i}.{LAYER[module]}.{kind}", x)
    for name, stacked in stacked_experts(hf, cfg["num_hidden_layers"], cfg["num_local_experts"]).items():
        if expert_type == T.F32:
            w.add_tensor(name, stacked)
        else:
            w.add_tensor(name, quantize(stacked, expert_type), raw_dtype=expert_type)
    finish(w)


def stacked_experts(hf: dict, num_layers: int, num_experts: int) -> dict[str, np.ndarray]:
    """llama.cpp's blk.{i}.ffn_{gate,up,down}_exps.weight [num_experts, out, in] of every block with routed
    experts, from HF's per-expert tensors (dense blocks have none)."""
    out = {}
    for i in range(num_layers):
        for proj in ("gate", "up", "down"):
            parts = [hf.get(f"model.layers.{i}.mlp.experts.{e}.{proj}_proj.weight")
                     for e in range(num_experts)]
            if parts and parts[0] is not None:
                out[f"blk.{i}.ffn_{proj}_exps.weight"] = np.stack(parts)
    return out


def finish(w: gguf.GGUFWriter) -> None:
    """Header, metadata and tensors to the file."""
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def add_shape(w: gguf.GGUFWriter, cfg: dict, rope_theta: float) -> None:
    """The model-shape keys of an HF config.json, as llama.cpp's converter writes them."""
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_key_length(cfg["head_dim"])
    w.add_value_length(cfg["head_dim"])
    w.add_rope_freq_base(rope_theta)
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_context_length(cfg["max_position_embeddings"])


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3moe") / "tiny-qwen3moe.gguf"
    write_qwen3moe_gguf(path)
    return path


def test_config_is_the_hf_config(tiny_gguf):
    hf, gg = load_checkpoint(TINY / "qwen3_moe").config, load_gguf(tiny_gguf).config
    assert gg.moe.layers == (0, 2) and gg.moe.num_experts == 8 and not gg.moe.norm_topk_prob  # layer 1 dense
    assert gg == hf


def test_logits_and_tokens_match_the_hf_load(tiny_gguf):
    assert_same_model(TINY / "qwen3_moe", tiny_gguf)


def assert_same_model(hf_dir, gguf_path, seed: int = 4) -> None:
    """float64, reference backend: the same weights give the same logits (to rounding) and greedy tokens."""
    models = {name: load_model(path, dtype="float64", backend="reference")
              for name, path in (("hf", hf_dir), ("gguf", gguf_path))}
    rng = np.random.default_rng(seed)
    lens = np.array([11, 4, 7])
    batch = build_forward_batch(np.arange(3), np.zeros(3, np.int64), lens, rng.integers(3, 297, lens.sum()),
                                np.ones(3, bool))
    logits = {n: m.model.forward(batch, m.model.new_cache(3, 32)).logits.numpy() for n, m in models.items()}
    assert np.abs(logits["hf"] - logits["gguf"]).max() < 1e-10
    prompts = [rng.integers(3, 297, 9).tolist() for _ in range(3)]
    sp = SamplingParams(max_tokens=8, ignore_eos=True)
    tokens = {n: [o.token_ids for o in generate(prompts, model=m, sampling=sp,
                                                engine=EngineConfig(dtype="float64"))]
              for n, m in models.items()}
    assert tokens["hf"] == tokens["gguf"]


def test_llama_cpp_default_renormalises_the_top_k(tmp_path):
    """Without {arch}.expert_weights_norm, llama.cpp's qwen3moe divides the top-k weights by their sum."""
    write_qwen3moe_gguf(tmp_path / "m.gguf", drop_norm_key=True)
    assert load_gguf(tmp_path / "m.gguf").config.moe.norm_topk_prob


def test_stacked_q8_0_experts_split_into_each_experts_rows(tmp_path):
    write_qwen3moe_gguf(tmp_path / "q8.gguf", expert_type=T.Q8_0)
    ckpt = load_gguf(tmp_path / "q8.gguf")
    hf = load_file(str(TINY / "qwen3_moe" / "model.safetensors"))
    name = "model.layers.2.mlp.experts.5.down_proj.weight"
    rows = ckpt.quantized[name]
    # [out, blocks, bytes]: 32 inputs, one block
    assert rows.kind == "Q8_0" and rows.blocks.shape == (64, 1, 34)
    assert np.array_equal(dequantize(rows.blocks.reshape(64, 34), T.Q8_0), ckpt.weights[name])
    assert np.abs(ckpt.weights[name] - hf[name]).max() <= np.abs(hf[name]).max() / 100
    # the fused backend multiplies each expert's Q8_0 blocks; the reference their dequantized values: one
    # result
    rng = np.random.default_rng(4)
    lens = np.array([11, 4, 7])
    batch = build_forward_batch(np.arange(3), np.zeros(3, np.int64), lens, rng.integers(3, 297, lens.sum()),
                                np.ones(3, bool))
    logits = {}
    for backend in ("fused", "reference"):
        m = load_model(tmp_path / "q8.gguf", backend=backend).model
        logits[backend] = m.forward(batch, m.new_cache(3, 32)).logits.numpy()
        if backend == "fused":
            # packed from the blocks as read (the blocks themselves let go)
            assert m.weights.blocks[2].moe.experts[5].down.weight.kind == "Q8_0"
    assert np.abs(logits["fused"] - logits["reference"]).max() < 1e-4


def test_a_missing_expert_tensor_is_named(tmp_path):
    path = tmp_path / "m.gguf"
    write_qwen3moe_gguf(path)
    reader = gguf.GGUFReader(path)
    w = gguf.GGUFWriter(str(tmp_path / "cut.gguf"), "qwen3moe")
    for field in reader.fields.values():
        if field.name.startswith(("GGUF.", "general.architecture")):
            continue
        w.add_key_value(field.name, field.contents(), field.types[0], field.types[-1] if len(field.types) > 1
                        else None)
    for t in reader.tensors:
        if t.name != "blk.2.ffn_up_exps.weight":
            w.add_tensor(t.name, np.array(t.data).reshape([int(d) for d in reversed(t.shape)]))
    finish(w)
    with pytest.raises(CheckpointError, match="blk.2.ffn_up_exps.weight"):
        load_gguf(tmp_path / "cut.gguf")
