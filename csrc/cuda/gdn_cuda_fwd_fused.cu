/*
 * gdn_cuda_fwd_fused.cu — the forward's state pass and outputs in one
 * warp-specialised sm_90a kernel (DESIGN §2, C = 64): no chunk state, W, U
 * or Vn ever goes to global memory. Per CTA one (sequence n, value head j,
 * block of 64 state columns vb); per chunk of the sequence, in order:
 *
 *   Vn = U - W S                 U = A diag(beta) V,  W = A diag(beta e^gamma rk) K
 *   O  = scale diag(e^gamma rq) Q S + P Vn,  P = lower_incl(Q K^T ⊙ Gamma) scale diag(rq) . diag(rk)
 *   S  = e^{gamma_C} S + Kd^T Vn,  Kd = diag(e^{gamma_C - gamma} rk) K
 *
 * with A = (I + L)^-1 and the gate record {gamma, beta, rk, rq} from
 * fq_fwd_inverse_kernel (gdn_cuda_fwd_wy.cu), run just before.
 *
 * Three warpgroups (384 threads), one CTA per SM (216 KB of shared memory at
 * K = 128: three stages of 72 KB):
 *   WG0, producer: one thread issues the TMA loads of a chunk's Q, K, V
 *        (this CTA's 64 columns) and A tiles into the stage's buffers
 *        (mbarrier `full`), three chunks deep; setmaxnreg 40.
 *   WG1, prep: the S-independent work of a chunk, one chunk ahead of WG2:
 *        P = Q K^T, U = A'' V, W = A' K on wgmma (A', A'' = A with its
 *        columns scaled, as register operands), then in place
 *        Q -> Qg = diag(scale e^gamma rq) Q, K -> Kd, A -> P (masked, gated,
 *        bf16), V -> W[:, 0:64], U^T in fp32; signals `ready`.
 *   WG2, chain: the state, S^T (64 columns x K) as wgmma accumulators in
 *        registers, never in shared or global memory:
 *          Vn^T = U^T - S^T W^T          (A = S^T bf16 from registers, B = W)
 *          O^T  = S^T Qg^T + Vn^T P^T
 *          S^T  = e^{gamma_C} S^T + Vn^T Kd
 *        then O through shared memory to global, and `empty` for the stage.
 *
 * Shared-memory tiles are SWIZZLE_128B, 64 x 64 bf16 (8 KB), as TMA writes
 * them; gdn_cuda_hopper.cuh explains the operand descriptors. Padding rows of
 * a sequence's last chunk (the next sequence's tokens, or TMA's zeros past
 * the tensor) are zeroed before use, so nothing from another sequence enters
 * the arithmetic.
 *
 * Only sm_90a code has the kernel; elsewhere it compiles to an empty body and
 * fq_cuda_fwd_fused_available() says no (gdn_cuda_fwd.cu then runs the
 * three-stage forward).
 */
#include "gdn_cuda_hopper.cuh"

#include <cuda.h> /* CUtensorMap and its enums only: the encoder comes from the runtime */

#include <string.h>

#define FQ_FUSED_STAGES 3
#define FQ_TILE 8192 /* one 64 x 64 bf16 SWIZZLE_128B tile */

/* Shared memory of one CTA. Per stage: Q (K/64 tiles), K (K/64 tiles), V,
 * A, the second W tile (K = 128), U^T (fp32 64 x 64); then the barriers,
 * per-stage scalars and the prep warpgroup's row vectors. */
