// Paged attention over many query tokens per sequence: prefill over cached prefixes, chunked
// prefill, speculative verification, decodes mixed in (DESIGN.md, "Attention over many query
// tokens").
//
// Layout: q/out [total_q, num_q_heads, head_dim]; sequence s owns query rows q_starts[s] ..
// q_starts[s + 1] - 1 (its q_len newest tokens, in order) and has seq_lens[s] tokens in the
// cache (the new ones written already); query i of s sees positions 0 .. kv_len - q_len + i,
// or with a sliding window of W > 0 tokens its last W of them (kv_len - q_len + i - W + 1 ..).
// The cache, tables and GQA mapping are the decode kernel's (paged_attention.cu).
//
// Work. The query rows of one sequence and kv head are packed head-minor: packed row r is
// token r / ratio, query head x * ratio + r % ratio, so one KV tile serves every query head of
// its group (ratio = num_q_heads / num_kv_heads). A work item (`items`, int32 x 4 from the
// host: s, row0, x | k << 16, n) is packed rows [row0, row0 + BM) of sequence s and kv head
// x, over piece k of n of their KV range: the range ends where the tile's last row stops
// seeing (positions past it are never read: tiles wholly above the causal diagonal are
// skipped; with a window it starts at the tile holding the first position the tile's first
// row sees, and positions before that are zero-filled, never read: their blocks may have been
// freed), and is cut into n runs of whole KV tiles. One CTA an item, the host ordering the
// items longest first. A piece of a split item (n > 1) leaves its rows' unnormalised
// output, max and sum in record (item * BM + row) of `partials` (D + 4 floats: output, max,
// sum, two unused), and rf_prefill_combine merges the pieces (pieces come first in `items`,
// so their record slots are their item indices). An item (or a combine) of n = 0 is padding
// and does nothing: a graph's fixed grid serves steps of fewer items.
//
// Pipeline. The CTA's queries and each KV tile go to shared memory (pf_tile.h): NVIDIA by
// 16-byte cp.async copies, STAGES deep (tiles t + 1 .. t + STAGES - 1 in flight while tile t
// is computed), an fp8 cache's codes widened into E rows once a tile has arrived; AMD by synchronous 16-byte loads
// into one stage, fp8 codes widened on the way. The math (pf_math.h) runs per warp over its
// 16 rows (WM = 4) or over its quarter of every tile's tokens (WM = 1, the warps' softmax
// states merged at the end).
#include "compat.h"
#include "pf_math.h"
#include "pf_tile.h"

#define RF_PF_LOG2E 1.4426950408889634f

// Where one item's rows and KV lie, read from its entry and the lengths.
struct rf_pf_item {
  int s, row0, x, k, n;
  int q_begin, q_len, kv_len, rows;  // rows: q_len * ratio packed rows of (s, x)
  int offset;                        // position of query token 0: kv_len - q_len
  int lo, end;                       // the piece's positions [lo, end), whole tiles from lo
  int window, from;                  // the window (0: none); the first position row 0 sees

