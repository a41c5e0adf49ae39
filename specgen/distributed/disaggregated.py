"""--pd P:D: prefill/decode disaggregation on one machine. P prefill workers compute each prompt's KV cache,
the drafter's state (an MTP head's cache, a draft model's cache, Medusa's guesses; n-gram needs only the
tokens) and the first token; they hand the request to one of D decode workers, which run the speculative
decode loop. Prompt processing then never shares a forward with decoding: a decode step's time no longer jumps
when a long prompt is admitted beside it.

The hand-off moves through shared memory (parcel.py): the prefill worker copies the slot's K/V rows (a shared
prompt prefix's rows first: the decode worker holds them as the slot's own) and the drafter's rows into one
segment, and sends its name, the slot's table row and the request to the parent, which passes it to the decode
pool's queue; the decode worker with a free slot copies it into its caches and frees the segment. Each side is
an Engine (PrefillEngine, DecodeEngine) with its own scheduler over its own slots.

The parent reads and tokenizes the input and writes every record, as for --data-parallel-size: one output
file, resumable, each id once. Tokens are the colocated engine's: the KV rows and the first token are what the
colocated engine computes, and each output position samples with its own counter-based noise."""
from __future__ import annotations

import dataclasses
import os
import secrets
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from specgen.config import EngineConfig, SpecConfig
from specgen.distributed.data_parallel import POLL_SECONDS, worker_engines
from specgen.distributed.launch import Worker, WorkerGroup
from specgen.distributed.parcel import Parcel, pack, sweep, unpack
from specgen.engine.engine import Engine
from specgen.engine.scheduler import Scheduler
from specgen.engine.types import Request, RequestOutput

PREFILL, DECODE = 0, 1  # the worker pools


@dataclass(frozen=True)
class Handoff:
    """A request a prefill worker computed the prompt of, on its way to a decode worker."""

    request: Request
    row: dict[str, np.ndarray]  # its SlotTable row (SlotTable.export_row): tokens, lengths, sampling,
    # ... statistics
    parcel: Parcel  # "kv.{j}": the main cache's tensor j [num_kv_heads, prompt_len, head_dim] (K layers,
    # then V); "draft.{key}": the drafter's state (its proposer's export_slot)
    kv_bytes: int  # the main cache's share of the parcel
    export_seconds: float  # the prefill worker's copy into shared memory
    sent: float  # time.time() when it was packed
    # a request asking for log-probabilities: those of its output so far (LogprobTable's rows from its prompt
    # length to its length; from position 1, its prompt's too, for prompt_logprobs): logprob [n], top ids
    # [n, top], top logprobs [n, top], ranks [n]
    logprobs: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None = None
    logprobs_from: int = 0  # the position of the first


@dataclass(frozen=True)
class HandoffTiming:
    """What one hand-off cost, as the decode worker saw it."""

    request_id: str
    sent: float  # time.time() the prefill worker packed it: the request's first token was known then
    kv_bytes: int
    parcel_bytes: int  # KV and drafter state
    export_seconds: float
    import_seconds: float  # the decode worker's copy into its caches
    wait_seconds: float  # from the prefill worker's pack to the decode worker's import (queues, a free slot)


