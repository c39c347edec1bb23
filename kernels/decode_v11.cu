// Decode attention v11: warp-specialized INT2 decode over page records, sm_90.
//
// Storage: one contiguous, 16-byte aligned record per (page, KV head) (oscar.kernels.decode_v11.RecordLayout):
//   [0, PS*D/4)          K codes, the page's bytes in the mma_k fragment order (16-token tiles; lane L's D/8 bytes
//                        of a tile at L*D/8: tokens g, g+8 of lane (g, t))
//   [PS*D/4, PS*D/2)     V codes in the mma_v order (token pairs 2t, 2t+1 and 2t+8, 2t+9)
//   [PS*D/2, +PS*8)      per-token meta, 128 bytes per tile: entry g (16 bytes) = bf16 {ks[g], ks[g+8], kz[g], kz[g+8],
//                        vs[g], vs[g+8], vz[g], vz[g+8]}: one 16-byte shared load per lane and tile (4 lanes share it)
//   [PS*D/2 + PS*8, +(PS/CT)*4*D)  per-channel keys (CT > 0): per block of CT tokens bf16 scale[D] then zero[D]
//                        (rotated-frame channel order); the K words of the meta entries stay zero
// CTA = W math warps + 1 producer warp. The producer's lane 0 reads the page table and issues one cp.async.bulk
// (global -> shared, mbarrier complete_tx) per record into an ST-stage ring (ST a multiple of W: page i of the split
// goes to stage i % ST and is computed by warp i % W, which releases the stage through its "empty" mbarrier). The
// math warps issue no global loads in the loop: per softmax step TPS tiles (TPS * 16 tokens, up to 64), tokens in the
// MMA M dimension (scores S[tokens x heads] = K Q^T, output O^T = V^T P'), codes unpacked to exact fp16 subnormals by
// one lop3 per two codes (the v9/v10 trick: the factor 4^J 2^-24 sits in the query's fragments and the output rows).
// Split-K partials and the BF16 windows' CTAs, then the last CTA of each (sequence, KV head) merges (as v10).
//
// Rope-centered keys (ROPE: keys stored minus RoPE_p(m), oscar.core.rope) add q . RoPE_p(m) = sum_i A_i cos(p w_i) +
// B_i sin(p w_i) to each logit (A, B from q and m once per CTA, in shared memory). At p = P + x (P the page's first
// position) the term is sum_i A'_i cos(x w_i) + B'_i sin(x w_i), (A', B') = (A, B) turned by -P w_i: a math warp
// turns them once per page (angles reduced in fp64, one pair of frequencies per lane, through shared memory) into
// fp16 B fragments, and per 16-token tile D/16 more MMAs score them against a constant table of cos/sin(x w_i),
// x < PS (fp16 A fragments, decode_mma.rope_table with a stride of one tile), copied to shared memory once per CTA.
// Per-channel keys (CT > 0, docs/DESIGN.md "Per-channel key pages"): at the first tile of each channel block the warp
// turns the block's scales into the query's B fragments (q_r * s, fp16; the scales become fp16 in place in the
// record, which the warp owns until it releases the stage) and adds q_r . z (bf16 MMAs of the zeros against q_r split
// into bf16 hi + lo): logit = (q_r * s) . c + q_r . z + q . mu_K (+ the rope term); values per token as always.

typedef unsigned int u32;
typedef unsigned short u16;
typedef unsigned long long u64;

#define NEG_INF (__int_as_float(0xff800000))
#define FULL 0xffffffffu

__device__ __forceinline__ constexpr int slot_j(int i) { return i < 5 ? i : i - 5; }
template <int I>
__device__ __forceinline__ u32 slot(u32 w) {  // 2-bit slot I of each half word as fp16 subnormals c 4^J 2^-24
  constexpr int J = slot_j(I);
  return (I < 5 ? w : (w >> 10)) & ((3u << (2 * J)) * 0x10001u);
}
__device__ __forceinline__ float pow4neg(int j) { return __int_as_float((127 - 2 * j) << 23); }
__device__ __forceinline__ float slot_factor(int j, int h) { return pow4neg(slot_j(2 * (j % 4) + h)); }

__device__ __forceinline__ void mma_f16(float* c, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
               : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
               : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
__device__ __forceinline__ void mma_bf16(float* c, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
               : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
               : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
__device__ __forceinline__ u32 movtrans(u32 x) {
  u32 r;
  asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;" : "=r"(r) : "r"(x));
  return r;
}
__device__ __forceinline__ u32 pack_f16(float lo, float hi) {
  u32 r;
  asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}
__device__ __forceinline__ u32 pack_bf16(float lo, float hi) {
  u32 r;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}
__device__ __forceinline__ float h2f(u32 x) {
  float r;
  asm("cvt.f32.f16 %0, %1;" : "=f"(r) : "h"((u16)(x & 0xffffu)));
  return r;
}
__device__ __forceinline__ float bf16f(u32 x) { return __uint_as_float((x & 0xffffu) << 16); }
__device__ __forceinline__ float bf_lo(u32 x) { return __uint_as_float(x << 16); }
__device__ __forceinline__ float bf_hi(u32 x) { return __uint_as_float(x & 0xffff0000u); }
__device__ __forceinline__ float ex2(float x) {
  float r;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x));
  return r;
}
__device__ __forceinline__ u32 smem_addr(const void* p) { return (u32)__cvta_generic_to_shared(p); }
__device__ __forceinline__ u32 hmul2(u32 a, u32 b) {
  u32 r;
  asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
  return r;
}
__device__ __forceinline__ void ldsm_x4(u32& r0, u32& r1, u32& r2, u32& r3, u32 a) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3) : "r"(a) : "memory");
}

// ---- mbarriers and the bulk copy (sm_90)
__device__ __forceinline__ void mbar_init(u64* bar, u32 count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(bar)), "r"(count));
}
__device__ __forceinline__ void mbar_expect_tx(u64* bar, u32 bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(bar)), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_arrive(u64* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_addr(bar)) : "memory");
}
__device__ __forceinline__ void mbar_wait(u64* bar, u32 parity) {
  asm volatile(
      "{\n .reg .pred p;\n"
      "W11_WAIT:\n"
      " mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
      " @!p bra W11_WAIT;\n}" ::"r"(smem_addr(bar)),
      "r"(parity)
      : "memory");
}
__device__ __forceinline__ void bulk_copy(void* dst, const void* src, u32 bytes, u64* bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                   smem_addr(dst)),
               "l"(src), "r"(bytes), "r"(smem_addr(bar))
               : "memory");
}