template <int K> struct fq_fused_smem {
    static constexpr int KT = K / 64;
    static constexpr int off_q = 0;
    static constexpr int off_k = off_q + KT * FQ_TILE;
    static constexpr int off_v = off_k + KT * FQ_TILE; /* V, then W tile 0 */
    static constexpr int off_a = off_v + FQ_TILE;      /* A, then P */
    static constexpr int off_w1 = off_a + FQ_TILE;     /* W tile 1 (K = 128) */
    static constexpr int off_u = off_w1 + (KT - 1) * FQ_TILE; /* U^T fp32, then O staging */
    static constexpr int stage = off_u + 64 * 64 * 4;
    static constexpr int off_bar = FQ_FUSED_STAGES * stage; /* full, ready, empty */
    static constexpr int off_scal = off_bar + 3 * FQ_FUSED_STAGES * 8;  /* per stage: e^{gamma_C}, len */
    static constexpr int off_vec = off_scal + FQ_FUSED_STAGES * 8;      /* prep: 7 x 64 floats */
    static constexpr int bytes = off_vec + 7 * 64 * 4 + 1024;           /* + alignment slack */
    static constexpr uint32_t load_bytes = (2 * KT + 2) * FQ_TILE;
};

struct fq_fused_args {
    const fq_seq_info *seqs;
    const float4 *rec;   /* [nc_max, HV, 64] {gamma, beta, rk, rq} */
    const float *h0;     /* [N, HV, K, V] or NULL */
    float *ht;           /* [N, HV, K, V] or NULL */
    void *o;             /* [B*T, HV, V], dtype odt */
    fq_dtype odt;
    int H, HV, V, nvb;   /* nvb = V / 64 column blocks */
    float scale;
};

#if FQ_SM90A
/* A 64 x 64 fp32 tile in shared memory, [row][col], the 16-byte chunk c of a
 * row at c ^ (row & 7) (no bank conflicts for the fragment stores and
 * loads below). U^T is kept as [v][r] (the chain reads float2 pairs of r),
 * the O staging in the same place as [r][v] (rows read as float4). */
static __device__ __forceinline__ float *fq_f32_tile(float *U, int row, int col)
{
    return U + row * 64 + ((((col >> 2) ^ (row & 7)) << 2) | (col & 3));
}

/* One bf16 pair (columns c, c+1; c even) of row r of a SWIZZLE_128B tile. */
static __device__ __forceinline__ uint32_t *fq_tile_pair(unsigned char *tile, int r, int c)
{
    return (uint32_t *)(tile + fq_sw128(r, 2 * c));
}

/* The A fragment of K-step kk (columns 16 kk..) for warp w's 16 rows of a
 * 64 x 64 bf16 SWIZZLE_128B tile, by ldmatrix. */
static __device__ __forceinline__ void fq_ldsm_a_sw128(uint32_t a[4], const unsigned char *tile, int w, int kk)
{
    const int l = threadIdx.x & 31;
    const int row = 16 * w + (l & 7) + ((l >> 3) & 1) * 8, col = 16 * kk + (l >> 4) * 8;
    fq_ldsm_x4(a, fq_smem_u32(tile + fq_sw128(row, 2 * col)));
}

/* bf16 pair scaled by two factors. */
static __device__ __forceinline__ uint32_t fq_scale_pair(uint32_t x, float f0, float f1)
{
    float2 v = fq_unpack_bf16(x);
    return fq_pack_bf16(v.x * f0, v.y * f1);
}

#endif

