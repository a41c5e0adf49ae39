"""`specgen run --ray ADDRESS`: the job on Ray Data, across the machines of a Ray cluster.

Ray Data reads the input in chunks (specgen's own readers, so records keep their line numbers and a bad line
becomes an error record naming it), `map_batches` runs them through a stateful Predictor (one engine per Ray
worker, `concurrency` = --data-parallel-size, `num_gpus` = 1 where there are GPUs), and the driver writes the
records in input order through the same sink as `specgen run`: the same schema, summary, manifest, lock and
--resume (the ids already written are skipped by every worker). The input path must be readable on every node.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import time
from dataclasses import dataclass
from functools import partial
from typing import Any

from specgen.config import RAY_LOCAL, EngineConfig, RunConfig, SamplingParams, SpecConfig
from specgen.errors import ConfigError, WorkerError
from specgen.io.ids import SeenIds
from specgen.io.interrupts import Interrupts
from specgen.io.job_output import JobPlan, JobResult, RecordWriter
from specgen.io.outputs import record_key
from specgen.io.readers import Chunk, RawRecord, chunks, count_records, iter_chunk, unit_name
from specgen.io.report import RunProgress
from specgen.io.requests import RequestSource
from specgen.io.schema import error_record, result_record
from specgen.models.loaded import context_len

BATCHES_PER_CALL = 4  # engine batches per Predictor call: slots stay full, a call's drained tail is short


@dataclass(frozen=True)
class RayJob:
    """What each Ray worker needs (pickled once per worker)."""

    model: str
    load: EngineConfig
    engine: EngineConfig
    spec: SpecConfig
    sampling: SamplingParams
    unit: str  # line | row
    done: SeenIds  # ids the output holds already (--resume)


def read_rows(chunk: dict[str, Any]) -> list[dict[str, Any]]:
    """A chunk's records as rows Ray can carry: the number, the record as JSON text (or why it is
    unreadable)."""
    rows = []
    for raw in iter_chunk(Chunk(**chunk)):
        value, error = None, raw.error
        if error is None:
            try:
                value = json.dumps(raw.value, ensure_ascii=False)
            except (TypeError, ValueError) as exc:  # a Parquet value JSON cannot hold (bytes, a date)
                error = f"a value JSON cannot hold ({exc})"
        rows.append({"number": raw.number, "value": value, "error": error})
    return rows


class Predictor:
    """Ray Data's stateful callable: a worker's engine, built once; input rows -> output records
    (+ number)."""

    def __init__(self, job: RayJob):
        from specgen.api import load_model, make_engine

        self.job = job
        self.loaded = load_model(job.model, job.load)
        self.engine = make_engine(self.loaded, job.engine, job.spec)

    def __call__(self, batch: Any) -> Any:
        import pyarrow as pa

        from specgen.api import encode_prompt
        from specgen.io.schema import arrow_schema

        job, current, records = self.job, [0], []

        def numbered():
            for row in batch.to_pylist():
                current[0] = row["number"]
                value = json.loads(row["value"]) if row["value"] is not None else None
                yield RawRecord(row["number"], value, row["error"])

        def on_bad(record_id: str, message: str, num_prompt_tokens: int | None, openai: bool) -> None:
            records.append({**error_record(record_id, message, job.spec, num_prompt_tokens),
                            "number": current[0]})

        source = RequestSource(records=numbered(), encode=partial(encode_prompt, self.loaded),
                               sampling=job.sampling, context_len=context_len(self.loaded, job.engine),
                               vocab_size=self.loaded.config.vocab_size, unit=job.unit, done_ids=job.done,
                               on_bad=on_bad, max_n=job.engine.batch_size)
        for out in self.engine.run(source):
            message = None if out.error is None else f"{job.unit} {out.index}: {out.error}"
            records.append({**result_record(out, job.spec, error=message), "number": out.index})
        records.sort(key=lambda r: r["number"])
        return pa.Table.from_pylist(records, schema=arrow_schema().append(pa.field("number", pa.int64())))


def connect(address: str) -> bool:
    """Join the cluster at `address`, or start a local instance; True if this call started Ray."""
    try:
        import ray
    except ImportError:
        raise ConfigError("--ray needs Ray: pip install 'specgen[ray]'") from None
    if ray.is_initialized():
        return False
    ray.init(address=None if address == RAY_LOCAL else address, include_dashboard=False, log_to_driver=False,
             logging_level="ERROR", configure_logging=True)
    return True


def run_on_ray(plan: JobPlan, loaded: Any, cfg: RunConfig, progress: RunProgress,
               interrupts: Interrupts) -> JobResult:
    """The job on Ray Data (run_job calls it: signals and errors leave what was written, as in a local
    run)."""
    import ray

    started = connect(cfg.parallel.ray)
    writer = RecordWriter(plan, progress, interrupts)
    unit = unit_name(plan.input_format)
    written = SeenIds()  # this run's ids: a later duplicate becomes an error record, as in a local run
    start = time.perf_counter()
    try:
        total = count_records(plan.input, plan.input_format)
        progress.start(total, completed=min(len(writer.done), total))
        for batch in _dataset(plan, loaded, cfg, writer.done).iter_batches(batch_size=None,
                                                                           batch_format="pyarrow"):
            for record in batch.to_pylist():
                number = record.pop("number")
                if record_key(record) in written:  # (a record's samples share its id)
                    record = error_record(record["id"], f"{unit} {number}: duplicate id {record['id']!r}",
                                          cfg.spec)
                written.add(record_key(record), number)
                writer.add(record)
    except ray.exceptions.RayError as exc:
        raise WorkerError(f"a Ray worker failed: {str(exc).strip().splitlines()[0]}") from None
    finally:
        writer.close()
        if started:
            ray.shutdown()
    return JobResult(writer.acc.summary(time.perf_counter() - start), len(writer.done))


def _dataset(plan: JobPlan, loaded: Any, cfg: RunConfig, done: SeenIds):
    import ray
    import ray.data

    ctx = ray.data.DataContext.get_current()
    ctx.execution_options.preserve_order = True  # records arrive in input order: duplicates found as in a run
    ctx.enable_progress_bars = ctx.print_on_execution_start = False  # specgen's own progress says it
    logging.getLogger("ray.data").setLevel(logging.ERROR)
    threads = max(cfg.engine.threads, 1)
    engine = dataclasses.replace(cfg.engine, threads=threads)
    job = RayJob(loaded.source, dataclasses.replace(loaded.engine, threads=threads), engine, cfg.spec,
                 cfg.sampling, unit_name(plan.input_format), done)
    gpus = cfg.engine.device == "gpu" or (cfg.engine.device == "auto"
                                          and ray.cluster_resources().get("GPU", 0) > 0)
    # One block per chunk, and a chunk per Predictor call: blocks are what Ray hands out to its workers.
    parts = [dataclasses.asdict(c) for c in chunks(plan.input, plan.input_format,
                                                   BATCHES_PER_CALL * cfg.engine.batch_size)]
    return (ray.data.from_items(parts, override_num_blocks=max(len(parts), 1))
            .flat_map(read_rows, num_cpus=0)  # light next to the engines: it must not wait for their CPUs
            .map_batches(Predictor, fn_constructor_kwargs={"job": job},
                         batch_format="pyarrow", batch_size=None,
                         compute=ray.data.ActorPoolStrategy(size=cfg.parallel.data_parallel_size),
                         num_cpus=threads, num_gpus=1 if gpus else 0))