struct Params11 {
  const u16* q;              // bf16 [B, H, D]
  const unsigned char* rec;  // records [P, Hkv, REC] bytes
  const int* page_table;     // [B, pt_stride]
  const int* int_len;        // [B]
  const uint2* rk;           // B fragments of R_K per KV head or null
  const float* muk;          // [Hkv, D] or null
  const uint2* rot_out;      // B fragments per KV head or null (partials not in the output frame)
  const float* muv;          // [Hkv, D] or null
  const u16* sink_k;
  const u16* sink_v;
  const int* sink_len;
  const u16* rec_k;
  const u16* rec_v;
  const int* rec_len;
  float* part_o;   // [B, Hkv, S_total, REP, D]
  float* part_ml;  // [B, Hkv, S_total, REP, 2]
  int* counters;   // [B * Hkv], zero between launches
  u16* out;        // bf16 [B, H, D]
  const int* win_row;
  float sc;  // sm_scale * log2(e)
  int hkv, pt_stride, s_int, s_total, has_sink, has_rec, out_rotated, pad_;
  long long rs_p, rs_h;  // record strides (bytes) of a page and a KV head
  long long sk_b, sk_h, sk_t, sk_max;
  long long rk_b, rk_h, rk_t, rk_max;
  const float* rope_m;    // [Hkv, D] pre-RoPE key means (ROPE) or null
  const double* rope_w;   // [D/2] inverse frequencies, zero past the rotary half
  const uint4* rope_tab;  // fp16 A fragments [PS/16][D/16][32 lanes]: cos/sin((16 k + j) w_i), row j of tile k
  const int* rope_pos0;   // [B] position of each sequence's first quantized token, or null (0)
  float rope_scaling;     // RoPE attention scaling
  int rope_half, rope_pos_add, pad2_;  // rotary_dim / 2; added to every position
};

constexpr int SMAX = 256;

template <int D>
struct State {
  float m[2], l[2], zs[2];
  float o[D / 16][4];
};

template <int D>
__device__ __forceinline__ void rescale(State<D>& st, const float (&alpha)[2]) {
  if (!__all_sync(FULL, alpha[0] == 1.f && alpha[1] == 1.f)) {
#pragma unroll
    for (int m = 0; m < D / 16; ++m) {
      st.o[m][0] *= alpha[0];
      st.o[m][1] *= alpha[1];
      st.o[m][2] *= alpha[0];
      st.o[m][3] *= alpha[1];
    }
  }
}

// Per-channel keys, at the first tile of a channel block: qc <- the query's fp16 B fragments (s_qf: q_r times the
// slots' 4^-J) times the block's scales, qz[k] <- q_r . z of head 2t + k. kc: the record's D bf16 K scales, D K zeros
// of the block; the scales turn to fp16 in place (each lane D/64 words), then each lane reads the words of its
// fragments with ldmatrix (all 8 row addresses of a matrix the same 8 channels: row g is every lane's copy). The zeros
// stay bf16 (exact) and are the B operand (every column the zero vector) of bf16 MMAs whose A rows are q_r's bf16 hi
// (rows 0-7: head g) and lo parts (rows 8-15) (s_qz); q_r . z of head g is the sum of rows g and g + 8, moved to the
// lanes of heads 2t, 2t + 1 by two shuffles (as v10's channel_frags).
template <int D>
__device__ __forceinline__ void channel_frags(u32 (&qc)[D / 16][2], float (&qz)[2], unsigned char* kc,
                                              const uint4* s_qf, const uint4* s_qz, int lane) {
  u32* w = reinterpret_cast<u32*>(kc);
#pragma unroll
  for (int i = 0; i < D / 64; ++i) {
    const u32 x = w[lane + 32 * i];
    w[lane + 32 * i] = pack_f16(__uint_as_float(x << 16), __uint_as_float(x & 0xffff0000u));
  }
  __syncwarp();
  const u32 kc_s = smem_addr(kc);
#pragma unroll
  for (int c = 0; c < D / 32; ++c) {  // matrix i of call c: channels 8 (4c + i) .. + 7, i.e. chunk 2c + i/2, half i%2
    u32 s0, s1, s2, s3;
    ldsm_x4(s0, s1, s2, s3, kc_s + 16 * (4 * c + (lane >> 3)));
    const uint4 f = s_qf[c * 32 + lane];
    qc[2 * c][0] = hmul2(f.x, s0);
    qc[2 * c][1] = hmul2(f.y, s1);
    qc[2 * c + 1][0] = hmul2(f.z, s2);
    qc[2 * c + 1][1] = hmul2(f.w, s3);
  }
  float za[2][4];
#pragma unroll
  for (int n = 0; n < 2; ++n)
#pragma unroll
    for (int i = 0; i < 4; ++i) za[n][i] = 0.f;
#pragma unroll
  for (int c = 0; c < D / 32; ++c) {
    u32 z0, z1, z2, z3;
    ldsm_x4(z0, z1, z2, z3, kc_s + 2 * D + 16 * (4 * c + (lane >> 3)));
    const uint4 a0 = s_qz[(2 * c) * 32 + lane], a1 = s_qz[(2 * c + 1) * 32 + lane];
    mma_bf16(za[0], a0.x, a0.y, a0.z, a0.w, z0, z1);
    mma_bf16(za[1], a1.x, a1.y, a1.z, a1.w, z2, z3);
  }
  const float v = (za[0][0] + za[1][0]) + (za[0][2] + za[1][2]);  // head g: hi + lo
  const int t = lane & 3;
  qz[0] = __shfl_sync(FULL, v, 8 * t);
  qz[1] = __shfl_sync(FULL, v, 8 * t + 4);
}

