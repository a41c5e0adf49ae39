"""Proposer registry: every Method maps to a proposer factory."""
from __future__ import annotations

from typing import Any

from specgen.config import Method, SpecConfig
from specgen.engine.proposers.base import NoProposer, Proposer


def build_proposer(spec: SpecConfig, loaded: Any) -> Proposer:
    if spec.method is Method.NONE:
        return NoProposer()
    if spec.method is Method.NGRAM:
        from specgen.engine.proposers.ngram import NgramProposer

        return NgramProposer(spec.num_speculative_tokens, spec.ngram_min, spec.ngram_max, spec.ngram_pool)
    from specgen.engine.proposers.mtp import build_mtp_proposer

    return build_mtp_proposer(spec, loaded)
