// The cpu kernel's block dots alone, against this core's FMA peak (one thread): float32,
// and bfloat16 on AMX or VDPBF16PS where the CPU has them.
//
//   g++ -O3 -march=native -std=c++17 -isystem "$(.venv/bin/python -c 'import jax;
//   print(jax.ffi.include_dir())')" benchmarks/native/cpu_dot.cc -o /tmp/cpu_dot && /tmp/cpu_dot
//
// (one command line).
//
// "hot": one block's operands, reused (they stay in L1 / L2); "cold": 64 different blocks
// in turn, as the kernel meets them. The peak is independent FMA chains on registers.
#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdio>

#include "../../src/rankattn/backends/cpu_attention.cc"

namespace {

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

// As many independent chains as fit the vector registers beside a and b: 16 of AVX-512's 32,
// 12 of AVX2's 16 (16 chains there spill, and measured 58 GFLOP/s on a Zen 3 whose dot runs at
// 95). Either is more than an FMA's latency times its throughput needs.
constexpr int kChains = kLanes == 16 ? 16 : 12;

double peak_gflops() {
  vf acc[kChains];
  for (int i = 0; i < kChains; ++i) acc[i] = splat(1e-3f * i);
  vf a = splat(0.999f), b = splat(1e-4f);
  const long n = 100000000;
  auto start = std::chrono::steady_clock::now();
  for (long k = 0; k < n; ++k) {
#pragma GCC unroll 16
    for (int i = 0; i < kChains; ++i) acc[i] = acc[i] * a + b;
    __asm__ volatile("" : "+v"(a));
  }
  double s = seconds_since(start);
  float sum = 0;
  for (int i = 0; i < kChains; ++i) sum += acc[i][0];
  std::printf("(checksum %g)\n", sum);
  return double(kChains) * kLanes * 2 * n / s / 1e9;
}

#if defined(__AVX512BF16__)
double bf16_peak_gflops() {  // 16 independent VDPBF16PS chains: 32 products each
  vf acc[16];
  for (int i = 0; i < 16; ++i) acc[i] = splat(1e-3f * i);
  auto a = DotOps<bf16_t>::broadcast(std::vector<bf16_t>{0x3f80, 0x3f80}.data());
  auto b = DotOps<bf16_t>::broadcast(std::vector<bf16_t>{0x3c00, 0x3c00}.data());
  const long n = 20000000;
  auto start = std::chrono::steady_clock::now();
  for (long k = 0; k < n; ++k) {
#pragma GCC unroll 16
    for (int i = 0; i < 16; ++i) acc[i] = DotOps<bf16_t>::madd(acc[i], a, b);
    __asm__ volatile("" : "+v"(a));
  }
  double s = seconds_since(start);
  float sum = 0;
  for (int i = 0; i < 16; ++i) sum += acc[i][0];
  std::printf("(checksum %g)\n", sum);
  return 16.0 * 64 * n / s / 1e9;
}
#endif

#if defined(RANKATTN_AMX)
// Nanoseconds per AMX instruction, each in a loop of its own over 4 tiles (so 4 are in
// flight): TDPBF16PS on 4 independent accumulators, TILELOADD of 1 KB tiles from L1 (4 KB
// in all), TILESTORED of 1 KB tiles to L1. A dot needs a load per TDPBF16PS in 2 x 2 blocks.
void amx_instruction_costs() {
  alignas(64) static bf16_t in[4 * 512];
  alignas(64) static float out[4 * 256];
  std::fill(in, in + 4 * 512, to_element<bf16_t>(1.0f));  // tiles of zeros load faster
  configure_tiles();
  auto ns_per_instruction = [](auto four_instructions) {  // four_instructions(), timed
    const long n = 2000000;
    const auto start = std::chrono::steady_clock::now();
    for (long i = 0; i < n; ++i) four_instructions();
    return seconds_since(start) / (4.0 * n) * 1e9;
  };
  const double dp = ns_per_instruction([] {
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
  });
  const double load = ns_per_instruction([] {
    _tile_loadd(4, in, 64);
    _tile_loadd(5, in + 512, 64);
    _tile_loadd(6, in + 1024, 64);
    _tile_loadd(7, in + 1536, 64);
  });
  const double stored = ns_per_instruction([] {
    _tile_stored(0, out, 64);
    _tile_stored(1, out + 256, 64);
    _tile_stored(2, out + 512, 64);
    _tile_stored(3, out + 768, 64);
  });
  std::exchange(at_region_end, nullptr)();
  std::printf("AMX, one core: TDPBF16PS %.1f ns (%.0f GFLOP/s), TILELOADD %.1f ns, TILESTORED "
              "%.1f ns\n", dp, 2.0 * 16 * 16 * 32 / dp, load, stored);
}
#endif

// One block dot C[m, n] = A[m, k] B[k, n] as the kernel calls it, in the dots' element type E,
// on buffers from the kernel's allocator (on cache lines), or `offset` bytes past their starts
// (16: where malloc puts a large block, which the kernel's buffers were until 2026-12-05).
template <typename E>
double dot_gflops(int64_t m, int64_t n, int64_t k, int blocks, int64_t offset = 0) {
  const int64_t lda = round_up(k, kDepth<E>) + kLanes, ldb = n + kLanes, ldc = n + kLanes;
  const int64_t a_size = rows_size<E>(m, lda), b_size = panel_size<E>(k, ldb);
  const int64_t c_size = rows_size<E>(m, ldc);
  Vector<std::byte> bytes_a(a_size * blocks * sizeof(E) + offset);
  Vector<std::byte> bytes_b(b_size * blocks * sizeof(E) + offset);
  Vector<std::byte> bytes_c(c_size * blocks * sizeof(float) + offset);
  E* a = reinterpret_cast<E*>(bytes_a.data() + offset);
  E* b = reinterpret_cast<E*>(bytes_b.data() + offset);
  float* c = reinterpret_cast<float*>(bytes_c.data() + offset);
  std::fill_n(a, a_size * blocks, to_element<E>(1.0f));
  std::fill_n(b, b_size * blocks, to_element<E>(0.5f));
  const int reps = 4000;
  auto start = std::chrono::steady_clock::now();
  for (int r = 0; r < reps; ++r) {
    const int i = r % blocks;
    gemm<false>(m, n, k, a + i * a_size, lda, b + i * b_size, ldb, c + i * c_size, ldc);
  }
  return 2.0 * m * n * k * reps / seconds_since(start) / 1e9;
}

#if defined(RANKATTN_AMX)
// float32 products from bfloat16 ones (what float32 dots on AMX would take: issue 40): each
// float32 x split into hi = bf16(x) and lo = bf16(x - hi), and C = A_lo B_hi + A_hi B_lo +
// A_hi B_hi in three AMX dots (A_lo B_lo and what the split drops, 2^-16 relative and under, are
// not computed). Its rate in float32 FLOPs (2 m n k per dot, not per product) on split
// operands, hot and cold as above; the split itself is not timed (the kernel's packing would
// write the two halves where it writes one float32 panel now). And the largest error of each
// way against a dot in double, relative to sum |a_i b_i| (the error bound's scale), on
// operands uniform in [-1, 1]. Every block holds the same operands.
struct SplitDot {
  int64_t m, n, k, lda, ldb, ldc, blocks;
  std::vector<float> a, b;  // float32 A rows, B rows (B[k][n] at k * n + n)
  Vector<bf16_t> a_hi, a_lo, b_hi, b_lo;  // `blocks` of each, one after another
  Vector<float> c;

