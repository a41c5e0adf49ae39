"""CLI test support: a CliRunner wrapper, input writers and output readers (tiny llama checkpoint)."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from specgen.cli import app

TINY_LLAMA = Path(__file__).resolve().parents[1] / "fixtures" / "tiny" / "llama"
HAS_NGRAM = importlib.util.find_spec("specgen.engine.proposers.ngram") is not None
needs_ngram = pytest.mark.skipif(not HAS_NGRAM, reason="specgen.engine.proposers.ngram is not there yet")


def invoke(*args: str | Path, model: bool = True):
    """Run `specgen ARGS` in-process; `model` adds --model <tiny llama> to run and bench."""
    argv = [str(a) for a in args]
    if model and argv and argv[0] in ("run", "bench"):
        argv += ["--model", str(TINY_LLAMA)]
    return CliRunner().invoke(app, argv)


def write_jsonl(path: Path, records: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


def write_parquet(path: Path, records: list[dict]) -> Path:
    pq.write_table(pa.Table.from_pylist(records), path)
    return path


def read_output(path: Path) -> list[dict]:
    if path.suffix == ".parquet":
        return pq.read_table(path).to_pylist()
    return [json.loads(line) for line in path.read_text().splitlines()]


def by_id(records: list[dict]) -> dict[str, dict]:
    out = {r["id"]: r for r in records}
    assert len(out) == len(records), "an id was written twice"
    return out


def prompts(n: int) -> list[dict]:
    """Varied small records: text, chat and token-id prompts."""
    recs = []
    for i in range(n):
        if i % 3 == 0:
            recs.append({"id": f"r{i}", "prompt": f"request number {i}: " + "abc " * (i % 5)})
        elif i % 3 == 1:
            recs.append({"id": f"r{i}", "messages": [{"role": "user", "content": f"tell me about {i}"}]})
        else:
            recs.append({"id": f"r{i}", "input_ids": [3 + j for j in range(2 + i % 7)]})
    return recs


def stderr_lines(result) -> list[str]:
    """What specgen printed on stderr, without Paddle's import-time OMP_NUM_THREADS banner."""
    return [line for line in result.stderr.splitlines()
            if line.strip() and "OMP_NUM_THREADS" not in line and not line.startswith("It will fail if")]


def assert_one_error_line(result, fragment: str) -> None:
    lines = stderr_lines(result)
    assert len(lines) == 1 and lines[0].startswith("error: ") and fragment in lines[0], result.stderr
    assert "Traceback" not in result.output
