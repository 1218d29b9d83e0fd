// Paged-attention decode: one query token per sequence over an HND paged K/V cache.
//
// Layout (DESIGN.md): k_cache/v_cache [num_blocks, num_kv_heads, block_size, head_dim] of E;
// q/out [num_seqs, num_q_heads, head_dim]; block_tables int32 [num_seqs, max_blocks];
// seq_lens int32 [num_seqs]. Query head h reads kv head h / (num_q_heads / num_kv_heads).
//
// Work. A unit is (sequence s, group x): kv head x / chunks and up to G of its query heads
// (chunks = ceil(ratio / G) groups per kv head), so each K/V element of a unit is read once
// for the whole group. Units are laid end to end, s-major, each len16(s) work tokens long
// (its length rounded up to 16, at least 16, so an empty sequence still owns a position);
// CTA c takes the work range [c * per_cta, min((c + 1) * per_cta, total)), planned on the
// host so one wave of CTAs covers everything with equal shares. Unit lengths come from
// `cum16` (int64 [num_seqs + 1], exclusive prefix sums of len16, with `first_seq` [CTAs]:
// the sequence holding each CTA's first position) or, when the host does not know the
// lengths, are `uniform16` for every sequence (the kernel reads the real lengths and skips
// the rest).
//
// A CTA streams K and V through shared memory in tiles (RF_PA_STAGES pipeline stages filled
// by asynchronous copies) from one unit's piece to the next without draining: the copies of
// the next piece's first tiles are in flight while the last one is finished. Each warp owns
// a fixed share of every tile's rows: it copies them, scores them (tensor cores for 16-bit
// caches with 4+ heads per group, else TPT threads per token with q from shared memory),
// keeps its own online softmax in float32 (base-2 exponent) and accumulates their V, so the
// tile loop has warp barriers only; the warps are combined once per piece. A unit inside one
// CTA's range is written to `out`; a unit split across CTAs c0..c1 leaves unnormalised
// partial outputs plus (max, sum) in slot 2c + (c == c0) of each CTA c (`partials`: per slot
// and query head of the group, D floats then the pair), and the piece that
// finishes last combines them (a per-unit counter in `counters`, zero between launches: each
// launch resets what it uses).
#include "compat.h"

#define RF_PA_THREADS 128
#define RF_PA_WARPS (RF_PA_THREADS / RF_WARP)
#define RF_LOG2E 1.4426950408889634f
// Bytes of one pipeline stage (K + V of one tile) and the number of stages in dynamic shared
// memory: launches pass what planning.attention_shared_bytes computes from the same numbers.
// AMD copies synchronously, so more than two stages would only cost shared memory there.
#ifndef RF_PA_STAGE_BYTES
#if defined(RF_AMD)
#define RF_PA_STAGE_BYTES 16384
#else
#define RF_PA_STAGE_BYTES 32768
#endif
#endif
#ifndef RF_PA_STAGES
#define RF_PA_STAGES 2
#endif
#ifndef RF_PA_MIN_BLOCKS  // CTAs per multiprocessor the register budget is fitted to
#define RF_PA_MIN_BLOCKS 3
#endif

// Weight of a warp whose running max is m_warp in a sum rescaled to max m_cta (0 if empty).
RF_DEVICE float l_part_scale(float m_warp, float m_cta) {
  return m_warp == -RF_INF ? 0.f : rf_exp2(m_warp - m_cta);
}

// Shared-memory stage: the K and V rows of one tile (TILE_TOKENS tokens).
template <class E, int D>
struct rf_pa_tile {
  static constexpr int ROW_BYTES = D * (int)sizeof(typename E::storage);
  static constexpr int TOKENS = RF_PA_STAGE_BYTES / 2 / ROW_BYTES;  // 16..128
  static constexpr int VPR = ROW_BYTES / 16;                        // 16-byte chunks per row
  static constexpr int TPT = RF_PA_THREADS / TOKENS;                // threads per token (QK)
  static constexpr int CHUNKS = VPR / TPT;                          // chunks per thread (8)
  // Rows are padded by one 16-byte chunk, so chunk j of row r sits r + j banks groups on:
  // the 8 rows an ldmatrix reads, and the 8 chunks of a row a copy writes, are all in
  // different bank groups. A row stays contiguous, so one bulk copy can fill it.
  static constexpr int STRIDE = VPR + 1;                            // chunks per padded row
  static constexpr int UNITS = TOKENS * STRIDE;                     // chunks of K (or V)
  RF_DEVICE static int at(int row, int j) { return row * STRIDE + j; }
};

// Whether QK and PV run on tensor cores (mma.sync, NVIDIA sm_80+): for 16-bit caches with
// four heads or more per group (CUDA cores are as fast below) and 8 rows or more per warp.
template <class E, int G, int WROWS>
struct rf_pa_tensor_cores {
#if defined(RF_HAVE_MMA)
  static constexpr bool value = E::TENSOR_KIND != 0 && G >= 4 && WROWS >= 8;
#else
  static constexpr bool value = false;
#endif
};