  SplitDot(int64_t m_, int64_t n_, int64_t k_, int64_t blocks_)
      : m(m_), n(n_), k(k_), lda(round_up(k_, kDepth<bf16_t>) + kLanes), ldb(n_ + kLanes),
        ldc(n_ + kLanes), blocks(blocks_), a(m_ * k_), b(k_ * n_),
        a_hi(rows_size<bf16_t>(m_, lda) * blocks_), a_lo(a_hi.size()),
        b_hi(panel_size<bf16_t>(k_, ldb) * blocks_), b_lo(b_hi.size()),
        c(rows_size<float>(m_, ldc) * blocks_) {
    uint64_t state = 12345;
    auto uniform = [&state] {  // a 64-bit LCG's top bits, in [-1, 1)
      state = state * 6364136223846793005ULL + 1442695040888963407ULL;
      return static_cast<float>(static_cast<int64_t>(state >> 40) - (1 << 23)) / (1 << 23);
    };
    for (float& x : a) x = uniform();
    for (float& x : b) x = uniform();
    auto split = [](float x, bf16_t* hi, bf16_t* lo) {
      *hi = to_element<bf16_t>(x);
      *lo = to_element<bf16_t>(x - to_float(*hi));
    };
    const int64_t a_size = a_hi.size() / blocks, b_size = b_hi.size() / blocks;
    for (int64_t block = 0; block < blocks; ++block) {
      for (int64_t i = 0; i < m; ++i)
        for (int64_t d = 0; d < k; ++d) {
          const int64_t at = block * a_size + i * lda + d;
          split(a[i * k + d], &a_hi[at], &a_lo[at]);
        }
      for (int64_t d = 0; d < k; ++d)
        for (int64_t j = 0; j < n; ++j) {
          const int64_t at = block * b_size + panel_index<bf16_t>(d, j, ldb);
          split(b[d * n + j], &b_hi[at], &b_lo[at]);
        }
    }
  }
  void three_products(int64_t block) {
    const int64_t a_at = block * (a_hi.size() / blocks), b_at = block * (b_hi.size() / blocks);
    float* cb = &c[block * (c.size() / blocks)];
    amx_gemm<false>(m, n, k, &a_lo[a_at], lda, &b_hi[b_at], ldb, cb, ldc);
    amx_gemm<true>(m, n, k, &a_hi[a_at], lda, &b_lo[b_at], ldb, cb, ldc);
    amx_gemm<true>(m, n, k, &a_hi[a_at], lda, &b_hi[b_at], ldb, cb, ldc);
  }
  double largest_error(const float* got, int64_t ld) const {  // relative to sum |a_i b_i|
    double worst = 0;
    for (int64_t i = 0; i < m; ++i)
      for (int64_t j = 0; j < n; ++j) {
        double exact = 0, scale = 0;
        for (int64_t d = 0; d < k; ++d) {
          exact += double(a[i * k + d]) * b[d * n + j];
          scale += std::abs(double(a[i * k + d]) * b[d * n + j]);
        }
        worst = std::max(worst, std::abs(got[i * ld + j] - exact) / scale);
      }
    return worst;
  }
};

void split_dot_report(int64_t m, int64_t n, int64_t k) {
  double gflops[2];  // hot (one block), cold (64)
  double error3 = 0;
  for (int cold = 0; cold < 2; ++cold) {
    SplitDot dot(m, n, k, cold ? 64 : 1);
    const int reps = 4000;
    auto start = std::chrono::steady_clock::now();
    for (int r = 0; r < reps; ++r) dot.three_products(r % dot.blocks);
    gflops[cold] = 2.0 * m * n * k * reps / seconds_since(start) / 1e9;
    std::exchange(at_region_end, nullptr)();
    error3 = dot.largest_error(dot.c.data(), dot.ldc);
  }
  SplitDot dot(m, n, k, 1);  // the float32 dot on the same operands (n whole strips of 32)
  Vector<float> c32(dot.c.size());
  gemm<false, float>(m, n, k, dot.a.data(), k, dot.b.data(), n, c32.data(), dot.ldc);
  std::printf("float32 as three bfloat16 dots (AMX) %ld x %ld x %ld: hot %.0f GFLOP/s, cold %.0f "
              "GFLOP/s; largest error / sum |a b| %.1e (the float32 dot's %.1e)\n",
              static_cast<long>(m), static_cast<long>(n), static_cast<long>(k), gflops[0],
              gflops[1], error3, dot.largest_error(c32.data(), dot.ldc));
}
#endif

}  // namespace

