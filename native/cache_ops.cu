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
