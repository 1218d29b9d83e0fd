// Paged-attention decode: one query token per sequence over an HND paged K/V cache.
//
// Layout (DESIGN.md): k_cache/v_cache [num_blocks, num_kv_heads, block_size, head_dim] of E;
// q/out [num_seqs, num_q_heads, head_dim]; block_tables int32 [num_seqs, max_blocks];
// seq_lens int32 [num_seqs]. Query head h reads kv head h / (num_q_heads / num_kv_heads).
//
// Work (pa_work.h). A unit is (sequence s, group x): kv head x / chunks and up to G of its
// query heads (chunks = ceil(ratio / G) groups per kv head), so each K/V element of a unit
// is read once for the whole group. Units are laid end to end, s-major, each len16(s) work
// tokens long (its length rounded up to 16, at least 16, so an empty sequence still owns a
// position); CTA c takes the work range [c * per_cta, min((c + 1) * per_cta, total)),
// planned on the host: one wave of CTAs with equal shares, or one CTA a unit (many units,
// which the hardware schedules as CTAs end, or about one a multiprocessor: NOTES v30). Unit
// lengths come from `cum16` (int64 [num_seqs + 1], exclusive prefix sums of len16, with
// `first_seq` [CTAs]: the sequence holding each CTA's first position) or, when the host does
// not know the lengths, are `uniform16` for every sequence (the kernel reads the real lengths
// and skips the rest).
//
// Pipeline. A CTA streams K and V through shared memory in tiles from one unit's piece to
// the next without draining: the copies of the next piece's first tiles are in flight while
// the last one is finished. NVIDIA: RF_PA_STAGES stages filled asynchronously by 16-byte
// cp.async copies (sm_80 and sm_90; RF_USE_BULK: sm_90's bulk-copy engine, one copy a row, for
// A/B), an fp8 cache's codes as they are (widened in registers by the math, pa_math.h).
// AMD: one stage, and the next tile in registers — each
// lane loads its share of tile i + 1 from global memory before tile i is computed and
// writes it to the stage once tile i is done. Each warp owns a fixed share of every tile's
// rows: it copies them, scores them and accumulates their V with its own online softmax
// (pa_math.h: CUDA cores, NVIDIA tensor cores or AMD matrix cores), so the tile loop has warp
// barriers only; the warps are combined once per piece. A unit inside one CTA's range is
// written to `out`; a unit split across CTAs c0..c1 leaves unnormalised partial outputs plus
// (max, sum) in slot 2c + (c == c0) of each CTA c (`partials`: per slot and query head of
// the group, an rf_pa_record), and the piece that finishes last combines them with the
// whole CTA (a per-unit counter in `counters`, zero between launches: each launch resets
// what it uses).
#include "compat.h"

#define RF_PA_THREADS 128
#define RF_PA_WARPS (RF_PA_THREADS / RF_WARP)
#define RF_LOG2E 1.4426950408889634f
// Bytes of one shared-memory stage (K + V of one tile) and the number of stages. NVIDIA's
// stages are dynamic shared memory: launches pass what planning.attention_shared_bytes
// computes from the same numbers (and the rows' padding below). AMD keeps one stage, static
// (its size is each instance's own: rf_pa_stage), and the next tile in registers.
#ifndef RF_PA_STAGE_BYTES
#if defined(RF_AMD)
#define RF_PA_STAGE_BYTES 16384
#else
#define RF_PA_STAGE_BYTES 32768
#endif
#endif
#ifndef RF_PA_STAGES
#if defined(RF_AMD)
#define RF_PA_STAGES 1
#else
#define RF_PA_STAGES 2
#endif
#endif
#define RF_PA_STAGE_ALIGN 128  // NVIDIA: planning.STAGE_ALIGN, the stages' alignment in bytes
#ifndef RF_PA_MIN_BLOCKS  // CTAs per multiprocessor the register budget is fitted to
#define RF_PA_MIN_BLOCKS 3
#endif
#ifndef RF_PA_NARROW_BLOCKS  // the same for NVIDIA's narrow instances (rf_pa_stage)
#define RF_PA_NARROW_BLOCKS 4
#endif

// Whether an instance computes on matrix units (pa_math.h: NVIDIA tensor cores, AMD MFMA or
// WMMA) rather than CUDA cores / VALU: a 16-bit or fp8 stage and, on NVIDIA, 8+ rows per
// warp (any group: G = 1 and 2 pad the queries' 8 rows of an m16n8k16 fragment, and still
// beat CUDA cores, NOTES v26); on AMD 4+ query heads per group. RF_PA_NO_MATRIX: never
// (an A/B build).
template <class E, int G, int TOKENS>
struct rf_pa_matrix_path {
#if defined(RF_PA_NO_MATRIX)
  static constexpr bool value = false;
#elif defined(RF_HAVE_MMA)
  static constexpr bool value = E::TENSOR_KIND != 0 && TOKENS / RF_PA_WARPS >= 8;
#elif defined(RF_HAVE_MFMA) || defined(RF_HAVE_WMMA)
  static constexpr bool value = E::TENSOR_KIND != 0 && G >= 4;
#else
  static constexpr bool value = false;
#endif
};

