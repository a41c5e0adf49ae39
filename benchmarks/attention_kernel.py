"""The fused attention op (specgen_attention: RoPE + KV write + causal attention) alone, for one slot with the
default model's shapes (9 query heads, 3 KV heads, head_dim 64), float32:

    python benchmarks/attention_kernel.py [--contexts 300 1000 2000] [--rows 1 6] [--threads 2]

ms for 30 calls (one per layer of a step), best of 5; "rows" is the tokens the slot feeds (1 = plain
decoding, 6 = verifying 5 drafts). The cache holds random keys and values.
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
    kc, vc = (paddle.to_tensor(rng.standard_normal((KV * cap, D)).astype("float32")) for _ in range(2))
    ones = paddle.ones([D], "float32")
    print(f"{'context':>8}" + "".join(f"{f'{n} rows ms':>14}" for n in args.rows) + f"{'ratio':>8}")
    for ctx in args.contexts:
        times = []
        for n in args.rows:
            qkv = paddle.to_tensor(rng.standard_normal((n, (H + 2 * KV) * D)).astype("float32"))
            pos = paddle.to_tensor(np.arange(ctx - n, ctx, dtype=np.int64))
            zeros = paddle.zeros([n], "int64")

            def call():
                for _ in range(30):
                    k_ops.specgen_attention(qkv, cos, sin, pos, zeros, kc, vc, ones, ones, zeros, ones, ones,
                                            H, KV, cap, False, 1e-5, 0)

            call()
            best = 1e9
            for _ in range(5):
                t = time.perf_counter()
                call()
                best = min(best, time.perf_counter() - t)
            times.append(best * 1e3)
        ratio = f"{times[-1] / times[0]:.2f}x" if len(times) > 1 else "-"
        print(f"{ctx:>8}" + "".join(f"{t:>14.2f}" for t in times) + f"{ratio:>8}", flush=True)


if __name__ == "__main__":
    main()
