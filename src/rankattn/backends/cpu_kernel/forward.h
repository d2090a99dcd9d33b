// The forward: one task per (batch row, kv head, query block), an online softmax over the key
// blocks its visit list names, with every query head of the kv head's group as rows of one
// block (GQA never repeats K / V). Per key block, with s the logits of a query row and t its
// logit multiplier (1 without one):
//   S = Q K^T                          (a dot: Q rows, the K^T panel)
//   s = t cap(scale S), masked to -inf (Problem::logits; the mask in partial blocks only)
//   m' = max(m, max_j s),  p = exp(s - m'),  l = exp(m - m') l + sum_j p
//   acc = exp(m - m') acc + P V        (a dot: P rows, the V panel)
// then a candidate's own key joins the softmax as one more logit, and
//   out = acc / l,  lse = m + log l    (NaN for a row that saw a non-finite input).
// Serving's paged forward is this over a Problem whose keys are pages (problem.h). Where each
// key is seen by all of a task's rows or by none (serving's candidates) and each task packs
// its own key blocks (one query block per row and kv head), a float32 task whose dv is whole
// vectors reads the pages in place instead of packing K^T and V, key-major (see key_major):
//   S^T = K Q^T,  P^T = exp(s^T - m'),  acc += P V   (K and V rows read through pointers).
//
// Part of cpu_attention.cc (see vectors.h).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "dots.h"
#include "panels.h"
#include "problem.h"
#include "runtime.h"
#include "vectors.h"

namespace {

// The running max of rows r0.. (a vector of them) after a block whose max logit is `top`:
// m' = max(m, top), its finite shift and alpha = exp(units (m - shift)) are vectors over the
// rows: row by row, that chain of scalar steps and a libm exp measured a fifth of the
// softmax's time. (exp(0) is 1: a row whose max stays keeps alpha exactly 1.) m, top and
// shift are in the units of the block's logits s, `units` times a logit: raw q . k where the
// scale is folded (units = scale), else 1. Every exponent is a difference of them taken
// first, then scaled: scaling m first erred by |m| (logits of 1e9 overflowed 2^t, CPU_KERNEL.md).
inline void raise_max(int64_t r0, vf top, vf units, float* m, float* shift, float* alpha) {
  const vf m_old = load(m + r0), m_new = m_old < top ? top : m_old;
  const vf finite_max = (m_new - m_new) == splat(0.0f) ? m_new : splat(0.0f);
  store(alpha + r0, m_old == finite_max ? splat(1.0f) : vexp((m_old - finite_max) * units));
  store(shift + r0, finite_max);
  store(m + r0, m_new);
}

// acc's row times alpha (n whole vectors), unless alpha is 1.
inline void rescale(float* row, int64_t n, float alpha) {
  if (alpha == 1.0f) return;
  const vf a = splat(alpha);
  for (int64_t d = 0; d < n; d += kLanes) store(row + d, load(row + d) * a);
}

template <typename D>
struct Forward {
  using T = typename D::T;
  using E = typename DotElement<D>::type;
  const Problem& pr;
  const KeyPanels<E>& keys;
  const T *q, *k, *v;
  T* out;
  float* lse;
  int64_t parts;  // tasks per query block, each a run of its tokens (see query_parts)

  int64_t tasks() const { return pr.batch * pr.kv_heads * pr.n_q * parts; }

