"""OpenAI Batch output lines: a native output record (io/schema.py) as the line OpenAI's Batch API writes
for a request, and back.

    {"id": "batch_req_...", "custom_id": ID, "error": null,
     "response": {"status_code": 200, "request_id": ..., "body": BODY}}

BODY is a `chat.completion` (a request of messages) or a `text_completion` (a prompt of text or token ids),
with one choice, `usage`, and the choice's `logprobs` in that API's shape when the request asked for them. The
native record, less the text and log-probabilities the body holds, is the body's `specgen` field (OpenAI's
types keep fields they do not know): statistics for `specgen stats`, the id for --resume. A bad record or a
request that failed is a response with status 400 (or 500 for a failure of the model's output) whose body is
OpenAI's `{"error": {"message", "type", "param", "code"}}`.
"""
from __future__ import annotations

import hashlib
from typing import Any

STYLES = ("auto", "native", "openai")  # --output-format: auto writes each record in its input line's form
CHAT, TEXT = "chat", "text"  # which body a request gets: messages -> chat.completion, else text_completion
_OWN = ("text", "logprobs")  # native fields the body itself holds


def _hash_id(prefix: str, record_id: str) -> str:
    return prefix + hashlib.blake2b(record_id.encode(), digest_size=12).hexdigest()


def openai_line(record: dict[str, Any], api: str, model: str, created: int) -> dict[str, Any]:
    """The Batch output line of a native record (`api`: CHAT or TEXT; `model`: the name in the body)."""
    rid = record["id"]
    own = {k: v for k, v in record.items() if k not in _OWN}
    line = {"id": _hash_id("batch_req_", rid), "custom_id": rid,
            "response": {"status_code": 200, "request_id": _hash_id("req_", rid)}, "error": None}
    if record["error"] is not None:
        failed = "non-finite" in record["error"]  # the model's output failed, not the request
        error = {"message": record["error"], "type": "server_error" if failed else "invalid_request_error",
                 "param": None, "code": None}
        line["response"] |= {"status_code": 500 if failed else 400, "body": {"error": error, "specgen": own}}
        return line
    usage = {"prompt_tokens": record["num_prompt_tokens"], "completion_tokens": record["num_output_tokens"],
             "total_tokens": record["num_prompt_tokens"] + record["num_output_tokens"]}
    entries = record.get("logprobs")
    if api == CHAT:
        choice = {"index": 0, "message": {"role": "assistant", "content": record["text"], "refusal": None},
                  "logprobs": None if entries is None else {"content": [_chat_entry(e) for e in entries],
                                                            "refusal": None},
                  "finish_reason": record["finish_reason"]}
        body = {"id": _hash_id("chatcmpl-", rid), "object": "chat.completion"}
    else:
        choice = {"index": 0, "text": record["text"],
                  "logprobs": None if entries is None else _completion_logprobs(entries),
                  "finish_reason": record["finish_reason"]}
        body = {"id": _hash_id("cmpl-", rid), "object": "text_completion"}
    body |= {"created": created, "model": model, "choices": [choice], "usage": usage,
             "system_fingerprint": None, "specgen": own}
    line["response"]["body"] = body
    return line


def _bytes(token: str) -> list[int] | None:
    """A token's UTF-8 bytes; None for a piece of a multi-byte character (its text is U+FFFD, not its
    bytes)."""
    return None if "\ufffd" in token else list(token.encode("utf-8"))


def _chat_entry(e: dict[str, Any]) -> dict[str, Any]:
    return {"token": e["token"], "logprob": e["logprob"], "bytes": _bytes(e["token"]),
            "top_logprobs": [{"token": t["token"], "logprob": t["logprob"], "bytes": _bytes(t["token"])}
                             for t in e["top_logprobs"]]}


def _completion_logprobs(entries: list[dict[str, Any]]) -> dict[str, Any]:
    """The completions API's logprobs: parallel lists, text_offset counted from the completion's start."""
    offsets, at = [], 0
    for e in entries:
        offsets.append(at)
        at += len(e["token"])
    return {"tokens": [e["token"] for e in entries], "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": [{t["token"]: t["logprob"] for t in e["top_logprobs"]} for e in entries],
            "text_offset": offsets}


def is_openai_line(line: dict[str, Any]) -> bool:
    return "custom_id" in line and "response" in line


def native_record(line: dict[str, Any]) -> dict[str, Any] | None:
    """The native record an OpenAI output line was made from (its text; log-probabilities not rebuilt), or
    None when the line holds no specgen record."""
    body = (line.get("response") or {}).get("body") or {}
    own = body.get("specgen")
    if not isinstance(own, dict) or own.get("id") != line.get("custom_id"):
        return None
    choices = body.get("choices") or [{}]
    text = choices[0].get("text", (choices[0].get("message") or {}).get("content", ""))
    return {**own, "text": text or "", "logprobs": None}
