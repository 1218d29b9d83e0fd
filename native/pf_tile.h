// The shapes and shared-memory layout of the multi-token attention kernel (prefill.cu), per
// instance: E the queries' and outputs' type, C the cache's (E, or rf_e4m3 codes), D the
// head size, WM the warps along the query rows (4: a 64-row query tile, each warp its own 16
// rows over the whole KV tile, 32 rows (128 a tile: MT = 2 m-tiles a warp) on NVIDIA's
// 16-bit instances up to head_dim 128; 1: a 16-row tile, the warps splitting each KV tile's
// tokens and merging at the end, for short query runs such as decodes and speculative
// verification).
//
// Shared memory (bytes from the start of the kernel's buffer, each region 128-byte aligned):
//   Q      BM rows of the queries (16-bit rows swizzled; f32 rows as they are)
//   stages STAGES x [K, V] x BN rows of what the copy brings (NVIDIA: tile t + STAGES - 1
//          in flight while tile t is computed): the cache's rows (16-bit
//          swizzled, f32 plain), or on NVIDIA an fp8 cache's codes as they are
//   wide   (NVIDIA fp8 only) [K, V] x BN rows of the codes widened to E, swizzled: what the
//          matrix math reads (AMD widens in its copy, so its stage holds E already)
// After the KV loop the stages serve the warps' merge (WM = 1) as scratch.
//
// NVIDIA swizzles: chunk j (16 bytes) of row r sits in slot j ^ (r & 7) of its row, for rows
// of at least 8 chunks (all 16-bit and f32 rows here), so the 8 rows an ldmatrix (or a
// quarter warp's 16-byte accesses) touch at one chunk fall in 8 distinct bank groups. AMD
// pads each row instead (rf_pf_shape::PAD).
#pragma once
#include "compat.h"

#define RF_PF_WARPS 4
#define RF_PF_THREADS (RF_PF_WARPS * RF_WARP)
#define RF_PF_ALIGN 128  // NVIDIA: the dynamic buffer's start is rounded up to this

template <int ROW_BYTES, bool SWIZZLED, int PAD = 0>
struct rf_pf_rows {
  static constexpr int CHUNKS = ROW_BYTES / 16;
  static constexpr int STRIDE = ROW_BYTES + PAD;     // bytes from one row to the next
  static constexpr bool ALIGNED = PAD % 16 == 0;     // every chunk 16-byte aligned
  static_assert(!SWIZZLED || (CHUNKS >= 8 && PAD == 0 && ROW_BYTES % 128 == 0),
                "swizzled rows: whole 128-byte lines, unpadded");
  // Swizzled, the XOR goes on the address: rows start at multiples of 128 bytes (the planes
  // are RF_PF_ALIGN-aligned, rows 128 or more bytes), so it flips only the chunk's bits 4-6,
  // and an access whose row is fixed mod 8 costs one XOR (not a slot's index arithmetic)
  RF_DEVICE static const char* chunk(const char* plane, int r, int j) {
    const char* at = plane + r * STRIDE + 16 * j;
    if constexpr (!SWIZZLED) return at;
    const rf_u64 flip = 16u * (unsigned)(r & 7);
    return reinterpret_cast<const char*>(reinterpret_cast<rf_u64>(at) ^ flip);
  }
  // The same as a shared-window address (NVIDIA's hot loops: 32-bit arithmetic the compiler
  // folds), `plane` the plane's (RF_PF_ALIGN-aligned): the row's start plus the chunk's
  // offset with bits 4-6 flipped, which is the XOR above (the row's start has bits 0-6 clear)
  RF_DEVICE static unsigned addr(unsigned plane, int r, int j) {
    const unsigned start = plane + (unsigned)(r * STRIDE);
    if constexpr (!SWIZZLED) return start + 16u * (unsigned)j;
    return start + ((16u * (unsigned)j) ^ (16u * (unsigned)(r & 7)));
  }
  RF_DEVICE static char* chunk(char* plane, int r, int j) {
    return const_cast<char*>(chunk(static_cast<const char*>(plane), r, j));
  }
  // byte b of row r (any alignment within its 16-byte chunk)
  RF_DEVICE static const char* at(const char* plane, int r, int b) {
    return chunk(plane, r, b / 16) + b % 16;
  }
  RF_DEVICE static void store(char* plane, int r, int j, const rf_vec16& v) {
    if constexpr (ALIGNED) rf_lds_store16(chunk(plane, r, j), v);
    else rf_lds_store16_a8(chunk(plane, r, j), v);
  }
  RF_DEVICE static rf_vec16 load(const char* plane, int r, int j) {
    if constexpr (ALIGNED) return rf_lds_load16(chunk(plane, r, j));
    else return rf_lds_load16_a8(chunk(plane, r, j));
  }
};

