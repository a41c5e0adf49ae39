// Small-M matrix product over a packed weight (see specgen/kernels/__init__.py: pack_linear / pack_quantized).
//
//   specgen_linear            x [m, k] float32 (or float64, with float64 panels), w packed, n -> x @ W [m, n]
//   specgen_screened_argmax   the argmax of each row of x @ W for a Q8_0 / Q4_0 / Q6_K W, without the product's rows
//   specgen_pack_blocks       GGUF blocks -> the packed layouts below (pack_quantized, pack_screen)
//
// w is either float32 panels [ceil(n / 32), k, 32] (float64 x: float64 panels of that layout, "Float64 panels"
// below) or, for a checkpoint stored block-quantized (GGUF Q4_0, Q4_1, Q8_0), uint8 panels [ceil(n / 32),
// k / 32, bytes]: for each panel of 32 output columns and each block of 32 inputs, the 32 columns' fp16 scales d
// (and, Q4_1, fp16 minimums m), then the 32 x 32 quants (Q8_0: row by row, one int8 per column; Q4: per group of 8
// inputs, each column's 8 nibbles in one 32-bit lane, q4_nibble). K-quants (Q4_K, Q6_K) keep their super-blocks
// of 256 inputs (the layout below: Quant), QX holds any of them; a weight of parts (kParts, a 1-D uint8 tensor)
// holds runs of columns in different formats.
// The kernel rebuilds each weight as the GGUF reader does, w = d * q (+ m) in float32 (d * q is exact, so one
// FMA gives the same bits), and feeds it to the same FMA chains: the product equals, bit for bit, the float32
// product over the dequantized weight, while reading 4.6-12 bits per weight instead of 32. The same blocks
// repacked as int8 panels (EngineConfig.matmul "int8") are multiplied by the inputs quantized to int8 per block
// instead, with integer products (see "Integer products" below): not float32's bits, but still a function of
// each row alone. A greedy step's LM head uses both: the integer products screen the columns, float32 decides
// among the few the screen's error bound keeps (see "Greedy tokens without the logits").
//
// A decode or verify step multiplies a few rows (1 to ~200) by every weight of the model, so the product is
// bound by streaming the weights from memory, not by arithmetic. The packed layout stores each panel of 32
// output columns as k contiguous 128-byte rows, so one thread reads its panels front to back with software
// prefetch 6 KB ahead, and applies every group of (up to) 8 input rows to a panel while it sits in L2. At
// 6 rows per slot this costs ~1.2x one row instead of MKL's ~1.6x (BENCHMARKS.md, "Packed linear").
//
// Every output element y[r, c] is the sum of two FMA chains, even + odd: one over the even inputs i = 0, 2,
// 4, ... and one over the odd inputs i = 1, 3, 5, ..., each in that order. That holds whatever m is and wherever
// row r sits in the batch, so a row's result does not depend on batch composition (speculation on or off gives
// bit-identical logits in float32). Groups of up to kBoth rows run both chains in one pass over the panel:
// a one-row product with a single chain per output waited on the FMA's latency and read the weights at half
// the memory's speed. Larger groups, whose registers do not hold both, run a pass per chain (the panel is in
// L1 for the second). AVX2 builds run the same chains 8 columns to a vector, and the generic path (neither)
// with std::fma.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "paddle/extension.h"
#include "specgen_kernels.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#include <omp.h>
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kPanel = 32;    // output columns per panel
constexpr int64_t kGroup = 8;     // input rows applied to a panel at a time
constexpr int64_t kAhead = 48;    // prefetch distance in panel rows (48 x 128 B)
constexpr int64_t kBlock = 32;    // inputs per quantization block

// Block formats of a packed weight, per panel and block of 32 inputs: GGUF's quantized ones, told apart by their
// size in bytes, and weights that are exactly 16-bit floats (a bf16 or fp16 checkpoint), 32 x 32 of them input by
// input, widened exactly: kF16's code is its size plus one.
// GGUF's K-quants (super-blocks of 256 inputs with 6- or 8-bit sub-block scales) keep their own scales, so a
// panel reads ~4.6 (Q4_K) or ~8.6 (Q6_K) bits a weight, not the 6 and 10 of float32 scale products: per panel
// and super-block of 256 inputs, the 32 columns' fp16 super-block scales (Q4_K: d, then dmin; Q6_K: d), then its
// 8 blocks of 32 inputs, each the columns' scale bytes and the quants. Q4_K block: sc and m (6-bit, a byte each,
// per column), Q4 nibbles; w = fma(d * sc, q, -(dmin * m)). Q6_K block: the int8 scales of inputs 0-15, then
// of inputs 16-31, per column, then q - 32 as int8 (Q8_0's rows); w = (d * sc) q. Each scale product is exact in
// float32 (an fp16 times an integer below 2^8), so the weights are the ones gguf.quants dequantizes, bit for
// bit. A K-quant's code is its bytes per block of 32 inputs on average (block_stride + the super-block's
// scales / 8); its blocks are found with block_at. Q6_K's integer-product panels (kQ6_K8) keep its 6.6 bits a
// weight: per block the scale bytes, the low 4 bits as Q4's integer layout, then the high 2 bits (ipanel_rows).
// kQX, any of these formats (specgen.kernels.block_parts): float32 d and m of each half of the inputs, int8 q,
// w = fma(d, q, m) (m = -0 where the format has no offset), for Q5_K and for fused projections of mixed formats.
enum class Quant {
  kQ4_0 = 64 + 512, kQ4_1 = 128 + 512, kQ8_0 = 64 + 1024, kQ4_K = 64 + 512 + 128 / 8, kQ6_K = 64 + 1024 + 64 / 8,
  kQ6_K8 = 64 + 512 + 256 + 64 / 8, kQX = 512 + 1024, kBF16 = 2048, kF16 = 2048 + 1
};

constexpr int64_t quant_bytes(Quant q) { return q == Quant::kF16 ? 2048 : static_cast<int64_t>(q); }
constexpr bool is_half(Quant q) { return q == Quant::kBF16 || q == Quant::kF16; }
constexpr bool is_q6(Quant q) { return q == Quant::kQ6_K || q == Quant::kQ6_K8; }
constexpr bool is_super(Quant q) { return q == Quant::kQ4_K || is_q6(q); }  // K-quant super-blocks
constexpr int64_t kSuper = 8;  // blocks of 32 inputs per K-quant super-block
// f(std::integral_constant<Quant, Q>) for the format q of the float32 products (not F32 panels): the one switch
// the paths' run-time dispatches share.
template <typename F>
inline void with_quant(Quant q, F&& f) {
  switch (q) {
    case Quant::kQ4_0: return f(std::integral_constant<Quant, Quant::kQ4_0>{});
    case Quant::kQ4_1: return f(std::integral_constant<Quant, Quant::kQ4_1>{});
    case Quant::kQ8_0: return f(std::integral_constant<Quant, Quant::kQ8_0>{});
    case Quant::kQ4_K: return f(std::integral_constant<Quant, Quant::kQ4_K>{});
    case Quant::kQ6_K: return f(std::integral_constant<Quant, Quant::kQ6_K>{});
    case Quant::kQX: return f(std::integral_constant<Quant, Quant::kQX>{});
    case Quant::kBF16: return f(std::integral_constant<Quant, Quant::kBF16>{});
    case Quant::kF16: return f(std::integral_constant<Quant, Quant::kF16>{});
  }
}
// Bytes of scales before a block's quants.
constexpr int64_t quant_head(Quant q) {
  return is_half(q) ? 0 : q == Quant::kQX ? 512 : q == Quant::kQ4_1 ? 128 : 64;
}
// Bytes of a K-quant super-block's own scales (fp16 per column: Q4_K d and dmin, Q6_K d), before its blocks.
constexpr int64_t super_head(Quant q) { return q == Quant::kQ4_K ? 128 : is_q6(q) ? 64 : 0; }
// Bytes from one block of 32 inputs to the next within a panel (a K-quant's, within its super-block).
constexpr int64_t block_stride(Quant q) { return quant_bytes(q) - super_head(q) / kSuper; }
// Block b of the panel at p (all its blocks: k / 32 of them), and its super-block's scales (K-quants).
inline const uint8_t* block_at(Quant q, const uint8_t* p, int64_t b) {
  if (!is_super(q)) return p + b * quant_bytes(q);
  return p + b / kSuper * kSuper * quant_bytes(q) + super_head(q) + b % kSuper * block_stride(q);
}
inline const uint8_t* super_at(Quant q, const uint8_t* p, int64_t b) {
  return p + b / kSuper * kSuper * quant_bytes(q);
}

inline float bf16_to_float(uint16_t h) {
  const uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// The nibble of input i (of 32) and column c (of 32) in a Q4 block's quants (the float32-product layout): per
// group g of 8 inputs, 128 bytes, columns 0-15 then 16-31 as one 32-bit lane each, input 8g + j in bits 4j ..
// 4j + 3 of the lane (see qpanel_rows).
inline int q4_nibble(const uint8_t* qs, int64_t i, int64_t c) {
  const uint8_t byte = qs[(i / 8) * 128 + (c / 16) * 64 + (c % 16) * 4 + (i % 8) / 2];
  return i % 2 ? byte >> 4 : byte & 0xF;
}

// The float32 weight of input i and column c of a quantized block whose quants start at qs, with the column's
// scale d (and Q4_1 minimum m), as gguf.quants dequantizes it: d * q is exact, so Q4_1's one FMA rounds once.
inline float rebuilt_weight(const uint8_t* qs, Quant q, float d, float m, int64_t i, int64_t c) {
  if (is_half(q)) {
    uint16_t h;
    std::memcpy(&h, qs + (i * kPanel + c) * 2, sizeof h);
    return q == Quant::kBF16 ? bf16_to_float(h) : specgen::half_to_float(h);
  }
  if (q == Quant::kQ8_0 || q == Quant::kQ6_K) return static_cast<float>(static_cast<int8_t>(qs[i * kPanel + c])) * d;
  if (q == Quant::kQX) return std::fma(d, static_cast<float>(static_cast<int8_t>(qs[i * kPanel + c])), m);
  const int nib = q4_nibble(qs, i, c);
  return q == Quant::kQ4_0 ? d * static_cast<float>(nib - 8) : std::fma(d, static_cast<float>(nib), m);
}

// Column c's scales for the inputs of half h (0: inputs 0-15, 1: 16-31) of the block at blk (K-quants: of the
// super-block whose scales are at sup), as the weights use them: w = fma(d, q, m), m = 0 where the format has
// no offset (Q4_0's q is the nibble - 8; 16-bit formats have no scales).
inline void block_scale_ref(Quant q, const uint8_t* blk, const uint8_t* sup, int64_t c, int h, float& d, float& m) {
  const uint16_t* halfs = reinterpret_cast<const uint16_t*>(q == Quant::kQ4_K || is_q6(q) ? sup : blk);
  d = m = 0.f;
  if (q == Quant::kQ4_K) {  // d * sc and -(dmin * m), exact
    d = specgen::half_to_float(halfs[c]) * static_cast<float>(blk[c]);
    m = -(specgen::half_to_float(halfs[kPanel + c]) * static_cast<float>(blk[kPanel + c]));
  } else if (is_q6(q)) {  // (kQ6_K8: the same scales)
    d = specgen::half_to_float(halfs[c]) * static_cast<float>(static_cast<int8_t>(blk[h * kPanel + c]));
  } else if (q == Quant::kQX) {
    float wide[2];
    std::memcpy(&wide[0], blk + (h * kPanel + c) * sizeof(float), sizeof(float));
    std::memcpy(&wide[1], blk + ((2 + h) * kPanel + c) * sizeof(float), sizeof(float));
    d = wide[0], m = wide[1];
  } else if (!is_half(q)) {
    d = specgen::half_to_float(halfs[c]);
    if (q == Quant::kQ4_1) m = specgen::half_to_float(halfs[kPanel + c]);
  }
}

// The dequantized panel [k, 32] of one quantized panel, in scalar code: the quantized path of builds without
// AVX-512 or AVX2 (with AVX-512, block_weights and qpanel_rows below do the same with vectors).
void dequant_panel_ref(const uint8_t* p, int64_t k, Quant q, float* out) {
  for (int64_t b = 0; b < k / kBlock; ++b) {
    const uint8_t* blk = block_at(q, p, b);
    const uint8_t* qs = blk + quant_head(q);
    for (int64_t i = 0; i < kBlock; ++i) {
      float* w = out + (b * kBlock + i) * kPanel;
      for (int64_t c = 0; c < kPanel; ++c) {
        float d, m;
        block_scale_ref(q, blk, super_at(q, p, b), c, i < 16 ? 0 : 1, d, m);
        w[c] = rebuilt_weight(qs, q, d, m, i, c);
      }
    }
  }
}

#if defined(__AVX512F__)
// a[r] += x[r * k + i] * (w0 | w1) for the G rows: one step of each output's FMA chain.
template <int G>
inline void fma_rows(const float* x, int64_t k, int64_t i, __m512 w0, __m512 w1, __m512* a0, __m512* a1) {
  for (int r = 0; r < G; ++r) {
    const __m512 b = _mm512_set1_ps(x[r * k + i]);
    a0[r] = _mm512_fmadd_ps(b, w0, a0[r]);
    a1[r] = _mm512_fmadd_ps(b, w1, a1[r]);
  }
}

// y[r, c0 .. c0 + width) = the G rows' accumulators (columns 0-15 in a0, 16-31 in a1).
template <int G>
inline void store_rows(const __m512* a0, const __m512* a1, float* y, int64_t n, int64_t c0, int64_t width) {
  const __mmask16 m0 = width >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << width) - 1);
  const __mmask16 m1 = width >= 32 ? 0xFFFF : width <= 16 ? 0 : static_cast<__mmask16>((1u << (width - 16)) - 1);
  for (int r = 0; r < G; ++r) {
    _mm512_mask_storeu_ps(y + r * n + c0, m0, a0[r]);
    _mm512_mask_storeu_ps(y + r * n + c0 + 16, m1, a1[r]);
  }
}

constexpr int kBoth = 5;  // rows whose two chains (4 accumulators per row) share one pass over a panel

// y[r, c0 .. c0 + width) = a[r] + b[r] for the G rows (the two chains' sums, even + odd).
template <int G>
inline void store_chains(__m512* a0, __m512* a1, const __m512* b0, const __m512* b1, float* y, int64_t n,
                         int64_t c0, int64_t width) {
  for (int r = 0; r < G; ++r) {
    a0[r] = _mm512_add_ps(a0[r], b0[r]);
    a1[r] = _mm512_add_ps(a1[r], b1[r]);
  }
  store_rows<G>(a0, a1, y, n, c0, width);
}

