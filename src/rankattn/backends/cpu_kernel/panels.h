// Panels and packing: q, k, v and dO read in their own [B, S, H, D] layout and dtype and
// packed, non-finite entries as 0, into the rows and panels the dots read (dots.h), in
// per-thread memory kept across calls; p and ds as operands of the dots that take them.
//
// Part of cpu_attention.cc (see vectors.h).
#pragma once

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <thread>
#include <type_traits>
#include <utility>

#include "dots.h"
#include "problem.h"
#include "runtime.h"
#include "vectors.h"

namespace {

// ---- p and ds, computed in float32, as operands of the dots that take them.

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
        const vh h = bf16_round(load(x + r * ld + c));
        std::memcpy(out + c, &h, sizeof h);
      }
      std::fill(out + cols, out + read, 0);
    }
    std::fill(buffer.data() + rows * ld, buffer.data() + buffer.size(), 0);
    return buffer.data();
  }
}

// The rows the forward writes p into, as the A operand of its P V dot: the logits' rows `s`
// themselves in float32 (p in place); in bfloat16 `buffer` [rows_size(rows, ld)], p rounded as
// dot_rows rounds it, written by the softmax pass itself (a separate rounding pass over the
// block measured 8% of a bfloat16 forward on AMX). Only the padded rows are cleared here: the
// pass writes every column of a row that the dot reads.
template <typename E>
E* p_rows(float* s, int64_t rows, int64_t ld, Vector<E>& buffer) {
  if constexpr (std::is_same_v<E, float>) {
    return s;
  } else {
    buffer.resize(rows_size<E>(rows, ld));
    std::fill(buffer.data() + rows * ld, buffer.data() + buffer.size(), 0);
    return buffer.data();
  }
}

// x into out[0, kLanes) as element type E (bfloat16: rounded as dot_rows rounds).
template <typename E>
inline void store_element(E* out, vf x) {
  if constexpr (std::is_same_v<E, float>) {
    store(out, x);
  } else {
    const vh h = bf16_round(x);
    std::memcpy(out, &h, sizeof h);
  }
}

