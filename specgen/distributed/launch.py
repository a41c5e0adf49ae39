"""Worker processes on this machine: start N with their rank and thread share, exchange messages, and turn a
dead worker into a WorkerError. Data parallelism uses it; tensor, expert and prefill/decode ranks can too."""
from __future__ import annotations

import multiprocessing as mp
import os
import queue
import signal
import threading
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

from specgen.errors import EngineError, SpecgenError, WorkerError

# What a worker's target receives, and what it sends back through `Worker.send`.
OUTPUT, READY, DONE, FAILED = "output", "ready", "done", "failed"


@dataclass(frozen=True)
class WorkerSpec:
    """A worker's place in its group."""

    rank: int  # 0 .. world_size - 1
    world_size: int
    threads: int  # its share of the CPU threads (EngineConfig.threads of the engine it runs)
    pool: int = 0  # which of the group's pools it serves (each pool has its own task queue; one unless told)
    pool_rank: int = 0  # its place in its pool
    pool_size: int = 1  # workers in its pool


class Message(NamedTuple):
    rank: int
    kind: str  # OUTPUT | READY | DONE (payload: the target's return value) | FAILED (payload: the exception)
    payload: Any


def thread_shares(total: int, world_size: int) -> list[int]:
    """`total` threads over the workers, the remainder to the first ranks, at least one each."""
    base, extra = divmod(total, world_size)
    return [max(1, base + (rank < extra)) for rank in range(world_size)]


class Worker:
    """The worker's side: its spec, the shared task queue and the way back."""

    def __init__(self, spec: WorkerSpec, tasks: Any, results: Any):
        self.spec, self._tasks, self._results = spec, tasks, results

    def tasks(self):
        """Tasks until the group's end marker (None)."""
        while (task := self._tasks.get()) is not None:
            yield task

    def has_task(self) -> bool:
        """Whether a task (or the end marker) is waiting: the next one comes without blocking."""
        return not self._tasks.empty()

    def send(self, payload: Any) -> None:
        self._results.put(Message(self.spec.rank, OUTPUT, payload))

    def ready(self) -> None:
        """Say that start-up (loading a model) is over: WorkerGroup.wait_ready returns once every worker
        has."""
        self._results.put(Message(self.spec.rank, READY, None))


Target = Callable[[Worker, Any], Any]  # (worker, the group's argument) -> the DONE payload


