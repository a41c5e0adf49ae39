// Fused CPU operators for the packed forward (see specgen/kernels/__init__.py for the build and
// specgen/layers/ for the Paddle reference each one matches: the reference backend, specgen/backends/reference.py).
//
//   specgen_rms_norm      x [n, h], w [h]                  -> x * rsqrt(mean(x^2) + eps) * w
//   specgen_add_rms_norm  x [n, h], r [n, h], w [h]        -> (x + r, rms_norm(x + r))
//   specgen_silu_mul      gu [n, 2 i]                      -> silu(gu[:, :i]) * gu[:, i:]
//   specgen_attention     qkv [n, (H + 2 KV) D], RoPE tables, per-token position and slot, the layer's cache
//                         -> causal attention output [n, H D]; writes the tokens' K/V into the cache first.
//                         Shared prefix (cascade): a token with prefix_len p reads keys/values of positions < p
//                         from one shared prefix cache [KV, prefix_capacity, D] and positions >= p from its slot's
//                         own rows, where position j sits at row j - p. One softmax runs over both parts, so the
//                         result equals attention over a private copy of the prefix.
//                         The caches hold the activations' type or, for float32, IEEE halves (float16 tensors):
//                         keys and values are rounded to nearest even once, when written, and widened exactly when
//                         read, so a row's result still depends only on its own inputs.
//   specgen_argmax        x [n, v]                         -> int64 [n]: index of each row's largest value, the
//                         lowest index on a tie (as paddle.argmax)
//   specgen_stack         whole pre-norm decoder blocks with packed weights (linear.cc), one after the other (each
//                         argument a list, one entry per block): the ops above and the four projections, the same
//                         functions in the same order, so bit-identical to calling them one by one; all 30 blocks
//                         of a forward are one call instead of ~250 Python-side dispatches. The activations' type
//                         is float32 or float64 (the exactness tests' type: float64 panels, caches, RoPE tables,
//                         norms and biases; half caches serve float32 only).
//   specgen_forward       a whole forward: embedding, specgen_stack's blocks, final norm, the LM head at the rows
//                         that need logits (bit-identical to those ops one after the other), and their argmax; in
//                         the embedding's type (the greedy screen of a quantized LM head, lm_screen, is float32's).
//   specgen_bind_weights  a model's weights for specgen_forward_bound, held in this library under a handle
//   specgen_bind_caches   a KV cache's per-block tensors (and its shared prefix's), held the same way
//   specgen_unbind        drops a handle of either kind
//   specgen_forward_bound specgen_forward with the weights and caches given by handle: the per-step arguments are
//                         the token indices alone. Handing Paddle ~480 tensors per call costs ~0.8 ms on this CPU
//                         (26 us per decoder block), a tenth of a one-token step of the default model.
//   specgen_bind_experts  a mixture-of-experts model's routers and experts (moe.cc), held with its bound weights:
//                         the routed blocks' MLP in specgen_forward_bound (beside their shared experts, if any)
//   specgen_take_expert_counts  the tokens each expert took since the last call, per routed block
//   specgen_eagle_pass    an EAGLE layer's pass: fc over [embedding; feature], its block, its output features, and
//                         the top-k of the LM head's log-softmax at the rows asked for (a token tree's depth)
//   specgen_mtp_draft     an MTP head's pass for a step: input norms and eh_proj, its block(s) (specgen_stack's code),
//                         final norm, LM head and argmax (or, with DraftSample, a draw coupled to verification's
//                         noise) at each sequence's last token, then depth - 1 chained
//                         passes on its own drafts; also the catch-up tokens' block outputs (the next MTP module's
//                         input). The same functions in the same order as the reference head, in the embedding's
//                         type, as specgen_forward.
//
// Every output row is computed from its own inputs in a fixed order, whatever else is in the batch, so results
// do not depend on batch composition or on how many tokens a slot feeds (speculation on or off).
#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <omp.h>
#include <type_traits>
#include <vector>

#include "paddle/extension.h"
#include "specgen_kernels.h"

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__) && defined(__F16C__))
#include <immintrin.h>
#endif

namespace {

// Eight interleaved partial sums combined in a fixed tree: the same order for any address alignment (an
// `omp simd` reduction may peel for alignment, which would make a row's result depend on where it sits).
template <typename T>
inline T dot(const T* a, const T* b, int64_t d) {
  T s[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 8 <= d; i += 8)
    for (int l = 0; l < 8; ++l) s[l] += a[i + l] * b[i + l];
  for (; i < d; ++i) s[i % 8] += a[i] * b[i];
  return ((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7]));
}

template <typename T>
inline void rms_norm_row(const T* x, const T* w, T* out, int64_t h, T eps) {
  const T r = T(1) / std::sqrt(dot(x, x, h) / T(h) + eps);
#pragma omp simd
  for (int64_t i = 0; i < h; ++i) out[i] = x[i] * r * w[i];
}

#if defined(__AVX512F__)
// e^x (scores minus their max, or -x for SiLU): Cephes' expf range reduction and polynomial, about 1 ulp; 0 below
// -87, inf above ~88.7.
inline __m512 exp512(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  const __m512 y = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(p, r), r, r), _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(y, n);
}

#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
// The AVX2 build's exp (8 lanes): exp512's range reduction and polynomial; 2^n built in the exponent field, with
// n capped at 128 (inf), as scalef gives for larger n.
inline __m256 exp256(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  const __m256 y = _mm256_add_ps(_mm256_fmadd_ps(_mm256_mul_ps(p, r), r, r), _mm256_set1_ps(1.0f));
  const __m256i e = _mm256_min_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(128));
  return _mm256_mul_ps(y, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(e, _mm256_set1_epi32(127)), 23)));
}

// Lanes [0, n) of 8 set (n <= 8), for masked loads and stores.
inline __m256i lanes_below(int64_t n) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
#endif

void check_cpu(const paddle::Tensor& t, const char* name) {
  PD_CHECK(t.is_cpu(), name, " must be a CPU tensor");
}

// The bits of a float16 tensor (a half KV cache), or nullptr for a stand-in of another type (no shared prefix).
uint16_t* half_data(const paddle::Tensor& t) {
  if (t.dtype() != paddle::DataType::FLOAT16) return nullptr;
  return static_cast<uint16_t*>(const_cast<void*>(static_cast<const void*>(t.data<phi::dtype::float16>())));
}

// A half cache serves float32 activations; K and V are both halves, and so is a shared prefix where one is read.
void check_half_cache(const paddle::Tensor& x, const paddle::Tensor& k_cache, const paddle::Tensor& v_cache,
                      const paddle::Tensor& prefix_len, const paddle::Tensor& prefix_k, const paddle::Tensor& prefix_v,
                      const char* op) {
  PD_CHECK(x.dtype() == paddle::DataType::FLOAT32, op, ": a float16 KV cache needs float32 activations");
  PD_CHECK(v_cache.dtype() == k_cache.dtype(), op, ": K and V caches of different types");
  const int64_t* plen = prefix_len.data<int64_t>();
  bool shared = false;
  for (int64_t i = 0; i < prefix_len.numel(); ++i) shared = shared || plen[i] > 0;
  PD_CHECK(!shared || (prefix_k.dtype() == k_cache.dtype() && prefix_v.dtype() == k_cache.dtype()), op,
           ": the shared prefix's cache type differs from the slots' cache");
}

// Each token's position and cache slot (the attention inputs of specgen_attention and specgen_stack).
void check_token_index(const paddle::Tensor& positions, const paddle::Tensor& slots) {
  PD_CHECK(positions.dtype() == paddle::DataType::INT64 && slots.dtype() == paddle::DataType::INT64,
           "positions and slots must be int64");
}

}  // namespace

namespace {

template <typename T>
void rms_norm_rows(const T* x, const T* w, T* out, int64_t n, int64_t h, T eps) {
#pragma omp parallel for if (n > 8)
  for (int64_t r = 0; r < n; ++r) rms_norm_row(x + r * h, w, out + r * h, h, eps);
}

template <typename T>
void add_rms_norm_rows(const T* x, const T* res, const T* w, T* sum, T* out, int64_t n, int64_t h, T eps) {
#pragma omp parallel for if (n > 8)
  for (int64_t r = 0; r < n; ++r) {
#pragma omp simd
    for (int64_t i = 0; i < h; ++i) sum[r * h + i] = x[r * h + i] + res[r * h + i];
    rms_norm_row(sum + r * h, w, out + r * h, h, eps);
  }
}

template <typename T>
void silu_mul_rows(const T* gu, T* out, int64_t n, int64_t inter) {
#pragma omp parallel for if (n > 4)
  for (int64_t r = 0; r < n; ++r) {
    const T* g = gu + r * 2 * inter;
    for (int64_t i = 0; i < inter; ++i) out[r * inter + i] = g[i] / (T(1) + std::exp(-g[i])) * g[inter + i];
  }
}

#if defined(__AVX512F__)
// float32: the same formula 16 lanes at a time with exp512 (libm's scalar expf made SiLU ~7% of a 32-slot
// step). Every element is computed alone, so a row's result does not depend on the others.
template <>
void silu_mul_rows<float>(const float* gu, float* out, int64_t n, int64_t inter) {
#pragma omp parallel for if (n > 4)
  for (int64_t r = 0; r < n; ++r) {
    const float* g = gu + r * 2 * inter;
    for (int64_t i = 0; i < inter; i += 16) {
      const __mmask16 mk = inter - i >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (inter - i)) - 1);
      const __m512 x = _mm512_maskz_loadu_ps(mk, g + i), u = _mm512_maskz_loadu_ps(mk, g + inter + i);
      const __m512 e = exp512(_mm512_sub_ps(_mm512_setzero_ps(), x));
      const __m512 y = _mm512_mul_ps(_mm512_div_ps(x, _mm512_add_ps(_mm512_set1_ps(1.0f), e)), u);
      _mm512_mask_storeu_ps(out + r * inter + i, mk, y);
    }
  }
}
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
// float32: 8 lanes at a time with exp256 instead of libm's scalar expf.
template <>
void silu_mul_rows<float>(const float* gu, float* out, int64_t n, int64_t inter) {
#pragma omp parallel for if (n > 4)
  for (int64_t r = 0; r < n; ++r) {
    const float* g = gu + r * 2 * inter;
    for (int64_t i = 0; i < inter; i += 8) {
      const __m256i mk = lanes_below(inter - i);
      const __m256 x = _mm256_maskload_ps(g + i, mk), u = _mm256_maskload_ps(g + inter + i, mk);
      const __m256 e = exp256(_mm256_sub_ps(_mm256_setzero_ps(), x));
      const __m256 y = _mm256_mul_ps(_mm256_div_ps(x, _mm256_add_ps(_mm256_set1_ps(1.0f), e)), u);
      _mm256_maskstore_ps(out + r * inter + i, mk, y);
    }
  }
}
#endif

}  // namespace

namespace {

template <typename T>
void argmax_rows(const T* x, int64_t n, int64_t v, int64_t* out) {
#pragma omp parallel for if (n > 1)
  for (int64_t r = 0; r < n; ++r) {
    const T* row = x + r * v;
    int64_t best = 0;
    for (int64_t i = 1; i < v; ++i) best = row[i] > row[best] ? i : best;
    out[r] = best;
  }
}

#if defined(__AVX512F__)
// float32: 16 lanes, each keeping its first maximum (a strictly greater value replaces it); then the largest
// value and, among the lanes holding it, the lowest index. (paddle.argmax on CPU took ~11 ms for 192 rows of
// 49,152 logits, 5% of a 32-slot verify step.)
template <>
void argmax_rows<float>(const float* x, int64_t n, int64_t v, int64_t* out) {
#pragma omp parallel for if (n > 1)
  for (int64_t r = 0; r < n; ++r) {
    const float* row = x + r * v;
    const __m512 lowest = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    const __m512i step = _mm512_set1_epi32(16);
    __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    __m512 best = lowest;
    __m512i at = lane;
    for (int64_t i = 0; i < v; i += 16) {
      const __mmask16 mk = v - i >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (v - i)) - 1);
      const __m512 val = _mm512_mask_loadu_ps(lowest, mk, row + i);
      const __mmask16 gt = _mm512_mask_cmp_ps_mask(mk, val, best, _CMP_GT_OQ);
      best = _mm512_mask_mov_ps(best, gt, val);
      at = _mm512_mask_mov_epi32(at, gt, lane);
      lane = _mm512_add_epi32(lane, step);
    }
    const float top = _mm512_reduce_max_ps(best);
    const __mmask16 eq = _mm512_cmp_ps_mask(best, _mm512_set1_ps(top), _CMP_EQ_OQ);
    out[r] = eq ? _mm512_mask_reduce_min_epi32(eq, at) : 0;
  }
}
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
// float32: the AVX-512 path's rule 8 lanes at a time: each lane keeps its first maximum (NaN never wins), then the
// largest value and, among the lanes holding it, the lowest index.
template <>
void argmax_rows<float>(const float* x, int64_t n, int64_t v, int64_t* out) {
#pragma omp parallel for if (n > 1)
  for (int64_t r = 0; r < n; ++r) {
    const float* row = x + r * v;
    const __m256 lowest = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
    const __m256i step = _mm256_set1_epi32(8);
    __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    __m256 best = lowest;
    __m256i at = lane;
    int64_t i = 0;
    for (; i + 8 <= v; i += 8) {
      const __m256 val = _mm256_loadu_ps(row + i);
      const __m256 gt = _mm256_cmp_ps(val, best, _CMP_GT_OQ);
      best = _mm256_blendv_ps(best, val, gt);
      at = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(at), _mm256_castsi256_ps(lane), gt));
      lane = _mm256_add_epi32(lane, step);
    }
    if (i < v) {
      const __m256i mk = lanes_below(v - i);
      const __m256 val = _mm256_blendv_ps(lowest, _mm256_maskload_ps(row + i, mk), _mm256_castsi256_ps(mk));
      const __m256 gt = _mm256_cmp_ps(val, best, _CMP_GT_OQ);
      best = _mm256_blendv_ps(best, val, gt);
      at = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(at), _mm256_castsi256_ps(lane), gt));
    }
    alignas(32) float bv[8];
    alignas(32) int32_t bi[8];
    _mm256_store_ps(bv, best);
    _mm256_store_si256(reinterpret_cast<__m256i*>(bi), at);
    float top = bv[0];
    for (int l = 1; l < 8; ++l) top = std::max(top, bv[l]);
    int64_t pick = -1;
    for (int l = 0; l < 8; ++l)
      if (bv[l] == top && (pick < 0 || bi[l] < pick)) pick = bi[l];
    out[r] = pick < 0 ? 0 : pick;
  }
}
#endif

}  // namespace

