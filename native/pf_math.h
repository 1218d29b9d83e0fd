// The arithmetic of multi-token attention (prefill.cu), per warp: 16 query rows of the tile,
// the warp's tokens of each KV tile, an online softmax per row (base-2 exponent, float32).
// Three paths with one interface, chosen per target and dtype by rf_pf_math:
//   rf_pf_mma     NVIDIA tensor cores (mma.sync m16n8k16, sm_80+), 16-bit rows (an fp8
//                 cache's widened codes too): S = Q K^T with rows in the M dimension, as
//                 FlashAttention-2 lays it out, so P feeds P V from registers;
//   rf_pf_matrix  AMD matrix cores (MFMA 16x16x16 on gfx90a/gfx94x, WMMA on gfx11), 16-bit:
//                 S^T = K Q^T, a lane per query row (its 16 columns), so P^T feeds V^T P^T
//                 from registers (the decode kernel's layout, pa_math.h);
//   rf_pf_core    CUDA cores / VALU (f32 caches): a lane per query row and token slice.
// Interface (warp-uniform calls): load_q (the tile's queries, once visible in shared memory),
// reset, tile (one KV tile: rows of K and V in shared memory, position t0 of its first row,
// `masked`: whether any of the warp's elements may lie past its row's limit), and at the end
// row_stats / output (per row of the warp: max, sum, and the unnormalised output, handed to a
// callback with the row's slot among the ROWS rows a lane holds, the row, and 1, 2 or 4
// consecutive dims).
//
// Masking: element (row r, position p) counts iff lim[r] - span < p <= lim[r], lim[r] the
// row's last visible position (causal, and the piece's end), -1 for rows past the sequence's
// queries; span (tile's argument, from the kernel's) the window, or 2^31 for none: one
// unsigned compare, rf_pf_sees.
#pragma once
#include "compat.h"
#include "pf_tile.h"

struct rf_pf_warp {
  int tid, lane, warp;
  int row0;  // the warp's first row of the tile (WM = 4: 16 * warp; WM = 1: 0)
  int tok0;  // the warp's first token of each KV tile (WM = 1: NTOK_W * warp; WM = 4: 0)
};

// Online-softmax bookkeeping of one row: max so far (log2 units, -inf before any valid
// element) and the factor earlier sums and outputs are rescaled by.
RF_DEVICE float rf_pf_rescale(float& m_run, float mx) {
  const float m_new = rf_fmax(m_run, mx);
  const float alpha = m_run == -RF_INF ? 0.f : rf_exp2(m_run - m_new);
  m_run = m_new;
  return alpha;
}
// The max to weigh a row's scores against: its max, or 0 while every score is -inf (then
// every weight is 2^-inf = 0, never NaN).
RF_DEVICE float rf_pf_safe(float m) { return m == -RF_INF ? 0.f : m; }
// How far (log2 units) a row's scores may pass its running max before the max moves (the
// NVIDIA mma path's lazy rescale): weights up to 2^8, which 16-bit P and float32 sums hold.
#define RF_PF_SLACK 8.f
RF_DEVICE float rf_pf_weight(float s, float m) { return s == -RF_INF ? 0.f : rf_exp2(s - m); }
// Whether a row whose last visible position is `lim` sees position `p` within `span`.
RF_DEVICE bool rf_pf_sees(int lim, int p, unsigned span) { return (unsigned)(lim - p) < span; }

