// CPU kernels for the logits front end, called from jitted JAX code through the
// XLA FFI (specjax/kernels/cpu_kernels.py builds and registers them).
//
// On XLA:CPU every vocabulary-wide operation of the JAX front end is a separate
// thunk handed to the intra-op pool: a B = 1 step ran about 30 of them (max, the
// row copy the reduction library needs, exp pass, sum, the draw's passes), each
// costing tens of µs on a small machine (docs/benchmarks.md). These kernels do
// the same work in one call:
//
//   specjax_verify     the acceptance step from logits, per batch row: position
//                      by position, the row statistics of the target and draft
//                      rows, p(x_i) and q(x_i) and the test, stopping at the
//                      first failure; then the residual draw of max(p - q, 0)
//                      (p alone for the bonus token, or when the residual is all
//                      zero) by inverse CDF over 128-wide blocks, with the
//                      rounding fallbacks of specjax.kernels.rejection.inverse_cdf;
//   specjax_row_stats  per row: max, first index of the max, and the normaliser
//                      sum_j [s_j >= cut] exp(s_j), s_j = (x_j - max) c;
//   specjax_probs      per row: the processed probabilities of every id (the
//                      draft's draw and specjax.sample_from_logits);
//   specjax_draw_probs the residual draw from rows of probabilities (the
//                      probability kernel, specjax.rejection_sample).
//
// The max and its index are exact (the same as jnp.max / the first argmax), and
// so is s_j (a subtraction, then a multiplication, each rounded as in XLA), so
// the kept tokens are the JAX path's. Normalisers and probabilities use the exp
// below, so they can differ from XLA's in the last bits; every single-device CPU
// path uses these same kernels and the same expression for a probability, so the
// draft's draw and the acceptance test see the same q, bit for bit.
//
// Built with -fno-math-errno -fno-trapping-math (which change no IEEE result) so
// that the loops vectorise, and -ffp-contract=off (the FMAs are explicit); never
// with -ffast-math (-inf logits must stay -inf).

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <memory>
#include <mutex>
#include <utility>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kBlock = 128;  // the draw's block length (rejection._CDF_BLOCK)

// exp(x) for x <= 0 (the callers subtract the row's max; x = -inf gives 0):
// Cody-Waite range reduction by ln 2 and a degree-7 polynomial (Cephes expf),
// about 1 ulp; results below the smallest normal float flush to 0.
inline float exp_nonpositive(float x) {
  const float lo = -87.33654f;  // log(FLT_MIN)
  const float xc = x > lo ? x : lo;
  const float t = xc * 1.44269504088896341f;
  const int32_t k = -static_cast<int32_t>(0.5f - t);  // round(t) for t <= 0
  const float kf = static_cast<float>(k);
  // Explicit FMAs (the build has -ffp-contract=off): the scalar and the
  // vectorised copies of this function give the same bits.
  float r = __builtin_fmaf(kf, -0.693359375f, xc);
  r = __builtin_fmaf(kf, 2.12194440e-4f, r);
  float p = 1.9875691500e-4f;
  p = __builtin_fmaf(p, r, 1.3981999507e-3f);
  p = __builtin_fmaf(p, r, 8.3334519073e-3f);
  p = __builtin_fmaf(p, r, 4.1665795894e-2f);
  p = __builtin_fmaf(p, r, 1.6666665459e-1f);
  p = __builtin_fmaf(p, r, 5.0000001201e-1f);
  p = __builtin_fmaf(p * r, r, r) + 1.0f;
  const float out = __builtin_bit_cast(float, __builtin_bit_cast(int32_t, p) + k * (1 << 23));
  return x >= lo ? out : 0.0f;
}

struct RowSummary {
  float max;
  int32_t argmax;
};