std::vector<paddle::Tensor> Argmax(const paddle::Tensor& x) {
  check_cpu(x, "x");
  PD_CHECK(x.shape().size() == 2, "specgen_argmax: x must be [rows, vocab]");
  const int64_t n = x.shape()[0], v = x.shape()[1];
  PD_CHECK(v > 0 && v < (int64_t(1) << 31), "specgen_argmax: vocabulary size out of range");
  auto out = paddle::empty({n}, paddle::DataType::INT64, x.place());
  PD_DISPATCH_FLOATING_TYPES(x.type(), "specgen_argmax", ([&] {
    argmax_rows<data_t>(x.data<data_t>(), n, v, out.data<int64_t>());
  }));
  return {out};
}

std::vector<paddle::Tensor> RmsNorm(const paddle::Tensor& x, const paddle::Tensor& w, double eps) {
  check_cpu(x, "x");
  auto out = paddle::empty_like(x);
  const int64_t h = x.shape().back(), n = x.numel() / h;
  PD_DISPATCH_FLOATING_TYPES(x.type(), "specgen_rms_norm", ([&] {
    rms_norm_rows<data_t>(x.data<data_t>(), w.data<data_t>(), out.data<data_t>(), n, h, data_t(eps));
  }));
  return {out};
}

std::vector<paddle::Tensor> AddRmsNorm(const paddle::Tensor& x, const paddle::Tensor& res, const paddle::Tensor& w,
                                       double eps) {
  check_cpu(x, "x");
  auto sum = paddle::empty_like(x);
  auto out = paddle::empty_like(x);
  const int64_t h = x.shape().back(), n = x.numel() / h;
  PD_DISPATCH_FLOATING_TYPES(x.type(), "specgen_add_rms_norm", ([&] {
    add_rms_norm_rows<data_t>(x.data<data_t>(), res.data<data_t>(), w.data<data_t>(), sum.data<data_t>(),
                              out.data<data_t>(), n, h, data_t(eps));
  }));
  return {sum, out};
}

std::vector<paddle::Tensor> SiluMul(const paddle::Tensor& gu) {
  check_cpu(gu, "gu");
  const int64_t two_i = gu.shape().back(), n = gu.numel() / two_i;
  auto out = paddle::empty({n, two_i / 2}, gu.dtype(), gu.place());
  PD_DISPATCH_FLOATING_TYPES(gu.type(), "specgen_silu_mul", ([&] {
    silu_mul_rows<data_t>(gu.data<data_t>(), out.data<data_t>(), n, two_i / 2);
  }));
  return {out};
}

namespace {

// Rotate-half RoPE of one head vector x [D] at a position whose cos/sin rows are c, s [D / 2].
template <typename T>
inline void rope(const T* x, const T* c, const T* s, T* out, int64_t d) {
  const int64_t half = d / 2;
  for (int64_t i = 0; i < half; ++i) {
    const T x1 = x[i], x2 = x[i + half];
    out[i] = x1 * c[i] - x2 * s[i];
    out[i + half] = x2 * c[i] + x1 * s[i];
  }
}

// A KV cache holds T (the activations' type) or, for float32 models, IEEE halves (uint16_t bits). Rows are
// converted element by element: halves widen exactly to float and floats narrow to the nearest even half.
template <typename To, typename From>
inline To convert(From x) {
  if constexpr (std::is_same_v<To, From>) {
    return x;
  } else if constexpr (std::is_same_v<From, uint16_t>) {
    return specgen::half_to_float(x);
  } else {
    return specgen::float_to_half(x);
  }
}

// dst [d] = src [d], converted to dst's element type.
template <typename From, typename To>
inline void convert_row(const From* src, To* dst, int64_t d) {
  for (int64_t i = 0; i < d; ++i) dst[i] = convert<To>(src[i]);
}

// One work item: the queries of `nt` consecutive tokens of one slot (positions p0 ..), the G query heads that
// share one KV head, against that head's keys/values [0, len).
template <typename T, typename C = T>
struct Tile {
  const T* q;       // query of token a, group head g at q + a * q_stride + g * D
  int64_t q_stride;  // H * D
  int64_t G, nt, p0, len;
  const C* k;  // this slot's own keys for this KV head: position j >= plen at k + (j - plen) * D
  const C* v;
  T* out;  // same indexing as q
  int64_t plen;  // positions [0, plen) come from the shared prefix
  const C* pk;   // shared prefix keys for this KV head: position j < plen at pk + j * D
  const C* pv;
  // Every tile is causal in its keys' index j. A token tree's node on its tree's first branch sits at its position
  // (its ancestors fill the rows before it). A node written off its position is a tile of its own whose keys are
  // indexed by position: key j < tail is row j, key j >= tail is row tail_rows[j - tail] (its ancestors, then
  // itself). Its chunks, lanes and sums are then those of plain decoding at its position, so a token accepted from
  // any branch has plain decoding's bits (a mask over keys by row had summed its softmax in other lanes).
  int64_t tail = std::numeric_limits<int64_t>::max();
  const int64_t* tail_rows = nullptr;
  inline int64_t row(int64_t j) const { return j >= tail ? tail_rows[j - tail] : j; }
  inline const C* key(int64_t j, int64_t D) const {
    const int64_t r = row(j);
    return r < plen ? pk + r * D : k + (r - plen) * D;
  }
  inline const C* value(int64_t j, int64_t D) const {
    const int64_t r = row(j);
    return r < plen ? pv + r * D : v + (r - plen) * D;
  }
};

// A tree token at row p and position P < p with visibility mask m (bit b: the row b back is itself or an
// ancestor; rows 64 or more back, the committed context, always visible): its keys in position order are rows
// [0, L) (L: the lowest row it does not see) and then the rows in (L, p] it sees, P + 1 - L of them. Writes those
// rows to tail_rows and returns L, or -1 when the mask does not fit that (not a tree's).
inline int64_t tree_tail(int64_t p, int64_t P, uint64_t m, int64_t* tail_rows) {
  int64_t top = -1;  // the highest bit clear: the lowest row not seen
  for (int64_t b = 63; b >= 0 && top < 0; --b)
    if (!((m >> b) & 1)) top = b;
  if (top < 0 || top > p) return -1;
  int64_t count = 0;
  for (int64_t b = top - 1; b >= 0; --b)
    if ((m >> b) & 1) tail_rows[count++] = p - b;
  const int64_t L = p - top;
  return count == P + 1 - L ? L : -1;
}

// Keys per chunk. A row's softmax is assembled from partial results over the fixed key ranges [c kChunk,
// (c + 1) kChunk) of its positions, merged in chunk order (merge_partials), so the arithmetic depends only on
// the row's own positions: not on the batch, nor on whether a tile's chunks run as one work item or several.
constexpr int64_t kChunk = 128;

// Partial results of one chunk for the rows of a tile, at `part`: m [rows] (max score), l [rows] (sum of
// e^(s - m)), acc [rows, D] (sum of e^(s - m) v). A row with no key in the chunk gets l = 0.
inline int64_t partial_size(int64_t rows, int64_t D) { return rows * (D + 2); }

// Reference-order version for any type: scores, max, exp, sum, weighted sum of values over keys [jb, je).
template <typename T, typename C>
void chunk_partial_generic(const Tile<T, C>& t, int64_t D, int64_t jb, int64_t je, std::vector<T>& sc, T* part) {
  const int64_t rows = t.nt * t.G, len = je - jb;
  T *m = part, *l = part + rows, *acc = part + 2 * rows;
  sc.assign(rows * len, T(0));
  std::fill(acc, acc + rows * D, T(0));
  std::vector<T> wide(D);  // a key or value row widened to T (a half cache)
  auto row = [&](const C* r) -> const T* {
    if constexpr (std::is_same_v<C, T>) {
      return r;
    } else {
      convert_row(r, wide.data(), D);
      return wide.data();
    }
  };
  for (int64_t j = jb; j < je; ++j) {
    const T* k = row(t.key(j, D));
    for (int64_t a = (j > t.p0 ? j - t.p0 : 0); a < t.nt; ++a)
      for (int64_t g = 0; g < t.G; ++g) sc[(a * t.G + g) * len + j - jb] = dot(t.q + a * t.q_stride + g * D, k, D);
  }
  for (int64_t a = 0; a < t.nt; ++a) {
    const int64_t last = std::min(je, t.p0 + a + 1);  // keys [jb, last)
    for (int64_t g = 0; g < t.G; ++g) {
      const int64_t r = a * t.G + g;
      T* e = sc.data() + r * len;
      if (last <= jb) { m[r] = -std::numeric_limits<T>::max(); l[r] = 0; continue; }
      T mx = e[0];
      for (int64_t j = 1; j < last - jb; ++j) mx = e[j] > mx ? e[j] : mx;
      T total = 0;
      for (int64_t j = 0; j < last - jb; ++j) { e[j] = std::exp(e[j] - mx); total += e[j]; }
      m[r] = mx;
      l[r] = total;
    }
  }
  for (int64_t j = jb; j < je; ++j) {
    const T* v = row(t.value(j, D));
    for (int64_t a = (j > t.p0 ? j - t.p0 : 0); a < t.nt; ++a)
      for (int64_t g = 0; g < t.G; ++g) {
        const T p = sc[(a * t.G + g) * len + j - jb];
        T* o = acc + (a * t.G + g) * D;
#pragma omp simd
        for (int64_t i = 0; i < D; ++i) o[i] += p * v[i];
      }
  }
}

template <typename T, typename C>
void chunk_partial(const Tile<T, C>& t, int64_t D, int64_t jb, int64_t je, std::vector<T>& sc, T* part) {
  chunk_partial_generic(t, D, jb, je, sc, part);
}

// Each row's output from the partials of its chunks 0 .. nch-1 (chunk c at parts + c * partial_size), in chunk
// order: out = sum_c e^(m_c - M) acc_c / sum_c e^(m_c - M) l_c with M the largest m_c.
template <typename T, typename C>
void merge_partials(const Tile<T, C>& t, int64_t D, const T* parts, int64_t nch) {
  const int64_t rows = t.nt * t.G, stride = partial_size(rows, D);
  for (int64_t r = 0; r < rows; ++r) {
    T mx = parts[r];  // chunk 0 holds key 0, which every row sees
    for (int64_t c = 1; c < nch; ++c) {
      const T* pc = parts + c * stride;
      if (pc[rows + r] > 0 && pc[r] > mx) mx = pc[r];
    }
    T* o = t.out + (r / t.G) * t.q_stride + (r % t.G) * D;
    std::fill(o, o + D, T(0));
    T total = 0;
    for (int64_t c = 0; c < nch; ++c) {
      const T* pc = parts + c * stride;
      if (!(pc[rows + r] > 0)) continue;
      const T w = std::exp(pc[r] - mx);
      total += w * pc[rows + r];
      const T* acc = pc + 2 * rows + r * D;
#pragma omp simd
      for (int64_t i = 0; i < D; ++i) o[i] += w * acc[i];
    }
    const T inv = T(1) / total;
#pragma omp simd
    for (int64_t i = 0; i < D; ++i) o[i] *= inv;
  }
}

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__) && defined(__F16C__))
constexpr int64_t kPrefetchKeys = 16;  // how far ahead of the scores the keys are asked for

// Asks for a key or value row ahead of its use (hardware prefetch alone streamed the caches at ~19 GB/s).
template <typename E>
inline void prefetch_row(const E* p, int64_t D) {
  for (int64_t off = 0; off < D * static_cast<int64_t>(sizeof(E)); off += 64)
    _mm_prefetch(reinterpret_cast<const char*>(p) + off, _MM_HINT_T0);
}

// Before a block of keys [j0, j0 + nk) is scored: the keys kPrefetchKeys further on (and, at a chunk's start,
// those of its first kPrefetchKeys positions), and the block's values, which the weighted sum reads next.
template <typename E>
inline void prefetch_block(const Tile<float, E>& t, int64_t D, int64_t jb, int64_t j0, int64_t nk, int64_t je) {
  if (j0 == jb)
    for (int64_t j = jb; j < std::min(je, jb + kPrefetchKeys); ++j) prefetch_row(t.key(j, D), D);
  for (int64_t j = j0 + kPrefetchKeys; j < std::min(je, j0 + kPrefetchKeys + nk); ++j) prefetch_row(t.key(j, D), D);
  for (int64_t j = j0; j < j0 + nk; ++j) prefetch_row(t.value(j, D), D);
}
#endif