// dS^T x[rows][ld] (float: rows are keys, columns query rows, the first `cols` valid) rounded
// to bfloat16 as the B panel of dQ^T += K^T dS^T, `rows` contraction rows, into `out`
// (panel_size(rows, ld)). A float32 dS^T is that panel already.
template <typename E>
void keep_panel(const float* x, int64_t rows, int64_t cols, int64_t ld, E* out) {
  static_assert(!kRowsArePanel<E>, "a float32 dS^T is computed in its kept panel");
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

// ---- Packing.

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

// The transposes below work on 8 x 8 blocks in registers (three rounds of interleaving rows i
// and i + 4 turn rows into columns), the edges element by element. (An element-by-element loop
// measured 44% of packing a key block.)
typedef float v8f __attribute__((vector_size(8 * sizeof(float))));
typedef int32_t v8i __attribute__((vector_size(8 * sizeof(int32_t))));

// Lanes 0-3 of a and b interleaved into *low (a0 b0 a1 b1 ...), lanes 4-7 into *high. GCC
// before 12 (Ubuntu 22.04's default compiler is GCC 11) has no __builtin_shufflevector; its
// __builtin_shuffle makes the same permutations from mask vectors. (By reference: a 32-byte
// vector passed by value changes the ABI of the builds without AVX.)
inline void interleave(const v8f& a, const v8f& b, v8f* low, v8f* high) {
#if defined(__clang__) || __GNUC__ >= 12
  *low = __builtin_shufflevector(a, b, 0, 8, 1, 9, 2, 10, 3, 11);
  *high = __builtin_shufflevector(a, b, 4, 12, 5, 13, 6, 14, 7, 15);
#else
  *low = __builtin_shuffle(a, b, v8i{0, 8, 1, 9, 2, 10, 3, 11});
  *high = __builtin_shuffle(a, b, v8i{4, 12, 5, 13, 6, 14, 7, 15});
#endif
}

// An 8 x 8 block of 32-bit lanes, rows r[0..8), transposed in place: three rounds of
// interleaving rows i and i + 4. (Lanes are moved, never computed on: any bits pass.)
inline void transpose8(v8f r[8]) {
  for (int round = 0; round < 3; ++round) {
    v8f t[8];
    for (int j = 0; j < 4; ++j) interleave(r[j], r[j + 4], &t[2 * j], &t[2 * j + 1]);
    std::copy(t, t + 8, r);
  }
}

// Elements x[0..8) of dtype D as float, non-finite ones 0; their lanes' non-finite flags
// (-1) OR-ed into *flags.
template <typename D>
inline void finite8(const typename D::T* x, v8f* out, v8i* flags) {
  v8f v;
  if constexpr (std::is_same_v<D, F32>) {
    std::memcpy(&v, x, sizeof v);
  } else if constexpr (std::is_same_v<D, BF16>) {  // widened as a vector: BF16::to's shift
    typedef uint16_t v8u16 __attribute__((vector_size(8 * sizeof(uint16_t))));
    typedef uint32_t v8u32 __attribute__((vector_size(8 * sizeof(uint32_t))));
    v8u16 half;
    std::memcpy(&half, x, sizeof half);
    const v8u32 bits = __builtin_convertvector(half, v8u32) << 16;
    std::memcpy(&v, &bits, sizeof v);
  } else {
    for (int c = 0; c < 8; ++c) v[c] = D::to(x[c]);
  }
  v8i bits;
  std::memcpy(&bits, &v, sizeof bits);
  const v8i inf_or_nan = (bits & 0x7f800000) == 0x7f800000;
  *flags |= inf_or_nan;
  *out = inf_or_nan ? v8f{} : v;
}

// dst[d * ld_dst + i] = x_i[d] for i < n, d < width, where x_i = row(i) holds `width` elements
// of dtype D, converted to float with non-finite entries 0 (finite_row's rule); rows with a
// non-finite entry get bad[i] = -1 (when `bad` is given). One pass over the source: a key
// block's K^T packed from the pages directly, without a finite copy first (the kernel's
// instructions in the 64-candidate serving call -2.2%, CPU_KERNEL.md).
template <typename D, typename Row>
void transpose_finite(Row row, int64_t n, int64_t width, float* dst, int64_t ld_dst,
                      int32_t* bad) {
  // Entries [from, width) of row i, one by one (the edges of the 8 x 8 blocks); whether any
  // was non-finite.
  auto column_tail = [&](const typename D::T* x, int64_t i, int64_t from) {
    bool any = false;
    for (int64_t d = from; d < width; ++d) {
      float edge[1];
      any |= finite_row<D, float>(x + d, 1, edge);
      dst[d * ld_dst + i] = edge[0];
    }
    return any;
  };
  int64_t i0 = 0;
  for (; i0 + 8 <= n; i0 += 8) {
    const typename D::T* x[8];
    v8i flags[8] = {};
    for (int j = 0; j < 8; ++j) x[j] = row(i0 + j);
    int64_t d0 = 0;
    for (; d0 + 8 <= width; d0 += 8) {
      v8f r[8];
      for (int j = 0; j < 8; ++j) finite8<D>(x[j] + d0, &r[j], &flags[j]);
      transpose8(r);
      for (int j = 0; j < 8; ++j) std::memcpy(dst + (d0 + j) * ld_dst + i0, &r[j], sizeof(v8f));
    }
    for (int j = 0; j < 8; ++j) {
      bool any = column_tail(x[j], i0 + j, d0);
      for (int c = 0; c < 8; ++c) any |= flags[j][c] != 0;
      if (bad && any) bad[i0 + j] = -1;
    }
  }
  for (; i0 < n; ++i0) {
    if (column_tail(row(i0), i0, 0) && bad) bad[i0] = -1;
  }
}

// src[n][ld_src] (finite floats) transposed: dst[d * ld_dst + i] = src[i * ld_src + d].
inline void transpose(const float* src, int64_t ld_src, int64_t n, int64_t width, float* dst,
                      int64_t ld_dst) {
  transpose_finite<F32>([&](int64_t i) { return src + i * ld_src; }, n, width, dst, ld_dst,
                        nullptr);
}

// bfloat16 rows x[n][ld] (zero from column `width` to the next even one) into the pair
// panels of dots.h, the n rows landing at rows `first`.. of the panel. Element by element,
// these loops measured a third of packing a bfloat16 key block; here 32-bit words move whole:
//  - X contracted over its rows (pair_panel): word (t / 2, d) holds (x[t][d], x[t + 1][d]),
//    rows t and t + 1 interleaved a vector at a time (an odd `first`, whose pairs straddle
//    the call's rows, goes element by element);
//  - X^T contracted over d (pair_panel_t): word (d / 2, t) holds (x[t][d], x[t][d + 1]), the
//    word of row t at column d: the panel is X's words transposed, in 8 x 8 blocks.
inline void pair_panel(const bf16_t* x, int64_t ld, int64_t n, int64_t width, bf16_t* panel,
                       int64_t ld_panel, int64_t first) {
  int64_t t = 0;
  for (; first % 2 == 0 && t + 1 < n; t += 2) {
    const bf16_t *a = x + t * ld, *b = a + ld;
    bf16_t* out = panel + panel_index<bf16_t>(first + t, 0, ld_panel);
    int64_t d = 0;
    for (; d + kLanes <= width; d += kLanes) {
      vh low, high;
      std::memcpy(&low, a + d, sizeof low);
      std::memcpy(&high, b + d, sizeof high);
      const vu pairs = __builtin_convertvector(low, vu) | (__builtin_convertvector(high, vu) << 16);
      std::memcpy(out + 2 * d, &pairs, sizeof pairs);
    }
    for (; d < width; ++d) out[2 * d] = a[d], out[2 * d + 1] = b[d];
  }
  for (; t < n; ++t) {
    for (int64_t d = 0; d < width; ++d) {
      panel[panel_index<bf16_t>(first + t, d, ld_panel)] = x[t * ld + d];
    }
  }
}

inline void pair_panel_t(const bf16_t* x, int64_t ld, int64_t n, int64_t width, bf16_t* panel,
                         int64_t ld_panel, int64_t first) {
  const int64_t words = (width + 1) / 2;
  // Word w of row i of x, and word w of panel row (column) i, as byte addresses.
  auto in = [&](int64_t i, int64_t w) { return x + i * ld + 2 * w; };
  auto out = [&](int64_t w, int64_t i) { return panel + 2 * (w * ld_panel + first + i); };
  int64_t i0 = 0;
  for (; i0 + 8 <= n; i0 += 8) {
    int64_t w0 = 0;
    for (; w0 + 8 <= words; w0 += 8) {
      v8f r[8];
      for (int j = 0; j < 8; ++j) std::memcpy(&r[j], in(i0 + j, w0), sizeof r[j]);
      transpose8(r);
      for (int j = 0; j < 8; ++j) std::memcpy(out(w0 + j, i0), &r[j], sizeof r[j]);
    }
    for (; w0 < words; ++w0) {
      for (int j = 0; j < 8; ++j) std::memcpy(out(w0, i0 + j), in(i0 + j, w0), 4);
    }
  }
  for (; i0 < n; ++i0) {
    for (int64_t w = 0; w < words; ++w) std::memcpy(out(w, i0), in(i0, w), 4);
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
  if constexpr (kRowsArePanel<E>) {  // float32 X^T alone: transposed from the source
    if (!to.rows && !to.panel && (!to.rows_t || !to.panel_t)) {
      float* x_t = to.rows_t ? to.rows_t : to.panel_t;
      if (x_t) {
        transpose_finite<D>(row, n, width, x_t + to.first,
                            to.rows_t ? to.ld_rows_t : to.ld_panel_t, bad);
        return;
      }
    }
  }
  thread_local Vector<E> scratch;
  E* rows;
  int64_t ld;
  if (to.rows || rows_in_panel) {
    ld = to.rows ? to.ld_rows : to.ld_panel;
    rows = (to.rows ? to.rows : to.panel) + to.first * ld;
  } else {  // an even stride, zero past width: whole pairs for the bfloat16 panels
    ld = round_up(width, kPair<E>);
    scratch.resize(n * ld);
    rows = scratch.data();
    if (ld != width) {
      for (int64_t t = 0; t < n; ++t) rows[t * ld + width] = E{};
    }
  }
  for (int64_t t = 0; t < n; ++t) {
    const bool is_bad = finite_row<D, E>(row(t), width, rows + t * ld);
    if (bad && is_bad) bad[t] = -1;
  }
  if (to.panel && !rows_in_panel) {
    if constexpr (kRowsArePanel<E>) {
      for (int64_t t = 0; t < n; ++t) {
        std::copy_n(rows + t * ld, width, to.panel + (to.first + t) * to.ld_panel);
      }
    } else {
      pair_panel(rows, ld, n, width, to.panel, to.ld_panel, to.first);
    }
  }
  // The transposed layouts: float32's (both X^T [width][tokens]) and bfloat16's pair panel
  // in 8 x 8 blocks; bfloat16's rows X^T 16 tokens at a time, so that they stay in L1 and the
  // writes along tokens are contiguous (writes along d, one cache line each, measured 13% of
  // a short call).
  if (!to.rows_t && !to.panel_t) return;
  if constexpr (kRowsArePanel<E>) {
    for (auto [x, ld_t] : {std::pair{to.rows_t, to.ld_rows_t}, {to.panel_t, to.ld_panel_t}}) {
      if (x) transpose(rows, ld, n, width, x + to.first, ld_t);
    }
  } else {
    if (to.panel_t) pair_panel_t(rows, ld, n, width, to.panel_t, to.ld_panel_t, to.first);
    if (!to.rows_t) return;
    for (int64_t start = 0; start < n; start += 16) {
      const int64_t end = std::min(n, start + 16);
      for (int64_t d = 0; d < width; ++d) {
        for (int64_t t = start; t < end; ++t) {
          to.rows_t[d * to.ld_rows_t + to.first + t] = rows[t * ld + d];
        }
      }
    }
  }
}

// ---- Per-thread memory and the panels in it.

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
      const int64_t bytes_wanted = round_up(n, kCacheLine);
      bytes.reset(static_cast<std::byte*>(allocate_bytes(bytes_wanted, kCacheLine)));
      size = bytes_wanted;  // only once the buffer exists (else the next call believes it)
    }
    return bytes.get();
  }
};

