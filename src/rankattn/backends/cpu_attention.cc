// Fused blocked attention for CPUs: the compute of rankattn's `cpu` backend.
//
// rankattn/backends/cpu.py owns everything else: shapes, the block plan, the
// custom VJP, dtype checks and the backward's per-row terms (semantics.py). This
// file only computes, one task per (batch row, kv head, block), on XLA's CPU
// thread pool. Each output element is written by exactly one task in a fixed
// order, so results do not depend on the thread count.
//
// The mask is semantics.py's, evaluated per element in partial blocks:
//   key j is history of query i's session:  |seg_q[i]| == seg_k[j] > 0
//                                           (and, causal, seg_q[i] < 0 || pos_k[j] <= pos_q[i])
//   plus, when `own` is set, a candidate's own key (seg_q[i] < 0, key i).
// Full blocks (every query sees every key) skip it. Non-finite inputs are replaced
// by 0 as they are copied into the task's buffers, and the rows that see them
// (semantics.py's "poisoned" rows) end with NaN out and lse.
//
// Every dot is C[M, N] (+)= A[M, K] B[K, N] with A and B row-major: a broadcast of
// A times a vector of B. Operand buffers are copied (and, for some, transposed)
// per visit, so the kernel reads q, k, v in their own [B, S, H, D] layout and
// dtype, and every B buffer's rows are padded with zeros to a multiple of the
// register tile: no loop ever reads past a buffer.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// ---- Vectors: GCC/Clang vector extensions, so the same code is AVX-512, AVX2 or NEON.

#if defined(__AVX512F__)
constexpr int kLanes = 16;
constexpr int kRowTile = 8;  // 8 x 2 accumulators + 2 loads of 32 registers
#elif defined(__AVX__)
constexpr int kLanes = 8;
constexpr int kRowTile = 6;  // 6 x 2 accumulators + 2 loads of 16 registers
#else
constexpr int kLanes = 4;
constexpr int kRowTile = 6;
#endif
constexpr int kColTile = 2 * kLanes;  // columns of one register tile

typedef float vf __attribute__((vector_size(kLanes * sizeof(float))));
typedef int32_t vi __attribute__((vector_size(kLanes * sizeof(int32_t))));

inline vf load(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline void store(float* p, vf v) { std::memcpy(p, &v, sizeof v); }
inline vf splat(float x) { return vf{} + x; }

int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

// exp(x) for a vector: exact 0 below -87.3 (so masked -inf logits give p = 0), a
// degree-6 polynomial on [-ln2/2, ln2/2] after x = n ln2 + r, 2 ulp or better.
inline vf vexp(vf x) {
  const vf lo = splat(-87.3f), hi = splat(88.3f);
  vi underflow = x < lo;
  x = x < lo ? lo : x;
  x = x > hi ? hi : x;
  const vf magic = splat(12582912.0f);  // 1.5 * 2^23: adding it rounds to an integer
  vf n = (x * splat(1.44269504088896341f) + magic) - magic;
  vf r = x - n * splat(0.693359375f);
  r = r - n * splat(-2.12194440e-4f);
  vf p = splat(1.9875691500e-4f);
  p = p * r + splat(1.3981999507e-3f);
  p = p * r + splat(8.3334519073e-3f);
  p = p * r + splat(4.1665795894e-2f);
  p = p * r + splat(1.6666665459e-1f);
  p = p * r + splat(5.0000001201e-1f);
  p = p * (r * r) + r + splat(1.0f);
  vi e = (__builtin_convertvector(n, vi) + 127) << 23;
  vf scale;
  std::memcpy(&scale, &e, sizeof scale);
  vf y = p * scale;
  return underflow ? splat(0.0f) : y;
}

// ---- Storage dtypes: float32, bfloat16 and float16 in, float32 math, the input dtype out.

struct F32 {
  using T = float;
  static float to(T x) { return x; }
  static T from(float x) { return x; }
};

struct BF16 {
  using T = uint16_t;
  static float to(T x) {
    uint32_t bits = static_cast<uint32_t>(x) << 16;
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
  }
  static T from(float f) {  // round to nearest even; NaN stays NaN
    uint32_t bits;
    std::memcpy(&bits, &f, 4);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<T>((bits >> 16) | 0x40);
    bits += 0x7fffu + ((bits >> 16) & 1u);
    return static_cast<T>(bits >> 16);
  }
};

struct F16 {
  using T = uint16_t;
  static float to(T h) {
    uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu, mant = h & 0x3ffu, bits;
    if (exp == 0x1f) {
      bits = sign | 0x7f800000u | (mant << 13);
    } else if (exp != 0) {
      bits = sign | ((exp + 112) << 23) | (mant << 13);
    } else if (mant == 0) {
      bits = sign;
    } else {  // subnormal: normalise
      int shift = 0;
      while (!(mant & 0x400u)) {
        mant <<= 1;
        ++shift;
      }
      bits = sign | (static_cast<uint32_t>(113 - shift) << 23) | ((mant & 0x3ffu) << 13);
    }
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
  }
  static T from(float f) {  // round to nearest even, overflow to inf, subnormals kept
    uint32_t bits;
    std::memcpy(&bits, &f, 4);
    uint32_t sign = (bits >> 16) & 0x8000u, abs = bits & 0x7fffffffu;
    if (abs > 0x7f800000u) return static_cast<T>(sign | 0x7e00u);
    if (abs >= 0x477ff000u) return static_cast<T>(sign | 0x7c00u);  // rounds past 65504
    if (abs < 0x38800000u) {  // below the smallest normal half: 2^-24 units
      float scaled;
      std::memcpy(&scaled, &abs, 4);
      return static_cast<T>(sign | static_cast<uint32_t>(std::nearbyint(scaled * 16777216.0f)));
    }
    uint32_t rounded = abs + 0xfffu + ((abs >> 13) & 1u);
    return static_cast<T>(sign | ((rounded - 0x38000000u) >> 13));
  }
};

// ---- The one dot: C[M, N] (+)= A[M, K] B[K, N], N a multiple of kColTile.

template <int R, bool kAccumulate>
inline void tile(int64_t k_len, const float* a, int64_t lda, const float* b, int64_t ldb,
                 float* c, int64_t ldc) {
  vf acc[R][2];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) {
    acc[r][0] = kAccumulate ? load(c + r * ldc) : splat(0.0f);
    acc[r][1] = kAccumulate ? load(c + r * ldc + kLanes) : splat(0.0f);
  }
  for (int64_t k = 0; k < k_len; ++k) {
    vf b0 = load(b + k * ldb), b1 = load(b + k * ldb + kLanes);
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      vf x = splat(a[r * lda + k]);
      acc[r][0] += x * b0;
      acc[r][1] += x * b1;
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) {
    store(c + r * ldc, acc[r][0]);
    store(c + r * ldc + kLanes, acc[r][1]);
  }
}