#if defined(__AVX512F__)
// r[j] = sum of the 16 lanes of a[j], j = 0..15: pairs of vectors are folded lane-half by lane-half (a fixed
// tree, 15 permute-and-add steps for 16 sums instead of 16 horizontal reductions).
inline __m512 hsum16(const __m512* a) {
  const __m512i l1 = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23);
  const __m512i h1 = _mm512_setr_epi32(8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  const __m512i l2 = _mm512_setr_epi32(0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27);
  const __m512i h2 = _mm512_setr_epi32(4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
  const __m512i l3 = _mm512_setr_epi32(0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29);
  const __m512i h3 = _mm512_setr_epi32(2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
  const __m512i l4 = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  const __m512i h4 = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
  __m512 b[8], c[4], d[2];
  for (int i = 0; i < 8; ++i)  // b[i]: 8 partial sums of a[2i] in lanes 0-7, of a[2i + 1] in lanes 8-15
    b[i] = _mm512_add_ps(_mm512_permutex2var_ps(a[2 * i], l1, a[2 * i + 1]),
                         _mm512_permutex2var_ps(a[2 * i], h1, a[2 * i + 1]));
  for (int i = 0; i < 4; ++i)  // c[i]: 4 partials each of a[4i .. 4i + 3]
    c[i] = _mm512_add_ps(_mm512_permutex2var_ps(b[2 * i], l2, b[2 * i + 1]),
                         _mm512_permutex2var_ps(b[2 * i], h2, b[2 * i + 1]));
  for (int i = 0; i < 2; ++i)  // d[i]: 2 partials each of a[8i .. 8i + 7]
    d[i] = _mm512_add_ps(_mm512_permutex2var_ps(c[2 * i], l3, c[2 * i + 1]),
                         _mm512_permutex2var_ps(c[2 * i], h3, c[2 * i + 1]));
  return _mm512_add_ps(_mm512_permutex2var_ps(d[0], l4, d[1]), _mm512_permutex2var_ps(d[0], h4, d[1]));
}

// 16 floats of a key or value row: float32 as is, halves widened (exact).
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const uint16_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// Scores of one query row against up to 16 keys (nk of them; the rest score 0), the query held in registers:
// the same operations in the same order as the generic-C loop below, so the same bits.
template <int C, typename E>
inline void scores16(const float* q, const E* const* keys, int64_t nk, float* out) {
  __m512 qv[C];
  for (int c = 0; c < C; ++c) qv[c] = _mm512_loadu_ps(q + 16 * c);
  __m512 part[16];
  for (int kk = 0; kk < 16; ++kk) {
    if (kk >= nk) { part[kk] = _mm512_setzero_ps(); continue; }
    __m512 s = _mm512_mul_ps(qv[0], load16(keys[kk]));
    for (int c = 1; c < C; ++c) s = _mm512_fmadd_ps(qv[c], load16(keys[kk] + 16 * c), s);
    part[kk] = s;
  }
  _mm512_storeu_ps(out, hsum16(part));
}

// Weighted sum of values for R rows with their accumulators in registers: rows of acc [R, 16 C] =
// sum_j p[r, j - jb] * v_j over jb <= j < je in order (p is zero past each row's last key).
template <int C, int R, typename E>
inline void pv_rows(const Tile<float, E>& t, int64_t D, int64_t jb, int64_t je, const float* p, int64_t stride,
                    float* acc) {
  __m512 o[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) o[r][c] = _mm512_setzero_ps();
  for (int64_t j = jb; j < je; ++j) {
    const E* v = t.value(j, D);
    __m512 vv[C];
    for (int c = 0; c < C; ++c) vv[c] = load16(v + 16 * c);
    for (int r = 0; r < R; ++r) {
      const __m512 w = _mm512_set1_ps(p[r * stride + j - jb]);
      for (int c = 0; c < C; ++c) o[r][c] = _mm512_fmadd_ps(w, vv[c], o[r][c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) _mm512_storeu_ps(acc + r * D + 16 * c, o[r][c]);
}

// pv_rows over rows [0, rows) in groups of R, the last group R' = rows mod R (a compile-time count each).
template <int C, int R, typename E>
inline void pv_tail(const Tile<float, E>& t, int64_t D, int64_t jb, int64_t je, const float* p, int64_t stride,
                    int64_t nr, float* acc) {
  if constexpr (R > 0) {
    if (nr == R) return pv_rows<C, R, E>(t, D, jb, je, p, stride, acc);
    pv_tail<C, R - 1, E>(t, D, jb, je, p, stride, nr, acc);
  }
}

template <int C, int R, typename E>
inline void pv_all(const Tile<float, E>& t, int64_t D, int64_t jb, int64_t je, const float* p, int64_t stride,
                   int64_t rows, float* acc) {
  int64_t r0 = 0;
  for (; r0 + R <= rows; r0 += R) pv_rows<C, R, E>(t, D, jb, je, p + r0 * stride, stride, acc + r0 * D);
  pv_tail<C, R - 1, E>(t, D, jb, je, p + r0 * stride, stride, rows - r0, acc + r0 * D);
}

// float32 with head_dim a multiple of 16 (up to 256): the same steps, vectorised by hand. Scores come 16 keys
// at a time (hsum16); the weighted sum keeps up to 6 rows' accumulators in registers when head_dim is 64 (3 at
// 128). Each query row is still computed on its own, in a fixed order.
template <typename E>
void chunk_partial(const Tile<float, E>& t, int64_t D, int64_t jb, int64_t je, std::vector<float>& sc,
                   float* part) {
  if (D % 16 != 0 || D > 256) {
    return chunk_partial_generic(t, D, jb, je, sc, part);
  }
  const int64_t rows = t.nt * t.G, C = D / 16;
  const int64_t stride = (je - jb + 15) & ~int64_t(15);
  float *m = part, *l = part + rows, *acc = part + 2 * rows;
  sc.resize(rows * stride);
  const E* keys[16];
  for (int64_t j0 = jb; j0 < je; j0 += 16) {
    const int64_t nk = std::min<int64_t>(16, je - j0);
    for (int64_t kk = 0; kk < 16; ++kk) keys[kk] = kk < nk ? t.key(j0 + kk, D) : nullptr;
    prefetch_block(t, D, jb, j0, nk, je);
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t a = r / t.G, g = r % t.G;
      if (j0 > t.p0 + a) continue;  // every key of the block is in this row's future (zeroed below)
      const float* q = t.q + a * t.q_stride + g * D;
      float* out = sc.data() + r * stride + j0 - jb;
      if (C == 4) {
        scores16<4, E>(q, keys, nk, out);
      } else if (C == 8) {
        scores16<8, E>(q, keys, nk, out);
      } else {
        __m512 part16[16];
        for (int64_t kk = 0; kk < 16; ++kk) {
          if (kk >= nk) { part16[kk] = _mm512_setzero_ps(); continue; }
          __m512 s = _mm512_mul_ps(_mm512_loadu_ps(q), load16(keys[kk]));
          for (int64_t c = 1; c < C; ++c)
            s = _mm512_fmadd_ps(_mm512_loadu_ps(q + 16 * c), load16(keys[kk] + 16 * c), s);
          part16[kk] = s;
        }
        _mm512_storeu_ps(out, hsum16(part16));
      }
    }
  }
  for (int64_t a = 0; a < t.nt; ++a) {
    const int64_t n = std::min(je, t.p0 + a + 1) - jb;  // this row's keys in the chunk: [jb, jb + n)
    for (int64_t g = 0; g < t.G; ++g) {
      const int64_t ri = a * t.G + g;
      float* r = sc.data() + ri * stride;
      if (n <= 0) {
        m[ri] = -std::numeric_limits<float>::max();
        l[ri] = 0.0f;
        std::fill(r, r + stride, 0.0f);
        continue;
      }
      __m512 mv = _mm512_set1_ps(-std::numeric_limits<float>::max());
      for (int64_t j = 0; j < n; j += 16) {
        const __mmask16 mk = n - j >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (n - j)) - 1);
        mv = _mm512_mask_max_ps(mv, mk, mv, _mm512_maskz_loadu_ps(mk, r + j));
      }
      const float mx = _mm512_reduce_max_ps(mv);
      const __m512 mb = _mm512_set1_ps(mx);
      __m512 tot = _mm512_setzero_ps();
      for (int64_t j = 0; j < n; j += 16) {
        const __mmask16 in = n - j >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (n - j)) - 1), mk = in;
        const __m512 e = _mm512_maskz_mov_ps(mk, exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(mk, r + j), mb)));
        _mm512_mask_storeu_ps(r + j, in, e);
        tot = _mm512_add_ps(tot, e);
      }
      m[ri] = mx;
      l[ri] = _mm512_reduce_add_ps(tot);
      std::fill(r + n, r + stride, 0.0f);  // future keys weigh nothing in the weighted sum
    }
  }
  if (C == 8) {
    pv_all<8, 3, E>(t, D, jb, je, sc.data(), stride, rows, acc);
  } else if (C == 4) {
    pv_all<4, 6, E>(t, D, jb, je, sc.data(), stride, rows, acc);
  } else {
    std::fill(acc, acc + rows * D, 0.0f);
    __m512 kv[16];
    for (int64_t j = jb; j < je; ++j) {
      const E* v = t.value(j, D);
      for (int64_t c = 0; c < C; ++c) kv[c] = load16(v + 16 * c);
      for (int64_t a = (j > t.p0 ? j - t.p0 : 0); a < t.nt; ++a)
        for (int64_t g = 0; g < t.G; ++g) {
          const __m512 p = _mm512_set1_ps(sc[(a * t.G + g) * stride + j - jb]);
          float* o = acc + (a * t.G + g) * D;
          for (int64_t c = 0; c < C; ++c)
            _mm512_storeu_ps(o + 16 * c, _mm512_fmadd_ps(p, kv[c], _mm512_loadu_ps(o + 16 * c)));
        }
    }
  }
}
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
// r[j] = sum of the 8 lanes of a[j], j = 0..7, by a fixed tree (two rounds of pairwise adds within 128-bit halves,
// then the halves added): the same order for every j.
inline __m256 hsum8(const __m256* a) {
  const __m256 t01 = _mm256_hadd_ps(a[0], a[1]), t23 = _mm256_hadd_ps(a[2], a[3]);
  const __m256 t45 = _mm256_hadd_ps(a[4], a[5]), t67 = _mm256_hadd_ps(a[6], a[7]);
  const __m256 u0 = _mm256_hadd_ps(t01, t23), u1 = _mm256_hadd_ps(t45, t67);
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

// 8 floats of a key or value row: float32 as is, halves widened (exact).
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const uint16_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }

// Weighted sum of values for R rows over the column vectors [c0, c0 + C) (8 columns each), accumulators in
// registers: acc[r, 8 c0 .. 8 (c0 + C)) = sum_j p[r, j - jb] * v_j over jb <= j < je in order (p is zero past
// each row's last key).
template <int C, int R, typename E>
inline void pv_rows8(const Tile<float, E>& t, int64_t D, int64_t jb, int64_t je, const float* p, int64_t stride,
                     int64_t c0, float* acc) {
  __m256 o[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) o[r][c] = _mm256_setzero_ps();
  for (int64_t j = jb; j < je; ++j) {
    const E* v = t.value(j, D) + 8 * c0;
    __m256 w[R];
    for (int r = 0; r < R; ++r) w[r] = _mm256_broadcast_ss(p + r * stride + j - jb);
    for (int c = 0; c < C; ++c) {
      const __m256 vv = load8(v + 8 * c);
      for (int r = 0; r < R; ++r) o[r][c] = _mm256_fmadd_ps(w[r], vv, o[r][c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) _mm256_storeu_ps(acc + r * D + 8 * (c0 + c), o[r][c]);
}

// float32 with head_dim a multiple of 8 (up to 256): the AVX-512 path's steps 8 lanes at a time. Scores come 8
// keys at a time (hsum8); the weighted sum runs over 32 columns at a time with 2 rows' accumulators in registers.
// Each query row is still computed on its own, in a fixed order.
template <typename E>
void chunk_partial(const Tile<float, E>& t, int64_t D, int64_t jb, int64_t je, std::vector<float>& sc,
                   float* part) {
  if (D % 8 != 0 || D > 256) {
    return chunk_partial_generic(t, D, jb, je, sc, part);
  }
  const int64_t rows = t.nt * t.G, C = D / 8;
  const int64_t stride = (je - jb + 7) & ~int64_t(7);
  float *m = part, *l = part + rows, *acc = part + 2 * rows;
  sc.resize(rows * stride);
  const E* keys[8];
  for (int64_t j0 = jb; j0 < je; j0 += 8) {
    const int64_t nk = std::min<int64_t>(8, je - j0);
    for (int64_t kk = 0; kk < 8; ++kk) keys[kk] = kk < nk ? t.key(j0 + kk, D) : nullptr;
    prefetch_block(t, D, jb, j0, nk, je);
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t a = r / t.G, g = r % t.G;
      if (j0 > t.p0 + a) continue;  // every key of the block is in this row's future (zeroed below)
      const float* q = t.q + a * t.q_stride + g * D;
      __m256 part8[8];
      for (int64_t kk = 0; kk < 8; ++kk) {
        if (kk >= nk) { part8[kk] = _mm256_setzero_ps(); continue; }
        __m256 s = _mm256_mul_ps(_mm256_loadu_ps(q), load8(keys[kk]));
        for (int64_t c = 1; c < C; ++c) s = _mm256_fmadd_ps(_mm256_loadu_ps(q + 8 * c), load8(keys[kk] + 8 * c), s);
        part8[kk] = s;
      }
      _mm256_storeu_ps(sc.data() + r * stride + j0 - jb, hsum8(part8));
    }
  }
  for (int64_t a = 0; a < t.nt; ++a) {
    const int64_t n = std::min(je, t.p0 + a + 1) - jb;  // this row's keys in the chunk: [jb, jb + n)
    for (int64_t g = 0; g < t.G; ++g) {
      const int64_t ri = a * t.G + g;
      float* r = sc.data() + ri * stride;
      if (n <= 0) {
        m[ri] = -std::numeric_limits<float>::max();
        l[ri] = 0.0f;
        std::fill(r, r + stride, 0.0f);
        continue;
      }
      const __m256 lowest = _mm256_set1_ps(-std::numeric_limits<float>::max());
      __m256 mv = lowest;
      for (int64_t j = 0; j < n; j += 8) {
        const __m256 mk = _mm256_castsi256_ps(lanes_below(n - j));
        mv = _mm256_max_ps(mv, _mm256_blendv_ps(lowest, _mm256_loadu_ps(r + j), mk));
      }
      alignas(32) float lanes[8];
      _mm256_store_ps(lanes, mv);
      float mx = lanes[0];
      for (int i = 1; i < 8; ++i) mx = std::max(mx, lanes[i]);
      const __m256 mb = _mm256_set1_ps(mx);
      __m256 tot = _mm256_setzero_ps();
      for (int64_t j = 0; j < n; j += 8) {
        const __m256 mk = _mm256_castsi256_ps(lanes_below(n - j));
        const __m256 e = _mm256_and_ps(mk, exp256(_mm256_sub_ps(_mm256_loadu_ps(r + j), mb)));
        _mm256_storeu_ps(r + j, e);  // lanes past n (still within the row's stride) get 0
        tot = _mm256_add_ps(tot, e);
      }
      _mm256_store_ps(lanes, tot);
      m[ri] = mx;
      l[ri] = ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) + ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]));
      std::fill(r + n, r + stride, 0.0f);  // future keys weigh nothing in the weighted sum
    }
  }
  for (int64_t c0 = 0; c0 < C; c0 += 4) {
    const int64_t cn = std::min<int64_t>(4, C - c0);
    int64_t r0 = 0;
    for (; r0 + 2 <= rows; r0 += 2) {
      const float* p = sc.data() + r0 * stride;
      float* o = acc + r0 * D;
      if (cn == 4) pv_rows8<4, 2, E>(t, D, jb, je, p, stride, c0, o);
      else for (int64_t c = 0; c < cn; ++c) pv_rows8<1, 2, E>(t, D, jb, je, p, stride, c0 + c, o);
    }
    if (r0 < rows) {
      const float* p = sc.data() + r0 * stride;
      float* o = acc + r0 * D;
      if (cn == 4) pv_rows8<4, 1, E>(t, D, jb, je, p, stride, c0, o);
      else for (int64_t c = 0; c < cn; ++c) pv_rows8<1, 1, E>(t, D, jb, je, p, stride, c0 + c, o);
    }
  }
}
#endif