// What the whole launch shares: the work's layout (see the top of this file).
struct rf_pa_work {
  const int* seq_lens;   // [num_seqs] tokens
  const rf_i64* cum16;   // [num_seqs + 1] or null (uniform16 for every sequence)
  int num_seqs, groups, uniform16;
  rf_i64 per_cta, total;  // work tokens per CTA (a multiple of 16) and in all
};

// One CTA's way through its work range: a piece [start, end) of one unit at a time.
// Everything is uniform across the threads that walk it. The next sequence's length and end
// are loaded one sequence ahead, so stepping into it waits for no load.
struct rf_pa_walker {
  int s, x;             // the unit: sequence, group
  int len, len16;       // tokens and work tokens of sequence s
  rf_i64 unit;          // work position of the unit's token 0
  rf_i64 range_end;     // end of this CTA's work range
  int start, end;       // this piece's tokens of the unit (end <= len)
  int next_len;         // tokens of sequence s + 1 (0 past the last)
  rf_i64 next_end16;    // cum16[s + 2]: where sequence s + 1's units end (cum16 mode)

  RF_DEVICE void fetch_next(const rf_pa_work& w) {
    next_len = s + 1 < w.num_seqs ? w.seq_lens[s + 1] : 0;
    next_end16 = w.cum16 != nullptr && s + 2 <= w.num_seqs ? w.cum16[s + 2] : 0;
  }
  RF_DEVICE void clip(rf_i64 from) {  // the piece: work positions [from, range_end) of unit
    const rf_i64 work_end = range_end - unit < len16 ? range_end - unit : len16;
    end = work_end < len ? (int)work_end : len;
    start = (int)(from - unit) < end ? (int)(from - unit) : end;
  }
  // Positions the walker at CTA c's first piece.
  RF_DEVICE void begin(const rf_pa_work& w, const int* first_seq, int c) {
    const rf_i64 p0 = (rf_i64)c * w.per_cta;
    range_end = p0 + w.per_cta < w.total ? p0 + w.per_cta : w.total;
    rf_i64 base;
    if (w.cum16 != nullptr) {
      s = first_seq[c];
      base = w.cum16[s] * w.groups;
      len16 = (int)(w.cum16[s + 1] - w.cum16[s]);
    } else {
      len16 = w.uniform16;
      s = (int)(p0 / ((rf_i64)w.groups * len16));
      base = (rf_i64)s * w.groups * len16;
    }
    len = w.seq_lens[s];
    x = (int)((p0 - base) / len16);
    unit = base + (rf_i64)x * len16;
    fetch_next(w);
    clip(p0);
  }
  // Moves to the next piece; false (and the walker unchanged) when the range is done.
  RF_DEVICE bool next(const rf_pa_work& w) {
    if (unit + len16 >= range_end) return false;  // this unit reaches the range's end
    unit += len16;
    if (++x == w.groups) {
      x = 0;
      ++s;
      len16 = w.cum16 != nullptr ? (int)(next_end16 - (unit / w.groups)) : w.uniform16;
      len = next_len;
      fetch_next(w);
    }
    clip(unit);
    return true;
  }
  // CTAs whose ranges hold part of this unit: [first, last].
  RF_DEVICE rf_i64 first_cta(const rf_pa_work& w) const { return unit / w.per_cta; }
  RF_DEVICE rf_i64 last_cta(const rf_pa_work& w) const { return (unit + len16 - 1) / w.per_cta; }
};

// Combines the pieces of one (unit, query head) with one warp:
// out = sum_p w_p o_p / sum_p w_p l_p with w_p = 2^(m_p - max_p m_p), from the unnormalised
// partial outputs and (max, sum) pairs that CTAs c0 .. c0 + pieces - 1 wrote for head g of
// the group (slot 2c + (c == c0); read past L1, after the caller's device-scope fence).
// Lane owns dims lane + k*WARP.
template <class E, int D, int G>
RF_DEVICE void combine_pieces(typename E::storage* __restrict__ out, const float* partials,
                              rf_i64 c0, int pieces, int g, int lane) {
  constexpr int PER = D / RF_WARP;
  auto at = [&](int p) -> const float* {  // piece p's record: D floats, then (max, sum)
    return partials + ((2 * (c0 + p) + (p == 0)) * G + g) * (D + 2);
  };
  float m = -RF_INF;
  for (int p = lane; p < pieces; p += RF_WARP) m = rf_fmax(m, rf_load_cg(at(p) + D));
  m = rf_warp_max(m);
  float total = 0.f, o[PER];
  for (int p = lane; p < pieces; p += RF_WARP) {
    const float l = rf_load_cg(at(p) + D + 1);
    total += l > 0.f ? rf_exp2(rf_load_cg(at(p) + D) - m) * l : 0.f;
  }
  total = rf_warp_sum(total);
#pragma unroll
  for (int e = 0; e < PER; ++e) o[e] = 0.f;
#pragma unroll 4
  for (int p = 0; p < pieces; ++p) {
    const float* record = at(p);
    const float l = rf_load_cg(record + D + 1);
    const float w = l > 0.f ? rf_exp2(rf_load_cg(record + D) - m) : 0.f;
#pragma unroll
    for (int e = 0; e < PER; ++e) o[e] += w * rf_load_cg(record + lane + e * RF_WARP);
  }
  const float inv = total > 0.f ? 1.f / total : 0.f;
#pragma unroll
  for (int e = 0; e < PER; ++e) out[lane + e * RF_WARP] = E::from_float(o[e] * inv);
}

