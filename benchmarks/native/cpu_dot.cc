// The cpu kernel's block dot alone, against this core's FMA peak (one thread).
//
//   g++ -O3 -march=native -std=c++17 -isystem "$(.venv/bin/python -c 'import jax;
//   print(jax.ffi.include_dir())')" benchmarks/native/cpu_dot.cc -o /tmp/cpu_dot && /tmp/cpu_dot
//
// (one command line).
//
// "hot": one block's operands, reused (they stay in L1 / L2); "cold": 64 different blocks
// in turn, as the kernel meets them. The peak is 16 independent FMA chains on registers.
#include <chrono>
#include <cstdio>

#include "../../src/rankattn/backends/cpu_attention.cc"

namespace {

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

double peak_gflops() {
  vf acc[16];
  for (int i = 0; i < 16; ++i) acc[i] = splat(1e-3f * i);
  vf a = splat(0.999f), b = splat(1e-4f);
  const long n = 100000000;
  auto start = std::chrono::steady_clock::now();
  for (long k = 0; k < n; ++k) {
#pragma GCC unroll 16
    for (int i = 0; i < 16; ++i) acc[i] = acc[i] * a + b;
    __asm__ volatile("" : "+v"(a));
  }
  double s = seconds_since(start);
  float sum = 0;
  for (int i = 0; i < 16; ++i) sum += acc[i][0];
  std::printf("(checksum %g)\n", sum);
  return 16.0 * kLanes * 2 * n / s / 1e9;
}

double dot_gflops(int64_t m, int64_t n, int64_t k, int blocks) {
  const int64_t lda = k + kLanes, ldb = n + kLanes, ldc = n + kLanes;
  std::vector<float> a(m * lda * blocks, 1.0f), b(k * ldb * blocks, 0.5f), c(m * ldc * blocks);
  const int reps = 4000;
  auto start = std::chrono::steady_clock::now();
  for (int r = 0; r < reps; ++r) {
    const int i = r % blocks;
    gemm<false>(m, n, k, a.data() + i * m * lda, lda, b.data() + i * k * ldb, ldb,
                c.data() + i * m * ldc, ldc);
  }
  return 2.0 * m * n * k * reps / seconds_since(start) / 1e9;
}

}  // namespace

int main() {
  std::printf("FMA peak, one core: %.0f GFLOP/s\n", peak_gflops());
  for (int64_t m : {64, 128}) {
    std::printf("dot %ld x 128 x 128: hot %.0f GFLOP/s, cold %.0f GFLOP/s\n",
                static_cast<long>(m), dot_gflops(m, 128, 128, 1), dot_gflops(m, 128, 128, 64));
  }
}
