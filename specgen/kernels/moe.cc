// The routed experts of a mixture-of-experts block (specgen/layers/moe.py is the reference): router, top-k
// gating, tokens grouped by expert, one product per expert over its own tokens, and each token's weighted sum of
// its experts' outputs. Every step depends only on the row itself: the router's product and the experts' products
// are packed_linear's (a row's bits never depend on the other rows), the softmax and the top-k run per row, and a
// row's sum goes over its experts in rank order. So a token's output is the same whatever else is in the batch,
// which keeps speculative decoding exact on MoE models.
#include <algorithm>
#include <cmath>
#include <vector>

#include "specgen_kernels.h"

namespace specgen {

namespace {

// One row's routing: probs = softmax(logits [E]); the top_k experts by probs + bias (the highest first, the lowest
// id on a tie); their probs as weights, divided by max(their sum, norm_min) when norm.
template <typename T>
void route_row(const T* logits, const float* bias, const ExpertBlock& m, std::vector<T>& probs, int64_t* ids,
               T* weights) {
  const int64_t E = m.num_experts, K = m.top_k;
  T mx = logits[0];
  for (int64_t e = 1; e < E; ++e) mx = std::max(mx, logits[e]);
  T sum = 0;
  for (int64_t e = 0; e < E; ++e) sum += probs[e] = std::exp(logits[e] - mx);
  for (int64_t e = 0; e < E; ++e) probs[e] /= sum;
  T total = 0;
  for (int64_t j = 0; j < K; ++j) {
    int64_t best = -1;
    T best_score = 0;
    for (int64_t e = 0; e < E; ++e) {
      if (std::find(ids, ids + j, e) != ids + j) continue;
      const T score = bias ? probs[e] + static_cast<T>(bias[e]) : probs[e];
      if (best < 0 || score > best_score) best = e, best_score = score;
    }
    ids[j] = best;
    total += weights[j] = probs[best];
  }
  if (m.norm) {
    const T d = std::max(total, static_cast<T>(m.norm_min));
    for (int64_t j = 0; j < K; ++j) weights[j] /= d;
  }
}

}  // namespace

template <typename T>
void moe_mlp(const T* h, T* out, int64_t n, int64_t hid, const ExpertBlock& m) {
  const int64_t E = m.num_experts, K = m.top_k, I = m.inter, P = n * K;
  static thread_local std::vector<T> logits, weights, y, xs, gu, act, ys, probs;
  static thread_local std::vector<int64_t> ids, order, start;
  logits.resize(n * E);
  weights.resize(P);
  ids.resize(P);
  probs.resize(E);
  packed_linear(h, n, hid, m.router, logits.data(), E);
  for (int64_t r = 0; r < n; ++r)
    route_row<T>(logits.data() + r * E, m.bias, m, probs, ids.data() + r * K, weights.data() + r * K);
  // (token, rank) pairs grouped by expert, in token order within each (a counting sort)
  start.assign(E + 1, 0);
  for (int64_t p = 0; p < P; ++p) ++start[ids[p] + 1];
  for (int64_t e = 0; e < E; ++e) start[e + 1] += start[e];
  order.resize(P);
  {
    std::vector<int64_t> next(start.begin(), start.end() - 1);
    for (int64_t p = 0; p < P; ++p) order[next[ids[p]]++] = p;
  }
  if (m.counts)
    for (int64_t e = 0; e < E; ++e) m.counts[e] += start[e + 1] - start[e];
  y.assign(P * hid, T(0));  // one output row per pair; pairs routed to experts held elsewhere stay zero
  for (int64_t l = 0; l < static_cast<int64_t>(m.gate_up.size()); ++l) {
    const int64_t e = m.first_expert + l, b = start[e], ne = start[e + 1] - b;
    if (ne == 0) continue;
    xs.resize(ne * hid);
    gu.resize(ne * 2 * I);
    act.resize(ne * I);
    ys.resize(ne * hid);
    for (int64_t i = 0; i < ne; ++i) std::copy(h + order[b + i] / K * hid, h + (order[b + i] / K + 1) * hid,
                                               xs.data() + i * hid);
    packed_linear(xs.data(), ne, hid, m.gate_up[l], gu.data(), 2 * I);
    for (int64_t r = 0; r < ne; ++r) {
      const T* g = gu.data() + r * 2 * I;
      for (int64_t i = 0; i < I; ++i) act[r * I + i] = g[i] / (T(1) + std::exp(-g[i])) * g[I + i];
    }
    packed_linear(act.data(), ne, I, m.down[l], ys.data(), hid);
    for (int64_t i = 0; i < ne; ++i) std::copy(ys.data() + i * hid, ys.data() + (i + 1) * hid,
                                               y.data() + order[b + i] * hid);
  }
  for (int64_t r = 0; r < n; ++r) {
    T* o = out + r * hid;
    const T* w = weights.data() + r * K;
    for (int64_t i = 0; i < hid; ++i) o[i] = w[0] * y[(r * K) * hid + i];
    for (int64_t j = 1; j < K; ++j)
      for (int64_t i = 0; i < hid; ++i) o[i] += w[j] * y[(r * K + j) * hid + i];
  }
}

template void moe_mlp<float>(const float*, float*, int64_t, int64_t, const ExpertBlock&);
template void moe_mlp<double>(const double*, double*, int64_t, int64_t, const ExpertBlock&);

}  // namespace specgen
