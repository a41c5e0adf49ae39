"""Output sinks: records reach the OS as they finish, the disk in bounded time; Parquet is finalized at close.

Durability policy: every record is flushed to the OS as one write of one line (a SIGKILL loses nothing that
was written); the file is fsynced every SYNC_EVERY_RECORDS records, at least every SYNC_EVERY_SECONDS while
records are pending (a background timer), and at close. A Parquet output is a JSONL journal until close,
which merges the existing Parquet file (from an earlier run) and the journal into a temporary file, renames it
over the output and removes the journal; a kill at any point of that leaves parts --resume can complete.
"""
from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import Any, Protocol

from specgen.errors import ConfigError, InputError
from specgen.io.outputs import existing_parts, iter_parquet_batches, journal_path, output_format, scan_jsonl

SYNC_EVERY_RECORDS = 64
SYNC_EVERY_SECONDS = 1.0
PARQUET_ROW_GROUP = 1024


class Sink(Protocol):
    path: Path

    def write(self, record: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


class _PeriodicSync:
    """fsyncs a file descriptor from a timer thread whenever records were written since the last sync."""

    def __init__(self, fd: int, interval: float):
        self._fd, self._interval = fd, interval
        self._lock = threading.Lock()
        self._dirty = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="specgen-fsync", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(self._interval):
            self.sync()

    def mark_dirty(self) -> None:
        self._dirty = True

    def sync(self) -> None:
        with self._lock:
            if self._dirty:
                self._dirty = False
                os.fsync(self._fd)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self.sync()


class JsonlSink:
    """One JSON object per line, appended in completion order."""

    def __init__(self, path: Path, append: bool):
        self.path = path
        self._file = open(path, "ab" if append else "xb")  # noqa: SIM115 (held open by the sink until close())
        self._sync = _PeriodicSync(self._file.fileno(), SYNC_EVERY_SECONDS)
        self._since_sync = 0

    def write(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps(record, ensure_ascii=False).encode("utf-8") + b"\n")
        self._file.flush()
        self._sync.mark_dirty()
        self._since_sync += 1
        if self._since_sync >= SYNC_EVERY_RECORDS:
            self._since_sync = 0
            self._sync.sync()

    def close(self) -> None:
        if self._file.closed:
            return
        self._file.flush()
        self._sync.stop()
        self._file.close()


class ParquetSink:
    """Records go to the journal as they finish; close() turns the output into one Parquet file."""

    def __init__(self, path: Path):
        self.path = path
        self._journal = JsonlSink(journal_path(path), append=True)

    def write(self, record: dict[str, Any]) -> None:
        self._journal.write(record)

    def close(self) -> None:
        self._journal.close()
        finalize_parquet(self.path)


def open_sink(path: Path, resume: bool) -> tuple[Sink, set[str]]:
    """Open the output; with `resume`, continue it and return the ids it already holds."""
    from specgen.io.outputs import done_ids

    fmt = output_format(path)
    parts = existing_parts(path)
    if parts and not resume:
        raise ConfigError(f"output {parts[0]} already exists; pass --resume to continue it, or remove it")
    if not path.parent.is_dir():
        raise ConfigError(f"{path.parent}: the output's folder does not exist")
    done = done_ids(path) if parts else set()
    sink: Sink = JsonlSink(path, append=bool(parts)) if fmt == "jsonl" else ParquetSink(path)
    return sink, done


def finalize_parquet(path: Path) -> None:
    """Merge the existing Parquet output (if any) and the journal into `path` atomically; drop the journal."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from specgen.io.schema import arrow_schema

    schema = arrow_schema()
    journal = journal_path(path)
    tmp = path.with_name(path.name + ".tmp")
    seen: set[str] = set()
    with pq.ParquetWriter(tmp, schema) as writer:
        if path.exists():
            for batch in iter_parquet_batches(path):
                try:
                    table = pa.Table.from_batches([batch]).cast(schema)
                except (pa.ArrowException, ValueError) as exc:
                    raise InputError(f"{path}: not a specgen output ({exc})") from None
                seen.update(table.column("id").to_pylist())
                writer.write_table(table)
        if journal.exists():
            chunk: list[dict[str, Any]] = []
            for record in scan_jsonl(journal, trim=False):
                if record["id"] not in seen:
                    seen.add(record["id"])
                    chunk.append(record)
                if len(chunk) >= PARQUET_ROW_GROUP:
                    writer.write_table(pa.Table.from_pylist(chunk, schema))
                    chunk = []
            if chunk:
                writer.write_table(pa.Table.from_pylist(chunk, schema))
    _fsync_path(tmp)
    os.replace(tmp, path)
    _fsync_path(path.parent)
    if journal.exists():
        journal.unlink()


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
