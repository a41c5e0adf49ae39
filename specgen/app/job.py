"""The batch job: input records -> engine -> output records, written as they finish, resumable."""
from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Any

from specgen import __version__
from specgen.api import encode_prompt, make_engine
from specgen.config import DRAFTERS, RunConfig, SpecConfig
from specgen.errors import ConfigError, OutputError, SpecgenError, Stopped, WorkerError
from specgen.io.interrupts import Interrupts
from specgen.io.job_output import JobPlan, JobResult, RecordWriter
from specgen.io.manifest import content_hash, differences, read_manifest, write_sidecar
from specgen.io.openai_output import TEXT, SampleGroups, openai_line
from specgen.io.outputs import done_ids, existing_parts, output_format
from specgen.io.readers import RawRecord, count_records, iter_records, unit_name
from specgen.io.report import RunProgress
from specgen.io.requests import RequestSource
from specgen.io.schema import error_record, result_record
from specgen.layers.sampling import SAMPLER_VERSION
from specgen.models.loaded import context_len


def run_manifest(loaded: Any, cfg: RunConfig) -> dict[str, Any]:
    """The settings that decide the output records: the model (path and content hash), the precision and
    backend it runs with, sampling, and the method with its settings. Batch size and threads do not change a
    token, so they are not in it."""
    e = loaded.engine
    return {
        "specgen_version": __version__,
        "model": {"path": str(Path(loaded.source).resolve()),
                  "sha256": content_hash(loaded.source, e.cache_root())},
        "engine": {"dtype": e.dtype, "kv_cache_dtype": cfg.engine.kv_cache_dtype,
                   "quantization": e.quantization,
                   "matmul": e.matmul, "backend": loaded.model.backend.name,
                   "max_model_len": cfg.engine.max_model_len},
        # the sampler's version: a new one samples other tokens than the last (plain decoding and speculation
        # still agree), so an output is not resumed across it
        "sampling": {**json.loads(json.dumps(dataclasses.asdict(cfg.sampling))), "sampler": SAMPLER_VERSION},
        "speculative": method_settings(cfg.spec),
    }


def method_settings(spec: SpecConfig) -> dict[str, Any]:
    """The method, its bound on drafts and its own settings (not those of the methods not run, nor `adaptive`,
    which chooses among drafts and cannot change a token)."""
    out: dict[str, Any] = {"method": spec.method.value, "num_speculative_tokens": spec.num_speculative_tokens}
    section = DRAFTERS[spec.method].section
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
                          + "\nrun with the output's settings, or add --allow-mismatch "
                            "to mix them in one output")
    if diffs:  # the output now mixes settings: say so in its manifest (`specgen stats` shows it)
        write_sidecar(plan.output, {**stored, "mixed": [*stored.get("mixed", []), *diffs]})
    return diffs


def request_source(plan_input: Path, fmt: str, loaded: Any, cfg: RunConfig,
                   records: Iterable[RawRecord] | None = None, **kwargs: Any) -> RequestSource:
    """The input's requests; `records`: these instead of the whole file (a sample of it)."""
    return RequestSource(
        records=iter_records(plan_input, fmt) if records is None else records,
        encode=partial(encode_prompt, loaded),
        sampling=cfg.sampling,
        context_len=context_len(loaded, cfg.engine), vocab_size=loaded.config.vocab_size, unit=unit_name(fmt),
        max_n=cfg.engine.batch_size, **kwargs,
    )


def run_job(plan: JobPlan, loaded: Any, cfg: RunConfig, progress: RunProgress) -> JobResult:
    """Stream the input through the engine, writing records as they finish. Stopped (a signal), OutputError
    (a failed write) and WorkerError (a dead worker) leave every record written before them on disk, and say
    how many."""
    interrupts = Interrupts()
    with interrupts.installed():
        try:
            if cfg.parallel.ray:
                from specgen.distributed.ray_job import run_on_ray

                if plan.output_style == "openai":
                    raise ConfigError("--output-format openai is not written by --ray (a Parquet output)")

                return run_on_ray(plan, loaded, cfg, progress, interrupts)
            return _run(plan, loaded, cfg, progress, interrupts)
        except Stopped as exc:
            raise Stopped(exc.signum, f"{_count_written(plan.output)} records are in {plan.output}") from None
        except (OutputError, WorkerError) as exc:
            raise type(exc)(f"{exc}; {_count_written(plan.output)} records are safely in "
                            f"{plan.output}") from None


