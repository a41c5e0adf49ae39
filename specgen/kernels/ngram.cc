// n-gram drafting on the host: a slot's own-text match, the job pool's lookup and the proposer's choice between
// them, as plain C functions called through ctypes on numpy buffers (no Paddle tensors: drafting reads the
// engine's numpy token table in place). The references are specgen/engine/proposers/ngram.py (ngram_match,
// NgramProposer.propose_reference) and ngram_pool.py (NgramPool.lookup_reference); tests/unit/test_ngram.py and
// test_ngram_native.py compare them on hand-worked and random cases. Each function takes its arguments as structs
// that specgen/kernels/host.py builds. Callers guarantee the shapes: slots index rows of the table,
// seq_lens[s] <= row_stride, k and n_max <= 64 (NATIVE_MAX).
#include <cstdint>

extern "C" {

// The argument structs (specgen/kernels/host.py mirrors each as a ctypes.Structure, field for field).

// Rows `slots` of the engine's token table [*, row_stride], valid up to seq_lens[s].
struct SlotText {
  const int64_t* tokens;
  int64_t row_stride;
  const int64_t* slots;     // [num_seqs]
  const int64_t* seq_lens;  // [num_seqs]
  int64_t num_seqs;
};

// Up to k drafts after the most recent occurrence of the longest tail of n_min..n_max tokens.
struct NgramRule {
  int64_t k, n_min, n_max;
};

// The job's pool (ngram_pool.py): ring [capacity], keys / ends [n_max + 1, 2^table_bits], `written` tokens so far.
struct PoolView {
  const int64_t* ring;
  int64_t capacity;
  const uint64_t* keys;
  const int64_t* ends;
  int64_t table_bits, written;
};

// Which source's draft a slot takes: rate[source][n] = (hits + prior_hits) / (seen + prior_seen) ([2, n_max + 1]
// each, source 0 its own text, 1 the pool); the pool's only where its rate beats the own one's and reaches
// min_rate.
struct SourceRates {
  const double* hits;
  const double* seen;
  double min_rate, prior_hits, prior_seen;
};

// Outputs: draft [num_seqs, k] (0 past num_draft), num_draft [num_seqs], match_len [num_seqs] (0 where no draft).
struct Drafts {
  int64_t* draft;
  int64_t* num_draft;
  int64_t* match_len;
};

}  // extern "C"

namespace {

constexpr uint64_t kMult = 0x9E3779B97F4A7C15ull;  // ngram_pool._MULT
constexpr int64_t kSep = -1;                       // ngram_pool._SEP

// ngram_pool.ngram_hashes for one window of n tokens (wrapping uint64 arithmetic, as numpy's).
inline uint64_t hash_window(const int64_t* w, int n) {
  uint64_t h = 0;
  for (int j = 0; j < n; ++j) h = (h + static_cast<uint64_t>(w[j]) + 1ull) * kMult;
  return h;
}

// specgen_ngram_match for one slot's text row[0 .. len): writes draft[0 .. k), returns num_draft; *match_len is
// the match's length (0 where no draft).
inline int64_t match_one(const int64_t* row, int64_t len, int64_t k, int64_t n_min, int64_t n_max, int64_t* draft,
                         int64_t* match_len) {
  int64_t best_len = 0, best_end = 0;  // match length (capped at n_max) and the index just past the occurrence
  if (len >= 2) {
    const int64_t last = row[len - 1];
    // j: the occurrence's last token; a token must follow it inside the text (j <= len - 2)
    for (int64_t j = len - 2; j >= 0 && best_len < n_max; --j) {
      if (row[j] != last) continue;
      int64_t m = 1;  // tokens matched backwards from j and from len - 1
      const int64_t cap = j + 1 < n_max ? j + 1 : n_max;
      while (m < cap && row[j - m] == row[len - 1 - m]) ++m;
      if (m > best_len) best_len = m, best_end = j + 1;
    }
  }
  int64_t nd = 0;
  if (best_len >= n_min) {
    const int64_t avail = len - best_end;
    nd = avail < k ? avail : k;
  }
  for (int64_t i = 0; i < k; ++i) draft[i] = i < nd ? row[best_end + i] : 0;
  *match_len = nd > 0 ? best_len : 0;
  return nd;
}

// NgramPool.lookup for one slot: tail[0 .. n_max) right-aligned, the slot's text holding tail_len tokens.
inline int64_t pool_one(const PoolView& pool, const int64_t* tail, int64_t tail_len, int64_t k, int64_t n_min,
                        int64_t n_max, int64_t* draft, int64_t* match_len) {
  const int64_t size = int64_t{1} << pool.table_bits;
  const int64_t oldest = pool.written - pool.capacity;
  int64_t end = -1, n_hit = 0;
  for (int64_t n = n_max; n >= n_min && n_hit == 0; --n) {
    if (tail_len < n) continue;
    const uint64_t h = hash_window(tail + (n_max - n), static_cast<int>(n));
    const int64_t slot = static_cast<int64_t>((h * kMult) >> (64 - pool.table_bits));
    const int64_t e = pool.ends[n * size + slot];
    if (pool.keys[n * size + slot] == h && e >= 0 && e - n >= oldest) end = e, n_hit = n;
  }
  int64_t nd = 0;
  if (n_hit > 0) {
    while (nd < k && end + nd < pool.written) {
      const int64_t tok = pool.ring[(end + nd) % pool.capacity];
      if (tok == kSep) break;
      draft[nd++] = tok;
    }
  }
  for (int64_t i = nd; i < k; ++i) draft[i] = 0;
  *match_len = nd > 0 ? n_hit : 0;
  return nd;
}

}  // namespace

