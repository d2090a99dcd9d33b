// The backward. The caller passes, per query row [B, Sq, Hq], the lse (+inf for rows that pass
// no gradient) and delta = rowsum(dO * O) - d lse (semantics.backward_rows). Then with
// s = scale q . k and t the query's logit multiplier (1 without one):
//   p = exp(t cap(s) - lse),  dp = dO . v,  ds = p (dp - delta) t cap'(s),
//   dq = scale * ds k,  dk = scale * ds^T q,  dv = p^T dO.
// Every block pair is computed once, key-major (rows are keys, columns query rows), by the
// dk / dv work of its key block: 5 dots per pair. Per pair of a key block (K) and a query
// block (Q, dO):
//   S^T = K Q^T,  dP^T = V dO^T                      (dots: K and V rows, Q^T and dO^T panels)
//   P^T = exp(t cap(scale S^T) - lse), masked to 0   (Problem::logits, then the exp)
//   dV += P^T dO                                     (a dot: P^T rows, the dO panel)
//   dS^T = P^T (dP^T - delta) t cap'                 (Problem::logit_grads)
//   dK += dS^T Q                                     (a dot: dS^T rows, the Q panel)
//   dQ^T += K^T dS^T                                 (a dot: K^T rows, the dS^T panel)
// in one of two passes (rows_pass picks), which add every dQ^T's pairs in ascending
// key-block order and every dK / dV's in ascending query-block order, so they give the same
// bits:
//  - rows: one task per (batch row, kv head) runs its block pairs and adds each pair's dQ^T
//    term at once, into the dQ^T its task alone writes; by key (key blocks outer, each
//    one's dK / dV in cache) or, where a query block's panels and dQ^T reach 512 KiB, by
//    query (query blocks outer, each one's panels and dQ^T in cache; queries_outer);
//  - blocks: one task per key block keeps its pairs' dS^T (KeptGrads), then one task per
//    query block adds its dQ^T terms: for calls whose (batch row, kv head) pairs do not
//    fill the threads. Keeping dS^T writes it out of cache and reads it back, which the
//    rows pass saves (CPU_KERNEL.md measures both).
//
// Part of cpu_attention.cc (see vectors.h).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <utility>

#include "dots.h"
#include "panels.h"
#include "problem.h"
#include "runtime.h"
#include "vectors.h"

namespace {

thread_local Workspace grad_memory;

// dS^T of the block pairs of a chunk of key blocks, as the panel dQ^T += K^T dS^T reads:
// written by the dk / dv tasks of the chunk, then added into each query block's dQ^T by the
// dq tasks. A chunk is as many key blocks (in (b, kv head, block) order) as fit
// RANKATTN_CPU_BACKWARD_MB (default 1024 MiB; at least one block), so every pair costs 5 dots
// however long the sequence. Each query block adds its pairs in ascending key-block order in
// every chunking, so dq has the same bits for any budget and thread count.
template <typename E>
struct KeptGrads {
  const Problem& pr;
  Vector<int64_t> first;  // per key task: the index of its first pair, over all pairs
  int64_t block_elements, budget_pairs;
  int64_t start = 0, end = 0;  // the chunk: key tasks [start, end)
  E* store = nullptr;
  // Per query task, the chunk's pairs it adds (key block, slot), as CSR rows.
  Vector<int64_t> row_start;
  Vector<std::pair<int32_t, const E*>> pairs;

  KeptGrads(const Problem& pr, int64_t budget_bytes)
      : pr(pr), first(pr.batch * pr.kv_heads * pr.n_k + 1, 0),
        block_elements(panel_size<E>(pr.block_k, pr.ld_rows())),
        budget_pairs(budget_bytes / (block_elements * static_cast<int64_t>(sizeof(E)))),
        row_start(pr.batch * pr.kv_heads * pr.n_q + 1) {
    for (int64_t t = 0; t + 1 < static_cast<int64_t>(first.size()); ++t) {
      first[t + 1] = first[t] + list(t).count;
    }
  }
  int64_t key_tasks() const { return static_cast<int64_t>(first.size()) - 1; }
  // Key task t = (b, kv head, key block)'s list of query blocks.
  Visits list(int64_t t) const {
    const int64_t b = t / (pr.kv_heads * pr.n_k), kb = t % pr.n_k;
    return visits(pr, pr.q_index, pr.q_full_count, pr.q_count, b * pr.n_k + kb, pr.n_q);
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
      pairs[free_slot[row]++] = {static_cast<int32_t>(t % pr.n_k), slot(t, e)};
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
        if (qb >= 0 && qb < pr.n_q) fn(t / pr.n_k * pr.n_q + qb, t, e);
      }
    }
  }
  E* slot(int64_t t, int64_t e) const {
    return store + (first[t] - first[start] + e) * block_elements;
  }
};

