"""Prefill (one forward over n prompt tokens per slot, logits for each slot's last), three ways side by side in
one run, on the default model:

    python benchmarks/prefill.py [--tokens 256 1024] [--slots 1] [--repeats 3] [--threads 2]

"packed": the default kernels; "narrow": the same with SPECGEN_WIDE_LINEAR=0 (the packed product one panel at a
time, as before the two-panel kernel for many rows); "mkl": a model built with SPECGEN_PACKED_LINEAR=0 (Paddle's
matmul over dense float32 weights). Best of --repeats, the three alternating. --slots S prefills S prompts of n
tokens each in one forward (a batch job's first step). "same bits" compares packed's and narrow's logits.
"""
from __future__ import annotations

import argparse
import os
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, nargs="+", default=[256, 1024])
    ap.add_argument("--slots", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    import numpy as np
    from spec_bench import load_default

    from specgen.engine.types import build_forward_batch

    packed = load_default(args.threads)
    mkl = load_default(args.threads, SPECGEN_PACKED_LINEAR="0")
    if not packed.model.packs:
        raise SystemExit("the packed linear kernel is off here (needs the fused kernels and AVX2 or AVX-512)")
    rng = np.random.default_rng(0)
    s = args.slots
    print(f"{'slots':>6}{'tokens':>8}{'packed ms':>11}{'narrow ms':>11}{'mkl ms':>9}{'packed tok/s':>14}"
          f"{'narrow/packed':>15}{'mkl/packed':>12}{'same bits':>11}")
    for n in args.tokens:
        batch = build_forward_batch(np.arange(s), np.zeros(s, np.int64), np.full(s, n),
                                    rng.integers(100, 40000, s * n), np.zeros(s, bool))
        best = {"packed": 1e9, "narrow": 1e9, "mkl": 1e9}
        logits = {}
        for _ in range(args.repeats):
            for name, m in (("packed", packed), ("narrow", packed), ("mkl", mkl)):
                os.environ["SPECGEN_WIDE_LINEAR"] = "0" if name == "narrow" else "1"
                cache = m.model.new_cache(s, n + 8)
                start = time.perf_counter()
                logits[name] = m.model.forward(batch, cache)[0].numpy()
                best[name] = min(best[name], time.perf_counter() - start)
        os.environ.pop("SPECGEN_WIDE_LINEAR")
        p, w, k = best["packed"], best["narrow"], best["mkl"]
        same = "yes" if np.array_equal(logits["packed"], logits["narrow"]) else "NO"
        print(f"{s:>6}{n:>8}{p * 1e3:>11.0f}{w * 1e3:>11.0f}{k * 1e3:>9.0f}{s * n / p:>14.0f}{w / p:>14.2f}x"
              f"{k / p:>11.2f}x{same:>11}", flush=True)


if __name__ == "__main__":
    main()
