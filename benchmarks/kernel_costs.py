"""The fused kernels' costs on the default model: the weights' products, and a whole forward by tokens fed.

    python benchmarks/kernel_costs.py --rows 1 2 4 6 8 16 32 64 128 --tokens 1 2 3 4 6 8 16 32 64

Products: for each row count M, one pass multiplies [M, k] inputs by every projection of the model (30 decoder
blocks' QKV, O, gate/up, down) and the LM head, as one step does; ms per pass is the best of --repeats, three
ways over the same weights: Paddle's matmul (MKL) over the dequantized float32 weights, specgen_linear over
them packed as float32 panels, and specgen_linear over the GGUF file's own Q4_1 / Q8_0 blocks (what the model
runs).
With --int8 (AVX-512 VNNI) a fourth: the blocks with the inputs quantized to int8 (matmul int8).
Forward: c(T), a greedy forward feeding T tokens to one slot at position --position, median of --repeats, and
c(T) / c(1): what verifying T - 1 drafts costs against a plain step.
With --tree: the same blocks of T = 1 + nodes rows also as token trees (up to MAX_TREE_NODES nodes; each
node's parent the (i - 1) // 4-th, as EAGLE-2's top-4 expansion shapes them), ancestor-masked, timed in turn
with the causal ones (each first every other round): c(T) by tree nodes, and tree / causal.
"""
from __future__ import annotations

import argparse
import time

import numpy as np
from common import machine, print_table, repeat_times


def best(fn, repeats: int) -> float:
    return min(repeat_times(fn, repeats))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 6, 8, 16, 32, 64, 128])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 3, 4, 6, 8, 16, 32, 64])
    ap.add_argument("--position", type=int, default=256)
    ap.add_argument("--int8", action="store_true", help="also time the integer products (matmul int8)")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tree", action="store_true", help="also time tree-masked blocks (c(T) by tree nodes)")
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
        ways["int8"] = ([lin.weight for b in m8.weights.blocks for lin in b.linears()]
                        + [m8.weights.lm_head.weight])
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
            ms[name] = best(lambda ws=ws: [ops_args.linear(ops, xs[w.k], w.panels, w.n) for w in ws],
                            args.repeats) * 1e3
        rows.append([m_rows] + [ms[k] for k in ms] + [ms["MKL"] / ms["blocks"]])
    print("weights read per pass: " + ", ".join(f"{k} {v:.0f} MiB" for k, v in mb.items()))
    print_table(["rows"] + [f"{k} ms" for k in ["MKL", *ways]] + ["MKL / blocks"], rows)
    costs = step_costs(m, args.position, args.tokens, repeats=args.repeats)
    print(f"\nforward at position {args.position}, one slot:")
    print_table(["tokens fed", "ms", "c(T) / c(1)"],
                [[t, costs[t] * 1e3, costs[t] / costs[1]] for t in args.tokens])
    if args.tree:
        from specgen.engine.tree import MAX_TREE_NODES

        tree = tree_costs(m, args.position, sorted({1} | {t for t in args.tokens if t <= MAX_TREE_NODES + 1}),
                          args.repeats)
        print(f"\ntree-masked blocks at position {args.position}, one slot (T = root + nodes):")
        # against a causal 1-token step: a block of a root alone runs the causal path
        print_table(["T", "causal ms", "tree ms", "tree / causal", "tree c(T) / c(1)"],
                    [[t, c * 1e3, tr * 1e3, tr / c, tr / tree[1][1]] for t, (tr, c) in tree.items()])


def tree_costs(m, position: int, tokens: list[int], repeats: int) -> dict[int, tuple[float, float]]:
    """{T: (tree, causal)} median seconds of a greedy verify forward of T rows (a root and T - 1 nodes) to one
    slot at `position`, as a token tree and as a causal block, timed in turn."""
    from specgen.engine.tree import tree_layout
    from specgen.runtime.batch import build_forward_batch

    rng = np.random.default_rng(0)
    one, zero = np.zeros(1, np.int64), np.zeros(1, bool)
    cache = m.new_cache(1, position + max(tokens) + 1)
    if position:
        m.forward(build_forward_batch(one, one, np.array([position]), rng.integers(0, 1000, position), zero),
                  cache, logits=False)
    batches = {}
    for t in tokens:
        ids = rng.integers(0, 1000, t)
        parents = (np.arange(t - 1) // 4)[None, :]  # node i + 1's parent: block index i // 4 (0: the root)
        depth, mask = tree_layout(parents)
        tree = build_forward_batch(one, np.array([position]), np.array([t]), ids, ~zero, tree_depth=depth[0],
                                   tree_mask=mask[0])
        causal = build_forward_batch(one, np.array([position]), np.array([t]), ids, ~zero)
        batches[t] = (tree, causal)
    times = {t: ([], []) for t in tokens}
    # the two kinds in turn, each first every other round (first runs slower)
    for r in range(2 * repeats + 1):
        for t, pair in batches.items():
            for b, out in list(zip(pair, times[t]))[::1 if r % 2 else -1]:
                start = time.perf_counter()
                m.forward(b, cache, logits=False)
                out.append(time.perf_counter() - start)
    return {t: (float(np.median(a[1:])), float(np.median(c[1:]))) for t, (a, c) in times.items()}


if __name__ == "__main__":
    main()
