"""The torch.save reader without torch: tensors as stored (float32, bfloat16, strided views, sharded), and
files that would run code refused before anything runs."""
import collections
import os
import zipfile
from pathlib import Path

import numpy as np
import pytest
from torch_files import save_pickle_archive, save_torch

from specgen.errors import CheckpointError
from specgen.models.hf_loader import _weight_files, read_weights
from specgen.models.torch_file import read_archives as read_torch_files
from specgen.models.torch_file import read_torch_files as read_any


def _tensors():
    rng = np.random.default_rng(3)
    return {"fc.weight": rng.standard_normal((6, 4)).astype(np.float32),
            "fc.bias": rng.standard_normal(6).astype(np.float32),
            "layers.0.x": rng.standard_normal((2, 3, 5)).astype(np.float32),
            "ids": np.arange(12, dtype=np.int64).reshape(3, 4)}


@pytest.mark.parametrize("bf16, views", [(False, False), (True, False), (False, True)])
def test_tensors_read_as_stored(tmp_path, bf16, views):
    want = _tensors()
    save_torch(tmp_path / "w.bin", want, bf16=bf16, views=views, archive="w")
    got = read_torch_files([tmp_path / "w.bin"])
    assert sorted(got) == sorted(want)
    for name, a in want.items():
        assert got.info[name] == a.shape
        exact = (a.view(np.uint32) >> 16 << 16).view(np.float32) if bf16 and a.dtype.kind == "f" else a
        assert got[name].dtype == a.dtype and np.array_equal(got[name], exact), name


def test_sharded_bin_directory(tmp_path):
    import json

    want = _tensors()
    names = list(want)
    save_torch(tmp_path / "pytorch_model-00001-of-00002.bin", {n: want[n] for n in names[:2]})
    save_torch(tmp_path / "pytorch_model-00002-of-00002.bin", {n: want[n] for n in names[2:]})
    (tmp_path / "pytorch_model.bin.index.json").write_text(json.dumps(
        {"weight_map": {n: f"pytorch_model-0000{1 + (i >= 2)}-of-00002.bin" for i, n in enumerate(names)}}))
    got = read_weights(_weight_files(tmp_path))  # (torch's own reader where torch >= 2.6 is installed)
    assert all(np.array_equal(got[n], want[n]) for n in names)


class _RunsCommand:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


class _Evaluates:
    def __reduce__(self):
        return eval, ("__import__('os').getcwd()",)


@pytest.mark.parametrize("payload", ["system", "eval", "class"])
def test_code_in_the_pickle_is_refused_and_never_runs(tmp_path, payload):
    marker = tmp_path / "ran"
    obj = {"system": lambda: collections.OrderedDict(w=_RunsCommand(marker)),
           "eval": lambda: {"w": _Evaluates()},
           "class": lambda: {"w": _RunsCommand}}[payload]()
    save_pickle_archive(tmp_path / "evil.bin", obj)
    with pytest.raises(CheckpointError, match="refused") as err:
        read_torch_files([tmp_path / "evil.bin"])
    assert not marker.exists()
    assert "evil.bin" in str(err.value)


def test_not_a_state_dict_or_not_an_archive(tmp_path):
    save_pickle_archive(tmp_path / "list.pt", [1, 2])
    with pytest.raises(CheckpointError, match="not a state dict"):
        read_torch_files([tmp_path / "list.pt"])
    import pickle

    (tmp_path / "legacy.pt").write_bytes(pickle.dumps({"w": 1}))
    with pytest.raises(CheckpointError, match="not a torch zip archive"):
        read_torch_files([tmp_path / "legacy.pt"])
    with zipfile.ZipFile(tmp_path / "empty.pt", "w") as z:
        z.writestr("x/other", b"")
    with pytest.raises(CheckpointError, match="no data.pkl"):
        read_torch_files([tmp_path / "empty.pt"])


