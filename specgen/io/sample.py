"""A uniform random sample of an input's records, drawn while streaming it once (reservoir sampling)."""
from __future__ import annotations

import random
from pathlib import Path

from specgen.errors import ConfigError
from specgen.io.readers import RawRecord, _decode_line, _is_record, iter_records


def sample_records(path: Path, fmt: str, n: int, seed: int) -> list[RawRecord]:
    """`n` records chosen uniformly at random (every n-subset equally likely; all of them when there are
    fewer), in input order, each with its number in the whole file, so that messages name the real line or
    row.

    Algorithm R (Vitter 1985): record i (0-based) replaces a random one of the n kept with probability
    n / (i + 1). JSONL lines are decoded only once kept; the same seed and file give the same sample."""
    if n < 1:
        raise ConfigError(f"--sample must be >= 1 records, got {n}")
    rng = random.Random(seed)
    kept: list[tuple[int, bytes | RawRecord]] = []
    for i, (number, item) in enumerate(_numbered(path, fmt)):
        if i < n:
            kept.append((number, item))
        else:
            j = rng.randrange(i + 1)
            if j < n:
                kept[j] = (number, item)
    kept.sort(key=lambda pair: pair[0])
    return [_decode_line(number, item) if isinstance(item, bytes) else item for number, item in kept]


def _numbered(path: Path, fmt: str):
    """(record number, raw line) for JSONL, undecoded; (row number, record) for Parquet."""
    if fmt == "parquet":
        for record in iter_records(path, fmt):
            yield record.number, record
        return
    with open(path, "rb") as f:
        for number, line in enumerate(f, start=1):
            if _is_record(line):
                yield number, line
