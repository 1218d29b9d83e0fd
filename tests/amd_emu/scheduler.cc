// How the emulator runs one workgroup. Each work-item is a fiber that runs until it reaches
// a synchronization point (s_barrier, wave_barrier, ds_bpermute) or exits. Between two
// s_barriers the waves run one after another, each as far as it gets (in order, or shuffled
// with the launch's seed): the schedule furthest from lockstep that AMD hardware allows, so
// waves that share memory without a barrier see each other's writes late, or never. When a
// wave waits, its wave-level point is released if the whole wave is there, and diagnosed if
// part of it is elsewhere; then the workgroup's barrier, likewise.
#include "scheduler.h"

#include <dlfcn.h>
#include <time.h>

#include <algorithm>
#include <cstdarg>
#include <cstdio>
#include <utility>

#if defined(__x86_64__) && !defined(RF_EMU_UCONTEXT)
// fiber.h's switch: callee-saved registers, MXCSR and the x87 control word.
asm(R"(
  .text
  .p2align 4
  .globl rf_emu_switch
  .hidden rf_emu_switch
  .type rf_emu_switch, @function
rf_emu_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  subq $8, %rsp
  stmxcsr (%rsp)
  fnstcw 4(%rsp)
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  ldmxcsr (%rsp)
  fldcw 4(%rsp)
  addq $8, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .size rf_emu_switch, .-rf_emu_switch
)");
#endif

