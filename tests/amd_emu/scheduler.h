// The emulator's scheduler, shared by scheduler.cc (which runs a workgroup's lanes) and
// runtime.cc (the builtins the kernels call, and the launch).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "fiber.h"
#include "rf_amd_emu.h"

namespace rf_emu {

constexpr size_t WAVE = __AMDGCN_WAVEFRONT_SIZE__;

// Where a lane is: running (or runnable), waiting at a synchronization point, done.
enum class At { running, s_barrier, wave_barrier, bpermute, matrix, exited, failed };

// A work-item: its fiber, where it is, its ids.
struct Lane {
  Fiber fiber;
  At at = At::running;
  unsigned id[3] = {0, 0, 0};
  const void* site = nullptr;   // return address of the call it waits in
  unsigned long long permutes = 0;  // cross-lane points passed: a wave meets at the same one
  int address = 0, value = 0;   // ds_bpermute: what it asks and gives, then its result
  int op = 0;                   // a matrix instruction: which, its operands, its result
  float a[16] = {}, b[16] = {}, c[8] = {}, d[8] = {};
};

// One launch: its kernel and arguments, the workgroup running and its lanes.
struct Launch {
  const Entry* kernel;
  void** params;
  unsigned grid[3], block[3], group[3];
  std::vector<Lane> lanes;
  Lane* current = nullptr;
  Fiber scheduler;
  std::string error;
  uint64_t rng;
  double deadline;
};

// The launch in progress (launches take a lock: one at a time) and the fibers' stacks.
extern Launch* active;
extern Stacks stacks;

double now_s();
std::string format(const char* fmt, ...) __attribute__((format(printf, 1, 2)));
void shuffle(std::vector<unsigned>& order, uint64_t& state);

// The lane side: the current lane waits at `at` (called from `site`) until released.
void wait_at(At at, const void* site);
// Stops the launch with `message` about the current lane.
[[noreturn]] void fail(const std::string& message);
// fail()s once the launch's time limit has passed.
void check_deadline();

// The scheduler side: runs workgroup active->group to its end; false with active->error set
// on a diagnosis.
bool run_group();

}  // namespace rf_emu
