"""`specgen run`, `stats` and `bench` end to end on the tiny llama checkpoint, through Typer's CliRunner."""
from __future__ import annotations

import json

import pytest
from cli_support import (
    TINY_LLAMA,
    by_id,
    invoke,
    needs_ngram,
    prompts,
    read_output,
    write_jsonl,
    write_parquet,
)

import specgen.api
import specgen.kernels
from specgen.io.schema import FIELDS

N = 12


@pytest.fixture(scope="module")
def jsonl_in(tmp_path_factory):
    return write_jsonl(tmp_path_factory.mktemp("in") / "in.jsonl", prompts(N))


@pytest.fixture(scope="module")
def jsonl_run(jsonl_in):
    """One plain run shared by the tests that only read its output."""
    out = jsonl_in.parent / "out.jsonl"
    summary = jsonl_in.parent / "summary.json"
    result = invoke("run", jsonl_in, "-o", out, "--max-tokens", "8", "--batch-size", "4",
                    "--summary-json", summary)
    assert result.exit_code == 0, result.output
    return out, summary, result


def test_jsonl_round_trip(jsonl_run):
    out, summary_path, result = jsonl_run
    records = by_id(read_output(out))
    assert sorted(records) == sorted(f"r{i}" for i in range(N))
    for rec in records.values():
        assert tuple(rec) == FIELDS
        assert rec["error"] is None and rec["method"] == "none"
        assert 1 <= rec["num_output_tokens"] == len(rec["token_ids"]) <= 8
        assert rec["num_emitted_tokens"] == rec["num_accepted_tokens"] + rec["num_steps"]
        assert rec["finish_reason"] in ("stop", "length")
        assert rec["accepted_per_position"] == [] and rec["acceptance_rate"] is None
    summary = json.loads(summary_path.read_text())
    assert summary["num_requests"] == N and summary["num_errors"] == 0
    assert summary["num_output_tokens"] == sum(r["num_output_tokens"] for r in records.values())
    assert summary["mean_accepted_length"] == 1.0
    assert "output tokens/s" in result.output and "mean accepted length" in result.output


def test_stats_reads_back_the_summary(jsonl_run, tmp_path):
    out, summary_path, _ = jsonl_run
    stats_json = tmp_path / "stats.json"
    result = invoke("stats", out, "--summary-json", stats_json)
    assert result.exit_code == 0, result.output
    assert "requests" in result.output and str(N) in result.output
    ran, read = json.loads(summary_path.read_text()), json.loads(stats_json.read_text())
    keys = ("num_requests", "num_errors", "num_prompt_tokens", "num_output_tokens", "mean_accepted_length")
    for key in keys:
        assert read[key] == ran[key], key
    assert read["wall_time_s"] is None


def test_parquet_in_and_out_equal_jsonl(jsonl_run, tmp_path):
    out_jsonl, _, _ = jsonl_run
    records = prompts(N)
    for r in records:  # Parquet wants one schema: give every row every column, null where unused
        for key in ("prompt", "messages", "input_ids"):
            r.setdefault(key, None)
    inp = write_parquet(tmp_path / "in.parquet", records)
    out = tmp_path / "out.parquet"
    result = invoke("run", inp, "-o", out, "--max-tokens", "8", "--batch-size", "3", "-q")
    assert result.exit_code == 0, result.output
    assert result.output == ""
    got, want = by_id(read_output(out)), by_id(read_output(out_jsonl))
    assert got == want


def test_openai_batch_lines(tmp_path):
    lines = [
        {"custom_id": "chat-1", "method": "POST", "url": "/v1/chat/completions",
         "body": {"model": "anything", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 5}},
        {"custom_id": "comp-1", "method": "POST", "url": "/v1/completions",
         "body": {"model": "anything", "prompt": "once upon", "max_completion_tokens": 3, "temperature": 0.7,
                  "seed": 3}},
    ]
    inp = write_jsonl(tmp_path / "batch.jsonl", lines)
    out = tmp_path / "out.jsonl"
    result = invoke("run", inp, "-o", out, "--ignore-eos", "-q")
    assert result.exit_code == 0, result.output
    # OpenAI Batch output lines back (tests/cli/test_openai_output.py)
    usage = {r["custom_id"]: r["response"]["body"]["usage"] for r in read_output(out)}
    assert usage["chat-1"]["completion_tokens"] == 5 and usage["comp-1"]["completion_tokens"] == 3
    loaded = specgen.api.load_model(TINY_LLAMA)
    chat_ids = specgen.api.encode_prompt(loaded, lines[0]["body"]["messages"])
    assert usage["chat-1"]["prompt_tokens"] == len(chat_ids)