#if defined(RF_HAVE_MMA)
// ---- NVIDIA tensor cores --------------------------------------------------------------------
// Lane (g, c) = (lane / 4, lane % 4) holds rows g and g + 8 of the warp's 16 and, of each
// 8-token n-tile j, tokens 8j + 2c and 8j + 2c + 1: s[j][2 r + e] is (row g + 8 r, token
// 8j + 2c + e). Q's A fragments come by ldmatrix from the Q rows (registers for D <= 128,
// shared memory per k-step for D = 256), K's B fragments by ldmatrix, V's by ldmatrix.trans;
// the output acc[dt][2 r + e] is (row g + 8 r, dim 8 dt + 2c + e).
template <class E, int D, class Shape>
struct rf_pf_mma {
  typedef typename Shape::QRows Rows;  // Q, K and V rows: E, swizzled
  static constexpr int KSTEPS = D / 16, NT = Shape::NTOK_W / 8, DT = D / 8;
  static constexpr int MT = Shape::MT;  // m-tiles (16 rows each) a warp holds
  static constexpr bool Q_REGS = D <= 128 && MT == 1 && !Shape::FP8;  // (fp8: registers short)
  static constexpr int KIND = E::TENSOR_KIND;
  static constexpr int ROWS = 2 * MT;  // rows a lane holds
  static_assert(KIND != 0, "16-bit rows");
  struct Shared {};
  rf_pf_warp w;
  unsigned qa[Q_REGS ? KSTEPS : 1][4];
  float acc[MT][DT][4], m_run[MT][2], l_part[MT][2];
  int lim[MT][2];
  unsigned q_plane;  // shared-window address of the Q rows

  RF_DEVICE void load_q(const char* q, const int* lim_s) {
    q_plane = rf_smem_u32(q);
    if constexpr (Q_REGS)
#pragma unroll
      for (int ks = 0; ks < KSTEPS; ++ks)
        rf_ldmatrix_x4_at<false>(qa[ks], Rows::addr(q_plane, w.row0 + w.lane % 16,
                                                    2 * ks + w.lane / 16));
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      lim[mt][0] = lim_s[w.row0 + 16 * mt + w.lane / 4];
      lim[mt][1] = lim_s[w.row0 + 16 * mt + w.lane / 4 + 8];
    }
  }
  RF_DEVICE void reset() {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
      for (int dt = 0; dt < DT; ++dt)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[mt][dt][e] = 0.f;
      m_run[mt][0] = m_run[mt][1] = -RF_INF;
      l_part[mt][0] = l_part[mt][1] = 0.f;
    }
  }
  template <bool CAP>  // whether `cap` (> 0: the logit cap) is applied
  RF_DEVICE void tile(const char* k_plane, const char* v_plane, int t0, bool masked,
                      float qscale, float cap, unsigned span) {
    const int lane = w.lane;
    const unsigned k_at = rf_smem_u32(k_plane), v_at = rf_smem_u32(v_plane);
    float s[MT][NT][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int j = 0; j < NT; ++j) s[mt][j][0] = s[mt][j][1] = s[mt][j][2] = s[mt][j][3] = 0.f;
    // S = Q K^T: per k-step, each m-tile's Q fragment, then the 16 dims of every n-tile pair
    // (x4: tokens 0-7 and 8-15 of the pair, each at dims 0-7 and 8-15), each feeding MT m-tiles
    const int k_row = w.tok0 + (lane / 16) * 8 + lane % 8, k_half = (lane / 8) % 2;
#pragma unroll
    for (int ks = 0; ks < KSTEPS; ++ks) {
      unsigned a[MT][4];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        if constexpr (Q_REGS) {
#pragma unroll
          for (int i = 0; i < 4; ++i) a[mt][i] = qa[ks][i];
        } else {
          rf_ldmatrix_x4_at<false>(a[mt], Rows::addr(q_plane, w.row0 + 16 * mt + lane % 16,
                                                     2 * ks + lane / 16));
        }
      }
#pragma unroll
      for (int np = 0; np < (NT + 1) / 2; ++np) {
        // an odd last n-tile: lanes 16-31 read its own rows again (their b1 is unused), never
        // rows past the warp's
        const int row = 2 * np + 1 < NT ? k_row + 16 * np : w.tok0 + 16 * np + lane % 8;
        unsigned b[4];
        rf_ldmatrix_x4_at<false>(b, Rows::addr(k_at, row, 2 * ks + k_half));
        const unsigned b0[2] = {b[0], b[1]}, b1[2] = {b[2], b[3]};
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          rf_mma16816<KIND>(s[mt][2 * np], a[mt], b0);
          if (2 * np + 1 < NT) rf_mma16816<KIND>(s[mt][2 * np + 1], a[mt], b1);
        }
      }
    }
    // mask (tiles that reach past a row's limit only), online softmax of rows g and g + 8 of
    // each m-tile; the scores stay unscaled, qscale goes into the exponent
    if (masked) {
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int j = 0; j < NT; ++j)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int p = t0 + w.tok0 + 8 * j + 2 * (lane % 4) + e % 2;
            s[mt][j][e] = rf_pf_sees(lim[mt][e / 2], p, span) ? s[mt][j][e] : -RF_INF;
          }
    }
    // The running max moves only when a row's tile max passes it by more than RF_PF_SLACK
    // (log2 units): weights stay below 2^RF_PF_SLACK, and the warp rescales an m-tile's sums
    // and outputs only in the tiles where one of its rows' max moved (few, once it settled)
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      float mx[2] = {-RF_INF, -RF_INF};
#pragma unroll
      for (int j = 0; j < NT; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) mx[e / 2] = rf_fmaxnum(mx[e / 2], s[mt][j][e]);
      bool grow[2];
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        mx[r] = rf_fmaxnum(mx[r], rf_shfl_xor_c<1>(mx[r]));  // the row's 4 lanes
        mx[r] = rf_fmaxnum(mx[r], rf_shfl_xor_c<2>(mx[r])) * qscale;  // (qscale > 0)
        // a logit cap (uniform): tanh is increasing, so the capped scores' max is the max
        // capped; each score is capped where it is exponentiated (no pass of its own: the
        // two-m-tile instance has no registers to spare)
        if (CAP && cap > 0.f && mx[r] != -RF_INF) mx[r] = rf_softcap(mx[r], cap);
        grow[r] = mx[r] > m_run[mt][r] + RF_PF_SLACK;  // (-inf + slack: any finite max)
      }
      if (rf_warp_any(grow[0] || grow[1])) {
        float alpha[2];
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          alpha[r] = grow[r] ? rf_pf_rescale(m_run[mt][r], mx[r]) : 1.f;
          l_part[mt][r] *= alpha[r];
        }