def _worker_main(target: Target, spec: WorkerSpec, tasks: Any, results: Any, arg: Any) -> None:
    """A worker process: the parent handles SIGINT / SIGTERM and ends its workers itself (a Ctrl-C reaches the
    whole process group); a worker whose parent died exits rather than compute for nobody."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    parent = mp.parent_process()
    if parent is not None:
        threading.Thread(target=lambda: (parent.join(), os._exit(1)), daemon=True,
                         name="specgen-orphan").start()
    try:
        done = target(Worker(spec, tasks, results), arg)
    except SpecgenError as exc:
        results.put(Message(spec.rank, FAILED, exc))
    except Exception as exc:  # noqa: BLE001
        # (a bug: its traceback travels as text; not every exception pickles)
        results.put(Message(spec.rank, FAILED, EngineError(
            f"worker {spec.rank} failed: {type(exc).__name__}: {exc}\n{traceback.format_exc()}")))
    else:
        results.put(Message(spec.rank, DONE, done))
    results.close()
    results.join_thread()  # every message is in the pipe before the process ends


def _death(exitcode: int) -> str:
    if exitcode < 0:
        try:
            return f"was killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"was killed by signal {-exitcode}"
    return f"exited with code {exitcode}"


class WorkerGroup:
    """N processes running `target(worker, arg)`, started with spawn (Paddle's threads and OpenMP pools do not
    survive a fork). Tasks go to one shared queue per pool (a worker with room takes the next); messages come
    back on one queue. `receive` raises the error a worker sent, or WorkerError for a worker that died.

    pools: (name, count) of each kind of worker, the ranks in that order (prefill workers, then decode
    workers); by default one pool of every worker, called `what`."""

    def __init__(self, target: Target, arg: Any, threads: list[int], what: str = "worker",
                 pools: list[tuple[str, int]] | None = None):
        ctx = mp.get_context("spawn")
        world_size = len(threads)
        self.pools = pools or [(what, world_size)]
        assert sum(count for _, count in self.pools) == world_size, "every worker in one pool"
        self.queues = [ctx.Queue() for _ in self.pools]  # each pool's tasks
        self.results = ctx.Queue()
        self.specs = [WorkerSpec(rank, world_size, t, pool, rank - first, count)
                      for rank, t, (pool, first, count) in zip(range(world_size), threads, self._ranks())]
        self.procs = [ctx.Process(target=_worker_main,
                                  args=(target, s, self.queues[s.pool], self.results, arg),
                                  name=f"specgen-{self.pools[s.pool][0].replace(' ', '-')}-{s.pool_rank}",
                                  daemon=True)
                      for s in self.specs]
        # held: a started Process drops its arguments, and a queue in them the parent drops is gone for the
        # child
        self.arg = arg
        self.finished: dict[int, Any] = {}  # rank -> its DONE payload
        self.num_ready = 0

    def _ranks(self) -> list[tuple[int, int, int]]:
        """(pool, its first rank, its size) of each rank."""
        out, first = [], 0
        for pool, (_, count) in enumerate(self.pools):
            out += [(pool, first, count)] * count
            first += count
        return out

    @property
    def tasks(self) -> Any:
        """The first pool's task queue."""
        return self.queues[0]

    def start(self) -> WorkerGroup:
        for p in self.procs:
            p.start()
        return self

    def submit(self, task: Any, pool: int = 0) -> None:
        self.queues[pool].put(task)

    def end_tasks(self, pool: int = 0) -> None:
        """No more tasks for the pool: each of its workers' task iterators ends."""
        for _ in range(self.pools[pool][1]):
            self.queues[pool].put(None)

    @property
    def all_done(self) -> bool:
        return len(self.finished) == len(self.procs)

    def pool_done(self, pool: int) -> bool:
        """Every worker of the pool has returned (its messages all received)."""
        return all(s.rank in self.finished for s in self.specs if s.pool == pool)

    def receive(self, timeout: float) -> Message | None:
        """The next OUTPUT message (None after `timeout` s without one); records DONE ones."""
        self.check_alive()
        try:
            msg = self.results.get(timeout=timeout)
        except queue.Empty:
            return None
        if msg.kind == FAILED:
            raise msg.payload
        if msg.kind == DONE:
            self.finished[msg.rank] = msg.payload
            return None
        if msg.kind == READY:
            self.num_ready += 1
            return None
        return msg

    def wait_ready(self) -> None:
        """Until every worker has called Worker.ready (its start-up errors, or its death, raise here)."""
        while self.num_ready < len(self.procs):
            msg = self.receive(timeout=1.0)
            assert msg is None, "a worker sent output before it was ready"

    def check_alive(self) -> None:
        """A worker that exited 0 has sent its last message (the queue is flushed before it exits)."""
        for spec, p in zip(self.specs, self.procs):
            if spec.rank not in self.finished and p.exitcode:
                raise WorkerError(f"{self.pools[spec.pool][0]} {spec.pool_rank} of {spec.pool_size} "
                                  f"(pid {p.pid}) {_death(p.exitcode)}")

    def close(self) -> None:
        """End every worker still running (SIGKILL: a worker holds nothing that must be saved) and reap it."""
        for p in self.procs:
            if p.is_alive():
                p.kill()
        for p in self.procs:
            if p.pid is not None:
                p.join()
        for q in (*self.queues, self.results):
            q.cancel_join_thread()  # tasks nobody will take must not hold the parent at exit
            q.close()

    def __enter__(self) -> WorkerGroup:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