template <bool kAccumulate, int R = kRowTile>
inline void tail_rows(int rows, int64_t k_len, const float* a, int64_t lda, const float* b,
                      int64_t ldb, float* c, int64_t ldc) {
  if constexpr (R > 0) {
    if (rows == R) return tile<R, kAccumulate>(k_len, a, lda, b, ldb, c, ldc);
    tail_rows<kAccumulate, R - 1>(rows, k_len, a, lda, b, ldb, c, ldc);
  }
}

template <bool kAccumulate>
void gemm(int64_t m, int64_t n, int64_t k_len, const float* a, int64_t lda, const float* b,
          int64_t ldb, float* c, int64_t ldc) {
  for (int64_t j = 0; j < n; j += kColTile) {  // a B panel stays in L1 across the rows
    int64_t i = 0;
    for (; i + kRowTile <= m; i += kRowTile) {
      tile<kRowTile, kAccumulate>(k_len, a + i * lda, lda, b + j, ldb, c + i * ldc + j, ldc);
    }
    if (i < m) {
      tail_rows<kAccumulate>(static_cast<int>(m - i), k_len, a + i * lda, lda, b + j, ldb,
                             c + i * ldc + j, ldc);
    }
  }
}

// ---- Problem description, shared by the forward and the backward.

struct Problem {
  int64_t batch, q_len, kv_len, q_heads, kv_heads, dim, dim_v;
  int64_t block_q, block_k, n_q, n_k;
  float scale, softcap;
  bool soft_sign, causal, own;
  const int32_t *seg_q, *seg_k, *pos_q, *pos_k;
  const int32_t *kv_index, *full_count, *count;        // [B, nQ, nK], [B, nQ], [B, nQ]
  const int32_t *q_index, *q_full_count, *q_count;     // [B, nK, nQ], [B, nK], [B, nK]

  int64_t group() const { return q_heads / kv_heads; }

  // The capped logit, and d cap / d logit, from the raw (scaled) logit.
  float cap(float s) const {
    if (softcap <= 0) return s;
    return soft_sign ? s / (1 + std::fabs(s) / softcap) : softcap * std::tanh(s / softcap);
  }
  float cap_grad(float s) const {
    if (softcap <= 0) return 1;
    if (soft_sign) {
      float d = 1 + std::fabs(s) / softcap;
      return 1 / (d * d);
    }
    float t = std::tanh(s / softcap);
    return 1 - t * t;
  }
  // In place over n (a multiple of kLanes) logits.
  void cap_row(float* s, int64_t n) const {
    if (softcap <= 0) return;
    const vf c = splat(softcap), inv = splat(1 / softcap);
    for (int64_t j = 0; j < n; j += kLanes) {
      vf x = load(s + j);
      if (soft_sign) {
        vf a = x < 0 ? -x : x;
        store(s + j, x / (1 + a * inv));
      } else {  // tanh(y) = 1 - 2 / (exp(2y) + 1), saturating cleanly at +-1
        store(s + j, c * (1 - 2 / (vexp(2 * x * inv) + 1)));
      }
    }
  }
  bool sees_history(int32_t sq, int32_t pq, int32_t sk, int32_t pk) const {
    bool same = sk > 0 && (sq == sk || sq == -sk);
    return same && (!causal || sq < 0 || pk <= pq);
  }
  // A plan entry, clamped so that a malformed plan can never index outside the arrays.
  int64_t clamp_count(int32_t c, int64_t limit) const {
    return std::max<int64_t>(0, std::min<int64_t>(c, limit));
  }
};

// Rows of one query block of one kv head: local row r = g * nq + t is token q0 + t of query
// head kv_head * G + g.
struct QueryRows {
  int64_t b, kv_head, q0, nq, rows;
};

template <typename D>
bool copy_row(const typename D::T* src, int64_t n, float mul, float* dst) {
  bool bad = false;
  for (int64_t d = 0; d < n; ++d) {
    float x = D::to(src[d]);
    bool ok = std::isfinite(x);
    bad |= !ok;
    dst[d] = ok ? x * mul : 0.0f;
  }
  return bad;
}

// Copy rows of x [B, S, H, width] (head h, tokens t0..t0+n) as row-major [n][ld] (ld >= width,
// zero padding) or transposed [width][ld] (ld >= n). Returns per-token non-finite flags OR-ed
// into `bad` (when given).
template <typename D>
void gather(const typename D::T* x, int64_t seq, int64_t heads, int64_t width, int64_t b,
            int64_t h, int64_t t0, int64_t n, float mul, bool transpose, float* dst, int64_t ld,
            uint8_t* bad, std::vector<float>& row) {
  row.resize(width);
  for (int64_t t = 0; t < n; ++t) {
    const typename D::T* src = x + ((b * seq + t0 + t) * heads + h) * width;
    bool is_bad = copy_row<D>(src, width, mul, row.data());
    if (bad) bad[t] |= is_bad;
    if (transpose) {
      for (int64_t d = 0; d < width; ++d) dst[d * ld + t] = row[d];
    } else {
      std::memcpy(dst + t * ld, row.data(), width * sizeof(float));
    }
  }
}

