// The arithmetic of paged attention, per warp: each warp owns WROWS rows of every tile and
// keeps its own online softmax (base-2 exponent, float32) over them. Three paths with one
// interface, chosen per target, dtype and group size by rf_pa_math:
//   rf_pa_core    CUDA cores / VALU: TPT threads per token score q from shared memory, each
//                 lane accumulates V for its chunks of the row (any dtype, any G, any target);
//   rf_pa_mma     NVIDIA tensor cores (mma.sync, sm_80+), 16-bit and fp8 caches, any G;
//   rf_pa_matrix  AMD matrix cores (MFMA on gfx90a/gfx94x, WMMA on gfx11), 16-bit, G >= 4.
// Interface (every call warp-uniform): load_queries (then a CTA barrier if QUERIES_SHARED),
// reset, tile (one tile's rows of this warp, tokens [t0, end) of the piece valid), publish
// (the warp's max and sum per head into wm_s/wl_s), put<ADD> (this warp's accumulators,
// rescaled from its max to the CTA's, stored into out_s[G][D], every element, or added to
// it: rf_pa_put).
#pragma once
#include "compat.h"

// Weight of a warp whose running max is m_warp in a sum rescaled to max m_cta (0 if empty).
RF_DEVICE float l_part_scale(float m_warp, float m_cta) {
  return m_warp == -RF_INF ? 0.f : rf_exp2(m_warp - m_cta);
}

// A warp's share of a piece's output into shared memory: stored (the first writer of the
// element) or added (a later one).
template <bool ADD>
RF_DEVICE void rf_pa_put(float& out, float x) {
  if constexpr (ADD) out += x;
  else out = x;
}

// Where a thread is: its index in the CTA, its lane, its warp.
struct rf_pa_thread {
  int tid, lane, warp;
};

// ---- CUDA cores -----------------------------------------------------------------------------
template <class E, int D, int G, class Tile>
struct rf_pa_core {
  typedef typename Tile::stored S;  // E, or fp8 codes (Tile::CODES), each chunk unpacked
  static constexpr int PV = S::PER_VEC, T = Tile::TOKENS, VPR = Tile::VPR, TPT = Tile::TPT;
  static constexpr int CHUNKS = Tile::CHUNKS, WROWS = T / RF_PA_WARPS;
  static constexpr int LPR = VPR < RF_WARP ? VPR : RF_WARP;  // V: lanes per row
  static constexpr int CPL = VPR / LPR;                       // V: chunks per lane
  static constexpr int VSTEP = RF_WARP / LPR;                 // V: rows a warp covers per step
  static constexpr int RPG = WROWS / VSTEP;                   // V: rows per group of LPR lanes
  // Queries: a cache chunk's PV of them (16, 32 or 64 bytes) every QPC floats: 16-bit chunks
  // get 16 bytes of padding (48-byte steps: 3 bank groups, odd, so 8 lanes reading 8 chunks
  // whose indices differ mod 8, as qk_chunk's do, read 8 different groups), chunks of codes
  // 16 too (80-byte steps: 5 groups); f32 chunks none.
  static constexpr int QPC = PV == 8 ? 12 : PV == 16 ? 20 : PV, QROW = D / PV * QPC;
  static constexpr bool QUERIES_SHARED = true;
  static constexpr float UNIT = 1.f;  // chunks unpack to their values (codes: / 256)
  static_assert(CHUNKS * TPT == VPR && T * TPT == RF_PA_THREADS, "tile shape");
  static_assert(WROWS * TPT == RF_WARP, "a warp's QK rows are its V rows");
  static_assert(RPG * VSTEP == WROWS && (LPR % 8 == 0 || Tile::CODES),
                "V: whole blocks of rows, 8-lane sets (AMD's bank analysis; codes: NVIDIA)");
  struct Shared {
    __attribute__((aligned(16))) float q[G][QROW];  // the group's queries, scaled
    float p[G][T];                               // each row's weight per head
  };
  Shared& sh;
  rf_pa_thread th;
  float acc[G][CPL * PV], m_run[G], l_part[G];

