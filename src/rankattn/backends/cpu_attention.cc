// Fused blocked attention for CPUs: the compute of rankattn's `cpu` backend, through XLA's FFI.
//
// rankattn/backends/cpu.py owns everything else: shapes, the block plan, the
// custom VJP, dtype checks and the backward's per-row terms (semantics.py). The
// kernel only computes, one task per (batch row, kv head, block), on XLA's CPU
// thread pool. Each output element is written by exactly one task in a fixed
// order, so results do not depend on the thread count.
//
// The mask is semantics.py's, evaluated per element in partial blocks:
//   key j is history of query i's session:  |seg_q[i]| == seg_k[j] > 0
//                                           (and, causal, seg_q[i] < 0 || pos_k[j] <= pos_q[i])
//   plus, when `own` is set, a candidate's own key (seg_q[i] < 0, key i).
// Full blocks (every query sees every key) skip it. Non-finite inputs are replaced
// by 0 as they are copied into the task's buffers (serving's key-major path, which reads
// the pages in place, checks a key only where one of its logits is not finite, and finds a
// value's in the output's sum), and the rows that see them
// (semantics.py's "poisoned" rows) end with NaN out and lse.
//
// Serving's entry points: the forward over paged K / V (a page table per batch row, each
// candidate's own key from separate arrays), the same with exact scoring's mask built from the
// histories' lengths, and Quest's page bounds (one dot of the queries' [q+ | q-] with the
// pages' key [max; min]).
//
// Every dot is C[M, N] (+)= A[M, K] B[K, N]: float32 on one register-tiled
// microkernel, bfloat16 on AMX tiles or VDPBF16PS. q, k, v (and in the backward
// dO) are read in their own [B, S, H, D] layout and dtype, and packed into panels,
// the layouts the dots read, padded with zeros to what the dots read: no loop ever
// reads past a buffer. Key blocks are packed once per call, except where each is read
// by one query block (or the parts of one), whose tasks pack what they read, and in
// serving's key-major path, which packs no key at all (panels.h, forward.h).
//
// This file is the one translation unit (rankattn.native compiles it) and holds the FFI
// handlers: the checks of what the Python side passes, then the tasks. The kernel is in
// cpu_kernel/, by concern (after flash-attention's csrc/ and PyTorch's
// FlashAttentionKernel.cpp):
//   vectors.h   vector math and storage dtypes     dots.h      dot micro-kernels (AMX, VDPBF16PS)
//   runtime.h   settings, memory, threads, errors  problem.h   shapes, mask and the logits step
//   panels.h    panels and packing                 forward.h   the forward
//   backward.h  the backward                       serving.h   exact scoring's mask, Quest's
//                                                               page bounds

#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <limits>
#include <string>
#include <type_traits>
#include <utility>

#include "cpu_kernel/backward.h"
#include "cpu_kernel/dots.h"
#include "cpu_kernel/forward.h"
#include "cpu_kernel/panels.h"
#include "cpu_kernel/problem.h"
#include "cpu_kernel/runtime.h"
#include "cpu_kernel/serving.h"
#include "cpu_kernel/vectors.h"
#include "xla/ffi/api/ffi.h"

