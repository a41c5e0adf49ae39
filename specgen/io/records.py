"""Input records: one JSON object / Parquet row -> an id, a prompt and per-request sampling overrides.

Two shapes are accepted, told apart by their keys:
  native        {"id"?, one of "prompt" | "messages" | "input_ids", "max_tokens"?, "temperature"?, ...}
  OpenAI Batch  {"custom_id", "method": "POST", "url": "/v1/chat/completions" | "/v1/completions",
                 "body": {...}}
A field whose value is null counts as absent (Parquet rows carry nulls for columns a row does not use).
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from specgen.errors import InputError
from specgen.io.openai_output import CHAT, TEXT

PROMPT_KEYS = ("prompt", "messages", "input_ids")
SAMPLING_KEYS = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "logprobs",
                 "top_logprobs", "repetition_penalty", "presence_penalty", "frequency_penalty", "logit_bias",
                 "min_tokens", "n", "stop_token_ids", "ignore_eos", "response_format", "prompt_logprobs")
# vLLM's guided decoding fields: each is a response_format of one kind (at most one per record)
GUIDED_KEYS = {"guided_json": "json_schema", "guided_regex": "regex", "guided_choice": "choice",
               "guided_grammar": "grammar"}
FLOAT_KEYS = ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty")
NATIVE_KEYS = ("id", *PROMPT_KEYS, *SAMPLING_KEYS, *GUIDED_KEYS)

OPENAI_KEYS = ("custom_id", "method", "url", "body")
OPENAI_URLS = {"/v1/chat/completions": "messages", "/v1/completions": "prompt"}
# body fields specgen reads, and those it accepts without effect (the model is chosen by --model).
OPENAI_BODY_READ = ("messages", "prompt", "max_tokens", "max_completion_tokens", "temperature", "top_p",
                    "top_k", "min_p", "seed", "stop", "logprobs", "top_logprobs", "repetition_penalty",
                    "presence_penalty", "frequency_penalty", "logit_bias", "min_tokens", "n",
                    "stop_token_ids", "ignore_eos", "response_format", "prompt_logprobs", *GUIDED_KEYS)
OPENAI_BODY_IGNORED = ("model", "user", "metadata", "store")
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1  # the engine keeps integer sampling fields in int64 arrays
SHOWN_CHARS = 60  # longest piece of a record's own text quoted in a message


class RecordError(InputError):
    """A bad input record; `record_id` is its id when it could be read (else None)."""

    def __init__(self, message: str, record_id: str | None = None, num_prompt_tokens: int | None = None):
        super().__init__(message)
        self.record_id = record_id
        self.num_prompt_tokens = num_prompt_tokens  # known when the prompt was tokenized
        self.openai = False  # the record is an OpenAI Batch line (its error is written in that shape)


@dataclass(frozen=True)
class InputRecord:
    """A parsed input record: the prompt is text, chat messages, or token ids."""

    id: str
    prompt: Any  # str | list[dict] | list[int]
    overrides: tuple[tuple[str, Any], ...]  # (SamplingParams field, value) given by this record
    api: str = TEXT  # CHAT for messages: the OpenAI body its output gets (io/openai_output.py)
    openai: bool = False  # an OpenAI Batch line


def parse_record(raw: Any, default_id: str) -> InputRecord:
    """Validate one decoded record; raises RecordError with a message that names the field."""
    if not isinstance(raw, dict):
        raise RecordError(f"expected a JSON object, got {_type_name(raw)}")
    raw = {k: v for k, v in raw.items() if v is not None}
    if "custom_id" in raw or "body" in raw:
        try:
            return _parse_openai(raw)
        except RecordError as exc:
            exc.openai = True
            raise
    record_id = _parse_id(raw.get("id", default_id), "id")
    unknown = sorted(_show_name(k) for k in raw if k not in NATIVE_KEYS)
    if unknown:
        raise RecordError(f"unknown field(s) {', '.join(unknown)} (valid: {', '.join(NATIVE_KEYS)})",
                          record_id)
    given = [k for k in PROMPT_KEYS if k in raw]
    if len(given) != 1:
        found = f"got {', '.join(given)}" if given else "got none"
        raise RecordError(f"need exactly one of prompt, messages, input_ids ({found})", record_id)
    prompt = _check_prompt(given[0], raw[given[0]], record_id)
    overrides = _check_sampling({k: raw[k] for k in (*SAMPLING_KEYS, *GUIDED_KEYS) if k in raw}, record_id)
    return InputRecord(record_id, prompt, overrides, CHAT if given[0] == "messages" else TEXT)


def _parse_openai(raw: dict[str, Any]) -> InputRecord:
    record_id = _parse_id(raw["custom_id"], "custom_id") if "custom_id" in raw else None
    unknown = sorted(_show_name(k) for k in raw if k not in OPENAI_KEYS)
    if unknown:
        raise RecordError(f"unknown field(s) {', '.join(unknown)} in an OpenAI Batch line "
                          f"(valid: {', '.join(OPENAI_KEYS)})", record_id)
    if record_id is None:
        raise RecordError("OpenAI Batch line without custom_id")
    if raw.get("method", "POST") != "POST":
        raise RecordError(f"method must be POST, got {_show(raw['method'])}", record_id)
    url = raw.get("url")
    if url is not None and not (isinstance(url, str) and url in OPENAI_URLS):
        raise RecordError(f"url {_show(url)} is not supported (valid: {', '.join(OPENAI_URLS)})", record_id)
    body = raw.get("body")
    if not isinstance(body, dict):
        raise RecordError("body must be a JSON object", record_id)
    body = {k: v for k, v in body.items() if v is not None}
    known = OPENAI_BODY_READ + OPENAI_BODY_IGNORED + ("stream",)
    unknown = sorted(_show_name(k) for k in body if k not in known)
    if unknown:
        raise RecordError(f"unsupported field(s) body.{', body.'.join(unknown)}", record_id)
    if body.get("stream", False) is not False:
        raise RecordError("only stream=false is supported", record_id)
    return _openai_prompt(body, url, record_id)


def _openai_prompt(body: dict[str, Any], url: str | None, record_id: str) -> InputRecord:
    key = OPENAI_URLS.get(url) if url else ("messages" if "messages" in body else "prompt")
    if key not in body:
        raise RecordError(f"body.{key} is missing", record_id)
    other = "prompt" if key == "messages" else "messages"
    if other in body:
        raise RecordError(f"body has both messages and prompt (give one; url {url or 'not given'})",
                          record_id)
    prompt = body[key]
    if key == "prompt" and isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        key = "input_ids"  # the completions API takes token ids as the prompt
    sampling = {k: body[k] for k in (*SAMPLING_KEYS, *GUIDED_KEYS) if k in body}
    if "max_completion_tokens" in body:
        if "max_tokens" in body and not _same_int(body["max_tokens"], body["max_completion_tokens"]):
            raise RecordError("body.max_tokens and body.max_completion_tokens disagree", record_id)
        sampling["max_tokens"] = body["max_completion_tokens"]
    return InputRecord(record_id, _check_prompt(key, prompt, record_id), _check_sampling(sampling, record_id),
                       CHAT if key == "messages" else TEXT, openai=True)


def _parse_id(value: Any, name: str) -> str:
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise RecordError(f"{name} must be a string or an integer, got {_type_name(value)}")
    text = str(value)
    if not text:
        raise RecordError(f"{name} must not be empty")
    _check_text(text, name, None)
    return text


def _check_text(value: str, name: str, record_id: str | None) -> None:
    """JSON's \\ud800 escapes can spell lone surrogates: not Unicode, so no tokenizer or writer takes them."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise RecordError(f"{name} is not valid Unicode (a lone surrogate \\u{ord(value[exc.start]):04x} "
                          f"at character {exc.start})", record_id) from None