// Per block: `elements` of the dots' type E, `floats` and `ints`, each region on cache lines.
template <typename E>
struct Panels {
  int64_t e_bytes, f_bytes, block_bytes;
  std::byte* base;
  Panels(Workspace& memory, int64_t blocks, int64_t elements, int64_t floats, int64_t ints)
      : e_bytes(round_up(elements * sizeof(E), kCacheLine)),
        f_bytes(round_up(floats * 4, kCacheLine)),
        block_bytes(e_bytes + f_bytes + round_up(ints * 4, kCacheLine)),
        base(memory.reserve(blocks * block_bytes)) {}
  E* e(int64_t block) const { return reinterpret_cast<E*>(base + block * block_bytes); }
  float* f(int64_t block) const {
    return reinterpret_cast<float*>(base + block * block_bytes + e_bytes);
  }
  int32_t* i(int64_t block) const {
    return reinterpret_cast<int32_t*>(base + block * block_bytes + e_bytes + f_bytes);
  }
  void clear(int64_t block) const { std::memset(base + block * block_bytes, 0, block_bytes); }
  // Its floats and ints only: for a block whose packing writes every element a dot reads.
  void clear_numbers(int64_t block) const {
    std::memset(base + block * block_bytes + e_bytes, 0, block_bytes - e_bytes);
  }
};

