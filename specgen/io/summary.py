"""The run summary, computed in one place from output records (used by run, stats and bench)."""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(frozen=True)
class Summary:
    """Totals over a set of output records; ratios are None when undefined.

    mean_accepted_length = emitted / steps and acceptance_rate = accepted / drafted, both over all successful
    requests; per_position_acceptance[i] = steps in which draft position i was accepted / decode steps
    (steps after each request's prefill).
    """

    num_requests: int
    num_errors: int
    num_prompt_tokens: int
    num_output_tokens: int
    num_steps: int
    num_draft_tokens: int
    num_accepted_tokens: int
    num_prefill_chunks: int
    num_cached_prompt_tokens: int
    wall_time_s: float | None
    output_tokens_per_s: float | None
    mean_accepted_length: float | None
    acceptance_rate: float | None
    per_position_acceptance: list[float]
    methods: list[str]
    # the engine's KV cache at its peak (a run, not a file), shared prefix once
    kv_cache_bytes: int | None = None
    kv_cache_bytes_unshared: int | None = None  # the same run if every slot held the prefix itself
    # A mixture-of-experts model (a run, not a file): the tokens each expert took, summed over the routed
    # blocks (every token the forwards fed: prompts, and drafts verified whether accepted or not), and the
    # load balance: per routed block the busiest expert's tokens over the mean expert's, averaged over the
    # blocks (1.0: even).
    expert_tokens: list[int] | None = None
    expert_load_max_over_mean: float | None = None
    # [i]: steps in which draft position i (a token tree's depth i + 1) was accepted / steps that verified a
    # draft there: each depth's own acceptance (records without drafted_per_position add nothing)
    per_depth_acceptance: list[float] | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class SummaryAccumulator:
    """Running totals, updated one record at a time (the progress bar reads them too)."""

    num_requests: int = 0
    num_errors: int = 0
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_steps: int = 0
    num_decode_steps: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_emitted_tokens: int = 0
    num_prefill_chunks: int = 0
    num_cached_prompt_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    drafted_per_position: list[int] = field(default_factory=list)
    methods: dict[str, None] = field(default_factory=dict)  # insertion-ordered set

    def add(self, record: dict[str, Any]) -> None:
        self.num_requests += 1
        if record.get("method"):
            self.methods.setdefault(record["method"], None)
        if record.get("error") is not None:
            self.num_errors += 1
            return
        self.num_prompt_tokens += record["num_prompt_tokens"] or 0
        self.num_output_tokens += record["num_output_tokens"]
        self.num_steps += record["num_steps"]
        self.num_decode_steps += max(record["num_steps"] - 1, 0)
        self.num_draft_tokens += record["num_draft_tokens"]
        self.num_accepted_tokens += record["num_accepted_tokens"]
        self.num_emitted_tokens += record["num_emitted_tokens"]
        # absent in files from before chunking
        self.num_prefill_chunks += record.get("num_prefill_chunks") or 0
        self.num_cached_prompt_tokens += record.get("num_cached_prompt_tokens") or 0
        _add_lists(self.accepted_per_position, record.get("accepted_per_position") or [])
        _add_lists(self.drafted_per_position, record.get("drafted_per_position") or [])  # absent before trees

    @property
    def acceptance_rate(self) -> float | None:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None

    def summary(self, wall_time_s: float | None = None, kv_cache_bytes: int | None = None,
                kv_cache_bytes_unshared: int | None = None, expert_tokens: Any = None) -> Summary:
        """expert_tokens: int [num_routed_blocks, num_experts] (Engine.memory), for an MoE model."""
        steps = self.num_decode_steps
        load = None
        if expert_tokens is not None and expert_tokens.sum():
            busy = expert_tokens[expert_tokens.sum(axis=1) > 0]
            load = float((busy.max(axis=1) / busy.mean(axis=1)).mean())
        return Summary(
            num_requests=self.num_requests,
            num_errors=self.num_errors,
            num_prompt_tokens=self.num_prompt_tokens,
            num_output_tokens=self.num_output_tokens,
            num_steps=self.num_steps,
            num_draft_tokens=self.num_draft_tokens,
            num_accepted_tokens=self.num_accepted_tokens,
            num_prefill_chunks=self.num_prefill_chunks,
            num_cached_prompt_tokens=self.num_cached_prompt_tokens,
            wall_time_s=wall_time_s,
            output_tokens_per_s=self.num_output_tokens / wall_time_s if wall_time_s else None,
            mean_accepted_length=self.num_emitted_tokens / self.num_steps if self.num_steps else None,
            acceptance_rate=self.acceptance_rate,
            per_position_acceptance=[n / steps if steps else 0.0 for n in self.accepted_per_position],
            methods=list(self.methods),
            kv_cache_bytes=kv_cache_bytes,
            kv_cache_bytes_unshared=kv_cache_bytes_unshared,
            expert_tokens=expert_tokens.sum(axis=0).tolist() if expert_tokens is not None else None,
            expert_load_max_over_mean=load,
            per_depth_acceptance=[a / d if d else 0.0 for a, d in zip(self.accepted_per_position,
                                                                      self.drafted_per_position)] or None,
        )


def _add_lists(total: list[int], counts: list[int]) -> None:
    """total[i] += counts[i], total grown to counts' length."""
    total.extend([0] * (len(counts) - len(total)))
    for i, n in enumerate(counts):
        total[i] += n


def summarize(records: Iterable[dict[str, Any]], wall_time_s: float | None = None) -> Summary:
    """The summary of output records (a finished file, or what one run wrote)."""
    acc = SummaryAccumulator()
    for record in records:
        acc.add(record)
    return acc.summary(wall_time_s)
