// Paged INT2/INT4 decode attention over pages in tensor-core fragment order (oscar.quant "mma_k"/"mma_v"),
// one launch per layer step: split-K CTAs over the quantized tokens, CTAs for the BF16 sink and recent
// windows, and the log-sum-exp merge (with the change of frame) done by the last CTA of each
// (sequence, KV head). Compiled at first use by NVRTC (oscar.kernels.decode_mma); no headers needed.
//
// Warp tile per 16-token block (mma.sync m16n8k16, fp32 accumulators), lane = 4g + t:
//   scores  S[tokens x heads(8)] = K[tokens x d] . Q^T[d x heads]   (K codes: the A operand, no zero rows)
//   output  O^T[d x heads]      = V^T[d x tokens] . P'[tokens x heads]  (V codes: the A operand)
// P' = p * s_V goes from the scores' accumulator layout to the B operand by two movmatrix.trans.
// Codes become exact fp16 *subnormals* c * 4^J * 2^-24 by one AND per two codes (slot J of a half word;
// slots 5-7 after one shift per word); the factor 4^J * 2^-24 is folded into the query's B fragment
// (keys) and into the output rows (values). Per-token scale/zero stay outside the products:
//   logit = s_K (q.c) + z_K sum(q) + q.mu_K,   o = sum_t (p_t s_V) c_t + sum_t p_t z_V.
// Rope-centered keys (RT > 0: keys stored minus RoPE_p(m), oscar.rope) add q . RoPE_p(m) = sum_i A_i cos(p w_i) +
// B_i sin(p w_i) (A, B from q and m, once per CTA). RoPE composes: at p = P + x the term is
// sum_i A'_i cos(x w_i) + B'_i sin(x w_i) with (A', B') = (A, B) turned by -P w_i. A warp turns (A, B) once per RT
// of its blocks (P = the first token of the first; angles reduced in fp64) into fp16 B fragments, and one more
// MMA per 16 channels scores them against a constant table of cos/sin(x w_i), x = 16 W k + j (k < RT, j < 16).
// Per-channel keys (CT > 0: K scale/zero bf16 [P, Hkv, page/CT, D], one pair per channel and block of CT tokens): a
// warp takes a contiguous run of 16-token blocks, and at its first block and at the first block of each channel block
// turns the channel block's scales into the query's B fragments (q_r * s, fp16) and adds q_r . z (bf16 MMAs of the
// zeros against q_r split into bf16 hi + lo): logit = (q_r * s) . c + q_r . z + q.mu_K (+ the rope term), values per
// token as always.

typedef unsigned int u32;
typedef unsigned short u16;

#define NEG_INF (__int_as_float(0xff800000))
#define FULL 0xffffffffu

// 2-bit slot I of a word (bits 2I, 2I+1 of each 16-bit half) as two fp16 subnormals c * 4^J * 2^-24.
__device__ __forceinline__ constexpr int slot_j(int i) { return i < 5 ? i : i - 5; }
template <int I>
__device__ __forceinline__ u32 slot(u32 w) {
  constexpr int J = slot_j(I);
  return (I < 5 ? w : (w >> 10)) & ((3u << (2 * J)) * 0x10001u);
}
__device__ __forceinline__ float pow4neg(int j) { return __int_as_float((127 - 2 * j) << 23); }  // 4^-j
// INT4: 4-bit slot I of a word (nibble I%2 of the low (I < 2) or high (I >= 2) byte of each half) as two fp16
// subnormals c * 16^(I%2) * 2^-24.
template <int I>
__device__ __forceinline__ u32 slot4(u32 w) {
  return (I < 2 ? w : (w >> 8)) & ((0xfu << (4 * (I & 1))) * 0x10001u);
}
// Factor 2^-24-free of the slot that feeds k-chunk j, half h (keys) or output rows 16j + 8h (values): 4^-J, 16^-h.
template <int BITS>
__device__ __forceinline__ float slot_factor(int j, int h) {
  return BITS == 2 ? pow4neg(slot_j(2 * (j % 4) + h)) : (h ? 0.0625f : 1.f);
}

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

__device__ __forceinline__ u32 hmul2(u32 a, u32 b) {
  u32 r;
  asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
  return r;
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

__device__ __forceinline__ float h2f(u32 x) {  // low 16 bits as fp16 -> float
  float r;
  asm("cvt.f32.f16 %0, %1;" : "=f"(r) : "h"((u16)(x & 0xffffu)));
  return r;
}

__device__ __forceinline__ float bf16f(u32 x) { return __uint_as_float((x & 0xffffu) << 16); }

__device__ __forceinline__ u32 smem_addr(const void* p) {
  u32 r;
  asm("{ .reg .u64 a; cvta.to.shared.u64 a, %1; cvt.u32.u64 %0, a; }" : "=r"(r) : "l"(p));
  return r;
}

// Four 8x8 b16 matrices at shared address a; lane 4g + t gets row g, columns 2t, 2t+1 of matrix i in r[i] (rows from
// lanes 8i..8i+7).
__device__ __forceinline__ void ldsm_x4(u32& r0, u32& r1, u32& r2, u32& r3, u32 a) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3) : "r"(a) : "memory");
}

