// Tiny kernels that prove the runtime, loader and launch path on a device.
#include "compat.h"

// x[i] = value for i < n.
RF_KERNEL(256) rf_fill_f32(float* x, float value, rf_u64 n) {
  rf_u64 i = (rf_u64)rf_bid_x() * 256u + rf_tid();
  if (i < n) x[i] = value;
}

// y[i] = a * x[i] for i < n.
RF_KERNEL(256) rf_scale_f32(float* y, const float* x, float a, rf_u64 n) {
  rf_u64 i = (rf_u64)rf_bid_x() * 256u + rf_tid();
  if (i < n) y[i] = a * x[i];
}

// Keeps the device busy for `ns` nanoseconds: queued ahead of a timed region, it lets the
// host enqueue the whole region before the device reaches it, so events time device work
// and not the host's launch overhead.
RF_KERNEL(32) rf_hold_ns(rf_u64 ns) {
  const rf_u64 start = rf_clock_ns();
  while (rf_clock_ns() - start < ns) rf_nap();
}

// Reads `n16` 16-byte chunks of `x` (grid-stride, `stride` = total threads, four loads in
// flight per thread) and folds them into one word that is stored only if it equals `never`:
// the loads cannot be optimised away, and nothing is written. The read-only bandwidth
// reference of the bench.
RF_KERNEL(256) rf_read_bytes(const rf_vec16* x, rf_u64 n16, rf_u64 stride, unsigned never,
                             unsigned* sink) {
  unsigned acc = 0;
  rf_u64 i = (rf_u64)rf_bid_x() * 256u + rf_tid();
  for (; i + 3 * stride < n16; i += 4 * stride) {
    const rf_vec16 a = x[i], b = x[i + stride], c = x[i + 2 * stride], d = x[i + 3 * stride];
    acc ^= a.x ^ a.y ^ a.z ^ a.w ^ b.x ^ b.y ^ b.z ^ b.w ^ c.x ^ c.y ^ c.z ^ c.w ^ d.x ^ d.y ^
           d.z ^ d.w;
  }
  for (; i < n16; i += stride) acc ^= x[i].x ^ x[i].y ^ x[i].z ^ x[i].w;
  if (acc == never) *sink = acc;
}

// The matrix units' rate: each warp runs `iters` rounds of 8 independent 16x16x16 (NVIDIA:
// two m16n8k16) 16-bit products on register operands, nothing from memory, and stores a sum
// only if it equals `never`. FLOPs: grid x 4 warps x iters x 8 x 8192. The ceiling of the
// bench's multi-token rows (the dense matrix rate measured in the same run).
RF_KERNEL(4 * RF_WARP) rf_matrix_rate_bf16(int iters, float never, float* sink) {
  float acc = 0.f;
#if defined(RF_HAVE_MMA)
  const unsigned a[4] = {rf_tid() * 0x00010001u, 0x3f803f80u, rf_bid_x(), 0x3c003c00u};
  const unsigned b[2] = {0x3f803f80u, rf_tid()};
  float d[8][4] = {};
  for (int i = 0; i < iters; ++i)
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      rf_mma16816<2>(d[j], a, b);
      rf_mma16816<2>(d[j], a, b);
    }
#pragma unroll
  for (int j = 0; j < 8; ++j) acc += d[j][0] + d[j][1] + d[j][2] + d[j][3];
#elif defined(RF_HAVE_MFMA)
  const rf_u64 a = 0x3f803f803f803f80ull ^ rf_tid(), b = 0x3f803f803f803f80ull ^ rf_bid_x();
  float c[8][4] = {};
  for (int i = 0; i < iters; ++i)
#pragma unroll
    for (int j = 0; j < 8; ++j) rf_mfma16<2>(c[j], a, b);
#pragma unroll
  for (int j = 0; j < 8; ++j) acc += c[j][0] + c[j][1] + c[j][2] + c[j][3];
#elif defined(RF_HAVE_WMMA)
  rf_u32x8 a, b;
  for (int k = 0; k < 8; ++k) {
    a.u[k] = 0x3f803f80u ^ rf_tid();
    b.u[k] = 0x3f803f80u ^ rf_bid_x();
  }
  float c[8][8] = {};
  for (int i = 0; i < iters; ++i)
#pragma unroll
    for (int j = 0; j < 8; ++j) rf_wmma16<2>(c[j], a, b);
#pragma unroll
  for (int j = 0; j < 8; ++j) acc += c[j][0] + c[j][7];
#endif
  if (acc == never) *sink = acc;
}
