"""The fused kernels' costs on the default model: the weights' products, and a whole forward by tokens fed.

    python benchmarks/kernel_costs.py --rows 1 2 4 6 8 16 32 64 128 --tokens 1 2 3 4 6 8 16 32 64

Products: for each row count M, one pass multiplies [M, k] inputs by every projection of the model (30 decoder
blocks' QKV, O, gate/up, down) and the LM head, as one step does; ms per pass is the best of --repeats, three
ways over the same weights: Paddle's matmul (MKL) over the dequantized float32 weights, specgen_linear over them
packed as float32 panels, and specgen_linear over the GGUF file's own Q4_1 / Q8_0 blocks (what the model runs).
With --int8 (AVX-512 VNNI) a fourth: the blocks with the inputs quantized to int8 (matmul int8).
Forward: c(T), a greedy forward feeding T tokens to one slot at position --position, median of --repeats, and
c(T) / c(1): what verifying T - 1 drafts costs against a plain step.
"""
from __future__ import annotations

import argparse
import time

import numpy as np

from common import machine, print_table


def best(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 6, 8, 16, 32, 64, 128])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 3, 4, 6, 8, 16, 32, 64])
    ap.add_argument("--position", type=int, default=256)
    ap.add_argument("--int8", action="store_true", help="also time the integer products (matmul int8)")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    import paddle

    from specgen import load_model
    from specgen.app.bounds import step_costs
    from specgen.kernels import args as ops_args
    from specgen.kernels import pack_linear

    print(machine())
    lm = load_model(None, threads=args.threads, backend="fused")
    m = lm.model
    ops = m.backend.ops
    linears = [lin for b in m.weights.blocks for lin in b.linears()] + [m.weights.lm_head]
    ways = {"blocks": [lin.weight for lin in linears]}
    dense = [lin.dense() for lin in linears]
    ways["float32 panels"] = [pack_linear(d) for d in dense]
    if args.int8:
        m8 = load_model(None, threads=args.threads, backend="fused", matmul="int8").model
        ways["int8"] = [lin.weight for b in m8.weights.blocks for lin in b.linears()] + [m8.weights.lm_head.weight]
    mb = {"MKL": sum(w.k * w.n * 4 for w in ways["blocks"]) / 2 ** 20}
    mb.update({k: sum(int(np.prod(w.panels.shape)) * w.panels.element_size() for w in v) / 2 ** 20
               for k, v in ways.items()})
    rng = np.random.default_rng(0)
    rows = []
    for m_rows in args.rows:
        xs = {k: paddle.to_tensor(rng.standard_normal((m_rows, k)).astype(np.float32))
              for k in sorted({w.k for w in ways["blocks"]})}
        ms = {"MKL": best(lambda: [paddle.matmul(xs[d.shape[0]], d) for d in dense], args.repeats) * 1e3}
        for name, ws in ways.items():
            ms[name] = best(lambda ws=ws: [ops_args.linear(ops, xs[w.k], w.panels, w.n) for w in ws], args.repeats) * 1e3
        rows.append([m_rows] + [ms[k] for k in ms] + [ms["MKL"] / ms["blocks"]])
    print(f"weights read per pass: " + ", ".join(f"{k} {v:.0f} MiB" for k, v in mb.items()))
    print_table(["rows"] + [f"{k} ms" for k in ["MKL", *ways]] + ["MKL / blocks"], rows)
    costs = step_costs(m, args.position, args.tokens, repeats=args.repeats)
    print(f"\nforward at position {args.position}, one slot:")
    print_table(["tokens fed", "ms", "c(T) / c(1)"], [[t, costs[t] * 1e3, costs[t] / costs[1]] for t in args.tokens])


if __name__ == "__main__":
    main()