// ---- Threads: tasks 0..n-1 claimed from a shared counter by the caller and pool workers.

template <typename Fn>
void parallel_for(ffi::ThreadPool& pool, int64_t n, Fn fn) {
  struct State {
    std::atomic<int64_t> next{0}, done{0};
  };
  auto state = std::make_shared<State>();
  // The state outlives this call for workers that start late; `fn` does not, so a
  // worker only touches it after claiming a task, which cannot happen once all are done.
  auto work = [state, n, &fn]() {
    for (int64_t i; (i = state->next.fetch_add(1)) < n;) {
      fn(i);
      state->done.fetch_add(1, std::memory_order_release);
    }
  };
  int64_t workers = std::min<int64_t>(pool.num_threads(), n) - 1;
  for (int64_t w = 0; w < workers; ++w) pool.Schedule([work]() { work(); });
  work();
  while (state->done.load(std::memory_order_acquire) < n) std::this_thread::yield();
}

// ---- Forward.

template <typename D>
struct Forward {
  using T = typename D::T;
  const Problem& p;
  const T *q, *k, *v;
  T* out;
  float* lse;

  void run(int64_t task) const {
    int64_t b = task / (p.kv_heads * p.n_q), hk = task / p.n_q % p.kv_heads, qb = task % p.n_q;
    const int64_t g_len = p.group(), q0 = qb * p.block_q;
    const int64_t nq = std::min(p.block_q, p.q_len - q0), m = g_len * nq;
    const int64_t dp = round_up(p.dim, kColTile), dvp = round_up(p.dim_v, kColTile);
    const int64_t np = round_up(p.block_k, kColTile);
    std::vector<float> qs(m * dp, 0.0f), kt(p.dim * np, 0.0f), vs(p.block_k * dvp, 0.0f),
        s(m * np), acc(m * dvp, 0.0f), row;
    std::vector<float> mx(m, -kInf), l(m, 0.0f);
    std::vector<uint8_t> key_bad(p.block_k), poisoned(m, 0);
    std::vector<int32_t> seg(np), pos(np);
    for (int64_t g = 0; g < g_len; ++g) {
      std::vector<uint8_t> bad(nq, 0);
      gather<D>(q, p.q_len, p.q_heads, p.dim, b, hk * g_len + g, q0, nq, p.scale, false,
                qs.data() + g * nq * dp, dp, bad.data(), row);
      for (int64_t t = 0; t < nq; ++t) poisoned[g * nq + t] |= bad[t];
    }
    const int32_t* seg_q = p.seg_q + b * p.q_len + q0;
    const int32_t* pos_q = p.pos_q + b * p.q_len + q0;

    const int64_t list = b * p.n_q + qb;
    const int64_t count = p.clamp_count(p.count[list], p.n_k);
    const int64_t full = p.clamp_count(p.full_count[list], count);
    for (int64_t e = 0; e < count; ++e) {
      int32_t kb = p.kv_index[list * p.n_k + e];
      if (kb < 0 || kb >= p.n_k) continue;
      const int64_t k0 = kb * p.block_k, nk = std::min(p.block_k, p.kv_len - k0);
      std::fill(key_bad.begin(), key_bad.end(), 0);
      std::fill(kt.begin(), kt.end(), 0.0f);
      gather<D>(k, p.kv_len, p.kv_heads, p.dim, b, hk, k0, nk, 1.0f, true, kt.data(), np,
                key_bad.data(), row);
      gather<D>(v, p.kv_len, p.kv_heads, p.dim_v, b, hk, k0, nk, 1.0f, false, vs.data(), dvp,
                key_bad.data(), row);
      std::fill(seg.begin(), seg.end(), 0);
      std::copy_n(p.seg_k + b * p.kv_len + k0, nk, seg.begin());
      std::copy_n(p.pos_k + b * p.kv_len + k0, nk, pos.begin());
      const bool masked = e >= full;
      const bool any_bad = std::any_of(key_bad.begin(), key_bad.begin() + nk,
                                       [](uint8_t x) { return x != 0; });

      gemm<false>(m, np, p.dim, qs.data(), dp, kt.data(), np, s.data(), np);
      for (int64_t r = 0; r < m; ++r) {
        float* sr = s.data() + r * np;
        const int64_t t = r % nq;
        p.cap_row(sr, np);
        if (masked) {
          for (int64_t j = 0; j < nk; ++j) {
            bool vis = p.sees_history(seg_q[t], pos_q[t], seg[j], pos[j]);
            poisoned[r] |= vis && key_bad[j];
            sr[j] = vis ? sr[j] : -kInf;
          }
        } else {
          poisoned[r] |= any_bad;
        }
        for (int64_t j = nk; j < np; ++j) sr[j] = -kInf;
        float row_max = mx[r];
        for (int64_t j = 0; j < nk; ++j) row_max = std::max(row_max, sr[j]);
        const float shift = std::isfinite(row_max) ? row_max : 0.0f;
        const float alpha = std::exp(mx[r] - shift);
        vf sum = splat(0.0f);
        for (int64_t j = 0; j < np; j += kLanes) {
          vf pj = vexp(load(sr + j) - shift);
          store(sr + j, pj);
          sum += pj;
        }
        float total = 0;
        for (int c = 0; c < kLanes; ++c) total += sum[c];
        l[r] = l[r] * alpha + total;
        mx[r] = row_max;
        float* ar = acc.data() + r * dvp;
        for (int64_t d = 0; d < dvp; ++d) ar[d] *= alpha;
      }
      gemm<true>(m, dvp, nk, s.data(), np, vs.data(), dvp, acc.data(), dvp);
    }

    std::vector<float> own_k(p.dim), own_v(p.dim_v);
    for (int64_t t = 0; t < nq; ++t) {
      const bool own = p.own && seg_q[t] < 0;
      bool own_bad = false;
      if (own) {
        const int64_t i = q0 + t;
        own_bad = copy_row<D>(k + ((b * p.kv_len + i) * p.kv_heads + hk) * p.dim, p.dim, 1.0f,
                              own_k.data());
        own_bad |= copy_row<D>(v + ((b * p.kv_len + i) * p.kv_heads + hk) * p.dim_v, p.dim_v,
                               1.0f, own_v.data());
      }
      for (int64_t g = 0; g < g_len; ++g) {
        const int64_t r = g * nq + t, h = hk * g_len + g;
        float* ar = acc.data() + r * dvp;
        if (own) {  // the own-key logit joins the softmax
          float dot = 0;
          const float* qr = qs.data() + r * dp;
          for (int64_t d = 0; d < p.dim; ++d) dot += qr[d] * own_k[d];
          const float s_own = p.cap(dot);
          const float m_new = std::max(mx[r], s_own);
          const float alpha = std::exp(mx[r] - m_new), p_own = std::exp(s_own - m_new);
          l[r] = l[r] * alpha + p_own;
          for (int64_t d = 0; d < p.dim_v; ++d) ar[d] = ar[d] * alpha + p_own * own_v[d];
          mx[r] = m_new;
          poisoned[r] |= own_bad;
        }
        const bool seen = l[r] != 0;
        const bool nan = seen && poisoned[r];
        const float inv = seen ? 1 / l[r] : 0.0f;
        T* o = out + ((b * p.q_len + q0 + t) * p.q_heads + h) * p.dim_v;
        for (int64_t d = 0; d < p.dim_v; ++d) o[d] = D::from(nan ? kNaN : ar[d] * inv);
        lse[(b * p.q_heads + h) * p.q_len + q0 + t] =
            nan ? kNaN : (seen ? mx[r] + std::log(l[r]) : -kInf);
      }
    }
  }
};


