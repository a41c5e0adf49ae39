"""`n` through `specgen run`: one native record per sample (sample_index), --resume counts samples, OpenAI
Batch lines get one line with n choices, and n above the batch is an error record naming the line."""
from __future__ import annotations

import json

import pytest
from cli_support import invoke, read_output, write_jsonl

RECORDS = [{"id": "a", "prompt": "tell me", "n": 3}, {"id": "b", "prompt": "once"},
           {"id": "c", "prompt": "too many", "n": 5}]


def _keys(records):
    return sorted((r["id"], r["sample_index"]) for r in records)


@pytest.mark.parametrize("suffix", ["jsonl", "parquet"])
def test_samples_native_and_resume(tmp_path, suffix):
    inp = write_jsonl(tmp_path / "in.jsonl", RECORDS)
    out = tmp_path / f"out.{suffix}"
    args = ("run", inp, "-o", out, "--max-tokens", "4", "--temperature", "0.9", "--batch-size", "4", "-q")
    result = invoke(*args)
    assert result.exit_code == 8, result.output  # c's error record
    records = read_output(out)
    assert _keys(records) == [("a", 0), ("a", 1), ("a", 2), ("b", 0), ("c", None)]
    error = next(r for r in records if r["id"] == "c")["error"]
    assert error == "line 3: n = 5 samples is more than the batch's 4 slots"
    a = {r["sample_index"]: r["token_ids"] for r in records if r["id"] == "a"}
    assert len({tuple(t) for t in a.values()}) > 1  # each sample its own stream
    if suffix == "jsonl":  # a kill after two samples of a: --resume writes the other one and b, once each
        kept = [r for r in records if (r["id"], r["sample_index"]) in {("a", 0), ("a", 2)}]
        out.write_text("".join(json.dumps(r) + "\n" for r in kept))
        result = invoke(*args, "--resume")
        assert result.exit_code == 8, result.output
        again = read_output(out)
        assert _keys(again) == _keys(records)
        assert {r["sample_index"]: r["token_ids"] for r in again if r["id"] == "a"} == a


def test_openai_line_gets_n_choices(tmp_path):
    from openai.types.chat import ChatCompletion

    line = {"custom_id": "q", "method": "POST", "url": "/v1/chat/completions",
            "body": {"messages": [{"role": "user", "content": "hi"}], "n": 3, "max_tokens": 4,
                     "temperature": 1.0, "logprobs": True}}
    inp = write_jsonl(tmp_path / "in.jsonl", [line, {"id": "plain", "prompt": "x", "n": 2}])
    native = tmp_path / "native.jsonl"
    assert invoke("run", inp, "-o", native, "--output-format", "native", "-q").exit_code == 0
    samples = sorted((r for r in read_output(native) if r["id"] == "q"), key=lambda r: r["sample_index"])
    out = tmp_path / "out.jsonl"
    result = invoke("run", inp, "-o", out, "-q")
    assert result.exit_code == 0, result.output
    lines = read_output(out)
    assert len(lines) == 3  # q's one line, and plain's two native records
    q = next(r for r in lines if r.get("custom_id") == "q")
    body = ChatCompletion.model_validate(q["response"]["body"])
    assert [c.index for c in body.choices] == [0, 1, 2]
    assert [c.message.content for c in body.choices] == [r["text"] for r in samples]
    assert [[e.logprob for e in c.logprobs.content] for c in body.choices] == [
        [e["logprob"] for e in r["logprobs"]] for r in samples]
    assert body.usage.completion_tokens == sum(r["num_output_tokens"] for r in samples)
    stats = invoke("stats", out, "--summary-json", tmp_path / "s.json")
    assert stats.exit_code == 0 and json.loads((tmp_path / "s.json").read_text())["num_requests"] == 5


def test_a_resume_in_openai_format_writes_the_samples_it_ran(tmp_path):
    """Samples 0 and 2 of a record written natively; a resume with --output-format openai (allowed to mix)
    runs sample 1 alone, and its OpenAI line is written at the end rather than held for ever."""
    inp = write_jsonl(tmp_path / "in.jsonl", RECORDS[:1])
    out = tmp_path / "out.jsonl"
    args = ("run", inp, "-o", out, "--max-tokens", "4", "--temperature", "0.9", "--batch-size", "4", "-q")
    assert invoke(*args, "--output-format", "native").exit_code == 0
    native = read_output(out)
    out.write_text("".join(json.dumps(r) + "\n" for r in native if r["sample_index"] != 1))
    result = invoke(*args, "--output-format", "openai", "--resume", "--allow-mismatch")
    assert result.exit_code == 0, result.output
    lines = read_output(out)
    assert len(lines) == 3 and lines[-1]["custom_id"] == "a"
    own = lines[-1]["response"]["body"]["specgen"]
    sample_1 = next(r for r in native if r["sample_index"] == 1)
    assert own["sample_index"] == 1 and own["token_ids"] == sample_1["token_ids"]