// Whether `len` of a padded extent `padded` leaves nothing a dot reads unwritten: no padding,
// and whole contraction steps (kDepth) and row tiles (kRows). The dots read zeros past a
// block's tokens and dims; a block its tokens fill has no such padding, and clearing its
// panels anyway (before every element is written) measured 5% of a 64-query forward and
// 2% of nano fwd+bwd (its query blocks).
template <typename E>
bool fills(int64_t len, int64_t padded) {
  return len == padded && len % kDepth<E> == 0 && len % kRows<E> == 0;
}

thread_local Workspace key_memory, query_memory, task_key_memory;

// Key block (b, kv head, kb) of its ld_keys keys, as the dots read it. (In float32 rows and
// panels are one layout.) Ints: seg, pos, bad (-1 where k or v is non-finite) [ld_keys] each,
// then "any bad".
template <typename E>
struct KeyPanel {
  // The forward's: K^T [D][ld_keys] and V [ld_keys][ld_dv] as B panels (S = Q K^T, O += P V).
  E *k_t_panel = nullptr, *v_panel = nullptr;
  // The backward's A rows: K [ld_keys][ld_d] (S^T = K Q^T), K^T [d_cols][ld_keys]
  // (dQ^T += K^T dS^T) and V [ld_keys][ld_dv] (dP^T = V dO^T).
  E *k_rows = nullptr, *k_t_rows = nullptr, *v_rows = nullptr;
  int32_t *seg, *pos, *bad;
  int64_t k0, nk;
  bool any_bad;
};

