"""Output sinks: records reach the OS as they finish, the disk in bounded time; Parquet is finalized at close.

Durability policy: every record is flushed to the OS as one write of one line (a SIGKILL loses nothing that
was written); the file is fsynced every SYNC_EVERY_RECORDS records, at least every SYNC_EVERY_SECONDS while
records are pending (a background timer), and at close. A Parquet output is a JSONL journal until close,
which merges the existing Parquet file (from an earlier run) and the journal into a temporary file, renames it
over the output and removes the journal; a kill at any point of that leaves parts --resume can complete.
"""
from __future__ import annotations

import errno
import json
import os
import threading
from pathlib import Path
from typing import Any, Protocol

from specgen.errors import ConfigError, InputError, OutputError
from specgen.io.ids import SeenIds
from specgen.io.manifest import PARQUET_KEY, read_manifest, sidecar_path
from specgen.io.outputs import (
    existing_parts,
    iter_parquet_batches,
    journal_path,
    output_format,
    record_key,
    scan_jsonl,
)

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
        self.error: OSError | None = None  # a failed fsync of the timer's, raised by the sink's next write
        self._thread = threading.Thread(target=self._loop, name="specgen-fsync", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(self._interval):
            try:
                self.sync()
            except OSError as exc:
                self.error = exc
                return

    def mark_dirty(self) -> None:
        self._dirty = True

    def sync(self) -> None:
        with self._lock:
            if self._dirty:
                self._dirty = False
                os.fsync(self._fd)

    def stop(self) -> None:
        """Stop the timer and sync what is pending."""
        self.halt()
        self.sync()

    def halt(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()


class JsonlSink:
    """One JSON object per line, appended in completion order, each line one write(2) of an unbuffered file (a
    failed write leaves at most a torn last line, which --resume trims). A write error, or the file vanishing
    from its path (its folder removed), raises OutputError; close() after one only lets the descriptor go."""

    def __init__(self, path: Path, append: bool):
        self.path = path
        try:
            self._file = open(path, "ab" if append else "xb", buffering=0)  # noqa: SIM115 (held until close())
        except OSError as exc:
            raise OutputError(_what(path, exc)) from None
        self._ino = os.fstat(self._file.fileno()).st_ino
        self._sync = _PeriodicSync(self._file.fileno(), SYNC_EVERY_SECONDS)
        self._since_sync = 0
        self.failed = False

    def write(self, record: dict[str, Any]) -> None:
        data = memoryview(json.dumps(record, ensure_ascii=False).encode("utf-8") + b"\n")
        try:
            if self._sync.error is not None:
                raise self._sync.error
            while data:
                data = data[self._file.write(data):]
            self._sync.mark_dirty()
            self._since_sync += 1
            if self._since_sync >= SYNC_EVERY_RECORDS:
                self._since_sync = 0
                self._check_path()
                self._sync.sync()
        except OSError as exc:
            self.failed = True
            raise OutputError(_what(self.path, exc)) from None

    def _check_path(self) -> None:
        """Writes to a file whose folder was removed succeed and are lost: fail instead."""
        try:
            same = os.stat(self.path).st_ino == self._ino
        except FileNotFoundError:
            same = False
        if not same:
            raise OSError(errno.ENOENT, "the file was removed or replaced while this run wrote it")

    def close(self) -> None:
        if self._file.closed:
            return
        try:
            if not self.failed:
                try:
                    if self._sync.error is not None:
                        raise self._sync.error
                    self._check_path()
                    self._sync.stop()
                except OSError as exc:
                    self.failed = True
                    raise OutputError(_what(self.path, exc)) from None
        finally:
            self._sync.halt()
            self._file.close()


class ParquetSink:
    """Records go to the journal as they finish; close() turns the output into one Parquet file (not after a
    failed write: the journal stays for --resume)."""

    def __init__(self, path: Path):
        self.path = path
        self._journal = JsonlSink(journal_path(path), append=True)

    def write(self, record: dict[str, Any]) -> None:
        self._journal.write(record)

    def close(self) -> None:
        self._journal.close()
        if not self._journal.failed:
            finalize_parquet(self.path)


def open_sink(path: Path, resume: bool) -> tuple[Sink, SeenIds]:
    """Open the output; with `resume`, continue it and return the ids it already holds."""
    from specgen.io.outputs import done_ids

    fmt = output_format(path)
    parts = existing_parts(path)
    if parts and not resume:
        raise ConfigError(f"output {parts[0]} already exists; pass --resume to continue it, or remove it")
    if not path.parent.is_dir():
        raise ConfigError(f"{path.parent}: the output's folder does not exist")
    done = done_ids(path) if parts else SeenIds()
    sink: Sink = JsonlSink(path, append=bool(parts)) if fmt == "jsonl" else ParquetSink(path)
    return sink, done


def finalize_parquet(path: Path) -> None:
    """Merge the existing Parquet output (if any) and the journal into `path` atomically, with the run
    manifest in its metadata; drop the journal and the manifest's sidecar. On any failure (or an interrupt)
    the temporary file goes and the parts stay as they were."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        _merge_parquet(path, tmp)
        _fsync_path(tmp)
        os.replace(tmp, path)
        _fsync_path(path.parent)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise OutputError(_what(tmp, exc)) from None
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    journal_path(path).unlink(missing_ok=True)
    sidecar_path(path).unlink(missing_ok=True)


def _with_new_columns(table, schema):
    """An output written before a column was added to the record (drafted_per_position) gains it, null; a
    table without ids is no output and stays as it is (the cast refuses it)."""
    import pyarrow as pa

    if "id" not in table.column_names:
        return table
    for f in schema:
        if f.name not in table.column_names:
            table = table.append_column(f, pa.nulls(len(table), f.type))
    return table.select(schema.names)


def _merge_parquet(path: Path, tmp: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    from specgen.io.schema import arrow_schema

    schema = arrow_schema()
    manifest = read_manifest(path)
    if manifest is not None:
        schema = schema.with_metadata({PARQUET_KEY: json.dumps(manifest, sort_keys=True).encode()})
    journal = journal_path(path)
    seen: set[str] = set()
    with pq.ParquetWriter(tmp, schema) as writer:
        if path.exists():
            for batch in iter_parquet_batches(path):
                try:
                    table = _with_new_columns(pa.Table.from_batches([batch]), schema).cast(schema)
                except (pa.ArrowException, ValueError) as exc:
                    raise InputError(f"{path}: not a specgen output ({exc})") from None
                seen.update(record_key(r) for r in table.select(["id", "sample_index"]).to_pylist())
                writer.write_table(table)
        if journal.exists():
            chunk: list[dict[str, Any]] = []
            for record in scan_jsonl(journal, trim=False):
                if record_key(record) not in seen:
                    seen.add(record_key(record))
                    chunk.append(record)
                if len(chunk) >= PARQUET_ROW_GROUP:
                    writer.write_table(pa.Table.from_pylist(chunk, schema))
                    chunk = []
            if chunk:
                writer.write_table(pa.Table.from_pylist(chunk, schema))


def _what(path: Path, exc: OSError) -> str:
    """`cannot write FILE: the error`, in the OS's words."""
    return f"cannot write {path}: {exc.strerror or exc}"


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
