"""This checkout's float32-over-blocks kernel (specgen/kernels/linear.cc: qpanel_all, the product of m rows
with one panel) against another checkout's, compiled side by side into one standalone program (two builds of
the Paddle operators cannot share a process, and separate processes on this machine differ by 20%):

    git worktree add /tmp/old <commit>
    python benchmarks/linear_ab.py --compare /tmp/old

One Q4_1 weight of 6,144 panels x 576 inputs (113 M weights, about the default model's Q4_1 projections),
random blocks; qpanel_all over every panel for 1 to 128 rows, calls alternating between the two kernels (120
up to 8 rows, 40 up to 32, 16 beyond), medians. Needs g++ with AVX-512; the code between `constexpr int64_t
kPanel` and the AVX-512 `void qpanel_any` of each linear.cc is pasted into its own namespace. Each row count
also says whether the two kernels' products have the same bits (they should, unless the summation order changed).
"""
from __future__ import annotations

import argparse
import os
import subprocess
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TEMPLATE = r"""
#include <immintrin.h>
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <vector>
namespace specgen { inline float half_to_float(uint16_t h) { return _cvtsh_ss(h); } }
namespace other {
@OTHER@
#endif
}
namespace this_ {
@THIS@
#endif
}
static double now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }
int main() {
  constexpr int64_t K = 576, NP = 6144, BYTES = 640;
  const size_t total = NP * (K / 32) * BYTES;
  uint8_t* W = (uint8_t*)aligned_alloc(64, total);
  for (size_t i = 0; i < total; ++i) W[i] = rand();
  auto median = [](std::vector<double> v) { std::sort(v.begin(), v.end()); return v[v.size() / 2]; };
  for (int M : {1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 16, 24, 32, 64, 128}) {
    std::vector<float> XM(M * K), YM(M * NP * 32);
    for (auto& v : XM) v = (rand() % 2000 - 1000) / 1000.f;
    const int calls = M <= 8 ? 120 : M <= 32 ? 40 : 16;
    std::vector<double> to, tn;
    for (int it = 0; it < calls; ++it) {
      const bool use_new = it % 2;
      double t = now();
#pragma omp parallel for
      for (int64_t p = 0; p < NP; ++p) {
        const uint8_t* pp = W + p * (K / 32) * BYTES;
        if (use_new) this_::qpanel_all<this_::Quant::kQ4_1>(XM.data(), M, K, pp, YM.data(), NP * 32, p * 32);
        else other::qpanel_all<other::Quant::kQ4_1>(XM.data(), M, K, pp, YM.data(), NP * 32, p * 32);
      }
      (use_new ? tn : to).push_back(now() - t);
    }
    std::vector<float> YO(M * NP * 32);
#pragma omp parallel for
    for (int64_t p = 0; p < NP; ++p) {
      const uint8_t* pp = W + p * (K / 32) * BYTES;
      this_::qpanel_all<this_::Quant::kQ4_1>(XM.data(), M, K, pp, YM.data(), NP * 32, p * 32);
      other::qpanel_all<other::Quant::kQ4_1>(XM.data(), M, K, pp, YO.data(), NP * 32, p * 32);
    }
    bool same = true;  // bit for bit, NaN for NaN (the random blocks' fp16 scales include NaNs and infinities)
    for (size_t i = 0; i < YM.size(); ++i)
      same = same && (std::memcmp(&YM[i], &YO[i], sizeof(float)) == 0 || (std::isnan(YM[i]) && std::isnan(YO[i])));
    printf("rows %d: other %.3f ms, this %.3f ms, other/this %.3f (medians of %d alternated calls), same bits: %s\n", M, median(to) * 1e3, median(tn) * 1e3, median(to) / median(tn), calls / 2, same ? "yes" : "no");
  }
}
"""


def kernel_code(tree: Path) -> str:
    src = (tree / "specgen" / "kernels" / "linear.cc").read_text()
    return src[src.index("constexpr int64_t kPanel = 32;"):src.index("void qpanel_any(const float* x")]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--compare", type=Path, required=True, help="the other checkout")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    code = TEMPLATE.replace("@OTHER@", kernel_code(args.compare)).replace("@THIS@", kernel_code(ROOT))
    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "ab.cc").write_text(code)
        subprocess.run(["g++", "-O3", "-march=native", "-fopenmp", "-std=c++17", "ab.cc", "-o", "ab"], cwd=d,
                       check=True)
        subprocess.run([str(Path(d) / "ab")], env={**os.environ, "OMP_NUM_THREADS": str(args.threads)}, check=True)


if __name__ == "__main__":
    main()
