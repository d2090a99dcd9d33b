// The native frames of a test worker's fatal signal, written by the crashing thread itself
// (tests/crash_report.py builds this, and each xdist worker installs it over faulthandler).
//
// Why in the process: gdb on a JAX worker's core (6 GB) ran past its 300 s in CI twice and
// named no frame, while a crash inside XLA's compile showed only Python frames. Here each
// frame is written as "#i <library>+0x<offset> <symbol>" (the offset from the library's load
// address, for addr2line, which names functions from the library's symbol table afterwards),
// then the signal goes on to the handler installed before (faulthandler's Python frames, then
// the default action and its core).
//
// Only async-signal-safe calls in the handler, but for backtrace() (its unwinder is loaded
// when the handler is installed) and dladdr() (the same that backtrace_symbols_fd calls).
#define _GNU_SOURCE
#include <dlfcn.h>
#include <execinfo.h>
#include <signal.h>
#include <stdint.h>
#include <string.h>
#include <ucontext.h>
#include <unistd.h>

enum { kMaxFrames = 40 };  // the innermost: where it crashed and what called it
static const int kSignals[] = {SIGSEGV, SIGBUS, SIGILL, SIGFPE, SIGABRT};
static struct sigaction previous[NSIG];
static int out_fd = 2;

static void put(const char* text) {
  for (size_t left = strlen(text); left > 0;) {
    const ssize_t n = write(out_fd, text, left);
    if (n <= 0) return;
    text += n, left -= (size_t)n;
  }
}

static void put_number(uintptr_t x, int base) {
  char digits[24];
  int i = sizeof digits - 1;
  digits[i] = '\0';
  do {
    digits[--i] = "0123456789abcdef"[x % base];
    x /= base;
  } while (x && i > 2);
  if (base == 16) digits[--i] = 'x', digits[--i] = '0';
  put(digits + i);
}

// One frame: its index, its library and the offset in it, and the nearest exported symbol.
static void put_frame(int index, uintptr_t pc) {
  Dl_info where;
  put("#");
  put_number((uintptr_t)index, 10);
  put(" ");
  if (dladdr((void*)pc, &where) && where.dli_fname && where.dli_fname[0]) {
    put(where.dli_fname);
    put("+");
    put_number(pc - (uintptr_t)where.dli_fbase, 16);
    put(" ");
    put(where.dli_sname ? where.dli_sname : "?");
  } else {
    put("?+");
    put_number(pc, 16);
    put(" ?");
  }
  put("\n");
}

static uintptr_t interrupted_pc(void* context) {
  const ucontext_t* uc = (const ucontext_t*)context;
#if defined(__x86_64__)
  return (uintptr_t)uc->uc_mcontext.gregs[REG_RIP];
#elif defined(__aarch64__)
  return (uintptr_t)uc->uc_mcontext.pc;
#else
  (void)uc;
  return 0;
#endif
}

static void on_fatal_signal(int signal, siginfo_t* info, void* context) {
  // The previous handler first: should the unwinder fault on a broken stack, that second signal
  // (not blocked: SA_NODEFER) reaches faulthandler, which still prints the Python frames.
  sigaction(signal, &previous[signal], NULL);
  put("Native frames (tests/native/crash_frames.c), the crash point first: signal ");
  put_number((uintptr_t)signal, 10);
  put(", address ");
  put_number((uintptr_t)info->si_addr, 16);
  put("\n");
  const uintptr_t pc = interrupted_pc(context);
  if (pc) put_frame(0, pc);
  // The unwinder's frames: this handler, the signal trampoline, then the interrupted frame
  // and its callers. Return addresses point past their call: one byte back lies in it.
  void* frames[kMaxFrames];
  const int n = backtrace(frames, kMaxFrames);
  int first = 0;  // the frame after the trampoline (the interrupted one, printed above)
  for (int i = 0; i < n; ++i) {
    if ((uintptr_t)frames[i] == pc) first = i + 1;
  }
  for (int i = first; i < n; ++i) put_frame(i - first + 1, (uintptr_t)frames[i] - 1);
  put("\n");
  // On to the previous handler: a fault recurs when the instruction runs again; a signal that
  // was sent (abort, kill) is sent again.
  if (info->si_code <= 0) raise(signal);
}

// Installs the handler for the fatal signals, writing to `fd`; 0, or -1 with errno set.
int crash_frames_install(int fd) {
  void* warm[1];
  backtrace(warm, 1);  // loads the unwinder (libgcc_s) now, not in the handler
  out_fd = fd;
  for (size_t i = 0; i < sizeof kSignals / sizeof kSignals[0]; ++i) {
    struct sigaction action;
    memset(&action, 0, sizeof action);
    action.sa_sigaction = on_fatal_signal;
    // On faulthandler's alternate stack, if any; see on_fatal_signal for SA_NODEFER.
    action.sa_flags = SA_SIGINFO | SA_ONSTACK | SA_NODEFER;
    sigemptyset(&action.sa_mask);
    if (sigaction(kSignals[i], &action, &previous[kSignals[i]]) != 0) return -1;
  }
  return 0;
}