template <typename T, typename C = T>
void attention(const T* qkv, const T* cos, const T* sin, const int64_t* pos, const int64_t* slot, C* kc, C* vc,
               const T* qn, const T* kn, T* out, int64_t n, int64_t H, int64_t KV, int64_t D, int64_t cap,
               bool qk_norm, T eps, int64_t tile, const int64_t* plen, const C* pk, const C* pv, int64_t pcap,
               const int64_t* rope_pos = nullptr, const uint64_t* tree_mask = nullptr) {
  // rope_pos: a token tree's positions (its root's + depth), where `pos` are the rows it is written to and
  // attends from; tree_mask: the rows each token sees (tree_tail). nullptr: the rows are the positions, causal.
  if (rope_pos == nullptr) rope_pos = pos;
  const int64_t G = H / KV, width = (H + 2 * KV) * D, half = D / 2;
  const T scale = T(1) / std::sqrt(T(D));
  std::vector<T> q(n * H * D);  // [n, H, D] roped, scaled queries
  // Phase 1: RoPE on q and k, K/V into the cache rows ((slot * KV + kv) * cap + pos).
#pragma omp parallel for if (n > 4)
  for (int64_t t = 0; t < n; ++t) {
    const T* row = qkv + t * width;
    const T* c = cos + rope_pos[t] * half;
    const T* s = sin + rope_pos[t] * half;
    std::vector<T> tmp(D), roped(D);
    for (int64_t h = 0; h < H; ++h) {
      const T* x = row + h * D;
      if (qk_norm) { rms_norm_row(x, qn, tmp.data(), D, eps); x = tmp.data(); }
      rope(x, c, s, q.data() + (t * H + h) * D, D);
#pragma omp simd
      for (int64_t i = 0; i < D; ++i) q[(t * H + h) * D + i] *= scale;
    }
    for (int64_t h = 0; h < KV; ++h) {
      const int64_t dst = ((slot[t] * KV + h) * cap + pos[t] - plen[t]) * D;
      const T* x = row + (H + h) * D;
      if (qk_norm) { rms_norm_row(x, kn, tmp.data(), D, eps); x = tmp.data(); }
      rope(x, c, s, roped.data(), D);
      convert_row(roped.data(), kc + dst, D);
      convert_row(row + (H + KV + h) * D, vc + dst, D);
    }
  }
  // Tree tokens written off their positions: their keys in position order (Tile::tail), each its own tile.
  std::vector<int64_t> tail, tail_rows;
  if (tree_mask != nullptr) {
    tail.assign(n, -1);
    tail_rows.resize(n * 64);
    for (int64_t t = 0; t < n; ++t) {
      if (pos[t] == rope_pos[t]) continue;  // at its position: causal
      tail[t] = tree_tail(pos[t], rope_pos[t], tree_mask[t], tail_rows.data() + t * 64);
      PD_CHECK(tail[t] >= 0, "attention: a token's tree mask does not fit its row and position");
    }
  }
  auto alone = [&](int64_t t) { return tree_mask != nullptr && tail[t] >= 0; };
  // Tiles: runs of up to `tile` tokens of one slot at consecutive positions (a decode/verify block, or a piece
  // of a prompt); each tile and KV head is one work item that reads its keys and values once.
  std::vector<int64_t> starts;
  for (int64_t t = 0; t < n; ++t) {
    if (t == 0 || slot[t] != slot[t - 1] || pos[t] != pos[t - 1] + 1 || t - starts.back() >= tile || alone(t) ||
        alone(t - 1))
      starts.push_back(t);
  }
  const int64_t num_tiles = starts.size();
  starts.push_back(n);
  // keys [0, len) of tile ti: through its last token's row, or position for a tree token alone
  auto tile_len = [&](int64_t ti) {
    const int64_t last = starts[ti + 1] - 1;
    return (alone(last) ? rope_pos[last] : pos[last]) + 1;
  };
  // Phase 2: attention of each query over keys [0, pos] of its slot, as partial softmaxes over fixed chunks of
  // keys merged in order. With many (tile, KV head) items each is one work item (its chunks in turn); with few
  // (one slot decoding: 3 items for 2 threads) every chunk is its own item, which balances the threads. Both
  // compute the same partials and merge them alike, so the results are the same bits.
  auto tile_of = [&](int64_t w) {
    const int64_t ti = w / KV, kvh = w % KV, t0 = starts[ti], nt = starts[ti + 1] - t0;
    const bool own = alone(t0);
    Tile<T, C> tl{q.data() + (t0 * H + kvh * G) * D, H * D, G, nt, own ? rope_pos[t0] : pos[t0], tile_len(ti),
                  kc + (slot[t0] * KV + kvh) * cap * D, vc + (slot[t0] * KV + kvh) * cap * D,
                  out + (t0 * H + kvh * G) * D, plen[t0], pk + kvh * pcap * D, pv + kvh * pcap * D};
    if (own) {
      tl.tail = tail[t0];
      tl.tail_rows = tail_rows.data() + t0 * 64;
    }
    return tl;
  };
  // Work items are handed out through an atomic counter, not `omp for schedule(dynamic)`: with GCC's OpenMP
  // calls served by Paddle's libiomp5, that schedule was seen to give one iteration to two threads.
  const int64_t items = num_tiles * KV;
  if (items >= 4 * omp_get_max_threads()) {
    std::atomic<int64_t> next{0};
#pragma omp parallel
    {
      std::vector<T> sc, parts;
      for (int64_t w; (w = next.fetch_add(1)) < items;) {
        const Tile<T, C> tl = tile_of(w);
        const int64_t nch = (tl.len + kChunk - 1) / kChunk, size = partial_size(tl.nt * G, D);
        parts.resize(nch * size);
        for (int64_t c = 0; c < nch; ++c)
          chunk_partial(tl, D, c * kChunk, std::min(tl.len, (c + 1) * kChunk), sc, parts.data() + c * size);
        merge_partials(tl, D, parts.data(), nch);
      }
    }
    return;
  }
  std::vector<int64_t> first(items + 1, 0), offset(items + 1, 0);  // each item's first chunk and partials
  for (int64_t w = 0; w < items; ++w) {
    const int64_t ti = w / KV, nt = starts[ti + 1] - starts[ti], len = tile_len(ti);
    const int64_t nch = (len + kChunk - 1) / kChunk;
    first[w + 1] = first[w] + nch;
    offset[w + 1] = offset[w] + nch * partial_size(nt * G, D);
  }
  std::vector<T> parts(offset[items]);
  std::atomic<int64_t> next{0};
#pragma omp parallel
  {
    std::vector<T> sc;
    for (int64_t i; (i = next.fetch_add(1)) < first[items];) {
      const int64_t w = std::upper_bound(first.begin(), first.end(), i) - first.begin() - 1, c = i - first[w];
      const Tile<T, C> tl = tile_of(w);
      chunk_partial(tl, D, c * kChunk, std::min(tl.len, (c + 1) * kChunk), sc,
                    parts.data() + offset[w] + c * partial_size(tl.nt * G, D));
    }
#pragma omp barrier
#pragma omp for schedule(static)
    for (int64_t w = 0; w < items; ++w)
      merge_partials(tile_of(w), D, parts.data() + offset[w], first[w + 1] - first[w]);
  }
}

}  // namespace

std::vector<paddle::Tensor> Attention(const paddle::Tensor& qkv, const paddle::Tensor& cos, const paddle::Tensor& sin,
                                      const paddle::Tensor& positions, const paddle::Tensor& slots,
                                      paddle::Tensor& k_cache, paddle::Tensor& v_cache, const paddle::Tensor& q_norm,
                                      const paddle::Tensor& k_norm, const paddle::Tensor& prefix_len,
                                      const paddle::Tensor& prefix_k, const paddle::Tensor& prefix_v, int num_heads,
                                      int num_kv_heads, int64_t capacity, bool qk_norm, double eps,
                                      int64_t prefix_capacity) {
  check_cpu(qkv, "qkv");
  check_cpu(k_cache, "k_cache");
  const int64_t n = qkv.shape()[0], D = k_cache.shape().back();
  PD_CHECK(qkv.shape()[1] == (num_heads + 2 * num_kv_heads) * D, "qkv width does not match the heads");
  check_token_index(positions, slots);
  auto out = paddle::empty({n, num_heads * D}, qkv.dtype(), qkv.place());
  if (k_cache.dtype() == paddle::DataType::FLOAT16) {  // a half cache for float32 activations
    check_half_cache(qkv, k_cache, v_cache, prefix_len, prefix_k, prefix_v, "specgen_attention");
    attention<float, uint16_t>(qkv.data<float>(), cos.data<float>(), sin.data<float>(), positions.data<int64_t>(),
                               slots.data<int64_t>(), half_data(k_cache), half_data(v_cache), q_norm.data<float>(),
                               k_norm.data<float>(), out.data<float>(), n, num_heads, num_kv_heads, D, capacity,
                               qk_norm, static_cast<float>(eps), 8, prefix_len.data<int64_t>(), half_data(prefix_k),
                               half_data(prefix_v), prefix_capacity);
    return {out};
  }
  PD_DISPATCH_FLOATING_TYPES(qkv.type(), "specgen_attention", ([&] {
    attention<data_t>(qkv.data<data_t>(), cos.data<data_t>(), sin.data<data_t>(), positions.data<int64_t>(),
                      slots.data<int64_t>(), k_cache.data<data_t>(), v_cache.data<data_t>(), q_norm.data<data_t>(),
                      k_norm.data<data_t>(), out.data<data_t>(), n, num_heads, num_kv_heads, D, capacity, qk_norm,
                      data_t(eps), 8, prefix_len.data<int64_t>(), prefix_k.data<data_t>(), prefix_v.data<data_t>(),
                      prefix_capacity);
  }));
  return {out};
}

namespace {

// out[r, :] += b for each of the n rows (no-op for an empty bias).
template <typename T>
void add_bias(T* out, const paddle::Tensor& b, int64_t n, int64_t width) {
  if (b.numel() == 0) return;
  PD_CHECK(b.numel() == width, "bias width does not match its projection");
  const T* bp = b.data<T>();
  for (int64_t r = 0; r < n; ++r)
#pragma omp simd
    for (int64_t i = 0; i < width; ++i) out[r * width + i] += bp[i];
}

// Scratch for one block's intermediates, reused across calls: grown to the largest forward seen and kept (an
// 8,192-token prefill chunk of the default model leaves ~280 MB here).
template <typename T>
struct LayerScratch {
  std::vector<T> h, qkv, att, o, sum, gu, act, m, e;
};

// One decoder block's tensors.
struct BlockTensors {
  const paddle::Tensor &attn_norm, &w_qkv, &b_qkv, &w_o, &b_o, &mlp_norm, &w_gu, &b_gu, &w_down, &b_down;
  paddle::Tensor &k_cache, &v_cache;
  const paddle::Tensor &q_norm, &k_norm, &prefix_k, &prefix_v;
};

// What every block of one forward shares; T is the activations' type (float or double).
template <typename T>
struct StepInputs {
  const T *cos, *sin;
  const int64_t *positions, *slots, *prefix_len;  // [n] per token
  int64_t H, KV, capacity;
  bool qk_norm;
  T eps;
  int64_t prefix_capacity;
  const int64_t* rope_positions = nullptr;  // [n] a token tree's positions (rows: `positions`); nullptr: the rows
  const uint64_t* tree_mask = nullptr;  // [n] the rows each token sees (tree_tail); nullptr: causal
};

// The paddle type of activations T, and its name for errors.
template <typename T>
constexpr paddle::DataType dtype_of() {
  return std::is_same_v<T, float> ? paddle::DataType::FLOAT32 : paddle::DataType::FLOAT64;
}
template <typename T>
constexpr const char* dtype_name() {
  return std::is_same_v<T, float> ? "float32" : "float64";
}

// f(T{}) for the activations' type T of t: float for float32, double for float64 (the whole-forward ops' two
// instantiations; errors name op).
template <typename F>
auto with_activations(const paddle::Tensor& t, const char* op, F&& f) {
  if (t.dtype() == paddle::DataType::FLOAT64) return f(double{});
  PD_CHECK(t.dtype() == paddle::DataType::FLOAT32, op, ": float32 or float64 activations only");
  return f(float{});
}

// w as a packed weight of k inputs and n outputs for activations T: float64 panels exactly when T is double, so a
// mismatch stops before anything is written (errors name `name`).
template <typename T>
specgen::PackedWeight packed_for(const paddle::Tensor& w, int64_t k, int64_t n, const char* name) {
  const specgen::PackedWeight p = specgen::packed_weight(w, k, n, name);
  PD_CHECK(((p.kind == specgen::kFloat64Panels) == std::is_same_v<T, double>), name, ": ", dtype_name<T>(),
           " activations need ", std::is_same_v<T, double> ? "float64 panels" : "float32, 16-bit or quantized panels");
  return p;
}

// A block's packed projections, checked against the shapes the block needs (errors name the projection). A routed
// block without shared experts has no dense MLP: inter 0.
struct BlockWeights {
  specgen::PackedWeight qkv, o, gu, down;
  int64_t D, inter;
};

template <typename T>
BlockWeights check_block(const BlockTensors& b, const StepInputs<T>& a, int64_t hid) {
  check_cpu(b.k_cache, "k_cache");
  if constexpr (std::is_same_v<T, float>) {
    PD_CHECK(b.k_cache.dtype() == paddle::DataType::FLOAT32 || b.k_cache.dtype() == paddle::DataType::FLOAT16,
             "specgen_stack: float32 or float16 caches only");
  } else {
    PD_CHECK(b.k_cache.dtype() == paddle::DataType::FLOAT64,
             "specgen_stack: float64 activations need float64 caches (float16 caches serve float32 only)");
  }
  PD_CHECK(b.v_cache.dtype() == b.k_cache.dtype(), "specgen_stack: K and V caches of different types");
  for (const paddle::Tensor* t :
       {&b.attn_norm, &b.mlp_norm, &b.q_norm, &b.k_norm, &b.b_qkv, &b.b_o, &b.b_gu, &b.b_down})
    PD_CHECK(t->numel() == 0 || t->dtype() == dtype_of<T>(), "specgen_stack: norms and biases must be ",
             dtype_name<T>(), ", as the activations");
  const int64_t D = b.k_cache.shape().back(), wq = (a.H + 2 * a.KV) * D;
  BlockWeights w{packed_for<T>(b.w_qkv, hid, wq, "w_qkv"), packed_for<T>(b.w_o, a.H * D, hid, "w_o"), {}, {}, D, 0};
  if (b.w_down.numel() == 0) return w;  // no dense MLP (a routed block's experts are all it has)
  // w_down's inputs: [panels, inter, 32] float32 / float64, or [panels, inter / 32, bytes] quantized
  const bool flat = b.w_down.dtype() == paddle::DataType::FLOAT32 || b.w_down.dtype() == paddle::DataType::FLOAT64;
  w.inter = b.w_down.shape()[1] * (flat ? 1 : 32);
  w.gu = packed_for<T>(b.w_gu, hid, 2 * w.inter, "w_gate_up");
  w.down = packed_for<T>(b.w_down, w.inter, hid, "w_down");
  return w;
}

// att [n, H D] = the block's attention over qkv [n, (H + 2 KV) D], writing the tokens' K/V into its cache (T, or
// for float32 activations IEEE halves).
template <typename T>
void block_attention(const T* qkv, T* att, int64_t n, int64_t D, const BlockTensors& b, const StepInputs<T>& a) {
  const int64_t H = a.H, KV = a.KV;
  if constexpr (std::is_same_v<T, float>) {
    if (b.k_cache.dtype() == paddle::DataType::FLOAT16) {
      bool shared = false;
      for (int64_t t = 0; t < n; ++t) shared = shared || a.prefix_len[t] > 0;
      PD_CHECK(!shared || (b.prefix_k.dtype() == b.k_cache.dtype() && b.prefix_v.dtype() == b.k_cache.dtype()),
               "specgen_stack: the shared prefix's cache type differs from the slots' cache");
      attention<float, uint16_t>(qkv, a.cos, a.sin, a.positions, a.slots, half_data(b.k_cache), half_data(b.v_cache),
                                 b.q_norm.data<float>(), b.k_norm.data<float>(), att, n, H, KV, D, a.capacity,
                                 a.qk_norm, a.eps, 8, a.prefix_len, half_data(b.prefix_k), half_data(b.prefix_v),
                                 a.prefix_capacity, a.rope_positions, a.tree_mask);
      return;
    }
  }
  attention<T>(qkv, a.cos, a.sin, a.positions, a.slots, b.k_cache.data<T>(), b.v_cache.data<T>(),
               b.q_norm.data<T>(), b.k_norm.data<T>(), att, n, H, KV, D, a.capacity, a.qk_norm, a.eps, 8,
               a.prefix_len, b.prefix_k.data<T>(), b.prefix_v.data<T>(), a.prefix_capacity, a.rope_positions,
               a.tree_mask);
}

// out [n, hid] = the pre-norm decoder block applied to x [n, hid], writing this block's K/V into its cache. With
// moe, the MLP is the routed experts' output plus the dense MLP's (the shared experts), if the block has one.
template <typename T>
void block_forward(const T* x, T* out, int64_t n, int64_t hid, const BlockTensors& b, const BlockWeights& w,
                   const StepInputs<T>& a, const specgen::ExpertBlock* moe) {
  const int64_t H = a.H, KV = a.KV, D = w.D, inter = w.inter, wq = (H + 2 * KV) * D;
  static thread_local LayerScratch<T> s;
  s.h.resize(n * hid);
  s.qkv.resize(n * wq);
  s.att.resize(n * H * D);
  s.o.resize(n * hid);
  s.sum.resize(n * hid);
  s.gu.resize(n * 2 * inter);
  s.act.resize(n * inter);
  s.m.resize(n * hid);
  if (b.attn_norm.numel() == 0)  // no input norm (an EAGLE-1 draft layer)
    std::copy(x, x + n * hid, s.h.data());
  else
    rms_norm_rows<T>(x, b.attn_norm.data<T>(), s.h.data(), n, hid, a.eps);
  specgen::packed_linear(s.h.data(), n, hid, w.qkv, s.qkv.data(), wq);
  add_bias(s.qkv.data(), b.b_qkv, n, wq);
  block_attention(s.qkv.data(), s.att.data(), n, D, b, a);
  specgen::packed_linear(s.att.data(), n, H * D, w.o, s.o.data(), hid);
  add_bias(s.o.data(), b.b_o, n, hid);
  add_rms_norm_rows<T>(x, s.o.data(), b.mlp_norm.data<T>(), s.sum.data(), s.h.data(), n, hid, a.eps);
  if (inter > 0) {
    specgen::packed_linear(s.h.data(), n, hid, w.gu, s.gu.data(), 2 * inter);
    add_bias(s.gu.data(), b.b_gu, n, 2 * inter);
    silu_mul_rows<T>(s.gu.data(), s.act.data(), n, inter);
    specgen::packed_linear(s.act.data(), n, inter, w.down, s.m.data(), hid);
    add_bias(s.m.data(), b.b_down, n, hid);
  }
  if (moe == nullptr) {
#pragma omp simd
    for (int64_t i = 0; i < n * hid; ++i) out[i] = s.sum[i] + s.m[i];
    return;
  }
  s.e.resize(n * hid);
  specgen::moe_mlp<T>(s.h.data(), s.e.data(), n, hid, *moe);
  if (inter > 0) {  // (routed + shared) + residual, transformers' order
#pragma omp simd
    for (int64_t i = 0; i < n * hid; ++i) out[i] = s.sum[i] + (s.e[i] + s.m[i]);
  } else {
#pragma omp simd
    for (int64_t i = 0; i < n * hid; ++i) out[i] = s.sum[i] + s.e[i];
  }
}

template <typename T>
StepInputs<T> step_inputs(const paddle::Tensor& x, const paddle::Tensor& cos, const paddle::Tensor& sin,
                          const paddle::Tensor& positions, const paddle::Tensor& slots,
                          const paddle::Tensor& prefix_len, int num_heads, int num_kv_heads, int64_t capacity,
                          bool qk_norm, double eps, int64_t prefix_capacity) {
  check_cpu(x, "x");
  PD_CHECK(x.dtype() == dtype_of<T>() && x.shape().size() == 2, dtype_name<T>(),
           " activations [n, hidden] expected");
  PD_CHECK(cos.dtype() == dtype_of<T>() && sin.dtype() == dtype_of<T>(), "RoPE tables (cos, sin) must be ",
           dtype_name<T>(), ", as the activations");
  check_token_index(positions, slots);
  return {cos.data<T>(), sin.data<T>(), positions.data<int64_t>(), slots.data<int64_t>(),
          prefix_len.data<int64_t>(), num_heads, num_kv_heads, capacity, qk_norm, static_cast<T>(eps),
          prefix_capacity};
}

}  // namespace

