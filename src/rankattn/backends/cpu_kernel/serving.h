// Serving's own kernel: Quest's page bounds. (Serving's exact scoring, the paged forward, is
// the forward of forward.h over a Problem whose keys are the cache's pages, problem.h, with
// each candidate's own key from separate arrays.)
//
// For each query row r and page j of batch row b,
//   U[r][j] = max(q_r, 0) . M_j + min(q_r, 0) . m_j,
// one dot of [q+ | q-] [R][2D] with the pages' [M; m] [2D][pages], kBoundPages pages per task.
// q [B, Hkv, R, D] (scaled), stats k_max / k_min [N, Hkv, D], page_table [B, M] (entries
// clamped to [0, N)), npages [B]: pages j >= npages[b] get -inf. Non-finite stats count as 0
// in the bound, and the page gets bad = 1 (the caller decides what such a page is worth).
//
// Part of cpu_attention.cc (see vectors.h).
#pragma once

#include <algorithm>
#include <cstdint>

#include "dots.h"
#include "panels.h"
#include "runtime.h"
#include "vectors.h"

namespace {

constexpr int64_t kBoundPages = 128;

struct PageBounds {
  int64_t batch, heads, rows, dim, num_pages, pages;  // B, Hkv, R, D, N, M
  const float *q, *k_max, *k_min;
  const int32_t *page_table, *npages;
  float* bounds;  // [B, Hkv, R, M]
  int32_t* bad;   // [B, Hkv, M]

  int64_t blocks() const { return (pages + kBoundPages - 1) / kBoundPages; }
  int64_t tasks() const { return batch * heads * blocks(); }

  // Pages [j0, j0 + kBoundPages) of (b, kv head).
  void run(int64_t task) const {
    const int64_t b = task / (heads * blocks()), hk = task / blocks() % heads;
    const int64_t j0 = task % blocks() * kBoundPages, nj = std::min(kBoundPages, pages - j0);
    const int64_t cols = round_up(nj, kColTile), ld = cols + kLanes, d2 = 2 * dim;
    thread_local Vector<float> a, stats, panel, c;
    a.resize(rows * d2);  // [q+ | q-]
    for (int64_t r = 0; r < rows; ++r) {
      const float* qr = q + ((b * heads + hk) * rows + r) * dim;
      for (int64_t d = 0; d < dim; ++d) {
        a[r * d2 + d] = std::max(qr[d], 0.0f);
        a[r * d2 + dim + d] = std::min(qr[d], 0.0f);
      }
    }
    stats.assign(nj * d2, 0.0f);  // [pages][M | m], zero for pages the row does not have
    for (int64_t jj = 0; jj < nj; ++jj) {
      const int64_t j = j0 + jj;
      bool is_bad = false;
      if (j < npages[b]) {
        const int64_t page = std::clamp<int64_t>(page_table[b * pages + j], 0, num_pages - 1);
        is_bad = finite_row<F32, float>(k_max + (page * heads + hk) * dim, dim, &stats[jj * d2]);
        is_bad |= finite_row<F32, float>(k_min + (page * heads + hk) * dim, dim,
                                         &stats[jj * d2 + dim]);
      }
      bad[(b * heads + hk) * pages + j] = is_bad;
    }
    panel.assign(d2 * ld, 0.0f);
    transpose(stats.data(), d2, nj, d2, panel.data(), ld);
    c.resize(rows * ld);
    // U = [q+ | q-] [M; m].
    gemm<false, float>(rows, cols, d2, a.data(), d2, panel.data(), ld, c.data(), ld);
    for (int64_t r = 0; r < rows; ++r) {
      float* o = bounds + ((b * heads + hk) * rows + r) * pages + j0;
      for (int64_t jj = 0; jj < nj; ++jj) o[jj] = j0 + jj < npages[b] ? c[r * ld + jj] : -kInf;
    }
  }
};

}  // namespace