def _check_prompt(key: str, value: Any, record_id: str) -> Any:
    if key == "prompt":
        if not isinstance(value, str):
            raise RecordError(f"prompt must be a string, got {_type_name(value)}", record_id)
        if not value:
            raise RecordError("empty prompt", record_id)
        _check_text(value, "prompt", record_id)
        return value
    if not isinstance(value, list):
        raise RecordError(f"{key} must be a list, got {_type_name(value)}", record_id)
    if not value:
        raise RecordError(f"empty prompt ({key} is an empty list)", record_id)
    if key == "input_ids":
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
            raise RecordError("input_ids must be a list of integers", record_id)
        return list(value)
    for i, m in enumerate(value):
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            raise RecordError(f"messages[{i}] must be an object with string role and content", record_id)
        _check_text(m["role"], f"messages[{i}].role", record_id)
        _check_text(m["content"], f"messages[{i}].content", record_id)
    return [{"role": m["role"], "content": m["content"]} for m in value]


def _check_sampling(values: dict[str, Any], record_id: str) -> tuple[tuple[str, Any], ...]:
    """Type-check per-request sampling fields; the ranges are SamplingParams' to check."""
    out = []
    guided = [k for k in ("response_format", *GUIDED_KEYS) if k in values]
    if len(guided) > 1:
        raise RecordError(f"{' and '.join(guided)}: give one structured-output field", record_id)
    for key, value in values.items():
        if key in GUIDED_KEYS:
            key, value = "response_format", _guided(key, value, record_id)
        if key == "response_format":
            if not isinstance(value, dict):
                raise RecordError(f"response_format must be an object, got {_type_name(value)}", record_id)
        elif key == "stop":
            value = [value] if isinstance(value, str) else value
            if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
                raise RecordError("stop must be a string or a list of strings", record_id)
            for i, s in enumerate(value):
                _check_text(s, f"stop[{i}]", record_id)
            value = tuple(value)
        elif key in FLOAT_KEYS:
            value = _check_float(key, value, record_id)
        elif key == "logit_bias":
            if not isinstance(value, dict):
                raise RecordError(f"logit_bias must be an object of token id: bias, got {_type_name(value)}",
                                  record_id)
            for tok, bias in value.items():
                if not str(tok).isdigit():
                    raise RecordError(f"logit_bias: {_show(tok)} is not a token id", record_id)
                _check_float(f"logit_bias[{tok}]", bias, record_id)
        elif key in ("logprobs", "ignore_eos") and isinstance(value, bool):
            pass
        elif key == "ignore_eos":
            raise RecordError(f"ignore_eos must be a boolean, got {_type_name(value)}", record_id)
        elif key == "stop_token_ids":
            if not isinstance(value, list) or not all(isinstance(t, int) and not isinstance(t, bool)
                                                      for t in value):
                raise RecordError("stop_token_ids must be a list of integers", record_id)
            value = tuple(value)
        elif key == "logprobs":  # the completions API's logprobs: K, the top K with each token's own
            if not isinstance(value, int):
                raise RecordError(f"logprobs must be a boolean or an integer, got {_type_name(value)}",
                                  record_id)
            if "top_logprobs" in values:
                raise RecordError("logprobs is an integer (the completions API's top count) and top_logprobs "
                                  "is given too: give one", record_id)
            out.extend([("logprobs", True), ("top_logprobs", value)])
            continue
        elif isinstance(value, bool) or not isinstance(value, int):
            raise RecordError(f"{key} must be an integer, got {_type_name(value)}", record_id)
        elif not INT64_MIN <= value <= INT64_MAX:
            raise RecordError(f"{key} must be a 64-bit integer, got one outside [-2**63, 2**63)", record_id)
        out.append((key, value))
    return tuple(out)


