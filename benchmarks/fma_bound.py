"""How close the float32-over-blocks product (specgen/kernels/linear.cc, qpanel_all) runs to this CPU's FMA peak,
and so what a verify block of m rows must cost against one row here:

    python benchmarks/fma_bound.py [--threads 2] [--rows 1 2 3 4 5 6 7 8 9]

A standalone program (this checkout's kernel code pasted in, as linear_ab.py does; --march x86-64-v3 for the
AVX2 build) first measures the peak: 12 independent FMA chains per thread in registers (512-bit on an AVX-512
build, else 256-bit), GFLOP/s over all
threads, the best of 5. Then it times qpanel_all over one Q4_1 weight of 6,144 panels x 576 inputs (113 M weights, about the
default model's Q4_1 projections; random blocks) for each row count: ms (median of alternated calls), GFLOP/s
(2 m 113 M per call) as a share of the peak, and the time against one row. One row streams the 71 MB of blocks;
m rows also do m times the FMAs, plus the rebuilding of every weight from its block (~3 vector ops per 16
weights, on the same ports as the FMAs), so past a few rows the product is bound by FMA issue, not memory.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import tempfile
from pathlib import Path

from linear_ab import ROOT

PROGRAM = r"""
#include <immintrin.h>
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <omp.h>
#include <vector>
namespace specgen { inline float half_to_float(uint16_t h) { return _cvtsh_ss(h); } }
namespace this_ {
@THIS@
#endif
}
static double now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }
#if defined(__AVX512F__)
using V = __m512;
static inline V vset(float x) { return _mm512_set1_ps(x); }
static inline V vfma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
static inline float vfirst(V a) { return _mm512_cvtss_f32(a); }
constexpr int kLanes = 16;
#else
using V = __m256;
static inline V vset(float x) { return _mm256_set1_ps(x); }
static inline V vfma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
static inline float vfirst(V a) { return _mm256_cvtss_f32(a); }
constexpr int kLanes = 8;
#endif
int main(int argc, char** argv) {
  const long iters = 100000000;
  float sink = 0;
  double peak = 0;
  for (int rep = 0; rep < 5; ++rep) {  // the best of 5
    const double t = now();
#pragma omp parallel reduction(+ : sink)
    {
      V a[12];
      const V b = vset(1.0000001f), c = vset(1e-9f);
      for (int i = 0; i < 12; ++i) a[i] = vset(i);
      for (long it = 0; it < iters / 12; ++it)
#pragma GCC unroll 12
        for (int i = 0; i < 12; ++i) a[i] = vfma(a[i], b, c);
      for (int i = 0; i < 12; ++i) sink += vfirst(a[i]);
    }
    peak = std::max(peak, double(iters / 12 * 12) * 2 * kLanes * omp_get_max_threads() / (now() - t) / 1e9);
  }
  printf("FMA peak: %.0f GFLOP/s (%d threads, %d lanes; checksum %g)\n", peak, omp_get_max_threads(), kLanes, sink);
  constexpr int64_t K = 576, NP = 6144, BYTES = 640;
  const size_t total = NP * (K / 32) * BYTES;
  uint8_t* W = (uint8_t*)aligned_alloc(64, total);
  for (size_t i = 0; i < total; ++i) W[i] = rand();
  for (int64_t p = 0; p < NP * (K / 32); ++p)  // finite fp16 scales and minimums (random bytes hold NaNs)
    for (int c = 0; c < 64; ++c) reinterpret_cast<uint16_t*>(W + p * BYTES)[c] = 0x2000 + rand() % 0x1000;
  auto median = [](std::vector<double> v) { std::sort(v.begin(), v.end()); return v[v.size() / 2]; };
  double one = 0;
  printf("%5s %9s %9s %9s %10s\n", "rows", "ms", "GFLOP/s", "of peak", "vs 1 row");
  for (int i = 1; i < argc; ++i) {
    const int M = atoi(argv[i]);
    std::vector<float> X(M * K), Y(M * NP * 32);
    for (auto& v : X) v = (rand() % 2000 - 1000) / 1000.f;
    std::vector<double> ts;
    for (int it = 0; it < 41; ++it) {
      const double t0 = now();
#pragma omp parallel for schedule(static)
      for (int64_t p = 0; p < NP; ++p)
        this_::qpanel_all<this_::Quant::kQ4_1>(X.data(), M, K, W + p * (K / 32) * BYTES, Y.data(), NP * 32, p * 32);
      ts.push_back(now() - t0);
    }
    const double ms = median(ts) * 1e3, gf = 2.0 * M * K * NP * 32 / (ms * 1e-3) / 1e9;
    if (M == 1 || one == 0) one = ms;
    printf("%5d %9.3f %9.1f %8.0f%% %9.2fx\n", M, ms, gf, 100 * gf / peak, ms / one);
  }
}
"""


def kernel_code() -> str:
    """linear.cc from `kPanel` up to the AVX2 branch's qpanel_any: the AVX-512 and the AVX2 products, whichever
    the build target enables (the program closes the open #if)."""
    src = (ROOT / "specgen" / "kernels" / "linear.cc").read_text()
    avx2 = src.index("#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)\n// AVX2")
    return src[src.index("constexpr int64_t kPanel = 32;"):src.index("void qpanel_any(const float* x", avx2)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 3, 4, 5, 6, 7, 8, 9])
    ap.add_argument("--march", default=os.environ.get("SPECGEN_MARCH", "native"))
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "fma.cc").write_text(PROGRAM.replace("@THIS@", kernel_code()))
        subprocess.run(["g++", "-O3", f"-march={args.march}", "-fopenmp", "-std=c++17", "fma.cc", "-o", "fma"],
                       cwd=d, check=True, capture_output=True)
        subprocess.run([str(Path(d) / "fma"), *map(str, args.rows)],
                       env={**os.environ, "OMP_NUM_THREADS": str(args.threads)}, check=True)


if __name__ == "__main__":
    main()
