"""Structured output through `specgen run`: response_format and vLLM's guided_* fields in native records and
OpenAI Batch bodies, --response-format FILE for the whole job, error records naming the line, outputs the
grammar accepts (JSON that validates against its schema), and --resume with the constraint in the manifest."""
from __future__ import annotations

import json

import pytest
from cli_support import by_id, invoke, read_output, write_jsonl

jsonschema = pytest.importorskip("jsonschema")

SCHEMA = {"type": "object", "properties": {"label": {"enum": ["spam", "ham"]},
                                           "score": {"type": "integer", "minimum": 0, "maximum": 9}},
          "required": ["label", "score"], "additionalProperties": False}
RECORDS = [
    {"id": "schema", "prompt": "classify: buy now", "response_format": {
        "type": "json_schema", "json_schema": {"name": "c", "strict": True, "schema": SCHEMA}}},
    {"id": "guided-json", "prompt": "classify: hello", "guided_json": json.dumps(SCHEMA)},
    {"id": "choice", "messages": [{"role": "user", "content": "yes or no?"}], "guided_choice": ["yes", "no"]},
    {"id": "regex", "prompt": "code:", "guided_regex": "[A-Z]{3}-[0-9]{2}"},
    {"id": "lark", "prompt": "list:", "guided_grammar": 'start: "[" /[a-c]/ ("," /[a-c]/)* "]"'},
    {"id": "bad-regex", "prompt": "x", "guided_regex": "a(b"},
    {"id": "bad-schema", "prompt": "x", "response_format": {"type": "json_schema",
                                                            "json_schema": {"schema": {"type": "nope"}}}},
    {"id": "two", "prompt": "x", "guided_regex": "a", "guided_choice": ["a"]},
    {"id": "ignore-eos", "prompt": "x", "guided_regex": "a", "ignore_eos": True},
    {"id": "empty-choice", "prompt": "x", "guided_choice": []},
    {"custom_id": "openai", "method": "POST", "url": "/v1/chat/completions", "body": {
        "model": "m", "messages": [{"role": "user", "content": "rate it"}],
        "response_format": {"type": "json_schema", "json_schema": {"name": "r", "schema": SCHEMA}}}},
]


def test_constraints_in_records(tmp_path):
    inp = write_jsonl(tmp_path / "in.jsonl", RECORDS)
    out = tmp_path / "out.jsonl"
    result = invoke("run", inp, "-o", out, "--max-tokens", "48", "--method", "ngram",
                    "--output-format", "native")
    assert result.exit_code == 8, result.output  # error records
    recs = by_id(read_output(out))
    for rid in ("schema", "guided-json", "openai"):
        r = recs[rid]
        assert r["finish_reason"] == "stop", r
        jsonschema.validate(json.loads(r["text"]), SCHEMA)
    assert recs["schema"]["num_forced_tokens"] > 0
    assert recs["choice"]["text"] in ("yes", "no")
    assert recs["regex"]["finish_reason"] == "stop" and len(recs["regex"]["text"]) == 6
    assert recs["regex"]["text"][:3].isupper() and recs["regex"]["text"][4:].isdigit()
    assert recs["lark"]["text"].startswith("[") and recs["lark"]["text"].endswith("]")
    assert "line 6: response_format: " in recs["bad-regex"]["error"]
    assert "unclosed group" in recs["bad-regex"]["error"]
    assert recs["bad-schema"]["error"].startswith("line 7: response_format: ")
    assert "give one structured-output field" in recs["two"]["error"]
    assert "ignore_eos" in recs["ignore-eos"]["error"]
    assert "guided_choice must be a non-empty list" in recs["empty-choice"]["error"]


def test_response_format_flag_for_the_job(tmp_path):
    """--response-format FILE constrains every record without its own; the manifest keeps it, so a resume
    with another constraint is refused."""
    fmt = tmp_path / "fmt.json"
    fmt.write_text(json.dumps({"type": "json_schema", "json_schema": {"name": "c", "schema": SCHEMA}}))
    recs = [{"id": str(i), "prompt": f"message {i}: classify"} for i in range(5)]
    recs.append({"id": "own", "prompt": "x", "guided_choice": ["up", "down"]})
    inp = write_jsonl(tmp_path / "in.jsonl", recs)
    out = tmp_path / "out.parquet"
    result = invoke("run", inp, "-o", out, "--max-tokens", "40", "--response-format", fmt,
                    "--batch-size", "3")
    assert result.exit_code == 0, result.output
    got = by_id(read_output(out))
    for i in range(5):
        assert got[str(i)]["finish_reason"] == "stop"
        jsonschema.validate(json.loads(got[str(i)]["text"]), SCHEMA)
    assert got["own"]["text"] in ("up", "down")
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"type": "json_object"}))
    again = invoke("run", inp, "-o", out, "--max-tokens", "40", "--response-format", other, "--resume")
    assert again.exit_code != 0 and "response_format" in again.output