  void run(int64_t task) const {
    const int64_t part = task % parts;
    task /= parts;
    const int64_t b = task / (pr.kv_heads * pr.n_q), hk = task / pr.n_q % pr.kv_heads;
    const int64_t qb = task % pr.n_q, g_len = pr.group();
    // Tokens [q0, q0 + nq) of the query block: its part `part` of `parts`.
    const int64_t block_len = std::min(pr.block_q, pr.q_len - qb * pr.block_q);
    const int64_t first = block_len * part / parts, q0 = qb * pr.block_q + first;
    const int64_t nq = block_len * (part + 1) / parts - first, m_rows = g_len * nq;
    if (nq == 0) return;
    const int64_t ld_d = pr.ld_d(), ld_dv = pr.ld_dv(), ld_keys = pr.ld_keys();
    const int64_t key_cols = pr.key_cols(), dv_cols = pr.dv_cols();
    // Per-thread buffers, reused by every task the thread runs (see Workspace): the rows of q
    // (zero where the dots read past them), S (and P in place in float32), P rounded for the
    // dot (bfloat16, p_rows), acc, and per row m (the running max), l (the running sum, as
    // kLanes partial sums added at the end: a horizontal sum per row and block took 3% of a
    // bfloat16 forward on AMX) and whether it saw a non-finite input.
    thread_local Vector<E> q_rows, p_buffer;
    thread_local Vector<float> s, acc, m, l, shift, alpha;  // shift, alpha: see the softmax
    thread_local Vector<int32_t> poisoned;
    q_rows.assign(rows_size<E>(m_rows, ld_d), E{});
    s.resize(rows_size<E>(m_rows, ld_keys));
    E* const p = p_rows<E>(s.data(), m_rows, ld_keys, p_buffer);
    acc.assign(rows_size<E>(m_rows, ld_dv), 0.0f);
    const int64_t row_vectors = round_up(m_rows, kLanes);  // m, shift, alpha: whole vectors
    m.assign(row_vectors, -kInf);
    shift.assign(row_vectors, -kInf);
    alpha.resize(row_vectors);
    l.assign(m_rows * kLanes, 0.0f);
    poisoned.assign(m_rows, 0);
    // Token by token, the group's heads side by side in q: head by head, reads 1-2 KB apart
    // missed the cache (5% of a bfloat16 forward on AMX, CPU_KERNEL.md).
    for (int64_t t = 0; t < nq; ++t) {
      for (int64_t g = 0; g < g_len; ++g) {
        const int64_t r = g * nq + t;
        poisoned[r] = finite_row<D, E>(q + pr.q_offset(b, hk * g_len + g, q0 + t, pr.dim), pr.dim,
                                       q_rows.data() + r * ld_d);
      }
    }
    const int32_t* seg_q = pr.seg_q + b * pr.q_len + q0;
    const int32_t* pos_q = pr.pos_q + b * pr.q_len + q0;
    const Visits list = visits(pr, pr.kv_index, pr.full_count, pr.count, b * pr.n_q + qb, pr.n_k);
    if constexpr (std::is_same_v<D, F32>) {
      if (keys.per_task && pr.page_size > 0 && pr.dim_v % kLanes == 0 && !pr.causal &&
          std::all_of(seg_q, seg_q + nq, [&](int32_t x) { return x == seg_q[0]; })) {
        key_major(list, b, hk, q0, nq, q_rows.data(), acc.data(), m.data(), l.data(),
                  poisoned.data());
        return finish(b, hk, q0, nq, q_rows.data(), acc.data(), m.data(), l.data(),
                      poisoned.data());
      }
    }

    const bool fold = pr.folds_scale();
    const vf fold_scale = splat(fold ? pr.scale : 1.0f);
    // exp(x) = 2^(x log2(e)): the logits' factor in vexp2's argument, with the scale if folded.
    const vf to_base2 = splat((fold ? pr.scale : 1.0f) * kLog2e);
    for (int64_t e = 0; e < list.count; ++e) {
      const int32_t kb = list.index[e];
      if (kb < 0 || kb >= pr.n_k) continue;
      const KeyPanel<E> key = keys.template for_task<D>(b, hk, kb, k, v);
      const bool masked = e >= list.full;
      // Row r's logits of the block, s = t cap(scale S) (folded: S, scaled in the exp below),
      // -inf where the mask hides a key; returns their max.
      auto logits = [&](int64_t r) {
        const int64_t t = r % nq;
        float* sr = s.data() + r * ld_keys;
        if (!fold) {
          const vf t_row = splat(pr.multiplier_of(b, hk * g_len + r / nq, q0 + t));
          pr.logits(sr, key_cols, nullptr, [&](int64_t) { return t_row; });
        }
        if (masked) {
          const vi sq = splat_i(seg_q[t]), pq = splat_i(pos_q[t]);
          vi hit = splat_i(0);
          for (int64_t j = 0; j < key_cols; j += kLanes) {
            vi vis = pr.sees_history(sq, pq, load_i(key.seg + j), load_i(key.pos + j));
            hit |= vis & load_i(key.bad + j);
            store(sr + j, vis ? load(sr + j) : splat(-kInf));
          }
          poisoned[r] |= any_lane(hit);
        } else {
          poisoned[r] |= key.any_bad;
          std::fill(sr + key.nk, sr + key_cols, -kInf);
        }
        vf top = splat(-kInf);
        for (int64_t j = 0; j < key_cols; j += kLanes) {
          vf x = load(sr + j);
          top = x > top ? x : top;
        }
        return max_lane(top);
      };
      // Row r's p = exp(s - m') (shift[r] is m' where finite), l = alpha l + sum_j p and
      // acc = alpha acc.
      auto exponentiate = [&](int64_t r) {
        const float* sr = s.data() + r * ld_keys;
        E* p_row = p + r * ld_keys;
        vf sum = splat(0.0f);
        const vf row_shift = splat(shift[r]);
        for (int64_t j = 0; j < key_cols; j += kLanes) {
          vf pj = softmax_exp2<E>((load(sr + j) - row_shift) * to_base2);
          store_element(p_row + j, pj);
          sum += pj;
        }
        store(l.data() + r * kLanes, load(l.data() + r * kLanes) * alpha[r] + sum);
        rescale(acc.data() + r * ld_dv, dv_cols, alpha[r]);
      };

      // S = Q K^T.
      gemm<false>(m_rows, key_cols, pr.dim, q_rows.data(), ld_d, key.k_t_panel, ld_keys,
                  s.data(), ld_keys);
      // The softmax, kLanes rows at a time, whose logits stay in L1 between its passes.
      for (int64_t r0 = 0; r0 < m_rows; r0 += kLanes) {
        const int64_t r_end = std::min(m_rows, r0 + kLanes);
        for (int64_t r = r0; r < r_end; ++r) shift[r] = logits(r);
        raise_max(r0, load(shift.data() + r0), fold_scale, m.data(), shift.data(), alpha.data());
        for (int64_t r = r0; r < r_end; ++r) exponentiate(r);
      }
      // acc += P V. p past the block's keys is 0 (their logits are -inf), so a bfloat16 pair
      // or an AMX tile row may read it.
      gemm<true>(m_rows, pr.dim_v, key.nk, p, ld_keys, key.v_panel, ld_dv, acc.data(), ld_dv);
    }
    finish(b, hk, q0, nq, q_rows.data(), acc.data(), m.data(), l.data(), poisoned.data());
  }