#pragma unroll
        for (int dt = 0; dt < DT; ++dt)
#pragma unroll
          for (int e = 0; e < 4; ++e) acc[mt][dt][e] *= alpha[e / 2];
      }
      const float base[2] = {rf_pf_safe(m_run[mt][0]), rf_pf_safe(m_run[mt][1])};
      if (CAP && cap > 0.f) {
#pragma unroll
        for (int j = 0; j < NT; ++j)
#pragma unroll
          for (int e = 0; e < 4; ++e) {  // 2^(cap(s qscale) - max), masked scores 0
            const float x = s[mt][j][e];
            s[mt][j][e] = x == -RF_INF ? 0.f : rf_exp2(rf_softcap(x * qscale, cap) - base[e / 2]);
            l_part[mt][e / 2] += s[mt][j][e];
          }
      } else {
#pragma unroll
        for (int j = 0; j < NT; ++j)
#pragma unroll
          for (int e = 0; e < 4; ++e) {  // 2^(s qscale - max): one FMA and one exp2
            s[mt][j][e] = rf_exp2(s[mt][j][e] * qscale - base[e / 2]);
            l_part[mt][e / 2] += s[mt][j][e];
          }
      }
    }
    // O += P V: P's A fragments straight from s (16 tokens a k-step), V's B fragments by
    // ldmatrix.trans (x4: tokens 0-7 and 8-15 of the k-step, each at dims 0-7 and 8-15 of a
    // pair of d-tiles), each feeding MT m-tiles
    const int v_row = w.tok0 + ((lane / 8) % 2) * 8 + lane % 8, v_half = lane / 16;
#pragma unroll
    for (int kk = 0; kk < (NT + 1) / 2; ++kk) {
      const bool second = 2 * kk + 1 < NT;
      // an odd last k-step: its tokens 8-15 (zero weights) read tokens 0-7 again, finite
      const int row = second ? v_row + 16 * kk : w.tok0 + 16 * kk + lane % 8;
      const int j1 = second ? 2 * kk + 1 : 2 * kk;  // (an index in range either way)
      unsigned a[MT][4];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        a[mt][0] = pack(s[mt][2 * kk][0], s[mt][2 * kk][1]);
        a[mt][1] = pack(s[mt][2 * kk][2], s[mt][2 * kk][3]);
        a[mt][2] = second ? pack(s[mt][j1][0], s[mt][j1][1]) : 0u;
        a[mt][3] = second ? pack(s[mt][j1][2], s[mt][j1][3]) : 0u;
      }
