// The builtins the kernels call (rf_amd_emu.h) and the launch: shared memory (the library's
// thread-local block, poisoned per workgroup, and the dynamic part before a guard page), the
// workgroups in grid order (x fastest, then y, then z; or shuffled with a seed), faults
// reported with the kernel, workgroup and lane. A translation unit of its own, so the
// kernels see every builtin as an opaque call.
#include <dlfcn.h>
#include <link.h>
#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <vector>

#include "scheduler.h"

char* rf_emu_dynamic_shared = nullptr;

using namespace rf_emu;

namespace {

constexpr size_t PAGE = 4096;
std::mutex launch_mutex;  // one launch at a time: shared memory is one block per thread
thread_local char lds_anchor;  // touched so this thread's shared-memory block exists

// This thread's block of the library's thread-local storage (the RF_SHARED variables).
struct Block { void* data; size_t bytes; };
int find_block(dl_phdr_info* info, size_t, void* out) {
  Dl_info self;
  if (!dladdr((void*)&find_block, &self) || (void*)info->dlpi_addr != self.dli_fbase) return 0;
  for (int i = 0; i < info->dlpi_phnum; ++i)
    if (info->dlpi_phdr[i].p_type == PT_TLS)
      *static_cast<Block*>(out) = Block{info->dlpi_tls_data, info->dlpi_phdr[i].p_memsz};
  return 1;
}

// The dynamic shared memory of a launch: `bytes` ending at a guard page.
struct DynamicShared {
  char* base = nullptr;
  size_t mapped = 0;
  char* place(size_t bytes) {
    const size_t need = (bytes + PAGE - 1) / PAGE * PAGE + PAGE;
    if (need > mapped) {
      if (base) munmap(base, mapped);
      base = static_cast<char*>(mmap(nullptr, need, PROT_READ | PROT_WRITE,
                                     MAP_PRIVATE | MAP_ANONYMOUS, -1, 0));
      if (base == MAP_FAILED) return base = nullptr, mapped = 0, nullptr;
      mapped = need;
      mprotect(base + need - PAGE, PAGE, PROT_NONE);
    }
    return base + mapped - PAGE - (bytes + 15) / 16 * 16;
  }
  bool guards(const void* address) const {
    const char* a = static_cast<const char*>(address);
    return base && a >= base + mapped - PAGE && a < base + mapped;
  }
} dynamic_shared;


// A fault in a kernel names the kernel, workgroup and lane (then the handler that was there
// before takes the repeated fault: Python's faulthandler prints the traceback).
struct sigaction previous_segv, previous_bus;
stack_t previous_altstack;
char altstack[64 * 1024];

void on_fault(int, siginfo_t* info, void*) {
  char text[512];
  const char* hint = stacks.guards(info->si_addr) ? " (stack overflow)"
                     : dynamic_shared.guards(info->si_addr)
                         ? " (past the end of the launch's dynamic shared memory)" : "";
  int n = snprintf(text, sizeof text, "rf_amd_emu: fault at %p%s", info->si_addr, hint);
  if (active && active->current)
    n += snprintf(text + n, sizeof text - n, " in %s, workgroup (%u, %u, %u), lane %ld",
                  active->kernel->name, active->group[0], active->group[1], active->group[2],
                  (long)(active->current - active->lanes.data()));
  text[n < (int)sizeof text - 1 ? n : sizeof text - 2] = '\n';
  (void)!write(2, text, std::min(n + 1, (int)sizeof text - 1));
  sigaction(SIGSEGV, &previous_segv, nullptr);
  sigaction(SIGBUS, &previous_bus, nullptr);
}

void guard_faults() {
  stack_t alt{};
  alt.ss_sp = altstack;
  alt.ss_size = sizeof altstack;
  sigaltstack(&alt, &previous_altstack);
  struct sigaction action{};
  action.sa_sigaction = on_fault;
  action.sa_flags = SA_SIGINFO | SA_ONSTACK | SA_NODEFER;
  sigaction(SIGSEGV, &action, &previous_segv);
  sigaction(SIGBUS, &action, &previous_bus);
}

void unguard_faults() {
  sigaction(SIGSEGV, &previous_segv, nullptr);
  sigaction(SIGBUS, &previous_bus, nullptr);
  sigaltstack(&previous_altstack, nullptr);
}

}  // namespace