class PrefillEngine(Engine):
    """An engine whose slots leave it as soon as their prompt is in the cache and their first token is chosen:
    each step's newly prefilled slots become Handoffs, yielded by `run` beside the outputs of requests that
    ended at their first token (or were rejected)."""

    tag = "specgen-pd"  # shared-memory segments' prefix (parcel.sweep frees what a killed worker left)

    def step(self) -> list[tuple[Any, int]]:
        finished = super().step()
        t = self.table
        return finished + [(self.hand_off(int(s)), int(s)) for s in np.nonzero(t.active & t.prefilled)[0]]

    def hand_off(self, slot: int) -> Handoff:
        """Pack `slot`'s KV rows and drafter state into shared memory and free the slot."""
        start = time.perf_counter()
        t = self.table
        seq_len = int(t.seq_len[slot])
        shared = int(t.prefix_len[slot]) if self.prefix_ids is not None else 0
        kv = self.cache.export_slot(slot, seq_len - 1, shared)
        arrays: dict[str, Any] = {f"kv.{j}": pieces for j, pieces in enumerate(kv)}
        export = getattr(self.proposer, "export_slot", None)
        if export is not None:
            arrays.update({f"draft.{key}": value for key, value in export(slot, seq_len).items()})
        parcel = pack(arrays, self.tag)
        row = t.export_row(slot)
        row["prefix_len"] = np.array(0)  # the shared prefix's rows travel as the slot's own
        req = self.requests[slot]
        logprobs, first = None, 1 if t.prompt_logprobs[slot] else int(t.prompt_len[slot])
        if t.logprobs[slot] or t.prompt_logprobs[slot]:
            lt, top = self.logprob_table, max(int(t.top_logprobs[slot]), int(t.prompt_top[slot]))
            out = slice(first, seq_len)
            logprobs = (lt.logprob[slot, out].copy(), lt.top_ids[slot, out, :top].copy(),
                        lt.top_logprobs[slot, out, :top].copy(), lt.rank[slot, out].copy())
        t.active[slot] = False
        self.requests[slot] = None
        if self.grammars is not None:
            self.grammars.release(slot)
        kv_bytes = sum(p.nbytes for pieces in kv for p in pieces)
        return Handoff(req, row, parcel, kv_bytes, time.perf_counter() - start, time.time(), logprobs, first)