RowSummary summarise_max(const float* __restrict x, int64_t v) {
  float m = -INFINITY;
#pragma omp simd reduction(max : m)
  for (int64_t j = 0; j < v; ++j) m = x[j] > m ? x[j] : m;
  // First index of the max: find the first 256-wide chunk holding it with a
  // vectorised test, then scan that chunk. (A NaN row has no such chunk: V - 1.)
  constexpr int64_t kChunk = 256;
  for (int64_t lo = 0; lo < v; lo += kChunk) {
    const int64_t hi = std::min(lo + kChunk, v);
    int hit = 0;
#pragma omp simd reduction(| : hit)
    for (int64_t j = lo; j < hi; ++j) hit |= x[j] == m;
    if (hit) {
      for (int64_t j = lo; j < hi; ++j) {
        if (x[j] == m) return {m, static_cast<int32_t>(j)};
      }
    }
  }
  return {m, static_cast<int32_t>(v - 1)};
}

// Sum of the n <= kBlock entries of w, in 16 lane-wise partial sums. (The hot
// loops write their terms to a small buffer, then sum it: loops of this shape
// vectorise reliably, where a reduction fused into a long loop body may not.)
inline float sum_block(const float* w, int64_t n) {
  constexpr int kLanes = 16;
  float lanes[kLanes] = {};
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes) {
    for (int l = 0; l < kLanes; ++l) lanes[l] += w[j + l];
  }
  float s = 0.0f;
  for (; j < n; ++j) s += w[j];
  for (int l = 0; l < kLanes; ++l) s += lanes[l];
  return s;
}

// sum_j [s_j >= cut] exp(s_j) with s_j = (x_j - x_max) c, in 16 lane-wise partial sums.
float normaliser(const float* __restrict x, int64_t v, float c, float x_max, float cut) {
  constexpr int kLanes = 16;
  float lanes[kLanes] = {};
  int64_t j = 0;
  for (; j + kLanes <= v; j += kLanes) {
    for (int l = 0; l < kLanes; ++l) {
      const float s = (x[j + l] - x_max) * c;
      lanes[l] += s >= cut ? exp_nonpositive(s) : 0.0f;
    }
  }
  float total = 0.0f;
  for (; j < v; ++j) {
    const float s = (x[j] - x_max) * c;
    total += s >= cut ? exp_nonpositive(s) : 0.0f;
  }
  for (int l = 0; l < kLanes; ++l) total += lanes[l];
  return total;
}

// A processed row: scale c (0 for greedy rows), raw max, normaliser z, cutoff.
struct RowParams {
  float c, x_max, z, cut;
};

// The probability of a logit x in a processed (non-greedy) row: every kernel
// computes a probability with this one expression, so the draft's draw
// (ProbsImpl) and the acceptance test (VerifyRow) see the same bits.
inline float processed_prob(float x, float x_max, float c, float z, float cut) {
  const float s = (x - x_max) * c;
  return s >= cut ? exp_nonpositive(s) / z : 0.0f;
}

// Sum over one block of max(p_j - q_j, 0), resp. of p_j. The parameters are
// copied to locals and the pointers marked __restrict so that the loops vectorise.
float residual_block_sum(const float* __restrict xt, RowParams pt, const float* __restrict xd, RowParams pd,
                         int64_t n) {
  float terms[kBlock];
  const float ct = pt.c, mt = pt.x_max, zt = pt.z, kt = pt.cut;
  const float cd = pd.c, md = pd.x_max, zd = pd.z, kd = pd.cut;
  for (int64_t j = 0; j < n; ++j) {
    const float w = processed_prob(xt[j], mt, ct, zt, kt) - processed_prob(xd[j], md, cd, zd, kd);
    terms[j] = w < 0.0f ? 0.0f : w;  // NaN kept: the sum is NaN, the row draws from p
  }
  return sum_block(terms, n);
}

float prob_block_sum(const float* __restrict xt, RowParams pt, int64_t n) {
  float terms[kBlock];
  const float ct = pt.c, mt = pt.x_max, zt = pt.z, kt = pt.cut;
  for (int64_t j = 0; j < n; ++j) terms[j] = processed_prob(xt[j], mt, ct, zt, kt);
  return sum_block(terms, n);
}

// The residual weight of entry j (the scalar path of the two sums above).
inline float residual_weight(float xt, const RowParams& pt, const float* xd, const RowParams& pd, bool use_q) {
  const float p = processed_prob(xt, pt.x_max, pt.c, pt.z, pt.cut);
  const float q = use_q ? processed_prob(*xd, pd.x_max, pd.c, pd.z, pd.cut) : 0.0f;
  const float w = p - q;
  return w < 0.0f ? 0.0f : w;
}

