"""The rows of `specgen bench`: one method at one batch size, beside what it could reach (Possible:
app/bounds.py computes it); read by the bench table and plot."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from specgen.io.summary import Summary


@dataclass(frozen=True)
class Possible:
    """What a drafting rule could gain on one job at one batch size, on this machine."""

    ceiling: float  # tokens per step if verifying were free: the replay's emitted tokens / its steps
    decode_bound: float  # the decoding steps' oracle speedup over plain decoding
    prefill_share: float  # the plain job's time spent before the first tokens (not sped up)
    oracle: float  # the whole job's bound: job_bound(decode_bound, prefill_share)
    costs: dict[int, float]  # the measured seconds per step, by tokens fed per slot
    slots: int  # the slots the costs were measured at


@dataclass(frozen=True)
class BenchRow:
    """One method at one batch size."""

    method: str
    label: str  # as --methods named it: the method, or method:k
    k: int | None  # drafts per step at most (num_speculative_tokens); None for none
    batch_size: int
    summary: Summary  # of its timed pass
    identical: bool  # token-identical to the first method's outputs at this batch size
    speedup: float | None  # output tok/s over the first method's at this batch size
    speedup_over_plain: float | None  # output tok/s over none's at this batch size (when none was benched)
    possible: Possible | None  # a replayable rule (ngram) with none benched: its ceiling and oracle bound
    # the job to its first token only (none; the prefill share's numerator)
    prefill_wall_s: float | None = None

    @property
    def tok_s(self) -> float | None:
        return self.summary.output_tokens_per_s

    @property
    def of_oracle(self) -> float | None:
        """The speedup over plain decoding as a share of the oracle bound."""
        if self.possible is None or self.speedup_over_plain is None:
            return None
        return self.speedup_over_plain / self.possible.oracle

    def to_dict(self) -> dict[str, Any]:
        p = self.possible
        return {
            "method": self.method, "label": self.label, "k": self.k, "batch_size": self.batch_size,
            "identical": self.identical,
            "tok_s": self.tok_s, "speedup": self.speedup, "speedup_over_plain": self.speedup_over_plain,
            "tokens_per_step": self.summary.mean_accepted_length, "acceptance": self.summary.acceptance_rate,
            "per_position_acceptance": self.summary.per_position_acceptance,
            "ceiling": None if p is None else p.ceiling,
            "decode_bound": None if p is None else p.decode_bound,
            "oracle": None if p is None else p.oracle, "of_oracle": self.of_oracle,
            "prefill_share": None if p is None else p.prefill_share, "prefill_wall_s": self.prefill_wall_s,
            "step_costs": None if p is None else {str(t): c for t, c in p.costs.items()},
            "cost_slots": None if p is None else p.slots,
            "summary": self.summary.to_dict(),
        }