template <int BYTES>
__device__ __forceinline__ void cp_async(void* dst, const void* src) {
  if (BYTES == 16)
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(smem_addr(dst)), "l"(src));
  else
    asm volatile("cp.async.ca.shared.global [%0], [%1], %2;" ::"r"(smem_addr(dst)), "l"(src), "n"(BYTES));
}

__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;"); }

template <int N>
__device__ __forceinline__ void cp_wait() { asm volatile("cp.async.wait_group %0;" ::"n"(N)); }

__device__ __forceinline__ float ex2(float x) {
  float r;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x));
  return r;
}

struct Params {
  const u16* q;             // bf16 [B, H, D]
  const unsigned char* kc;  // codes [P, Hkv, page_size, D/4] (mma_k)
  const unsigned char* vc;  // (mma_v)
  const u16* ks;            // bf16 scale/zero [P, Hkv, page_size] (one group per row)
  const u16* kz;
  const u16* vs;
  const u16* vz;
  const int* page_table;  // [B, pt_stride]
  const int* int_len;     // [B]
  const uint2* rk;        // B fragments of R_K per KV head (rotate_rows) or null: q_rot = q @ R_K
  const float* muk;       // [Hkv, D] or null
  const uint2* rot_out;   // B fragments per KV head or null: x @ M for the partials not in the output frame
  const float* muv;       // [Hkv, D] or null
  const u16* sink_k;      // bf16 [B, Hkv, S0, D] or [R, Hkv, S0, D] with win_row (strides below) or null
  const u16* sink_v;
  const int* sink_len;
  const u16* rec_k;
  const u16* rec_v;
  const int* rec_len;
  float* part_o;   // [B, Hkv, S_total, REP, D]
  float* part_ml;  // [B, Hkv, S_total, REP, 2]
  int* counters;   // [B * Hkv], zero between launches
  u16* out;        // bf16 [B, H, D]
  float sc;        // sm_scale * log2(e)
  int hkv, pt_stride, page_shift, s_int, s_total, has_sink, has_rec, out_rotated;
  long long cs_p, cs_h;  // code strides (bytes) of a page and a head; a slot is D/4 bytes
  long long ss_p, ss_h;  // scale strides (elements)
  long long sk_b, sk_h, sk_t, sk_max;  // sink strides (elements) and capacity
  long long rk_b, rk_h, rk_t, rk_max;  // recent
  const float* rope_m;    // [Hkv, D] pre-RoPE key means (rope-centered keys, RT > 0) or null
  const double* rope_w;   // [D/2] inverse frequencies, zero past the rotary half
  const uint4* rope_tab;  // fp16 A fragments [RT][D/16][32 lanes]: cos/sin((16 W k + j) w_i), row j, k < RT
  const int* rope_pos0;   // [B] position of each sequence's first quantized token, or null (0)
  float rope_scaling;     // RoPE attention scaling
  int rope_half, rope_pos_add;  // rotary_dim / 2; added to every position
  const int* win_row;     // [B] row of the sink/recent tensors that sequence b reads (per-slot windows), or null (b)
  long long kss_p, kss_h;  // K scale strides (elements): ss_p, ss_h (per token) or of [P, Hkv, page/CT, D] (CT > 0)
};

constexpr int SMAX = 256;  // most partials per (sequence, KV head); the launcher checks

// Online-softmax state of one warp; lane (g, t) holds heads 2t, 2t+1 and O^T (channels 16m+g(+8), heads 2t, 2t+1).
template <int D>
struct State {
  float m[2], l[2], zs[2];
  float o[D / 16][4];
};

// Scores of one block (lg[e]: e = 0 (token g, head 2t), 1 (g, 2t+1), 2 (g+8, 2t), 3 (g+8, 2t+1)) -> softmax
// update -> B fragments of P' = p * sv (two 8x8 transposes). zv: V zeros (quantized blocks only).
template <int D, bool BF>
__device__ __forceinline__ void softmax_update(State<D>& st, const float (&lg)[4], const float (&sv)[2], const float (&zv)[2],
                                               u32& pb0, u32& pb1) {
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
  for (int k = 0; k < 2; ++k) {
    st.l[k] = st.l[k] * alpha[k] + (p[k] + p[k + 2]);
    if (!BF) st.zs[k] = st.zs[k] * alpha[k] + fmaf(p[k], zv[0], p[k + 2] * zv[1]);
  }
  if (!__all_sync(FULL, alpha[0] == 1.f && alpha[1] == 1.f)) {  // a running max moved: rescale O
#pragma unroll
    for (int m = 0; m < D / 16; ++m) {
      st.o[m][0] *= alpha[0];
      st.o[m][1] *= alpha[1];
      st.o[m][2] *= alpha[0];
      st.o[m][3] *= alpha[1];
    }
  }
  if (BF) {
    pb0 = movtrans(pack_bf16(p[0], p[1]));
    pb1 = movtrans(pack_bf16(p[2], p[3]));
  } else {
    pb0 = movtrans(pack_f16(p[0] * sv[0], p[1] * sv[0]));
    pb1 = movtrans(pack_f16(p[2] * sv[1], p[3] * sv[1]));
  }
}

