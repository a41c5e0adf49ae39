"""Streaming input readers: JSONL lines and Parquet rows, one decoded record at a time (bounded memory)."""
from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specgen.errors import ConfigError, InputError

INPUT_FORMATS = {".jsonl": "jsonl", ".json": "jsonl", ".ndjson": "jsonl",
                 ".parquet": "parquet", ".pq": "parquet"}
PARQUET_BATCH_ROWS = 256


@dataclass(frozen=True)
class RawRecord:
    """One input record before validation: its 1-based line (JSONL) or row (Parquet) number."""

    number: int
    value: Any  # the decoded JSON value / the row as a dict; None when `error` is set
    error: str | None = None  # why it could not be decoded


def input_format(path: Path, given: str | None) -> str:
    """`given` (--input-format) wins; otherwise the extension decides."""
    if given is not None:
        if given not in ("jsonl", "parquet"):
            raise ConfigError(f"--input-format must be jsonl or parquet, got {given!r}")
        return given
    fmt = INPUT_FORMATS.get(path.suffix.lower())
    if fmt is None:
        raise ConfigError(f"{path}: cannot tell the input format from the extension "
                          f"(use {', '.join(INPUT_FORMATS)} or pass --input-format jsonl|parquet)")
    return fmt


def unit_name(fmt: str) -> str:
    """What a record is called in messages: a line of JSONL, a row of Parquet."""
    return "line" if fmt == "jsonl" else "row"


def check_input(path: Path) -> None:
    if not path.exists():
        raise InputError(f"{path}: input file not found")
    if not path.is_file():
        raise InputError(f"{path}: input is not a file")


def count_records(path: Path, fmt: str) -> int:
    """Cheap total for the progress bar: non-blank lines (one pass over bytes), or Parquet metadata rows."""
    if fmt == "parquet":
        return _parquet_file(path).metadata.num_rows
    n = 0
    with open(path, "rb") as f:
        for line in f:
            n += bool(line.strip())
    return n


def iter_records(path: Path, fmt: str) -> Iterator[RawRecord]:
    """Decoded records in input order; undecodable JSONL lines come back with `error` set."""
    return _iter_parquet(path) if fmt == "parquet" else _iter_jsonl(path)


def _iter_jsonl(path: Path) -> Iterator[RawRecord]:
    with open(path, "rb") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue  # blank lines (a trailing newline, spacing) are not records
            try:
                yield RawRecord(number, json.loads(line))
            except UnicodeDecodeError:
                yield RawRecord(number, None, "not UTF-8 text")
            except json.JSONDecodeError as exc:
                yield RawRecord(number, None, f"malformed JSON ({exc.msg} at column {exc.colno})")


def _parquet_file(path: Path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        return pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as exc:
        raise InputError(f"{path}: not a readable Parquet file ({exc})") from None


def _iter_parquet(path: Path) -> Iterator[RawRecord]:
    import pyarrow as pa

    pf = _parquet_file(path)
    number = 0
    batches = pf.iter_batches(batch_size=PARQUET_BATCH_ROWS)
    while True:
        try:
            batch = next(batches)
        except StopIteration:
            return
        except (pa.ArrowException, OSError) as exc:
            raise InputError(f"{path}: Parquet read failed after row {number} ({exc})") from None
        for row in batch.to_pylist():
            number += 1
            yield RawRecord(number, row)
