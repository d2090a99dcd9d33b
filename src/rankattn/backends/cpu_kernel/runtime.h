// The kernel's runtime: its settings (the environment, read once), every allocation of its
// buffers (with the tests' fault injection), parallel_for on XLA's CPU pool, and the
// exceptions of a call returned as its FFI error.
//
// Part of cpu_attention.cc (see vectors.h).
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <limits>
#include <memory>
#include <new>
#include <numeric>
#include <random>
#include <sched.h>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "vectors.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// ---- Settings: the environment, read once per process (by the first call), in one place.

enum class TaskOrder { kNatural, kReverse, kShuffle };
enum class BackwardPass { kAuto, kRows, kRowsByKey, kRowsByQuery, kBlocks };  // backward.h

struct Settings {
  int64_t max_threads;     // RANKATTN_CPU_THREADS: at most this many threads per call
  int64_t backward_bytes;  // RANKATTN_CPU_BACKWARD_MB, in bytes: the dS a backward keeps
  // RANKATTN_CPU_BACKWARD_PASS=auto | rows | rows-by-key | rows-by-query | blocks: which of
  // the backward's two passes runs (auto: rows where its tasks fill the threads, see
  // rows_pass), and in which order the rows pass takes its block pairs (rows: the order
  // queries_outer picks). All give the same bits; for tests and measurements.
  BackwardPass backward_pass;
  // Tests only: RANKATTN_CPU_FAIL_ALLOC=caller:<n> or pool:<n> fails the n-th allocation
  // (from 1) of the kernel's buffers on the threads that call the kernel, or on XLA's pool
  // workers, once per process.
  bool fail_in_pool;
  int64_t fail_at;  // 0: never
  // Tests only: RANKATTN_CPU_TASK_ORDER=natural | reverse | shuffle:<seed>, the order in which
  // parallel_for's tasks are claimed, which must not change a bit of any result (every output
  // is written by one task), even where the pool has one thread.
  TaskOrder task_order;
  uint64_t shuffle_seed;
  // RANKATTN_CPU_TRACE=1: each thread of each parallel_for prints when it started, after the
  // call began, on which CPU, and how many tasks it ran in how long (stderr; CPU_KERNEL.md
  // reads it: on a 2-core VM, caller and worker shared one CPU after a pause).
  bool trace;
  // RANKATTN_CPU_MOVE_WORKERS=0: a pool worker woken onto its caller's CPU stays there, and the
  // caller does not yield to it (see AwayFrom and kWorkerLate; for measuring what both gain).
  bool move_workers;

  static int64_t number(const char* name, int64_t fallback, int64_t lo, int64_t hi) {
    const char* text = std::getenv(name);
    return text ? std::clamp<int64_t>(std::strtoll(text, nullptr, 10), lo, hi) : fallback;
  }
  static Settings from_environment() {
    constexpr int64_t kMax = std::numeric_limits<int64_t>::max();
    Settings s{};
    s.max_threads = number("RANKATTN_CPU_THREADS", kMax, 1, kMax);
    // Clamped so that the bytes fit an int64_t (a larger budget keeps every pair anyway).
    s.backward_bytes = number("RANKATTN_CPU_BACKWARD_MB", 1024, 0, kMax >> 20) << 20;
    if (const char* fail = std::getenv("RANKATTN_CPU_FAIL_ALLOC")) {
      s.fail_in_pool = std::strncmp(fail, "pool:", 5) == 0;
      if (s.fail_in_pool || std::strncmp(fail, "caller:", 7) == 0) {
        s.fail_at = std::max<int64_t>(0, std::strtoll(std::strchr(fail, ':') + 1, nullptr, 10));
      }
    }
    if (const char* pass = std::getenv("RANKATTN_CPU_BACKWARD_PASS")) {
      if (std::strcmp(pass, "rows") == 0) s.backward_pass = BackwardPass::kRows;
      if (std::strcmp(pass, "rows-by-key") == 0) s.backward_pass = BackwardPass::kRowsByKey;
      if (std::strcmp(pass, "rows-by-query") == 0) s.backward_pass = BackwardPass::kRowsByQuery;
      if (std::strcmp(pass, "blocks") == 0) s.backward_pass = BackwardPass::kBlocks;
    }
    if (const char* order = std::getenv("RANKATTN_CPU_TASK_ORDER")) {
      if (std::strcmp(order, "reverse") == 0) s.task_order = TaskOrder::kReverse;
      if (std::strncmp(order, "shuffle:", 8) == 0) {
        s.task_order = TaskOrder::kShuffle;
        s.shuffle_seed = std::strtoull(order + 8, nullptr, 10);
      }
    }
    s.move_workers = number("RANKATTN_CPU_MOVE_WORKERS", 1, 0, 1) != 0;
    if (const char* trace = std::getenv("RANKATTN_CPU_TRACE")) {
      s.trace = std::strcmp(trace, "1") == 0;
    }
    return s;
  }
};

