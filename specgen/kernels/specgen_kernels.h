// Functions shared between the kernel sources (linear.cc, cpu_ops.cc, moe.cc), compiled into one extension module.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "paddle/extension.h"

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
void screened_argmax(const float* x, int64_t m, int64_t k, const PackedWeight& w, const PackedWeight& screen,
                     const float* bound, int64_t n, int64_t* out);

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