// Whether the backward takes the rows pass (see above): unless RANKATTN_CPU_BACKWARD_PASS says,
// where its tasks, one per (batch row, kv head), fill the call's threads: a multiple of them,
// or so many that a last partial round idles little. (Equal rows then take equal time; rows of
// very unequal masks would balance better in the blocks pass.)
inline bool rows_pass(int64_t rows, int64_t threads) {
  switch (settings().backward_pass) {
    case BackwardPass::kRows:
    case BackwardPass::kRowsByKey:
    case BackwardPass::kRowsByQuery: return true;
    case BackwardPass::kBlocks: return false;
    case BackwardPass::kAuto: break;
  }
  return rows % threads == 0 || rows >= 8 * threads;
}

// Whether the rows pass takes query blocks outer: where a query block's float32 panels and
// dQ^T (its rows: the group's heads times block_q, 3 D + 2 Dv floats each) reach 512 KiB, a
// quarter of a Sapphire Rapids core's L2. Key blocks outer, those are read again for every
// key block; query blocks outer, a key block's K, K^T, V and dK / dV accumulators are. At the
// default 64 x 256 blocks that is 4 query heads per kv head at D = 128, 2 at D = 256: there
// the sweep's fwd+bwd cells measured 1-10% faster by query, and at 2 heads of D = 128 2-6%
// slower (CPU_KERNEL.md). bfloat16 panels (half the bytes) measured no faster by query. By
// query a thread keeps every key block's dK / dV accumulators of its row (float32, K and V's
// size): at most kMaxQueryOrderBytes, past which (about 58K keys at D = Dv = 128) it takes
// key order.
constexpr int64_t kMaxQueryOrderBytes = int64_t{64} << 20;
template <typename E>
bool queries_outer(const Problem& pr) {
  switch (settings().backward_pass) {
    case BackwardPass::kRowsByKey: return false;
    case BackwardPass::kRowsByQuery: return true;
    default: break;
  }
  const int64_t query_block_bytes =
      pr.group() * pr.block_q * (3 * pr.dim + 2 * pr.dim_v) * int64_t{sizeof(float)};
  const int64_t accumulator_bytes = pr.n_k * (rows_size<E>(pr.block_k, pr.ld_d()) +
                                              rows_size<E>(pr.block_k, pr.ld_dv())) *
                                    int64_t{sizeof(float)};
  return std::is_same_v<E, float> && query_block_bytes >= (int64_t{512} << 10) &&
         accumulator_bytes <= kMaxQueryOrderBytes;
}

// A visit list's valid entries in ascending block order (a list holds its full blocks, then
// its partial ones): the order every dK / dV and dQ^T adds its pairs in, whichever pass and
// order computes them. `entry` is the index in the list (the blocks pass's kept slot); an
// entry outside [0, limit) (a malformed plan) is skipped; a block listed twice keeps its
// list order.
struct Visit {
  int32_t block, entry;
  bool masked;
};
inline void ascending(const Visits& list, Vector<Visit>& out) {
  out.clear();
  for (int64_t e = 0; e < list.count; ++e) {
    const int32_t block = list.index[e];
    if (block >= 0 && block < list.limit) {
      out.push_back({block, static_cast<int32_t>(e), e >= list.full});
    }
  }
  for (size_t i = 1; i < out.size(); ++i) {  // insertion: the list is two ascending runs
    const Visit x = out[i];
    size_t j = i;
    for (; j > 0 && out[j - 1].block > x.block; --j) out[j] = out[j - 1];
    out[j] = x;
  }
}

template <typename D>
struct Backward {
  using T = typename D::T;
  using E = typename DotElement<D>::type;
  const Problem& pr;
  const KeyPanels<E>& keys;
  const QueryPanels<E>& queries;
  const KeptGrads<E>& kept;  // q, k, v and dO are read from the panels only
  T *dq, *dk, *dv;

  // Per-thread buffers of one block pair, reused by every task the thread runs (see
  // Workspace), [nk][ld_rows] each: in bfloat16, S^T, then P^T, then dS^T in place (in
  // float32 the blocks pass computes them in the pair's kept slot, see pair_grads); dP^T -
  // delta; and with a cap
  // the logits before it.
  struct Pair {
    Vector<float> s_t, dp_t, raw;
  };