namespace {

using Tensors = std::vector<paddle::Tensor>;

// Blocks 0 .. L-1 of one forward, block i's tensors at index i of each list (errors name the projection); moe[i]
// the routed experts of block i (nullptr: dense; an empty list: no block is routed).
struct Blocks {
  std::vector<BlockTensors> tensors;
  std::vector<BlockWeights> weights;
  std::vector<const specgen::ExpertBlock*> moe;
};

template <typename T>
Blocks collect_blocks(const StepInputs<T>& a, int64_t hid, const Tensors& attn_norm, const Tensors& w_qkv,
                      const Tensors& b_qkv, const Tensors& w_o, const Tensors& b_o, const Tensors& mlp_norm,
                      const Tensors& w_gu, const Tensors& b_gu, const Tensors& w_down, const Tensors& b_down,
                      Tensors& k_cache, Tensors& v_cache, const Tensors& q_norm, const Tensors& k_norm,
                      const Tensors& prefix_k, const Tensors& prefix_v) {
  const size_t L = attn_norm.size();
  for (const auto* list : {&w_qkv, &b_qkv, &w_o, &b_o, &mlp_norm, &w_gu, &b_gu, &w_down, &b_down, &q_norm, &k_norm,
                           &prefix_k, &prefix_v})
    PD_CHECK(list->size() == L, "specgen_stack: every list needs one tensor per block");
  PD_CHECK(k_cache.size() == L && v_cache.size() == L && L > 0, "specgen_stack: one cache per block");
  Blocks b;
  for (size_t i = 0; i < L; ++i) {
    b.tensors.push_back({attn_norm[i], w_qkv[i], b_qkv[i], w_o[i], b_o[i], mlp_norm[i], w_gu[i], b_gu[i], w_down[i],
                         b_down[i], k_cache[i], v_cache[i], q_norm[i], k_norm[i], prefix_k[i], prefix_v[i]});
    b.weights.push_back(check_block(b.tensors.back(), a, hid));
  }
  return b;
}

// capture (with features [n, C hidden]): the input of block capture[c] (the output of the last block for
// capture[c] == L), for every token, into features' columns [c hidden, (c + 1) hidden) (EAGLE-3's features).
template <typename T>
void capture_rows(const T* in, int64_t n, int64_t hid, size_t layer, const std::vector<int64_t>* capture,
                  T* features) {
  if (capture == nullptr) return;
  const int64_t C = static_cast<int64_t>(capture->size());
  for (int64_t c = 0; c < C; ++c) {
    if ((*capture)[c] != static_cast<int64_t>(layer)) continue;
    for (int64_t t = 0; t < n; ++t) std::copy(in + t * hid, in + (t + 1) * hid, features + (t * C + c) * hid);
  }
}

// out [n, hid] = the blocks applied one after the other to x [n, hid] (n > 0).
template <typename T>
void run_blocks(const T* x, T* out, int64_t n, int64_t hid, const Blocks& b, const StepInputs<T>& a,
                const std::vector<int64_t>* capture = nullptr, T* features = nullptr) {
  static thread_local std::vector<T> ping, pong;  // block outputs between blocks
  ping.resize(n * hid);
  pong.resize(n * hid);
  const size_t L = b.tensors.size();
  const T* in = x;
  for (size_t i = 0; i < L; ++i) {
    capture_rows(in, n, hid, i, capture, features);
    T* dst = i + 1 == L ? out : (i % 2 == 0 ? ping.data() : pong.data());
    block_forward(in, dst, n, hid, b.tensors[i], b.weights[i], a, b.moe.empty() ? nullptr : b.moe[i]);
    in = dst;
  }
  capture_rows(in, n, hid, L, capture, features);
}

}  // namespace

// Blocks 0 .. L-1 in one call, each list holding block i's tensor at i: x [n, hidden] -> the last block's output.
std::vector<paddle::Tensor> Stack(const paddle::Tensor& x, const Tensors& attn_norm, const Tensors& w_qkv,
                                  const Tensors& b_qkv, const Tensors& w_o, const Tensors& b_o,
                                  const Tensors& mlp_norm, const Tensors& w_gu, const Tensors& b_gu,
                                  const Tensors& w_down, const Tensors& b_down, const paddle::Tensor& cos,
                                  const paddle::Tensor& sin, const paddle::Tensor& positions,
                                  const paddle::Tensor& slots, Tensors& k_cache, Tensors& v_cache,
                                  const Tensors& q_norm, const Tensors& k_norm, const paddle::Tensor& prefix_len,
                                  const Tensors& prefix_k, const Tensors& prefix_v, int num_heads, int num_kv_heads,
                                  int64_t capacity, bool qk_norm, double eps, int64_t prefix_capacity) {
  return with_activations(x, "specgen_stack", [&](auto type) -> std::vector<paddle::Tensor> {
    using T = decltype(type);
    const StepInputs<T> a = step_inputs<T>(x, cos, sin, positions, slots, prefix_len, num_heads, num_kv_heads,
                                           capacity, qk_norm, eps, prefix_capacity);
    const int64_t n = x.shape()[0], hid = x.shape()[1];
    const Blocks b = collect_blocks(a, hid, attn_norm, w_qkv, b_qkv, w_o, b_o, mlp_norm, w_gu, b_gu, w_down, b_down,
                                    k_cache, v_cache, q_norm, k_norm, prefix_k, prefix_v);
    auto out = paddle::empty({n, hid}, x.dtype(), x.place());
    if (n > 0) run_blocks(x.data<T>(), out.data<T>(), n, hid, b, a);
    return {out};
  });
}

// A whole forward of the main model (Model.forward with specgen_stack): x = embed[token_ids], the blocks, then
// hidden = rms_norm(x, final_norm) for every token and logits = hidden[logit_rows] @ lm_head. The same functions in
// the same order as the separate ops, so the same bits; one call instead of five, and the Python between them,
// which after the blocks have streamed the weights through the caches costs ~0.2 ms a call, is gone. The logits'
// argmax (specgen_argmax's) comes with them: the greedy token of every logit row, for the sampler. With a non-empty
// lm_screen (the LM head's integer-product panels) and lm_bound, only the greedy tokens are computed, with the
// same values (specgen::screened_argmax), and logits is [0, vocab] (float32 only); with `sample` too, the rows it
// samples (temperature > 0, no filter) get their sampled token instead, drawn from the same bounds. A float64 embedding makes the
// whole forward float64: float64 panels (the LM head's too), caches, tables and norms.
// -> (logits [num_logits, vocab], hidden [n, hidden] in the embedding's type, greedy int64 [num_logits])
std::vector<paddle::Tensor> ForwardImpl(
    const paddle::Tensor& token_ids, const paddle::Tensor& embed, const Tensors& attn_norm, const Tensors& w_qkv,
    const Tensors& b_qkv, const Tensors& w_o, const Tensors& b_o, const Tensors& mlp_norm, const Tensors& w_gu,
    const Tensors& b_gu, const Tensors& w_down, const Tensors& b_down, const paddle::Tensor& cos,
    const paddle::Tensor& sin, const paddle::Tensor& positions, const paddle::Tensor& slots, Tensors& k_cache,
    Tensors& v_cache, const Tensors& q_norm, const Tensors& k_norm, const paddle::Tensor& prefix_len,
    const Tensors& prefix_k, const Tensors& prefix_v, const paddle::Tensor& final_norm,
    const paddle::Tensor& logit_rows, const paddle::Tensor& lm_head, const paddle::Tensor& lm_screen,
    const paddle::Tensor& lm_bound, int num_heads, int num_kv_heads, int64_t capacity, bool qk_norm, double eps,
    int64_t prefix_capacity, int64_t vocab, const std::vector<const specgen::ExpertBlock*>* moe,
    const int64_t* tree = nullptr, const std::vector<int64_t>* capture = nullptr,
    const paddle::Tensor* sample = nullptr) {
  check_cpu(embed, "embed");
  PD_CHECK(embed.shape().size() == 2, "specgen_forward: embedding [vocab, hidden]");
  return with_activations(embed, "specgen_forward", [&](auto type) -> std::vector<paddle::Tensor> {
    using T = decltype(type);
    PD_CHECK(token_ids.dtype() == paddle::DataType::INT64 && logit_rows.dtype() == paddle::DataType::INT64,
             "specgen_forward: int64 token ids and logit rows");
    const int64_t n = token_ids.numel(), m = logit_rows.numel(), V = embed.shape()[0], hid = embed.shape()[1];
    PD_CHECK(positions.numel() == n && slots.numel() == n && prefix_len.numel() == n,
             "specgen_forward: one position, slot and prefix length per token");
    PD_CHECK(final_norm.numel() == hid, "specgen_forward: final_norm must be [hidden]");
    auto hidden = paddle::empty({n, hid}, embed.dtype(), embed.place());
    const int64_t C = capture != nullptr ? static_cast<int64_t>(capture->size()) : 0;
    if (capture != nullptr)
      for (int64_t l : *capture)
        PD_CHECK(l >= 0 && l <= static_cast<int64_t>(w_qkv.size()), "specgen_forward: capture layer out of range");
    auto features = paddle::empty({C ? n : 0, C * hid}, embed.dtype(), embed.place());
    StepInputs<T> a = step_inputs<T>(hidden, cos, sin, positions, slots, prefix_len, num_heads, num_kv_heads,
                                     capacity, qk_norm, eps, prefix_capacity);
    if (tree != nullptr) {  // [2 n]: positions, then masks
      a.rope_positions = tree;
      a.tree_mask = reinterpret_cast<const uint64_t*>(tree + n);
    }
    Blocks b = collect_blocks(a, hid, attn_norm, w_qkv, b_qkv, w_o, b_o, mlp_norm, w_gu, b_gu, w_down, b_down,
                              k_cache, v_cache, q_norm, k_norm, prefix_k, prefix_v);
    if (moe != nullptr) {
      PD_CHECK(moe->size() == b.tensors.size(), "specgen_forward: one entry of the bound experts per block");
      for (const specgen::ExpertBlock* e : *moe)
        PD_CHECK(e == nullptr || (e->router.kind == specgen::kFloat64Panels) == (std::is_same_v<T, double>),
                 "specgen_forward: the experts' panels are not of the activations' type");
      b.moe = *moe;
    }
    const specgen::PackedWeight lm = packed_for<T>(lm_head, hid, vocab, "lm_head");
    const bool screened = lm_screen.numel() > 0;  // tokens only (specgen::screened_argmax), no logits
    PD_CHECK(screened || sample == nullptr || sample->numel() == 0,
             "specgen_forward: sampling in the forward needs the LM head's screen");
    if (screened) {
      PD_CHECK((std::is_same_v<T, float>), "specgen_forward: the screened LM head (lm_screen) is float32 only");
      PD_CHECK(lm_bound.dtype() == paddle::DataType::FLOAT32 &&
                   lm_bound.numel() == lm_head.shape()[0] * (hid / 32) * 32,
               "specgen_forward: lm_bound must be float32 [panels, hidden / 32, 32]");
    }
    auto logits = paddle::empty({screened ? 0 : m, vocab}, embed.dtype(), embed.place());
    auto greedy = paddle::empty({m}, paddle::DataType::INT64, embed.place());
    if (n == 0) return {logits, hidden, greedy, features};
    static thread_local std::vector<T> x, y, rows;
    x.resize(n * hid);
    y.resize(n * hid);
    const int64_t *tok = token_ids.data<int64_t>(), *lr = logit_rows.data<int64_t>();
    const T* emb = embed.data<T>();
    for (int64_t t = 0; t < n; ++t) {
      PD_CHECK(tok[t] >= 0 && tok[t] < V, "specgen_forward: token id out of range");
      std::copy(emb + tok[t] * hid, emb + (tok[t] + 1) * hid, x.data() + t * hid);
    }
    run_blocks(x.data(), y.data(), n, hid, b, a, C ? capture : nullptr, C ? features.data<T>() : nullptr);
    T* h = hidden.data<T>();
    rms_norm_rows<T>(y.data(), final_norm.data<T>(), h, n, hid, static_cast<T>(eps));
    if (m == 0) return {logits, hidden, greedy, features};
    rows.resize(m * hid);
    for (int64_t r = 0; r < m; ++r) {
      PD_CHECK(lr[r] >= 0 && lr[r] < n, "specgen_forward: logit row out of range");
      std::copy(h + lr[r] * hid, h + (lr[r] + 1) * hid, rows.data() + r * hid);
    }
    if constexpr (std::is_same_v<T, float>) {
      if (screened) {
        const specgen::PackedWeight screen = specgen::packed_weight(lm_screen, hid, vocab, "lm_screen");
        const bool sampled = sample != nullptr && sample->numel() > 0;
        if (sampled)
          PD_CHECK(sample->dtype() == paddle::DataType::FLOAT64 && sample->numel() == 8 * m,
                   "specgen_forward: sample params must be float64 [8, num_logit_rows]");
        specgen::screened_argmax(rows.data(), m, hid, lm, screen, lm_bound.data<float>(), vocab,
                                 greedy.data<int64_t>(), sampled ? sample->data<double>() : nullptr);
        return {logits, hidden, greedy, features};
      }
    }
    specgen::packed_linear(rows.data(), m, hid, lm, logits.data<T>(), vocab);
    argmax_rows<T>(logits.data<T>(), m, vocab, greedy.data<int64_t>());
    return {logits, hidden, greedy, features};
  });
}