// Runs body(i) for every i in [0, n), on the calling thread and, when the work
// is large enough to pay for the hand-offs, on helpers from the XLA:CPU
// intra-op pool. Rows are handed out one at a time from a shared counter, so
// the calling thread never waits for a helper that has not started (on a busy
// machine it may simply do every row itself); it waits only for rows already
// running elsewhere. Each row runs on one thread: results do not depend on the
// split.
struct RowQueue {
  explicit RowQueue(int64_t n) : n(n) {}
  const int64_t n;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
  std::mutex mu;
  std::condition_variable all_done;

  template <typename Body>
  void work(const Body* body) {
    for (int64_t i = next.fetch_add(1); i < n; i = next.fetch_add(1)) {
      (*body)(i);
      if (done.fetch_add(1) + 1 == n) {
        std::lock_guard<std::mutex> lock(mu);
        all_done.notify_all();
      }
    }
  }
};

template <typename Body>
void parallel_rows(ffi::ThreadPool& pool, int64_t n, int64_t work_per_row, const Body& body) {
  const int64_t min_work = int64_t{1} << 20;  // per thread: about 21 rows of 49152, ~0.5 ms
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), n - 1);
  if (helpers <= 0 || n * work_per_row < 2 * min_work) {
    for (int64_t i = 0; i < n; ++i) body(i);
    return;
  }
  // A helper may start after every row is done: it then finds the counter
  // exhausted and never calls ``body`` (whose captures live on this stack), so
  // only the queue itself must outlive this call.
  auto queue = std::make_shared<RowQueue>(n);
  for (int64_t h = 0; h < helpers; ++h) {
    pool.Schedule([queue, b = &body] { queue->work(b); });
  }
  queue->work(&body);
  std::unique_lock<std::mutex> lock(queue->mu);
  queue->all_done.wait(lock, [&] { return queue->done.load() == n; });
}

// A target row and a draft row given as logits and their statistics.
struct LogitPair {
  const float* xt;
  RowParams pt;
  const float* xd;
  RowParams pd;
  float block_sum(int64_t lo, int64_t n, bool use_q) const {
    return use_q ? residual_block_sum(xt + lo, pt, xd + lo, pd, n) : prob_block_sum(xt + lo, pt, n);
  }
  float weight(int64_t j, bool use_q) const { return residual_weight(xt[j], pt, use_q ? xd + j : nullptr, pd, use_q); }
};

// A target row and a draft row given as probabilities (the probability kernel).
struct ProbPair {
  const float* p;
  const float* q;
  float block_sum(int64_t lo, int64_t n, bool use_q) const {
    float terms[kBlock];
    const float* __restrict pp = p + lo;
    if (use_q) {
      const float* __restrict qq = q + lo;
      for (int64_t j = 0; j < n; ++j) {
        const float w = pp[j] - qq[j];
        terms[j] = w < 0.0f ? 0.0f : w;  // NaN kept: the sum is NaN, the row draws from p
      }
      return sum_block(terms, n);
    }
    return sum_block(pp, n);
  }
  float weight(int64_t j, bool use_q) const {
    const float w = p[j] - (use_q ? q[j] : 0.0f);
    return w < 0.0f ? 0.0f : w;
  }
};