// ---- Backward. The caller passes, per query row [B, Sq, Hq], the lse (+inf for rows that
// pass no gradient) and delta = rowsum(dO * O) - d lse (semantics.backward_rows). Then
// p = exp(cap(s) - lse), dp = dO . v, ds = p (dp - delta) cap'(s), and with q pre-scaled:
// dq = scale * ds k, dk = ds^T (scale q), dv = p^T dO.

// d logits from p (in place in `sp`), dp and the raw logits, for one row of n (a multiple of
// kLanes) entries.
inline void logit_grads(const Problem& p, float* sp, const float* dp, const float* raw,
                        float delta, int64_t n) {
  const vf inv = splat(p.softcap > 0 ? 1 / p.softcap : 0.0f);
  for (int64_t j = 0; j < n; j += kLanes) {
    vf ds = load(sp + j) * (load(dp + j) - delta);
    if (p.softcap > 0) {
      vf x = load(raw + j), g;
      if (p.soft_sign) {
        vf d = 1 + (x < 0 ? -x : x) * inv;
        g = 1 / (d * d);
      } else {
        vf t = 1 - 2 / (vexp(2 * x * inv) + 1);
        g = 1 - t * t;
      }
      ds *= g;
    }
    store(sp + j, ds);
  }
}

// p from the raw logits of one row, in place in `s` (raw kept in `raw` when capped); masked
// entries (and padding, from n_real on) get 0.
template <typename Visible>
inline void probabilities(const Problem& p, float* s, float* raw, int64_t n_real, int64_t n,
                          float lse, bool masked, Visible visible) {
  if (p.softcap > 0) std::memcpy(raw, s, n * sizeof(float));
  p.cap_row(s, n);
  const float shift = lse == -kInf ? kInf : lse;  // a row that sees nothing: every p is 0
  for (int64_t j = 0; j < n; j += kLanes) store(s + j, vexp(load(s + j) - shift));
  if (masked) {
    for (int64_t j = 0; j < n_real; ++j) s[j] = visible(j) ? s[j] : 0.0f;
  }
  for (int64_t j = n_real; j < n; ++j) s[j] = 0.0f;
}

template <typename D>
struct Backward {
  using T = typename D::T;
  const Problem& p;
  const T *q, *k, *v, *d_out;
  const float *lse, *delta;  // [B, Sq, Hq]
  T *dq, *dk, *dv;

  float row_lse(int64_t b, int64_t i, int64_t h) const {
    return lse[(b * p.q_len + i) * p.q_heads + h];
  }
  float row_delta(int64_t b, int64_t i, int64_t h) const {
    return delta[(b * p.q_len + i) * p.q_heads + h];
  }

