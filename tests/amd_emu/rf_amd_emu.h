// Host definitions of what native/compat.h's AMD branch takes from the target, so the real
// kernel sources compile with a host C++ compiler (g++ or clang++) and run on the CPU:
// the target-attribute macros, the amdgcn builtins (as macros calling runtime.cc, which
// schedules work-items as fibers) and the launcher that unpacks kernelParams by each
// kernel's own parameter types. emulator.py includes this first and defines
// __AMDGCN_WAVEFRONT_SIZE__ (64 or 32) per build.
#pragma once

#if !defined(__AMDGCN_WAVEFRONT_SIZE__) || !defined(__AMDGCN_WAVEFRONT_SIZE)
#error "rf_amd_emu.h: define __AMDGCN_WAVEFRONT_SIZE__ and __AMDGCN_WAVEFRONT_SIZE (64 or 32)"
#elif __AMDGCN_WAVEFRONT_SIZE__ != __AMDGCN_WAVEFRONT_SIZE || \
    (__AMDGCN_WAVEFRONT_SIZE__ != 64 && __AMDGCN_WAVEFRONT_SIZE__ != 32)
#error "rf_amd_emu.h: the wavefront size must be 64 or 32, the same in both macros"
#endif

#include <cstddef>
#include <type_traits>
#include <utility>

#define RF_AMD_EMULATION 1
#define RF_EMU_API extern "C" __attribute__((visibility("default")))

// --- target attributes (compat.h leaves these five to us under RF_AMD_EMULATION) ----------
// Kernels are exported so that diagnostics can name the kernel around a code address. The
// discovery pass (emulator.py, preprocessing only) marks each kernel with its thread bound.
#ifdef RF_EMU_DISCOVER
#define RF_KERNEL(threads) rf_emu_kernel_threads(threads) extern "C" void
#else
#define RF_KERNEL(threads) extern "C" __attribute__((visibility("default"))) void
#endif
#define RF_KERNEL_OCCUPANCY(threads, blocks) RF_KERNEL(threads)
#define RF_DEVICE inline __attribute__((always_inline))
// Shared memory is this library's thread-local storage: workgroups run one at a time on one
// thread, and the runtime poisons the whole block (0xFF bytes) before each workgroup.
#define RF_SHARED static thread_local
// Dynamic shared memory: the launch's shared_bytes, ending at a guard page, poisoned too.
#define RF_DYNAMIC_SHARED(type, name) \
  type* const name = reinterpret_cast<type*>(rf_emu_dynamic_shared)

// --- the amdgcn builtins compat.h uses, with AMD's semantics --------------------------------
extern "C" {
extern char* rf_emu_dynamic_shared;
unsigned rf_emu_workitem_id(int dim);
unsigned rf_emu_workgroup_id(int dim);
void rf_emu_s_barrier();    // all work-items of the workgroup meet
void rf_emu_wave_barrier(); // all work-items of the wave meet
int rf_emu_ds_bpermute(int byte_address, int value);  // the whole wave meets and exchanges
unsigned long long rf_emu_memrealtime();              // the 100 MHz real-time counter
unsigned long long rf_emu_sendmsg_rtnl(int message);  // only MSG_RTN_GET_REALTIME (0x83)
void rf_emu_sleep(int units);                         // lets the other work-items run
void rf_emu_fence(int order, const char* scope);      // checks the scope; orders nothing
}
// Every shared-memory access compat.h's helpers make (rf_lds_read, rf_lds_load16, ...): the
// runtime records them while a trace is on (emulator.py: Emulator.lds_trace).
extern "C" void rf_emu_lds_access(const void* address, int bytes, int write);
#define RF_LDS_TRACE(p, bytes, write) rf_emu_lds_access(p, bytes, write)
#define __builtin_amdgcn_workitem_id_x() rf_emu_workitem_id(0)
#define __builtin_amdgcn_workitem_id_y() rf_emu_workitem_id(1)
#define __builtin_amdgcn_workitem_id_z() rf_emu_workitem_id(2)
#define __builtin_amdgcn_workgroup_id_x() rf_emu_workgroup_id(0)
#define __builtin_amdgcn_workgroup_id_y() rf_emu_workgroup_id(1)
#define __builtin_amdgcn_workgroup_id_z() rf_emu_workgroup_id(2)
#define __builtin_amdgcn_s_barrier() rf_emu_s_barrier()
#define __builtin_amdgcn_wave_barrier() rf_emu_wave_barrier()
#define __builtin_amdgcn_ds_bpermute(address, value) rf_emu_ds_bpermute(address, value)
#define __builtin_amdgcn_s_memrealtime() rf_emu_memrealtime()
#define __builtin_amdgcn_s_sendmsg_rtnl(message) rf_emu_sendmsg_rtnl(message)
#define __builtin_amdgcn_s_sleep(units) rf_emu_sleep(units)
#define __builtin_amdgcn_fence(order, scope) rf_emu_fence(order, scope)
// Cross-lane moves compat.h makes with constant patterns: each lane computes its source lane
// and the wave meets at this very call, as for ds_bpermute (so divergence is diagnosed alike).
extern "C" {
int rf_emu_dpp_source(int dpp_ctrl, int row_mask, int bank_mask, int bound_ctrl);
int rf_emu_swizzle_source(int pattern);
// One matrix instruction of the wave: `op` (MATRIX_* below), this lane's operands as floats
// (a, b: 4 each for MFMA, 16 for WMMA; c: 4 or 8) and its result d. The whole wave meets.
void rf_emu_matrix(int op, const float* a, const float* b, const float* c, float* d);
}
#define __builtin_amdgcn_mov_dpp(src, ctrl, row_mask, bank_mask, bound_ctrl) \
  rf_emu_ds_bpermute(rf_emu_dpp_source(ctrl, row_mask, bank_mask, bound_ctrl) << 2, src)
