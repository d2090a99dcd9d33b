// Dot micro-kernels: C[M, N] (+)= A[M, K] B[K, N] with A in rows and B in panels, float32 on
// one register-tiled microkernel (any ISA), bfloat16 on AMX tiles or with AVX-512 BF16's
// VDPBF16PS; the layouts of their operands (rows, panels) and what the dots read past them.
// On a CPU with neither (AVX2, NEON) no bfloat16 dot is compiled: bfloat16 inputs become
// float32 panels.
//
// Part of cpu_attention.cc (see vectors.h).
#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>

// AMX comes with AVX-512 BF16 (Sapphire Rapids on), whose VDPBF16PS is its fallback.
#if defined(__AVX512BF16__) && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define RANKATTN_AMX 1
#include <sys/syscall.h>
#include <unistd.h>
#endif
#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

#include "runtime.h"
#include "vectors.h"

namespace {

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

// The degree of the softmax's exp2 polynomial (vexp2) where its p feed dots of element E. A p
// that feeds a bfloat16 dot is rounded to bfloat16 (2^-9 relative) first, under which a
// degree-4 polynomial's 2.7e-6 does not show.
template <typename E>
constexpr int kExp2Degree = std::is_same_v<E, float> ? 6 : 4;

// The softmax's p = 2^t, t = (s - m') log2(e) <= 0 (Exp2Range), for dots of element E.
template <typename E>
inline vf softmax_exp2(vf t) {
  return vexp2<kExp2Degree<E>, Exp2Range::kSoftmax>(t);
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

// sum_d a[d] b[d] over n (a multiple of kLanes) entries, kLanes running sums added at the
// end: a loop of one running sum is a chain of scalar adds the compiler may not reorder (a
// candidate's own-key dot measured a fifth of a 64-candidate call over a short history).
template <typename E>
inline float dot_lanes(const E* a, const float* b, int64_t n) {
  float part[kLanes] = {};
  for (int64_t d = 0; d < n; d += kLanes) {
    for (int c = 0; c < kLanes; ++c) part[c] += to_float(a[d + c]) * b[d + c];
  }
  float sum = 0;
  for (int c = 0; c < kLanes; ++c) sum += part[c];
  return sum;
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

// ---- The one dot: C[M, N] (+)= A[M, K] B[K, N], A rows, B a panel (in float32, either may
// also be read in place through row pointers, A in columns too). Its columns are computed in
// strips of kColTile, the last one a single vector wide where N ends within one (head dim
// 80: 16 of its 96 padded columns are not computed, a sixth of the P V, dS^T Q and P^T dO
// dots); so B and C hold N rounded up to kColTile columns, or in B's rows through pointers N
// a whole number of vectors.

// A operands, `from(i)`: rows i... Rows, A[i][k] at a[i * ld + k]; float32 rows anywhere,
// A[i][k] at rows[i][k] (serving's keys in their pages, forward.h); columns, A[i][k] at
// a[k * ld + i] (the forward's P^T of key-major blocks).
template <typename E>
struct RowsA {
  const E* a;
  int64_t ld;
  const E* at(int64_t i, int64_t k) const { return a + i * ld + k; }
  RowsA from(int64_t i) const { return {a + i * ld, ld}; }
};
struct PointedRowsA {
  const float* const* rows;
  const float* at(int64_t i, int64_t k) const { return rows[i] + k; }
  PointedRowsA from(int64_t i) const { return {rows + i}; }
};
struct ColumnsA {
  const float* a;
  int64_t ld;
  const float* at(int64_t i, int64_t k) const { return a + k * ld + i; }
  ColumnsA from(int64_t i) const { return {a + i, ld}; }
};

// B operands, `from(j)`: columns j... A panel, B[k][n] at panel_index(k, n, ld); or float32
// rows anywhere, B[k][n] at rows[k][n] (serving's V in its pages).
template <typename E>
struct PanelB {
  const E* b;
  int64_t ld;
  const E* at(int64_t k, int64_t n) const { return b + panel_index<E>(k, n, ld); }
  PanelB from(int64_t j) const { return {b + panel_index<E>(0, j, ld), ld}; }
};
struct PointedRowsB {
  const float* const* rows;
  int64_t col;
  const float* at(int64_t k, int64_t n) const { return rows[k] + col + n; }
  PointedRowsB from(int64_t j) const { return {rows, col + j}; }
};

template <int R, bool kAccumulate, typename E, int V, typename A, typename B>  // R x V vectors
inline void tile(int64_t k_len, const A& a, const B& b, float* c, int64_t ldc) {
  using Ops = DotOps<E>;
  vf acc[R][V];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 2
    for (int v = 0; v < V; ++v) {
      acc[r][v] = kAccumulate ? load(c + r * ldc + v * kLanes) : splat(0.0f);
    }
  }
  for (int64_t k = 0; k < k_len; k += kPair<E>) {
    typename Ops::B bv[V];
#pragma GCC unroll 2
    for (int v = 0; v < V; ++v) bv[v] = Ops::load_b(b.at(k, v * kLanes));
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const auto x = Ops::broadcast(a.at(r, k));
#pragma GCC unroll 2
      for (int v = 0; v < V; ++v) acc[r][v] = Ops::madd(acc[r][v], x, bv[v]);
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 2
    for (int v = 0; v < V; ++v) store(c + r * ldc + v * kLanes, acc[r][v]);
  }
}

template <bool kAccumulate, typename E, int V, typename A, typename B, int R = kRowTile>
inline void tail_rows(int rows, int64_t k_len, const A& a, const B& b, float* c, int64_t ldc) {
  if constexpr (R > 0) {
    if (rows == R) return tile<R, kAccumulate, E, V>(k_len, a, b, c, ldc);
    tail_rows<kAccumulate, E, V, A, B, R - 1>(rows, k_len, a, b, c, ldc);
  }
}

// Rows [0, m) of C's strip of V vectors at column j.
template <bool kAccumulate, typename E, int V, typename A, typename B>
inline void strip(int64_t m, int64_t j, int64_t k_len, const A& a, const B& b, float* c,
                  int64_t ldc) {
  const B bj = b.from(j);  // a B strip stays in L1 across the rows
  int64_t i = 0;
  for (; i + kRowTile <= m; i += kRowTile) {
    tile<kRowTile, kAccumulate, E, V>(k_len, a.from(i), bj, c + i * ldc + j, ldc);
  }
  if (i < m) {
    tail_rows<kAccumulate, E, V>(static_cast<int>(m - i), k_len, a.from(i), bj,
                                 c + i * ldc + j, ldc);
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

void release_tiles() { _tile_release(); }

// Every tile 16 rows of 64 bytes, configured by a thread's first dot of a parallel_for and
// released when its share ends (at_region_end, runtime.h): per dot, configuring and releasing
// took 250 ns, a quarter of a 32-row dot.
void configure_tiles() {
  if (at_region_end == release_tiles) return;
  TileConfig config;
  for (int t = 0; t < 8; ++t) config.bytes_per_row[t] = 64, config.rows[t] = 16;
  _tile_loadconfig(&config);
  at_region_end = release_tiles;
}

// C in 32 x 32 blocks of four 16 x 16 tiles (0-3), from two A tiles (4, 5: 16 rows x 32 k)
// and two B tiles (6, 7: 16 pairs of k x 16 columns).
template <bool kAccumulate>
void amx_gemm(int64_t m, int64_t n, int64_t k_len, const bf16_t* a, int64_t lda,
              const bf16_t* b, int64_t ldb, float* c, int64_t ldc) {
  configure_tiles();
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
}
#endif

// E: the dots' element type (float32 for the operands read through pointers or in columns).
template <bool kAccumulate, typename E = float, typename A, typename B>
void gemm(int64_t m, int64_t n, int64_t k_len, const A& a, const B& b, float* c, int64_t ldc) {
  for (int64_t j = 0; j < n; j += kColTile) {
    if (n - j <= kLanes) {
      strip<kAccumulate, E, 1>(m, j, k_len, a, b, c, ldc);
    } else {
      strip<kAccumulate, E, 2>(m, j, k_len, a, b, c, ldc);
    }
  }
}

template <bool kAccumulate, typename E>
void gemm(int64_t m, int64_t n, int64_t k_len, const E* a, int64_t lda, const E* b, int64_t ldb,
          float* c, int64_t ldc) {
#if defined(RANKATTN_AMX)
  if constexpr (std::is_same_v<E, bf16_t>) {
    if (amx_usable()) return amx_gemm<kAccumulate>(m, n, k_len, a, lda, b, ldb, c, ldc);
  }
#endif
  gemm<kAccumulate, E>(m, n, k_len, RowsA<E>{a, lda}, PanelB<E>{b, ldb}, c, ldc);
}

}  // namespace
