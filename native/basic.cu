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
