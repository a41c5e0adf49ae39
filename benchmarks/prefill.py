"""Prefill of one prompt (one forward over n tokens, logits for the last), packed weights against MKL's
matmul on the same model, side by side in one run:

    python benchmarks/prefill.py [--tokens 256 1024] [--repeats 3] [--threads 2]

Both models are the default one; "mkl" is built with SPECGEN_PACKED_LINEAR=0. Best of --repeats, alternating.
"""
from __future__ import annotations

import argparse
import os
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, nargs="+", default=[256, 1024])
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
        raise SystemExit("the packed linear kernel is off here (needs the fused kernels and AVX-512)")
    rng = np.random.default_rng(0)
    print(f"{'tokens':>7}{'packed ms':>11}{'mkl ms':>9}{'packed tok/s':>14}{'mkl tok/s':>11}{'speedup':>9}")
    for n in args.tokens:
        batch = build_forward_batch(np.array([0]), np.array([0]), np.array([n]), rng.integers(100, 40000, n),
                                    np.array([False]))
        best = {"packed": 1e9, "mkl": 1e9}
        for _ in range(args.repeats):
            for name, m in (("packed", packed), ("mkl", mkl)):
                cache = m.model.new_cache(1, n + 8)
                start = time.perf_counter()
                m.model.forward(batch, cache)[0].numpy()
                best[name] = min(best[name], time.perf_counter() - start)
        p, k = best["packed"], best["mkl"]
        print(f"{n:>7}{p * 1e3:>11.0f}{k * 1e3:>9.0f}{n / p:>14.0f}{n / k:>11.0f}{k / p:>8.2f}x", flush=True)


if __name__ == "__main__":
    main()