template <int K>
__global__ void __launch_bounds__(384, 1)
    fq_fwd_fused_kernel(const __grid_constant__ CUtensorMap tm_q, const __grid_constant__ CUtensorMap tm_k,
                        const __grid_constant__ CUtensorMap tm_v, const __grid_constant__ CUtensorMap tm_a,
                        const fq_fused_args args)
{
#if FQ_SM90A
    typedef fq_fused_smem<K> SM;
    constexpr int KT = SM::KT;
    extern __shared__ unsigned char smem_raw[];
    unsigned char *smem = (unsigned char *)(((uintptr_t)smem_raw + 1023) & ~(uintptr_t)1023);
    uint64_t *full = (uint64_t *)(smem + SM::off_bar);
    uint64_t *ready = full + FQ_FUSED_STAGES, *empty = ready + FQ_FUSED_STAGES;
    float2 *scal = (float2 *)(smem + SM::off_scal);
    float *vec = (float *)(smem + SM::off_vec);

    const int HV = args.HV, nvb = args.nvb;
    const int vb = blockIdx.x % nvb, j = (blockIdx.x / nvb) % HV, n = blockIdx.x / (nvb * HV);
    const int hq = j / (HV / args.H);
    const int tid = threadIdx.x, wg = tid >> 7;

    if (tid == 0) {
        for (int s = 0; s < FQ_FUSED_STAGES; s++) {
            fq_mbar_init(&full[s], 1);
            fq_mbar_init(&ready[s], 1);
            fq_mbar_init(&empty[s], 1);
        }
        fq_mbar_init_fence();
        fq_tma_prefetch_desc(&tm_q);
        fq_tma_prefetch_desc(&tm_k);
        fq_tma_prefetch_desc(&tm_v);
        fq_tma_prefetch_desc(&tm_a);
    }
    __syncthreads();
    /* the chunk table, A and the record come from the kernels before */
    fq_pdl_wait();
    const fq_seq_info si = args.seqs[n];
    const int nch = si.nchunks;

    if (wg == 0) {
        /* ---------------------------------------------------- producer ---- */
        fq_setmaxnreg_dec40();
        if (tid == 0) {
            for (int i = 0; i < nch; i++) {
                const int s = i % FQ_FUSED_STAGES;
                if (i >= FQ_FUSED_STAGES) fq_mbar_wait(&empty[s], ((i / FQ_FUSED_STAGES) - 1) & 1);
                unsigned char *st = smem + s * SM::stage;
                const int row = si.bos + 64 * i;
                fq_mbar_arrive_tx(&full[s], SM::load_bytes);
#pragma unroll
                for (int kt = 0; kt < KT; kt++) {
                    fq_tma_load_3d(st + SM::off_q + kt * FQ_TILE, &tm_q, &full[s], 64 * kt, hq, row);
                    fq_tma_load_3d(st + SM::off_k + kt * FQ_TILE, &tm_k, &full[s], 64 * kt, hq, row);
                }
                fq_tma_load_3d(st + SM::off_v, &tm_v, &full[s], 64 * vb, j, row);
                fq_tma_load_2d(st + SM::off_a, &tm_a, &full[s], 0, ((si.chunk0 + i) * HV + j) * 64);
            }
        }
    } else if (wg == 1) {
        /* -------------------------------------------------------- prep ---- */
        fq_setmaxnreg_inc232();
        const int tp = tid - 128, w = tp >> 5, lane = tp & 31, g = lane >> 2, t = lane & 3;
        float *gam = vec, *rkv = vec + 64, *prq = vec + 128; /* gamma, rk, scale rq */
        float *fa1 = vec + 192, *fa2 = vec + 256;            /* columns of A': beta e^gamma rk; of A'': beta */
        float *fqg = vec + 320, *fkd = vec + 384;            /* rows of Qg: scale e^gamma rq; of Kd */
        float4 rnext = make_float4(0.f, 0.f, 0.f, 0.f);
        if (tp < 64 && nch > 0) rnext = args.rec[((int64_t)si.chunk0 * HV + j) * 64 + tp];
        for (int i = 0; i < nch; i++) {
            const int s = i % FQ_FUSED_STAGES;
            unsigned char *st = smem + s * SM::stage;
            const int len = min(64, si.len - 64 * i);
            const float4 rc = rnext;
            if (tp < 64 && i + 1 < nch) rnext = args.rec[((int64_t)(si.chunk0 + i + 1) * HV + j) * 64 + tp];

            /* the row vectors of this chunk (the previous chunk's readers are done) */
            fq_named_bar(2, 128);
            if (tp < 64) { gam[tp] = rc.x; rkv[tp] = rc.z; prq[tp] = args.scale * rc.w; }
            fq_named_bar(2, 128);
            if (tp < 64) {
                const float eg = __expf(rc.x), gC = gam[63];
                fa1[tp] = rc.y * eg * rc.z;
                fa2[tp] = rc.y;
                fqg[tp] = args.scale * eg * rc.w;
                fkd[tp] = __expf(gC - rc.x) * rc.z;
            }

            /* the stage is ours once its loads landed (the chain is done with its last use) */
            fq_mbar_wait(&full[s], (i / FQ_FUSED_STAGES) & 1);
            if (tp == 0) scal[s] = make_float2(__expf(gam[63]), (float)len);
            if (len < 64) {
                /* zero the padding rows of Q, K, V (rows of the next sequence) */
                const int nt = 2 * KT + 1, nrow = 64 - len;
                for (int idx = tp; idx < nt * nrow * 8; idx += 128) {
                    const int tile = idx / (nrow * 8), r = len + (idx / 8) % nrow, c = idx % 8;
                    unsigned char *tb = st + (tile < KT ? SM::off_q + tile * FQ_TILE
                                              : tile < 2 * KT ? SM::off_k + (tile - KT) * FQ_TILE
                                                              : SM::off_v);
                    *(uint4 *)(tb + r * 128 + c * 16) = make_uint4(0, 0, 0, 0);
                }
                fq_fence_async_smem();
            }
            fq_named_bar(2, 128);

            /* A' = A diag(fa1), A'' = A diag(fa2) as A fragments (warp w: rows 16w..) */
            uint32_t a1[4][4], a2[4][4];
#pragma unroll
            for (int kk = 0; kk < 4; kk++) {
                uint32_t a[4];
                fq_ldsm_a_sw128(a, st + SM::off_a, w, kk);
                const int c0 = 16 * kk + 2 * t, c1 = c0 + 8;
                a1[kk][0] = fq_scale_pair(a[0], fa1[c0], fa1[c0 + 1]);
                a1[kk][1] = fq_scale_pair(a[1], fa1[c0], fa1[c0 + 1]);
                a1[kk][2] = fq_scale_pair(a[2], fa1[c1], fa1[c1 + 1]);
                a1[kk][3] = fq_scale_pair(a[3], fa1[c1], fa1[c1 + 1]);
                a2[kk][0] = fq_scale_pair(a[0], fa2[c0], fa2[c0 + 1]);
                a2[kk][1] = fq_scale_pair(a[1], fa2[c0], fa2[c0 + 1]);
                a2[kk][2] = fq_scale_pair(a[2], fa2[c1], fa2[c1 + 1]);
                a2[kk][3] = fq_scale_pair(a[3], fa2[c1], fa2[c1 + 1]);
            }

            float pacc[32], uacc[32], wacc[K / 2];
            const uint32_t sq = fq_smem_u32(st + SM::off_q), sk = fq_smem_u32(st + SM::off_k);
            const uint32_t sv = fq_smem_u32(st + SM::off_v);
            fq_wgmma_fence();
            /* P0 = Q K^T (both K-major) */
#pragma unroll
            for (int kk = 0; kk < K / 16; kk++) {
                const uint32_t off = (kk >> 2) * FQ_TILE + 32 * (kk & 3);
                fq_wgmma_ss_n64<0, 0>(pacc, fq_desc_sw128(sq + off, 16, 1024), fq_desc_sw128(sk + off, 16, 1024),
                                      kk > 0);
            }
            /* U = A'' V (V MN-major: rows are the reduction index) */
#pragma unroll
            for (int kk = 0; kk < 4; kk++)
                fq_wgmma_rs_n64<1, 0>(uacc, a2[kk], fq_desc_sw128(sv + 2048 * kk, FQ_TILE, 1024), kk > 0);
            /* W = A' K (K MN-major; its two 64-column tiles FQ_TILE apart) */
#pragma unroll
            for (int kk = 0; kk < 4; kk++) {
                if constexpr (K == 128)
                    fq_wgmma_rs_n128<1, 0>(wacc, a1[kk], fq_desc_sw128(sk + 2048 * kk, FQ_TILE, 1024), kk > 0);
                else
                    fq_wgmma_rs_n64<1, 0>(wacc, a1[kk], fq_desc_sw128(sk + 2048 * kk, FQ_TILE, 1024), kk > 0);
            }
            fq_wgmma_commit();
            fq_wgmma_wait<0>();
            fq_reg_fence(pacc);
            fq_reg_fence(uacc);
            fq_reg_fence(wacc);
            fq_named_bar(2, 128); /* every warp's products are done with Q, K, V, A */

            /* P = lower_incl(P0 ⊙ Gamma) diag(scale rq) . diag(rk) -> A's tile */
#pragma unroll
            for (int nb = 0; nb < 8; nb++)
#pragma unroll
                for (int h = 0; h < 2; h++) {
                    const int r = 16 * w + g + 8 * h, c = 8 * nb + 2 * t;
                    const float pr = prq[r], gr = gam[r];
                    float x0 = c <= r ? pacc[4 * nb + 2 * h] * pr * rkv[c] * __expf(gr - gam[c]) : 0.f;
                    float x1 = c + 1 <= r ? pacc[4 * nb + 2 * h + 1] * pr * rkv[c + 1] * __expf(gr - gam[c + 1]) : 0.f;
                    *fq_tile_pair(st + SM::off_a, r, c) = fq_pack_bf16(x0, x1);
                }
            /* U^T fp32 */
            float *Us = (float *)(st + SM::off_u);
#pragma unroll
            for (int nb = 0; nb < 8; nb++)
#pragma unroll
                for (int h = 0; h < 2; h++) {
                    const int r = 16 * w + g + 8 * h, v = 8 * nb + 2 * t;
                    *fq_f32_tile(Us, v, r) = uacc[4 * nb + 2 * h];
                    *fq_f32_tile(Us, v + 1, r) = uacc[4 * nb + 2 * h + 1];
                }
            /* W: columns 0..63 into V's tile, 64..127 into the W tile */
#pragma unroll
            for (int nb = 0; nb < K / 8; nb++)
#pragma unroll
                for (int h = 0; h < 2; h++) {
                    const int r = 16 * w + g + 8 * h, c = 8 * nb + 2 * t;
                    unsigned char *tile = st + (c < 64 ? SM::off_v : SM::off_w1);
                    *fq_tile_pair(tile, r, c & 63) = fq_pack_bf16(wacc[4 * nb + 2 * h], wacc[4 * nb + 2 * h + 1]);
                }
            /* Kd = diag(e^{gamma_C - gamma} rk) K and Qg = diag(scale e^gamma rq) Q, in place
             * (the swizzle keeps each 16-byte chunk in its row) */
            for (int idx = tp; idx < 2 * KT * 512; idx += 128) {
                const int tile = idx >> 9, r = (idx >> 3) & 63;
                unsigned char *p = st + (tile < KT ? SM::off_k + tile * FQ_TILE : SM::off_q + (tile - KT) * FQ_TILE) +
                                   (idx & 511) * 16;
                const float f = tile < KT ? fkd[r] : fqg[r];
                uint4 x = *(uint4 *)p;
                x.x = fq_scale_pair(x.x, f, f);
                x.y = fq_scale_pair(x.y, f, f);
                x.z = fq_scale_pair(x.z, f, f);
                x.w = fq_scale_pair(x.w, f, f);
                *(uint4 *)p = x;
            }
            fq_fence_async_smem();
            fq_named_bar(2, 128);
            if (tp == 0) fq_mbar_arrive(&ready[s]);
        }
    } else {
        /* ------------------------------------------------------- chain ---- */
        fq_setmaxnreg_inc232();
        const int tc = tid - 256, w = tc >> 5, lane = tc & 31, g = lane >> 2, t = lane & 3;
        const int V = args.V;
        /* S^T: row v = 16 w + g + 8 h (this CTA's column 64 vb + v), column kd = 8 nb + 2 t + e:
         * S[4 nb + 2 h + e] */
        float S[K / 2];
        const int64_t sbase = ((int64_t)n * HV + j) * K * V + 64 * vb;
#pragma unroll
        for (int nb = 0; nb < K / 8; nb++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const int v = 16 * w + g + 8 * (e >> 1), kd = 8 * nb + 2 * t + (e & 1);
                S[4 * nb + e] = args.h0 ? args.h0[sbase + (int64_t)kd * V + v] : 0.f;
            }
        uint32_t sb[K / 16][4];
#pragma unroll
        for (int kk = 0; kk < K / 16; kk++) fq_acc_to_a(sb[kk], &S[8 * kk], 1.f);

        for (int i = 0; i < nch; i++) {
            const int s = i % FQ_FUSED_STAGES;
            unsigned char *st = smem + s * SM::stage;
            fq_mbar_wait(&ready[s], (i / FQ_FUSED_STAGES) & 1);
            float *Us = (float *)(st + SM::off_u);
            float vacc[32], oacc[32];
#pragma unroll
            for (int nb = 0; nb < 8; nb++)
#pragma unroll
                for (int h = 0; h < 2; h++) {
                    const float2 u = *(const float2 *)fq_f32_tile(Us, 16 * w + g + 8 * h, 8 * nb + 2 * t);
                    vacc[4 * nb + 2 * h] = u.x;
                    vacc[4 * nb + 2 * h + 1] = u.y;
                }
            const uint32_t sq = fq_smem_u32(st + SM::off_q), sk = fq_smem_u32(st + SM::off_k);
            const uint32_t sw0 = fq_smem_u32(st + SM::off_v), sw1 = fq_smem_u32(st + SM::off_w1);
            const uint32_t sp = fq_smem_u32(st + SM::off_a);
            fq_wgmma_fence();
            /* Vn^T = U^T - S^T W^T (W K-major) */
#pragma unroll
            for (int kk = 0; kk < K / 16; kk++)
                fq_wgmma_rs_n64<0, 1>(vacc, sb[kk], fq_desc_sw128((kk < 4 ? sw0 : sw1) + 32 * (kk & 3), 16, 1024), 1);
            fq_wgmma_commit();
            /* O^T = S^T Qg^T */
#pragma unroll
            for (int kk = 0; kk < K / 16; kk++)
                fq_wgmma_rs_n64<0, 0>(oacc, sb[kk], fq_desc_sw128(sq + (kk >> 2) * FQ_TILE + 32 * (kk & 3), 16, 1024),
                                      kk > 0);
            fq_wgmma_commit();
            fq_wgmma_wait<1>();
            fq_reg_fence(vacc);
            uint32_t vn[4][4];
#pragma unroll
            for (int kk = 0; kk < 4; kk++) fq_acc_to_a(vn[kk], &vacc[8 * kk], 1.f);
            const float2 sc = scal[s];
#pragma unroll
            for (int e = 0; e < K / 2; e++) S[e] *= sc.x;
            fq_wgmma_fence();
            /* S^T = e^{gamma_C} S^T + Vn^T Kd (Kd MN-major) */
#pragma unroll
            for (int kk = 0; kk < 4; kk++) {
                if constexpr (K == 128)
                    fq_wgmma_rs_n128<1, 0>(S, vn[kk], fq_desc_sw128(sk + 2048 * kk, FQ_TILE, 1024), 1);
                else
                    fq_wgmma_rs_n64<1, 0>(S, vn[kk], fq_desc_sw128(sk + 2048 * kk, FQ_TILE, 1024), 1);
            }
            /* O^T += Vn^T P^T (P K-major) */
#pragma unroll
            for (int kk = 0; kk < 4; kk++) fq_wgmma_rs_n64<0, 0>(oacc, vn[kk], fq_desc_sw128(sp + 32 * kk, 16, 1024), 1);
            fq_wgmma_commit();
            fq_wgmma_wait<0>();
            fq_reg_fence(S);
            fq_reg_fence(oacc);

            /* O: through U's place (fp32, [r][v]) to global rows r < len */
#pragma unroll
            for (int nb = 0; nb < 8; nb++)
#pragma unroll
                for (int h = 0; h < 2; h++) {
                    const int v = 16 * w + g + 8 * h, r = 8 * nb + 2 * t;
                    *fq_f32_tile(Us, r, v) = oacc[4 * nb + 2 * h];
                    *fq_f32_tile(Us, r + 1, v) = oacc[4 * nb + 2 * h + 1];
                }
            fq_named_bar(3, 128);
            const int len = (int)sc.y;
            const int64_t orow0 = (int64_t)(si.bos + 64 * i) * HV * V + (int64_t)j * V + 64 * vb;
            /* thread: row r, 8 consecutive columns v0..v0+7, four such pieces */
#pragma unroll
            for (int q = 0; q < 4; q++) {
                const int piece = tc + 128 * q, r = piece >> 3, v0 = (piece & 7) * 8;
                if (r < len) {
                    const float4 x0 = *(const float4 *)fq_f32_tile(Us, r, v0);
                    const float4 x1 = *(const float4 *)fq_f32_tile(Us, r, v0 + 4);
                    const float x[8] = {x0.x, x0.y, x0.z, x0.w, x1.x, x1.y, x1.z, x1.w};
                    const int64_t oi = orow0 + (int64_t)r * HV * V + v0;
                    if (args.odt == FQ_BF16) {
                        uint4 y = make_uint4(fq_pack_bf16(x[0], x[1]), fq_pack_bf16(x[2], x[3]), fq_pack_bf16(x[4], x[5]),
                                             fq_pack_bf16(x[6], x[7]));
                        *(uint4 *)((fq_bf16 *)args.o + oi) = y;
                    } else {
#pragma unroll
                        for (int e = 0; e < 8; e += 2) fq_st_f2(args.o, args.odt, oi + e, x[e], x[e + 1]);
                    }
                }
            }
            fq_named_bar(3, 128);
            if (tc == 0) fq_mbar_arrive(&empty[s]);
#pragma unroll
            for (int kk = 0; kk < K / 16; kk++) fq_acc_to_a(sb[kk], &S[8 * kk], 1.f);
        }
        if (args.ht) {
#pragma unroll
            for (int nb = 0; nb < K / 8; nb++)
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    const int v = 16 * w + g + 8 * (e >> 1), kd = 8 * nb + 2 * t + (e & 1);
                    args.ht[sbase + (int64_t)kd * V + v] = S[4 * nb + e];
                }
        }
    }
