"""Prefill/decode disaggregation (--pd 1:1) against one engine with chunked prefill: the default model, plain
decoding.

    OMP_NUM_THREADS=2 python benchmarks/disaggregated.py --rounds 2

One job, the same for every arm, in three groups, read in this order:
  decoders  --decoders short prompts that generate --decode-tokens tokens each (they are decoding when the
            rest arrives);
  long      --long prompts of --long-tokens tokens (Spec-Bench questions repeated), --short-tokens
            tokens each;
  short     --short short prompts queued behind the long ones, --short-tokens tokens each.
Every request generates exactly its tokens (ignore_eos), greedy; --batch-size slots hold the whole job at
once, and a step admits prompts while --max-prefill-tokens lasts (every arm), so the long prompts arrive one
or two a step while the decoders decode.

Arms (each with 2 threads in all), alternated round by round:
  colo        one engine, 2 threads, whole prompts prefilled in a step, beside the decoding slots;
  colo-chunk  the same with --prefill-chunk (prompt chunks mixed into decode steps);
  pd          --pd 1:1: a prefill worker and a decode worker of 1 thread each (workers timed from the first
              request handed out; their start-up apart).
Reported per arm: the job's wall time and output tok/s; decode-side step time (median and p90, ms) of steps
with prompt tokens mixed in and of steps without (pd: the decode worker's steps, all without); time to first
token (median, s from the job's start) of the long prompts and of the short ones queued behind them; for pd
each hand-off's bytes (the main KV cache; with the drafter's state) and its export (prefill side, into shared
memory), import (decode side, into its cache) and wait (from export to import: the queues, a free decode
slot). Last, the transports alone on --transport-mib sizes: shared memory's two copies (what a hand-off does)
and paddle.distributed send/recv over gloo (two processes, loopback TCP: the transport a hand-off between
machines would use).
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import socket
import time

import numpy as np
from common import DATA, machine, print_table


def texts(n: int, tokens_min: int, offset: int) -> list[str]:
    lines = [json.loads(x) for x in (DATA / "spec_bench" / "question.jsonl").read_text().splitlines()
             if x.strip()]
    out = []
    for i in range(n):
        text = ""
        j = offset + i * 7
        while len(text) < tokens_min * 4:  # ~4 characters a token; cut to the token count after encoding
            text += lines[j % len(lines)]["turns"][0] + "\n"
            j += 1
        out.append(text)
    return out


def job(loaded, args) -> list:
    from specgen.api import encode_prompt
    from specgen.config import SamplingParams
    from specgen.engine.types import Request

    groups = [("decoders", args.decoders, 24, args.decode_tokens), ("long", args.long, args.long_tokens,
                                                                     args.short_tokens),
              ("short", args.short, 16, args.short_tokens)]
    reqs = []
    for name, n, prompt_tokens, max_tokens in groups:
        for i, text in enumerate(texts(n, prompt_tokens, len(reqs))):
            ids = encode_prompt(loaded, text)[:prompt_tokens]
            reqs.append(Request(f"{name}{i}", len(reqs), ids,
                                SamplingParams(max_tokens=max_tokens, ignore_eos=True)))
    return reqs


def colocated(loaded, reqs, batch: int, chunk: int, budget: int = 4096) -> dict:
    """One engine of 2 threads in this process: wall, tok/s, step times by kind, first-token times."""
    from specgen.api import make_engine
    from specgen.config import EngineConfig, SpecConfig

    engine = make_engine(loaded, EngineConfig(batch_size=batch, threads=2, prefill_chunk=chunk,
                                              max_prefill_tokens=budget), SpecConfig())
    steps, first = [], {}
    step, t = engine.step, engine.table

    def timed_step():
        prefilling = bool((t.active & ~t.prefilled).any())
        before = t.active & ~t.prefilled
        s0 = time.perf_counter()
        out = step()
        steps.append((time.perf_counter() - s0, prefilling))
        now = time.perf_counter()
        for slot in np.nonzero(before & (t.prefilled | ~t.active))[0]:
            req = engine.requests[slot]
            if req is not None:
                first.setdefault(req.id, now)
        for o, _ in out:
            first.setdefault(o.id, now)
        return out

    engine.step = timed_step
    start = time.perf_counter()
    tokens = sum(len(o.token_ids) for o in engine.run(reqs))
    wall = time.perf_counter() - start
    return {"wall": wall, "tok_s": tokens / wall, "mixed": [s for s, p in steps if p],
            "pure": [s for s, p in steps if not p], "first": {k: v - start for k, v in first.items()}}


def disaggregated(loaded, reqs, batch: int, chunk: int, budget: int) -> dict:
    from specgen.config import EngineConfig, SpecConfig
    from specgen.distributed.disaggregated import DisaggregatedEngine

    s0 = time.perf_counter()
    cfg = EngineConfig(batch_size=batch, threads=2, prefill_chunk=chunk, max_prefill_tokens=budget)
    with DisaggregatedEngine(loaded.source, loaded.engine, cfg, SpecConfig(), 1, 1) as pd:
        ready = time.perf_counter()
        wall0 = time.time()
        tokens = sum(len(o.token_ids) for o in pd.run(reqs))
        wall = time.perf_counter() - ready
        timings, steps = pd.timings(), pd.decode_steps()
    return {"wall": wall, "tok_s": tokens / wall, "mixed": [], "pure": [s for s, _ in steps],
            "first": {h.request_id: h.sent - wall0 for h in timings}, "handoffs": timings,
            "start": ready - s0}


def ms(xs: list[float], q: float) -> float | None:
    return float(np.quantile(xs, q)) * 1e3 if xs else None


def med(xs) -> float | None:
    xs = list(xs)
    return float(np.median(xs)) if xs else None


def _gloo_rank(rank: int, endpoints: list[str], sizes: list[int], repeats: int, out) -> None:
    import paddle

    os.environ.update(PADDLE_TRAINER_ID=str(rank), PADDLE_TRAINERS_NUM="2",
                      PADDLE_TRAINER_ENDPOINTS=",".join(endpoints), PADDLE_CURRENT_ENDPOINT=endpoints[rank],
                      PADDLE_DISTRI_BACKEND="gloo")
    paddle.set_device("cpu")
    paddle.distributed.init_parallel_env()
    result = []
    warm = paddle.zeros([1024], "float16")
    for _ in range(2):  # the pair's first messages connect it
        paddle.distributed.send(warm, dst=1) if rank == 0 else paddle.distributed.recv(warm, src=0)
    for size in sizes:
        x = paddle.ones([size // 2], "float16") if rank == 0 else paddle.zeros([size // 2], "float16")
        times = []
        for _ in range(repeats):
            paddle.distributed.barrier()
            s0 = time.perf_counter()
            if rank == 0:
                paddle.distributed.send(x, dst=1)
            else:
                paddle.distributed.recv(x, src=0)
            paddle.distributed.barrier()  # the receiver has it
            times.append(time.perf_counter() - s0)
        result.append(float(np.median(times)))
    if rank == 0:
        out.put(result)


def shm_hand_off(sizes: list[int], repeats: int = 5) -> list[tuple[float, float]]:
    """Median seconds of a hand-off's two copies through shared memory, in this process: pack (a new segment,
    the array copied in) and unpack (the segment's view copied into an array allocated once, as a decode
    worker's cache is), for `sizes` bytes of float32."""
    from specgen.distributed.parcel import pack, unpack

    result = []
    for size in sizes:
        src, dst = np.ones(size // 4, np.float32), np.zeros(size // 4, np.float32)
        times = []
        for _ in range(repeats):
            s0 = time.perf_counter()
            parcel = pack({"kv": src}, "specgen-bench")
            s1 = time.perf_counter()
            with unpack(parcel) as arrays:
                dst[:] = arrays["kv"]
            times.append((s1 - s0, time.perf_counter() - s1))
        result.append(tuple(np.median(np.array(times), axis=0).tolist()))
    return result


def gloo_send_recv(sizes: list[int], repeats: int = 5) -> list[float]:
    """Median seconds to move `sizes` bytes from one process to another with paddle.distributed send/recv
    (gloo, loopback), each send bracketed by barriers."""
    socks = [socket.socket() for _ in range(2)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    endpoints = [f"127.0.0.1:{s.getsockname()[1]}" for s in socks]
    for s in socks:
        s.close()
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_gloo_rank, args=(r, endpoints, sizes, repeats, out)) for r in range(2)]
    for p in procs:
        p.start()
    result = out.get(timeout=300)
    for p in procs:
        p.join()
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--decoders", type=int, default=12)
    ap.add_argument("--decode-tokens", type=int, default=48)
    ap.add_argument("--long", type=int, default=6)
    ap.add_argument("--long-tokens", type=int, default=1024)
    ap.add_argument("--short", type=int, default=6)
    ap.add_argument("--short-tokens", type=int, default=8)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--max-prefill-tokens", type=int, default=1024,
                    help="prompt tokens admitted per step (every arm)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--arms", default="colo,colo-chunk,pd",
                    help="comma-separated; empty: only the transports")
    ap.add_argument("--transport-mib", default="0.7,1,33", help="sizes the transports move (empty: none)")
    args = ap.parse_args()
    from specgen import load_model

    print(machine())
    loaded = load_model(None, threads=2)
    reqs = job(loaded, args)
    colocated(loaded, reqs[:4], 4, 0)  # warm-up: first-call costs out of the timings
    print(f"{len(reqs)} requests: {args.decoders} decoders x {args.decode_tokens} tokens, {args.long} "
          f"prompts of {args.long_tokens} tokens, {args.short} short prompts behind them; "
          f"batch {args.batch_size}")
    budget = args.max_prefill_tokens
    arms = {"colo": lambda: colocated(loaded, reqs, args.batch_size, 0, budget),
            "colo-chunk": lambda: colocated(loaded, reqs, args.batch_size, args.chunk, budget),
            "pd": lambda: disaggregated(loaded, reqs, args.batch_size, 0, budget)}
    rows, handoffs = [], []
    for r in range(args.rounds):
        for name in filter(None, args.arms.split(",")):
            res = arms[name]()
            first = res["first"]
            rows.append([name, r + 1, res["wall"], res["tok_s"], ms(res["pure"], 0.5), ms(res["pure"], 0.9),
                         len(res["pure"]), ms(res["mixed"], 0.5), ms(res["mixed"], 0.9), len(res["mixed"]),
                         med(v for k, v in first.items() if k.startswith("long")),
                         med(v for k, v in first.items() if k.startswith("short"))])
            handoffs += res.get("handoffs", [])
            print_table(["arm", "round", "wall (s)", "tok/s", "pure p50", "pure p90", "n", "mixed p50",
                         "mixed p90", "n", "TTFT long", "TTFT short"], rows[-1:])
            print(machine(), flush=True)
    if handoffs:
        print("\nhand-offs (pd arm, all rounds): per prompt group, medians")
        table = []
        for group in ("decoders", "long", "short"):
            hs = [h for h in handoffs if h.request_id.startswith(group)]
            if hs:
                kv = med(h.kv_bytes for h in hs)
                table.append([group, len(hs), kv / 2**20, kv / med(len(r.prompt_ids) for r in reqs
                                                                    if r.id.startswith(group)) / 1024,
                              med(h.parcel_bytes for h in hs) / 2**20,
                              med(h.export_seconds * 1e3 for h in hs),
                              med(h.import_seconds * 1e3 for h in hs), med(h.wait_seconds * 1e3 for h in hs)])
        print_table(["group", "n", "KV MiB", "KiB/token", "parcel MiB", "export ms", "import ms", "wait ms"],
                    table)
    sizes = [int(float(x) * 2**20) for x in args.transport_mib.split(",")] if args.transport_mib else []
    if sizes:
        print("\nthe same bytes moved between processes, median ms: shared memory's two copies (pack into a "
              "new segment, unpack into an array), in one process alone; paddle.distributed send/recv over "
              "gloo (2 processes, loopback TCP, barriers around each)")
        copies = shm_hand_off(sizes)
        moved = gloo_send_recv(sizes)
        print_table(["MiB", "shm pack", "shm unpack", "gloo send/recv"],
                    [[n / 2**20, a * 1e3, b * 1e3, t * 1e3] for n, (a, b), t in zip(sizes, copies, moved)])
        print(machine())


if __name__ == "__main__":
    main()
