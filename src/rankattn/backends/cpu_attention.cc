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
// Serving's entry points: the forward over paged K / V (a page table per batch row, each
// candidate's own key from separate arrays), and Quest's page bounds (one dot of the
// queries' [q+ | q-] with the pages' key [max; min]).
//
// Every dot is C[M, N] (+)= A[M, K] B[K, N]: float32 on one register-tiled
// microkernel, bfloat16 on AMX tiles or VDPBF16PS. q, k, v (and in the backward
// dO) are read in their own [B, S, H, D] layout and dtype, and packed once per
// call into panels, the layouts the dots read, padded with zeros to what the dots
// read: no loop ever reads past a buffer.

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <limits>
#include <memory>
#include <new>
#include <numeric>
#include <string>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

// AMX comes with AVX-512 BF16 (Sapphire Rapids on), whose VDPBF16PS is its fallback.
#if defined(__AVX512BF16__) && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define RANKATTN_AMX 1
#include <sys/syscall.h>
#include <unistd.h>
#endif
#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

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

// ---- Dot elements. The dots read float32, except that bfloat16 inputs on a CPU with AMX or
// AVX-512 BF16 stay bfloat16: exact products summed in float32, on AMX tiles (TDPBF16PS, 2.5-3x
// the float32 FMA rate of a Sapphire Rapids core on 128-wide blocks) or with VDPBF16PS (twice
// the FMA rate on Zen 4, but half of it on Sapphire Rapids, which is why AMX comes first). p
// and ds are then rounded to bfloat16 before the dots that take them, as flash attention does
// on GPUs (tests/tolerances.py allows for it). q is never pre-scaled, so no scale is rounded
// into it: the logits are scaled in float32.

using bf16_t = uint16_t;  // a bfloat16's bits, as the dots read them

template <typename D>
struct DotElement {  // the element type of D's panels
  using type = float;
};

#if defined(__AVX512BF16__)
template <>
struct DotElement<BF16> {
  using type = bf16_t;
};
#endif

// What a dot of element type E reads past its operands' sizes: the contraction length is
// rounded up to kDepth (AMX: one 32-element tile row; VDPBF16PS: a pair), and the rows of A
// and C to kRows (AMX: 16-row tiles). Every operand buffer is sized and zero-padded for it.
#if defined(RANKATTN_AMX)
constexpr int64_t kBf16Depth = 32, kBf16Rows = 16;
#else
constexpr int64_t kBf16Depth = 2, kBf16Rows = 1;
#endif
template <typename E>
constexpr int64_t kDepth = std::is_same_v<E, float> ? 1 : kBf16Depth;
template <typename E>
constexpr int64_t kRows = std::is_same_v<E, float> ? 1 : kBf16Rows;
template <typename E>
constexpr int64_t kPair = std::is_same_v<E, float> ? 1 : 2;  // elements side by side

// Two layouts of a matrix X that a dot contracts over one of its dimensions:
//  - rows, X[i][k] at i * ld + k with k contracted: an A operand;
//  - panel, X[k][n] with k contracted: at k * ld + n in float32; in bfloat16 the pairs
//    (k, k + 1) of a column side by side, ((k / 2) * ld + n) * 2 + k % 2, as VDPBF16PS and
//    AMX's B tiles take them: a B operand.
// In float32 a matrix's rows layout is its panel layout, so what one dot contracts over its
// rows and another over its columns is stored once; in bfloat16, twice.
template <typename E>
constexpr bool kRowsArePanel = std::is_same_v<E, float>;
template <typename E>
inline int64_t panel_index(int64_t k, int64_t n, int64_t ld) {
  return ((k / kPair<E>) * ld + n) * kPair<E> + k % kPair<E>;
}
template <typename E>
inline int64_t panel_size(int64_t k, int64_t ld) {  // a panel of k contraction rows, padded
  return round_up(k, kDepth<E>) * ld;
}
template <typename E>
inline int64_t rows_size(int64_t rows, int64_t ld) {  // an A or C operand of `rows` rows
  return round_up(rows, kRows<E>) * ld;
}

// The storage dtype whose bits an element E of the dots holds, and its conversions.
template <typename E>
using ElementDtype = std::conditional_t<std::is_same_v<E, float>, F32, BF16>;
template <typename E>
inline E to_element(float x) {
  return ElementDtype<E>::from(x);
}
template <typename E>
inline float to_float(E x) {
  return ElementDtype<E>::to(x);
}

template <typename E>
struct DotOps {  // float32: a broadcast of A times a vector of B, fused multiply-add
  using B = vf;
  static B load_b(const float* p) { return load(p); }
  static B broadcast(const float* a) { return splat(*a); }
  static vf madd(vf acc, B a, B b) { return acc + a * b; }
};

#if defined(__AVX512BF16__)
static_assert(kLanes == 16, "AVX-512 BF16 comes with 16-lane float vectors");
template <>
struct DotOps<bf16_t> {  // bfloat16: a broadcast pair of A times 16 pairs of B, VDPBF16PS
  using B = __m512bh;
  static B load_b(const bf16_t* p) {
    B v;
    std::memcpy(&v, p, sizeof v);
    return v;
  }
  static B broadcast(const bf16_t* a) {
    int32_t pair;
    std::memcpy(&pair, a, sizeof pair);
    return (B)_mm512_set1_epi32(pair);
  }
  static vf madd(vf acc, B a, B b) { return _mm512_dpbf16_ps(acc, a, b); }
};
#endif

// ---- The one dot: C[M, N] (+)= A[M, K] B[K, N], N a multiple of kColTile, A rows, B a panel.

template <int R, bool kAccumulate, typename E>
inline void tile(int64_t k_len, const E* a, int64_t lda, const E* b, int64_t ldb, float* c,
                 int64_t ldc) {
  using Ops = DotOps<E>;
  vf acc[R][2];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) {
    acc[r][0] = kAccumulate ? load(c + r * ldc) : splat(0.0f);
    acc[r][1] = kAccumulate ? load(c + r * ldc + kLanes) : splat(0.0f);
  }
  for (int64_t k = 0; k < k_len; k += kPair<E>) {
    const auto b0 = Ops::load_b(b + panel_index<E>(k, 0, ldb));
    const auto b1 = Ops::load_b(b + panel_index<E>(k, kLanes, ldb));
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const auto x = Ops::broadcast(a + r * lda + k);
      acc[r][0] = Ops::madd(acc[r][0], x, b0);
      acc[r][1] = Ops::madd(acc[r][1], x, b1);
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) {
    store(c + r * ldc, acc[r][0]);
    store(c + r * ldc + kLanes, acc[r][1]);
  }
}

template <bool kAccumulate, typename E, int R = kRowTile>
inline void tail_rows(int rows, int64_t k_len, const E* a, int64_t lda, const E* b, int64_t ldb,
                      float* c, int64_t ldc) {
  if constexpr (R > 0) {
    if (rows == R) return tile<R, kAccumulate>(k_len, a, lda, b, ldb, c, ldc);
    tail_rows<kAccumulate, E, R - 1>(rows, k_len, a, lda, b, ldb, c, ldc);
  }
}

#if defined(RANKATTN_AMX)
// AMX needs the kernel's permission once per process (Linux 5.16+); without it, VDPBF16PS.
bool amx_usable() {
  static const bool usable = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */,
                                     18 /* XFEATURE_XTILEDATA */) == 0;
  return usable;
}

struct TileConfig {  // the ldtilecfg operand, palette 1
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t bytes_per_row[16] = {};
  uint8_t rows[16] = {};
};

// C in 32 x 32 blocks of four 16 x 16 tiles (0-3), from two A tiles (4, 5: 16 rows x 32 k)
// and two B tiles (6, 7: 16 pairs of k x 16 columns). Configured per call and released
// after, so no tile state outlives it on XLA's threads.
template <bool kAccumulate>
void amx_gemm(int64_t m, int64_t n, int64_t k_len, const bf16_t* a, int64_t lda,
              const bf16_t* b, int64_t ldb, float* c, int64_t ldc) {
  TileConfig config;
  for (int t = 0; t < 8; ++t) config.bytes_per_row[t] = 64, config.rows[t] = 16;
  _tile_loadconfig(&config);
  const int64_t a_stride = lda * 2, b_stride = ldb * 4, c_stride = ldc * 4;
  for (int64_t i = 0; i < m; i += 32) {
    const bool two = i + 16 < m;  // a second 16-row half
    for (int64_t j = 0; j < n; j += 32) {
      float* c0 = c + i * ldc + j;
      float* c1 = c0 + 16 * ldc;
      if (kAccumulate) {
        _tile_loadd(0, c0, c_stride);
        _tile_loadd(1, c0 + 16, c_stride);
        if (two) _tile_loadd(2, c1, c_stride);
        if (two) _tile_loadd(3, c1 + 16, c_stride);
      } else {
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
      }
      for (int64_t k = 0; k < k_len; k += 32) {
        _tile_loadd(4, a + i * lda + k, a_stride);
        _tile_loadd(6, b + panel_index<bf16_t>(k, j, ldb), b_stride);
        _tile_loadd(7, b + panel_index<bf16_t>(k, j + 16, ldb), b_stride);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        if (two) {
          _tile_loadd(5, a + (i + 16) * lda + k, a_stride);
          _tile_dpbf16ps(2, 5, 6);
          _tile_dpbf16ps(3, 5, 7);
        }
      }
      _tile_stored(0, c0, c_stride);
      _tile_stored(1, c0 + 16, c_stride);
      if (two) _tile_stored(2, c1, c_stride);
      if (two) _tile_stored(3, c1 + 16, c_stride);
    }
  }
  _tile_release();
}
#endif