  // dq of one query block of one kv head, over the key blocks it sees.
  void dq_task(int64_t task) const {
    int64_t b = task / (p.kv_heads * p.n_q), hk = task / p.n_q % p.kv_heads, qb = task % p.n_q;
    const int64_t g_len = p.group(), q0 = qb * p.block_q;
    const int64_t nq = std::min(p.block_q, p.q_len - q0), m = g_len * nq;
    const int64_t dp = round_up(p.dim, kColTile), dvp = round_up(p.dim_v, kColTile);
    const int64_t np = round_up(p.block_k, kColTile);
    std::vector<float> qs(m * dp, 0.0f), dos(m * dvp, 0.0f), kt(p.dim * np, 0.0f),
        vt(p.dim_v * np, 0.0f), ks(p.block_k * dp, 0.0f), s(m * np), dpm(m * np), raw(np),
        grad(m * dp, 0.0f), row, lse_r(m), delta_r(m);
    std::vector<int32_t> seg(np), pos(np);
    for (int64_t g = 0; g < g_len; ++g) {
      const int64_t h = hk * g_len + g;
      gather<D>(q, p.q_len, p.q_heads, p.dim, b, h, q0, nq, p.scale, false,
                qs.data() + g * nq * dp, dp, nullptr, row);
      gather<D>(d_out, p.q_len, p.q_heads, p.dim_v, b, h, q0, nq, 1.0f, false,
                dos.data() + g * nq * dvp, dvp, nullptr, row);
      for (int64_t t = 0; t < nq; ++t) {
        lse_r[g * nq + t] = row_lse(b, q0 + t, h);
        delta_r[g * nq + t] = row_delta(b, q0 + t, h);
      }
    }
    const int32_t* seg_q = p.seg_q + b * p.q_len + q0;
    const int32_t* pos_q = p.pos_q + b * p.q_len + q0;
    const int64_t list = b * p.n_q + qb;
    const int64_t count = p.clamp_count(p.count[list], p.n_k);
    const int64_t full = p.clamp_count(p.full_count[list], count);
    for (int64_t e = 0; e < count; ++e) {
      int32_t kb = p.kv_index[list * p.n_k + e];
      if (kb < 0 || kb >= p.n_k) continue;
      const int64_t k0 = kb * p.block_k, nk = std::min(p.block_k, p.kv_len - k0);
      std::fill(kt.begin(), kt.end(), 0.0f);
      std::fill(vt.begin(), vt.end(), 0.0f);
      gather<D>(k, p.kv_len, p.kv_heads, p.dim, b, hk, k0, nk, 1.0f, true, kt.data(), np,
                nullptr, row);
      gather<D>(v, p.kv_len, p.kv_heads, p.dim_v, b, hk, k0, nk, 1.0f, true, vt.data(), np,
                nullptr, row);
      gather<D>(k, p.kv_len, p.kv_heads, p.dim, b, hk, k0, nk, 1.0f, false, ks.data(), dp,
                nullptr, row);
      std::copy_n(p.seg_k + b * p.kv_len + k0, nk, seg.begin());
      std::copy_n(p.pos_k + b * p.kv_len + k0, nk, pos.begin());
      const bool masked = e >= full;
      gemm<false>(m, np, p.dim, qs.data(), dp, kt.data(), np, s.data(), np);
      gemm<false>(m, np, p.dim_v, dos.data(), dvp, vt.data(), np, dpm.data(), np);
      for (int64_t r = 0; r < m; ++r) {
        const int64_t t = r % nq;
        float* sr = s.data() + r * np;
        probabilities(p, sr, raw.data(), nk, np, lse_r[r], masked, [&](int64_t j) {
          return p.sees_history(seg_q[t], pos_q[t], seg[j], pos[j]);
        });
        logit_grads(p, sr, dpm.data() + r * np, raw.data(), delta_r[r], np);
      }
      gemm<true>(m, dp, nk, s.data(), np, ks.data(), dp, grad.data(), dp);
    }

    std::vector<float> own_k(p.dim), own_v(p.dim_v);
    for (int64_t t = 0; t < nq; ++t) {
      const bool own = p.own && seg_q[t] < 0;
      if (own) {
        const int64_t i = q0 + t;
        copy_row<D>(k + ((b * p.kv_len + i) * p.kv_heads + hk) * p.dim, p.dim, 1.0f,
                    own_k.data());
        copy_row<D>(v + ((b * p.kv_len + i) * p.kv_heads + hk) * p.dim_v, p.dim_v, 1.0f,
                    own_v.data());
      }
      for (int64_t g = 0; g < g_len; ++g) {
        const int64_t r = g * nq + t;
        float* gr = grad.data() + r * dp;
        if (own) {
          const float ds = own_grad(qs.data() + r * dp, dos.data() + r * dvp, own_k.data(),
                                    own_v.data(), lse_r[r], delta_r[r], nullptr);
          for (int64_t d = 0; d < p.dim; ++d) gr[d] += ds * own_k[d];
        }
        T* o = dq + ((b * p.q_len + q0 + t) * p.q_heads + hk * g_len + g) * p.dim;
        for (int64_t d = 0; d < p.dim; ++d) o[d] = D::from(gr[d] * p.scale);
      }
    }
  }

  // d logit of a candidate's own key, given its (scaled) q, dO and own k, v; *p_out = p.
  float own_grad(const float* qs, const float* dos, const float* own_k, const float* own_v,
                 float lse_r, float delta_r, float* p_out) const {
    float dot = 0, dpv = 0;
    for (int64_t d = 0; d < p.dim; ++d) dot += qs[d] * own_k[d];
    for (int64_t d = 0; d < p.dim_v; ++d) dpv += dos[d] * own_v[d];
    const float shift = lse_r == -kInf ? kInf : lse_r;
    const float prob = std::exp(p.cap(dot) - shift);
    if (p_out) *p_out = prob;
    return prob * (dpv - delta_r) * p.cap_grad(dot);
  }