// The even chains' sums of G rows, parked in `part` [G, 32] while a second pass runs the odd chains.
template <int G>
inline void park(const __m512* a0, const __m512* a1, float* part) {
  for (int r = 0; r < G; ++r) {
    _mm512_store_ps(part + r * kPanel, a0[r]);
    _mm512_store_ps(part + r * kPanel + 16, a1[r]);
  }
}

template <int G>
inline void unpark(const float* part, __m512* a0, __m512* a1) {
  for (int r = 0; r < G; ++r) {
    a0[r] = _mm512_load_ps(part + r * kPanel);
    a1[r] = _mm512_load_ps(part + r * kPanel + 16);
  }
}

// The chain of inputs i = first, first + step, ... < k of G rows over panel p [k, 32], into a.
template <int G>
inline void panel_chain(const float* x, int64_t k, const float* p, int64_t first, int64_t step, __m512* a0,
                        __m512* a1) {
  for (int64_t i = first; i < k; i += step) {
    const float* w = p + i * kPanel;
    _mm_prefetch(reinterpret_cast<const char*>(w + kPanel * kAhead), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(w + kPanel * kAhead + 16), _MM_HINT_T0);
    fma_rows<G>(x, k, i, _mm512_load_ps(w), _mm512_load_ps(w + 16), a0, a1);
  }
}

// y[r, c0 .. c0 + width) for rows r < G of x (row stride k); panel p [k, 32]
template <int G>
inline void panel_rows(const float* x, int64_t k, const float* p, float* y, int64_t n, int64_t c0, int64_t width) {
  __m512 a0[G], a1[G], b0[G], b1[G];  // the even inputs' chains (a) and the odd ones' (b)
  for (int r = 0; r < G; ++r) a0[r] = a1[r] = b0[r] = b1[r] = _mm512_setzero_ps();
  if constexpr (G <= kBoth) {
    const float* w = p;
    int64_t i = 0;
    for (; i + 1 < k; i += 2, w += 2 * kPanel) {  // an even input, then an odd one
      for (int64_t off = 0; off < 2 * kPanel; off += 16)
        _mm_prefetch(reinterpret_cast<const char*>(w + kPanel * kAhead + off), _MM_HINT_T0);
      fma_rows<G>(x, k, i, _mm512_load_ps(w), _mm512_load_ps(w + 16), a0, a1);
      fma_rows<G>(x, k, i + 1, _mm512_load_ps(w + kPanel), _mm512_load_ps(w + kPanel + 16), b0, b1);
    }
    if (i < k) fma_rows<G>(x, k, i, _mm512_load_ps(w), _mm512_load_ps(w + 16), a0, a1);  // odd k: the last input
  } else {
    alignas(64) float part[G * kPanel];
    panel_chain<G>(x, k, p, 0, 2, a0, a1);
    park<G>(a0, a1, part);
    panel_chain<G>(x, k, p, 1, 2, b0, b1);
    unpark<G>(part, a0, a1);
  }
  store_chains<G>(a0, a1, b0, b1, y, n, c0, width);
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

// Rows in ceil(m / kGroup) groups of balanced sizes (5 + 4 rather than 8 + 1 for 9 rows): a lone row keeps
// few FMA chains in flight and waits on the FMA's latency (when each output was one chain, an 8 + 1 split cost
// 9 rows what 12 cost). The first m mod groups groups get one row more.
inline int64_t group_rows(int64_t m, int64_t groups, int64_t g) { return m / groups + (g < m % groups ? 1 : 0); }

// y[r, c0 .. c0 + 32) = rows r0 .. m of x times panel p [k, 32], in balanced groups from the (g0)th of groups.
void panel_groups(const float* x, int64_t m, int64_t k, const float* p, float* y, int64_t n, int64_t c0, int64_t r0,
                  int64_t g0, int64_t groups) {
  const int64_t width = std::min<int64_t>(kPanel, n - c0);
  for (int64_t g = g0, r = r0; g < groups; r += group_rows(m, groups, g), ++g)
    panel_tail<kGroup>(x + r * k, group_rows(m, groups, g), k, p, y + r * n, n, c0, width);
}

void panel_all(const float* x, int64_t m, int64_t k, const float* p, float* y, int64_t n, int64_t c0) {
  panel_groups(x, m, k, p, y, n, c0, 0, 0, (m + kGroup - 1) / kGroup);
}

// The column scales of the block at p (columns 0-15 in d0 and m0, 16-31 in d1 and m1); K-quants: products with
// their super-block's fp16 scales at sup, exact (Q6_K: the scales of inputs 0-15 in d, of inputs 16-31 in m).
template <Quant Q>
inline void block_scales(const uint8_t* p, const uint8_t* sup, __m512& d0, __m512& d1, __m512& m0, __m512& m1) {
  auto half16 = [](const uint8_t* a) { return _mm512_cvtph_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(a))); };
  auto byte16 = [](const uint8_t* a) {  // 16 scale bytes, unsigned (Q4_K) or signed (Q6_K), as float32
    const __m128i v = _mm_load_si128(reinterpret_cast<const __m128i*>(a));
    return _mm512_cvtepi32_ps(Q == Quant::kQ4_K ? _mm512_cvtepu8_epi32(v) : _mm512_cvtepi8_epi32(v));
  };
  if constexpr (Q == Quant::kQ4_K) {  // d sc; -(dmin m), the FNMA's -0 addend keeps the negation's zero sign
    const __m512 z = _mm512_set1_ps(-0.f);
    d0 = _mm512_mul_ps(half16(sup), byte16(p)), d1 = _mm512_mul_ps(half16(sup + 32), byte16(p + 16));
    m0 = _mm512_fnmadd_ps(half16(sup + 64), byte16(p + 32), z);
    m1 = _mm512_fnmadd_ps(half16(sup + 96), byte16(p + 48), z);
    return;
  }
  if constexpr (is_q6(Q)) {
    const __m512 s0 = half16(sup), s1 = half16(sup + 32);
    d0 = _mm512_mul_ps(s0, byte16(p)), d1 = _mm512_mul_ps(s1, byte16(p + 16));
    m0 = _mm512_mul_ps(s0, byte16(p + 32)), m1 = _mm512_mul_ps(s1, byte16(p + 48));
    return;
  }
  d0 = half16(p), d1 = half16(p + 32);
  if constexpr (Q == Quant::kQ4_1) {
    m0 = half16(p + 64), m1 = half16(p + 96);
  } else {
    m0 = m1 = _mm512_setzero_ps();
  }
}

constexpr int64_t kQuantAhead = 4096;  // prefetch distance in bytes of a quantized panel

// f(i, w0, w1) for the inputs i of the quantized block at p (K-quants: of the super-block whose scales are at
// sup), in order: the weights of panel row i (columns 0-15 in w0, 16-31 in w1), rebuilt in float32 as
// gguf.quants dequantizes them. Par 2: all 32 inputs; 0 or 1: the even or the odd ones only (one chain's pass).
template <Quant Q, int Par, typename F>
inline void block_weights(const uint8_t* p, const uint8_t* sup, F&& f) {
  constexpr int64_t first = Par == 2 ? 0 : Par, step = Par == 2 ? 1 : 2;
  if constexpr (is_half(Q)) {  // 32 16-bit weights per input, widened exactly
#pragma GCC unroll 2
    for (int64_t i = first; i < kBlock; i += step) {
      const __m256i h0 = _mm256_load_si256(reinterpret_cast<const __m256i*>(p + i * 64));
      const __m256i h1 = _mm256_load_si256(reinterpret_cast<const __m256i*>(p + i * 64 + 32));
      if constexpr (Q == Quant::kF16) {
        f(i, _mm512_cvtph_ps(h0), _mm512_cvtph_ps(h1));
      } else {
        f(i, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h0), 16)),
          _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h1), 16)));
      }
    }
    return;
  }
  if constexpr (Q == Quant::kQX) {  // d of inputs 0-15, of 16-31, then m of each: w = fma(d, q, m)
    const float* sc = reinterpret_cast<const float*>(p);
    const uint8_t* qs = p + quant_head(Q);
    for (int h = 0; h < 2; ++h) {
      const __m512 d0 = _mm512_load_ps(sc + 32 * h), d1 = _mm512_load_ps(sc + 32 * h + 16);
      const __m512 m0 = _mm512_load_ps(sc + 64 + 32 * h), m1 = _mm512_load_ps(sc + 64 + 32 * h + 16);
#pragma GCC unroll 2
      for (int64_t i = h * 16 + first; i < h * 16 + 16; i += step) {
        const __m512i q0 = _mm512_cvtepi8_epi32(_mm_load_si128(reinterpret_cast<const __m128i*>(qs + i * kPanel)));
        const __m512i q1 = _mm512_cvtepi8_epi32(_mm_load_si128(reinterpret_cast<const __m128i*>(qs + i * kPanel + 16)));
        f(i, _mm512_fmadd_ps(d0, _mm512_cvtepi32_ps(q0), m0), _mm512_fmadd_ps(d1, _mm512_cvtepi32_ps(q1), m1));
      }
    }
    return;
  }
  __m512 d0, d1, m0, m1;
  block_scales<Q>(p, sup, d0, d1, m0, m1);
  const uint8_t* qs = p + quant_head(Q);
  if constexpr (Q == Quant::kQ8_0 || Q == Quant::kQ6_K) {
#pragma GCC unroll 2
    for (int64_t i = first; i < kBlock; i += step) {
      const __m512i q0 = _mm512_cvtepi8_epi32(_mm_load_si128(reinterpret_cast<const __m128i*>(qs + i * kPanel)));
      const __m512i q1 = _mm512_cvtepi8_epi32(_mm_load_si128(reinterpret_cast<const __m128i*>(qs + i * kPanel + 16)));
      const bool low = Q == Quant::kQ8_0 || i < 16;  // Q6_K: the second half's scales are in m0, m1
      f(i, _mm512_mul_ps(_mm512_cvtepi32_ps(q0), low ? d0 : m0), _mm512_mul_ps(_mm512_cvtepi32_ps(q1), low ? d1 : m1));
    }
  } else {
    // Each 32-bit lane holds one column's nibbles of 8 consecutive inputs (q4_nibble). A permute reads only its
    // index's low 4 bits, so it turns the lane's lowest nibble into the float 0..15 (Q4_0: -8..7) without a
    // mask, and a shift by 4 brings up the next: one shuffle and one shift per 16 weights (for one chain, a
    // shift by 8 brings up the next input of the same parity).
    const __m512 values = Q == Quant::kQ4_0 ? _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7)
                                             : _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    for (int64_t g = 0; g < kBlock / 8; ++g) {
      __m512i v0 = _mm512_load_si512(qs + g * 128), v1 = _mm512_load_si512(qs + g * 128 + 64);
      if constexpr (Par == 1) {
        v0 = _mm512_srli_epi32(v0, 4);
        v1 = _mm512_srli_epi32(v1, 4);
      }
#pragma GCC unroll 8
      for (int64_t j = first; j < 8; j += step) {
        const __m512 q0 = _mm512_permutexvar_ps(v0, values), q1 = _mm512_permutexvar_ps(v1, values);
        if constexpr (Q == Quant::kQ4_0) {
          f(g * 8 + j, _mm512_mul_ps(d0, q0), _mm512_mul_ps(d1, q1));
        } else {
          f(g * 8 + j, _mm512_fmadd_ps(d0, q0, m0), _mm512_fmadd_ps(d1, q1, m1));
        }
        v0 = _mm512_srli_epi32(v0, 4 * step);
        v1 = _mm512_srli_epi32(v1, 4 * step);
      }
    }
  }
}

// One pass over a quantized panel (block_weights' Par): the even inputs into a, the odd ones into b; with Keep,
// the rebuilt weights are also stored in `keep` [k, 32].
template <Quant Q, int G, int Par, bool Keep>
inline void qpanel_chain(const float* x, int64_t k, const uint8_t* p, float* keep, __m512* a0, __m512* a1,
                         __m512* b0, __m512* b1) {
  constexpr int64_t bytes = quant_bytes(Q);  // on average, per block
  for (int64_t b = 0; b < k / kBlock; ++b) {
    if constexpr (Par != 1)  // the odd inputs' pass reads what the even inputs' pass brought in
      for (int64_t off = 0; off < bytes; off += 64)
        _mm_prefetch(reinterpret_cast<const char*>(p + b * bytes + kQuantAhead + off), _MM_HINT_T0);
    block_weights<Q, Par>(block_at(Q, p, b), super_at(Q, p, b), [&](int64_t i, __m512 w0, __m512 w1) {
      if constexpr (Keep) {
        _mm512_store_ps(keep + (b * kBlock + i) * kPanel, w0);
        _mm512_store_ps(keep + (b * kBlock + i) * kPanel + 16, w1);
      }
      if (i % 2 == 0) fma_rows<G>(x + b * kBlock, k, i, w0, w1, a0, a1);
      else fma_rows<G>(x + b * kBlock, k, i, w0, w1, b0, b1);
    });
  }
}

// panel_rows over a quantized panel: each weight is rebuilt in registers and applied to the G rows at once;
// with Keep, the rebuilt panel [k, 32] is also stored in `keep` for the next row groups (qpanel_all).
template <Quant Q, int G, bool Keep = false>
inline void qpanel_rows(const float* x, int64_t k, const uint8_t* p, float* y, int64_t n, int64_t c0,
                        int64_t width, float* keep = nullptr) {
  __m512 a0[G], a1[G], b0[G], b1[G];  // the even inputs' chains (a) and the odd ones' (b); kBlock is even
  for (int r = 0; r < G; ++r) a0[r] = a1[r] = b0[r] = b1[r] = _mm512_setzero_ps();
  if constexpr (G <= kBoth) {
    qpanel_chain<Q, G, 2, Keep>(x, k, p, keep, a0, a1, b0, b1);
  } else {
    alignas(64) float part[G * kPanel];
    qpanel_chain<Q, G, 0, Keep>(x, k, p, keep, a0, a1, a0, a1);
    park<G>(a0, a1, part);
    qpanel_chain<Q, G, 1, Keep>(x, k, p, keep, b0, b1, b0, b1);
    unpark<G>(part, a0, a1);
  }
  store_chains<G>(a0, a1, b0, b1, y, n, c0, width);
}

template <Quant Q, int G, bool Keep = false>
inline void qpanel_tail(const float* x, int64_t rows, int64_t k, const uint8_t* p, float* y, int64_t n, int64_t c0,
                        int64_t width, float* keep = nullptr) {
  if constexpr (G > 0) {
    if (rows == G) return qpanel_rows<Q, G, Keep>(x, k, p, y, n, c0, width, keep);
    qpanel_tail<Q, G - 1, Keep>(x, rows, k, p, y, n, c0, width, keep);
  }
}