// specgen_forward's operator: no routed experts (those come bound, with specgen_forward_bound).
std::vector<paddle::Tensor> Forward(
    const paddle::Tensor& token_ids, const paddle::Tensor& embed, const Tensors& attn_norm, const Tensors& w_qkv,
    const Tensors& b_qkv, const Tensors& w_o, const Tensors& b_o, const Tensors& mlp_norm, const Tensors& w_gu,
    const Tensors& b_gu, const Tensors& w_down, const Tensors& b_down, const paddle::Tensor& cos,
    const paddle::Tensor& sin, const paddle::Tensor& positions, const paddle::Tensor& slots, Tensors& k_cache,
    Tensors& v_cache, const Tensors& q_norm, const Tensors& k_norm, const paddle::Tensor& prefix_len,
    const Tensors& prefix_k, const Tensors& prefix_v, const paddle::Tensor& final_norm,
    const paddle::Tensor& logit_rows, const paddle::Tensor& lm_head, const paddle::Tensor& lm_screen,
    const paddle::Tensor& lm_bound, int num_heads, int num_kv_heads, int64_t capacity, bool qk_norm, double eps,
    int64_t prefix_capacity, int64_t vocab) {
  auto out = ForwardImpl(token_ids, embed, attn_norm, w_qkv, b_qkv, w_o, b_o, mlp_norm, w_gu, b_gu, w_down, b_down,
                         cos, sin, positions, slots, k_cache, v_cache, q_norm, k_norm, prefix_len, prefix_k, prefix_v,
                         final_norm, logit_rows, lm_head, lm_screen, lm_bound, num_heads, num_kv_heads, capacity,
                         qk_norm, eps, prefix_capacity, vocab, nullptr);
  out.pop_back();  // no features
  return out;
}

namespace {

// What specgen_bind_weights / specgen_bind_caches keep: copies of the tensor handles (they share the storage,
// which stays alive until specgen_unbind), looked up by handle in specgen_forward_bound.
// A mixture-of-experts model's routed blocks (specgen_bind_experts): the tensors, their ExpertBlocks, each block's
// entry (nullptr: dense) and the tokens each expert took since they were last taken.
struct BoundExperts {
  Tensors routers, bias, w_gu, w_down;
  std::vector<specgen::ExpertBlock> routed;  // [num_routed]
  std::vector<const specgen::ExpertBlock*> blocks;  // [num_layers]
  std::vector<int64_t> counts;  // [num_routed, num_experts]
};

struct BoundWeights {
  paddle::Tensor embed, cos, sin, final_norm, lm_head;
  Tensors attn_norm, w_qkv, b_qkv, w_o, b_o, mlp_norm, w_gu, b_gu, w_down, b_down, q_norm, k_norm;
  std::shared_ptr<BoundExperts> experts;  // set by specgen_bind_experts for an MoE model
};
struct BoundCaches {
  Tensors k, v, prefix_k, prefix_v;
};

std::mutex bound_mutex;
int64_t bound_next = 1;  // handles of both kinds from one counter, so a handle names one binding
std::map<int64_t, std::shared_ptr<BoundWeights>> bound_weights;
std::map<int64_t, std::shared_ptr<BoundCaches>> bound_caches;

paddle::Tensor handle_tensor(int64_t id, const paddle::Place& place) {
  auto t = paddle::empty({1}, paddle::DataType::INT64, place);
  t.data<int64_t>()[0] = id;
  return t;
}

}  // namespace

// -> handle int64 [1]. The tensors are specgen_forward's weight arguments, in its order (the LM head's screen
// is not among them: specgen_forward_bound takes it per call, as greedy and sampled steps differ).
std::vector<paddle::Tensor> BindWeights(const paddle::Tensor& embed, const Tensors& attn_norm, const Tensors& w_qkv,
                                        const Tensors& b_qkv, const Tensors& w_o, const Tensors& b_o,
                                        const Tensors& mlp_norm, const Tensors& w_gu, const Tensors& b_gu,
                                        const Tensors& w_down, const Tensors& b_down, const paddle::Tensor& cos,
                                        const paddle::Tensor& sin, const Tensors& q_norm, const Tensors& k_norm,
                                        const paddle::Tensor& final_norm, const paddle::Tensor& lm_head) {
  check_cpu(embed, "embed");
  auto w = std::make_shared<BoundWeights>(BoundWeights{embed, cos, sin, final_norm, lm_head, attn_norm, w_qkv, b_qkv,
                                                       w_o, b_o, mlp_norm, w_gu, b_gu, w_down, b_down, q_norm,
                                                       k_norm});
  std::lock_guard<std::mutex> lock(bound_mutex);
  const int64_t id = bound_next++;
  bound_weights[id] = std::move(w);
  return {handle_tensor(id, embed.place())};
}

namespace {

std::shared_ptr<BoundWeights> bound_weights_of(const paddle::Tensor& handle, const char* op) {
  PD_CHECK(handle.dtype() == paddle::DataType::INT64 && handle.numel() == 1, op, ": one int64 handle");
  const int64_t id = handle.data<int64_t>()[0];
  std::lock_guard<std::mutex> lock(bound_mutex);
  auto it = bound_weights.find(id);
  PD_CHECK(it != bound_weights.end(), op, ": no weights bound under handle ", id);
  return it->second;
}

}  // namespace

// The routed experts of the weights bound under `handle` (returned): routers[j], bias[j] (float32 [num_experts] or
// empty) and the local experts l of routed block j at w_gate_up / w_down[j * num_local + l] (packed panels), for
// the blocks listed in `blocks` (ascending). The experts held are ids [first_expert, first_expert + num_local).
std::vector<paddle::Tensor> BindExperts(const paddle::Tensor& handle, const Tensors& routers, const Tensors& bias,
                                        const Tensors& w_gu, const Tensors& w_down,
                                        const std::vector<int64_t>& blocks, int64_t hidden, int64_t inter,
                                        int64_t num_experts, int64_t top_k, int64_t first_expert, bool norm,
                                        double norm_min) {
  auto w = bound_weights_of(handle, "specgen_bind_experts");
  const size_t R = blocks.size(), L = w->attn_norm.size();
  PD_CHECK(R > 0 && routers.size() == R && bias.size() == R && w_gu.size() == w_down.size() &&
               w_gu.size() % R == 0 && !w_gu.empty(),
           "specgen_bind_experts: one router and bias per routed block, the same number of experts in each");
  PD_CHECK(top_k >= 1 && top_k <= num_experts, "specgen_bind_experts: 1 <= top_k <= num_experts");
  const int64_t local = static_cast<int64_t>(w_gu.size() / R);
  PD_CHECK(first_expert >= 0 && first_expert + local <= num_experts, "specgen_bind_experts: experts out of range");
  auto e = std::make_shared<BoundExperts>(BoundExperts{routers, bias, w_gu, w_down, {}, {}, {}});
  e->routed.resize(R);
  e->blocks.assign(L, nullptr);
  e->counts.assign(R * num_experts, 0);
  for (size_t j = 0; j < R; ++j) {
    PD_CHECK(blocks[j] >= 0 && static_cast<size_t>(blocks[j]) < L, "specgen_bind_experts: block out of range");
    specgen::ExpertBlock& m = e->routed[j];
    m.router = specgen::packed_weight(routers[j], hidden, num_experts, "router");
    for (int64_t l = 0; l < local; ++l) {
      m.gate_up.push_back(specgen::packed_weight(w_gu[j * local + l], hidden, 2 * inter, "expert gate_up"));
      m.down.push_back(specgen::packed_weight(w_down[j * local + l], inter, hidden, "expert down"));
    }
    PD_CHECK(bias[j].numel() == 0 || (bias[j].dtype() == paddle::DataType::FLOAT32 && bias[j].numel() == num_experts),
             "specgen_bind_experts: a selection bias is float32 [num_experts]");
    m.bias = bias[j].numel() ? bias[j].data<float>() : nullptr;
    m.num_experts = num_experts;
    m.top_k = top_k;
    m.inter = inter;
    m.first_expert = first_expert;
    m.norm = norm;
    m.norm_min = norm_min;
    m.counts = e->counts.data() + j * num_experts;
    e->blocks[blocks[j]] = &m;
  }
  std::lock_guard<std::mutex> lock(bound_mutex);
  w->experts = std::move(e);
  return {handle.copy_to(handle.place(), false)};
}

// -> int64 [num_routed, num_experts]: the tokens each expert of each routed block took since the last call (then
// zeroed); [0, 0] for weights without experts.
std::vector<paddle::Tensor> TakeExpertCounts(const paddle::Tensor& handle) {
  auto w = bound_weights_of(handle, "specgen_take_expert_counts");
  if (!w->experts) return {paddle::empty({0, 0}, paddle::DataType::INT64, handle.place())};
  auto& e = *w->experts;
  const int64_t R = static_cast<int64_t>(e.routed.size()), E = e.routed[0].num_experts;
  auto out = paddle::empty({R, E}, paddle::DataType::INT64, handle.place());
  std::copy(e.counts.begin(), e.counts.end(), out.data<int64_t>());
  std::fill(e.counts.begin(), e.counts.end(), 0);
  return {out};
}

std::vector<paddle::Tensor> BindCaches(const Tensors& k_cache, const Tensors& v_cache, const Tensors& prefix_k,
                                       const Tensors& prefix_v) {
  PD_CHECK(!k_cache.empty() && k_cache.size() == v_cache.size(), "specgen_bind_caches: one K and V cache per block");
  auto c = std::make_shared<BoundCaches>(BoundCaches{k_cache, v_cache, prefix_k, prefix_v});
  std::lock_guard<std::mutex> lock(bound_mutex);
  const int64_t id = bound_next++;
  bound_caches[id] = std::move(c);
  return {handle_tensor(id, k_cache[0].place())};
}

// -> [1] int64: 1 where the handle was bound (and is now dropped), 0 where it was not.
std::vector<paddle::Tensor> Unbind(const paddle::Tensor& handle) {
  PD_CHECK(handle.dtype() == paddle::DataType::INT64 && handle.numel() == 1, "specgen_unbind: one int64 handle");
  const int64_t id = handle.data<int64_t>()[0];
  std::lock_guard<std::mutex> lock(bound_mutex);
  const int64_t dropped = static_cast<int64_t>(bound_weights.erase(id) + bound_caches.erase(id));
  return {handle_tensor(dropped, handle.place())};
}