extern "C" {

// For each slot of `text`: the most recent occurrence of the longest tail n-gram that ends before the last token;
// the draft is the up-to-k tokens after it.
void specgen_ngram_match(const SlotText* text, const NgramRule* rule, const Drafts* out) {
  for (int64_t s = 0; s < text->num_seqs; ++s)
    out->num_draft[s] = match_one(text->tokens + text->slots[s] * text->row_stride, text->seq_lens[s], rule->k,
                                  rule->n_min, rule->n_max, out->draft + s * rule->k, out->match_len + s);
}

// NgramPool.lookup: tails [num_seqs, n_max] (each slot's last tokens, right-aligned), tail_lens [num_seqs].
void specgen_ngram_pool_lookup(const int64_t* tails, const int64_t* tail_lens, int64_t num_seqs,
                               const NgramRule* rule, const PoolView* pool, const Drafts* out) {
  for (int64_t s = 0; s < num_seqs; ++s)
    out->num_draft[s] = pool_one(*pool, tails + s * rule->n_max, tail_lens[s], rule->k, rule->n_min, rule->n_max,
                                 out->draft + s * rule->k, out->match_len + s);
}

// NgramProposer.propose with a pool (its numpy path is the reference): per slot the own-text match and the pool's
// lookup of the slot's last n_max tokens, the draft chosen by `rates`, capped at max_draft[s]. out
// [num_seqs, k + 5]: k draft ids, num_draft, then own first draft, own match length, pool first draft, pool match
// length (for the proposer's scoring after the step).
void specgen_ngram_propose(const SlotText* text, const int64_t* max_draft, const NgramRule* rule,
                           const PoolView* pool, const SourceRates* rates, int64_t* out) {
  const int64_t k = rule->k, n_min = rule->n_min, n_max = rule->n_max, width = k + 5;
  int64_t own_draft[64], pool_draft[64], tail[64];  // k, n_max <= 64 (NATIVE_MAX in host.py)
  for (int64_t s = 0; s < text->num_seqs; ++s) {
    const int64_t* row = text->tokens + text->slots[s] * text->row_stride;
    const int64_t len = text->seq_lens[s];
    int64_t own_len = 0, pool_len = 0;
    int64_t own_nd = match_one(row, len, k, n_min, n_max, own_draft, &own_len);
    for (int64_t j = 0; j < n_max; ++j) {  // right-aligned, index 0 where the text is shorter (never looked up)
      const int64_t c = len - n_max + j;
      tail[j] = row[c > 0 ? c : 0];
    }
    int64_t pool_nd = pool_one(*pool, tail, len, k, n_min, n_max, pool_draft, &pool_len);
    auto rate = [&](int64_t cell) {
      return (rates->hits[cell] + rates->prior_hits) / (rates->seen[cell] + rates->prior_seen);
    };
    const double own_rate = own_len > 0 ? rate(own_len) : 0.0;
    const double pool_rate = pool_len > 0 ? rate((n_max + 1) + pool_len) : 0.0;
    const bool take = pool_rate > own_rate && pool_rate >= rates->min_rate;
    const int64_t* d = take ? pool_draft : own_draft;
    int64_t nd = take ? pool_nd : own_nd;
    int64_t* o = out + s * width;
    for (int64_t i = 0; i < k; ++i) o[i] = d[i];
    o[k] = nd < max_draft[s] ? nd : max_draft[s];
    o[k + 1] = own_draft[0];
    o[k + 2] = own_len;
    o[k + 3] = pool_draft[0];
    o[k + 4] = pool_len;
  }
}

}  // extern "C"