// A shared-memory stage: the K rows of one tile (TOKENS tokens), then its V rows. On NVIDIA,
// rows of 16-bit elements, and fp8 codes of up to 128 dims (d256's stay padded: swizzled,
// they spilled registers), are unpadded and swizzled: chunk j of row r sits in slot
// j ^ (line(r) & 7) of its row (line(r): r, or r / 2 for 64-byte rows, which swizzle by & 3),
// so the 8 rows an ldmatrix reads at one chunk, and the 128 bytes a quarter warp's 16-byte
// copies fill, fall in 8 distinct bank groups. Unpadded rows cost less power per byte moved
// than padded ones (NOTES v29: 55-60 W less, and 3 % less time, for the copy alone on an
// H100). Elsewhere (f32 rows, d256 codes, AMD) each row is padded. Shared memory is 32 banks
// of 4 bytes; a 16-byte access by a wave is served 8 lanes at a time (NVIDIA: a quarter warp;
// AMD: lanes 8i..8i+7, and for gfx9's ds_read_b128 also lanes 4i..4i+3 with those 16 on and 4
// off: 0-3 with 20-23, 4-7 with 16-19), so it is conflict-free when the 8 lanes of each such
// set read 8 different bank groups of 16 bytes (or the same address). Padded rows are padded
// by 16 bytes (AMD's vector path: 16 per 8 threads of a row's score; NVIDIA's stages give a
// row at most 8), so row r + 1 starts PAD / 16 bank groups after row r: chunk j of row r is
// in group (r * PAD / 16 + j) mod 8. qk_chunk, the vector path's V rows and chunks and query
// layout (pa_math.h) and the register copy's stores choose which lane touches which chunk so
// that every access is conflict-free; tests/test_amd_emulation.py checks that on the AMD
// kernels' traced accesses. AMD's matrix path pads by 8 bytes instead, so the 16 rows of an
// MFMA/WMMA K read (8 bytes each) fall in 16 distinct bank pairs (rows then only 8-byte
// aligned: two 8-byte accesses per chunk).
//
// S is what the stage holds: E (16-bit or f32 rows), or on NVIDIA an fp8 cache's codes as
// they are in the cache (CODES: rows of D bytes, widened in registers by the math).
template <class E, class S, int D, int STAGE_BYTES, int G>
struct rf_pa_tile {
  typedef S stored;
  static constexpr bool CODES = sizeof(typename S::storage) == 1;
  static constexpr int ROW_BYTES = D * (int)sizeof(typename S::storage);
  static constexpr int TOKENS = STAGE_BYTES / 2 / ROW_BYTES;  // 4..128
  static constexpr int VPR = ROW_BYTES / 16;                        // 16-byte chunks per row
  static constexpr int TPT = RF_PA_THREADS / TOKENS;                // threads per token (QK)
  static constexpr int CHUNKS = VPR / TPT;                          // chunks per thread (QK)
  static constexpr bool MATRIX = rf_pa_matrix_path<E, G, TOKENS>::value;
#if defined(RF_AMD)
  static constexpr bool SWIZZLED = false;
  static constexpr int PAD = MATRIX ? 8 : 16 * (TPT > 8 ? TPT / 8 : 1);
#elif defined(RF_HAVE_BULK)  // (A/B) one bulk copy a row: rows whole, so padded
  static constexpr bool SWIZZLED = false;
  static constexpr int PAD = 16;
#else  // 16-bit rows, codes of up to 128 dims (d256's spilled more registers swizzled);
       // planning.attention_shared_bytes sizes the stages the same way
  static constexpr bool SWIZZLED = sizeof(typename S::storage) == 2 || (CODES && D <= 128);
  static constexpr int PAD = SWIZZLED ? 0 : 16;
#endif
  static constexpr int STRIDE = ROW_BYTES + PAD;  // bytes per (padded) row
  static constexpr int PLANE = TOKENS * STRIDE;   // bytes of K (or V) of one stage
  static constexpr bool ALIGNED = PAD % 16 == 0;  // every chunk 16-byte aligned
  static constexpr int LINE_ROWS = ROW_BYTES >= 128 ? 1 : 128 / ROW_BYTES;  // rows a line
  static constexpr int SWIZZLE = (VPR < 8 ? VPR : 8) - 1;  // the chunk bits the XOR flips
  static_assert(ROW_BYTES % 128 == 0 || (CODES && ROW_BYTES == 64),
                "a row spans whole sets of the 32 banks (or half of them: codes of 64 dims)");
  RF_DEVICE static const char* row(const char* plane, int r) {  // (padded layouts only)
    static_assert(!SWIZZLED, "a swizzled row is not whole: address it by chunk()");
    return plane + r * STRIDE;
  }
  // Swizzled, the XOR goes on the address: a row starts at a multiple of 128 bytes (64 for
  // 64-byte rows; the stages are RF_PA_STAGE_ALIGN-aligned), so it flips only the chunk's
  // bits 4-6 (or 4-5), and ptxas keeps one address a row and an XOR an access. (XORing the
  // chunk index instead, ptxas hoisted each access's offset out of the tile loop: head_dim
  // 256 spilled up to 300 bytes, ptxas -v.)
  RF_DEVICE static const char* chunk(const char* plane, int r, int j) {
    const char* at = plane + r * STRIDE + 16 * j;
    if constexpr (!SWIZZLED) return at;
    const rf_u64 flip = 16u * (unsigned)(r / LINE_ROWS & SWIZZLE);
    return reinterpret_cast<const char*>(reinterpret_cast<rf_u64>(at) ^ flip);
  }
  RF_DEVICE static char* chunk(char* plane, int r, int j) {
    return const_cast<char*>(chunk(static_cast<const char*>(plane), r, j));
  }
  RF_DEVICE static rf_vec16 load(const char* plane, int r, int j) {
    if constexpr (ALIGNED) return rf_lds_load16(chunk(plane, r, j));
    else return rf_lds_load16_a8(chunk(plane, r, j));
  }
  RF_DEVICE static void store(char* plane, int r, int j, const rf_vec16& x) {
    if constexpr (ALIGNED) rf_lds_store16(chunk(plane, r, j), x);
    else rf_lds_store16_a8(chunk(plane, r, j), x);
  }
  // The chunk that thread t of a row's TPT reads at step c of its CHUNKS (core path's scores):
  // thread t owns chunks [t * CHUNKS, (t + 1) * CHUNKS) and starts at a rotated one. With 8+
  // chunks a thread, the TPT threads of a row start 8 / TPT groups apart; with 4 or 2 (AMD's
  // 16 KiB stages and half stages, NVIDIA's fp8 and narrow half stages), by bits 1 and 2 of t,
  // which also keeps gfx9's lane sets (0-3 with 20-23, ...) on distinct groups.
  RF_DEVICE static int qk_chunk(int t, int c) {
    const int start = CHUNKS >= 8 ? t * (TPT < 8 ? 8 / TPT : 1) : 2 * (t >> 1 & 1) + (t >> 2 & 1);
    return t * CHUNKS + (c + start) % CHUNKS;
  }
};