template <class E, class C, int D, int WM>
struct rf_pf_shape {
  static constexpr bool FP8 = sizeof(typename C::storage) == 1;
  static constexpr bool F32 = sizeof(typename E::storage) == 4;
#if defined(RF_AMD)
  static constexpr int MT = 1;
#else
  // NVIDIA's 16-bit WM = 4 instances up to head_dim 128 (not an fp8 cache's: its widening
  // takes the registers): 32 rows a warp (two m-tiles), so each K or V fragment read from
  // shared memory feeds twice the products
  static constexpr int MT = WM == 4 && !F32 && !FP8 && D <= 128 ? 2 : 1;
#endif
  static constexpr int BM = 16 * WM * MT;  // query rows of a tile
#if defined(RF_AMD)
  static constexpr int BN = F32 ? (D == 64 ? 32 : 16) : (D <= 128 ? 64 : 16);
  static constexpr int STAGES = 1;  // the copy is synchronous: a second stage would idle
  static constexpr bool WIDEN_IN_COPY = FP8;
#else
  // (64-token tiles for two m-tiles of head_dim 128 too: 13 registers spill, outside the
  // tile's products, and each tile's fixed work (softmax bookkeeping, barriers, Q's
  // fragments) is spread over twice the tokens: 11 % faster than 32-token tiles on P1-P2)
  static constexpr int BN = F32 ? (D == 64 ? 64 : D == 128 ? 32 : 16) : (D <= 128 ? 64 : 32);
  // stages in flight: up to head_dim 128 enough that a tile's loads outlast its math (four
  // of 16 KiB, three larger; two of 32 KiB beside two m-tiles' 32 KiB of queries, so two
  // CTAs share a multiprocessor), two at head_dim 256 and f32 (two CTAs a multiprocessor)
  static constexpr int STAGE_BYTES = 2 * BN * D * (int)sizeof(typename C::storage);
  static constexpr int STAGES =
      D <= 128 && !F32 ? (STAGE_BYTES <= 16384 ? 4 : MT == 2 ? 2 : 3) : 2;
  static constexpr bool WIDEN_IN_COPY = false;
#endif
  static constexpr int NTOK_W = WM == 4 ? BN : BN / RF_PF_WARPS;  // tokens a warp takes
  static constexpr int E_ROW = D * (int)sizeof(typename E::storage);  // bytes of a Q/E row
  // what the stages hold: the cache's rows, or E rows where the copy widens fp8 codes
  static constexpr int S_ROW = WIDEN_IN_COPY ? E_ROW : D * (int)sizeof(typename C::storage);
  static constexpr bool CODE_STAGE = FP8 && !WIDEN_IN_COPY;  // NVIDIA fp8: codes staged
#if defined(RF_AMD)
  // AMD: rows padded, not swizzled, so a lane's reads of a tile are constant offsets from one
  // address (swizzled, the offsets of 16 rows were hoisted out of the loop: gfx11 spilled):
  // 16-bit rows by 8 bytes (the 16 rows of a matrix operand's 8-byte reads in 16 bank
  // pairs), f32 rows by 16 (the core path's 16-byte reads)
  static constexpr int PAD = F32 ? 16 : 8;
  static constexpr bool SWIZZLE = false;
#else
  static constexpr int PAD = 0;
  static constexpr bool SWIZZLE = true;
#endif
  typedef rf_pf_rows<E_ROW, SWIZZLE, PAD> QRows;                 // Q and E-typed K/V rows
  typedef rf_pf_rows<S_ROW, SWIZZLE && !CODE_STAGE, CODE_STAGE ? 0 : PAD> SRows;  // stage
  static constexpr int Q_BYTES = BM * QRows::STRIDE;
  static constexpr int PLANE = BN * SRows::STRIDE;  // K (or V) of one stage
  static constexpr int WIDE_PLANE = CODE_STAGE ? BN * QRows::STRIDE : 0;
  static constexpr int round(int b) { return (b + RF_PF_ALIGN - 1) / RF_PF_ALIGN * RF_PF_ALIGN; }
  static constexpr int AT_STAGES = round(Q_BYTES);
  static constexpr int AT_WIDE = AT_STAGES + round(STAGES * 2 * PLANE);
  static constexpr int BYTES = AT_WIDE + round(2 * WIDE_PLANE);  // planning.prefill_shared_bytes
  // the merge's scratch (WM = 1): one region of [16][D] floats per warp, or fewer in turns
  static constexpr int REGION = 16 * D * 4;
  static constexpr int REGIONS = BYTES - AT_STAGES >= RF_PF_WARPS * REGION ? RF_PF_WARPS
                                 : BYTES - AT_STAGES >= 2 * REGION         ? 2
                                                                           : 1;
  static_assert(BYTES - AT_STAGES >= REGION, "one warp's rows fit the stages for the merge");
};
