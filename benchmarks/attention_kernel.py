"""The fused attention op (specgen_attention: RoPE + KV write + causal attention) alone, for one slot with the
default model's shapes (9 query heads, 3 KV heads, head_dim 64), float32:

    python benchmarks/attention_kernel.py [--contexts 300 1000 2000] [--rows 1 6] [--threads 2]
        [--slots 1] [--layers 1]

ms for 30 calls (one per layer of a step), best of 5; "rows" is the tokens each slot feeds (1 = plain
decoding, 6 = verifying 5 drafts). The cache holds random keys and values. With --slots S, S slots feed their
rows in one call (a batched step); with --layers 30 each call has its own cache, as the 30 layers of a real step
do, so the keys and values come from memory instead of staying in cache between calls. GB/s counts the K/V
bytes one pass of the 30 calls reads.
"""
from __future__ import annotations

import argparse
import os
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--contexts", type=int, nargs="+", default=[300, 1000, 2000])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 6])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--slots", type=int, default=1)
    ap.add_argument("--layers", type=int, default=1, help="distinct caches the 30 calls cycle through")
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    import numpy as np
    import paddle

    from specgen.kernels import ops

    k_ops = ops()
    if k_ops is None:
        raise SystemExit("the fused CPU kernels are not built here")
    H, KV, D, cap = 9, 3, 64, max(args.contexts) + 64
    rng = np.random.default_rng(0)
    ang = np.arange(cap)[:, None] * (1.0 / 10000 ** (np.arange(0, D, 2) / D))[None, :]
    cos, sin = (paddle.to_tensor(f(ang).astype("float32")) for f in (np.cos, np.sin))
    S = args.slots
    caches = [tuple(paddle.to_tensor(rng.standard_normal((S * KV * cap, D)).astype("float32")) for _ in range(2))
              for _ in range(args.layers)]
    ones = paddle.ones([D], "float32")
    print(f"slots {S}, distinct caches {args.layers}")
    print(f"{'context':>8}" + "".join(f"{f'{n} rows ms':>14}{'GB/s':>7}" for n in args.rows) + f"{'ratio':>8}")
    for ctx in args.contexts:
        times = []
        for n in args.rows:
            qkv = paddle.to_tensor(rng.standard_normal((S * n, (H + 2 * KV) * D)).astype("float32"))
            pos = paddle.to_tensor(np.tile(np.arange(ctx - n, ctx, dtype=np.int64), S))
            slots = paddle.to_tensor(np.repeat(np.arange(S, dtype=np.int64), n))
            zeros = paddle.zeros([S * n], "int64")

            def call():
                for layer in range(30):
                    kc, vc = caches[layer % len(caches)]
                    k_ops.specgen_attention(qkv, cos, sin, pos, slots, kc, vc, ones, ones, zeros, ones, ones,
                                            H, KV, cap, False, 1e-5, 0)

            call()
            best = 1e9
            for _ in range(5):
                t = time.perf_counter()
                call()
                best = min(best, time.perf_counter() - t)
            times.append(best * 1e3)
        ratio = f"{times[-1] / times[0]:.2f}x" if len(times) > 1 else "-"
        gbs = 30 * S * KV * ctx * D * 4 * 2 / 1e9
        print(f"{ctx:>8}" + "".join(f"{t:>14.2f}{gbs / (t / 1e3):>7.1f}" for t in times) + f"{ratio:>8}", flush=True)


if __name__ == "__main__":
    main()
