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
#include <cstdlib>
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
// x - 0 is x for every x, -0 included, so this compiles to a bare broadcast (x + 0 would not).
inline vf splat(float x) { return x - vf{}; }

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

// ---- The one dot: C[M, N] (+)= A[M, K] B[K, N], N a multiple of kColTile. A is row-major,
// A(r, k) = a[r * lda + k], or with kTransposedA column-major, A(r, k) = a[k * lda + r].

template <bool kTransposedA>
inline const float* a_element(const float* a, int64_t lda, int64_t r, int64_t k) {
  return kTransposedA ? a + k * lda + r : a + r * lda + k;
}

template <int R, bool kAccumulate, bool kTransposedA>
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
      vf x = splat(*a_element<kTransposedA>(a, lda, r, k));
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

template <bool kAccumulate, bool kTransposedA, int R = kRowTile>
inline void tail_rows(int rows, int64_t k_len, const float* a, int64_t lda, const float* b,
                      int64_t ldb, float* c, int64_t ldc) {
  if constexpr (R > 0) {
    if (rows == R) return tile<R, kAccumulate, kTransposedA>(k_len, a, lda, b, ldb, c, ldc);
    tail_rows<kAccumulate, kTransposedA, R - 1>(rows, k_len, a, lda, b, ldb, c, ldc);
  }
}

template <bool kAccumulate, bool kTransposedA = false>
void gemm(int64_t m, int64_t n, int64_t k_len, const float* a, int64_t lda, const float* b,
          int64_t ldb, float* c, int64_t ldc) {
  for (int64_t j = 0; j < n; j += kColTile) {  // a B panel stays in L1 across the rows
    int64_t i = 0;
    for (; i + kRowTile <= m; i += kRowTile) {
      tile<kRowTile, kAccumulate, kTransposedA>(k_len, a_element<kTransposedA>(a, lda, i, 0),
                                                lda, b + j, ldb, c + i * ldc + j, ldc);
    }
    if (i < m) {
      tail_rows<kAccumulate, kTransposedA>(static_cast<int>(m - i), k_len,
                                           a_element<kTransposedA>(a, lda, i, 0), lda, b + j,
                                           ldb, c + i * ldc + j, ldc);
    }
  }
}

// ---- Problem description, shared by the forward and the backward.