const Settings& settings() {
  static const Settings once = Settings::from_environment();
  return once;
}

// ---- Memory: every buffer of the kernel is allocated here, so that a failure says how many
// bytes were asked for (RA126, see Guarded) and the tests can inject one.

struct OutOfMemory : std::bad_alloc {
  int64_t bytes;
  explicit OutOfMemory(int64_t bytes) : bytes(bytes) {}
};

thread_local bool on_pool_worker = false;  // while a pool worker runs parallel_for's tasks

bool injected_failure() {
  const Settings& s = settings();
  if (s.fail_at == 0 || on_pool_worker != s.fail_in_pool) return false;
  static std::atomic<int64_t> count{0};
  return count.fetch_add(1) + 1 == s.fail_at;
}

void* allocate_bytes(int64_t bytes, int64_t alignment) {
  void* x = nullptr;
  if (!injected_failure()) {
    x = alignment <= static_cast<int64_t>(alignof(std::max_align_t))
            ? std::malloc(bytes)
            : std::aligned_alloc(alignment, round_up(bytes, alignment));
  }
  if (!x) throw OutOfMemory(bytes);
  return x;
}

// std::vector's allocator for the kernel's buffers, on cache lines: malloc aligns to 16 bytes
// (a large block starts 16 bytes into a page), which split every 64-byte vector and AMX tile
// row of a buffer over two lines (an AMX dot measured half as fast on such rows, cpu_dot).
constexpr int64_t kCacheLine = 64;
template <typename T>
struct Allocator {
  using value_type = T;
  Allocator() = default;
  template <typename U>
  Allocator(const Allocator<U>&) {}
  T* allocate(size_t n) {
    return static_cast<T*>(allocate_bytes(static_cast<int64_t>(n * sizeof(T)),
                                          std::max<int64_t>(alignof(T), kCacheLine)));
  }
  void deallocate(T* x, size_t) { std::free(x); }
  bool operator==(const Allocator&) const { return true; }
  bool operator!=(const Allocator&) const { return false; }
};
template <typename T>
using Vector = std::vector<T, Allocator<T>>;

// ---- Threads: tasks 0..n-1 claimed from a shared counter by the caller and pool workers.
// A task that throws (std::bad_alloc above all: an exception that left a pool worker would end
// the process) fails the call: the tasks not yet started are skipped, every task that started
// is waited for (they use the caller's stack frame), and the first failure is rethrown on the
// calling thread, where Guarded returns it as the FFI handler's error.

std::atomic<int64_t> traced_regions{0};  // numbers parallel_for's regions in the trace

// Linux may wake a pool worker onto the CPU of the thread that woke it, where one of the two
// then waits for the other while another CPU idles, for milliseconds, until the scheduler's
// balancing moves one (RANKATTN_CPU_TRACE on a 2-core VM: caller and worker on one CPU in
// most calls after a pause, the caller starting up to 4 ms late; see CPU_KERNEL.md). A worker
// that finds itself on the caller's CPU with tasks left moves to the other CPUs it may run
// on, until its share of the call is done; then it may run anywhere again.
class AwayFrom {
 public:
  explicit AwayFrom(int cpu) : found_there_(cpu >= 0 && sched_getcpu() == cpu) {
    if (!found_there_ || sched_getaffinity(0, sizeof saved_, &saved_) != 0) return;
    cpu_set_t others = saved_;
    CPU_CLR(cpu, &others);
    moved_ = CPU_COUNT(&others) > 0 && sched_setaffinity(0, sizeof others, &others) == 0;
  }
  ~AwayFrom() {
    if (moved_) sched_setaffinity(0, sizeof saved_, &saved_);
  }
  AwayFrom(const AwayFrom&) = delete;
  AwayFrom& operator=(const AwayFrom&) = delete;
  bool found_there() const { return found_there_; }  // whether the thread was on that CPU

