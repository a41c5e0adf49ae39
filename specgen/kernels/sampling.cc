// The sampling operator: each logit row's token, in one pass over the vocabulary where the row's filters allow.
// And the log-probabilities operator (specgen_logprobs, below): each row's log-softmax at a token and its top K.
// Its reference is specgen/layers/sampling.py's `sample` (Paddle's operators and numpy), which computes the same
// rule:
//   greedy rows (temperature 0) keep the argmax the forward computed (the lowest id on a tie);
//   sampled rows weigh each token by exp((x - max) / temperature), keep the top_k largest logits (ties kept),
//   then the smallest set of most likely tokens whose mass before the last reaches top_p (ties at the threshold
//   kept), then the tokens whose weight is at least min_p of the most likely one's; of the kept tokens the row
//   takes the one whose key x_j (1 / temperature) + g_j is largest (the lowest id on a tie), g_j the Gumbel
//   variable of token j in the row's counter-based stream (the Gumbel-max draw).
// Each weight is exp in single precision of (x - max) / temperature taken in double (a polynomial exp the compiler
// vectorizes), the filters' sums in double, so the kept set is a function of the row alone: the same in a verify
// block as in plain decoding, at any batch size. The reference computes the weights in double: the kept sets agree
// but where a weight lies within about 1e-7 of a filter's threshold.
// A row with no filter needs no weight at all. Its keys need not all be computed either: g_j <= -log(1 - u_j),
// bounded from the leading zeros of the integer behind 1 - u_j, so one vectorized pass bounds every key from the
// hash alone, and only tokens whose bound reaches the best key so far get theirs exactly (a handful a row).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#ifdef __AVX512F__
#include <immintrin.h>
#endif

#include "paddle/extension.h"
#include "specgen_kernels.h"

#ifdef _OPENMP
#include <omp.h>
#endif

