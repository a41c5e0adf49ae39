"""Writing torch.save files without torch (it is not installed here), for tests: the zip archive torch >= 1.6
writes (ARCHIVE/data.pkl, ARCHIVE/data/KEY, ARCHIVE/version, ARCHIVE/byteorder), its pickle naming
`torch._utils._rebuild_tensor_v2` and `torch.FloatStorage` / `torch.BFloat16Storage` as torch's does. The
names are resolved through stand-in modules put in sys.modules only while pickling."""
from __future__ import annotations

import collections
import io
import pickle
import sys
import types
import zipfile
from contextlib import contextmanager
from pathlib import Path

import numpy as np

_STORAGE = {np.dtype(np.float32): "FloatStorage", np.dtype(np.float64): "DoubleStorage",
            np.dtype(np.float16): "HalfStorage", np.dtype(np.int64): "LongStorage"}


@contextmanager
def _stand_in_torch():
    torch, utils = types.ModuleType("torch"), types.ModuleType("torch._utils")

    def _rebuild_tensor_v2(*args):  # never called: only its name is pickled
        raise AssertionError

    _rebuild_tensor_v2.__module__ = "torch._utils"
    _rebuild_tensor_v2.__qualname__ = "_rebuild_tensor_v2"
    utils._rebuild_tensor_v2 = _rebuild_tensor_v2
    torch._utils = utils
    for name in [*_STORAGE.values(), "BFloat16Storage"]:
        setattr(torch, name, type(name, (), {"__module__": "torch"}))
    saved = {k: sys.modules.get(k) for k in ("torch", "torch._utils")}
    sys.modules.update({"torch": torch, "torch._utils": utils})
    try:
        yield torch
    finally:
        for k, v in saved.items():
            if v is None:
                sys.modules.pop(k, None)
            else:
                sys.modules[k] = v


class _StorageRef:
    def __init__(self, kind: str, key: str, numel: int):
        self.kind, self.key, self.numel = kind, key, numel


class _TensorRef:
    def __init__(self, storage: _StorageRef, offset: int, size: tuple, stride: tuple, rebuild):
        self.args = (storage, offset, size, stride, False, collections.OrderedDict())
        self.rebuild = rebuild

    def __reduce__(self):
        return self.rebuild, self.args


def save_torch(path: Path, tensors: dict[str, np.ndarray], bf16: bool = False, views: bool = False,
               archive: str = "archive") -> None:
    """A state dict file as torch.save writes it. bf16: float tensors stored as bfloat16 (their float32
    values' top halves: give values exact in bfloat16). views: each 2-D tensor stored as the transpose view of
    a storage holding its transpose (a strided tensor, as torch saves `w.t()`), after a leading unused
    element (a non-zero storage offset)."""
    blobs: dict[str, bytes] = {}
    with _stand_in_torch() as torch:
        state = collections.OrderedDict()
        for i, (name, a) in enumerate(tensors.items()):
            a = np.asarray(a)
            kind = "BFloat16Storage" if bf16 and a.dtype.kind == "f" else _STORAGE[a.dtype]
            data = a.astype(np.float32).view(np.uint32) >> 16 if kind == "BFloat16Storage" else a
            data = data.astype(np.uint16) if kind == "BFloat16Storage" else data
            offset, stride = 0, tuple(int(np.prod(a.shape[d + 1:])) for d in range(a.ndim))
            if views and a.ndim == 2:
                data = np.concatenate([np.zeros(1, data.dtype), np.ascontiguousarray(data.T).reshape(-1)])
                offset, stride = 1, (1, a.shape[0])
            blobs[str(i)] = np.ascontiguousarray(data).tobytes()
            storage = _StorageRef(kind, str(i), int(np.asarray(data).size))
            state[name] = _TensorRef(storage, offset, tuple(a.shape), stride, torch._utils._rebuild_tensor_v2)
        state._metadata = collections.OrderedDict({"": {"version": 1}})

        class _Pickler(pickle.Pickler):
            def persistent_id(self, obj):
                if isinstance(obj, _StorageRef):
                    return ("storage", getattr(torch, obj.kind), obj.key, "cpu", obj.numel)
                return None

        buf = io.BytesIO()
        _Pickler(buf, protocol=2).dump(state)
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as z:
        z.writestr(f"{archive}/data.pkl", buf.getvalue())
        z.writestr(f"{archive}/byteorder", "little")
        for key, blob in blobs.items():
            z.writestr(f"{archive}/data/{key}", blob)
        z.writestr(f"{archive}/version", "3\n")


def save_pickle_archive(path: Path, obj, archive: str = "archive") -> None:
    """Any object pickled as an archive's data.pkl (for files that must be refused)."""
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(f"{archive}/data.pkl", pickle.dumps(obj, protocol=2))
        z.writestr(f"{archive}/version", "3\n")


def save_pickle_tensor(path: Path, size: tuple, stride: tuple) -> None:
    """A one-tensor archive whose tensor claims `size` and `stride` over a 1-element float32 storage."""
    with _stand_in_torch() as torch:
        storage = _StorageRef("FloatStorage", "0", 1)
        rebuild = torch._utils._rebuild_tensor_v2
        state = collections.OrderedDict(t=_TensorRef(storage, 0, size, stride, rebuild))

        class _Pickler(pickle.Pickler):
            def persistent_id(self, obj):
                if isinstance(obj, _StorageRef):
                    return ("storage", torch.FloatStorage, obj.key, "cpu", obj.numel)
                return None

        buf = io.BytesIO()
        _Pickler(buf, protocol=2).dump(state)
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as z:
        z.writestr("archive/data.pkl", buf.getvalue())
        z.writestr("archive/data/0", np.zeros(1, np.float32).tobytes())