// Every key block's panels, packed once per call by their own tasks; or, `per_task`, each block
// packed by each task that reads it just before it reads it, into that thread's one-block
// buffer (what a call whose key blocks have one query block each wants, e.g. serving's
// candidates: packing all blocks first writes them out of cache and reads them back, which
// measured a third of such a call; and so do the parts of a split query block, see
// query_parts). The forward's stored blocks are packed in the region of its tasks: by their
// own tasks, which come first, or by the first task that reads one before them (`state`).
template <typename E>
struct KeyPanels {
  const Problem& pr;
  bool backward, per_task;
  int64_t k_t_size, v_size, k_size;  // elements of a block's K^T, V and (backward) K
  Panels<E> store;
  // The forward's, per stored block: kUnpacked, kPacking (a task packs it: others wait) or
  // kPacked.
  enum : uint8_t { kUnpacked, kPacking, kPacked };
  mutable Vector<std::atomic<uint8_t>> state;
  KeyPanels(const Problem& pr, bool backward, bool per_task)
      : pr(pr), backward(backward), per_task(per_task), k_t_size(pr.d_cols() * pr.ld_keys()),
        v_size(panel_size<E>(pr.ld_keys(), pr.ld_dv())),
        k_size(backward ? pr.ld_keys() * pr.ld_d() : 0),
        store(key_memory, per_task ? 0 : stored(), elements(), 0, ints()),
        state(backward || per_task ? 0 : stored()) {}

  int64_t stored() const { return pr.batch * pr.kv_heads * pr.n_k; }

  int64_t elements() const { return k_t_size + v_size + k_size; }
  int64_t ints() const { return 3 * pr.ld_keys() + 1; }

  KeyPanel<E> get(int64_t b, int64_t hk, int64_t kb) const {
    return at(store, (b * pr.kv_heads + hk) * pr.n_k + kb, kb);
  }

  // Block kb of (b, kv head) for the forward task that reads it: packed now when per_task,
  // else once it is in the store.
  template <typename D>
  KeyPanel<E> for_task(int64_t b, int64_t hk, int64_t kb, const typename D::T* k,
                       const typename D::T* v) const {
    const int64_t block = (b * pr.kv_heads + hk) * pr.n_k + kb;
    if (!per_task) {
      pack_stored<D>(block, k, v);
      return get(b, hk, kb);
    }
    const Panels<E> mine(task_key_memory, 1, elements(), 0, ints());
    return pack<D>(mine, 0, block, k, v);
  }

  // The panels in slot `slot` of `in`, holding key block kb of its row: K^T, then V, then
  // (backward) K.
  KeyPanel<E> at(const Panels<E>& in, int64_t slot, int64_t kb) const {
    KeyPanel<E> key;
    E* first = in.e(slot);
    if (backward) {
      key.k_t_rows = first, key.v_rows = first + k_t_size, key.k_rows = key.v_rows + v_size;
    } else {
      key.k_t_panel = first, key.v_panel = first + k_t_size;
    }
    int32_t* i = in.i(slot);
    const int64_t ld_keys = pr.ld_keys();
    key.seg = i, key.pos = i + ld_keys, key.bad = i + 2 * ld_keys;
    key.k0 = kb * pr.block_k, key.nk = std::min(pr.block_k, pr.kv_len - key.k0);
    key.any_bad = i[3 * ld_keys] != 0;
    return key;
  }

