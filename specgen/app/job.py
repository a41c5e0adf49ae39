"""The batch job: input records -> engine -> output records, written as they finish, resumable."""
from __future__ import annotations

import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

from specgen.api import encode_prompt, make_engine
from specgen.app.settings import RunConfig
from specgen.errors import ConfigError, InputError
from specgen.io.outputs import existing_parts, output_format
from specgen.io.readers import check_input, count_records, input_format, iter_records, unit_name
from specgen.io.report import RunProgress
from specgen.io.requests import RequestSource
from specgen.io.schema import error_record, result_record
from specgen.io.summary import Summary, SummaryAccumulator
from specgen.io.writers import open_sink

ON_ERROR = ("skip", "fail")


@dataclass(frozen=True)
class JobPlan:
    """Checked paths and policies of a run, known before the model is loaded."""

    input: Path
    input_format: str  # jsonl | parquet
    output: Path
    resume: bool
    on_error: str  # skip: bad records become error records; fail: the first one stops the run (exit 2)


@dataclass(frozen=True)
class JobResult:
    summary: Summary  # of the records this run wrote
    num_resumed: int  # records skipped because an earlier run had written them


def plan_job(input: Path, output: Path, fmt: str | None, resume: bool, on_error: str) -> JobPlan:
    """Fail fast (before loading a model) on a missing input, an unknown format or an existing output."""
    if on_error not in ON_ERROR:
        raise ConfigError(f"--on-error must be one of {', '.join(ON_ERROR)}, got {on_error!r}")
    check_input(input)
    fmt = input_format(input, fmt)
    output_format(output)
    parts = existing_parts(output)
    if parts and not resume:
        raise ConfigError(f"output {parts[0]} already exists; pass --resume to continue it, or remove it")
    return JobPlan(input, fmt, output, resume, on_error)


def context_len(loaded: Any, engine_cfg: Any) -> int:
    """The engine's context: the model's, capped by max_model_len when that is set."""
    ctx = loaded.config.max_position_embeddings
    return min(ctx, engine_cfg.max_model_len) if engine_cfg.max_model_len else ctx


def request_source(plan_input: Path, fmt: str, loaded: Any, cfg: RunConfig, **kwargs: Any) -> RequestSource:
    return RequestSource(
        records=iter_records(plan_input, fmt), encode=partial(encode_prompt, loaded), sampling=cfg.sampling,
        context_len=context_len(loaded, cfg.engine), vocab_size=loaded.config.vocab_size, unit=unit_name(fmt),
        **kwargs,
    )


@contextmanager
def deferred_sigint() -> Iterator[None]:
    """Hold a Ctrl-C until the block is done, so that a record is never half written."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    received: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: received.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if received and callable(previous):
            previous(signal.SIGINT, None)


def run_job(plan: JobPlan, loaded: Any, cfg: RunConfig, progress: RunProgress) -> JobResult:
    """Stream the input through the engine; a KeyboardInterrupt leaves every finished record on disk."""
    unit = unit_name(plan.input_format)
    total = count_records(plan.input, plan.input_format)
    sink, done = open_sink(plan.output, plan.resume)
    acc = SummaryAccumulator()
    completed = [len(done)]

    def emit(record: dict[str, Any]) -> None:
        with deferred_sigint():
            sink.write(record)
        acc.add(record)
        completed[0] += 1
        progress.update(acc, completed[0])

    def on_bad(record_id: str, message: str, num_prompt_tokens: int | None) -> None:
        progress.record_error(message)
        emit(error_record(record_id, message, cfg.spec, num_prompt_tokens))

    skip = plan.on_error == "skip"
    source = request_source(plan.input, plan.input_format, loaded, cfg, done_ids=done,
                            on_bad=on_bad if skip else None)
    start = time.perf_counter()
    try:
        progress.start(total, completed=min(len(done), total))
        engine = make_engine(loaded, cfg.engine, cfg.spec)
        for out in engine.run(source):
            message = None
            if out.error is not None:
                message = f"{unit} {out.index}: {out.error}"
                if not skip:
                    raise InputError(message)
                progress.record_error(message)
            emit(result_record(out, cfg.spec, error=message))
    finally:
        with deferred_sigint():
            sink.close()
    return JobResult(acc.summary(time.perf_counter() - start, **engine.memory()), source.num_skipped)
