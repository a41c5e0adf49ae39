"""Side-by-side runs of the same prompts with several methods on one loaded model, at one or more batch sizes,
each beside what it could reach on them (the ceiling and the oracle bound of bounds.py)."""
from __future__ import annotations

import dataclasses
import itertools
import time
from array import array
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specgen.api import iter_generate
from specgen.app import bounds
from specgen.app.job import request_source
from specgen.config import EngineConfig, Method, RunConfig, SamplingParams, SpecConfig
from specgen.engine.proposers import build_proposer
from specgen.engine.types import Request
from specgen.errors import ConfigError
from specgen.io.bench_rows import BenchRow
from specgen.io.readers import RawRecord
from specgen.io.schema import error_record, result_record
from specgen.io.summary import Summary, SummaryAccumulator

WARMUP_TOKENS = 4
# Drafting rules a model-free replay can run (bounds.replay_steps): their ceiling and oracle bound are
# computed.
REPLAYABLE = (Method.NGRAM,)


@dataclass(frozen=True)
class BenchInput:
    """What is benched: a file, streamed once per pass, or a sample of its records (io/sample.py)."""

    path: Path
    fmt: str  # jsonl | parquet
    sample: list[RawRecord] | None = None  # None: every record of the file


@dataclass
class _Pass:
    """One timed pass: its summary, each request's output tokens (packed, exact) and, when kept, the
    prompts and outputs in input order for the replay."""

    summary: Summary
    tokens: dict[str, bytes]
    prompts: dict[str, tuple[int, tuple[int, ...]]]  # id -> (index, prompt ids)
    outputs: dict[str, list[int]]


@dataclass(frozen=True)
class Choice:
    """A method to bench, and its k when --methods gives one ("ngram:2"; None: --num-speculative-tokens)."""

    method: Method
    k: int | None = None

    @property
    def label(self) -> str:
        return self.method.value if self.k is None else f"{self.method.value}:{self.k}"


def parse_methods(value: str) -> list[Choice]:
    """"none,ngram:2,ngram:5" -> each method with its k, if given; the first is the baseline."""
    names = [v.strip() for v in value.split(",") if v.strip()]
    if not names:
        raise ConfigError("--methods needs at least one method (e.g. none,ngram or none,ngram:2,ngram:5)")
    choices = [_choice(n) for n in names]
    if len({c.label for c in choices}) != len(choices):
        raise ConfigError(f"--methods lists a method twice: {value}")
    return choices


def _choice(name: str) -> Choice:
    method, _, k = name.partition(":")
    m = Method.parse(method.strip())
    if not k:
        return Choice(m)
    if m is Method.NONE:
        raise ConfigError(f"--methods: none drafts nothing, so it takes no k ({name!r})")
    try:
        num = int(k)
    except ValueError:
        raise ConfigError(f"--methods: k must be an integer, as in ngram:2 (got {name!r})") from None
    SpecConfig(method=m, num_speculative_tokens=num)  # 1..5, or an error saying so
    return Choice(m, num)


def parse_batch_sizes(value: str) -> list[int]:
    """"1,32,256" -> [1, 32, 256], each a valid EngineConfig.batch_size."""
    try:
        sizes = [int(v) for v in value.split(",") if v.strip()]
    except ValueError:
        raise ConfigError("--batch-sizes must be comma-separated integers (e.g. 1,32,256), "
                          f"got {value!r}") from None
    if not sizes or len(set(sizes)) != len(sizes):
        raise ConfigError(f"--batch-sizes needs distinct sizes (e.g. 1,32,256), got {value!r}")
    for size in sizes:
        EngineConfig(batch_size=size)  # 1..256, or an error saying so
    return sizes


def run_bench(inp: BenchInput, loaded: Any, cfg: RunConfig, methods: Sequence[Choice],
              batch_sizes: Sequence[int] | None = None, warmup: bool = True,
              measure: bounds.MeasureCosts = bounds.step_costs, repeats: int = 1) -> list[BenchRow]:
    """Every method at every batch size (default: the configured one), batch size after batch size. `measure`:
    the step costs of the oracle bound (bounds.step_costs times this machine). `repeats`: timed passes per
    method, alternated with the others; each keeps its fastest, the one least disturbed by other processes on
    a shared machine (its outputs are checked on every pass)."""
    if repeats < 1:
        raise ConfigError(f"--repeats must be >= 1, got {repeats}")
    rows: list[BenchRow] = []
    for size in batch_sizes or [cfg.engine.batch_size]:
        sized = dataclasses.replace(cfg, engine=dataclasses.replace(cfg.engine, batch_size=size))
        rows += _bench_batch(inp, loaded, sized, methods, warmup, measure, repeats)
    return rows


