"""OpenAI Batch output (--output-format auto | openai): every line's body parses with the `openai` package's
own types (ChatCompletion, Completion, ErrorObject), carries the native record's tokens and log-probabilities,
and --resume and `specgen stats` read such an output back."""
from __future__ import annotations

import json

import pytest
from cli_support import invoke, read_output, write_jsonl

openai_types = pytest.importorskip("openai.types")
from openai.types import Completion, ErrorObject  # noqa: E402
from openai.types.chat import ChatCompletion  # noqa: E402

CHAT = "/v1/chat/completions"


def batch_line(cid: str, url: str, **body) -> dict:
    return {"custom_id": cid, "method": "POST", "url": url, "body": {"model": "any", **body}}


LINES = [
    batch_line("chat-lp", CHAT, messages=[{"role": "user", "content": "hi"}], max_tokens=4, logprobs=True,
               top_logprobs=3),
    batch_line("chat", CHAT, messages=[{"role": "user", "content": "tell me"}], max_completion_tokens=3,
               temperature=0.8, seed=5),
    batch_line("text-lp", "/v1/completions", prompt="hello there", max_tokens=5, logprobs=2),
    batch_line("ids", "/v1/completions", prompt=[5, 6, 7], max_tokens=2),
    batch_line("bad-field", "/v1/completions", prompt="x", frequency_penalty=9),
    batch_line("bad-range", CHAT, messages=[{"role": "user", "content": "x"}], logprobs=True,
               top_logprobs=21),
    {"id": "native", "prompt": "a native record", "max_tokens": 3},
    batch_line("text-plp", "/v1/completions", prompt="hello there you", max_tokens=2, prompt_logprobs=2),
]


def _run(tmp_path, *extra, name="out.jsonl", lines=LINES):
    inp = write_jsonl(tmp_path / "in.jsonl", lines)
    out = tmp_path / name
    result = invoke("run", inp, "-o", out, "--max-tokens", "4", *extra)
    return result, out


def _native(tmp_path):
    result, out = _run(tmp_path, "--output-format", "native", name="native.jsonl")
    assert result.exit_code == 8, result.output  # two error records
    return {r["id"]: r for r in read_output(out)}


def test_openai_lines_get_openai_batch_output(tmp_path):
    native = _native(tmp_path)
    result, out = _run(tmp_path)
    assert result.exit_code == 8, result.output
    lines = {r.get("custom_id", r["id"]): r for r in read_output(out)}
    assert sorted(lines) == sorted(native)
    assert "response" not in lines["native"] and lines["native"] == {**native["native"]}  # auto: as its input
    for cid in ("chat-lp", "chat"):
        line = lines[cid]
        assert line["error"] is None and line["response"]["status_code"] == 200
        body = ChatCompletion.model_validate(line["response"]["body"])
        choice = body.choices[0]
        assert choice.message.content == native[cid]["text"]
        assert choice.finish_reason == native[cid]["finish_reason"]
        assert body.usage.completion_tokens == len(native[cid]["token_ids"])
        assert body.usage.prompt_tokens == native[cid]["num_prompt_tokens"]
        assert line["response"]["body"]["specgen"]["token_ids"] == native[cid]["token_ids"]
    lp = ChatCompletion.model_validate(lines["chat-lp"]["response"]["body"]).choices[0].logprobs.content
    assert [e.logprob for e in lp] == [e["logprob"] for e in native["chat-lp"]["logprobs"]]
    assert all(len(e.top_logprobs) == 3 for e in lp)
    assert [[t.logprob for t in e.top_logprobs] for e in lp] == [
        [t["logprob"] for t in e["top_logprobs"]] for e in native["chat-lp"]["logprobs"]]
    assert ChatCompletion.model_validate(lines["chat"]["response"]["body"]).choices[0].logprobs is None
    for cid in ("text-lp", "ids"):
        body = Completion.model_validate(lines[cid]["response"]["body"])
        assert body.choices[0].text == native[cid]["text"]
    text_lp = Completion.model_validate(lines["text-lp"]["response"]["body"]).choices[0].logprobs
    assert text_lp.token_logprobs == [e["logprob"] for e in native["text-lp"]["logprobs"]]
    assert all(len(top) <= 2 for top in text_lp.top_logprobs)
    assert text_lp.text_offset[0] == 0
    assert text_lp.tokens == [e["token"] for e in native["text-lp"]["logprobs"]]
    # prompt_logprobs: the body's own field in vLLM's shape (the prompt's token and the top 2 by id)
    plp = lines["text-plp"]["response"]["body"]["prompt_logprobs"]
    entries = native["text-plp"]["prompt_logprobs"]
    assert Completion.model_validate(lines["text-plp"]["response"]["body"]).choices[0].text is not None
    assert plp[0] is None and entries[0] is None and len(plp) == native["text-plp"]["num_prompt_tokens"] > 2
    for got, e in zip(plp[1:], entries[1:]):
        assert got[str(e["token_id"])]["logprob"] == e["logprob"]
        assert got[str(e["token_id"])]["rank"] == e["rank"] >= 1
        assert [got[str(t["token_id"])]["rank"] for t in e["top_logprobs"]] == [1, 2]
        assert set(got) == {str(e["token_id"])} | {str(t["token_id"]) for t in e["top_logprobs"]}
    assert "prompt_logprobs" not in lines["text-plp"]["response"]["body"]["specgen"]
    for cid, fragment in (("bad-field", "frequency_penalty"), ("bad-range", "top_logprobs")):
        response = lines[cid]["response"]
        assert response["status_code"] == 400
        error = ErrorObject.model_validate(response["body"]["error"])
        assert fragment in error.message and error.message.startswith("line ")