  // Every thread: the piece's queries, scaled, into shared memory (zeros past nh heads).
  RF_DEVICE void load_queries(const typename E::storage* q, int s, int num_q_heads, int q0,
                              int nh, float qscale) {
    for (int i = th.tid; i < G * D; i += RF_PA_THREADS) {
      const int g = i / D, d = i % D;
      sh.q[g][d / PV * QPC + d % PV] =
          g < nh ? E::to_float(q[((rf_i64)s * num_q_heads + q0 + g) * D + d]) * qscale : 0.f;
    }
  }
  RF_DEVICE void reset() {
#pragma unroll
    for (int g = 0; g < G; ++g) {
      m_run[g] = -RF_INF;
      l_part[g] = 0.f;
#pragma unroll
      for (int e = 0; e < CPL * PV; ++e) acc[g][e] = 0.f;
    }
  }
  RF_DEVICE void tile(const char* k_plane, const char* v_plane, int t0, int first, int end,
                      float, float cap) {
    // scores: TPT threads per token, each over CHUNKS chunks, then summed across them
    const int my_row = th.tid / TPT;
    const int tok = t0 + my_row;
    // the queries are read from shared memory per tile: held across the loop, eight heads'
    // would take G x CHUNKS x PV registers
    int q_at = 0;
    if constexpr (G >= 8) rf_opaque(q_at);
    const float(*q_s)[QROW] = reinterpret_cast<const float(*)[QROW]>(
        reinterpret_cast<const char*>(&sh.q[0][0]) + q_at);
    // two accumulators (chunks alternate, halving the FMA chains) where registers allow
    constexpr int CHAINS = G < 8 ? 2 : 1;
    float s[G], s_odd[G];
#pragma unroll
    for (int g = 0; g < G; ++g) s[g] = s_odd[g] = 0.f;
#pragma unroll
    for (int c = 0; c < CHUNKS; ++c) {
      const int j = Tile::qk_chunk(th.tid % TPT, c);  // conflict-free (rf_pa_tile)
      float k[PV];
      S::unpack(Tile::load(k_plane, my_row, j), k);
#pragma unroll
      for (int g = 0; g < G; ++g) {
        float dot = 0.f;
#pragma unroll
        for (int e = 0; e < PV; e += 4) {
          const rf_float4 qv = rf_lds_read<rf_float4>(&q_s[g][j * QPC + e]);
          dot += qv.x * k[e] + qv.y * k[e + 1] + qv.z * k[e + 2] + qv.w * k[e + 3];
        }
        if (CHAINS == 2 && (c & 1)) s_odd[g] += dot; else s[g] += dot;
        if constexpr (G >= 8) rf_sched_fence();  // one head's queries live at a time
      }
    }
#pragma unroll
    for (int g = 0; g < G; ++g) s[g] += s_odd[g];
    // online softmax over this warp's rows (every lane of the warp gets the same max)
    const bool leader = th.tid % TPT == 0;
#pragma unroll
    for (int g = 0; g < G; ++g) {
      s[g] = rf_softcap(rf_xor_sum<1, TPT>(s[g]), cap);
      if (tok >= end || tok < first) s[g] = -RF_INF;
      const float m_new = rf_fmax(m_run[g], rf_warp_max(s[g]));
      const float alpha = m_run[g] == -RF_INF ? 0.f : rf_exp2(m_run[g] - m_new);
      const float p = tok < end && tok >= first ? rf_exp2(s[g] - m_new) : 0.f;
      if (leader) sh.p[g][my_row] = p;
      l_part[g] = l_part[g] * alpha + (leader ? p : 0.f);
      m_run[g] = m_new;
#pragma unroll
      for (int e = 0; e < CPL * PV; ++e) acc[g][e] *= alpha;
    }
    rf_syncwarp();
    // values: lane owns chunks lane % LPR + cc * LPR (cc < CPL) of its group's RPG rows
    const int rows = end - t0 < T ? end - t0 : T;
    const int vrow0 = th.warp * WROWS + RPG * v_group();
    for (int r = vrow0; r < vrow0 + RPG; ++r) {
      if (r < rows) {
#pragma unroll
        for (int cc = 0; cc < CPL; ++cc) {
          float v[PV];
          S::unpack(Tile::load(v_plane, r, th.lane % LPR + cc * LPR), v);
#pragma unroll
          for (int g = 0; g < G; ++g) {
            const float p = sh.p[g][r];
#pragma unroll
            for (int e = 0; e < PV; ++e) acc[g][cc * PV + e] += p * v[e];
          }
        }
      }
    }
  }
  RF_DEVICE void publish(float (*wm_s)[RF_PA_WARPS], float (*wl_s)[RF_PA_WARPS]) {
#pragma unroll
    for (int g = 0; g < G; ++g) {
#pragma unroll
      for (int e = 0; e < CPL * PV; ++e) acc[g][e] = rf_xor_sum<LPR, RF_WARP>(acc[g][e]);
      const float l = rf_warp_sum(l_part[g]);
      if (th.lane == 0) {
        wm_s[g][th.warp] = m_run[g];
        wl_s[g][th.warp] = l;
      }
    }
  }
  template <bool ADD>
  RF_DEVICE void put(float (*out_s)[D], const float* m_cta) {
    if (th.lane >= LPR) return;
#pragma unroll
    for (int g = 0; g < G; ++g) {
      const float scale_w = l_part_scale(m_run[g], m_cta[g]);
#pragma unroll
      for (int cc = 0; cc < CPL; ++cc)
#pragma unroll
        for (int e = 0; e < PV; ++e)
          rf_pa_put<ADD>(out_s[g][(th.lane + cc * LPR) * PV + e],
                         scale_w * acc[g][cc * PV + e]);
    }
  }
  // Which of the warp's blocks of RPG rows the lane's group of LPR lanes reads V from: block
  // i for group i, except on wave64 with 16 lanes a row (groups 0-3, RPG = 4), where groups 1
  // and 2 trade blocks, so that lanes 16 apart, which gfx9's ds_read_b128 serves together
  // (0-3 with 20-23, ...), read rows 8 apart: the same bank groups, for different chunks.
  // With 8 lanes a row, lanes 16 apart are groups i and i + 2, 8 rows apart already.
  RF_DEVICE int v_group() const {
    const int i = th.lane / LPR;
    return RF_WARP == 64 && LPR == 16 ? (i & 1) << 1 | i >> 1 : i;
  }
};

