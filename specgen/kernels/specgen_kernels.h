// Functions shared between the kernel sources (linear.cc, cpu_ops.cc, moe.cc), compiled into one extension module.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "paddle/extension.h"

#if defined(__AVX512F__) && defined(__AVX512DQ__) && defined(__AVX512CD__) && defined(__AVX512VL__)
#define KEY_BOUNDS_AVX512 1
#include <immintrin.h>
#endif

namespace specgen {

// A packed weight W [k, n] (linear.cc): float32 panels [panels, k, 32] (kind 0), float64 panels of the same layout
// for float64 activations (kind kFloat64Panels), or panels of blocks of 32 inputs [panels, k / 32, block]:
// GGUF-quantized (kind: the block's size in bytes, K-quants' on average), uint8 for float32 products over the
// rebuilt weights, int8 for integer products with the inputs quantized to 8 bits (int8_product); or exactly
// 16-bit weights, bfloat16 / float16 [panels, k / 32, 1024] (kind: linear.cc's Quant::kBF16 / kF16).
constexpr int64_t kFloat64Panels = 1;  // below every block kind's size in bytes (576 and up)
// A weight of parts: runs of output columns in different block formats (a QKV projection fused from Q4_K and
// Q6_K rows), one uint8 tensor: int64 count, then per part its panels, kind, int8_product and the byte offset
// of its panels in the tensor (64-aligned), then the parts' panels. Every part but the last has whole panels.
constexpr int64_t kParts = 2;
constexpr int64_t kMaxParts = 4;

struct PackedWeight {
  const void* data;
  int64_t panels;
  int64_t kind;
  bool int8_product;
  const int64_t* parts = nullptr;  // kParts: the tensor's header (count, then 4 values per part)
};

// Checks that w is a packed weight of k inputs and n outputs (errors name `name`) and describes it.
PackedWeight packed_weight(const paddle::Tensor& w, int64_t k, int64_t n, const char* name);

// IEEE half precision as uint16_t bits (GGUF scales, float16 KV caches): exact widening, and narrowing with
// round-to-nearest-even (overflow to inf, NaN kept), the same bits as numpy's astype(float16).
inline float half_to_float(uint16_t h) {
  const uint32_t sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1F, man = h & 0x3FF;
  uint32_t bits;
  if (exp == 0x1F) {
    bits = sign | 0x7F800000u | (man << 13);
  } else if (exp != 0) {
    bits = sign | ((exp + 112) << 23) | (man << 13);
  } else if (man == 0) {
    bits = sign;
  } else {  // subnormal: normalize
    int e = -1;
    uint32_t m = man;
    do {
      m <<= 1;
      ++e;
    } while (!(m & 0x400));
    bits = sign | ((112 - e) << 23) | ((m & 0x3FF) << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline uint16_t float_to_half(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  const uint32_t sign = (x >> 16) & 0x8000u, a = x & 0x7FFFFFFFu;
  if (a >= 0x7F800000u) return static_cast<uint16_t>(sign | 0x7C00u | (a > 0x7F800000u ? 0x200u : 0u));
  if (a >= 0x477FF000u) return static_cast<uint16_t>(sign | 0x7C00u);  // 65520 and up round to inf
  if (a >= 0x38800000u) {  // normal halves (2^-14 and up): rebias, round the 13 dropped bits to even
    const uint32_t r = a - 0x38000000u;
    return static_cast<uint16_t>(sign | ((r + 0xFFFu + ((r >> 13) & 1u)) >> 13));
  }
  float v;  // subnormal halves: multiples of 2^-24, rounded to even by nearbyint (exact scaling by 2^24)
  std::memcpy(&v, &a, 4);
  return static_cast<uint16_t>(sign | static_cast<uint32_t>(std::nearbyint(v * 16777216.0f)));
}

// y [m, n] = x [m, k] @ W (float32; each output two FMA chains, over the even and the odd inputs, added; or
// with int8_product one over the blocks of 32 inputs; a row's result never depends on the other rows).
void packed_linear(const float* x, int64_t m, int64_t k, const PackedWeight& w, float* y, int64_t n);

// The same for float64 x and float64 panels: each output one chain over the inputs in order (linear.cc).
void packed_linear(const double* x, int64_t m, int64_t k, const PackedWeight& w, double* y, int64_t n);

// out [m] = the argmax (lowest index on a tie) of each row of x [m, k] @ W for a Q8_0 or Q4_0 weight w, without
// computing every float32 logit: screen is the same weight's integer-product panels, bound [panels, k / 32, 32]
// float32 |d| * sum |q| per column and block (linear.cc, "Greedy tokens without the logits").
// With `sample` (float64 [8, m], specgen_sample's params; nullptr: every row greedy) a row of temperature > 0
// takes its Gumbel-max draw (layers/sampling.py's rule) instead, from the same bounds: its filters must be off.
void screened_argmax(const float* x, int64_t m, int64_t k, const PackedWeight& w, const PackedWeight& screen,
                     const float* bound, int64_t n, int64_t* out, const double* sample = nullptr);

// ---- The sampling rule's noise (sampling.cc; layers/sampling.py's streams and gumbels) ----

constexpr uint64_t kGolden = 0x9E3779B97F4A7C15ull;  // splitmix64's increment

// splitmix64 (layers/sampling.py's _splitmix64)
inline uint64_t splitmix64(uint64_t x) {
  x += kGolden;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// The noise stream of (request key, output position): layers/sampling.py's streams, to the bit.
inline uint64_t noise_stream(uint64_t key, int64_t position) {
  return splitmix64(key ^ splitmix64(static_cast<uint64_t>(position)));
}

// Token j's Gumbel variable in `stream` (layers/sampling.py's gumbels): u = (m + 1/2) 2^-52, m the top 52 bits of
// splitmix64 at counter j (each step exact), -log(-log u) in double.
inline double gumbel(uint64_t stream, int64_t j) {
  const uint64_t h = splitmix64(stream + static_cast<uint64_t>(j) * kGolden);
  const double u = (static_cast<double>(h >> 12) + 0.5) * (1.0 / 4503599627370496.0);
  return -std::log(-std::log(u));
}

// A token's key, x (1 / temperature) + g, in double: two roundings, as the reference takes them (the empty asm
// keeps the compiler from fusing the product into the sum: GCC contracts a * b + c into one FMA by default).
inline double gumbel_key(double x, double inv_t, uint64_t stream, int64_t j) {
  double a = x * inv_t;
#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__))
  __asm__("" : "+x"(a));
#endif
  return a + gumbel(stream, j);
}

// The best key so far and its token (-1: none); take() keeps the larger key, the lower id on a tie.
struct Pick {
  double key;
  int64_t id;
};

inline void take(Pick& p, double key, int64_t j) {
  if (key > p.key || (key == p.key && p.id >= 0 && j < p.id)) p = {key, j};
}

// Calls hit(j) for each token j of [lo, hi) that `kept` keeps (a weight above 0; nullptr: all) whose key could
// reach best(): an
// upper bound on its key from x_j (an upper bound on its logit, or the logit) and its hash's bits alone. -log u
// >= 1 - u, so g <= -log(1 - u); with K = 2^52 - m (1 <= K <= 2^52), 1 - u = (K - 1/2) 2^-52 >=
// 2^(floor(log2 K) - 53), so g <= (clz64(K) - 10) ln 2 (36.7 at most); the margin 1e-9 (|a| + 64) covers the
// roundings of both sides many times over. best() is read once per 8 tokens (it may rise inside hit). One
// vectorized pass where AVX-512 (DQ, CD) is there: a 49,152-token row in ~40 us.
constexpr double kLn2 = 0.6931471805599453;

template <typename T, typename Best, typename Hit>
void key_bounds(const T* x, const float* kept, int64_t lo, int64_t hi, double inv_t, uint64_t stream, Best best,
                Hit hit) {
  int64_t i = lo;
#if defined(KEY_BOUNDS_AVX512)
  const __m512i golden = _mm512_set1_epi64(static_cast<int64_t>(kGolden));
  // counters i + 1 .. i + 8 times the increment: splitmix64's state at tokens i .. i + 7
  __m512i ctr = _mm512_add_epi64(_mm512_set1_epi64(static_cast<int64_t>(stream + static_cast<uint64_t>(lo) * kGolden)),
                                 _mm512_mullo_epi64(_mm512_set_epi64(8, 7, 6, 5, 4, 3, 2, 1), golden));
  const __m512i step = _mm512_set1_epi64(static_cast<int64_t>(8 * kGolden));
  const __m512i c1 = _mm512_set1_epi64(static_cast<int64_t>(0xBF58476D1CE4E5B9ull));
  const __m512i c2 = _mm512_set1_epi64(static_cast<int64_t>(0x94D049BB133111EBull));
  const __m512i two52 = _mm512_set1_epi64(int64_t(1) << 52), ten = _mm512_set1_epi64(10);
  const __m512d ln2 = _mm512_set1_pd(kLn2), scale = _mm512_set1_pd(inv_t), tiny = _mm512_set1_pd(1e-9),
                pad = _mm512_set1_pd(64.0);
  for (; i + 8 <= hi; i += 8) {
    __m512i z = ctr;
    ctr = _mm512_add_epi64(ctr, step);
    z = _mm512_mullo_epi64(_mm512_xor_si512(z, _mm512_srli_epi64(z, 30)), c1);
    z = _mm512_mullo_epi64(_mm512_xor_si512(z, _mm512_srli_epi64(z, 27)), c2);
    z = _mm512_xor_si512(z, _mm512_srli_epi64(z, 31));
    const __m512i k = _mm512_sub_epi64(two52, _mm512_srli_epi64(z, 12));
    const __m512d b = _mm512_mul_pd(_mm512_cvtepi64_pd(_mm512_sub_epi64(_mm512_lzcnt_epi64(k), ten)), ln2);
    __m512d a;
    if constexpr (std::is_same_v<T, float>) {
      a = _mm512_mul_pd(_mm512_cvtps_pd(_mm256_loadu_ps(x + i)), scale);
    } else {
      a = _mm512_mul_pd(_mm512_loadu_pd(x + i), scale);
    }
    const __m512d bound =
        _mm512_add_pd(_mm512_add_pd(a, b), _mm512_mul_pd(tiny, _mm512_add_pd(_mm512_abs_pd(a), pad)));
    __mmask8 h = _mm512_cmp_pd_mask(bound, _mm512_set1_pd(best()), _CMP_GE_OQ);
    if (kept != nullptr && h) {
      h &= static_cast<__mmask8>(_mm256_cmp_ps_mask(_mm256_loadu_ps(kept + i), _mm256_setzero_ps(), _CMP_GT_OQ));
    }
    while (h) {
      const int64_t j = i + __builtin_ctz(h);
      h &= h - 1;
      hit(j);
    }
  }
#endif
  for (; i < hi; ++i) {
    if (kept != nullptr && !(kept[i] > 0.0f)) continue;
    const uint64_t k = (uint64_t(1) << 52) - (splitmix64(stream + static_cast<uint64_t>(i) * kGolden) >> 12);
    const double a = static_cast<double>(x[i]) * inv_t;
    const double bound = a + static_cast<double>(__builtin_clzll(k) - 10) * kLn2 + 1e-9 * (std::fabs(a) + 64.0);
    if (bound >= best()) hit(i);
  }
}

// A routed (mixture-of-experts) block's weights as moe_mlp reads them: the router [hidden] -> [num_experts], and the
// experts held here, ids [first_expert, first_expert + gate_up.size()), each gate_up [hidden] -> [2 inter] and
// down [inter] -> [hidden]. Bias (float32 [num_experts], or nullptr) is added to the probabilities to choose the
// experts, not to weight them (ERNIE-4.5's e_score_correction_bias).
struct ExpertBlock {
  PackedWeight router;
  std::vector<PackedWeight> gate_up, down;
  const float* bias;
  int64_t num_experts, top_k, inter, first_expert;
  bool norm;  // divide the top-k weights by max(their sum, norm_min)
  double norm_min;
  int64_t* counts;  // [num_experts] tokens routed to each expert, added to per call (nullptr: not counted)
};

// out [n, hid] = the routed experts' output for normed rows h [n, hid] (moe.cc; specgen/layers/moe.py's math).
template <typename T>
void moe_mlp(const T* h, T* out, int64_t n, int64_t hid, const ExpertBlock& m);

}  // namespace specgen
