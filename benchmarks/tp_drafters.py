"""Drafters under --tensor-parallel-size: rank 0 runs an MTP head on its own full copy of the model
(replicated, tensor_parallel.py). What that costs per step, against what a head sharded like the main model
would add.

    OMP_NUM_THREADS=1 python benchmarks/tp_drafters.py --batch-sizes 1 8 --tokens 24

The default model and its shipped MTP head, the reference backend (the one tensor parallelism runs), 1 thread
(a rank's share of 2): a job of --batch-sizes requests of --tokens tokens each, every draft verified (no
controller, k = 3). `main step`: the engine's forward per step; `head per step`: the MtpProposer's observe per
step (its catch-up pass and 3 chained drafts: 3 LM-head products), on rank 0 as it runs replicated. A head
sharded over 2 ranks would at best halve that compute, but each of its passes (the catch-up, then each chained
draft: 3 per step) would add the collectives the main model's shards make: an all-reduce after the embedding
lookup, two in its block, and the vocabulary-parallel LM head's gather: 4 per pass, 12 per step, timed here as
lone all-reduces of [batch, hidden] float32 between 2 processes (`sharding adds`), against the half of the
head's time it could save.
"""
from __future__ import annotations

import argparse
import dataclasses
import time

from common import machine, print_table
from tensor_parallel import lone_allreduce


def head_cost(loaded, batch: int, tokens: int) -> tuple[float, float, int]:
    """(main forward seconds per step, the head's observe seconds per step, steps) of one job."""
    from specgen.api import encode_prompt, make_engine
    from specgen.config import EngineConfig, SamplingParams, SpecConfig
    from specgen.engine.types import Request

    engine = make_engine(loaded, EngineConfig(batch_size=batch, threads=1, backend="reference"),
                         SpecConfig(method="mtp", adaptive=False))
    prompt = encode_prompt(loaded, "Write a short story about a lighthouse keeper and a storm.")
    reqs = [Request(f"r{i}", i, prompt, SamplingParams(max_tokens=tokens, ignore_eos=True))
            for i in range(batch)]
    spent = {"head": 0.0, "main": 0.0, "steps": 0}
    observe, forward = engine.proposer.observe, engine.model.forward

    def timed_observe(update):
        start = time.perf_counter()
        observe(update)
        spent["head"] += time.perf_counter() - start

    def timed_forward(*args, **kwargs):
        start = time.perf_counter()
        out = forward(*args, **kwargs)
        spent["main"] += time.perf_counter() - start
        spent["steps"] += 1
        return out

    engine.proposer.observe = timed_observe
    engine.model.forward = timed_forward
    for _ in engine.run(reqs):
        pass
    n = spent["steps"]
    return spent["main"] / n, spent["head"] / n, n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--tokens", type=int, default=24)
    args = ap.parse_args()
    from specgen import load_model
    from specgen.config import SpecConfig
    from specgen.distributed.tensor_parallel import CommandChannel, RankJob, free_endpoints

    print(machine())
    loaded = load_model(None, threads=1, backend="reference")
    head_cost(loaded, 1, 4)  # warm-up
    job = RankJob(loaded.source, loaded.engine, loaded.engine, SpecConfig(), free_endpoints(2),
                  CommandChannel.make(2))
    lone = lone_allreduce(dataclasses.replace(job, endpoints=free_endpoints(2),
                                              commands=CommandChannel.make(2)),
                          args.batch_sizes, loaded.config.hidden_size)
    rows = []
    for batch in args.batch_sizes:
        main_s, head_s, steps = head_cost(loaded, batch, args.tokens)
        adds = 12 * lone[batch]
        rows.append([batch, steps, main_s * 1e3, head_s * 1e3, head_s / main_s, lone[batch] * 1e3, adds * 1e3,
                     head_s / 2 * 1e3])
    print_table(["batch", "steps", "main step ms", "head per step ms", "head / main", "1 all-reduce ms",
                 "sharding adds ms", "sharding saves <= ms"], rows)
    print(machine())


if __name__ == "__main__":
    main()