namespace {

// ---- FFI: checks of what the Python side passes, then the tasks.

using I32 = ffi::Buffer<ffi::S32>;
using F32Buffer = ffi::Buffer<ffi::F32>;

ffi::Error check(bool ok, const std::string& what) {
  return ok ? ffi::Error::Success()
            : ffi::Error(ffi::ErrorCode::kInvalidArgument, "rankattn cpu kernel: " + what);
}

bool dims_are(ffi::Span<const int64_t> dims, std::initializer_list<int64_t> want) {
  return dims.size() == want.size() && std::equal(want.begin(), want.end(), dims.begin());
}

// The shapes and attributes of a call's problem, after checking every shape against q, k, v
// and the block sizes, so the tasks can index without further checks. With a page table
// [B, M], k and v are pages [N, Hkv, P, D] (or [N, P, D], one kv head) and the keys of row b
// are its M pages in table order (S = M * P), every kv head of them.
ffi::Error describe_shapes(const ffi::AnyBuffer& q, const ffi::AnyBuffer& k,
                           const ffi::AnyBuffer& v, const I32* page_table, float scale,
                           float softcap, bool soft_sign, bool causal, bool own, int64_t block_q,
                           int64_t block_k, Problem* pr) {
  auto qd = q.dimensions(), kd = k.dimensions(), vd = v.dimensions();
  const size_t kv_rank = page_table && kd.size() == 3 ? 3 : 4;
  if (auto e = check(qd.size() == 4 && kd.size() == kv_rank && vd.size() == kv_rank,
                     "q must be 4-D, and k, v 4-D (or 3-D pages with a page table)");
      e.failure())
    return e;
  *pr = Problem{};
  pr->batch = qd[0], pr->q_len = qd[1], pr->q_heads = qd[2], pr->dim = qd[3];
  pr->dim_v = vd[kv_rank - 1];
  pr->scale = scale, pr->softcap = softcap, pr->soft_sign = soft_sign, pr->causal = causal;
  pr->own = own;
  bool ok;
  if (page_table) {
    auto td = page_table->dimensions();
    ok = td.size() == 2 && td[0] == pr->batch && td[1] >= 1 && kd[0] >= 1 &&
         kd[kv_rank - 2] >= 1;
    if (auto e = check(ok, "the page table must be [B, M] and the pages [N, Hkv, P, D]");
        e.failure())
      return e;
    pr->page_table = page_table->typed_data();
    pr->num_pages = kd[0], pr->kv_heads = kv_rank == 4 ? kd[1] : 1;
    pr->page_size = kd[kv_rank - 2];
    pr->kv_len = td[1] * pr->page_size;
    if (kv_rank == 4) {
      ok = dims_are(kd, {pr->num_pages, pr->kv_heads, pr->page_size, pr->dim}) &&
           dims_are(vd, {pr->num_pages, pr->kv_heads, pr->page_size, pr->dim_v});
    } else {
      ok = dims_are(kd, {pr->num_pages, pr->page_size, pr->dim}) &&
           dims_are(vd, {pr->num_pages, pr->page_size, pr->dim_v});
    }
  } else {  // an own key in k / v is key i of query i: one sequence for both
    pr->kv_len = kd[1], pr->kv_heads = kd[2];
    ok = dims_are(kd, {pr->batch, pr->kv_len, pr->kv_heads, pr->dim}) &&
         dims_are(vd, {pr->batch, pr->kv_len, pr->kv_heads, pr->dim_v}) &&
         (!own || pr->q_len == pr->kv_len);
  }
  ok = ok && pr->batch >= 1 && pr->q_len >= 1 && pr->kv_len >= 1 && pr->kv_heads >= 1 &&
       pr->q_heads % pr->kv_heads == 0 && pr->dim >= 1 && pr->dim_v >= 1 && block_q >= 1 &&
       block_k >= 1 && q.element_type() == k.element_type() &&
       q.element_type() == v.element_type();
  if (auto e = check(ok, "inconsistent q, k, v shapes, block sizes or own-key flag"); e.failure())
    return e;
  // A block past its sequence holds the whole sequence (cpu.plan_sizes caps them so): capped
  // here too, every size the tasks compute from a block is bounded by the arrays' own (a
  // block_k of 2^58 from a direct FFI call wrapped the panels' byte counts and wrote past them).
  pr->block_q = std::min(block_q, pr->q_len), pr->block_k = std::min(block_k, pr->kv_len);
  pr->n_q = (pr->q_len + pr->block_q - 1) / pr->block_q;
  pr->n_k = (pr->kv_len + pr->block_k - 1) / pr->block_k;
  return ffi::Error::Success();
}

// The problem of a call with its mask and block plan arrays, checked against its shapes
// (describe_shapes). The logit multiplier is [B, Sq, Hq], or empty for none.
ffi::Error describe(const ffi::AnyBuffer& q, const ffi::AnyBuffer& k, const ffi::AnyBuffer& v,
                    const I32* page_table, const F32Buffer& multiplier, const I32& seg_q,
                    const I32& seg_k, const I32& pos_q, const I32& pos_k, const I32& kv_index,
                    const I32& full_count, const I32& count, float scale, float softcap,
                    bool soft_sign, bool causal, bool own, int64_t block_q, int64_t block_k,
                    Problem* pr) {
  if (auto e = describe_shapes(q, k, v, page_table, scale, softcap, soft_sign, causal, own,
                               block_q, block_k, pr);
      e.failure())
    return e;
  bool ok = dims_are(seg_q.dimensions(), {pr->batch, pr->q_len}) &&
       dims_are(pos_q.dimensions(), {pr->batch, pr->q_len}) &&
       dims_are(seg_k.dimensions(), {pr->batch, pr->kv_len}) &&
       dims_are(pos_k.dimensions(), {pr->batch, pr->kv_len}) &&
       dims_are(kv_index.dimensions(), {pr->batch, pr->n_q, pr->n_k}) &&
       dims_are(full_count.dimensions(), {pr->batch, pr->n_q}) &&
       dims_are(count.dimensions(), {pr->batch, pr->n_q});
  if (auto e = check(ok, "mask or plan arrays do not match q, k and the block sizes");
      e.failure())
    return e;
  const bool multiplied = multiplier.element_count() != 0;
  ok = !multiplied || dims_are(multiplier.dimensions(), {pr->batch, pr->q_len, pr->q_heads});
  if (auto e = check(ok, "the logit multiplier must be [B, Sq, Hq] or empty"); e.failure())
    return e;
  pr->multiplier = multiplied ? multiplier.typed_data() : nullptr;
  pr->seg_q = seg_q.typed_data(), pr->seg_k = seg_k.typed_data();
  pr->pos_q = pos_q.typed_data(), pr->pos_k = pos_k.typed_data();
  pr->kv_index = kv_index.typed_data(), pr->full_count = full_count.typed_data();
  pr->count = count.typed_data();
  return ffi::Error::Success();
}

template <typename D>
struct Tag {
  using type = D;
};

// Calls fn(Tag<storage dtype>{}).
template <typename Fn>
ffi::Error by_dtype(ffi::DataType dtype, Fn fn) {
  switch (dtype) {
    case ffi::DataType::F32: return fn(Tag<F32>{});
    case ffi::DataType::BF16: return fn(Tag<BF16>{});
    case ffi::DataType::F16: return fn(Tag<F16>{});
    default: return check(false, "q, k, v must be float32, bfloat16 or float16");
  }
}

// How many tasks share each query block of the forward, each a run of its tokens: 1, unless
// the query blocks are fewer than the threads (a request of one user and kv head is one
// block: it ran on one core), then enough to occupy them, of at least kMinPartTokens tokens.
// Where a query block is the only reader of its key blocks, each part packs them for itself:
// packed once and shared, in a parallel region of their own, measured 13-21% slower.
constexpr int64_t kMinPartTokens = 8;
int64_t query_parts(const Problem& pr, int64_t threads) {
  const int64_t blocks = pr.batch * pr.kv_heads * pr.n_q;
  if (blocks >= threads) return 1;
  const int64_t most = std::max<int64_t>(1, std::min(pr.block_q, pr.q_len) / kMinPartTokens);
  return std::min((threads + blocks - 1) / blocks, most);
}

// The forward of a described problem (contiguous or paged keys), in one parallel region: the key
// blocks packed by their own tasks (unless each is read by one query block only, whose tasks
// pack it), then one task per query block, or per part of one (query_parts). (Packing in a
// region of its own cost a second wake of the pool per call: a worker's start and the caller's
// Schedule took 30-60 us each on the 2-core VMs.)
ffi::Error run_forward(ffi::ThreadPool& pool, const Problem& pr, const ffi::AnyBuffer& q,
                       const ffi::AnyBuffer& k, const ffi::AnyBuffer& v,
                       ffi::Result<ffi::AnyBuffer>& out,
                       ffi::Result<ffi::Buffer<ffi::F32>>& lse) {
  bool ok = out->element_type() == q.element_type() &&
            dims_are(out->dimensions(), {pr.batch, pr.q_len, pr.q_heads, pr.dim_v}) &&
            dims_are(lse->dimensions(), {pr.batch, pr.q_heads, pr.q_len});
  if (auto e = check(ok, "out or lse has the wrong shape or dtype"); e.failure()) return e;
  return by_dtype(q.element_type(), [&](auto tag) {
    using D = typename decltype(tag)::type;
    using T = typename D::T;
    const T* k_in = static_cast<const T*>(k.untyped_data());
    const T* v_in = static_cast<const T*>(v.untyped_data());
    using E = typename DotElement<D>::type;
    const int64_t parts = query_parts(pr, call_threads(pool));
    KeyPanels<E> keys(pr, false, pr.n_q == 1);
    Forward<D> kernel{pr, keys, static_cast<const T*>(q.untyped_data()), k_in, v_in,
                      static_cast<T*>(out->untyped_data()), lse->typed_data(), parts};
    const int64_t key_tasks = keys.per_task ? 0 : keys.stored();
    parallel_for(pool, key_tasks + kernel.tasks(), [&](int64_t t) {
      if (t < key_tasks) {
        keys.template pack_stored<D>(t, k_in, v_in);
      } else {
        kernel.run(t - key_tasks);
      }
    });
    return ffi::Error::Success();
  });
}

ffi::Error forward(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                   F32Buffer multiplier, I32 seg_q, I32 seg_k, I32 pos_q, I32 pos_k, I32 kv_index,
                   I32 full_count, I32 count, ffi::Result<ffi::AnyBuffer> out,
                   ffi::Result<ffi::Buffer<ffi::F32>> lse,
                   float scale, float softcap, bool soft_sign, bool causal, bool own,
                   int64_t block_q, int64_t block_k) {
  Problem pr;
  if (auto e = describe(q, k, v, nullptr, multiplier, seg_q, seg_k, pos_q, pos_k, kv_index,
                        full_count, count, scale, softcap, soft_sign, causal, own, block_q,
                        block_k, &pr);
      e.failure())
    return e;
  return run_forward(pool, pr, q, k, v, out, lse);
}

// With `own`, each query's own key from k_self / v_self [B, Sq, Hkv, D] (ignored without it).
ffi::Error own_keys(const ffi::AnyBuffer& q, const ffi::AnyBuffer& k_self,
                    const ffi::AnyBuffer& v_self, Problem* pr) {
  if (!pr->own) return ffi::Error::Success();
  bool ok = k_self.element_type() == q.element_type() &&
            v_self.element_type() == q.element_type() &&
            dims_are(k_self.dimensions(), {pr->batch, pr->q_len, pr->kv_heads, pr->dim}) &&
            dims_are(v_self.dimensions(), {pr->batch, pr->q_len, pr->kv_heads, pr->dim_v});
  if (auto e = check(ok, "k_self / v_self must be [B, Sq, Hkv, D] in q's dtype"); e.failure())
    return e;
  pr->own_k = k_self.untyped_data(), pr->own_v = v_self.untyped_data();
  return ffi::Error::Success();
}

// Serving: queries over paged history keys (pages [N, Hkv, P, D] or [N, P, D], page_table
// [B, M]), and with `own` each query's own key from k_self / v_self [B, Sq, Hkv, D] (ignored
// without it).
ffi::Error paged_forward(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer k_pages,
                         ffi::AnyBuffer v_pages, I32 page_table, ffi::AnyBuffer k_self,
                         ffi::AnyBuffer v_self, F32Buffer multiplier, I32 seg_q, I32 seg_k,
                         I32 pos_q, I32 pos_k, I32 kv_index, I32 full_count, I32 count,
                         ffi::Result<ffi::AnyBuffer> out,
                         ffi::Result<ffi::Buffer<ffi::F32>> lse, float scale, float softcap,
                         bool soft_sign, bool causal, bool own, int64_t block_q,
                         int64_t block_k) {
  Problem pr;
  if (auto e = describe(q, k_pages, v_pages, &page_table, multiplier, seg_q, seg_k, pos_q,
                        pos_k, kv_index, full_count, count, scale, softcap, soft_sign, causal,
                        own, block_q, block_k, &pr);
      e.failure())
    return e;
  if (auto e = own_keys(q, k_self, v_self, &pr); e.failure()) return e;
  return run_forward(pool, pr, q, k_pages, v_pages, out, lse);
}

// Serving's exact scoring: paged_forward's queries, every one a candidate that sees keys
// [0, lengths[b]) of its row b (lengths [B]) and, with `own`, its own key (CandidatesMask,
// serving.h; `causal` changes nothing for candidates). No logit multiplier.
ffi::Error paged_candidates_forward(ffi::ThreadPool pool, ffi::AnyBuffer q,
                                    ffi::AnyBuffer k_pages, ffi::AnyBuffer v_pages,
                                    I32 page_table, ffi::AnyBuffer k_self, ffi::AnyBuffer v_self,
                                    I32 lengths, ffi::Result<ffi::AnyBuffer> out,
                                    ffi::Result<ffi::Buffer<ffi::F32>> lse, float scale,
                                    float softcap, bool soft_sign, bool causal, bool own,
                                    int64_t block_q, int64_t block_k) {
  Problem pr;
  if (auto e = describe_shapes(q, k_pages, v_pages, &page_table, scale, softcap, soft_sign,
                               causal, own, block_q, block_k, &pr);
      e.failure())
    return e;
  bool ok = dims_are(lengths.dimensions(), {pr.batch}) &&
            pr.kv_len + pr.q_len <= std::numeric_limits<int32_t>::max();
  if (auto e = check(ok, "lengths must be [B], and S + Sq within int32"); e.failure()) return e;
  if (auto e = own_keys(q, k_self, v_self, &pr); e.failure()) return e;
  const CandidatesMask mask(pr, lengths.typed_data());
  return run_forward(pool, pr, q, k_pages, v_pages, out, lse);
}

ffi::Error backward(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                    ffi::AnyBuffer d_out, ffi::Buffer<ffi::F32> lse, ffi::Buffer<ffi::F32> delta,
                    F32Buffer multiplier, I32 seg_q, I32 seg_k, I32 pos_q, I32 pos_k, I32 kv_index,
                    I32 full_count, I32 count, I32 q_index, I32 q_full_count, I32 q_count,
                    ffi::Result<ffi::AnyBuffer> dq, ffi::Result<ffi::AnyBuffer> dk,
                    ffi::Result<ffi::AnyBuffer> dv, float scale, float softcap, bool soft_sign,
                    bool causal, bool own, int64_t block_q, int64_t block_k) {
  Problem pr;
  if (auto e = describe(q, k, v, nullptr, multiplier, seg_q, seg_k, pos_q, pos_k, kv_index,
                        full_count, count, scale, softcap, soft_sign, causal, own, block_q,
                        block_k, &pr);
      e.failure())
    return e;
  const auto dtype = q.element_type();
  bool ok = d_out.element_type() == dtype && dq->element_type() == dtype &&
            dk->element_type() == dtype && dv->element_type() == dtype &&
            dims_are(d_out.dimensions(), {pr.batch, pr.q_len, pr.q_heads, pr.dim_v}) &&
            dims_are(lse.dimensions(), {pr.batch, pr.q_len, pr.q_heads}) &&
            dims_are(delta.dimensions(), {pr.batch, pr.q_len, pr.q_heads}) &&
            dims_are(q_index.dimensions(), {pr.batch, pr.n_k, pr.n_q}) &&
            dims_are(q_full_count.dimensions(), {pr.batch, pr.n_k}) &&
            dims_are(q_count.dimensions(), {pr.batch, pr.n_k}) &&
            dims_are(dq->dimensions(), {pr.batch, pr.q_len, pr.q_heads, pr.dim}) &&
            dims_are(dk->dimensions(), {pr.batch, pr.kv_len, pr.kv_heads, pr.dim}) &&
            dims_are(dv->dimensions(), {pr.batch, pr.kv_len, pr.kv_heads, pr.dim_v});
  if (auto e = check(ok, "backward operands have the wrong shape or dtype"); e.failure()) return e;
  pr.q_index = q_index.typed_data(), pr.q_full_count = q_full_count.typed_data();
  pr.q_count = q_count.typed_data();
  return by_dtype(dtype, [&](auto tag) {
    using D = typename decltype(tag)::type;
    using T = typename D::T;
    const T* q_in = static_cast<const T*>(q.untyped_data());
    const T* k_in = static_cast<const T*>(k.untyped_data());
    const T* v_in = static_cast<const T*>(v.untyped_data());
    const T* d_out_in = static_cast<const T*>(d_out.untyped_data());
    using E = typename DotElement<D>::type;
    // Every key block and query block packed, one task each.
    KeyPanels<E> keys(pr, true, false);
    QueryPanels<E> queries(pr);
    const int64_t key_tasks = pr.batch * pr.kv_heads * pr.n_k;
    const int64_t tasks = key_tasks + pr.batch * pr.kv_heads * pr.n_q;
    parallel_for(pool, tasks, [&](int64_t t) {
      if (t < key_tasks) {
        keys.template pack_stored<D>(t, k_in, v_in);
      } else {
        queries.template pack<D>(t - key_tasks, q_in, d_out_in, lse.typed_data(),
                                 delta.typed_data());
      }
    });
    KeptGrads<E> kept(pr, settings().backward_bytes);
    Backward<D> kernel{pr, keys, queries, kept, static_cast<T*>(dq->untyped_data()),
                       static_cast<T*>(dk->untyped_data()), static_cast<T*>(dv->untyped_data())};
    const int64_t query_tasks = tasks - key_tasks, rows = pr.batch * pr.kv_heads;
    if (rows_pass(rows, call_threads(pool))) {  // dk, dv and dQ^T per (batch row, kv head)
      parallel_for(pool, rows, [&](int64_t row) { kernel.row_task(row); });
    } else {  // per chunk of key blocks: dk, dv (keeping dS^T), then dQ^T per query block
      for (int64_t from = 0; kept.next(from); from = kept.end) {
        parallel_for(pool, kept.end - kept.start,
                     [&](int64_t t) { kernel.dkv_task(kept.start + t, false); });
        parallel_for(pool, query_tasks, [&](int64_t t) { kernel.dq_add(t); });
      }
    }
    // Then dq from dQ^T.
    parallel_for(pool, query_tasks, [&](int64_t t) { kernel.dq_finish(t); });
    return ffi::Error::Success();
  });
}

// Quest's page bounds (serving.h): q [B, Hkv, R, D], stats k_max / k_min [N, Hkv, D],
// page_table [B, M], npages [B].
ffi::Error page_bounds(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k_max,
                       ffi::Buffer<ffi::F32> k_min, I32 page_table, I32 npages,
                       ffi::Result<ffi::Buffer<ffi::F32>> bounds, ffi::Result<I32> bad) {
  auto qd = q.dimensions(), sd = k_max.dimensions(), td = page_table.dimensions();
  bool ok = qd.size() == 4 && sd.size() == 3 && td.size() == 2;
  if (auto e = check(ok, "page bounds: q must be 4-D, the stats 3-D, the table 2-D"); e.failure())
    return e;
  const int64_t batch = qd[0], heads = qd[1], rows = qd[2], dim = qd[3], n = sd[0], m = td[1];
  ok = batch >= 1 && heads >= 1 && rows >= 1 && dim >= 1 && n >= 1 && m >= 1 &&
       dims_are(sd, {n, heads, dim}) && dims_are(k_min.dimensions(), {n, heads, dim}) &&
       dims_are(td, {batch, m}) && dims_are(npages.dimensions(), {batch}) &&
       dims_are(bounds->dimensions(), {batch, heads, rows, m}) &&
       dims_are(bad->dimensions(), {batch, heads, m});
  if (auto e = check(ok, "page bounds: inconsistent q, stats, table, npages or results");
      e.failure())
    return e;
  const PageBounds kernel{batch, heads, rows, dim, n, m, q.typed_data(), k_max.typed_data(),
                          k_min.typed_data(), page_table.typed_data(), npages.typed_data(),
                          bounds->typed_data(), bad->typed_data()};
  parallel_for(pool, kernel.tasks(), [&](int64_t task) { kernel.run(task); });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(RankattnCpuPageBounds, Guarded<page_bounds>{},
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // q [B, Hkv, R, D]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // k_max [N, Hkv, D]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // k_min [N, Hkv, D]
                                  .Arg<I32>()                    // page_table [B, M]
                                  .Arg<I32>()                    // npages [B]
                                  .Ret<ffi::Buffer<ffi::F32>>()  // bounds [B, Hkv, R, M]
                                  .Ret<I32>());                  // bad [B, Hkv, M]

// The bindings' shared parts: the logit multiplier, the mask and block plan arrays, and the
// attributes.
template <typename Binding>
auto with_mask_and_plan(Binding binding) {
  return std::move(binding).template Arg<F32Buffer>()  // logit multiplier [B, Sq, Hq] or empty
      .template Arg<I32>()             // seg_q
      .template Arg<I32>()             // seg_k
      .template Arg<I32>()             // pos_q
      .template Arg<I32>()             // pos_k
      .template Arg<I32>()             // kv_index
      .template Arg<I32>()             // full_count
      .template Arg<I32>();            // count
}

template <typename Binding>
auto with_attributes(Binding binding) {
  return std::move(binding).template Attr<float>("scale")
      .template Attr<float>("softcap")
      .template Attr<bool>("soft_sign")
      .template Attr<bool>("causal")
      .template Attr<bool>("own")
      .template Attr<int64_t>("block_q")
      .template Attr<int64_t>("block_k");
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    RankattnCpuForward, Guarded<forward>{},
    with_attributes(with_mask_and_plan(ffi::Ffi::Bind()
                                           .Ctx<ffi::ThreadPool>()
                                           .Arg<ffi::AnyBuffer>()   // q
                                           .Arg<ffi::AnyBuffer>()   // k
                                           .Arg<ffi::AnyBuffer>())  // v
                        .Ret<ffi::AnyBuffer>()                       // out
                        .Ret<ffi::Buffer<ffi::F32>>()));             // lse

// The paged entries' operands before their mask: q, the pages, the page table, the own keys.
template <typename Binding>
auto with_paged_operands(Binding binding) {
  return std::move(binding).template Arg<ffi::AnyBuffer>()  // q
      .template Arg<ffi::AnyBuffer>()  // k pages
      .template Arg<ffi::AnyBuffer>()  // v pages
      .template Arg<I32>()             // page_table
      .template Arg<ffi::AnyBuffer>()  // k_self
      .template Arg<ffi::AnyBuffer>();  // v_self
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    RankattnCpuPagedForward, Guarded<paged_forward>{},
    with_attributes(with_mask_and_plan(with_paged_operands(ffi::Ffi::Bind()
                                                               .Ctx<ffi::ThreadPool>()))
                        .Ret<ffi::AnyBuffer>()              // out
                        .Ret<ffi::Buffer<ffi::F32>>()));    // lse

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    RankattnCpuPagedCandidatesForward, Guarded<paged_candidates_forward>{},
    with_attributes(with_paged_operands(ffi::Ffi::Bind().Ctx<ffi::ThreadPool>())
                        .Arg<I32>()                         // lengths [B]
                        .Ret<ffi::AnyBuffer>()              // out
                        .Ret<ffi::Buffer<ffi::F32>>()));    // lse

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    RankattnCpuBackward, Guarded<backward>{},
    with_attributes(with_mask_and_plan(ffi::Ffi::Bind()
                                           .Ctx<ffi::ThreadPool>()
                                           .Arg<ffi::AnyBuffer>()           // q
                                           .Arg<ffi::AnyBuffer>()           // k
                                           .Arg<ffi::AnyBuffer>()           // v
                                           .Arg<ffi::AnyBuffer>()           // d_out
                                           .Arg<ffi::Buffer<ffi::F32>>()    // lse [B, Sq, Hq]
                                           .Arg<ffi::Buffer<ffi::F32>>())   // delta [B, Sq, Hq]
                        .Arg<I32>()                                          // q_index
                        .Arg<I32>()                                          // q_full_count
                        .Arg<I32>()                                          // q_count
                        .Ret<ffi::AnyBuffer>()                               // dq
                        .Ret<ffi::AnyBuffer>()                               // dk
                        .Ret<ffi::AnyBuffer>()));                            // dv