def _bench_batch(inp: BenchInput, loaded: Any, cfg: RunConfig, methods: Sequence[Choice], warmup: bool,
                 measure: bounds.MeasureCosts, repeats: int) -> list[BenchRow]:
    specs = {c: dataclasses.replace(cfg.spec, method=c.method, num_speculative_tokens=c.k or
                                    cfg.spec.num_speculative_tokens) for c in methods}
    if warmup:
        for spec in specs.values():
            _warmup(inp, loaded, dataclasses.replace(cfg, spec=spec))
    passes: dict[Choice, _Pass] = {}
    identical = dict.fromkeys(methods, True)
    for _ in range(repeats):
        for c, spec in specs.items():
            p = _run_method(inp, loaded, cfg, spec, keep=c.method is Method.NONE)
            first = passes.get(methods[0], p if c == methods[0] else None)
            identical[c] &= first is not None and p.tokens == first.tokens
            if c not in passes or p.summary.wall_time_s < passes[c].summary.wall_time_s:
                passes[c] = p
    base = passes[methods[0]]
    plain = next((passes[c] for c in methods if c.method is Method.NONE), None)
    prefill_wall = share = None
    if plain is not None and any(c.method in REPLAYABLE for c in methods):
        prefill_wall = min(_prefill_wall(inp, loaded, cfg) for _ in range(repeats))
        share = bounds.prefill_share(prefill_wall, plain.summary.wall_time_s)
    rows = []
    for c, spec in specs.items():
        m, s = c.method, passes[c].summary
        possible = None
        if m in REPLAYABLE and share is not None and plain.outputs:
            ids = sorted(plain.outputs, key=lambda i: plain.prompts[i][0])  # input order
            proposer = build_proposer(spec, loaded.model)  # fresh, the numpy reference: the rule, replayed
            possible = bounds.possible(loaded.model, proposer, [plain.prompts[i][1] for i in ids],
                                       [plain.outputs[i] for i in ids], spec.num_speculative_tokens,
                                       cfg.engine.batch_size, share, measure)
        rows.append(BenchRow(
            method=m.value, label=c.label, k=None if m is Method.NONE else spec.num_speculative_tokens,
            batch_size=cfg.engine.batch_size, summary=s, identical=identical[c],
            speedup=_ratio(s, base.summary),
            speedup_over_plain=None if plain is None else _ratio(s, plain.summary),
            possible=possible, prefill_wall_s=prefill_wall if m is Method.NONE else None))
    return rows


def _ratio(s: Summary, base: Summary) -> float | None:
    if not s.output_tokens_per_s or not base.output_tokens_per_s:
        return None
    return s.output_tokens_per_s / base.output_tokens_per_s


def _source(inp: BenchInput, loaded: Any, cfg: RunConfig, acc: SummaryAccumulator | None):
    def on_bad(record_id: str, message: str, num_prompt_tokens: int | None, openai: bool) -> None:
        if acc is not None:
            acc.add(error_record(record_id, message, cfg.spec, num_prompt_tokens))

    return request_source(inp.path, inp.fmt, loaded, cfg, records=inp.sample, on_bad=on_bad)


def _run_method(inp: BenchInput, loaded: Any, cfg: RunConfig, spec: SpecConfig, keep: bool) -> _Pass:
    """One timed pass over the input; `keep`: hold its prompts and outputs for the replay."""
    acc = SummaryAccumulator()
    tokens: dict[str, bytes] = {}
    prompts: dict[str, tuple[int, tuple[int, ...]]] = {}
    outputs: dict[str, list[int]] = {}

    def tapped(requests: Iterable[Request]) -> Iterator[Request]:
        for r in requests:
            prompts[r.id] = (r.index, r.prompt_ids)
            yield r

    source = _source(inp, loaded, cfg, acc)
    start = time.perf_counter()
    for out in iter_generate(loaded, tapped(source) if keep else source, cfg.engine, spec):
        acc.add(result_record(out, spec))
        tokens[out.id] = array("q", out.token_ids).tobytes()
        if keep and out.error is None:
            outputs[out.id] = list(out.token_ids)
    return _Pass(acc.summary(time.perf_counter() - start), tokens, prompts, outputs)


def _prefill_wall(inp: BenchInput, loaded: Any, cfg: RunConfig) -> float:
    """Seconds of plain decoding's pass with every request cut to its first token: the job's prefill."""
    spec = dataclasses.replace(cfg.spec, method=Method.NONE)
    first = (dataclasses.replace(r, params=dataclasses.replace(r.params, max_tokens=1))
             for r in _source(inp, loaded, cfg, None))
    start = time.perf_counter()
    for _ in iter_generate(loaded, first, cfg.engine, spec):
        pass
    return time.perf_counter() - start


def _warmup(inp: BenchInput, loaded: Any, cfg: RunConfig) -> None:
    """The first batch of requests, WARMUP_TOKENS each, before a method is measured: its one-time start-up
    (the runtime's warm-up, the step-cost table at the job's batch size, a head's load) is then not in its
    figures, as it is a negligible part of a real job's."""
    short = dataclasses.replace(cfg, sampling=SamplingParams(max_tokens=WARMUP_TOKENS))
    source = _source(inp, loaded, short, None)
    first = [dataclasses.replace(r, params=short.sampling)
             for r in itertools.islice(source, cfg.engine.batch_size)]
    for _ in iter_generate(loaded, first, cfg.engine, cfg.spec):
        pass