template <Quant Q>
void qpanel_all(const float* x, int64_t m, int64_t k, const uint8_t* p, float* y, int64_t n, int64_t c0) {
  const int64_t width = std::min<int64_t>(kPanel, n - c0);
  if (m <= kGroup) return qpanel_tail<Q, kGroup>(x, m, k, p, y, n, c0, width);
  // Several row groups: the first rebuilds the panel in registers, as above, streaming the blocks with prefetch
  // while it multiplies, and keeps the rebuilt panel (it stays in L2); the float32 kernel runs the other groups
  // over it. (Rebuilding it first and multiplying after left the FMAs idle while the blocks came from memory:
  // 16 rows cost 2.6x 8 rows.)
  static thread_local std::vector<__m512> scratch;  // [k, 32] floats, 64-byte aligned
  scratch.resize(k * kPanel / 16);
  float* w = reinterpret_cast<float*>(scratch.data());
  const int64_t groups = (m + kGroup - 1) / kGroup, first = group_rows(m, groups, 0);
  qpanel_tail<Q, kGroup, true>(x, first, k, p, y, n, c0, width, w);
  panel_groups(x, m, k, w, y, n, c0, first, 1, groups);
}

void qpanel_any(const float* x, int64_t m, int64_t k, const uint8_t* p, Quant q, float* y, int64_t n, int64_t c0) {
  with_quant(q, [&](auto Q) { qpanel_all<decltype(Q)::value>(x, m, k, p, y, n, c0); });
}

// ---- Many rows (prefill): two panels at a time ----
//
// panel_rows gives each broadcast input two FMAs (one panel's 32 columns) and, past kBoth rows, streams the
// whole panel from L2 for every group of rows: with many rows it was bound by those reads, not by its FMAs
// (~120 GFLOP/s on two cores where MKL reached ~145). Past kWideMin rows, pair_all applies kPairRows rows at a
// time to two adjacent panels (64 columns, 4 FMAs per broadcast, 24 accumulators), one chain per pass as
// panel_rows does past kBoth rows, over slices of the inputs that stay in L1: every output is still its even
// chain plus its odd chain, each in input order, so the bits are those of panel_rows whatever the row count.
constexpr int64_t kPairRows = 6;    // rows per group of pair_all
constexpr int64_t kChunkRows = 48;  // rows per work item of wide_linear
constexpr int64_t kWideMin = 2 * kGroup + 1;  // rows from which packed_linear takes wide_linear
constexpr int64_t kSlice = 96;      // inputs per slice of pair_all (even: the chains' parity is kept)

// One chain's inputs i = i0, i0 + 2, ... < i1 of G rows over panels p and q [k, 32], continuing the accumulators
// at acc [G, 64] (zero when i0 < 2) and leaving them there.
template <int G>
inline void pair_chain(const float* x, int64_t k, const float* p, const float* q, int64_t i0, int64_t i1,
                       float* acc) {
  __m512 a[G][4];
  for (int r = 0; r < G; ++r)
    for (int c = 0; c < 4; ++c) a[r][c] = i0 < 2 ? _mm512_setzero_ps() : _mm512_load_ps(acc + r * 64 + 16 * c);
  for (int64_t i = i0; i < i1; i += 2) {
    const __m512 w0 = _mm512_load_ps(p + i * kPanel), w1 = _mm512_load_ps(p + i * kPanel + 16);
    const __m512 w2 = _mm512_load_ps(q + i * kPanel), w3 = _mm512_load_ps(q + i * kPanel + 16);
    for (int r = 0; r < G; ++r) {
      const __m512 b = _mm512_set1_ps(x[r * k + i]);
      a[r][0] = _mm512_fmadd_ps(b, w0, a[r][0]);
      a[r][1] = _mm512_fmadd_ps(b, w1, a[r][1]);
      a[r][2] = _mm512_fmadd_ps(b, w2, a[r][2]);
      a[r][3] = _mm512_fmadd_ps(b, w3, a[r][3]);
    }
  }
  for (int r = 0; r < G; ++r)
    for (int c = 0; c < 4; ++c) _mm512_store_ps(acc + r * 64 + 16 * c, a[r][c]);
}

// Both chains of G rows over the inputs [s0, s1) (s0 even), accumulators at acc [2, G, 64] (even, odd).
template <int G>
inline void pair_slice(const float* x, int64_t k, const float* p, const float* q, int64_t s0, int64_t s1, float* acc) {
  pair_chain<G>(x, k, p, q, s0, s1, acc);
  pair_chain<G>(x, k, p, q, s0 + 1, s1, acc + G * 64);
}

template <int G>
inline void pair_slice_tail(const float* x, int64_t rows, int64_t k, const float* p, const float* q, int64_t s0,
                            int64_t s1, float* acc) {
  if constexpr (G > 0) {
    if (rows == G) return pair_slice<G>(x, k, p, q, s0, s1, acc);
    pair_slice_tail<G - 1>(x, rows, k, p, q, s0, s1, acc);
  }
}

// y[r, c0 .. c0 + min(64, n - c0)) for m <= kChunkRows rows of x, panels p and q holding columns c0 .. c0 + 64.
// The inputs go in slices of kSlice, each applied to every row group before the next: the two panels' slice
// (24 KB) stays in L1 while the groups reuse it (one group's pass over whole panels read them from L2, which
// bound it), and each group's accumulators wait in `acc` between slices. Each chain still runs over its inputs
// in order, so the bits are unchanged.
void pair_all(const float* x, int64_t m, int64_t k, const float* p, const float* q, float* y, int64_t n,
              int64_t c0) {
  const int64_t width = std::min<int64_t>(2 * kPanel, n - c0), groups = (m + kPairRows - 1) / kPairRows;
  alignas(64) float acc[(kChunkRows + kPairRows - 1) / kPairRows][2 * kPairRows * 64];
  for (int64_t s0 = 0; s0 < k; s0 += kSlice) {
    const int64_t s1 = std::min(k, s0 + kSlice);
    for (int64_t g = 0; g < groups; ++g) {
      const int64_t r = g * kPairRows, rows = std::min(kPairRows, m - r);
      pair_slice_tail<kPairRows>(x + r * k, rows, k, p, q, s0, s1, acc[g]);
    }
  }
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t r0 = g * kPairRows, rows = std::min(kPairRows, m - r0);
    const float* even = acc[g];
    const float* odd = acc[g] + rows * 64;
    for (int c = 0; c < 4; ++c) {
      const int64_t left = width - 16 * c;
      const __mmask16 mk = left >= 16 ? 0xFFFF : left <= 0 ? 0 : static_cast<__mmask16>((1u << left) - 1);
      for (int64_t r = 0; r < rows; ++r)  // even + odd, as store_chains adds them
        _mm512_mask_storeu_ps(y + (r0 + r) * n + c0 + 16 * c, mk,
                              _mm512_add_ps(_mm512_load_ps(even + r * 64 + 16 * c), _mm512_load_ps(odd + r * 64 + 16 * c)));
    }
  }
}

// The first group of rows over a quantized panel, rebuilding it into `keep` [k, 32] as it goes (qpanel_all's
// first group).
void qpanel_keep(const float* x, int64_t rows, int64_t k, const uint8_t* p, Quant q, float* y, int64_t n, int64_t c0,
                 float* keep) {
  const int64_t width = std::min<int64_t>(kPanel, n - c0);
  with_quant(q, [&](auto Q) { qpanel_tail<decltype(Q)::value, kGroup, true>(x, rows, k, p, y, n, c0, width, keep); });
}

// packed_linear for m >= kWideMin rows: work items (pair of panels, chunk of <= kChunkRows rows), pair-major, in
// static shares, so a thread meets each of its pairs in consecutive items and rebuilds a quantized pair once, in
// its first item (whose first kGroup rows run qpanel_rows with Keep, streaming the blocks with prefetch). A last
// panel without a partner takes the one-panel path on each chunk.
void wide_linear(const float* x, int64_t m, int64_t k, const void* data, int64_t panels, int64_t kind,
                 float* y, int64_t n, int64_t c_base) {
  const int64_t pairs = (panels + 1) / 2, threads = omp_get_max_threads();
  int64_t chunks = (m + kChunkRows - 1) / kChunkRows;
  // Few items that the threads cannot share evenly (9 pairs of a 576-column weight, 32 rows: 5 against 4):
  // smaller chunks, so they can.
  if ((pairs * chunks) % threads != 0 && pairs * chunks < 8 * threads)
    chunks = std::min(std::max<int64_t>(m / kPairRows, 1), chunks * threads);
  const int64_t chunk_rows = (m + chunks - 1) / chunks;  // <= kChunkRows
  chunks = (m + chunk_rows - 1) / chunk_rows;  // every chunk has rows
  const int64_t panel_bytes = kind ? k / kBlock * quant_bytes(static_cast<Quant>(kind)) : 0;
  const float* f = static_cast<const float*>(data);
  const uint8_t* qp = static_cast<const uint8_t*>(data);
#pragma omp parallel
  {
    static thread_local std::vector<__m512> scratch;  // two rebuilt panels [2, k, 32]
    if (kind) scratch.resize(2 * k * kPanel / 16);
    float* s = reinterpret_cast<float*>(scratch.data());
    int64_t have = -1;  // the pair now in scratch
#pragma omp for schedule(static)
    for (int64_t item = 0; item < pairs * chunks; ++item) {
      const int64_t pi = item / chunks, r0 = item % chunks * chunk_rows, rows = std::min(chunk_rows, m - r0);
      const int64_t p0 = 2 * pi, c0 = c_base + p0 * kPanel;
      const float* xr = x + r0 * k;
      float* yr = y + r0 * n;
      if (p0 + 1 == panels) {  // the last panel, alone
        if (kind) qpanel_any(xr, rows, k, qp + p0 * panel_bytes, static_cast<Quant>(kind), yr, n, c0);
        else panel_all(xr, rows, k, f + p0 * k * kPanel, yr, n, c0);
        continue;
      }
      if (!kind) {
        pair_all(xr, rows, k, f + p0 * k * kPanel, f + (p0 + 1) * k * kPanel, yr, n, c0);
        continue;
      }
      int64_t done = 0;
      if (have != pi) {
        done = std::min(kGroup, rows);
        for (int64_t h = 0; h < 2; ++h)
          qpanel_keep(xr, done, k, qp + (p0 + h) * panel_bytes, static_cast<Quant>(kind), yr, n,
                      c0 + h * kPanel, s + h * k * kPanel);
        have = pi;
      }
      pair_all(xr + done * k, rows - done, k, s, s + k * kPanel, yr + done * n, n, c0);
    }
  }
}
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
// AVX2 (x86-64-v3 CPUs without AVX-512): the same two chains per output, 8 columns to a vector. One row takes the
// whole panel at once (2 chains x 4 vectors = 8 accumulators of the 16 registers); more rows go in groups of up to
// kRows2, each over 32 inputs at a time and half the panel at a time (2 chains x 2 vectors per row), their
// accumulators parked in L1 between halves, so each group still reads the panel once. A quantized panel is
// rebuilt as gguf.quants dequantizes it, block by block into L1 for up to kRows2 rows, or once whole for more.
// Chains run in input order and are summed even + odd at the end: the bits are those of the AVX-512 and generic
// paths, whatever the row count.
constexpr int kRows2 = 3;  // rows per group: 3 rows x 2 chains x 2 vectors = 12 accumulators
constexpr int64_t kQuantAhead2 = 4096;  // prefetch distance in bytes of a quantized panel

// The G rows' chains over inputs i0 .. i1 (i0 even) of weights w (input i's V vectors of 8 columns at w + i * ws):
// a[r][v] the even inputs' chain of column vector v, a[r][V + v] the odd ones'.
template <int G, int V>
inline void chains(const float* x, int64_t k, int64_t i0, int64_t i1, const float* w, int64_t ws,
                   __m256 (&a)[G][2 * V]) {
  int64_t i = i0;
  for (; i + 1 < i1; i += 2) {
    const float* we = w + i * ws;
    __m256 wv[V];
    for (int v = 0; v < V; ++v) wv[v] = _mm256_loadu_ps(we + 8 * v);
    for (int r = 0; r < G; ++r) {
      const __m256 b = _mm256_broadcast_ss(x + r * k + i);
      for (int v = 0; v < V; ++v) a[r][v] = _mm256_fmadd_ps(b, wv[v], a[r][v]);
    }
    for (int v = 0; v < V; ++v) wv[v] = _mm256_loadu_ps(we + ws + 8 * v);
    for (int r = 0; r < G; ++r) {
      const __m256 b = _mm256_broadcast_ss(x + r * k + i + 1);
      for (int v = 0; v < V; ++v) a[r][V + v] = _mm256_fmadd_ps(b, wv[v], a[r][V + v]);
    }
  }
  if (i < i1) {  // a last even input (odd k)
    for (int r = 0; r < G; ++r) {
      const __m256 b = _mm256_broadcast_ss(x + r * k + i);
      for (int v = 0; v < V; ++v) a[r][v] = _mm256_fmadd_ps(b, _mm256_loadu_ps(w + i * ws + 8 * v), a[r][v]);
    }
  }
}

// y[r, c0 .. c0 + width) = even + odd chains of the G rows (width <= 8 V).
template <int G, int V>
inline void store_chains2(__m256 (&a)[G][2 * V], float* y, int64_t n, int64_t c0, int64_t width) {
  for (int r = 0; r < G; ++r) {
    alignas(32) float out[8 * V];
    for (int v = 0; v < V; ++v) _mm256_store_ps(out + 8 * v, _mm256_add_ps(a[r][v], a[r][V + v]));
    std::memcpy(y + r * n + c0, out, sizeof(float) * width);
  }
}