template <bool kAccumulate, typename E>
void gemm(int64_t m, int64_t n, int64_t k_len, const E* a, int64_t lda, const E* b, int64_t ldb,
          float* c, int64_t ldc) {
#if defined(RANKATTN_AMX)
  if constexpr (std::is_same_v<E, bf16_t>) {
    if (amx_usable()) return amx_gemm<kAccumulate>(m, n, k_len, a, lda, b, ldb, c, ldc);
  }
#endif
  for (int64_t j = 0; j < n; j += kColTile) {  // a B panel stays in L1 across the rows
    const E* bj = b + panel_index<E>(0, j, ldb);
    int64_t i = 0;
    for (; i + kRowTile <= m; i += kRowTile) {
      tile<kRowTile, kAccumulate>(k_len, a + i * lda, lda, bj, ldb, c + i * ldc + j, ldc);
    }
    if (i < m) {
      tail_rows<kAccumulate>(static_cast<int>(m - i), k_len, a + i * lda, lda, bj, ldb,
                             c + i * ldc + j, ldc);
    }
  }
}

// ---- Settings: the environment, read once per process (by the first call), in one place.

struct Settings {
  int64_t max_threads;     // RANKATTN_CPU_THREADS: at most this many threads per call
  int64_t backward_bytes;  // RANKATTN_CPU_BACKWARD_MB, in bytes: the dS a backward keeps
  // Tests only: RANKATTN_CPU_FAIL_ALLOC=caller:<n> or pool:<n> fails the n-th allocation
  // (from 1) of the kernel's buffers on the threads that call the kernel, or on XLA's pool
  // workers, once per process.
  bool fail_in_pool;
  int64_t fail_at;  // 0: never

  static int64_t number(const char* name, int64_t fallback, int64_t lo, int64_t hi) {
    const char* text = std::getenv(name);
    return text ? std::clamp<int64_t>(std::strtoll(text, nullptr, 10), lo, hi) : fallback;
  }
  static Settings from_environment() {
    constexpr int64_t kMax = std::numeric_limits<int64_t>::max();
    Settings s{};
    s.max_threads = number("RANKATTN_CPU_THREADS", kMax, 1, kMax);
    // Clamped so that the bytes fit an int64_t (a larger budget keeps every pair anyway).
    s.backward_bytes = number("RANKATTN_CPU_BACKWARD_MB", 1024, 0, kMax >> 20) << 20;
    if (const char* fail = std::getenv("RANKATTN_CPU_FAIL_ALLOC")) {
      s.fail_in_pool = std::strncmp(fail, "pool:", 5) == 0;
      if (s.fail_in_pool || std::strncmp(fail, "caller:", 7) == 0) {
        s.fail_at = std::max<int64_t>(0, std::strtoll(std::strchr(fail, ':') + 1, nullptr, 10));
      }
    }
    return s;
  }
};

const Settings& settings() {
  static const Settings once = Settings::from_environment();
  return once;
}

// ---- Memory: every buffer of the kernel is allocated here, so that a failure says how many
// bytes were asked for (RA126, see `guarded`) and the tests can inject one.

struct OutOfMemory : std::bad_alloc {
  int64_t bytes;
  explicit OutOfMemory(int64_t bytes) : bytes(bytes) {}
};

thread_local bool on_pool_worker = false;  // while a pool worker runs parallel_for's tasks

bool injected_failure() {
  const Settings& s = settings();
  if (s.fail_at == 0 || on_pool_worker != s.fail_in_pool) return false;
  static std::atomic<int64_t> count{0};
  return count.fetch_add(1) + 1 == s.fail_at;
}

void* allocate_bytes(int64_t bytes, int64_t alignment) {
  void* x = nullptr;
  if (!injected_failure()) {
    x = alignment <= static_cast<int64_t>(alignof(std::max_align_t))
            ? std::malloc(bytes)
            : std::aligned_alloc(alignment, round_up(bytes, alignment));
  }
  if (!x) throw OutOfMemory(bytes);
  return x;
}

// std::vector's allocator for the kernel's buffers.
template <typename T>
struct Allocator {
  using value_type = T;
  Allocator() = default;
  template <typename U>
  Allocator(const Allocator<U>&) {}
  T* allocate(size_t n) {
    return static_cast<T*>(allocate_bytes(static_cast<int64_t>(n * sizeof(T)), alignof(T)));
  }
  void deallocate(T* x, size_t) { std::free(x); }
  bool operator==(const Allocator&) const { return true; }
  bool operator!=(const Allocator&) const { return false; }
};
template <typename T>
using Vector = std::vector<T, Allocator<T>>;