#pragma unroll
      for (int dp = 0; dp < DT / 2; ++dp) {
        unsigned b[4];
        rf_ldmatrix_x4_at<true>(b, Rows::addr(v_at, row, 2 * dp + v_half));
        const unsigned b0[2] = {b[0], b[1]}, b1[2] = {b[2], b[3]};
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          rf_mma16816<KIND>(acc[mt][2 * dp], a[mt], b0);
          rf_mma16816<KIND>(acc[mt][2 * dp + 1], a[mt], b1);
        }
      }
    }
  }
  RF_DEVICE static unsigned pack(float lo, float hi) { return rf_pack2<KIND>(lo, hi); }
  // (slot, row of the warp's 16 MT, max, sum) of each row this lane holds: every lane
  // calls, and the lanes of a row pass the same values
  template <class F>
  RF_DEVICE void row_stats(F&& f) {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int r = 0; r < 2; ++r)
        f(2 * mt + r, 16 * mt + w.lane / 4 + 8 * r, m_run[mt][r],
          rf_xor_sum<1, 4>(l_part[mt][r]));
  }
  // (slot, row, first dim, values of 2 consecutive dims) of the lane's unnormalised outputs
  template <class F>
  RF_DEVICE void output(F&& f) {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int dt = 0; dt < DT; ++dt)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          const float v[2] = {acc[mt][dt][2 * r], acc[mt][dt][2 * r + 1]};
          f(2 * mt + r, 16 * mt + w.lane / 4 + 8 * r, 8 * dt + 2 * (w.lane % 4), v, 2);
        }
  }
};
#endif

#if defined(RF_HAVE_MFMA) || defined(RF_HAVE_WMMA)
// ---- AMD matrix cores -----------------------------------------------------------------------
// S^T[16 tokens x 16 rows] = K[16 tokens x 16 dims] . Q^T[16 dims x 16 rows] per m-tile of 16
// tokens and k-step, lane l serving row l % 16 (its column). MFMA (wave64): result i of lane l
// is token 4 (l / 16) + i, A = 4 dims of a K row (8 bytes), B = 4 dims of the lane's Q row
// (registers); WMMA (wave32): result i is token 2i + l / 16, A = a K row's 16 dims, B = the
// lane's Q row's 16 dims (read from shared memory per tile). O^T[16 dims x 16 rows] += V^T .
// P^T per d-tile: P^T is the lane's own scores (WMMA: the other parity from lane ^ 16), V^T
// the lane's dim of 4 (MFMA) or 16 (WMMA) tokens.
template <class E, int D, class Shape>
struct rf_pf_matrix {
  typedef typename E::storage S;
  typedef typename Shape::QRows Rows;
  static constexpr int KSTEPS = D / 16, DT = D / 16, MT = Shape::NTOK_W / 16;
#if defined(RF_HAVE_MFMA)
  static constexpr bool WMMA = false;
  static constexpr int R = 4;
#else
  static constexpr bool WMMA = true;
  static constexpr int R = 8;
#endif
  static_assert(Shape::NTOK_W % 16 == 0, "whole 16-token m-tiles");
  // Whether tile() applies a logit cap: not on wave32 (WMMA) at head_dim 256, whose 256
  // registers hold no more (multi_token refuses a capped call there before queueing).
  static constexpr bool CAPS = !(WMMA && D == 256);
  static constexpr int ROWS = 1;  // rows a lane holds
  struct Shared {};
  rf_pf_warp w;
  rf_u64 qf[WMMA ? 1 : KSTEPS];  // MFMA: the lane's Q^T fragment per k-step
  float acc[DT][R], m_run, l_part;
  int lim;
  const char* q_plane;