  // dk, dv of one key block of one kv head, over the query blocks that see it.
  void dkv_task(int64_t task) const {
    int64_t b = task / (p.kv_heads * p.n_k), hk = task / p.n_k % p.kv_heads, kb = task % p.n_k;
    const int64_t g_len = p.group(), k0 = kb * p.block_k;
    const int64_t nk = std::min(p.block_k, p.kv_len - k0);
    const int64_t dp = round_up(p.dim, kColTile), dvp = round_up(p.dim_v, kColTile);
    const int64_t m_max = g_len * p.block_q, mp = round_up(m_max, kColTile);
    std::vector<float> ks(nk * dp, 0.0f), vs(nk * dvp, 0.0f), qt(p.dim * mp, 0.0f),
        dout_t(p.dim_v * mp, 0.0f), qs(m_max * dp, 0.0f), dos(m_max * dvp, 0.0f), st(nk * mp),
        dpt(nk * mp), raw, dk_acc(nk * dp, 0.0f), dv_acc(nk * dvp, 0.0f), row;
    std::vector<float> shift_c(mp), delta_c(mp, 0.0f);
    std::vector<int32_t> seg_c(mp), pos_c(mp);
    gather<D>(k, p.kv_len, p.kv_heads, p.dim, b, hk, k0, nk, 1.0f, false, ks.data(), dp,
              nullptr, row);
    gather<D>(v, p.kv_len, p.kv_heads, p.dim_v, b, hk, k0, nk, 1.0f, false, vs.data(), dvp,
              nullptr, row);
    const int32_t* seg_k = p.seg_k + b * p.kv_len + k0;
    const int32_t* pos_k = p.pos_k + b * p.kv_len + k0;

    const int64_t list = b * p.n_k + kb;
    const int64_t count = p.clamp_count(p.q_count[list], p.n_q);
    const int64_t full = p.clamp_count(p.q_full_count[list], count);
    for (int64_t e = 0; e < count; ++e) {
      int32_t qb = p.q_index[list * p.n_q + e];
      if (qb < 0 || qb >= p.n_q) continue;
      const int64_t q0 = qb * p.block_q, nq = std::min(p.block_q, p.q_len - q0), m = g_len * nq;
      std::fill(qt.begin(), qt.end(), 0.0f);
      std::fill(dout_t.begin(), dout_t.end(), 0.0f);
      std::fill(delta_c.begin(), delta_c.end(), 0.0f);
      for (int64_t g = 0; g < g_len; ++g) {
        const int64_t h = hk * g_len + g;
        gather<D>(q, p.q_len, p.q_heads, p.dim, b, h, q0, nq, p.scale, false,
                  qs.data() + g * nq * dp, dp, nullptr, row);
        gather<D>(d_out, p.q_len, p.q_heads, p.dim_v, b, h, q0, nq, 1.0f, false,
                  dos.data() + g * nq * dvp, dvp, nullptr, row);
        for (int64_t t = 0; t < nq; ++t) {
          const int64_t r = g * nq + t;
          for (int64_t d = 0; d < p.dim; ++d) qt[d * mp + r] = qs[r * dp + d];
          for (int64_t d = 0; d < p.dim_v; ++d) dout_t[d * mp + r] = dos[r * dvp + d];
          const float lse_r = row_lse(b, q0 + t, h);
          shift_c[r] = lse_r == -kInf ? kInf : lse_r;  // a row that sees nothing: p = 0
          delta_c[r] = row_delta(b, q0 + t, h);
          seg_c[r] = p.seg_q[b * p.q_len + q0 + t];
          pos_c[r] = p.pos_q[b * p.q_len + q0 + t];
        }
      }
      const bool masked = e >= full;
      gemm<false>(nk, mp, p.dim, ks.data(), dp, qt.data(), mp, st.data(), mp);
      gemm<false>(nk, mp, p.dim_v, vs.data(), dvp, dout_t.data(), mp, dpt.data(), mp);
      if (p.softcap > 0) raw = st;
      for (int64_t j = 0; j < nk; ++j) {  // p^T: columns are query rows, each with its lse
        float* sr = st.data() + j * mp;
        p.cap_row(sr, mp);
        for (int64_t r = 0; r < m; ++r) {
          const bool vis = !masked || p.sees_history(seg_c[r], pos_c[r], seg_k[j], pos_k[j]);
          sr[r] = vis ? sr[r] - shift_c[r] : -kInf;
        }
        for (int64_t r = m; r < mp; ++r) sr[r] = -kInf;
        for (int64_t r = 0; r < mp; r += kLanes) store(sr + r, vexp(load(sr + r)));
      }
      gemm<true>(nk, dvp, m, st.data(), mp, dos.data(), dvp, dv_acc.data(), dvp);
      for (int64_t j = 0; j < nk; ++j) {
        float* dr = dpt.data() + j * mp;
        for (int64_t r = 0; r < mp; ++r) dr[r] -= delta_c[r];
        logit_grads(p, st.data() + j * mp, dr, raw.data() + j * mp, 0.0f, mp);
      }
      gemm<true>(nk, dp, m, st.data(), mp, qs.data(), dp, dk_acc.data(), dp);
    }

    if (p.own) {  // each candidate key's own query rows
      std::vector<float> q_row(dp), do_row(dvp);
      for (int64_t j = 0; j < nk; ++j) {
        const int64_t i = k0 + j;
        if (p.seg_q[b * p.q_len + i] >= 0) continue;
        for (int64_t g = 0; g < g_len; ++g) {
          const int64_t h = hk * g_len + g;
          copy_row<D>(q + ((b * p.q_len + i) * p.q_heads + h) * p.dim, p.dim, p.scale,
                      q_row.data());
          copy_row<D>(d_out + ((b * p.q_len + i) * p.q_heads + h) * p.dim_v, p.dim_v, 1.0f,
                      do_row.data());
          float prob;
          const float ds = own_grad(q_row.data(), do_row.data(), ks.data() + j * dp,
                                    vs.data() + j * dvp, row_lse(b, i, h), row_delta(b, i, h),
                                    &prob);
          for (int64_t d = 0; d < p.dim; ++d) dk_acc[j * dp + d] += ds * q_row[d];
          for (int64_t d = 0; d < p.dim_v; ++d) dv_acc[j * dvp + d] += prob * do_row[d];
        }
      }
    }
    for (int64_t j = 0; j < nk; ++j) {
      T* ok = dk + ((b * p.kv_len + k0 + j) * p.kv_heads + hk) * p.dim;
      T* ov = dv + ((b * p.kv_len + k0 + j) * p.kv_heads + hk) * p.dim_v;
      for (int64_t d = 0; d < p.dim; ++d) ok[d] = D::from(dk_acc[j * dp + d]);
      for (int64_t d = 0; d < p.dim_v; ++d) ov[d] = D::from(dv_acc[j * dvp + d]);
    }
  }
};