// Rope-centered keys, once per page: ub <- the rope term's B fragments for the page's tokens from position pos:
// (A', B') = (A, B) turned by -pos w_i, head g, as fp16. s_u: per head D/4 entries {A_2p, B_2p, A_2p+1, B_2p+1}
// (times sc and the RoPE scaling); s_cs: this warp's D/4 entries {cos, sin} of frequencies 2p, 2p + 1, written by lane
// p (angles reduced in fp64, then fast sincos within [-pi, pi]; w: lane p's two frequencies, loaded before the loop).
// ub[kc] (kc < D/32) multiplies the table's cos columns, ub[kc + D/32] its sin columns (frequencies
// 16 kc + 8 h + 2t + {0, 1}).
template <int D, int REP>
__device__ __forceinline__ void rope_turn(u32 (&ub)[D / 16][2], const float4* s_u, float4* s_cs, const double (&w)[2],
                                          long long pos, int lane) {
  const int g = lane >> 2, t = lane & 3;
  if (lane < D / 4) {
    float c[2], s[2];
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const double a = (double)pos * w[e];
      const double r = fma(-rint(a * 0.15915494309189535), 6.283185307179586, a);
      __sincosf((float)r, &s[e], &c[e]);
    }
    s_cs[lane] = make_float4(c[0], s[0], c[1], s[1]);
  }
  __syncwarp();
#pragma unroll
  for (int kc = 0; kc < D / 32; ++kc) {
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const int p = 8 * kc + 4 * hh + t;
      const float4 cs = s_cs[p];
      const float4 u = g < REP ? s_u[g * (D / 4) + p] : make_float4(0.f, 0.f, 0.f, 0.f);
      ub[kc][hh] = pack_f16(fmaf(cs.x, u.x, cs.y * u.y), fmaf(cs.z, u.z, cs.w * u.w));
      ub[kc + D / 32][hh] = pack_f16(fmaf(cs.x, u.y, -cs.y * u.x), fmaf(cs.z, u.w, -cs.w * u.z));
    }
  }
}

// One softmax step over TPS tiles (16 tokens each) of a record in shared memory: tiles tile0 .. tile0 + TPS - 1.
// MASK: tokens at or past nv (counted from the page's first token) are masked (the sequence's last page).
// ROPE: ub are the page's rope-term B fragments (rope_turn), tab the table in shared memory. CT > 0 (per-channel keys):
// qc/qzm hold the current channel block's query fragments and logit offset (updated here at each block's first tile;
// s_qf, s_qz: the query's fragments for channel_frags); the per-token path uses qb, qs and qm.
template <int D, int PS, int TPS, bool MASK, bool ROPE, int CT>
__device__ __forceinline__ void int_step(State<D>& st, unsigned char* rec, int tile0, const u32 (&qb)[D / 16][2],
                                         const float (&qs)[2], const float (&qm)[2], float ksc, int nv, int lane,
                                         const u32 (&ub)[D / 16][2], const uint4* tab, u32 (&qc)[D / 16][2],
                                         float (&qzm)[2], const uint4* s_qf, const uint4* s_qz, float sc) {
  constexpr int NU = D / 64;  // words per token (K) or token pair (V) and lane
  constexpr int LB = D / 8;   // bytes per lane and tile
  const int g = lane >> 2, t = lane & 3;
  float lg[TPS][4], sv[TPS][2], zv[TPS][2];
#pragma unroll
  for (int j = 0; j < TPS; ++j) {
    if (CT && ((tile0 + j) * 16) % (CT ? CT : 1) == 0) {  // the first tile of a channel block
      float qz[2];
      channel_frags<D>(qc, qz, rec + PS * D / 2 + PS * 8 + ((tile0 + j) * 16 / (CT ? CT : 1)) * 4 * D, s_qf, s_qz, lane);
      qzm[0] = fmaf(qz[0], sc, qm[0]);
      qzm[1] = fmaf(qz[1], sc, qm[1]);
    }
    const u32(*qk)[2] = CT ? qc : qb;  // CT is a constant: the registers of one of them
    const unsigned char* kt = rec + (tile0 + j) * 16 * (D / 4) + lane * LB;
    u32 kw[2 * NU];
    if (NU == 2) {
      const uint4 x = *reinterpret_cast<const uint4*>(kt);
      kw[0] = x.x; kw[1] = x.y; kw[NU] = x.z; kw[NU + 1] = x.w;
    } else {
      const uint2 x = *reinterpret_cast<const uint2*>(kt);
      kw[0] = x.x; kw[1] = x.y;
    }
    const uint4 meta = *reinterpret_cast<const uint4*>(rec + PS * D / 2 + (tile0 + j) * 128 + g * 16);
    float acc[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int u = 0; u < NU; ++u) {
      const u32 w0 = kw[u], w1 = kw[NU + u];  // tokens g and g + 8
      mma_f16(acc, slot<0>(w0), slot<0>(w1), slot<1>(w0), slot<1>(w1), qk[4 * u + 0][0], qk[4 * u + 0][1]);
      mma_f16(acc, slot<2>(w0), slot<2>(w1), slot<3>(w0), slot<3>(w1), qk[4 * u + 1][0], qk[4 * u + 1][1]);
      mma_f16(acc, slot<4>(w0), slot<4>(w1), slot<5>(w0), slot<5>(w1), qk[4 * u + 2][0], qk[4 * u + 2][1]);
      mma_f16(acc, slot<6>(w0), slot<6>(w1), slot<7>(w0), slot<7>(w1), qk[4 * u + 3][0], qk[4 * u + 3][1]);
    }
    float racc[4] = {0.f, 0.f, 0.f, 0.f};  // the rope term of tokens g, g + 8 (heads 2t, 2t + 1)
    if (ROPE) {
#pragma unroll
      for (int kc = 0; kc < D / 16; ++kc) {
        const uint4 a = tab[((tile0 + j) * (D / 16) + kc) * 32 + lane];
        mma_f16(racc, a.x, a.y, a.z, a.w, ub[kc][0], ub[kc][1]);
      }
    }
    const float sk[2] = {CT ? ksc : bf_lo(meta.x) * ksc, CT ? ksc : bf_hi(meta.x) * ksc};
    const float zk[2] = {bf_lo(meta.y), bf_hi(meta.y)};
    sv[j][0] = bf_lo(meta.z);
    sv[j][1] = bf_hi(meta.z);
    zv[j][0] = bf_lo(meta.w);
    zv[j][1] = bf_hi(meta.w);
#pragma unroll
    for (int n = 0; n < 2; ++n) {
#pragma unroll
      for (int k = 0; k < 2; ++k) {
        const float base = CT ? qzm[k] : fmaf(zk[n], qs[k], qm[k]);
        lg[j][2 * n + k] = fmaf(acc[2 * n + k], sk[n], ROPE ? base + racc[2 * n + k] : base);
      }
      if (MASK) {
        const bool ok = (tile0 + j) * 16 + 8 * n + g < nv;
        if (!ok) {
          lg[j][2 * n] = NEG_INF;
          lg[j][2 * n + 1] = NEG_INF;
          sv[j][n] = 0.f;
          zv[j][n] = 0.f;
        }
      }
    }
  }
  // softmax over the step's TPS * 16 tokens
  float mh[2] = {lg[0][0], lg[0][1]};
#pragma unroll
  for (int j = 0; j < TPS; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) mh[e & 1] = fmaxf(mh[e & 1], lg[j][e]);
#pragma unroll
  for (int k = 0; k < 2; ++k) {
    mh[k] = fmaxf(mh[k], __shfl_xor_sync(FULL, mh[k], 4));
    mh[k] = fmaxf(mh[k], __shfl_xor_sync(FULL, mh[k], 8));
    mh[k] = fmaxf(mh[k], __shfl_xor_sync(FULL, mh[k], 16));
  }
  float alpha[2];
#pragma unroll
  for (int k = 0; k < 2; ++k) {  // the step holds a valid token, so mh is finite
    const float mn = fmaxf(st.m[k], mh[k]);
    alpha[k] = ex2(st.m[k] - mn);
    st.m[k] = mn;
  }
  float lsum[2] = {0.f, 0.f}, zsum[2] = {0.f, 0.f};
  u32 pb[TPS][2];
#pragma unroll
  for (int j = 0; j < TPS; ++j) {
    float p[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) p[e] = ex2(lg[j][e] - st.m[e & 1]);
#pragma unroll
    for (int k = 0; k < 2; ++k) {
      lsum[k] += p[k] + p[k + 2];
      zsum[k] = fmaf(p[k], zv[j][0], fmaf(p[k + 2], zv[j][1], zsum[k]));
    }
    pb[j][0] = movtrans(pack_f16(p[0] * sv[j][0], p[1] * sv[j][0]));
    pb[j][1] = movtrans(pack_f16(p[2] * sv[j][1], p[3] * sv[j][1]));
  }
#pragma unroll
  for (int k = 0; k < 2; ++k) {
    st.l[k] = fmaf(st.l[k], alpha[k], lsum[k]);
    st.zs[k] = fmaf(st.zs[k], alpha[k], zsum[k]);
  }
  rescale<D>(st, alpha);
  (void)t;
#pragma unroll
  for (int j = 0; j < TPS; ++j) {
    const unsigned char* vt = rec + PS * D / 4 + (tile0 + j) * 16 * (D / 4) + lane * LB;
    u32 vw[2 * NU];
    if (NU == 2) {
      const uint4 x = *reinterpret_cast<const uint4*>(vt);
      vw[0] = x.x; vw[1] = x.y; vw[NU] = x.z; vw[NU + 1] = x.w;
    } else {
      const uint2 x = *reinterpret_cast<const uint2*>(vt);
      vw[0] = x.x; vw[1] = x.y;
    }
#pragma unroll
    for (int u = 0; u < NU; ++u) {
      const u32 w0 = vw[u], w1 = vw[NU + u];  // token pairs (2t, 2t+1) and (2t+8, 2t+9)
      mma_f16(st.o[4 * u + 0], slot<0>(w0), slot<1>(w0), slot<0>(w1), slot<1>(w1), pb[j][0], pb[j][1]);
      mma_f16(st.o[4 * u + 1], slot<2>(w0), slot<3>(w0), slot<2>(w1), slot<3>(w1), pb[j][0], pb[j][1]);
      mma_f16(st.o[4 * u + 2], slot<4>(w0), slot<5>(w0), slot<4>(w1), slot<5>(w1), pb[j][0], pb[j][1]);
      mma_f16(st.o[4 * u + 3], slot<6>(w0), slot<7>(w0), slot<6>(w1), slot<7>(w1), pb[j][0], pb[j][1]);
    }
  }
}

