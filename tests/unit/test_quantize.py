"""Weight-only quantization at load: the blocks, the same weights on both backends, exactness, the cache."""
from __future__ import annotations

import numpy as np
import pytest
from conftest import TINY
from gguf import GGMLQuantizationType, quants

from specgen import EngineConfig, Method, SamplingParams, SpecConfig, generate, load_model
from specgen.errors import ConfigError
from specgen.models import load_checkpoint
from specgen.models.quantize import HEAD_KIND, KIND, projection_names, quantize_checkpoint, quantize_rows

PROMPTS = [[3, 4, 5, 6, 7, 3, 4, 5], [9, 8, 7, 9, 8, 7, 9, 8], [11, 12, 13], [20, 21, 20, 21, 20, 21, 20]]


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_1"])
def test_quantize_rows_are_gguf_blocks(kind):
    w = np.random.default_rng(0).standard_normal((6, 64)).astype(np.float32)
    blocks, values = quantize_rows(w, kind)
    assert blocks.shape == (6, 2, {"Q8_0": 34, "Q4_1": 20}[kind]) and blocks.dtype == np.uint8
    qtype = GGMLQuantizationType[kind]
    np.testing.assert_array_equal(values, quants.dequantize(blocks.reshape(6, -1), qtype))
    err = np.abs(values - w).max(axis=1) / np.abs(w).max(axis=1)
    assert (err < {"Q8_0": 0.01, "Q4_1": 0.2}[kind]).all() and (values != w).any()


@pytest.mark.parametrize("mode", ["wint8", "wint4"])
def test_every_projection_and_the_head_quantized(mode, tmp_path):
    ckpt = load_checkpoint(TINY / "llama", tmp_path)
    quantized, count = quantize_checkpoint(ckpt, mode)
    names = projection_names(ckpt)
    assert count == len(names) == 2 * 7 + 1 and names[-1] == "lm_head.weight"
    for name in names:
        q = quantized.quantized[name]
        assert q.kind == (HEAD_KIND if name == "lm_head.weight" else KIND[mode])
        assert np.array_equal(quantized.weights[name],
                              quants.dequantize(q.blocks.reshape(q.blocks.shape[0], -1),
                                                GGMLQuantizationType[q.kind]))
    assert np.array_equal(quantized.weights["model.embed_tokens.weight"],
                          ckpt.weights["model.embed_tokens.weight"])
    none, _ = quantize_checkpoint(quantized, "none")  # float again: the quantized values, no blocks
    assert none.quantized == {} and np.array_equal(none.weights[names[0]], quantized.weights[names[0]])
    again, count = quantize_checkpoint(quantized, mode)  # blocks of the mode's kind stay as stored
    assert count == 0
    assert np.array_equal(again.quantized[names[0]].blocks, quantized.quantized[names[0]].blocks)


@pytest.mark.parametrize("mode", ["wint8", "wint4"])
def test_fused_and_reference_run_the_same_weights(mode):
    """fp64: the fused kernels over the blocks and Paddle's operators over the dequantized values agree token
    for token (and differ from the float model: the quantization is real)."""
    sp = SamplingParams(max_tokens=16, ignore_eos=True)
    runs = {}
    for backend in ("fused", "reference"):
        for q in ("auto", mode):
            lm = load_model(TINY / "llama", backend=backend, dtype="float64", quantization=q)
            runs[backend, q] = [o.token_ids for o in generate(PROMPTS, model=lm, sampling=sp)]
    assert runs["fused", mode] == runs["reference", mode]
    assert runs["fused", "auto"] == runs["reference", "auto"]
    assert runs["fused", mode] != runs["fused", "auto"]


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("mode", ["wint8", "wint4"])
def test_speculation_exact_under_quantization(mode, dtype):
    lm = load_model(TINY / "llama", dtype=dtype, quantization=mode)
    runs = []
    for batch in (1, 3):
        for method in (Method.NONE, Method.NGRAM):
            for temperature in (0.0, 0.8):
                sp = SamplingParams(max_tokens=24, ignore_eos=True, temperature=temperature, seed=5)
                outs = generate(PROMPTS, model=lm, sampling=sp,
                                engine=EngineConfig(batch_size=batch, dtype=dtype),
                                speculative=SpecConfig(method=method, adaptive=False))
                runs.append(((method, temperature), [o.token_ids for o in outs]))
    for temperature in (0.0, 0.8):
        same = [ids for (m, t), ids in runs if t == temperature]
        assert all(ids == same[0] for ids in same)


def test_quantized_checkpoint_is_cached(tmp_path):
    first = load_checkpoint(TINY / "llama", tmp_path, "wint4")
    entries = list((tmp_path / "quantized").iterdir())
    assert len(entries) == 1 and entries[0].name.startswith("llama-wint4-")
    second = load_checkpoint(TINY / "llama", tmp_path, "wint4")
    for name, q in first.quantized.items():
        assert (q.kind == second.quantized[name].kind
                and np.array_equal(q.blocks, second.quantized[name].blocks))
    assert load_checkpoint(TINY / "llama", tmp_path, "auto").quantized == {}


def test_unknown_quantization_is_a_config_error():
    with pytest.raises(ConfigError, match="quantization must be one of auto, none, wint8, wint4"):
        EngineConfig(quantization="int3")