// ---- FFI: checks of what the Python side passes, then the tasks.

using I32 = ffi::Buffer<ffi::S32>;

ffi::Error check(bool ok, const std::string& what) {
  return ok ? ffi::Error::Success()
            : ffi::Error(ffi::ErrorCode::kInvalidArgument, "rankattn cpu kernel: " + what);
}

bool dims_are(ffi::Span<const int64_t> dims, std::initializer_list<int64_t> want) {
  return dims.size() == want.size() && std::equal(want.begin(), want.end(), dims.begin());
}

// The problem of a call, after checking every shape against q, k, v and the block sizes, so
// the tasks can index without further checks.
ffi::Error describe(const ffi::AnyBuffer& q, const ffi::AnyBuffer& k, const ffi::AnyBuffer& v,
                    const I32& seg_q, const I32& seg_k, const I32& pos_q, const I32& pos_k,
                    const I32& kv_index, const I32& full_count, const I32& count, float scale,
                    float softcap, bool soft_sign, bool causal, bool own, int64_t block_q,
                    int64_t block_k, Problem* p) {
  auto qd = q.dimensions(), kd = k.dimensions(), vd = v.dimensions();
  if (auto e = check(qd.size() == 4 && kd.size() == 4 && vd.size() == 4, "q, k, v must be 4-D");
      e.failure())
    return e;
  *p = Problem{};
  p->batch = qd[0], p->q_len = qd[1], p->q_heads = qd[2], p->dim = qd[3];
  p->kv_len = kd[1], p->kv_heads = kd[2], p->dim_v = vd[3];
  p->block_q = block_q, p->block_k = block_k;
  p->scale = scale, p->softcap = softcap, p->soft_sign = soft_sign, p->causal = causal;
  p->own = own;
  bool ok = p->batch >= 1 && p->q_len >= 1 && p->kv_len >= 1 && p->kv_heads >= 1 &&
            p->q_heads % p->kv_heads == 0 && p->dim >= 1 && p->dim_v >= 1 &&
            dims_are(kd, {p->batch, p->kv_len, p->kv_heads, p->dim}) &&
            dims_are(vd, {p->batch, p->kv_len, p->kv_heads, p->dim_v}) && block_q >= 1 &&
            block_k >= 1 && q.element_type() == k.element_type() &&
            q.element_type() == v.element_type() && (!own || p->q_len == p->kv_len);
  if (auto e = check(ok, "inconsistent q, k, v shapes, block sizes or own-key flag"); e.failure())
    return e;
  p->n_q = (p->q_len + block_q - 1) / block_q;
  p->n_k = (p->kv_len + block_k - 1) / block_k;
  ok = dims_are(seg_q.dimensions(), {p->batch, p->q_len}) &&
       dims_are(pos_q.dimensions(), {p->batch, p->q_len}) &&
       dims_are(seg_k.dimensions(), {p->batch, p->kv_len}) &&
       dims_are(pos_k.dimensions(), {p->batch, p->kv_len}) &&
       dims_are(kv_index.dimensions(), {p->batch, p->n_q, p->n_k}) &&
       dims_are(full_count.dimensions(), {p->batch, p->n_q}) &&
       dims_are(count.dimensions(), {p->batch, p->n_q});
  if (auto e = check(ok, "mask or plan arrays do not match q, k and the block sizes");
      e.failure())
    return e;
  p->seg_q = seg_q.typed_data(), p->seg_k = seg_k.typed_data();
  p->pos_q = pos_q.typed_data(), p->pos_k = pos_k.typed_data();
  p->kv_index = kv_index.typed_data(), p->full_count = full_count.typed_data();
  p->count = count.typed_data();
  return ffi::Error::Success();
}

template <typename D>
struct Tag {
  using type = D;
};

// Calls fn(Tag<storage dtype>{}).
template <typename Fn>
ffi::Error by_dtype(ffi::DataType dtype, Fn fn) {
  switch (dtype) {
    case ffi::DataType::F32: return fn(Tag<F32>{});
    case ffi::DataType::BF16: return fn(Tag<BF16>{});
    case ffi::DataType::F16: return fn(Tag<F16>{});
    default: return check(false, "q, k, v must be float32, bfloat16 or float16");
  }
}

ffi::Error forward(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                   I32 seg_q, I32 seg_k, I32 pos_q, I32 pos_k, I32 kv_index, I32 full_count,
                   I32 count, ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::Buffer<ffi::F32>> lse,
                   float scale, float softcap, bool soft_sign, bool causal, bool own,
                   int64_t block_q, int64_t block_k) {
  Problem p;
  if (auto e = describe(q, k, v, seg_q, seg_k, pos_q, pos_k, kv_index, full_count, count, scale,
                        softcap, soft_sign, causal, own, block_q, block_k, &p);
      e.failure())
    return e;
  bool ok = out->element_type() == q.element_type() &&
            dims_are(out->dimensions(), {p.batch, p.q_len, p.q_heads, p.dim_v}) &&
            dims_are(lse->dimensions(), {p.batch, p.q_heads, p.q_len});
  if (auto e = check(ok, "out or lse has the wrong shape or dtype"); e.failure()) return e;
  return by_dtype(q.element_type(), [&](auto tag) {
    using D = typename decltype(tag)::type;
    using T = typename D::T;
    Forward<D> kernel{p, static_cast<const T*>(q.untyped_data()),
                      static_cast<const T*>(k.untyped_data()),
                      static_cast<const T*>(v.untyped_data()), static_cast<T*>(out->untyped_data()),
                      lse->typed_data()};
    parallel_for(pool, p.batch * p.kv_heads * p.n_q, [&](int64_t t) { kernel.run(t); });
    return ffi::Error::Success();
  });
}

