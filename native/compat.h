// rocmforge_raw portable kernel layer: one source for nvcc/NVRTC (NVIDIA) and clang/hipcc/hiprtc
// (AMD, wave64 and wave32). The AMD side uses amdgcn builtins only, so it builds with
// -nogpulib -nogpuinc (no ROCm device libraries or HIP headers needed).
#pragma once

#if defined(__CUDACC__) || defined(__CUDACC_RTC__)
#define RF_NVIDIA 1
#define RF_KERNEL(threads) extern "C" __global__ void __launch_bounds__(threads)
// ... and asks the compiler to fit `blocks` blocks per multiprocessor (caps registers).
#define RF_KERNEL_OCCUPANCY(threads, blocks) \
  extern "C" __global__ void __launch_bounds__(threads, blocks)
#define RF_DEVICE __device__ __forceinline__
#define RF_SHARED __shared__
#define RF_WARP 32
RF_DEVICE unsigned rf_tid() { return threadIdx.x; }
RF_DEVICE unsigned rf_bid_x() { return blockIdx.x; }
RF_DEVICE unsigned rf_bid_y() { return blockIdx.y; }
RF_DEVICE unsigned rf_bid_z() { return blockIdx.z; }
RF_DEVICE void rf_sync() { __syncthreads(); }
RF_DEVICE void rf_syncwarp() { __syncwarp(); }
RF_DEVICE float rf_shfl_xor(float v, int mask) { return __shfl_xor_sync(0xffffffffu, v, mask); }
template <int MASK>
RF_DEVICE float rf_shfl_xor_c(float v) { return __shfl_xor_sync(0xffffffffu, v, MASK); }
// whether p holds in any lane of the warp (every lane calls)
RF_DEVICE bool rf_warp_any(bool p) { return __any_sync(0xffffffffu, p); }
RF_DEVICE void rf_sched_fence() {}   // AMD's register-pressure controls: not needed here
RF_DEVICE int rf_uniform(int x) { return x; }
RF_DEVICE void rf_opaque(int& x) { asm volatile("" : "+r"(x)); }  // as on AMD (below)
RF_DEVICE float rf_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
RF_DEVICE float rf_half_to_float(unsigned short h) {
  float f; asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h)); return f;
}
RF_DEVICE unsigned short rf_float_to_half(float f) {
  unsigned short h; asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f)); return h;
}
typedef unsigned long long rf_u64;
typedef long long rf_i64;
// 16-byte global -> shared copies that complete asynchronously (sm_80+: cp.async), in groups.
// The 32-bit shared-memory address of a generic pointer into shared memory.
RF_DEVICE unsigned rf_smem_addr(const void* smem) {
  unsigned addr;
  asm volatile("{ .reg .u64 a; cvta.to.shared.u64 a, %1; cvt.u32.u64 %0, a; }"
               : "=r"(addr) : "l"(smem));
  return addr;
}
// .cg: through L2 only; L2::128B: L2 fetches the whole 128-byte line of each request (the
// rows are read whole: H100, native/NOTES.md v24, 1-3 % faster than without; RF_COPY_CA
// caches in L1 too, RF_COPY_NO_L2_PREFETCH drops the hint, RF_COPY_EVICT_FIRST drops it for
// an L2 evict-first policy, for A/B).
RF_DEVICE void rf_copy16_async(void* smem, const void* gmem) {
#if defined(RF_COPY_CA)
  asm volatile("cp.async.ca.shared.global [%0], [%1], 16;" ::"r"(rf_smem_addr(smem)),
               "l"(gmem) : "memory");
#elif defined(RF_COPY_NO_L2_PREFETCH)
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(rf_smem_addr(smem)),
               "l"(gmem) : "memory");
