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


class Message(NamedTuple):
    rank: int
    kind: str  # OUTPUT | READY | DONE (payload: the target's return value) | FAILED (payload: the exception)
    payload: Any


def thread_shares(total: int, num_workers: int) -> list[int]:
    """`total` threads over the workers, the remainder to the first ranks, at least one each."""
    base, extra = divmod(total, num_workers)
    return [max(1, base + (rank < extra)) for rank in range(num_workers)]


class Worker:
    """The worker's side: its spec, the shared task queue and the way back."""

    def __init__(self, spec: WorkerSpec, tasks: Any, results: Any):
        self.spec, self._tasks, self._results = spec, tasks, results

    def tasks(self):
        """Tasks until the group's end marker (None)."""
        while (task := self._tasks.get()) is not None:
            yield task

    def send(self, payload: Any) -> None:
        self._results.put(Message(self.spec.rank, OUTPUT, payload))

    def ready(self) -> None:
        """Say that start-up (loading a model) is over: WorkerGroup.wait_ready returns once every worker has."""
        self._results.put(Message(self.spec.rank, READY, None))


Target = Callable[[Worker, Any], Any]  # (worker, the group's argument) -> the DONE payload


def _worker_main(target: Target, spec: WorkerSpec, tasks: Any, results: Any, arg: Any) -> None:
    """A worker process: the parent handles SIGINT / SIGTERM and ends its workers itself (a Ctrl-C reaches the
    whole process group); a worker whose parent died exits rather than compute for nobody."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    parent = mp.parent_process()
    if parent is not None:
        threading.Thread(target=lambda: (parent.join(), os._exit(1)), daemon=True, name="specgen-orphan").start()
    try:
        done = target(Worker(spec, tasks, results), arg)
    except SpecgenError as exc:
        results.put(Message(spec.rank, FAILED, exc))
    except Exception as exc:  # noqa: BLE001 (a bug: its traceback travels as text; not every exception pickles)
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
    survive a fork). Tasks go to one shared queue (a worker with room takes the next); messages come back on
    one queue. `receive` raises the error a worker sent, or WorkerError for a worker that died."""

    def __init__(self, target: Target, arg: Any, threads: list[int], what: str = "worker"):
        ctx = mp.get_context("spawn")
        self.what = what
        self.tasks, self.results = ctx.Queue(), ctx.Queue()
        n = len(threads)
        self.specs = [WorkerSpec(rank, n, t) for rank, t in enumerate(threads)]
        self.procs = [ctx.Process(target=_worker_main, args=(target, s, self.tasks, self.results, arg),
                                  name=f"specgen-{what.replace(' ', '-')}-{s.rank}", daemon=True)
                      for s in self.specs]
        self.finished: dict[int, Any] = {}  # rank -> its DONE payload
        self.num_ready = 0

    def start(self) -> WorkerGroup:
        for p in self.procs:
            p.start()
        return self

    def submit(self, task: Any) -> None:
        self.tasks.put(task)

    def end_tasks(self) -> None:
        """No more tasks: each worker's task iterator ends."""
        for _ in self.procs:
            self.tasks.put(None)

    @property
    def all_done(self) -> bool:
        return len(self.finished) == len(self.procs)

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
                raise WorkerError(f"{self.what} {spec.rank} of {spec.world_size} (pid {p.pid}) {_death(p.exitcode)}")

    def close(self) -> None:
        """End every worker still running (SIGKILL: a worker holds nothing that must be saved) and reap it."""
        for p in self.procs:
            if p.is_alive():
                p.kill()
        for p in self.procs:
            if p.pid is not None:
                p.join()
        for q in (self.tasks, self.results):
            q.cancel_join_thread()  # tasks nobody will take must not hold the parent at exit
            q.close()

    def __enter__(self) -> WorkerGroup:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
