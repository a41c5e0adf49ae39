"""OpenAI Batch output lines: a native output record (io/schema.py) as the line OpenAI's Batch API writes
for a request, and back.

    {"id": "batch_req_...", "custom_id": ID, "error": null,
     "response": {"status_code": 200, "request_id": ..., "body": BODY}}

BODY is a `chat.completion` (a request of messages) or a `text_completion` (a prompt of text or token ids),
with one choice, `usage`, and the choice's `logprobs` in that API's shape when the request asked for them
(and `prompt_logprobs` in vLLM's shape, for a request that asked for those). The
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
_OWN = ("text", "logprobs", "prompt_logprobs")  # native fields the body itself holds


def _hash_id(prefix: str, record_id: str) -> str:
    return prefix + hashlib.blake2b(record_id.encode(), digest_size=12).hexdigest()


def openai_line(records: list[dict[str, Any]], api: str, model: str, created: int) -> dict[str, Any]:
    """The Batch output line of a request's native records, one per sample (sample_index order: the choices),
    `api` CHAT or TEXT, `model` the name in the body. An error in any sample makes the line an error."""
    rid = records[0]["id"]
    own = [{k: v for k, v in r.items() if k not in _OWN} for r in records]
    line = {"id": _hash_id("batch_req_", rid), "custom_id": rid,
            "response": {"status_code": 200, "request_id": _hash_id("req_", rid)}, "error": None}
    own_field = own[0] if len(own) == 1 else own
    failure = next((r["error"] for r in records if r["error"] is not None), None)
    if failure is not None:
        failed = "non-finite" in failure  # the model's output failed, not the request
        error = {"message": failure, "type": "server_error" if failed else "invalid_request_error",
                 "param": None, "code": None}
        line["response"] |= {"status_code": 500 if failed else 400,
                             "body": {"error": error, "specgen": own_field}}
        return line
    prompt_tokens = records[0]["num_prompt_tokens"]
    completion_tokens = sum(r["num_output_tokens"] for r in records)
    usage = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
             "total_tokens": prompt_tokens + completion_tokens}
    if api == CHAT:
        choices = [{"index": i, "message": {"role": "assistant", "content": r["text"], "refusal": None},
                    "logprobs": None if r.get("logprobs") is None else {
                        "content": [_chat_entry(e) for e in r["logprobs"]], "refusal": None},
                    "finish_reason": r["finish_reason"]} for i, r in enumerate(records)]
        body = {"id": _hash_id("chatcmpl-", rid), "object": "chat.completion"}
    else:
        choices = [{"index": i, "text": r["text"],
                    "logprobs": None if r.get("logprobs") is None else _completion_logprobs(r["logprobs"]),
                    "finish_reason": r["finish_reason"]} for i, r in enumerate(records)]
        body = {"id": _hash_id("cmpl-", rid), "object": "text_completion"}
    body |= {"created": created, "model": model, "choices": choices, "usage": usage,
             "system_fingerprint": None, "specgen": own_field}
    if records[0].get("prompt_logprobs") is not None:
        body["prompt_logprobs"] = [_vllm_prompt_entry(e) for e in records[0]["prompt_logprobs"]]
    line["response"]["body"] = body
    return line


class SampleGroups:
    """A request's samples held until all n are done: the OpenAI line has one choice per sample."""

    def __init__(self) -> None:
        self._pending: dict[str, list[dict[str, Any]]] = {}

    def add(self, record: dict[str, Any], num_samples: int) -> list[dict[str, Any]] | None:
        """The request's records in sample order once `record` completes them, else None."""
        if num_samples <= 1 or record.get("sample_index") is None:
            return [record]
        group = self._pending.setdefault(record["id"], [])
        group.append(record)
        if len(group) < num_samples:
            return None
        del self._pending[record["id"]]
        return sorted(group, key=lambda r: r["sample_index"])

    def rest(self) -> list[list[dict[str, Any]]]:
        """The groups still short of their n (a resumed output whose other samples were written before, in
        another format): written as they are when the job ends, rather than lost."""
        groups = [sorted(g, key=lambda r: r["sample_index"]) for g in self._pending.values()]
        self._pending.clear()
        return groups


def _vllm_prompt_entry(e: dict[str, Any] | None) -> dict[str, dict[str, Any]] | None:
    """A prompt position's log-probabilities in vLLM's shape (its OpenAI server's `prompt_logprobs`): token id
    (a string, as JSON keys are) -> {logprob, rank, decoded_token}, the prompt's token (its rank in the
    vocabulary) and the top ones (their place in the top)."""
    if e is None:
        return None
    out = {str(e["token_id"]): {"logprob": e["logprob"], "rank": e["rank"], "decoded_token": e["token"]}}
    for r, t in enumerate(e["top_logprobs"], 1):  # (a prompt token in the top: its place there, as vLLM's)
        out[str(t["token_id"])] = {"logprob": t["logprob"], "rank": r, "decoded_token": t["token"]}
    return out


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


def native_records(line: dict[str, Any]) -> list[dict[str, Any]] | None:
    """The native records an OpenAI output line was made from, one per sample (their text; log-probabilities
    not rebuilt), or None when the line holds no specgen records."""
    body = (line.get("response") or {}).get("body") or {}
    own = body.get("specgen")
    own = [own] if isinstance(own, dict) else own
    ours = isinstance(own, list) and own and all(
        isinstance(o, dict) and o.get("id") == line.get("custom_id") for o in own)
    if not ours:
        return None
    choices = body.get("choices") or [{}] * len(own)
    texts = [c.get("text", (c.get("message") or {}).get("content", "")) for c in choices]
    return [{**o, "text": (texts[i] if i < len(texts) else "") or "", "logprobs": None,
             "prompt_logprobs": None} for i, o in enumerate(own)]