#endif
}

/* ------------------------------------------------------------- host ---- */

typedef CUresult (*fq_encode_tiled_fn)(CUtensorMap *, CUtensorMapDataType, cuuint32_t, void *, const cuuint64_t *,
                                       const cuuint64_t *, const cuuint32_t *, const cuuint32_t *, CUtensorMapInterleave,
                                       CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

/* cuTensorMapEncodeTiled from the driver, through the runtime (no libcuda
 * link), looked up once. */
static fq_status fq_encoder(fq_encode_tiled_fn *fn)
{
    static fq_encode_tiled_fn cached = NULL;
    if (!cached) {
        void *f = NULL;
        cudaDriverEntryPointQueryResult q;
        FQ_CUDA_CHECK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &f, 12000, cudaEnableDefault, &q));
        if (q != cudaDriverEntryPointSuccess || !f)
            return fq_fail(FQ_ERR_CUDA, "the CUDA driver has no cuTensorMapEncodeTiled (driver too old?)");
        cached = (fq_encode_tiled_fn)f;
    }
    *fn = cached;
    return FQ_OK;
}

/* A bf16 tensor map over rank dims (innermost first, elements) with the
 * given strides (bytes, dims 1..), 64 x ... boxes, SWIZZLE_128B. */
static fq_status fq_tmap(CUtensorMap *m, const void *base, int rank, const uint64_t *dims, const uint64_t *strides,
                         const uint32_t *box)
{
    fq_encode_tiled_fn enc;
    fq_status st = fq_encoder(&enc);
    if (st != FQ_OK) return st;
    cuuint64_t d[3], sb[2];
    cuuint32_t bx[3], es[3] = {1, 1, 1};
    for (int i = 0; i < rank; i++) { d[i] = dims[i]; bx[i] = box[i]; }
    for (int i = 0; i < rank - 1; i++) sb[i] = strides[i];
    CUresult r = enc(m, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, (cuuint32_t)rank, (void *)base, d, sb, bx, es,
                     CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                     CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    if (r != CUDA_SUCCESS) return fq_fail(FQ_ERR_CUDA, "cuTensorMapEncodeTiled failed (%d)", (int)r);
    return FQ_OK;
}

extern "C" int fq_cuda_fwd_fused_available(const fq_gdn_params *p)
{
    if ((p->K != 64 && p->K != 128) || (p->V != 64 && p->V != 128)) return 0;
    int dev = 0, major = 0;
    if (cudaGetDevice(&dev) != cudaSuccess) return 0;
    if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess || major != 9) return 0;
    cudaFuncAttributes fa;
    const void *k = p->K == 128 ? (const void *)fq_fwd_fused_kernel<128> : (const void *)fq_fwd_fused_kernel<64>;
    if (cudaFuncGetAttributes(&fa, k) != cudaSuccess || fa.ptxVersion < 90) {
        cudaGetLastError();
        return 0;
    }
    return 1;
}