// index int64 [4 n + m]: the n tokens' ids, positions, slots and prefix lengths, then the m logit rows (one
// tensor instead of five: each costs ~25 us to make on the Python side); with `tree` [6 n + m]: the tokens' tree
// positions and masks after the prefix lengths (StepInputs); lm_screen / lm_bound as specgen_forward's (empty: the
// logits); sample: specgen_sample's params [8, num_logit_rows] for rows sampled with the screen (temperature > 0,
// no filter), or empty: the greedy tokens.
std::vector<paddle::Tensor> ForwardBound(const paddle::Tensor& index, const paddle::Tensor& lm_screen,
                                         const paddle::Tensor& lm_bound, const paddle::Tensor& sample,
                                         int64_t num_tokens, int64_t weights,
                                         int64_t caches, int num_heads, int num_kv_heads, int64_t capacity,
                                         bool qk_norm, double eps, int64_t prefix_capacity, int64_t vocab, bool tree,
                                         const std::vector<int64_t>& capture) {
  check_cpu(index, "index");
  const int64_t n = num_tokens, parts = tree ? 6 : 4;
  PD_CHECK(index.dtype() == paddle::DataType::INT64 && index.shape().size() == 1 && n >= 0 &&
               index.numel() >= parts * n,
           "specgen_forward_bound: int64 index [4 (6 with trees) num_tokens + num_logit_rows]");
  auto part = [&](int64_t begin, int64_t end) {  // a view of index[begin, end) (Tensor::slice refuses empty ones)
    return begin < end ? index.slice(begin, end) : paddle::empty({0}, paddle::DataType::INT64, index.place());
  };
  const paddle::Tensor token_ids = part(0, n), positions = part(n, 2 * n), slots = part(2 * n, 3 * n),
                       prefix_len = part(3 * n, 4 * n), logit_rows = part(parts * n, index.numel());
  std::shared_ptr<BoundWeights> w;
  std::shared_ptr<BoundCaches> c;
  {
    std::lock_guard<std::mutex> lock(bound_mutex);
    auto wi = bound_weights.find(weights);
    auto ci = bound_caches.find(caches);
    PD_CHECK(wi != bound_weights.end(), "specgen_forward_bound: no weights bound under handle ", weights);
    PD_CHECK(ci != bound_caches.end(), "specgen_forward_bound: no caches bound under handle ", caches);
    w = wi->second;
    c = ci->second;
  }
  // The bound caches must be the ones this step was planned for (a cache that grew is bound again): every
  // token's rows inside them.
  const int64_t rows = c->k[0].shape()[0];
  PD_CHECK(capacity > 0 && rows % (num_kv_heads * capacity) == 0,
           "specgen_forward_bound: the bound caches do not have this capacity (stale binding)");
  const int64_t *pos = positions.data<int64_t>(), *slot = slots.data<int64_t>(), *pl = prefix_len.data<int64_t>();
  for (int64_t t = 0; t < n; ++t)
    PD_CHECK(slot[t] >= 0 && slot[t] < rows / (num_kv_heads * capacity) && pos[t] - pl[t] >= 0 &&
                 pos[t] - pl[t] < capacity,
             "specgen_forward_bound: token ", t, " falls outside the bound caches");
  return ForwardImpl(token_ids, w->embed, w->attn_norm, w->w_qkv, w->b_qkv, w->w_o, w->b_o, w->mlp_norm, w->w_gu,
                     w->b_gu, w->w_down, w->b_down, w->cos, w->sin, positions, slots, c->k, c->v, w->q_norm, w->k_norm,
                     prefix_len, c->prefix_k, c->prefix_v, w->final_norm, logit_rows, w->lm_head, lm_screen, lm_bound,
                     num_heads, num_kv_heads, capacity, qk_norm, eps, prefix_capacity, vocab,
                     w->experts ? &w->experts->blocks : nullptr,
                     tree && n ? index.data<int64_t>() + 4 * n : nullptr, &capture, &sample);
}

// A draft coupled to the token verification will sample (layers/sampling.py's coupled_drafts): the Gumbel-max draw
// from logit row x [v] at inv_t, each column's noise that of its token id (ids[j], or j) in `stream` (the noise the
// main model's sampler uses at that output position), among the columns whose scaled logit is within kDraftSpan of
// the argmax's (`top`); the lowest column on a tie. Where the drafter's distribution is near the main model's the
// two draws agree more often than its argmax is sampled (benchmarks/sampled_drafts.py). Drafts only: any rule is
// exact.
constexpr double kDraftSpan = 12.0;

template <typename T>
int64_t coupled_draft(const T* x, int64_t v, const int64_t* ids, double inv_t, uint64_t stream, int64_t top) {
  double a = static_cast<double>(x[top]) * inv_t;
#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__))
  __asm__("" : "+x"(a));  // (rounded before the subtraction, as the reference: no fused multiply-add)
#endif
  const double floor = a - kDraftSpan;
  // (a float pre-test a little below the floor: the exact test in double decides)
  const T pre = static_cast<T>(floor / inv_t) - static_cast<T>(1e-3) * (std::abs(static_cast<T>(floor / inv_t)) + 1);
  specgen::Pick p{-std::numeric_limits<double>::infinity(), -1};
  for (int64_t j = 0; j < v; ++j) {
    if (!(x[j] >= pre) || !(static_cast<double>(x[j]) * inv_t >= floor)) continue;
    specgen::take(p, specgen::gumbel_key(static_cast<double>(x[j]), inv_t, stream, ids ? ids[j] : j), j);
  }
  return p.id >= 0 ? p.id : top;
}


// An MTP head's whole pass for a step (see MtpProposer in specgen/engine/proposers/mtp.py, which runs the same
// functions one op at a time): for each catch-up token t, input [rms_norm(embed[token_ids[t]], enorm);
// rms_norm(hidden[rows[t]], hnorm)] @ eh_proj, the head's blocks (caches written), then at each sequence's last
// token the final norm, the LM head and the argmax: draft 0 (a sampled sequence of draft_sample, float64 [4, S]:
// 1 / temperature (0: greedy), its request key's high and low 32 bits, its first draft's output position, takes
// coupled_draft's column instead, at that position + d for draft d). Drafts 1 .. depth-1 apply the head again to
// its own output row and draft (mapped through draft_vocab when it is not empty), one position further on. Sequences
// whose drafts are not wanted (MTP's copies) are left out of last_rows: their tokens are only caught up. The
// embedding's type (float32 or float64) is the pass's: hidden, norms, tables and caches in it, float64 panels for
// float64 (eh_proj and the LM head included).
// -> drafts int64 [num_seqs, depth] (LM-head column indices mapped through draft_vocab), and the block's output
// rows of the catch-up tokens [num_tokens, hidden] (the next module's hidden input in multi-layer MTP).
std::vector<paddle::Tensor> MtpDraft(
    const paddle::Tensor& token_ids, const paddle::Tensor& hidden, const paddle::Tensor& rows,
    const paddle::Tensor& embed, const paddle::Tensor& enorm, const paddle::Tensor& hnorm,
    const paddle::Tensor& eh_proj, const Tensors& attn_norm, const Tensors& w_qkv, const Tensors& b_qkv,
    const Tensors& w_o, const Tensors& b_o, const Tensors& mlp_norm, const Tensors& w_gu, const Tensors& b_gu,
    const Tensors& w_down, const Tensors& b_down, const paddle::Tensor& cos, const paddle::Tensor& sin,
    const paddle::Tensor& positions, const paddle::Tensor& slots, Tensors& k_cache, Tensors& v_cache,
    const Tensors& q_norm, const Tensors& k_norm, const paddle::Tensor& prefix_len, const Tensors& prefix_k,
    const Tensors& prefix_v, const paddle::Tensor& last_rows, const paddle::Tensor& final_norm,
    const paddle::Tensor& lm_head, const paddle::Tensor& draft_vocab, const paddle::Tensor& draft_sample,
    int num_heads, int num_kv_heads, int64_t capacity, bool qk_norm, double eps, int64_t prefix_capacity, int depth,
    int64_t vocab) {
  check_cpu(hidden, "hidden");
  return with_activations(embed, "specgen_mtp_draft", [&](auto type) -> std::vector<paddle::Tensor> {
    using T = decltype(type);
    PD_CHECK(hidden.dtype() == embed.dtype(), "specgen_mtp_draft: hidden states of the embedding's type");
    const int64_t hid = hidden.shape()[1], n = token_ids.numel(), S = last_rows.numel();
    const int64_t num_hidden = hidden.shape()[0], V = embed.shape()[0];
    PD_CHECK(embed.shape().size() == 2 && embed.shape()[1] == hid && enorm.numel() == hid && hnorm.numel() == hid &&
                 final_norm.numel() == hid,
             "specgen_mtp_draft: embedding [vocab, hidden] and norms [hidden] must match the hidden states");
    PD_CHECK(rows.numel() == n && positions.numel() == n && slots.numel() == n && prefix_len.numel() == n,
             "specgen_mtp_draft: one row, position, slot and prefix length per token");
    PD_CHECK(depth >= 1, "specgen_mtp_draft: depth >= 1");
    for (const auto* t : {&token_ids, &rows, &last_rows, &draft_vocab})
      PD_CHECK(t->dtype() == paddle::DataType::INT64, "specgen_mtp_draft: token ids, rows and draft_vocab are int64");
    const StepInputs<T> a = step_inputs<T>(hidden, cos, sin, positions, slots, prefix_len, num_heads, num_kv_heads,
                                           capacity, qk_norm, eps, prefix_capacity);
    const Blocks b = collect_blocks(a, hid, attn_norm, w_qkv, b_qkv, w_o, b_o, mlp_norm, w_gu, b_gu, w_down, b_down,
                                    k_cache, v_cache, q_norm, k_norm, prefix_k, prefix_v);
    const specgen::PackedWeight eh = packed_for<T>(eh_proj, 2 * hid, hid, "eh_proj");
    const specgen::PackedWeight lm = packed_for<T>(lm_head, hid, vocab, "lm_head");
    const int64_t nv = draft_vocab.numel();
    PD_CHECK(nv == 0 || nv == vocab, "specgen_mtp_draft: draft_vocab needs one token id per LM-head column");
    const bool coupled = draft_sample.numel() > 0;
    PD_CHECK(!coupled || (draft_sample.is_cpu() && draft_sample.dtype() == paddle::DataType::FLOAT64 &&
                          draft_sample.numel() == 4 * S),
             "specgen_mtp_draft: draft_sample must be float64 [4, num_wanted] or empty");
    const double* ds = coupled ? draft_sample.data<double>() : nullptr;
    auto drafts = paddle::empty({S, depth}, paddle::DataType::INT64, hidden.place());
    auto out_rows = paddle::empty({n, hid}, hidden.dtype(), hidden.place());
    if (n == 0) return {drafts, out_rows};
    const int64_t *tok = token_ids.data<int64_t>(), *row = rows.data<int64_t>(), *last = last_rows.data<int64_t>();
    const int64_t *ids = nv ? draft_vocab.data<int64_t>() : nullptr, *pos = positions.data<int64_t>();
    const int64_t* slot = slots.data<int64_t>();
    const T *emb = embed.data<T>(), *hs = hidden.data<T>(), *fn = final_norm.data<T>();
    const T eps_t = static_cast<T>(eps);
    static thread_local std::vector<T> in, x, y, last_x, normed, logits;
    std::vector<int64_t> idx(S), chain_tok(S), chain_pos(S), chain_slot(S), chain_zero(S, 0);
    int64_t* out = drafts.data<int64_t>();
    for (int d = 0; d < depth; ++d) {
      // pass d: catch-up tokens (d == 0) or one token per sequence, fed its previous draft and output row
      const int64_t m = d == 0 ? n : S;
      const int64_t *t_tok = d == 0 ? tok : chain_tok.data(), *t_pos = d == 0 ? pos : chain_pos.data();
      const int64_t* t_slot = d == 0 ? slot : chain_slot.data();
      in.resize(m * 2 * hid);
      for (int64_t t = 0; t < m; ++t) {
        PD_CHECK(t_tok[t] >= 0 && t_tok[t] < V, "specgen_mtp_draft: token id out of range");
        const T* h_row = d == 0 ? hs + row[t] * hid : last_x.data() + t * hid;
        PD_CHECK(d > 0 || (row[t] >= 0 && row[t] < num_hidden), "specgen_mtp_draft: hidden row out of range");
        rms_norm_rows<T>(emb + t_tok[t] * hid, enorm.data<T>(), in.data() + t * 2 * hid, 1, hid, eps_t);
        rms_norm_rows<T>(h_row, hnorm.data<T>(), in.data() + t * 2 * hid + hid, 1, hid, eps_t);
      }
      x.resize(m * hid);
      y.resize(m * hid);
      specgen::packed_linear(in.data(), m, 2 * hid, eh, x.data(), hid);
      StepInputs<T> pass = a;  // the chained passes: their own positions and slots, no shared prefix
      if (d > 0) {
        pass.positions = chain_pos.data();
        pass.slots = chain_slot.data();
        pass.prefix_len = chain_zero.data();
      }
      run_blocks(x.data(), y.data(), m, hid, b, pass);
      if (d == 0) std::copy(y.data(), y.data() + n * hid, out_rows.data<T>());
      if (S == 0) break;  // the catch-up alone: no sequence wants drafts this step
      last_x.resize(S * hid);
      for (int64_t s = 0; s < S; ++s) {
        const int64_t r = d == 0 ? last[s] : s;
        PD_CHECK(r >= 0 && r < m, "specgen_mtp_draft: last row out of range");
        std::copy(y.data() + r * hid, y.data() + (r + 1) * hid, last_x.data() + s * hid);
      }
      normed.resize(S * hid);
      rms_norm_rows<T>(last_x.data(), fn, normed.data(), S, hid, eps_t);
      logits.resize(S * vocab);
      specgen::packed_linear(normed.data(), S, hid, lm, logits.data(), vocab);
      argmax_rows<T>(logits.data(), S, vocab, idx.data());
      // sampled sequences: drafts coupled to verification's draw (each row's scan its own: rows apart; the
      // thread_local logits by pointer, as inside the parallel loop its name is each thread's own)
      const T* lg = logits.data();
      int64_t* ix = idx.data();
#pragma omp parallel for schedule(static, 1) if (coupled && S > 1)
      for (int64_t s = 0; s < (coupled ? S : 0); ++s) {
        if (!(ds[s] > 0.0)) continue;
        const uint64_t key = (static_cast<uint64_t>(ds[S + s]) << 32) | static_cast<uint64_t>(ds[2 * S + s]);
        const uint64_t stream = specgen::noise_stream(key, static_cast<int64_t>(ds[3 * S + s]) + d);
        ix[s] = coupled_draft<T>(lg + s * vocab, vocab, ids, ds[s], stream, ix[s]);
      }
      for (int64_t s = 0; s < S; ++s) {
        const int64_t r = d == 0 ? last[s] : s;
        out[s * depth + d] = ids ? ids[idx[s]] : idx[s];
        chain_tok[s] = out[s * depth + d];
        chain_pos[s] = t_pos[r] + 1;
        chain_slot[s] = t_slot[r];
      }
    }
    return {drafts, out_rows};
  });
}

