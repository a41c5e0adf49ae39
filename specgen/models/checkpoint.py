"""Checkpoint: what every loader (HF directory, GGUF) hands to the runtime."""
from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Generic, TypeVar

import numpy as np

from specgen.models.config import ModelConfig
from specgen.models.tokenizer import TextTokenizer

# GGUF block formats whose raw blocks the runtime can multiply by directly (specgen/kernels/linear.cc): bytes
# per block, and weights per block (the K-quants' super-blocks hold 256).
# "QX" is specgen's own (specgen.kernels.qx_rows): what rows of mixed formats are converted to when fused.
QUANT_BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34, "Q4_K": 144, "Q5_K": 176, "Q6_K": 210, "QX": 48}
QUANT_BLOCK_WEIGHTS = {"Q4_0": 32, "Q4_1": 32, "Q8_0": 32, "Q4_K": 256, "Q5_K": 256, "Q6_K": 256, "QX": 32}


@dataclass(frozen=True)
class QuantRows:
    """A Linear weight [out, in] as its GGUF file stores it (or, fused from rows of several formats, as QX):
    uint8 blocks [out, in / QUANT_BLOCK_WEIGHTS[kind], QUANT_BLOCK_BYTES[kind]] of `kind`. Dequantized, they
    are the float32 weight the checkpoint also holds."""

    kind: str
    blocks: np.ndarray  # [out, in / QUANT_BLOCK_WEIGHTS[kind], QUANT_BLOCK_BYTES[kind]] uint8


class MixedRows:
    """QuantRows of rows fused from runs stored in different formats: `parts`, the runs as stored (in row
    order), which the fused kernels multiply each in its own format; `blocks`, their union converted to QX
    (the reference backend's), made only when asked for."""

    kind = "QX"

    def __init__(self, parts: tuple[QuantRows, ...]):
        self.parts = parts
        self._blocks: np.ndarray | None = None

    @property
    def blocks(self) -> np.ndarray:  # [out, in / 32, 48] uint8
        if self._blocks is None:
            from specgen.kernels.packing import qx_rows

            self._blocks = np.concatenate([qx_rows(p.kind, p.blocks) for p in self.parts])
        return self._blocks


class StoredRows:
    """QuantRows whose blocks are read from the checkpoint each time they are asked for (an LM head's, kept
    for the drafters that take rows of it, once the backend packed it)."""

    def __init__(self, kind: str, read: Callable[[], QuantRows]):
        self.kind, self._read = kind, read

    @property
    def blocks(self) -> np.ndarray:  # [out, in / QUANT_BLOCK_WEIGHTS[kind], QUANT_BLOCK_BYTES[kind]] uint8
        return self._read().blocks


V = TypeVar("V")


class Lazy(Mapping[str, V], Generic[V]):
    """name -> value, each read only when asked for and not kept (from its file, dequantized from its blocks):
    a load that asks for one tensor at a time holds one at a time. What each entry is (a tensor's shape, a
    block set's kind) is known without reading it."""

    def __init__(self, info: dict[str, Any], read: Callable[[str], V]):
        self.info, self._read = info, read

    @classmethod
    def held(cls, values: Mapping[str, V], describe: Callable[[V], Any]) -> "Lazy[V]":
        """Values already in memory."""
        return values if isinstance(values, Lazy) else cls({n: describe(v) for n, v in values.items()},
                                                           values.__getitem__)

    def __getitem__(self, name: str) -> V:
        if name not in self.info:
            raise KeyError(name)
        return self._read(name)

    def __contains__(self, name: object) -> bool:
        return name in self.info

    def __iter__(self) -> Iterator[str]:
        return iter(self.info)

    def __len__(self) -> int:
        return len(self.info)

    def overlay(self, info: dict[str, Any], read: Callable[[str], V]) -> "Lazy[V]":
        """These entries, with those of `info` read by `read` instead (added or replacing)."""
        own = self._read
        return Lazy(self.info | info, lambda n: read(n) if n in info else own(n))


def tensor_shape(w: np.ndarray) -> tuple[int, ...]:
    return tuple(w.shape)


def block_kind(q: QuantRows) -> str:
    return q.kind


@dataclass
class Checkpoint:
    """Weights in HF naming and HF layout (Linear weights [out, in]), float32 numpy arrays read when asked for
    (`weights.info`: their shapes); `quantized` the raw blocks of those a GGUF file stores block-quantized
    (or quantized at load; `quantized.info`: their kinds). Plain dicts given are wrapped."""

    config: ModelConfig
    weights: Lazy[np.ndarray]
    tokenizer: TextTokenizer | None
    source: str  # the path it was loaded from, for messages
    quantized: Lazy[QuantRows] = field(default_factory=dict)

    def __post_init__(self):
        self.weights = Lazy.held(self.weights, tensor_shape)
        self.quantized = Lazy.held(self.quantized, block_kind)


# Files of an HF checkpoint directory that decide its outputs: weights, configs, tokenizer.
MODEL_FILE_SUFFIXES = (".safetensors", ".json", ".model", ".txt", ".gguf", ".npy", ".jinja")


