"""The packed linear kernel (specgen/kernels/linear.cc) against Paddle's matmul (MKL sgemm) on the weights of the
default model, side by side in one run:

    python benchmarks/linear_kernel.py [--rows 1 2 4 6 8 12 16 32 64 128 192] [--threads 2]

For each row count M, one "pass" multiplies [M, k] inputs by every projection of the model (30 layers of QKV, O,
gate/up and down) and the LM head, as one decode or verify step does; ms per pass is the best of --repeats.
Three ways, all giving float32 products over the same float32 weights: Paddle's matmul over the dequantized
weights, specgen_linear over them packed as float32 panels, and specgen_linear over the GGUF file's own
Q4_1 / Q8_0 blocks (what the model runs by default). GB/s counts the bytes each way reads per pass. With
--int8 (a CPU with AVX-512 VNNI), a fourth way: the same blocks with the inputs quantized to int8 and integer
products (`--matmul int8`), whose results differ from float32's by the inputs' rounding.
"""
from __future__ import annotations

import argparse
import os
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 6, 8, 12, 16, 32, 64, 128, 192])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--int8", action="store_true", help="also time the integer products (--matmul int8)")
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    import numpy as np
    import paddle

    from specgen import load_model
    from specgen.kernels import dense, pack_linear

    lm = load_model(None, threads=args.threads)
    m = lm.model
    if not m.packs:
        raise SystemExit("the packed linear kernel is off here (needs the fused kernels and AVX2 or AVX-512)")
    weights = [L[key] for L in m.w.layers for key in ("w_qkv", "w_o", "w_gate_up", "w_down")] + [m.w.lm_head]
    if not m.keeps_quantized or any(w.kind == "F32" for w in weights):
        raise SystemExit("the model does not keep its quantized blocks here (SPECGEN_QUANTIZED_WEIGHTS=0?)")
    dense_w = [dense(w) for w in weights]
    int8_w = []
    if args.int8:
        m8 = load_model(None, threads=args.threads, matmul="int8").model
        int8_w = [L[key] for L in m8.w.layers for key in ("w_qkv", "w_o", "w_gate_up", "w_down")] + [m8.w.lm_head]
    f32_w = [pack_linear(d) for d in dense_w]
    nbytes = sum(w.k * w.n * 4 for w in weights)
    qbytes = sum(int(np.prod(w.panels.shape)) for w in weights)
    rng = np.random.default_rng(0)

    def best(fn) -> float:
        fn()
        times = []
        for _ in range(args.repeats):
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
        return min(times)

    print(f"weights: {nbytes / 2**20:.0f} MiB float32, {qbytes / 2**20:.0f} MiB as blocks; threads {args.threads}")
    print(f"{'rows':>5}{'matmul ms':>11}{'packed f32 ms':>15}{'blocks ms':>11}{'f32 GB/s':>10}{'blocks GB/s':>13}"
          f"{'blocks/f32':>12}{'blocks/matmul':>15}{'f32 vs 1 row':>14}{'blocks vs 1 row':>17}"
          + (f"{'int8 ms':>9}{'blocks/int8':>13}{'int8 vs 1 row':>15}" if int8_w else ""))
    base = {}
    for rows in args.rows:
        xs = {k: paddle.to_tensor(rng.standard_normal((rows, k)).astype(np.float32)) for k in {w.k for w in weights}}

        def run_packed():
            for w in weights:
                y = m.matmul(xs[w.k], w)
            y.numpy()

        def run_f32():
            for w in f32_w:
                y = m.matmul(xs[w.k], w)
            y.numpy()

        def run_matmul():
            for w, d in zip(weights, dense_w):
                y = paddle.matmul(xs[w.k], d)
            y.numpy()

        def run_int8():
            for w in int8_w:
                y = m.matmul(xs[w.k], w)
            y.numpy()

        tm, tf, tp = best(run_matmul), best(run_f32), best(run_packed)
        ti = best(run_int8) if int8_w else 0.0
        base.setdefault("f", tf)
        base.setdefault("p", tp)
        base.setdefault("i", ti)
        print(f"{rows:>5}{tm * 1e3:>11.2f}{tf * 1e3:>15.2f}{tp * 1e3:>11.2f}{nbytes / tf / 1e9:>10.1f}"
              f"{qbytes / tp / 1e9:>13.1f}{tf / tp:>11.2f}x{tm / tp:>14.2f}x{tf / base['f']:>13.2f}x"
              f"{tp / base['p']:>16.2f}x"
              + (f"{ti * 1e3:>9.2f}{tp / ti:>12.2f}x{ti / base['i']:>14.2f}x" if int8_w else ""), flush=True)


if __name__ == "__main__":
    main()