#if defined(RF_HAVE_MMA)
// ---- NVIDIA tensor cores ---------------------------------------------------------------------
// QK: S^T[16 tokens x 8 heads] = K[16 x D] . Q^T[D x 8] per warp and m-tile, K by ldmatrix from
// the stage (rf_pa_tile), Q^T fragments in registers, or for D > 128 (where registers are
// short) read per k-step from shared memory, rows padded by 16 bytes so the reads are
// conflict-free; heads past the group are zero, and scores are scaled after the product.
// PV: O^T[16 dims x 8 heads] += V^T[16 dims x 16 tokens] . P^T[16 tokens x 8 heads], V^T by
// ldmatrix.trans, P rounded to the cache's type through shared memory.
// A stage of fp8 codes (Tile::CODES) is read by the same ldmatrix, two codes taken for one
// 16-bit element, and widened in registers (rf_e4m3::moved, a byte permute apart):
// - K: one x4 covers 16 rows x 32 dims, two k-steps; lane (g, c) = (lane / 4, lane % 4) gets
//   dims 4c .. 4c + 3 of rows g and g + 8 of each, which fill the A operand's k-slots 2c, 2c
//   + 1 (dims 4c, 4c + 1) and 2c + 8, 2c + 9 (dims 4c + 2, 4c + 3): the k-step's dims taken
//   in that order, as the query fragments are (load_queries);
// - V: one x4.trans covers 16 tokens x 32 dims, two d-tiles; lane (g, c) gets tokens 2c and
//   2c + 1 of dims 2g and 2g + 1 (of 8 tokens and 16 dims), which fill the V^T operand's
//   rows g (dim 2g) and g + 8 (dim 2g + 1): the d-tile's dims in that order, as put()
//   stores them.
template <class E, int D, int G, class Tile>
struct rf_pa_mma {
  static constexpr bool CODES = Tile::CODES;
  static constexpr int T = Tile::TOKENS, WROWS = T / RF_PA_WARPS, KSTEPS = D / 16;
  static constexpr int DTILES = D / 16, MROWS = WROWS < 16 ? WROWS : 16;
  static constexpr int MTILES = WROWS < 16 ? 1 : WROWS / 16;
  static constexpr bool Q_IN_SMEM = D > 128, QUERIES_SHARED = Q_IN_SMEM;
  // Q^T rows in shared memory (D > 128): padded by 16 bytes, or 32 for codes (whose lanes read
  // 8 bytes: 4 rows then fill the 32 banks)
  static constexpr int QROW = D + (CODES ? 16 : 8);
  static constexpr float UNIT = CODES && E::TENSOR_KIND == 2 ? rf_e4m3::BF16_UNIT : 1.f;
  static_assert(!CODES || MROWS == 16, "codes: whole 16-row m-tiles");
  struct Shared {
    typename E::storage p16[G][T];
    alignas(16) typename E::storage q16[Q_IN_SMEM ? 8 : 1][Q_IN_SMEM ? QROW : 2];
  };
  // Lane (g, c)'s query dims for k-slots 2c + 8 half (and the next): 16-bit rows keep them in
  // order, codes take 4c + 2 half (see above).
  RF_DEVICE static int q_dim(int lane, int half) {
    return CODES ? 4 * (lane % 4) + 2 * half : half * 8 + (lane % 4) * 2;
  }
  // Two of a register's four codes -> one A-operand register (selector: their bytes, placed
  // in bytes 1 and 3)
  RF_DEVICE static unsigned widen(unsigned codes, unsigned selector) {
    return rf_e4m3::moved<E>(rf_byte_perm(codes, 0u, selector));
  }
  Shared& sh;
  rf_pa_thread th;
  unsigned qb[Q_IN_SMEM ? 1 : KSTEPS][2];
  float acc2[DTILES][4], m_run[G], l_part[G];