// The stage of one instance, and the CTAs per multiprocessor its registers are fitted to. On
// wave32 AMD targets a group of 8 heads halves it: the next tile, which waits in registers,
// then takes 16 registers a lane instead of 32, and with eight heads' accumulators a 16 KiB
// stage spilled on gfx1100 (to 128 bytes of scratch). NVIDIA's narrow instances (128-byte
// rows of a 16-bit cache, head_dim 64, and fewer than 8 heads) take half stages (64-token
// tiles, as at head_dim 128) and four CTAs per SM instead of three: their per-tile work is a
// latency chain that more warps hide (planning.attention_shared_bytes halves their stages the
// same way). Five spilled 36-64 bytes in 96 registers and ran 2-7 % slower (NOTES v29).
//
// NVIDIA's fp8 instances stage the codes as copied (CODES: the asynchronous pipeline of the
// 16-bit instances, half the bytes a token) and widen them in registers; their stages hold
// at most 128 tokens (one row a lane: 32 rows a warp), so head_dim 64 takes half a stage.
template <class E, class C, int D, int G>
struct rf_pa_stage {
  static constexpr bool FP8 = sizeof(typename C::storage) != sizeof(typename E::storage);
#if defined(RF_AMD)
  static constexpr bool CODES = false;
  static constexpr bool NARROW = false;
  static constexpr int BYTES = RF_WARP == 32 && G >= 8 ? RF_PA_STAGE_BYTES / 2 : RF_PA_STAGE_BYTES;
#else
  static constexpr bool CODES = FP8;
  static constexpr bool NARROW = !FP8 && D * sizeof(typename E::storage) == 128 && G < 8;
  static constexpr int CODE_BYTES = 2 * 128 * D < RF_PA_STAGE_BYTES ? 2 * 128 * D
                                                                    : RF_PA_STAGE_BYTES;
  static constexpr int BYTES = CODES ? CODE_BYTES
                               : NARROW ? RF_PA_STAGE_BYTES / 2 : RF_PA_STAGE_BYTES;
#endif
  typedef typename rf_pa_pick<CODES, C, E>::type S;  // what the stage holds
  static constexpr int MIN_BLOCKS = NARROW ? RF_PA_NARROW_BLOCKS : RF_PA_MIN_BLOCKS;
};

#include "pa_math.h"
#include "pa_work.h"

// A piece's record in `partials` (per slot and query head of the group): D floats of the
// unnormalised output, then (max, sum) and two unused floats, so every record and its pair
// start 16-byte aligned (planning.split_workspace sizes records the same way).
template <int D>
struct rf_pa_record {
  static constexpr int FLOATS = D + 4;
};

// Combines the pieces of one unit with the whole CTA: for each of the nh heads of the group,
// out = sum_p w_p o_p / sum_p w_p l_p with w_p = 2^(m_p - max_p m_p), from the records that
// CTAs c0 .. c0 + pieces - 1 wrote (slot 2c + (c == c0); plain loads, after the caller's
// device-scope fence, rf_fence_device, and a barrier). `out` is the group's first head's
// row. The group's outputs are COLUMNS columns of 4 dims; thread t takes TASKS of them
// (t + k * RF_PA_THREADS) over the pieces p = slice (mod SLICES), folding its pieces online
// (running max) with LOADS records in flight at a time; slice 0 then folds the other slices'
// results through `scratch` (shared, 6 floats a thread, idle until the caller's next
// barrier). Inlined: an out-of-line call cost every piece of the hot path on sm_90 (ragged
// batches 9-30 % slower).
template <class E, int D, int G, int LOADS>
RF_DEVICE void combine_pieces(typename E::storage* __restrict__ out, const float* partials,
                              rf_i64 c0, int pieces, int nh, int tid, float* scratch,
                              const float* sinks) {
  constexpr int COLS = D / 4, COLUMNS = G * COLS;  // 4-dim columns per head, per group
  constexpr int SLICES = COLUMNS < RF_PA_THREADS ? RF_PA_THREADS / COLUMNS : 1;
  constexpr int TASKS = COLUMNS > RF_PA_THREADS ? COLUMNS / RF_PA_THREADS : 1;
  constexpr int BATCH = LOADS / TASKS > 1 ? LOADS / TASKS : 1;  // pieces a batch
  constexpr int R = rf_pa_record<D>::FLOATS;
  static_assert(COLUMNS % RF_PA_THREADS == 0 || RF_PA_THREADS % COLUMNS == 0, "even split");
  static_assert(RF_PA_THREADS % COLS == 0, "a thread's columns share their dims");
  const int slice = tid / (RF_PA_THREADS / SLICES), column = tid % (RF_PA_THREADS / SLICES);
  float m[TASKS], l[TASKS];
  rf_float4 acc[TASKS];
#pragma unroll
  for (int k = 0; k < TASKS; ++k) {
    m[k] = -RF_INF;
    l[k] = 0.f;
    acc[k] = rf_float4{0.f, 0.f, 0.f, 0.f};
  }
  auto head = [&](int k) { return (column + k * RF_PA_THREADS) / COLS; };  // task k's head
  auto at = [&](int p, int k) -> const float* {  // piece p's record for task k's head
    return partials + ((2 * (c0 + p) + (p == 0)) * G + head(k)) * R;
  };
  auto fold = [&](int k, float mp, float lp, const rf_float4& o) {
    if (!(lp > 0.f)) return;  // an empty piece (no tokens): nothing to add
    const float mn = rf_fmax(m[k], mp);
    const float a = rf_exp2(m[k] - mn), b = rf_exp2(mp - mn);
    acc[k] = rf_float4{acc[k].x * a + o.x * b, acc[k].y * a + o.y * b,
                       acc[k].z * a + o.z * b, acc[k].w * a + o.w * b};
    l[k] = l[k] * a + lp * b;
    m[k] = mn;
  };
  const int dims = 4 * (column % COLS);  // the same for each task: COLS divides the threads
  for (int p0 = slice; p0 < pieces; p0 += SLICES * BATCH) {
    float mp[BATCH][TASKS], lp[BATCH][TASKS];  // every load of the batch, then the folds
    rf_float4 o[BATCH][TASKS];
#pragma unroll
    for (int b = 0; b < BATCH; ++b) {
      const int p = p0 + b * SLICES;
#pragma unroll
      for (int k = 0; k < TASKS; ++k) {
        const bool here = p < pieces && head(k) < nh;
        const float* record = at(here ? p : 0, k);
        mp[b][k] = here ? record[D] : -RF_INF;
        lp[b][k] = here ? record[D + 1] : 0.f;
        o[b][k] = here ? *reinterpret_cast<const rf_float4*>(record + dims)
                       : rf_float4{0.f, 0.f, 0.f, 0.f};
      }
    }
#pragma unroll
    for (int b = 0; b < BATCH; ++b)
#pragma unroll
      for (int k = 0; k < TASKS; ++k) fold(k, mp[b][k], lp[b][k], o[b][k]);
  }
  if constexpr (SLICES > 1) {  // slice 0 folds the others' results (TASKS is 1 here)
    float* mine = scratch + 6 * tid;
    mine[0] = m[0];
    mine[1] = l[0];
    mine[2] = acc[0].x;
    mine[3] = acc[0].y;
    mine[4] = acc[0].z;
    mine[5] = acc[0].w;
    rf_sync();
    if (slice == 0)
      for (int s = 1; s < SLICES; ++s) {
        const float* theirs = scratch + 6 * (tid + s * (RF_PA_THREADS / SLICES));
        fold(0, theirs[0], theirs[1], rf_float4{theirs[2], theirs[3], theirs[4], theirs[5]});
      }
  }
  if (slice != 0) return;
#pragma unroll
  for (int k = 0; k < TASKS; ++k) {
    if (head(k) >= nh) continue;
    const float sink = sinks != nullptr ? rf_exp2(sinks[head(k)] * RF_LOG2E - m[k]) : 0.f;
    const float inv = l[k] > 0.f ? 1.f / (l[k] + sink) : 0.f;
    typename E::storage* row = out + head(k) * D + dims;
    row[0] = E::from_float(acc[k].x * inv);
    row[1] = E::from_float(acc[k].y * inv);
    row[2] = E::from_float(acc[k].z * inv);
    row[3] = E::from_float(acc[k].w * inv);
  }
}