// One 16-token block of a BF16 window (as v10's bf16_block; the windows are read straight from global memory).
template <int D>
__device__ __forceinline__ void bf16_block(State<D>& st, const u16* kp, const u16* vp, long long st_t,
                                           const u32 (&qb)[D / 16][2], float sc, int tok0, int n, int lane) {
  const int g = lane >> 2, t = lane & 3;
  float acc[2][4];
#pragma unroll
  for (int h = 0; h < 2; ++h)
#pragma unroll
    for (int i = 0; i < 4; ++i) acc[h][i] = 0.f;
  const bool ok0 = tok0 + g < n, ok1 = tok0 + g + 8 < n;
  const u32* r0 = reinterpret_cast<const u32*>(kp + (long long)(tok0 + g) * st_t);
  const u32* r1 = reinterpret_cast<const u32*>(kp + (long long)(tok0 + g + 8) * st_t);
#pragma unroll
  for (int j = 0; j < D / 16; ++j) {
    const u32 a0 = ok0 ? __ldg(r0 + 8 * j + t) : 0u, a2 = ok0 ? __ldg(r0 + 8 * j + 4 + t) : 0u;
    const u32 a1 = ok1 ? __ldg(r1 + 8 * j + t) : 0u, a3 = ok1 ? __ldg(r1 + 8 * j + 4 + t) : 0u;
    mma_bf16(acc[j & 1], a0, a1, a2, a3, qb[j][0], qb[j][1]);
  }
  float lg[4];
#pragma unroll
  for (int e = 0; e < 4; ++e) lg[e] = ((e < 2) ? ok0 : ok1) ? (acc[0][e] + acc[1][e]) * sc : NEG_INF;
  float mh[2] = {fmaxf(lg[0], lg[2]), fmaxf(lg[1], lg[3])};
#pragma unroll
  for (int k = 0; k < 2; ++k) {
    mh[k] = fmaxf(mh[k], __shfl_xor_sync(FULL, mh[k], 4));
    mh[k] = fmaxf(mh[k], __shfl_xor_sync(FULL, mh[k], 8));
    mh[k] = fmaxf(mh[k], __shfl_xor_sync(FULL, mh[k], 16));
  }
  float alpha[2], mu[2];
#pragma unroll
  for (int k = 0; k < 2; ++k) {
    const float mn = fmaxf(st.m[k], mh[k]);
    mu[k] = mn == NEG_INF ? 0.f : mn;
    alpha[k] = ex2(st.m[k] - mu[k]);
    st.m[k] = mn;
  }
  float p[4];
#pragma unroll
  for (int e = 0; e < 4; ++e) p[e] = ex2(lg[e] - mu[e & 1]);
#pragma unroll
  for (int k = 0; k < 2; ++k) st.l[k] = st.l[k] * alpha[k] + (p[k] + p[k + 2]);
  rescale<D>(st, alpha);
  const u32 pb0 = movtrans(pack_bf16(p[0], p[1])), pb1 = movtrans(pack_bf16(p[2], p[3]));
  bool okv[2][2];
#pragma unroll
  for (int h = 0; h < 2; ++h)
#pragma unroll
    for (int e = 0; e < 2; ++e) okv[h][e] = tok0 + 8 * h + 2 * t + e < n;
  const u16* v0 = vp + (long long)(tok0 + 2 * t) * st_t;
#pragma unroll
  for (int m = 0; m < D / 16; ++m) {
    u32 a[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int ch = 16 * m + g + 8 * (i & 1), dt = 8 * (i >> 1);
      const u32 lo = okv[i >> 1][0] ? __ldg(v0 + (long long)dt * st_t + ch) : 0u;
      const u32 hi = okv[i >> 1][1] ? __ldg(v0 + (long long)(dt + 1) * st_t + ch) : 0u;
      a[i] = lo | (hi << 16);
    }
    mma_bf16(st.o[m], a[0], a[1], a[2], a[3], pb0, pb1);
  }
}

