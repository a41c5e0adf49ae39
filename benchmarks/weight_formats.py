"""specgen_linear over each weight format it multiplies by, side by side in one process, on one decoder layer of a
Llama-3.2-1B-sized model (hidden 2048, intermediate 8192: QKV 2048 -> 3072, O 2048 -> 2048, gate/up 2048 ->
16384, down 8192 -> 2048; 60 M weights):

    python benchmarks/weight_formats.py [--rows 1 2 6 16 64] [--repeats 7] [--threads 2] [--layers 1]

Formats: float32 panels (what a dequantized GGUF K-quant got before, 4 bytes a weight), bfloat16 panels (a BF16
checkpoint, 2 bytes), and GGUF Q8_0, Q6_K, Q5_K (packed as QX: float32 scales and offsets per 16 inputs, int8
quants), Q4_K and Q4_1 blocks (random blocks with small finite scales), rebuilt in registers. --layers such layers of distinct weights: one layer's blocks stay in a large L3 cache
between passes, a model's do not (this machine's L3 is 480 MiB). ms per pass over every layer's four products
is the best of --repeats; the first layer's products are checked bit-identical, in each format, to the float32
panels of its dequantized weight.
"""
from __future__ import annotations

import argparse
import os
import time

import numpy as np

SHAPES = [(2048, 3072), (2048, 2048), (2048, 16384), (8192, 2048)]  # (k, n) of QKV, O, gate/up, down


def random_blocks(kind: str, n: int, k: int, rng) -> np.ndarray:
    """GGUF blocks [n, k / block weights, block bytes] of random quants and small finite fp16 scales."""
    from specgen.models.checkpoint import QUANT_BLOCK_BYTES, QUANT_BLOCK_WEIGHTS

    blocks = rng.integers(0, 256, (n, k // QUANT_BLOCK_WEIGHTS[kind], QUANT_BLOCK_BYTES[kind]), dtype=np.uint8)
    scale_bytes = {"Q8_0": slice(0, 2), "Q4_1": slice(0, 4), "Q4_K": slice(0, 4), "Q5_K": slice(0, 4),
                   "Q6_K": slice(208, 210)}[kind]
    width = scale_bytes.stop - scale_bytes.start
    halves = (rng.random((n, blocks.shape[1], width // 2)) * 0.01).astype(np.float16)
    blocks[..., scale_bytes] = halves.view(np.uint8).reshape(n, blocks.shape[1], width)
    return blocks


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 6, 16, 64])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--layers", type=int, default=1)
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    import paddle

    from specgen import kernels
    from specgen.api import set_threads

    set_threads(args.threads)
    K = kernels.ops()
    if K is None or not kernels.packed_linear_enabled(K, "float32"):
        raise SystemExit("packed weights need the fused kernels and AVX2 or AVX-512")
    rng = np.random.default_rng(0)
    formats: dict[str, list] = {}
    for kind in ("Q8_0", "Q6_K", "Q5_K", "Q4_K", "Q4_1"):
        formats[kind] = [kernels.pack_quantized(kind, random_blocks(kind, n, k, rng))
                         for _ in range(args.layers) for k, n in SHAPES]
    dense = [w.numpy() for w in formats["Q4_K"]]
    formats["F32"] = [kernels.pack_linear(d, halves=False) for d in dense]
    bf16 = [((d.view(np.uint32) >> 16) << 16).view(np.float32) for d in dense]
    formats["BF16"] = [kernels.pack_linear(d) for d in bf16]
    order = ["F32", "BF16", "Q8_0", "Q6_K", "Q5_K", "Q4_K", "Q4_1"]
    size = {f: sum(int(np.prod(w.panels.shape)) * w.panels.element_size() for w in formats[f]) for f in order}
    print("MiB per pass: " + ", ".join(f"{f} {size[f] / 2**20:.0f}" for f in order) + f"; threads {args.threads}")
    print(f"{'rows':>5}" + "".join(f"{f + ' ms':>10}" for f in order) + "".join(f"{'F32/' + f:>11}" for f in order[1:]))
    for rows in args.rows:
        xs = {k: paddle.to_tensor(rng.standard_normal((rows, k)).astype(np.float32)) for k, _ in SHAPES}
        for f in order[1:]:  # bits: each format against float32 panels of its own values
            for w in formats[f][: len(SHAPES)]:
                r = kernels.pack_linear(w.numpy(), halves=False)
                assert np.array_equal(K.specgen_linear(xs[w.k], w.panels, w.n).numpy(),
                                      K.specgen_linear(xs[r.k], r.panels, r.n).numpy()), f
        best = {}
        for f in order:
            times = []
            for _ in range(args.repeats):
                t = time.perf_counter()
                for w in formats[f]:
                    y = K.specgen_linear(xs[w.k], w.panels, w.n)
                y.numpy()
                times.append(time.perf_counter() - t)
            best[f] = min(times)
        print(f"{rows:>5}" + "".join(f"{best[f] * 1e3:>10.2f}" for f in order)
              + "".join(f"{best['F32'] / best[f]:>10.2f}x" for f in order[1:]), flush=True)


if __name__ == "__main__":
    main()
