// KV-cache writes and block copies. Both move whole 16-byte vectors: every row of
// head_dim elements is a multiple of 16 bytes for the supported dtypes and head sizes.
#include "compat.h"

#define RF_CO_THREADS 256

// Writes the K and V rows of new tokens into the paged cache.
// key/value [num_tokens, num_kv_heads, head_dim]; k_cache/v_cache
// [num_blocks, num_kv_heads, block_size, head_dim]; slot_mapping int64 [num_tokens] with
// slot = block_id * block_size + offset, and -1 meaning "skip this token".
// Grid (num_tokens); row_vecs = head_dim * itemsize / 16.
RF_KERNEL(RF_CO_THREADS) rf_reshape_and_cache(
    rf_vec16* __restrict__ k_cache, rf_vec16* __restrict__ v_cache,
    const rf_vec16* __restrict__ key, const rf_vec16* __restrict__ value,
    const rf_i64* __restrict__ slot_mapping, int num_kv_heads, int block_size, int row_vecs) {
  const rf_i64 token = rf_bid_x();
  const rf_i64 slot = slot_mapping[token];
  if (slot < 0) return;
  const rf_i64 block = slot / block_size, offset = slot % block_size;
  const int token_vecs = num_kv_heads * row_vecs;
  for (int i = (int)rf_tid(); i < token_vecs; i += RF_CO_THREADS) {
    const int head = i / row_vecs, c = i % row_vecs;
    const rf_i64 dst = ((block * num_kv_heads + head) * block_size + offset) * row_vecs + c;
    k_cache[dst] = key[token * token_vecs + i];
    v_cache[dst] = value[token * token_vecs + i];
  }
}

// fp8 e4m3 code of x * inv_scale (fp32 arithmetic), saturated and rounded to nearest even:
// e4m3fn (fnuz = 0) saturates at 448 and keeps the sign of zero; e4m3fnuz (fnuz = 1, bias 8)
// is encoded as the bias-7 code of twice the value (exact), saturates at 240 (code 0x7F) and
// has one zero. NaN stays NaN (0x7F fn, 0x80 fnuz). As ml_dtypes casts a clipped float32.
RF_DEVICE unsigned rf_to_e4m3(float x, float inv_scale, int fnuz) {
  float v = x * inv_scale;
  if (fnuz) v *= 2.f;
  const unsigned bits = __builtin_bit_cast(unsigned, v);
  const unsigned sign = (bits >> 24) & 0x80u;
  if (v != v) return fnuz ? 0x80u : 0x7fu;
  float a = __builtin_bit_cast(float, bits & 0x7fffffffu);
  const float limit = fnuz ? 480.f : 448.f;
  a = a < limit ? a : limit;
  unsigned code;
  if (a < 0.015625f) {  // below 2^-6: subnormal codes, in steps of 2^-9
    code = (unsigned)rf_rint(a * 512.f);
  } else {              // 3 mantissa bits, rounded to nearest even, then the bias moved
    unsigned u = __builtin_bit_cast(unsigned, a);
    u += 0x7ffffu + ((u >> 20) & 1u);
    code = (u >> 20) - (120u << 3);
  }
  return fnuz && code == 0 ? 0u : code | sign;
}

// reshape_and_cache into an fp8 cache: K/V of E (fp16/bf16) quantized with the layer's
// inverse scales. k_cache/v_cache hold codes, [num_blocks, num_kv_heads, block_size,
// head_dim] bytes; row_vecs = head_dim / 8 (8 elements in, 8 codes out per thread step).
template <class E>
RF_DEVICE void rf_write_e4m3(rf_u64* __restrict__ k_cache, rf_u64* __restrict__ v_cache,
                             const rf_vec16* __restrict__ key,
                             const rf_vec16* __restrict__ value,
                             const rf_i64* __restrict__ slot_mapping, int num_kv_heads,
                             int block_size, int row_vecs, float k_inv, float v_inv,
                             int fnuz) {
  const rf_i64 token = rf_bid_x();
  const rf_i64 slot = slot_mapping[token];
  if (slot < 0) return;
  const rf_i64 block = slot / block_size, offset = slot % block_size;
  const int token_vecs = num_kv_heads * row_vecs;
  auto codes = [&](const rf_vec16& x, float inv) {
    const unsigned words[4] = {x.x, x.y, x.z, x.w};
    rf_u64 out = 0;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const unsigned short e = (unsigned short)(words[i / 2] >> (16 * (i % 2)));
      out |= (rf_u64)rf_to_e4m3(E::to_float(e), inv, fnuz) << (8 * i);
    }
    return out;
  };
  for (int i = (int)rf_tid(); i < token_vecs; i += RF_CO_THREADS) {
    const int head = i / row_vecs, c = i % row_vecs;
    const rf_i64 dst = ((block * num_kv_heads + head) * block_size + offset) * row_vecs + c;
    k_cache[dst] = codes(key[token * token_vecs + i], k_inv);
    v_cache[dst] = codes(value[token * token_vecs + i], v_inv);
  }
}

