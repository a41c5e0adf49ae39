"""What a short job pays before and around its forwards, alternated in one run:

- its KV cache allocated uninitialized (the default on the fused kernels, KVCache(zeroed=False)) against
  zero-filled;
- with n-gram speculation, the controller's step-cost table read from disk (engine/cost_cache.py, as a rerun on
  the same machine finds it) against timed at start-up (SPECGEN_COST_CACHE=0).

    python benchmarks/engine_start.py [--batch-sizes 32 256] [--requests 8] [--max-tokens 16] [--repeats 3]

Each timing is one `generate` call of --requests 8-token prompts on the default model (a new engine, so a new
cache, per call; the model's in-memory tables are cleared before each n-gram one); the best of --repeats per
variant. Also times the cache allocation alone (256 positions).
"""
from __future__ import annotations

import argparse
import os
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[32, 256])
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    from specgen import EngineConfig, SamplingParams, SpecConfig, generate, load_model
    from specgen.engine import kv_cache

    lm = load_model(None, threads=args.threads)
    prompts = [[1, 2, 3, 4, 5, 6, 7, 8]] * args.requests
    sp = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    plain_init = kv_cache.KVCache.__init__

    def zeroed_init(self, *a, **kw):  # the variant: every cache zero-filled, as before
        kw["zeroed"] = True
        plain_init(self, *a, **kw)

    def timed(bs: int, zeroed: bool) -> tuple[float, float]:
        kv_cache.KVCache.__init__ = zeroed_init if zeroed else plain_init
        try:
            start = time.perf_counter()
            generate(prompts, model=lm, sampling=sp, engine=EngineConfig(batch_size=bs))
            job = time.perf_counter() - start
            start = time.perf_counter()
            lm.model.new_cache(bs, 256, "auto")
            return job, time.perf_counter() - start
        finally:
            kv_cache.KVCache.__init__ = plain_init

    print(f"{'slots':>6}{'zeroed job s':>14}{'uninit job s':>14}{'ratio':>8}{'zeroed alloc s':>16}"
          f"{'uninit alloc s':>16}")
    for bs in args.batch_sizes:
        timed(bs, False)  # warm-up
        best = {True: [1e9, 1e9], False: [1e9, 1e9]}
        for _ in range(args.repeats):
            for zeroed in (True, False):
                job, alloc = timed(bs, zeroed)
                best[zeroed] = [min(best[zeroed][0], job), min(best[zeroed][1], alloc)]
        (zj, za), (uj, ua) = best[True], best[False]
        print(f"{bs:>6}{zj:>14.3f}{uj:>14.3f}{zj / uj:>7.2f}x{za:>16.3f}{ua:>16.4f}", flush=True)

    ngram = SpecConfig(method="ngram", num_speculative_tokens=5)

    def ngram_job(bs: int, stored: bool) -> float:
        os.environ["SPECGEN_COST_CACHE"] = "1" if stored else "0"
        lm.model.calibrations.clear()
        try:
            start = time.perf_counter()
            generate(prompts, model=lm, sampling=sp, engine=EngineConfig(batch_size=bs), speculative=ngram)
            return time.perf_counter() - start
        finally:
            del os.environ["SPECGEN_COST_CACHE"]

    print(f"{'slots':>6}{'ngram, table timed s':>22}{'ngram, table read s':>21}{'ratio':>8}")
    for bs in args.batch_sizes:
        ngram_job(bs, True)  # warm-up, and the table stored
        timed_s = read_s = 1e9
        for _ in range(args.repeats):
            timed_s = min(timed_s, ngram_job(bs, False))
            read_s = min(read_s, ngram_job(bs, True))
        print(f"{bs:>6}{timed_s:>22.3f}{read_s:>21.3f}{timed_s / read_s:>7.2f}x", flush=True)


if __name__ == "__main__":
    main()
