"""Side-by-side runs of the same prompts with several methods on one loaded model."""
from __future__ import annotations

import dataclasses
import itertools
import time
from array import array
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from specgen.api import iter_generate
from specgen.app.job import request_source
from specgen.app.settings import RunConfig
from specgen.config import Method, SamplingParams, SpecConfig
from specgen.errors import ConfigError
from specgen.io.schema import error_record, result_record
from specgen.io.summary import Summary, SummaryAccumulator

WARMUP_TOKENS = 4


def parse_methods(value: str) -> list[Method]:
    """"none,ngram" -> [Method.NONE, Method.NGRAM]; the first is the baseline."""
    names = [v.strip() for v in value.split(",") if v.strip()]
    if not names:
        raise ConfigError("--methods needs at least one method (e.g. none,ngram)")
    methods = [Method.parse(n) for n in names]
    if len(set(methods)) != len(methods):
        raise ConfigError(f"--methods lists a method twice: {value}")
    return methods


def run_bench(input: Path, fmt: str, loaded: Any, cfg: RunConfig, methods: Sequence[Method],
              warmup: bool = True) -> list[tuple[str, Summary, bool]]:
    """(method, summary, token-identical to the first method's outputs) for each method, in order."""
    if warmup:
        for method in methods:
            _warmup(input, fmt, loaded, dataclasses.replace(cfg, spec=dataclasses.replace(cfg.spec, method=method)))
    rows: list[tuple[str, Summary, bool]] = []
    baseline: dict[str, bytes] | None = None
    for method in methods:
        summary, tokens = _run_method(input, fmt, loaded, cfg, dataclasses.replace(cfg.spec, method=method))
        baseline = tokens if baseline is None else baseline
        rows.append((method.value, summary, tokens == baseline))
    return rows


def _run_method(input: Path, fmt: str, loaded: Any, cfg: RunConfig, spec: SpecConfig):
    """One timed pass over the input: its summary and each request's output tokens (packed, exact)."""
    acc = SummaryAccumulator()
    tokens: dict[str, bytes] = {}

    def on_bad(record_id: str, message: str, num_prompt_tokens: int | None) -> None:
        acc.add(error_record(record_id, message, spec, num_prompt_tokens))

    source = request_source(input, fmt, loaded, cfg, on_bad=on_bad)
    start = time.perf_counter()
    for out in iter_generate(loaded, source, cfg.engine, spec):
        acc.add(result_record(out, spec))
        tokens[out.id] = array("q", out.token_ids).tobytes()
    return acc.summary(time.perf_counter() - start), tokens


def _warmup(input: Path, fmt: str, loaded: Any, cfg: RunConfig) -> None:
    """The first batch of requests, WARMUP_TOKENS each, before a method is measured: its one-time start-up (the
    runtime's warm-up, the step-cost table at the job's batch size, a head's load) is then not in its figures,
    as it is a negligible part of a real job's."""
    short = dataclasses.replace(cfg, sampling=SamplingParams(max_tokens=WARMUP_TOKENS))
    source = request_source(input, fmt, loaded, short, on_bad=lambda *args: None)
    first = [dataclasses.replace(r, params=short.sampling) for r in itertools.islice(source, cfg.engine.batch_size)]
    for _ in iter_generate(loaded, first, cfg.engine, cfg.spec):
        pass
