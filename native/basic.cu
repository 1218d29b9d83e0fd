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