class DecodeEngine(Engine):
    """An engine whose requests arrive prefilled (Handoffs): a free slot takes one, its rows copied into the
    caches and its table row set, and it decodes from its next step on. `ready` says whether the next hand-off
    is waiting: running slots never wait for one."""

    def __init__(self, *args: Any, ready: Callable[[], bool] | None = None, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.ready = ready
        self.timings: list[HandoffTiming] = []
        self.steps: list[tuple[float, int]] = []  # (seconds, decoding slots) of every step (the benchmark's)

    def step(self) -> list[tuple[RequestOutput, int]]:
        start, active = time.perf_counter(), int(self.table.active.sum())
        finished = super().step()
        self.steps.append((time.perf_counter() - start, active))
        return finished

    def _scheduler(self, requests: Iterable[Handoff]) -> Scheduler:
        return Scheduler(requests, self.config.batch_size, self.config.max_prefill_tokens, ready=self.ready,
                         cost=lambda handoff: 0)

    def _admit(self, slot: int, h: Handoff) -> None:
        start = time.perf_counter()
        req, end = h.request, int(h.row["max_len"])
        self.kv_memory.admit(slot, req.id, len(req.prompt_ids), end)
        with unpack(h.parcel) as arrays:
            self.cache.import_slot(slot, [arrays[f"kv.{j}"] for j in range(2 * self.cache.num_layers)])
            load = getattr(self.proposer, "import_slot", None)
            if load is not None:
                load(slot, {k[len("draft."):]: v for k, v in arrays.items() if k.startswith("draft.")},
                     self.config.batch_size)
        self.table.import_row(slot, h.row)
        self._set_lists(slot, req)
        self.requests[slot] = req
        # its grammar advanced by the first token
        why = self._grammar_rejection(req) or self._constrain(slot, req)
        if why is not None:
            return self._fail(slot, why)
        if h.logprobs is not None:
            n = len(h.logprobs[0])
            self._logprob_room(req).write(np.full(n, slot), h.logprobs_from + np.arange(n), *h.logprobs)
        self.requests[slot] = req
        if self.controller is not None:
            self.controller.reset(slot)
        self.timings.append(HandoffTiming(req.id, h.sent, h.kv_bytes, h.parcel.nbytes, h.export_seconds,
                                          time.perf_counter() - start, time.time() - h.sent))
        return None


def make_pd_engine(loaded: Any, engine: EngineConfig, spec: SpecConfig, role: int,
                   tag: str = PrefillEngine.tag, ready: Callable[[], bool] | None = None) -> Engine:
    """A prefill (role PREFILL) or decode engine over a loaded model. The prefill side drafts nothing (its
    proposer only catches up on the prompt and prepares the first drafts, k of them) and shares a prompt
    prefix; the decode side chooses drafts with the adaptive controller, measured before the first request
    comes."""
    from specgen.api import make_engine

    if role == PREFILL:
        eng = make_engine(loaded, engine, dataclasses.replace(spec, adaptive=False),
                          engine_class=PrefillEngine)
        eng.tag = tag
        eng.ready = ready
        return eng
    eng = make_engine(loaded, dataclasses.replace(engine, shared_prefix="off"), spec,
                      engine_class=DecodeEngine, ready=ready)
    if eng.adaptive:
        eng._start(engine.batch_size)
    return eng


@dataclass(frozen=True)
class PDJob:
    """What a worker needs to build its engine (sent once, pickled)."""

    model: str  # the checkpoint's path (LoadedModel.source)
    load: EngineConfig  # the settings the parent loaded it with
    engine: EngineConfig  # the job's batch settings (each worker's KV budget)
    spec: SpecConfig
    tag: str  # the job's shared-memory prefix


def serve(worker: Worker, job: PDJob) -> dict[str, Any]:
    """A worker of either pool: load the model with its thread share, run what it takes (prompts, or
    hand-offs), send each item out (hand-offs and outputs from a prefill worker, outputs from a decode
    worker)."""
    from specgen.api import load_model

    threads = worker.spec.threads
    loaded = load_model(job.model, dataclasses.replace(job.load, threads=threads))
    engine = make_pd_engine(loaded, dataclasses.replace(job.engine, threads=threads), job.spec,
                            worker.spec.pool, job.tag, worker.has_task)
    worker.ready()
    for item in engine.run(worker.tasks()):
        worker.send(item)
    return {"pool": worker.spec.pool, "memory": engine.memory(), "timings": getattr(engine, "timings", []),
            "steps": getattr(engine, "steps", [])}


class DisaggregatedEngine:
    """Engine.run's contract (requests in, outputs out as they finish) over P prefill and D decode workers. At
    most `max_in_flight` requests are out at once: a batch per prefill worker and two per decode worker (its
    slots and the hand-offs waiting for them, whose KV sits in shared memory meanwhile)."""

    def __init__(self, model: str, load: EngineConfig, engine: EngineConfig, spec: SpecConfig, prefill: int,
                 decode: int):
        threads, shared = worker_engines(engine, prefill + decode)
        self.tag = f"specgen-pd-{os.getpid()}-{secrets.token_hex(3)}"
        self.group = WorkerGroup(serve, PDJob(model, load, shared, spec, self.tag), threads,
                                 pools=[("prefill worker", prefill), ("decode worker", decode)])
        self.max_in_flight = (prefill + 2 * decode) * engine.batch_size

    def __enter__(self) -> DisaggregatedEngine:
        """Start the workers and wait until each has loaded its model (a load error is raised here)."""
        self.group.start()
        try:
            self.group.wait_ready()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """End the workers; free the hand-offs nobody took (a killed worker's, a stopped job's)."""
        self.group.close()
        sweep(self.tag)

    def run(self, requests: Iterable[Request]) -> Iterator[RequestOutput]:
        g = self.group
        source, in_flight, more, decode_open = iter(requests), 0, True, True
        while more or in_flight or not g.all_done:
            while more and in_flight < self.max_in_flight:
                req = next(source, None)
                if req is None:
                    more = False
                    g.end_tasks(PREFILL)
                else:
                    g.submit(req, PREFILL)
                    in_flight += 1
            if decode_open and not more and g.pool_done(PREFILL):  # every hand-off has been passed on
                g.end_tasks(DECODE)
                decode_open = False
            msg = g.receive(POLL_SECONDS)
            if msg is None:
                continue
            if isinstance(msg.payload, Handoff):
                g.submit(msg.payload, DECODE)
                continue
            in_flight -= 1
            yield msg.payload

    def memory(self) -> dict[str, Any]:
        """The workers' KV cache peaks, summed (prefill and decode caches both)."""
        peaks = [done["memory"] for done in self.group.finished.values()]
        return {k: sum(p[k] for p in peaks) for k in (peaks[0] if peaks else {})}

    def timings(self) -> list[HandoffTiming]:
        """Every hand-off's cost, from the decode workers (once they are done)."""
        return [t for done in self.group.finished.values() for t in done["timings"]]

    def decode_steps(self) -> list[tuple[float, int]]:
        """(seconds, decoding slots) of every decode worker's steps (once they are done)."""
        return [s for done in self.group.finished.values() for s in done["steps"]]
