"""--data-parallel-size N on one machine: N engines in worker processes behind the job's one reader and one
writer. The parent reads and tokenizes the input (so bad records name their line, as in a one-engine run),
hands requests to whichever worker has room, and writes every output itself: one file, resumable, each id
once. Tokens do not depend on the worker: sampling is counter-based per (seed, request id, position)."""
from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from specgen.config import EngineConfig, SpecConfig
from specgen.distributed.launch import Worker, WorkerGroup, thread_shares
from specgen.engine.types import Request, RequestOutput
from specgen.errors import EngineError
from specgen.runtime.kv_cache import available_memory

POLL_SECONDS = 0.1  # how often the parent looks for a dead worker while none has sent anything


@dataclass(frozen=True)
class EngineJob:
    """What a worker needs to build its engine (sent once, pickled): the checkpoint and the settings."""

    model: str  # the checkpoint's path (LoadedModel.source)
    load: EngineConfig  # the settings the parent loaded it with
    engine: EngineConfig  # the job's batch settings
    spec: SpecConfig


def serve(worker: Worker, job: EngineJob) -> dict[str, int]:
    """A worker: load the model with its thread share, run the requests it takes, send each output as it
    finishes; returns its KV cache peak (Engine.memory)."""
    from specgen.api import load_model, make_engine

    threads = worker.spec.threads
    loaded = load_model(job.model, dataclasses.replace(job.load, threads=threads))
    engine = make_engine(loaded, dataclasses.replace(job.engine, threads=threads), job.spec)
    worker.ready()
    for out in engine.run(worker.tasks()):
        worker.send(out)
    return engine.memory()


def worker_engines(engine: EngineConfig, world_size: int) -> tuple[list[int], EngineConfig]:
    """Each worker's threads (its share of `engine`'s) and the engine settings they share: the KV budget split
    too (the one given, or 90% of the memory available now), or every worker would count the same free
    memory."""
    budget = engine.kv_memory_limit() or int(0.9 * available_memory())
    return thread_shares(engine.num_threads(), world_size), dataclasses.replace(
        engine, max_kv_memory=str(max(budget // world_size, 1)))


class WorkerEngine:
    """Engine.run's contract (requests in, outputs out as they finish) over a WorkerGroup of one pool: each
    request goes to whichever worker takes it, at most `max_in_flight` out at once. `grace`: after a worker's
    EngineError, the seconds to look for a dead worker that caused it (a tensor-parallel rank whose collective
    broke under it), reported as that death instead (WorkerError)."""

    def __init__(self, group: WorkerGroup, max_in_flight: int, grace: float = 0.0):
        self.group, self.max_in_flight, self.grace = group, max_in_flight, grace

    def __enter__(self) -> WorkerEngine:
        """Start the workers and wait until each has loaded its model (a load error is raised here)."""
        self.group.start()
        try:
            self.group.wait_ready()
        except BaseException:
            self.group.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.group.close()

    def run(self, requests: Iterable[Request]) -> Iterator[RequestOutput]:
        try:
            yield from self._run(requests)
        except EngineError:
            deadline = time.monotonic() + self.grace
            while time.monotonic() < deadline:
                self.group.check_alive()  # raises WorkerError naming the dead worker
                time.sleep(0.1)
            raise

    def _run(self, requests: Iterable[Request]) -> Iterator[RequestOutput]:
        source, in_flight, more = iter(requests), 0, True
        while more or in_flight or not self.group.all_done:
            while more and in_flight < self.max_in_flight:
                req = next(source, None)
                if req is None:
                    more = False
                    self.group.end_tasks()
                else:
                    self.group.submit(req)
                    in_flight += 1
            msg = self.group.receive(POLL_SECONDS)
            if msg is not None:
                in_flight -= 1
                yield msg.payload

    def memory(self) -> dict[str, int]:
        """The workers' KV cache peaks (and an MoE model's tokens per expert), summed over those that report
        each."""
        peaks = list(self.group.finished.values())
        keys = dict.fromkeys(k for p in peaks for k in p)  # every key any worker reports, in order
        return {k: sum(p[k] for p in peaks if k in p) for k in keys}


def data_parallel_engine(model: str, load: EngineConfig, engine: EngineConfig, spec: SpecConfig,
                         world_size: int) -> WorkerEngine:
    """--data-parallel-size: `world_size` engines, each with its share of the threads and of the KV budget, at
    most two batches each out at once (slots stay full, memory stays bounded)."""
    threads, shared = worker_engines(engine, world_size)
    group = WorkerGroup(serve, EngineJob(model, load, shared, spec), threads, "data-parallel worker")
    return WorkerEngine(group, 2 * world_size * engine.batch_size)
