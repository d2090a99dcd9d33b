// Serving's own parts of the kernel: the mask of its exact scoring, built from the histories'
// lengths, and Quest's page bounds. (Serving's scoring itself is the forward of forward.h over a
// Problem whose keys are the cache's pages, problem.h, with each candidate's own key from
// separate arrays.)
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
#include "problem.h"
#include "runtime.h"
#include "vectors.h"

namespace {

// Serving's exact scoring as a mask, from the lengths alone: every query of batch row b is a
// candidate (segment -1) that sees keys [0, L_b) of its row (segment 1, the rest 0), L_b =
// lengths[b] clamped to [0, S], and its own key; the queries come after the keys (positions S
// + t and j). Its block plan: key blocks below L_b full, the one L_b ends in partial, the rest
// unvisited. It is what scoring.py's _candidates and blocks.make_block_plan give the general
// entry, built here so that a request's XLA program is the kernel call alone: XLA's CPU
// client runs a program that its cost analysis puts under 1000 flops (a custom call counts
// as unknown, -1) on the calling thread, without the thread hop of asynchronous dispatch
// (60-110 us of one user's 64-candidate request, benchmarks/CPU_KERNEL.md).
struct CandidatesMask {
  Vector<int32_t> seg_q, seg_k, pos_q, pos_k, kv_index, full_count, count;

  // Builds the mask of pr's shapes and points pr at it (pr must not outlive it).
  CandidatesMask(Problem& pr, const int32_t* lengths)
      : seg_q(pr.batch * pr.q_len, -1), seg_k(pr.batch * pr.kv_len),
        pos_q(pr.batch * pr.q_len), pos_k(pr.batch * pr.kv_len),
        kv_index(pr.batch * pr.n_q * pr.n_k), full_count(pr.batch * pr.n_q),
        count(pr.batch * pr.n_q) {
    for (int64_t b = 0; b < pr.batch; ++b) {
      const int64_t length = std::clamp<int64_t>(lengths[b], 0, pr.kv_len);
      for (int64_t j = 0; j < pr.kv_len; ++j) {
        seg_k[b * pr.kv_len + j] = j < length;
        pos_k[b * pr.kv_len + j] = static_cast<int32_t>(j);
      }
      for (int64_t t = 0; t < pr.q_len; ++t) {
        pos_q[b * pr.q_len + t] = static_cast<int32_t>(pr.kv_len + t);
      }
      for (int64_t qb = 0; qb < pr.n_q; ++qb) {
        full_count[b * pr.n_q + qb] = static_cast<int32_t>(length / pr.block_k);
        count[b * pr.n_q + qb] = static_cast<int32_t>((length + pr.block_k - 1) / pr.block_k);
        for (int64_t kb = 0; kb < pr.n_k; ++kb) {
          kv_index[(b * pr.n_q + qb) * pr.n_k + kb] = static_cast<int32_t>(kb);
        }
      }
    }
    pr.seg_q = seg_q.data(), pr.seg_k = seg_k.data(), pr.pos_q = pos_q.data();
    pr.pos_k = pos_k.data(), pr.kv_index = kv_index.data();
    pr.full_count = full_count.data(), pr.count = count.data();
  }
};

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