ffi::Error backward(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                    ffi::AnyBuffer d_out, ffi::Buffer<ffi::F32> lse, ffi::Buffer<ffi::F32> delta,
                    I32 seg_q, I32 seg_k, I32 pos_q, I32 pos_k, I32 kv_index, I32 full_count,
                    I32 count, I32 q_index, I32 q_full_count, I32 q_count,
                    ffi::Result<ffi::AnyBuffer> dq, ffi::Result<ffi::AnyBuffer> dk,
                    ffi::Result<ffi::AnyBuffer> dv, float scale, float softcap, bool soft_sign,
                    bool causal, bool own, int64_t block_q, int64_t block_k) {
  Problem p;
  if (auto e = describe(q, k, v, seg_q, seg_k, pos_q, pos_k, kv_index, full_count, count, scale,
                        softcap, soft_sign, causal, own, block_q, block_k, &p);
      e.failure())
    return e;
  const auto dtype = q.element_type();
  bool ok = d_out.element_type() == dtype && dq->element_type() == dtype &&
            dk->element_type() == dtype && dv->element_type() == dtype &&
            dims_are(d_out.dimensions(), {p.batch, p.q_len, p.q_heads, p.dim_v}) &&
            dims_are(lse.dimensions(), {p.batch, p.q_len, p.q_heads}) &&
            dims_are(delta.dimensions(), {p.batch, p.q_len, p.q_heads}) &&
            dims_are(q_index.dimensions(), {p.batch, p.n_k, p.n_q}) &&
            dims_are(q_full_count.dimensions(), {p.batch, p.n_k}) &&
            dims_are(q_count.dimensions(), {p.batch, p.n_k}) &&
            dims_are(dq->dimensions(), {p.batch, p.q_len, p.q_heads, p.dim}) &&
            dims_are(dk->dimensions(), {p.batch, p.kv_len, p.kv_heads, p.dim}) &&
            dims_are(dv->dimensions(), {p.batch, p.kv_len, p.kv_heads, p.dim_v});
  if (auto e = check(ok, "backward operands have the wrong shape or dtype"); e.failure()) return e;
  p.q_index = q_index.typed_data(), p.q_full_count = q_full_count.typed_data();
  p.q_count = q_count.typed_data();
  return by_dtype(dtype, [&](auto tag) {
    using D = typename decltype(tag)::type;
    using T = typename D::T;
    Backward<D> kernel{p,
                       static_cast<const T*>(q.untyped_data()),
                       static_cast<const T*>(k.untyped_data()),
                       static_cast<const T*>(v.untyped_data()),
                       static_cast<const T*>(d_out.untyped_data()),
                       lse.typed_data(),
                       delta.typed_data(),
                       static_cast<T*>(dq->untyped_data()),
                       static_cast<T*>(dk->untyped_data()),
                       static_cast<T*>(dv->untyped_data())};
    // dk / dv tasks (per key block) and dq tasks (per query block) write disjoint outputs.
    const int64_t key_tasks = p.batch * p.kv_heads * p.n_k;
    parallel_for(pool, key_tasks + p.batch * p.kv_heads * p.n_q, [&](int64_t t) {
      if (t < key_tasks) {
        kernel.dkv_task(t);
      } else {
        kernel.dq_task(t - key_tasks);
      }
    });
    return ffi::Error::Success();
  });
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(RankattnCpuForward, forward,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()  // q
                                  .Arg<ffi::AnyBuffer>()  // k
                                  .Arg<ffi::AnyBuffer>()  // v
                                  .Arg<I32>()             // seg_q
                                  .Arg<I32>()             // seg_k
                                  .Arg<I32>()             // pos_q
                                  .Arg<I32>()             // pos_k
                                  .Arg<I32>()             // kv_index
                                  .Arg<I32>()             // full_count
                                  .Arg<I32>()             // count
                                  .Ret<ffi::AnyBuffer>()  // out
                                  .Ret<ffi::Buffer<ffi::F32>>()  // lse
                                  .Attr<float>("scale")
                                  .Attr<float>("softcap")
                                  .Attr<bool>("soft_sign")
                                  .Attr<bool>("causal")
                                  .Attr<bool>("own")
                                  .Attr<int64_t>("block_q")
                                  .Attr<int64_t>("block_k"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(RankattnCpuBackward, backward,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()  // q
                                  .Arg<ffi::AnyBuffer>()  // k
                                  .Arg<ffi::AnyBuffer>()  // v
                                  .Arg<ffi::AnyBuffer>()  // d_out
                                  .Arg<ffi::Buffer<ffi::F32>>()  // lse [B, Sq, Hq]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // delta [B, Sq, Hq]
                                  .Arg<I32>()             // seg_q
                                  .Arg<I32>()             // seg_k
                                  .Arg<I32>()             // pos_q
                                  .Arg<I32>()             // pos_k
                                  .Arg<I32>()             // kv_index
                                  .Arg<I32>()             // full_count
                                  .Arg<I32>()             // count
                                  .Arg<I32>()             // q_index
                                  .Arg<I32>()             // q_full_count
                                  .Arg<I32>()             // q_count
                                  .Ret<ffi::AnyBuffer>()  // dq
                                  .Ret<ffi::AnyBuffer>()  // dk
                                  .Ret<ffi::AnyBuffer>()  // dv
                                  .Attr<float>("scale")
                                  .Attr<float>("softcap")
                                  .Attr<bool>("soft_sign")
                                  .Attr<bool>("causal")
                                  .Attr<bool>("own")
                                  .Attr<int64_t>("block_q")
                                  .Attr<int64_t>("block_k"));
