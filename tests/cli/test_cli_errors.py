"""Bad input never kills a job silently: exact exit codes and one clear message naming the line."""
from __future__ import annotations

import pytest
from cli_support import assert_one_error_line, by_id, invoke, read_output, write_jsonl, write_parquet

from specgen.errors import EXIT_RECORD_ERRORS

GOOD = {"id": "ok", "prompt": "fine"}

# (case, the bad line written as line 2, message fragment); the tiny model: vocab 300, context 256.
BAD_RECORDS = [
    ("malformed json", '{"prompt": "abc"', "line 2: malformed JSON"),
    ("not an object", "[1, 2, 3]", "line 2: expected a JSON object, got a list"),
    ("wrong type", {"prompt": 42}, "line 2: prompt must be a string, got an integer"),
    ("wrong sampling type", {"prompt": "a", "max_tokens": "ten"}, "line 2: max_tokens must be an integer"),
    ("bad sampling value", {"prompt": "a", "temperature": -1}, "line 2: temperature must be >= 0, got -1.0"),
    ("missing prompt", {"id": "x"}, "line 2: need exactly one of prompt, messages, input_ids (got none)"),
    ("two prompts", {"prompt": "a", "input_ids": [1]},
     "line 2: need exactly one of prompt, messages, input_ids"),
    ("empty prompt", {"prompt": ""}, "line 2: empty prompt"),
    ("empty token list", {"input_ids": []}, "line 2: empty prompt"),
    ("too long", {"input_ids": [5] * 300}, "line 2: prompt has 300 tokens; the model's context is 256"),
    ("out of vocabulary", {"input_ids": [1, 300]}, "line 2: token id 300 outside the vocabulary [0, 300)"),
    ("unknown field", {"prompt": "a", "temprature": 0.5}, "line 2: unknown field(s) temprature"),
    ("duplicate id", {"id": "ok", "prompt": "again"}, "line 2: duplicate id 'ok'"),
    ("bad chat message", {"messages": [{"role": "user"}]}, "line 2: messages[0] must be an object"),
    ("openai bad url", {"custom_id": "c", "method": "POST", "url": "/v1/embeddings", "body": {}},
     "line 2: url '/v1/embeddings' is not supported"),
    ("penalty out of range", {"prompt": "a", "presence_penalty": 3},
     "line 2: presence_penalty must be in [-2, 2]"),
    ("logit bias outside the vocabulary", {"prompt": "a", "logit_bias": {"300": 1}},
     "line 2: logit_bias: token id 300 outside the vocabulary [0, 300)"),
    ("logit bias not a map", {"prompt": "a", "logit_bias": [1, 2]}, "line 2: logit_bias must be an object"),
    ("top_logprobs too many", {"prompt": "a", "logprobs": 21}, "line 2: top_logprobs must be in [0, 20]"),
    ("stop token outside the vocabulary", {"prompt": "a", "stop_token_ids": [7, 300]},
     "line 2: stop_token_ids: token id 300 outside the vocabulary [0, 300)"),
]


@pytest.mark.parametrize("case,line,fragment", BAD_RECORDS, ids=[c[0] for c in BAD_RECORDS])
def test_bad_record_fails_with_exit_2(tmp_path, case, line, fragment):
    inp = write_jsonl(tmp_path / "in.jsonl", [GOOD, line, {"prompt": "after"}])
    result = invoke("run", inp, "-o", tmp_path / "out.jsonl", "--max-tokens", "2", "--on-error", "fail", "-q")
    assert result.exit_code == 2, result.output
    assert_one_error_line(result, fragment)


@pytest.mark.parametrize("case,line,fragment", BAD_RECORDS, ids=[c[0] for c in BAD_RECORDS])
def test_bad_record_skipped_as_an_error_record(tmp_path, case, line, fragment):
    inp = write_jsonl(tmp_path / "in.jsonl", [GOOD, line, {"id": "after", "prompt": "after"}])
    out = tmp_path / "out.jsonl"
    # native records for every line (OpenAI lines' errors in OpenAI's shape: tests/cli/test_openai_output.py)
    result = invoke("run", inp, "-o", out, "--max-tokens", "2", "-q", "--output-format", "native")
    assert result.exit_code == EXIT_RECORD_ERRORS, result.output  # finished, with error records
    assert fragment in result.stderr  # errors are shown even with --quiet
    records = read_output(out)
    errors = [r for r in records if r["error"] is not None]
    assert len(errors) == 1 and fragment in errors[0]["error"]
    assert errors[0]["token_ids"] == [] and errors[0]["finish_reason"] is None
    fine = {r["id"] for r in records if r["error"] is None}
    assert fine == {"ok", "after"}


def test_error_record_ids(tmp_path):
    inp = write_jsonl(tmp_path / "in.jsonl", ["{broken", {"id": "mine", "prompt": ""}])
    out = tmp_path / "out.jsonl"
    assert invoke("run", inp, "-o", out, "-q").exit_code == EXIT_RECORD_ERRORS
    records = by_id(read_output(out))
    assert records["1"]["error"].startswith("line 1: malformed JSON")  # unreadable: the line number
    assert records["mine"]["error"] == "line 2: empty prompt"  # readable: its own id


def test_parquet_errors_name_the_row(tmp_path):
    inp = write_parquet(tmp_path / "in.parquet", [{"prompt": "a"}, {"prompt": ""}])
    result = invoke("run", inp, "-o", tmp_path / "out.jsonl", "--on-error", "fail")
    assert result.exit_code == 2
    assert "error: row 2: empty prompt" in result.stderr


