// The problem of one call, shared by the forward and the backward: its shapes, where each
// token's q, k, v are (contiguous, or serving's paged keys), the strides of the buffers that
// hold blocks of them, the block plan's visit lists, the mask, and the logits step.
//
// Part of cpu_attention.cc (see vectors.h).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "vectors.h"

namespace {

struct Problem {
  int64_t batch, q_len, kv_len, q_heads, kv_heads, dim, dim_v;
  int64_t block_q, block_k, n_q, n_k;
  float scale, softcap;
  bool soft_sign, causal, own;
  const int32_t *seg_q, *seg_k, *pos_q, *pos_k;
  const int32_t *kv_index, *full_count, *count;     // [B, nQ, nK], [B, nQ], [B, nQ]
  const int32_t *q_index, *q_full_count, *q_count;  // [B, nK, nQ], [B, nK], [B, nK]
  // Paged keys (serving's cache): key t of batch row b is slot t % page_size of page
  // page_table[b][t / page_size] of k, v [N, Hkv, page_size, D]. page_size 0: k, v are
  // [B, S, Hkv, D].
  const int32_t* page_table = nullptr;
  int64_t page_size = 0, num_pages = 0;
  // The own key of query i from own_k / own_v [B, Sq, Hkv, D] (serving's candidates, whose
  // keys are not in k / v), instead of key i of k / v. Null: from k / v.
  const void *own_k = nullptr, *own_v = nullptr;
  // Each query's logit multiplier [B, Sq, Hq] (finite: the Python side poisons the query of a
  // non-finite one), applied after the cap. Null: 1.
  const float* multiplier = nullptr;

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

  // Columns the dots compute (multiples of the register tile): of q / k rows (D), of v / out
  // rows (Dv), of a block's keys and of a block's query rows (every head of the group); and
  // the leading dimensions (row strides) of buffers that hold them. A stride one vector
  // longer keeps rows off the same L1 sets: with 128 columns a stride of 512 bytes maps every
  // 8th row to one set (measured 75 -> 91 GFLOP/s on one 128^3 dot from cold buffers).
  int64_t d_cols() const { return round_up(dim, kColTile); }
  int64_t dv_cols() const { return round_up(dim_v, kColTile); }
  int64_t key_cols() const { return round_up(block_k, kColTile); }
  int64_t row_cols() const { return round_up(group() * block_q, kColTile); }
  int64_t ld_d() const { return d_cols() + kLanes; }
  int64_t ld_dv() const { return dv_cols() + kLanes; }
  int64_t ld_keys() const { return key_cols() + kLanes; }
  int64_t ld_rows() const { return row_cols() + kLanes; }

  // A plan entry, clamped so that a malformed plan can never index outside the arrays.
  int64_t clamp_count(int32_t c, int64_t limit) const {
    return std::max<int64_t>(0, std::min<int64_t>(c, limit));
  }

  // semantics.sees_history, lane-wise: -1 where query (sq, pq) sees history key (sk, pk).
  vi sees_history(vi sq, vi pq, vi sk, vi pk) const {
    vi vis = ((sk == sq) | (sk == -sq)) & (sk > 0);
    if (causal) vis &= (sq < 0) | (pk <= pq);
    return vis;
  }

  // ---- The logits step, s = t cap(scale * q . k) with t the query's logit multiplier (1
  // without one), and its gradient, in one place: blocks of logits (`logits`, `logit_grads`),
  // a candidate's own key (`logit`, `logit_grad`), and the forward's shortcut without a cap
  // (`folds_scale`). Blocks take t as `factor(j)`, the vector of t over entries j.. j + kLanes
  // (one query's t in the forward's rows, the queries' t in the backward's key-major rows).

  // t of query i of batch row b in head h.
  float multiplier_of(int64_t b, int64_t h, int64_t i) const {
    return multiplier ? multiplier[(b * q_len + i) * q_heads + h] : 1.0f;
  }

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
  // The logit of one dot of unscaled q and k (the own key's), of a query with multiplier t.
  float logit(float dot, float t) const { return t * cap(dot * scale); }
  // d logit: ds = p (dp - delta) t cap'(scale * dot), from p, dp - delta and the dot.
  float logit_grad(float dot, float prob, float dp_delta, float t) const {
    return prob * dp_delta * t * cap_grad(dot * scale);
  }
  // Logits from the dots of unscaled q and k, in place over n (a multiple of kLanes) entries:
  // times the scale, then the cap, then t. `raw` (when given) receives them before the cap,
  // for cap'.
  template <typename Factor>
  void logits(float* s, int64_t n, float* raw, Factor factor) const {
    const vf mul = splat(scale), c = splat(softcap);
    const vf inv = splat(softcap > 0 ? 1 / softcap : 0.0f);
    for (int64_t j = 0; j < n; j += kLanes) {
      vf x = load(s + j) * mul;
      if (raw) store(raw + j, x);
      if (softcap > 0) x = soft_sign ? x / (1 + (x < 0 ? -x : x) * inv) : c * vtanh(x * inv);
      if (multiplier) x *= factor(j);
      store(s + j, x);
    }
  }
  // d logits over n (a multiple of kLanes) entries, in place over p in `s`, from dp - delta
  // and the raw logits (`logits`' `raw`): ds = p (dp - delta) t cap'(raw).
  template <typename Factor>
  void logit_grads(float* s, const float* dp_delta, const float* raw, int64_t n,
                   Factor factor) const {
    const vf inv = splat(softcap > 0 ? 1 / softcap : 0.0f);
    for (int64_t j = 0; j < n; j += kLanes) {
      vf ds = load(s + j) * load(dp_delta + j);
      if (softcap > 0) {
        vf x = load(raw + j), g;
        if (soft_sign) {
          vf d = 1 + (x < 0 ? -x : x) * inv;
          g = 1 / (d * d);
        } else {
          vf t = vtanh(x * inv);
          g = 1 - t * t;
        }
        ds *= g;
      }
      if (multiplier) ds *= factor(j);
      store(s + j, ds);
    }
  }
  // Without a cap or a multiplier, and with a positive scale (which commutes with the row
  // max), the forward takes the scale into its exp, p = exp(scale s - shift): one pass over
  // the logits fewer.
  bool folds_scale() const { return softcap <= 0 && scale > 0 && !multiplier; }
};

// A visit list of the block plan: the blocks one block visits, the first `full` of them full
// (no mask), the rest partial.
struct Visits {
  const int32_t* index;
  int64_t count, full, limit;
};

inline Visits visits(const Problem& pr, const int32_t* index, const int32_t* full,
                     const int32_t* count, int64_t list, int64_t limit) {
  const int64_t n = pr.clamp_count(count[list], limit);
  return Visits{index + list * limit, n, pr.clamp_count(full[list], n), limit};
}

}  // namespace