inline vi splat_i(int32_t x) { return x - vi{}; }
inline vi load_i(const int32_t* p) {
  vi v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline bool any_lane(vi x) {
  for (int c = 0; c < kLanes; ++c) {
    if (x[c]) return true;
  }
  return false;
}
inline float max_lane(vf x) {
  float m = x[0];
  for (int c = 1; c < kLanes; ++c) m = std::max(m, x[c]);
  return m;
}
inline float sum_lanes(vf x) {
  float s = 0;
  for (int c = 0; c < kLanes; ++c) s += x[c];
  return s;
}

struct Problem {
  int64_t batch, q_len, kv_len, q_heads, kv_heads, dim, dim_v;
  int64_t block_q, block_k, n_q, n_k;
  float scale, softcap;
  bool soft_sign, causal, own;
  const int32_t *seg_q, *seg_k, *pos_q, *pos_k;
  const int32_t *kv_index, *full_count, *count;     // [B, nQ, nK], [B, nQ], [B, nQ]
  const int32_t *q_index, *q_full_count, *q_count;  // [B, nK, nQ], [B, nK], [B, nK]

  int64_t group() const { return q_heads / kv_heads; }
  // Columns the dots compute (multiples of the register tile) of q / k rows, v / out rows,
  // the keys of a block and the query rows of a block; and the row strides of buffers that
  // hold them. A stride one vector longer keeps rows off the same L1 sets: with 128 columns
  // a stride of 512 bytes maps every 8th row to one set (measured 75 -> 91 GFLOP/s on one
  // 128^3 dot from cold buffers).
  int64_t dc() const { return round_up(dim, kColTile); }
  int64_t dvc() const { return round_up(dim_v, kColTile); }
  int64_t nc() const { return round_up(block_k, kColTile); }
  int64_t mc() const { return round_up(group() * block_q, kColTile); }
  int64_t dp() const { return dc() + kLanes; }
  int64_t dvp() const { return dvc() + kLanes; }
  int64_t np() const { return nc() + kLanes; }
  int64_t mp() const { return mc() + kLanes; }

  float cap(float s) const {
    if (softcap <= 0) return s;
    return soft_sign ? s / (1 + std::fabs(s) / softcap) : softcap * std::tanh(s / softcap);
  }
  float cap_grad(float s) const {  // d cap(s) / d s
    if (softcap <= 0) return 1;
    if (soft_sign) {
      float d = 1 + std::fabs(s) / softcap;
      return 1 / (d * d);
    }
    float t = std::tanh(s / softcap);
    return 1 - t * t;
  }
  // The cap in place over n (a multiple of kLanes) logits.
  void cap_row(float* s, int64_t n) const {
    if (softcap <= 0) return;
    const vf c = splat(softcap), inv = splat(1 / softcap);
    for (int64_t j = 0; j < n; j += kLanes) {
      vf x = load(s + j);
      if (soft_sign) {
        store(s + j, x / (1 + (x < 0 ? -x : x) * inv));
      } else {  // tanh(y) = 1 - 2 / (exp(2y) + 1), saturating cleanly at +-1
        store(s + j, c * (1 - 2 / (vexp(2 * x * inv) + 1)));
      }
    }
  }
  // semantics.sees_history, lane-wise: -1 where query (sq, pq) sees history key (sk, pk).
  vi sees_history(vi sq, vi pq, vi sk, vi pk) const {
    vi vis = ((sk == sq) | (sk == -sq)) & (sk > 0);
    if (causal) vis &= (sq < 0) | (pk <= pq);
    return vis;
  }
  // A plan entry, clamped so that a malformed plan can never index outside the arrays.
  int64_t clamp_count(int32_t c, int64_t limit) const {
    return std::max<int64_t>(0, std::min<int64_t>(c, limit));
  }
};

// d logits from p (in place in `sp`), dp - delta (`dp`) and the raw logits, over n (a multiple
// of kLanes) entries: ds = p (dp - delta) cap'(raw).
inline void logit_grads(const Problem& p, float* sp, const float* dp, const float* raw,
                        int64_t n) {
  const vf inv = splat(p.softcap > 0 ? 1 / p.softcap : 0.0f);
  for (int64_t j = 0; j < n; j += kLanes) {
    vf ds = load(sp + j) * load(dp + j);
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

// Tokens t0 .. t0 + n of head h of x [B, S, H, width], times `mul`, non-finite entries 0, into
// `rows` ([n][ld_rows], when given) and `cols` (transposed, [width][ld_cols], when given);
// per-token non-finite flags OR-ed into `bad` (when given).
template <typename D>
void gather(const typename D::T* x, int64_t seq, int64_t heads, int64_t width, int64_t b,
            int64_t h, int64_t t0, int64_t n, float mul, float* rows, int64_t ld_rows,
            float* cols, int64_t ld_cols, int32_t* bad) {
  for (int64_t t = 0; t < n; ++t) {
    const typename D::T* src = x + ((b * seq + t0 + t) * heads + h) * width;
    bool is_bad = false;
    for (int64_t d = 0; d < width; ++d) {
      const float v = D::to(src[d]);
      const bool ok = std::isfinite(v);
      is_bad |= !ok;
      const float y = ok ? v * mul : 0.0f;
      if (rows) rows[t * ld_rows + d] = y;
      if (cols) cols[d * ld_cols + t] = y;
    }
    if (bad && is_bad) bad[t] = -1;
  }
}

// Panels: every block in the layouts the dots read, packed once per call by their own tasks
// (so each q, k, v element is converted once, and first touched by the thread that fills it).
// Entries past a block's real tokens are zero, with segment id 0 (invisible).
// Panel memory, kept per calling thread and grown as needed: a fresh allocation per call
// would be mapped anew by the kernel and page-faulted in, which measured 0.5 ms of a 3.5 ms
// short call (B=2, 320 tokens). So a thread keeps its largest call's panels until it exits.
struct Workspace {
  std::unique_ptr<float[]> floats;
  std::unique_ptr<int32_t[]> ints;
  int64_t n_floats = 0, n_ints = 0;
  void reserve(int64_t f, int64_t i) {
    if (f > n_floats) floats.reset(new float[n_floats = f]);
    if (i > n_ints) ints.reset(new int32_t[n_ints = i]);
  }
};

struct Panels {
  int64_t floats_per_block, ints_per_block;
  float* floats;
  int32_t* ints;
  Panels(Workspace& memory, int64_t blocks, int64_t f, int64_t i)
      : floats_per_block(f), ints_per_block(i) {
    memory.reserve(blocks * f, blocks * i);
    floats = memory.floats.get();
    ints = memory.ints.get();
  }
  float* f(int64_t block) const { return floats + block * floats_per_block; }
  int32_t* i(int64_t block) const { return ints + block * ints_per_block; }
};

thread_local Workspace key_memory, query_memory;

// Key block (b, kv head, kb): kt [D][np] (k transposed), vs [np][dvp]; for the backward also
// ks [np][dp] and vt [Dv][np]. Ints: seg, pos, bad (-1 where k or v is non-finite) [np] each.
struct KeyPanel {
  const float *kt, *vs, *ks, *vt;
  const int32_t *seg, *pos, *bad;
  int64_t k0, nk;
  bool any_bad;
};

struct KeyPanels {
  const Problem& p;
  bool backward;
  Panels store;
  KeyPanels(const Problem& p, bool backward)
      : p(p), backward(backward),
        store(key_memory, p.batch * p.kv_heads * p.n_k,
              p.dim * p.np() + p.np() * p.dvp() + (backward ? p.np() * p.dp() + p.dim_v * p.np() : 0),
              3 * p.np() + 1) {}

  KeyPanel get(int64_t b, int64_t hk, int64_t kb) const {
    const int64_t block = (b * p.kv_heads + hk) * p.n_k + kb, np = p.np();
    const float* f = store.f(block);
    const int32_t* i = store.i(block);
    const int64_t k0 = kb * p.block_k;
    return KeyPanel{f, f + p.dim * np, backward ? f + p.dim * np + np * p.dvp() : nullptr,
                    backward ? f + p.dim * np + np * p.dvp() + np * p.dp() : nullptr,
                    i, i + np, i + 2 * np, k0, std::min(p.block_k, p.kv_len - k0),
                    i[3 * np] != 0};
  }

  template <typename D>
  void pack(int64_t block, const typename D::T* k, const typename D::T* v) const {
    const int64_t b = block / (p.kv_heads * p.n_k), hk = block / p.n_k % p.kv_heads;
    const int64_t kb = block % p.n_k, np = p.np(), dp = p.dp(), dvp = p.dvp();
    float* f = store.f(block);
    int32_t* in = store.i(block);
    std::fill_n(f, store.floats_per_block, 0.0f);
    std::fill_n(in, store.ints_per_block, 0);
    const int64_t k0 = kb * p.block_k, nk = std::min(p.block_k, p.kv_len - k0);
    float* kt = f;
    float* vs = kt + p.dim * np;
    float* ks = backward ? vs + np * dvp : nullptr;
    float* vt = backward ? ks + np * dp : nullptr;
    int32_t* bad = in + 2 * np;
    gather<D>(k, p.kv_len, p.kv_heads, p.dim, b, hk, k0, nk, 1.0f, ks, dp, kt, np, bad);
    gather<D>(v, p.kv_len, p.kv_heads, p.dim_v, b, hk, k0, nk, 1.0f, vs, dvp, vt, np, bad);
    std::copy_n(p.seg_k + b * p.kv_len + k0, nk, in);
    std::copy_n(p.pos_k + b * p.kv_len + k0, nk, in + np);
    in[3 * np] = std::any_of(bad, bad + nk, [](int32_t x) { return x != 0; });
  }
};

// ---- Threads: tasks 0..n-1 claimed from a shared counter by the caller and pool workers.

template <typename Fn>
void parallel_for(ffi::ThreadPool& pool, int64_t n, Fn fn) {
  struct State {
    std::atomic<int64_t> next{0}, done{0};
  };
  auto state = std::make_shared<State>();
  // The state outlives this call for workers that start late; `fn` does not, so a worker
  // only touches it after claiming a task, which cannot happen once all are done.
  auto work = [state, n, &fn]() {
    for (int64_t i; (i = state->next.fetch_add(1)) < n;) {
      fn(i);
      state->done.fetch_add(1, std::memory_order_release);
    }
  };
  int64_t threads = pool.num_threads();
  if (const char* cap = std::getenv("RANKATTN_CPU_THREADS")) {  // a user's cap, e.g. 1
    threads = std::min<int64_t>(threads, std::max(1L, std::strtol(cap, nullptr, 10)));
  }
  int64_t workers = std::min<int64_t>(threads, n) - 1;
  for (int64_t w = 0; w < workers; ++w) pool.Schedule([work]() { work(); });
  work();
  while (state->done.load(std::memory_order_acquire) < n) std::this_thread::yield();
}

// The first `full` of a visit list are full blocks (no mask), the rest partial.
struct Visits {
  const int32_t* index;
  int64_t count, full, limit;
};

inline Visits visits(const Problem& p, const int32_t* index, const int32_t* full,
                     const int32_t* count, int64_t list, int64_t limit) {
  const int64_t n = p.clamp_count(count[list], limit);
  return Visits{index + list * limit, n, p.clamp_count(full[list], n), limit};
}

// ---- Forward: one task per (b, kv head, query block), an online softmax over its key blocks.

template <typename D>
struct Forward {
  using T = typename D::T;
  const Problem& p;
  const KeyPanels& keys;
  const T *q, *k, *v;
  T* out;
  float* lse;

  void run(int64_t task) const {
    const int64_t b = task / (p.kv_heads * p.n_q), hk = task / p.n_q % p.kv_heads;
    const int64_t qb = task % p.n_q, g_len = p.group(), q0 = qb * p.block_q;
    const int64_t nq = std::min(p.block_q, p.q_len - q0), m = g_len * nq;
    const int64_t dp = p.dp(), dvp = p.dvp(), np = p.np(), nc = p.nc(), dvc = p.dvc();
    // Per-thread buffers, reused by every task the thread runs (see Workspace).
    thread_local std::vector<float> qs, s, acc, mx, l;
    thread_local std::vector<int32_t> poisoned;
    qs.resize(m * dp);
    s.resize(m * np);
    acc.assign(m * dvp, 0.0f);
    mx.assign(m, -kInf);
    l.assign(m, 0.0f);
    poisoned.assign(m, 0);
    for (int64_t g = 0; g < g_len; ++g) {
      gather<D>(q, p.q_len, p.q_heads, p.dim, b, hk * g_len + g, q0, nq, p.scale,
                qs.data() + g * nq * dp, dp, nullptr, 0, poisoned.data() + g * nq);
    }
    const int32_t* seg_q = p.seg_q + b * p.q_len + q0;
    const int32_t* pos_q = p.pos_q + b * p.q_len + q0;

    const Visits list = visits(p, p.kv_index, p.full_count, p.count, b * p.n_q + qb, p.n_k);
    for (int64_t e = 0; e < list.count; ++e) {
      const int32_t kb = list.index[e];
      if (kb < 0 || kb >= p.n_k) continue;
      const KeyPanel key = keys.get(b, hk, kb);
      const bool masked = e >= list.full;
      gemm<false>(m, nc, p.dim, qs.data(), dp, key.kt, np, s.data(), np);
      for (int64_t r = 0; r < m; ++r) {
        const int64_t t = r % nq;
        float* sr = s.data() + r * np;
        p.cap_row(sr, nc);
        if (masked) {
          const vi sq = splat_i(seg_q[t]), pq = splat_i(pos_q[t]);
          vi hit = splat_i(0);
          for (int64_t j = 0; j < nc; j += kLanes) {
            vi vis = p.sees_history(sq, pq, load_i(key.seg + j), load_i(key.pos + j));
            hit |= vis & load_i(key.bad + j);
            store(sr + j, vis ? load(sr + j) : splat(-kInf));
          }
          poisoned[r] |= any_lane(hit);
        } else {
          poisoned[r] |= key.any_bad;
          std::fill(sr + key.nk, sr + nc, -kInf);
        }
        vf top = splat(mx[r]);
        for (int64_t j = 0; j < nc; j += kLanes) {
          vf x = load(sr + j);
          top = x > top ? x : top;
        }
        const float row_max = max_lane(top);
        const float shift = std::isfinite(row_max) ? row_max : 0.0f;
        const float alpha = std::exp(mx[r] - shift);
        vf sum = splat(0.0f);
        for (int64_t j = 0; j < nc; j += kLanes) {
          vf pj = vexp(load(sr + j) - shift);
          store(sr + j, pj);
          sum += pj;
        }
        l[r] = l[r] * alpha + sum_lanes(sum);
        mx[r] = row_max;
        if (alpha != 1.0f) {
          float* ar = acc.data() + r * dvp;
          for (int64_t d = 0; d < dvc; d += kLanes) store(ar + d, load(ar + d) * alpha);
        }
      }
      gemm<true>(m, dvc, key.nk, s.data(), np, key.vs, dvp, acc.data(), dvp);
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
          const float s_own = p.cap(dot), m_new = std::max(mx[r], s_own);
          const float alpha = std::exp(mx[r] - m_new), p_own = std::exp(s_own - m_new);
          l[r] = l[r] * alpha + p_own;
          for (int64_t d = 0; d < p.dim_v; ++d) ar[d] = ar[d] * alpha + p_own * own_v[d];
          mx[r] = m_new;
          poisoned[r] |= own_bad;
        }
        const bool seen = l[r] != 0, nan = seen && poisoned[r];
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

// Query block (b, kv head, qb), rows r = g * nq + t (token q0 + t, query head hk * G + g):
// qs [mp][dp] (scaled q), qt [D][mp], dos [mp][dvp], dot [Dv][mp], shift [mp] (the lse; +inf
// where p must be 0), delta [mp]. Ints: seg, pos [mp].
struct QueryPanel {
  const float *qs, *qt, *dos, *dot, *shift, *delta;
  const int32_t *seg, *pos;
  int64_t q0, nq, m;
};

struct QueryPanels {
  const Problem& p;
  Panels store;
  explicit QueryPanels(const Problem& p)
      : p(p), store(query_memory, p.batch * p.kv_heads * p.n_q,
                    p.mp() * (p.dp() + p.dvp() + 2) + (p.dim + p.dim_v) * p.mp(), 2 * p.mp()) {}

  QueryPanel get(int64_t b, int64_t hk, int64_t qb) const {
    const int64_t block = (b * p.kv_heads + hk) * p.n_q + qb, mp = p.mp();
    const float* f = store.f(block);
    const int32_t* i = store.i(block);
    const float* dos = f + mp * p.dp() + p.dim * mp;
    const float* dot = dos + mp * p.dvp();
    const float* shift = dot + p.dim_v * mp;
    const int64_t q0 = qb * p.block_q, nq = std::min(p.block_q, p.q_len - q0);
    return QueryPanel{f, f + mp * p.dp(), dos, dot, shift, shift + mp, i, i + mp, q0, nq,
                      p.group() * nq};
  }

  template <typename D>
  void pack(int64_t block, const typename D::T* q, const typename D::T* d_out, const float* lse,
            const float* delta) const {
    const int64_t b = block / (p.kv_heads * p.n_q), hk = block / p.n_q % p.kv_heads;
    const int64_t qb = block % p.n_q, mp = p.mp(), dp = p.dp(), dvp = p.dvp();
    float* f = store.f(block);
    int32_t* in = store.i(block);
    std::fill_n(f, store.floats_per_block, 0.0f);
    std::fill_n(in, store.ints_per_block, 0);
    const QueryPanel panel = get(b, hk, qb);
    float* qs = f;
    float* qt = qs + mp * dp;
    float* dos = qt + p.dim * mp;
    float* dot = dos + mp * dvp;
    float* shift = dot + p.dim_v * mp;
    float* dl = shift + mp;
    std::fill_n(shift, mp, kInf);
    const int64_t g_len = p.group(), nq = panel.nq;
    for (int64_t g = 0; g < g_len; ++g) {
      const int64_t h = hk * g_len + g, r0 = g * nq;
      gather<D>(q, p.q_len, p.q_heads, p.dim, b, h, panel.q0, nq, p.scale, qs + r0 * dp, dp,
                qt + r0, mp, nullptr);
      gather<D>(d_out, p.q_len, p.q_heads, p.dim_v, b, h, panel.q0, nq, 1.0f, dos + r0 * dvp,
                dvp, dot + r0, mp, nullptr);
      for (int64_t t = 0; t < nq; ++t) {
        const int64_t row = (b * p.q_len + panel.q0 + t) * p.q_heads + h;
        shift[r0 + t] = lse[row] == -kInf ? kInf : lse[row];  // sees nothing: every p is 0
        dl[r0 + t] = delta[row];
        in[r0 + t] = p.seg_q[b * p.q_len + panel.q0 + t];
        in[mp + r0 + t] = p.pos_q[b * p.q_len + panel.q0 + t];
      }
    }
  }
};

thread_local Workspace grad_memory;

// dS^T of every visited block pair, written by the dk / dv tasks and read by the dq tasks
// (then 5 dots per pair, not 7), when it fits RANKATTN_CPU_BACKWARD_MB (default 1024 MiB);
// beyond that the dq tasks recompute S and dP. Both give bit-identical dq: the recomputed
// dots sum in the same order.
struct KeptGrads {
  const Problem& p;
  std::vector<int64_t> first;  // per (b, kv head, key block): its first slot
  int64_t block_floats;
  float* store = nullptr;

  KeptGrads(const Problem& p, int64_t budget_bytes)
      : p(p), first(p.batch * p.kv_heads * p.n_k + 1, 0), block_floats(p.block_k * p.mp()) {
    for (int64_t b = 0; b < p.batch; ++b) {
      for (int64_t hk = 0; hk < p.kv_heads; ++hk) {
        for (int64_t kb = 0; kb < p.n_k; ++kb) {
          const int64_t i = (b * p.kv_heads + hk) * p.n_k + kb;
          first[i + 1] = first[i] + visits(p, p.q_index, p.q_full_count, p.q_count,
                                           b * p.n_k + kb, p.n_q).count;
        }
      }
    }
    const int64_t floats = first.back() * block_floats;
    if (floats * static_cast<int64_t>(sizeof(float)) <= budget_bytes) {
      grad_memory.reserve(floats, 0);
      store = grad_memory.floats.get();
    }
  }
  bool kept() const { return store != nullptr; }
  float* slot(int64_t b, int64_t hk, int64_t kb, int64_t e) const {
    return store + (first[(b * p.kv_heads + hk) * p.n_k + kb] + e) * block_floats;
  }
  // The slot of the pair (kb, qb), or nullptr when kb's list lacks qb (a malformed plan).
  const float* find(int64_t b, int64_t hk, int64_t kb, int64_t qb) const {
    const Visits list = visits(p, p.q_index, p.q_full_count, p.q_count, b * p.n_k + kb, p.n_q);
    for (int64_t e = 0; e < list.count; ++e) {
      if (list.index[e] == qb) return slot(b, hk, kb, e);
    }
    return nullptr;
  }
};

template <typename D>
struct Backward {
  using T = typename D::T;
  const Problem& p;
  const KeyPanels& keys;
  const QueryPanels& queries;
  const KeptGrads& kept;  // q, k, v and dO are read from the panels only
  T *dq, *dk, *dv;

  // d logit of a candidate's own key from its scaled q, dO, own k and v, its shift and delta;
  // *prob = p.
  float own_grad(const float* qs, const float* dos, const float* own_k, const float* own_v,
                 float shift, float delta, float* prob) const {
    float dot = 0, dpv = 0;
    for (int64_t d = 0; d < p.dim; ++d) dot += qs[d] * own_k[d];
    for (int64_t d = 0; d < p.dim_v; ++d) dpv += dos[d] * own_v[d];
    *prob = std::exp(p.cap(dot) - shift);
    return *prob * (dpv - delta) * p.cap_grad(dot);
  }

  // dq of one query block of one kv head, over the key blocks it sees.
  void dq_task(int64_t task) const {
    const int64_t b = task / (p.kv_heads * p.n_q), hk = task / p.n_q % p.kv_heads;
    const int64_t qb = task % p.n_q, dp = p.dp(), dvp = p.dvp(), np = p.np(), nc = p.nc();
    const QueryPanel qp = queries.get(b, hk, qb);
    const int64_t m = qp.m;
    thread_local std::vector<float> s, dpm, raw, grad;  // per thread, as in Forward::run
    s.resize(m * np);
    dpm.resize(m * np);
    grad.assign(m * dp, 0.0f);
    const Visits list = visits(p, p.kv_index, p.full_count, p.count, b * p.n_q + qb, p.n_k);
    for (int64_t e = 0; e < list.count; ++e) {
      const int32_t kb = list.index[e];
      if (kb < 0 || kb >= p.n_k) continue;
      const KeyPanel key = keys.get(b, hk, kb);
      if (kept.kept()) {  // dQ += dS K, dS^T from the dk / dv task
        if (const float* ds_t = kept.find(b, hk, kb, qb)) {
          gemm<true, true>(m, p.dc(), key.nk, ds_t, p.mp(), key.ks, dp, grad.data(), dp);
        }
        continue;
      }
      const bool masked = e >= list.full;
      gemm<false>(m, nc, p.dim, qp.qs, dp, key.kt, np, s.data(), np);
      gemm<false>(m, nc, p.dim_v, qp.dos, dvp, key.vt, np, dpm.data(), np);
      if (p.softcap > 0) raw = s;
      for (int64_t r = 0; r < m; ++r) {
        float* sr = s.data() + r * np;
        float* dr = dpm.data() + r * np;
        p.cap_row(sr, nc);
        const vf shift = splat(qp.shift[r]), delta = splat(qp.delta[r]);
        const vi sq = splat_i(qp.seg[r]), pq = splat_i(qp.pos[r]);
        for (int64_t j = 0; j < nc; j += kLanes) {
          vf pj = vexp(load(sr + j) - shift);
          if (masked) pj = p.sees_history(sq, pq, load_i(key.seg + j), load_i(key.pos + j)) ? pj : 0;
          store(sr + j, pj);
          store(dr + j, load(dr + j) - delta);
        }
        logit_grads(p, sr, dr, raw.data() + (p.softcap > 0 ? r * np : 0), nc);
      }
      // Columns past the block's keys hold junk; the dot reads only the first nk.
      gemm<true>(m, p.dc(), key.nk, s.data(), np, key.ks, dp, grad.data(), dp);
    }

    const int64_t g_len = p.group();
    for (int64_t t = 0; t < qp.nq; ++t) {
      const int64_t i = qp.q0 + t;
      const bool own = p.own && qp.seg[t] < 0;
      const float *own_k = nullptr, *own_v = nullptr;  // the packed rows of key i
      if (own) {  // own implies q_len == kv_len, so key i exists
        const KeyPanel key = keys.get(b, hk, i / p.block_k);
        own_k = key.ks + (i % p.block_k) * dp;
        own_v = key.vs + (i % p.block_k) * dvp;
      }
      for (int64_t g = 0; g < g_len; ++g) {
        const int64_t r = g * qp.nq + t;
        float* gr = grad.data() + r * dp;
        if (own) {
          float prob;
          const float ds = own_grad(qp.qs + r * dp, qp.dos + r * dvp, own_k, own_v, qp.shift[r],
                                    qp.delta[r], &prob);
          for (int64_t d = 0; d < p.dim; ++d) gr[d] += ds * own_k[d];
        }
        T* o = dq + ((b * p.q_len + i) * p.q_heads + hk * g_len + g) * p.dim;
        for (int64_t d = 0; d < p.dim; ++d) o[d] = D::from(gr[d] * p.scale);
      }
    }
  }

  // dk, dv of one key block of one kv head, over the query blocks that see it.
  void dkv_task(int64_t task) const {
    const int64_t b = task / (p.kv_heads * p.n_k), hk = task / p.n_k % p.kv_heads;
    const int64_t kb = task % p.n_k, dp = p.dp(), dvp = p.dvp(), mp = p.mp(), mc = p.mc();
    const KeyPanel key = keys.get(b, hk, kb);
    const int64_t nk = key.nk;
    thread_local std::vector<float> st, dpt, raw, dk_acc, dv_acc;  // as in Forward::run
    st.resize(nk * mp);
    dpt.resize(nk * mp);
    dk_acc.assign(nk * dp, 0.0f);
    dv_acc.assign(nk * dvp, 0.0f);
    const Visits list = visits(p, p.q_index, p.q_full_count, p.q_count, b * p.n_k + kb, p.n_q);
    for (int64_t e = 0; e < list.count; ++e) {
      const int32_t qb = list.index[e];
      if (qb < 0 || qb >= p.n_q) continue;
      const QueryPanel qp = queries.get(b, hk, qb);
      const bool masked = e >= list.full;
      gemm<false>(nk, mc, p.dim, key.ks, dp, qp.qt, mp, st.data(), mp);
      gemm<false>(nk, mc, p.dim_v, key.vs, dvp, qp.dot, mp, dpt.data(), mp);
      if (p.softcap > 0) raw = st;
      for (int64_t j = 0; j < nk; ++j) {  // p^T: columns are query rows, each with its lse
        float* sr = st.data() + j * mp;
        float* dr = dpt.data() + j * mp;
        p.cap_row(sr, mc);
        const vi sk = splat_i(key.seg[j]), pk = splat_i(key.pos[j]);
        for (int64_t r = 0; r < mc; r += kLanes) {  // padded rows: shift +inf, so p = 0
          vf pr = vexp(load(sr + r) - load(qp.shift + r));
          if (masked) pr = p.sees_history(load_i(qp.seg + r), load_i(qp.pos + r), sk, pk) ? pr : 0;
          store(sr + r, pr);
          store(dr + r, load(dr + r) - load(qp.delta + r));
        }
      }
      gemm<true>(nk, p.dvc(), qp.m, st.data(), mp, qp.dos, dvp, dv_acc.data(), dvp);
      for (int64_t j = 0; j < nk; ++j) {
        logit_grads(p, st.data() + j * mp, dpt.data() + j * mp,
                    raw.data() + (p.softcap > 0 ? j * mp : 0), mc);
      }
      gemm<true>(nk, p.dc(), qp.m, st.data(), mp, qp.qs, dp, dk_acc.data(), dp);
      if (kept.kept()) std::copy_n(st.data(), nk * mp, kept.slot(b, hk, kb, e));
    }

    if (p.own) {  // each candidate key's own query rows
      std::vector<float> q_row(p.dim), do_row(p.dim_v);
      const int64_t g_len = p.group();
      for (int64_t j = 0; j < nk; ++j) {
        const int64_t i = key.k0 + j;
        if (p.seg_q[b * p.q_len + i] >= 0) continue;
        const QueryPanel qp = queries.get(b, hk, i / p.block_q);
        const int64_t t = i - qp.q0;
        for (int64_t g = 0; g < g_len; ++g) {
          const int64_t r = g * qp.nq + t;
          float prob;
          const float ds = own_grad(qp.qs + r * dp, qp.dos + r * dvp, key.ks + j * dp,
                                    key.vs + j * dvp, qp.shift[r], qp.delta[r], &prob);
          for (int64_t d = 0; d < p.dim; ++d) dk_acc[j * dp + d] += ds * qp.qs[r * dp + d];
          for (int64_t d = 0; d < p.dim_v; ++d) dv_acc[j * dvp + d] += prob * qp.dos[r * dvp + d];
        }
      }
    }
    for (int64_t j = 0; j < nk; ++j) {
      T* ok = dk + ((b * p.kv_len + key.k0 + j) * p.kv_heads + hk) * p.dim;
      T* ov = dv + ((b * p.kv_len + key.k0 + j) * p.kv_heads + hk) * p.dim_v;
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
    const T* kp = static_cast<const T*>(k.untyped_data());
    const T* vp = static_cast<const T*>(v.untyped_data());
    KeyPanels keys(p, false);
    parallel_for(pool, p.batch * p.kv_heads * p.n_k,
                 [&](int64_t block) { keys.pack<D>(block, kp, vp); });
    Forward<D> kernel{p, keys, static_cast<const T*>(q.untyped_data()), kp, vp,
                      static_cast<T*>(out->untyped_data()), lse->typed_data()};
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
    const T* qp = static_cast<const T*>(q.untyped_data());
    const T* kp = static_cast<const T*>(k.untyped_data());
    const T* vp = static_cast<const T*>(v.untyped_data());
    const T* dop = static_cast<const T*>(d_out.untyped_data());
    KeyPanels keys(p, true);
    QueryPanels queries(p);
    const int64_t key_tasks = p.batch * p.kv_heads * p.n_k;
    const int64_t tasks = key_tasks + p.batch * p.kv_heads * p.n_q;
    parallel_for(pool, tasks, [&](int64_t t) {
      if (t < key_tasks) {
        keys.pack<D>(t, kp, vp);
      } else {
        queries.pack<D>(t - key_tasks, qp, dop, lse.typed_data(), delta.typed_data());
      }
    });
    int64_t budget_mib = 1024;
    if (const char* env = std::getenv("RANKATTN_CPU_BACKWARD_MB")) {
      budget_mib = std::max(0L, std::strtol(env, nullptr, 10));
    }
    KeptGrads kept(p, budget_mib << 20);
    Backward<D> kernel{p, keys, queries, kept, static_cast<T*>(dq->untyped_data()),
                       static_cast<T*>(dk->untyped_data()), static_cast<T*>(dv->untyped_data())};
    if (kept.kept()) {  // the dq tasks read what the dk / dv tasks keep
      parallel_for(pool, key_tasks, [&](int64_t t) { kernel.dkv_task(t); });
      parallel_for(pool, tasks - key_tasks, [&](int64_t t) { kernel.dq_task(t); });
    } else {  // dk / dv tasks and dq tasks write disjoint outputs
      parallel_for(pool, tasks, [&](int64_t t) {
        if (t < key_tasks) {
          kernel.dkv_task(t);
        } else {
          kernel.dq_task(t - key_tasks);
        }
      });
    }
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
