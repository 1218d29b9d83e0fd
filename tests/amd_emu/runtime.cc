// The emulator's scheduler. A launch runs its workgroups one at a time in grid order (x
// fastest, then y, then z; or a seeded shuffle of that order), each work-item a fiber on its
// own stack. Work-items run until they reach a synchronization point (s_barrier,
// wave_barrier, ds_bpermute) or exit; when none can run, waits that are complete are
// released, and a wait that can never complete is reported as an error naming the kernel,
// the workgroup and the barrier. Built into every emulated library, in a translation unit of
// its own, so that the kernels see each synchronization point as an opaque call.
#include <dlfcn.h>
#include <link.h>
#include <signal.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <string>
#include <vector>

#include "fiber.h"
#include "rf_amd_emu.h"

char* rf_emu_dynamic_shared = nullptr;

namespace {

constexpr size_t WAVE = __AMDGCN_WAVEFRONT_SIZE__;
constexpr size_t PAGE = 4096;

enum class At { running, s_barrier, wave_barrier, bpermute, exited, failed };
const char* const AT_NAMES[] = {"running", "s_barrier", "wave_barrier", "ds_bpermute",
                                "exited", "failed"};

struct Lane {
  rf_emu::Fiber fiber;
  At at = At::running;
  unsigned id[3] = {0, 0, 0};
  const void* site = nullptr;   // return address of the call it waits in
  unsigned long long permutes = 0;  // ds_bpermutes passed: a wave meets at the same one
  int address = 0, value = 0;   // ds_bpermute: what it asks and gives, then its result
};

struct Launch {
  const rf_emu::Entry* kernel;
  void** params;
  unsigned grid[3], block[3], group[3];
  std::vector<Lane> lanes;
  Lane* current = nullptr;
  rf_emu::Fiber scheduler;
  std::string error;
  uint64_t rng;
  double deadline;
};

std::mutex launch_mutex;  // one launch at a time: shared memory is one block per thread
Launch* g = nullptr;      // the launch in progress
rf_emu::Stacks stacks;
thread_local char lds_anchor;  // touched so this thread's shared-memory block exists

double now_s() {
  timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + 1e-9 * t.tv_nsec;
}

uint64_t next_random(uint64_t& state) {  // splitmix64
  uint64_t z = (state += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

void shuffle(std::vector<unsigned>& order, uint64_t& state) {
  for (size_t i = order.size(); i > 1; --i) std::swap(order[i - 1], order[next_random(state) % i]);
}

std::string format(const char* fmt, ...) {
  char text[512];
  va_list args;
  va_start(args, fmt);
  vsnprintf(text, sizeof text, fmt, args);
  va_end(args);
  return text;
}

// "kernel+0x1c4" for a code address in this library.
std::string describe_site(const void* site) {
  Dl_info info;
  if (!site || !dladdr(site, &info)) return "?";
  const char* at = static_cast<const char*>(site);
  if (info.dli_sname)
    return format("%s+0x%zx", info.dli_sname, (size_t)(at - (const char*)info.dli_saddr));
  return format("+0x%zx", (size_t)(at - (const char*)info.dli_fbase));
}

std::string where() {
  return format("%s: workgroup (%u, %u, %u)", g->kernel->name, g->group[0], g->group[1],
                g->group[2]);
}

// Whether two lanes wait at the same point (exited lanes all alike).
bool same_wait(const Lane& a, const Lane& b) {
  return a.at == b.at && (a.at == At::exited || a.site == b.site) &&
         (a.at != At::bpermute || a.permutes == b.permutes);
}

// The lanes [first, last) summarised as runs of equal state: "lanes 0-15 at ds_bpermute #3
// (k+0x40), lanes 16-63 exited" (cut short after a few hundred characters).
std::string describe_lanes(size_t first, size_t last) {
  std::string text;
  for (size_t i = first; i < last;) {
    const Lane& a = g->lanes[i];
    size_t j = i + 1;
    while (j < last && same_wait(g->lanes[j], a)) ++j;
    if (text.size() > 600) return text + ", ...";
    text += text.empty() ? "" : ", ";
    text += j - i == 1 ? format("lane %zu", i) : format("lanes %zu-%zu", i, j - 1);
    text += a.at == At::exited ? " exited" : format(" at %s", AT_NAMES[(int)a.at]);
    if (a.at == At::bpermute) text += format(" #%llu", a.permutes + 1);
    if (a.at != At::exited) text += " (" + describe_site(a.site) + ")";
    i = j;
  }
  return text;
}

// --- the lane side ---------------------------------------------------------------------------
void lane_main() {
  g->kernel->launch(g->params);
  g->current->at = At::exited;
  rf_emu::switch_fiber(g->current->fiber, g->scheduler);
  __builtin_trap();  // an exited lane is never resumed
}

void wait_at(At at, const void* site) {
  Lane& lane = *g->current;
  lane.at = at;
  lane.site = site;
  rf_emu::switch_fiber(lane.fiber, g->scheduler);
}

void fail(std::string message) {
  g->error = where() + ", lane " + std::to_string(g->current - g->lanes.data()) + ": " + message;
  wait_at(At::failed, nullptr);
  __builtin_trap();  // a failed launch never resumes its lanes
}

void check_deadline() {
  if (now_s() > g->deadline)
    fail("still running at the time limit (a wait for another workgroup never ends here: "
         "workgroups run one at a time)");
}

// --- the scheduler side ------------------------------------------------------------------------
// Sets g->error: `what` happened in the lanes [first, last) (a wave, or the workgroup).
void error_at(const char* what, size_t first, size_t last, bool wave) {
  g->error = format("%s in %s", what, where().c_str());
  if (wave) g->error += format(", wave %zu (lanes %zu-%zu)", first / WAVE, first, last - 1);
  g->error += ": " + describe_lanes(first, last);
}

// Releases the wave [first, last) if all of it waits at one wave-level point; false with
// g->error set if part of it waits there and the rest never can.
bool release_wave(size_t first, size_t last, bool& released) {
  Lane* lanes = g->lanes.data();
  const At at = lanes[first].at;
  bool any_bpermute = false, any_wave_barrier = false, same = true;
  for (size_t i = first; i < last; ++i) {
    any_bpermute |= lanes[i].at == At::bpermute;
    any_wave_barrier |= lanes[i].at == At::wave_barrier;
    // a wave barrier may be met at different calls (as __syncwarp); a ds_bpermute may not
    same &= at == At::wave_barrier ? lanes[i].at == at : same_wait(lanes[i], lanes[first]);
  }
  if (!any_bpermute && !any_wave_barrier) return true;
  if (!same) {
    error_at(any_bpermute ? "divergent ds_bpermute" : "deadlock at wave_barrier", first, last,
             true);
    return false;
  }
  if (at == At::bpermute) {
    std::vector<int> values(last - first);
    for (size_t i = first; i < last; ++i) values[i - first] = lanes[i].value;
    for (size_t i = first; i < last; ++i) {
      const unsigned source = ((unsigned)lanes[i].address >> 2) % WAVE;
      if (source >= last - first) {
        const std::string what =
            format("ds_bpermute reading lane %u of a %zu-lane wave", source, last - first);
        error_at(what.c_str(), first, last, true);
        return false;
      }
      lanes[i].value = values[source];
      ++lanes[i].permutes;
    }
  }
  for (size_t i = first; i < last; ++i) lanes[i].at = At::running;
  released = true;
  return true;
}

// Runs the wave [first, last) until each of its lanes waits at s_barrier or has exited
// (true), or a lane sleeps (true: the other waves get a turn), or an error (false).
bool run_wave(size_t first, size_t last) {
  std::vector<unsigned> order(last - first);
  for (size_t i = 0; i < order.size(); ++i) order[i] = (unsigned)(first + i);
  for (;;) {
    bool slept = false;
    if (g->rng) shuffle(order, g->rng);
    for (unsigned i : order) {  // every lane until it waits, exits, sleeps or fails
      Lane& lane = g->lanes[i];
      if (lane.at != At::running) continue;
      g->current = &lane;
      rf_emu::switch_fiber(g->scheduler, lane.fiber);
      if (!g->error.empty()) return false;
      slept |= lane.at == At::running;
    }
    if (slept) return true;
    bool released = false;
    if (!release_wave(first, last, released)) return false;
    if (!released) return true;
  }
}

// Runs one workgroup to its end; false with g->error set on a diagnosis. Between two
// s_barriers the waves run one after another, each as far as it gets (waves in order, or
// shuffled with a seed): a schedule as far from lockstep as AMD hardware allows, so that
// waves that share memory without a barrier see each other's writes late, or never.
bool run_group() {
  const size_t n = g->lanes.size(), waves = (n + WAVE - 1) / WAVE;
  for (size_t i = 0; i < n; ++i) {
    Lane& lane = g->lanes[i];
    lane = Lane{};
    lane.id[0] = (unsigned)(i % g->block[0]);
    lane.id[1] = (unsigned)(i / g->block[0] % g->block[1]);
    lane.id[2] = (unsigned)(i / ((size_t)g->block[0] * g->block[1]));
    rf_emu::start_fiber(lane.fiber, stacks.stack(i), stacks.bytes(), lane_main);
  }
  std::vector<unsigned> order(waves);
  for (size_t w = 0; w < waves; ++w) order[w] = (unsigned)w;
  for (;;) {
    for (bool running = true; running;) {
      if (g->rng) shuffle(order, g->rng);
      for (unsigned w : order)
        if (!run_wave(w * WAVE, std::min(n, (w + 1) * WAVE))) return false;
      running = false;
      for (const Lane& lane : g->lanes) running |= lane.at == At::running;
      if (running && now_s() > g->deadline) {
        g->error = where() + ": still running at the time limit";
        return false;
      }
    }
    // every lane waits at s_barrier or has exited
    size_t waiting = 0;
    for (const Lane& lane : g->lanes) waiting += lane.at == At::s_barrier;
    if (waiting == 0) return true;
    if (waiting < n) {
      error_at("deadlock at s_barrier (lanes exited while others wait)", 0, n, false);
      return false;
    }
    for (Lane& lane : g->lanes) lane.at = At::running;
  }
}

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

void on_fault(int sig, siginfo_t* info, void*) {
  char text[512];
  const char* hint = stacks.guards(info->si_addr) ? " (stack overflow)"
                     : dynamic_shared.guards(info->si_addr)
                         ? " (past the end of the launch's dynamic shared memory)" : "";
  int n = snprintf(text, sizeof text, "rf_amd_emu: fault at %p%s", info->si_addr, hint);
  if (g && g->current)
    n += snprintf(text + n, sizeof text - n, " in %s, workgroup (%u, %u, %u), lane %ld",
                  g->kernel->name, g->group[0], g->group[1], g->group[2],
                  (long)(g->current - g->lanes.data()));
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

unsigned rf_emu_workitem_id(int dim) { return g->current->id[dim]; }
unsigned rf_emu_workgroup_id(int dim) { return g->group[dim]; }

__attribute__((noinline)) void rf_emu_s_barrier() {
  wait_at(At::s_barrier, __builtin_return_address(0));
}

__attribute__((noinline)) void rf_emu_wave_barrier() {
  wait_at(At::wave_barrier, __builtin_return_address(0));
}

__attribute__((noinline)) int rf_emu_ds_bpermute(int byte_address, int value) {
  Lane& lane = *g->current;
  lane.address = byte_address;
  lane.value = value;
  wait_at(At::bpermute, __builtin_return_address(0));
  return lane.value;
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
  rf_emu::switch_fiber(g->current->fiber, g->scheduler);
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
// `error`. `seed` != 0 shuffles the workgroup order and each round of lanes.
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
  g = &launch;
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
  g = nullptr;
  if (!ok) snprintf(error, error_bytes, "%s", launch.error.c_str());
  return ok ? 0 : 1;
}

}  // extern "C"