#elif defined(RF_COPY_EVICT_FIRST)
  rf_u64 policy;
  asm("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
  asm volatile("cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, %2;"
               ::"r"(rf_smem_addr(smem)), "l"(gmem), "l"(policy) : "memory");
#else
  asm volatile("cp.async.cg.shared.global.L2::128B [%0], [%1], 16;" ::"r"(rf_smem_addr(smem)),
               "l"(gmem) : "memory");
#endif
}
// The shared-window address of `smem` as plain arithmetic the compiler folds and hoists
// (rf_smem_addr's asm is repeated at each use): for address math in hot loops.
RF_DEVICE unsigned rf_smem_u32(const void* smem) {
  return (unsigned)__cvta_generic_to_shared(smem);
}
// 16 bytes from `gmem` to the shared-window address `smem` as rf_copy16_async, or 16 zero
// bytes where `valid` is false (src-size 0: nothing is read, `gmem` need only be a global
// address).
RF_DEVICE void rf_copy16_async_zfill(unsigned smem, const void* gmem, bool valid) {
  asm volatile("cp.async.cg.shared.global.L2::128B [%0], [%1], 16, %2;" ::"r"(smem), "l"(gmem),
               "r"(valid ? 16 : 0) : "memory");
}
RF_DEVICE void rf_copy_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
// Wait until at most `pending` committed groups are still in flight.
template <int pending>
RF_DEVICE void rf_copy_wait() { asm volatile("cp.async.wait_group %0;" ::"n"(pending) : "memory"); }
// A device clock in nanoseconds (the global timer: one time base for every multiprocessor).
RF_DEVICE rf_u64 rf_clock_ns() {
  rf_u64 t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
RF_DEVICE void rf_nap() { __nanosleep(1000); }
// The dynamic shared memory this launch was given (bytes).
RF_DEVICE unsigned rf_dynamic_smem_bytes() {
  unsigned n;
  asm volatile("mov.u32 %0, %%dynamic_smem_size;" : "=r"(n));
  return n;
}
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900 && defined(RF_USE_BULK)
// sm_90 bulk copies (the copy engine) into shared memory, completing on an mbarrier: one
// per 256-byte row costs the copy unit more than cp.async's 16-byte copies cost the LSU
// (H100, native/NOTES.md v24: a no-math stream of S1's pages at 90 % of read, against 94 %),
// so every NVIDIA target builds the cp.async path unless RF_USE_BULK asks for this one (A/B).
#define RF_HAVE_BULK 1
// One arrival (the expect_tx) per phase; makes the barrier visible to the copy engine.
RF_DEVICE void rf_mbar_init(rf_u64* bar) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;\n\tfence.mbarrier_init.release.cluster;"
               ::"r"(rf_smem_addr(bar)) : "memory");
}
// Arrives on `bar` and makes its current phase also wait for `bytes` of bulk copies.
RF_DEVICE void rf_mbar_expect_tx(rf_u64* bar, unsigned bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;"
               ::"r"(rf_smem_addr(bar)), "r"(bytes) : "memory");
}
// Waits until the phase with parity `phase` of `bar` has completed.
RF_DEVICE void rf_mbar_wait(rf_u64* bar, unsigned phase) {
  asm volatile("{\n\t.reg .pred done;\n\tRF_WAIT_%=:\n\t"
               "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n\t"
               "@!done bra RF_WAIT_%=;\n\t}" ::"r"(rf_smem_addr(bar)), "r"(phase) : "memory");
}
// Copies `bytes` (a multiple of 16, both ends 16-byte aligned) from `gmem` to `smem`.
// The rows stream through L2 once (evict first: 0-5 % faster on H200's bench shapes than the
// default policy, NOTES v23); the policy's asm is not volatile, so copies may share it.
RF_DEVICE void rf_bulk_copy(void* smem, const void* gmem, unsigned bytes, rf_u64* bar) {
  rf_u64 policy;
  asm("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint "
               "[%0], [%1], %2, [%3], %4;" ::"r"(rf_smem_addr(smem)), "l"(gmem), "r"(bytes),
               "r"(rf_smem_addr(bar)), "l"(policy) : "memory");
}
RF_DEVICE unsigned rf_warp_sum_u32(unsigned v) { return __reduce_add_sync(0xffffffffu, v); }
// Orders this thread's earlier generic-proxy accesses to shared memory before later bulk
// copies (the async proxy) into the same bytes.
RF_DEVICE void rf_fence_proxy_async() {
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}
#else
RF_DEVICE void rf_fence_proxy_async() {}  // cp.async and plain copies: one proxy
#endif
// Device-scope ordering between CTAs: writes, a CTA barrier, one thread's fence (cumulative:
// it orders what the barrier ordered before it), a relaxed counter; the CTA that reads the
// last count fences too before a barrier, and its plain loads then see the others' writes
// (the fences synchronise through the counter; sm_70+'s fence also invalidates the SM's L1).
RF_DEVICE void rf_fence_device() { __threadfence(); }
// Each thread's part of such a release made by one thread after a CTA barrier: none (the
// fence is cumulative over what the barrier ordered before it).
RF_DEVICE void rf_fence_device_before_barrier() {}
RF_DEVICE int rf_atomic_add_device(int* p, int v) { return atomicAdd(p, v); }
#define RF_DYNAMIC_SHARED(type, name) extern __shared__ __align__(16) type name[]
// +infinity from its bits: NVRTC has no __builtin_inff (nvcc takes it from the host compiler).
#define RF_INF __int_as_float(0x7f800000)
#define RF_HAVE_MMA 1
RF_DEVICE float rf_shfl(float v, int src) { return __shfl_sync(0xffffffffu, v, src); }
RF_DEVICE int rf_shfl_int(int v, int src) { return __shfl_sync(0xffffffffu, v, src); }
// Four 8x8 tiles of 16-bit values from shared memory (transposed with TRANS); lane i gives
// the address of row i % 8 of tile i / 8.
// rf_ldmatrix_x4_at: the same from a shared-window address (rf_smem_u32).
template <bool TRANS>
RF_DEVICE void rf_ldmatrix_x4_at(unsigned (&r)[4], unsigned row_addr) {
  if (TRANS)
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(row_addr));
  else
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(row_addr));
}
template <bool TRANS>
RF_DEVICE void rf_ldmatrix_x4(unsigned (&r)[4], const void* smem_row) {
  rf_ldmatrix_x4_at<TRANS>(r, rf_smem_addr(smem_row));
}
// d += a (16x16, row-major) * b (16x8, column-major), float32 accumulate; KIND 1 = fp16,
// 2 = bf16 inputs.
template <int KIND>
RF_DEVICE void rf_mma16816(float (&d)[4], const unsigned (&a)[4], const unsigned (&b)[2]) {
  if (KIND == 2)
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, "
                 "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  else
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, "
                 "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

#elif defined(__HIP__) || defined(__HIPCC_RTC__) || defined(__AMDGCN__) || \
    defined(RF_AMD_EMULATION)
#define RF_AMD 1
// Target attributes (these four and RF_DYNAMIC_SHARED): under RF_AMD_EMULATION the CPU
// emulation's header (tests/amd_emu/rf_amd_emu.h) defines host versions; the rest is verbatim.
#ifndef RF_AMD_EMULATION
#define RF_KERNEL(threads) \
  extern "C" __attribute__((global, amdgpu_flat_work_group_size(1, threads))) void
#define RF_KERNEL_OCCUPANCY(threads, blocks) RF_KERNEL(threads)
#define RF_DEVICE __attribute__((device)) inline __attribute__((always_inline))
#define RF_SHARED __attribute__((shared))
#endif
// The wavefront size the code is built for: the compiler's macro (newer compilers deprecate
// the unsuffixed one), or RF_WAVE_SIZE given by the build. Guessing is never safe: lane
// arithmetic built for 64 lanes computes wrong results on a wave32 target.
#if defined(__AMDGCN_WAVEFRONT_SIZE__)
#define RF_WARP __AMDGCN_WAVEFRONT_SIZE__
#elif defined(__AMDGCN_WAVEFRONT_SIZE)
#define RF_WARP __AMDGCN_WAVEFRONT_SIZE
#elif defined(RF_WAVE_SIZE)
#define RF_WARP RF_WAVE_SIZE
#else
#error "compat.h: unknown wavefront size (no __AMDGCN_WAVEFRONT_SIZE__): build with -DRF_WAVE_SIZE=64 or 32"
#endif
#if defined(RF_WAVE_SIZE) && RF_WAVE_SIZE != RF_WARP
#error "compat.h: RF_WAVE_SIZE differs from the compiler's wavefront size for this target"
#endif
#if RF_WARP != 64 && RF_WARP != 32
#error "compat.h: the wavefront size must be 64 or 32"
#endif
RF_DEVICE unsigned rf_tid() { return __builtin_amdgcn_workitem_id_x(); }
RF_DEVICE unsigned rf_bid_x() { return __builtin_amdgcn_workgroup_id_x(); }
RF_DEVICE unsigned rf_bid_y() { return __builtin_amdgcn_workgroup_id_y(); }
RF_DEVICE unsigned rf_bid_z() { return __builtin_amdgcn_workgroup_id_z(); }
RF_DEVICE void rf_sync() {
  __builtin_amdgcn_fence(__ATOMIC_RELEASE, "workgroup");
  __builtin_amdgcn_s_barrier();
  __builtin_amdgcn_fence(__ATOMIC_ACQUIRE, "workgroup");
}
RF_DEVICE void rf_syncwarp() {
  __builtin_amdgcn_fence(__ATOMIC_RELEASE, "wavefront");
  __builtin_amdgcn_wave_barrier();
  __builtin_amdgcn_fence(__ATOMIC_ACQUIRE, "wavefront");
}
RF_DEVICE float rf_shfl_xor(float v, int mask) {
  int lane = (int)(rf_tid() % RF_WARP);
  int bits = __builtin_amdgcn_ds_bpermute((lane ^ mask) << 2, __builtin_bit_cast(int, v));
  return __builtin_bit_cast(float, bits);
}
// The value of lane `lane ^ MASK`, by the cheapest cross-lane move that does it: DPP
// quad_perm for 1 and 2 (a VALU operand modifier), ds_swizzle's bit mode within 32 lanes for
// 4, 8 and 16 (no address register, no LDS access), ds_bpermute across the halves of a wave64.
template <int MASK>
RF_DEVICE float rf_shfl_xor_c(float v) {
  const int bits = __builtin_bit_cast(int, v);
  if constexpr (MASK == 1) {
    return __builtin_bit_cast(float, __builtin_amdgcn_mov_dpp(bits, 0xB1, 0xF, 0xF, false));
  } else if constexpr (MASK == 2) {
    return __builtin_bit_cast(float, __builtin_amdgcn_mov_dpp(bits, 0x4E, 0xF, 0xF, false));
  } else if constexpr (MASK < 32) {  // and_mask 0x1F, or_mask 0, xor_mask MASK
    return __builtin_bit_cast(float, __builtin_amdgcn_ds_swizzle(bits, (MASK << 10) | 0x1F));
  } else {
    return rf_shfl_xor(v, MASK);
  }
}
RF_DEVICE float rf_exp2(float x) { return __builtin_exp2f(x); }
RF_DEVICE float rf_half_to_float(unsigned short h) {
  return (float)__builtin_bit_cast(_Float16, h);
}
RF_DEVICE unsigned short rf_float_to_half(float f) {
  return __builtin_bit_cast(unsigned short, (_Float16)f);
}
typedef unsigned long long rf_u64;
typedef long long rf_i64;
// No asynchronous copy on this path: the copy happens at once; commit and wait are no-ops.
struct alignas(16) rf_copy16_t { unsigned x, y, z, w; };
RF_DEVICE void rf_copy16_async(void* smem, const void* gmem) {
  *reinterpret_cast<rf_copy16_t*>(smem) = *reinterpret_cast<const rf_copy16_t*>(gmem);
}
RF_DEVICE void rf_copy_commit() {}
template <int pending>
RF_DEVICE void rf_copy_wait() {}
// The 100 MHz real-time counter in nanoseconds (a message on gfx11, an instruction before).
RF_DEVICE rf_u64 rf_clock_ns() {
#if defined(__GFX11__) || defined(__GFX12__)
  return __builtin_amdgcn_s_sendmsg_rtnl(0x83) * 10;  // MSG_RTN_GET_REALTIME
#else
  return __builtin_amdgcn_s_memrealtime() * 10;
#endif
}
RF_DEVICE void rf_nap() { __builtin_amdgcn_s_sleep(127); }
// The agent-scope fence also invalidates this CU's L1, so plain loads after it see other
// workgroups' published writes (after one thread's fence, the workgroup acquire of the
// barrier that follows invalidates the L0 of the other CU of a gfx11 WGP).
RF_DEVICE void rf_fence_device() { __builtin_amdgcn_fence(__ATOMIC_SEQ_CST, "agent"); }
// Each thread's part of a release made by one thread after a workgroup barrier: its own
// agent-scope fence, because the barrier as LLVM 19 builds it for gfx9 (and for gfx11 in CU
// mode) does not wait for the other waves' stores, and one wave's agent fence waits only
// for its own.
RF_DEVICE void rf_fence_device_before_barrier() { rf_fence_device(); }
RF_DEVICE int rf_atomic_add_device(int* p, int v) {  // agent scope: no system-wide traffic
  return __hip_atomic_fetch_add(p, v, __ATOMIC_RELAXED, __HIP_MEMORY_SCOPE_AGENT);
}
// Matrix cores. MFMA (gfx90a, gfx94x: v_mfma_f32_16x16x16{f16,bf16_1k}, a wave64 computes
// D[16x16] += A[16x16] B[16x16]): lane l holds A[l % 16][4 (l / 16) + i],
// B[4 (l / 16) + i][l % 16] and C/D[4 (l / 16) + i][l % 16], i = 0..3 (composable_kernel's
// mfma_type: 16 threads per block along M/N, 4 blocks along K, 4 consecutive k per lane).
// WMMA (gfx11, wave32: v_wmma_f32_16x16x16_{f16,bf16}): lanes l and l + 16 both hold
// A[l % 16][0..15] and B[0..15][l % 16]; C/D[2 i + l / 16][l % 16], i = 0..7 (the RDNA 3
// WMMA layout of AMD's GPUOpen notes).
#if defined(__gfx90a__) || defined(__gfx940__) || defined(__gfx941__) || defined(__gfx942__)
#define RF_HAVE_MFMA 1
#elif defined(__GFX11__) && RF_WARP == 32
#define RF_HAVE_WMMA 1
#endif
#if defined(RF_AMD_EMULATION)  // GCC vectors; the emulator's builtins take these
typedef _Float16 rf_half4v __attribute__((vector_size(8)));
typedef short rf_short4v __attribute__((vector_size(8)));
typedef float rf_float4v __attribute__((vector_size(16)));
typedef _Float16 rf_half16v __attribute__((vector_size(32)));
typedef short rf_short16v __attribute__((vector_size(32)));
typedef float rf_float8v __attribute__((vector_size(32)));
#else
typedef _Float16 rf_half4v __attribute__((ext_vector_type(4)));
typedef short rf_short4v __attribute__((ext_vector_type(4)));
typedef float rf_float4v __attribute__((ext_vector_type(4)));
typedef _Float16 rf_half16v __attribute__((ext_vector_type(16)));
typedef short rf_short16v __attribute__((ext_vector_type(16)));
typedef float rf_float8v __attribute__((ext_vector_type(8)));
#endif
struct rf_u32x8 { unsigned u[8]; };
#if defined(RF_HAVE_MFMA)
// c += a . b for one MFMA tile; a and b: 4 packed 16-bit values each (KIND 1 fp16, 2 bf16).
template <int KIND>
RF_DEVICE void rf_mfma16(float (&c)[4], rf_u64 a, rf_u64 b) {
  rf_float4v acc = {c[0], c[1], c[2], c[3]};
  if constexpr (KIND == 2)
    acc = __builtin_amdgcn_mfma_f32_16x16x16bf16_1k(__builtin_bit_cast(rf_short4v, a),
                                                     __builtin_bit_cast(rf_short4v, b), acc,
                                                     0, 0, 0);
  else
    acc = __builtin_amdgcn_mfma_f32_16x16x16f16(__builtin_bit_cast(rf_half4v, a),
                                                __builtin_bit_cast(rf_half4v, b), acc, 0, 0, 0);
  for (int i = 0; i < 4; ++i) c[i] = acc[i];
}
#endif
#if defined(RF_HAVE_WMMA)
// c += a . b for one WMMA tile; a and b: 16 packed 16-bit values each (KIND 1 fp16, 2 bf16).
template <int KIND>
RF_DEVICE void rf_wmma16(float (&c)[8], const rf_u32x8& a, const rf_u32x8& b) {
  rf_float8v acc = {c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]};
  if constexpr (KIND == 2)
    acc = __builtin_amdgcn_wmma_f32_16x16x16_bf16_w32(__builtin_bit_cast(rf_short16v, a),
                                                      __builtin_bit_cast(rf_short16v, b), acc);
  else
    acc = __builtin_amdgcn_wmma_f32_16x16x16_f16_w32(__builtin_bit_cast(rf_half16v, a),
                                                     __builtin_bit_cast(rf_half16v, b), acc);
  for (int i = 0; i < 8; ++i) c[i] = acc[i];
}
#endif
RF_DEVICE void rf_fence_proxy_async() {}  // no bulk copies: one proxy
// A scheduling fence: the compiler moves no instruction across it, which bounds how many
// values (hoisted loads) are live at once where registers are short.
#if !defined(RF_AMD_EMULATION) && __clang_major__ >= 15
RF_DEVICE void rf_sched_fence() { __builtin_amdgcn_sched_barrier(0); }
#else
RF_DEVICE void rf_sched_fence() {}
#endif
// x, which the compiler may no longer assume it knows: loads addressed through it stay where
// they are written (not hoisted out of a loop to hold their values in registers throughout).
// rf_depend: x (an address offset, 0) now waits for v, so loads addressed through it are
// issued after v is computed: a bound on how many operands are loaded ahead.
// rf_uniform: a value every lane of the wave holds alike, in a scalar register.
#if defined(RF_AMD_EMULATION)
RF_DEVICE void rf_opaque(int& x) { asm volatile("" : "+r"(x)); }
RF_DEVICE void rf_depend(int&, float) {}
RF_DEVICE int rf_uniform(int x) { return x; }
#else
RF_DEVICE void rf_opaque(int& x) { asm volatile("" : "+v"(x)); }
RF_DEVICE void rf_depend(int& x, float v) { asm volatile("" : "+v"(x) : "v"(v)); }
RF_DEVICE int rf_uniform(int x) { return __builtin_amdgcn_readfirstlane(x); }
#endif
#ifndef RF_AMD_EMULATION
#define RF_DYNAMIC_SHARED(type, name) extern __attribute__((shared)) type name[]
#endif
#define RF_INF __builtin_inff()