def _guided(key: str, value: Any, record_id: str) -> dict[str, Any]:
    """A vLLM guided_* field as the response_format it stands for (SamplingParams checks its shape)."""
    kind = GUIDED_KEYS[key]
    if kind == "json_schema":
        if isinstance(value, str):  # vLLM takes the schema as JSON text too
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise RecordError(f"guided_json is not valid JSON ({exc})", record_id) from None
        if not isinstance(value, dict):
            raise RecordError(f"guided_json must be a JSON schema object, got {_type_name(value)}", record_id)
        return {"type": "json_schema", "json_schema": {"schema": value}}
    if kind == "choice" and not (isinstance(value, list) and value and all(isinstance(c, str) and c
                                                                           for c in value)):
        raise RecordError(f"guided_choice must be a non-empty list of non-empty strings, got {_show(value)}",
                          record_id)
    if kind != "choice" and not (isinstance(value, str) and value):
        raise RecordError(f"{key} must be a non-empty string, got {_show(value)}", record_id)
    return {"type": kind, kind: value}


def _check_float(key: str, value: Any, record_id: str) -> float:
    """A finite float: JSON (as Python reads it) and Parquet both carry NaN and infinities."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise RecordError(f"{key} must be a number, got {_type_name(value)}", record_id)
    try:
        number = float(value)
    except OverflowError:  # an integer past the float range
        raise RecordError(f"{key} must be a finite number, got an integer past the float range",
                          record_id) from None
    if not math.isfinite(number):
        raise RecordError(f"{key} must be a finite number, got {number}", record_id)
    return number


def _same_int(a: Any, b: Any) -> bool:
    """a == b for integers; anything else differs (a deep == of nested lists can overflow the stack)."""
    return type(a) is int and type(b) is int and a == b


def _show(value: Any) -> str:
    """A record's value in a message: a string or number quoted (shortened), anything else by its type."""
    if isinstance(value, (str, int, float)) and not isinstance(value, bool):
        text = repr(value)  # repr escapes lone surrogates, so the message can be written as UTF-8
        return text if len(text) <= SHOWN_CHARS else text[: SHOWN_CHARS - 3] + "..."
    return _type_name(value)


def _show_name(key: Any) -> str:
    """A field name in a message: as written, unless it would be unwritable (lone surrogates) or long."""
    text = str(key).encode("utf-8", "backslashreplace").decode("utf-8")
    return text if len(text) <= SHOWN_CHARS else text[: SHOWN_CHARS - 3] + "..."


def _type_name(value: Any) -> str:
    names = {str: "a string", int: "an integer", float: "a number", bool: "a boolean", list: "a list",
             dict: "an object", type(None): "null"}
    return names.get(type(value), type(value).__name__)
