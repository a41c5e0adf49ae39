"""One writer per output: an exclusive lock file beside it (`OUT.lock`) holding the writer's process id.

The lock is an flock(2) on that file, so the kernel releases it when its process ends however it ends: a lock
left by a killed run is stale, and the next run simply takes it over. The file itself may stay behind; what
counts is whether a live process holds the flock.
"""
from __future__ import annotations

import fcntl
import os
from pathlib import Path

from specgen.errors import OutputBusyError, OutputError


def lock_path(output: Path) -> Path:
    return output.with_name(output.name + ".lock")


class OutputLock:
    """Held from acquire() to release(); a second acquirer fails at once naming the holder's pid."""

    def __init__(self, output: Path):
        self.path = lock_path(output)
        self._fd: int | None = None

    def acquire(self) -> "OutputLock":
        while True:
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            except OSError as exc:
                raise OutputError(f"cannot create {self.path} (the output's lock): {exc.strerror}") from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _read_pid(fd)
                os.close(fd)
                who = f"process {holder}" if holder else "another process"
                raise OutputBusyError(f"{self.path.with_suffix('')} is being written by {who} "
                                      f"(lock {self.path}); wait for it to finish or stop it") from None
            # The holder before us may have removed the file after we opened it: lock the file the path names
            # now.
            try:
                same = os.fstat(fd).st_ino == os.stat(self.path).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is None:
            return
        try:
            self.path.unlink()
        except OSError:
            pass  # a folder that vanished or turned read-only: the flock still goes with the descriptor
        os.close(self._fd)
        self._fd = None

    def __enter__(self) -> "OutputLock":
        return self if self._fd is not None else self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


def _read_pid(fd: int) -> int | None:
    try:
        text = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None