  template <int BM, int BN>
  RF_DEVICE void read(const int* items, int item, const int* q_starts, const int* seq_lens,
                      int ratio, int window_) {
    const int* e = items + 4 * (rf_i64)item;
    s = e[0];
    row0 = e[1];
    x = e[2] & 0xffff;
    k = e[2] >> 16;
    n = e[3];
    q_begin = q_starts[s];
    q_len = q_starts[s + 1] - q_begin;
    kv_len = seq_lens[s];
    rows = q_len * ratio;
    offset = kv_len - q_len;
    const int last = (row0 + BM < rows ? row0 + BM : rows) - 1;
    const int hi = offset + last / ratio + 1;  // the last row's positions end here
    window = window_;
    from = window > 0 ? offset + row0 / ratio - window + 1 : 0;
    if (from < 0) from = 0;
    const int first_tile = from / BN;
    const int tiles = (hi + BN - 1) / BN - first_tile, per = (tiles + n - 1) / n;
    const int lo_tile = first_tile + (k * per < tiles ? k * per : tiles);
    lo = lo_tile * BN;
    end = (lo_tile + per) * BN < hi ? (lo_tile + per) * BN : hi;
    if (end < lo) end = lo;
  }
  // Row r's last visible position in the piece (-1 past the sequence's rows); with a window,
  // its last position itself (the math counts positions lim - W < p <= lim: the piece's
  // tiles end at its end or past every row's position, so the end needs no clip there).
  RF_DEVICE int limit(int r, int ratio) const {
    if (row0 + r >= rows) return -1;
    const int causal = offset + (row0 + r) / ratio;
    return causal < end - 1 || window > 0 ? causal : end - 1;
  }
  // The first position every row of the tile sees (INT_MIN without a window): a KV tile
  // that starts there or later needs no mask below.
  template <int BM>
  RF_DEVICE int seen_by_all(int ratio) const {
    const int last = (row0 + BM < rows ? row0 + BM : rows) - 1;
    return window > 0 ? offset + last / ratio - window + 1 : -0x7fffffff - 1;
  }
  // Row r's element offset in q and out.
  RF_DEVICE rf_i64 at(int r, int ratio, int num_q_heads, int D) const {
    const int p = row0 + r;
    return ((rf_i64)(q_begin + p / ratio) * num_q_heads + x * ratio + p % ratio) * D;
  }
};

