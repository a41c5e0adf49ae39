"""Checkpoints stored in bfloat16 or float16: read exactly, and multiplied from 16-bit panels
with float32's bits."""
import json
import shutil
import struct

import numpy as np
import paddle
import pytest
from conftest import TINY
from safetensors.numpy import load_file

from specgen import EngineConfig, SamplingParams, generate, kernels, load_model
from specgen.backends import fused
from specgen.runtime.batch import build_forward_batch


def rounded(a: np.ndarray, dtype: str) -> np.ndarray:
    """float32 values made exactly representable in `dtype`
    (BF16: round to nearest even on the top 16 bits)."""
    a = np.ascontiguousarray(a, np.float32)
    if dtype == "F16":
        return a.astype(np.float16).astype(np.float32)
    bits = a.view(np.uint32).astype(np.uint64)
    top = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    return (top.astype(np.uint32) << 16).view(np.float32)


def save_safetensors(path, tensors: dict[str, np.ndarray], dtype: str) -> None:
    """A safetensors file with every tensor stored as `dtype` (BF16 or F16), written byte by byte: an 8-byte
    little-endian header length, the JSON header, the data."""
    header, chunks, offset = {}, [], 0
    for name, a in tensors.items():
        data = (rounded(a, "BF16").view(np.uint32) >> 16).astype("<u2") if dtype == "BF16" \
            else a.astype("<f2")
        raw = data.tobytes()
        header[name] = {"dtype": dtype, "shape": list(a.shape), "data_offsets": [offset, offset + len(raw)]}
        chunks.append(raw)
        offset += len(raw)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + b"".join(chunks))


@pytest.fixture(scope="module", params=["BF16", "F16"])
def half_dir(request, tmp_path_factory):
    """The tiny llama checkpoint with every tensor stored as BF16 or F16."""
    d = tmp_path_factory.mktemp(request.param.lower())
    for f in TINY.joinpath("llama").iterdir():
        if f.name != "model.safetensors":
            shutil.copy(f, d / f.name)
    save_safetensors(d / "model.safetensors", load_file(TINY / "llama" / "model.safetensors"), request.param)
    return request.param, d


def test_half_tensors_load_exactly(half_dir):
    dtype, d = half_dir
    from specgen.models.hf_loader import read_safetensors

    got = read_safetensors([d / "model.safetensors"])
    want = load_file(TINY / "llama" / "model.safetensors")
    assert got.keys() == want.keys()
    for name, w in want.items():
        assert got[name].dtype == np.float32 and np.array_equal(got[name], rounded(w, dtype)), name


def test_half_kind_picks_the_narrowest_exact_format():
    x = np.array([0.5, -0.0, 3.0, 1e-3], np.float32)
    assert kernels.half_kind(rounded(x, "BF16")) == "BF16"  # bf16 first: every value fits it
    assert kernels.half_kind(np.array([1 + 2 ** -10, -0.0], np.float32)) == "F16"  # 11 significant bits
    assert kernels.half_kind(np.array([1e-8], np.float32)) is None  # a float16 subnormal rounds it
    assert kernels.half_kind(np.array([1 + 2 ** -20], np.float32)) is None
    assert kernels.half_kind(np.array([70000.0], np.float32)) is None  # a float16 overflows: not F16...
    assert kernels.half_kind(np.array([65536.0, np.inf], np.float32)) == "BF16"  # ...but a bfloat16


def test_half_checkpoint_packs_half_panels_with_float32_bits(half_dir, monkeypatch):
    """A bf16 / fp16 checkpoint's projections and LM head are packed as 16-bit panels (half the bytes of
    float32 panels); its logits and hidden states are bit-identical to float32 panels over the same values,
    prefill and verify blocks alike, and so are whole generations."""
    dtype, d = half_dir
    m = load_model(d).model
    if not isinstance(m.backend, fused.FusedBackend):
        pytest.skip("packed weights need the fused kernels and AVX2 or AVX-512")

    def kinds(model):
        return ({lin.weight.kind for lin in model.weights.blocks[0].linears()}
                | {model.weights.lm_head.weight.kind})

    assert kinds(m) == {dtype}
    # the same model packed as float32 panels
    monkeypatch.setattr(fused, "pack_linear", lambda w, dtype="float32": kernels.pack_linear(w, False, dtype))
    ref = load_model(d).model
    assert kinds(ref) == {"F32"}
    rng = np.random.default_rng(3)
    pre = build_forward_batch(np.arange(2), np.zeros(2, np.int64), np.array([9, 14]),
                              rng.integers(3, 250, 23), np.zeros(2, bool))
    ver = build_forward_batch(np.array([0, 1]), np.array([9, 14]), np.array([6, 1]), rng.integers(3, 250, 7),
                              np.ones(2, bool))
    outs = []
    for model in (m, ref):
        cache = model.new_cache(2, 64)
        outs.append([t.numpy() for b in (pre, ver) for out in [model.forward(b, cache)]
                     for t in (out.logits, out.hidden)])
    for a, b in zip(*outs):
        assert np.array_equal(a, b)
    prompts = [[5, 6, 7, 8, 9], [11, 12]]
    sp = SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.8, seed=2)
    runs = [generate(prompts, model=load_model(d), sampling=sp)]
    monkeypatch.undo()
    lm = load_model(d)
    runs += [generate(prompts, model=lm, sampling=sp, engine=EngineConfig(batch_size=bs)) for bs in (2, 1)]
    assert [o.token_ids for o in runs[0]] == [o.token_ids for o in runs[1]] == [o.token_ids for o in runs[2]]


@pytest.mark.parametrize("kind", ["BF16", "F16"])
def test_half_panels_multiply_like_float32_panels(kind):
    """specgen_linear over 16-bit panels: bit-identical to float32 panels of the same values for 1 to 130 rows
    (every row-group path, the many-row paths), any offset; the panels widen back to the weight."""
    if kernels.ops() is None:
        pytest.skip("fused CPU kernels not built")
    K = kernels.ops()
    rng = np.random.default_rng(len(kind))
    for k, n in [(64, 45), (576, 96), (96, 33)]:
        w = rounded(rng.standard_normal((k, n)) * 0.05, kind)
        half, full = kernels.pack_linear(w), kernels.pack_linear(w, halves=False)
        assert (half.kind, full.kind) == (kind, "F32") and np.array_equal(half.numpy(), w)
        x = rng.standard_normal((130, k)).astype(np.float32)
        y = K.specgen_linear(paddle.to_tensor(x), full.panels, n).numpy()
        for m, at in [(1, 0), (2, 7), (3, 1), (5, 40), (6, 2), (8, 12), (9, 0), (17, 20), (40, 3), (130, 0)]:
            part = K.specgen_linear(paddle.to_tensor(x[at:at + m]), half.panels, n).numpy()
            assert np.array_equal(part, y[at:at + m]), (k, n, m)
    w = rounded(rng.standard_normal((40, 8)), kind)  # k not a multiple of 32: float32 panels
    assert kernels.pack_linear(w).kind == "F32"