namespace {

constexpr int64_t kBlock = 64;  // tokens per block of the weights' sums (top_p's total) and of a row's parts
// params [kParams, rows]: temperature, top_k, top_p, min_p, the request key's high and low 32 bits, the output
// position, the greedy token (kernels/args.py's sample_rows)
constexpr int kParams = 8;

using specgen::gumbel_key;
using specgen::Pick;
using specgen::take;

// The best (largest key, lowest id on a tie) of the tokens of [lo, hi) that `kept` keeps (nullptr: all),
// against p from before: each token's key bounded (specgen::key_bounds), the exact key computed where the bound
// reaches the best so far.
template <typename T>
Pick gumbel_max(const T* x, const float* kept, int64_t lo, int64_t hi, double inv_t, uint64_t stream, Pick p) {
  specgen::key_bounds(x, kept, lo, hi, inv_t, stream, [&p]() { return p.key; },
                      [&](int64_t j) { take(p, gumbel_key(static_cast<double>(x[j]), inv_t, stream, j), j); });
  return p;
}

// exp(x) for x <= 0 in single precision (x below -87 is taken as -87: its exp, ~2e-38, next to the largest
// weight's 1), within about 2 ulp: x = k ln2 + r, |r| <= ln2 / 2, exp(r) by its Taylor series to degree 7, scaled by
// 2^k through the exponent bits; k is rounded by adding and taking away 1.5 * 2^23 (its low bits then hold k).
// Inline, with no branch and no call, so a loop over a row vectorizes 16 lanes wide.
inline float exp_nonpositive(float x) {
  constexpr float kShift = 12582912.0f;  // 1.5 * 2^23
  x = x < -87.0f ? -87.0f : x;
  const float shifted = x * 1.44269504f + kShift;
  int32_t k_bits;
  std::memcpy(&k_bits, &shifted, sizeof k_bits);
  const float k = shifted - kShift;
  const float r = (x - k * 0.693359375f) + k * 2.12194440e-4f;  // ln2 in two parts: r exact to float rounding
  float p = 1.0f / 5040.0f;
  p = p * r + 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const int32_t scale_bits = ((k_bits - 0x4B400000) + 127) << 23;  // k + 127 (>= 1 for x >= -87) in the exponent
  float scale;
  std::memcpy(&scale, &scale_bits, sizeof scale);
  return p * scale;
}

// The k-th largest of x[0, v) (k in [1, v]): a min-heap of the k largest so far for small k (one comparison per
// value once the heap holds k: most values are below its least), a selection over a copy otherwise.
template <typename T>
T kth_largest(const T* x, int64_t v, int64_t k, std::vector<T>& scratch) {
  auto greater = [](T a, T b) { return a > b; };
  if (k > 4096) {
    scratch.assign(x, x + v);
    std::nth_element(scratch.begin(), scratch.begin() + (k - 1), scratch.end(), greater);
    return scratch[k - 1];
  }
  scratch.assign(x, x + k);
  std::make_heap(scratch.begin(), scratch.end(), greater);  // the least on top
  for (int64_t i = k; i < v; ++i) {
    if (x[i] > scratch.front()) {
      std::pop_heap(scratch.begin(), scratch.end(), greater);
      scratch.back() = x[i];
      std::push_heap(scratch.begin(), scratch.end(), greater);
    }
  }
  return scratch.front();
}

// Appends to cand the weights of w[lo, hi) that top_p may keep: those of at least floor = (1 - top_p) * total / v
// (the mass above any smaller one exceeds top_p * total), above 0. With lo a multiple of 16, ranges one after
// another pack what one range from 0 packs, in the same order.
void top_p_candidates(const float* w, int64_t lo, int64_t hi, double floor, std::vector<float>& cand) {
  int64_t n = static_cast<int64_t>(cand.size()), i = lo;
  cand.resize(n + (hi - lo) + 16);  // without a branch per token: the candidates packed to the front
#ifdef __AVX512F__
  const __m512 lowest = _mm512_set1_ps(std::max(static_cast<float>(floor), std::numeric_limits<float>::min()));
  for (; i + 16 <= hi; i += 16) {  // (a weight of at least the smallest normal float is above 0)
    const __m512 x = _mm512_loadu_ps(w + i);
    const __mmask16 keep = _mm512_cmp_ps_mask(x, lowest, _CMP_GE_OQ);
    // compressed in a register and stored whole (a compressing store to memory is slow on some CPUs)
    _mm512_storeu_ps(cand.data() + n, _mm512_maskz_compress_ps(keep, x));
    n += __builtin_popcount(keep);
  }
#endif
  for (; i < hi; ++i) {
    cand[n] = w[i];
    n += w[i] > 0.0f && w[i] >= floor;
  }
  cand.resize(n);
}

// The smallest weight kept by top_p, from the candidates (top_p_candidates) of weights whose total is `total`:
// walking the weights from the largest down, the last one whose mass before it is below top_p * total (ties at
// it all kept). A selection by mass finds it in linear time: split around a pivot into larger, equal and smaller
// weights; the answer lies in the larger part if their mass (with what lies above the range) reaches the bound,
// at the pivot if the equal ones reach it, else in the smaller part.
double top_p_select(std::vector<float>& cand, double total, double top_p) {
  const double bound = top_p * total;
  double above = 0.0;  // the mass of the candidates larger than every one in [lo, hi)
  auto lo = cand.begin(), hi = cand.end();
  while (lo < hi) {
    std::nth_element(lo, lo + (hi - lo) / 2, hi, [](float a, float b) { return a > b; });
    const float pivot = *(lo + (hi - lo) / 2);
    auto eq = std::partition(lo, hi, [pivot](float c) { return c > pivot; });
    auto lt = std::partition(eq, hi, [pivot](float c) { return c == pivot; });
    double larger = 0.0;
    for (auto it = lo; it < eq; ++it) larger += *it;
    if (above + larger >= bound) {  // the first equal one is not kept: the answer is a larger weight
      hi = eq;
      continue;
    }
    const double through = above + larger + static_cast<double>(lt - eq) * static_cast<double>(pivot);
    if (through >= bound || lt == hi) return pivot;  // no smaller weight is kept
    above = through;
    lo = lt;
  }
  return cand.empty() ? 0.0 : *std::min_element(cand.begin(), cand.end());
}

// Blocks [b0, b1)'s sums of w [v] (blocks of kBlock tokens, each summed in token order from 0, into blocks[b]),
// eight blocks at a time so that their additions overlap.
void block_sums(const float* w, int64_t v, int64_t b0, int64_t b1, double* blocks) {
  const int64_t full = std::min(b1, v / kBlock);
  int64_t b = b0;
  for (; b + 8 <= full; b += 8) {
    double s[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    for (int64_t t = 0; t < kBlock; ++t) {
      for (int lane = 0; lane < 8; ++lane) s[lane] += w[(b + lane) * kBlock + t];
    }
    for (int lane = 0; lane < 8; ++lane) blocks[b + lane] = s[lane];
  }
  for (; b < b1; ++b) {
    double s = 0.0;
    for (int64_t i = b * kBlock, end = std::min(v, (b + 1) * kBlock); i < end; ++i) s += w[i];
    blocks[b] = s;
  }
}

// Blocks [b0, b1) of w [v] with the weights below thr set to 0. (thr > 0 in double, compared in float as the least
// float at or above it: the same test for every float weight.)
void mask_blocks(float* w, int64_t v, int64_t b0, int64_t b1, double thr) {
  float f = static_cast<float>(thr);
  if (static_cast<double>(f) < thr) f = std::nextafter(f, std::numeric_limits<float>::infinity());
  for (int64_t i = b0 * kBlock, end = std::min(v, b1 * kBlock); i < end; ++i) w[i] = w[i] >= f ? w[i] : 0.0f;
}

// The largest of x[0, v): x[0], or a later value above every one before it, as a scan from x[0] takes it (a NaN
// is never above, so a NaN x[0] is the result and a NaN elsewhere is skipped). In 16 lanes, each scanning from
// x[0], then the lanes' largest (with the scan, each maximum waiting on the one before, a 49,152-token row took
// the operator 1.5-2x as long: BENCHMARKS.md, "Sampling"). The same value as the scan; where +0 and -0 tie,
// either may be taken, and x - max is the same for both. With AVX-512 float rows take the lanes' step as
// vmaxps(x, lanes), which is x > lanes ? x : lanes to the bit (NaN and signed zeros included): the compiler
// left the plain loop's 16 lanes scalar (12 against 4 us a row here).
template <typename T>
T row_max(const T* x, int64_t lo, int64_t hi, T first) {
  T lanes[16];
  int64_t i = lo;
#ifdef __AVX512F__
  if constexpr (std::is_same_v<T, float>) {
    __m512 acc = _mm512_set1_ps(first);
    for (; i + 16 <= hi; i += 16) acc = _mm512_max_ps(_mm512_loadu_ps(x + i), acc);
    _mm512_storeu_ps(lanes, acc);
  } else
#endif
  {
    for (int l = 0; l < 16; ++l) lanes[l] = first;
    for (; i + 16 <= hi; i += 16) {
      for (int l = 0; l < 16; ++l) lanes[l] = x[i + l] > lanes[l] ? x[i + l] : lanes[l];
    }
  }
  T m = first;
  for (int l = 0; l < 16; ++l) m = lanes[l] > m ? lanes[l] : m;
  for (; i < hi; ++i) m = x[i] > m ? x[i] : m;
  return m;
}

template <typename T>
T row_max(const T* x, int64_t v) {
  return row_max(x, 0, v, x[0]);
}

constexpr int kMaxParts = 64;        // threads one row's passes are split over, at most
constexpr int64_t kSplitMin = 8192;  // tokens in a row below which its passes are not split

// f(p, b0, b1) over `parts` consecutive ranges [b0, b1) of the nb blocks, part p on its own thread (parts > 1),
// or f(0, 0, nb).
template <typename F>
void over_parts(int parts, int64_t nb, F f) {
  if (parts <= 1) {
    f(0, int64_t(0), nb);
    return;
  }
#pragma omp parallel for num_threads(parts) schedule(static, 1)
  for (int p = 0; p < parts; ++p) f(p, nb * p / parts, nb * (p + 1) / parts);
}

// The first index of x[0, v) holding m (-1: none, as for a NaN m).
template <typename T>
int64_t first_equal(const T* x, int64_t v, T m) {
  int64_t i = 0;
#ifdef __AVX512F__
  if constexpr (std::is_same_v<T, float>) {
    const __m512 target = _mm512_set1_ps(m);
    for (; i + 16 <= v; i += 16) {
      const __mmask16 eq = _mm512_cmp_ps_mask(_mm512_loadu_ps(x + i), target, _CMP_EQ_OQ);
      if (eq) return i + __builtin_ctz(eq);
    }
  }
#endif
  for (; i < v; ++i) {
    if (x[i] == m) return i;
  }
  return -1;
}

constexpr int64_t kExactKept = 2048;  // kept tokens up to which a filtered row's keys are all computed exactly

// The ids of w[0, v)'s weights above 0 (a NaN weight is not kept), ascending, appended to ids.
void kept_ids(const float* w, int64_t v, std::vector<int32_t>& ids) {
  int64_t n = static_cast<int64_t>(ids.size()), i = 0;
  ids.resize(n + v + 16);
#ifdef __AVX512F__
  const __m512i step = _mm512_set1_epi32(16);
  __m512i at = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  for (; i + 16 <= v; i += 16) {
    const __mmask16 keep = _mm512_cmp_ps_mask(_mm512_loadu_ps(w + i), _mm512_setzero_ps(), _CMP_GT_OQ);
    _mm512_storeu_si512(ids.data() + n, _mm512_maskz_compress_epi32(keep, at));
    n += __builtin_popcount(keep);
    at = _mm512_add_epi32(at, step);
  }
#endif
  for (; i < v; ++i) {
    ids[n] = static_cast<int32_t>(i);
    n += w[i] > 0.0f;
  }
  ids.resize(n);
}

// One row's token. With parts > 1 its passes over the vocabulary (the maximum, the weights and their block sums,
// top_p's candidates, the filters' mask, the keys' bounds) run split over that many threads, block ranges apart;
// every value is computed as in one pass (a part's maximum scans from x[0] as the whole row's does, the parts'
// maxima, candidates and best keys are taken in order), so the token is the same. The selection among top_p's
// candidates stays on the calling thread. cand: [parts] buffers. A filtered row whose weights are not all finite
// (a NaN or infinite logit) keeps its greedy token, as the reference, whose filtered softmax keeps nothing then.
template <typename T>
int64_t sample_row(const T* x, int64_t v, const double* prm, uint64_t stream, int64_t greedy, std::vector<float>& w,
                   std::vector<double>& blocks, std::vector<T>& scratch, std::vector<float>* cand,
                   std::vector<int32_t>& ids, int parts = 1) {
  const double temperature = prm[0], top_p = prm[2], min_p = prm[3];
  const int64_t top_k = static_cast<int64_t>(prm[1]);
  const int64_t nb = (v + kBlock - 1) / kBlock;
  auto tokens = [v](int64_t b) { return std::min(v, b * kBlock); };  // the first token of block b
  T part_max[kMaxParts];
  over_parts(parts, nb, [&](int p, int64_t b0, int64_t b1) { part_max[p] = row_max(x, tokens(b0), tokens(b1), x[0]); });
  T m = x[0];
  for (int p = 0; p < parts; ++p) m = part_max[p] > m ? part_max[p] : m;
  // top_k: logits below the k-th largest weigh nothing
  const bool by_k = top_k > 0 && top_k < v;
  const bool filtered = by_k || top_p < 1.0 || min_p > 0.0;
  const double inv_t = 1.0 / temperature;
  const float* kept = nullptr;  // the filters' weights, 0 where a token is not kept (nullptr: every token kept)
  if (filtered) {
    const T kth = by_k ? kth_largest(x, v, top_k, scratch) : m;
    // (x - max) / temperature in double, its exp in single precision: weights in (0, 1], summed in double
    const double mx = static_cast<double>(m);
    w.resize(v);
    blocks.resize(nb);
    float* wp = w.data();
    double* bs = blocks.data();
    over_parts(parts, nb, [&](int, int64_t b0, int64_t b1) {
      const int64_t lo = tokens(b0), hi = tokens(b1);
      if (by_k) {
        for (int64_t i = lo; i < hi; ++i) {
          const float e = exp_nonpositive(static_cast<float>((static_cast<double>(x[i]) - mx) * inv_t));
          wp[i] = x[i] >= kth ? e : 0.0f;
        }
      } else {
        for (int64_t i = lo; i < hi; ++i) {
          wp[i] = exp_nonpositive(static_cast<float>((static_cast<double>(x[i]) - mx) * inv_t));
        }
      }
      block_sums(wp, v, b0, b1, bs);
    });
    double total = 0.0;
    for (int64_t b = 0; b < nb; ++b) total += bs[b];
    if (!std::isfinite(total)) return greedy;
    // the filters' thresholds on weights (the most likely token weighs 1)
    double thr = 0.0;
    if (top_p < 1.0) {
      const double floor = (1.0 - top_p) * total / static_cast<double>(v);
      over_parts(parts, nb, [&](int p, int64_t b0, int64_t b1) {
        cand[p].clear();
        top_p_candidates(wp, tokens(b0), tokens(b1), floor, cand[p]);
      });
      for (int p = 1; p < parts; ++p) cand[0].insert(cand[0].end(), cand[p].begin(), cand[p].end());
      thr = top_p_select(cand[0], total, top_p);
    }
    thr = std::max(thr, min_p);
    if (thr > 0.0) over_parts(parts, nb, [&](int, int64_t b0, int64_t b1) { mask_blocks(wp, v, b0, b1, thr); });
    kept = wp;
  }
  // the Gumbel-max draw. A filtered row keeps few tokens as a rule: their exact keys, in id order.
  if (filtered) {
    ids.clear();
    kept_ids(w.data(), v, ids);
    if (static_cast<int64_t>(ids.size()) <= kExactKept) {
      Pick best{-std::numeric_limits<double>::infinity(), -1};
      for (int32_t j : ids) take(best, gumbel_key(static_cast<double>(x[j]), inv_t, stream, j), j);
      return best.id >= 0 && best.key > -std::numeric_limits<double>::infinity() ? best.id : greedy;
    }
  }
  // Otherwise from the most likely token's key (every filter keeps it), the others bounded
  const int64_t top = first_equal(x, v, m);
  const Pick first = top >= 0 ? Pick{gumbel_key(static_cast<double>(x[top]), inv_t, stream, top), top}
                              : Pick{-std::numeric_limits<double>::infinity(), -1};
  Pick part_pick[kMaxParts];
  over_parts(parts, nb, [&](int p, int64_t b0, int64_t b1) {
    part_pick[p] = gumbel_max(x, kept, tokens(b0), tokens(b1), inv_t, stream, first);
  });
  Pick best = first;
  for (int p = 0; p < parts; ++p) {
    if (part_pick[p].id >= 0) take(best, part_pick[p].key, part_pick[p].id);
  }
  return best.id >= 0 && best.key > -std::numeric_limits<double>::infinity() ? best.id : greedy;
}

// A thread's buffers for the rows it samples, kept between rows and calls: a row's (196 KB for 49,152 tokens)
// freshly mapped pages cost about as much to fault in as the sampling itself. (Reached through this function
// by the thread that samples the row, so that each thread's are constructed; a split row's parts write into
// its thread's.)
template <typename T>
struct RowBuffers {
  std::vector<float> w, cand[kMaxParts];  // cand: top_p's candidates, per part of a row
  std::vector<int32_t> ids;  // a filtered row's kept tokens
  std::vector<double> blocks;
  std::vector<T> scratch;
};

template <typename T>
RowBuffers<T>& row_buffers() {
  static thread_local RowBuffers<T> buffers;
  return buffers;
}

template <typename T>
void sample_rows(const T* x, int64_t n, int64_t v, const double* prm, int64_t* tok) {
  auto row = [&](int64_t r, int parts) {
    auto at = [&](int c) { return prm[c * n + r]; };
    if (!(at(0) > 0.0)) {
      tok[r] = static_cast<int64_t>(at(7));  // greedy (NaN included, as the reference): the forward's argmax
      return;
    }
    const uint64_t key = (static_cast<uint64_t>(at(4)) << 32) | static_cast<uint64_t>(at(5));
    // sample_row's settings: temperature, top_k, top_p, min_p
    const double p[4] = {at(0), at(1), at(2), at(3)};
    RowBuffers<T>& b = row_buffers<T>();
    tok[r] = sample_row<T>(x + r * v, v, p, specgen::noise_stream(key, static_cast<int64_t>(at(6))),
                           static_cast<int64_t>(at(7)), b.w, b.blocks, b.scratch, b.cand, b.ids, parts);
  };
#ifdef _OPENMP
  const int threads = std::min(omp_get_max_threads(), kMaxParts);
#else
  const int threads = 1;
#endif
  if (n == 1 && threads > 1 && v >= kSplitMin) {  // one row (a batch-1 step): its passes split over the threads
    row(0, threads);
    return;
  }
  // rows round robin over the threads (a dynamic schedule ran the rows on one thread inside Paddle's process)
#pragma omp parallel for schedule(static, 1) if (n > 1)
  for (int64_t r = 0; r < n; ++r) row(r, 1);
}

std::vector<paddle::Tensor> Sample(const paddle::Tensor& logits, const paddle::Tensor& params) {
  PD_CHECK(logits.is_cpu() && params.is_cpu(), "specgen_sample: CPU tensors only");
  PD_CHECK(logits.shape().size() == 2, "specgen_sample: logits must be [rows, vocab]");
  const int64_t n = logits.shape()[0], v = logits.shape()[1];
  PD_CHECK(params.dtype() == paddle::DataType::FLOAT64 && params.shape().size() == 2 &&
               params.shape()[0] == kParams && params.shape()[1] == n,
           "specgen_sample: params must be float64 [8, rows]");
  PD_CHECK(v > 0 && v < (int64_t(1) << 31), "specgen_sample: vocabulary size out of range");
  auto out = paddle::empty({n}, paddle::DataType::INT64, logits.place());
  const double* prm = params.data<double>();
  int64_t* tok = out.data<int64_t>();
  PD_DISPATCH_FLOATING_TYPES(logits.type(), "specgen_sample", ([&] {
    sample_rows<data_t>(logits.data<data_t>(), n, v, prm, tok);
  }));
  return {out};
}

// exp(x) for x <= 0 in double precision (x below -708 is taken as -708), within about 1 ulp: x = k ln2 + r,
// |r| <= ln2 / 2, exp(r) by its Taylor series to degree 13 (the next term is below 2e-17 of it), scaled by 2^k
// through the exponent bits; branch-free, so a loop over a row vectorizes.
inline double exp_nonpositive_d(double x) {
  constexpr double kShift = 6755399441055744.0;  // 1.5 * 2^52
  x = x < -708.0 ? -708.0 : x;
  const double shifted = x * 1.4426950408889634 + kShift;
  int64_t k_bits;
  std::memcpy(&k_bits, &shifted, sizeof k_bits);
  const double k = shifted - kShift;
  const double r = (x - k * 0.6931471803691238) - k * 1.9082149292705877e-10;  // ln2 in two parts
  double p = 1.0 / 6227020800.0;
  p = p * r + 1.0 / 479001600.0;
  p = p * r + 1.0 / 39916800.0;
  p = p * r + 1.0 / 3628800.0;
  p = p * r + 1.0 / 362880.0;
  p = p * r + 1.0 / 40320.0;
  p = p * r + 1.0 / 5040.0;
  p = p * r + 1.0 / 720.0;
  p = p * r + 1.0 / 120.0;
  p = p * r + 1.0 / 24.0;
  p = p * r + 1.0 / 6.0;
  p = p * r + 0.5;
  p = p * r + 1.0;
  p = p * r + 1.0;
  const int64_t scale_bits = ((k_bits - 0x4338000000000000LL) + 1023) << 52;  // k + 1023 in the exponent
  double scale;
  std::memcpy(&scale, &scale_bits, sizeof scale);
  return p * scale;
}

struct Scored {
  double value;
  int64_t id;
};

// a before b in the top list: more likely, or as likely with a lower id
inline bool before(const Scored& a, const Scored& b) {
  return a.value > b.value || (a.value == b.value && a.id < b.id);
}

constexpr int64_t kMaxBlock = 64;  // tokens per block of the row's block maxima (logprob_row)

// One row's log-softmax at `token` and its `top` most likely tokens (most likely first, the lower id first on a
// tie), in double: the maximum of every block of 64 tokens (the row's max is theirs), then the sum of
// exp(x - max) in token order, 8 partial sums; the top by a heap of the best so far, whose worst is on top (a
// token equal to it comes later in id order, so it never enters), skipping the blocks whose maximum cannot
// enter a full heap.
template <typename T>
double logprob_row(const T* x, int64_t v, int64_t token, int64_t top, int64_t* top_ids, double* top_lp,
                   std::vector<Scored>& heap, std::vector<T>& maxima) {
  const int64_t num_blocks = (v + kMaxBlock - 1) / kMaxBlock;
  maxima.resize(num_blocks);
  for (int64_t b = 0; b < num_blocks; ++b) {
    maxima[b] = row_max<T>(x + b * kMaxBlock, std::min(kMaxBlock, v - b * kMaxBlock));
  }
  T largest = maxima[0];
  for (int64_t b = 1; b < num_blocks; ++b) largest = maxima[b] > largest ? maxima[b] : largest;
  const double m = static_cast<double>(largest);
  double part[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 8 <= v; i += 8) {
    for (int lane = 0; lane < 8; ++lane) part[lane] += exp_nonpositive_d(static_cast<double>(x[i + lane]) - m);
  }
  for (; i < v; ++i) part[0] += exp_nonpositive_d(static_cast<double>(x[i]) - m);
  const double sum = ((part[0] + part[1]) + (part[2] + part[3])) + ((part[4] + part[5]) + (part[6] + part[7]));
  const double lse = m + std::log(sum);
  if (top > 0) {
    heap.clear();
    for (int64_t b = 0; b < num_blocks; ++b) {
      // (a full heap takes only values above its worst, which only rises)
      if (static_cast<int64_t>(heap.size()) == top && !(static_cast<double>(maxima[b]) > heap.front().value)) {
        continue;
      }
      for (int64_t j = b * kMaxBlock; j < std::min(v, (b + 1) * kMaxBlock); ++j) {
        const Scored s{static_cast<double>(x[j]), j};
        if (static_cast<int64_t>(heap.size()) < top) {
          heap.push_back(s);
          std::push_heap(heap.begin(), heap.end(), before);
        } else if (s.value > heap.front().value) {
          std::pop_heap(heap.begin(), heap.end(), before);
          heap.back() = s;
          std::push_heap(heap.begin(), heap.end(), before);
        }
      }
    }
    std::sort(heap.begin(), heap.end(), before);
    for (int64_t k = 0; k < top; ++k) {
      top_ids[k] = heap[k].id;
      top_lp[k] = heap[k].value - lse;
    }
  }
  return static_cast<double>(x[token]) - lse;
}

template <typename T>
void logprob_rows(const T* x, int64_t n, int64_t v, const int64_t* tok, int64_t top, double* out, int64_t* id,
                  double* tl) {
  // rows round robin over the threads; each row on one thread, so its sums do not depend on the batch
#pragma omp parallel for schedule(static, 1) if (n > 1)
  for (int64_t r = 0; r < n; ++r) {
    static thread_local std::vector<Scored> heap;
    static thread_local std::vector<T> maxima;
    out[r] = logprob_row<T>(x + r * v, v, tok[r], top, id + r * top, tl + r * top, heap, maxima);
  }
}

std::vector<paddle::Tensor> Logprobs(const paddle::Tensor& logits, const paddle::Tensor& tokens, int64_t top) {
  PD_CHECK(logits.is_cpu() && tokens.is_cpu(), "specgen_logprobs: CPU tensors only");
  PD_CHECK(logits.shape().size() == 2, "specgen_logprobs: logits must be [rows, vocab]");
  const int64_t n = logits.shape()[0], v = logits.shape()[1];
  PD_CHECK(tokens.dtype() == paddle::DataType::INT64 && tokens.shape().size() == 1 && tokens.shape()[0] == n,
           "specgen_logprobs: tokens must be int64 [rows]");
  PD_CHECK(top >= 0 && top <= v, "specgen_logprobs: top out of range");
  auto lp = paddle::empty({n}, paddle::DataType::FLOAT64, logits.place());
  auto ids = paddle::empty({n, top}, paddle::DataType::INT64, logits.place());
  auto tlp = paddle::empty({n, top}, paddle::DataType::FLOAT64, logits.place());
  const int64_t* tok = tokens.data<int64_t>();
  for (int64_t r = 0; r < n; ++r) PD_CHECK(tok[r] >= 0 && tok[r] < v, "specgen_logprobs: token out of range");
  double* out = lp.data<double>();
  int64_t* id = ids.data<int64_t>();
  double* tl = tlp.data<double>();
  PD_DISPATCH_FLOATING_TYPES(logits.type(), "specgen_logprobs", ([&] {
    logprob_rows<data_t>(logits.data<data_t>(), n, v, tok, top, out, id, tl);
  }));
  return {lp, ids, tlp};
}

}  // namespace

PD_BUILD_OP(specgen_logprobs)
    .Inputs({"Logits", "Tokens"})
    .Outputs({"Logprob", "TopIds", "TopLogprobs"})
    .Attrs({"top: int64_t"})
    .SetKernelFn(PD_KERNEL(Logprobs));

PD_BUILD_OP(specgen_sample).Inputs({"Logits", "Params"}).Outputs({"Out"}).SetKernelFn(PD_KERNEL(Sample));