  RF_DEVICE void load_queries(const typename E::storage* q, int s, int num_q_heads, int q0,
                              int nh, float) {
    if constexpr (Q_IN_SMEM) {
      for (int i = th.tid; i < 8 * D; i += RF_PA_THREADS) {
        const int g = i / D, d = i % D;
        sh.q16[g][d] = g < nh ? q[((rf_i64)s * num_q_heads + q0 + g) * D + d] : 0;
      }
    } else {
      const int head = th.lane / 4;
      const typename E::storage* qrow = q + ((rf_i64)s * num_q_heads + q0 + head) * D;
#pragma unroll
      for (int ks = 0; ks < KSTEPS; ++ks)
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const int d = ks * 16 + q_dim(th.lane, half);
          qb[ks][half] = head < nh ? (unsigned)qrow[d] | ((unsigned)qrow[d + 1] << 16) : 0u;
        }
    }
  }
  RF_DEVICE void reset() {
#pragma unroll
    for (int dt = 0; dt < DTILES; ++dt)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc2[dt][e] = 0.f;
#pragma unroll
    for (int g = 0; g < G; ++g) {
      m_run[g] = -RF_INF;
      l_part[g] = 0.f;
    }
  }
  RF_DEVICE void tile(const char* k_plane, const char* v_plane, int t0, int first, int end,
                      float qscale, float cap) {
    const int lane = th.lane, warp = th.warp;
    float sc[MTILES][4];
    const int row_in = (lane % 8) + 8 * ((lane / 8) % 2);
#pragma unroll
    for (int mt = 0; mt < MTILES; ++mt) {
      float odd[4] = {0.f, 0.f, 0.f, 0.f};  // odd k-steps: two chains of dependent mma
      sc[mt][0] = sc[mt][1] = sc[mt][2] = sc[mt][3] = 0.f;
      const int row = warp * WROWS + mt * 16 + row_in % MROWS;
      auto query = [&](int ks, unsigned (&b)[2]) {  // the k-step's Q^T fragment
        if constexpr (Q_IN_SMEM) {
          const unsigned* qrow = reinterpret_cast<const unsigned*>(
              &sh.q16[lane / 4][ks * 16 + q_dim(lane, 0)]);
          b[0] = qrow[0];
          b[1] = qrow[CODES ? 1 : 4];
        } else {
          b[0] = qb[ks][0];
          b[1] = qb[ks][1];
        }
      };
      if constexpr (CODES) {
#pragma unroll
        for (int ks = 0; ks < KSTEPS; ks += 2) {
          unsigned r[4];  // [rows 0-7, rows 8-15] x [k-step ks, ks + 1], 4 codes each
          rf_ldmatrix_x4<false>(r, Tile::chunk(k_plane, row, ks + lane / 16));
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const unsigned a[4] = {widen(r[2 * h], 0x1404u), widen(r[2 * h + 1], 0x1404u),
                                   widen(r[2 * h], 0x3424u), widen(r[2 * h + 1], 0x3424u)};
            unsigned b[2];
            query(ks + h, b);
            rf_mma16816<E::TENSOR_KIND>(h ? odd : sc[mt], a, b);
          }
        }
      } else {
#pragma unroll
        for (int ks = 0; ks < KSTEPS; ++ks) {
          unsigned a[4];
          rf_ldmatrix_x4<false>(a, Tile::chunk(k_plane, row, ks * 2 + lane / 16));
          unsigned b[2];
          query(ks, b);
          rf_mma16816<E::TENSOR_KIND>(ks % 2 ? odd : sc[mt], a, b);
        }
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
        const bool valid = (r == 0 || MROWS == 16) && t0 + row < end && t0 + row >= first;
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
          sc[mt][r * 2 + hh] = valid ? sc[mt][r * 2 + hh] * qscale : -RF_INF;
          mx[hh] = rf_fmax(mx[hh], sc[mt][r * 2 + hh]);
        }
      }
    if (cap > 0.f) {  // (uniform) tanh is increasing: the capped scores' max is the max capped
#pragma unroll
      for (int mt = 0; mt < MTILES; ++mt)
#pragma unroll
        for (int e = 0; e < 4; ++e)
          sc[mt][e] = sc[mt][e] == -RF_INF ? -RF_INF : rf_softcap(sc[mt][e], cap);
#pragma unroll
      for (int hh = 0; hh < 2; ++hh)
        mx[hh] = mx[hh] == -RF_INF ? -RF_INF : rf_softcap(mx[hh], cap);
    }
    mx[0] = rf_xor_max<4, 32>(mx[0]);
    mx[1] = rf_xor_max<4, 32>(mx[1]);
    float m_new[G], alpha_h[2] = {1.f, 1.f};