// Inverse CDF of the residual max(p - q, 0) of one row pair (p alone when there
// is no q or the residual is all zero), as specjax.kernels.rejection.inverse_cdf:
// 128-wide block sums, the first block whose running sum exceeds s * total, the
// first entry inside it whose running sum does; when rounding leaves none, the
// block's (or the last positive block's) last positive entry.
template <typename Pair>
int32_t draw_pair(const Pair& pair, bool has_q, float s, int64_t v, float* sums) {
  const int64_t nb = (v + kBlock - 1) / kBlock;
  bool use_q = has_q;
  for (;;) {
    float total = 0.0f;
    for (int64_t b = 0; b < nb; ++b) {
      const int64_t lo = b * kBlock;
      sums[b] = pair.block_sum(lo, std::min(kBlock, v - lo), use_q);
      total += sums[b];
    }
    if (!(total > 0.0f) && use_q) {  // the residual is all zero: draw from p
      use_q = false;
      continue;
    }
    const float threshold = s * total;
    float cum = 0.0f;
    int64_t last_positive_block = -1;
    for (int64_t b = 0; b < nb; ++b) {
      if (sums[b] > 0.0f) last_positive_block = b;
      if (!(cum + sums[b] > threshold)) {
        cum += sums[b];
        continue;
      }
      const int64_t lo = b * kBlock, hi = std::min(lo + kBlock, v);
      int64_t last_in_block = -1;
      for (int64_t j = lo; j < hi; ++j) {
        const float w = pair.weight(j, use_q);
        if (w > 0.0f) last_in_block = j;
        cum += w;
        if (cum > threshold && w > 0.0f) return static_cast<int32_t>(j);
      }
      if (last_in_block >= 0) return static_cast<int32_t>(last_in_block);
      break;
    }
    if (last_positive_block >= 0) {
      const int64_t lo = last_positive_block * kBlock, hi = std::min(lo + kBlock, v);
      for (int64_t j = hi - 1; j >= lo; --j) {
        if (pair.weight(j, use_q) > 0.0f) return static_cast<int32_t>(j);
      }
    }
    return static_cast<int32_t>(v - 1);  // unreachable for a row with positive weight
  }
}

ffi::Error RowStatsImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> logits, ffi::Buffer<ffi::F32> inv_t,
                        ffi::Buffer<ffi::F32> cut, ffi::ResultBuffer<ffi::F32> row_max,
                        ffi::ResultBuffer<ffi::F32> norm, ffi::ResultBuffer<ffi::S32> argmax) {
  const auto dims = logits.dimensions();
  if (dims.size() != 2) return ffi::Error::InvalidArgument("specjax_row_stats: logits must be [N, V]");
  const int64_t n = dims[0], v = dims[1];
  if (inv_t.element_count() != n || cut.element_count() != n) {
    return ffi::Error::InvalidArgument("specjax_row_stats: inv_t and cut must have N entries");
  }
  const float* x = logits.typed_data();
  const float* c = inv_t.typed_data();
  const float* k = cut.typed_data();
  float* out_max = row_max->typed_data();
  float* out_norm = norm->typed_data();
  int32_t* out_arg = argmax->typed_data();
  parallel_rows(pool, n, v, [&](int64_t r) {
    const float* row = x + r * v;
    const RowSummary s = summarise_max(row, v);
    out_max[r] = s.max;
    out_arg[r] = s.argmax;
    // c = 0 marks a greedy row: its distribution is one-hot, no normaliser needed.
    out_norm[r] = c[r] == 0.0f ? 1.0f : normaliser(row, v, c[r], s.max, k[r]);
  });
  return ffi::Error::Success();
}

// Processed probabilities of whole rows (frontend.probs_from_stats over every
// id): params [N, 4] = (c, max, normaliser, cutoff) per row, c = 0 marking a
// greedy row (one-hot at its argmax).
ffi::Error ProbsImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> logits, ffi::Buffer<ffi::F32> params,
                     ffi::Buffer<ffi::S32> argmax, ffi::ResultBuffer<ffi::F32> probs) {
  const auto dims = logits.dimensions();
  const auto pd = params.dimensions();
  if (dims.size() != 2 || pd.size() != 2 || pd[0] != dims[0] || pd[1] != 4 || argmax.element_count() != dims[0]) {
    return ffi::Error::InvalidArgument("specjax_probs: expected logits [N, V], params [N, 4], argmax [N]");
  }
  const int64_t n = dims[0], v = dims[1];
  const float* x = logits.typed_data();
  const float* prm = params.typed_data();
  const int32_t* am = argmax.typed_data();
  float* out = probs->typed_data();
  parallel_rows(pool, n, v, [&](int64_t r) {
    const float* __restrict row = x + r * v;
    float* __restrict o = out + r * v;
    const float c = prm[4 * r], m = prm[4 * r + 1], z = prm[4 * r + 2], cut = prm[4 * r + 3];
    if (c == 0.0f) {
      std::fill(o, o + v, 0.0f);
      if (am[r] >= 0 && am[r] < v) o[am[r]] = 1.0f;
      return;
    }
    for (int64_t j = 0; j < v; ++j) o[j] = processed_prob(row[j], m, c, z, cut);
  });
  return ffi::Error::Success();
}