def test_truncated_storage(tmp_path):
    save_torch(tmp_path / "w.bin", {"a": np.ones((4, 4), np.float32)})
    with zipfile.ZipFile(tmp_path / "w.bin") as z:
        entries = {n: z.read(n) for n in z.namelist()}
    entries["archive/data/0"] = entries["archive/data/0"][:20]
    with zipfile.ZipFile(tmp_path / "cut.bin", "w") as z:
        for n, b in entries.items():
            z.writestr(n, b)
    with pytest.raises(CheckpointError, match="truncated"):
        read_torch_files([tmp_path / "cut.bin"])["a"]


def test_a_pickle_cannot_change_the_reader_for_later_files(tmp_path):
    """BUILD on the objects the reader hands out (a storage type, a rebuild function) reaches only this load's
    objects: a later float32 file still reads as float32."""
    # GLOBAL torch FloatStorage; {"numpy": "<f8"}; BUILD; then an empty dict as the result
    body = b"\x80\x02ctorch\nFloatStorage\n}X\x05\x00\x00\x00numpyX\x03\x00\x00\x00<f8sb0}."
    with zipfile.ZipFile(tmp_path / "odd.bin", "w") as z:
        z.writestr("archive/data.pkl", body)
    try:
        read_torch_files([tmp_path / "odd.bin"])
    except CheckpointError:
        pass  # refused or read as an empty state dict: either way nothing else changes
    save_torch(tmp_path / "w.bin", {"a": np.arange(6, dtype=np.float32)})
    assert read_torch_files([tmp_path / "w.bin"])["a"].tolist() == list(range(6))


@pytest.mark.parametrize("size, stride", [((1 << 20, 1 << 10), (0, 0)), ((-1,), (1,)), ((2.5,), (1,))])
def test_a_tensor_larger_than_its_storage_is_refused(tmp_path, size, stride):
    """A few bytes of storage claiming a huge (or malformed) tensor: refused before anything is allocated."""
    from torch_files import save_pickle_tensor

    save_pickle_tensor(tmp_path / "big.bin", size, stride)
    with pytest.raises(CheckpointError, match="refused"):
        read_torch_files([tmp_path / "big.bin"])


def test_a_compressed_pickle_is_refused(tmp_path):
    save_torch(tmp_path / "w.bin", {"a": np.ones(4, np.float32)})
    with zipfile.ZipFile(tmp_path / "w.bin") as z:
        entries = {n: z.read(n) for n in z.namelist()}
    with zipfile.ZipFile(tmp_path / "zipped.bin", "w", zipfile.ZIP_DEFLATED) as z:
        for n, b in entries.items():
            z.writestr(n, b)
    with pytest.raises(CheckpointError, match="compressed"):
        read_torch_files([tmp_path / "zipped.bin"])


def test_without_safe_torch_the_restricted_reader_is_used(tmp_path, monkeypatch):
    import specgen.models.torch_file as tf

    monkeypatch.setattr(tf, "_safe_torch", lambda: None)
    save_torch(tmp_path / "w.bin", {"a": np.arange(3, dtype=np.float32)})
    assert read_any([tmp_path / "w.bin"])["a"].tolist() == [0, 1, 2]


def test_a_main_model_as_pytorch_model_bin(tmp_path):
    """An HF directory with pytorch_model.bin (no safetensors) loads as the same model: the same tokens."""
    import shutil

    from conftest import TINY

    from specgen import SamplingParams, generate, load_model
    from specgen.models.hf_loader import read_safetensors

    src = TINY / "llama"
    for f in src.iterdir():
        if f.suffix != ".safetensors" and f.is_file():
            shutil.copy(f, tmp_path / f.name)
    tensors = read_safetensors([src / "model.safetensors"])
    save_torch(tmp_path / "pytorch_model.bin", {n: tensors[n] for n in tensors}, views=True)
    prompts, sp = [[5, 9, 31, 7], [40, 41]], SamplingParams(max_tokens=8)
    want = generate(prompts, model=load_model(src, dtype="float64"), sampling=sp)
    got = generate(prompts, model=load_model(tmp_path, dtype="float64"), sampling=sp)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
