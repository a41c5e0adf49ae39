"""The output record: one per request, the same fields in JSONL and Parquet (see docs/output-schema.md)."""
from __future__ import annotations

from typing import Any

from specgen.config import Method, SpecConfig
from specgen.engine.types import RequestOutput

FIELDS = (
    "id", "sample_index", "text", "token_ids", "finish_reason", "num_prompt_tokens", "num_output_tokens",
    "num_steps",
    "num_draft_tokens", "num_accepted_tokens", "num_emitted_tokens", "acceptance_rate",
    "mean_accepted_length", "accepted_per_position", "drafted_per_position", "num_prefill_chunks",
    "num_cached_prompt_tokens", "num_forced_tokens", "method",
    "error", "logprobs", "prompt_logprobs",
)


def arrow_schema():
    """The Parquet schema; nullable where docs/output-schema.md says null is possible."""
    import pyarrow as pa

    i64 = pa.int64()
    TOKEN = [("token_id", i64), ("token", pa.string()), ("logprob", pa.float64())]
    return pa.schema([
        ("id", pa.string()),
        ("sample_index", i64),
        ("text", pa.string()),
        ("token_ids", pa.list_(i64)),
        ("finish_reason", pa.string()),
        ("num_prompt_tokens", i64),
        ("num_output_tokens", i64),
        ("num_steps", i64),
        ("num_draft_tokens", i64),
        ("num_accepted_tokens", i64),
        ("num_emitted_tokens", i64),
        ("acceptance_rate", pa.float64()),
        ("mean_accepted_length", pa.float64()),
        ("accepted_per_position", pa.list_(i64)),
        ("drafted_per_position", pa.list_(i64)),
        ("num_prefill_chunks", i64),
        ("num_cached_prompt_tokens", i64),
        ("num_forced_tokens", i64),
        ("method", pa.string()),
        ("error", pa.string()),
        ("logprobs", pa.list_(pa.struct([*TOKEN, ("top_logprobs", pa.list_(pa.struct(TOKEN)))]))),
        ("prompt_logprobs", pa.list_(pa.struct([*TOKEN, ("rank", i64),
                                                ("top_logprobs", pa.list_(pa.struct(TOKEN)))]))),
    ])


def num_positions(spec: SpecConfig) -> int:
    """Draft positions in accepted_per_position: k for a speculative method, none for plain decoding."""
    return 0 if spec.method is Method.NONE else spec.num_speculative_tokens


def result_record(out: RequestOutput, spec: SpecConfig, error: str | None = None) -> dict[str, Any]:
    """The output record of a request the engine ran (or rejected: then `error` names the line)."""
    s = out.stats
    if out.error is not None:
        return error_record(out.id, error or out.error, spec, out.num_prompt_tokens)
    per_pos = list(s.accepted_per_position or [])[: num_positions(spec)]
    drafted = list(s.drafted_per_position or [])[: num_positions(spec)]
    return {
        "id": out.id,
        "sample_index": out.sample_index,
        "text": out.text,
        "token_ids": [int(t) for t in out.token_ids],
        "finish_reason": out.finish_reason,
        "num_prompt_tokens": out.num_prompt_tokens,
        "num_output_tokens": len(out.token_ids),
        "num_steps": s.num_steps,
        "num_draft_tokens": s.num_draft_tokens,
        "num_accepted_tokens": s.num_accepted_tokens,
        "num_emitted_tokens": s.num_emitted_tokens,
        "acceptance_rate": s.acceptance_rate,
        "mean_accepted_length": s.mean_accepted_length,
        "accepted_per_position": [int(x) for x in per_pos],
        "drafted_per_position": [int(x) for x in drafted],
        "num_prefill_chunks": s.num_prefill_chunks,
        "num_cached_prompt_tokens": s.num_cached_prompt_tokens,
        "num_forced_tokens": s.num_forced_tokens,
        "method": spec.method.value,
        "error": None,
        "logprobs": out.logprobs,
        "prompt_logprobs": out.prompt_logprobs,
    }


def error_record(record_id: str, message: str, spec: SpecConfig,
                 num_prompt_tokens: int | None = None) -> dict[str, Any]:
    """A request that produced nothing: empty text and counts, null rates, `error` says why."""
    return {
        "id": record_id,
        "sample_index": None,
        "text": "",
        "token_ids": [],
        "finish_reason": None,
        "num_prompt_tokens": num_prompt_tokens,
        "num_output_tokens": 0,
        "num_steps": 0,
        "num_draft_tokens": 0,
        "num_accepted_tokens": 0,
        "num_emitted_tokens": 0,
        "acceptance_rate": None,
        "mean_accepted_length": None,
        "accepted_per_position": [],
        "drafted_per_position": [],
        "num_prefill_chunks": 0,
        "num_cached_prompt_tokens": 0,
        "num_forced_tokens": 0,
        "method": spec.method.value,
        "error": message,
        "logprobs": None,
        "prompt_logprobs": None,
    }