template <class E, class C, int D, int WM, bool CAP>
RF_DEVICE void prefill(typename E::storage* __restrict__ out, float* __restrict__ partials,
                       const typename E::storage* __restrict__ q,
                       const typename C::storage* __restrict__ k_cache,
                       const typename C::storage* __restrict__ v_cache,
                       const int* __restrict__ block_tables, const int* __restrict__ seq_lens,
                       const int* __restrict__ q_starts, const int* __restrict__ items,
                       float scale, int num_q_heads, int num_kv_heads, int max_blocks,
                       int block_shift, float out_scale, float softcap,
                       const float* __restrict__ sinks, int window) {
  typedef rf_pf_shape<E, C, D, WM> Shape;
  typedef typename rf_pf_math<E, D, Shape>::type Math;
  typedef typename Shape::QRows QRows;
  typedef typename Shape::SRows SRows;
  constexpr int BM = Shape::BM, BN = Shape::BN, STAGES = Shape::STAGES;
  static_assert(Shape::NTOK_W % 8 == 0 || Shape::F32, "whole 8-token slices for the matrices");
  static_assert(!Shape::F32 || WM == 1, "f32 instances take 16-row tiles");
  constexpr int QC = QRows::CHUNKS;                          // 16-byte chunks of a Q row
  constexpr int CC = D * (int)sizeof(typename C::storage) / 16;  // of a cache row
#if defined(RF_AMD)
  RF_SHARED rf_vec16 buf_v[Shape::BYTES / 16];
  char* const buf = reinterpret_cast<char*>(buf_v);
#else
  RF_DYNAMIC_SHARED(rf_vec16, buf_v);
  char* const buf = reinterpret_cast<char*>(buf_v) +
                    (-(int)rf_smem_addr(buf_v) & (RF_PF_ALIGN - 1));
  // a launch must pass what planning.prefill_shape computes: less would overrun the buffer
  if (rf_dynamic_smem_bytes() < Shape::BYTES + RF_PF_ALIGN) __trap();
#endif
  RF_SHARED int lim_s[BM];
  RF_SHARED typename Math::Shared math_s;
  RF_SHARED float m_s[RF_PF_WARPS][16], l_s[RF_PF_WARPS][16];
  char* const q_plane = buf;
  char* const stages = buf + Shape::AT_STAGES;
  char* const wide = buf + Shape::AT_WIDE;  // NVIDIA fp8: [K, V] widened

  const int tid = (int)rf_tid(), lane = tid % RF_WARP, warp = tid / RF_WARP;
  const int item = (int)rf_bid_x(), ratio = num_q_heads / num_kv_heads;
  if (items[4 * (rf_i64)item + 3] == 0) return;  // padding (a graph's fixed grid)
  const int block_size = 1 << block_shift;
  rf_pf_item it{};
  it.template read<BM, BN>(items, item, q_starts, seq_lens, ratio, window);
  const int* table = block_tables + (rf_i64)it.s * max_blocks;

  // the queries (zero rows past the sequence's), each row's limit
  for (int i = tid; i < BM * QC; i += RF_PF_THREADS) {
    const int r = i / QC, j = i % QC;
    const bool here = it.row0 + r < it.rows;
    const rf_vec16* src = reinterpret_cast<const rf_vec16*>(
        q + (here ? it.at(r, ratio, num_q_heads, D) : 0)) + j;
    if (QRows::ALIGNED && here)
      rf_copy16_async(QRows::chunk(q_plane, r, j), src);
    else
      QRows::store(q_plane, r, j, here ? *src : rf_vec16{0u, 0u, 0u, 0u});
  }
  for (int r = tid; r < BM; r += RF_PF_THREADS) lim_s[r] = it.limit(r, ratio);

  // tile t's K and V rows into stage st: the cache's rows (AMD fp8: widened to E), zeros
  // past the piece's end, so products over whole tiles stay finite
#if !defined(RF_AMD)
  // NVIDIA: thread tid copies chunk tid % CC of rows tid / CC + PASS_ROWS i of the tile, so
  // its shared addresses are fixed offsets from the stage's and each row's source is found
  // once for its K and V chunks; rows past the piece's end are zero-filled by the copy
  constexpr int PASS_ROWS = RF_PF_THREADS / CC, PASSES = BN / PASS_ROWS;
  static_assert(RF_PF_THREADS % CC == 0 && BN % PASS_ROWS == 0, "whole passes over a tile");
  constexpr rf_u64 CACHE_ROW = D * sizeof(typename C::storage);  // bytes of a cache row
  const int copy_j = tid % CC, copy_r = tid / CC;
  const unsigned stages_at = rf_smem_u32(stages);
  const char* const k_src = reinterpret_cast<const char*>(k_cache) + 16 * copy_j;
  const char* const v_src = reinterpret_cast<const char*>(v_cache) + 16 * copy_j;
  auto issue = [&](int st, int t) {
    const unsigned k_dst = stages_at + (unsigned)(2 * st * Shape::PLANE);
    const unsigned v_dst = k_dst + Shape::PLANE;
#pragma unroll
    for (int i = 0; i < PASSES; ++i) {
      const int row = copy_r + PASS_ROWS * i, p = t * BN + row;
      const bool here = p < it.end && p >= it.from;
      const int at = here ? p : it.end - 1;  // (else: a position the table holds)
      // the row's index among the cache's rows: unsigned, as a cache of 2^32 rows of 64 or
      // more bytes (256 GiB) fits no GPU
      const unsigned cache_row =
          ((unsigned)table[at >> block_shift] * num_kv_heads + it.x) * block_size +
          (at & (block_size - 1));
      const rf_u64 offset = cache_row * CACHE_ROW;
      rf_copy16_async_zfill(SRows::addr(k_dst, row, copy_j), k_src + offset, here);
      rf_copy16_async_zfill(SRows::addr(v_dst, row, copy_j), v_src + offset, here);
    }
    rf_copy_commit();
  };
#else
  auto issue = [&](int st, int t) {
    char* k_dst = stages + (2 * st) * Shape::PLANE;
    char* v_dst = k_dst + Shape::PLANE;
#pragma unroll 1  // synchronous copies: unrolled, their registers sat beside the accumulators
    for (int i = tid; i < BN * CC; i += RF_PF_THREADS) {
      const int row = i / CC, j = i % CC, p = t * BN + row;
      if (p < it.end && p >= it.from) {
        const rf_i64 cache_row =
            ((rf_i64)table[p >> block_shift] * num_kv_heads + it.x) * block_size +
            (p & (block_size - 1));
        const rf_vec16* ks = reinterpret_cast<const rf_vec16*>(k_cache + cache_row * D) + j;
        const rf_vec16* vs = reinterpret_cast<const rf_vec16*>(v_cache + cache_row * D) + j;
        if constexpr (Shape::WIDEN_IN_COPY) {
          const rf_vec16 kc = *ks, vc = *vs;
          SRows::store(k_dst, row, 2 * j, rf_e4m3::widen<E>(kc.x, kc.y));
          SRows::store(k_dst, row, 2 * j + 1, rf_e4m3::widen<E>(kc.z, kc.w));
          SRows::store(v_dst, row, 2 * j, rf_e4m3::widen<E>(vc.x, vc.y));
          SRows::store(v_dst, row, 2 * j + 1, rf_e4m3::widen<E>(vc.z, vc.w));
        } else {
          SRows::store(k_dst, row, j, *ks);
          SRows::store(v_dst, row, j, *vs);
        }
      } else {
        // stage chunks a cache chunk: 1, or 2 where the copy widens fp8 codes
        constexpr int PER = Shape::WIDEN_IN_COPY ? sizeof(typename E::storage) : 1;
#pragma unroll
        for (int h = 0; h < PER; ++h) {
          SRows::store(k_dst, row, PER * j + h, rf_vec16{0u, 0u, 0u, 0u});
          SRows::store(v_dst, row, PER * j + h, rf_vec16{0u, 0u, 0u, 0u});
        }
      }
    }
    rf_copy_commit();
  };
#endif
  // NVIDIA fp8: stage st's codes widened into E rows (`wide`), the planes the math reads
  auto widen = [&](int st) {
    if constexpr (Shape::CODE_STAGE) {
      const char* codes = stages + (2 * st) * Shape::PLANE;
#pragma unroll 1  // (unrolled, its chunks' registers sat beside the accumulators)
      for (int i = tid; i < 2 * BN * CC; i += RF_PF_THREADS) {
        const int kv = i / (BN * CC), row = i / CC % BN, j = i % CC;
        const rf_vec16 c = SRows::load(codes + kv * Shape::PLANE, row, j);
        char* plane = wide + kv * Shape::WIDE_PLANE;
        QRows::store(plane, row, 2 * j, rf_e4m3::widen<E>(c.x, c.y));
        QRows::store(plane, row, 2 * j + 1, rf_e4m3::widen<E>(c.z, c.w));
      }
    }
  };

  Math math{};
  math.w = rf_pf_warp{tid, lane, warp, WM == 4 ? 16 * Shape::MT * warp : 0,
                      WM == 4 ? 0 : Shape::NTOK_W * warp};
  if constexpr (sizeof(typename Math::Shared) > 1) math.sh = &math_s;
  math.reset();
  const float qscale = scale * RF_PF_LOG2E;
  const float cap = CAP ? softcap * RF_PF_LOG2E : 0.f;  // the cap in the scores' log2 units
  const int first_tile = it.lo / BN, tiles = (it.end - it.lo + BN - 1) / BN;
  const int full_lim = it.limit(0, ratio);  // row 0 sees least: a tile up to it needs no mask
  const int all_from = it.template seen_by_all<BM>(ratio);  // (nor one from here, windowed)
  rf_copy_commit();  // the queries: group 0
#pragma unroll
  for (int i = 0; i + 1 < STAGES; ++i) {  // tiles 0 .. STAGES - 2 in flight (empty groups past
    if (i < tiles) issue(i, first_tile + i);  // the last tile keep the count)
    else rf_copy_commit();
  }
  for (int t = 0; t < tiles; ++t) {
    const int st = t % STAGES, ahead = t + STAGES - 1;
    // tile t + STAGES - 1 into the stage tile t - 1 left (every warp passed its barrier),
    // then wait until only the STAGES - 1 newest groups are in flight: tile t is in
    if (ahead < tiles) issue(ahead % STAGES, first_tile + ahead);
    else rf_copy_commit();
    rf_copy_wait<STAGES - 1>();
    rf_sync();  // tile t (at t = 0: the queries and limits too) is in shared memory
    if (t == 0) math.load_q(q_plane, lim_s);
    const char* k_plane = stages + (2 * st) * Shape::PLANE;
    if constexpr (Shape::CODE_STAGE) {
      widen(st);
      rf_sync();
      k_plane = wide;
    }
    const char* v_plane = k_plane + (Shape::CODE_STAGE ? Shape::WIDE_PLANE : Shape::PLANE);
    const int t0 = (first_tile + t) * BN;
    math.template tile<CAP>(k_plane, v_plane, t0, t0 + BN - 1 > full_lim || t0 < all_from,
                            qscale, cap, window > 0 ? (unsigned)window : 0x80000000u);
    rf_sync();  // every warp is done with stage st (and `wide`) before they are refilled
  }

  // The result: per row, output / sum, or the piece's record for the combine (its output,
  // max and sum). Each row's destination and factor are found once, then its values go out.
  const float o_scale = Shape::FP8 ? out_scale : 1.f;
  const bool split = it.n > 1;
  float* const records = partials + (rf_i64)item * BM * (D + 4);
  struct Dest {
    float* record;                // split: the row's record, else null
    typename E::storage* out;     // else: the row's output (null past the sequence's rows)
    float factor;                 // what a value is multiplied by on its way out
  };
  auto dest = [&](int r, float m, float l) {  // row r of the tile, its max and sum
    Dest at{nullptr, nullptr, 0.f};
    if (it.row0 + r >= it.rows) return at;
    if (split) {
      at.record = records + r * (D + 4);
      at.record[D] = m;
      at.record[D + 1] = l;
      at.factor = o_scale;
    } else {
      at.out = out + it.at(r, ratio, num_q_heads, D);
      const int head = it.x * ratio + (it.row0 + r) % ratio;  // the row's query head
      const float sink = sinks != nullptr ? rf_exp2(sinks[head] * RF_PF_LOG2E - m) : 0.f;
      at.factor = l > 0.f ? o_scale / (l + sink) : 0.f;
    }
    return at;
  };
  auto put = [&](const Dest& at, int d, const float* v, int count) {
    if (at.record != nullptr)
      for (int e = 0; e < count; ++e) at.record[d + e] = v[e] * at.factor;
    else if (at.out != nullptr)
      for (int e = 0; e < count; ++e) at.out[d + e] = E::from_float(v[e] * at.factor);
  };
  if constexpr (WM == 4) {
    Dest at[Math::ROWS];  // indexed by constant slots: registers
    math.row_stats([&](int slot, int r, float m, float l) {
#pragma unroll
      for (int k = 0; k < Math::ROWS; ++k)
        if (k == slot) at[k] = dest(math.w.row0 + r, m, l);
    });
    math.output([&](int slot, int, int d, const float* v, int count) {
      put(at[slot], d, v, count);
    });
  } else {
    // merge the warps' states of the 16 rows: each warp's output rescaled to the CTA's max,
    // summed through the stages' memory (regions of [16][D] floats, in turns where fewer
    // than RF_PF_WARPS fit)
    math.row_stats([&](int, int r, float m, float l) {
      m_s[warp][r] = m;
      l_s[warp][r] = l;
    });
    rf_sync();
    float* const region = reinterpret_cast<float*>(stages);
    constexpr int REGIONS = Shape::REGIONS;
    for (int turn = 0; turn < RF_PF_WARPS / REGIONS; ++turn) {
      if (warp / REGIONS == turn)
        math.output([&](int, int r, int d, const float* v, int count) {
          float mx = -RF_INF;
#pragma unroll
          for (int u = 0; u < RF_PF_WARPS; ++u) mx = rf_fmax(mx, m_s[u][r]);
          const float wgt = m_s[warp][r] == -RF_INF ? 0.f : rf_exp2(m_s[warp][r] - mx);
          float* o = region + ((warp % REGIONS) * 16 + r) * D + d;
          for (int e = 0; e < count; ++e) o[e] = turn == 0 ? wgt * v[e] : o[e] + wgt * v[e];
        });
      rf_sync();
    }
    for (int i = tid; i < 16 * D; i += RF_PF_THREADS) {
      const int r = i / D, d = i % D;
      float mx = -RF_INF, l = 0.f, o = 0.f;
#pragma unroll
      for (int u = 0; u < RF_PF_WARPS; ++u) mx = rf_fmax(mx, m_s[u][r]);
#pragma unroll
      for (int u = 0; u < RF_PF_WARPS; ++u)
        l += m_s[u][r] == -RF_INF ? 0.f : rf_exp2(m_s[u][r] - mx) * l_s[u][r];
#pragma unroll
      for (int g = 0; g < REGIONS; ++g) o += region[(g * 16 + r) * D + d];
      const Dest at = dest(r, mx, l);  // (every thread of the row writes the same tail)
      put(at, d, &o, 1);
    }
  }
}