template <int K>
static fq_status fq_launch_fused(const fq_gdn_params *p, const fq_fwd_ws *ws, cudaStream_t stream)
{
    const int64_t rows = p->B * p->T;
    CUtensorMap tq, tk, tv, ta;
    const uint32_t box[3] = {64, 1, 64};
    const uint64_t dq[3] = {(uint64_t)K, (uint64_t)p->H, (uint64_t)rows};
    const uint64_t sq[2] = {(uint64_t)K * 2, (uint64_t)p->H * K * 2};
    const uint64_t dv[3] = {(uint64_t)p->V, (uint64_t)p->HV, (uint64_t)rows};
    const uint64_t sv[2] = {(uint64_t)p->V * 2, (uint64_t)p->HV * p->V * 2};
    const uint64_t da[2] = {64, (uint64_t)ws->nc_max * p->HV * 64};
    const uint64_t sa[1] = {128};
    const uint32_t boxa[2] = {64, 64};
    fq_status st;
    if ((st = fq_tmap(&tq, ws->qb, 3, dq, sq, box)) != FQ_OK) return st;
    if ((st = fq_tmap(&tk, ws->kb, 3, dq, sq, box)) != FQ_OK) return st;
    if ((st = fq_tmap(&tv, ws->vb, 3, dv, sv, box)) != FQ_OK) return st;
    if ((st = fq_tmap(&ta, ws->a, 2, da, sa, boxa)) != FQ_OK) return st;
    fq_fused_args args;
    args.seqs = ws->seqs;
    args.rec = ws->rec;
    args.h0 = (const float *)p->h0;
    args.ht = (float *)p->ht;
    args.o = p->o;
    args.odt = p->dtype;
    args.H = (int)p->H;
    args.HV = (int)p->HV;
    args.V = (int)p->V;
    args.nvb = (int)(p->V / 64);
    args.scale = (float)p->scale;
    const int bytes = fq_fused_smem<K>::bytes;
    if ((st = fq_cuda_set_smem((const void *)fq_fwd_fused_kernel<K>, bytes)) != FQ_OK) return st;
    const int64_t blocks = p->N * p->HV * args.nvb;
    if (blocks <= 0) return FQ_OK;
    return fq_launch_k(fq_fwd_fused_kernel<K>, (unsigned)blocks, 384, bytes, stream, fq_cuda_pdl_enabled(), tq, tk, tv,
                       ta, args);
}

extern "C" fq_status fq_cuda_fwd_fused(const fq_gdn_params *p, const fq_fwd_ws *ws, cudaStream_t stream)
{
    if (p->K == 128) return fq_launch_fused<128>(p, ws, stream);
    if (p->K == 64) return fq_launch_fused<64>(p, ws, stream);
    return fq_cuda_head_dims_unsupported(p);
}