// x[REP][D] (shared) <- x @ M on the tensor cores by the W math warps; every thread of the CTA calls it (barriers).
template <int D, int REP, int W>
__device__ __forceinline__ void rotate_rows(float* x, const uint2* __restrict__ Mf, int tid) {
  constexpr int KC = D / 16, NTW = D / 8 / W;
  const int lane = tid & 31, warp = tid >> 5, g = lane >> 2, t = lane & 3;
  const bool math = warp < W;
  u32 a[KC][2];
  if (math) {
#pragma unroll
    for (int kc = 0; kc < KC; ++kc) {
      const int ch = 16 * kc + 2 * t;
      a[kc][0] = g < REP ? pack_f16(x[g * D + ch], x[g * D + ch + 1]) : 0u;
      a[kc][1] = g < REP ? pack_f16(x[g * D + ch + 8], x[g * D + ch + 9]) : 0u;
    }
  }
  __syncthreads();  // x is read by every warp before any writes it
  if (math) {
#pragma unroll
    for (int n = 0; n < NTW; ++n) {
      uint2 bf[KC];
#pragma unroll
      for (int kc = 0; kc < KC; ++kc) bf[kc] = __ldg(Mf + ((warp + n * W) * KC + kc) * 32 + lane);
      float c[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
      for (int kc = 0; kc < KC; ++kc) mma_f16(c, a[kc][0], 0u, a[kc][1], 0u, bf[kc].x, bf[kc].y);
      if (g < REP) {
        const int col = 8 * (warp + n * W) + 2 * t;
        x[g * D + col] = c[0];
        x[g * D + col + 1] = c[1];
      }
    }
  }
  __syncthreads();
}

// D: head dim (64, 128), PS: page size (16..128), REP: GQA ratio, W: math warps, ST: ring stages (a multiple of W),
// MINB: CTAs per SM for the register allocation, ROPE: rope-centered keys (0/1), CT: tokens per channel block of
// per-channel keys (0: per-token keys). Dynamic shared memory: max(ST * REC + (ROPE ? PS * D * 2 : 0), W * REP * D * 4)
// bytes: the ring, then the rope table; the math warps' outputs alias both after the loop.
template <int D, int PS, int REP, int W, int ST, int MINB, int ROPE = 0, int CT = 0>
__global__ void __launch_bounds__((W + 1) * 32, MINB) oscar_decode_v11(const Params11 P) {
  static_assert(ST % W == 0, "ring stages must be a multiple of the math warps");
  static_assert(CT == 0 || (CT % 16 == 0 && PS % CT == 0), "a channel block is whole tiles of one page");
  constexpr int NT = (W + 1) * 32;
  constexpr int REC = PS * D / 2 + PS * 8 + (CT ? (PS / CT) * 4 * D : 0);  // record bytes
  constexpr int TILES = PS / 16, TPS = TILES < 4 ? TILES : 4, STEPS = TILES / TPS;
  constexpr int NX = (CT ? 3 * D : 0) + (ROPE ? REP * D / 4 + W * D / 4 : 0);
  __shared__ float s_q[REP * D];
  __shared__ uint4 s_x[NX > 0 ? NX : 1];  // CT: s_qf [D/32][32], s_qz [D/16][32]; ROPE: s_u [REP][D/4], s_cs [W][D/4]
  const uint4* s_qf = s_x;
  const uint4* s_qz = s_x + D;
  float4* s_u = reinterpret_cast<float4*>(s_x + (CT ? 3 * D : 0));
  float4* s_cs = s_u + REP * D / 4;
  extern __shared__ __align__(128) unsigned char s_buf[];
  float* s_o = reinterpret_cast<float*>(s_buf);
  const uint4* s_tab = reinterpret_cast<const uint4*>(s_buf + ST * REC);  // ROPE: the table (after the ring)
  __shared__ __align__(8) u64 s_full[ST], s_empty[ST];
  __shared__ float s_m[W][2 * REP], s_l[W][2 * REP];
  __shared__ float s_f[REP][SMAX];
  __shared__ int s_last;

  const int split = blockIdx.x, kvh = blockIdx.y, b = blockIdx.z;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t = lane & 3;
  const bool is_int = split < P.s_int;
  const bool producer = warp == W;

  int len = 0, lo = 0, n = 0;
  const int* pt = P.page_table + (long long)b * P.pt_stride;
  const unsigned char* rbase = P.rec + (long long)kvh * P.rs_h;
  if (is_int) {
    len = __ldg(P.int_len + b);
    const int npg = (len + PS - 1) / PS;
    const int per = (npg + P.s_int - 1) / P.s_int;
    lo = split * per;
    n = max(0, min(npg, lo + per) - lo);  // pages of this split: lo .. lo + n - 1
    if (tid == 0) {
#pragma unroll
      for (int s = 0; s < ST; ++s) {
        mbar_init(&s_full[s], 1);
        mbar_init(&s_empty[s], 1);
      }
      asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
  }
  __syncthreads();
  int pv = 0;  // producer lanes: page ids of pages 32 c + lane of the current chunk c
  auto produce = [&](int from, int to) {  // the whole producer warp; lane 0 waits on the ring and issues the copies
    for (int i = from; i < to; ++i) {
      if ((i & 31) == 0) pv = i + lane < n ? __ldg(pt + lo + i + lane) : 0;
      const int page = __shfl_sync(FULL, pv, i & 31);
      if (lane == 0) {
        const int s = i % ST;
        if (i >= ST) mbar_wait(&s_empty[s], ((i / ST) + 1) & 1);  // phase i/ST - 1 of the stage's release
        mbar_expect_tx(&s_full[s], REC);
        bulk_copy(s_buf + s * REC, rbase + (long long)page * P.rs_p, REC, &s_full[s]);
      }
      __syncwarp();
    }
  };
  if (is_int && producer) produce(0, min(n, ST));  // the first ST records go out before the query work
  if (P.rot_out != nullptr) {  // the merge's rotation: its fragments to L2 now (one CTA of the pair will read them)
    const char* rf = reinterpret_cast<const char*>(P.rot_out + (long long)kvh * D * D / 4);
    for (int i = tid; i < D * D * 2 / 128; i += NT) asm volatile("prefetch.global.L2 [%0];" ::"l"(rf + 128 * i));
  }
  if (is_int && P.rk != nullptr) {  // the query rotation's fragments to L1 while the query loads
    const char* rf = reinterpret_cast<const char*>(P.rk + (long long)kvh * D * D / 4);
    for (int i = tid; i < D * D * 2 / 128; i += NT) asm volatile("prefetch.global.L1 [%0];" ::"l"(rf + 128 * i));
  }

  // ---- query of this KV head's REP heads (rotated for the quantized splits)
  const u16* qg = P.q + ((long long)b * P.hkv * REP + (long long)kvh * REP) * D;
  for (int i = tid; i < REP * D / 8; i += NT) {  // 8 bf16 per thread and load (one round trip at REP * D <= 8 NT)
    const uint4 x = __ldg(reinterpret_cast<const uint4*>(qg) + i);
    const u32 w[4] = {x.x, x.y, x.z, x.w};
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      s_q[8 * i + 2 * k] = bf_lo(w[k]);
      s_q[8 * i + 2 * k + 1] = bf_hi(w[k]);
    }
  }
  if (ROPE && is_int) {  // the rope table to shared memory (the same for every CTA: an L2 hit)
    uint4* tab = reinterpret_cast<uint4*>(s_buf + ST * REC);
    for (int i = tid; i < PS * D / 8; i += NT) tab[i] = __ldg(P.rope_tab + i);
  }
  __syncthreads();
  float qmu = 0.f;  // q . mu_K of head g (partial over t), plus q . m on the channels RoPE leaves alone
  if (is_int && (P.muk != nullptr || ROPE) && g < REP && !producer) {
    const float* mk = P.muk + (long long)kvh * D;
    const float* rm = P.rope_m + (long long)kvh * D;
    for (int i = t; i < D; i += 4) {
      float m = P.muk != nullptr ? mk[i] : 0.f;
      if (ROPE && i >= 2 * P.rope_half) m += rm[i];
      qmu += s_q[g * D + i] * m;
    }
  }
  if (ROPE && is_int) {  // A_i, B_i of the rope term, times sc (base-2 logits), interleaved for rope_turn
    const float* rm = P.rope_m + (long long)kvh * D;
    const int hf = P.rope_half;
    const float f = P.sc * P.rope_scaling;
    float* su = reinterpret_cast<float*>(s_u);
    for (int i = tid; i < REP * (D / 2); i += NT) {
      const int hh = i / (D / 2), c = i % (D / 2);
      float a = 0.f, bb = 0.f;
      if (c < hf) {
        const float q1 = s_q[hh * D + c], q2 = s_q[hh * D + hf + c], m1 = rm[c], m2 = rm[hf + c];
        a = f * fmaf(q1, m1, q2 * m2);
        bb = f * fmaf(q2, m1, -q1 * m2);
      }
      su[hh * D + 4 * (c >> 1) + 2 * (c & 1)] = a;
      su[hh * D + 4 * (c >> 1) + 2 * (c & 1) + 1] = bb;
    }
    __syncthreads();  // before rotate_rows overwrites s_q, and before the loop reads s_u
  }
  if (is_int && P.rk != nullptr) rotate_rows<D, REP, W>(s_q, P.rk + (long long)kvh * D * D / 4, tid);
  if (CT && is_int) {  // per-channel keys: the query's fragments for channel_frags, the same in every warp
    if (warp == 0) {
      uint4* qf = s_x;
      uint4* qz = s_x + D;
#pragma unroll
      for (int c = 0; c < D / 32; ++c) {
        u32 f[4];
#pragma unroll
        for (int r = 0; r < 4; ++r) {  // chunk j = 2c + r/2, half h = r%2 (the qb fragments of the math warps)
          const int j = 2 * c + (r >> 1), h = r & 1, ch = 16 * j + 2 * t + 8 * h;
          const float x0 = g < REP ? s_q[g * D + ch] : 0.f, x1 = g < REP ? s_q[g * D + ch + 1] : 0.f;
          const float fj = slot_factor(j, h);
          f[r] = pack_f16(x0 * fj, x1 * fj);
        }
        qf[c * 32 + lane] = make_uint4(f[0], f[1], f[2], f[3]);
      }
#pragma unroll
      for (int j = 0; j < D / 16; ++j) {
        u32 hl[2][2];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int ch = 16 * j + 2 * t + 8 * h;
          const float x0 = g < REP ? s_q[g * D + ch] : 0.f, x1 = g < REP ? s_q[g * D + ch + 1] : 0.f;
          hl[0][h] = pack_bf16(x0, x1);
          hl[1][h] = pack_bf16(x0 - bf_lo(hl[0][h]), x1 - bf_hi(hl[0][h]));
        }
        qz[j * 32 + lane] = make_uint4(hl[0][0], hl[1][0], hl[0][1], hl[1][1]);  // A: hi rows g, lo rows g + 8
      }
    }
    __syncthreads();
  }

  State<D> st;
#pragma unroll
  for (int k = 0; k < 2; ++k) {
    st.m[k] = NEG_INF;
    st.l[k] = 0.f;
    st.zs[k] = 0.f;
  }
#pragma unroll
  for (int m = 0; m < D / 16; ++m)
#pragma unroll
    for (int i = 0; i < 4; ++i) st.o[m][i] = 0.f;

  if (producer) {
    if (is_int) produce(ST, n);
  } else {
    u32 qb[D / 16][2];
    float qsum = 0.f;
#pragma unroll
    for (int j = 0; j < D / 16; ++j) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int ch = 16 * j + 2 * t + 8 * h;
        const float x0 = g < REP ? s_q[g * D + ch] : 0.f, x1 = g < REP ? s_q[g * D + ch + 1] : 0.f;
        if (is_int) {
          const float f = slot_factor(j, h);
          qb[j][h] = pack_f16(x0 * f, x1 * f);
          qsum += (h2f(qb[j][h]) + h2f(qb[j][h] >> 16)) * (1.f / f);
        } else {
          qb[j][h] = pack_bf16(x0, x1);
        }
      }
    }
    qsum += __shfl_xor_sync(FULL, qsum, 1);
    qsum += __shfl_xor_sync(FULL, qsum, 2);
    qmu += __shfl_xor_sync(FULL, qmu, 1);
    qmu += __shfl_xor_sync(FULL, qmu, 2);
    const float qs[2] = {__shfl_sync(FULL, qsum, 8 * t) * P.sc, __shfl_sync(FULL, qsum, 8 * t + 4) * P.sc};
    const float qm[2] = {__shfl_sync(FULL, qmu, 8 * t) * P.sc, __shfl_sync(FULL, qmu, 8 * t + 4) * P.sc};

    if (is_int) {
      const float ksc = P.sc * 16777216.f;  // 2^24: the codes' subnormal scale
      const int nfull = min(n, max(0, len / PS - lo));  // pages of the split with PS valid tokens
      u32 ub[D / 16][2];  // ROPE: the page's rope-term B fragments
      u32 qc[D / 16][2];  // CT: the query's B fragments times the current channel block's scales
      float qzm[2] = {qm[0], qm[1]};  // CT: sc (q_r . z + q . mu_K) of the current channel block
      long long rpos = 0;  // ROPE: position of the split's first token
      if (ROPE) rpos = (long long)(P.rope_pos0 != nullptr ? __ldg(P.rope_pos0 + b) : 0) + P.rope_pos_add + (long long)lo * PS;
      float4* cs = s_cs + warp * (D / 4);
      double wl[2] = {0.0, 0.0};  // ROPE: this lane's frequencies (rope_turn)
      if (ROPE && lane < D / 4) {
        wl[0] = __ldg(P.rope_w + 2 * lane);
        wl[1] = __ldg(P.rope_w + 2 * lane + 1);
      }
      for (int i = warp; i < nfull; i += W) {  // the main loop: full pages, no masks
        const int s = i % ST;
        mbar_wait(&s_full[s], (i / ST) & 1);
        unsigned char* rec = s_buf + s * REC;
        if (ROPE) rope_turn<D, REP>(ub, s_u, cs, wl, rpos + (long long)i * PS, lane);
#pragma unroll
        for (int k = 0; k < STEPS; ++k)
          int_step<D, PS, TPS, false, ROPE != 0, CT>(st, rec, k * TPS, qb, qs, qm, ksc, PS, lane, ub, s_tab, qc, qzm,
                                                     s_qf, s_qz, P.sc);
        if (CT) asm volatile("fence.proxy.async.shared::cta;" ::: "memory");  // in-place scales before the refill
        __syncwarp();
        if (lane == 0) mbar_arrive(&s_empty[s]);
      }
      if (nfull < n && nfull % W == warp) {  // the sequence's last, partial page
        const int i = nfull, s = i % ST, nv = len - (lo + i) * PS;
        mbar_wait(&s_full[s], (i / ST) & 1);
        unsigned char* rec = s_buf + s * REC;
        if (ROPE) rope_turn<D, REP>(ub, s_u, cs, wl, rpos + (long long)i * PS, lane);
#pragma unroll
        for (int k = 0; k < STEPS; ++k)
          if (k * TPS * 16 < nv)
            int_step<D, PS, TPS, true, ROPE != 0, CT>(st, rec, k * TPS, qb, qs, qm, ksc, nv, lane, ub, s_tab, qc, qzm,
                                                      s_qf, s_qz, P.sc);
      }
    } else {
      const int seg = split - P.s_int;  // 0: sink (if present), then recent
      const bool sink = P.has_sink && seg == 0;
      const u16* kp = sink ? P.sink_k : P.rec_k;
      const u16* vp = sink ? P.sink_v : P.rec_v;
      const long long sb = sink ? P.sk_b : P.rk_b, sh = sink ? P.sk_h : P.rk_h, stt = sink ? P.sk_t : P.rk_t;
      const int nw = (int)min((long long)__ldg((sink ? P.sink_len : P.rec_len) + b), sink ? P.sk_max : P.rk_max);
      const long long wb = P.win_row != nullptr ? (long long)__ldg(P.win_row + b) : (long long)b;
      kp += wb * sb + kvh * sh;
      vp += wb * sb + kvh * sh;
      for (int blk = warp; blk * 16 < nw; blk += W) bf16_block<D>(st, kp, vp, stt, qb, P.sc, blk * 16, nw, lane);
    }