#else
#error "compat.h: compile with nvcc/NVRTC (NVIDIA) or clang/hipcc/hiprtc in HIP mode (AMD)"
#endif

RF_DEVICE float rf_fmax(float a, float b) { return a > b ? a : b; }
// A score soft-capped as Gemma 2 caps attention logits, cap * tanh(s / cap), for cap > 0 (0:
// s as it is), s and cap in the same units (the kernels' log2 units: both times log2 e).
// tanh from one exp2 (AMD has no tanh instruction and these objects link no device library):
// tanh |x| = (1 - t) / (1 + t), t = 2^(-2 |x| log2 e), and below |x| = 1/16, where 1 - t
// loses digits, its series x - x^3 / 3: both within about 2^-18 of tanh, relative.
RF_DEVICE float rf_softcap(float s, float cap) {
  if (!(cap > 0.f)) return s;
  const float x = s / cap, ax = x < 0.f ? -x : x;
  const float t = rf_exp2(-2.8853900817779268f * ax);
  const float th = ax < 0.0625f ? ax - ax * ax * ax * (1.f / 3.f) : (1.f - t) / (1.f + t);
  return cap * (x < 0.f ? -th : th);
}
// max(a, b) as IEEE maxNum (a NaN operand gives the other): one instruction on NVIDIA
// (FMNMX; rf_fmax's compare-and-select takes two), for values that are never NaN
#if defined(RF_NVIDIA)
RF_DEVICE float rf_fmaxnum(float a, float b) { return fmaxf(a, b); }
#else
RF_DEVICE float rf_fmaxnum(float a, float b) { return __builtin_fmaxf(a, b); }
#endif
// x rounded to an integer, halves to even
#if defined(RF_NVIDIA)
RF_DEVICE float rf_rint(float x) {
  float y;
  asm("cvt.rni.f32.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
#else
RF_DEVICE float rf_rint(float x) { return __builtin_rintf(x); }
#endif
RF_DEVICE float rf_bf16_to_float(unsigned short h) {
  return __builtin_bit_cast(float, ((unsigned)h) << 16);
}
RF_DEVICE unsigned short rf_float_to_bf16(float f) {  // round to nearest even, NaN kept quiet
  unsigned u = __builtin_bit_cast(unsigned, f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (unsigned short)((u >> 16) | 0x40u);
  return (unsigned short)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

// Two floats as two 16-bit values of KIND (1 fp16, 2 bf16), round to nearest even, ``lo`` in
// the low half: one cvt instruction on NVIDIA (sm_80+), the element conversions elsewhere.
template <int KIND>
RF_DEVICE unsigned rf_pack2(float lo, float hi) {
#if defined(RF_NVIDIA)
  unsigned r;
  if constexpr (KIND == 2) asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  else asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
#else
  if constexpr (KIND == 2) return rf_float_to_bf16(lo) | ((unsigned)rf_float_to_bf16(hi) << 16);
  else return rf_float_to_half(lo) | ((unsigned)rf_float_to_half(hi) << 16);
#endif
}

// The type A when C holds, else B (the standard library's conditional, which NVRTC and
// -nogpuinc builds lack).
template <bool C, class A, class B>
struct rf_pa_pick {
  typedef A type;
};
template <class A, class B>
struct rf_pa_pick<false, A, B> {
  typedef B type;
};

// Byte i of the result is byte (selector nibble i) of the 8 bytes x (0-3), y (4-7), as
// NVIDIA's prmt / __byte_perm: one instruction there, shifts elsewhere.
RF_DEVICE unsigned rf_byte_perm(unsigned x, unsigned y, unsigned selector) {
#if defined(RF_NVIDIA)
  return __byte_perm(x, y, selector);
#else
  const rf_u64 both = (rf_u64)y << 32 | x;
  unsigned r = 0;
  for (int i = 0; i < 4; ++i)
    r |= (unsigned)(both >> (8 * (selector >> (4 * i) & 7)) & 0xffu) << (8 * i);
  return r;
#endif
}

// 16 bytes, the width of one vector load/store.
struct alignas(16) rf_vec16 { unsigned x, y, z, w; };
struct alignas(16) rf_float4 { float x, y, z, w; };

// 16 bytes of shared memory at p, 16-byte aligned (one ds_read_b128 / ld.shared.v4), or only
// 8-byte aligned (_a8: two 8-byte accesses; AMD's matrix-path rows are padded by 8 bytes).
// RF_LDS_TRACE(p, bytes, write) sees each access: nothing on a GPU; the CPU emulation
// (tests/amd_emu) records them to check the layouts for bank conflicts.
#ifndef RF_LDS_TRACE
#define RF_LDS_TRACE(p, bytes, write) ((void)0)
#endif
template <class T>
RF_DEVICE T rf_lds_read(const void* p) {
  RF_LDS_TRACE(p, sizeof(T), 0);
  return *static_cast<const T*>(p);
}
RF_DEVICE rf_vec16 rf_lds_load16(const void* p) { return rf_lds_read<rf_vec16>(p); }
RF_DEVICE void rf_lds_store16(void* p, const rf_vec16& v) {
  RF_LDS_TRACE(p, 16, 1);
  *static_cast<rf_vec16*>(p) = v;
}
RF_DEVICE rf_vec16 rf_lds_load16_a8(const void* p) {
  RF_LDS_TRACE(p, 16, 0);
  const rf_u64 lo = static_cast<const rf_u64*>(p)[0], hi = static_cast<const rf_u64*>(p)[1];
  return rf_vec16{(unsigned)lo, (unsigned)(lo >> 32), (unsigned)hi, (unsigned)(hi >> 32)};
}
RF_DEVICE void rf_lds_store16_a8(void* p, const rf_vec16& v) {
  RF_LDS_TRACE(p, 16, 1);
  static_cast<rf_u64*>(p)[0] = v.x | (rf_u64)v.y << 32;
  static_cast<rf_u64*>(p)[1] = v.z | (rf_u64)v.w << 32;
}

// Element types: `storage` is what the cache holds; PER_VEC elements fit in one rf_vec16.
struct rf_f32 {
  typedef float storage;
  static constexpr int PER_VEC = 4;
  static constexpr int TENSOR_KIND = 0;  // no 16-bit tensor-core path
  RF_DEVICE static void unpack(const rf_vec16& v, float* out) {
    out[0] = __builtin_bit_cast(float, v.x); out[1] = __builtin_bit_cast(float, v.y);
    out[2] = __builtin_bit_cast(float, v.z); out[3] = __builtin_bit_cast(float, v.w);
  }
  RF_DEVICE static storage from_float(float f) { return f; }
  RF_DEVICE static float to_float(storage s) { return s; }
};

template <float (*CONVERT)(unsigned short), unsigned short (*BACK)(float), int KIND>
struct rf_16bit {
  typedef unsigned short storage;
  static constexpr int PER_VEC = 8;
  static constexpr int TENSOR_KIND = KIND;  // 1 = fp16, 2 = bf16 (rf_mma16816)
  RF_DEVICE static void unpack(const rf_vec16& v, float* out) {
    const unsigned words[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      out[2 * i] = CONVERT((unsigned short)(words[i] & 0xffffu));
      out[2 * i + 1] = CONVERT((unsigned short)(words[i] >> 16));
    }
  }
  RF_DEVICE static storage from_float(float f) { return BACK(f); }
  RF_DEVICE static float to_float(storage s) { return CONVERT(s); }
};
typedef rf_16bit<rf_half_to_float, rf_float_to_half, 1> rf_f16;
typedef rf_16bit<rf_bf16_to_float, rf_float_to_bf16, 2> rf_bf16;

// fp8 e4m3, the 8-bit KV-cache format (the cache only: queries, outputs and the arithmetic
// stay 16-bit or wider). Codes are read as e4m3 with exponent bias 7 and every code finite
// (0x7F = 480: e4m3fn never stores it, its NaN; e4m3fnuz, bias 8, reads as twice its value,
// a factor the host folds into the scales with the layer's). `widen` turns 8 codes into 8
// elements of the 16-bit type E exactly, by moving bits: the fp16 whose sign, exponent and
// mantissa fields are the code's is its value / 256 (subnormal codes land on fp16
// subnormals), and every such value is a bf16 too. So the stage holds value / 256.
struct rf_e4m3 {
  typedef unsigned char storage;
  // codes in bytes 0 and 1 of b -> the two fp16 halves of a word
  RF_DEVICE static unsigned half2(unsigned b) {
    const unsigned spread = (b & 0xffu) | ((b & 0xff00u) << 8);  // byte i at bit 16 i
    return ((spread & 0x00800080u) << 8) | ((spread & 0x007f007fu) << 7);
  }
  template <class E>
  RF_DEVICE static unsigned pair(unsigned b) {  // two codes -> two elements of E
    const unsigned h = half2(b);
    if constexpr (E::TENSOR_KIND == 1) {
      return h;
    } else {
      static_assert(E::TENSOR_KIND == 2, "fp8 caches widen to fp16 or bf16");
      const unsigned lo = __builtin_bit_cast(unsigned, rf_half_to_float(h & 0xffffu));
      const unsigned hi = __builtin_bit_cast(unsigned, rf_half_to_float(h >> 16));
      return (lo >> 16) | (hi & 0xffff0000u);  // exact: at most 4 significant bits
    }
  }
  // 8 codes (two words) -> 8 elements of E (16 bytes)
  template <class E>
  RF_DEVICE static rf_vec16 widen(unsigned w0, unsigned w1) {
    return rf_vec16{pair<E>(w0), pair<E>(w0 >> 16), pair<E>(w1), pair<E>(w1 >> 16)};
  }
  // A stage of codes (NVIDIA's fp8 instances copy the codes as they are and widen them in
  // registers, pa_math.h): a 16-byte chunk holds PER_VEC codes; `unpack` gives their values
  // / 256 as floats (the CUDA-core path).
  static constexpr int PER_VEC = 16;
  RF_DEVICE static void unpack(const rf_vec16& v, float* out) {
    const unsigned words[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const unsigned two = half2(words[i] >> (16 * h));
        out[4 * i + 2 * h] = rf_half_to_float((unsigned short)(two & 0xffffu));
        out[4 * i + 2 * h + 1] = rf_half_to_float((unsigned short)(two >> 16));
      }
  }
  // Two codes in bytes 1 and 3 of y (bytes 0 and 2 zero: rf_byte_perm places them) -> the two
  // 16-bit halves of a word of E's bits by moving fields (the tensor-core path): fp16 holds
  // value / 256 as `pair` does; bf16 holds value * 2^-120 (bf16's exponent bias is 127, the
  // code's 7; subnormal codes land on bf16 subnormals), which BF16_UNIT brings back to value
  // / 256. Three integer operations, no conversion.
  static constexpr float BF16_UNIT = 5.192296858534828e33f;  // 2^112
  template <class E>
  RF_DEVICE static unsigned moved(unsigned y) {
    if constexpr (E::TENSOR_KIND == 1) return ((y >> 1) & 0x3f803f80u) | (y & 0x80008000u);
    else return ((y >> 4) & 0x07f007f0u) | (y & 0x80008000u);
  }
};

// Sum or max over the lanes whose indices differ in the bits [FIRST, LAST) of the lane
// index (FIRST, LAST powers of two): a butterfly of constant-mask shuffles; every lane of
// such a group gets the result.
template <int FIRST, int LAST>
RF_DEVICE float rf_xor_sum(float v) {
  if constexpr (FIRST < LAST) return rf_xor_sum<FIRST * 2, LAST>(v + rf_shfl_xor_c<FIRST>(v));
  else return v;
}
template <int FIRST, int LAST>
RF_DEVICE float rf_xor_max(float v) {
  if constexpr (FIRST < LAST)
    return rf_xor_max<FIRST * 2, LAST>(rf_fmax(v, rf_shfl_xor_c<FIRST>(v)));
  else return v;
}
// Sum or max over one warp/wavefront; every lane gets the result.
RF_DEVICE float rf_warp_sum(float v) { return rf_xor_sum<1, RF_WARP>(v); }
RF_DEVICE float rf_warp_max(float v) { return rf_xor_max<1, RF_WARP>(v); }
