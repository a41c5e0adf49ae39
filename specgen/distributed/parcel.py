"""Arrays handed from one process to another on this machine through POSIX shared memory: the sender packs
them into one new segment and passes its Parcel (a name and a layout: a few hundred bytes) through a queue;
the receiver reads numpy views of the segment, copies what it keeps, and frees it. A prefill worker hands a
request's KV cache and drafter state to a decode worker this way (disaggregated.py).

Segments are named after the job (`tag`), so whatever a killed process left behind is found and freed by
`sweep`."""
from __future__ import annotations

import _posixshmem  # the C module under multiprocessing.shared_memory (POSIX)
import itertools
import mmap
import os
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
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


class _Segment:
    """A POSIX shared-memory segment (the name, its mapping as `buf`), opened without multiprocessing's
    resource tracker: this module frees every segment itself (unpack, discard, sweep). Through SharedMemory
    (Python < 3.13 registers a segment with the tracker on create and on attach), a segment the decode worker
    attached just after the parent swept a killed prefill worker's hand-offs stayed registered, and at exit
    the tracker printed leak warnings after the job's last line."""

    def __init__(self, name: str, size: int = 0):
        """size > 0: create it (exclusively); 0: open the existing one."""
        self.name = name
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if size else 0)
        fd = _posixshmem.shm_open("/" + name, flags, mode=0o600)
        try:
            if size:
                os.ftruncate(fd, size)
            self._map = mmap.mmap(fd, size or os.fstat(fd).st_size)
        finally:
            os.close(fd)
        self.buf = memoryview(self._map)

    def close(self) -> None:
        """Unmap (BufferError while a view of buf is alive)."""
        self.buf.release()
        self._map.close()

    def unlink(self) -> None:
        """Remove the name (the mapping stays valid until closed); gone already is fine."""
        try:
            _posixshmem.shm_unlink("/" + self.name)
        except FileNotFoundError:
            pass


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
    shm = _Segment(name, max(offset, 1))
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
    """Views of the parcel's arrays, valid inside the block (copy what is kept); the segment is freed after
    it."""
    shm = _Segment(parcel.name)
    views = {key: np.ndarray(shape, dtype, buffer=shm.buf, offset=at)
             for key, dtype, shape, at in parcel.layout}
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
        shm = _Segment(name)
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
