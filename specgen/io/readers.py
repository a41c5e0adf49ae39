"""Streaming input readers: JSONL lines and Parquet rows, one decoded record at a time (bounded memory)."""
from __future__ import annotations

import json
import sys
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
        return _parquet_rows(_parquet_file(path), path)
    n = 0
    with open(path, "rb") as f:
        for line in f:
            n += _is_record(line)
    return n


def _is_record(line: bytes) -> bool:
    """Blank lines (a trailing newline, ASCII spacing) are not records; count and read both ask here."""
    return bool(line.strip())


def iter_records(path: Path, fmt: str) -> Iterator[RawRecord]:
    """Decoded records in input order; undecodable JSONL lines come back with `error` set."""
    return _iter_parquet(path) if fmt == "parquet" else _iter_jsonl(path)


def _iter_jsonl(path: Path) -> Iterator[RawRecord]:
    with open(path, "rb") as f:
        for number, line in enumerate(f, start=1):
            if _is_record(line):
                yield _decode_line(number, line)


def _decode_line(number: int, line: bytes) -> RawRecord:
    # Decoded here, not by json.loads(bytes): that guesses UTF-16/32 from NUL bytes and would read a UTF-16
    # line as a record. A leading byte-order mark is allowed (where a file starts, or where files were
    # joined).
    try:
        text = line.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        at = len(line) - len(exc.object) + exc.start + 1  # exc.object: the line past a byte-order mark
        return RawRecord(number, None, f"not UTF-8 text (byte {at})")
    try:
        return RawRecord(number, json.loads(text))
    except json.JSONDecodeError as exc:
        return RawRecord(number, None, f"malformed JSON ({exc.msg} at column {exc.colno})")
    except RecursionError:
        return RawRecord(number, None, "malformed JSON (nested too deeply)")
    except ValueError:  # the only other one: an integer past Python's int/str conversion limit
        return RawRecord(number, None,
                         f"malformed JSON (an integer over {sys.get_int_max_str_digits()} digits)")


def _parquet_file(path: Path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        return pq.ParquetFile(path)
    except (pa.ArrowException, OSError, ValueError) as exc:  # ValueError: a footer's names not UTF-8
        raise InputError(f"{path}: not a readable Parquet file ({exc})") from None


def _parquet_rows(pf, path: Path) -> int:
    """The footer's row count, once its row groups add up to it: a corrupt footer can say anything."""
    meta = pf.metadata
    groups = [meta.row_group(i).num_rows for i in range(meta.num_row_groups)]
    if meta.num_rows < 0 or min(groups, default=0) < 0 or sum(groups) != meta.num_rows:
        raise InputError(f"{path}: corrupt Parquet footer ({meta.num_rows} rows, but its row groups hold "
                         f"{sum(groups)})")
    return meta.num_rows


def _iter_parquet(path: Path) -> Iterator[RawRecord]:
    import pyarrow as pa

    pf = _parquet_file(path)
    num_rows = _parquet_rows(pf, path)
    number = 0
    batches = pf.iter_batches(batch_size=PARQUET_BATCH_ROWS)
    while True:
        try:
            batch = next(batches)
        except StopIteration:
            break
        except (pa.ArrowException, OSError, ValueError) as exc:
            raise InputError(f"{path}: Parquet read failed after row {number} ({exc})") from None
        if number + batch.num_rows > num_rows:  # count_records promised num_rows: every row is accounted for
            raise InputError(f"{path}: corrupt Parquet file (more rows than the {num_rows} its footer lists)")
        for row, error in _batch_rows(batch):
            number += 1
            yield RawRecord(number, row, error)
    if number != num_rows:
        raise InputError(f"{path}: corrupt Parquet file (it ends after row {number} of the {num_rows} its "
                         "footer lists)")


def _batch_rows(batch) -> list[tuple[dict[str, Any] | None, str | None]]:
    """A batch's rows as dicts; a value Python cannot hold (a timestamp past the year 9999) fails its row
    only."""
    import pyarrow as pa

    try:
        return [(row, None) for row in batch.to_pylist()]
    except (pa.ArrowException, ValueError, OverflowError):
        return [_row(batch, i) for i in range(batch.num_rows)]


def _row(batch, i: int) -> tuple[dict[str, Any] | None, str | None]:
    import pyarrow as pa

    row = {}
    for name, column in zip(batch.schema.names, batch.columns):
        try:
            row[name] = column[i].as_py()
        except (pa.ArrowException, ValueError, OverflowError) as exc:
            return None, f"column {name!r} has a value Python cannot hold ({exc})"
    return row, None


@dataclass(frozen=True)
class Chunk:
    """A run of an input's records that can be read on its own (by another process or machine)."""

    path: str
    fmt: str  # jsonl | parquet
    start: int  # JSONL: the byte offset of its first line; Parquet: its row group
    first_number: int  # the line / row number before its first record
    num_records: int  # records to read (JSONL: blank lines not counted)
    skip: int = 0  # Parquet: the row group's rows before it


def chunks(path: Path, fmt: str, size: int) -> list[Chunk]:
    """The input cut into runs of `size` records (Parquet: within row groups), in input order: one pass over a
    JSONL file's bytes, a Parquet file's footer."""
    if fmt == "parquet":
        meta = _parquet_file(path).metadata
        out, first = [], 0
        for group in range(meta.num_row_groups):
            rows = meta.row_group(group).num_rows
            out += [Chunk(str(path), fmt, group, first + skip, min(size, rows - skip), skip)
                    for skip in range(0, rows, size)]
            first += rows
        return out
    out, offset, start, first, count = [], 0, 0, 0, 0
    with open(path, "rb") as f:
        for number, line in enumerate(f, start=1):
            if _is_record(line):
                if count == 0:
                    start, first = offset, number - 1
                count += 1
                if count == size:
                    out.append(Chunk(str(path), fmt, start, first, count))
                    count = 0
            offset += len(line)
    if count:
        out.append(Chunk(str(path), fmt, start, first, count))
    return out


def iter_chunk(chunk: Chunk) -> Iterator[RawRecord]:
    """A chunk's records, numbered as iter_records numbers them."""
    if chunk.fmt == "parquet":
        import pyarrow as pa

        try:
            batch = (_parquet_file(Path(chunk.path)).read_row_group(chunk.start)
                     .slice(chunk.skip, chunk.num_records))
        except (pa.ArrowException, OSError, ValueError) as exc:
            raise InputError(f"{chunk.path}: Parquet read failed in row group {chunk.start} "
                             f"({exc})") from None
        for i, (row, error) in enumerate(_batch_rows(batch), start=chunk.first_number + 1):
            yield RawRecord(i, row, error)
        return
    with open(chunk.path, "rb") as f:
        f.seek(chunk.start)
        left = chunk.num_records
        for number, line in enumerate(f, start=chunk.first_number + 1):
            if not left:
                return
            if _is_record(line):
                left -= 1
                yield _decode_line(number, line)