  // P^T into s_t ([nk][ld_rows]) and dP^T - delta into pair.dp_t, and with a cap the logits
  // before it into pair.raw.
  void probabilities(const KeyPanel<E>& key, const QueryPanel<E>& qp, bool masked, float* s_t,
                     Pair& pair) const {
    const int64_t nk = key.nk, ld_rows = pr.ld_rows(), row_cols = pr.row_cols();
    pair.dp_t.resize(rows_size<E>(nk, ld_rows));
    if (pr.softcap > 0) pair.raw.resize(nk * ld_rows);
    // S^T = K Q^T, dP^T = V dO^T.
    gemm<false>(nk, row_cols, pr.dim, key.k_rows, pr.ld_d(), qp.q_t_panel, ld_rows, s_t,
                ld_rows);
    gemm<false>(nk, row_cols, pr.dim_v, key.v_rows, pr.ld_dv(), qp.d_out_t_panel, ld_rows,
                pair.dp_t.data(), ld_rows);
    for (int64_t j = 0; j < nk; ++j) {  // each column with its query row's lse
      float* sr = s_t + j * ld_rows;
      float* dr = pair.dp_t.data() + j * ld_rows;
      pr.logits(sr, row_cols, pr.softcap > 0 ? pair.raw.data() + j * ld_rows : nullptr,
                [&](int64_t r) { return load(qp.multiplier + r); });
      const vi sk = splat_i(key.seg[j]), pk = splat_i(key.pos[j]);
      for (int64_t r = 0; r < row_cols; r += kLanes) {  // padded rows: shift +inf, so p = 0
        vf prob = softmax_exp2<E>((load(sr + r) - load(qp.shift + r)) * kLog2e);
        if (masked) {
          prob = pr.sees_history(load_i(qp.seg + r), load_i(qp.pos + r), sk, pk) ? prob : 0;
        }
        store(sr + r, prob);
        store(dr + r, load(dr + r) - load(qp.delta + r));
      }
    }
  }