#define RF_WRITE_E4M3(NAME, E)                                                                 \
  RF_KERNEL(RF_CO_THREADS) rf_reshape_and_cache_e4m3_##NAME(                                   \
      rf_u64* k_cache, rf_u64* v_cache, const rf_vec16* key, const rf_vec16* value,            \
      const rf_i64* slot_mapping, int num_kv_heads, int block_size, int row_vecs, float k_inv, \
      float v_inv, int fnuz) {                                                                 \
    rf_write_e4m3<E>(k_cache, v_cache, key, value, slot_mapping, num_kv_heads, block_size,    \
                     row_vecs, k_inv, v_inv, fnuz);                                            \
  }
RF_WRITE_E4M3(f16, rf_f16)
RF_WRITE_E4M3(bf16, rf_bf16)

// Copies whole blocks, in every layer, K and V, for each (src, dst) pair.
// slab [num_layers, 2, num_blocks, block_vecs] of 16-byte vectors (block_vecs = num_kv_heads *
// block_size * head_dim * itemsize / 16); pairs int64 [num_pairs, 2].
// Grid (num_pairs, num_layers * 2).
RF_KERNEL(RF_CO_THREADS) rf_copy_blocks(rf_vec16* __restrict__ slab,
                                       const rf_i64* __restrict__ pairs, int num_blocks,
                                       rf_i64 block_vecs) {
  const rf_i64 pair = rf_bid_x(), plane = rf_bid_y();
  const rf_i64 base = plane * num_blocks * block_vecs;
  rf_vec16* src = slab + base + pairs[2 * pair] * block_vecs;
  rf_vec16* dst = slab + base + pairs[2 * pair + 1] * block_vecs;
  for (rf_i64 i = rf_tid(); i < block_vecs; i += RF_CO_THREADS) dst[i] = src[i];
}

// Copies pieces of memory this device can address: its own, an IPC mapping, a peer's with
// peer access on. pieces int64 [num_pieces, 3] of (src address, dst address, bytes), every
// address and size a multiple of 16 (ops.cut_pieces keeps each within 64 KiB); pieces never
// overlap one another's destinations. Grid (num_pieces): one CTA a piece, each thread
// loading four 16-byte vectors before it stores them (bytes in flight hide a peer's or a
// mapping's latency), then the piece's tail a vector at a time. A vector moves as two
// aligned 64-bit words, which both compilers fuse into one 16-byte access (a copied struct
// would go through a stack slot on AMD: scratch, promoted to LDS).
RF_KERNEL(RF_CO_THREADS) rf_copy_pieces(const rf_i64* __restrict__ pieces) {
  const rf_i64* piece = pieces + 3 * (rf_i64)rf_bid_x();
  const rf_u64* __restrict__ src = static_cast<const rf_u64*>(
      __builtin_assume_aligned(reinterpret_cast<const void*>(piece[0]), 16));
  rf_u64* __restrict__ dst =
      static_cast<rf_u64*>(__builtin_assume_aligned(reinterpret_cast<void*>(piece[1]), 16));
  const int vecs = (int)(piece[2] >> 4), t = RF_CO_THREADS;
  int i = (int)rf_tid();
  for (; i + 3 * t < vecs; i += 4 * t) {
    rf_u64 words[8];
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      words[2 * u] = src[2 * (i + u * t)];
      words[2 * u + 1] = src[2 * (i + u * t) + 1];
    }
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      dst[2 * (i + u * t)] = words[2 * u];
      dst[2 * (i + u * t) + 1] = words[2 * u + 1];
    }
  }
  for (; i < vecs; i += t) {
    dst[2 * i] = src[2 * i];
    dst[2 * i + 1] = src[2 * i + 1];
  }
}