  // Serving's candidates over keys that each row of the task sees or none does (one segment
  // id, not causal; float32), the pages read in place: packing K^T and V from them was the
  // call's one cost besides its dots and softmax (1 user x 64 candidates, CPU_KERNEL.md).
  // Key-major, per key block: S^T = K Q^T with K's rows read through pointers; the softmax a
  // vector of rows at a time down S^T's columns; acc += P V with P^T read as A's columns and
  // V's rows through pointers, a zero row for a key no row sees (its p is 0, but 0 times a
  // non-finite value in an unused slot would be NaN). Non-finite values are not packed away:
  // a seen key with a non-finite entry has non-finite logits in every row (any product with
  // inf or NaN is inf or NaN, and so is any sum with one: the zero columns of Q^T past m_rows
  // too), so a key is checked itself only where its first vector of logits has one (before
  // the cap, which would hide an inf); if it holds one, every row (all see it) is poisoned and its
  // logits count as 0, as a packed key's non-finite entries do, else its logit overflowed and
  // stays as the packed path computes it. A seen non-finite value of V shows in acc, which
  // poisons the row at the end. V's rows are read a vector at a time: dim_v is a whole number
  // of vectors. Only blocks that the visit list names are read, each key masked by its own
  // segment id (the row-major path trusts the list's full blocks instead). Leaves l as
  // `finish` reads it (one lane per row).
  void key_major(const Visits& list, int64_t b, int64_t hk, int64_t q0, int64_t nq,
                 const float* q_rows, float* acc, float* m, float* l, int32_t* poisoned) const {
    const int64_t g_len = pr.group(), m_rows = g_len * nq, ld_rows = pr.ld_rows();
    const int64_t row_vectors = round_up(m_rows, kLanes), ld_dv = pr.ld_dv();
    thread_local Vector<float> q_t, s_t, multiplier, sums, shift, alpha, zero_row;
    thread_local Vector<const float*> k_rows, v_rows;
    thread_local Vector<int32_t> seen;
    q_t.assign(pr.dim * ld_rows, 0.0f);  // Q^T, zero past the rows (the dot reads vectors)
    transpose(q_rows, pr.ld_d(), m_rows, pr.dim, q_t.data(), ld_rows);
    s_t.resize(pr.block_k * ld_rows);
    multiplier.assign(row_vectors, 1.0f);
    for (int64_t r = 0; r < m_rows; ++r) {
      multiplier[r] = pr.multiplier_of(b, hk * g_len + r / nq, q0 + r % nq);
    }
    sums.assign(row_vectors, 0.0f);
    shift.resize(row_vectors);
    alpha.resize(row_vectors);
    zero_row.assign(pr.dim_v, 0.0f);
    bool keys_bad = false;  // a seen key with a non-finite entry
    const bool fold = pr.folds_scale();
    const vf fold_scale = splat(fold ? pr.scale : 1.0f);
    const vf to_base2 = splat((fold ? pr.scale : 1.0f) * kLog2e);
    const vi sq = splat_i(pr.seg_q[b * pr.q_len + q0]), pq = splat_i(pr.pos_q[b * pr.q_len + q0]);
    for (int64_t e = 0; e < list.count; ++e) {
      const int32_t kb = list.index[e];
      if (kb < 0 || kb >= pr.n_k) continue;
      const int64_t k0 = kb * pr.block_k, nk = std::min(pr.block_k, pr.kv_len - k0);
      k_rows.resize(nk);
      v_rows.resize(nk);
      seen.resize(nk);
      for (int64_t j = 0; j < nk; ++j) {
        const int64_t key = b * pr.kv_len + k0 + j;
        seen[j] = pr.sees_history(sq, pq, splat_i(pr.seg_k[key]), splat_i(pr.pos_k[key]))[0];
        k_rows[j] = k + pr.kv_offset(b, hk, k0 + j, pr.dim);
        v_rows[j] = seen[j] ? v + pr.kv_offset(b, hk, k0 + j, pr.dim_v) : zero_row.data();
      }
      // S^T = K Q^T; a seen non-finite key's logits 0 (see above), then t cap(scale S^T).
      gemm<false>(nk, m_rows, pr.dim, PointedRowsA{k_rows.data()},
                  PanelB<float>{q_t.data(), ld_rows}, s_t.data(), ld_rows);
      for (int64_t j = 0; j < nk; ++j) {
        if (!seen[j]) continue;
        float* sr = s_t.data() + j * ld_rows;
        vi bits;  // the first vector of rows: a key with a non-finite entry makes all non-finite
        std::memcpy(&bits, sr, sizeof bits);
        if (any_lane((bits & 0x7f800000) == 0x7f800000) &&
            !std::all_of(k_rows[j], k_rows[j] + pr.dim,
                         [](float x) { return std::isfinite(x); })) {
          keys_bad = true;
          std::fill(sr, sr + row_vectors, 0.0f);
        }
        if (!fold) {
          pr.logits(sr, row_vectors, nullptr,
                    [&](int64_t r) { return load(multiplier.data() + r); });
        }
      }
      // The softmax down the columns: p = exp(s - m'), 0 for a key no row sees.
      for (int64_t r0 = 0; r0 < m_rows; r0 += kLanes) {
        vf top = splat(-kInf);
        for (int64_t j = 0; j < nk; ++j) {
          const vf x = load(s_t.data() + j * ld_rows + r0);
          if (seen[j]) top = x > top ? x : top;
        }
        raise_max(r0, top, fold_scale, m, shift.data(), alpha.data());
        const vf rows_shift = load(shift.data() + r0);
        vf sum = splat(0.0f);
        for (int64_t j = 0; j < nk; ++j) {
          float* x = s_t.data() + j * ld_rows + r0;
          const vf p = seen[j] ? softmax_exp2<float>((load(x) - rows_shift) * to_base2)
                               : splat(0.0f);
          store(x, p);
          sum += p;
        }
        store(sums.data() + r0, load(sums.data() + r0) * load(alpha.data() + r0) + sum);
        for (int64_t r = r0; r < std::min(m_rows, r0 + kLanes); ++r) {
          rescale(acc + r * ld_dv, pr.dv_cols(), alpha[r]);
        }
      }
      // acc += P V.
      gemm<true>(m_rows, pr.dim_v, nk, ColumnsA{s_t.data(), ld_rows},
                 PointedRowsB{v_rows.data(), 0}, acc, ld_dv);
    }
    for (int64_t r = 0; r < m_rows; ++r) {
      const float* ar = acc + r * ld_dv;
      poisoned[r] |= keys_bad ||
                     !std::all_of(ar, ar + pr.dim_v, [](float x) { return std::isfinite(x); });
      l[r * kLanes] = sums[r];
    }
  }