// CUDA-core QK: the group's queries of sequence s, scaled, into q_s (zeros past nh heads).
template <class E, int D, int G>
RF_DEVICE void load_queries(float (*q_s)[D], const typename E::storage* __restrict__ q, int s,
                            int num_q_heads, int q0, int nh, float qscale, int tid) {
  for (int i = tid; i < G * D; i += RF_PA_THREADS) {
    const int g = i / D, d = i % D;
    q_s[g][d] = g < nh ? E::to_float(q[((rf_i64)s * num_q_heads + q0 + g) * D + d]) * qscale
                       : 0.f;
  }
}

template <class E, int D, int G>
RF_DEVICE void paged_attention(
    typename E::storage* __restrict__ out, float* __restrict__ partials,
    int* __restrict__ counters,
    const typename E::storage* __restrict__ q,
    const typename E::storage* __restrict__ k_cache,
    const typename E::storage* __restrict__ v_cache, const int* __restrict__ block_tables,
    const rf_pa_work& w, const int* __restrict__ first_seq, float scale, int num_q_heads,
    int num_kv_heads, int max_blocks, int block_shift) {
  typedef rf_pa_tile<E, D> Tile;
  constexpr int PV = E::PER_VEC, T = Tile::TOKENS, VPR = Tile::VPR, TPT = Tile::TPT;
  constexpr int CHUNKS = Tile::CHUNKS;
  // Each warp owns WROWS rows of every tile, for the copy, QK, softmax and V alike, with its
  // own online softmax state: no block-wide barrier inside the tile loop.
  constexpr int WROWS = T / RF_PA_WARPS;
  constexpr int LPR = VPR < RF_WARP ? VPR : RF_WARP;  // V: lanes per row
  constexpr int CPL = VPR / LPR;                       // V: chunks per lane
  constexpr int VSTEP = RF_WARP / LPR;                 // V: rows a warp covers per step
  static_assert(CHUNKS * TPT == VPR && T * TPT == RF_PA_THREADS, "tile shape");
  static_assert(WROWS * TPT == RF_WARP, "a warp's QK rows are its V rows");

  constexpr int STAGES = RF_PA_STAGES;
  static_assert(STAGES >= 2, "the pipeline needs two stages at least");
  RF_DYNAMIC_SHARED(rf_vec16, stage_s);  // [STAGES][K, V][T rows][VPR + 1 chunks]
  constexpr bool TENSOR = rf_pa_tensor_cores<E, G, WROWS>::value;
  // CUDA-core QK: the queries, scaled, and each row's weight per head in float32; tensor
  // cores: the weights rounded to the cache's type, as the PV product takes them
  RF_SHARED __attribute__((aligned(16))) float q_s[TENSOR ? 1 : G][TENSOR ? 4 : D];
  RF_SHARED float p_s[TENSOR ? 1 : G][TENSOR ? 1 : T];
  RF_SHARED typename E::storage p16_s[TENSOR ? G : 1][TENSOR ? T : 1];
  RF_SHARED float wm_s[G][RF_PA_WARPS], wl_s[G][RF_PA_WARPS];  // per-warp max and sum
  static_assert(G * D * 4 <= RF_PA_STAGE_BYTES, "a piece's output fits in one stage");

  const int tid = (int)rf_tid(), lane = tid % RF_WARP, warp = tid / RF_WARP;
  const int cta = (int)rf_bid_x();
  const int ratio = num_q_heads / num_kv_heads, chunks = (ratio + G - 1) / G;
  const int block_size = 1 << block_shift;
  const float qscale = scale * RF_LOG2E;

  // Each warp copies its own rows of every tile, so a tile needs warp barriers only. Rows
  // (of the cache's [num_blocks * num_kv_heads * block_size, D] rows, fewer than 2^31 as
  // the host checks; -1 past the piece's end) come from row_s, which lane l
  // fills for row row0 + l one tile ahead of the copy that uses them; ok_s says whether the
  // stage's tile exists at all.
  RF_SHARED int row_s[STAGES][T];
  RF_SHARED bool ok_s[STAGES][RF_PA_WARPS];
  const int my_row = tid / TPT, my_chunk0 = (tid % TPT) * CHUNKS;  // QK share of a tile
  static_assert(WROWS * VPR % RF_WARP == 0 && WROWS <= RF_WARP, "copy shape");
  const int row0 = warp * WROWS;
  // The walks: each warp's walk of the pieces STAGES tiles ahead of the computation, and the
  // CTA's walk of the pieces it computes, live in shared memory and move (lane 0 of the warp,
  // thread 0 of the CTA) only from one piece to the next; the tile ahead within its piece is
  // in registers, uniform across the warp.
  RF_SHARED rf_pa_walker ahead_s[RF_PA_WARPS];
  RF_SHARED bool ahead_done_s[RF_PA_WARPS];
  RF_SHARED rf_pa_walker piece_s;
  RF_SHARED bool more_pieces_s;
  rf_pa_walker& ahead = ahead_s[warp];
  const rf_pa_walker& piece = piece_s;
  if (lane == 0) ahead.begin(w, first_seq, cta);
  if (tid == 0) piece_s.begin(w, first_seq, cta);
  rf_syncwarp();
  const int* a_table = nullptr;  // the tile ahead: its sequence's block table, kv head, first
  int a_kvh = 0, a_t = 0, a_end = 0;  // token and its piece's end; a_ok: it exists
  bool a_ok = true;
  auto enter_piece = [&]() {  // the registers from the walk
    a_table = block_tables + (rf_i64)ahead.s * max_blocks;
    a_kvh = ahead.x / chunks;
    a_t = ahead.start;
    a_end = ahead.end;
  };
  auto next_piece = [&]() {  // the walk to the next piece with tokens (warp-uniform call)
    rf_syncwarp();  // every lane has read the walk
    if (lane == 0) {
      bool more;
      do more = ahead.next(w); while (more && ahead.start >= ahead.end);
      ahead_done_s[warp] = !more;
    }
    rf_syncwarp();
    a_ok = !ahead_done_s[warp];
    if (a_ok) enter_piece();
  };
  auto advance = [&]() {  // the tile after the one ahead
    a_t += T;
    if (a_ok && a_t >= a_end) next_piece();
  };
  enter_piece();
  if (a_t >= a_end) next_piece();
  auto row_offset = [&]() -> int {  // cache row of row row0 + lane of the tile ahead
    const int tok = a_t + row0 + lane;
    if (!a_ok || lane >= WROWS || tok >= a_end) return -1;
    return (a_table[tok >> block_shift] * num_kv_heads + a_kvh) * block_size +
           (tok & (block_size - 1));
  };
#if defined(RF_HAVE_BULK)
  // sm_90: lane c copies one whole row (K for c < WROWS, else V) with the bulk copy engine,
  // completing on the warp's barrier of the stage; lane 0 tells it how many bytes to expect
  RF_SHARED rf_u64 bar_s[STAGES][RF_PA_WARPS];
  auto issue = [&](int stage) {
    unsigned bytes = 0;
    for (int c = lane; c < 2 * WROWS; c += RF_WARP) {
      const int row = row0 + c % WROWS, kv = c / WROWS;
      const int cache_row = row_s[stage][row];
      rf_vec16* dst = stage_s + (stage * 2 + kv) * Tile::UNITS + Tile::at(row, 0);
      if (cache_row >= 0) {
        rf_bulk_copy(dst, (kv ? v_cache : k_cache) + (rf_i64)cache_row * D, Tile::ROW_BYTES,
                     &bar_s[stage][warp]);
        bytes += Tile::ROW_BYTES;
      } else {  // past the end: zeros, so products over whole 16-row tiles stay finite
        for (int j = 0; j < VPR; ++j) dst[j] = rf_vec16{0u, 0u, 0u, 0u};
        rf_fence_proxy_async();  // before a later tile's bulk copy into this row
      }
    }
    bytes = rf_warp_sum_u32(bytes);
    if (lane == 0) rf_mbar_expect_tx(&bar_s[stage][warp], bytes);
  };
#else
  // cp.async (or, on AMD, plain) copies, coalesced: piece p = it * WARP + lane of the warp's
  // rows is chunk p % VPR of row row0 + p / VPR
  auto issue = [&](int stage) {
    rf_vec16* k_dst = stage_s + (stage * 2 + 0) * Tile::UNITS;
    rf_vec16* v_dst = stage_s + (stage * 2 + 1) * Tile::UNITS;
#pragma unroll
    for (int it = 0; it < WROWS * VPR / RF_WARP; ++it) {
      const int piece = it * RF_WARP + lane, row = row0 + piece / VPR, j = piece % VPR;
      const int cache_row = row_s[stage][row];
      const rf_i64 offset = (rf_i64)cache_row * D;
      const int at = Tile::at(row, j);
      if (cache_row >= 0) {
        rf_copy16_async(k_dst + at, reinterpret_cast<const rf_vec16*>(k_cache + offset) + j);
        rf_copy16_async(v_dst + at, reinterpret_cast<const rf_vec16*>(v_cache + offset) + j);
      } else {  // past the end: zeros, so products over whole 16-row tiles stay finite
        k_dst[at] = rf_vec16{0u, 0u, 0u, 0u};
        v_dst[at] = rf_vec16{0u, 0u, 0u, 0u};
      }
    }
    rf_copy_commit();
  };
#endif

  // prologue: row offsets of tiles 0 .. STAGES-1, then tiles 0 .. STAGES-2 in flight
#pragma unroll
  for (int st = 0; st < STAGES; ++st) {
    const int cache_row = row_offset();
    if (lane < WROWS) row_s[st][row0 + lane] = cache_row;
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

  rf_sync();  // piece_s is set
  int kvh = piece.x / chunks, q0 = kvh * ratio + (piece.x % chunks) * G;
  int nh = ratio - (q0 - kvh * ratio) < G ? ratio - (q0 - kvh * ratio) : G;

  // Tensor-core QK: S^T[16 tokens x 8 heads] = K[16 x D] . Q^T[D x 8] per warp and m-tile, K
  // by ldmatrix from the padded stage, Q^T fragments in registers, or for D > 128 (where
  // registers are short) read per k-step from q16_s, rows padded by 16 bytes so the
  // fragment reads are conflict-free; heads past the group are zero, and scores are scaled
  // after the product.
  constexpr bool Q_IN_SMEM = TENSOR && D > 128;
  RF_SHARED typename E::storage q16_s[Q_IN_SMEM ? 8 : 1][Q_IN_SMEM ? D + 8 : 2];
#if defined(RF_HAVE_MMA)
  constexpr int KSTEPS = D / 16, MROWS = WROWS < 16 ? WROWS : 16;
  constexpr int MTILES = WROWS < 16 ? 1 : WROWS / 16;
  unsigned qb[TENSOR && !Q_IN_SMEM ? KSTEPS : 1][2];
#endif
  auto load_piece_queries = [&]() {  // this piece's queries where its QK reads them
    if constexpr (!TENSOR) {
      load_queries<E, D, G>(q_s, q, piece.s, num_q_heads, q0, nh, qscale, tid);
    } else if constexpr (Q_IN_SMEM) {
      for (int i = tid; i < 8 * D; i += RF_PA_THREADS) {
        const int g = i / D, d = i % D;
        q16_s[g][d] = g < nh ? q[((rf_i64)piece.s * num_q_heads + q0 + g) * D + d] : 0;
      }
    } else {
#if defined(RF_HAVE_MMA)
      const int head = lane / 4, k0 = (lane % 4) * 2;
      const typename E::storage* qrow = q + ((rf_i64)piece.s * num_q_heads + q0 + head) * D;
#pragma unroll
      for (int ks = 0; ks < KSTEPS; ++ks)
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const int d = ks * 16 + half * 8 + k0;
          qb[ks][half] = head < nh ? (unsigned)qrow[d] | ((unsigned)qrow[d + 1] << 16) : 0u;
        }
#endif
    }
  };
  load_piece_queries();
  rf_sync();

#if defined(RF_HAVE_MMA)
  // Tensor-core PV: O^T[16 dims x 8 heads] per dim tile; this lane holds dims lane/4 (+8)
  // and heads (lane%4)*2 (+1) of each.
  constexpr int DTILES = D / 16;
  float acc2[TENSOR ? DTILES : 1][4];
#endif
  const int vrow0 = warp * WROWS + lane / LPR, vchunk0 = (lane % LPR) * CPL;
  float acc[G][CPL * PV], m_run[G], l_part[G];

  int stage = 0, tile = 0;  // the next tile to compute: its stage and its index in the stream
  for (;;) {  // pieces
#if defined(RF_HAVE_MMA)
#pragma unroll
    for (int dt = 0; dt < (TENSOR ? DTILES : 1); ++dt)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc2[dt][e] = 0.f;
#endif
#pragma unroll
    for (int g = 0; g < G; ++g) {
      m_run[g] = -RF_INF;
      l_part[g] = 0.f;
#pragma unroll
      for (int e = 0; e < CPL * PV; ++e) acc[g][e] = 0.f;
    }
    const int end = piece.end;
    for (int t0 = piece.start; t0 < end;
         t0 += T, ++tile, stage = stage + 1 == STAGES ? 0 : stage + 1) {
      // keep STAGES-1 tiles in flight: issue tile `tile + STAGES-1` into the stage freed by
      // the previous tile, then wait for this tile only; the block ids of the tile after
      // that load meanwhile and land in row_s[stage] at the end of this tile
      const int next_row = row_offset();
      const bool next_ok = a_ok;
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
      const rf_vec16* k_s = stage_s + (stage * 2 + 0) * Tile::UNITS;
      const rf_vec16* v_s = stage_s + (stage * 2 + 1) * Tile::UNITS;

#if defined(RF_HAVE_MMA)
      if constexpr (TENSOR) {
        float sc[MTILES][4];
        const int row_in = (lane % 8) + 8 * ((lane / 8) % 2);
#pragma unroll
        for (int mt = 0; mt < MTILES; ++mt) {
          float odd[4] = {0.f, 0.f, 0.f, 0.f};  // odd k-steps: two chains of dependent mma
          sc[mt][0] = sc[mt][1] = sc[mt][2] = sc[mt][3] = 0.f;
          const int row = warp * WROWS + mt * 16 + row_in % MROWS;
#pragma unroll
          for (int ks = 0; ks < KSTEPS; ++ks) {
            unsigned a[4];
            rf_ldmatrix_x4<false>(a, &k_s[Tile::at(row, ks * 2 + lane / 16)]);
            unsigned b[2];
            if constexpr (Q_IN_SMEM) {
              const unsigned* row = reinterpret_cast<const unsigned*>(
                  &q16_s[lane / 4][ks * 16 + (lane % 4) * 2]);
              b[0] = row[0];
              b[1] = row[4];
            } else {
              b[0] = qb[ks][0];
              b[1] = qb[ks][1];
            }
            rf_mma16816<E::TENSOR_KIND>(ks % 2 ? odd : sc[mt], a, b);
          }
#pragma unroll
          for (int e = 0; e < 4; ++e) sc[mt][e] += odd[e];
        }
        // thread holds rows lane/4 (+8) of each m-tile, heads h0 = (lane%4)*2 and h0 + 1
        const int h0 = (lane % 4) * 2;
        float mx[2] = {-RF_INF, -RF_INF};
#pragma unroll
        for (int mt = 0; mt < MTILES; ++mt)
#pragma unroll
          for (int r = 0; r < 2; ++r) {
            const int row = warp * WROWS + mt * 16 + lane / 4 + 8 * r;
            const bool valid = (r == 0 || MROWS == 16) && t0 + row < end;
#pragma unroll
            for (int hh = 0; hh < 2; ++hh) {
              sc[mt][r * 2 + hh] = valid ? sc[mt][r * 2 + hh] * qscale : -RF_INF;
              mx[hh] = rf_fmax(mx[hh], sc[mt][r * 2 + hh]);
            }
          }
#pragma unroll
        for (int m = 4; m < 32; m <<= 1) {
          mx[0] = rf_fmax(mx[0], rf_shfl_xor(mx[0], m));
          mx[1] = rf_fmax(mx[1], rf_shfl_xor(mx[1], m));
        }
        float m_new[G], alpha_h[2] = {1.f, 1.f};
#pragma unroll
        for (int g = 0; g < G; ++g) {
          m_new[g] = rf_fmax(m_run[g], rf_shfl(g % 2 ? mx[1] : mx[0], g / 2));
          const float alpha = m_run[g] == -RF_INF ? 0.f : rf_exp2(m_run[g] - m_new[g]);
          l_part[g] *= alpha;
          m_run[g] = m_new[g];
          alpha_h[0] = g == (lane % 4) * 2 ? alpha : alpha_h[0];
          alpha_h[1] = g == (lane % 4) * 2 + 1 ? alpha : alpha_h[1];
        }
#pragma unroll
        for (int dt = 0; dt < DTILES; ++dt) {
          acc2[dt][0] *= alpha_h[0];
          acc2[dt][1] *= alpha_h[1];
          acc2[dt][2] *= alpha_h[0];
          acc2[dt][3] *= alpha_h[1];
        }
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
          const int h = h0 + hh;
          float m_h = -RF_INF;
#pragma unroll
          for (int g = 0; g < G; ++g) m_h = g == h ? m_new[g] : m_h;
          float sum = 0.f;
#pragma unroll
          for (int mt = 0; mt < MTILES; ++mt)
#pragma unroll
            for (int r = 0; r < 2; ++r) {
              const int row = warp * WROWS + mt * 16 + lane / 4 + 8 * r;
              const float x = sc[mt][r * 2 + hh];
              const float p = x == -RF_INF ? 0.f : rf_exp2(x - m_h);
              if (h < G && (r == 0 || MROWS == 16)) p16_s[h][row] = E::from_float(p);
              sum += p;
            }
#pragma unroll
          for (int g = 0; g < G; ++g) l_part[g] += g == h ? sum : 0.f;
        }
      } else
#endif
      {
        // scores: TPT threads per token, each over CHUNKS chunks, then summed across them
        const int tok = t0 + my_row;
        float s[G], s_odd[G];  // two accumulators: chunks alternate, halving the FMA chains
#pragma unroll
        for (int g = 0; g < G; ++g) s[g] = s_odd[g] = 0.f;
#pragma unroll
        for (int c = 0; c < CHUNKS; ++c) {
          // chunks rotate by thread, so the 8 lanes of a shared-memory phase hit 8 bank groups
          const int j = my_chunk0 + (c + (tid % TPT) * (8 / TPT)) % CHUNKS;
          float k[PV];
          E::unpack(k_s[Tile::at(my_row, j)], k);
#pragma unroll
          for (int g = 0; g < G; ++g) {
            float dot = 0.f;
#pragma unroll
            for (int e = 0; e < PV; e += 4) {
              const rf_float4 qv = *reinterpret_cast<const rf_float4*>(&q_s[g][j * PV + e]);
              dot += qv.x * k[e] + qv.y * k[e + 1] + qv.z * k[e + 2] + qv.w * k[e + 3];
            }
            if (c & 1) s_odd[g] += dot; else s[g] += dot;
          }
        }
#pragma unroll
        for (int g = 0; g < G; ++g) s[g] += s_odd[g];
        // online softmax over this warp's rows (every lane of the warp gets the same max)
        const bool leader = tid % TPT == 0;
#pragma unroll
        for (int g = 0; g < G; ++g) {
#pragma unroll
          for (int m = 1; m < TPT; m <<= 1) s[g] += rf_shfl_xor(s[g], m);
          if (tok >= end) s[g] = -RF_INF;
          const float m_new = rf_fmax(m_run[g], rf_warp_max(s[g]));
          const float alpha = m_run[g] == -RF_INF ? 0.f : rf_exp2(m_run[g] - m_new);
          const float p = tok < end ? rf_exp2(s[g] - m_new) : 0.f;
          if (leader) p_s[g][my_row] = p;
          l_part[g] = l_part[g] * alpha + (leader ? p : 0.f);
          m_run[g] = m_new;
#pragma unroll
          for (int e = 0; e < CPL * PV; ++e) acc[g][e] *= alpha;
        }
      }
      rf_syncwarp();
#if defined(RF_HAVE_MMA)
      if constexpr (TENSOR) {  // O^T += V^T[16 dims x 16 tokens] . P^T[16 tokens x 8 heads]
        const int head = lane / 4, k0 = (lane % 4) * 2;
#pragma unroll
        for (int mt = 0; mt < MTILES; ++mt) {
          const int base = warp * WROWS + mt * 16;
          unsigned b[2];
#pragma unroll
          for (int half = 0; half < 2; ++half) {
            const int k = k0 + half * 8;
            const bool ok = head < G && k < MROWS;
            const typename E::storage* p = p16_s[head < G ? head : 0] + base + k;
            b[half] = ok ? (unsigned)p[0] | ((unsigned)p[1] << 16) : 0u;
          }
          const int row = base + ((lane % 8) + 8 * (lane / 16)) % MROWS;
#pragma unroll
          for (int dt = 0; dt < DTILES; ++dt) {
            unsigned a[4];
            rf_ldmatrix_x4<true>(a, &v_s[Tile::at(row, dt * 2 + (lane / 8) % 2)]);
            rf_mma16816<E::TENSOR_KIND>(acc2[dt], a, b);
          }
        }
      } else
#endif
      {
        // values: lane owns chunks [vchunk0, vchunk0 + CPL) of rows vrow0, vrow0 + VSTEP, ...
        const int rows = end - t0 < T ? end - t0 : T;
        for (int r = vrow0; r < (warp + 1) * WROWS; r += VSTEP) {
          if (r < rows) {
#pragma unroll
            for (int cc = 0; cc < CPL; ++cc) {
              float v[PV];
              E::unpack(v_s[Tile::at(r, vchunk0 + cc)], v);
#pragma unroll
              for (int g = 0; g < G; ++g) {
                const float p = p_s[g][r];
#pragma unroll
                for (int e = 0; e < PV; ++e) acc[g][cc * PV + e] += p * v[e];
              }
            }
          }
        }
      }
      if (lane < WROWS) row_s[stage][row0 + lane] = next_row;
      if (lane == 0) ok_s[stage][warp] = next_ok;
      rf_syncwarp();  // the warp's rows of this stage are rewritten by its next issue
    }

    // The piece's result: warps combined, rescaled to the CTA's max, into out_s, which is
    // the stage the last tile used (idle until the next tile's issue, after this).
    float (*out_s)[D] = reinterpret_cast<float (*)[D]>(
        stage_s + (stage == 0 ? STAGES - 1 : stage - 1) * 2 * Tile::UNITS);
    rf_sync();  // every warp is done with that stage
    for (int i = tid; i < G * D; i += RF_PA_THREADS) out_s[i / D][i % D] = 0.f;
#pragma unroll
    for (int g = 0; g < G; ++g) {
      if constexpr (!TENSOR) {
#pragma unroll
        for (int m = LPR; m < RF_WARP; m <<= 1)
#pragma unroll
          for (int e = 0; e < CPL * PV; ++e) acc[g][e] += rf_shfl_xor(acc[g][e], m);
      }
      const float l = rf_warp_sum(l_part[g]);
      if (lane == 0) {
        wm_s[g][warp] = m_run[g];
        wl_s[g][warp] = l;
      }
    }
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
    for (int v = 0; v < RF_PA_WARPS; ++v) {
#if defined(RF_HAVE_MMA)
      if constexpr (TENSOR) {
        if (warp == v) {
#pragma unroll
          for (int hh = 0; hh < 2; ++hh) {
            const int h = (lane % 4) * 2 + hh;
            float m_w = -RF_INF, m_c = 0.f;
#pragma unroll
            for (int g = 0; g < G; ++g) {
              m_w = g == h ? m_run[g] : m_w;
              m_c = g == h ? m_cta[g] : m_c;
            }
            const float scale_w = l_part_scale(m_w, m_c);
#pragma unroll
            for (int dt = 0; dt < DTILES; ++dt)
#pragma unroll
              for (int r = 0; r < 2; ++r)
                if (h < G) out_s[h][dt * 16 + lane / 4 + 8 * r] += scale_w * acc2[dt][r * 2 + hh];
          }
        }
        rf_sync();
        continue;
      }
#endif
      if (warp == v && lane < LPR) {
#pragma unroll
        for (int g = 0; g < G; ++g) {
          const float scale_w = l_part_scale(m_run[g], m_cta[g]);
#pragma unroll
          for (int e = 0; e < CPL * PV; ++e) out_s[g][vchunk0 * PV + e] += scale_w * acc[g][e];
        }
      }
      rf_sync();
    }
    const rf_i64 c0 = piece.first_cta(w);
    const int pieces = (int)(piece.last_cta(w) - c0) + 1;
    const rf_i64 slot = 2 * (rf_i64)cta + (c0 == cta);  // this CTA's slot for the unit
    for (int i = tid; i < nh * D; i += RF_PA_THREADS) {
      const int g = i / D, d = i % D;
      if (pieces == 1) {
        const rf_i64 head = (rf_i64)piece.s * num_q_heads + q0 + g;
        out[head * D + d] = E::from_float(l_cta[g] > 0.f ? out_s[g][d] / l_cta[g] : 0.f);
      } else {
        float* record = partials + (slot * G + g) * (D + 2);
        record[d] = out_s[g][d];
        if (d == 0) {
          record[D] = m_cta[g];
          record[D + 1] = l_cta[g];
        }
      }
    }
    if (pieces > 1) {
      // The last piece of the unit to finish combines them all: each publishes its partials
      // (fence, then one count); the one that counts last resets the counter for the next
      // launch and reads the others' partials after a fence.
      RF_SHARED int last_s;
      rf_fence_device();
      rf_sync();
      if (tid == 0) {
        int* counter = counters + (rf_i64)piece.s * w.groups + piece.x;
        last_s = rf_atomic_add_device(counter, 1) == pieces - 1;
        if (last_s) *counter = 0;
      }
      rf_sync();
      if (last_s) {
        rf_fence_device();
        for (int g = warp; g < nh; g += RF_PA_WARPS) {
          const rf_i64 head = (rf_i64)piece.s * num_q_heads + q0 + g;
          combine_pieces<E, D, G>(out + head * D, partials, c0, pieces, g, lane);
        }
      }
    }
    rf_fence_proxy_async();  // out_s's generic accesses before later bulk copies there
    rf_sync();  // every thread is done with this piece (piece_s, out_s)
    if (tid == 0) more_pieces_s = piece_s.next(w);
    rf_sync();
    if (!more_pieces_s) return;
    kvh = piece.x / chunks;
    q0 = kvh * ratio + (piece.x % chunks) * G;
    nh = ratio - (q0 - kvh * ratio) < G ? ratio - (q0 - kvh * ratio) : G;
    load_piece_queries();
    if constexpr (!TENSOR || Q_IN_SMEM) rf_sync();
  }
}