  RF_DEVICE int row() const { return w.lane % 16; }
  RF_DEVICE int token(int i) const { return WMMA ? 2 * i + w.lane / 16 : 4 * (w.lane / 16) + i; }
  RF_DEVICE static rf_u64 load8(const char* p) { return *reinterpret_cast<const rf_u64*>(p); }
  RF_DEVICE static rf_u32x8 load32(const char* row_plane, int r, int byte0) {
    rf_u32x8 v;  // 32 bytes: two chunks of row r
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const rf_vec16 c = Rows::load(row_plane, r, byte0 / 16 + h);
      v.u[4 * h] = c.x;
      v.u[4 * h + 1] = c.y;
      v.u[4 * h + 2] = c.z;
      v.u[4 * h + 3] = c.w;
    }
    return v;
  }

  RF_DEVICE void load_q(const char* q, const int* lim_s) {
    q_plane = q;
    if constexpr (!WMMA)
#pragma unroll
      for (int ks = 0; ks < KSTEPS; ++ks)
        qf[ks] = load8(Rows::at(q, w.row0 + row(), 2 * (16 * ks + 4 * (w.lane / 16))));
    lim = lim_s[w.row0 + row()];
  }
  RF_DEVICE void reset() {
#pragma unroll
    for (int dt = 0; dt < DT; ++dt)
#pragma unroll
      for (int i = 0; i < R; ++i) acc[dt][i] = 0.f;
    m_run = -RF_INF;
    l_part = 0.f;
  }
  // One KV tile, an m-tile of 16 tokens at a time: its scores, the online softmax over them,
  // and its P V (a running max per m-tile keeps one m-tile's scores in registers).
  template <bool CAP>  // whether `cap` (> 0: the logit cap) is applied
  RF_DEVICE void tile(const char* k_plane, const char* v_plane, int t0, bool masked,
                      float qscale, float cap, unsigned span) {
    const int lane = w.lane;
#pragma unroll 1  // one m-tile's code: unrolled, the m-tiles' loads were all hoisted (spills)
    for (int mt = 0; mt < MT; ++mt) {
      float s[R];
#pragma unroll
      for (int i = 0; i < R; ++i) s[i] = 0.f;
      const int base = w.tok0 + 16 * mt, k_row = base + lane % 16;
#if defined(RF_HAVE_WMMA)
      // Q^T's operands (16 values a lane a k-step) are read per m-tile: held across the
      // tiles they would take 8 registers a k-step (an opaque offset keeps them from being
      // hoisted out of the loops)
      int q_at = 0;
      rf_opaque(q_at);
      const char* q_rows = q_plane + q_at;
#endif
      int after = 0;  // WMMA: two k-steps' operands (32 registers) loaded at a time
#pragma unroll
      for (int ks = 0; ks < KSTEPS; ++ks) {
#if defined(RF_HAVE_MFMA)
        rf_mfma16<E::TENSOR_KIND>(
            s, load8(Rows::at(k_plane, k_row, 2 * (16 * ks + 4 * (lane / 16)))), qf[ks]);
#else
        if (ks >= 2 && ks % 2 == 0) rf_depend(after, s[0]);
        rf_wmma16<E::TENSOR_KIND>(s, load32(k_plane + after, k_row, 32 * ks),
                                  load32(q_rows + after, w.row0 + row(), 32 * ks));
#endif
      }
      (void)after;
      float mx = -RF_INF;
#pragma unroll
      for (int i = 0; i < R; ++i) {
        const int p = t0 + base + token(i);
        s[i] = !masked || rf_pf_sees(lim, p, span) ? s[i] * qscale : -RF_INF;
        if (CAP && CAPS && cap > 0.f && s[i] != -RF_INF) s[i] = rf_softcap(s[i], cap);
        mx = rf_fmax(mx, s[i]);
      }
      mx = rf_xor_max<16, RF_WARP>(mx);
      const float alpha = rf_pf_rescale(m_run, mx);
      l_part *= alpha;
#pragma unroll
      for (int dt = 0; dt < DT; ++dt)
#pragma unroll
        for (int i = 0; i < R; ++i) acc[dt][i] *= alpha;
#pragma unroll
      for (int i = 0; i < R; ++i) {
        s[i] = rf_pf_weight(s[i], m_run);
        l_part += s[i];
      }
#if defined(RF_HAVE_MFMA)
      rf_u64 b = 0;  // P^T: the lane's 4 tokens of its row
#pragma unroll
      for (int i = 0; i < 4; ++i) b |= (rf_u64)E::from_float(s[i]) << (16 * i);
#pragma unroll
      for (int dt = 0; dt < DT; ++dt) {
        rf_u64 a = 0;  // V^T: dim 16 dt + lane % 16 of the lane's 4 tokens
#pragma unroll
        for (int i = 0; i < 4; ++i)
          a |= (rf_u64)rf_lds_read<S>(Rows::at(v_plane, base + 4 * (lane / 16) + i,
                                               2 * (16 * dt + lane % 16)))
               << (16 * i);
        rf_mfma16<E::TENSOR_KIND>(acc[dt], a, b);
      }
#else
      rf_u32x8 b;  // P^T: the 16 tokens of the lane's row (the other parity from lane ^ 16)
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        const float other = rf_shfl_xor_c<16>(s[i]);
        const unsigned mine = E::from_float(s[i]), theirs = E::from_float(other);
        b.u[i] = lane < 16 ? mine | (theirs << 16) : theirs | (mine << 16);
      }
      int v_after = 0;  // two d-tiles' operands loaded at a time
#pragma unroll
      for (int dt = 0; dt < DT; ++dt) {
        if (dt >= 2 && dt % 2 == 0) rf_depend(v_after, acc[dt - 2][0]);
        rf_u32x8 a;  // V^T: dim 16 dt + lane % 16 of the m-tile's 16 tokens
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          unsigned pair = 0;
#pragma unroll
          for (int h = 0; h < 2; ++h)
            pair |= (unsigned)rf_lds_read<S>(Rows::at(v_plane + v_after, base + 2 * i + h,
                                                      2 * (16 * dt + lane % 16)))
                    << (16 * h);
          a.u[i] = pair;
        }
        rf_wmma16<E::TENSOR_KIND>(acc[dt], a, b);
      }