#define __builtin_amdgcn_ds_swizzle(src, pattern) \
  rf_emu_ds_bpermute(rf_emu_swizzle_source(pattern) << 2, src)
// Scoped atomics: workgroups run one at a time here, so every scope is the same.
#define __HIP_MEMORY_SCOPE_AGENT 4
#define __hip_atomic_fetch_add(p, v, order, scope) __atomic_fetch_add(p, v, order)

namespace rf_emu {
enum { MATRIX_MFMA_16x16x16 = 0, MATRIX_WMMA_16x16x16 = 1 };

inline float element_to_float(_Float16 x, bool) { return (float)x; }
inline float element_to_float(short x, bool bf16) {  // bfloat16 bits (or fp16 bits)
  if (bf16) return __builtin_bit_cast(float, (unsigned)(unsigned short)x << 16);
  return (float)__builtin_bit_cast(_Float16, x);
}

// D = A B + C of one matrix instruction: the operands' elements as floats, the wave meets.
template <int OP, bool BF16, int K, int N, class V, class C>
__attribute__((always_inline)) inline C matrix(V a, V b, C c) {
  float fa[K], fb[K], fc[N], fd[N];
  for (int i = 0; i < K; ++i) {
    fa[i] = element_to_float(a[i], BF16);
    fb[i] = element_to_float(b[i], BF16);
  }
  for (int i = 0; i < N; ++i) fc[i] = c[i];
  rf_emu_matrix(OP, fa, fb, fc, fd);
  for (int i = 0; i < N; ++i) c[i] = fd[i];
  return c;
}
}  // namespace rf_emu
#define __builtin_amdgcn_mfma_f32_16x16x16f16(a, b, c, cbsz, abid, blgp) \
  rf_emu::matrix<rf_emu::MATRIX_MFMA_16x16x16, false, 4, 4>(a, b, c)
#define __builtin_amdgcn_mfma_f32_16x16x16bf16_1k(a, b, c, cbsz, abid, blgp) \
  rf_emu::matrix<rf_emu::MATRIX_MFMA_16x16x16, true, 4, 4>(a, b, c)
#define __builtin_amdgcn_wmma_f32_16x16x16_f16_w32(a, b, c) \
  rf_emu::matrix<rf_emu::MATRIX_WMMA_16x16x16, false, 16, 8>(a, b, c)
#define __builtin_amdgcn_wmma_f32_16x16x16_bf16_w32(a, b, c) \
  rf_emu::matrix<rf_emu::MATRIX_WMMA_16x16x16, true, 16, 8>(a, b, c)

// --- the launcher ---------------------------------------------------------------------------
namespace rf_emu {

// One character per parameter type: 'p' pointer, 'f'/'d' float/double, struct codes for
// integers ('i' int32, 'Q' uint64, ...), '?' a type a kernelParams slot cannot carry.
template <class T>
constexpr char code() {
  if constexpr (std::is_pointer_v<T>) return 'p';
  else if constexpr (std::is_same_v<T, float>) return 'f';
  else if constexpr (std::is_same_v<T, double>) return 'd';
  else if constexpr (std::is_integral_v<T> && !std::is_same_v<T, bool>)
    return "bhiq"[sizeof(T) == 1 ? 0 : sizeof(T) == 2 ? 1 : sizeof(T) == 4 ? 2 : 3] -
           (std::is_unsigned_v<T> ? 'a' - 'A' : 0);
  else return '?';
}

template <class... A>
struct signature_of {
  static constexpr char text[] = {code<A>()..., '\0'};
};

template <class... A, std::size_t... I>
void call(void (*kernel)(A...), void** params, std::index_sequence<I...>) {
  kernel(*static_cast<std::remove_cv_t<A>*>(params[I])...);
}

// Calls `kernel` with its arguments read from `params` (cuLaunchKernel's kernelParams: one
// pointer per argument, to a value of exactly the parameter's type).
template <class... A>
void launch(void (*kernel)(A...), void** params) {
  call(kernel, params, std::index_sequence_for<A...>{});
}

template <class... A>
constexpr const char* signature(void (*)(A...)) { return signature_of<A...>::text; }

template <auto kernel>
void launcher(void** params) { launch(kernel, params); }

// One kernel of the generated table: name, launcher, RF_KERNEL's thread bound, signature.
struct Entry {
  const char* name;
  void (*launch)(void** params);
  unsigned max_threads;
  const char* signature;
};

}  // namespace rf_emu

// The generated file defines the table, ending with an entry whose name is null.
extern "C" const rf_emu::Entry* rf_emu_table();
