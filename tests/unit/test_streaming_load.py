"""Loads that hold one tensor at a time: checkpoints read when asked for, GGUF tensors used from the file
(the cache keeps no copy), quantization streamed into the cache, and blocks kept on the reference backend."""
from __future__ import annotations

import numpy as np
import pytest
from conftest import TINY
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize, quantize
from safetensors.numpy import load_file, save_file
from test_gguf_loader import ALL_LINEAR, K_QUANTS, T, write_tiny_gguf

from specgen import load_model
from specgen.errors import CheckpointError
from specgen.layers.quant import DeviceBlocks
from specgen.models import checkpoint, gguf_loader, load_checkpoint
from specgen.models.checkpoint import SafetensorsFile, write_safetensors
from specgen.models.gguf_loader import load_gguf
from specgen.models.quantize import projection_names
from specgen.runtime.batch import build_forward_batch


def random_blocks(kind: str, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """GGUF blocks [rows, cols / block weights, block bytes] of `kind`."""
    qtype = GGMLQuantizationType[kind]
    weights, size = GGML_QUANT_SIZES[qtype]
    if qtype in K_QUANTS:  # random bytes, with a sane float16 super-block scale (and minimum)
        b = rng.integers(0, 256, (rows, cols // weights, size), dtype=np.uint8)
        s = K_QUANTS[qtype]
        b[:, :, s] = np.full((s.stop - s.start) // 2, 0.01, np.float16).view(np.uint8)
        return b
    w = rng.standard_normal((rows, cols)).astype(np.float32)
    return quantize(w, qtype).reshape(rows, cols // weights, size)


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K"])
def test_device_blocks_rebuild_gguf_values_exactly(kind):
    rng = np.random.default_rng(1)
    blocks = random_blocks(kind, 48, 512, rng)
    want = dequantize(blocks.reshape(48, -1), GGMLQuantizationType[kind]).reshape(48, 512)
    dev = DeviceBlocks.of(kind, blocks)
    got = dev.dense().numpy()  # [in, out]
    assert got.dtype == np.float32 and np.array_equal(got.view(np.uint32), want.T.view(np.uint32))
    assert np.array_equal(dev.dense("float64").numpy(), want.T.astype(np.float64))
    assert dev.nbytes() <= {"Q8_0": 1.07, "Q4_0": 0.57, "Q4_1": 0.63}.get(kind, 1.5) * 48 * 512


@pytest.mark.parametrize("mode", ["wint8", "wint4"])
def test_reference_backend_keeps_quantized_weights_as_blocks(mode):
    """--quantization wint8 / wint4 on the reference backend: every projection and the LM head stay blocks
    (a fraction of float32's bytes), dequantized a layer at a time to the values the fused path multiplies by:
    float64 logits equal the fused backend's to float64 rounding, float32 within float32's."""
    rng = np.random.default_rng(2)
    lens = np.array([7, 4])
    batch = build_forward_batch(np.arange(2), np.zeros(2, np.int64), lens, rng.integers(3, 290, lens.sum()),
                                np.ones(2, bool))
    logits = {}
    for backend in ("reference", "fused"):
        for dtype in ("float64", "float32"):
            m = load_model(TINY / "llama", backend=backend, dtype=dtype, quantization=mode).model
            logits[backend, dtype] = m.forward(batch, m.new_cache(2, 32)).logits.numpy()
            if backend == "reference":
                linears = m.weights.linears()
                assert all(isinstance(lin.weight, DeviceBlocks) and lin.blocks is None for lin in linears)
                held = sum(lin.weight.nbytes() for lin in linears)
                floats = sum(4 * lin.weight.out * lin.weight.inp for lin in linears)
                assert held < {"wint8": 0.28, "wint4": 0.26}[mode] * floats, (held, floats)
    ref, fused = logits["reference", "float64"], logits["fused", "float64"]
    assert np.abs(ref - fused).max() <= 1e-12 * np.abs(fused).max()
    assert np.abs(logits["reference", "float32"] - logits["fused", "float32"]).max() < 1e-4


def test_gguf_tensors_are_read_from_the_file_when_asked_for(tmp_path, monkeypatch):
    """load_gguf reads metadata only; a fused model reads each projection's blocks once and never makes their
    float32 values (only the embedding's, the norms' and the float tensors'); the LM head's blocks are read
    again when a drafter asks for them, not held."""
    path = tmp_path / "m.gguf"
    write_tiny_gguf(path, qtype=T.Q4_1, quantized=ALL_LINEAR)
    reads: list[int] = []
    real = checkpoint.read_range
    monkeypatch.setattr(gguf_loader, "read_range", lambda p, o, n: reads.append(n) or real(p, o, n))
    values: list[str] = []
    real_values = gguf_loader.StoredTensor.values
    monkeypatch.setattr(gguf_loader.StoredTensor, "values",
                        lambda self, p: values.append(self.kind) or real_values(self, p))
    ckpt = load_gguf(path)
    assert reads == [] and values == []
    m = load_model(path, backend="fused", cache_dir=str(tmp_path / "cache")).model
    data = sum(t.n_bytes for t in __import__("gguf").GGUFReader(path).tensors)
    assert data <= sum(reads) <= data + 2 * ckpt.quantized["model.embed_tokens.weight"].blocks.nbytes
    # floats made: the Q4_1 embedding (its rows are looked up) and the F32 norms only
    assert values.count("Q4_1") == 1 and set(values) == {"Q4_1", "F32"}
    head = m.weights.lm_head
    assert head.blocks is not None and not isinstance(head.blocks, checkpoint.QuantRows)
    assert np.array_equal(head.blocks.blocks, ckpt.quantized["model.embed_tokens.weight"].blocks)


def test_quantized_cache_entry_holds_no_float_copy_of_a_quantized_weight(tmp_path):
    first = load_checkpoint(TINY / "llama", tmp_path, "wint4")
    entries = list((tmp_path / "quantized").iterdir())
    assert len(entries) == 1
    floats = load_file(entries[0] / "model.safetensors")
    names = projection_names(first)
    assert not set(floats) & set(names) and set(floats) == set(first.weights) - set(names)
    blocks = SafetensorsFile.open(entries[0] / "quantized.safetensors")
    assert set(blocks.tensors) == set(names)
    again = load_checkpoint(TINY / "llama", tmp_path, "wint4")  # read back
    for name in first.weights:
        assert np.array_equal(again.weights[name], first.weights[name]), name


def test_write_safetensors_is_read_back_by_safetensors(tmp_path):
    rng = np.random.default_rng(3)
    arrays = {"a": rng.standard_normal((3, 5)).astype(np.float32), "b": rng.integers(0, 255, (7,), np.uint8),
              "c": rng.standard_normal((2, 2)).astype(np.float16)}
    write_safetensors(tmp_path / "x.safetensors",
                      {n: ({"float32": "F32", "uint8": "U8", "float16": "F16"}[str(a.dtype)], a.shape)
                       for n, a in arrays.items()}, arrays.__getitem__, {"k": "v"})
    back = load_file(tmp_path / "x.safetensors")
    assert back.keys() == arrays.keys() and all(np.array_equal(back[n], a) for n, a in arrays.items())
    # BF16 given as bits, read back widened exactly by our reader
    bits = (rng.standard_normal(6).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    write_safetensors(tmp_path / "h.safetensors", {"h": ("BF16", (6,))}, lambda n: bits)
    got = SafetensorsFile.open(tmp_path / "h.safetensors").read("h")
    assert np.array_equal(got.view(np.uint32), bits.astype(np.uint32) << 16)
    save_file({"z": np.zeros(3, np.float32)}, tmp_path / "z.safetensors")
    assert SafetensorsFile.open(tmp_path / "z.safetensors").read("z").tolist() == [0, 0, 0]


def header_matches_gguf_reader(path) -> None:
    import gguf

    from specgen.models.gguf_header import read_header

    ours, theirs = read_header(path), gguf.GGUFReader(path)
    fields = {k: f.contents() for k, f in theirs.fields.items() if not k.startswith("GGUF.")}
    assert ours.fields.keys() == fields.keys()
    for key, value in fields.items():
        assert ours.fields[key] == value and type(ours.fields[key]) is type(value), key
    assert [(t.name, t.shape, t.tensor_type, t.data_offset, t.n_bytes) for t in ours.tensors] == [
        (t.name, tuple(int(d) for d in t.shape), t.tensor_type, int(t.data_offset), int(t.n_bytes))
        for t in theirs.tensors]


@pytest.mark.parametrize("qtype", [T.Q8_0, T.Q4_1, T.F16], ids=lambda t: t.name)
def test_gguf_header_reads_what_gguf_reader_reads(tmp_path, qtype):
    path = tmp_path / "m.gguf"
    write_tiny_gguf(path, qtype=qtype, quantized=ALL_LINEAR)
    header_matches_gguf_reader(path)
    truncated = tmp_path / "t.gguf"
    truncated.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(CheckpointError, match="not a readable GGUF file"):
        load_gguf(truncated)


@pytest.mark.realmodel
def test_gguf_header_of_the_default_model():
    from conftest import has_default_model

    if not has_default_model():
        pytest.skip("the default model is not installed")
    from specgen.models.default_model import default_gguf_path

    header_matches_gguf_reader(default_gguf_path())
