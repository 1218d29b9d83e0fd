// Cooperative fibers for the emulator's work-items: start a function on a stack of its own,
// switch between fibers. On x86-64 a switch saves the callee-saved registers, MXCSR and the
// x87 control word on the old stack and restores them from the new one (no system call);
// elsewhere, or with RF_EMU_UCONTEXT, it is swapcontext. Stacks have a guard page below.
#pragma once

#include <sys/mman.h>

#include <cstddef>
#include <cstdint>
#include <cstring>

#if defined(__x86_64__) && !defined(RF_EMU_UCONTEXT)
// Saves the registers on this stack and its pointer in *save_sp, then restores a fiber from
// load_sp (defined in scheduler.cc).
extern "C" void rf_emu_switch(void** save_sp, void* load_sp);
#else
#include <ucontext.h>
#endif

namespace rf_emu {

#if defined(__x86_64__) && !defined(RF_EMU_UCONTEXT)
struct Fiber { void* sp = nullptr; };

inline void switch_fiber(Fiber& from, Fiber& to) { rf_emu_switch(&from.sp, to.sp); }

// The first switch to `fiber` enters `entry`, which must never return.
inline void start_fiber(Fiber& fiber, char* stack, size_t bytes, void (*entry)()) {
  // from the top: a zero return address for `entry` (at a 16-byte boundary + 8, as a call
  // leaves it), `entry` for rf_emu_switch's ret, six registers, MXCSR and control word
  uint64_t* top = reinterpret_cast<uint64_t*>(stack + bytes);
  uint64_t* sp = top - 9;
  std::memset(sp, 0, 9 * sizeof(uint64_t));
  sp[7] = reinterpret_cast<uint64_t>(entry);
  uint32_t control[2] = {0, 0};
  asm volatile("stmxcsr %0\n\tfnstcw %1" : "=m"(control[0]), "=m"(control[1]));
  std::memcpy(sp, control, sizeof control);
  fiber.sp = sp;
}
#else
struct Fiber { ucontext_t context; };

inline void switch_fiber(Fiber& from, Fiber& to) { swapcontext(&from.context, &to.context); }

inline void start_fiber(Fiber& fiber, char* stack, size_t bytes, void (*entry)()) {
  getcontext(&fiber.context);
  fiber.context.uc_stack.ss_sp = stack;
  fiber.context.uc_stack.ss_size = bytes;
  fiber.context.uc_link = nullptr;
  makecontext(&fiber.context, entry, 0);
}
#endif

// Stacks for up to `count` fibers, each `bytes()` long above a PROT_NONE guard page; kept
// and grown across launches.
class Stacks {
 public:
  static constexpr size_t PAGE = 4096, BYTES = 256 * 1024;
  bool reserve(size_t count) {
    if (count <= count_) return true;
    if (base_) munmap(base_, count_ * (BYTES + PAGE));
    count_ = 0;
    void* mem = mmap(nullptr, count * (BYTES + PAGE), PROT_READ | PROT_WRITE,
                     MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (mem == MAP_FAILED) return base_ = nullptr, false;
    base_ = static_cast<char*>(mem);
    for (size_t i = 0; i < count; ++i) mprotect(base_ + i * (BYTES + PAGE), PAGE, PROT_NONE);
    count_ = count;
    return true;
  }
  char* stack(size_t i) const { return base_ + i * (BYTES + PAGE) + PAGE; }
  size_t bytes() const { return BYTES; }
  // Whether `address` is in the guard page of a stack (a stack overflow).
  bool guards(const void* address) const {
    const char* a = static_cast<const char*>(address);
    if (!base_ || a < base_ || a >= base_ + count_ * (BYTES + PAGE)) return false;
    return (size_t)(a - base_) % (BYTES + PAGE) < PAGE;
  }

 private:
  char* base_ = nullptr;
  size_t count_ = 0;
};

}  // namespace rf_emu
