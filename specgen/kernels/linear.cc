// Small-M matrix product over a packed weight (see specgen/kernels/__init__.py: pack_linear / Packed).
//
//   specgen_linear  x [m, k] float32, w packed [ceil(n / 32), k, 32] float32, n -> x @ W [m, n]
//
// A decode or verify step multiplies a few rows (1 to ~200) by every weight of the model, so the product is
// bound by streaming the weights from memory, not by arithmetic. The packed layout stores each panel of 32
// output columns as k contiguous 128-byte rows, so one thread reads its panels front to back with software
// prefetch 6 KB ahead, and applies every group of (up to) 8 input rows to a panel while it sits in L2. At
// 6 rows per slot this costs ~1.2x one row instead of MKL's ~1.6x (BENCHMARKS.md, "Packed linear").
//
// Every output element y[r, c] is one FMA chain over k = 0, 1, ..., k-1 in that order, whatever m is and
// wherever row r sits in the batch, so a row's result does not depend on batch composition (speculation on or
// off gives bit-identical logits in float32). The generic path (no AVX-512) runs the same chains with std::fma.
#include <algorithm>
#include <cmath>
#include <vector>

#include "paddle/extension.h"
#include "specgen_kernels.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kPanel = 32;    // output columns per panel
constexpr int64_t kGroup = 8;     // input rows applied to a panel at a time
constexpr int64_t kAhead = 48;    // prefetch distance in panel rows (48 x 128 B)

#if defined(__AVX512F__)
// y[r, c0 .. c0 + width) for rows r < G of x (row stride k); panel p [k, 32]
template <int G>
inline void panel_rows(const float* x, int64_t k, const float* p, float* y, int64_t n, int64_t c0, int64_t width) {
  __m512 a0[G], a1[G];
  for (int r = 0; r < G; ++r) {
    a0[r] = _mm512_setzero_ps();
    a1[r] = _mm512_setzero_ps();
  }
  const float* w = p;
  for (int64_t i = 0; i < k; ++i, w += kPanel) {
    _mm_prefetch(reinterpret_cast<const char*>(w + kPanel * kAhead), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(w + kPanel * kAhead + 16), _MM_HINT_T0);
    const __m512 w0 = _mm512_load_ps(w), w1 = _mm512_load_ps(w + 16);
    for (int r = 0; r < G; ++r) {
      const __m512 b = _mm512_set1_ps(x[r * k + i]);
      a0[r] = _mm512_fmadd_ps(b, w0, a0[r]);
      a1[r] = _mm512_fmadd_ps(b, w1, a1[r]);
    }
  }
  const __mmask16 m0 = width >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << width) - 1);
  const __mmask16 m1 = width >= 32 ? 0xFFFF : width <= 16 ? 0 : static_cast<__mmask16>((1u << (width - 16)) - 1);
  for (int r = 0; r < G; ++r) {
    _mm512_mask_storeu_ps(y + r * n + c0, m0, a0[r]);
    _mm512_mask_storeu_ps(y + r * n + c0 + 16, m1, a1[r]);
  }
}

// The last m mod kGroup rows, with a compile-time row count.
template <int G>
inline void panel_tail(const float* x, int64_t rows, int64_t k, const float* p, float* y, int64_t n, int64_t c0,
                       int64_t width) {
  if constexpr (G > 0) {
    if (rows == G) return panel_rows<G>(x, k, p, y, n, c0, width);
    panel_tail<G - 1>(x, rows, k, p, y, n, c0, width);
  }
}

void panel_all(const float* x, int64_t m, int64_t k, const float* p, float* y, int64_t n, int64_t c0) {
  const int64_t width = std::min<int64_t>(kPanel, n - c0);
  int64_t r = 0;
  for (; r + kGroup <= m; r += kGroup) panel_rows<kGroup>(x + r * k, k, p, y + r * n, n, c0, width);
  panel_tail<kGroup - 1>(x + r * k, m - r, k, p, y + r * n, n, c0, width);
}
#else
void panel_all(const float* x, int64_t m, int64_t k, const float* p, float* y, int64_t n, int64_t c0) {
  const int64_t width = std::min<int64_t>(kPanel, n - c0);
  float acc[kPanel];
  for (int64_t r = 0; r < m; ++r) {
    for (int64_t j = 0; j < kPanel; ++j) acc[j] = 0.f;
    for (int64_t i = 0; i < k; ++i) {
      const float b = x[r * k + i];
      const float* w = p + i * kPanel;
      for (int64_t j = 0; j < kPanel; ++j) acc[j] = std::fma(b, w[j], acc[j]);
    }
    for (int64_t j = 0; j < width; ++j) y[r * n + c0 + j] = acc[j];
  }
}
#endif

}  // namespace

namespace specgen {

void packed_linear(const float* x, int64_t m, int64_t k, const float* w, int64_t panels, float* y, int64_t n) {
  if (m == 0) return;
#pragma omp parallel for schedule(static)
  for (int64_t p = 0; p < panels; ++p) panel_all(x, m, k, w + p * k * kPanel, y, n, p * kPanel);
}

}  // namespace specgen

std::vector<paddle::Tensor> Linear(const paddle::Tensor& x, const paddle::Tensor& w, int64_t n) {
  PD_CHECK(x.is_cpu() && w.is_cpu(), "specgen_linear: CPU tensors only");
  PD_CHECK(x.dtype() == paddle::DataType::FLOAT32 && w.dtype() == paddle::DataType::FLOAT32,
           "specgen_linear: float32 only");
  PD_CHECK(x.shape().size() == 2 && w.shape().size() == 3 && w.shape()[2] == kPanel, "specgen_linear: shapes");
  const int64_t m = x.shape()[0], k = x.shape()[1], panels = w.shape()[0];
  PD_CHECK(w.shape()[1] == k && panels * kPanel >= n && (panels - 1) * kPanel < n,
           "specgen_linear: packed weight does not match x or n");
  auto out = paddle::empty({m, n}, paddle::DataType::FLOAT32, x.place());
  specgen::packed_linear(x.data<float>(), m, k, w.data<float>(), panels, out.data<float>(), n);
  return {out};
}

PD_BUILD_OP(specgen_linear).Inputs({"X", "W"}).Outputs({"Out"}).Attrs({"n: int64_t"}).SetKernelFn(PD_KERNEL(Linear));