#endif
    }
  }
  template <class F>
  RF_DEVICE void row_stats(F&& f) {
    f(0, row(), m_run, rf_xor_sum<16, RF_WARP>(l_part));  // (lanes of a row agree)
  }
  template <class F>
  RF_DEVICE void output(F&& f) {
#pragma unroll
    for (int dt = 0; dt < DT; ++dt)
#pragma unroll
      for (int i = 0; i < R; ++i) {
        const float v[1] = {acc[dt][i]};
        f(0, row(), 16 * dt + token(i), v, 1);
        if (i == R - 1) rf_sched_fence();  // a d-tile at a time: gfx11's d256 spilled else
      }
  }
};
#endif

// ---- CUDA cores / VALU ----------------------------------------------------------------------
// Lane l serves row l % 16 and slice j = l / 16 of J = RF_WARP / 16: its tokens of each tile
// are j, j + J, ... of the warp's, scored against the row's query (shared memory, float) one
// dot product each; its outputs are dims 4 (j + J k) .. + 3. P goes through shared memory
// (the warp's [16][NTOK_W] floats), so each lane weighs every token's V of its row.
template <class E, int D, class Shape>
struct rf_pf_core {
  typedef typename E::storage S;
  static constexpr int J = RF_WARP / 16, NTOK = Shape::NTOK_W, TPL = NTOK / J;
  static constexpr int DPL = D / J;  // dims a lane accumulates
  static_assert(NTOK % J == 0 && D % (4 * J) == 0, "whole tokens and dims a lane");
  static_assert(sizeof(S) == 4, "the core path serves f32 caches");
  static constexpr int ROWS = 1;  // rows a lane holds
  struct Shared {
    float p[RF_PF_WARPS][16][NTOK];
  };
  Shared* sh;
  rf_pf_warp w;
  float acc[DPL], m_run, l_part;
  int lim;
  const char* q_plane;

