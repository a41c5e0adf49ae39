"""Input record parsing: native and OpenAI Batch shapes, and every kind of bad record."""
from __future__ import annotations

import pytest

from specgen.config import SamplingParams
from specgen.errors import ConfigError
from specgen.io.records import RecordError, parse_record


def test_native_prompt_with_overrides():
    raw = {"id": 7, "prompt": "hi", "max_tokens": 4, "temperature": 1, "stop": "x", "seed": 3}
    rec = parse_record(raw, "1")
    assert rec.id == "7"
    assert rec.prompt == "hi"
    assert dict(rec.overrides) == {"max_tokens": 4, "temperature": 1.0, "stop": ("x",), "seed": 3}


def test_min_p_is_a_sampling_field():
    assert dict(parse_record({"prompt": "hi", "min_p": 0.05}, "1").overrides) == {"min_p": 0.05}
    with pytest.raises(RecordError, match="min_p must be a number"):
        parse_record({"prompt": "hi", "min_p": "low"}, "1")


def test_default_id_and_null_fields_are_absent():
    rec = parse_record({"prompt": None, "messages": [{"role": "user", "content": "a"}], "top_k": None}, "12")
    assert rec.id == "12"
    assert rec.prompt == [{"role": "user", "content": "a"}]
    assert rec.overrides == ()


def test_input_ids():
    assert parse_record({"input_ids": [1, 2]}, "1").prompt == [1, 2]


def test_openai_chat_line():
    line = {"custom_id": "req-1", "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "gpt-x", "messages": [{"role": "user", "content": "hello"}],
                     "max_completion_tokens": 9, "temperature": 0.5, "top_p": 0.9, "seed": 1, "stop": ["\n"]}}
    rec = parse_record(line, "1")
    assert rec.id == "req-1"
    assert rec.prompt == [{"role": "user", "content": "hello"}]
    want = {"max_tokens": 9, "temperature": 0.5, "top_p": 0.9, "seed": 1, "stop": ("\n",)}
    assert dict(rec.overrides) == want


def test_openai_completions_text_and_ids():
    base = {"custom_id": "c", "method": "POST", "url": "/v1/completions"}
    assert parse_record({**base, "body": {"prompt": "abc", "max_tokens": 3}}, "1").prompt == "abc"
    assert parse_record({**base, "body": {"prompt": [5, 6]}}, "1").prompt == [5, 6]


BAD = [
    ("[1, 2]", [1, 2], "expected a JSON object, got a list"),
    ("no prompt", {"id": "a"}, "need exactly one of prompt, messages, input_ids (got none)"),
    ("two prompts", {"prompt": "a", "input_ids": [1]}, "got prompt, input_ids"),
    ("empty text", {"prompt": ""}, "empty prompt"),
    ("empty messages", {"messages": []}, "empty prompt"),
    ("prompt type", {"prompt": 5}, "prompt must be a string, got an integer"),
    ("messages type", {"messages": [{"role": "user"}]}, "messages[0] must be an object"),
    ("ids type", {"input_ids": [1, "2"]}, "input_ids must be a list of integers"),
    ("unknown field", {"prompt": "a", "colour": 1}, "unknown field(s) colour"),
    ("max_tokens type", {"prompt": "a", "max_tokens": "3"}, "max_tokens must be an integer, got a string"),
    ("temperature type", {"prompt": "a", "temperature": True}, "temperature must be a number"),
    ("stop type", {"prompt": "a", "stop": [1]}, "stop must be a string or a list of strings"),
    ("id type", {"id": [1], "prompt": "a"}, "id must be a string or an integer"),
    ("openai url", {"custom_id": "x", "url": "/v1/embeddings", "body": {"input": "a"}},
     "url '/v1/embeddings'"),
    ("openai body field",
     {"custom_id": "x", "body": {"messages": [{"role": "u", "content": "c"}], "tools": []}},
     "unsupported field(s) body.tools"),
    ("openai stream", {"custom_id": "x", "body": {"prompt": "a", "stream": True}}, "only stream=false"),
    ("openai no id", {"body": {"prompt": "a"}}, "without custom_id"),
]


@pytest.mark.parametrize("name,raw,fragment", BAD, ids=[b[0] for b in BAD])
def test_bad_records(name, raw, fragment):
    with pytest.raises(RecordError) as info:
        parse_record(raw, "3")
    assert fragment in str(info.value)


def test_record_error_carries_the_id_when_known():
    with pytest.raises(RecordError) as info:
        parse_record({"id": "mine", "prompt": ""}, "3")
    assert info.value.record_id == "mine"