// The register copy (AMD; an fp8 cache's codes are widened on the way into the stage): each
// lane moves N 16-byte chunks of the cache's K and N of its V per tile
// (N = 4 for a 16-bit 16 KiB stage: 128 bytes in eight registers): chunk c of RPL consecutive
// rows, SPAN chunks a row apart by a warp's width (SPAN = 1 while a row has at most a warp's
// width of chunks; rows of f32 x 256 on wave32 take two passes). Lane l: c = l % (VPR / SPAN),
// rows RPL g .. RPL g + RPL - 1 of the warp's rows with g = l / (VPR / SPAN), VPR the cache
// row's chunks. The rows are consecutive tokens of one block (block sizes are multiples of
// 8), so one block-table entry places them; rows past the piece's end are zeros. A cache
// chunk of C fills WIDEN stage chunks of E (2 for fp8: rf_e4m3::widen).
template <class E, class C, int D, class Tile>
struct rf_pa_reg_copy {
  static constexpr int WIDEN = sizeof(typename E::storage) / sizeof(typename C::storage);
  static constexpr int VPR = Tile::VPR / WIDEN, N = Tile::TOKENS / RF_PA_WARPS * VPR / RF_WARP;
  static constexpr int SPAN = VPR > RF_WARP ? VPR / RF_WARP : 1, RPL = N / SPAN;
  static_assert(N * RF_WARP == Tile::TOKENS / RF_PA_WARPS * VPR && RPL >= 1 && RPL <= 8 &&
                    SPAN * RPL == N && (WIDEN == 1 || WIDEN == 2),
                "whole chunks of whole rows per lane, the rows within one block");
  struct Rows {        // where a lane's rows of a tile are (the table entry not yet used)
    int block;         // block id (a pending load until the rows are copied)
    int offset;        // first row within the (block * num_kv_heads)-th block_size rows
    unsigned valid;    // bit j: row j exists
  };
  rf_vec16 k[N], v[N];  // [row j][pass s] at j * SPAN + s
  int c, g;

  RF_DEVICE Rows rows(const int* table, int kvh, int t, int first, int end, bool ok, int row0,
                      int block_shift) const {
    const int tok = t + row0 + RPL * g;
    if (!ok || tok >= end) return Rows{0, 0, 0u};
    unsigned valid = 0;  // rows before `first` (a window's) are never read: zeros
#pragma unroll
    for (int j = 0; j < RPL; ++j) valid |= tok + j < end && tok + j >= first ? 1u << j : 0u;
    return Rows{table[tok >> block_shift],
                (kvh << block_shift) + (tok & ((1 << block_shift) - 1)), valid};
  }
  RF_DEVICE void load(const typename C::storage* k_cache, const typename C::storage* v_cache,
                      const Rows& r, int num_kv_heads, int block_shift) {
    const rf_i64 first = ((rf_i64)r.block * num_kv_heads << block_shift) + r.offset;
    const rf_vec16* kc = reinterpret_cast<const rf_vec16*>(k_cache) + first * VPR + c;
    const rf_vec16* vc = reinterpret_cast<const rf_vec16*>(v_cache) + first * VPR + c;
#pragma unroll
    for (int j = 0; j < RPL; ++j)
#pragma unroll
      for (int s = 0; s < SPAN; ++s) {
        const bool ok = (r.valid >> j) & 1u;
        const int at = j * VPR + s * RF_WARP;
        k[j * SPAN + s] = ok ? kc[at] : rf_vec16{0u, 0u, 0u, 0u};
        v[j * SPAN + s] = ok ? vc[at] : rf_vec16{0u, 0u, 0u, 0u};
      }
  }
  // A widened chunk fills stage chunks 2c and 2c + 1. On AMD's vector path (16-byte stores),
  // lanes with bit 2 set write the second first, so the 8 lanes of a store fill 8 bank groups,
  // not every other group twice. NVIDIA keeps the plain order (the swap measured 3 % slower
  // there: H200, S1/S5/S6 fp8), as does AMD's matrix path (8-byte stores; 3 more VGPRs cost
  // gfx1100's d256 G = 4 instances a workgroup per CU).
  RF_DEVICE void put(char* plane, int row, int chunk, const rf_vec16& x) const {
#if defined(RF_AMD)
    constexpr bool SWAP = WIDEN == 2 && Tile::ALIGNED;
#else
    constexpr bool SWAP = false;
#endif
    if constexpr (WIDEN == 1) {
      Tile::store(plane, row, chunk, x);
    } else if constexpr (!SWAP) {
      Tile::store(plane, row, 2 * chunk, C::template widen<E>(x.x, x.y));
      Tile::store(plane, row, 2 * chunk + 1, C::template widen<E>(x.z, x.w));
    } else {
      const int second = (g * (VPR / SPAN) + c) >> 2 & 1;  // the lane's bit 2
      const unsigned swap = 0u - (unsigned)second;            // all ones if second
      const unsigned zx = (x.x ^ x.z) & swap, wy = (x.y ^ x.w) & swap;
      Tile::store(plane, row, 2 * chunk + second, C::template widen<E>(x.x ^ zx, x.y ^ wy));
      Tile::store(plane, row, 2 * chunk + 1 - second, C::template widen<E>(x.z ^ zx, x.w ^ wy));
    }
  }
  RF_DEVICE void store(char* stage, int row0) const {
#pragma unroll
    for (int j = 0; j < RPL; ++j)
#pragma unroll
      for (int s = 0; s < SPAN; ++s) {
        const int row = row0 + RPL * g + j, chunk = c + s * RF_WARP;
        put(stage, row, chunk, k[j * SPAN + s]);
        put(stage + Tile::PLANE, row, chunk, v[j * SPAN + s]);
      }
  }
};

