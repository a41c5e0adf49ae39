"""Reading `torch.save` files (pytorch_model.bin, *.pt, *.pth: a state dict of tensors) without running code
from them.

With torch installed, `torch.load(weights_only=True)` reads them. Without it, a restricted reader of torch's
zip archive (the format of every torch >= 1.6): `ARCHIVE/data.pkl` is a pickle whose tensors are calls of
`torch._utils._rebuild_tensor_v2(storage, offset, size, stride, ...)` over storages named by persistent ids
`("storage", torch.FloatStorage, key, location, numel)`, each storage's little-endian bytes in
`ARCHIVE/data/KEY`. The unpickler resolves only those names (the tensor rebuilders, the storage types, torch's
dtypes, OrderedDict): anything else a pickle asks for (os.system, builtins.eval, any class) is refused before
it is called, so a file from the internet runs nothing. The pickle is read first (cheap: it holds only
references); each tensor's bytes are read from the archive when a load asks for it (models/checkpoint.Lazy).
"""
from __future__ import annotations

import collections
import io
import pickle
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from specgen.errors import CheckpointError
from specgen.models.checkpoint import Lazy

TORCH_SUFFIXES = (".bin", ".pt", ".pth")

# torch storage classes and dtypes -> numpy dtype ("bf16": uint16 bits, widened to float32 when read)
_STORAGES = {"FloatStorage": "<f4", "DoubleStorage": "<f8", "HalfStorage": "<f2", "BFloat16Storage": "bf16",
             "LongStorage": "<i8", "IntStorage": "<i4", "ShortStorage": "<i2", "CharStorage": "i1",
             "ByteStorage": "u1", "BoolStorage": "?"}
_DTYPES = {"float32": "<f4", "float": "<f4", "float64": "<f8", "double": "<f8", "float16": "<f2",
           "half": "<f2", "bfloat16": "bf16", "int64": "<i8", "long": "<i8", "int32": "<i4", "int": "<i4",
           "int16": "<i2", "short": "<i2", "int8": "i1", "uint8": "u1", "bool": "?"}


@dataclass(frozen=True)
class _Dtype:
    """A torch storage type or dtype named by the pickle: its element type."""

    numpy: str


@dataclass(frozen=True)
class _Storage:
    key: str
    dtype: str  # _STORAGES / _DTYPES value
    numel: int


@dataclass(frozen=True)
class _Tensor:
    """A tensor of the archive, not yet read: `size` elements strided over its storage from `offset`."""

    storage: _Storage
    offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]


def _ints(values, what: str) -> tuple[int, ...]:
    if not isinstance(values, (tuple, list)) or not all(type(v) is int and v >= 0 for v in values):
        raise pickle.UnpicklingError(f"a tensor's {what} must be non-negative integers")
    return tuple(values)


def _rebuild_tensor(storage, offset, size, stride, *_rest) -> _Tensor:
    if not isinstance(storage, _Storage) or type(offset) is not int or offset < 0:
        raise pickle.UnpicklingError("a tensor whose storage is not one of the archive's")
    size, stride = _ints(size, "size"), _ints(stride, "strides")
    if len(size) != len(stride) or int(np.prod(size, dtype=object)) > max(storage.numel, 1):
        raise pickle.UnpicklingError("a tensor of more elements than its storage holds")
    return _Tensor(storage, offset, size, stride)