 private:
  const bool found_there_;
  cpu_set_t saved_{};
  bool moved_ = false;
};

// What a thread must undo once its share of a parallel_for is done, set by what needs it: the
// AMX tile state that the first bfloat16 dot on a thread configures (dots.h), so that the
// tiles are configured once per call and thread, not per dot, and none outlives a call.
thread_local void (*at_region_end)() = nullptr;

// The threads a call's parallel_for runs tasks on (the caller and pool workers), at most.
inline int64_t call_threads(ffi::ThreadPool& pool) {
  return std::max<int64_t>(1, std::min<int64_t>(pool.num_threads(), settings().max_threads));
}

// A worker woken onto its caller's CPU cannot run, and so cannot move away, until the caller's
// time slice ends: 2.3-3.7 ms on the 2-core Zen 4 VM, where it happened in a third of short-fwd's
// calls after a pause and in three quarters of the 64-candidate serving request's. So while a
// worker has not begun, the caller yields its CPU before each task (the worker, if it waits
// there, then runs and moves) once the worker is late: at once where workers were lately woken
// onto their caller's CPU, else kWorkerLate after the call began (a woken worker began 25-60 us
// after it there). Yielding at once in every call cost 6% of short-fwd beside a busy process.
constexpr std::chrono::microseconds kWorkerLate{100};
// Whether workers were lately woken onto their caller's CPU: a worker found there raises it by
// 4, one found elsewhere lowers it by 1, within [0, 16]. (Racy updates only blur it.)
std::atomic<int> woken_on_caller{0};