  // The candidates' own keys join the softmax, then out = acc / l and lse = m + log l.
  void finish(int64_t b, int64_t hk, int64_t q0, int64_t nq, const E* q_rows, float* acc,
              float* m, const float* l, int32_t* poisoned) const {
    const int64_t g_len = pr.group(), ld_d = pr.ld_d(), ld_dv = pr.ld_dv();
    const int32_t* seg_q = pr.seg_q + b * pr.q_len + q0;
    const bool fold = pr.folds_scale();  // m in the blocks' units (raise_max)
    const float units = fold ? pr.scale : 1.0f;
    thread_local Vector<float> own_k, own_v;  // zero past dim, as the rows of q
    own_k.assign(pr.d_cols(), 0.0f);
    own_v.assign(pr.dim_v, 0.0f);
    for (int64_t t = 0; t < nq; ++t) {
      const bool own = pr.own && seg_q[t] < 0;
      bool own_bad = false;
      if (own) {
        const int64_t i = q0 + t;
        const int64_t own_row = (b * pr.q_len + i) * pr.kv_heads + hk;  // in own_k / own_v
        const T* ko = pr.own_k ? static_cast<const T*>(pr.own_k) + own_row * pr.dim
                               : k + pr.kv_offset(b, hk, i, pr.dim);
        const T* vo = pr.own_v ? static_cast<const T*>(pr.own_v) + own_row * pr.dim_v
                               : v + pr.kv_offset(b, hk, i, pr.dim_v);
        own_bad = finite_row<D, float>(ko, pr.dim, own_k.data());
        own_bad |= finite_row<D, float>(vo, pr.dim_v, own_v.data());
      }
      for (int64_t g = 0; g < g_len; ++g) {
        const int64_t r = g * nq + t, h = hk * g_len + g;
        float* ar = acc + r * ld_dv;
        float l_r = sum_lanes(load(l + r * kLanes));
        if (own) {  // the own key's logit joins the softmax
          const float dot = dot_lanes(q_rows + r * ld_d, own_k.data(), pr.d_cols());
          const float s_own = fold ? dot : pr.logit(dot, pr.multiplier_of(b, h, q0 + t));
          const float m_new = std::max(m[r], s_own);
          const float alpha = std::exp((m[r] - m_new) * units);
          const float p_own = std::exp((s_own - m_new) * units);
          l_r = l_r * alpha + p_own;
          for (int64_t d = 0; d < pr.dim_v; ++d) ar[d] = ar[d] * alpha + p_own * own_v[d];
          m[r] = m_new;
          poisoned[r] |= own_bad;
        }
        // out = acc / l, lse = units m + log l.
        const bool seen = l_r != 0, nan = seen && poisoned[r];
        const float inv = seen ? 1 / l_r : 0.0f;
        T* o = out + ((b * pr.q_len + q0 + t) * pr.q_heads + h) * pr.dim_v;
        for (int64_t d = 0; d < pr.dim_v; ++d) o[d] = D::from(nan ? kNaN : ar[d] * inv);
        lse[(b * pr.q_heads + h) * pr.q_len + q0 + t] =
            nan ? kNaN : (seen ? m[r] * units + std::log(l_r) : -kInf);
      }
    }
  }
};

}  // namespace