// The draws of rejection_sample: batch row i draws from target row rows[i][0]
// and draft row rows[i][1] (no draft row when outside [0, Nd)).
ffi::Error DrawProbsImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> target, ffi::Buffer<ffi::F32> draft,
                         ffi::Buffer<ffi::S32> rows, ffi::Buffer<ffi::F32> s, ffi::ResultBuffer<ffi::S32> out) {
  const int64_t batch = s.element_count();
  const auto td = target.dimensions();
  const auto dd = draft.dimensions();
  const auto rd = rows.dimensions();
  if (td.size() != 2 || dd.size() != 2 || rd.size() != 2 || rd[0] != batch || rd[1] != 2 || dd[1] != td[1]) {
    return ffi::Error::InvalidArgument(
        "specjax_draw_probs: expected target [Nt, V], draft [Nd, V], rows [B, 2], s [B]");
  }
  const int64_t nt = td[0], nd = dd[0], v = td[1];
  const int32_t* r = rows.typed_data();
  int32_t* y = out->typed_data();
  parallel_rows(pool, batch, 2 * v, [&](int64_t i) {
    const int32_t t_row = r[2 * i], d_row = r[2 * i + 1];
    if (t_row < 0 || t_row >= nt) {
      y[i] = 0;
      return;
    }
    const bool has_q = d_row >= 0 && d_row < nd;
    const ProbPair pair{target.typed_data() + t_row * v, has_q ? draft.typed_data() + d_row * v : nullptr};
    std::unique_ptr<float[]> sums(new float[(v + kBlock - 1) / kBlock]);
    y[i] = draw_pair(pair, has_q, s.typed_data()[i], v, sums.get());
  });
  return ffi::Error::Success();
}

// The acceptance step of one batch row from logits, position by position
// (specjax.kernels.frontend.verify_core): position i is summarised only if the
// tests before it passed, so with an early rejection most of the 2G + 1 rows
// are never read. The test and the draw are those of
// specjax.kernels.rejection (num_accepted_from_ratios, then the residual draw
// of draw_pair), on p and q computed as in row_stats / probs_from_stats.
struct VerifyRow {
  const float* target;  // [G + 1, V]
  const float* draft;   // [G, V]
  const int32_t* x;     // [G]
  const float* u;       // [G]
  const float* cut_t;   // [G + 1]
  const float* cut_d;   // [G]
  int64_t k, v;         // k in [0, G]
  float c, s;           // c = 1 / temperature, 0 for a greedy row

  struct Summary {
    RowSummary m;
    float z;
  };

  Summary summarise(const float* row, float cut) const {
    const RowSummary m = summarise_max(row, v);
    return {m, c == 0.0f ? 1.0f : normaliser(row, v, c, m.max, cut)};
  }

  // p(x) of a processed row (probs_from_stats); 0 for an id outside [0, V),
  // which is then never accepted (frontend.vocab_gather).
  float prob(const float* row, const Summary& st, float cut, int32_t id) const {
    if (id < 0 || id >= v) return 0.0f;
    if (c == 0.0f) return id == st.m.argmax ? 1.0f : 0.0f;
    return processed_prob(row[id], st.m.max, c, st.z, cut);
  }