def checkpoint_files(path: str | Path) -> list[Path]:
    """The files a checkpoint is: a .gguf file itself, or a directory's weight / config / tokenizer files."""
    root = Path(path)
    if root.is_file():
        return [root]
    return sorted(p for p in root.iterdir() if p.is_file() and p.suffix in MODEL_FILE_SUFFIXES)


def file_stamps(files: list[Path]) -> list[list]:
    """[resolved path, size, modification time] of each file: what tells a cache keyed by them that they
    changed."""
    return [[str(p.resolve()), p.stat().st_size, p.stat().st_mtime_ns] for p in files]


def read_range(path: Path, offset: int, nbytes: int) -> np.ndarray:
    """uint8 [nbytes]: the file's bytes from `offset`, read into memory of their own. Not a view of a mapping:
    mapped pages a load has touched count in its resident memory until the mapping goes; these go with the
    array."""
    with open(path, "rb") as f:
        f.seek(offset)
        out = np.empty(nbytes, np.uint8)
        if f.readinto(memoryview(out)) != nbytes:
            raise OSError(f"{path}: {nbytes} bytes at {offset} are past the end of the file")
    return out


# safetensors dtypes -> numpy (BF16, which numpy lacks, is widened to float32 by its bits)
SAFETENSORS_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": np.uint16,
                      "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8,
                      "BOOL": np.bool_}


@dataclass(frozen=True)
class SafetensorsFile:
    """A safetensors file's header: each tensor's dtype, shape and [begin, end) bytes past `start`. The
    format: a u64 little-endian header length, a JSON header, then the data."""

    path: Path
    start: int
    tensors: dict[str, dict[str, Any]]
    metadata: dict[str, str]

    @classmethod
    def open(cls, path: Path) -> "SafetensorsFile":
        """Raises ValueError for a file that is not a well-formed safetensors file."""
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) != 8:
                raise ValueError("file too short")
            n = int.from_bytes(head, "little")
            if n > size - 8:
                raise ValueError(f"header of {n} bytes in a file of {size}")
            header = json.loads(f.read(n))
        if not isinstance(header, dict):
            raise ValueError("header is not a JSON object")
        metadata = header.pop("__metadata__", None) or {}
        for name, t in header.items():
            begin, end = t["data_offsets"]
            dt = SAFETENSORS_DTYPES.get(t["dtype"])
            width = np.dtype(dt).itemsize * int(np.prod(t["shape"])) if dt is not None else end - begin
            if not 0 <= begin <= end <= size - 8 - n or end - begin != width:
                raise ValueError(f"tensor {name!r}: bad data offsets {[begin, end]}")
        return cls(path, 8 + n, header, metadata)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(int(d) for d in self.tensors[name]["shape"])

    def raw(self, name: str) -> np.ndarray:
        """The tensor's bytes, uint8 [nbytes]."""
        begin, end = self.tensors[name]["data_offsets"]
        return read_range(self.path, self.start + begin, end - begin)

    def mapped(self, name: str) -> np.ndarray:
        """An F32 tensor as a copy-on-write mapping of the file (only the pages read become resident)."""
        t = self.tensors[name]
        begin, end = t["data_offsets"]
        if t["dtype"] != "F32" or end == begin:
            return self.read(name)
        return np.memmap(self.path, np.float32, mode="c", offset=self.start + begin, shape=self.shape(name))

    def read(self, name: str, float32: bool = True) -> np.ndarray:
        """The tensor in its own dtype, or (float32) widened to float32: exact for F16 and BF16 (a bfloat16 is
        the top half of a float32's bits)."""
        t = self.tensors[name]
        if t["dtype"] not in SAFETENSORS_DTYPES:
            raise ValueError(f"tensor {name!r}: dtype {t['dtype']} is not supported")
        a = self.raw(name).view(SAFETENSORS_DTYPES[t["dtype"]]).reshape(self.shape(name))
        if t["dtype"] == "BF16":
            return (a.astype(np.uint32) << 16).view(np.float32)
        return a.astype(np.float32, copy=False) if float32 else a


def write_safetensors(path: Path, specs: dict[str, tuple[str, tuple[int, ...]]],
                      read: Callable[[str], np.ndarray], metadata: dict[str, str] | None = None) -> None:
    """A safetensors file of the tensors `specs` names (name -> (safetensors dtype, shape); BF16 given as
    their uint16 bits), each asked of `read` once and written as it comes: one in memory at a time
    (safetensors.numpy.save_file copies every array to bytes first)."""
    infos, offset = {}, 0
    for n, (dt, shape) in specs.items():
        size = np.dtype(SAFETENSORS_DTYPES[dt]).itemsize * int(np.prod(shape))
        infos[n] = {"dtype": dt, "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(({"__metadata__": metadata} if metadata else {}) | infos).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(len(text).to_bytes(8, "little"))
        f.write(text)
        for n, (dt, shape) in specs.items():
            a = np.ascontiguousarray(read(n), dtype=SAFETENSORS_DTYPES[dt])
            if tuple(a.shape) != tuple(shape):
                raise ValueError(f"{n}: shape {list(a.shape)}, expected {list(shape)}")
            f.write(memoryview(a.reshape(-1)).cast("B"))
