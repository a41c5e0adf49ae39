"""GGUF ernie4_5 and ernie4_5-moe (llama.cpp's layout: q/k rows as HF writes them, interleaved-pair RoPE;
ffn_gate_inp routers, ffn_{gate,up,down}_exps stacked experts, ffn_*_shexp shared experts, exp_probs_b the
selection bias) written here from the tiny ERNIE-4.5 HF fixtures: the same config and, in float64, the same
logits and greedy tokens as the HF load of the same weights."""
from __future__ import annotations

import json

import gguf
import pytest
from conftest import TINY
from safetensors.numpy import load_file
from test_gguf_moe import add_shape, assert_same_model, finish, stacked_experts

from specgen.errors import CheckpointError
from specgen.models import load_checkpoint
from specgen.models.gguf_loader import load_gguf

GLOBAL = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
          "lm_head.weight": "output.weight"}
LAYER = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
         "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
         "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
         "mlp.gate": "ffn_gate_inp",
         "mlp.shared_experts.gate_proj": "ffn_gate_shexp", "mlp.shared_experts.up_proj": "ffn_up_shexp",
         "mlp.shared_experts.down_proj": "ffn_down_shexp"}


def write_ernie_gguf(path, fixture: str, skip: tuple[str, ...] = (), vocabulary=None) -> None:
    """llama.cpp's convert_hf_to_gguf layout of tests/fixtures/tiny/<fixture>; tensors whose GGUF names
    contain one of `skip` are left out; vocabulary(writer) writes the tokenizer's keys (None: no tokenizer,
    the fixture's bos and eos ids)."""
    cfg = json.loads((TINY / fixture / "config.json").read_text())
    hf = load_file(str(TINY / fixture / "model.safetensors"))
    moe = "moe_num_experts" in cfg
    arch = "ernie4_5-moe" if moe else "ernie4_5"
    w = gguf.GGUFWriter(str(path), arch)
    add_shape(w, cfg, cfg["rope_theta"])
    if moe:
        w.add_expert_count(cfg["moe_num_experts"])
        w.add_expert_used_count(cfg["moe_k"])
        w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
        w.add_expert_shared_count(cfg["moe_num_shared_experts"])
        w.add_leading_dense_block_count(cfg["moe_layer_start_index"])
        w.add_interleave_moe_layer_step(cfg["moe_layer_interval"])
    if vocabulary is None:
        w.add_bos_token_id(cfg["bos_token_id"])
        w.add_eos_token_id(cfg["eos_token_id"])
    else:
        vocabulary(w)
    tensors = {}
    for name, x in hf.items():
        if name in GLOBAL:
            tensors[GLOBAL[name]] = x
            continue
        _, _, i, rest = name.split(".", 3)
        if ".experts." in rest:
            continue  # written stacked below
        if rest.endswith("moe_statics.e_score_correction_bias"):
            tensors[f"blk.{i}.exp_probs_b.bias"] = x.reshape(-1)  # llama.cpp's [num_experts]
            continue
        module, kind = rest.rsplit(".", 1)
        tensors[f"blk.{i}.{LAYER[module]}.{kind}"] = x
    tensors.update(stacked_experts(hf, cfg["num_hidden_layers"], cfg.get("moe_num_experts", 0)))
    for name, x in tensors.items():
        if not any(s in name for s in skip):
            w.add_tensor(name, x)
    finish(w)


@pytest.fixture(scope="module", params=["ernie4_5", "ernie4_5_moe"])
def ernie_gguf(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param) / f"tiny-{request.param}.gguf"
    write_ernie_gguf(path, request.param)
    return request.param, path


def test_config_is_the_hf_config(ernie_gguf):
    fixture, path = ernie_gguf
    hf, gg = load_checkpoint(TINY / fixture).config, load_gguf(path).config
    assert gg.rope_interleaved and gg.tie_word_embeddings
    if fixture == "ernie4_5_moe":
        assert gg.moe.layers == (1, 2) and gg.moe.num_shared_experts == 2 and gg.moe.selection_bias
    else:
        assert gg.qkv_bias and gg.o_bias and gg.mlp_bias
    assert gg == hf


def test_logits_and_tokens_match_the_hf_load(ernie_gguf):
    fixture, path = ernie_gguf
    assert_same_model(TINY / fixture, path, seed=5)


@pytest.mark.parametrize("missing", ["blk.1.ffn_up_shexp", "blk.2.exp_probs_b"])
def test_a_missing_ernie_moe_tensor_is_named(tmp_path, missing):
    """Without one shared-experts tensor the load names it; without a block's selection bias, the other
    block's makes it expected there too."""
    path = tmp_path / "m.gguf"
    write_ernie_gguf(path, "ernie4_5_moe", skip=(missing,))
    with pytest.raises(CheckpointError, match=missing.replace(".", r"\.")):
        load_gguf(path)