#pragma unroll
    for (int g = 0; g < G; ++g) {
      m_new[g] = rf_fmax(m_run[g], rf_shfl(g % 2 ? mx[1] : mx[0], g / 2));
      const float alpha = m_run[g] == -RF_INF ? 0.f : rf_exp2(m_run[g] - m_new[g]);
      l_part[g] *= alpha;
      m_run[g] = m_new[g];
      alpha_h[0] = g == h0 ? alpha : alpha_h[0];
      alpha_h[1] = g == h0 + 1 ? alpha : alpha_h[1];
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
          if (h < G && (r == 0 || MROWS == 16)) sh.p16[h][row] = E::from_float(p);
          sum += p;
        }
#pragma unroll
      for (int g = 0; g < G; ++g) l_part[g] += g == h ? sum : 0.f;
    }
    rf_syncwarp();
    const int head = lane / 4, k0 = (lane % 4) * 2;
#pragma unroll
    for (int mt = 0; mt < MTILES; ++mt) {
      const int base = warp * WROWS + mt * 16;
      unsigned b[2];
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int k = k0 + half * 8;
        const bool ok = head < G && k < MROWS;
        const typename E::storage* p = sh.p16[head < G ? head : 0] + base + k;
        b[half] = ok ? (unsigned)p[0] | ((unsigned)p[1] << 16) : 0u;
      }
      if constexpr (CODES) {
        const int row = base + (lane % 8) + 8 * ((lane / 8) % 2);
#pragma unroll
        for (int dt = 0; dt < DTILES; dt += 2) {
          unsigned r[4];  // [tokens 0-7, tokens 8-15] x [d-tile dt, dt + 1]
          rf_ldmatrix_x4<true>(r, Tile::chunk(v_plane, row, dt + lane / 16));
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const unsigned a[4] = {widen(r[2 * h], 0x2404u), widen(r[2 * h], 0x3414u),
                                   widen(r[2 * h + 1], 0x2404u), widen(r[2 * h + 1], 0x3414u)};
            rf_mma16816<E::TENSOR_KIND>(acc2[dt + h], a, b);
          }
        }
      } else {
        const int row = base + ((lane % 8) + 8 * (lane / 16)) % MROWS;
#pragma unroll
        for (int dt = 0; dt < DTILES; ++dt) {
          unsigned a[4];
          rf_ldmatrix_x4<true>(a, Tile::chunk(v_plane, row, dt * 2 + (lane / 8) % 2));
          rf_mma16816<E::TENSOR_KIND>(acc2[dt], a, b);
        }
      }
    }
  }
  RF_DEVICE void publish(float (*wm_s)[RF_PA_WARPS], float (*wl_s)[RF_PA_WARPS]) {
#pragma unroll
    for (int g = 0; g < G; ++g) {
      const float l = rf_warp_sum(l_part[g]);
      if (th.lane == 0) {
        wm_s[g][th.warp] = m_run[g];
        wl_s[g][th.warp] = l;
      }
    }
  }
  template <bool ADD>
  RF_DEVICE void put(float (*out_s)[D], const float* m_cta) {
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const int h = (th.lane % 4) * 2 + hh;
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
        for (int r = 0; r < 2; ++r)  // row lane / 4 + 8 r of the d-tile (see above for codes)
          if (h < G)
            rf_pa_put<ADD>(out_s[h][dt * 16 + (CODES ? 2 * (th.lane / 4) + r
                                                     : th.lane / 4 + 8 * r)],
                           scale_w * acc2[dt][r * 2 + hh]);
    }
  }
};
#endif

