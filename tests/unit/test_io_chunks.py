"""Input chunks (what Ray Data's read tasks read): together, exactly the records iter_records reads,
numbered alike."""
from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from specgen.io.readers import chunks, iter_chunk, iter_records


@pytest.mark.parametrize("size", [1, 2, 3, 10])
def test_jsonl_chunks_read_every_record_once(tmp_path, size):
    path = tmp_path / "in.jsonl"
    # blank lines, no final \n
    path.write_text('{"a": 1}\n\n{"a": 2}\nnot json\n\n \n{"a": 3}\n{"a": 4}\n{"a": 5}')
    parts = chunks(path, "jsonl", size)
    assert [c.num_records for c in parts][:-1] == [size] * (len(parts) - 1)
    assert [r for c in parts for r in iter_chunk(c)] == list(iter_records(path, "jsonl"))


@pytest.mark.parametrize("size", [1, 3, 5, 20])
def test_parquet_chunks_split_row_groups(tmp_path, size):
    path = tmp_path / "in.parquet"
    pq.write_table(pa.Table.from_pylist([{"prompt": str(i)} for i in range(10)]), path, row_group_size=4)
    parts = chunks(path, "parquet", size)
    assert max(c.num_records for c in parts) <= size
    assert [r for c in parts for r in iter_chunk(c)] == list(iter_records(path, "parquet"))