def _run(plan: JobPlan, loaded: Any, cfg: RunConfig, progress: RunProgress,
         interrupts: Interrupts) -> JobResult:
    unit = unit_name(plan.input_format)
    total = count_records(plan.input, plan.input_format)
    writer = RecordWriter(plan, progress, interrupts)

    shaped = _Shaper(plan, loaded)

    def on_bad(record_id: str, message: str, num_prompt_tokens: int | None, openai: bool) -> None:
        record = error_record(record_id, message, cfg.spec, num_prompt_tokens)
        writer.add(record, shaped(record, TEXT, openai, 1))

    source = request_source(plan.input, plan.input_format, loaded, cfg, done_ids=writer.done, on_bad=on_bad)
    start = time.perf_counter()
    try:
        progress.start(total, completed=min(len(writer.done), total))
        with job_engine(loaded, cfg, progress) as engine:
            for out in engine.run(source):
                message = None if out.error is None else f"{unit} {out.index}: {out.error}"
                record = result_record(out, cfg.spec, error=message)
                writer.add(record, shaped(record, out.api, out.openai, out.num_samples))
            writer.write_lines(shaped.rest())
            memory = engine.memory()
    finally:
        writer.close()
    return JobResult(writer.acc.summary(time.perf_counter() - start, **memory), source.num_skipped)


class _Shaper:
    """(native record, api, from an OpenAI line, the request's samples) -> the lines to write in its place:
    the record itself, or (--output-format, JobPlan.output_style) an OpenAI line once the request's samples
    are all done (none before). OpenAI lines name the model by its file or folder."""

    def __init__(self, plan: JobPlan, loaded: Any):
        self.native = plan.output_style == "native" or output_format(plan.output) == "parquet"
        self.every = plan.output_style == "openai"
        self.model, self.created = Path(loaded.source).name, int(time.time())
        self.groups, self.apis = SampleGroups(), {}

    def __call__(self, record: dict[str, Any], api: str, openai: bool,
                 num_samples: int) -> list[dict[str, Any]]:
        if self.native or not (openai or self.every):
            return [record]
        done = self.groups.add(record, num_samples)
        self.apis[record["id"]] = api
        if done is None:
            return []
        return [openai_line(done, self.apis.pop(record["id"]), self.model, self.created)]

    def rest(self) -> list[dict[str, Any]]:
        """The lines of requests whose samples never all came (SampleGroups.rest)."""
        return [openai_line(g, self.apis.pop(g[0]["id"], TEXT), self.model, self.created)
                for g in self.groups.rest()]


@contextmanager
def job_engine(loaded: Any, cfg: RunConfig, progress: RunProgress) -> Iterator[Any]:
    """The job's engine: one here, or --data-parallel-size workers, or --tensor- / --expert-parallel-size
    ranks, behind the same run/memory contract (their processes end with the block)."""
    par = cfg.parallel
    if par.world_size > 1:
        from specgen.distributed.tensor_parallel import tensor_parallel_engine

        with tensor_parallel_engine(loaded.source, loaded.engine, cfg.engine, cfg.spec, par.world_size,
                                    loaded.config, expert_parallel=par.expert_parallel_size > 1) as engine:
            yield engine
        return
    if par.pd:
        from specgen.distributed.disaggregated import DisaggregatedEngine

        with DisaggregatedEngine(loaded.source, loaded.engine, cfg.engine, cfg.spec,
                                 *par.pd_workers) as engine:
            yield engine
        return
    if par.data_parallel_size > 1:
        from specgen.distributed.data_parallel import data_parallel_engine

        with data_parallel_engine(loaded.source, loaded.engine, cfg.engine, cfg.spec,
                                  par.data_parallel_size) as engine:
            yield engine
        return
    engine = make_engine(loaded, cfg.engine, cfg.spec)
    warning = engine.kv_memory.warning(cfg.engine.batch_size)
    if warning is not None:
        progress.note(warning)
    yield engine


def _count_written(output: Path) -> str:
    """Records the output holds now, read back from disk (a torn last line is trimmed, as --resume would)."""
    try:
        return str(len(done_ids(output)))
    except (OSError, SpecgenError):
        return "an unknown number of"
