"""The batch job: input records -> engine -> output records, written as they finish, resumable."""
from __future__ import annotations

import dataclasses
import json
import os
import signal
import threading
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from specgen import __version__
from specgen.api import encode_prompt, make_engine
from specgen.app.settings import RunConfig
from specgen.config import METHOD_SECTIONS, SpecConfig
from specgen.engine.engine import gib
from specgen.errors import ConfigError, InputError, OutputError, SpecgenError, Stopped, WorkerError
from specgen.io.lock import OutputLock
from specgen.io.manifest import content_hash, differences, read_manifest, write_sidecar
from specgen.io.outputs import done_ids, existing_parts, output_format
from specgen.io.readers import RawRecord, check_input, count_records, input_format, iter_records, unit_name
from specgen.io.report import RunProgress
from specgen.io.requests import RequestSource
from specgen.io.schema import error_record, result_record
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


@dataclass(frozen=True)
class JobResult:
    summary: Summary  # of the records this run wrote
    num_resumed: int  # records skipped because an earlier run had written them


def plan_job(input: Path, output: Path, fmt: str | None, resume: bool, on_error: str,
             allow_mismatch: bool = False) -> JobPlan:
    """Fail fast (before loading a model) on a missing input, an unknown format, an output another run holds, an
    existing output without --resume, or one that cannot be written; takes the output's lock."""
    if on_error not in ON_ERROR:
        raise ConfigError(f"--on-error must be one of {', '.join(ON_ERROR)}, got {on_error!r}")
    if allow_mismatch and not resume:
        raise ConfigError("--allow-mismatch only applies with --resume")
    check_input(input)
    fmt = input_format(input, fmt)
    output_format(output)
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
    return JobPlan(input, fmt, output, resume, on_error, lock, allow_mismatch)


def run_manifest(loaded: Any, cfg: RunConfig) -> dict[str, Any]:
    """The settings that decide the output records: the model (path and content hash), the precision and
    backend it runs with, sampling, and the method with its settings. Batch size and threads do not change a
    token, so they are not in it."""
    e = loaded.engine
    return {
        "specgen_version": __version__,
        "model": {"path": str(Path(loaded.source).resolve()), "sha256": content_hash(loaded.source, e.cache_root())},
        "engine": {"dtype": e.dtype, "kv_cache_dtype": cfg.engine.kv_cache_dtype, "quantization": e.quantization,
                   "matmul": e.matmul, "backend": loaded.model.backend.name,
                   "max_model_len": cfg.engine.max_model_len},
        "sampling": json.loads(json.dumps(dataclasses.asdict(cfg.sampling))),
        "speculative": method_settings(cfg.spec),
    }


def method_settings(spec: SpecConfig) -> dict[str, Any]:
    """The method, its bound on drafts and its own settings (not those of the methods not run, nor `adaptive`,
    which chooses among drafts and cannot change a token)."""
    out: dict[str, Any] = {"method": spec.method.value, "num_speculative_tokens": spec.num_speculative_tokens}
    section = METHOD_SECTIONS.get(spec.method)
    if section is not None:
        out[section] = dataclasses.asdict(getattr(spec, section))
    if spec.draft_model is not None:
        out["draft_model"] = spec.draft_model
    return json.loads(json.dumps(out))


def check_manifest(plan: JobPlan, manifest: dict[str, Any]) -> list[str]:
    """Store the manifest with a new output (or an old output without one); on --resume, refuse settings that
    differ from the stored ones unless --allow-mismatch. Returns the differences allowed."""
    stored = read_manifest(plan.output) if existing_parts(plan.output) else None
    if stored is None:
        write_sidecar(plan.output, manifest)
        return []
    diffs = differences(stored, manifest)
    if diffs and not plan.allow_mismatch:
        raise ConfigError(f"--resume: {plan.output} was written with other settings:\n  " + "\n  ".join(diffs)
                          + "\nrun with the output's settings, or add --allow-mismatch to mix them in one output")
    if diffs:  # the output now mixes settings: say so in its manifest (`specgen stats` shows it)
        write_sidecar(plan.output, {**stored, "mixed": [*stored.get("mixed", []), *diffs]})
    return diffs


def context_len(loaded: Any, engine_cfg: Any) -> int:
    """The engine's context: the model's, capped by max_model_len when that is set."""
    ctx = loaded.config.max_position_embeddings
    return min(ctx, engine_cfg.max_model_len) if engine_cfg.max_model_len else ctx


def request_source(plan_input: Path, fmt: str, loaded: Any, cfg: RunConfig, records: Iterable[RawRecord] | None = None,
                   **kwargs: Any) -> RequestSource:
    """The input's requests; `records`: these instead of the whole file (a sample of it)."""
    return RequestSource(
        records=iter_records(plan_input, fmt) if records is None else records, encode=partial(encode_prompt, loaded),
        sampling=cfg.sampling,
        context_len=context_len(loaded, cfg.engine), vocab_size=loaded.config.vocab_size, unit=unit_name(fmt),
        **kwargs,
    )


