"""Arrays handed from one process to another on this machine through shared memory (multiprocessing's
SharedMemory): the sender packs them into one new segment and passes its Parcel (a name and a layout: a few
hundred bytes) through a queue; the receiver reads numpy views of the segment, copies what it keeps, and frees it.
A prefill worker hands a request's KV cache and drafter state to a decode worker this way (disaggregated.py).

Segments are named after the job (`tag`), so whatever a killed process left behind is found and freed by `sweep`."""
from __future__ import annotations

import itertools
import os
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from multiprocessing import shared_memory
from pathlib import Path

import numpy as np

ALIGN = 64  # bytes: each array starts on a cache line
SHM_DIR = Path("/dev/shm")  # where Linux keeps POSIX shared memory (sweep looks there)

Arrays = Mapping[str, "np.ndarray | Sequence[np.ndarray]"]  # a sequence: pieces joined along axis 1
_counter = itertools.count()


@dataclass(frozen=True)
class Parcel:
    """One shared-memory segment holding named arrays."""

    name: str  # the segment's name
    layout: tuple[tuple[str, str, tuple[int, ...], int], ...]  # (key, dtype, shape, byte offset) per array
    nbytes: int

    @property
    def keys(self) -> list[str]:
        return [key for key, *_ in self.layout]


def _shape(value) -> tuple[tuple[int, ...], np.dtype]:
    if isinstance(value, np.ndarray):
        return value.shape, value.dtype
    first = value[0]
    return (first.shape[0], sum(p.shape[1] for p in value), *first.shape[2:]), first.dtype


def pack(arrays: Arrays, tag: str) -> Parcel:
    """Copy `arrays` into a new segment named tag-pid-n; the receiver frees it (unpack)."""
    layout, offset = [], 0
    for key, value in arrays.items():
        shape, dtype = _shape(value)
        layout.append((key, dtype.str, tuple(int(d) for d in shape), offset))
        offset += -(-int(np.prod(shape, dtype=np.int64)) * dtype.itemsize // ALIGN) * ALIGN
    name = f"{tag}-{os.getpid()}-{next(_counter)}"
    shm = shared_memory.SharedMemory(name=name, create=True, size=max(offset, 1))
    try:
        for (key, dtype, shape, at), value in zip(layout, arrays.values()):
            out = np.ndarray(shape, dtype, buffer=shm.buf, offset=at)
            if isinstance(value, np.ndarray):
                out[...] = value
            else:
                np.concatenate(value, axis=1, out=out)
            del out
    except BaseException:
        shm.close()
        shm.unlink()
        raise
    shm.close()
    return Parcel(name, tuple(layout), offset)


@contextmanager
def unpack(parcel: Parcel) -> Iterator[dict[str, np.ndarray]]:
    """Views of the parcel's arrays, valid inside the block (copy what is kept); the segment is freed after it."""
    shm = shared_memory.SharedMemory(name=parcel.name)
    views = {key: np.ndarray(shape, dtype, buffer=shm.buf, offset=at) for key, dtype, shape, at in parcel.layout}
    try:
        yield views
    finally:
        views.clear()
        try:
            shm.close()
        except BufferError:  # a view outlived the block: the mapping goes with it, the name goes now
            pass
        shm.unlink()


def discard(name: str) -> bool:
    """Free a segment nobody will unpack; False if it is gone already."""
    try:
        shm = shared_memory.SharedMemory(name=name)
    except FileNotFoundError:
        return False
    shm.close()
    shm.unlink()
    return True


def sweep(tag: str) -> int:
    """Free every segment of this job's tag still present (a process killed between pack and unpack leaves its
    segments behind); returns how many. Looks in /dev/shm (Linux)."""
    if not SHM_DIR.is_dir():
        return 0
    return sum(discard(p.name) for p in SHM_DIR.glob(f"{tag}-*"))