#if defined(RF_HAVE_MFMA) || defined(RF_HAVE_WMMA)
// ---- AMD matrix cores --------------------------------------------------------------------------
// One 16x16x16 instruction per step, lane l serving head h = l % 16 (heads past G are zero):
// QK  S^T[16 tokens x 16 heads] = K[16 tokens x 16 dims] . Q^T[16 dims x 16 heads], k-steps
//     over D; PV  O^T[16 dims x 16 heads] += V^T[16 dims x 16 tokens] . P^T[16 tokens x 16
//     heads], d-tiles over D. The score layout (tokens in registers, head by lane) is the
//     P^T operand's, so P never leaves registers (WMMA: the odd/even tokens come from the
//     other half of the wave), and each lane's online softmax is its head's alone.
// MFMA (wave64): a lane holds 4 tokens x 1 head of a 16 x 16 tile, and reads K as 8 bytes (4
// dims of a row) and V as 4 separate 2-byte values (one dim, 4 rows); Q^T fragments sit in
// registers. WMMA (wave32): lanes l and l + 16 hold the same operands (16 values: a whole K
// row's 16 dims, a V column's 16 tokens) and a lane 8 tokens of the result; Q^T from shared
// memory. Rows of the stage are padded by 8 bytes, so the 16 rows a K read touches fall in
// distinct bank pairs, and V's 2-byte reads of consecutive dims share words, not banks.
template <class E, int D, int G, class Tile>
struct rf_pa_matrix {
  typedef typename E::storage S;
  static constexpr int T = Tile::TOKENS, WROWS = T / RF_PA_WARPS, KSTEPS = D / 16;
  static constexpr int DTILES = D / 16, MROWS = WROWS < 16 ? WROWS : 16;
  static constexpr int MTILES = WROWS < 16 ? 1 : WROWS / 16;
#if defined(RF_HAVE_MFMA)
  static constexpr bool WMMA = false;
  static constexpr int R = 4;  // result values per lane
#else
  static constexpr bool WMMA = true;
  static constexpr int R = 8;
#endif
  static constexpr bool QUERIES_SHARED = WMMA;
  // Whether tile() applies a logit cap: not on wave32 (WMMA) at head_dim 256 in groups of 8,
  // whose 255 registers hold no more (planning.attention_instance gives capped calls there
  // groups of 4).
  static constexpr bool CAPS = !(WMMA && D == 256 && G == 8);
  static constexpr float UNIT = 1.f;
  static_assert(G <= 16, "one head per lane of a 16-column tile");
  struct Shared {
    alignas(16) S q16[WMMA ? 8 : 1][WMMA ? D + 8 : 2];  // WMMA's Q^T, rows padded by 16 bytes
  };
  Shared& sh;
  rf_pa_thread th;
  rf_u64 qf[WMMA ? 1 : KSTEPS];  // MFMA: this lane's Q^T fragment per k-step (4 dims)
  float acc[DTILES][R], m_run, l_part;

  RF_DEVICE int head() const { return th.lane % 16; }
  // The token (row of the warp's m-tile) of result value i of this lane.
  RF_DEVICE int token(int i) const { return WMMA ? 2 * i + th.lane / 16 : 4 * (th.lane / 16) + i; }