// The quantized block at blk (K-quants: of the super-block whose scales are at sup) rebuilt as float32 into out
// [32, 32] (row stride os).
template <Quant Q>
inline void rebuild_block(const uint8_t* blk, const uint8_t* sup, float* out, int64_t os) {
  if constexpr (is_half(Q)) {  // 32 16-bit weights per input, widened exactly
    for (int64_t i = 0; i < kBlock; ++i)
      for (int c = 0; c < kPanel; c += 8) {
        const __m128i h = _mm_load_si128(reinterpret_cast<const __m128i*>(blk + (i * kPanel + c) * 2));
        _mm256_storeu_ps(out + i * os + c, Q == Quant::kF16 ? _mm256_cvtph_ps(h)
                                                             : _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16)));
      }
    return;
  }
  const uint8_t* qs = blk + quant_head(Q);
  if constexpr (Q == Quant::kQX) {  // d of inputs 0-15, of 16-31, then m of each: w = fma(d, q, m)
    const float* wide = reinterpret_cast<const float*>(blk);
    for (int c = 0; c < kPanel; c += 8)
      for (int64_t i = 0; i < kBlock; ++i) {
        const int64_t h = i < 16 ? 0 : kPanel;
        const __m256i q = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(qs + i * kPanel + c)));
        _mm256_storeu_ps(out + i * os + c, _mm256_fmadd_ps(_mm256_loadu_ps(wide + h + c), _mm256_cvtepi32_ps(q),
                                                           _mm256_loadu_ps(wide + 2 * kPanel + h + c)));
      }
    return;
  }
  auto half8 = [](const uint8_t* a) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(a))); };
  auto byte8 = [](const uint8_t* a) {  // 8 scale bytes, unsigned (Q4_K) or signed (Q6_K), as float32
    const __m128i v = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(a));
    return _mm256_cvtepi32_ps(Q == Quant::kQ4_K ? _mm256_cvtepu8_epi32(v) : _mm256_cvtepi8_epi32(v));
  };
  for (int c = 0; c < kPanel; c += 8) {  // columns c .. c + 7
    // K-quants: the exact products of the super-block's scales with the block's (block_scales)
    const __m256 d = Q == Quant::kQ4_K || Q == Quant::kQ6_K ? _mm256_mul_ps(half8(sup + 2 * c), byte8(blk + c))
                                                            : half8(blk + 2 * c);
    if constexpr (Q == Quant::kQ8_0 || Q == Quant::kQ6_K) {
      // Q6_K: inputs 16-31's scale
      const __m256 d1 = Q == Quant::kQ6_K ? _mm256_mul_ps(half8(sup + 2 * c), byte8(blk + kPanel + c)) : d;
      for (int64_t i = 0; i < kBlock; ++i) {
        const __m256i q = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(qs + i * kPanel + c)));
        _mm256_storeu_ps(out + i * os + c, _mm256_mul_ps(_mm256_cvtepi32_ps(q), i < 16 ? d : d1));
      }
    } else {
      // per group of 8 inputs, the 8 columns' 32-bit lanes at 4 c (q4_nibble): input j in bits 4j .. 4j + 3
      const __m256 m = Q == Quant::kQ4_1   ? half8(blk + 64 + 2 * c)
                       : Q == Quant::kQ4_K ? _mm256_fnmadd_ps(half8(sup + 64 + 2 * c), byte8(blk + kPanel + c),
                                                              _mm256_set1_ps(-0.f))  // -(dmin m)
                                           : _mm256_set1_ps(8.f);
      const __m256i low = _mm256_set1_epi32(0xF);
      for (int64_t g = 0; g < kBlock / 8; ++g) {
        __m256i lanes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + g * 128 + 4 * c));
        for (int64_t j = 0; j < 8; ++j, lanes = _mm256_srli_epi32(lanes, 4)) {
          const __m256 q = _mm256_cvtepi32_ps(_mm256_and_si256(lanes, low));
          const __m256 w = Q == Quant::kQ4_0 ? _mm256_mul_ps(d, _mm256_sub_ps(q, m)) : _mm256_fmadd_ps(d, q, m);
          _mm256_storeu_ps(out + (g * 8 + j) * os + c, w);
        }
      }
    }
  }
}

// Rows in balanced groups of at most kRows2 (2 + 2 rather than 3 + 1 for 4 rows).
inline int64_t group_rows2(int64_t m, int64_t g) {
  const int64_t groups = (m + kRows2 - 1) / kRows2;
  return m / groups + (g < m % groups ? 1 : 0);
}

// Accumulators of G rows over both halves of a panel, parked in L1 while the other half runs.
template <int G>
struct Parked {
  __m256 half[2][G][4];
  void clear() {
    for (auto& h : half)
      for (auto& r : h)
        for (auto& v : r) v = _mm256_setzero_ps();
  }
  // inputs i0 .. i1 of both halves, weights of input i at w + i * ws (32 columns)
  void run(const float* x, int64_t k, int64_t i0, int64_t i1, const float* w, int64_t ws) {
    for (int h = 0; h < 2; ++h) {
      __m256 a[G][4];
      std::memcpy(a, half[h], sizeof(a));
      chains<G, 2>(x, k, i0, i1, w + 16 * h, ws, a);
      std::memcpy(half[h], a, sizeof(a));
    }
  }
  void store(float* y, int64_t n, int64_t c0, int64_t width) {
    for (int h = 0; h < 2 && 16 * h < width; ++h)
      store_chains2<G, 2>(half[h], y, n, c0 + 16 * h, std::min<int64_t>(16, width - 16 * h));
  }
};

// Prefetch the float32 panel rows kAhead .. kAhead + 32 past input i0 (those before k), both cache lines of each.
inline void prefetch_rows(const float* p, int64_t i0, int64_t k) {
  for (int64_t i = i0 + kAhead; i < std::min(k, i0 + kAhead + kBlock); ++i) {
    _mm_prefetch(reinterpret_cast<const char*>(p + i * kPanel), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(p + i * kPanel + 16), _MM_HINT_T0);
  }
}

// One row's chains over the whole float32 panel p [k, 32] in registers.
inline void panel_row(const float* x, int64_t k, const float* p, float* y, int64_t n, int64_t c0, int64_t width) {
  __m256 a[1][8];
  for (int v = 0; v < 8; ++v) a[0][v] = _mm256_setzero_ps();
  for (int64_t i0 = 0; i0 < k; i0 += kBlock) {
    prefetch_rows(p, i0, k);
    chains<1, 4>(x, k, i0, std::min(k, i0 + kBlock), p, kPanel, a);
  }
  store_chains2<1, 4>(a, y, n, c0, width);
}

// Up to three row groups of G1, G2, G3 rows (G2, G3 may be 0): block after block of 32 inputs, every group runs
// over the block (block(b): its weights [32, 32], in L1) before the next. The group sizes are compile-time: with
// a run-time count of groups and a switch on each group's size the same work ran 1.5-1.7x slower here.
template <int G1, int G2, int G3, typename Block>
void unit_rows(const float* x, int64_t k, Block&& block, float* y, int64_t n, int64_t c0, int64_t width) {
  Parked<G1> a1;
  Parked<G2 == 0 ? 1 : G2> a2;
  Parked<G3 == 0 ? 1 : G3> a3;
  a1.clear(), a2.clear(), a3.clear();
  const float* x2 = x + G1 * k;
  const float* x3 = x2 + G2 * k;
  for (int64_t i0 = 0, b = 0; i0 < k; i0 += kBlock, ++b) {
    const int64_t i1 = std::min(k, i0 + kBlock);
    const float* w = block(b) - i0 * kPanel;  // input i's weights at w + i * 32
    a1.run(x, k, i0, i1, w, kPanel);
    if constexpr (G2 > 0) a2.run(x2, k, i0, i1, w, kPanel);
    if constexpr (G3 > 0) a3.run(x3, k, i0, i1, w, kPanel);
  }
  a1.store(y, n, c0, width);
  if constexpr (G2 > 0) a2.store(y + G1 * n, n, c0, width);
  if constexpr (G3 > 0) a3.store(y + (G1 + G2) * n, n, c0, width);
}

constexpr int64_t kUnit = 3 * kRows2;  // rows per unit_rows call

// rows (1 .. kUnit) in balanced groups of at most kRows2 (2 + 2 rather than 3 + 1 for 4 rows).
template <typename Block>
void unit_any(int64_t rows, const float* x, int64_t k, Block&& block, float* y, int64_t n, int64_t c0,
              int64_t width) {
  switch (rows) {
    case 1: return unit_rows<1, 0, 0>(x, k, block, y, n, c0, width);
    case 2: return unit_rows<2, 0, 0>(x, k, block, y, n, c0, width);
    case 3: return unit_rows<3, 0, 0>(x, k, block, y, n, c0, width);
    case 4: return unit_rows<2, 2, 0>(x, k, block, y, n, c0, width);
    case 5: return unit_rows<3, 2, 0>(x, k, block, y, n, c0, width);
    case 6: return unit_rows<3, 3, 0>(x, k, block, y, n, c0, width);
    case 7: return unit_rows<3, 2, 2>(x, k, block, y, n, c0, width);
    case 8: return unit_rows<3, 3, 2>(x, k, block, y, n, c0, width);
    default: return unit_rows<3, 3, 3>(x, k, block, y, n, c0, width);
  }
}

// The rows in units of at most kUnit, balanced (9 + 8 rather than 9 + 9 + ... + 1 for 17 rows... of each unit
// count, the first m mod units units take one row more).
template <typename Block>
void units(const float* x, int64_t m, int64_t k, Block&& block, float* y, int64_t n, int64_t c0, int64_t width) {
  const int64_t count = (m + kUnit - 1) / kUnit;
  for (int64_t u = 0, r = 0; u < count; ++u) {
    const int64_t rows = m / count + (u < m % count ? 1 : 0);
    unit_any(rows, x + r * k, k, block, y + r * n, n, c0, width);
    r += rows;
  }
}

void panel_all(const float* x, int64_t m, int64_t k, const float* p, float* y, int64_t n, int64_t c0) {
  const int64_t width = std::min<int64_t>(kPanel, n - c0);
  if (m == 1) return panel_row(x, k, p, y, n, c0, width);
  units(x, m, k, [p, k](int64_t b) {
    prefetch_rows(p, b * kBlock, k);
    return p + b * kBlock * kPanel;
  }, y, n, c0, width);
}

// One row keeps its chains in registers while each block is rebuilt into L1 (wb) and multiplied there; up to
// kUnit rows share each rebuilt block; more rows rebuild the panel whole first (into L2) and take the float32
// path over it.
template <Quant Q>
void qpanel_all(const float* x, int64_t m, int64_t k, const uint8_t* p, float* y, int64_t n, int64_t c0) {
  constexpr int64_t bytes = quant_bytes(Q);
  const int64_t width = std::min<int64_t>(kPanel, n - c0);
  alignas(32) float wb[kBlock * kPanel];  // the block being multiplied, rebuilt [32, 32]
  if (m == 1) {
    __m256 a[1][8];
    for (int v = 0; v < 8; ++v) a[0][v] = _mm256_setzero_ps();
    for (int64_t b = 0; b < k / kBlock; ++b) {
      for (int64_t off = 0; off < bytes; off += 64)
        _mm_prefetch(reinterpret_cast<const char*>(p + b * bytes + kQuantAhead2 + off), _MM_HINT_T0);
      rebuild_block<Q>(block_at(Q, p, b), super_at(Q, p, b), wb, kPanel);
      chains<1, 4>(x + b * kBlock, k, 0, kBlock, wb, kPanel, a);
    }
    return store_chains2<1, 4>(a, y, n, c0, width);
  }
  if (m <= kUnit) {
    return unit_any(m, x, k, [&](int64_t b) {
      for (int64_t off = 0; off < bytes; off += 64)
        _mm_prefetch(reinterpret_cast<const char*>(p + b * bytes + kQuantAhead2 + off), _MM_HINT_T0);
      rebuild_block<Q>(block_at(Q, p, b), super_at(Q, p, b), wb, kPanel);
      return static_cast<const float*>(wb);
    }, y, n, c0, width);
  }
  static thread_local std::vector<float> scratch;  // the rebuilt panel [k, 32]
  scratch.resize(k * kPanel);
  for (int64_t b = 0; b < k / kBlock; ++b)
    rebuild_block<Q>(block_at(Q, p, b), super_at(Q, p, b), scratch.data() + b * kBlock * kPanel, kPanel);
  units(x, m, k, [&](int64_t b) { return static_cast<const float*>(scratch.data()) + b * kBlock * kPanel; }, y, n,
        c0, width);
}

void qpanel_any(const float* x, int64_t m, int64_t k, const uint8_t* p, Quant q, float* y, int64_t n, int64_t c0) {
  with_quant(q, [&](auto Q) { qpanel_all<decltype(Q)::value>(x, m, k, p, y, n, c0); });
}
#else
void panel_all(const float* x, int64_t m, int64_t k, const float* p, float* y, int64_t n, int64_t c0) {
  const int64_t width = std::min<int64_t>(kPanel, n - c0);
  float acc[2][kPanel];  // the even inputs' chains and the odd ones'
  for (int64_t r = 0; r < m; ++r) {
    for (int64_t j = 0; j < kPanel; ++j) acc[0][j] = acc[1][j] = 0.f;
    for (int64_t i = 0; i < k; ++i) {
      const float b = x[r * k + i];
      const float* w = p + i * kPanel;
      float* a = acc[i % 2];
      for (int64_t j = 0; j < kPanel; ++j) a[j] = std::fma(b, w[j], a[j]);
    }
    for (int64_t j = 0; j < width; ++j) y[r * n + c0 + j] = acc[0][j] + acc[1][j];
  }
}

void qpanel_any(const float* x, int64_t m, int64_t k, const uint8_t* p, Quant q, float* y, int64_t n, int64_t c0) {
  static thread_local std::vector<float> scratch;
  scratch.resize(k * kPanel);
  dequant_panel_ref(p, k, q, scratch.data());
  panel_all(x, m, k, scratch.data(), y, n, c0);
}
#endif

// ---- Integer products (PackedWeight::int8_product) ----
//
// The same blocks repacked for integer dot products: per panel and block of 32 inputs, the 32 columns' fp16
// scales d (Q4_1: then their fp16 minimums m), then the quants as unsigned bytes u = q + offset (Q4_0: the
// nibble itself, q + 8; Q8_0: q + 128; Q4_1: q), grouped by 4 consecutive inputs: group g (inputs 4g .. 4g + 3)
// is 128 bytes, column c's 4 bytes at 4c (c < 16) and 64 + 4 (c - 16). Q4 kinds store a group in 64 bytes,
// columns c and c + 16 in the low and high nibble of one byte. K-quants keep their super-blocks and scale bytes
// (block_at, block_scales) with these quants (Q4_K: as Q4_1's; Q6_K, kQ6_K8: u = q + 32's low 4 bits as Q4's,
// then 256 bytes of its high 2, repacked_quant); Q6_K's two halves of a block are two sums, each with its own
// scale and offset 32 times its half's sxq.
//
// Each input row is quantized per block of 32 as a GGUF Q8_0 block would be: dx = max |x| / 127,
// xq = round-to-even(x * (1 / dx)) (a float32 reciprocal), with sxq = sum xq and sx = sum x (in input order). Then for every output column
//   acc = fma(float(sum u * xq - offset * sxq), d * dx, acc)   (then Q4_1, Q4_K: acc = fma(m, sx, acc))
// block after block. The integer sums are exact, so a row's result depends only on that row (speculation on or
// off still gives the same bits), but not the same bits as the float32 product: the inputs lose precision, as
// in llama.cpp's quantized matrix products. With AVX-512 VNNI one instruction does 64 of the byte products.

