"""Expert parallelism's communication per step: benchmarks/moe.py's random ERNIE-4.5-21B-A3B-shaped MoE (64
experts top-6, 2 shared, hidden 320, 6 layers) over 2 ranks of 1 thread (--expert-parallel-size 2: experts
0-31 and 32-63 whole, attention heads, shared experts and vocabulary sharded), against one process of 2
threads on the same (reference) backend.

    OMP_NUM_THREADS=2 python benchmarks/expert_parallel.py --batch-sizes 1 32 --tokens 1 4 --steps 10 \
        --rounds 3

Each step is one forward of batch x tokens at position --context, greedy (each rank's best token, one small
all-gather). Per step, rank 0's collectives by kind: `embedding` (the vocabulary-parallel lookup's sum),
`attention` (after each block's o rows), `mlp` (after each block's MLP: for a routed block the experts'
outputs scattered back to their tokens, with the shared experts' columns), `vocab` (the greedy pick's gather);
bytes are what rank 0 puts into them (its tensor's size; an all-reduce of 2 ranks moves about that much each
way), ms the time in them, waiting for the other rank included. Arms alternate within each round; each keeps
its fastest.
"""
from __future__ import annotations

import argparse
import dataclasses
import tempfile
import time
from pathlib import Path

import numpy as np
from common import machine, print_table
from moe import write_model

KINDS = ("embedding", "attention", "mlp", "vocab")


def step_batch(batch: int, tokens: int, context: int, vocab: int):
    from specgen.runtime.batch import build_forward_batch

    rng = np.random.default_rng(0)
    return build_forward_batch(np.arange(batch, dtype=np.int64), np.full(batch, context, np.int64),
                               np.full(batch, tokens, np.int64), rng.integers(0, vocab, batch * tokens),
                               np.ones(batch, bool))


def time_steps(model, batch: int, tokens: int, steps: int, context: int) -> tuple[float, dict]:
    """(seconds per step, {kind: (collectives, bytes, seconds) per step}) of `steps` forwards after a
    prefill."""
    from specgen.runtime.batch import build_forward_batch

    cache = model.new_cache(batch, context + tokens + 1)
    rng = np.random.default_rng(1)
    model.forward(build_forward_batch(np.arange(batch, dtype=np.int64), np.zeros(batch, np.int64),
                                      np.full(batch, context, np.int64),
                                      rng.integers(0, model.config.vocab_size, batch * context),
                                      np.zeros(batch, bool)), cache, logits=False)
    fb = step_batch(batch, tokens, context, model.config.vocab_size)
    model.forward(fb, cache, logits=False)  # warm-up
    traffic = getattr(model.backend, "traffic", {})
    before = {k: dataclasses.astuple(t) for k, t in traffic.items()}
    start = time.perf_counter()
    for _ in range(steps):
        model.forward(fb, cache, logits=False)
    elapsed = time.perf_counter() - start
    per = {k: tuple((a - b) / steps for a, b in zip(dataclasses.astuple(t), before.get(k, (0, 0, 0.0))))
           for k, t in traffic.items()}
    return elapsed / steps, per


def rank_main(worker, job) -> None:
    """A rank: rank 0 times the steps it is asked for (its forwards sent to the other rank, which follows)."""
    from tensor_parallel import serve_timings

    serve_timings(worker, job, time_steps)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--context", type=int, default=64)
    a = ap.parse_args()

    import paddle

    from specgen.api import load_model
    from specgen.config import EngineConfig, SpecConfig
    from specgen.distributed.launch import WorkerGroup
    from specgen.distributed.tensor_parallel import CommandChannel, RankJob, free_endpoints

    print(machine())
    path = write_model(Path(tempfile.mkdtemp(prefix="specgen-ep-")) / "moe", True)
    load = EngineConfig(backend="reference")
    ref = load_model(str(path), dataclasses.replace(load, threads=2)).model
    job = RankJob(str(path), load, load, SpecConfig(), free_endpoints(2), CommandChannel.make(2))
    tasks = [(b, t, a.steps, a.context) for b in a.batch_sizes for t in a.tokens]
    best: dict[tuple, dict[str, tuple]] = {task: {} for task in tasks}
    with WorkerGroup(rank_main, job, [1, 1], "expert-parallel rank") as group:
        group.wait_ready()
        for _ in range(a.rounds):
            for task in tasks:
                for arm in ("ref", "ep"):
                    if arm == "ep":
                        group.submit(task)
                        while (msg := group.receive(1.0)) is None:
                            pass
                        got = msg.payload
                    else:
                        paddle.base.core.set_num_threads(2)
                        got = time_steps(ref, *task)
                    if arm not in best[task] or got[0] < best[task][arm][0]:
                        best[task][arm] = got
        group.end_tasks()
    rows = []
    for (b, t, _, _), arms in best.items():
        step, per = arms["ep"]
        comm = sum(v[2] for v in per.values())
        cells = [f"{per[k][0]:.0f} / {per[k][1] / 1024:.1f} / {1e3 * per[k][2]:.1f}" if k in per else "-"
                 for k in KINDS]
        rows.append([b, t, 1e3 * arms["ref"][0], 1e3 * step, step / arms["ref"][0],
                     sum(v[1] for v in per.values()) / 1024, 1e3 * comm, comm / step, *cells])
    print("per step; by kind: collectives / KiB / ms")
    print_table(["batch", "tokens", "ref 1x2 ms", "ep 2x1 ms", "ep/ref", "KiB", "comm ms", "comm share",
                 *KINDS], rows)
    print(machine())


if __name__ == "__main__":
    main()
