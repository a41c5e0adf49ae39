"""Packed weights kept beside their checkpoint's cache entry: written once by the first load that packs them,
mapped by every later load. A later load then reads and packs nothing (a 7B Q4_1 GGUF: 10 s -> ~1 s), and its
weights are pages of the page cache, shared by every process that maps them (data-parallel workers, jobs run
side by side) instead of a private copy each.

The entry is keyed by what decides the packed bytes: the panel layout (PANELS_FORMAT, packing.py and the
kernels' sources) and the integer-product setting. Only weights packed from a checkpoint's blocks are kept:
those are what the cache may hold (converted forms of stored weights, never a float copy of them)."""
from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
import threading
from pathlib import Path

import numpy as np
import paddle

from specgen.kernels.packing import Packed

log = logging.getLogger(__name__)

PANELS_FORMAT = 1  # bump whenever the bytes of a Packed's panels change
_WRITERS: list[threading.Thread] = []


def flush() -> None:
    """Wait until every panel cache this process started writing is written."""
    while _WRITERS:
        _WRITERS.pop().join()
_DATA, _INDEX = "panels.bin", "panels.json"


def panels_key(build_key: str, int8_product: bool) -> str:
    packing = (Path(__file__).parent.parent / "kernels" / "packing.py").read_bytes()
    return hashlib.sha256(json.dumps([PANELS_FORMAT, build_key, int8_product]).encode()
                          + packing).hexdigest()[:16]


class PanelCache:
    """One checkpoint's packed weights by name, in <entry>/panels-<key>: `get` maps what an earlier load
    wrote, `put` collects what this load packed, `close` writes it (once: an entry is never rewritten)."""

    def __init__(self, entry: Path, key: str):
        self.dir = entry / f"panels-{key}"
        self.index: dict[str, dict] | None = None
        self.new: dict[str, Packed] = {}
        self.mapped = 0  # bytes of the panels mapped by this load
        try:
            self.index = json.loads((self.dir / _INDEX).read_text())
        except (OSError, ValueError):
            self.index = None

    def get(self, name: str) -> Packed | None:
        info = (self.index or {}).get(name)
        if info is None:
            return None
        arr = np.memmap(self.dir / _DATA, dtype=np.dtype(info["dtype"]), mode="c", offset=info["offset"],
                        shape=tuple(info["shape"]))
        self.mapped += arr.nbytes
        tensor = paddle.base.core.eager.Tensor(arr, paddle.CPUPlace(), False, True, "panels", True)
        return Packed(tensor, info["k"], info["n"], info["kind"], info["int8_product"])

    def put(self, name: str, packed: Packed) -> None:
        if self.index is None:
            self.new[name] = packed

    def close(self) -> None:
        """Write what this load packed, in a thread of its own (the job goes on meanwhile; the process waits
        for it at exit), into a temporary sibling then renamed: readers see all or nothing. A cache that
        cannot be written is skipped with a warning (the next load packs again)."""
        new, self.new = self.new, {}
        if not new or self.index is not None:
            return
        writer = threading.Thread(target=self._write, args=(new,), name="specgen-panels")
        _WRITERS.append(writer)
        writer.start()

    def _write(self, new: dict[str, Packed]) -> None:
        try:
            tmp = Path(tempfile.mkdtemp(prefix=f".{self.dir.name}.", dir=self.dir.parent))
        except OSError as e:
            log.warning("packed weights not cached (%s)", e)
            return
        try:
            index, offset = {}, 0
            with open(tmp / _DATA, "wb") as f:
                for name, p in new.items():
                    a = np.ascontiguousarray(p.panels.numpy())
                    pad = -offset % 64  # each array 64-byte aligned, as the kernels' loads like it
                    f.write(b"\0" * pad)
                    offset += pad
                    index[name] = {"offset": offset, "shape": list(a.shape), "dtype": a.dtype.str, "k": p.k,
                                   "n": p.n, "kind": p.kind, "int8_product": p.int8_product}
                    f.write(memoryview(a.reshape(-1)).cast("B"))
                    offset += a.nbytes
            (tmp / _INDEX).write_text(json.dumps(index))
            os.rename(tmp, self.dir)
        except OSError as e:
            if not self.dir.is_dir():  # else another process wrote the same entry first
                log.warning("packed weights not cached (%s)", e)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