def test_logprobs_fields():
    """logprobs: true / false, top_logprobs with it, or the completions API's logprobs: K (= true with top K),
    in native records and OpenAI Batch bodies alike; ranges are SamplingParams' to check."""
    over = lambda raw: dict(parse_record(raw, "1").overrides)  # noqa: E731
    both = {"logprobs": True, "top_logprobs": 3}
    assert over({"prompt": "hi", **both}) == both
    assert over({"prompt": "hi", "logprobs": 5}) == {"logprobs": True, "top_logprobs": 5}
    assert over({"prompt": "hi", "logprobs": False}) == {"logprobs": False}
    chat = {"custom_id": "a", "url": "/v1/chat/completions",
            "body": {"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 2}}
    assert over(chat) == {"logprobs": True, "top_logprobs": 2}
    completion = {"custom_id": "a", "url": "/v1/completions", "body": {"prompt": "x", "logprobs": 4}}
    assert over(completion) == {"logprobs": True, "top_logprobs": 4}
    for raw, fragment in [({"prompt": "hi", "logprobs": "yes"}, "logprobs must be a boolean or an integer"),
                          ({"prompt": "hi", "logprobs": 2, "top_logprobs": 2}, "give one"),
                          ({"prompt": "hi", "top_logprobs": 1.5}, "top_logprobs must be an integer")]:
        with pytest.raises(RecordError, match=fragment):
            parse_record(raw, "1")
    # prompt_logprobs (vLLM's): K; null, as every null field, is not given (a Parquet column's empty cells)
    assert over({"prompt": "hi", "prompt_logprobs": 3}) == {"prompt_logprobs": 3}
    assert over({"prompt": "hi", "prompt_logprobs": None}) == {}
    assert over({**completion, "body": {"prompt": "x", "prompt_logprobs": 0}}) == {"prompt_logprobs": 0}
    with pytest.raises(RecordError, match="prompt_logprobs must be an integer"):
        parse_record({"prompt": "hi", "prompt_logprobs": True}, "1")
    for bad, fragment in [({"top_logprobs": 21, "logprobs": True}, r"top_logprobs must be in \[0, 20\]"),
                          ({"top_logprobs": 2}, "top_logprobs needs logprobs"),
                          ({"prompt_logprobs": 21}, r"prompt_logprobs must be in \[0, 20\]")]:
        with pytest.raises(ConfigError, match=fragment):
            SamplingParams(**bad)


def test_penalty_fields():
    """Penalties, logit bias (OpenAI's map, ids as strings) and min_tokens, native and in OpenAI bodies."""
    over = lambda raw: dict(parse_record(raw, "1").overrides)  # noqa: E731
    fields = {"repetition_penalty": 1.2, "presence_penalty": -0.5, "frequency_penalty": 1, "min_tokens": 3,
              "logit_bias": {"50": -100, "7": 2.5}}
    assert over({"prompt": "hi", **fields}) == {**fields, "frequency_penalty": 1.0}
    body = {"custom_id": "a", "url": "/v1/completions", "body": {"prompt": "x", **fields}}
    assert over(body)["logit_bias"] == {"50": -100, "7": 2.5}
    assert SamplingParams(**over(body)).logit_bias == ((7, 2.5), (50, -100.0))
    for raw, fragment in [({"logit_bias": {"x": 1}}, "not a token id"),
                          ({"logit_bias": {"3": "big"}}, r"logit_bias\[3\] must be a number"),
                          ({"min_tokens": 1.5}, "min_tokens must be an integer")]:
        with pytest.raises(RecordError, match=fragment):
            parse_record({"prompt": "hi", **raw}, "1")
    assert over({"prompt": "hi", "stop_token_ids": [5, 7], "ignore_eos": True}) == {
        "stop_token_ids": (5, 7), "ignore_eos": True}
    for raw, fragment in [({"stop_token_ids": 5}, "stop_token_ids must be a list of integers"),
                          ({"ignore_eos": 1}, "ignore_eos must be a boolean")]:
        with pytest.raises(RecordError, match=fragment):
            parse_record({"prompt": "hi", **raw}, "1")
    for bad, fragment in [({"repetition_penalty": 0}, "repetition_penalty must be in"),
                          ({"frequency_penalty": -2.5}, "frequency_penalty must be in"),
                          ({"logit_bias": {"3": 101}}, "bias in"), ({"min_tokens": -1}, "min_tokens must be"),
                          ({"logit_bias": ("3=1",)}, "ID:BIAS")]:
        with pytest.raises(ConfigError, match=fragment):
            SamplingParams(**bad)