// Raw bytes of one quantized block for one lane: codes of tokens g, g+8 (K) and token pairs 2t, 2t+1 / +8 (V),
// scale/zero of tokens g and g+8.
template <int D, int BITS>
struct Raw {
  u32 k[D * BITS / 64], v[D * BITS / 64];
  u32 ks[2], kz[2], vs[2], vz[2];
};

// A warp's ring stage for one block: K codes, V codes (16 * D/4 bytes each, lane L's at L * D/8), then the
// block's 16 bf16 K scales, K zeros, V scales, V zeros; per-channel keys (CT > 0): the 16 V scales, V zeros, then
// (first block of a channel block only) the channel block's D bf16 K scales and D K zeros at KC.
template <int D, int BITS, int CT>
struct Stage {
  static constexpr int CB = 16 * D * BITS / 8;
  static constexpr int KC = 2 * CB + 64;
  static constexpr int BYTES = CT ? KC + 4 * D : 2 * CB + 128;
};

// kzs (CT > 0): this lane's part of the K scales (lanes 0-15) or zeros (16-31) of KV head kvh, page 0, block 0;
// first: the warp's first block (it reads its channel block's scales wherever the block sits in it).
template <int D, int BITS, int CT>
__device__ __forceinline__ void issue_block(unsigned char* st, const Params& P, int page, int kvh, int off, int lane,
                                            const u16* kzs, bool first) {
  constexpr int CB = Stage<D, BITS, CT>::CB, LB = D * BITS / 16, LC = LB > 16 ? 16 : LB;
  const long long cbase = (long long)page * P.cs_p + (long long)kvh * P.cs_h + (long long)off * (D * BITS / 8) + lane * LB;
#pragma unroll
  for (int c = 0; c < LB / LC; ++c) {
    cp_async<LC>(st + lane * LB + c * LC, P.kc + cbase + c * LC);
    cp_async<LC>(st + CB + lane * LB + c * LC, P.vc + cbase + c * LC);
  }
  const int a = lane >> 3;  // 4 bytes (2 tokens) of one of the four scale/zero arrays per lane
  if (CT == 0) {
    const u16* src = a == 0 ? P.ks : a == 1 ? P.kz : a == 2 ? P.vs : P.vz;
    cp_async<4>(st + 2 * CB + 4 * lane, src + (long long)page * P.ss_p + (long long)kvh * P.ss_h + off + 2 * (lane & 7));
  } else {
    if (a >= 2)
      cp_async<4>(st + 2 * CB + 4 * (lane - 16), (a == 2 ? P.vs : P.vz) + (long long)page * P.ss_p + (long long)kvh * P.ss_h +
                                                   off + 2 * (lane & 7));
    if (first || (off & (CT - 1)) == 0) {  // the channel block's K scales (lanes 0-15) and zeros (16-31), D/8 bytes per lane
      constexpr int KB = D / 8;
      cp_async<KB>(st + Stage<D, BITS, CT>::KC + lane * KB, kzs + (long long)page * P.kss_p + (off / (CT ? CT : 1)) * D);
    }
  }
}

template <int D, int BITS, int CT>
__device__ __forceinline__ void read_block(Raw<D, BITS>& raw, const unsigned char* st, int lane) {
  constexpr int CB = Stage<D, BITS, CT>::CB, LB = D * BITS / 16;
  if (LB >= 16) {
#pragma unroll
    for (int c = 0; c < LB / 16; ++c) {
      const uint4 kk = *reinterpret_cast<const uint4*>(st + lane * LB + 16 * c);
      const uint4 vv = *reinterpret_cast<const uint4*>(st + CB + lane * LB + 16 * c);
      raw.k[4 * c] = kk.x; raw.k[4 * c + 1] = kk.y; raw.k[4 * c + 2] = kk.z; raw.k[4 * c + 3] = kk.w;
      raw.v[4 * c] = vv.x; raw.v[4 * c + 1] = vv.y; raw.v[4 * c + 2] = vv.z; raw.v[4 * c + 3] = vv.w;
    }
  } else {
    const uint2 kk = *reinterpret_cast<const uint2*>(st + lane * LB);
    const uint2 vv = *reinterpret_cast<const uint2*>(st + CB + lane * LB);
    raw.k[0] = kk.x; raw.k[1] = kk.y;
    raw.v[0] = vv.x; raw.v[1] = vv.y;
  }
  const u16* sc = reinterpret_cast<const u16*>(st + 2 * CB);
  const int g = lane >> 2;
#pragma unroll
  for (int n = 0; n < 2; ++n) {
    if (CT == 0) {
      raw.ks[n] = sc[g + 8 * n];
      raw.kz[n] = sc[16 + g + 8 * n];
    }
    raw.vs[n] = sc[(CT ? 0 : 32) + g + 8 * n];
    raw.vz[n] = sc[(CT ? 16 : 48) + g + 8 * n];
  }
}