  // Packs key block `block` ((b, kv head, kb) in row-major order) into slot `slot` of `into`.
  template <typename D>
  KeyPanel<E> pack(const Panels<E>& into, int64_t slot, int64_t block, const typename D::T* k,
                   const typename D::T* v) const {
    const int64_t b = block / (pr.kv_heads * pr.n_k), hk = block / pr.n_k % pr.kv_heads;
    const int64_t kb = block % pr.n_k, ld_keys = pr.ld_keys();
    // The panels are cleared only where they have padding (see fills). The flags are always
    // cleared: `bad` is only set where a token is bad.
    const int64_t nk = std::min(pr.block_k, pr.kv_len - kb * pr.block_k);
    if (fills<E>(nk, pr.key_cols()) && fills<E>(pr.dim, pr.d_cols()) &&
        fills<E>(pr.dim_v, pr.dv_cols())) {
      into.clear_numbers(slot);
    } else {
      into.clear(slot);
    }
    KeyPanel<E> key = at(into, slot, kb);
    Destination<E> k_to, v_to;
    if (backward) {
      k_to.rows = key.k_rows, k_to.ld_rows = pr.ld_d();
      k_to.rows_t = key.k_t_rows, k_to.ld_rows_t = ld_keys;
      v_to.rows = key.v_rows, v_to.ld_rows = pr.ld_dv();
    } else {
      k_to.panel_t = key.k_t_panel, k_to.ld_panel_t = ld_keys;
      v_to.panel = key.v_panel, v_to.ld_panel = pr.ld_dv();
    }
    gather<D, E>([&](int64_t t) { return k + pr.kv_offset(b, hk, key.k0 + t, pr.dim); },
                 pr.dim, key.nk, k_to, key.bad);
    gather<D, E>([&](int64_t t) { return v + pr.kv_offset(b, hk, key.k0 + t, pr.dim_v); },
                 pr.dim_v, key.nk, v_to, key.bad);
    std::copy_n(pr.seg_k + b * pr.kv_len + key.k0, key.nk, key.seg);
    std::copy_n(pr.pos_k + b * pr.kv_len + key.k0, key.nk, key.pos);
    key.any_bad = std::any_of(key.bad, key.bad + key.nk, [](int32_t x) { return x != 0; });
    into.i(slot)[3 * ld_keys] = key.any_bad;
    return key;
  }

  // Packs block `block` into the call's store (not per_task). The forward's: unless a task has,
  // once another task packing it is done (a task whose packing failed leaves it to the next).
  template <typename D>
  void pack_stored(int64_t block, const typename D::T* k, const typename D::T* v) const {
    if (state.empty()) {
      pack<D>(store, block, block, k, v);
      return;
    }
    std::atomic<uint8_t>& s = state[block];
    for (uint8_t seen; (seen = s.load(std::memory_order_acquire)) != kPacked;) {
      if (seen == kUnpacked && s.compare_exchange_strong(seen, kPacking)) {
        try {
          pack<D>(store, block, block, k, v);
        } catch (...) {
          s.store(kUnpacked, std::memory_order_release);
          throw;
        }
        s.store(kPacked, std::memory_order_release);
        return;
      }
      std::this_thread::yield();
    }
  }
};

// Query block (b, kv head, qb) of the backward, rows r = g * nq + t (token q0 + t, query head
// hk * G + g), as the dots read it: the panels of Q [ld_rows][ld_d] (dK += dS^T Q), of Q^T
// [D][ld_rows] (S^T = K Q^T), of dO [ld_rows][ld_dv] (dV += P^T dO) and of dO^T [Dv][ld_rows]
// (dP^T = V dO^T). Floats: shift [ld_rows] (the lse, which p = 2^((s - lse) log2(e))
// subtracts before scaling; +inf where p must be 0), delta [ld_rows], the rows' logit
// multipliers [ld_rows] (1 without one), and the block's dQ^T [d_cols][ld_rows], summed over
// its key blocks. Ints: seg, pos [ld_rows].
template <typename E>
struct QueryPanel {
  E *q_panel, *q_t_panel, *d_out_panel, *d_out_t_panel;
  float *shift, *delta, *multiplier, *dq_t;
  int32_t *seg, *pos;
  int64_t q0, nq, m;
};