  // dS^T over P^T in s_t.
  void logit_grads_of(int64_t nk, const QueryPanel<E>& qp, float* s_t, Pair& pair) const {
    const int64_t ld_rows = pr.ld_rows();
    for (int64_t j = 0; j < nk; ++j) {
      pr.logit_grads(s_t + j * ld_rows, pair.dp_t.data() + j * ld_rows,
                     pr.softcap > 0 ? pair.raw.data() + j * ld_rows : nullptr, pr.row_cols(),
                     [&](int64_t r) { return load(qp.multiplier + r); });
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
    float dot = 0, dpv = 0;  // q . k and dO . v
    for (int64_t d = 0; d < pr.dim; ++d) {
      dot += element(qp.q_panel, pr.ld_d(), r, d) * to_float(own_k[d]);
    }
    for (int64_t d = 0; d < pr.dim_v; ++d) {
      dpv += element(qp.d_out_panel, pr.ld_dv(), r, d) * to_float(own_v[d]);
    }
    *prob = std::exp2((pr.logit(dot, qp.multiplier[r]) - qp.shift[r]) * kLog2e);
    return pr.logit_grad(dot, *prob, dpv - qp.delta[r], qp.multiplier[r]);
  }

  // dQ^T of query task `task` (b, kv head, query block) += K^T dS^T over the chunk's pairs.
  void dq_add(int64_t task) const {
    const int64_t b = task / (pr.kv_heads * pr.n_q), hk = task / pr.n_q % pr.kv_heads;
    const QueryPanel<E> qp = queries.get(b, hk, task % pr.n_q);
    for (int64_t i = kept.row_start[task]; i < kept.row_start[task + 1]; ++i) {
      const auto& [kb, ds_t] = kept.pairs[i];
      dq_pair(keys.get(b, hk, kb), ds_t, qp);
    }
  }

  // dQ^T += K^T dS^T of one pair, dS^T as the panel ds_t.
  void dq_pair(const KeyPanel<E>& key, const E* ds_t, const QueryPanel<E>& qp) const {
    // Only dQ^T's first `dim` rows (whole row tiles of AMX) are read: d_cols rounds D up
    // to the column tile, 96 for D = 80.
    gemm<true>(round_up(pr.dim, kRows<E>), pr.row_cols(), key.nk, key.k_t_rows, pr.ld_keys(),
               ds_t, pr.ld_rows(), qp.dq_t, pr.ld_rows());
  }

  // dq of query task `task`: its dQ^T, the candidates' own keys, the scale.
  void dq_finish(int64_t task) const {
    const int64_t b = task / (pr.kv_heads * pr.n_q), hk = task / pr.n_q % pr.kv_heads;
    const QueryPanel<E> qp = queries.get(b, hk, task % pr.n_q);
    const int64_t g_len = pr.group(), ld_rows = pr.ld_rows();
    for (int64_t t = 0; t < qp.nq; ++t) {
      const int64_t i = qp.q0 + t;
      const bool own = pr.own && qp.seg[t] < 0;
      const E *own_k = nullptr, *own_v = nullptr;  // the rows of key i
      if (own) {  // own implies q_len == kv_len, so key i exists
        const KeyPanel<E> key = keys.get(b, hk, i / pr.block_k);
        own_k = key.k_rows + (i % pr.block_k) * pr.ld_d();
        own_v = key.v_rows + (i % pr.block_k) * pr.ld_dv();
      }
      for (int64_t g = 0; g < g_len; ++g) {
        const int64_t r = g * qp.nq + t;
        if (own) {
          float prob;
          const float d_s = own_grad(qp, r, own_k, own_v, &prob);
          for (int64_t d = 0; d < pr.dim; ++d) qp.dq_t[d * ld_rows + r] += d_s * to_float(own_k[d]);
        }
        T* o = dq + ((b * pr.q_len + i) * pr.q_heads + hk * g_len + g) * pr.dim;
        for (int64_t d = 0; d < pr.dim; ++d) o[d] = D::from(qp.dq_t[d * ld_rows + r] * pr.scale);
      }
    }
  }

  // The rows pass's task: every block pair of (batch row, kv head) `row`, key blocks outer
  // (each key block's dK / dV finished before the next) or query blocks outer.
  void row_task(int64_t row) const {
    if (!queries_outer<E>(pr)) {
      for (int64_t kb = 0; kb < pr.n_k; ++kb) dkv_task(row * pr.n_k + kb, true);
      return;
    }
    const int64_t b = row / pr.kv_heads, hk = row % pr.kv_heads;
    const int64_t dk_size = rows_size<E>(pr.block_k, pr.ld_d());
    const int64_t dv_size = rows_size<E>(pr.block_k, pr.ld_dv());
    thread_local Vector<float> dk_acc, dv_acc;  // every key block's, one after another
    thread_local Vector<Visit> order;
    dk_acc.assign(pr.n_k * dk_size, 0.0f);
    dv_acc.assign(pr.n_k * dv_size, 0.0f);
    for (int64_t qb = 0; qb < pr.n_q; ++qb) {
      const QueryPanel<E> qp = queries.get(b, hk, qb);
      ascending(visits(pr, pr.kv_index, pr.full_count, pr.count, b * pr.n_q + qb, pr.n_k),
                order);
      for (const Visit& pair : order) {
        pair_grads(keys.get(b, hk, pair.block), qp, pair.masked, nullptr,
                   dk_acc.data() + pair.block * dk_size, dv_acc.data() + pair.block * dv_size);
      }
    }
    for (int64_t kb = 0; kb < pr.n_k; ++kb) {
      finish_key_block(b, hk, keys.get(b, hk, kb), dk_acc.data() + kb * dk_size,
                       dv_acc.data() + kb * dv_size);
    }
  }

  // One block pair: dV += P^T dO, dK += dS^T Q into dk_acc / dv_acc, and dQ^T += K^T dS^T now
  // (kept_slot null) or its dS^T kept in kept_slot. Never inlined: one compiled copy for
  // every pass and order. Inlined into both row orders, the copies gave capped logits'
  // gradients that differed in their last bits (the compiler decides per copy which
  // multiplies and adds become FMAs).
  __attribute__((noinline)) void pair_grads(const KeyPanel<E>& key, const QueryPanel<E>& qp,
                                            bool masked, E* kept_slot, float* dk_acc,
                                            float* dv_acc) const {
    const int64_t nk = key.nk, ld_d = pr.ld_d(), ld_dv = pr.ld_dv(), ld_rows = pr.ld_rows();
    const bool add_dq = kept_slot == nullptr;
    thread_local Pair pair;
    thread_local Vector<E> rounded, ds_panel;
    // In float32, dS^T's rows are the panel dQ^T += K^T dS^T reads, so a kept pair is
    // computed in its kept slot (a copy measured 2.4% of nano fwd+bwd); else in pair.s_t,
    // and a bfloat16 one then rounded into its panel.
    float* s_t = nullptr;
    if constexpr (kRowsArePanel<E>) s_t = kept_slot;
    if (!s_t) {
      pair.s_t.resize(rows_size<E>(nk, ld_rows));
      s_t = pair.s_t.data();
    }
    probabilities(key, qp, masked, s_t, pair);
    // dV += P^T dO.
    gemm<true>(nk, pr.dim_v, qp.m, dot_rows<E>(s_t, nk, qp.m, ld_rows, rounded), ld_rows,
               qp.d_out_panel, ld_dv, dv_acc, ld_dv);
    // dS^T, then dK += dS^T Q, and dQ^T += K^T dS^T now or dS^T kept for it.
    logit_grads_of(nk, qp, s_t, pair);
    gemm<true>(nk, pr.dim, qp.m, dot_rows<E>(s_t, nk, qp.m, ld_rows, rounded), ld_rows,
               qp.q_panel, ld_d, dk_acc, ld_d);
    if constexpr (kRowsArePanel<E>) {
      if (add_dq) dq_pair(key, s_t, qp);
    } else {
      if (add_dq) ds_panel.resize(panel_size<E>(pr.block_k, ld_rows));
      E* panel = add_dq ? ds_panel.data() : kept_slot;
      keep_panel(s_t, nk, qp.m, ld_rows, panel);
      if (add_dq) dq_pair(key, panel, qp);
    }
  }

  // dk, dv of one key block of one kv head, over the query blocks that see it in ascending
  // order; each pair's dQ^T term added at once (`add_dq`, the rows pass by key) or its dS^T
  // kept (the blocks pass).
  void dkv_task(int64_t task, bool add_dq) const {
    const int64_t b = task / (pr.kv_heads * pr.n_k), hk = task / pr.n_k % pr.kv_heads;
    const int64_t kb = task % pr.n_k;
    const KeyPanel<E> key = keys.get(b, hk, kb);
    thread_local Vector<float> dk_acc, dv_acc;
    dk_acc.assign(rows_size<E>(key.nk, pr.ld_d()), 0.0f);
    dv_acc.assign(rows_size<E>(key.nk, pr.ld_dv()), 0.0f);
    thread_local Vector<Visit> order;
    ascending(visits(pr, pr.q_index, pr.q_full_count, pr.q_count, b * pr.n_k + kb, pr.n_q),
              order);
    for (const Visit& pair : order) {
      pair_grads(key, queries.get(b, hk, pair.block), pair.masked,
                 add_dq ? nullptr : kept.slot(task, pair.entry), dk_acc.data(), dv_acc.data());
    }
    finish_key_block(b, hk, key, dk_acc.data(), dv_acc.data());
  }

  // The candidates' own-key terms of a key block's dk / dv, then dk = scale dK, dv = dV.
  // Never inlined, as pair_grads: both row orders call it.
  __attribute__((noinline)) void finish_key_block(int64_t b, int64_t hk, const KeyPanel<E>& key,
                                                  float* dk_acc, float* dv_acc) const {
    const int64_t nk = key.nk, ld_d = pr.ld_d(), ld_dv = pr.ld_dv();
    if (pr.own) {  // each candidate key's own query rows
      const int64_t g_len = pr.group();
      for (int64_t j = 0; j < nk; ++j) {
        const int64_t i = key.k0 + j;
        if (pr.seg_q[b * pr.q_len + i] >= 0) continue;
        const QueryPanel<E> qp = queries.get(b, hk, i / pr.block_q);
        const int64_t t = i - qp.q0;
        for (int64_t g = 0; g < g_len; ++g) {
          const int64_t r = g * qp.nq + t;
          float prob;
          const float d_s = own_grad(qp, r, key.k_rows + j * ld_d, key.v_rows + j * ld_dv, &prob);
          for (int64_t d = 0; d < pr.dim; ++d) {
            dk_acc[j * ld_d + d] += d_s * element(qp.q_panel, ld_d, r, d);
          }
          for (int64_t d = 0; d < pr.dim_v; ++d) {
            dv_acc[j * ld_dv + d] += prob * element(qp.d_out_panel, ld_dv, r, d);
          }
        }
      }
    }
    for (int64_t j = 0; j < nk; ++j) {
      T* ok = dk + ((b * pr.kv_len + key.k0 + j) * pr.kv_heads + hk) * pr.dim;
      T* ov = dv + ((b * pr.kv_len + key.k0 + j) * pr.kv_heads + hk) * pr.dim_v;
      for (int64_t d = 0; d < pr.dim; ++d) ok[d] = D::from(dk_acc[j * ld_d + d] * pr.scale);
      for (int64_t d = 0; d < pr.dim_v; ++d) ov[d] = D::from(dv_acc[j * ld_dv + d]);
    }
  }
};

}  // namespace