// bfloat16 bits of each lane, rounded to nearest even (finite and infinite lanes; p and ds,
// the only values rounded here, are never NaN).
typedef uint32_t vu __attribute__((vector_size(kLanes * sizeof(uint32_t))));
typedef uint16_t vh __attribute__((vector_size(kLanes * sizeof(uint16_t))));
inline vu bf16_bits(vf x) {
  vu bits;
  std::memcpy(&bits, &x, sizeof bits);
  return (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
}

// p or ds rows x[rows][ld] (float, their first `cols` columns) as an A operand of the dots'
// element type: x itself in float32; in bfloat16 a rounded copy in `buffer`, zero from
// column `cols` to what the dot reads, and in the padded rows.
template <typename E>
const E* dot_rows(const float* x, int64_t rows, int64_t cols, int64_t ld,
                  Vector<E>& buffer) {
  if constexpr (std::is_same_v<E, float>) {
    return x;
  } else {
    buffer.resize(rows_size<E>(rows, ld));
    const int64_t width = round_up(cols, kLanes);  // <= ld: rows are padded to whole vectors
    const int64_t read = std::max(width, round_up(cols, kDepth<E>));  // <= ld as well
    for (int64_t r = 0; r < rows; ++r) {
      E* out = buffer.data() + r * ld;
      for (int64_t c = 0; c < width; c += kLanes) {
        const vh h = __builtin_convertvector(bf16_bits(load(x + r * ld + c)), vh);
        std::memcpy(out + c, &h, sizeof h);
      }
      std::fill(out + cols, out + read, 0);
    }
    std::fill(buffer.data() + rows * ld, buffer.data() + buffer.size(), 0);
    return buffer.data();
  }
}

// ds^T x[rows][ld] (float: rows are keys, columns query rows, the first `cols` valid) as the
// B panel of dQ^T += K^T dS^T, `rows` contraction rows, into `out` (panel_size(rows, ld)).
template <typename E>
void keep_panel(const float* x, int64_t rows, int64_t cols, int64_t ld, E* out) {
  if constexpr (std::is_same_v<E, float>) {
    std::copy_n(x, rows * ld, out);
  } else {
    const int64_t width = round_up(cols, kLanes);
    for (int64_t k = 0; k < rows; k += 2) {
      for (int64_t c = 0; c < width; c += kLanes) {
        const vu low = bf16_bits(load(x + k * ld + c));
        const vu high = k + 1 < rows ? bf16_bits(load(x + (k + 1) * ld + c)) : vu{};
        const vu pairs = low | (high << 16);
        std::memcpy(out + panel_index<E>(k, c, ld), &pairs, sizeof pairs);
      }
      std::fill(out + panel_index<E>(k, width, ld), out + panel_index<E>(k, ld, ld), 0);
    }
    std::fill(out + panel_index<E>(round_up(rows, 2), 0, ld), out + panel_size<E>(rows, ld), 0);
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
// Horizontal max and sum as a tree of halves, in registers (per row and block, a lane-by-lane
// loop measured a quarter of the forward's softmax pass, and halves taken through memory kept
// the running sum on the stack).
template <size_t kOffset, typename V, size_t... kLane>
inline auto lanes(V x, std::index_sequence<kLane...>) {
  return __builtin_shufflevector(x, x, (kOffset + kLane)...);
}
template <int N, typename V, typename Op>
inline float reduce(V x, Op op) {
  if constexpr (N == 1) {
    return x[0];
  } else {
    const auto half = std::make_index_sequence<N / 2>();
    return reduce<N / 2>(op(lanes<0>(x, half), lanes<N / 2>(x, half)), op);
  }
}
inline float max_lane(vf x) {
  return reduce<kLanes>(x, [](auto a, auto b) { return a > b ? a : b; });
}
inline float sum_lanes(vf x) {
  return reduce<kLanes>(x, [](auto a, auto b) { return a + b; });
}

struct Problem {
  int64_t batch, q_len, kv_len, q_heads, kv_heads, dim, dim_v;
  int64_t block_q, block_k, n_q, n_k;
  float scale, softcap;
  bool soft_sign, causal, own;
  const int32_t *seg_q, *seg_k, *pos_q, *pos_k;
  const int32_t *kv_index, *full_count, *count;     // [B, nQ, nK], [B, nQ], [B, nQ]
  const int32_t *q_index, *q_full_count, *q_count;  // [B, nK, nQ], [B, nK], [B, nK]
  // Paged keys (serving's cache): key t of batch row b is slot t % page_size of page
  // page_table[b][t / page_size] of k, v [N, page_size, D] (one kv head). page_size 0: k, v
  // are [B, S, Hkv, D].
  const int32_t* page_table = nullptr;
  int64_t page_size = 0, num_pages = 0;
  // The own key of query i from own_k / own_v [B, Sq, Hkv, D] (serving's candidates, whose
  // keys are not in k / v), instead of key i of k / v. Null: from k / v.
  const void *own_k = nullptr, *own_v = nullptr;

  int64_t group() const { return q_heads / kv_heads; }
  // Element offsets of token t of head h in q-like [B, Sq, H, width] and in k / v. A page
  // table entry outside [0, N) reads page 0 or N - 1: never out of bounds, and the mask
  // (the caller's segment ids) decides whether the token is seen.
  int64_t q_offset(int64_t b, int64_t h, int64_t t, int64_t width) const {
    return ((b * q_len + t) * q_heads + h) * width;
  }
  int64_t kv_offset(int64_t b, int64_t h, int64_t t, int64_t width) const {
    if (page_size == 0) return ((b * kv_len + t) * kv_heads + h) * width;
    const int64_t entry = page_table[b * (kv_len / page_size) + t / page_size];
    const int64_t page = std::clamp<int64_t>(entry, 0, num_pages - 1);
    return ((page * kv_heads + h) * page_size + t % page_size) * width;
  }
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
  // Logits from the dots of unscaled q and k, in place over n (a multiple of kLanes) entries:
  // times the scale, then the cap. `raw` (when given) receives them before the cap, for cap'.
  void logits(float* s, int64_t n, float* raw = nullptr) const {
    const vf mul = splat(scale), c = splat(softcap);
    const vf inv = splat(softcap > 0 ? 1 / softcap : 0.0f);
    for (int64_t j = 0; j < n; j += kLanes) {
      vf x = load(s + j) * mul;
      if (raw) store(raw + j, x);
      if (softcap > 0) {
        if (soft_sign) {
          x = x / (1 + (x < 0 ? -x : x) * inv);
        } else {  // tanh(y) = 1 - 2 / (exp(2y) + 1), saturating cleanly at +-1
          x = c * (1 - 2 / (vexp(2 * x * inv) + 1));
        }
      }
      store(s + j, x);
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

// A row of x as E, non-finite entries 0; whether any was non-finite. Tested on the bits, so
// that the loop vectorises (packing measured 12% of the bf16 forward with std::isfinite).
template <typename D, typename E>
bool finite_row(const typename D::T* src, int64_t width, E* dst) {
  uint32_t any = 0;  // an integer OR, which vectorises (a bool's does not)
  if constexpr (std::is_same_v<D, BF16> && std::is_same_v<E, bf16_t>) {
    for (int64_t d = 0; d < width; ++d) {
      const bf16_t x = src[d];
      const uint32_t inf_or_nan = (x & 0x7f80u) == 0x7f80u;
      any |= inf_or_nan;
      dst[d] = inf_or_nan ? 0 : x;
    }
  } else {
    for (int64_t d = 0; d < width; ++d) {
      const float v = D::to(src[d]);
      uint32_t bits;
      std::memcpy(&bits, &v, sizeof bits);
      const uint32_t inf_or_nan = (bits & 0x7f800000u) == 0x7f800000u;
      any |= inf_or_nan;
      dst[d] = to_element<E>(inf_or_nan ? 0.0f : v);
    }
  }
  return any != 0;
}

// dst[d * ld_dst + i] = src[i * ld_src + d] for i < n, d < width: 8 x 8 blocks transposed in
// registers (three rounds of interleaving rows i and i + 4 turn rows into columns), the edges
// element by element. (An element-by-element loop measured 44% of packing a key block.)
typedef float v8f __attribute__((vector_size(8 * sizeof(float))));

void transpose(const float* src, int64_t ld_src, int64_t n, int64_t width, float* dst,
               int64_t ld_dst) {
  int64_t i0 = 0;
  for (; i0 + 8 <= n; i0 += 8) {
    int64_t d0 = 0;
    for (; d0 + 8 <= width; d0 += 8) {
      v8f r[8];
      for (int j = 0; j < 8; ++j) std::memcpy(&r[j], src + (i0 + j) * ld_src + d0, sizeof(v8f));
      for (int round = 0; round < 3; ++round) {
        v8f t[8];
        for (int j = 0; j < 4; ++j) {
          t[2 * j] = __builtin_shufflevector(r[j], r[j + 4], 0, 8, 1, 9, 2, 10, 3, 11);
          t[2 * j + 1] = __builtin_shufflevector(r[j], r[j + 4], 4, 12, 5, 13, 6, 14, 7, 15);
        }
        std::copy(t, t + 8, r);
      }
      for (int j = 0; j < 8; ++j) std::memcpy(dst + (d0 + j) * ld_dst + i0, &r[j], sizeof(v8f));
    }
    for (; d0 < width; ++d0) {
      for (int64_t i = i0; i < i0 + 8; ++i) dst[d0 * ld_dst + i] = src[i * ld_src + d0];
    }
  }
  for (; i0 < n; ++i0) {
    for (int64_t d = 0; d < width; ++d) dst[d * ld_dst + i0] = src[i0 * ld_src + d];
  }
}

// Where gather puts tokens X[n][width] of one head, token t at row `first` + t (null: not
// wanted): the rows of X (contracted over d) and of X^T (over tokens), and the panels of X
// (over tokens) and of X^T (over d).
template <typename E>
struct Destination {
  E* rows = nullptr;
  int64_t ld_rows = 0;
  E* rows_t = nullptr;
  int64_t ld_rows_t = 0;
  E* panel = nullptr;
  int64_t ld_panel = 0;
  E* panel_t = nullptr;
  int64_t ld_panel_t = 0;
  int64_t first = 0;
};

// n tokens of `width` elements, token t at row(t), non-finite entries 0, into `to`;
// per-token non-finite flags OR-ed into `bad` (when given).
template <typename D, typename E, typename Row>
void gather(Row row, int64_t width, int64_t n, const Destination<E>& to, int32_t* bad) {
  // The rows go straight to the destination's rows, or in float32 to its panel (the same
  // layout); else to a per-thread scratch that the other layouts are copied from. (A fresh
  // scratch per call, allocated and zeroed, and a panel copied from it, measured a fifth of
  // a 64-query forward over 1024 keys.)
  const bool rows_in_panel = !to.rows && to.panel && kRowsArePanel<E>;
  thread_local Vector<E> scratch;
  E* rows;
  int64_t ld;
  if (to.rows || rows_in_panel) {
    ld = to.rows ? to.ld_rows : to.ld_panel;
    rows = (to.rows ? to.rows : to.panel) + to.first * ld;
  } else {
    scratch.resize(n * width);
    rows = scratch.data(), ld = width;
  }
  for (int64_t t = 0; t < n; ++t) {
    const bool is_bad = finite_row<D, E>(row(t), width, rows + t * ld);
    if (bad && is_bad) bad[t] = -1;
  }
  if (to.panel && !rows_in_panel) {
    for (int64_t t = 0; t < n; ++t) {
      for (int64_t d = 0; d < width; ++d) {
        to.panel[panel_index<E>(to.first + t, d, to.ld_panel)] = rows[t * ld + d];
      }
    }
  }
  // The transposed layouts 16 tokens at a time: their rows stay in L1, and the writes along
  // tokens are contiguous (writes along d, one cache line each, measured 13% of a short call).
  if (!to.rows_t && !to.panel_t) return;
  if constexpr (kRowsArePanel<E>) {  // float32: both are X^T [width][tokens]
    for (auto [x, ld_t] : {std::pair{to.rows_t, to.ld_rows_t}, {to.panel_t, to.ld_panel_t}}) {
      if (x) transpose(rows, ld, n, width, x + to.first, ld_t);
    }
    return;
  }
  for (int64_t start = 0; start < n; start += 16) {
    const int64_t end = std::min(n, start + 16);
    for (int64_t d = 0; d < width; ++d) {
      for (int64_t t = start; t < end; ++t) {
        const int64_t i = to.first + t;
        if (to.rows_t) to.rows_t[d * to.ld_rows_t + i] = rows[t * ld + d];
        if (to.panel_t) to.panel_t[panel_index<E>(d, i, to.ld_panel_t)] = rows[t * ld + d];
      }
    }
  }
}

// Panels: every block in the layouts the dots read, packed once per call by their own tasks
// (so each q, k, v element is converted once, and first touched by the thread that fills it).
// Entries past a block's real tokens are zero, with segment id 0 (invisible).
// Panel memory, kept per calling thread and grown as needed: a fresh allocation per call
// would be mapped anew by the kernel and page-faulted in, which measured 0.5 ms of a 3.5 ms
// short call (B=2, 320 tokens). So a thread keeps its largest call's panels until it exits.
struct Workspace {
  struct Free {
    void operator()(std::byte* x) const { std::free(x); }
  };
  std::unique_ptr<std::byte[], Free> bytes;
  int64_t size = 0;
  std::byte* reserve(int64_t n) {
    if (n > size) {  // the old contents are not kept: freed first, for a lower peak
      bytes.reset();
      size = 0;
      bytes.reset(static_cast<std::byte*>(allocate_bytes(round_up(n, 64), 64)));
      size = round_up(n, 64);  // only once the buffer exists (else the next call believes it)
    }
    return bytes.get();
  }
};

// Per block: `elements` of the dots' type E, `floats` and `ints`, each region 64-byte aligned.
template <typename E>
struct Panels {
  int64_t e_bytes, f_bytes, block_bytes;
  std::byte* base;
  Panels(Workspace& memory, int64_t blocks, int64_t elements, int64_t floats, int64_t ints)
      : e_bytes(round_up(elements * sizeof(E), 64)), f_bytes(round_up(floats * 4, 64)),
        block_bytes(e_bytes + f_bytes + round_up(ints * 4, 64)),
        base(memory.reserve(blocks * block_bytes)) {}
  E* e(int64_t block) const { return reinterpret_cast<E*>(base + block * block_bytes); }
  float* f(int64_t block) const {
    return reinterpret_cast<float*>(base + block * block_bytes + e_bytes);
  }
  int32_t* i(int64_t block) const {
    return reinterpret_cast<int32_t*>(base + block * block_bytes + e_bytes + f_bytes);
  }
  void clear(int64_t block) const { std::memset(base + block * block_bytes, 0, block_bytes); }
};

thread_local Workspace key_memory, query_memory;

// Key block (b, kv head, kb) of np keys, as the dots read it:
//   kt: forward, the panel of K^T [D][np] (S = Q K^T); backward, the rows of K^T [dc][np]
//       (dQ^T += K^T dS^T);
//   vs: forward, the panel of V [np][dvp] (O += P V); backward, the rows of V (dP^T = V dO^T);
//   ks: backward only, the rows of K [np][dp] (S^T = K Q^T).
// (In float32 rows and panels are one layout.) Ints: seg, pos, bad (-1 where k or v is
// non-finite) [np] each, then "any bad".
template <typename E>
struct KeyPanel {
  E *kt, *vs, *ks;
  int32_t *seg, *pos, *bad;
  int64_t k0, nk;
  bool any_bad;
};

thread_local Workspace task_key_memory;

// Every key block's panels, packed once per call by their own tasks; or, `per_task`, each block
// packed by the one task that reads it just before it reads it, into that thread's one-block
// buffer (what a call whose key blocks have one query block each wants, e.g. serving's
// candidates: packing all blocks first writes them out of cache and reads them back, which
// measured a third of such a call).
template <typename E>
struct KeyPanels {
  const Problem& p;
  bool backward, per_task;
  int64_t kt_size, vs_size, ks_size;
  Panels<E> store;
  KeyPanels(const Problem& p, bool backward, bool per_task)
      : p(p), backward(backward), per_task(per_task), kt_size(p.dc() * p.np()),
        vs_size(panel_size<E>(p.np(), p.dvp())), ks_size(backward ? p.np() * p.dp() : 0),
        store(key_memory, per_task ? 0 : p.batch * p.kv_heads * p.n_k, elements(), 0, ints()) {}

  int64_t elements() const { return kt_size + vs_size + ks_size; }
  int64_t ints() const { return 3 * p.np() + 1; }

  KeyPanel<E> get(int64_t b, int64_t hk, int64_t kb) const {
    return at(store, (b * p.kv_heads + hk) * p.n_k + kb, kb);
  }

  // Block kb of (b, kv head) for the task that reads it: packed now when per_task.
  template <typename D>
  KeyPanel<E> for_task(int64_t b, int64_t hk, int64_t kb, const typename D::T* k,
                       const typename D::T* v) const {
    if (!per_task) return get(b, hk, kb);
    const Panels<E> mine(task_key_memory, 1, elements(), 0, ints());
    return pack<D>(mine, 0, (b * p.kv_heads + hk) * p.n_k + kb, k, v);
  }

  // The panels in slot `slot` of `in`, holding key block kb of its row.
  KeyPanel<E> at(const Panels<E>& in, int64_t slot, int64_t kb) const {
    E* kt = in.e(slot);
    int32_t* i = in.i(slot);
    const int64_t np = p.np(), k0 = kb * p.block_k;
    return KeyPanel<E>{kt, kt + kt_size, backward ? kt + kt_size + vs_size : nullptr,
                       i, i + np, i + 2 * np, k0, std::min(p.block_k, p.kv_len - k0),
                       i[3 * np] != 0};
  }

  // Whether `len` of a padded extent `padded` leaves nothing a dot reads unwritten: no padding,
  // and whole contraction steps (kDepth) and row tiles (kRows).
  static bool fills(int64_t len, int64_t padded) {
    return len == padded && len % kDepth<E> == 0 && len % kRows<E> == 0;
  }

  // Packs key block `block` ((b, kv head, kb) in row-major order) into slot `slot` of `into`.
  template <typename D>
  KeyPanel<E> pack(const Panels<E>& into, int64_t slot, int64_t block, const typename D::T* k,
                   const typename D::T* v) const {
    const int64_t b = block / (p.kv_heads * p.n_k), hk = block / p.n_k % p.kv_heads;
    const int64_t kb = block % p.n_k, np = p.np(), dp = p.dp(), dvp = p.dvp();
    // The dots read zeros past a block's tokens and dims; a block its tokens fill has no such
    // padding, and clearing it anyway (before every element is written) measured 5% of a
    // 64-query forward. The flags are always cleared: `bad` is only set where a token is bad.
    const int64_t nk = std::min(p.block_k, p.kv_len - kb * p.block_k);
    if (fills(nk, p.nc()) && fills(p.dim, p.dc()) && fills(p.dim_v, p.dvc())) {
      std::memset(into.i(slot), 0, ints() * sizeof(int32_t));
    } else {
      into.clear(slot);
    }
    KeyPanel<E> key = at(into, slot, kb);
    Destination<E> k_to, v_to;
    if (backward) {
      k_to.rows = key.ks, k_to.ld_rows = dp, k_to.rows_t = key.kt, k_to.ld_rows_t = np;
      v_to.rows = key.vs, v_to.ld_rows = dvp;
    } else {
      k_to.panel_t = key.kt, k_to.ld_panel_t = np;
      v_to.panel = key.vs, v_to.ld_panel = dvp;
    }
    gather<D, E>([&](int64_t t) { return k + p.kv_offset(b, hk, key.k0 + t, p.dim); }, p.dim,
                 key.nk, k_to, key.bad);
    gather<D, E>([&](int64_t t) { return v + p.kv_offset(b, hk, key.k0 + t, p.dim_v); },
                 p.dim_v, key.nk, v_to, key.bad);
    std::copy_n(p.seg_k + b * p.kv_len + key.k0, key.nk, key.seg);
    std::copy_n(p.pos_k + b * p.kv_len + key.k0, key.nk, key.pos);
    key.any_bad = std::any_of(key.bad, key.bad + key.nk, [](int32_t x) { return x != 0; });
    into.i(slot)[3 * np] = key.any_bad;
    return key;
  }

  // Packs block `block` into the call's store (not per_task).
  template <typename D>
  void pack_stored(int64_t block, const typename D::T* k, const typename D::T* v) const {
    pack<D>(store, block, block, k, v);
  }
};

// ---- Threads: tasks 0..n-1 claimed from a shared counter by the caller and pool workers.
// A task that throws (std::bad_alloc above all: an exception that left a pool worker would end
// the process) fails the call: the tasks not yet started are skipped, every task that started
// is waited for (they use the caller's stack frame), and the first failure is rethrown on the
// calling thread, where `guarded` returns it as the FFI handler's error.

template <typename Fn>
void parallel_for(ffi::ThreadPool& pool, int64_t n, Fn fn) {
  struct State {
    std::atomic<int64_t> next{0}, done{0};
    std::atomic<bool> failed{false};
    std::exception_ptr failure;  // the first, written by the task that set `failed`
  };
  auto state = std::make_shared<State>();
  // The state outlives this call for workers that start late; `fn` does not, so a worker
  // only touches it after claiming a task, which cannot happen once all are done.
  auto work = [state, n, &fn]() {
    for (int64_t i; (i = state->next.fetch_add(1)) < n;) {
      if (!state->failed.load(std::memory_order_relaxed)) {
        try {
          fn(i);
        } catch (...) {
          if (!state->failed.exchange(true)) state->failure = std::current_exception();
        }
      }
      state->done.fetch_add(1, std::memory_order_release);
    }
  };
  const int64_t workers = std::min({pool.num_threads(), settings().max_threads, n}) - 1;
  try {
    for (int64_t w = 0; w < workers; ++w) {
      pool.Schedule([work]() {
        on_pool_worker = true;
        work();
        on_pool_worker = false;
      });
    }
  } catch (const std::bad_alloc&) {
    // A worker that could not be scheduled leaves its share to the others (the caller below).
  }
  work();
  while (state->done.load(std::memory_order_acquire) < n) std::this_thread::yield();
  if (state->failure) std::rethrow_exception(state->failure);
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
  using E = typename DotElement<D>::type;
  const Problem& p;
  const KeyPanels<E>& keys;
  const T *q, *k, *v;
  T* out;
  float* lse;

  void run(int64_t task) const {
    const int64_t b = task / (p.kv_heads * p.n_q), hk = task / p.n_q % p.kv_heads;
    const int64_t qb = task % p.n_q, g_len = p.group(), q0 = qb * p.block_q;
    const int64_t nq = std::min(p.block_q, p.q_len - q0), m = g_len * nq;
    const int64_t dp = p.dp(), dvp = p.dvp(), np = p.np(), nc = p.nc(), dvc = p.dvc();
    // Per-thread buffers, reused by every task the thread runs (see Workspace).
    thread_local Vector<E> qs, pe;
    thread_local Vector<float> s, acc, mx, l;
    thread_local Vector<int32_t> poisoned;
    qs.assign(rows_size<E>(m, dp), E{});  // the rows of q, zero where the dots read past them
    s.resize(rows_size<E>(m, np));
    acc.assign(rows_size<E>(m, dvp), 0.0f);
    mx.assign(m, -kInf);
    l.assign(m, 0.0f);
    poisoned.assign(m, 0);
    for (int64_t g = 0; g < g_len; ++g) {
      const int64_t h = hk * g_len + g;
      gather<D, E>([&](int64_t t) { return q + p.q_offset(b, h, q0 + t, p.dim); }, p.dim, nq,
                   {qs.data() + g * nq * dp, dp}, poisoned.data() + g * nq);
    }
    const int32_t* seg_q = p.seg_q + b * p.q_len + q0;
    const int32_t* pos_q = p.pos_q + b * p.q_len + q0;

    // Without a cap (and a positive scale, which commutes with the max), the scale joins the
    // exp: p = exp(scale s - shift), one pass over the logits fewer.
    const bool fold = p.softcap <= 0 && p.scale > 0;
    const vf mul = splat(fold ? p.scale : 1.0f);
    const Visits list = visits(p, p.kv_index, p.full_count, p.count, b * p.n_q + qb, p.n_k);
    for (int64_t e = 0; e < list.count; ++e) {
      const int32_t kb = list.index[e];
      if (kb < 0 || kb >= p.n_k) continue;
      const KeyPanel<E> key = keys.template for_task<D>(b, hk, kb, k, v);
      const bool masked = e >= list.full;
      gemm<false>(m, nc, p.dim, qs.data(), dp, key.kt, np, s.data(), np);
      for (int64_t r = 0; r < m; ++r) {
        const int64_t t = r % nq;
        float* sr = s.data() + r * np;
        if (!fold) p.logits(sr, nc);
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
        vf top = splat(-kInf);
        for (int64_t j = 0; j < nc; j += kLanes) {
          vf x = load(sr + j);
          top = x > top ? x : top;
        }
        const float row_max = std::max(mx[r], max_lane(top) * (fold ? p.scale : 1.0f));
        const float shift = std::isfinite(row_max) ? row_max : 0.0f;
        const float alpha = std::exp(mx[r] - shift);
        vf sum = splat(0.0f);
        for (int64_t j = 0; j < nc; j += kLanes) {
          vf pj = vexp(load(sr + j) * mul - shift);
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
      // p past the block's keys is 0 (their logits are -inf), so a bfloat16 pair may read it.
      gemm<true>(m, dvc, key.nk, dot_rows<E>(s.data(), m, key.nk, np, pe), np, key.vs, dvp,
                 acc.data(), dvp);
    }

    Vector<float> own_k(p.dim), own_v(p.dim_v);
    for (int64_t t = 0; t < nq; ++t) {
      const bool own = p.own && seg_q[t] < 0;
      bool own_bad = false;
      if (own) {
        const int64_t i = q0 + t;
        const int64_t own_row = (b * p.q_len + i) * p.kv_heads + hk;  // in own_k / own_v
        const T* ko = p.own_k ? static_cast<const T*>(p.own_k) + own_row * p.dim
                              : k + p.kv_offset(b, hk, i, p.dim);
        const T* vo = p.own_v ? static_cast<const T*>(p.own_v) + own_row * p.dim_v
                              : v + p.kv_offset(b, hk, i, p.dim_v);
        own_bad = finite_row<D, float>(ko, p.dim, own_k.data());
        own_bad |= finite_row<D, float>(vo, p.dim_v, own_v.data());
      }
      for (int64_t g = 0; g < g_len; ++g) {
        const int64_t r = g * nq + t, h = hk * g_len + g;
        float* ar = acc.data() + r * dvp;
        if (own) {  // the own-key logit joins the softmax
          float dot = 0;
          const E* qr = qs.data() + r * dp;
          for (int64_t d = 0; d < p.dim; ++d) dot += to_float(qr[d]) * own_k[d];
          const float s_own = p.cap(dot * p.scale), m_new = std::max(mx[r], s_own);
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
// pass no gradient) and delta = rowsum(dO * O) - d lse (semantics.backward_rows). Then with
// s = scale q . k: p = exp(cap(s) - lse), dp = dO . v, ds = p (dp - delta) cap'(s), and
// dq = scale * ds k, dk = scale * ds^T q, dv = p^T dO. Every block pair is computed once,
// key-major (rows are keys, columns query rows), by a dk / dv task, which keeps its dS^T for
// the dq tasks (KeptGrads): 5 dots per pair.

// Query block (b, kv head, qb), rows r = g * nq + t (token q0 + t, query head hk * G + g):
//   qs, the panel of q [mp][dp] (dK += dS^T Q); qt, the panel of Q^T [D][mp] (S^T = K Q^T);
//   dos, the panel of dO [mp][dvp] (dV += P^T dO); dot, the panel of dO^T [Dv][mp]
//   (dP^T = V dO^T).
// Floats: shift [mp] (the lse; +inf where p must be 0), delta [mp], and the block's dQ^T
// [dc][mp], summed over its key blocks. Ints: seg, pos [mp].
template <typename E>
struct QueryPanel {
  E *qs, *qt, *dos, *dot;
  float *shift, *delta, *grad_t;
  int32_t *seg, *pos;
  int64_t q0, nq, m;
};

template <typename E>
struct QueryPanels {
  const Problem& p;
  int64_t qs_size, qt_size, dos_size, dot_size;
  Panels<E> store;
  explicit QueryPanels(const Problem& p)
      : p(p), qs_size(panel_size<E>(p.mp(), p.dp())), qt_size(panel_size<E>(p.dim, p.mp())),
        dos_size(panel_size<E>(p.mp(), p.dvp())), dot_size(panel_size<E>(p.dim_v, p.mp())),
        store(query_memory, p.batch * p.kv_heads * p.n_q, qs_size + qt_size + dos_size + dot_size,
              (2 + p.dc()) * p.mp(), 2 * p.mp()) {}

  QueryPanel<E> get(int64_t b, int64_t hk, int64_t qb) const {
    return at((b * p.kv_heads + hk) * p.n_q + qb);
  }

  QueryPanel<E> at(int64_t block) const {
    E* qs = store.e(block);
    float* f = store.f(block);
    int32_t* i = store.i(block);
    const int64_t mp = p.mp(), q0 = block % p.n_q * p.block_q;
    const int64_t nq = std::min(p.block_q, p.q_len - q0);
    return QueryPanel<E>{qs, qs + qs_size, qs + qs_size + qt_size,
                         qs + qs_size + qt_size + dos_size, f, f + mp, f + 2 * mp, i, i + mp,
                         q0, nq, p.group() * nq};
  }

  template <typename D>
  void pack(int64_t block, const typename D::T* q, const typename D::T* d_out, const float* lse,
            const float* delta) const {
    const int64_t b = block / (p.kv_heads * p.n_q), hk = block / p.n_q % p.kv_heads;
    const int64_t mp = p.mp();
    store.clear(block);
    const QueryPanel<E> qp = at(block);
    std::fill_n(qp.shift, mp, kInf);
    const int64_t g_len = p.group(), nq = qp.nq;
    for (int64_t g = 0; g < g_len; ++g) {
      const int64_t h = hk * g_len + g, r0 = g * nq;
      Destination<E> q_to, d_to;
      q_to.panel = qp.qs, q_to.ld_panel = p.dp(), q_to.panel_t = qp.qt, q_to.ld_panel_t = mp;
      d_to.panel = qp.dos, d_to.ld_panel = p.dvp(), d_to.panel_t = qp.dot, d_to.ld_panel_t = mp;
      q_to.first = d_to.first = r0;
      gather<D, E>([&](int64_t t) { return q + p.q_offset(b, h, qp.q0 + t, p.dim); }, p.dim, nq,
                   q_to, nullptr);
      gather<D, E>([&](int64_t t) { return d_out + p.q_offset(b, h, qp.q0 + t, p.dim_v); },
                   p.dim_v, nq, d_to, nullptr);
      for (int64_t t = 0; t < nq; ++t) {
        const int64_t row = (b * p.q_len + qp.q0 + t) * p.q_heads + h, r = r0 + t;
        qp.shift[r] = lse[row] == -kInf ? kInf : lse[row];  // sees nothing: every p is 0
        qp.delta[r] = delta[row];
        qp.seg[r] = p.seg_q[b * p.q_len + qp.q0 + t];
        qp.pos[r] = p.pos_q[b * p.q_len + qp.q0 + t];
      }
    }
  }
};

thread_local Workspace grad_memory;

// dS^T of the block pairs of a chunk of key blocks, as the panel dQ^T += K^T dS^T reads:
// written by the dk / dv tasks of the chunk, then added into each query block's dQ^T by the
// dq tasks. A chunk is as many key blocks (in (b, kv head, block) order) as fit
// RANKATTN_CPU_BACKWARD_MB (default 1024 MiB; at least one block), so every pair costs 5 dots
// however long the sequence. Each query block adds its pairs in ascending key-block order in
// every chunking, so dq has the same bits for any budget and thread count.
template <typename E>
struct KeptGrads {
  const Problem& p;
  Vector<int64_t> first;  // per key task: the index of its first pair, over all pairs
  int64_t block_elements, budget_pairs;
  int64_t start = 0, end = 0;  // the chunk: key tasks [start, end)
  E* store = nullptr;
  // Per query task, the chunk's pairs it adds (key block, slot), as CSR rows.
  Vector<int64_t> row_start;
  Vector<std::pair<int32_t, const E*>> pairs;

  KeptGrads(const Problem& p, int64_t budget_bytes)
      : p(p), first(p.batch * p.kv_heads * p.n_k + 1, 0),
        block_elements(panel_size<E>(p.block_k, p.mp())),
        budget_pairs(budget_bytes / (block_elements * static_cast<int64_t>(sizeof(E)))),
        row_start(p.batch * p.kv_heads * p.n_q + 1) {
    for (int64_t t = 0; t + 1 < static_cast<int64_t>(first.size()); ++t) {
      first[t + 1] = first[t] + list(t).count;
    }
  }
  int64_t key_tasks() const { return static_cast<int64_t>(first.size()) - 1; }
  // Key task t = (b, kv head, key block)'s list of query blocks.
  Visits list(int64_t t) const {
    const int64_t b = t / (p.kv_heads * p.n_k), kb = t % p.n_k;
    return visits(p, p.q_index, p.q_full_count, p.q_count, b * p.n_k + kb, p.n_q);
  }
  // Makes [from, ...) the next chunk; false when no key task is left.
  bool next(int64_t from) {
    if (from >= key_tasks()) return false;
    start = from;
    end = from + 1;
    while (end < key_tasks() && first[end + 1] - first[start] <= budget_pairs) ++end;
    store = reinterpret_cast<E*>(
        grad_memory.reserve((first[end] - first[start]) * block_elements * sizeof(E)));
    // Each query task's pairs, in ascending key-block order (the order of the key tasks).
    std::fill(row_start.begin(), row_start.end(), 0);
    for_each_pair([&](int64_t row, int64_t, int64_t) { ++row_start[row + 1]; });
    std::partial_sum(row_start.begin(), row_start.end(), row_start.begin());
    pairs.resize(row_start.back());
    Vector<int64_t> free_slot(row_start.begin(), row_start.end() - 1);
    for_each_pair([&](int64_t row, int64_t t, int64_t e) {
      pairs[free_slot[row]++] = {static_cast<int32_t>(t % p.n_k), slot(t, e)};
    });
    return true;
  }
  // fn(query task, key task, entry) for every pair of the chunk. A malformed plan's entries
  // outside the grid are skipped, as the dk / dv tasks skip them.
  template <typename Fn>
  void for_each_pair(Fn fn) const {
    for (int64_t t = start; t < end; ++t) {
      const Visits l = list(t);
      for (int64_t e = 0; e < l.count; ++e) {
        const int32_t qb = l.index[e];
        if (qb >= 0 && qb < p.n_q) fn(t / p.n_k * p.n_q + qb, t, e);
      }
    }
  }
  E* slot(int64_t t, int64_t e) const {
    return store + (first[t] - first[start] + e) * block_elements;
  }
};

template <typename D>
struct Backward {
  using T = typename D::T;
  using E = typename DotElement<D>::type;
  const Problem& p;
  const KeyPanels<E>& keys;
  const QueryPanels<E>& queries;
  const KeptGrads<E>& kept;  // q, k, v and dO are read from the panels only
  T *dq, *dk, *dv;

  // Per-thread buffers of one block pair, reused by every task the thread runs (see Workspace).
  struct Pair {
    Vector<float> st, dpt, raw;
  };

  // p^T into pair.st and dp^T - delta into pair.dpt ([nk][mp]: rows are keys, columns query
  // rows), and with a cap the logits before it into pair.raw.
  void probabilities(const KeyPanel<E>& key, const QueryPanel<E>& qp, bool masked,
                     Pair& pair) const {
    const int64_t nk = key.nk, mp = p.mp(), mc = p.mc();
    pair.st.resize(rows_size<E>(nk, mp));
    pair.dpt.resize(rows_size<E>(nk, mp));
    if (p.softcap > 0) pair.raw.resize(nk * mp);
    gemm<false>(nk, mc, p.dim, key.ks, p.dp(), qp.qt, mp, pair.st.data(), mp);
    gemm<false>(nk, mc, p.dim_v, key.vs, p.dvp(), qp.dot, mp, pair.dpt.data(), mp);
    for (int64_t j = 0; j < nk; ++j) {  // each column with its query row's lse
      float* sr = pair.st.data() + j * mp;
      float* dr = pair.dpt.data() + j * mp;
      p.logits(sr, mc, p.softcap > 0 ? pair.raw.data() + j * mp : nullptr);
      const vi sk = splat_i(key.seg[j]), pk = splat_i(key.pos[j]);
      for (int64_t r = 0; r < mc; r += kLanes) {  // padded rows: shift +inf, so p = 0
        vf pr = vexp(load(sr + r) - load(qp.shift + r));
        if (masked) pr = p.sees_history(load_i(qp.seg + r), load_i(qp.pos + r), sk, pk) ? pr : 0;
        store(sr + r, pr);
        store(dr + r, load(dr + r) - load(qp.delta + r));
      }
    }
  }

  // ds^T over p^T in pair.st.
  void logit_grads_of(int64_t nk, Pair& pair) const {
    const int64_t mp = p.mp();
    for (int64_t j = 0; j < nk; ++j) {
      logit_grads(p, pair.st.data() + j * mp, pair.dpt.data() + j * mp,
                  p.softcap > 0 ? pair.raw.data() + j * mp : nullptr, p.mc());
    }
  }

  // Element (r, d) of a query panel.
  static float element(const E* panel, int64_t ld, int64_t r, int64_t d) {
    return to_float(panel[panel_index<E>(r, d, ld)]);
  }

  // d logit of a candidate's own key for query row r of `qp`, from the rows of its own k and
  // v; *prob = p.
  float own_grad(const QueryPanel<E>& qp, int64_t r, const E* own_k, const E* own_v,
                 float* prob) const {
    float dot = 0, dpv = 0;
    for (int64_t d = 0; d < p.dim; ++d) dot += element(qp.qs, p.dp(), r, d) * to_float(own_k[d]);
    for (int64_t d = 0; d < p.dim_v; ++d) {
      dpv += element(qp.dos, p.dvp(), r, d) * to_float(own_v[d]);
    }
    const float s = dot * p.scale;
    *prob = std::exp(p.cap(s) - qp.shift[r]);
    return *prob * (dpv - qp.delta[r]) * p.cap_grad(s);
  }

  // dQ^T of query task `task` (b, kv head, query block) += K^T dS^T over the chunk's pairs.
  void dq_add(int64_t task) const {
    const int64_t b = task / (p.kv_heads * p.n_q), hk = task / p.n_q % p.kv_heads;
    const QueryPanel<E> qp = queries.get(b, hk, task % p.n_q);
    for (int64_t i = kept.row_start[task]; i < kept.row_start[task + 1]; ++i) {
      const auto& [kb, ds_t] = kept.pairs[i];
      const KeyPanel<E> key = keys.get(b, hk, kb);
      gemm<true>(p.dc(), p.mc(), key.nk, key.kt, p.np(), ds_t, p.mp(), qp.grad_t, p.mp());
    }
  }

  // dq of query task `task`: its dQ^T, the candidates' own keys, the scale.
  void dq_finish(int64_t task) const {
    const int64_t b = task / (p.kv_heads * p.n_q), hk = task / p.n_q % p.kv_heads;
    const QueryPanel<E> qp = queries.get(b, hk, task % p.n_q);
    const int64_t g_len = p.group(), mp = p.mp();
    for (int64_t t = 0; t < qp.nq; ++t) {
      const int64_t i = qp.q0 + t;
      const bool own = p.own && qp.seg[t] < 0;
      const E *own_k = nullptr, *own_v = nullptr;  // the rows of key i
      if (own) {  // own implies q_len == kv_len, so key i exists
        const KeyPanel<E> key = keys.get(b, hk, i / p.block_k);
        own_k = key.ks + (i % p.block_k) * p.dp();
        own_v = key.vs + (i % p.block_k) * p.dvp();
      }
      for (int64_t g = 0; g < g_len; ++g) {
        const int64_t r = g * qp.nq + t;
        if (own) {
          float prob;
          const float d_s = own_grad(qp, r, own_k, own_v, &prob);
          for (int64_t d = 0; d < p.dim; ++d) qp.grad_t[d * mp + r] += d_s * to_float(own_k[d]);
        }
        T* o = dq + ((b * p.q_len + i) * p.q_heads + hk * g_len + g) * p.dim;
        for (int64_t d = 0; d < p.dim; ++d) o[d] = D::from(qp.grad_t[d * mp + r] * p.scale);
      }
    }
  }

  // dk, dv of one key block of one kv head, over the query blocks that see it.
  void dkv_task(int64_t task) const {
    const int64_t b = task / (p.kv_heads * p.n_k), hk = task / p.n_k % p.kv_heads;
    const int64_t kb = task % p.n_k, dp = p.dp(), dvp = p.dvp(), mp = p.mp();
    const KeyPanel<E> key = keys.get(b, hk, kb);
    const int64_t nk = key.nk;
    thread_local Pair pair;
    thread_local Vector<float> dk_acc, dv_acc;
    thread_local Vector<E> rounded;
    dk_acc.assign(rows_size<E>(nk, dp), 0.0f);
    dv_acc.assign(rows_size<E>(nk, dvp), 0.0f);
    const Visits list = visits(p, p.q_index, p.q_full_count, p.q_count, b * p.n_k + kb, p.n_q);
    for (int64_t e = 0; e < list.count; ++e) {
      const int32_t qb = list.index[e];
      if (qb < 0 || qb >= p.n_q) continue;
      const QueryPanel<E> qp = queries.get(b, hk, qb);
      probabilities(key, qp, e >= list.full, pair);
      gemm<true>(nk, p.dvc(), qp.m, dot_rows<E>(pair.st.data(), nk, qp.m, mp, rounded), mp,
                 qp.dos, dvp, dv_acc.data(), dvp);
      logit_grads_of(nk, pair);
      gemm<true>(nk, p.dc(), qp.m, dot_rows<E>(pair.st.data(), nk, qp.m, mp, rounded), mp,
                 qp.qs, dp, dk_acc.data(), dp);
      keep_panel<E>(pair.st.data(), nk, qp.m, mp, kept.slot(task, e));
    }

    if (p.own) {  // each candidate key's own query rows
      const int64_t g_len = p.group();
      for (int64_t j = 0; j < nk; ++j) {
        const int64_t i = key.k0 + j;
        if (p.seg_q[b * p.q_len + i] >= 0) continue;
        const QueryPanel<E> qp = queries.get(b, hk, i / p.block_q);
        const int64_t t = i - qp.q0;
        for (int64_t g = 0; g < g_len; ++g) {
          const int64_t r = g * qp.nq + t;
          float prob;
          const float d_s = own_grad(qp, r, key.ks + j * dp, key.vs + j * dvp, &prob);
          for (int64_t d = 0; d < p.dim; ++d) dk_acc[j * dp + d] += d_s * element(qp.qs, dp, r, d);
          for (int64_t d = 0; d < p.dim_v; ++d) {
            dv_acc[j * dvp + d] += prob * element(qp.dos, dvp, r, d);
          }
        }
      }
    }
    for (int64_t j = 0; j < nk; ++j) {
      T* ok = dk + ((b * p.kv_len + key.k0 + j) * p.kv_heads + hk) * p.dim;
      T* ov = dv + ((b * p.kv_len + key.k0 + j) * p.kv_heads + hk) * p.dim_v;
      for (int64_t d = 0; d < p.dim; ++d) ok[d] = D::from(dk_acc[j * dp + d] * p.scale);
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

// RA126 (rankattn/errors.py's catalog): JAX raises it as its JaxRuntimeError, so the message
// starts with the code, as rankattn's own errors do, and says what to change.
ffi::Error out_of_memory(int64_t bytes) {
  char what[96] = "a buffer of unknown size";
  if (bytes >= 0) {
    const bool mib = bytes >= (1 << 20);
    std::snprintf(what, sizeof what, "%lld bytes (%.1f %s)", static_cast<long long>(bytes),
                  static_cast<double>(bytes) / (mib ? 1 << 20 : 1 << 10), mib ? "MiB" : "KiB");
  }
  return ffi::Error(
      ffi::ErrorCode::kResourceExhausted,
      std::string("[RA126] the cpu kernel could not allocate memory: it asked for ") + what +
          ". Lower RANKATTN_CPU_BACKWARD_MB (the dS a backward keeps, default 1024), pass a "
          "smaller batch or fewer tokens per call, or lower RANKATTN_CPU_THREADS (each thread "
          "keeps buffers of its own).\n  (rankattn explain RA126 for more.)");
}

// An FFI handler with every exception it lets out (on the calling thread, or rethrown there by
// parallel_for) as the call's error: none may cross into XLA.
template <auto handler>
struct Guarded {
  template <typename... Args>
  ffi::Error operator()(Args&&... args) const {
    try {
      return handler(std::forward<Args>(args)...);
    } catch (const OutOfMemory& e) {
      return out_of_memory(e.bytes);
    } catch (const std::bad_alloc&) {
      return out_of_memory(-1);
    } catch (const std::exception& e) {
      return ffi::Error(ffi::ErrorCode::kInternal, std::string("rankattn cpu kernel: ") + e.what());
    } catch (...) {
      return ffi::Error(ffi::ErrorCode::kInternal, "rankattn cpu kernel: an unknown exception");
    }
  }
};

bool dims_are(ffi::Span<const int64_t> dims, std::initializer_list<int64_t> want) {
  return dims.size() == want.size() && std::equal(want.begin(), want.end(), dims.begin());
}

// The problem of a call, after checking every shape against q, k, v and the block sizes, so
// the tasks can index without further checks. With a page table [B, M], k and v are pages
// [N, P, D] of one kv head and the keys of row b are its M pages in table order (S = M * P).
ffi::Error describe(const ffi::AnyBuffer& q, const ffi::AnyBuffer& k, const ffi::AnyBuffer& v,
                    const I32* page_table, const I32& seg_q, const I32& seg_k, const I32& pos_q, const I32& pos_k,
                    const I32& kv_index, const I32& full_count, const I32& count, float scale,
                    float softcap, bool soft_sign, bool causal, bool own, int64_t block_q,
                    int64_t block_k, Problem* p) {
  auto qd = q.dimensions(), kd = k.dimensions(), vd = v.dimensions();
  const size_t kv_rank = page_table ? 3 : 4;
  if (auto e = check(qd.size() == 4 && kd.size() == kv_rank && vd.size() == kv_rank,
                     "q must be 4-D, and k, v 4-D (3-D pages with a page table)");
      e.failure())
    return e;
  *p = Problem{};
  p->batch = qd[0], p->q_len = qd[1], p->q_heads = qd[2], p->dim = qd[3];
  p->dim_v = vd[kv_rank - 1];
  p->block_q = block_q, p->block_k = block_k;
  p->scale = scale, p->softcap = softcap, p->soft_sign = soft_sign, p->causal = causal;
  p->own = own;
  bool ok;
  if (page_table) {
    auto td = page_table->dimensions();
    ok = td.size() == 2 && td[0] == p->batch && td[1] >= 1 && kd[0] >= 1 && kd[1] >= 1;
    if (auto e = check(ok, "the page table must be [B, M] and the pages [N, P, D]");
        e.failure())
      return e;
    p->page_table = page_table->typed_data();
    p->num_pages = kd[0], p->kv_heads = 1, p->page_size = kd[1];
    p->kv_len = td[1] * p->page_size;
    ok = dims_are(kd, {p->num_pages, p->page_size, p->dim}) &&
         dims_are(vd, {p->num_pages, p->page_size, p->dim_v});
  } else {  // an own key in k / v is key i of query i: one sequence for both
    p->kv_len = kd[1], p->kv_heads = kd[2];
    ok = dims_are(kd, {p->batch, p->kv_len, p->kv_heads, p->dim}) &&
         dims_are(vd, {p->batch, p->kv_len, p->kv_heads, p->dim_v}) &&
         (!own || p->q_len == p->kv_len);
  }
  ok = ok && p->batch >= 1 && p->q_len >= 1 && p->kv_len >= 1 && p->kv_heads >= 1 &&
       p->q_heads % p->kv_heads == 0 && p->dim >= 1 && p->dim_v >= 1 && block_q >= 1 &&
       block_k >= 1 && q.element_type() == k.element_type() &&
       q.element_type() == v.element_type();
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

// The forward of a described problem p (contiguous or paged keys).
ffi::Error run_forward(ffi::ThreadPool& pool, const Problem& p, const ffi::AnyBuffer& q,
                       const ffi::AnyBuffer& k, const ffi::AnyBuffer& v,
                       ffi::Result<ffi::AnyBuffer>& out,
                       ffi::Result<ffi::Buffer<ffi::F32>>& lse) {
  bool ok = out->element_type() == q.element_type() &&
            dims_are(out->dimensions(), {p.batch, p.q_len, p.q_heads, p.dim_v}) &&
            dims_are(lse->dimensions(), {p.batch, p.q_heads, p.q_len});
  if (auto e = check(ok, "out or lse has the wrong shape or dtype"); e.failure()) return e;
  return by_dtype(q.element_type(), [&](auto tag) {
    using D = typename decltype(tag)::type;
    using T = typename D::T;
    const T* kp = static_cast<const T*>(k.untyped_data());
    const T* vp = static_cast<const T*>(v.untyped_data());
    using E = typename DotElement<D>::type;
    KeyPanels<E> keys(p, false, p.n_q == 1);
    if (!keys.per_task) {
      parallel_for(pool, p.batch * p.kv_heads * p.n_k,
                   [&](int64_t block) { keys.template pack_stored<D>(block, kp, vp); });
    }
    Forward<D> kernel{p, keys, static_cast<const T*>(q.untyped_data()), kp, vp,
                      static_cast<T*>(out->untyped_data()), lse->typed_data()};
    parallel_for(pool, p.batch * p.kv_heads * p.n_q, [&](int64_t t) { kernel.run(t); });
    return ffi::Error::Success();
  });
}

ffi::Error forward(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                   I32 seg_q, I32 seg_k, I32 pos_q, I32 pos_k, I32 kv_index, I32 full_count,
                   I32 count, ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::Buffer<ffi::F32>> lse,
                   float scale, float softcap, bool soft_sign, bool causal, bool own,
                   int64_t block_q, int64_t block_k) {
  Problem p;
  if (auto e = describe(q, k, v, nullptr, seg_q, seg_k, pos_q, pos_k, kv_index, full_count,
                        count, scale, softcap, soft_sign, causal, own, block_q, block_k, &p);
      e.failure())
    return e;
  return run_forward(pool, p, q, k, v, out, lse);
}

// Serving: queries over paged history keys (pages [N, P, D], page_table [B, M]), and with
// `own` each query's own key from k_self / v_self [B, Sq, 1, D] (ignored without it).
ffi::Error paged_forward(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer k_pages,
                         ffi::AnyBuffer v_pages, I32 page_table, ffi::AnyBuffer k_self,
                         ffi::AnyBuffer v_self, I32 seg_q, I32 seg_k, I32 pos_q, I32 pos_k,
                         I32 kv_index, I32 full_count, I32 count,
                         ffi::Result<ffi::AnyBuffer> out,
                         ffi::Result<ffi::Buffer<ffi::F32>> lse, float scale, float softcap,
                         bool soft_sign, bool causal, bool own, int64_t block_q,
                         int64_t block_k) {
  Problem p;
  if (auto e = describe(q, k_pages, v_pages, &page_table, seg_q, seg_k, pos_q, pos_k, kv_index,
                        full_count, count, scale, softcap, soft_sign, causal, own, block_q,
                        block_k, &p);
      e.failure())
    return e;
  if (own) {
    bool ok = k_self.element_type() == q.element_type() &&
              v_self.element_type() == q.element_type() &&
              dims_are(k_self.dimensions(), {p.batch, p.q_len, p.kv_heads, p.dim}) &&
              dims_are(v_self.dimensions(), {p.batch, p.q_len, p.kv_heads, p.dim_v});
    if (auto e = check(ok, "k_self / v_self must be [B, Sq, Hkv, D] in q's dtype"); e.failure())
      return e;
    p.own_k = k_self.untyped_data(), p.own_v = v_self.untyped_data();
  }
  return run_forward(pool, p, q, k_pages, v_pages, out, lse);
}

ffi::Error backward(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                    ffi::AnyBuffer d_out, ffi::Buffer<ffi::F32> lse, ffi::Buffer<ffi::F32> delta,
                    I32 seg_q, I32 seg_k, I32 pos_q, I32 pos_k, I32 kv_index, I32 full_count,
                    I32 count, I32 q_index, I32 q_full_count, I32 q_count,
                    ffi::Result<ffi::AnyBuffer> dq, ffi::Result<ffi::AnyBuffer> dk,
                    ffi::Result<ffi::AnyBuffer> dv, float scale, float softcap, bool soft_sign,
                    bool causal, bool own, int64_t block_q, int64_t block_k) {
  Problem p;
  if (auto e = describe(q, k, v, nullptr, seg_q, seg_k, pos_q, pos_k, kv_index, full_count,
                        count, scale, softcap, soft_sign, causal, own, block_q, block_k, &p);
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
    using E = typename DotElement<D>::type;
    KeyPanels<E> keys(p, true, false);
    QueryPanels<E> queries(p);
    const int64_t key_tasks = p.batch * p.kv_heads * p.n_k;
    const int64_t tasks = key_tasks + p.batch * p.kv_heads * p.n_q;
    parallel_for(pool, tasks, [&](int64_t t) {
      if (t < key_tasks) {
        keys.template pack_stored<D>(t, kp, vp);
      } else {
        queries.template pack<D>(t - key_tasks, qp, dop, lse.typed_data(), delta.typed_data());
      }
    });
    KeptGrads<E> kept(p, settings().backward_bytes);
    Backward<D> kernel{p, keys, queries, kept, static_cast<T*>(dq->untyped_data()),
                       static_cast<T*>(dk->untyped_data()), static_cast<T*>(dv->untyped_data())};
    const int64_t query_tasks = tasks - key_tasks;
    for (int64_t from = 0; kept.next(from); from = kept.end) {
      parallel_for(pool, kept.end - kept.start, [&](int64_t t) { kernel.dkv_task(kept.start + t); });
      parallel_for(pool, query_tasks, [&](int64_t t) { kernel.dq_add(t); });
    }
    parallel_for(pool, query_tasks, [&](int64_t t) { kernel.dq_finish(t); });
    return ffi::Error::Success();
  });
}

// ---- Quest's page bounds (serving): for each query row r and page j of batch row b,
// U[r][j] = max(q_r, 0) . M_j + min(q_r, 0) . m_j, one dot of [q+ | q-] [R][2D] with the pages'
// [M; m] [2D][pages], kBoundPages pages per task. q [B, Hkv, R, D] (scaled), stats k_max /
// k_min [N, Hkv, D], page_table [B, M] (entries clamped to [0, N)), npages [B]: pages
// j >= npages[b] get -inf. Non-finite stats count as 0 in the bound, and the page gets
// bad = 1 (the caller decides what such a page is worth).
constexpr int64_t kBoundPages = 128;

ffi::Error page_bounds(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k_max,
                       ffi::Buffer<ffi::F32> k_min, I32 page_table, I32 npages,
                       ffi::Result<ffi::Buffer<ffi::F32>> bounds, ffi::Result<I32> bad) {
  auto qd = q.dimensions(), sd = k_max.dimensions(), td = page_table.dimensions();
  bool ok = qd.size() == 4 && sd.size() == 3 && td.size() == 2;
  if (auto e = check(ok, "page bounds: q must be 4-D, the stats 3-D, the table 2-D"); e.failure())
    return e;
  const int64_t batch = qd[0], heads = qd[1], rows = qd[2], dim = qd[3], n = sd[0], m = td[1];
  ok = batch >= 1 && heads >= 1 && rows >= 1 && dim >= 1 && n >= 1 && m >= 1 &&
       dims_are(sd, {n, heads, dim}) && dims_are(k_min.dimensions(), {n, heads, dim}) &&
       dims_are(td, {batch, m}) && dims_are(npages.dimensions(), {batch}) &&
       dims_are(bounds->dimensions(), {batch, heads, rows, m}) &&
       dims_are(bad->dimensions(), {batch, heads, m});
  if (auto e = check(ok, "page bounds: inconsistent q, stats, table, npages or results");
      e.failure())
    return e;
  const int64_t blocks = (m + kBoundPages - 1) / kBoundPages, d2 = 2 * dim;
  const float *qp = q.typed_data(), *hi = k_max.typed_data(), *lo = k_min.typed_data();
  const int32_t *table = page_table.typed_data(), *count = npages.typed_data();
  float* out = bounds->typed_data();
  int32_t* flags = bad->typed_data();
  parallel_for(pool, batch * heads * blocks, [&](int64_t task) {
    const int64_t b = task / (heads * blocks), hk = task / blocks % heads;
    const int64_t j0 = task % blocks * kBoundPages, nj = std::min(kBoundPages, m - j0);
    const int64_t nc = round_up(nj, kColTile), ld = nc + kLanes;
    thread_local Vector<float> a, stats, panel, c;
    a.resize(rows * d2);
    for (int64_t r = 0; r < rows; ++r) {
      const float* qr = qp + ((b * heads + hk) * rows + r) * dim;
      for (int64_t d = 0; d < dim; ++d) {
        a[r * d2 + d] = std::max(qr[d], 0.0f);
        a[r * d2 + dim + d] = std::min(qr[d], 0.0f);
      }
    }
    stats.assign(nj * d2, 0.0f);  // [pages][M | m], zero for pages the row does not have
    for (int64_t jj = 0; jj < nj; ++jj) {
      const int64_t j = j0 + jj;
      bool is_bad = false;
      if (j < count[b]) {
        const int64_t page = std::clamp<int64_t>(table[b * m + j], 0, n - 1);
        is_bad = finite_row<F32, float>(hi + (page * heads + hk) * dim, dim, &stats[jj * d2]);
        is_bad |= finite_row<F32, float>(lo + (page * heads + hk) * dim, dim,
                                         &stats[jj * d2 + dim]);
      }
      flags[(b * heads + hk) * m + j] = is_bad;
    }
    panel.assign(d2 * ld, 0.0f);
    transpose(stats.data(), d2, nj, d2, panel.data(), ld);
    c.resize(rows * ld);
    gemm<false, float>(rows, nc, d2, a.data(), d2, panel.data(), ld, c.data(), ld);
    for (int64_t r = 0; r < rows; ++r) {
      float* o = out + ((b * heads + hk) * rows + r) * m + j0;
      for (int64_t jj = 0; jj < nj; ++jj) o[jj] = j0 + jj < count[b] ? c[r * ld + jj] : -kInf;
    }
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(RankattnCpuPageBounds, Guarded<page_bounds>{},
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // q [B, Hkv, R, D]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // k_max [N, Hkv, D]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // k_min [N, Hkv, D]
                                  .Arg<I32>()                    // page_table [B, M]
                                  .Arg<I32>()                    // npages [B]
                                  .Ret<ffi::Buffer<ffi::F32>>()  // bounds [B, Hkv, R, M]
                                  .Ret<I32>());                  // bad [B, Hkv, M]

// The bindings' shared parts: the mask and block plan arrays, and the attributes.
template <typename Binding>
auto with_mask_and_plan(Binding binding) {
  return std::move(binding).template Arg<I32>()  // seg_q
      .template Arg<I32>()             // seg_k
      .template Arg<I32>()             // pos_q
      .template Arg<I32>()             // pos_k
      .template Arg<I32>()             // kv_index
      .template Arg<I32>()             // full_count
      .template Arg<I32>();            // count
}

template <typename Binding>
auto with_attributes(Binding binding) {
  return std::move(binding).template Attr<float>("scale")
      .template Attr<float>("softcap")
      .template Attr<bool>("soft_sign")
      .template Attr<bool>("causal")
      .template Attr<bool>("own")
      .template Attr<int64_t>("block_q")
      .template Attr<int64_t>("block_k");
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    RankattnCpuForward, Guarded<forward>{},
    with_attributes(with_mask_and_plan(ffi::Ffi::Bind()
                                           .Ctx<ffi::ThreadPool>()
                                           .Arg<ffi::AnyBuffer>()   // q
                                           .Arg<ffi::AnyBuffer>()   // k
                                           .Arg<ffi::AnyBuffer>())  // v
                        .Ret<ffi::AnyBuffer>()                       // out
                        .Ret<ffi::Buffer<ffi::F32>>()));             // lse

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    RankattnCpuPagedForward, Guarded<paged_forward>{},
    with_attributes(with_mask_and_plan(ffi::Ffi::Bind()
                                           .Ctx<ffi::ThreadPool>()
                                           .Arg<ffi::AnyBuffer>()   // q
                                           .Arg<ffi::AnyBuffer>()   // k pages
                                           .Arg<ffi::AnyBuffer>()   // v pages
                                           .Arg<I32>()              // page_table
                                           .Arg<ffi::AnyBuffer>()   // k_self
                                           .Arg<ffi::AnyBuffer>())  // v_self
                        .Ret<ffi::AnyBuffer>()                       // out
                        .Ret<ffi::Buffer<ffi::F32>>()));             // lse

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    RankattnCpuBackward, Guarded<backward>{},
    with_attributes(with_mask_and_plan(ffi::Ffi::Bind()
                                           .Ctx<ffi::ThreadPool>()
                                           .Arg<ffi::AnyBuffer>()           // q
                                           .Arg<ffi::AnyBuffer>()           // k
                                           .Arg<ffi::AnyBuffer>()           // v
                                           .Arg<ffi::AnyBuffer>()           // d_out
                                           .Arg<ffi::Buffer<ffi::F32>>()    // lse [B, Sq, Hq]
                                           .Arg<ffi::Buffer<ffi::F32>>())   // delta [B, Sq, Hq]
                        .Arg<I32>()                                          // q_index
                        .Arg<I32>()                                          // q_full_count
                        .Arg<I32>()                                          // q_count
                        .Ret<ffi::AnyBuffer>()                               // dq
                        .Ret<ffi::AnyBuffer>()                               // dk
                        .Ret<ffi::AnyBuffer>()));                            // dv