// Merges the pieces of split items: combine c takes items first .. first + n - 1 (`combines`,
// int32 x 2: first, n), the pieces of one item's BM rows (the instance's tile); each row's output is sum_k w_k o_k /
// sum_k w_k l_k with w_k = 2^(m_k - max_k m_k), pieces without tokens (sum 0) left out.
template <class E, int D, int WM>
RF_DEVICE void prefill_combine(typename E::storage* __restrict__ out,
                               const float* __restrict__ partials, const int* __restrict__ items,
                               const int* __restrict__ combines, const int* __restrict__ q_starts,
                               int num_q_heads, int num_kv_heads, int BM,
                               const float* __restrict__ sinks) {
  const int c = (int)rf_bid_x(), tid = (int)rf_tid(), ratio = num_q_heads / num_kv_heads;
  const int first = combines[2 * c], n = combines[2 * c + 1];
  if (n == 0) return;  // a padding combine (a graph's fixed grid)
  const int* e = items + 4 * (rf_i64)first;
  const int s = e[0], row0 = e[1], x = e[2] & 0xffff;
  const int q_begin = q_starts[s], rows = (q_starts[s + 1] - q_begin) * ratio;
  for (int i = tid; i < BM * (D / 4); i += RF_PF_THREADS) {
    const int r = i / (D / 4), d = 4 * (i % (D / 4));
    if (row0 + r >= rows) continue;
    float mx = -RF_INF;
    for (int k = 0; k < n; ++k) {
      const float* rec = partials + ((rf_i64)(first + k) * BM + r) * (D + 4);
      if (rec[D + 1] > 0.f) mx = rf_fmax(mx, rec[D]);
    }
    float l = 0.f, o[4] = {0.f, 0.f, 0.f, 0.f};
    for (int k = 0; k < n; ++k) {
      const float* rec = partials + ((rf_i64)(first + k) * BM + r) * (D + 4);
      if (!(rec[D + 1] > 0.f)) continue;
      const float w = rf_exp2(rec[D] - mx);
      l += w * rec[D + 1];
#pragma unroll
      for (int j = 0; j < 4; ++j) o[j] += w * rec[d + j];
    }
    const int p = row0 + r;
    typename E::storage* row =
        out + ((rf_i64)(q_begin + p / ratio) * num_q_heads + x * ratio + p % ratio) * D + d;
    const float sink = sinks != nullptr ? rf_exp2(sinks[x * ratio + p % ratio] * RF_PF_LOG2E - mx)
                                        : 0.f;
    const float inv = l > 0.f ? 1.f / (l + sink) : 0.f;
#pragma unroll
    for (int j = 0; j < 4; ++j) row[j] = E::from_float(o[j] * inv);
  }
}