  RF_DEVICE void load_queries(const S* q, int s, int num_q_heads, int q0, int nh, float) {
    if constexpr (WMMA) {
      for (int i = th.tid; i < 8 * D; i += RF_PA_THREADS) {
        const int g = i / D, d = i % D;
        sh.q16[g][d] = g < nh ? q[((rf_i64)s * num_q_heads + q0 + g) * D + d] : (S)0;
      }
    } else {
      const S* qrow = q + ((rf_i64)s * num_q_heads + q0 + head()) * D + 4 * (th.lane / 16);
#pragma unroll
      for (int ks = 0; ks < KSTEPS; ++ks) {
        rf_u64 v = 0;
        if (head() < nh)
#pragma unroll
          for (int i = 0; i < 4; ++i) v |= (rf_u64)qrow[ks * 16 + i] << (16 * i);
        qf[ks] = v;
      }
    }
  }
  RF_DEVICE void reset() {
#pragma unroll
    for (int dt = 0; dt < DTILES; ++dt)
#pragma unroll
      for (int i = 0; i < R; ++i) acc[dt][i] = 0.f;
    m_run = -RF_INF;
    l_part = 0.f;
  }
  // 16 values (WMMA operand) from shared memory: 8-byte aligned, so four 8-byte reads.
  RF_DEVICE static rf_u32x8 load32(const char* p) {
    rf_u32x8 v;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const rf_u64 w = *reinterpret_cast<const rf_u64*>(p + 8 * i);
      v.u[2 * i] = (unsigned)w;
      v.u[2 * i + 1] = (unsigned)(w >> 32);
    }
    return v;
  }
  RF_DEVICE void tile(const char* k_plane, const char* v_plane, int t0, int first, int end,
                      float qscale, float cap) {
    const int lane = th.lane, base = th.warp * WROWS;
    const bool my_row = lane % 16 < MROWS;  // the A operand's row is one of this warp's
#if defined(RF_HAVE_WMMA)
    // WMMA's Q^T operands (16 values a lane per k-step) are read from shared memory per
    // tile: held across the loop they would take 8 registers per k-step
    int q_at = head() * (D + 8) * (int)sizeof(S);
    rf_opaque(q_at);
    const char* q_row = reinterpret_cast<const char*>(&sh.q16[0][0]) + q_at;
#endif
    float s[MTILES][R];
#pragma unroll
    for (int mt = 0; mt < MTILES; ++mt) {
      float c[R];
#pragma unroll
      for (int i = 0; i < R; ++i) c[i] = 0.f;
      const char* k_row = Tile::row(k_plane, base + mt * 16 + lane % 16);
      int after = 0;  // WMMA: two k-steps' operands (32 registers) loaded at a time
#pragma unroll
      for (int ks = 0; ks < KSTEPS; ++ks) {
#if defined(RF_HAVE_MFMA)
        const rf_u64 a = my_row ? *reinterpret_cast<const rf_u64*>(
                                      k_row + ks * 32 + 8 * (lane / 16)) : 0;
        rf_mfma16<E::TENSOR_KIND>(c, a, qf[ks]);
#else
        if (ks >= 2 && ks % 2 == 0) rf_depend(after, c[0]);
        const rf_u32x8 zero = {};
        const rf_u32x8 a = my_row ? load32(k_row + after + ks * 32) : zero;
        const rf_u32x8 b = head() < 8 ? load32(q_row + after + ks * 32) : zero;
        rf_wmma16<E::TENSOR_KIND>(c, a, b);
#endif
      }
#pragma unroll
      for (int i = 0; i < R; ++i) {
        const int row = mt * 16 + token(i);
        const int tok = t0 + base + row;
        s[mt][i] = row < WROWS && tok < end && tok >= first ? c[i] * qscale : -RF_INF;
      }
    }
    if (CAPS && cap > 0.f)  // (uniform, after the products: no registers held across them)
#pragma unroll
      for (int mt = 0; mt < MTILES; ++mt)
#pragma unroll
        for (int i = 0; i < R; ++i)
          s[mt][i] = s[mt][i] == -RF_INF ? -RF_INF : rf_softcap(s[mt][i], cap);
    // online softmax of this lane's head: its own values, then the lanes that share the head
    float mx = -RF_INF;
#pragma unroll
    for (int mt = 0; mt < MTILES; ++mt)
#pragma unroll
      for (int i = 0; i < R; ++i) mx = rf_fmax(mx, s[mt][i]);
    mx = rf_xor_max<16, RF_WARP>(mx);
    const float m_new = rf_fmax(m_run, mx);
    const float alpha = m_run == -RF_INF ? 0.f : rf_exp2(m_run - m_new);
    m_run = m_new;
    float sum = 0.f;
#pragma unroll
    for (int mt = 0; mt < MTILES; ++mt)
#pragma unroll
      for (int i = 0; i < R; ++i) {
        s[mt][i] = s[mt][i] == -RF_INF ? 0.f : rf_exp2(s[mt][i] - m_new);
        sum += s[mt][i];
      }
    l_part = l_part * alpha + sum;
#pragma unroll
    for (int dt = 0; dt < DTILES; ++dt)
#pragma unroll
      for (int i = 0; i < R; ++i) acc[dt][i] *= alpha;
#pragma unroll
    for (int mt = 0; mt < MTILES; ++mt) {
#if defined(RF_HAVE_MFMA)
      rf_u64 b = 0;  // P^T: this lane's 4 tokens of its head, in the cache's type
#pragma unroll
      for (int i = 0; i < 4; ++i) b |= (rf_u64)E::from_float(s[mt][i]) << (16 * i);
      // V^T: dim 16 dt + lane % 16 of the lane's 4 tokens, at constant offsets from vb
      const S* vb = reinterpret_cast<const S*>(
          Tile::row(v_plane, base + mt * 16 + 4 * (lane / 16)) + 2 * (lane % 16));
      const bool rows_mine = mt * 16 + 4 * (lane / 16) < WROWS;  // all 4 or none (WROWS % 4)
#pragma unroll
      for (int dt = 0; dt < DTILES; ++dt) {
        rf_u64 a = 0;
#pragma unroll
        for (int i = 0; i < 4; ++i)
          a |= (rf_u64)(rows_mine ? vb[(i * Tile::STRIDE) / 2 + 16 * dt] : (S)0) << (16 * i);
        rf_mfma16<E::TENSOR_KIND>(acc[dt], a, b);
      }
#else
      rf_u32x8 b;  // P^T: all 16 tokens of this lane's head (the other parity from lane ^ 16)
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        const float other = rf_shfl_xor_c<16>(s[mt][i]);
        const unsigned mine = E::from_float(s[mt][i]), theirs = E::from_float(other);
        b.u[i] = lane < 16 ? mine | (theirs << 16) : theirs | (mine << 16);
      }
      // V^T: dim 16 dt + lane % 16 of the m-tile's 16 tokens, at constant offsets from vb;
      // two d-tiles' operands loaded at a time
      const S* vb = reinterpret_cast<const S*>(Tile::row(v_plane, base + mt * 16) +
                                               2 * (lane % 16));
      int after = 0;
#pragma unroll
      for (int dt = 0; dt < DTILES; ++dt) {
        if (dt >= 2 && dt % 2 == 0) rf_depend(after, acc[dt - 2][0]);
        vb += after;
        rf_u32x8 a;
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          unsigned pair = 0;
#pragma unroll
          for (int h = 0; h < 2; ++h)
            if (mt * 16 + 2 * i + h < WROWS)
              pair |= (unsigned)vb[((2 * i + h) * Tile::STRIDE) / 2 + 16 * dt] << (16 * h);
          a.u[i] = pair;
        }
        rf_wmma16<E::TENSOR_KIND>(acc[dt], a, b);
      }
