// Vector math and storage dtypes: the float / int vectors every loop of the kernel runs on,
// exp for a vector, horizontal max and sum, and the float32 / bfloat16 / float16 conversions.
//
// Part of cpu_attention.cc, the one translation unit that includes these headers (hence the
// anonymous namespace: nothing here is visible outside the library).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <utility>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

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

inline vi splat_i(int32_t x) { return x - vi{}; }
inline vi load_i(const int32_t* p) {
  vi v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline void store(int32_t* p, vi v) { std::memcpy(p, &v, sizeof v); }
inline bool any_lane(vi x) {
  for (int c = 0; c < kLanes; ++c) {
    if (x[c]) return true;
  }
  return false;
}

int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
constexpr float kLog2e = 1.44269504088896341f;

#if defined(__AVX512F__)
// The AVX-512 intrinsics below are their all-lanes zero-masking forms, which compile to the
// same unmasked instructions: GCC 12's plain _mm512_scalef_ps and _mm512_roundscale_ps merge
// into _mm512_undefined_ps(), which -Wmaybe-uninitialized flags once inlined, failing the
// -Werror build (tests/test_cpu_kernel.py checks that g++ builds it).
constexpr __mmask16 kAllLanes = 0xFFFF;
#endif

// p 2^n for p within a factor 2 of 1, rounded once: one VSCALEFPS with AVX-512, else p times
// 2^n built from its exponent bits, for whole n in [-126, 127]. kPastExponents: n may also be
// 128 (vexp2 rounds t in [127.5, 128) to n = 128, and p < 1 keeps 2^t finite there) or -127,
// which one float's exponent field cannot hold: without AVX-512, p is then scaled by
// 2^floor(n/2) (exact: the product stays normal) and 2^(n - floor(n/2)), five more
// instructions per vector (15% of serving's softmax on a Zen 3, CPU_KERNEL.md). For n <= 127
// both give the same bits.
template <bool kPastExponents>
inline vf times_pow2(vf p, vf n) {
#if defined(__AVX512F__)
  return _mm512_maskz_scalef_ps(kAllLanes, p, n);
#else
  if constexpr (kPastExponents) {
    const vi whole = __builtin_convertvector(n, vi), half = whole >> 1;
    const vi bits_low = (half + 127) << 23, bits_high = (whole - half + 127) << 23;
    vf low, high;
    std::memcpy(&low, &bits_low, sizeof low);
    std::memcpy(&high, &bits_high, sizeof high);
    return p * low * high;
  } else {
    const vi bits = (__builtin_convertvector(n, vi) + 127) << 23;
    vf scale;
    std::memcpy(&scale, &bits, sizeof scale);
    return p * scale;
  }
#endif
}

// exp(x) for a vector (the soft cap's tanh; the softmax's exp is vexp2 below): a degree-6
// polynomial on [-ln2/2, ln2/2] after x = n ln2 + r, within 1.01 ulp of exp in double over
// every float in [-87.3, 88.3] (measured on all 2.2e9 of them; 0.99 ulp in builds without
// FMA). Exact 0 below -87.3; above 88.3 it stays at exp(88.3) (tanh only needs it large); NaN
// stays NaN.
inline vf vexp(vf x) {
  const vf lo = splat(-87.3f), hi = splat(88.3f);
  const vi underflow = x < lo;
  x = x < lo ? lo : x;
  x = x > hi ? hi : x;
  const vf magic = splat(12582912.0f);  // 1.5 * 2^23: adding it rounds to an integer
  vf n = (x * splat(kLog2e) + magic) - magic;
  vf r = x - n * splat(0.693359375f);
  r = r - n * splat(-2.12194440e-4f);
  vf p = splat(1.9875691500e-4f);
  p = p * r + splat(1.3981999507e-3f);
  p = p * r + splat(8.3334519073e-3f);
  p = p * r + splat(4.1665795894e-2f);
  p = p * r + splat(1.6666665459e-1f);
  p = p * r + splat(5.0000001201e-1f);
  p = p * (r * r) + r + splat(1.0f);
  return underflow ? splat(0.0f) : times_pow2<false>(p, n);  // n in [-126, 127]
}

// The t a vexp2 call may get: any (kWhole), or a softmax's t = (s - m') log2(e) <= 0 (kSoftmax;
// the difference is taken before the scaling, so it is <= 0 however large m' is), where n <= 0
// and 2^n is one scale (times_pow2). Both give the same bits where n <= 127.
enum class Exp2Range { kWhole, kSoftmax };

// 2^t for a vector, the softmax's exp in base 2: the forward subtracts the row's max from its
// logits and scales the difference by log2(e) (t = (s - m) log2(e)), which leaves
// t = n + f, n = round(t), and a degree-6 polynomial for 2^f on [-1/2, 1/2] (fitted for
// relative error), scaled by 2^n. Within 0.95 ulp of 2^t in double (8.0e-8 relative) on every
// float in [-126, 128) (FMA builds; tests/test_cpu_kernel_numerics.py), as accurate as vexp,
// in 12 vector instructions per 16 logits with the FMA against vexp's 19 with the scaling
// (the bfloat16 forward on AMX: 5-9% faster, CPU_KERNEL.md).
// Exact 0 below -126 (masked -inf logits give p = 0, so that a row that sees no key has
// l = 0); NaN stays NaN; from 128 up, inf (the rows of an infinite input, which the kernel poisons,
// are the only ones that see one).
// kDegree 4, for the p that are rounded to bfloat16 next (relative 2^-9): a degree-4
// polynomial, within 2.7e-6 relative (tests/test_cpu_kernel_numerics.py), two FMAs fewer per
// 16 logits, a few percent of a bfloat16 forward on AMX (CPU_KERNEL.md).
template <int kDegree = 6, Exp2Range kRange = Exp2Range::kWhole>
inline vf vexp2(vf t) {
  static_assert(kDegree == 6 || kDegree == 4, "vexp2 has degree-6 and degree-4 polynomials");
  const vi underflow = t < -126.0f;
#if defined(__AVX512F__)  // VRNDSCALEPS and VSCALEFPS take every input, infinities included
  const vf n = _mm512_maskz_roundscale_ps(kAllLanes, t,
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
#else  // n goes through an int below: t is clamped to where it fits
  t = t < -127.0f ? splat(-127.0f) : t;
  t = t > 128.0f ? splat(128.0f) : t;
  const vf magic = splat(12582912.0f);  // 1.5 * 2^23: adding it rounds to an integer
  const vf n = (t + magic) - magic;
#endif
  const vf f = t - n;
  vf p;
  if constexpr (kDegree == 6) {
    p = splat(1.534572074888274e-4f);
    p = p * f + splat(1.3399895979091525e-3f);
    p = p * f + splat(9.618489071726799e-3f);
    p = p * f + splat(5.550329014658928e-2f);
    p = p * f + splat(2.4022646248340607e-1f);
    p = p * f + splat(6.931471824645996e-1f);
    p = p * f + splat(1.0f);
  } else {
    p = splat(9.570098482072353e-3f);
    p = p * f + splat(5.5917855352163315e-2f);
    p = p * f + splat(2.40247443318367e-1f);
    p = p * f + splat(6.931217908859253e-1f);
    p = p * f + splat(9.999992847442627e-1f);
  }
  return underflow ? splat(0.0f) : times_pow2<kRange == Exp2Range::kWhole>(p, n);
}

// tanh(y) for a vector (the soft cap c tanh(s / c)). For |y| >= 0.625, 1 - 2 / (exp(2|y|) + 1)
// with y's sign, which saturates cleanly at +-1. Below, that form cancels: at large caps
// (30, 80) logits sit at |y| ~ 0.01-0.1, where it lost eps / |y| relative (a cap of 50's
// logits carried 8x the error of exact tanh); there tanh(y) = y + y^3 P(y^2), P of degree 5
// fitted by least squares to (tanh(y) - y) / y^3 on |y| <= 0.625 (weighted by relative
// error). Within 1.33 ulp of tanh in double (0.75 on the polynomial's range), measured by
// tests/test_cpu_kernel_numerics.py.
inline vf vtanh(vf y) {
  const vf a = y < 0 ? -y : y, z = y * y;
  vf p = splat(2.138226293e-3f);
  p = p * z + splat(-8.171788417e-3f);
  p = p * z + splat(2.169821039e-2f);
  p = p * z + splat(-5.394625291e-2f);
  p = p * z + splat(1.333320141e-1f);
  p = p * z + splat(-3.333333135e-1f);
  const vf small = y + y * z * p;
  const vf large = 1 - 2 / (vexp(2 * a) + 1);
  return a < 0.625f ? small : (y < 0 ? -large : large);
}

// Horizontal max and sum as a tree of halves, in registers (per row and block, a lane-by-lane
// loop measured a quarter of the forward's softmax pass, and halves taken through memory kept
// the running sum on the stack).
template <size_t kOffset, typename V, size_t... kLane>
inline auto lanes(V x, std::index_sequence<kLane...>) {
#if defined(__clang__) || __GNUC__ >= 12
  return __builtin_shufflevector(x, x, (kOffset + kLane)...);
#else  // GCC 11 (Ubuntu 22.04's) has no __builtin_shufflevector: the half by memcpy
  using Element = std::remove_reference_t<decltype(x[0])>;
  typedef Element Half __attribute__((vector_size(sizeof...(kLane) * sizeof(Element))));
  Half half;
  std::memcpy(&half, reinterpret_cast<const char*>(&x) + kOffset * sizeof(Element), sizeof half);
  return half;
#endif
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

// Each lane rounded to bfloat16, to nearest even (finite and infinite lanes; p and ds, the
// only values rounded here, are never NaN): its bits, in 16 or (bf16_bits) 32-bit lanes. Only
// CPUs with AVX-512 BF16 round (the others' dots take float32), and there it is one
// VCVTNEPS2BF16 (the shifts, adds and permute of the portable form measured a third of the
// bfloat16 forward's softmax pass on AMX). The instruction takes denormals as 0 (DAZ / FTZ):
// a p or ds under 1.2e-38 rounds to 0 instead of to a bfloat16 denormal.
typedef uint32_t vu __attribute__((vector_size(kLanes * sizeof(uint32_t))));
typedef uint16_t vh __attribute__((vector_size(kLanes * sizeof(uint16_t))));
inline vh bf16_round(vf x) {
  vh h;
#if defined(__AVX512BF16__)
  const __m256bh rounded = _mm512_cvtneps_pbh(x);
  std::memcpy(&h, &rounded, sizeof h);
#else
  vu bits;
  std::memcpy(&bits, &x, sizeof bits);
  h = __builtin_convertvector((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16, vh);
#endif
  return h;
}
inline vu bf16_bits(vf x) { return __builtin_convertvector(bf16_round(x), vu); }

}  // namespace
