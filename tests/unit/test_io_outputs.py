"""Output sinks, torn-line recovery, the Parquet journal, and the summary arithmetic."""
from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest

from specgen.config import Method, SpecConfig
from specgen.engine.types import RequestOutput, RequestStats
from specgen.errors import ConfigError, InputError
from specgen.io.outputs import done_ids, iter_output_records, journal_path
from specgen.io.schema import FIELDS, arrow_schema, error_record, result_record
from specgen.io.summary import summarize
from specgen.io.writers import finalize_parquet, open_sink

NGRAM = SpecConfig(method=Method.NGRAM, num_speculative_tokens=3)


def record(i: int, error: str | None = None) -> dict:
    if error:
        return error_record(f"r{i}", error, NGRAM)
    stats = RequestStats(num_steps=3, num_draft_tokens=6, num_accepted_tokens=2, num_emitted_tokens=5,
                         accepted_per_position=[2, 0, 0, 0, 0])
    return result_record(RequestOutput(f"r{i}", i, f"text {i}", [1, 2, 3, 4, i], "length", 7, stats), NGRAM)


def test_result_record_fields_and_statistics():
    rec = record(9)
    assert tuple(rec) == FIELDS
    assert rec["num_output_tokens"] == 5 and rec["num_emitted_tokens"] == rec["num_accepted_tokens"] + 3
    assert rec["acceptance_rate"] == pytest.approx(2 / 6)
    assert rec["mean_accepted_length"] == pytest.approx(5 / 3)
    assert rec["accepted_per_position"] == [2, 0, 0]  # k positions for a speculative method
    assert rec["method"] == "ngram" and rec["error"] is None
    assert tuple(arrow_schema().names) == FIELDS


def test_error_record():
    rec = record(1, "line 1: empty prompt")
    assert rec["error"] == "line 1: empty prompt" and rec["finish_reason"] is None
    assert rec["token_ids"] == [] and rec["acceptance_rate"] is None and rec["mean_accepted_length"] is None


def test_jsonl_sink_and_resume_trims_a_torn_line(tmp_path):
    out = tmp_path / "out.jsonl"
    sink, done = open_sink(out, resume=False)
    assert len(done) == 0
    for i in range(3):
        sink.write(record(i))
    sink.close()
    with open(out, "ab") as f:
        f.write(b'{"id": "r3", "text": "half a rec')  # a run killed mid-write
    assert [r["id"] for r in iter_output_records(out)] == ["r0", "r1", "r2"]
    with pytest.raises(ConfigError, match="already exists; pass --resume"):
        open_sink(out, resume=False)
    sink, done = open_sink(out, resume=True)
    assert len(done) == 3 and all(f"r{i}" in done for i in range(3))
    sink.write(record(3))
    sink.close()
    lines = out.read_text().splitlines()
    assert [json.loads(line)["id"] for line in lines] == ["r0", "r1", "r2", "r3"]


def test_a_corrupt_middle_line_is_an_error(tmp_path):
    out = tmp_path / "out.jsonl"
    out.write_text(json.dumps(record(0)) + "\ngarbage\n" + json.dumps(record(1)) + "\n")
    with pytest.raises(InputError, match="line 2 is not an output record"):
        done_ids(out)


def test_parquet_journal_finalize_and_resume(tmp_path):
    out = tmp_path / "out.parquet"
    sink, _ = open_sink(out, resume=False)
    sink.write(record(0))
    sink.write(record(1, "line 2: empty prompt"))
    # A kill before close leaves only the journal: readable, and resumable.
    assert not out.exists() and journal_path(out).exists()
    assert [r["id"] for r in iter_output_records(out)] == ["r0", "r1"]
    sink.close()
    assert out.exists() and not journal_path(out).exists()
    assert pq.read_table(out).schema.equals(arrow_schema())

    sink, done = open_sink(out, resume=True)
    assert len(done) == 2 and "r0" in done and "r1" in done and "r2" not in done
    sink.write(record(2))
    sink.close()
    rows = pq.read_table(out).to_pylist()
    assert [r["id"] for r in rows] == ["r0", "r1", "r2"]
    assert rows[0] == record(0) and rows[1]["error"] == "line 2: empty prompt"


def test_resume_of_a_parquet_output_written_before_a_column_was_added(tmp_path):
    """An output without drafted_per_position (written before token trees) is resumed: the column comes back
    null for its old rows."""
    import pyarrow as pa

    out = tmp_path / "out.parquet"
    old = pa.schema([f for f in arrow_schema() if f.name != "drafted_per_position"])
    pq.write_table(pa.Table.from_pylist([{k: v for k, v in record(0).items() if k in old.names}],
                                        schema=old), out)
    sink, done = open_sink(out, resume=True)
    assert len(done) == 1 and "r0" in done
    sink.write(record(1))
    sink.close()
    rows = pq.read_table(out).to_pylist()
    assert [r["id"] for r in rows] == ["r0", "r1"] and rows[0]["drafted_per_position"] is None


def test_finalize_after_a_kill_between_rename_and_journal_delete(tmp_path):
    """The journal may still hold records already merged: they are not written twice."""
    out = tmp_path / "out.parquet"
    sink, _ = open_sink(out, resume=False)
    sink.write(record(0))
    sink.close()
    journal_path(out).write_text(json.dumps(record(0)) + "\n" + json.dumps(record(1)) + "\n")
    done = done_ids(out)
    assert len(done) == 2 and "r0" in done and "r1" in done and "r2" not in done
    assert [r["id"] for r in iter_output_records(out)] == ["r0", "r1"]
    finalize_parquet(out)
    assert [r["id"] for r in pq.read_table(out).to_pylist()] == ["r0", "r1"]


def test_output_extension(tmp_path):
    with pytest.raises(ConfigError, match=r"must end in \.jsonl or \.parquet"):
        open_sink(tmp_path / "out.csv", resume=False)


def test_summary():
    s = summarize([record(0), record(1), record(2, "line 3: bad")], wall_time_s=2.0)
    assert (s.num_requests, s.num_errors, s.num_prompt_tokens, s.num_output_tokens) == (3, 1, 14, 10)
    assert s.output_tokens_per_s == pytest.approx(5.0)
    assert s.mean_accepted_length == pytest.approx(10 / 6)
    assert s.acceptance_rate == pytest.approx(4 / 12)
    assert s.per_position_acceptance == pytest.approx([4 / 4, 0, 0])  # 2 decode steps per request
    assert s.methods == ["ngram"]
    empty = summarize([])
    assert empty.acceptance_rate is None and empty.mean_accepted_length is None
    assert empty.output_tokens_per_s is None


def test_summary_table_says_what_each_rate_is_out_of():
    from rich.console import Console

    from specgen.io.report import summary_table

    console = Console(width=120, record=True)
    console.print(summary_table(summarize([record(0), record(1)])))
    rows = {line.split("│")[1].strip(): line.split("│")[2].strip()
            for line in console.export_text().splitlines() if line.count("│") == 3}
    assert rows["drafts verified"] == "12"
    assert rows["acceptance rate (of drafts verified)"] == "0.333"
    assert rows["draft position 1 accepted, per decode step"] == "1.000"  # 2 of 2 decode steps per request
    assert rows["draft position 3 accepted, per decode step"] == "0.000"