// --- the builtins ---------------------------------------------------------------------------
extern "C" {

unsigned rf_emu_workitem_id(int dim) { return active->current->id[dim]; }
unsigned rf_emu_workgroup_id(int dim) { return active->group[dim]; }

__attribute__((noinline)) void rf_emu_s_barrier() {
  wait_at(At::s_barrier, __builtin_return_address(0));
}

__attribute__((noinline)) void rf_emu_wave_barrier() {
  wait_at(At::wave_barrier, __builtin_return_address(0));
}

__attribute__((noinline)) int rf_emu_ds_bpermute(int byte_address, int value) {
  Lane& lane = *active->current;
  lane.address = byte_address;
  lane.value = value;
  wait_at(At::bpermute, __builtin_return_address(0));
  return lane.value;
}

// The source lane of DPP quad_perm (dpp_ctrl < 0x100, every row and bank enabled; the only
// form compat.h uses) for the calling lane.
int rf_emu_dpp_source(int ctrl, int row_mask, int bank_mask, int) {
  if (ctrl >= 0x100 || row_mask != 0xF || bank_mask != 0xF)
    fail(format("DPP control 0x%x (row mask 0x%x, bank mask 0x%x) is not emulated", ctrl,
                row_mask, bank_mask));
  const int lane = (int)((active->current - active->lanes.data()) % WAVE);
  return (lane & ~3) | ((ctrl >> (2 * (lane & 3))) & 3);
}

// The source lane of ds_swizzle for the calling lane: bit mode (within groups of 32 lanes,
// ((lane & and) | or) ^ xor) or quad-permute mode (offset bit 15).
int rf_emu_swizzle_source(int pattern) {
  const int lane = (int)((active->current - active->lanes.data()) % WAVE);
  if (pattern & 0x8000) return (lane & ~3) | ((pattern >> (2 * (lane & 3))) & 3);
  const int and_mask = pattern & 0x1F, or_mask = (pattern >> 5) & 0x1F;
  const int xor_mask = (pattern >> 10) & 0x1F;
  return (lane & ~31) | (((lane & and_mask) | or_mask) ^ xor_mask);
}

// The LDS trace: one record per access through compat.h's helpers, in each work-item's
// program order, while on (one launch at a time writes it: launches hold launch_mutex; the
// caller starts, reads and stops it between launches, from one thread: emulator.py).
struct LdsAccess {
  unsigned long long address;
  unsigned group, item;  // workgroup (x fastest) and work-item index within it
  int bytes, write;
};
static bool lds_tracing = false;
static std::vector<LdsAccess> lds_trace;

void rf_emu_lds_access(const void* address, int bytes, int write) {
  if (!lds_tracing) return;
  const Launch& l = *active;
  lds_trace.push_back(LdsAccess{
      (unsigned long long)address, l.group[0] + l.grid[0] * (l.group[1] + l.grid[1] * l.group[2]),
      (unsigned)(l.current - l.lanes.data()), bytes, write});
}

// Starts (on != 0) or stops recording; either way the records so far are dropped.
RF_EMU_API void rf_emu_lds_trace(int on) {
  lds_tracing = on != 0;
  lds_trace.clear();
  lds_trace.shrink_to_fit();
}
RF_EMU_API size_t rf_emu_lds_trace_size() { return lds_trace.size(); }
RF_EMU_API const LdsAccess* rf_emu_lds_trace_data() { return lds_trace.data(); }

static unsigned long long matrix_ops = 0;  // matrix instructions run (whole waves)

RF_EMU_API unsigned long long rf_emu_matrix_ops() { return matrix_ops; }

__attribute__((noinline)) void rf_emu_matrix(int op, const float* a, const float* b,
                                             const float* c, float* d) {
  Lane& lane = *active->current;
  if (lane.id[0] % WAVE == 0) ++matrix_ops;
  const int k = op == MATRIX_MFMA_16x16x16 ? 4 : 16, n = op == MATRIX_MFMA_16x16x16 ? 4 : 8;
  lane.op = op;
  std::copy(a, a + k, lane.a);
  std::copy(b, b + k, lane.b);
  std::copy(c, c + n, lane.c);
  wait_at(At::matrix, __builtin_return_address(0));
  std::copy(lane.d, lane.d + n, d);
}

unsigned long long rf_emu_memrealtime() {
  check_deadline();
  return (unsigned long long)(now_s() * 1e8);
}

unsigned long long rf_emu_sendmsg_rtnl(int message) {
  if (message != 0x83) fail(format("s_sendmsg_rtnl(0x%x) is not emulated", message));
  return rf_emu_memrealtime();
}

void rf_emu_sleep(int) {
  check_deadline();
  switch_fiber(active->current->fiber, active->scheduler);
}

void rf_emu_fence(int, const char* scope) {
  static const char* const scopes[] = {"", "singlethread", "wavefront", "workgroup", "agent"};
  for (const char* s : scopes)
    if (!std::strcmp(scope, s)) return;
  fail(format("fence with unknown scope \"%s\"", scope));
}

RF_EMU_API int rf_emu_wave_size() { return WAVE; }

RF_EMU_API int rf_emu_kernel_count() {
  int n = 0;
  while (rf_emu_table()[n].name) ++n;
  return n;
}

RF_EMU_API const char* rf_emu_kernel_name(int i) { return rf_emu_table()[i].name; }
RF_EMU_API unsigned rf_emu_kernel_threads(int i) { return rf_emu_table()[i].max_threads; }
RF_EMU_API const char* rf_emu_kernel_signature(int i) { return rf_emu_table()[i].signature; }

// Runs kernel `index` over `grid` workgroups of `block` work-items; 0, or 1 with a message in
// `error`. `seed` != 0 shuffles the order of workgroups, of waves and of lanes.
RF_EMU_API int rf_emu_launch(int index, const unsigned* grid, const unsigned* block,
                             unsigned long long shared_bytes, void** params,
                             unsigned long long seed, double timeout_s, char* error,
                             size_t error_bytes) {
  std::lock_guard<std::mutex> hold(launch_mutex);
  Launch launch{};
  launch.kernel = &rf_emu_table()[index];
  launch.params = params;
  std::copy(grid, grid + 3, launch.grid);
  std::copy(block, block + 3, launch.block);
  launch.rng = seed;
  launch.deadline = now_s() + timeout_s;
  const size_t threads = (size_t)block[0] * block[1] * block[2];
  if (threads > launch.kernel->max_threads || threads > 1024) {
    snprintf(error, error_bytes, "%s: a block of %zu work-items exceeds the kernel's bound of %u",
             launch.kernel->name, threads, launch.kernel->max_threads);
    return 1;
  }
  rf_emu_dynamic_shared = dynamic_shared.place(shared_bytes);
  if (!rf_emu_dynamic_shared || !stacks.reserve(threads)) {
    snprintf(error, error_bytes, "%s: out of memory for %zu fibers", launch.kernel->name, threads);
    return 1;
  }
  *static_cast<volatile char*>(&lds_anchor) = 1;  // allocates the block in this thread
  Block lds{nullptr, 0};
  dl_iterate_phdr(find_block, &lds);
  launch.lanes.resize(threads);
  std::vector<unsigned> order((size_t)grid[0] * grid[1] * grid[2]);
  for (size_t i = 0; i < order.size(); ++i) order[i] = (unsigned)i;
  if (launch.rng) shuffle(order, launch.rng);
  active = &launch;
  guard_faults();
  bool ok = true;
  for (size_t i = 0; ok && i < order.size(); ++i) {
    launch.group[0] = order[i] % grid[0];
    launch.group[1] = order[i] / grid[0] % grid[1];
    launch.group[2] = order[i] / ((size_t)grid[0] * grid[1]);
    if (lds.data) std::memset(lds.data, 0xFF, lds.bytes);
    std::memset(rf_emu_dynamic_shared, 0xFF, (shared_bytes + 15) / 16 * 16);
    ok = run_group();
  }
  unguard_faults();
  active = nullptr;
  if (!ok) snprintf(error, error_bytes, "%s", launch.error.c_str());
  return ok ? 0 : 1;
}

}  // extern "C"
