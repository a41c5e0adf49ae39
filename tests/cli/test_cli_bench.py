"""`specgen bench` through Typer's CliRunner: --sample, --batch-sizes, --plot, --summary-json and the
advice."""
from __future__ import annotations

import json

import pytest
from cli_support import assert_one_error_line, invoke, needs_ngram, prompts, write_jsonl

from specgen.app.settings import load_yaml, resolve
from specgen.io.sample import sample_records

N = 40


@pytest.fixture(scope="module")
def bench_run(tmp_path_factory):
    """One bench of a 6-record sample of N records at two batch sizes, with a plot and the summary JSON."""
    folder = tmp_path_factory.mktemp("bench")
    path = write_jsonl(folder / "in.jsonl", prompts(N))
    summary, plot = folder / "bench.json", folder / "bench.png"
    result = invoke("bench", path, "--methods", "none,ngram:2", "--sample", "6", "--sample-seed", "5",
                    "--batch-sizes", "1,4", "--max-tokens", "6", "--repeats", "2", "--plot", plot,
                    "--summary-json", summary)
    assert result.exit_code == 0, result.output
    return path, json.loads(summary.read_text()), plot, result.output


@needs_ngram
def test_sample_is_the_seeded_one_with_line_numbers(bench_run):
    path, data, _, output = bench_run
    numbers = [r.number for r in sample_records(path, "jsonl", 6, 5)]
    assert data["sample"] == {"records": 6, "seed": 5, "numbers": numbers} and data["repeats"] == 2
    assert "sample: 6 records of in.jsonl (seed 5)" in output
    assert all(row["summary"]["num_requests"] == 6 for row in data["rows"])


@needs_ngram
def test_every_batch_size_and_figure(bench_run):
    _, data, _, output = bench_run
    rows = data["rows"]
    assert [(r["label"], r["method"], r["k"], r["batch_size"]) for r in rows] == [
        ("none", "none", None, 1), ("ngram:2", "ngram", 2, 1), ("none", "none", None, 4),
        ("ngram:2", "ngram", 2, 4)]
    for r in rows:
        assert r["identical"] and r["tok_s"] > 0 and r["speedup"] > 0
        assert r["summary"]["num_output_tokens"] / r["summary"]["wall_time_s"] == pytest.approx(r["tok_s"])
    for r in rows[1::2]:  # ngram: what was possible
        assert r["ceiling"] >= 1 and r["oracle"] >= 1 and 0 < r["prefill_share"] < 1
        assert r["of_oracle"] == pytest.approx(r["speedup"] / r["oracle"])
        assert r["decode_bound"] >= 1 and r["step_costs"]["1"] > 0 and len(r["per_position_acceptance"]) == 2
    for column in ("tok/s", "speedup", "ceiling", "oracle", "of oracle", "per position", "identical"):
        assert column in output


@needs_ngram
def test_advice_names_the_fastest_and_its_yaml_resolves(bench_run, tmp_path):
    _, data, _, output = bench_run
    advice = data["advice"]
    best = max(data["rows"], key=lambda r: r["tok_s"])
    assert (advice["method"], advice["batch_size"]) == (best["method"], best["batch_size"])
    assert advice["headline"] in output and f"why: {advice['why']}" in output and advice["yaml"] in output
    assert advice["why"].startswith("no drafter pays" if best["method"] == "none" else "ngram:2 gains")
    path = tmp_path / "advised.yaml"
    path.write_text(advice["yaml"])
    cfg = resolve(load_yaml(path), {})
    assert (cfg.spec.method.value, cfg.engine.batch_size, cfg.sampling.max_tokens) == (
        best["method"], best["batch_size"], 6)
    assert best["method"] == "none" or cfg.spec.num_speculative_tokens == 2


@needs_ngram
def test_plot_is_a_png(bench_run):
    plot = bench_run[2]
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and plot.stat().st_size < 200_000


def test_batch_size_and_batch_sizes_conflict(tmp_path):
    path = write_jsonl(tmp_path / "in.jsonl", prompts(2))
    result = invoke("bench", path, "--batch-size", "2", "--batch-sizes", "1,2")
    assert result.exit_code == 2
    assert_one_error_line(result, "give --batch-size or --batch-sizes, not both")
    result = invoke("bench", path, "--batch-sizes", "1,300")
    assert result.exit_code == 2
    assert_one_error_line(result, "batch_size must be in 1..256")