// Per-channel keys, at the first block of a channel block: qb <- the query's fp16 B fragments (from s_qf: q_r times the
// slots' 4^-J) times the block's scales, qz[k] <- q_r . z of head 2t + k. kc: the stage's D bf16 K scales, D K zeros;
// the scales turn to fp16 in place (each lane D/64 words), then each lane reads the words of its fragments with
// ldmatrix (all 8 row addresses of a matrix the same 8 channels: row g is every lane's copy; kc_s: kc's shared
// address). The zeros stay bf16 (exact) and are the B operand (every column the zero vector) of bf16 MMAs whose A rows
// are q_r's bf16 hi (rows 0-7: head g) and lo parts (rows 8-15) (s_qz: those A fragments); q_r . z of head g is the
// sum of rows g and g + 8, moved to the lanes of heads 2t, 2t + 1 by two shuffles.
template <int D>
__device__ __forceinline__ void channel_frags(u32 (&qb)[D / 16][2], float (&qz)[2], unsigned char* kc, u32 kc_s,
                                              const uint4* s_qf, const uint4* s_qz, int lane) {
  u32* w = reinterpret_cast<u32*>(kc);
#pragma unroll
  for (int i = 0; i < D / 64; ++i) {
    const u32 x = w[lane + 32 * i];
    w[lane + 32 * i] = pack_f16(__uint_as_float(x << 16), __uint_as_float(x & 0xffff0000u));
  }
  __syncwarp();
#pragma unroll
  for (int c = 0; c < D / 32; ++c) {  // matrix i of call c: channels 8 (4c + i) .. + 7, i.e. chunk 2c + i/2, half i%2
    u32 s0, s1, s2, s3;
    ldsm_x4(s0, s1, s2, s3, kc_s + 16 * (4 * c + (lane >> 3)));
    const uint4 f = s_qf[c * 32 + lane];
    qb[2 * c][0] = hmul2(f.x, s0);
    qb[2 * c][1] = hmul2(f.y, s1);
    qb[2 * c + 1][0] = hmul2(f.z, s2);
    qb[2 * c + 1][1] = hmul2(f.w, s3);
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

// qb: the query's B fragments (head g; channels 16j + 2t + {0,1}, + 8) times 4^-J of the slot they meet.
// qs/qm: sum(q) and q.mu_K of heads 2t, 2t+1, times sc. ksc = sc * 2^24 (the codes' subnormal scale).
// ub/tab (ROPE): the block's rope-term B fragments and its table rows (rope_frags).
// CT > 0 (per-channel keys): qb already carries the block's scales and qm is sc (q_r . z + q . mu_K).
template <int D, int BITS, bool ROPE, int CT>
__device__ __forceinline__ void int_block(State<D>& st, const Raw<D, BITS>& raw, const u32 (&qb)[D / 16][2], const float (&qs)[2],
                                          const float (&qm)[2], float ksc, int tok0, int end, int lane,
                                          const u32 (&ub)[D / 16][2], const uint4* __restrict__ tab) {
  constexpr int NU = D * BITS / 128;  // words per token (K) or token pair (V) and lane
  float racc[2][4];
  if (ROPE) {
#pragma unroll
    for (int n = 0; n < 2; ++n)
#pragma unroll
      for (int i = 0; i < 4; ++i) racc[n][i] = 0.f;
#pragma unroll
    for (int kc = 0; kc < D / 16; ++kc) {
      const uint4 a = __ldg(tab + kc * 32 + lane);
      mma_f16(racc[kc & 1], a.x, a.y, a.z, a.w, ub[kc][0], ub[kc][1]);
    }
  }
  float acc[2][4];
#pragma unroll
  for (int n = 0; n < 2; ++n)
#pragma unroll
    for (int i = 0; i < 4; ++i) acc[n][i] = 0.f;
#pragma unroll
  for (int u = 0; u < NU; ++u) {
    const u32 w0 = raw.k[u], w1 = raw.k[NU + u];  // tokens g and g + 8
    if (BITS == 2) {
      mma_f16(acc[0], slot<0>(w0), slot<0>(w1), slot<1>(w0), slot<1>(w1), qb[4 * u + 0][0], qb[4 * u + 0][1]);
      mma_f16(acc[1], slot<2>(w0), slot<2>(w1), slot<3>(w0), slot<3>(w1), qb[4 * u + 1][0], qb[4 * u + 1][1]);
      mma_f16(acc[0], slot<4>(w0), slot<4>(w1), slot<5>(w0), slot<5>(w1), qb[4 * u + 2][0], qb[4 * u + 2][1]);
      mma_f16(acc[1], slot<6>(w0), slot<6>(w1), slot<7>(w0), slot<7>(w1), qb[4 * u + 3][0], qb[4 * u + 3][1]);
    } else {
      mma_f16(acc[0], slot4<0>(w0), slot4<0>(w1), slot4<1>(w0), slot4<1>(w1), qb[2 * u + 0][0], qb[2 * u + 0][1]);
      mma_f16(acc[1], slot4<2>(w0), slot4<2>(w1), slot4<3>(w0), slot4<3>(w1), qb[2 * u + 1][0], qb[2 * u + 1][1]);
    }
  }
  const int g = lane >> 2;
  float lg[4], sv[2], zv[2];
#pragma unroll
  for (int n = 0; n < 2; ++n) {  // token g + 8n
    const bool ok = tok0 + 8 * n + g < end;
    const float sk = CT ? ksc : bf16f(raw.ks[n]) * ksc, zk = CT ? 0.f : bf16f(raw.kz[n]);
#pragma unroll
    for (int k = 0; k < 2; ++k) {
      const float b0 = CT ? qm[k] : fmaf(zk, qs[k], qm[k]);
      const float base = ROPE ? b0 + (racc[0][2 * n + k] + racc[1][2 * n + k]) : b0;
      lg[2 * n + k] = ok ? fmaf(acc[0][2 * n + k] + acc[1][2 * n + k], sk, base) : NEG_INF;
    }
    sv[n] = ok ? bf16f(raw.vs[n]) : 0.f;
    zv[n] = ok ? bf16f(raw.vz[n]) : 0.f;
  }
  u32 pb0, pb1;
  softmax_update<D, false>(st, lg, sv, zv, pb0, pb1);
#pragma unroll
  for (int u = 0; u < NU; ++u) {
    const u32 w0 = raw.v[u], w1 = raw.v[NU + u];  // token pairs (2t, 2t+1) and (2t+8, 2t+9)
    if (BITS == 2) {
      mma_f16(st.o[4 * u + 0], slot<0>(w0), slot<1>(w0), slot<0>(w1), slot<1>(w1), pb0, pb1);
      mma_f16(st.o[4 * u + 1], slot<2>(w0), slot<3>(w0), slot<2>(w1), slot<3>(w1), pb0, pb1);
      mma_f16(st.o[4 * u + 2], slot<4>(w0), slot<5>(w0), slot<4>(w1), slot<5>(w1), pb0, pb1);
      mma_f16(st.o[4 * u + 3], slot<6>(w0), slot<7>(w0), slot<6>(w1), slot<7>(w1), pb0, pb1);
    } else {
      mma_f16(st.o[2 * u + 0], slot4<0>(w0), slot4<1>(w0), slot4<0>(w1), slot4<1>(w1), pb0, pb1);
      mma_f16(st.o[2 * u + 1], slot4<2>(w0), slot4<3>(w0), slot4<2>(w1), slot4<3>(w1), pb0, pb1);
    }
  }
}

// One 16-token block of a BF16 window (rows of D bf16 at stride st_t), tokens >= n masked.
template <int D>
__device__ __forceinline__ void bf16_block(State<D>& st, const u16* kp, const u16* vp, long long st_t, const u32 (&qb)[D / 16][2],
                                           float sc, int tok0, int n, int lane) {
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
  const float one[2] = {1.f, 1.f}, zero[2] = {0.f, 0.f};
#pragma unroll
  for (int e = 0; e < 4; ++e) lg[e] = ((e < 2) ? ok0 : ok1) ? (acc[0][e] + acc[1][e]) * sc : NEG_INF;
  u32 pb0, pb1;
  softmax_update<D, true>(st, lg, one, zero, pb0, pb1);
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
    for (int i = 0; i < 4; ++i) {  // (channel 16m + g + 8(i&1), tokens 2t + 8(i>>1) + {0,1})
      const int ch = 16 * m + g + 8 * (i & 1), dt = 8 * (i >> 1);
      const u32 lo = okv[i >> 1][0] ? __ldg(v0 + (long long)dt * st_t + ch) : 0u;
      const u32 hi = okv[i >> 1][1] ? __ldg(v0 + (long long)(dt + 1) * st_t + ch) : 0u;
      a[i] = lo | (hi << 16);
    }
    mma_bf16(st.o[m], a[0], a[1], a[2], a[3], pb0, pb1);
  }
}

// The rope term's B fragments for blocks from position pos: (A', B') = (A, B) turned by -pos w_i, head g, as fp16.
// s_u: A (channels 0..D/2) and B (D/2..D) per head, row stride D + 4. Lane L reduces the angles of frequencies L,
// L + 32 (fp64, then fast sincos within [-pi, pi]); the lanes that need them read them by shuffles.
template <int D, int REP>
__device__ __forceinline__ void rope_frags(u32 (&ub)[D / 16][2], const float* s_u, const double* __restrict__ w, long long pos,
                                           int lane) {
  constexpr int NF = D / 64, SU = D + 4;
  const int g = lane >> 2, t = lane & 3;
  float cs[NF], sn[NF];
#pragma unroll
  for (int f = 0; f < NF; ++f) {
    const double a = (double)pos * __ldg(w + lane + 32 * f);
    const double r = fma(-rint(a * 0.15915494309189535), 6.283185307179586, a);
    __sincosf((float)r, &sn[f], &cs[f]);
  }
#pragma unroll
  for (int kc = 0; kc < D / 32; ++kc) {
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      float ap[2], bp[2];
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int i = 16 * kc + 8 * hh + 2 * t + e;
        const int f = (16 * kc + 8 * hh) >> 5;
        const float c = __shfl_sync(FULL, cs[f], i & 31), s = __shfl_sync(FULL, sn[f], i & 31);
        const float A = g < REP ? s_u[g * SU + i] : 0.f, B = g < REP ? s_u[g * SU + D / 2 + i] : 0.f;
        ap[e] = fmaf(c, A, s * B);
        bp[e] = fmaf(c, B, -s * A);
      }
      ub[kc][hh] = pack_f16(ap[0], ap[1]);
      ub[kc + D / 32][hh] = pack_f16(bp[0], bp[1]);
    }
  }
}