struct QuantRows {   // m input rows quantized per block of 32
  const int8_t* q;   // [m, k]
  const float* d;    // [m, k / 32] dx
  const int32_t* s;  // [m, k / 32] sxq
  const int32_t* h;  // [m, k / 32] sxq of the block's inputs 0-15 (Q6_K's halves)
  const float* sx;   // [m, k / 32]
  int64_t k;
};

void quantize_row(const float* x, int64_t k, int8_t* q, float* d, int32_t* s, int32_t* h, float* sx) {
  for (int64_t b = 0; b < k / kBlock; ++b, x += kBlock, q += kBlock) {
    float amax = 0.f, sum = 0.f;
    for (int64_t i = 0; i < kBlock; ++i) amax = std::max(amax, std::fabs(x[i]));
    for (int64_t i = 0; i < kBlock; ++i) sum += x[i];
    const float dx = amax / 127.f, inv = dx > 0.f ? 1.f / dx : 0.f;
    int32_t qsum = 0;
    for (int64_t i = 0; i < kBlock; ++i) {
      const float v = std::min(127.f, std::max(-127.f, std::nearbyint(x[i] * inv)));
      q[i] = static_cast<int8_t>(v);
      qsum += q[i];
      if (i == 15) h[b] = qsum;
    }
    d[b] = dx;
    s[b] = qsum;
    sx[b] = sum;
  }
}

// x [m, k] quantized row by row (quantize_row) into this thread's buffers, which the parallel loops of the
// caller read through the result.
QuantRows quantize_rows(const float* x, int64_t m, int64_t k) {
  static thread_local std::vector<int8_t> q;
  static thread_local std::vector<float> d, sx;
  static thread_local std::vector<int32_t> s, h;
  const int64_t kb = k / kBlock;
  q.resize(m * k);
  d.resize(m * kb);
  sx.resize(m * kb);
  s.resize(m * kb);
  h.resize(m * kb);
  int8_t* qp = q.data();  // (thread_local names would be the other threads' own buffers inside the loop)
  float *dp = d.data(), *sxp = sx.data();
  int32_t *sp = s.data(), *hp = h.data();
#pragma omp parallel for schedule(static) if (m >= 8)
  for (int64_t r = 0; r < m; ++r)
    quantize_row(x + r * k, k, qp + r * k, dp + r * kb, sp + r * kb, hp + r * kb, sxp + r * kb);
  return {qp, dp, sp, hp, sxp, k};
}

constexpr int32_t quant_offset(Quant q) {
  return q == Quant::kQ4_0 ? 8 : q == Quant::kQ8_0 ? 128 : q == Quant::kQ6_K8 ? 32 : 0;
}

// Unsigned quant of input i (of 32), column c (of 32) in a block's repacked quants. kQ6_K8: the low 4 bits as
// Q4's, then per group of 4 inputs 32 bytes of high 2 bits: position b = 4 (c % 16) + j of a group's 64 bytes
// (those of columns c < 16, or of c >= 16) at bits 2 (b / 32) + 4 (c / 16) of byte b % 32.
inline int32_t repacked_quant(const uint8_t* qs, Quant q, int64_t i, int64_t c) {
  const int64_t g = i / 4, j = i % 4;
  if (q == Quant::kQ8_0) return qs[g * 128 + (c / 16) * 64 + (c % 16) * 4 + j];
  const uint8_t byte = qs[g * 64 + (c % 16) * 4 + j];
  const int32_t low = c < 16 ? byte & 0xF : byte >> 4;
  if (q != Quant::kQ6_K8) return low;
  const int64_t b = (c % 16) * 4 + j;
  return low | ((qs[512 + g * 32 + b % 32] >> (2 * (b / 32) + 4 * (c / 16))) & 3) << 4;
}

// The integer sum's offset term of row r's block b: -offset * sxq of the block's inputs (Q6_K: of half h's).
inline int32_t offset_sum(const QuantRows& a, Quant q, int64_t r, int64_t b, int h) {
  const int64_t at = r * (a.k / kBlock) + b;
  const int32_t sxq = q != Quant::kQ6_K8 ? a.s[at] : h == 0 ? a.h[at] : a.s[at] - a.h[at];
  return -quant_offset(q) * sxq;
}

// y[r, c0 .. c0 + 32) for the m rows of a, in scalar code (builds without AVX-512 VNNI).
void ipanel_ref(const QuantRows& a, int64_t m, const uint8_t* p, Quant q, float* y, int64_t n, int64_t c0) {
  const int64_t kb = a.k / kBlock, halves = q == Quant::kQ6_K8 ? 2 : 1, width = std::min<int64_t>(kPanel, n - c0);
  float acc[kPanel];
  for (int64_t r = 0; r < m; ++r) {
    std::fill(acc, acc + kPanel, 0.f);
    for (int64_t b = 0; b < kb; ++b) {
      const uint8_t* blk = block_at(q, p, b);
      const int8_t* xq = a.q + r * a.k + b * kBlock;
      const float dx = a.d[r * kb + b];
      for (int64_t c = 0; c < kPanel; ++c) {
        for (int h = 0; h < halves; ++h) {  // Q6_K: inputs 0-15, then 16-31, each with its scale
          float d, mn;
          block_scale_ref(q, blk, super_at(q, p, b), c, h, d, mn);
          int32_t sum = offset_sum(a, q, r, b, h);
          for (int64_t i = h * kBlock / halves; i < (h + 1) * kBlock / halves; ++i)
            sum += repacked_quant(blk + quant_head(q), q, i, c) * xq[i];
          acc[c] = std::fma(static_cast<float>(sum), d * dx, acc[c]);
          if (q == Quant::kQ4_1 || q == Quant::kQ4_K) acc[c] = std::fma(mn, a.sx[r * kb + b], acc[c]);
        }
      }
    }
    for (int64_t c = 0; c < width; ++c) y[r * n + c0 + c] = acc[c];
  }
}

// One panel's part of screened_argmax: its bounds C [k / 32, 32], the margin factor s, and per row r the
// panel's lowest bound max_c (A - margin) at low[r * panels + p] and highest max_c (A + margin) at top[...].
struct ScreenPanel {
  const float* bound;
  float s;
  float* low;
  float* top;
  int64_t panels, p;
};

// |A| + margin at or past this (or not a number): the column is a candidate whatever its bound (screen_store).
constexpr float kHuge = 0x1p110f;

#if defined(__AVX512F__)
// Row r's screen of one panel from its accumulators: h [width] = A + margin, margin = s E + 2^-20 (|A| + 1).
inline void screen_store(__m512 a0, __m512 a1, __m512 e0, __m512 e1, float* h, int64_t width, const ScreenPanel& sp,
                         int64_t r) {
  const __mmask16 m0 = width >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << width) - 1);
  const __mmask16 m1 = width >= 32 ? 0xFFFF : width <= 16 ? 0 : static_cast<__mmask16>((1u << (width - 16)) - 1);
  const __m512 s = _mm512_set1_ps(sp.s), tiny = _mm512_set1_ps(0x1p-20f), one = _mm512_set1_ps(1.f);
  const __m512 g0 = _mm512_fmadd_ps(s, e0, _mm512_mul_ps(tiny, _mm512_add_ps(_mm512_abs_ps(a0), one)));
  const __m512 g1 = _mm512_fmadd_ps(s, e1, _mm512_mul_ps(tiny, _mm512_add_ps(_mm512_abs_ps(a1), one)));
  // A column whose A or margin is not finite or so large that a sum could have overflowed (a corrupt scale,
  // inputs near float32's range) is always a candidate: h = +inf, and it sets no threshold.
  const __m512 lowest = _mm512_set1_ps(-std::numeric_limits<float>::infinity()), huge = _mm512_set1_ps(kHuge);
  const __mmask16 ok0 = _mm512_cmp_ps_mask(_mm512_add_ps(_mm512_abs_ps(a0), g0), huge, _CMP_LT_OQ);
  const __mmask16 ok1 = _mm512_cmp_ps_mask(_mm512_add_ps(_mm512_abs_ps(a1), g1), huge, _CMP_LT_OQ);
  const __m512 plus = _mm512_set1_ps(std::numeric_limits<float>::infinity());
  const __m512 h0 = _mm512_mask_mov_ps(plus, ok0, _mm512_add_ps(a0, g0));
  const __m512 h1 = _mm512_mask_mov_ps(plus, ok1, _mm512_add_ps(a1, g1));
  const __m512 l0 = _mm512_mask_mov_ps(lowest, ok0, _mm512_sub_ps(a0, g0));
  const __m512 l1 = _mm512_mask_mov_ps(lowest, ok1, _mm512_sub_ps(a1, g1));
  _mm512_mask_storeu_ps(h, m0, h0);
  _mm512_mask_storeu_ps(h + 16, m1, h1);
  const __m512 low = _mm512_mask_max_ps(_mm512_mask_mov_ps(lowest, m0, l0), m1, _mm512_mask_mov_ps(lowest, m0, l0), l1);
  const __m512 top = _mm512_mask_max_ps(_mm512_mask_mov_ps(lowest, m0, h0), m1, _mm512_mask_mov_ps(lowest, m0, h0), h1);
  sp.low[r * sp.panels + sp.p] = _mm512_reduce_max_ps(low);
  sp.top[r * sp.panels + sp.p] = _mm512_reduce_max_ps(top);
}
#endif

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
// ipanel_ref for rows r0 .. r0 + G, with VNNI: per group of 4 inputs, two vpdpbusd per row (columns 0-15 and
// 16-31), the weights unpacked once for all G rows.
// With Screen (screened_argmax), each row also accumulates E = sum_b dx_b C_b for the panel's columns, and
// screen_store writes A + margin instead of A (see "Greedy tokens without the logits").
template <Quant Q, int G, bool Screen = false>
inline void ipanel_rows(const QuantRows& a, int64_t r0, const uint8_t* p, float* y, int64_t n, int64_t c0,
                        int64_t width, const ScreenPanel* sp = nullptr) {
  constexpr int64_t bytes = quant_bytes(Q);  // on average, per block
  constexpr int halves = Q == Quant::kQ6_K8 ? 2 : 1;  // Q6_K: a sum and a scale per 16 inputs
  constexpr bool offsets = Q == Quant::kQ4_1 || Q == Quant::kQ4_K;  // acc += m sx
  const int64_t kb = a.k / kBlock;
  __m512 acc0[G], acc1[G], e0[Screen ? G : 1], e1[Screen ? G : 1];
  for (int r = 0; r < G; ++r) acc0[r] = acc1[r] = _mm512_setzero_ps();
  if constexpr (Screen)
    for (int r = 0; r < G; ++r) e0[r] = e1[r] = _mm512_setzero_ps();
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  for (int64_t b = 0; b < kb; ++b) {
    for (int64_t off = 0; off < bytes; off += 64)
      _mm_prefetch(reinterpret_cast<const char*>(p + b * bytes + kQuantAhead + off), _MM_HINT_T0);
    const uint8_t* blk = block_at(Q, p, b);
    const uint8_t* qs = blk + quant_head(Q);
    const int8_t* xq = a.q + r0 * a.k + b * kBlock;
    __m512 d0, d1, m0, m1;
    block_scales<Q>(blk, super_at(Q, p, b), d0, d1, m0, m1);
    for (int h = 0; h < halves; ++h) {
      __m512i s0[G], s1[G];
      for (int r = 0; r < G; ++r) s0[r] = s1[r] = _mm512_set1_epi32(offset_sum(a, Q, r0 + r, b, h));
      for (int64_t g = h * 8 / halves; g < (h + 1) * 8 / halves; ++g) {
        __m512i w0, w1;
        if constexpr (Q == Quant::kQ8_0) {
          w0 = _mm512_loadu_si512(qs + g * 128);
          w1 = _mm512_loadu_si512(qs + g * 128 + 64);
        } else {
          const __m512i v = _mm512_loadu_si512(qs + g * 64);
          w0 = _mm512_and_si512(v, nibble);
          w1 = _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble);
          if constexpr (Q == Quant::kQ6_K8) {  // the high 2 bits into bits 4-5 (repacked_quant)
            const __m512i hv = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 512 + g * 32)));
            const __m512i high = _mm512_set1_epi8(0x30);
            // bytes 0-31 of w0 from bits 0-1, 32-63 from bits 2-3; w1's from bits 4-5 and 6-7
            const __m512i h0 = _mm512_mask_blend_epi64(0xF0, _mm512_slli_epi16(hv, 4), _mm512_slli_epi16(hv, 2));
            const __m512i h1 = _mm512_mask_blend_epi64(0xF0, hv, _mm512_srli_epi16(hv, 2));
            w0 = _mm512_or_si512(w0, _mm512_and_si512(h0, high));
            w1 = _mm512_or_si512(w1, _mm512_and_si512(h1, high));
          }
        }
        for (int r = 0; r < G; ++r) {
          int32_t four;
          std::memcpy(&four, xq + r * a.k + g * 4, 4);
          const __m512i x = _mm512_set1_epi32(four);
          s0[r] = _mm512_dpbusd_epi32(s0[r], w0, x);
          s1[r] = _mm512_dpbusd_epi32(s1[r], w1, x);
        }
      }
      const __m512 sc0 = h == 0 ? d0 : m0, sc1 = h == 0 ? d1 : m1;  // Q6_K: inputs 16-31's scales in m
      for (int r = 0; r < G; ++r) {
        const __m512 dx = _mm512_set1_ps(a.d[(r0 + r) * kb + b]);
        acc0[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s0[r]), _mm512_mul_ps(sc0, dx), acc0[r]);
        acc1[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s1[r]), _mm512_mul_ps(sc1, dx), acc1[r]);
        if constexpr (offsets) {
          const __m512 sx = _mm512_set1_ps(a.sx[(r0 + r) * kb + b]);
          acc0[r] = _mm512_fmadd_ps(m0, sx, acc0[r]);
          acc1[r] = _mm512_fmadd_ps(m1, sx, acc1[r]);
        }
      }
    }
    if constexpr (Screen) {  // (Q4_0, Q8_0, Q6_K: C per block of 32 inputs, both halves)
      const __m512 cb0 = _mm512_loadu_ps(sp->bound + b * kPanel), cb1 = _mm512_loadu_ps(sp->bound + b * kPanel + 16);
      for (int r = 0; r < G; ++r) {
        const __m512 dx = _mm512_set1_ps(a.d[(r0 + r) * kb + b]);
        e0[r] = _mm512_fmadd_ps(dx, cb0, e0[r]);
        e1[r] = _mm512_fmadd_ps(dx, cb1, e1[r]);
      }
    }
  }
  if constexpr (Screen) {
    for (int r = 0; r < G; ++r)
      screen_store(acc0[r], acc1[r], e0[r], e1[r], y + (r0 + r) * n + c0, width, *sp, r0 + r);
  } else {
    store_rows<G>(acc0, acc1, y + r0 * n, n, c0, width);
  }
}