// An EAGLE layer's pass (see EaglePass in specgen/engine/proposers/eagle.py, the same functions one op at a
// time): for each token t, x = [embed[token_ids[t]]; hidden[rows[t]]] @ fc (+ fc_bias), the layer's block (an
// empty attn_norm: none), then its output feature (final_norm applied unless empty) for every token, and at each
// logit row the LM head, log-softmax and the top-k columns (largest first, the lower column on a tie).
// index int64 [7 n + m]: token ids, rows of `hidden`, cache rows, slots, prefix lengths (zeros), RoPE positions,
// tree masks (tree_tail), then the m logit rows.
// -> (features [n, hidden], top-k log-probabilities [m, topk], their LM-head columns int64 [m, topk])
std::vector<paddle::Tensor> EaglePass(
    const paddle::Tensor& index, const paddle::Tensor& hidden, const paddle::Tensor& embed, const paddle::Tensor& fc,
    const paddle::Tensor& fc_bias, const Tensors& attn_norm, const Tensors& w_qkv, const Tensors& b_qkv,
    const Tensors& w_o, const Tensors& b_o, const Tensors& mlp_norm, const Tensors& w_gu, const Tensors& b_gu,
    const Tensors& w_down, const Tensors& b_down, const paddle::Tensor& cos, const paddle::Tensor& sin,
    Tensors& k_cache, Tensors& v_cache, const Tensors& q_norm, const Tensors& k_norm, const Tensors& prefix_k,
    const Tensors& prefix_v, const paddle::Tensor& final_norm, const paddle::Tensor& lm_head, int64_t num_tokens,
    int num_heads, int num_kv_heads, int64_t capacity, bool qk_norm, double eps, int64_t vocab, int topk) {
  check_cpu(hidden, "hidden");
  check_cpu(index, "index");
  return with_activations(embed, "specgen_eagle_pass", [&](auto type) -> std::vector<paddle::Tensor> {
    using T = decltype(type);
    const int64_t n = num_tokens, hid = hidden.shape()[1], V = embed.shape()[0];
    PD_CHECK(index.dtype() == paddle::DataType::INT64 && index.numel() >= 7 * n && n >= 0,
             "specgen_eagle_pass: int64 index [7 num_tokens + num_logit_rows]");
    PD_CHECK(hidden.dtype() == embed.dtype() && embed.shape()[1] == hid,
             "specgen_eagle_pass: hidden states [rows, hidden] of the embedding's type and width");
    PD_CHECK(final_norm.numel() == 0 || final_norm.numel() == hid, "specgen_eagle_pass: final_norm [hidden] or empty");
    PD_CHECK(topk >= 1 && topk <= vocab, "specgen_eagle_pass: 1 <= topk <= vocab");
    const int64_t m = index.numel() - 7 * n;
    auto part = [&](int64_t begin, int64_t end) {
      return begin < end ? index.slice(begin, end) : paddle::empty({0}, paddle::DataType::INT64, index.place());
    };
    const paddle::Tensor positions = part(2 * n, 3 * n), slots = part(3 * n, 4 * n), prefix_len = part(4 * n, 5 * n);
    StepInputs<T> a = step_inputs<T>(hidden, cos, sin, positions, slots, prefix_len, num_heads, num_kv_heads,
                                     capacity, qk_norm, eps, 0);
    const int64_t* ix = index.data<int64_t>();
    a.rope_positions = ix + 5 * n;
    a.tree_mask = reinterpret_cast<const uint64_t*>(ix + 6 * n);
    const Blocks b = collect_blocks(a, hid, attn_norm, w_qkv, b_qkv, w_o, b_o, mlp_norm, w_gu, b_gu, w_down, b_down,
                                    k_cache, v_cache, q_norm, k_norm, prefix_k, prefix_v);
    const specgen::PackedWeight f = packed_for<T>(fc, 2 * hid, hid, "fc");
    const specgen::PackedWeight lm = packed_for<T>(lm_head, hid, vocab, "lm_head");
    PD_CHECK(fc_bias.numel() == 0 || (fc_bias.numel() == hid && fc_bias.dtype() == embed.dtype()),
             "specgen_eagle_pass: fc_bias [hidden] of the activations' type, or empty");
    auto feat = paddle::empty({n, hid}, hidden.dtype(), hidden.place());
    auto top_vals = paddle::empty({m, topk}, hidden.dtype(), hidden.place());
    auto top_cols = paddle::empty({m, topk}, paddle::DataType::INT64, hidden.place());
    if (n == 0) return {feat, top_vals, top_cols};
    const int64_t *tok = ix, *row = ix + n, *lr = ix + 7 * n;
    const int64_t num_hidden = hidden.shape()[0];
    const T *emb = embed.data<T>(), *hs = hidden.data<T>();
    static thread_local std::vector<T> in, x, y, sel, logits;
    in.resize(n * 2 * hid);
    for (int64_t t = 0; t < n; ++t) {
      PD_CHECK(tok[t] >= 0 && tok[t] < V, "specgen_eagle_pass: token id out of range");
      PD_CHECK(row[t] >= 0 && row[t] < num_hidden, "specgen_eagle_pass: hidden row out of range");
      std::copy(emb + tok[t] * hid, emb + (tok[t] + 1) * hid, in.data() + t * 2 * hid);
      std::copy(hs + row[t] * hid, hs + (row[t] + 1) * hid, in.data() + t * 2 * hid + hid);
    }
    x.resize(n * hid);
    y.resize(n * hid);
    specgen::packed_linear(in.data(), n, 2 * hid, f, x.data(), hid);
    add_bias(x.data(), fc_bias, n, hid);
    run_blocks(x.data(), y.data(), n, hid, b, a);
    T* out = feat.data<T>();
    if (final_norm.numel())
      rms_norm_rows<T>(y.data(), final_norm.data<T>(), out, n, hid, static_cast<T>(eps));
    else
      std::copy(y.data(), y.data() + n * hid, out);
    if (m == 0) return {feat, top_vals, top_cols};
    sel.resize(m * hid);
    for (int64_t r = 0; r < m; ++r) {
      PD_CHECK(lr[r] >= 0 && lr[r] < n, "specgen_eagle_pass: logit row out of range");
      std::copy(out + lr[r] * hid, out + (lr[r] + 1) * hid, sel.data() + r * hid);
    }
    logits.resize(m * vocab);
    specgen::packed_linear(sel.data(), m, hid, lm, logits.data(), vocab);
    T* tv = top_vals.data<T>();
    int64_t* tc = top_cols.data<int64_t>();
    std::vector<int64_t> order(vocab);
    for (int64_t r = 0; r < m; ++r) {
      const T* z = logits.data() + r * vocab;
      T mx = z[0];
      for (int64_t j = 1; j < vocab; ++j) mx = std::max(mx, z[j]);
      T sum = 0;
      for (int64_t j = 0; j < vocab; ++j) sum += std::exp(z[j] - mx);
      const T lse = mx + std::log(sum);
      for (int64_t j = 0; j < vocab; ++j) order[j] = j;
      std::partial_sort(order.begin(), order.begin() + topk, order.end(),
                        [z](int64_t i, int64_t j) { return z[i] > z[j] || (z[i] == z[j] && i < j); });
      for (int k = 0; k < topk; ++k) {
        tc[r * topk + k] = order[k];
        tv[r * topk + k] = z[order[k]] - lse;
      }
    }
    return {feat, top_vals, top_cols};
  });
}

PD_BUILD_OP(specgen_rms_norm).Inputs({"X", "W"}).Outputs({"Out"}).Attrs({"eps: double"}).SetKernelFn(PD_KERNEL(RmsNorm));

PD_BUILD_OP(specgen_add_rms_norm)
    .Inputs({"X", "Res", "W"})
    .Outputs({"Sum", "Out"})
    .Attrs({"eps: double"})
    .SetKernelFn(PD_KERNEL(AddRmsNorm));

PD_BUILD_OP(specgen_argmax).Inputs({"X"}).Outputs({"Out"}).SetKernelFn(PD_KERNEL(Argmax));

PD_BUILD_OP(specgen_silu_mul).Inputs({"GU"}).Outputs({"Out"}).SetKernelFn(PD_KERNEL(SiluMul));

PD_BUILD_OP(specgen_attention)
    .Inputs({"QKV", "Cos", "Sin", "Positions", "Slots", "KCache", "VCache", "QNorm", "KNorm", "PrefixLen", "PrefixK",
             "PrefixV"})
    .Outputs({"Out", "KCacheOut", "VCacheOut"})
    .SetInplaceMap({{"KCache", "KCacheOut"}, {"VCache", "VCacheOut"}})
    .Attrs({"num_heads: int", "num_kv_heads: int", "capacity: int64_t", "qk_norm: bool", "eps: double",
            "prefix_capacity: int64_t"})
    .SetKernelFn(PD_KERNEL(Attention));


PD_BUILD_OP(specgen_stack)
    .Inputs({"X", paddle::Vec("AttnNorm"), paddle::Vec("WQkv"), paddle::Vec("BQkv"), paddle::Vec("WO"),
             paddle::Vec("BO"), paddle::Vec("MlpNorm"), paddle::Vec("WGateUp"), paddle::Vec("BGateUp"),
             paddle::Vec("WDown"), paddle::Vec("BDown"), "Cos", "Sin", "Positions", "Slots", paddle::Vec("KCache"),
             paddle::Vec("VCache"), paddle::Vec("QNorm"), paddle::Vec("KNorm"), "PrefixLen", paddle::Vec("PrefixK"),
             paddle::Vec("PrefixV")})
    .Outputs({"Out", paddle::Vec("KCacheOut"), paddle::Vec("VCacheOut")})
    .SetInplaceMap({{paddle::Vec("KCache"), paddle::Vec("KCacheOut")}, {paddle::Vec("VCache"), paddle::Vec("VCacheOut")}})
    .Attrs({"num_heads: int", "num_kv_heads: int", "capacity: int64_t", "qk_norm: bool", "eps: double",
            "prefix_capacity: int64_t"})
    .SetKernelFn(PD_KERNEL(Stack));

PD_BUILD_OP(specgen_mtp_draft)
    .Inputs({"TokenIds", "Hidden", "Rows", "Embed", "ENorm", "HNorm", "EhProj", paddle::Vec("AttnNorm"),
             paddle::Vec("WQkv"), paddle::Vec("BQkv"), paddle::Vec("WO"), paddle::Vec("BO"), paddle::Vec("MlpNorm"),
             paddle::Vec("WGateUp"), paddle::Vec("BGateUp"), paddle::Vec("WDown"), paddle::Vec("BDown"), "Cos", "Sin",
             "Positions", "Slots", paddle::Vec("KCache"), paddle::Vec("VCache"), paddle::Vec("QNorm"),
             paddle::Vec("KNorm"), "PrefixLen", paddle::Vec("PrefixK"), paddle::Vec("PrefixV"), "LastRows",
             "FinalNorm", "LmHead", "DraftVocab", "DraftSample"})
    .Outputs({"Drafts", "BlockOut", paddle::Vec("KCacheOut"), paddle::Vec("VCacheOut")})
    .SetInplaceMap({{paddle::Vec("KCache"), paddle::Vec("KCacheOut")}, {paddle::Vec("VCache"), paddle::Vec("VCacheOut")}})
    .Attrs({"num_heads: int", "num_kv_heads: int", "capacity: int64_t", "qk_norm: bool", "eps: double",
            "prefix_capacity: int64_t", "depth: int", "vocab: int64_t"})
    .SetKernelFn(PD_KERNEL(MtpDraft));

PD_BUILD_OP(specgen_eagle_pass)
    .Inputs({"Index", "Hidden", "Embed", "Fc", "FcBias", paddle::Vec("AttnNorm"), paddle::Vec("WQkv"),
             paddle::Vec("BQkv"), paddle::Vec("WO"), paddle::Vec("BO"), paddle::Vec("MlpNorm"), paddle::Vec("WGateUp"),
             paddle::Vec("BGateUp"), paddle::Vec("WDown"), paddle::Vec("BDown"), "Cos", "Sin", paddle::Vec("KCache"),
             paddle::Vec("VCache"), paddle::Vec("QNorm"), paddle::Vec("KNorm"), paddle::Vec("PrefixK"),
             paddle::Vec("PrefixV"), "FinalNorm", "LmHead"})
    .Outputs({"Feat", "TopVals", "TopCols", paddle::Vec("KCacheOut"), paddle::Vec("VCacheOut")})
    .SetInplaceMap({{paddle::Vec("KCache"), paddle::Vec("KCacheOut")}, {paddle::Vec("VCache"), paddle::Vec("VCacheOut")}})
    .Attrs({"num_tokens: int64_t", "num_heads: int", "num_kv_heads: int", "capacity: int64_t", "qk_norm: bool",
            "eps: double", "vocab: int64_t", "topk: int"})
    .SetKernelFn(PD_KERNEL(EaglePass));

PD_BUILD_OP(specgen_forward)
    .Inputs({"TokenIds", "Embed", paddle::Vec("AttnNorm"), paddle::Vec("WQkv"), paddle::Vec("BQkv"), paddle::Vec("WO"),
             paddle::Vec("BO"), paddle::Vec("MlpNorm"), paddle::Vec("WGateUp"), paddle::Vec("BGateUp"),
             paddle::Vec("WDown"), paddle::Vec("BDown"), "Cos", "Sin", "Positions", "Slots", paddle::Vec("KCache"),
             paddle::Vec("VCache"), paddle::Vec("QNorm"), paddle::Vec("KNorm"), "PrefixLen", paddle::Vec("PrefixK"),
             paddle::Vec("PrefixV"), "FinalNorm", "LogitRows", "LmHead", "LmScreen", "LmBound"})
    .Outputs({"Logits", "Hidden", "Greedy", paddle::Vec("KCacheOut"), paddle::Vec("VCacheOut")})
    .SetInplaceMap({{paddle::Vec("KCache"), paddle::Vec("KCacheOut")}, {paddle::Vec("VCache"), paddle::Vec("VCacheOut")}})
    .Attrs({"num_heads: int", "num_kv_heads: int", "capacity: int64_t", "qk_norm: bool", "eps: double",
            "prefix_capacity: int64_t", "vocab: int64_t"})
    .SetKernelFn(PD_KERNEL(Forward));

PD_BUILD_OP(specgen_bind_weights)
    .Inputs({"Embed", paddle::Vec("AttnNorm"), paddle::Vec("WQkv"), paddle::Vec("BQkv"), paddle::Vec("WO"),
             paddle::Vec("BO"), paddle::Vec("MlpNorm"), paddle::Vec("WGateUp"), paddle::Vec("BGateUp"),
             paddle::Vec("WDown"), paddle::Vec("BDown"), "Cos", "Sin", paddle::Vec("QNorm"), paddle::Vec("KNorm"),
             "FinalNorm", "LmHead"})
    .Outputs({"Handle"})
    .SetKernelFn(PD_KERNEL(BindWeights));

PD_BUILD_OP(specgen_bind_caches)
    .Inputs({paddle::Vec("KCache"), paddle::Vec("VCache"), paddle::Vec("PrefixK"), paddle::Vec("PrefixV")})
    .Outputs({"Handle"})
    .SetKernelFn(PD_KERNEL(BindCaches));

PD_BUILD_OP(specgen_bind_experts)
    .Inputs({"Handle", paddle::Vec("Routers"), paddle::Vec("Bias"), paddle::Vec("WGateUp"), paddle::Vec("WDown")})
    .Outputs({"Out"})
    .Attrs({"blocks: std::vector<int64_t>", "hidden: int64_t", "inter: int64_t", "num_experts: int64_t",
            "top_k: int64_t", "first_expert: int64_t", "norm: bool", "norm_min: double"})
    .SetKernelFn(PD_KERNEL(BindExperts));

PD_BUILD_OP(specgen_take_expert_counts)
    .Inputs({"Handle"})
    .Outputs({"Counts"})
    .SetKernelFn(PD_KERNEL(TakeExpertCounts));

PD_BUILD_OP(specgen_unbind).Inputs({"Handle"}).Outputs({"Dropped"}).SetKernelFn(PD_KERNEL(Unbind));

PD_BUILD_OP(specgen_forward_bound)
    .Inputs({"Index", "LmScreen", "LmBound", "Sample"})
    .Outputs({"Logits", "Hidden", "Greedy", "Features"})
    .Attrs({"num_tokens: int64_t", "weights: int64_t", "caches: int64_t", "num_heads: int", "num_kv_heads: int",
            "capacity: int64_t", "qk_norm: bool", "eps: double", "prefix_capacity: int64_t", "vocab: int64_t",
            "tree: bool", "capture: std::vector<int64_t>"})
    .SetKernelFn(PD_KERNEL(ForwardBound));