def test_openai_for_every_record_resume_and_stats(tmp_path):
    """--output-format openai: native records too (messages -> chat.completion, text and ids ->
    text_completion); a resumed run adds only what is missing; `specgen stats` counts the records."""
    result, out = _run(tmp_path, "--output-format", "openai", lines=LINES[:3] + LINES[6:])
    assert result.exit_code == 0, result.output
    lines = read_output(out)
    assert all("custom_id" in r and r["response"]["status_code"] == 200 for r in lines)
    native = next(r for r in lines if r["custom_id"] == "native")
    assert Completion.model_validate(native["response"]["body"]).choices[0].text is not None
    # a kill after two lines: --resume writes the others once
    out.write_text("".join(json.dumps(r) + "\n" for r in lines[:2]))
    result, _ = _run(tmp_path, "--output-format", "openai", "--resume", lines=LINES[:3] + LINES[6:])
    assert result.exit_code == 0, result.output
    again = read_output(out)
    assert sorted(r["custom_id"] for r in again) == sorted(r["custom_id"] for r in lines)
    stats = invoke("stats", out, "--summary-json", tmp_path / "s.json")
    assert stats.exit_code == 0, stats.output
    summary = json.loads((tmp_path / "s.json").read_text())
    assert summary["num_requests"] == len(lines)
    assert summary["num_output_tokens"] == sum(r["response"]["body"]["usage"]["completion_tokens"]
                                               for r in lines)


def test_openai_format_refuses_parquet_and_a_changed_format_on_resume(tmp_path):
    result, _ = _run(tmp_path, "--output-format", "openai", name="out.parquet")
    assert result.exit_code == 2 and "use a .jsonl output" in result.output
    result, out = _run(tmp_path, "--output-format", "native", lines=LINES[:1])
    assert result.exit_code == 0, result.output
    result, _ = _run(tmp_path, "--output-format", "openai", "--resume", lines=LINES[:1])
    assert result.exit_code == 2 and "output_format" in result.output


def test_prompt_logprobs_flag_and_a_record_of_its_own(tmp_path):
    """--prompt-logprobs K gives every record its prompt's entries (ranked, K top tokens each) but one whose
    own field says otherwise; null is not given (the run's K); Parquet holds the same."""
    lines = [{"id": "a", "prompt": "one two three four", "max_tokens": 2, "prompt_logprobs": None},
             {"id": "b", "prompt": "five six seven", "max_tokens": 2, "prompt_logprobs": 3}]
    for name in ("out.jsonl", "out.parquet"):
        result, out = _run(tmp_path, "--prompt-logprobs", "1", name=name, lines=lines)
        assert result.exit_code == 0, result.output
        recs = {r["id"]: r for r in read_output(out)}
        a = recs["a"]["prompt_logprobs"]
        assert len(a) == recs["a"]["num_prompt_tokens"] > 2 and a[0] is None
        assert all(len(e["top_logprobs"]) == 1 and e["rank"] >= 1 and e["logprob"] <= 0 for e in a[1:])
        assert all((e["rank"] == 1) == (e["top_logprobs"][0]["token_id"] == e["token_id"]) for e in a[1:])
        b = recs["b"]["prompt_logprobs"]
        assert [len(e["top_logprobs"]) for e in b[1:]] == [3] * (recs["b"]["num_prompt_tokens"] - 1)