template <Quant Q, int G, bool Screen>
inline void ipanel_tail(const QuantRows& a, int64_t r0, int64_t rows, const uint8_t* p, float* y, int64_t n,
                        int64_t c0, int64_t width, const ScreenPanel* sp) {
  if constexpr (G > 0) {
    if (rows == G) return ipanel_rows<Q, G, Screen>(a, r0, p, y, n, c0, width, sp);
    ipanel_tail<Q, G - 1, Screen>(a, r0, rows, p, y, n, c0, width, sp);
  }
}

// rows per pass over a panel: 4 x 6 accumulators stay in registers (screening: 6 x 4, with E's two)
constexpr int kIntGroup = 6, kScreenGroup = 4;

template <Quant Q, bool Screen>
void ipanel_all(const QuantRows& a, int64_t m, const uint8_t* p, float* y, int64_t n, int64_t c0,
                const ScreenPanel* sp) {
  constexpr int G = Screen ? kScreenGroup : kIntGroup;
  const int64_t width = std::min<int64_t>(kPanel, n - c0);
  int64_t r = 0;
  for (; r + G <= m; r += G) ipanel_rows<Q, G, Screen>(a, r, p, y, n, c0, width, sp);
  ipanel_tail<Q, G - 1, Screen>(a, r, m - r, p, y, n, c0, width, sp);
}

// y[r, c0 .. c0 + 32) = the integer products of the m rows of a with panel p; with a ScreenPanel, A + margin
// and the panel's bounds per row (see screen_store).
void ipanel_any(const QuantRows& a, int64_t m, const uint8_t* p, Quant q, float* y, int64_t n, int64_t c0,
                const ScreenPanel* sp = nullptr) {
  switch (q) {
    case Quant::kQ4_0:
      return sp ? ipanel_all<Quant::kQ4_0, true>(a, m, p, y, n, c0, sp)
                : ipanel_all<Quant::kQ4_0, false>(a, m, p, y, n, c0, sp);
    case Quant::kQ4_1:  // (never screened: the bound does not cover its offsets m)
      return ipanel_all<Quant::kQ4_1, false>(a, m, p, y, n, c0, sp);
    case Quant::kQ8_0:
      return sp ? ipanel_all<Quant::kQ8_0, true>(a, m, p, y, n, c0, sp)
                : ipanel_all<Quant::kQ8_0, false>(a, m, p, y, n, c0, sp);
    case Quant::kQ4_K:  // (never screened: its offsets m, as Q4_1's)
      return ipanel_all<Quant::kQ4_K, false>(a, m, p, y, n, c0, sp);
    case Quant::kQ6_K8:
      return sp ? ipanel_all<Quant::kQ6_K8, true>(a, m, p, y, n, c0, sp)
                : ipanel_all<Quant::kQ6_K8, false>(a, m, p, y, n, c0, sp);
    default:
      PD_THROW("integer products of this block format are not built");
  }
}
#else
void ipanel_any(const QuantRows& a, int64_t m, const uint8_t* p, Quant q, float* y, int64_t n, int64_t c0,
                const ScreenPanel* sp = nullptr) {
  ipanel_ref(a, m, p, q, y, n, c0);
  if (sp == nullptr) return;
  const int64_t kb = a.k / kBlock, width = std::min<int64_t>(kPanel, n - c0);
  for (int64_t r = 0; r < m; ++r) {
    float* h = y + r * n + c0;
    float low = -std::numeric_limits<float>::infinity(), top = low;
    for (int64_t c = 0; c < width; ++c) {
      float e = 0.f;
      for (int64_t b = 0; b < kb; ++b) e = std::fma(a.d[r * kb + b], sp->bound[b * kPanel + c], e);
      const float v = h[c], margin = std::fma(sp->s, e, 0x1p-20f * (std::fabs(v) + 1.f));
      if (!(std::fabs(v) + margin < kHuge)) {  // always a candidate (screen_store)
        h[c] = top = std::numeric_limits<float>::infinity();
        continue;
      }
      low = std::max(low, v - margin);
      h[c] = v + margin;
      top = std::max(top, h[c]);
    }
    sp->low[r * sp->panels + sp->p] = low;
    sp->top[r * sp->panels + sp->p] = top;
  }
}
#endif


// ---- Greedy tokens without the logits (screened_argmax) ----
//
// A greedy step needs only the argmax of each logit row, not the row. For an LM head of Q8_0, Q4_0 or Q6_K blocks the
// integer products above give every logit cheaply but inexactly; a bound on their error then rules out all but a
// few columns, and only those get the float32 product (the FMA chains qpanel_rows runs), so the argmax is the
// float32 logits' argmax, ties to the lowest index included. The bound, for row x and column j:
//   |x . w_j - A_j| <= 0.50005 sum_b dx_b C_jb        (each input is within 0.50005 dx_b of dx_b xq, and w = d q:
//                                                       C_jb = |d_jb| sum_i |q_ij| over block b, the "bound" array)
//   |A_j - its float32 evaluation| <= 127 (kb + 2) u sum_b dx_b C_jb (Q6_K: 2 kb terms, a sum per half block,
//                                                       C_jb = sum over both halves of |d sc_h| sum_i |q_ij|),
//   |x . w_j - float32 chain over k| <= 127 k u / (1 - k u) sum_b dx_b C_jb   (|x_i| <= 127 dx_b (1 + u)),
// so z_j lies within s * E_j of A_j, E_j = sum_b dx_b C_jb, s = 1.01 (0.50005 + 128 (k + terms + 4) u) (the 1%
// covers E's own rounding), plus 2^-20 (|A_j| + 1) for rounding the sums A_j -/+ s E_j. Every column j whose
// A_j + s E_j reaches max_l (A_l - s E_l) is a candidate (the argmax and every column tied with it are); the
// rest are below some candidate's float32 logit. On the default model's LM head a row keeps ~5 candidates of
// 49,152 (62 at most in a sample of 234 rows of Spec-Bench prompts). Rows with a NaN or infinite input take the
// full product (the screen's arithmetic assumes finite inputs); a column whose |A_j| + s E_j is not below 2^110
// (a non-finite scale, or sums that could overflow) is a candidate whatever its bound; NaN logits never win.

// z[t] = the float32 product of x [k] with output column js[t] (t < count <= 8) of quantized panels in the float32
// layout: for each, the two FMA chains qpanel_rows (and, past kGroup rows, panel_rows over the panel it kept)
// runs for that column, the weight rebuilt as block_weights does (rebuilt_weight). Eight columns at a time,
// interleaved: one alone waits on each FMA's latency.
constexpr int kChains = 8;

void exact_columns(const float* x, int64_t k, const uint8_t* panels, Quant q, const int64_t* js, int count, float* z) {
  const uint8_t* base[kChains];
  int64_t col[kChains];
  for (int t = 0; t < kChains; ++t) {
    const int64_t j = js[t < count ? t : 0];  // spare chains repeat the first column
    base[t] = panels + (j / kPanel) * (k / kBlock) * quant_bytes(q);
    col[t] = j % kPanel;
  }
  float acc[2][kChains] = {};  // per column, the even inputs' chain and the odd ones'
  for (int64_t b = 0; b < k / kBlock; ++b) {
    float d[2][kChains], m[2][kChains];  // the scales of inputs 0-15 and of 16-31
    const uint8_t* qs[kChains];
    for (int t = 0; t < kChains; ++t) {
      const uint8_t* blk = block_at(q, base[t], b);
      for (int h = 0; h < 2; ++h) block_scale_ref(q, blk, super_at(q, base[t], b), col[t], h, d[h][t], m[h][t]);
      qs[t] = blk + quant_head(q);
    }
    for (int64_t i = 0; i < kBlock; ++i) {
      const float xi = x[b * kBlock + i];
      float* a = acc[i % 2];
      const int h = i < 16 ? 0 : 1;
      for (int t = 0; t < kChains; ++t)
        a[t] = std::fma(xi, rebuilt_weight(qs[t], q, d[h][t], m[h][t], i, col[t]), a[t]);
    }
  }
  for (int t = 0; t < count; ++t) z[t] = acc[0][t] + acc[1][t];
}

constexpr int64_t kScreenRows = 64;  // rows screened at a time (their [rows, n] bounds stay ~12 MB)

// ---- Float64 panels (specgen::kFloat64Panels) ----
//
// Float64 runs (the exactness tests' dtype) multiply by float64 panels [panels, k, 32], the float32 panels' layout.
// Every output is one chain over the inputs in order, acc = fma(x[r, i], w[i, c], acc) from 0 for i = 0 .. k-1:
// an FMA rounds once whether or not the compiler vectorises it, so a row's bits depend on that row alone, not on
// m, its place in the batch or its row group. Rows go kRows64 at a time over a panel (the panel stays in L2 for
// the next group); the compiler vectorises the 32 columns, and a group's accumulators (24 AVX-512 registers) stay
// in registers. Not the float32 path's tuning: these products serve tests and float64 runs.
constexpr int64_t kRows64 = 6;

// One step of an output's chain. Builds without FMA instructions, where std::fma is a library call ([32, 576] @
// [576, 1536] took 27 ms instead of 1.9 ms), round the product and the sum apart: other bits than FMA builds, but
// still the same for every row.
inline double chain_step(double x, double w, double acc) {
#if defined(__FMA__)
  return std::fma(x, w, acc);
#else
  return acc + x * w;
#endif
}

// y[r, c0 .. c0 + width) for rows r < R of x (row stride k); panel p [k, 32] float64.
template <int R>
void f64_rows(const double* x, int64_t k, const double* p, double* y, int64_t n, int64_t c0, int64_t width) {
  double acc[R][kPanel] = {};
  for (int64_t i = 0; i < k; ++i) {
    const double* w = p + i * kPanel;
    for (int r = 0; r < R; ++r) {
      const double b = x[r * k + i];
#pragma omp simd
      for (int64_t c = 0; c < kPanel; ++c) acc[r][c] = chain_step(b, w[c], acc[r][c]);
    }
  }
  for (int r = 0; r < R; ++r) std::memcpy(y + r * n + c0, acc[r], width * sizeof(double));
}

// The last m mod kRows64 rows, with a compile-time row count.
template <int R>
void f64_tail(const double* x, int64_t rows, int64_t k, const double* p, double* y, int64_t n, int64_t c0,
              int64_t width) {
  if constexpr (R > 0) {
    if (rows == R) return f64_rows<R>(x, k, p, y, n, c0, width);
    f64_tail<R - 1>(x, rows, k, p, y, n, c0, width);
  }
}

}  // namespace