  // Returns (n, y): the accepted count and the emitted token.
  std::pair<int32_t, int32_t> run(float* sums) const {
    for (int64_t i = 0; i < k; ++i) {
      const float* xt = target + i * v;
      const float* xd = draft + i * v;
      const Summary st = summarise(xt, cut_t[i]);
      const Summary sd = summarise(xd, cut_d[i]);
      const float p = prob(xt, st, cut_t[i], x[i]);
      const float q = prob(xd, sd, cut_d[i], x[i]);
      if (passes(p, q, u[i])) continue;
      if (c == 0.0f) return {static_cast<int32_t>(i), st.m.argmax};
      const LogitPair pair{xt, {c, st.m.max, st.z, cut_t[i]}, xd, {c, sd.m.max, sd.z, cut_d[i]}};
      return {static_cast<int32_t>(i), draw_pair(pair, true, s, v, sums)};
    }
    // Every test passed: the bonus token from p at position k.
    const float* xt = target + k * v;
    const Summary st = summarise(xt, cut_t[k]);
    if (c == 0.0f) return {static_cast<int32_t>(k), st.m.argmax};
    const LogitPair pair{xt, {c, st.m.max, st.z, cut_t[k]}, nullptr, {}};
    return {static_cast<int32_t>(k), draw_pair(pair, false, s, v, sums)};
  }

  // Test i passes iff u < p / q (rejection.num_accepted_from_ratios): decided
  // on the bits where XLA would flush subnormals (rejection.is_positive /
  // positive_ratio), so a token the target gives probability 0 never passes.
  static bool passes(float p, float q, float u) {
    if (p != p || q != q) return false;  // NaN fails (num_accepted_from_ratios)
    const int32_t pi = __builtin_bit_cast(int32_t, p), qi = __builtin_bit_cast(int32_t, q);
    if (qi <= 0) return pi > 0;
    const int32_t tiny = __builtin_bit_cast(int32_t, FLT_MIN);
    const float ratio = pi < tiny && qi < tiny ? static_cast<float>(pi) / static_cast<float>(qi) : p / q;
    return u < ratio || (u == 0.0f && pi > 0);
  }
};

ffi::Error VerifyImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> target, ffi::Buffer<ffi::F32> draft,
                      ffi::Buffer<ffi::S32> tokens, ffi::Buffer<ffi::S32> num_draft, ffi::Buffer<ffi::F32> accept_u,
                      ffi::Buffer<ffi::F32> sample_u, ffi::Buffer<ffi::F32> scale, ffi::Buffer<ffi::F32> cut_t,
                      ffi::Buffer<ffi::F32> cut_d, ffi::ResultBuffer<ffi::S32> num_accepted,
                      ffi::ResultBuffer<ffi::S32> emitted) {
  const auto td = target.dimensions();
  const auto dd = draft.dimensions();
  if (td.size() != 3 || dd.size() != 3 || td[1] < 1) {
    return ffi::Error::InvalidArgument("specjax_verify: expected target [B, G+1, V], draft [B, G, V]");
  }
  const int64_t b = td[0], g = td[1] - 1, v = td[2];
  if (dd[0] != b || dd[1] != g || dd[2] != v || v < 1 || tokens.element_count() != b * g ||
      num_draft.element_count() != b || accept_u.element_count() != b * g || sample_u.element_count() != b ||
      scale.element_count() != b || cut_t.element_count() != b * (g + 1) || cut_d.element_count() != b * g) {
    return ffi::Error::InvalidArgument(
        "specjax_verify: expected tokens, u, cut_d [B, G], k, s, scale [B], cut_t [B, G+1]");
  }
  const int32_t* k = num_draft.typed_data();
  int32_t* n_out = num_accepted->typed_data();
  int32_t* y_out = emitted->typed_data();
  parallel_rows(pool, b, (2 * g + 1) * v, [&](int64_t r) {
    const VerifyRow row{target.typed_data() + r * (g + 1) * v,
                        draft.typed_data() + r * g * v,
                        tokens.typed_data() + r * g,
                        accept_u.typed_data() + r * g,
                        cut_t.typed_data() + r * (g + 1),
                        cut_d.typed_data() + r * g,
                        std::min<int64_t>(std::max<int64_t>(k[r], 0), g),
                        v,
                        scale.typed_data()[r],
                        sample_u.typed_data()[r]};
    std::unique_ptr<float[]> sums(new float[(v + kBlock - 1) / kBlock]);
    const auto [n, y] = row.run(sums.get());
    n_out[r] = n;
    y_out[r] = y;
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(SpecjaxRowStats, RowStatsImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(SpecjaxProbs, ProbsImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(SpecjaxDrawProbs, DrawProbsImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(SpecjaxVerify, VerifyImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>());