// rf_prefill_<E>[_e4m3][_cap]_d<D>_m<WM>: queries and outputs of E over a cache of E (or of
// fp8 e4m3 codes: _e4m3), WM warps along the rows; _cap: the instance that applies `softcap`
// (the others ignore it: the cap's code costs the two-m-tile instances registers, spills on
// sm_90, that calls without a cap should not pay); rf_prefill_combine_<E>_d<D>_m<WM>.
#define RF_PF_ONE(NAME, CAPPED, CAP, E, C, D, WM)                                              \
  RF_KERNEL(RF_PF_THREADS)                                                                     \
  rf_prefill_##NAME##CAPPED##_d##D##_m##WM(                                                    \
      E::storage* out, float* partials, const E::storage* q, const C::storage* k_cache,        \
      const C::storage* v_cache, const int* block_tables, const int* seq_lens,                 \
      const int* q_starts, const int* items, float scale, int num_q_heads, int num_kv_heads,  \
      int max_blocks, int block_shift, float out_scale, float softcap, const float* sinks,     \
      int window) {                                                                            \
    prefill<E, C, D, WM, CAP>(out, partials, q, k_cache, v_cache, block_tables, seq_lens,     \
                              q_starts, items, scale, num_q_heads, num_kv_heads, max_blocks,  \
                              block_shift, out_scale, softcap, sinks, window);                 \
  }
