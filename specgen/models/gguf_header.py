"""A GGUF file's header, read in one pass: its metadata and where each tensor lies (the data is not touched).

gguf.GGUFReader makes a numpy view for every part of every field, ~250k of them for a 49k-token vocabulary
(2.3 s of a 6 s first load of a 1.1B model); this reads the same values, the same way (little-endian GGUF v2 /
v3: the layout of gguf-py's own reader and writer), in a fraction of that. The values are what
GGUFReader's `ReaderField.contents()` gives: Python scalars, str, and lists of them.
"""
from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

MAGIC = b"GGUF"
# GGUF value types (gguf.GGUFValueType) -> struct format of a scalar
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9
_NUMPY = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?", 10: "<u8", 11: "<i8",
          12: "<f8"}


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # GGUF's ne: the row length first
    tensor_type: GGMLQuantizationType
    data_offset: int  # from the start of the file
    n_bytes: int


@dataclass(frozen=True)
class GgufHeader:
    fields: dict[str, Any]
    tensors: list[TensorInfo]


class _Cursor:
    def __init__(self, buf: Any):
        self.buf, self.pos = buf, 0

    def scalar(self, fmt: str) -> Any:
        (value,) = struct.unpack_from("<" + fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.scalar("Q")
        end = self.pos + n
        if end > len(self.buf):
            raise ValueError("a string runs past the end of the file")
        value = bytes(self.buf[self.pos:end]).decode("utf-8", errors="replace")
        self.pos = end
        return value

    def value(self, kind: int) -> Any:
        if kind in _SCALARS:
            return self.scalar(_SCALARS[kind])
        if kind == _STRING:
            return self.string()
        if kind != _ARRAY:
            raise ValueError(f"unknown GGUF value type {kind}")
        item, count = self.scalar("I"), self.scalar("Q")
        if item in _NUMPY:
            dt = np.dtype(_NUMPY[item])
            end = self.pos + count * dt.itemsize
            if end > len(self.buf):
                raise ValueError("an array runs past the end of the file")
            values = np.frombuffer(self.buf, dt, count, self.pos).tolist()
            self.pos = end
            return values
        return [self.value(item) for _ in range(count)]


def read_header(path: Path) -> GgufHeader:
    """Raises ValueError (or struct.error) for a file that is not a well-formed little-endian GGUF v2 / v3."""
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        c = _Cursor(buf)
        if bytes(buf[:4]) != MAGIC:
            raise ValueError("not a GGUF file (bad magic)")
        c.pos = 4
        version = c.scalar("I")
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version} is not supported (2 and 3 are; big-endian files not)")
        n_tensors, n_fields = c.scalar("Q"), c.scalar("Q")
        fields: dict[str, Any] = {}
        for _ in range(n_fields):
            key = c.string()
            fields[key] = c.value(c.scalar("I"))
        infos = []
        for _ in range(n_tensors):
            name = c.string()
            shape = tuple(c.scalar("Q") for _ in range(c.scalar("I")))
            infos.append((name, shape, GGMLQuantizationType(c.scalar("I")), c.scalar("Q")))
        align = int(fields.get("general.alignment", 32))
        start = -(-c.pos // align) * align
        tensors = []
        for name, shape, kind, offset in infos:
            block, size = GGML_QUANT_SIZES[kind]
            n_bytes = int(np.prod(shape)) // block * size
            if start + offset + n_bytes > len(buf):
                raise ValueError(f"tensor {name!r} runs past the end of the file")
            tensors.append(TensorInfo(name, shape, kind, start + offset, n_bytes))
        return GgufHeader(fields, tensors)