  RF_DEVICE int row() const { return w.lane % 16; }
  RF_DEVICE int slice() const { return w.lane / 16; }
  RF_DEVICE int dim(int k) const { return 4 * (slice() + J * (k / 4)) + k % 4; }
  RF_DEVICE void load_q(const char* q, const int* lim_s) {
    q_plane = q;
    lim = lim_s[w.row0 + row()];
  }
  RF_DEVICE void reset() {
#pragma unroll
    for (int k = 0; k < DPL; ++k) acc[k] = 0.f;
    m_run = -RF_INF;
    l_part = 0.f;
  }
  template <bool CAP>  // whether `cap` (> 0: the logit cap) is applied
  RF_DEVICE void tile(const char* k_plane, const char* v_plane, int t0, bool masked,
                      float qscale, float cap, unsigned span) {
    typedef typename Shape::SRows KRows;
    typedef typename Shape::QRows QRows;
    float s[TPL];
#pragma unroll
    for (int i = 0; i < TPL; ++i) {
      const int tok = w.tok0 + slice() + J * i;
      float dot = 0.f;
#pragma unroll 8  // (whole, the window's compare tipped clang into 256 VGPRs at d128)
      for (int c = 0; c < D / 4; ++c) {
        const rf_float4 k = rf_lds_read<rf_float4>(KRows::chunk(k_plane, tok, c));
        const rf_float4 qv = rf_lds_read<rf_float4>(QRows::chunk(q_plane, w.row0 + row(), c));
        dot += qv.x * k.x + qv.y * k.y + qv.z * k.z + qv.w * k.w;
      }
      const int p = t0 + tok;
      s[i] = !masked || rf_pf_sees(lim, p, span) ? dot * qscale : -RF_INF;
      if (CAP && cap > 0.f && s[i] != -RF_INF) s[i] = rf_softcap(s[i], cap);  // (uniform)
    }
    float mx = -RF_INF;
#pragma unroll
    for (int i = 0; i < TPL; ++i) mx = rf_fmax(mx, s[i]);
    mx = rf_xor_max<16, RF_WARP>(mx);
    const float alpha = rf_pf_rescale(m_run, mx);
    l_part *= alpha;
#pragma unroll
    for (int k = 0; k < DPL; ++k) acc[k] *= alpha;
    float(*p_s)[NTOK] = sh->p[w.warp];
    rf_syncwarp();  // the previous tile's weights are read
#pragma unroll
    for (int i = 0; i < TPL; ++i) {
      const float p = rf_pf_weight(s[i], m_run);
      l_part += p;
      p_s[row()][slice() + J * i] = p;
    }
    rf_syncwarp();
    for (int t = 0; t < NTOK; ++t) {
      const float p = p_s[row()][t];
#pragma unroll
      for (int k = 0; k < DPL; k += 4) {
        const rf_float4 v = rf_lds_read<rf_float4>(KRows::chunk(v_plane, w.tok0 + t, dim(k) / 4));
        acc[k] += p * v.x;
        acc[k + 1] += p * v.y;
        acc[k + 2] += p * v.z;
        acc[k + 3] += p * v.w;
      }
    }
  }
  template <class F>
  RF_DEVICE void row_stats(F&& f) {
    f(0, row(), m_run, rf_xor_sum<16, RF_WARP>(l_part));  // (lanes of a row agree)
  }
  template <class F>
  RF_DEVICE void output(F&& f) {
#pragma unroll
    for (int k = 0; k < DPL; k += 4) {
      const float v[4] = {acc[k], acc[k + 1], acc[k + 2], acc[k + 3]};
      f(0, row(), dim(k), v, 4);
    }
  }
};

// The path of an instance.
template <class E, int D, class Shape>
struct rf_pf_math {
#if defined(RF_HAVE_MMA)
  typedef typename rf_pa_pick<E::TENSOR_KIND != 0, rf_pf_mma<E, D, Shape>,
                              rf_pf_core<E, D, Shape>>::type type;
#elif defined(RF_HAVE_MFMA) || defined(RF_HAVE_WMMA)
  typedef typename rf_pa_pick<E::TENSOR_KIND != 0, rf_pf_matrix<E, D, Shape>,
                              rf_pf_core<E, D, Shape>>::type type;
#else
  typedef rf_pf_core<E, D, Shape> type;
#endif
};
