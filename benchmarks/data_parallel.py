"""Data parallelism on one machine, and Ray's cost per record: the default model, plain decoding.

    python benchmarks/data_parallel.py --batch-sizes 32 256 --max-tokens 32 --rounds 2

Throughput (output tok/s, every request generating exactly --max-tokens tokens) of one engine with 2 threads
(in this process) against 1 and 2 worker processes of 1 thread each (--data-parallel-size), each engine with
--batch-size slots; a job is --batches x batch-size Spec-Bench prompts (cut to --prompt-chars characters), the
same for every configuration; with --rounds the three arms alternate. Workers are timed from the first request
handed out (their model loads before it, and is reported apart). Ray: `specgen run --ray local` jobs of
--ray-records and 32 records (1 worker, 1 thread, batch 32, 8 tokens each), against the same jobs run by one
local worker process: the difference of their per-record slopes is Ray's overhead per record (reading,
shipping rows to the worker and records back, writing), the intercepts its start-up.
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from common import DATA, machine, print_table


def prompts(n: int, chars: int = 400) -> list[dict]:
    lines = [json.loads(x) for x in (DATA / "spec_bench" / "question.jsonl").read_text().splitlines()
             if x.strip()]
    return [{"id": f"q{i}", "messages": [{"role": "user",
                                          "content": lines[(i * 37) % len(lines)]["turns"][0][:chars]}]}
            for i in range(n)]


def requests(loaded, n: int, max_tokens: int, chars: int = 400):
    from specgen.api import encode_prompt
    from specgen.config import SamplingParams
    from specgen.engine.types import Request

    sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    return [Request(p["id"], i, encode_prompt(loaded, p["messages"]), sp)
            for i, p in enumerate(prompts(n, chars))]


def one_engine(loaded, reqs, batch: int) -> float:
    from specgen.api import make_engine
    from specgen.config import EngineConfig, SpecConfig

    engine = make_engine(loaded, EngineConfig(batch_size=batch, threads=2), SpecConfig())
    start = time.perf_counter()
    tokens = sum(len(o.token_ids) for o in engine.run(reqs))
    return tokens / (time.perf_counter() - start)


def workers(loaded, reqs, batch: int, n: int) -> tuple[float, float]:
    """(tok/s from the first request handed out, seconds the workers took to start)."""
    from specgen.config import EngineConfig, SpecConfig
    from specgen.distributed.data_parallel import data_parallel_engine

    start = time.perf_counter()
    with data_parallel_engine(loaded.source, loaded.engine, EngineConfig(batch_size=batch, threads=n),
                              SpecConfig(), n) as dp:
        ready = time.perf_counter()
        tokens = sum(len(o.token_ids) for o in dp.run(reqs))
        return tokens / (time.perf_counter() - ready), ready - start


def job_seconds(loaded, inp: Path, out: Path, ray: str, size: int) -> float:
    """The wall time of a `specgen run` job (its summary's: the engines' start-up included, not Ray's
    init)."""
    from specgen.app.job import run_job
    from specgen.app.settings import resolve
    from specgen.io.job_output import plan_job
    from specgen.io.report import run_progress

    cfg = resolve(None, {"max_tokens": 8, "ignore_eos": True, "batch_size": 32, "threads": 1,
                         "data_parallel_size": size, "ray": ray})
    plan = plan_job(inp, out, None, False, "skip")
    with plan.lock, run_progress(True) as progress:
        return run_job(plan, loaded, cfg, progress).summary.wall_time_s


def ray_overhead(loaded, records: int) -> list[list[object]]:
    """Per-record slope and intercept of Ray jobs and of one local worker's (a 1-worker data_parallel_engine:
    one process of 1 thread, as a Ray worker is) over jobs of 32 and `records` records."""
    import ray

    ray.init(include_dashboard=False, log_to_driver=False, logging_level="ERROR")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        times: dict[str, list[float]] = {"ray": [], "local": []}
        sizes = (32, records)
        for n in sizes:
            inp = Path(tmp) / f"in{n}.jsonl"
            inp.write_text("".join(json.dumps(p) + "\n" for p in prompts(n)))
            times["ray"].append(job_seconds(loaded, inp, Path(tmp) / f"ray{n}.jsonl", "auto", 1))
            # a 1-worker local job: run_job keeps one engine in this process, so time a worker process
            # directly
            reqs = requests(loaded, n, 8)
            tok_s, startup = workers(loaded, reqs, 32, 1)
            times["local"].append(n * 8 / tok_s + startup)
        for name, (t_small, t_big) in times.items():
            slope = (t_big - t_small) / (sizes[1] - sizes[0])
            rows.append([name, t_small, t_big, slope * 1e3, t_small - slope * sizes[0]])
    ray.shutdown()
    rows.append(["ray - local", None, None, rows[0][3] - rows[1][3], rows[0][4] - rows[1][4]])
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[32, 256])
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=1,
                    help="times each batch size's three arms run, alternated")
    ap.add_argument("--batches", type=int, default=2, help="a job is this many x batch-size requests")
    ap.add_argument("--prompt-chars", type=int, default=400, help="each prompt cut to this many characters")
    ap.add_argument("--ray-records", type=int, default=288, help="records of the larger Ray job (0: no Ray)")
    args = ap.parse_args()
    from specgen import load_model

    print(machine())
    loaded = load_model(None, threads=2)
    one_engine(loaded, requests(loaded, 4, 2), 4)  # warm-up: first-call costs out of the timings
    print(f"plain decoding, {args.max_tokens} tokens per request; output tok/s; x: ratio to one engine "
          f"of 2 threads")
    for batch in args.batch_sizes:
        reqs = requests(loaded, args.batches * batch, args.max_tokens, args.prompt_chars)
        for r in range(args.rounds):  # the arms alternate round by round (a shared machine's load drifts)
            base = one_engine(loaded, reqs, batch)
            w1, s1 = workers(loaded, reqs, batch, 1)
            w2, s2 = workers(loaded, reqs, batch, 2)
            row = [batch, r + 1, len(reqs), base, w1, w2, w1 / base, w2 / base, s1, s2]
            print_table(["batch", "round", "requests", "1 engine x 2 thr", "1 worker x 1 thr",
                         "2 workers x 1 thr", "1 worker x", "2 workers x", "start 1 (s)", "start 2 (s)"],
                        [row])
            print(machine(), flush=True)  # the load changes: say it after each row
    if args.ray_records:
        print(f"\nRay Data (local instance, 1 worker of 1 thread, batch 32, 8 tokens per record) against "
              f"one local worker process: job seconds at 32 and {args.ray_records} records, the slope per "
              f"record, the intercept")
        print_table(["", "s @32", f"s @{args.ray_records}", "ms / record", "start-up (s)"],
                    ray_overhead(loaded, args.ray_records))


if __name__ == "__main__":
    main()