namespace specgen {

// Whether block kind `kind` (its bytes) is one the products take, for integer products or float32 ones: Q4_0,
// Q4_1, Q8_0 and Q4_K both; Q6_K's own layouts (kQ6_K for float32 products, kQ6_K8 for integer ones); QX for
// float32 products only.
bool known_kind(int64_t kind, bool int8_product) {
  for (Quant q : {Quant::kQ4_0, Quant::kQ4_1, Quant::kQ8_0, Quant::kQ4_K})
    if (kind == static_cast<int64_t>(q)) return true;
  return kind == static_cast<int64_t>(int8_product ? Quant::kQ6_K8 : Quant::kQ6_K) ||
         (kind == static_cast<int64_t>(Quant::kQX) && !int8_product);
}

// One part of a weight of parts (see kParts), its header checked against the tensor's `size` bytes (PD_CHECKs
// name `name`) without arithmetic that could overflow, whatever the tensor holds: the kind among the quantized
// ones, the offset past the header and 64-aligned, the panels within the tensor.
PackedWeight packed_part(const uint8_t* base, int64_t size, int64_t header, const int64_t* h, int64_t k,
                         int64_t max_panels, const char* name) {
  const int64_t panels = h[0], kind = h[1], offset = h[3];
  const bool int8_product = h[2] != 0;
  PD_CHECK(known_kind(kind, int8_product) && k > 0 && k % kBlock == 0 && (h[2] == 0 || h[2] == 1), name,
           ": a part of a weight of parts that is not a quantized weight of ", k, " inputs");
  const Quant q = static_cast<Quant>(kind);
  const int64_t panel_bytes = k / kBlock * quant_bytes(q);  // k is a checked shape: no overflow
  PD_CHECK((!is_super(q) || (k / kBlock) % kSuper == 0) && offset >= header && offset <= size && offset % 64 == 0 &&
               panels > 0 && panels <= max_panels && panels <= (size - offset) / panel_bytes,
           name, ": a part of a weight of parts that is not within it");
  return {base + offset, panels, kind, int8_product};
}

PackedWeight packed_weight(const paddle::Tensor& w, int64_t k, int64_t n, const char* name) {
  if (w.is_cpu() && w.shape().size() == 1 && w.dtype() == paddle::DataType::UINT8) {  // kParts
    const int64_t size = w.shape()[0], want = (n + kPanel - 1) / kPanel;
    const uint8_t* base = w.data<uint8_t>();
    const int64_t* h = reinterpret_cast<const int64_t*>(base);
    // (the aligned loads need a 64-aligned base: a tensor of its own, not a slice of one)
    PD_CHECK(reinterpret_cast<uintptr_t>(base) % 64 == 0 && size >= 8 && h[0] >= 1 && h[0] <= kMaxParts &&
                 size >= 8 * (1 + 4 * h[0]),
             name, ": not a packed weight of parts");
    int64_t panels = 0;  // each part's at most `want`: the sum cannot overflow
    for (int64_t i = 0; i < h[0]; ++i)
      panels += packed_part(base, size, 8 * (1 + 4 * h[0]), h + 1 + 4 * i, k, want, name).panels;
    PD_CHECK(panels == want, name, ": a weight of parts of ", panels * kPanel, " output columns, not ", n);
    return {base, panels, kParts, false, h};
  }
  PD_CHECK(w.is_cpu() && w.shape().size() == 3 && w.shape()[0] == (n + kPanel - 1) / kPanel, name,
           ": not a packed weight of ", n, " output columns");
  if (w.dtype() == paddle::DataType::FLOAT32) {
    PD_CHECK(w.shape()[1] == k && w.shape()[2] == kPanel, name, ": not a packed [ceil(n / 32), ", k,
             ", 32] float32 weight");
    return {w.data<float>(), w.shape()[0], 0, false};
  }
  if (w.dtype() == paddle::DataType::FLOAT64) {
    PD_CHECK(w.shape()[1] == k && w.shape()[2] == kPanel, name, ": not a packed [ceil(n / 32), ", k,
             ", 32] float64 weight");
    return {w.data<double>(), w.shape()[0], kFloat64Panels, false};
  }
  if (w.dtype() == paddle::DataType::BFLOAT16 || w.dtype() == paddle::DataType::FLOAT16) {
    PD_CHECK(k % kBlock == 0 && w.shape()[1] == k / kBlock && w.shape()[2] == kBlock * kPanel, name,
             ": not a packed [ceil(n / 32), ", k / kBlock, ", 1024] bfloat16 or float16 weight");
    const Quant q = w.dtype() == paddle::DataType::BFLOAT16 ? Quant::kBF16 : Quant::kF16;
    return {w.data(), w.shape()[0], static_cast<int64_t>(q), false};
  }
  const int64_t bytes = w.shape()[2];
  const bool int8_product = w.dtype() == paddle::DataType::INT8;
  const bool super = known_kind(bytes, int8_product) && is_super(static_cast<Quant>(bytes));  // whole super-blocks
  PD_CHECK((w.dtype() == paddle::DataType::UINT8 || int8_product) && k % kBlock == 0 && w.shape()[1] == k / kBlock &&
               (!super || (k / kBlock) % kSuper == 0) && known_kind(bytes, int8_product),
           name, ": not a quantized [ceil(n / 32), ", k / kBlock,
           ", 576 | 640 | 1088 | 592 | 1096 | 1536] uint8 or [.., 576 | 640 | 1088 | 592 | 840] int8 weight (592, "
           "1096, 840: k a multiple of 256)");
  return {w.data(), w.shape()[0], bytes, int8_product};
}

// y[:, c_base .. c_base + 32 w.panels) of x @ W for a weight of one format (a whole weight, or a part of one);
// integer products over x's rows quantized in `a` (the caller's, shared by a weight's parts) or here.
void packed_columns(const float* x, int64_t m, int64_t k, const PackedWeight& w, float* y, int64_t n,
                    int64_t c_base, const QuantRows* a = nullptr) {
#if defined(__AVX512F__)
  if (m >= kWideMin && !w.int8_product) return wide_linear(x, m, k, w.data, w.panels, w.kind, y, n, c_base);
#endif
  if (w.kind == 0) {
    const float* f = static_cast<const float*>(w.data);
#pragma omp parallel for schedule(static)
    for (int64_t p = 0; p < w.panels; ++p) panel_all(x, m, k, f + p * k * kPanel, y, n, c_base + p * kPanel);
    return;
  }
  const uint8_t* q = static_cast<const uint8_t*>(w.data);
  const Quant kind = static_cast<Quant>(w.kind);
  const int64_t panel_bytes = k / kBlock * quant_bytes(kind);
  if (w.int8_product) {
    const QuantRows rows = a != nullptr ? *a : quantize_rows(x, m, k);
#pragma omp parallel for schedule(static)
    for (int64_t p = 0; p < w.panels; ++p) ipanel_any(rows, m, q + p * panel_bytes, kind, y, n, c_base + p * kPanel);
    return;
  }
#pragma omp parallel for schedule(static)
  for (int64_t p = 0; p < w.panels; ++p) qpanel_any(x, m, k, q + p * panel_bytes, kind, y, n, c_base + p * kPanel);
}

void packed_linear(const float* x, int64_t m, int64_t k, const PackedWeight& w, float* y, int64_t n) {
  PD_CHECK(w.kind != kFloat64Panels, "packed_linear: float64 panels need float64 inputs");
  if (m == 0) return;
  if (w.kind != kParts) return packed_columns(x, m, k, w, y, n, 0);
  const uint8_t* base = static_cast<const uint8_t*>(w.data);
  bool any_int8 = false;
  for (int64_t i = 0; i < w.parts[0]; ++i) any_int8 = any_int8 || w.parts[1 + 4 * i + 2] != 0;
  QuantRows a{};
  if (any_int8) a = quantize_rows(x, m, k);  // once for every part with integer products
  for (int64_t i = 0, c_base = 0; i < w.parts[0]; ++i) {  // each part's columns, in its own format
    const int64_t* h = w.parts + 1 + 4 * i;
    packed_columns(x, m, k, {base + h[3], h[0], h[1], h[2] != 0}, y, n, c_base, any_int8 ? &a : nullptr);
    c_base += h[0] * kPanel;
  }
}

void packed_linear(const double* x, int64_t m, int64_t k, const PackedWeight& w, double* y, int64_t n) {
  PD_CHECK(w.kind == kFloat64Panels, "packed_linear: float64 inputs need float64 panels");
  if (m == 0) return;
  const double* f = static_cast<const double*>(w.data);
#pragma omp parallel for schedule(static)
  for (int64_t p = 0; p < w.panels; ++p) {
    const int64_t c0 = p * kPanel, width = std::min<int64_t>(kPanel, n - c0);
    for (int64_t r = 0; r < m; r += kRows64)
      f64_tail<kRows64>(x + r * k, std::min(kRows64, m - r), k, f + p * k * kPanel, y + r * n, n, c0, width);
  }
}

void screened_argmax(const float* x, int64_t m, int64_t k, const PackedWeight& w, const PackedWeight& screen,
                     const float* bound, int64_t n, int64_t* out, const double* sample) {
  const Quant q = static_cast<Quant>(w.kind), qs = static_cast<Quant>(screen.kind);
  PD_CHECK(!w.int8_product && screen.int8_product && screen.panels == w.panels &&
               ((q == qs && (q == Quant::kQ8_0 || q == Quant::kQ4_0)) || (q == Quant::kQ6_K && qs == Quant::kQ6_K8)),
           "screened_argmax: a Q8_0 / Q4_0 / Q6_K weight and its integer-product panels");
  const int64_t kb = k / kBlock, panels = w.panels;
  const int64_t panel_bytes = kb * quant_bytes(q), screen_bytes = kb * quant_bytes(qs);
  // the integer sums' terms: one per block (Q6_K: per half block)
  const int64_t terms = qs == Quant::kQ6_K8 ? 2 * kb : kb;
  const float s = 1.01f * (0.50005f + 128.f * static_cast<float>(k + terms + 4) * 0x1p-24f);
  const uint8_t* exact = static_cast<const uint8_t*>(w.data);
  const uint8_t* ints = static_cast<const uint8_t*>(screen.data);
  static thread_local std::vector<float> hi, low, top;
  if (sample != nullptr) {  // (checked here: an exception must not leave the parallel loops below)
    for (int64_t row = 0; row < m; ++row)
      PD_CHECK(!(sample[row] > 0.0) || ((sample[m + row] <= 0.0 || sample[m + row] >= static_cast<double>(n)) &&
                                        sample[2 * m + row] >= 1.0 && sample[3 * m + row] <= 0.0),
               "screened_argmax: a sampled row's filters (top_k, top_p, min_p) need its logits");
  }
  for (int64_t r0 = 0; r0 < m; r0 += kScreenRows) {
    const int64_t mc = std::min(kScreenRows, m - r0);
    const float* xc = x + r0 * k;
    const QuantRows a = quantize_rows(xc, mc, k);
    hi.resize(mc * n);
    low.resize(mc * panels);
    top.resize(mc * panels);
    float *H = hi.data(), *L = low.data(), *T = top.data();
#pragma omp parallel for schedule(static)
    for (int64_t p = 0; p < panels; ++p) {
      const ScreenPanel sp{bound + p * kb * kPanel, s, L, T, panels, p};
      ipanel_any(a, mc, ints + p * screen_bytes, qs, H, n, p * kPanel, &sp);  // A + margin [mc, n], bounds
    }
    // rows round robin over the threads: with GCC's OpenMP calls served by Paddle's libiomp5 a dynamic schedule
    // ran every row on every thread (cpu_ops.cc's attention saw the like), each row's work done twice over
#pragma omp parallel for schedule(static, 1) if (mc > 1)
    for (int64_t r = 0; r < mc; ++r) {
      const float* xr = xc + r * k;
      bool finite = true;
      for (int64_t i = 0; i < k; ++i) finite &= std::isfinite(xr[i]);
      int64_t best = -1;
      float best_z = 0.f;  // the argmax's float32 logit
      if (finite) {
        float thr = -std::numeric_limits<float>::infinity(), z[kChains];
        for (int64_t p = 0; p < panels; ++p) thr = std::max(thr, L[r * panels + p]);
        int64_t cand[kChains];
        int count = 0;
        auto flush = [&]() {  // candidates arrive in increasing j: a later one must be strictly larger
          exact_columns(xr, k, exact, q, cand, count, z);
          for (int t = 0; t < count; ++t)
            if (!std::isnan(z[t]) && (best < 0 || z[t] > best_z)) best = cand[t], best_z = z[t];  // NaN never wins
          count = 0;
        };
        for (int64_t p = 0; p < panels; ++p) {
          if (!(T[r * panels + p] >= thr)) continue;
          const int64_t width = std::min<int64_t>(kPanel, n - p * kPanel);
          const float* h = H + r * n + p * kPanel;
          for (int64_t c = 0; c < width; ++c) {
            if (!(h[c] >= thr)) continue;
            cand[count++] = p * kPanel + c;
            if (count == kChains) flush();
          }
        }
        if (count > 0) flush();
      }
      const int64_t row = r0 + r;
      const bool sampled = sample != nullptr && sample[row] > 0.0;  // (a NaN temperature: greedy)
      const double inv_t = sampled ? 1.0 / sample[row] : 0.0;
      const uint64_t stream =
          sampled ? noise_stream((static_cast<uint64_t>(sample[4 * m + row]) << 32) |
                                     static_cast<uint64_t>(sample[5 * m + row]),
                                 static_cast<int64_t>(sample[6 * m + row]))
                  : 0;
      if (best < 0) {  // a non-finite input (or no candidate): the full float32 product of this row
        std::vector<float> z(n);
        for (int64_t p = 0; p < panels; ++p) qpanel_any(xr, 1, k, exact + p * panel_bytes, q, z.data(), n, p * kPanel);
        for (int64_t j = 0; j < n; ++j)  // specgen_argmax's rule: NaN never wins, all NaN gives 0
          if (!std::isnan(z[j]) && (best < 0 || z[j] > z[best])) best = j;
        best = std::max<int64_t>(best, 0);
        if (sampled) {  // every key from the logits (sampling.cc's rule, no bounds needed)
          Pick p{-std::numeric_limits<double>::infinity(), -1};
          for (int64_t j = 0; j < n; ++j) take(p, gumbel_key(static_cast<double>(z[j]), inv_t, stream, j), j);
          if (p.id >= 0 && p.key > -std::numeric_limits<double>::infinity()) best = p.id;
        }
      } else if (sampled) {
        // The Gumbel-max draw from the bounds: the argmax's exact key first (every logit is at most its A +
        // margin, so every key at most that bound's), then the exact logits of the columns whose bounded key
        // reaches the best so far: their whole panel's float32 product for this row (qpanel_any: the bits the
        // full product gives; 32 columns in one vectorized pass, ~20x exact_columns' cost a column less).
        static thread_local std::vector<float> zrow;
        static thread_local std::vector<uint8_t> done;
        zrow.resize(n);
        done.assign(panels, 0);
        Pick p{gumbel_key(static_cast<double>(best_z), inv_t, stream, best), best};
        key_bounds(H + r * n, nullptr, 0, n, inv_t, stream, [&p]() { return p.key; }, [&](int64_t j) {
          if (j == best) return;  // (its exact key is p's first)
          const int64_t pj = j / kPanel;
          if (!done[pj]) {
            qpanel_any(xr, 1, k, exact + pj * panel_bytes, q, zrow.data(), n, pj * kPanel);
            done[pj] = 1;
          }
          take(p, gumbel_key(static_cast<double>(zrow[j]), inv_t, stream, j), j);
        });
        if (p.key > -std::numeric_limits<double>::infinity()) best = p.id;
      }
      out[row] = best;
    }
  }
}

}  // namespace specgen

// x [m, k] float32, or float64 with float64 panels; the output has x's type.
std::vector<paddle::Tensor> Linear(const paddle::Tensor& x, const paddle::Tensor& w, int64_t n) {
  const bool f64 = x.dtype() == paddle::DataType::FLOAT64;
  PD_CHECK(x.is_cpu() && (x.dtype() == paddle::DataType::FLOAT32 || f64) && x.shape().size() == 2,
           "specgen_linear: x must be a float32 or float64 CPU matrix");
  const int64_t m = x.shape()[0], k = x.shape()[1];
  const specgen::PackedWeight pw = specgen::packed_weight(w, k, n, "specgen_linear");
  auto out = paddle::empty({m, n}, x.dtype(), x.place());
  if (f64) specgen::packed_linear(x.data<double>(), m, k, pw, out.data<double>(), n);
  else specgen::packed_linear(x.data<float>(), m, k, pw, out.data<float>(), n);
  return {out};
}

PD_BUILD_OP(specgen_linear).Inputs({"X", "W"}).Outputs({"Out"}).Attrs({"n: int64_t"}).SetKernelFn(PD_KERNEL(Linear));

// specgen_screened_argmax  x [m, k] float32, w (a Q8_0 / Q4_0 / Q6_K weight's panels), screen (its integer-product
// panels), bound, sample (specgen_sample's params float64 [8, m], or empty), n -> int64 [m]: the argmax of each row
// of x @ W, lowest index on a tie, or where sample's temperature is above 0 the row's Gumbel-max draw
// (specgen_forward's tokens with a screen; on its own for tests and benchmarks).
std::vector<paddle::Tensor> ScreenedArgmax(const paddle::Tensor& x, const paddle::Tensor& w,
                                           const paddle::Tensor& screen, const paddle::Tensor& bound,
                                           const paddle::Tensor& sample, int64_t n) {
  PD_CHECK(x.is_cpu() && x.dtype() == paddle::DataType::FLOAT32 && x.shape().size() == 2,
           "specgen_screened_argmax: x must be a float32 CPU matrix");
  const int64_t m = x.shape()[0], k = x.shape()[1];
  const specgen::PackedWeight pw = specgen::packed_weight(w, k, n, "specgen_screened_argmax");
  const specgen::PackedWeight ps = specgen::packed_weight(screen, k, n, "specgen_screened_argmax screen");
  PD_CHECK(bound.dtype() == paddle::DataType::FLOAT32 && bound.numel() == pw.panels * k,
           "specgen_screened_argmax: bound must be float32 [panels, k / 32, 32]");
  auto out = paddle::empty({m}, paddle::DataType::INT64, x.place());
  const bool sampled = sample.numel() > 0;
  PD_CHECK(!sampled || (sample.dtype() == paddle::DataType::FLOAT64 && sample.numel() == 8 * m),
           "specgen_screened_argmax: sample must be float64 [8, m] or empty");
  if (m > 0)
    specgen::screened_argmax(x.data<float>(), m, k, pw, ps, bound.data<float>(), n, out.data<int64_t>(),
                             sampled ? sample.data<double>() : nullptr);
  return {out};
}

