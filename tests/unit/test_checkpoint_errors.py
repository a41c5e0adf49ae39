"""Bad checkpoints give a CheckpointError that names the file and the tensor."""
import json
import shutil

import numpy as np
import pytest
from conftest import TINY
from safetensors.numpy import load_file, save_file

from specgen import load_model
from specgen.errors import CheckpointError


@pytest.fixture
def ckpt(tmp_path):
    d = tmp_path / "ckpt"
    shutil.copytree(TINY / "llama", d)
    return d


def test_missing_directory(tmp_path):
    with pytest.raises(CheckpointError, match="no such checkpoint"):
        load_model(tmp_path / "nope")


def test_missing_config(ckpt):
    (ckpt / "config.json").unlink()
    with pytest.raises(CheckpointError, match=r"config\.json: file not found"):
        load_model(ckpt)


def test_missing_weights_file(ckpt):
    (ckpt / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="no model.safetensors"):
        load_model(ckpt)


def test_unsupported_architecture(ckpt):
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (ckpt / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"config\.json: unsupported architecture.*GPT2LMHeadModel"):
        load_model(ckpt)


def test_missing_tensor(ckpt):
    w = load_file(str(ckpt / "model.safetensors"))
    del w["model.layers.1.mlp.up_proj.weight"]
    save_file(w, str(ckpt / "model.safetensors"))
    with pytest.raises(CheckpointError,
                       match=r"ckpt: missing tensor 'model\.layers\.1\.mlp\.up_proj\.weight'"):
        load_model(ckpt)


def test_wrong_shape(ckpt):
    w = load_file(str(ckpt / "model.safetensors"))
    w["model.layers.0.self_attn.k_proj.weight"] = np.zeros((5, 64), np.float32)
    save_file(w, str(ckpt / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"k_proj\.weight' has shape \[5, 64\], expected \[32, 64\]"):
        load_model(ckpt)


def test_corrupt_safetensors(ckpt):
    (ckpt / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(CheckpointError, match=r"model\.safetensors: cannot read safetensors"):
        load_model(ckpt)


def test_sharded_index_and_missing_shard(ckpt):
    w = load_file(str(ckpt / "model.safetensors"))
    names = sorted(w)
    half = len(names) // 2
    save_file({n: w[n] for n in names[:half]}, str(ckpt / "model-00001-of-00002.safetensors"))
    save_file({n: w[n] for n in names[half:]}, str(ckpt / "model-00002-of-00002.safetensors"))
    (ckpt / "model.safetensors").unlink()
    index = {"weight_map": {n: f"model-0000{1 if i < half else 2}-of-00002.safetensors"
                            for i, n in enumerate(names)}}
    (ckpt / "model.safetensors.index.json").write_text(json.dumps(index))
    assert load_model(ckpt).config.num_layers == 2
    (ckpt / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"model-00002-of-00002\.safetensors: weight shard not found"):
        load_model(ckpt)
