"""--sample: reservoir sampling of an input's records: uniform, repeatable with a seed,
real line numbers kept."""
from __future__ import annotations

import json
from collections import Counter

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from specgen.config import SamplingParams
from specgen.errors import ConfigError
from specgen.io.requests import RequestSource
from specgen.io.sample import sample_records


def lines_file(tmp_path, n: int, blank_every: int = 0):
    """n records {"id": "rI", "prompt": "text I"}; with blank_every, a blank line after every that many."""
    out = []
    for i in range(n):
        out.append(json.dumps({"id": f"r{i}", "prompt": f"text {i}"}))
        if blank_every and i % blank_every == blank_every - 1:
            out.append("")
    path = tmp_path / "in.jsonl"
    path.write_text("\n".join(out) + "\n")
    return path


def test_same_seed_same_sample_in_input_order(tmp_path):
    path = lines_file(tmp_path, 100)
    a = sample_records(path, "jsonl", 10, seed=7)
    assert [r.number for r in a] == [r.number for r in sample_records(path, "jsonl", 10, seed=7)]
    assert [r.number for r in a] != [r.number for r in sample_records(path, "jsonl", 10, seed=8)]
    assert [r.number for r in a] == sorted(r.number for r in a) and len({r.number for r in a}) == 10


def test_fewer_records_than_asked_gives_them_all(tmp_path):
    path = lines_file(tmp_path, 4)
    assert [r.value["id"] for r in sample_records(path, "jsonl", 10, seed=0)] == ["r0", "r1", "r2", "r3"]
    with pytest.raises(ConfigError, match="--sample must be >= 1"):
        sample_records(path, "jsonl", 0, seed=0)


def test_uniform(tmp_path):
    """Each of 20 records is kept with probability 5/20: over 4000 seeds, ~1000 times each (sd ~27), and the
    pairs of records as often as independence of the n-subset's members allows."""
    path = lines_file(tmp_path, 20)
    counts: Counter = Counter()
    first_two = 0
    for seed in range(4000):
        numbers = [r.number for r in sample_records(path, "jsonl", 5, seed)]
        counts.update(numbers)
        first_two += numbers[:2] == [1, 2]
    assert set(counts) == set(range(1, 21))
    assert all(abs(c - 1000) < 135 for c in counts.values()), counts  # 5 sd
    # P(records 1 and 2 both kept) = (5/20) (4/19) = 1/19: ~210 of 4000
    assert abs(first_two - 4000 / 19) < 5 * (4000 / 19) ** 0.5


def test_line_numbers_are_the_files(tmp_path):
    """Blank lines count as lines; a bad line sampled is reported at its line in the file."""
    path = lines_file(tmp_path, 30, blank_every=3)
    text = path.read_text().splitlines()
    text[10] = "{not json"
    path.write_text("\n".join(text) + "\n")
    seed = next(s for s in range(100) if 11 in [r.number for r in sample_records(path, "jsonl", 8, s)])
    records = sample_records(path, "jsonl", 8, seed)  # 8 of 30 records, the bad line among them
    for r in records:
        assert r.error is not None if r.number == 11 else r.value == json.loads(text[r.number - 1])
    bad = []
    source = RequestSource(records=records, encode=lambda prompt, where: (1, 2), sampling=SamplingParams(),
                           context_len=64, vocab_size=10,
                           on_bad=lambda rid, message, n, openai: bad.append((rid, message)))
    ids = [r.id for r in source]
    assert bad == [("11", "line 11: malformed JSON (Expecting property name enclosed in double quotes "
                          "at column 2)")]
    assert len(ids) == 7 and "r8" not in ids  # r8 was line 11


def test_parquet_rows(tmp_path):
    path = tmp_path / "in.parquet"
    pq.write_table(pa.Table.from_pylist([{"id": f"r{i}", "prompt": f"text {i}"} for i in range(50)]), path)
    got = sample_records(path, "parquet", 6, seed=3)
    assert len(got) == 6 and all(r.value["id"] == f"r{r.number - 1}" for r in got)