class Interrupts:
    """SIGTERM and SIGINT during a run: the first raises Stopped where the run is (admitting, in a forward), or
    right after the record being written, so a record is never half written; what is finished stays written.
    A second one (a Parquet output being finalized) raises again at once: the journal stays for --resume."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self.count = 0  # signals received
        self._holding = False
        self._abort_at = 0  # while holding: the signal count that aborts the block anyway (0: none does)
        self._pending = False

    def _handle(self, signum: int, frame: Any) -> None:
        self.signum = self.signum or signum
        self.count += 1
        if self._holding and not (self._abort_at and self.count >= self._abort_at):
            self._pending = True
            return
        raise Stopped(self.signum)

    @contextmanager
    def installed(self) -> Iterator["Interrupts"]:
        if threading.current_thread() is not threading.main_thread():
            yield self
            return
        previous = {s: signal.signal(s, self._handle) for s in (signal.SIGTERM, signal.SIGINT)}
        try:
            yield self
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)

    @contextmanager
    def held(self, abortable: bool = False) -> Iterator[None]:
        """Signals wait until the block is done; `abortable`: a second signal (counting one that came before the
        block) aborts it."""
        self._holding = True
        self._abort_at = self.count + 1 if abortable and self.count else (2 if abortable else 0)
        try:
            yield
        finally:
            self._holding = False
            self._abort_at = 0
            if self._pending:
                self._pending = False
                raise Stopped(self.signum)


def run_job(plan: JobPlan, loaded: Any, cfg: RunConfig, progress: RunProgress) -> JobResult:
    """Stream the input through the engine, writing records as they finish. Stopped (a signal), OutputError
    (a failed write) and WorkerError (a dead worker) leave every record written before them on disk, and say how
    many."""
    interrupts = Interrupts()
    with interrupts.installed():
        try:
            if cfg.parallel.ray:
                from specgen.distributed.ray_job import run_on_ray

                return run_on_ray(plan, loaded, cfg, progress, interrupts)
            return _run(plan, loaded, cfg, progress, interrupts)
        except Stopped as exc:
            raise Stopped(exc.signum, f"{_count_written(plan.output)} records are in {plan.output}") from None
        except (OutputError, WorkerError) as exc:
            raise type(exc)(f"{exc}; {_count_written(plan.output)} records are safely in {plan.output}") from None


class RecordWriter:
    """The job's one writer: each record to the output (a signal waits until it is whole), the summary and the
    progress. Under --on-error fail an error record stops the run instead (InputError, exit 2)."""

    def __init__(self, plan: JobPlan, progress: RunProgress, interrupts: Interrupts):
        self.sink, self.done = open_sink(plan.output, plan.resume)  # done: the ids the output holds already
        self.fail = plan.on_error == "fail"
        self.progress, self.interrupts = progress, interrupts
        self.acc = SummaryAccumulator()
        self.completed = len(self.done)

    def add(self, record: dict[str, Any]) -> None:
        if record["error"] is not None:
            if self.fail:
                raise InputError(record["error"])
            self.progress.record_error(record["error"])
        with self.interrupts.held():
            self.sink.write(record)
        self.acc.add(record)
        self.completed += 1
        self.progress.update(self.acc, self.completed)

    def close(self) -> None:
        with self.interrupts.held(abortable=True):  # a Parquet merge: the first signal waits for it, a second aborts
            self.sink.close()


def _run(plan: JobPlan, loaded: Any, cfg: RunConfig, progress: RunProgress, interrupts: Interrupts) -> JobResult:
    unit = unit_name(plan.input_format)
    total = count_records(plan.input, plan.input_format)
    writer = RecordWriter(plan, progress, interrupts)

    def on_bad(record_id: str, message: str, num_prompt_tokens: int | None) -> None:
        writer.add(error_record(record_id, message, cfg.spec, num_prompt_tokens))

    source = request_source(plan.input, plan.input_format, loaded, cfg, done_ids=writer.done, on_bad=on_bad)
    start = time.perf_counter()
    try:
        progress.start(total, completed=min(len(writer.done), total))
        with job_engine(loaded, cfg, progress) as engine:
            for out in engine.run(source):
                message = None if out.error is None else f"{unit} {out.index}: {out.error}"
                writer.add(result_record(out, cfg.spec, error=message))
            memory = engine.memory()
    finally:
        writer.close()
    return JobResult(writer.acc.summary(time.perf_counter() - start, **memory), source.num_skipped)


@contextmanager
def job_engine(loaded: Any, cfg: RunConfig, progress: RunProgress) -> Iterator[Any]:
    """The job's engine: one here, or --data-parallel-size workers, or --tensor- / --expert-parallel-size ranks,
    behind the same run/memory contract (their processes end with the block)."""
    par = cfg.parallel
    if par.tensor_parallel_size > 1 or par.expert_parallel_size > 1:
        from specgen.distributed.tensor_parallel import TensorParallelEngine

        ep = par.expert_parallel_size > 1
        with TensorParallelEngine(loaded.source, loaded.engine, cfg.engine, cfg.spec,
                                  par.expert_parallel_size if ep else par.tensor_parallel_size, loaded.config,
                                  expert_parallel=ep) as engine:
            yield engine
        return
    if cfg.parallel.pd:
        from specgen.distributed.disaggregated import DisaggregatedEngine

        with DisaggregatedEngine(loaded.source, loaded.engine, cfg.engine, cfg.spec,
                                 *cfg.parallel.pd_workers) as engine:
            yield engine
        return
    if cfg.parallel.data_parallel_size > 1:
        from specgen.distributed.data_parallel import DataParallelEngine

        with DataParallelEngine(loaded.source, loaded.engine, cfg.engine, cfg.spec,
                                cfg.parallel.data_parallel_size) as engine:
            yield engine
        return
    engine = make_engine(loaded, cfg.engine, cfg.spec)
    full = engine.kv_need(np.full(cfg.engine.batch_size, engine.context_len))
    if full > engine.kv_budget:
        progress.note(f"the KV cache at {cfg.engine.batch_size} slots x {engine.context_len} positions would need "
                      f"{gib(full)}, over its budget of {gib(engine.kv_budget)}; a request that would take it past "
                      f"the budget stops the run (exit 7; {engine.memory_advice()})")
    yield engine


def _count_written(output: Path) -> str:
    """Records the output holds now, read back from disk (a torn last line is trimmed, as --resume would)."""
    try:
        return str(len(done_ids(output)))
    except (OSError, SpecgenError):
        return "an unknown number of"