def _rebuild_tensor_v3(storage, offset, size, stride, requires_grad, hooks, dtype, *_rest) -> _Tensor:
    if not isinstance(dtype, _Dtype) or not isinstance(storage, _Storage):
        raise pickle.UnpicklingError("a tensor of an unknown dtype")
    # an untyped (byte) storage read as `dtype`
    width = np.dtype(np.uint16 if dtype.numpy == "bf16" else dtype.numpy).itemsize
    return _rebuild_tensor(_Storage(storage.key, dtype.numpy, storage.numel // width), offset, size, stride)


def _rebuild_parameter(data, requires_grad, hooks, *_rest):
    return data


class _Call:
    """One of the rebuild functions, handed to the pickle as a fresh object each time (what a pickle does to
    it cannot reach another load)."""

    __slots__ = ("_fn",)

    def __init__(self, fn):
        object.__setattr__(self, "_fn", fn)

    def __call__(self, *args):
        return self._fn(*args)


_CALLS = {("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor,
          ("torch._utils", "_rebuild_tensor"): _rebuild_tensor,
          ("torch._utils", "_rebuild_tensor_v3"): _rebuild_tensor_v3,
          ("torch._utils", "_rebuild_parameter"): _rebuild_parameter}
_TYPES = {("torch", "UntypedStorage"): "u1",
          **{("torch", name): dt for name, dt in _STORAGES.items()},
          **{("torch", name): dt for name, dt in _DTYPES.items()}}


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        # fresh objects: a pickle's BUILD or setattr reaches only what this load made
        if (module, name) == ("collections", "OrderedDict"):
            return collections.OrderedDict
        if (module, name) in _CALLS:
            return _Call(_CALLS[module, name])
        if (module, name) in _TYPES:
            return _Dtype(_TYPES[module, name])
        raise pickle.UnpicklingError(f"it asks for {module}.{name}, which a file of tensors never needs")

    def persistent_load(self, pid):
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"
                and isinstance(pid[1], _Dtype) and type(pid[4]) is int and pid[4] >= 0):
            raise pickle.UnpicklingError(f"unknown persistent id {pid!r:.80}")
        return _Storage(str(pid[2]), pid[1].numpy, pid[4])


@dataclass(frozen=True)
class TorchArchive:
    """A torch zip archive's tensors, by name (the restricted reader)."""

    path: Path
    prefix: str  # the archive's folder ("archive/", or the saved file's stem)
    tensors: dict[str, _Tensor]

    @classmethod
    def open(cls, path: Path) -> "TorchArchive":
        if not zipfile.is_zipfile(path):
            raise CheckpointError(f"{path}: not a torch zip archive (files saved by torch < 1.6, or not by "
                                  "torch.save, are not read; convert it to safetensors)")
        try:
            with zipfile.ZipFile(path) as z:
                pkl = [n for n in z.namelist() if n.endswith("data.pkl") and n.count("/") <= 1]
                if len(pkl) != 1:
                    raise CheckpointError(f"{path}: not a torch archive (no data.pkl)")
                info = z.getinfo(pkl[0])
                if info.compress_type != zipfile.ZIP_STORED:  # torch stores; a compressed one may be a bomb
                    raise CheckpointError(f"{path}: refused, {pkl[0]} is compressed (torch.save stores it)")
                state = _Unpickler(io.BytesIO(z.read(pkl[0]))).load()
        except CheckpointError:
            raise
        except pickle.UnpicklingError as exc:
            raise CheckpointError(f"{path}: refused, not a plain file of tensors: {exc}") from None
        except Exception as exc:  # a malformed pickle raises whatever its opcodes hit (all refused)
            raise CheckpointError(f"{path}: refused, cannot read the torch archive "
                                  f"({type(exc).__name__}: {exc})") from None
        if not isinstance(state, dict) or not all(isinstance(k, str) and isinstance(v, _Tensor)
                                                  for k, v in state.items()):
            raise CheckpointError(f"{path}: not a state dict (a mapping of names to tensors)")
        return cls(path, pkl[0][: -len("data.pkl")], dict(state))

    def shape(self, name: str) -> tuple[int, ...]:
        return self.tensors[name].size

    def read(self, name: str) -> np.ndarray:
        """The tensor, floats widened to float32 (exact for float16 and bfloat16), other types as stored; only
        the bytes of its storage that it spans are read."""
        t = self.tensors[name]
        s = t.storage
        dt = np.dtype(np.uint16 if s.dtype == "bf16" else s.dtype)
        if any(n == 0 for n in t.size):
            a = np.zeros(t.size, dt)
        else:
            span = sum((n - 1) * st for n, st in zip(t.size, t.stride)) + 1  # elements from the offset on
            if t.offset + span > s.numel:
                raise CheckpointError(f"{self.path}: tensor {name!r} reaches past its storage")
            member = f"{self.prefix}data/{s.key}"
            try:
                with zipfile.ZipFile(self.path) as z:
                    info = z.getinfo(member)
                    if info.compress_type != zipfile.ZIP_STORED:
                        raise CheckpointError(f"{self.path}: refused, {member} is compressed")
                    with z.open(info) as f:
                        f.seek(t.offset * dt.itemsize)
                        raw = f.read(span * dt.itemsize)
            except KeyError:
                raise CheckpointError(f"{self.path}: storage {s.key} of {name!r} is missing") from None
            if len(raw) < span * dt.itemsize:
                raise CheckpointError(f"{self.path}: storage {s.key} of {name!r} is truncated")
            data = np.frombuffer(raw, dt, span)
            strides = tuple(st * dt.itemsize for st in t.stride)
            a = np.lib.stride_tricks.as_strided(data, t.size, strides).copy()
        if s.dtype == "bf16":
            return (a.astype(np.uint32) << 16).view(np.float32)
        return a.astype(np.float32) if a.dtype.kind == "f" else a


def read_archives(files: list[Path]) -> Lazy[np.ndarray]:
    """Every tensor of the files through the restricted reader, each read when asked for."""
    where: dict[str, TorchArchive] = {}
    for f in files:
        archive = TorchArchive.open(f)
        where.update(dict.fromkeys(archive.tensors, archive))
    return Lazy({n: a.shape(n) for n, a in where.items()}, lambda n: where[n].read(n))


# torch.load(weights_only=True) could still run code before torch 2.6 (CVE-2025-32434)
SAFE_TORCH = (2, 6)


def read_torch_files(files: list[Path]) -> Lazy[np.ndarray]:
    """Every tensor of the files (shards of one state dict), each converted when asked for: torch.load(
    weights_only=True, mmap=True) when torch >= 2.6 is installed, else the restricted archive reader."""
    for f in files:
        if not f.is_file():
            raise CheckpointError(f"{f}: weight file not found")
    torch = _safe_torch()
    if torch is None:
        return read_archives(files)
    held: dict = {}
    for f in files:
        held.update(_torch_load(torch, f))

    def read(name: str) -> np.ndarray:
        v = held[name]
        return v.float().numpy() if v.is_floating_point() else v.numpy().copy()

    return Lazy({n: tuple(v.shape) for n, v in held.items()}, read)


def _safe_torch():
    """torch, when it is installed and its weights_only loading is safe (>= 2.6); else None."""
    import importlib.util

    if importlib.util.find_spec("torch") is None:
        return None
    import torch

    try:
        version = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
    except ValueError:
        return None
    return torch if version >= SAFE_TORCH else None


def _torch_load(torch, path: Path) -> dict:
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as exc:  # torch raises its own UnpicklingError / RuntimeError kinds
        raise CheckpointError(f"{path}: refused or unreadable torch file ({exc})") from None
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise CheckpointError(f"{path}: not a state dict (a mapping of names to tensors)")
    return state