def test_per_record_overrides_and_stop(tmp_path):
    inp = write_jsonl(tmp_path / "in.jsonl", [
        {"id": "short", "prompt": "abc", "max_tokens": 2},
        {"id": "long", "prompt": "abc"},
    ])
    out = tmp_path / "out.jsonl"
    result = invoke("run", inp, "-o", out, "--max-tokens", "6", "--ignore-eos", "-q")
    assert result.exit_code == 0, result.output
    records = by_id(read_output(out))
    assert records["short"]["num_output_tokens"] == 2 and records["long"]["num_output_tokens"] == 6


def test_resume_of_a_finished_output_adds_nothing(jsonl_in, tmp_path):
    out = tmp_path / "out.jsonl"
    assert invoke("run", jsonl_in, "-o", out, "--max-tokens", "4", "-q").exit_code == 0
    before = out.read_text()
    result = invoke("run", jsonl_in, "-o", out, "--max-tokens", "4", "--resume")
    assert result.exit_code == 0, result.output
    assert out.read_text() == before
    assert f"resumed: {N} records" in result.output


def test_resume_completes_a_partial_output(jsonl_in, tmp_path):
    full, partial = tmp_path / "full.jsonl", tmp_path / "partial.jsonl"
    assert invoke("run", jsonl_in, "-o", full, "--max-tokens", "6", "-q").exit_code == 0
    lines = full.read_text().splitlines(keepends=True)
    partial.write_text("".join(lines[:5]) + lines[5][:17])  # five records and a torn sixth
    result = invoke("run", jsonl_in, "-o", partial, "--max-tokens", "6", "--resume", "-q")
    assert result.exit_code == 0, result.output
    assert by_id(read_output(partial)) == by_id(read_output(full))


def test_interrupt_keeps_finished_records(jsonl_in, tmp_path, monkeypatch):
    """Ctrl-C (KeyboardInterrupt) mid-run: exit 130, finished records kept, Parquet finalized, resumable."""
    from specgen.engine.engine import Engine

    real = Engine.run

    def interrupted(self, requests):
        for i, out in enumerate(real(self, requests)):
            if i == 3:
                raise KeyboardInterrupt
            yield out

    out = tmp_path / "out.parquet"
    monkeypatch.setattr(Engine, "run", interrupted)
    result = invoke("run", jsonl_in, "-o", out, "--max-tokens", "4", "-q")
    assert result.exit_code == 130
    assert "rerun with --resume" in result.output
    assert len(read_output(out)) == 3
    monkeypatch.setattr(Engine, "run", real)
    assert invoke("run", jsonl_in, "-o", out, "--max-tokens", "4", "--resume", "-q").exit_code == 0
    assert len(by_id(read_output(out))) == N


@needs_ngram
def test_ngram_is_lossless_and_reports_acceptance(jsonl_run, tmp_path):
    out_none, _, _ = jsonl_run
    out = tmp_path / "ngram.jsonl"
    result = invoke("run", out_none.parent / "in.jsonl", "-o", out, "--max-tokens", "8", "--batch-size", "4",
                    "--method", "ngram", "--num-speculative-tokens", "2", "-q")
    assert result.exit_code == 0, result.output
    got, want = by_id(read_output(out)), by_id(read_output(out_none))
    for rid, rec in got.items():
        assert rec["token_ids"] == want[rid]["token_ids"]
        assert rec["method"] == "ngram" and len(rec["accepted_per_position"]) == 2
        assert rec["num_emitted_tokens"] == rec["num_accepted_tokens"] + rec["num_steps"]


@needs_ngram
def test_bench_side_by_side(jsonl_in, tmp_path):
    summary = tmp_path / "bench.json"
    result = invoke("bench", jsonl_in, "--methods", "none,ngram", "--max-tokens", "6", "--batch-size", "4",
                    "--summary-json", summary)
    assert result.exit_code == 0, result.output
    rows = json.loads(summary.read_text())["rows"]
    assert [r["method"] for r in rows] == ["none", "ngram"]
    assert all(r["identical"] for r in rows)
    assert rows[0]["summary"]["num_requests"] == rows[1]["summary"]["num_requests"] == N
    for column in ("tok/s", "speedup", "accept", "identical"):
        assert column in result.output


def test_bench_single_method(jsonl_in):
    result = invoke("bench", jsonl_in, "--methods", "none", "--max-tokens", "3")
    assert result.exit_code == 0, result.output
    assert "1.00x" in result.output and "yes" in result.output


