"""A job's output: its paths and policies checked before the model loads, with the output's lock (plan_job),
the one writer of its records (RecordWriter), and what a run wrote (JobResult). Used by the job on this
machine and on Ray (distributed/ray_job.py)."""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specgen.errors import ConfigError, InputError, OutputError
from specgen.io.interrupts import Interrupts
from specgen.io.lock import OutputLock
from specgen.io.openai_output import STYLES
from specgen.io.outputs import existing_parts, output_format
from specgen.io.readers import check_input, input_format
from specgen.io.report import RunProgress
from specgen.io.summary import Summary, SummaryAccumulator
from specgen.io.writers import open_sink

ON_ERROR = ("skip", "fail")


@dataclass(frozen=True)
class JobPlan:
    """Checked paths and policies of a run, known before the model is loaded; holds the output's lock."""

    input: Path
    input_format: str  # jsonl | parquet
    output: Path
    resume: bool
    on_error: str  # skip: bad records become error records; fail: the first one stops the run (exit 2)
    lock: OutputLock  # held: release() (or `with plan.lock`) when the run ends
    allow_mismatch: bool = False  # resume an output whose manifest differs from this run's settings
    # records as OpenAI Batch output lines: "openai" every one, "auto" those of OpenAI Batch input lines,
    # "native" none (io/openai_output.py)
    output_style: str = "auto"


@dataclass(frozen=True)
class JobResult:
    summary: Summary  # of the records this run wrote
    num_resumed: int  # records skipped because an earlier run had written them


def plan_job(input: Path, output: Path, fmt: str | None, resume: bool, on_error: str,
             allow_mismatch: bool = False, output_style: str = "auto") -> JobPlan:
    """Fail fast (before loading a model) on a missing input, an unknown format, an output another run holds,
    an existing output without --resume, or one that cannot be written; takes the output's lock."""
    if on_error not in ON_ERROR:
        raise ConfigError(f"--on-error must be one of {', '.join(ON_ERROR)}, got {on_error!r}")
    if allow_mismatch and not resume:
        raise ConfigError("--allow-mismatch only applies with --resume")
    if output_style not in STYLES:
        raise ConfigError(f"--output-format must be one of {', '.join(STYLES)}, got {output_style!r}")
    check_input(input)
    fmt = input_format(input, fmt)
    if output_format(output) == "parquet" and output_style == "openai":
        raise ConfigError("--output-format openai writes OpenAI's Batch output, JSON lines: "
                          "use a .jsonl output")
    if not output.parent.is_dir():
        raise ConfigError(f"{output.parent}: the output's folder does not exist")
    lock = OutputLock(output).acquire()
    try:
        parts = existing_parts(output)
        if parts and not resume:
            raise ConfigError(f"output {parts[0]} already exists; pass --resume to continue it, or remove it")
        for part in parts:
            if not os.access(part, os.W_OK):
                raise OutputError(f"cannot write {part}: permission denied (read-only)")
    except BaseException:
        lock.release()
        raise
    return JobPlan(input, fmt, output, resume, on_error, lock, allow_mismatch, output_style)


class RecordWriter:
    """The job's one writer: each record to the output (a signal waits until it is whole), the summary and the
    progress. Under --on-error fail an error record stops the run instead (InputError, exit 2)."""

    def __init__(self, plan: JobPlan, progress: RunProgress, interrupts: Interrupts):
        self.sink, self.done = open_sink(plan.output, plan.resume)  # done: the ids the output holds already
        self.fail = plan.on_error == "fail"
        self.progress, self.interrupts = progress, interrupts
        self.acc = SummaryAccumulator()
        self.completed = len(self.done)

    def add(self, record: dict[str, Any], lines: list[dict[str, Any]] | None = None) -> None:
        """Write `lines` (the record in another shape: an OpenAI Batch output line, or none until a request's
        samples are all done), or the record itself."""
        if record["error"] is not None:
            if self.fail:
                raise InputError(record["error"])
            self.progress.record_error(record["error"])
        with self.interrupts.held():
            for line in [record] if lines is None else lines:
                self.sink.write(line)
        self.acc.add(record)
        self.completed += 1
        self.progress.update(self.acc, self.completed)

    def write_lines(self, lines: list[dict[str, Any]]) -> None:
        """Lines of records already added (a request's samples held for one OpenAI line)."""
        with self.interrupts.held():
            for line in lines:
                self.sink.write(line)

    def close(self) -> None:
        # a Parquet merge: the first signal waits for it, a second aborts
        with self.interrupts.held(abortable=True):
            self.sink.close()