#endif
    }
  }
  RF_DEVICE void publish(float (*wm_s)[RF_PA_WARPS], float (*wl_s)[RF_PA_WARPS]) {
    const float l = rf_xor_sum<16, RF_WARP>(l_part);
    if (th.lane < 16 && head() < G) {
      wm_s[head()][th.warp] = m_run;
      wl_s[head()][th.warp] = l;
    }
  }
  template <bool ADD>
  RF_DEVICE void put(float (*out_s)[D], const float* m_cta) {
    if (head() >= G) return;
    float m_c = 0.f;
#pragma unroll
    for (int g = 0; g < G; ++g) m_c = g == head() ? m_cta[g] : m_c;
    const float scale_w = l_part_scale(m_run, m_c);
#pragma unroll
    for (int dt = 0; dt < DTILES; ++dt)
#pragma unroll
      for (int i = 0; i < R; ++i)
        rf_pa_put<ADD>(out_s[head()][dt * 16 + token(i)], scale_w * acc[dt][i]);
  }
};
#endif

// The path of an instance (Tile::MATRIX: rf_pa_matrix_path in paged_attention.cu).
template <class E, int D, int G, class Tile>
struct rf_pa_math {
#if defined(RF_HAVE_MMA)
  typedef typename rf_pa_pick<Tile::MATRIX, rf_pa_mma<E, D, G, Tile>,
                              rf_pa_core<E, D, G, Tile>>::type type;
#elif defined(RF_HAVE_MFMA) || defined(RF_HAVE_WMMA)
  typedef typename rf_pa_pick<Tile::MATRIX, rf_pa_matrix<E, D, G, Tile>,
                              rf_pa_core<E, D, G, Tile>>::type type;
#else
  typedef rf_pa_core<E, D, G, Tile> type;
#endif
};
