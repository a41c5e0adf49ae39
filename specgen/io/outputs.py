"""Reading output files back: their format, the ids already done (for --resume), and their records.

A Parquet output is written through a JSONL journal next to it (`OUT.parquet.journal.jsonl`); the records of
an output are the Parquet file's rows (when it exists) plus the journal's records not already in it.
"""
from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from specgen.engine.types import sample_key
from specgen.errors import ConfigError, InputError
from specgen.io.ids import SeenIds
from specgen.io.openai_output import is_openai_line, native_records

OUTPUT_FORMATS = {".jsonl": "jsonl", ".json": "jsonl", ".ndjson": "jsonl",
                  ".parquet": "parquet", ".pq": "parquet"}


def output_format(path: Path) -> str:
    fmt = OUTPUT_FORMATS.get(path.suffix.lower())
    if fmt is None:
        raise ConfigError(f"{path}: the output must end in .jsonl or .parquet")
    return fmt


def journal_path(path: Path) -> Path:
    """Where a Parquet output's records go until it is finalized."""
    return path.with_name(path.name + ".journal.jsonl")


def existing_parts(path: Path) -> list[Path]:
    """The files a previous run left for this output."""
    parts = [path]
    if output_format(path) == "parquet":
        parts.append(journal_path(path))
    return [p for p in parts if p.exists()]


def scan_jsonl(path: Path, trim: bool) -> Iterator[dict[str, Any]]:
    """Records of a JSONL output (an OpenAI Batch line's: one per sample); a torn last line (a run killed
    mid-write) is skipped, and cut if `trim`."""
    with open(path, "rb") as f:
        offset, pending = 0, None  # pending: (offset, number, line) of the line read before this one
        for number, line in enumerate(f, start=1):
            if pending is not None:
                yield from _decode(path, *pending[1:])
            pending = (offset, number, line)
            offset += len(line)
    if pending is None:
        return
    start, number, line = pending
    records = _decode(path, number, line, last=True)
    if records is not None:
        yield from records
    elif trim:
        with open(path, "r+b") as f:
            f.truncate(start)
            f.flush()
            os.fsync(f.fileno())


def _decode(path: Path, number: int, line: bytes, last: bool = False) -> list[dict[str, Any]] | None:
    try:
        record = json.loads(line) if line.endswith(b"\n") else None
    except (UnicodeDecodeError, json.JSONDecodeError):
        record = None
    records = [record]
    if isinstance(record, dict) and is_openai_line(record):  # an OpenAI Batch output line
        records = native_records(record) or [None]
    if all(isinstance(r, dict) and isinstance(r.get("id"), str) for r in records):
        return records
    if last:
        return None
    raise InputError(f"{path}: line {number} is not an output record; cannot read this output")


def record_key(record: dict[str, Any]) -> str:
    """A record's key among the done ids: its id, and its sample's index past the first (sample_key)."""
    return sample_key(record["id"], record.get("sample_index"))


def done_ids(path: Path) -> SeenIds:
    """Ids already written to an output (and its journal); trims a torn last line so appends stay clean. Held
    as SeenIds: an eighth of a byte per "req-N"-style id, where a set takes ~70 (a resumed 1M-record job: 350
    MiB peak instead of 439)."""
    ids = SeenIds()
    if output_format(path) == "jsonl":
        if path.exists():
            for r in scan_jsonl(path, trim=True):
                ids.add(record_key(r))
        return ids
    if path.exists():
        for key in _parquet_keys(path):
            ids.add(key)
    journal = journal_path(path)
    if journal.exists():
        for r in scan_jsonl(journal, trim=True):
            ids.add(record_key(r))
    return ids


def _parquet_keys(path: Path) -> Iterator[str]:
    import pyarrow.parquet as pq

    columns = ["id", "sample_index"] if "sample_index" in pq.read_schema(path).names else ["id"]
    for batch in iter_parquet_batches(path, columns=columns):
        yield from (record_key(r) for r in batch.to_pylist())


def iter_parquet_batches(path: Path, columns: list[str] | None = None):
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        yield from pq.ParquetFile(path).iter_batches(batch_size=1024, columns=columns)
    except (pa.ArrowException, OSError) as exc:
        raise InputError(f"{path}: not a readable Parquet output ({exc})") from None


def iter_output_records(path: Path) -> Iterator[dict[str, Any]]:
    """Every record of an output (finished or not), each id once."""
    if not existing_parts(path):
        raise InputError(f"{path}: output file not found")
    if output_format(path) == "jsonl":
        yield from scan_jsonl(path, trim=False)
        return
    journal = journal_path(path)
    seen: set[str] = set()
    if path.exists():
        for batch in iter_parquet_batches(path):
            for record in batch.to_pylist():
                if journal.exists():
                    seen.add(record_key(record))
                yield record
    if journal.exists():
        for record in scan_jsonl(journal, trim=False):
            if record_key(record) not in seen:
                seen.add(record_key(record))
                yield record