// ---- Tests only (tests/test_cpu_kernel_numerics.py and test_serving_in_place.py, through
// ctypes): the dtype conversions, the vector exp and tanh, exact scoring's block plan, and
// which vector width and bfloat16 dots this build has.

namespace {

// y[i] = f(vector of x)[i] over n floats, a vector at a time (the last one zero-padded).
template <typename Out, typename F>
void by_vectors(const float* x, Out* y, int64_t n, F f) {
  for (int64_t i = 0; i < n; i += kLanes) {
    float lanes[kLanes] = {};
    std::copy_n(x + i, std::min<int64_t>(kLanes, n - i), lanes);
    const auto result = f(load(lanes));
    for (int64_t j = 0; j < kLanes && i + j < n; ++j) y[i + j] = static_cast<Out>(result[j]);
  }
}

}  // namespace

extern "C" {

void rankattn_test_bf16_from_f32(const float* x, uint16_t* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] = BF16::from(x[i]);
}
void rankattn_test_bf16_bits(const float* x, uint16_t* y, int64_t n) {  // p and ds's rounding
  by_vectors(x, y, n, bf16_bits);
}
void rankattn_test_f16_from_f32(const float* x, uint16_t* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] = F16::from(x[i]);
}
void rankattn_test_f16_to_f32(const uint16_t* x, float* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] = F16::to(x[i]);
}
void rankattn_test_exp(const float* x, float* y, int64_t n) { by_vectors(x, y, n, vexp); }
void rankattn_test_exp2(const float* x, float* y, int64_t n) { by_vectors(x, y, n, vexp2<6>); }
void rankattn_test_exp2_degree4(const float* x, float* y, int64_t n) {
  by_vectors(x, y, n, vexp2<4>);
}
void rankattn_test_exp2_softmax(const float* x, float* y, int64_t n) {
  by_vectors(x, y, n, vexp2<6, Exp2Range::kSoftmax>);
}
void rankattn_test_exp2_degree4_softmax(const float* x, float* y, int64_t n) {
  by_vectors(x, y, n, vexp2<4, Exp2Range::kSoftmax>);
}
void rankattn_test_tanh(const float* x, float* y, int64_t n) { by_vectors(x, y, n, vtanh); }
int rankattn_test_lanes() { return kLanes; }
// Whether this build's vector a * b + c rounds once (contracted to an FMA), on which exp2's ulp
// bound depends: asked of the code itself, since a CPU with FMA may still not contract
// (-ffp-contract=off, or -O0 as in the sanitizer build). (1 + 2^-12)^2 - (1 + 2^-11) is 2^-24
// in one rounding and 0 in two (the product's 2^-24 is a tie to even). Volatile, so that the
// compiler cannot fold it.
int rankattn_test_fma() {
  volatile float x = 1 + 0x1p-12f, y = -(1 + 0x1p-11f);
  const vf a = splat(x), c = splat(y);
  const vf r = a * a + c;
  return r[0] != 0;
}
// Where a kernel buffer (Vector) of n floats, and one of n 16-bit elements, starts within its
// cache line: the sum of the two offsets in bytes.
int64_t rankattn_test_buffer_offsets(int64_t n) {
  const Vector<float> f(n);
  const Vector<uint16_t> h(n);
  return reinterpret_cast<uintptr_t>(f.data()) % kCacheLine +
         reinterpret_cast<uintptr_t>(h.data()) % kCacheLine;
}
// Exact scoring's mask and block plan as the kernel builds them (CandidatesMask) for `batch`
// rows of q_len candidates over kv_len keys, row b seeing lengths[b] of them: seg_k [B, S],
// kv_index [B, nQ, nK], full_count and count [B, nQ].
void rankattn_test_candidates_plan(int64_t batch, int64_t q_len, int64_t kv_len,
                                   int64_t block_q, int64_t block_k, const int32_t* lengths,
                                   int32_t* seg_k, int32_t* kv_index, int32_t* full_count,
                                   int32_t* count) {
  Problem pr{};
  pr.batch = batch, pr.q_len = q_len, pr.kv_len = kv_len;
  pr.block_q = block_q, pr.block_k = block_k;
  pr.n_q = (q_len + block_q - 1) / block_q, pr.n_k = (kv_len + block_k - 1) / block_k;
  const CandidatesMask mask(pr, lengths);
  std::copy(mask.seg_k.begin(), mask.seg_k.end(), seg_k);
  std::copy(mask.kv_index.begin(), mask.kv_index.end(), kv_index);
  std::copy(mask.full_count.begin(), mask.full_count.end(), full_count);
  std::copy(mask.count.begin(), mask.count.end(), count);
}
// 0: bfloat16 inputs run float32 dots; 1: VDPBF16PS; 2: AMX tiles.
int rankattn_test_bf16_dots() {
#if defined(RANKATTN_AMX)
  if (amx_usable()) return 2;
#endif
  return std::is_same_v<DotElement<BF16>::type, bf16_t> ? 1 : 0;
}

}  // extern "C"
