"""specgen run --ray: Ray Data on a local 2-CPU instance writes the one-engine run's records (same schema,
summary, error records naming their line) and resumes by id."""
from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest
from cli_support import by_id, invoke, read_output, write_jsonl, write_parquet

from specgen.io.schema import arrow_schema

ray = pytest.importorskip("ray", reason="ray is not installed: pip install 'specgen[ray]'")

RECORDS = [{"id": f"r{i}", "prompt": f"request {i}: " + "abc " * (i % 5), "max_tokens": 4 + i % 9,
            "temperature": 0.9 if i % 2 else None} for i in range(30)]
RECORDS[7] = {"id": "r7", "prompt": None, "messages": None, "temperature": 0.5}  # no prompt: an error record


@pytest.fixture(scope="module")
def local_ray():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level="ERROR")
    yield
    ray.shutdown()


def run(inp, out, *extra):
    summary = out.with_suffix(".summary.json")
    res = invoke("run", inp, "-o", out, "--batch-size", "4", "--seed", "3", "--summary-json", summary, "-q",
                 *extra)
    return res, json.loads(summary.read_text()) if summary.exists() else None


def test_ray_job_writes_the_local_records_and_resumes(tmp_path, local_ray):
    inp = write_parquet(tmp_path / "in.parquet", RECORDS)
    res, local = run(inp, tmp_path / "local.parquet")
    assert res.exit_code == 8, res.output
    res, remote = run(inp, tmp_path / "ray.parquet", "--ray", "auto", "--data-parallel-size", "2",
                      "--threads", "1")
    assert res.exit_code == 8, res.output
    assert pq.read_schema(tmp_path / "ray.parquet").remove_metadata() == arrow_schema()
    want, got = by_id(read_output(tmp_path / "local.parquet")), read_output(tmp_path / "ray.parquet")
    # input order (a local run's: completion order)
    assert [r["id"] for r in got] == [r["id"] for r in RECORDS]
    assert {r["id"]: r for r in got} == want  # every field
    assert want["r7"]["error"].startswith("row 8: need exactly one of prompt, messages, input_ids")
    for key in ("num_requests", "num_errors", "num_prompt_tokens", "num_output_tokens", "num_steps",
                "methods"):
        assert remote[key] == local[key], key

    # Resume by id: an output holding the first half, completed on Ray; every id once.
    half = write_jsonl(tmp_path / "half.jsonl",
                       [{k: v for k, v in r.items() if v is not None} for r in RECORDS[:15]])
    out = tmp_path / "resumed.jsonl"
    res, _ = run(half, out)
    assert res.exit_code == 8, res.output
    res, resumed = run(inp, out, "--ray", "auto", "--resume", "--threads", "1")
    assert res.exit_code == 0, res.output
    assert resumed["num_resumed"] == 15 and resumed["num_requests"] == 15
    done = by_id(read_output(out))
    assert sorted(done) == sorted(want)
    assert all(done[rid]["token_ids"] == w["token_ids"] for rid, w in want.items())


def test_ray_writes_every_sample(tmp_path, local_ray):
    """A record's n samples share its id: each is written once, as the one-engine run writes them."""
    records = [{"id": "a", "prompt": "tell me", "n": 3, "temperature": 0.9}, {"id": "b", "prompt": "once"}]
    inp = write_parquet(tmp_path / "in.parquet", records)
    res, _ = run(inp, tmp_path / "local.parquet")
    assert res.exit_code == 0, res.output
    res, _ = run(inp, tmp_path / "ray.parquet", "--ray", "auto", "--threads", "1")
    assert res.exit_code == 0, res.output

    def by_sample(path):
        return {(r["id"], r["sample_index"]): r["token_ids"] for r in read_output(path)}

    local = by_sample(tmp_path / "local.parquet")
    assert sorted(local) == [("a", 0), ("a", 1), ("a", 2), ("b", 0)]
    assert by_sample(tmp_path / "ray.parquet") == local