// x[REP][D] (shared, float) <- x @ M on the tensor cores (fp16 operands, fp32 sums). Mf: M's B fragments in
// fp16, [D/8 n-tiles][D/16 k-chunks][32 lanes] x uint2 (oscar.kernels.decode_mma.mma_b_fragments); warp w
// computes n-tiles w, w + W, ...; every lane's loads are issued before the first product.
template <int D, int REP, int W>
__device__ __forceinline__ void rotate_rows(float* x, const uint2* __restrict__ Mf, int tid) {
  constexpr int KC = D / 16, NTW = D / 8 / W;
  const int lane = tid & 31, warp = tid >> 5, g = lane >> 2, t = lane & 3;
  uint2 bf[NTW][KC];
#pragma unroll
  for (int n = 0; n < NTW; ++n)
#pragma unroll
    for (int kc = 0; kc < KC; ++kc) bf[n][kc] = __ldg(Mf + ((warp + n * W) * KC + kc) * 32 + lane);
  u32 a[KC][2];
#pragma unroll
  for (int kc = 0; kc < KC; ++kc) {
    const int ch = 16 * kc + 2 * t;
    a[kc][0] = g < REP ? pack_f16(x[g * D + ch], x[g * D + ch + 1]) : 0u;
    a[kc][1] = g < REP ? pack_f16(x[g * D + ch + 8], x[g * D + ch + 9]) : 0u;
  }
  __syncthreads();  // x is read by every warp before any writes it
#pragma unroll
  for (int n = 0; n < NTW; ++n) {
    float c[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int kc = 0; kc < KC; ++kc) mma_f16(c, a[kc][0], 0u, a[kc][1], 0u, bf[n][kc].x, bf[n][kc].y);
    if (g < REP) {
      const int col = 8 * (warp + n * W) + 2 * t;
      x[g * D + col] = c[0];
      x[g * D + col + 1] = c[1];
    }
  }
  __syncthreads();
}