#define RF_PA_KERNEL(NAME, E, D, G)                                                            \
  RF_KERNEL_OCCUPANCY(RF_PA_THREADS, RF_PA_MIN_BLOCKS)                                         \
  rf_paged_attention_##NAME##_d##D##_g##G(                                                     \
      E::storage* out, float* partials, int* counters, const E::storage* q,                    \
      const E::storage* k_cache, const E::storage* v_cache, const int* block_tables,           \
      const int* seq_lens, const rf_i64* cum16, const int* first_seq, float scale,             \
      int num_q_heads, int num_kv_heads, int max_blocks, int block_shift, int num_seqs,        \
      int uniform16, rf_i64 per_cta, rf_i64 total) {                                           \
    const int groups = num_kv_heads * ((num_q_heads / num_kv_heads + G - 1) / G);              \
    const rf_pa_work w{seq_lens, cum16, num_seqs, groups, uniform16, per_cta, total};          \
    paged_attention<E, D, G>(out, partials, counters, q, k_cache, v_cache,                    \
                             block_tables, w, first_seq, scale, num_q_heads, num_kv_heads,     \
                             max_blocks, block_shift);                                         \
  }

#define RF_PA_HEAD_DIM(NAME, E, D)                                                             \
  RF_PA_KERNEL(NAME, E, D, 1)                                                                  \
  RF_PA_KERNEL(NAME, E, D, 2)                                                                  \
  RF_PA_KERNEL(NAME, E, D, 4)                                                                  \
  RF_PA_KERNEL(NAME, E, D, 8)

#define RF_PA_DTYPE(NAME, E)                                                                   \
  RF_PA_HEAD_DIM(NAME, E, 64)                                                                  \
  RF_PA_HEAD_DIM(NAME, E, 128)                                                                 \
  RF_PA_HEAD_DIM(NAME, E, 256)

#ifdef RF_PA_BENCH_ONLY  // tuning builds: just what the bench shapes use
RF_PA_KERNEL(f16, rf_f16, 128, 4) RF_PA_KERNEL(f16, rf_f16, 128, 1)
RF_PA_KERNEL(bf16, rf_bf16, 128, 4) RF_PA_KERNEL(bf16, rf_bf16, 128, 8)
#else
RF_PA_DTYPE(f16, rf_f16)
RF_PA_DTYPE(bf16, rf_bf16)
RF_PA_DTYPE(f32, rf_f32)
#endif