namespace rf_emu {

Launch* active = nullptr;
Stacks stacks;

static const char* const AT_NAMES[] = {"running", "s_barrier", "wave_barrier",
                                       "ds_bpermute", "matrix op", "exited", "failed"};

double now_s() {
  timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + 1e-9 * t.tv_nsec;
}

static uint64_t next_random(uint64_t& state) {  // splitmix64
  uint64_t z = (state += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

void shuffle(std::vector<unsigned>& order, uint64_t& state) {
  for (size_t i = order.size(); i > 1; --i)
    std::swap(order[i - 1], order[next_random(state) % i]);
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
static std::string describe_site(const void* site) {
  Dl_info info;
  if (!site || !dladdr(site, &info)) return "?";
  const char* at = static_cast<const char*>(site);
  if (info.dli_sname)
    return format("%s+0x%zx", info.dli_sname, (size_t)(at - (const char*)info.dli_saddr));
  return format("+0x%zx", (size_t)(at - (const char*)info.dli_fbase));
}

static std::string where() {
  const unsigned* group = active->group;
  return format("%s: workgroup (%u, %u, %u)", active->kernel->name, group[0], group[1],
                group[2]);
}

// Whether two lanes wait at the same point (exited lanes all alike).
static bool same_wait(const Lane& a, const Lane& b) {
  return a.at == b.at && (a.at == At::exited || a.site == b.site) &&
         ((a.at != At::bpermute && a.at != At::matrix) || a.permutes == b.permutes);
}

// The lanes [first, last) summarised as runs of equal state: "lanes 0-15 at ds_bpermute #3
// (k+0x40), lanes 16-63 exited" (cut short after a few hundred characters).
static std::string describe_lanes(size_t first, size_t last) {
  std::string text;
  for (size_t i = first; i < last;) {
    const Lane& a = active->lanes[i];
    size_t j = i + 1;
    while (j < last && same_wait(active->lanes[j], a)) ++j;
    if (text.size() > 600) return text + ", ...";
    text += text.empty() ? "" : ", ";
    text += j - i == 1 ? format("lane %zu", i) : format("lanes %zu-%zu", i, j - 1);
    text += a.at == At::exited ? " exited" : format(" at %s", AT_NAMES[(int)a.at]);
    if (a.at == At::bpermute || a.at == At::matrix) text += format(" #%llu", a.permutes + 1);
    if (a.at != At::exited) text += " (" + describe_site(a.site) + ")";
    i = j;
  }
  return text;
}

// --- the lane side ---------------------------------------------------------------------------
static void lane_main() {
  active->kernel->launch(active->params);
  active->current->at = At::exited;
  switch_fiber(active->current->fiber, active->scheduler);
  __builtin_trap();  // an exited lane is never resumed
}

void wait_at(At at, const void* site) {
  Lane& lane = *active->current;
  lane.at = at;
  lane.site = site;
  switch_fiber(lane.fiber, active->scheduler);
}

void fail(const std::string& message) {
  const size_t lane = active->current - active->lanes.data();
  active->error = where() + ", lane " + std::to_string(lane) + ": " + message;
  wait_at(At::failed, nullptr);
  __builtin_trap();  // a failed launch never resumes its lanes
}

void check_deadline() {
  if (now_s() > active->deadline)
    fail("still running at the time limit (a wait for another workgroup never ends here: "
         "workgroups run one at a time)");
}

// --- the scheduler side ------------------------------------------------------------------------
// Sets active->error: `what` happened in the lanes [first, last) (a wave, or the workgroup).
static void error_at(const char* what, size_t first, size_t last, bool wave) {
  active->error = format("%s in %s", what, where().c_str());
  if (wave)
    active->error += format(", wave %zu (lanes %zu-%zu)", first / WAVE, first, last - 1);
  active->error += ": " + describe_lanes(first, last);
}

static bool release_matrix(size_t first, size_t last);

// Releases the wave [first, last) if all of it waits at one wave-level point; false with
// active->error set if part of it waits there and the rest never can.
static bool release_wave(size_t first, size_t last, bool& released) {
  Lane* lanes = active->lanes.data();
  const At at = lanes[first].at;
  bool any_bpermute = false, any_wave_barrier = false, same = true;
  for (size_t i = first; i < last; ++i) {
    any_bpermute |= lanes[i].at == At::bpermute || lanes[i].at == At::matrix;
    any_wave_barrier |= lanes[i].at == At::wave_barrier;
    // a wave barrier may be met at different calls (as __syncwarp); a ds_bpermute may not
    same &= at == At::wave_barrier ? lanes[i].at == at : same_wait(lanes[i], lanes[first]);
  }
  if (!any_bpermute && !any_wave_barrier) return true;
  if (!same) {
    error_at(any_bpermute ? "divergent cross-lane operation" : "deadlock at wave_barrier",
             first, last, true);
    return false;
  }
  if (at == At::matrix) {
    if (!release_matrix(first, last)) return false;
    for (size_t i = first; i < last; ++i) ++lanes[i].permutes;
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

// A matrix instruction of the wave [first, last): every lane's result from the gathered
// operands, as the instruction lays them out (see compat.h); false with active->error set if
// the wave cannot run it (wrong wave size, WMMA operands not mirrored across lane halves).
static bool release_matrix(size_t first, size_t last) {
  Lane* lanes = active->lanes.data() + first;
  const size_t n = last - first;
  const int op = lanes[0].op;
  float A[16][16] = {}, B[16][16] = {}, C[16][16] = {};
  if (op == MATRIX_MFMA_16x16x16) {
    if (n != 64) return error_at("MFMA in a wave that is not 64 lanes", first, last, true), false;
    for (size_t l = 0; l < 64; ++l)
      for (int i = 0; i < 4; ++i) {
        A[l % 16][4 * (l / 16) + i] = lanes[l].a[i];
        B[4 * (l / 16) + i][l % 16] = lanes[l].b[i];
        C[4 * (l / 16) + i][l % 16] = lanes[l].c[i];
      }
  } else {
    if (n != 32) return error_at("WMMA in a wave that is not 32 lanes", first, last, true), false;
    for (size_t l = 0; l < 32; ++l)
      for (int k = 0; k < 16; ++k) {
        if (lanes[l].a[k] != lanes[l % 16].a[k] || lanes[l].b[k] != lanes[l % 16].b[k]) {
          const std::string what = format("WMMA operands of lane %zu differ from lane %zu's", l,
                                          l % 16);
          return error_at(what.c_str(), first, last, true), false;
        }
        A[l % 16][k] = lanes[l].a[k];
        B[k][l % 16] = lanes[l].b[k];
      }
    for (size_t l = 0; l < 32; ++l)
      for (int i = 0; i < 8; ++i) C[2 * i + l / 16][l % 16] = lanes[l].c[i];
  }
  float D[16][16];
  for (int m = 0; m < 16; ++m)
    for (int j = 0; j < 16; ++j) {
      float sum = C[m][j];
      for (int k = 0; k < 16; ++k) sum = __builtin_fmaf(A[m][k], B[k][j], sum);
      D[m][j] = sum;
    }
  for (size_t l = 0; l < n; ++l)
    for (int i = 0; i < (op == MATRIX_MFMA_16x16x16 ? 4 : 8); ++i)
      lanes[l].d[i] = op == MATRIX_MFMA_16x16x16 ? D[4 * (l / 16) + i][l % 16]
                                                 : D[2 * i + l / 16][l % 16];
  return true;
}

// Runs the wave [first, last) until each of its lanes waits at s_barrier or has exited
// (true), or a lane sleeps (true: the other waves get a turn), or an error (false).
static bool run_wave(size_t first, size_t last) {
  std::vector<unsigned> order(last - first);
  for (size_t i = 0; i < order.size(); ++i) order[i] = (unsigned)(first + i);
  for (;;) {
    bool slept = false;
    if (active->rng) shuffle(order, active->rng);
    for (unsigned i : order) {  // every lane until it waits, exits, sleeps or fails
      Lane& lane = active->lanes[i];
      if (lane.at != At::running) continue;
      active->current = &lane;
      switch_fiber(active->scheduler, lane.fiber);
      if (!active->error.empty()) return false;
      slept |= lane.at == At::running;
    }
    if (slept) return true;
    bool released = false;
    if (!release_wave(first, last, released)) return false;
    if (!released) return true;
  }
}

bool run_group() {
  const size_t n = active->lanes.size(), waves = (n + WAVE - 1) / WAVE;
  for (size_t i = 0; i < n; ++i) {
    Lane& lane = active->lanes[i];
    lane = Lane{};
    lane.id[0] = (unsigned)(i % active->block[0]);
    lane.id[1] = (unsigned)(i / active->block[0] % active->block[1]);
    lane.id[2] = (unsigned)(i / ((size_t)active->block[0] * active->block[1]));
    start_fiber(lane.fiber, stacks.stack(i), stacks.bytes(), lane_main);
  }
  std::vector<unsigned> order(waves);
  for (size_t w = 0; w < waves; ++w) order[w] = (unsigned)w;
  for (;;) {
    for (bool running = true; running;) {
      if (active->rng) shuffle(order, active->rng);
      for (unsigned w : order)
        if (!run_wave(w * WAVE, std::min(n, (w + 1) * WAVE))) return false;
      running = false;
      for (const Lane& lane : active->lanes) running |= lane.at == At::running;
      if (running && now_s() > active->deadline) {
        active->error = where() + ": still running at the time limit";
        return false;
      }
    }
    // every lane waits at s_barrier or has exited
    size_t waiting = 0;
    for (const Lane& lane : active->lanes) waiting += lane.at == At::s_barrier;
    if (waiting == 0) return true;
    if (waiting < n) {
      error_at("deadlock at s_barrier (lanes exited while others wait)", 0, n, false);
      return false;
    }
    for (Lane& lane : active->lanes) lane.at = At::running;
  }
}

}  // namespace rf_emu