#pragma unroll
    for (int k = 0; k < 2; ++k)
#pragma unroll
      for (int x = 4; x < 32; x <<= 1) {
        st.l[k] += __shfl_xor_sync(FULL, st.l[k], x);
        st.zs[k] += __shfl_xor_sync(FULL, st.zs[k], x);
      }
  }
  __syncthreads();  // the warps' outputs go where the ring was: every record has been consumed
  if (!producer) {
    if (g == 0) {
#pragma unroll
      for (int k = 0; k < 2; ++k) {
        if (2 * t + k < REP) {
          s_m[warp][2 * t + k] = st.m[k];
          s_l[warp][2 * t + k] = st.l[k];
        }
      }
    }
#pragma unroll
    for (int m = 0; m < D / 16; ++m) {
      const float f0 = is_int ? 16777216.f * slot_factor(m, 0) : 1.f;
      const float f1 = is_int ? 16777216.f * slot_factor(m, 1) : 1.f;
#pragma unroll
      for (int k = 0; k < 2; ++k) {
        const int h = 2 * t + k;
        if (h < REP) {
          s_o[(warp * REP + h) * D + 16 * m + g] = fmaf(st.o[m][k], f0, st.zs[k]);
          s_o[(warp * REP + h) * D + 16 * m + g + 8] = fmaf(st.o[m][2 + k], f1, st.zs[k]);
        }
      }
    }
  }
  __syncthreads();
  const long long pbase = ((long long)b * P.hkv + kvh) * P.s_total + split;
  for (int i = tid; i < REP * D; i += NT) {
    const int h = i / D, ch = i % D;
    float mx = NEG_INF;
#pragma unroll
    for (int w = 0; w < W; ++w) mx = fmaxf(mx, s_m[w][h]);
    float o = 0.f, l = 0.f;
#pragma unroll
    for (int w = 0; w < W; ++w) {
      const float f = s_m[w][h] == NEG_INF ? 0.f : ex2(s_m[w][h] - mx);
      o = fmaf(f, s_o[(w * REP + h) * D + ch], o);
      l = fmaf(f, s_l[w][h], l);
    }
    P.part_o[pbase * REP * D + i] = o;
    if (ch == 0) {
      P.part_ml[(pbase * REP + h) * 2] = mx;
      P.part_ml[(pbase * REP + h) * 2 + 1] = l;
    }
  }

  // ---- the last CTA of this (sequence, KV head) merges every split (v10's merge)
  __threadfence();
  __syncthreads();
  if (tid == 0) {
    const int ticket = atomicAdd(P.counters + b * P.hkv + kvh, 1);
    s_last = ticket == P.s_total - 1;
  }
  __syncthreads();
  if (!s_last) return;
  __threadfence();
  const long long hbase = ((long long)b * P.hkv + kvh) * P.s_total;
  for (int h = warp; h < REP; h += W + 1) {
    float2 ml[SMAX / 32];
    float mx = NEG_INF;
#pragma unroll
    for (int k = 0; k < SMAX / 32; ++k) {
      const int s = lane + 32 * k;
      ml[k] = s < P.s_total ? __ldcg(reinterpret_cast<const float2*>(P.part_ml) + (hbase + s) * REP + h)
                            : make_float2(NEG_INF, 0.f);
      mx = fmaxf(mx, ml[k].x);
    }
#pragma unroll
    for (int x = 1; x < 32; x <<= 1) mx = fmaxf(mx, __shfl_xor_sync(FULL, mx, x));
    float mxs = 0.f, mys = 0.f;
#pragma unroll
    for (int k = 0; k < SMAX / 32; ++k) {
      const int s = lane + 32 * k;
      const float f = ml[k].x == NEG_INF ? 0.f : ex2(ml[k].x - mx);
      if (s < P.s_total) {
        s_f[h][s] = f;
        if ((s < P.s_int) == (P.out_rotated != 0)) mys += f * ml[k].y; else mxs += f * ml[k].y;
      }
    }
#pragma unroll
    for (int x = 1; x < 32; x <<= 1) {
      mxs += __shfl_xor_sync(FULL, mxs, x);
      mys += __shfl_xor_sync(FULL, mys, x);
    }
    const float inv = mxs + mys > 0.f ? 1.f / (mxs + mys) : 0.f;
    for (int s = lane; s < P.s_total; s += 32) s_f[h][s] *= inv;
    if (lane == 0) {
      s_m[0][h] = mxs * inv;
      s_m[0][REP + h] = mys * inv;
    }
  }
  __syncthreads();
  constexpr int UNITS = REP * D / 4, PER_T = (UNITS + NT - 1) / NT;
  const int x_lo = P.out_rotated ? P.s_int : 0, x_hi = P.out_rotated ? P.s_total : P.s_int;
  float4 y[PER_T];