// ST: stages of each warp's cp.async ring (ST - 1 blocks in flight while one is computed). RT: blocks of a warp per
// turn of the rope term's fragments (0: keys not rope-centered). CT: tokens per channel block of per-channel keys (0:
// per-token keys). A warp's k-th block of its split: lo + warp + k W (per-token keys), lo + k (per-channel keys: lo
// the start of the warp's contiguous run, as balanced as blocks allow); the rope table's block stride is W or 1.
// BITS: 2 or 4 (codes per byte 4 or 2). Dynamic shared memory: the rings, then the warps' outputs,
// max(W * ST * Stage::BYTES, W * REP * D * 4) bytes (the launcher passes it).
template <int D, int BITS, int REP, int W, int ST, int MINB, int RT, int CT = 0>
__global__ void __launch_bounds__(W * 32, MINB) oscar_decode_mma(const Params P) {
  constexpr int NT = W * 32;
  constexpr int R = CT ? CT / 16 : 1;  // blocks per channel block
  constexpr int BS = CT ? 1 : W;       // blocks between a warp's consecutive blocks
  using Stg = Stage<D, BITS, CT>;
  __shared__ float s_q[REP * D];
  extern __shared__ __align__(16) unsigned char s_buf[];  // the rings, then the warps' outputs
  float* s_o = reinterpret_cast<float*>(s_buf);
  unsigned char* ring = s_buf + (threadIdx.x >> 5) * ST * Stg::BYTES;
  const u32 ring_s = CT ? smem_addr(ring) : 0u;
  __shared__ float s_m[W][2 * REP], s_l[W][2 * REP];
  __shared__ float s_f[REP][SMAX];
  __shared__ float s_u[RT ? REP * (D + 4) : 1];  // rope term: A, B per head (rope_frags)
  __shared__ uint4 s_qc[CT ? 3 * D : 1];  // per-channel keys: the query's fragments (channel_frags), s_qf then s_qz
  __shared__ int s_last;

  const int split = blockIdx.x, kvh = blockIdx.y, b = blockIdx.z;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t = lane & 3;
  const bool is_int = split < P.s_int;

  // ---- the first blocks' copies go out before the query work
  int len = 0, lo = 0, n_w = 0, pv_cur = 0, pv_next = 0;
  const int* pt = P.page_table + (long long)b * P.pt_stride;
  const u16* kzs = CT ? (lane < 16 ? P.ks : P.kz) + (long long)kvh * P.kss_h + (lane & 15) * (D / 16) : nullptr;
  const int pmask = (1 << P.page_shift) - 1;
  auto blk = [&](int kk) -> int { return CT ? lo + kk : lo + warp + kk * W; };  // this warp's kk-th block
  auto page_of = [&](int kk) -> int {  // page of this warp's kk-th block
    return kk < n_w ? __ldg(pt + ((blk(kk) * 16) >> P.page_shift)) : 0;
  };
  if (is_int) {
    len = __ldg(P.int_len + b);
    const int nblk = (len + 15) >> 4;
    const int per = (nblk + P.s_int - 1) / P.s_int;
    lo = split * per;
    const int hi = min(nblk, lo + per);
    if (CT) {  // a contiguous run of ceil((hi - lo) / W) blocks per warp
      const int c = (max(0, hi - lo) + W - 1) / W;
      lo += warp * c;
      n_w = max(0, min(hi, lo + c) - lo);
    } else {
      n_w = hi > lo + warp ? (hi - lo - warp + W - 1) / W : 0;  // blocks of this warp: lo + warp + k W
    }
    pv_cur = page_of(lane);  // pages of blocks 0..31 (lane k holds block k), then 32..63
    pv_next = page_of(32 + lane);
#pragma unroll
    for (int s = 0; s < ST - 1; ++s) {
      if (s < n_w)
        issue_block<D, BITS, CT>(ring + s * Stg::BYTES, P, __shfl_sync(FULL, pv_cur, s), kvh, (blk(s) * 16) & pmask, lane, kzs,
                                 s == 0);
      cp_commit();
    }
  }

  // ---- query of this KV head's REP heads (rotated for the quantized splits)
  const u16* qg = P.q + ((long long)b * P.hkv * REP + (long long)kvh * REP) * D;
  for (int i = tid; i < REP * D; i += NT) s_q[i] = bf16f(qg[i]);
  __syncthreads();
  float qmu = 0.f;  // q . mu_K of head g (partial over t), plus q . m on the channels RoPE leaves alone
  if (is_int && (P.muk != nullptr || RT)) {
    const float* mk = P.muk + (long long)kvh * D;
    const float* rm = P.rope_m + (long long)kvh * D;
    if (g < REP)
      for (int i = t; i < D; i += 4) {
        float m = P.muk != nullptr ? mk[i] : 0.f;
        if (RT && i >= 2 * P.rope_half) m += rm[i];
        qmu += s_q[g * D + i] * m;
      }
  }
  if (RT && is_int) {  // A_i, B_i of the rope term, times sc (base-2 logits)
    const float* rm = P.rope_m + (long long)kvh * D;
    const int hf = P.rope_half;
    const float f = P.sc * P.rope_scaling;
    for (int i = tid; i < REP * (D / 2); i += NT) {
      const int hh = i / (D / 2), c = i % (D / 2);
      float a = 0.f, bb = 0.f;
      if (c < hf) {
        const float q1 = s_q[hh * D + c], q2 = s_q[hh * D + hf + c], m1 = rm[c], m2 = rm[hf + c];
        a = f * fmaf(q1, m1, q2 * m2);
        bb = f * fmaf(q2, m1, -q1 * m2);
      }
      s_u[hh * (D + 4) + c] = a;
      s_u[hh * (D + 4) + D / 2 + c] = bb;
    }
    __syncthreads();  // before rotate_rows overwrites s_q, and before the loop reads s_u
  }
  if (is_int && P.rk != nullptr) rotate_rows<D, REP, W>(s_q, P.rk + (long long)kvh * D * D / 4, tid);
  u32 qb[D / 16][2];
  float qsum = 0.f;  // of head g, partial over t: the fp16 query the products see, scaled back
#pragma unroll
  for (int j = 0; j < D / 16; ++j) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int ch = 16 * j + 2 * t + 8 * h;
      const float x0 = g < REP ? s_q[g * D + ch] : 0.f, x1 = g < REP ? s_q[g * D + ch + 1] : 0.f;
      if (is_int) {
        const float f = slot_factor<BITS>(j, h);
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
  if (CT && is_int) {  // per-channel keys: the query's fragments for channel_frags, the same in every warp
    if (warp == 0) {
#pragma unroll
      for (int c = 0; c < D / 32; ++c) s_qc[c * 32 + lane] = make_uint4(qb[2 * c][0], qb[2 * c][1], qb[2 * c + 1][0], qb[2 * c + 1][1]);
#pragma unroll
      for (int j = 0; j < D / 16; ++j) {
        u32 hl[2][2];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int ch = 16 * j + 2 * t + 8 * h;
          const float x0 = g < REP ? s_q[g * D + ch] : 0.f, x1 = g < REP ? s_q[g * D + ch + 1] : 0.f;
          hl[0][h] = pack_bf16(x0, x1);
          hl[1][h] = pack_bf16(x0 - bf16f(hl[0][h]), x1 - bf16f(hl[0][h] >> 16));
        }
        s_qc[D + j * 32 + lane] = make_uint4(hl[0][0], hl[1][0], hl[0][1], hl[1][1]);  // A: hi rows g, lo rows g + 8
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

  if (is_int) {
    const float ksc = P.sc * 16777216.f;  // 2^24
    int rs = 0, ws = ST - 1;  // ring stage read and written this iteration
    u32 ub[D / 16][2];
    long long rpos = 0;  // position of this warp's first block
    if (RT) rpos = (long long)(P.rope_pos0 != nullptr ? __ldg(P.rope_pos0 + b) : 0) + P.rope_pos_add + (long long)blk(0) * 16;
    u32 qc[D / 16][2];  // per-channel keys: the query's B fragments times the current channel block's scales
    float qzm[2] = {qm[0], qm[1]};  // the logit's offset: sc q . mu_K, plus sc q_r . z of the channel block (CT > 0)
    for (int k = 0; k < n_w; ++k) {
      const int kn = k + ST - 1;
      if (kn >= 32 && (kn & 31) == 0) {  // next 32 pages
        pv_cur = pv_next;
        pv_next = page_of(kn + 32 + lane);
      }
      __syncwarp();  // every lane is done with the stage about to be refilled
      if (kn < n_w)
        issue_block<D, BITS, CT>(ring + ws * Stg::BYTES, P, __shfl_sync(FULL, pv_cur, kn & 31), kvh, (blk(kn) * 16) & pmask,
                                 lane, kzs, kn == 0);
      cp_commit();
      cp_wait<ST - 1>();  // block k has landed
      __syncwarp();
      if (RT && k % (RT ? RT : 1) == 0) rope_frags<D, REP>(ub, s_u, P.rope_w, rpos + (long long)k * BS * 16, lane);
      if (CT && (k == 0 || (blk(k) & (R - 1)) == 0)) {  // a run's first block, a channel block's first
        float qz[2];
        channel_frags<D>(qc, qz, ring + rs * Stg::BYTES + Stg::KC, ring_s + rs * Stg::BYTES + Stg::KC, s_qc, s_qc + D, lane);
        qzm[0] = fmaf(qz[0], P.sc, qm[0]);
        qzm[1] = fmaf(qz[1], P.sc, qm[1]);
      }
      Raw<D, BITS> raw;
      read_block<D, BITS, CT>(raw, ring + rs * Stg::BYTES, lane);
      int_block<D, BITS, (RT > 0), CT>(st, raw, CT ? qc : qb, qs, qzm, ksc, blk(k) * 16, len, lane, ub,
                                       P.rope_tab + (RT ? (k % (RT ? RT : 1)) * (D / 16) * 32 : 0));
      rs = rs + 1 == ST ? 0 : rs + 1;
      ws = ws + 1 == ST ? 0 : ws + 1;
    }
  } else {
    const int seg = split - P.s_int;  // 0: sink (if present), then recent
    const bool sink = P.has_sink && seg == 0;
    const u16* kp = sink ? P.sink_k : P.rec_k;
    const u16* vp = sink ? P.sink_v : P.rec_v;
    const long long sb = sink ? P.sk_b : P.rk_b, sh = sink ? P.sk_h : P.rk_h, stt = sink ? P.sk_t : P.rk_t;
    const int n = (int)min((long long)__ldg((sink ? P.sink_len : P.rec_len) + b), sink ? P.sk_max : P.rk_max);
    const long long wb = P.win_row != nullptr ? (long long)__ldg(P.win_row + b) : (long long)b;
    kp += wb * sb + kvh * sh;
    vp += wb * sb + kvh * sh;
    for (int blk = warp; blk * 16 < n; blk += W) bf16_block<D>(st, kp, vp, stt, qb, P.sc, blk * 16, n, lane);
  }

  // ---- combine the warps (lane (g, t): heads 2t, 2t+1; l, zs partial over g)
#pragma unroll
  for (int k = 0; k < 2; ++k)
#pragma unroll
    for (int x = 4; x < 32; x <<= 1) {
      st.l[k] += __shfl_xor_sync(FULL, st.l[k], x);
      st.zs[k] += __shfl_xor_sync(FULL, st.zs[k], x);
    }
  cp_wait<0>();
  __syncthreads();  // the warps' outputs go where the rings were: every warp must be done with its ring
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
    // values: rows 16m + g use slot 2(m%4), rows + 8 slot 2(m%4)+1: factor 2^24 4^-J
    const float f0 = is_int ? 16777216.f * slot_factor<BITS>(m, 0) : 1.f;
    const float f1 = is_int ? 16777216.f * slot_factor<BITS>(m, 1) : 1.f;
#pragma unroll
    for (int k = 0; k < 2; ++k) {
      const int h = 2 * t + k;
      if (h < REP) {
        s_o[(warp * REP + h) * D + 16 * m + g] = fmaf(st.o[m][k], f0, st.zs[k]);
        s_o[(warp * REP + h) * D + 16 * m + g + 8] = fmaf(st.o[m][2 + k], f1, st.zs[k]);
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

  // ---- the last CTA of this (sequence, KV head) merges every split
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
  // weights f_s of every partial (per head) and the masses of the two frames, over L:
  // s_m[0][h] = X (to rotate), s_m[0][REP + h] = Y (in the output frame)
  for (int h = warp; h < REP; h += W) {
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
  // X and Y, normalized, four channels per unit; partials [x_lo, x_hi) are not in the output frame
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
      if (P.out_rotated && P.muv != nullptr) {  // BF16 part, centred before the rotation
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