def test_prefill_chunk_flag_counts_chunks_and_keeps_outputs(jsonl_in, jsonl_run):
    """--prefill-chunk cuts every prompt into ceil(len / chunk) prefill forwards; outputs stay the same."""
    out = jsonl_in.parent / "chunked.jsonl"
    summary = jsonl_in.parent / "chunked_summary.json"
    result = invoke("run", jsonl_in, "-o", out, "--max-tokens", "8", "--batch-size", "4",
                    "--prefill-chunk", "4", "--summary-json", summary)
    assert result.exit_code == 0, result.output
    chunked, plain = by_id(read_output(out)), by_id(read_output(jsonl_run[0]))
    for rid, rec in chunked.items():
        assert rec["num_prefill_chunks"] == -(-rec["num_prompt_tokens"] // 4)
        assert plain[rid]["num_prefill_chunks"] == 1
        assert rec["token_ids"] == plain[rid]["token_ids"]
    assert json.loads(summary.read_text())["num_prefill_chunks"] == sum(r["num_prefill_chunks"]
                                                                        for r in chunked.values())


def test_shared_prefix_is_reused_and_reported(tmp_path):
    """Token prompts sharing 80 leading tokens: with --shared-prefix auto (the default) every record reads
    them from the shared prefix, outputs equal --shared-prefix off, and the summary reports less KV cache."""
    prefix = [3 + (7 * j) % 200 for j in range(80)]
    recs = [{"id": f"s{i}", "input_ids": prefix + [5 + i, 9 + i][: 1 + i % 2]} for i in range(6)]
    src = write_jsonl(tmp_path / "in.jsonl", recs)
    outs = {}
    for mode in ("auto", "off"):
        out, summary = tmp_path / f"{mode}.jsonl", tmp_path / f"{mode}.json"
        result = invoke("run", src, "-o", out, "--max-tokens", "5", "--batch-size", "6",
                        "--shared-prefix", mode, "--summary-json", summary)
        assert result.exit_code == 0, result.output
        outs[mode] = (by_id(read_output(out)), json.loads(summary.read_text()))
    (shared, s_sum), (plain, p_sum) = outs["auto"], outs["off"]
    assert {k: v["token_ids"] for k, v in shared.items()} == {k: v["token_ids"] for k, v in plain.items()}
    assert all(r["num_cached_prompt_tokens"] == 80 for r in shared.values())
    assert s_sum["num_cached_prompt_tokens"] == 480 and p_sum["num_cached_prompt_tokens"] == 0
    assert s_sum["kv_cache_bytes"] < s_sum["kv_cache_bytes_unshared"] == p_sum["kv_cache_bytes"]


@pytest.mark.skipif(specgen.kernels.ops() is None, reason="a float16 KV cache needs the fused CPU kernels")
def test_kv_cache_dtype_float16_halves_the_reported_cache(jsonl_in, jsonl_run, tmp_path):
    """--kv-cache-dtype float16: every record written, the summary's KV cache bytes halved; a bad value
    exits 2."""
    out, summary = tmp_path / "half.jsonl", tmp_path / "half.json"
    result = invoke("run", jsonl_in, "-o", out, "--max-tokens", "8", "--batch-size", "4", "--kv-cache-dtype",
                    "float16", "--summary-json", summary)
    assert result.exit_code == 0, result.output
    assert set(by_id(read_output(out))) == set(by_id(read_output(jsonl_run[0])))
    half, full = (json.loads(p.read_text())["kv_cache_bytes"] for p in (summary, jsonl_run[1]))
    assert half * 2 == full
    bad = invoke("run", jsonl_in, "-o", tmp_path / "bad.jsonl", "--kv-cache-dtype", "int8")
    assert bad.exit_code == 2 and "kv_cache_dtype must be one of auto, float16, got 'int8'" in bad.output


def test_matmul_int8_needs_block_weights(jsonl_in, tmp_path):
    """--matmul int8 on a checkpoint without GGUF block weights (the tiny float32 one) stops with exit 2 and
    says what it needs; an engine asked for int8 over a float32-loaded model is refused too."""
    result = invoke("run", jsonl_in, "-o", tmp_path / "int8.jsonl", "--matmul", "int8")
    assert result.exit_code == 2, result.output
    assert ("matmul int8 needs block weights (GGUF Q4_0 / Q4_1 / Q8_0 / Q4_K / Q6_K, or --quantization "
            "wint8 | wint4)" in result.output)
    assert not (tmp_path / "int8.jsonl").exists() or not (tmp_path / "int8.jsonl").read_text()
    from specgen import EngineConfig, generate, load_model
    from specgen.errors import ConfigError

    with pytest.raises(ConfigError, match="loaded with matmul 'float32', the engine asks for 'int8'"):
        generate([[3, 4, 5]], model=load_model(TINY_LLAMA), engine=EngineConfig(matmul="int8"))