def _yaml(tmp_path, text):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    return path


# (case, extra arguments given a valid input and output, exit code, message fragment)
RUN_ERRORS = [
    ("missing input", lambda t: ["run", t / "nope.jsonl", "-o", t / "o.jsonl"], 2, "input file not found"),
    ("unreadable parquet", lambda t: ["run", _bytes(t / "bad.parquet"), "-o", t / "o.jsonl"], 2,
     "not a readable Parquet file"),
    ("unknown input extension", lambda t: ["run", _bytes(t / "in.txt"), "-o", t / "o.jsonl"], 2,
     "cannot tell the input format"),
    ("bad yaml key",
     lambda t: ["run", "IN", "-o", t / "o.jsonl", "--config", _yaml(t, "engine:\n  batchsize: 4\n")],
     2, "engine: unknown key(s) batchsize (valid: backend, batch_size"),
    ("missing yaml", lambda t: ["run", "IN", "-o", t / "o.jsonl", "--config", t / "none.yaml"], 2,
     "config file not found"),
    ("k with method none", lambda t: ["run", "IN", "-o", t / "o.jsonl", "--num-speculative-tokens", "2"], 2,
     "num_speculative_tokens has no effect with method 'none'"),
    ("mtp model without mtp", lambda t: ["run", "IN", "-o", t / "o.jsonl", "--method", "ngram",
                                         "--mtp-model", "/x"], 2, "mtp.model needs method 'mtp'"),
    ("unknown method", lambda t: ["run", "IN", "-o", t / "o.jsonl", "--method", "lookahead"], 2,
     "unknown method 'lookahead' (valid: none, ngram, mtp, draft_model, medusa, "),
    ("batch size", lambda t: ["run", "IN", "-o", t / "o.jsonl", "--batch-size", "0"], 2,
     "batch_size must be in 1..256, got 0"),
    ("k too large", lambda t: ["run", "IN", "-o", t / "o.jsonl", "--method", "ngram",
                               "--num-speculative-tokens", "9"], 2, "num_speculative_tokens must be in 1..5"),
    ("dtype", lambda t: ["run", "IN", "-o", t / "o.jsonl", "--dtype", "bf16"], 2,
     "dtype must be one of float32, float64, got 'bf16'"),
    ("on-error", lambda t: ["run", "IN", "-o", t / "o.jsonl", "--on-error", "ignore"], 2,
     "--on-error must be one of skip, fail"),
    ("bad speculative json",
     lambda t: ["run", "IN", "-o", t / "o.jsonl", "--speculative-config", '{"k": 1}'], 2, "unknown key(s) k"),
    ("output exists", lambda t: ["run", "IN", "-o", _bytes(t / "done.jsonl")], 2,
     "already exists; pass --resume to continue it, or remove it"),
    ("output extension", lambda t: ["run", "IN", "-o", t / "o.csv"], 2, "must end in .jsonl or .parquet"),
    ("missing model", lambda t: ["run", "IN", "-o", t / "o.jsonl", "--model", t / "no-model"], 3,
     "no such checkpoint"),
    ("stats of nothing", lambda t: ["stats", t / "none.jsonl"], 2, "output file not found"),
    ("bench methods", lambda t: ["bench", "IN", "--methods", "none,none"], 2, "lists a method twice"),
]


def _bytes(path):
    path.write_bytes(b"PAR1 garbage")
    return path


@pytest.mark.parametrize("case,argv,code,fragment", RUN_ERRORS, ids=[c[0] for c in RUN_ERRORS])
def test_run_level_errors(tmp_path, case, argv, code, fragment):
    inp = write_jsonl(tmp_path / "in.jsonl", [GOOD])
    args = [inp if a == "IN" else a for a in argv(tmp_path)]
    explicit_model = "--model" in args
    result = invoke(*args, model=not explicit_model)
    assert result.exit_code == code, result.output
    assert_one_error_line(result, fragment)


def test_resume_without_an_output_starts_one(tmp_path):
    inp = write_jsonl(tmp_path / "in.jsonl", [GOOD])
    out = tmp_path / "fresh.jsonl"
    result = invoke("run", inp, "-o", out, "--resume", "--max-tokens", "2", "-q")
    assert result.exit_code == 0, result.output
    assert [r["id"] for r in read_output(out)] == ["ok"]


def test_engine_rejections_name_the_line(tmp_path, monkeypatch):
    """A rejection the reader did not foresee still names the line (the reader's checks bypassed here)."""
    from specgen.io import requests

    monkeypatch.setattr(requests.RequestSource, "_check_ids", lambda self, ids, record_id: None)
    inp = write_jsonl(tmp_path / "in.jsonl", [GOOD, {"input_ids": [1, 300]}])
    out = tmp_path / "out.jsonl"
    assert invoke("run", inp, "-o", out, "--max-tokens", "2", "-q").exit_code == EXIT_RECORD_ERRORS
    errors = [r["error"] for r in read_output(out) if r["error"]]
    assert errors == ["line 2: token id 300 outside the vocabulary [0, 300)"]
    result = invoke("run", inp, "-o", tmp_path / "o2.jsonl", "--on-error", "fail")
    assert result.exit_code == 2 and "error: line 2: token id 300" in result.stderr