#define RF_PF_KERNEL(NAME, E, C, D, WM)                                                        \
  RF_PF_ONE(NAME, , false, E, C, D, WM) RF_PF_ONE(NAME, _cap, true, E, C, D, WM)
#define RF_PF_COMBINE(NAME, E, D, WM)                                                          \
  RF_KERNEL(RF_PF_THREADS)                                                                     \
  rf_prefill_combine_##NAME##_d##D##_m##WM(E::storage* out, const float* partials,            \
                                           const int* items, const int* combines,              \
                                           const int* q_starts, int num_q_heads,               \
                                           int num_kv_heads, int rows, const float* sinks) {   \
    prefill_combine<E, D, WM>(out, partials, items, combines, q_starts, num_q_heads,          \
                              num_kv_heads, rows, sinks);                                      \
  }

// The instances: WM = 4 and 1 for 16-bit caches and fp8 (AMD's d256: WM = 4 only, its
// 16-token tiles leave a warp no whole m-tile), WM = 1 for f32.
#if defined(RF_AMD)
#define RF_PF_WIDE(NAME, E, C, D) RF_PF_KERNEL(NAME, E, C, D, 4) RF_PF_KERNEL(NAME, E, C, D, 1)
#define RF_PF_D256(NAME, E, C) RF_PF_KERNEL(NAME, E, C, 256, 4)
#else
#define RF_PF_WIDE(NAME, E, C, D) RF_PF_KERNEL(NAME, E, C, D, 4) RF_PF_KERNEL(NAME, E, C, D, 1)
#define RF_PF_D256(NAME, E, C) RF_PF_WIDE(NAME, E, C, 256)
#endif
#define RF_PF_DTYPE(NAME, E, C)                                                                \
  RF_PF_WIDE(NAME, E, C, 64) RF_PF_WIDE(NAME, E, C, 128) RF_PF_D256(NAME, E, C)
#define RF_PF_COMBINES(NAME, E, WM)                                                            \
  RF_PF_COMBINE(NAME, E, 64, WM) RF_PF_COMBINE(NAME, E, 128, WM) RF_PF_COMBINE(NAME, E, 256, WM)

RF_PF_DTYPE(f16, rf_f16, rf_f16)
RF_PF_DTYPE(bf16, rf_bf16, rf_bf16)
RF_PF_DTYPE(f16_e4m3, rf_f16, rf_e4m3)
RF_PF_DTYPE(bf16_e4m3, rf_bf16, rf_e4m3)
RF_PF_KERNEL(f32, rf_f32, rf_f32, 64, 1)
RF_PF_KERNEL(f32, rf_f32, rf_f32, 128, 1)
RF_PF_KERNEL(f32, rf_f32, rf_f32, 256, 1)
RF_PF_COMBINES(f16, rf_f16, 4)
RF_PF_COMBINES(f16, rf_f16, 1)
RF_PF_COMBINES(bf16, rf_bf16, 4)
RF_PF_COMBINES(bf16, rf_bf16, 1)
RF_PF_COMBINES(f32, rf_f32, 1)