int main() {
  std::printf("FMA peak, one core: %.0f GFLOP/s\n", peak_gflops());
  for (int64_t m : {64, 128}) {
    std::printf("float32 dot %ld x 128 x 128: hot %.0f GFLOP/s, cold %.0f GFLOP/s\n",
                static_cast<long>(m), dot_gflops<float>(m, 128, 128, 1),
                dot_gflops<float>(m, 128, 128, 64));
  }
#if defined(__AVX512BF16__)
  std::printf("VDPBF16PS peak, one core: %.0f GFLOP/s\n", bf16_peak_gflops());
#if defined(RANKATTN_AMX)
  if (amx_usable()) amx_instruction_costs();
  const char* unit = amx_usable() ? "AMX" : "VDPBF16PS";
#else
  const char* unit = "VDPBF16PS";
#endif
  for (int64_t m : {64, 128}) {
    std::printf("bfloat16 dot (%s) %ld x 128 x 128: hot %.0f GFLOP/s, cold %.0f GFLOP/s\n", unit,
                static_cast<long>(m), dot_gflops<bf16_t>(m, 128, 128, 1),
                dot_gflops<bf16_t>(m, 128, 128, 64));
  }
  std::printf("bfloat16 dot (%s) 128 x 128 x 128, buffers 16 bytes off their cache lines: hot "
              "%.0f GFLOP/s, cold %.0f GFLOP/s\n", unit, dot_gflops<bf16_t>(128, 128, 128, 1, 16),
              dot_gflops<bf16_t>(128, 128, 128, 64, 16));
#if defined(RANKATTN_AMX)
  if (amx_usable()) {
    for (int64_t m : {64, 128}) split_dot_report(m, 128, 128);
  }
#endif
#endif
}