template <typename Fn>
void parallel_for(ffi::ThreadPool& pool, int64_t n, Fn fn) {
  // Claim i runs task i, or (tests only) task order[i] or n - 1 - i.
  const TaskOrder task_order = settings().task_order;
  Vector<int64_t> order;
  if (task_order == TaskOrder::kShuffle) {
    order.resize(n);
    std::iota(order.begin(), order.end(), 0);
    std::shuffle(order.begin(), order.end(), std::mt19937_64(settings().shuffle_seed));
  }
  auto task = [&](int64_t i) {
    fn(task_order == TaskOrder::kShuffle   ? order[i]
       : task_order == TaskOrder::kReverse ? n - 1 - i
                                           : i);
  };
  struct State {
    std::atomic<int64_t> next{0}, done{0}, started{0};  // started: workers that began
    std::atomic<bool> failed{false};
    std::exception_ptr failure;  // the first, written by the task that set `failed`
  };
  auto state = std::make_shared<State>();
  const int64_t region = settings().trace ? traced_regions.fetch_add(1) : 0;
  const auto start = std::chrono::steady_clock::now();
  // The state outlives this call for workers that start late; `task` does not, so a worker
  // only touches it after claiming a task, which cannot happen once all are done.
  // `away_from`: a worker's caller's CPU (see AwayFrom); -1 for the caller. `workers`: for the
  // caller, the workers scheduled, which it yields to while they are late (see kWorkerLate).
  auto work = [state, n, &task, region, start](int away_from, int64_t workers) {
    const bool tasks_left = state->next.load(std::memory_order_relaxed) < n;
    const AwayFrom moved(tasks_left ? away_from : -1);
    if (on_pool_worker) {
      if (tasks_left && away_from >= 0) {
        const int was = woken_on_caller.load(std::memory_order_relaxed);
        woken_on_caller.store(moved.found_there() ? std::min(was + 4, 16) : std::max(was - 1, 0),
                              std::memory_order_relaxed);
      }
      state->started.fetch_add(1, std::memory_order_relaxed);
    }
    const auto began = std::chrono::steady_clock::now();
    const int cpu = settings().trace ? sched_getcpu() : -1;
    int64_t ran = 0, yields = 0;
    for (int64_t i; (i = state->next.fetch_add(1)) < n; ++ran) {
      if (state->started.load(std::memory_order_relaxed) < workers &&
          (woken_on_caller.load(std::memory_order_relaxed) > 0 ||
           std::chrono::steady_clock::now() - start > kWorkerLate)) {
        sched_yield();
        ++yields;
      }
      if (!state->failed.load(std::memory_order_relaxed)) {
        try {
          task(i);
        } catch (...) {
          if (!state->failed.exchange(true)) state->failure = std::current_exception();
        }
      }
      state->done.fetch_add(1, std::memory_order_release);
    }
    if (at_region_end) std::exchange(at_region_end, nullptr)();
    if (settings().trace) {  // one write per line: the threads' lines do not interleave
      std::fprintf(stderr,
                   "rankattn cpu trace: region %lld of %lld tasks: %s started %.0f us after the "
                   "call on cpu %d, ran %lld in %.0f us, yielded %lld times\n",
                   static_cast<long long>(region), static_cast<long long>(n),
                   on_pool_worker ? "worker" : "caller",
                   std::chrono::duration<double, std::micro>(began - start).count(), cpu,
                   static_cast<long long>(ran),
                   std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() -
                                                             began).count(),
                   static_cast<long long>(yields));
    }
  };
  const int64_t workers = std::min(call_threads(pool), n) - 1;
  int64_t scheduled = 0;
  try {
    const int caller_cpu = workers > 0 && settings().move_workers ? sched_getcpu() : -1;
    for (; scheduled < workers; ++scheduled) {
      pool.Schedule([work, caller_cpu]() {
        on_pool_worker = true;
        work(caller_cpu, 0);
        on_pool_worker = false;
      });
    }
  } catch (const std::bad_alloc&) {
    // A worker that could not be scheduled leaves its share to the others (the caller below).
  }
  work(-1, settings().move_workers ? scheduled : 0);
  while (state->done.load(std::memory_order_acquire) < n) std::this_thread::yield();
  if (state->failure) std::rethrow_exception(state->failure);
}

// ---- Errors.

// RA126 (rankattn/errors.py's catalog): JAX raises it as its JaxRuntimeError, so the message
// starts with the code, as rankattn's own errors do, and says what to change.
ffi::Error out_of_memory(int64_t bytes) {
  char what[96] = "a buffer of unknown size";
  if (bytes >= 0) {
    const bool mib = bytes >= (1 << 20);
    std::snprintf(what, sizeof what, "%lld bytes (%.1f %s)", static_cast<long long>(bytes),
                  static_cast<double>(bytes) / (mib ? 1 << 20 : 1 << 10), mib ? "MiB" : "KiB");
  }
  return ffi::Error(
      ffi::ErrorCode::kResourceExhausted,
      std::string("[RA126] the cpu kernel could not allocate memory: it asked for ") + what +
          ". Lower RANKATTN_CPU_BACKWARD_MB (the dS a backward keeps, default 1024), pass a "
          "smaller batch or fewer tokens per call, or lower RANKATTN_CPU_THREADS (each thread "
          "keeps buffers of its own).\n  (rankattn explain RA126 for more.)");
}

// An FFI handler with every exception it lets out (on the calling thread, or rethrown there by
// parallel_for) as the call's error: none may cross into XLA.
template <auto handler>
struct Guarded {
  template <typename... Args>
  ffi::Error operator()(Args&&... args) const {
    try {
      return handler(std::forward<Args>(args)...);
    } catch (const OutOfMemory& e) {
      return out_of_memory(e.bytes);
    } catch (const std::bad_alloc&) {
      return out_of_memory(-1);
    } catch (const std::exception& e) {
      return ffi::Error(ffi::ErrorCode::kInternal, std::string("rankattn cpu kernel: ") + e.what());
    } catch (...) {
      return ffi::Error(ffi::ErrorCode::kInternal, "rankattn cpu kernel: an unknown exception");
    }
  }
};

}  // namespace