#pragma unroll
  for (int k = 0; k < PER_T; ++k) {
    const int u = tid + k * NT;
    y[k] = make_float4(0.f, 0.f, 0.f, 0.f);
    if (u < UNITS) {
      const int h = (4 * u) / D;
      float4 x = make_float4(0.f, 0.f, 0.f, 0.f), yy = x;
      const float4* po = reinterpret_cast<const float4*>(P.part_o + hbase * REP * D) + u;
#pragma unroll 8
      for (int s = 0; s < P.s_total; ++s) {
        const float4 v = __ldcg(po + (long long)s * UNITS);
        const float f = s_f[h][s], fx = (s >= x_lo && s < x_hi) ? f : 0.f, fy = f - fx;
        x.x = fmaf(fx, v.x, x.x); x.y = fmaf(fx, v.y, x.y); x.z = fmaf(fx, v.z, x.z); x.w = fmaf(fx, v.w, x.w);
        yy.x = fmaf(fy, v.x, yy.x); yy.y = fmaf(fy, v.y, yy.y); yy.z = fmaf(fy, v.z, yy.z); yy.w = fmaf(fy, v.w, yy.w);
      }
      if (P.out_rotated && P.muv != nullptr) {
        const float4 mv = *reinterpret_cast<const float4*>(P.muv + (long long)kvh * D + (4 * u) % D);
        const float ms = s_m[0][h];
        x.x -= ms * mv.x; x.y -= ms * mv.y; x.z -= ms * mv.z; x.w -= ms * mv.w;
      }
      reinterpret_cast<float4*>(s_q)[u] = x;
      y[k] = yy;
    }
  }
  __syncthreads();
  if (tid == 0) P.counters[b * P.hkv + kvh] = 0;
  if (P.rot_out != nullptr) rotate_rows<D, REP, W>(s_q, P.rot_out + (long long)kvh * D * D / 4, tid);
  u16* og = P.out + ((long long)b * P.hkv * REP + (long long)kvh * REP) * D;
#pragma unroll
  for (int k = 0; k < PER_T; ++k) {
    const int u = tid + k * NT;
    if (u < UNITS) {
      const int h = (4 * u) / D, j = (4 * u) % D;
      float4 o = reinterpret_cast<const float4*>(s_q)[u];
      o.x += y[k].x; o.y += y[k].y; o.z += y[k].z; o.w += y[k].w;
      if (!P.out_rotated && P.muv != nullptr) {
        const float4 mv = *reinterpret_cast<const float4*>(P.muv + (long long)kvh * D + j);
        const float ms = s_m[0][h];
        o.x = fmaf(ms, mv.x, o.x); o.y = fmaf(ms, mv.y, o.y); o.z = fmaf(ms, mv.z, o.z); o.w = fmaf(ms, mv.w, o.w);
      }
      uint2 packed;
      packed.x = pack_bf16(o.x, o.y);
      packed.y = pack_bf16(o.z, o.w);
      reinterpret_cast<uint2*>(og)[u] = packed;
    }
  }
}