// E: the queries' and outputs' element type; C: the cache's (E, or rf_e4m3: codes the AMD copy
// widens to E on their way into the stage, NVIDIA's math in registers: rf_pa_stage::S).
// `scale` multiplies the scores, `out_scale` the outputs of an fp8 cache (the host folds the
// layer's K and V scales and the codes' factor into them; other caches ignore out_scale).
// `window` > 0: each sequence attends to its last `window` tokens (Mistral, Gemma's local
// layers), the work split planned over those and the blocks before them never read.
// `softcap` > 0 soft-caps the scaled scores (softcap * tanh(s / softcap): Gemma 2; 0: none);
// `sinks` (null: none) holds one logit a query head that joins each head's softmax
// denominator only (gpt-oss): out = sum_t e^(s_t - m) v_t / (sum_t e^(s_t - m) + e^(sink - m)).
template <class E, class C, int D, int G>
RF_DEVICE void paged_attention(
    typename E::storage* __restrict__ out, float* __restrict__ partials,
    int* __restrict__ counters, const typename E::storage* __restrict__ q,
    const typename C::storage* __restrict__ k_cache,
    const typename C::storage* __restrict__ v_cache, const int* __restrict__ block_tables,
    const rf_pa_work& w, const int* __restrict__ first_seq, float scale, int num_q_heads,
    int num_kv_heads, int max_blocks, int block_shift, float out_scale, float softcap,
    const float* __restrict__ sinks) {
  typedef rf_pa_stage<E, C, D, G> Stage;
  constexpr bool FP8 = Stage::FP8;
  typedef rf_pa_tile<E, typename Stage::S, D, Stage::BYTES, G> Tile;
  typedef typename rf_pa_math<E, D, G, Tile>::type Math;
  typedef rf_pa_reg_copy<E, C, D, Tile> Copy;
#if defined(RF_AMD)
  constexpr bool REG = true;  // the copy through registers, one stage
#else
  constexpr bool REG = false;
#endif
  constexpr int T = Tile::TOKENS, VPR = Tile::VPR, WROWS = T / RF_PA_WARPS;
  constexpr int STAGES = REG ? 1 : RF_PA_STAGES;
  static_assert(WROWS * VPR % RF_WARP == 0 && WROWS <= RF_WARP, "copy shape");
  static_assert(G * D * 4 <= 2 * Tile::PLANE && RF_PA_THREADS * 6 * 4 <= 2 * Tile::PLANE,
                "a piece's output, and the combine's scratch, fit in one stage");
#if defined(RF_AMD)
  RF_SHARED rf_vec16 stage_v[STAGES * 2 * Tile::PLANE / 16];  // [STAGES][K, V][T rows]
  char* const stage_s = reinterpret_cast<char*>(stage_v);
#else
  // The stages start at the next multiple of RF_PA_STAGE_ALIGN bytes, whatever alignment the
  // compiler gives the dynamic array (the launch passes that many bytes more): the swizzle
  // (rf_pa_tile::chunk) flips address bits of rows that must start on 128-byte boundaries.
  RF_DYNAMIC_SHARED(rf_vec16, stage_v);
  char* const stage_s = reinterpret_cast<char*>(stage_v) +
                        (-(int)rf_smem_addr(stage_v) & (RF_PA_STAGE_ALIGN - 1));
#endif
  RF_SHARED typename Math::Shared math_s;
  RF_SHARED float wm_s[G][RF_PA_WARPS], wl_s[G][RF_PA_WARPS];  // per-warp max and sum

  const rf_pa_thread th{(int)rf_tid(), (int)rf_tid() % RF_WARP, (int)rf_tid() / RF_WARP};
  const int tid = th.tid, lane = th.lane, warp = th.warp;
  const int cta = (int)rf_bid_x();
  const int ratio = num_q_heads / num_kv_heads, chunks = (ratio + G - 1) / G;
  const int block_size = 1 << block_shift;
  // Math::UNIT: what the math's widened codes need to read as value / 256 (1 but for bf16
  // on tensor cores: rf_e4m3::moved); it multiplies the scores and the outputs
  const float qscale = scale * RF_LOG2E * Math::UNIT;
  const float o_scale = out_scale * Math::UNIT;
  const float cap = softcap * RF_LOG2E;  // the logit cap in the scores' log2 units (0: none)
  const int row0 = warp * WROWS;

  // The walks: each warp's walk of the pieces STAGES tiles ahead of the computation, and the
  // CTA's walk of the pieces it computes, live in shared memory and move (lane 0 of the warp,
  // thread 0 of the CTA) only from one piece to the next; the tile ahead within its piece is
  // in registers, uniform across the warp. The CTA's walk has two places: the piece being
  // computed, pieces_s[now], and the next, which thread 0 steps to as the piece's tiles end
  // (its queries' loads then overlap the piece's output).
  RF_SHARED rf_pa_walker ahead_s[RF_PA_WARPS];
  RF_SHARED bool ahead_done_s[RF_PA_WARPS];
  RF_SHARED rf_pa_walker pieces_s[2];
  RF_SHARED bool more_pieces_s;
  rf_pa_walker& ahead = ahead_s[warp];
  int now = 0;
  if (lane == 0) ahead.begin(w, first_seq, cta);
  if (tid == 0) pieces_s[0].begin(w, first_seq, cta);
  rf_syncwarp();
  const int* a_table = nullptr;  // the tile ahead: its sequence's block table, kv head, first
  int a_kvh = 0, a_t = 0, a_end = 0;  // token and its piece's end; a_ok: it exists
  int a_first = 0;  // the piece's first token attended (a window's): rows before it are zeros
  bool a_ok = true;
  auto enter_piece = [&]() {  // the registers from the walk (scalar registers on AMD)
    a_table = block_tables + (rf_i64)rf_uniform(ahead.s) * max_blocks;
    a_kvh = rf_uniform(ahead.x) / chunks;
    a_t = rf_uniform(ahead.start);
    a_end = rf_uniform(ahead.end);
    a_first = rf_uniform(ahead.first);
  };
  auto next_piece = [&]() {  // the walk to the next piece with tokens (warp-uniform call)
    rf_syncwarp();  // every lane has read the walk
    if (lane == 0) {
      bool more;
      do more = ahead.next(w); while (more && ahead.start >= ahead.end);
      ahead_done_s[warp] = !more;
    }
    rf_syncwarp();
    a_ok = rf_uniform(!ahead_done_s[warp]);
    if (a_ok) enter_piece();
  };
  auto advance = [&]() {  // the tile after the one ahead
    a_t += T;
    if (a_ok && a_t >= a_end) next_piece();
  };
  enter_piece();
  if (a_t >= a_end) next_piece();

  // REG: one stage; tile i + 1 in registers while tile i is computed, tile i + 2's rows
  // placed
  Copy copy;
  typename Copy::Rows pending{0, 0, 0u};
  auto place = [&]() {  // the rows of the tile ahead, then the walk moves on
    const auto r = copy.rows(a_table, a_kvh, a_t, a_first, a_end, a_ok, row0, block_shift);
    advance();
    return r;
  };
  if constexpr (REG) {
    copy.c = lane % (Copy::VPR / Copy::SPAN);
    copy.g = lane / (Copy::VPR / Copy::SPAN);
    copy.load(k_cache, v_cache, place(), num_kv_heads, block_shift);  // tile 0
    pending = place();                                                // tile 1
  }
#if !defined(RF_AMD)
  // Each warp copies its own rows of every tile, so a tile needs warp barriers only. Rows
  // (of the cache's [num_blocks * num_kv_heads * block_size, D] rows, fewer than 2^31 as
  // the host checks; -1 past the piece's end) are held in registers, one per stage: lane l
  // places row row0 + l of the tile a stage takes next one tile ahead of its copy, and the
  // copying lane takes it by a shuffle (shared memory would cost d64's G = 8 instances a CTA
  // per SM); ok_s says whether the stage's tile exists at all.
  int rows_of[STAGES];  // indexed by constants only (unrolled selects): stays in registers
#pragma unroll
  for (int i = 0; i < STAGES; ++i) rows_of[i] = -1;
  auto rows_at = [&](int st) {
    int r = rows_of[0];
#pragma unroll
    for (int i = 1; i < STAGES; ++i) r = st == i ? rows_of[i] : r;
    return r;
  };
  auto set_rows = [&](int st, int r) {
#pragma unroll
    for (int i = 0; i < STAGES; ++i) rows_of[i] = st == i ? r : rows_of[i];
  };
  RF_SHARED bool ok_s[STAGES][RF_PA_WARPS];
  auto row_offset = [&]() -> int {  // cache row of row row0 + lane of the tile ahead
    const int tok = a_t + row0 + lane;
    if (!a_ok || lane >= WROWS || tok >= a_end || tok < a_first) return -1;
    return (a_table[tok >> block_shift] * num_kv_heads + a_kvh) * block_size +
           (tok & (block_size - 1));
  };
#if defined(RF_HAVE_BULK)
  // sm_90: lane c copies one whole row (K for c < WROWS, else V) with the bulk copy engine,
  // completing on the warp's barrier of the stage; lane 0 tells it how many bytes to expect
  RF_SHARED rf_u64 bar_s[STAGES][RF_PA_WARPS];
  auto issue = [&](int stage) {
    unsigned bytes = 0;
    const int mine = rows_at(stage);
#pragma unroll
    for (int it = 0; it < (2 * WROWS + RF_WARP - 1) / RF_WARP; ++it) {
      const int c = it * RF_WARP + lane, row = row0 + c % WROWS, kv = c / WROWS;
      const int cache_row = rf_shfl_int(mine, c % WROWS);
      if (c >= 2 * WROWS) continue;
      char* dst = Tile::chunk(stage_s + (stage * 2 + kv) * Tile::PLANE, row, 0);
      if (cache_row >= 0) {
        rf_bulk_copy(dst, (kv ? v_cache : k_cache) + (rf_i64)cache_row * D, Tile::ROW_BYTES,
                     &bar_s[stage][warp]);
        bytes += Tile::ROW_BYTES;
      } else {  // past the end: zeros, so products over whole 16-row tiles stay finite
        for (int j = 0; j < VPR; ++j)
          reinterpret_cast<rf_vec16*>(dst)[j] = rf_vec16{0u, 0u, 0u, 0u};
        rf_fence_proxy_async();  // before a later tile's bulk copy into this row
      }
    }
    bytes = rf_warp_sum_u32(bytes);
    if (lane == 0) rf_mbar_expect_tx(&bar_s[stage][warp], bytes);
  };
#else
  // cp.async copies, coalesced: piece p = it * WARP + lane of the warp's rows is chunk
  // p % VPR of row row0 + p / VPR
  auto issue = [&](int stage) {
    char* k_dst = stage_s + (stage * 2 + 0) * Tile::PLANE;
    char* v_dst = stage_s + (stage * 2 + 1) * Tile::PLANE;
    const int mine = rows_at(stage);
#pragma unroll
    for (int it = 0; it < WROWS * VPR / RF_WARP; ++it) {
      const int piece_i = it * RF_WARP + lane, row = row0 + piece_i / VPR, j = piece_i % VPR;
      const int cache_row = rf_shfl_int(mine, piece_i / VPR);
      const rf_i64 offset = (rf_i64)cache_row * D;
      if (cache_row >= 0) {
        rf_copy16_async(Tile::chunk(k_dst, row, j),
                        reinterpret_cast<const rf_vec16*>(k_cache + offset) + j);
        rf_copy16_async(Tile::chunk(v_dst, row, j),
                        reinterpret_cast<const rf_vec16*>(v_cache + offset) + j);
      } else {  // past the end: zeros, so products over whole 16-row tiles stay finite
        rf_lds_store16(Tile::chunk(k_dst, row, j), rf_vec16{0u, 0u, 0u, 0u});
        rf_lds_store16(Tile::chunk(v_dst, row, j), rf_vec16{0u, 0u, 0u, 0u});
      }
    }
    rf_copy_commit();
  };
#endif
  // prologue: row offsets of tiles 0 .. STAGES-1, then tiles 0 .. STAGES-2 in flight
  if constexpr (!REG) {
#pragma unroll
    for (int st = 0; st < STAGES; ++st) {
      rows_of[st] = row_offset();
      if (lane == 0) ok_s[st][warp] = a_ok;
      advance();
    }
#if defined(RF_HAVE_BULK)
    if (lane == 0)
#pragma unroll
      for (int st = 0; st < STAGES; ++st) rf_mbar_init(&bar_s[st][warp]);
#endif
    rf_syncwarp();
#pragma unroll
    for (int st = 0; st < STAGES - 1; ++st)
      if (ok_s[st][warp]) issue(st);
  }
#endif

  rf_sync();  // pieces_s[0] is set
  // the query heads of a piece: q0 .. q0 + nh - 1 (nh < G in a kv head's last group)
  auto first_head = [&](const rf_pa_walker& p) {
    return p.x / chunks * ratio + p.x % chunks * G;
  };
  auto heads = [&](int q0_of) {
    const int left = ratio - q0_of % ratio;
    return left < G ? left : G;
  };
  int q0 = first_head(pieces_s[0]), nh = heads(q0);
  Math math{math_s, th};
  math.load_queries(q, pieces_s[0].s, num_q_heads, q0, nh, qscale);
  rf_sync();

  int stage = 0, tile = 0;  // the next tile to compute: its stage and its index in the stream
  for (;;) {  // pieces
    const rf_pa_walker& piece = pieces_s[now];
    math.reset();
    const int end = rf_uniform(piece.end), first = rf_uniform(piece.first);
    for (int t0 = rf_uniform(piece.start); t0 < end;
         t0 += T, ++tile, stage = stage + 1 == STAGES ? 0 : stage + 1) {
      int next_row = 0;
      bool next_ok = false;
      if constexpr (REG) {
        // tile `tile` goes from registers into the stage (once the warp is done with the
        // previous one), tile + 1's loads go out, and tile + 2's rows are placed
        // (tile + 2's placing comes first: its block-table load, and at a piece boundary the
        // walk's loads, are then older than the tile loads, so waiting for them later never
        // waits for those)
        rf_syncwarp();
        copy.store(stage_s, row0);
        const auto placed = place();
        copy.load(k_cache, v_cache, pending, num_kv_heads, block_shift);
        pending = placed;
        rf_syncwarp();  // the warp's rows of this tile are visible to all its lanes
      } else {
#if !defined(RF_AMD)
        // keep STAGES-1 tiles in flight: issue tile `tile + STAGES-1` into the stage freed by
        // the previous tile, then wait for this tile only; the block ids of the tile after
        // that load meanwhile and land in rows_of[stage] at the end of this tile
        next_row = row_offset();
        next_ok = a_ok;
        const int free_stage = stage == 0 ? STAGES - 1 : stage - 1;
        const bool more = ok_s[free_stage][warp];
        if (more) issue(free_stage);
#if defined(RF_HAVE_BULK)
        rf_mbar_wait(&bar_s[stage][warp], (tile / STAGES) & 1);
#else
        if (more) rf_copy_wait<STAGES - 1>(); else rf_copy_wait<0>();  // the tail drains
#endif
        rf_syncwarp();  // the warp's copies of this tile are visible to all its lanes
        advance();
#endif
      }
      const char* k_plane = stage_s + stage * 2 * Tile::PLANE;
#if !defined(RF_PA_NO_MATH)  // tuning builds: the copy path alone (outputs meaningless)
      math.tile(k_plane, k_plane + Tile::PLANE, t0, first, end, qscale, cap);
#endif
#if !defined(RF_AMD)
      if constexpr (!REG) {
        set_rows(stage, next_row);
        if (lane == 0) ok_s[stage][warp] = next_ok;
        rf_syncwarp();  // the warp's rows of this stage are rewritten by its next issue
      }
#endif
    }

    // The piece's result: each warp's share, rescaled to the CTA's max, in a region of its
    // own ([G][D] floats) of the stage the last tile used (idle until the next tile's copy,
    // after this): every warp at once where RF_PA_WARPS regions fit, else in turns, the
    // later ones adding to the first's.
    constexpr int FIT = 2 * Tile::PLANE / (G * D * 4);
    constexpr int REGIONS = FIT >= RF_PA_WARPS ? RF_PA_WARPS : FIT >= 2 ? 2 : 1;
    static_assert(RF_PA_WARPS % REGIONS == 0, "whole turns");
    float* const out_s = reinterpret_cast<float*>(
        stage_s + (stage == 0 ? STAGES - 1 : stage - 1) * 2 * Tile::PLANE);
    rf_sync();  // every warp is done with that stage and with the piece's queries
    if (tid == 0) {  // the next piece
      pieces_s[now ^ 1] = piece;
      more_pieces_s = pieces_s[now ^ 1].next(w);
    }
    math.publish(wm_s, wl_s);
    rf_sync();
    float m_cta[G], l_cta[G];
#pragma unroll
    for (int g = 0; g < G; ++g) {
      m_cta[g] = -RF_INF;
      l_cta[g] = 0.f;
#pragma unroll
      for (int v = 0; v < RF_PA_WARPS; ++v) m_cta[g] = rf_fmax(m_cta[g], wm_s[g][v]);
#pragma unroll
      for (int v = 0; v < RF_PA_WARPS; ++v)
        if (wl_s[g][v] > 0.f) l_cta[g] += rf_exp2(wm_s[g][v] - m_cta[g]) * wl_s[g][v];
    }
    float (*const mine)[D] = reinterpret_cast<float (*)[D]>(out_s + warp % REGIONS * G * D);
    for (int turn = 0; turn < RF_PA_WARPS / REGIONS; ++turn) {
      if (warp / REGIONS == turn) {
        if (turn == 0) math.template put<false>(mine, m_cta);
        else math.template put<true>(mine, m_cta);
      }
      if (turn + 1 < RF_PA_WARPS / REGIONS) rf_sync();
    }
    const bool more = more_pieces_s;
    rf_sync();  // the regions are written
    const rf_i64 c0 = piece.first_cta(w);
    const int pieces = (int)(piece.last_cta(w) - c0) + 1;
    const rf_i64 slot = 2 * (rf_i64)cta + (c0 == cta);  // this CTA's slot for the unit
    for (int i = tid; i < nh * D; i += RF_PA_THREADS) {
      const int g = i / D, d = i % D;
      float m = 0.f, l = 0.f;  // m_cta[g], l_cta[g] by selection: no indexed register array
#pragma unroll
      for (int h = 0; h < G; ++h) {
        m = h == g ? m_cta[h] : m;
        l = h == g ? l_cta[h] : l;
      }
      float o = 0.f;
#pragma unroll
      for (int r = 0; r < REGIONS; ++r) o += out_s[r * G * D + i];
      if constexpr (FP8) o *= o_scale;
      if (pieces == 1) {
        const rf_i64 head = (rf_i64)piece.s * num_q_heads + q0 + g;
        const float sink = sinks != nullptr ? rf_exp2(sinks[q0 + g] * RF_LOG2E - m) : 0.f;
        out[head * D + d] = E::from_float(l > 0.f ? o / (l + sink) : 0.f);
      } else {
        float* record = partials + (slot * G + g) * rf_pa_record<D>::FLOATS;
        record[d] = o;
        if (d == 0) {
          record[D] = m;
          record[D + 1] = l;
        }
      }
    }
    if (pieces > 1) {
      // The last piece of the unit to finish combines them all: each publishes its partials
      // (a barrier, then thread 0's fence and one count: the barrier orders every thread's
      // records before the fence, which is cumulative on NVIDIA; AMD fences each wave too);
      // the one that counts last resets the counter for the next launch and fences again
      // before the barrier after which its threads read the others' partials.
      RF_SHARED int last_s;
      rf_fence_device_before_barrier();
      rf_sync();
      if (tid == 0) {
        rf_fence_device();
        int* counter = counters + (rf_i64)piece.s * w.groups + piece.x;
        const bool last = rf_atomic_add_device(counter, 1) == pieces - 1;
        if (last) {
          *counter = 0;
          rf_fence_device();
        }
        last_s = last;
      }
      rf_sync();
      if (last_s) {
        const rf_i64 first_row = (rf_i64)piece.s * num_q_heads + q0;
        // records in flight a thread: fewer where the registers are at their cap (fp8's
        // register copy, groups of 1024+ outputs; gfx11's d256 G = 4 spilled at 4)
#if defined(RF_AMD)
        constexpr int TIGHT = RF_WARP == 32 ? 2 : 4;
#else
        constexpr int TIGHT = 4;
#endif
        constexpr int LOADS = FP8 || G * D >= 1024 ? TIGHT : 8;
        combine_pieces<E, D, G, LOADS>(out + first_row * D, partials, c0, pieces, nh, tid,
                                       out_s, sinks != nullptr ? sinks + q0 : nullptr);
      }
    }
    if (!more) return;
    // The next piece's queries: loaded into registers, they are waited for in its first
    // tile, after its copies; stored into shared memory, the barrier below publishes them.
    q0 = first_head(pieces_s[now ^ 1]);
    nh = heads(q0);
    math.load_queries(q, pieces_s[now ^ 1].s, num_q_heads, q0, nh, qscale);
    rf_fence_proxy_async();  // out_s's generic accesses before later bulk copies there
    rf_sync();  // every thread is done with this piece (its walk, out_s)
    now ^= 1;
  }
}