template <typename E>
struct QueryPanels {
  const Problem& pr;
  int64_t q_size, q_t_size, d_out_size, d_out_t_size;
  Panels<E> store;
  explicit QueryPanels(const Problem& pr)
      : pr(pr), q_size(panel_size<E>(pr.ld_rows(), pr.ld_d())),
        q_t_size(panel_size<E>(pr.dim, pr.ld_rows())),
        d_out_size(panel_size<E>(pr.ld_rows(), pr.ld_dv())),
        d_out_t_size(panel_size<E>(pr.dim_v, pr.ld_rows())),
        store(query_memory, pr.batch * pr.kv_heads * pr.n_q,
              q_size + q_t_size + d_out_size + d_out_t_size, (3 + pr.d_cols()) * pr.ld_rows(),
              2 * pr.ld_rows()) {}

  QueryPanel<E> get(int64_t b, int64_t hk, int64_t qb) const {
    return at((b * pr.kv_heads + hk) * pr.n_q + qb);
  }

  QueryPanel<E> at(int64_t block) const {
    E* q = store.e(block);
    float* f = store.f(block);
    int32_t* i = store.i(block);
    const int64_t ld_rows = pr.ld_rows(), q0 = block % pr.n_q * pr.block_q;
    const int64_t nq = std::min(pr.block_q, pr.q_len - q0);
    return QueryPanel<E>{q, q + q_size, q + q_size + q_t_size,
                         q + q_size + q_t_size + d_out_size, f, f + ld_rows, f + 2 * ld_rows,
                         f + 3 * ld_rows, i, i + ld_rows, q0, nq, pr.group() * nq};
  }

  template <typename D>
  void pack(int64_t block, const typename D::T* q, const typename D::T* d_out, const float* lse,
            const float* delta) const {
    const int64_t b = block / (pr.kv_heads * pr.n_q), hk = block / pr.n_q % pr.kv_heads;
    const int64_t ld_rows = pr.ld_rows();
    const QueryPanel<E> qp = at(block);
    // The panels are cleared only where they have padding (see fills); dQ^T, which the dq
    // tasks sum into, always.
    if (fills<E>(qp.m, pr.row_cols()) && fills<E>(pr.dim, pr.d_cols()) &&
        fills<E>(pr.dim_v, pr.dv_cols())) {
      store.clear_numbers(block);
    } else {
      store.clear(block);
    }
    std::fill_n(qp.shift, ld_rows, kInf);
    const int64_t g_len = pr.group(), nq = qp.nq;
    for (int64_t g = 0; g < g_len; ++g) {
      const int64_t h = hk * g_len + g, r0 = g * nq;
      Destination<E> q_to, d_to;
      q_to.panel = qp.q_panel, q_to.ld_panel = pr.ld_d();
      q_to.panel_t = qp.q_t_panel, q_to.ld_panel_t = ld_rows;
      d_to.panel = qp.d_out_panel, d_to.ld_panel = pr.ld_dv();
      d_to.panel_t = qp.d_out_t_panel, d_to.ld_panel_t = ld_rows;
      q_to.first = d_to.first = r0;
      gather<D, E>([&](int64_t t) { return q + pr.q_offset(b, h, qp.q0 + t, pr.dim); }, pr.dim,
                   nq, q_to, nullptr);
      gather<D, E>([&](int64_t t) { return d_out + pr.q_offset(b, h, qp.q0 + t, pr.dim_v); },
                   pr.dim_v, nq, d_to, nullptr);
      for (int64_t t = 0; t < nq; ++t) {
        const int64_t row = (b * pr.q_len + qp.q0 + t) * pr.q_heads + h, r = r0 + t;
        qp.shift[r] = lse[row] == -kInf ? kInf : lse[row];  // -inf: every p is 0
        qp.delta[r] = delta[row];
        qp.multiplier[r] = pr.multiplier_of(b, h, qp.q0 + t);
        qp.seg[r] = pr.seg_q[b * pr.q_len + qp.q0 + t];
        qp.pos[r] = pr.pos_q[b * pr.q_len + qp.q0 + t];
      }
    }
  }
};

}  // namespace