PD_BUILD_OP(specgen_screened_argmax)
    .Inputs({"X", "W", "Screen", "Bound", "Sample"})
    .Outputs({"Out"})
    .Attrs({"n: int64_t"})
    .SetKernelFn(PD_KERNEL(ScreenedArgmax));

// Input i's nibble in a GGUF Q4 block's 16 quant bytes: byte j holds input j (low) and input j + 16 (high).
inline int gguf_nibble(const uint8_t* qs, int64_t i) { return i < 16 ? qs[i] & 0xF : qs[i - 16] >> 4; }

inline uint64_t load64(const uint8_t* a) {
  uint64_t v;
  std::memcpy(&v, a, sizeof v);
  return v;
}
inline uint32_t load32(const uint8_t* a) {
  uint32_t v;
  std::memcpy(&v, a, sizeof v);
  return v;
}
inline void store32(uint8_t* a, uint32_t v) { std::memcpy(a, &v, sizeof v); }

constexpr uint64_t kLowNibbles = 0x0F0F0F0F0F0F0F0FULL;

// The low nibbles of x's 8 bytes (little-endian), byte t's at bits 4t .. 4t + 3 (BMI2's pext with mask
// kLowNibbles, in shifts: pext is microcoded on some AMD CPUs).
inline uint32_t gather_nibbles(uint64_t x) {
  x &= kLowNibbles;
  x = (x | x >> 4) & 0x00FF00FF00FF00FFULL;
  x = (x | x >> 8) & 0x0000FFFF0000FFFFULL;
  return static_cast<uint32_t>(x | x >> 16);
}

// GGUF K-quant super-blocks [n, k / 256, 144 (Q4_K) | 210 (Q6_K)] -> their panels (block_at's layout; with
// int8_product the quants as the integer products take them: Q4_K's as Q4_1's, Q6_K's kQ6_K8): the same bytes
// as specgen.kernels' _pack_super.
// With `bound` (Q6_K's integer panels: the greedy screen's), also each column's C per block of 32 inputs,
// [panels, k / 32, 32]: |d sc_0| sum |q| over inputs 0-15 + |d sc_1| sum |q| over 16-31, in float32.
paddle::Tensor pack_super(const paddle::Tensor& blocks, bool int8_product, float* bound = nullptr) {
  const int64_t n = blocks.shape()[0], nsb = blocks.shape()[1], src_bytes = blocks.shape()[2];
  const Quant q = src_bytes == 144 ? Quant::kQ4_K : int8_product ? Quant::kQ6_K8 : Quant::kQ6_K;
  const int64_t kb = nsb * kSuper, bytes = quant_bytes(q), panels = (n + kPanel - 1) / kPanel;
  auto out = paddle::empty({panels, kb, bytes}, int8_product ? paddle::DataType::INT8 : paddle::DataType::UINT8,
                           blocks.place());
  const uint8_t* src = blocks.data<uint8_t>();
  uint8_t* dst = reinterpret_cast<uint8_t*>(out.data());
  // Eight quants at a time as the bytes of one 64-bit word (four for Q4_K's integer layout), little-endian.
#pragma omp parallel for schedule(static)
  for (int64_t p = 0; p < panels; ++p) {
    for (int64_t sb = 0; sb < nsb; ++sb) {
      uint8_t* sup = dst + (p * kb + sb * kSuper) * bytes;
      std::memset(sup, 0, kSuper * bytes);
      for (int64_t c = 0; c < kPanel && p * kPanel + c < n; ++c) {  // columns past n stay zero
        const uint8_t* g = src + ((p * kPanel + c) * nsb + sb) * src_bytes;
        const int64_t h = c / 16, l = c % 16;
        if (q == Quant::kQ4_K) {
          std::memcpy(sup + 2 * c, g, 2);            // d
          std::memcpy(sup + 64 + 2 * c, g + 2, 2);   // dmin
        } else {
          std::memcpy(sup + 2 * c, g + 208, 2);      // d
        }
        for (int64_t j = 0; j < kSuper; ++j) {
          uint8_t* blk = sup + super_head(q) + j * block_stride(q);
          uint8_t* quants = blk + quant_head(q);
          if (q == Quant::kQ4_K) {
            // gguf.quants' scales: 6-bit sc and m of sub-block j
            const uint8_t* sc = g + 4;
            blk[c] = j < 4 ? sc[j] & 63 : (sc[j + 4] & 0xF) | ((sc[j - 4] >> 6) << 4);
            blk[kPanel + c] = j < 4 ? sc[j + 4] & 63 : (sc[j + 4] >> 4) | ((sc[j] >> 6) << 4);
            // 32 bytes per pair of sub-blocks: the even one's inputs in the low nibbles, the odd one's high
            const uint8_t* qs = g + 16 + 32 * (j / 2);
            const int shift = 4 * (j % 2);
            if (int8_product) {  // group of 4 inputs: a byte each, column c + 16's in the high nibble
              for (int64_t i = 0; i < kBlock; i += 4) {
                const uint32_t nibs = (load32(qs + i) >> shift) & 0x0F0F0F0Fu;
                uint8_t* at = quants + (i / 4) * 64 + l * 4;
                store32(at, load32(at) | nibs << (4 * h));
              }
            } else {  // group of 8 inputs: the column's 32-bit lane (q4_nibble)
              for (int64_t i = 0; i < kBlock; i += 8)
                store32(quants + (i / 8) * 128 + h * 64 + l * 4,
                        gather_nibbles((load64(qs + i) >> shift) & kLowNibbles));
            }
          } else {
            blk[c] = g[192 + 2 * j];  // int8 scales of inputs 0-15 and 16-31
            blk[kPanel + c] = g[192 + 2 * j + 1];
            // low 4 bits in ql, high 2 in qh: u = q + 32, 0 .. 63
            const uint8_t* ql = g + (j / 4) * 64 + (j % 2) * 32;
            const uint8_t* qh = g + 128 + (j / 4) * 32;
            const int low_shift = 4 * ((j % 4) / 2), high_shift = 2 * (j % 4);
            int32_t magnitude[2] = {0, 0};  // sum |q| of inputs 0-15 and 16-31
            for (int64_t i = 0; i < kBlock; i += 8) {
              const uint64_t u = ((load64(ql + i) >> low_shift) & kLowNibbles) |
                                 (((load64(qh + i) >> high_shift) & 0x0303030303030303ULL) << 4);
              if (bound != nullptr)
                for (int b = 0; b < 8; ++b) magnitude[i / 16] += std::abs(static_cast<int>((u >> (8 * b)) & 0xFF) - 32);
              if (int8_product) {  // kQ6_K8 (repacked_quant): groups i / 4 and i / 4 + 1, 4 inputs each
                for (int64_t g4 = 0; g4 < 2; ++g4) {
                  const uint32_t four = static_cast<uint32_t>(u >> (32 * g4));
                  uint8_t* low = quants + (i / 4 + g4) * 64 + l * 4;
                  store32(low, load32(low) | (four & 0x0F0F0F0Fu) << (4 * h));
                  uint8_t* high = quants + 512 + (i / 4 + g4) * 32 + (l % 8) * 4;
                  store32(high, load32(high) | ((four >> 4) & 0x03030303u) << (2 * (l / 8) + 4 * h));
                }
              } else {  // q = u - 32 as int8, one per input row: bit 5 flipped, then sign-extended
                uint64_t v = u ^ 0x2020202020202020ULL;
                v |= (v & 0x2020202020202020ULL) * 6;
                for (int b = 0; b < 8; ++b) quants[(i + b) * kPanel + c] = static_cast<uint8_t>(v >> (8 * b));
              }
            }
            if (bound != nullptr) {  // |d sc_h| is exact in float32; each term and their sum round once
              uint16_t dh;
              std::memcpy(&dh, g + 208, 2);
              const float d = specgen::half_to_float(dh);
              float c0 = std::fabs(d * static_cast<float>(static_cast<int8_t>(g[192 + 2 * j]))) *
                         static_cast<float>(magnitude[0]);
              float c1 = std::fabs(d * static_cast<float>(static_cast<int8_t>(g[192 + 2 * j + 1]))) *
                         static_cast<float>(magnitude[1]);
#if defined(__GNUC__) && defined(__x86_64__)
              asm volatile("" : "+x"(c0), "+x"(c1));  // both products rounded, as numpy's: no FMA contracted
#endif
              bound[((p * nsb + sb) * kSuper + j) * kPanel + c] = c0 + c1;
            }
          }
        }
      }
    }
  }
  return out;
}

// specgen_pack_blocks  blocks uint8 [n, k / 32, GGUF block bytes] (Q4_0: 18, Q4_1: 20, Q8_0: 34; or K-quant
//                      super-blocks [n, k / 256, bytes], Q4_K: 144, Q6_K: 210: pack_super), int8_product,
//                      with_bound -> (panels [ceil(n / 32), k / 32, panel bytes], bound): the layouts described
// at the top of this file (uint8 for the float32 products, int8 for the integer ones); columns past n are all-zero
// GGUF blocks. The same bytes as the numpy code of specgen.kernels (_pack_quantized_numpy, pack_screen without
// the kernels), its reference, in one pass instead of numpy's several.
std::vector<paddle::Tensor> PackBlocks(const paddle::Tensor& blocks, bool int8_product, bool with_bound) {
  PD_CHECK(blocks.is_cpu() && blocks.dtype() == paddle::DataType::UINT8 && blocks.shape().size() == 3,
           "specgen_pack_blocks: uint8 GGUF blocks [n, k / 32, block bytes]");
  const int64_t n = blocks.shape()[0], kb = blocks.shape()[1], src_bytes = blocks.shape()[2];
  if (src_bytes == 144 || src_bytes == 210) {  // Q4_K, Q6_K super-blocks [n, k / 256, bytes]
    PD_CHECK(!with_bound || (src_bytes == 210 && int8_product),
             "specgen_pack_blocks: a screen bound for Q6_K's integer panels only (Q4_K has offsets)");
    const int64_t panels = (n + kPanel - 1) / kPanel;
    auto bound = paddle::empty({with_bound ? panels * kb * kSuper * kPanel : 0}, paddle::DataType::FLOAT32,
                               blocks.place());
    if (with_bound) std::memset(bound.data<float>(), 0, sizeof(float) * panels * kb * kSuper * kPanel);
    return {pack_super(blocks, int8_product, with_bound ? bound.data<float>() : nullptr), bound};
  }
  PD_CHECK(src_bytes == 18 || src_bytes == 20 || src_bytes == 34,
           "specgen_pack_blocks: not Q4_0 / Q4_1 / Q8_0 / Q4_K / Q6_K");
  const Quant q = src_bytes == 18 ? Quant::kQ4_0 : src_bytes == 20 ? Quant::kQ4_1 : Quant::kQ8_0;
  const int64_t bytes = static_cast<int64_t>(q), head = q == Quant::kQ4_1 ? 128 : 64;
  const int64_t panels = (n + kPanel - 1) / kPanel;
  auto out = paddle::empty({panels, kb, bytes}, int8_product ? paddle::DataType::INT8 : paddle::DataType::UINT8,
                           blocks.place());
  // with_bound (Q8_0 / Q4_0; Q6_K: pack_super): the screen's bound [panels, k / 32, 32] |d| * sum |q| (screened_argmax), else [0]
  auto bound = paddle::empty({with_bound ? panels * kb * kPanel : 0}, paddle::DataType::FLOAT32, blocks.place());
  PD_CHECK(!with_bound || q != Quant::kQ4_1, "specgen_pack_blocks: no screen bound for Q4_1");
  const uint8_t* src = blocks.data<uint8_t>();
  uint8_t* dst = reinterpret_cast<uint8_t*>(out.data());
  float* bnd = with_bound ? bound.data<float>() : nullptr;
#pragma omp parallel for schedule(static)
  for (int64_t p = 0; p < panels; ++p) {
    for (int64_t b = 0; b < kb; ++b) {
      uint8_t* o = dst + (p * kb + b) * bytes;
      std::memset(o, 0, bytes);
      for (int64_t c = 0; c < kPanel; ++c) {
        const int64_t col = p * kPanel + c;
        static const uint8_t zero_block[34] = {};  // columns past n: d = m = 0, q = 0
        const uint8_t* blk = col < n ? src + (col * kb + b) * src_bytes : zero_block;
        std::memcpy(o + 2 * c, blk, 2);                                      // d
        if (q == Quant::kQ4_1) std::memcpy(o + 64 + 2 * c, blk + 2, 2);      // m
        const uint8_t* qs = blk + (q == Quant::kQ4_1 ? 4 : 2);
        uint8_t* quants = o + head;
        const int64_t h = c / 16, l = c % 16;
        if (bnd != nullptr) {
          int32_t sum = 0;  // sum |q|: exact, and |d| * sum is exact in float32 (11 bits times < 2^12)
          for (int64_t i = 0; i < kBlock; ++i)
            sum += q == Quant::kQ8_0 ? std::abs(static_cast<int8_t>(qs[i]))
                                     : std::abs(gguf_nibble(qs, i) - 8);
          uint16_t dh;
          std::memcpy(&dh, blk, 2);
          bnd[(p * kb + b) * kPanel + c] = std::fabs(specgen::half_to_float(dh)) * static_cast<float>(sum);
        }
        if (q == Quant::kQ8_0) {
          for (int64_t i = 0; i < kBlock; ++i) {
            if (int8_product) quants[(i / 4) * 128 + h * 64 + l * 4 + i % 4] = qs[i] ^ 0x80;  // q + 128
            else quants[i * kPanel + c] = qs[i];
          }
        } else {
          for (int64_t i = 0; i < kBlock; ++i) {
            const uint8_t nib = gguf_nibble(qs, i);
            if (int8_product) quants[(i / 4) * 64 + l * 4 + i % 4] |= static_cast<uint8_t>(nib << (4 * h));
            else quants[(i / 8) * 128 + h * 64 + l * 4 + (i % 8) / 2] |= static_cast<uint8_t>(nib << (4 * (i % 2)));
          }
        }
      }
    }
  }
  return {out, bound};
}

PD_BUILD_OP(specgen_pack_blocks)
    .Inputs({"Blocks"})
    .Outputs({"Panels", "Bound"})
    .Attrs({"int8_product: bool", "with_bound: bool"})
    .SetKernelFn(PD_KERNEL(PackBlocks));