// rf_paged_attention_<E>[_e4m3]_d<D>_g<G>: queries and outputs of E, a cache of E (or of
// fp8 e4m3 codes: _e4m3).
#define RF_PA_KERNEL(NAME, E, C, D, G)                                                         \
  RF_KERNEL_OCCUPANCY(RF_PA_THREADS, (rf_pa_stage<E, C, D, G>::MIN_BLOCKS))                    \
  rf_paged_attention_##NAME##_d##D##_g##G(                                                     \
      E::storage* out, float* partials, int* counters, const E::storage* q,                    \
      const C::storage* k_cache, const C::storage* v_cache, const int* block_tables,           \
      const int* seq_lens, const rf_i64* cum16, const int* first_seq, float scale,             \
      int num_q_heads, int num_kv_heads, int max_blocks, int block_shift, int num_seqs,        \
      int uniform16, rf_i64 per_cta, rf_i64 total, float out_scale, float softcap,             \
      const float* sinks, int window) {                                                        \
    const int groups = num_kv_heads * ((num_q_heads / num_kv_heads + G - 1) / G);              \
    const rf_pa_work w{seq_lens, cum16, num_seqs, groups, uniform16, per_cta, total, window};  \
    paged_attention<E, C, D, G>(out, partials, counters, q, k_cache, v_cache,                 \
                                block_tables, w, first_seq, scale, num_q_heads, num_kv_heads,  \
                                max_blocks, block_shift, out_scale, softcap, sinks);           \
  }

