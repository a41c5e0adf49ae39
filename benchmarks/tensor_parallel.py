"""Tensor parallelism on this machine: the default model's step time over 2 ranks of 1 thread against 1
process of 2 threads, and what the all-reduces take.

    python benchmarks/tensor_parallel.py --batch-sizes 1 8 32 --tokens 1 4 --steps 20 --rounds 3

Each step is one forward of --batch-sizes slots x --tokens tokens (1: decode, 4: a verify block of 3 drafts)
at position --context, greedy (no logits gathered: each rank's best token, then one small all-gather). Arms:
`fused 1x2` (specgen's fused CPU forward, the default backend, 2 threads), `ref 1x2` (the reference backend,
the one tensor parallelism runs, 2 threads), `tp 2x1` (--tensor-parallel-size 2: two rank processes of 1
thread each, the reference backend on each shard). Arms alternate within each round; each keeps its fastest
round (a shared machine). `comm ms` is the time rank 0 spends in collectives per step (the all-reduces after
the embedding and after each block's o and down products, and the greedy all-gather: `colls`), waiting for the
other rank included; `1 all-reduce ms` one all-reduce of the step's [tokens, hidden] rows alone (two processes
doing nothing else).
"""
from __future__ import annotations

import argparse
import dataclasses
import time

import numpy as np
from common import machine, print_table


def time_steps(model, batch: int, tokens: int, steps: int, context: int) -> tuple[float, float, int]:
    """(seconds per step, seconds in collectives per step, collectives per step) of `steps` forwards."""
    from specgen.runtime.batch import build_forward_batch

    cache = model.new_cache(batch, context + tokens + 1)
    rng = np.random.default_rng(0)
    fb = build_forward_batch(np.arange(batch, dtype=np.int64), np.full(batch, context, np.int64),
                             np.full(batch, tokens, np.int64),
                             rng.integers(0, model.config.vocab_size, batch * tokens).astype(np.int64),
                             np.ones(batch, bool))
    backend = model.backend
    model.forward(fb, cache, logits=False)  # warm-up
    comm0, colls0 = getattr(backend, "comm_seconds", 0.0), getattr(backend, "num_collectives", 0)
    start = time.perf_counter()
    for _ in range(steps):
        model.forward(fb, cache, logits=False)
    elapsed = time.perf_counter() - start
    comm = getattr(backend, "comm_seconds", 0.0) - comm0
    colls = getattr(backend, "num_collectives", 0) - colls0
    return elapsed / steps, comm / steps, colls // steps


def rank_main(worker, job) -> None:
    """A rank: rank 0 times the steps it is asked for (its forwards broadcast to the other rank, which
    follows)."""
    serve_timings(worker, job, time_steps)


def serve_timings(worker, job, timer) -> None:
    """A rank of a timing job: rank 0 sends timer(model, *task) for each task; the other ranks follow its
    forwards (benchmarks/expert_parallel.py's ranks too)."""
    from specgen.distributed.tensor_parallel import follow, join_group, load_rank

    spec = worker.spec
    join_group(spec.rank, job)
    model, _, _ = load_rank(job, spec.rank, spec.world_size, spec.threads)
    worker.ready()
    if spec.rank:
        follow(model, model.backend)
        return
    try:
        for task in worker.tasks():
            worker.send(timer(model, *task))
    finally:
        model.backend.stop()


def allreduce_main(worker, arg) -> dict[int, float]:
    """Both ranks: all-reduces alone, in lockstep: {rows: seconds per all-reduce of [rows, hidden]
    float32}."""
    import paddle

    from specgen.distributed.tensor_parallel import join_group

    job, sizes, hidden, reps = arg
    join_group(worker.spec.rank, job)
    out = {}
    for rows in sizes:
        x = paddle.ones([rows, hidden], "float32")
        paddle.distributed.all_reduce(x)
        start = time.perf_counter()
        for _ in range(reps):
            paddle.distributed.all_reduce(x)
        out[rows] = (time.perf_counter() - start) / reps
    worker.ready()
    return out


def lone_allreduce(job, sizes: list[int], hidden: int, reps: int = 100) -> dict[int, float]:
    from specgen.distributed.launch import WorkerGroup

    with WorkerGroup(allreduce_main, (job, sizes, hidden, reps), [1, 1], "all-reduce rank") as group:
        group.wait_ready()
        while not group.all_done:
            group.receive(0.5)
        return group.finished[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--context", type=int, default=128)
    a = ap.parse_args()

    from specgen.api import load_model
    from specgen.config import EngineConfig, SpecConfig
    from specgen.distributed.launch import WorkerGroup
    from specgen.distributed.tensor_parallel import CommandChannel, RankJob, free_endpoints

    print(machine())
    fused = load_model(None, EngineConfig(threads=2, backend="fused")).model
    ref = load_model(None, EngineConfig(threads=2, backend="reference"))
    load = EngineConfig(backend="reference")
    job = RankJob(ref.source, load, load, SpecConfig(), free_endpoints(2), CommandChannel.make(2))
    tasks = [(b, t, a.steps, a.context) for b in a.batch_sizes for t in a.tokens]
    lone = lone_allreduce(dataclasses.replace(job, endpoints=free_endpoints(2),
                                              commands=CommandChannel.make(2)),
                          sorted({b * t for b, t, _, _ in tasks}), ref.config.hidden_size)
    best: dict[tuple, dict[str, tuple]] = {task: {} for task in tasks}
    with WorkerGroup(rank_main, job, [1, 1], "tensor-parallel rank") as group:
        group.wait_ready()
        import paddle

        for _ in range(a.rounds):
            for task in tasks:
                for arm, model in (("fused", fused), ("ref", ref.model), ("tp", None)):
                    if model is None:
                        group.submit(task)
                        while (msg := group.receive(1.0)) is None:
                            pass
                        got = msg.payload
                    else:
                        paddle.base.core.set_num_threads(2)
                        got = time_steps(model, *task)
                    if arm not in best[task] or got[0] < best[task][arm][0]:
                        best[task][arm] = got
        group.end_tasks()
    rows = []
    for (b, t, _, _), arms in best.items():
        f, r, tp = arms["fused"][0], arms["ref"][0], arms["tp"]
        rows.append([b, t, 1e3 * f, 1e3 * r, 1e3 * tp[0], tp[0] / r, tp[0] / f, 1e3 * tp[1], tp[2],
                     1e3 * (tp[0] - tp[1]), 1e3 * lone[b * t]])
    print_table(["batch", "tokens", "fused 1x2 ms", "ref 1x2 ms", "tp 2x1 ms", "tp/ref", "tp/fused",
                 "comm ms", "colls", "tp - comm ms", "1 all-reduce ms"], rows)
    print(machine())


if __name__ == "__main__":
    main()