#define RF_PA_HEAD_DIM(NAME, E, C, D)                                                          \
  RF_PA_KERNEL(NAME, E, C, D, 1)                                                               \
  RF_PA_KERNEL(NAME, E, C, D, 2)                                                               \
  RF_PA_KERNEL(NAME, E, C, D, 4)                                                               \
  RF_PA_KERNEL(NAME, E, C, D, 8)

#define RF_PA_DTYPE(NAME, E, C)                                                                \
  RF_PA_HEAD_DIM(NAME, E, C, 64)                                                               \
  RF_PA_HEAD_DIM(NAME, E, C, 128)                                                              \
  RF_PA_HEAD_DIM(NAME, E, C, 256)

#ifdef RF_PA_BENCH_ONLY  // tuning builds: just what the bench shapes use
RF_PA_KERNEL(f16, rf_f16, rf_f16, 128, 4) RF_PA_KERNEL(f16, rf_f16, rf_f16, 128, 1)
RF_PA_KERNEL(bf16, rf_bf16, rf_bf16, 128, 4) RF_PA_KERNEL(bf16, rf_bf16, rf_bf16, 128, 8)
RF_PA_KERNEL(f16_e4m3, rf_f16, rf_e4m3, 128, 4) RF_PA_KERNEL(f16_e4m3, rf_f16, rf_e4m3, 128, 1)
RF_PA_KERNEL(bf16_e4m3, rf_bf16, rf_e4m3, 128, 4) RF_PA_KERNEL(bf16_e4m3, rf_bf16, rf_e4m3, 128, 8)
#else
RF_PA_DTYPE(f16, rf_f16, rf_f16)
RF_PA_DTYPE(bf16, rf_bf16, rf_bf16)
RF_PA_DTYPE(f32, rf_f32, rf_f32)
RF_PA_DTYPE(f16_e4m3, rf_f16, rf_e4m3)
RF_PA_DTYPE(bf16_e4m3, rf_bf16, rf_e4m3)
#endif
