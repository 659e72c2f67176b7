/*
 * gdn_cuda_bwd_fused_sm90.cu — the backward's two local kernels, bwd_local
 * (step 3 of gdn_cuda_bwd.cu) and bwd_wy (step 5), on sm_90a at K = V = 128:
 * the equations, epilogues, deterministic reduction slots and causality
 * selects of fq_bwd_local_kernel and fq_bwd_wy_kernel (gdn_cuda_bwd_fused.cu,
 * which keeps every other head size and the compute_80 PTX path), with each
 * product a warpgroup wgmma reading its operands from shared memory; bwd_local
 * without dv_local and dS_local, which the reverse pass on sm_90a forms on
 * chip (gdn_cuda_bwd_state_sm90.cu).
 *
 * Both: one block of two warpgroups (256 threads) per (chunk, q/k head),
 * looping over the GVA group's value heads with dQ or dK (64 x K fp32) in
 * wgmma accumulators; two blocks per SM (~100-110 KB of shared memory each,
 * 128 registers), so that the loads of one block's phases overlap the other's
 * products. Warpgroup u owns output columns [64u, 64u + 64) of every 64 x 128
 * product and [32u, 32u + 32) of every 64 x 64 one; warp w of it rows
 * [16w, 16w + 16). Accumulator element d[4 nb + e] is row 16 w + g + 8 (e / 2),
 * column (slice start) + 8 nb + 2 t + e % 2 (gdn_cuda_hopper.cuh).
 *
 * Shared memory: 64-row bf16 matrices as SWIZZLE_128B tiles of 64 columns
 * (tile i: columns 64 i ..), 128-row ones (h, dS') as tiles by row block
 * too; all loaded by cp.async into their swizzled places. One tile serves as
 * a K-major operand (rows = M or N) or an MN-major one (rows = the
 * reduction), so no transposed copies: only bwd_wy's dA is stored transposed
 * (dA^T [s'][s]) so that M1 = A^T dA has a K-major B whose 32-row half is a
 * plain row offset.
 */
#include "gdn_cuda_bwd.cuh"
#include "gdn_cuda_hopper.cuh"

#include <stdlib.h> /* getenv */
#include <string.h>

struct fq_wy90_smem {
    static constexpr int off_k = 0;                       /* K (rows scaled by rk) [s][kd], 2 tiles */
    static constexpr int off_vn = off_k + 2 * FQ_TILE;  /* Vn [r][v], then -dW [r][kd]           */
    static constexpr int off_dvn = off_vn + 2 * FQ_TILE; /* dVn = dU [r][v]                      */
    /* h = S and dS' [kd][v] by halves of v (2 tiles each: kd 0.., 64..), then V [s][v] */
    static constexpr int off_h = off_dvn + 2 * FQ_TILE;
    static constexpr int off_ds = off_h + 2 * FQ_TILE;
    static constexpr int off_v = off_h;
    static constexpr int off_a = off_ds + 2 * FQ_TILE;  /* A [r][s]                              */
    static constexpr int off_dat = off_a + FQ_TILE;     /* dA^T [s][r], then Gl [r][s]           */
    static constexpr int off_m1 = off_dat + FQ_TILE;    /* M1 [r][s]                             */
    static constexpr int off_gl = off_dat;
    static constexpr int off_vec = off_m1 + FQ_TILE;
    static constexpr int bytes = off_vec + 1040 * 4 + 1024; /* + alignment slack */
    static_assert(2 * (bytes + 1024) <= 228 * 1024, "two blocks per SM");
};

#if FQ_SM90A
/* rows x (64 NT) bf16, global row r at src + r * stride (16-byte aligned),
 * into NT-column-tile SWIZZLE_128B tiles at dst (row r of tile
 * NT (r / 64) + c / 64), rows >= len zero-filled; the caller commits and
 * waits. fq_finite_tiles / fq_scale_tiles visit the same 16-byte pieces per
 * thread. */
template <int NT>
static __device__ __forceinline__ void fq_async_tiles(unsigned char *dst, const fq_bf16 *src, int64_t stride, int rows,
                                                      int len)
{
    for (int idx = threadIdx.x; idx < rows * NT * 8; idx += blockDim.x) {
        const int r = idx / (NT * 8), c = idx % (NT * 8);
        const bool ok = r < len;
        fq_cp_async16(dst + (NT * (r >> 6) + (c >> 3)) * FQ_TILE + fq_sw128(r & 63, 16 * (c & 7)),
                      src + (ok ? r * stride + 8 * c : 0), ok ? 16 : 0);
    }
}
template <int NT> static __device__ __forceinline__ uint4 *fq_tile_piece(unsigned char *dst, int idx)
{
    const int r = idx / (NT * 8), c = idx % (NT * 8);
    return (uint4 *)(dst + (NT * (r >> 6) + (c >> 3)) * FQ_TILE + fq_sw128(r & 63, 16 * (c & 7)));
}
/* Causality (issue 9), as fq_finite_rows: the thread's own pieces' non-finite
 * elements to zero. */
template <int NT> static __device__ __forceinline__ void fq_finite_tiles(unsigned char *dst, int rows)
{
    for (int idx = threadIdx.x; idx < rows * NT * 8; idx += blockDim.x) fq_zero_nonfinite8(fq_tile_piece<NT>(dst, idx));
}
/* In place: row r of a 64-row tile set times rs[r] (the thread's own pieces). */
template <int NT> static __device__ __forceinline__ void fq_scale_tiles(unsigned char *dst, const float *rs)
{
    for (int idx = threadIdx.x; idx < 64 * NT * 8; idx += blockDim.x) {
        uint4 *pp = fq_tile_piece<NT>(dst, idx);
        const float f = rs[idx / (NT * 8)];
        uint4 x = *pp;
        uint32_t *xs = (uint32_t *)&x;
#pragma unroll
        for (int q = 0; q < 4; q++) {
            const float2 f2 = fq_unpack_bf16(xs[q]);
            xs[q] = fq_pack_bf16(f2.x * f, f2.y * f);
        }
        *pp = x;
    }
}

template <int TA, int TB>
static __device__ __forceinline__ void fq_wg_ss(float (&d)[32], uint64_t da, uint64_t db, int acc)
{
    fq_wgmma_ss_n64<TA, TB>(d, da, db, acc);
}
template <int TA, int TB>
static __device__ __forceinline__ void fq_wg_ss(float (&d)[16], uint64_t da, uint64_t db, int acc)
{
    fq_wgmma_ss_n32<TA, TB>(d, da, db, acc);
}

/* acc (+)= A B, both K-major, over KS K-steps of 16 (A's and B's column tiles consecutive) */
template <int KS, int NR>
static __device__ __forceinline__ void fq_mm_kk(float (&acc)[NR], const unsigned char *a, const unsigned char *b,
                                                int accumulate)
{
    const uint64_t da = fq_dkm(a), db = fq_dkm(b);
#pragma unroll
    for (int kk = 0; kk < KS; kk++) fq_wg_ss<0, 0>(acc, fq_desc_at(da, fq_koff(kk)), fq_desc_at(db, fq_koff(kk)), accumulate || kk > 0);
}
/* acc (+)= A B over 64 (one tile of reduction rows): TA / TB 1 = MN-major */
template <int TA, int TB, int NR>
static __device__ __forceinline__ void fq_mm_64(float (&acc)[NR], const unsigned char *a, const unsigned char *b,
                                                int accumulate)
{
    const uint64_t da = TA ? fq_dmn(a) : fq_dkm(a), db = TB ? fq_dmn(b) : fq_dkm(b);
#pragma unroll
    for (int kk = 0; kk < 4; kk++)
        fq_wg_ss<TA, TB>(acc, fq_desc_at(da, TA ? 2048 * kk : 32 * kk), fq_desc_at(db, TB ? 2048 * kk : 32 * kk),
                         accumulate || kk > 0);
}
template <int NR> static __device__ __forceinline__ void fq_wait_all(float (&x)[NR])
{
    fq_wgmma_commit();
    fq_wgmma_wait<0>();
    fq_reg_fence(x);
}
#endif

/* ============================================================ bwd_local ==== */

/* Forward line:  O = scale (diag(e^g) Q S + P Vn),  P = lower_incl(Q K^T ⊙ Gamma)
 *   dP       = scale (dO Vn^T) ⊙ Gamma (lower incl.);  Z = dP ⊙ Q K^T
 *   F        = diag(scale e^g) dO S^T
 *   dQ       = F + dP K                (summed over the GVA group in registers)
 *   dK_O     = dP^T Q                  (summed likewise -> a.dkp, group slot)
 *   dgamma   = rowsum(F ⊙ Q) + rowsum(Z) - colsum(Z)           (-> a.dgam)
 * then dq = r (dq_hat - q_hat (q_hat . dq_hat)) with use_qk_l2norm.
 * After bwd_rev90 (a.dkw given; gdn_cuda_bwd_reverse_sm90.cu) it finishes dk and dg
 * instead: dk_hat = dK_O + the sum of bwd_rev90's dK over the group's value heads
 * (bf16 partials), dk as dq; dg = reverse cumsum(dgamma + bwd_rev90's dgamma from
 * a.dgam) in the chunk; nothing in a.dkp.
 *
 *   product                 A (major)                       B (major)
 *   QK = Q K^T              Q [r][kd] (K)                   K [s][kd] (K)
 *   dV = dO Vn^T            dO [r][v] (K)                   Vn [s][v] (K)
 *   F = dO S^T              dO [r][v] (K)                   h [kd][v] (K)
 *   dQ += dP K              dP [r][s] (K)                   K [s][kd] (MN)
 *   dK_O = dP^T Q           dP [r][s] (MN)                  Q [r][kd] (MN)
 * The mma.sync kernel (gdn_cuda_bwd_fused.cu) also forms dv_local = scale P^T dO
 * and dS_local = Q^T diag(scale e^g) dO for bwd_state; beside this one the
 * reverse pass bwd_state90 (gdn_cuda_bwd_state_sm90.cu) forms them on chip. */
struct fq_local90_smem {
    static constexpr int off_q = 0;                        /* Q (rows scaled by rq) [r][kd] */
    static constexpr int off_k = off_q + 2 * FQ_TILE;   /* K (rows scaled by rk) [s][kd] */
    static constexpr int off_do = off_k + 2 * FQ_TILE;  /* dO [r][v]                     */
    static constexpr int off_vn = off_do + 2 * FQ_TILE; /* Vn [s][v], then dP [r][s]     */
    static constexpr int off_h = off_vn + 2 * FQ_TILE;  /* h = S [kd][v], 4 tiles        */
    static constexpr int off_vec = off_h + 4 * FQ_TILE;
    /* sg, sfo, srq, srk 64 each, srowp 128, sdgp 128, scz 256, srev 64 (floats) */
    static constexpr int vec_floats = 832;
    static constexpr int bytes = off_vec + vec_floats * 4 + 1024; /* + alignment slack */
    static_assert(2 * (bytes + 1024) <= 228 * 1024, "two blocks per SM");
};

__global__ void __launch_bounds__(256, 2) fq_bwd_local90_kernel(fq_bwd_args a)
{
#if FQ_SM90A
    constexpr int K = 128, V = 128;
    typedef fq_local90_smem SM;
    extern __shared__ __align__(16) unsigned char smem_raw[];
    unsigned char *smem = smem_raw + ((1024 - (fq_smem_u32(smem_raw) & 1023)) & 1023);
    unsigned char *sQ = smem + SM::off_q, *sK = smem + SM::off_k, *sdO = smem + SM::off_do;
    unsigned char *sVn = smem + SM::off_vn, *sdP = sVn + FQ_TILE, *sH = smem + SM::off_h;
    float *sg = (float *)(smem + SM::off_vec), *sfo = sg + 64, *srq = sg + 128, *srk = sg + 192;
    /* deterministic reductions as in fq_bwd_local_kernel: row-sum slots [u][row],
     * column-sum slots [w][column] */
    float *srowp = sg + 256, *sdgp = sg + 384, *scz = sg + 512, *srev = sg + 768; /* (.. 832: vec_floats) */

    const int c = blockIdx.x, hq = blockIdx.y, HV = a.HV, H = a.H, G = HV / H;
    const fq_chunk_info ci = a.chunks[c];
    if (ci.seq < 0) return;
    const int len = ci.len, tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int g = lane >> 2, t = lane & 3, u = warp >> 2, w = warp & 3;
    const int64_t qrow = (int64_t)ci.row0 * H + hq;

    if (tid < 64) {
        float rq = 1.f, rk = 1.f;
        if (a.rq && tid < len) {
            rq = a.rq[(int64_t)(ci.row0 + tid) * H + hq];
            rk = a.rk[(int64_t)(ci.row0 + tid) * H + hq];
        }
        srq[tid] = rq;
        srk[tid] = rk;
        srowp[tid] = srowp[64 + tid] = 0.f;
    }
    fq_async_tiles<2>(sQ, a.qb + qrow * K, (int64_t)H * K, 64, len);
    fq_async_tiles<2>(sK, a.kb + qrow * K, (int64_t)H * K, 64, len);

    /* dQ and dK_O (columns kd = 64 u + 8 nb + 2 t + e % 2) summed over the
     * group in wgmma accumulators; dK_O to a.dkp ([B*T, H, K]) at the end. After
     * bwd_rev90 (a.dkw) dK_O's accumulator starts from the reverse pass's dK of the
     * group's value heads (bf16 [B*T, HV, K], summed in the order of the heads), read
     * here so that the loads overlap the tiles' and the products:
     *   dk_hat = sum_j dK_rev[j] + sum_j dK_O[j] */
    float dQ[32], dKO[32];
#pragma unroll
    for (int i = 0; i < 32; i++) dQ[i] = dKO[i] = 0.f;
    if (a.dkw) {
#pragma unroll
        for (int h = 0; h < 2; h++) {
            const int r = 16 * w + g + 8 * h;
            if (r < len) {
                const fq_bf16 *pw = a.dkw + ((int64_t)(ci.row0 + r) * HV + hq * G) * K + 64 * u + 2 * t;
                for (int jj = 0; jj < G; jj++) {
#pragma unroll
                    for (int nb = 0; nb < 8; nb++) {
                        const float2 x = fq_unpack_bf16(*(const uint32_t *)(pw + (int64_t)jj * K + 8 * nb));
                        dKO[4 * nb + 2 * h] += x.x;
                        dKO[4 * nb + 2 * h + 1] += x.y;
                    }
                }
            }
        }
    }

    for (int jj = 0; jj < G; jj++) {
        const int j = hq * G + jj;
        const int64_t tile = (int64_t)c * HV + j;
        if (jj > 0) __syncthreads(); /* the previous head is done with dO, Vn/P/dP, h, the vectors */
        if (tid < 64) {
            const float gm = a.gamma[tile * 64 + tid];
            sg[tid] = gm;
            sfo[tid] = a.scale * __expf(gm);
            sdgp[tid] = sdgp[64 + tid] = 0.f;
            if (a.dkw) srev[tid] = a.dgam[tile * 64 + tid]; /* bwd_rev90's dgamma */
        }
        fq_async_tiles<2>(sVn, a.vn + tile * 64 * V, V, 64, 64);
        if (a.dout_async) {
            fq_async_tiles<2>(sdO, (const fq_bf16 *)a.dout + ((int64_t)ci.row0 * HV + j) * V, (int64_t)HV * V, 64, len);
        } else {
            for (int idx = tid; idx < 64 * V / 2; idx += blockDim.x) {
                const int r = idx / (V / 2), col = (idx % (V / 2)) * 2;
                float x = 0.f, y = 0.f;
                if (r < len) {
                    const int64_t o = ((int64_t)(ci.row0 + r) * HV + j) * V + col;
                    x = fq_ld_f(a.dout, a.dt, o);
                    y = fq_ld_f(a.dout, a.dt, o + 1);
                }
                *fq_tile_pair(sdO + (col >> 6) * FQ_TILE, r, col & 63) = fq_pack_bf16(x, y);
            }
        }
        fq_cp_async_commit();
        /* h is first needed by dO S^T: its load overlaps the products before */
        fq_async_tiles<2>(sH, a.h + tile * K * V, V, K, K);
        fq_cp_async_commit();
        fq_cp_async_wait<1>();
        /* causality (issue 9): K's non-finite elements to zero, so that dQ's
         * dP K never multiplies a structural zero of dP by a NaN of a later
         * token (after the scaling with use_qk_l2norm, whose rk of a NaN row is NaN) */
        if (jj == 0 && !a.rq) fq_finite_tiles<2>(sK, 64);
        __syncthreads();
        if (jj == 0 && a.rq) {
            fq_scale_tiles<2>(sQ, srq);
            fq_scale_tiles<2>(sK, srk);
            fq_finite_tiles<2>(sK, 64);
        }
        fq_fence_async_smem();
        __syncthreads();

        /* Q K^T and dO Vn^T (columns s = 32 u ..); P, dP, Z in registers */
        uint32_t dpp[4][2];
        {
            float qk[16], dv[16];
            fq_wgmma_fence();
            fq_mm_kk<8>(qk, sQ, sK + 4096 * u, 0);
            fq_mm_kk<8>(dv, sdO, sVn + 4096 * u, 0);
            fq_wgmma_commit();
            fq_wgmma_wait<0>();
            fq_reg_fence(qk);
            fq_reg_fence(dv);
            float rz[2] = {0.f, 0.f}, cz[4][2];
#pragma unroll
            for (int nb = 0; nb < 4; nb++) {
                cz[nb][0] = cz[nb][1] = 0.f;
#pragma unroll
                for (int h = 0; h < 2; h++) {
                    const int r = 16 * w + g + 8 * h;
                    float dpv[2];
#pragma unroll
                    for (int e2 = 0; e2 < 2; e2++) {
                        const int s = 32 * u + 8 * nb + 2 * t + e2;
                        /* lower_incl by selects (causality: never 0 * a non-finite value) */
                        const float Gm = __expf(sg[r] - sg[s]);
                        const float x = qk[4 * nb + 2 * h + e2];
                        dpv[e2] = r >= s ? a.scale * dv[4 * nb + 2 * h + e2] * Gm : 0.f;
                        const float z = r >= s ? dpv[e2] * x : 0.f;
                        rz[h] += z;
                        cz[nb][e2] += z;
                    }
                    dpp[nb][h] = fq_pack_bf16(dpv[0], dpv[1]);
                }
            }
#pragma unroll
            for (int h = 0; h < 2; h++) {
                const float z = fq_quad_sum(rz[h]);
                if (t == 0) sdgp[64 * u + 16 * w + g + 8 * h] = z;
            }
#pragma unroll
            for (int nb = 0; nb < 4; nb++)
#pragma unroll
                for (int e2 = 0; e2 < 2; e2++) {
                    float z = cz[nb][e2];
                    z += __shfl_xor_sync(0xffffffffu, z, 4);
                    z += __shfl_xor_sync(0xffffffffu, z, 8);
                    z += __shfl_xor_sync(0xffffffffu, z, 16);
                    if (g == 0) scz[64 * w + 32 * u + 8 * nb + 2 * t + e2] = z;
                }
        }
        __syncthreads(); /* every warpgroup done with Vn */
#pragma unroll
        for (int nb = 0; nb < 4; nb++) {
            const int s = 32 * u + 8 * nb + 2 * t, r = 16 * w + g;
            *fq_tile_pair(sdP, r, s) = dpp[nb][0];
            *fq_tile_pair(sdP, r + 8, s) = dpp[nb][1];
        }
        fq_cp_async_wait<0>();
        fq_fence_async_smem();
        __syncthreads();

        /* F = diag(scale e^g) dO S^T:  dgamma += rowsum(F ⊙ Q);  dQ += F + dP K;  dK_O += dP^T Q */
        {
            float acc[32];
            fq_wgmma_fence();
            fq_mm_kk<8>(acc, sdO, sH + 2 * u * FQ_TILE, 0);
            fq_wait_all(acc);
            float xr[2] = {0.f, 0.f};
#pragma unroll
            for (int nb = 0; nb < 8; nb++)
#pragma unroll
                for (int h = 0; h < 2; h++) {
                    const int r = 16 * w + g + 8 * h, cl = 8 * nb + 2 * t;
                    const float2 qv = fq_unpack_bf16(*fq_tile_pair(sQ + u * FQ_TILE, r, cl));
                    const float f0 = sfo[r] * acc[4 * nb + 2 * h], f1 = sfo[r] * acc[4 * nb + 2 * h + 1];
                    xr[h] += f0 * qv.x + f1 * qv.y;
                    dQ[4 * nb + 2 * h] += f0;
                    dQ[4 * nb + 2 * h + 1] += f1;
                }
#pragma unroll
            for (int h = 0; h < 2; h++) {
                const float x = fq_quad_sum(xr[h]);
                if (t == 0) sdgp[64 * u + 16 * w + g + 8 * h] += x;
            }
            fq_wgmma_fence();
            fq_mm_64<0, 1>(dQ, sdP, sK + u * FQ_TILE, 1);
            fq_mm_64<1, 1>(dKO, sdP, sQ + u * FQ_TILE, 1);
            fq_wgmma_commit();
            fq_wgmma_wait<0>();
            fq_reg_fence(dQ);
            fq_reg_fence(dKO);
        }
        __syncthreads(); /* dgamma complete */
        if (!a.dkw) {
            if (tid < 64)
                a.dgam[tile * 64 + tid] =
                    sdgp[tid] + sdgp[64 + tid] - (scz[tid] + scz[64 + tid] + scz[128 + tid] + scz[192 + tid]);
        } else if (warp == 0) {
            /* after bwd_rev90 (a.dgam: its dgamma): dg = reverse cumsum(both) in the chunk */
            float x[2];
#pragma unroll
            for (int e = 0; e < 2; e++) {
                const int r = 2 * lane + e;
                x[e] = srev[r] + sdgp[r] + sdgp[64 + r] -
                       (scz[r] + scz[64 + r] + scz[128 + r] + scz[192 + r]);
            }
            fq_bwd_dg_store(a, x[0], x[1], len, ci.row0, j, lane);
        }
    }

    if (!a.dkw) {
        float *dko = a.dkp + ((int64_t)ci.row0 * H + hq) * K;
#pragma unroll
        for (int nb = 0; nb < 8; nb++)
#pragma unroll
            for (int h = 0; h < 2; h++) {
                const int r = 16 * w + g + 8 * h, col = 64 * u + 8 * nb + 2 * t;
                if (r < len)
                    *(float2 *)(dko + (int64_t)r * H * K + col) = make_float2(dKO[4 * nb + 2 * h], dKO[4 * nb + 2 * h + 1]);
            }
    }
    /* dq = dq_hat, or its L2-norm backward */
    fq_bwd_dx_store<8, false>(a, a.q, a.dq, dQ, (const float *)NULL, a.rq ? srq : (const float *)NULL, srowp, u, 16 * w + g,
                              [&](int nb) { return 64 * u + 8 * nb + 2 * t; }, len, qrow, K);
    if (a.dkw) {
        /* dk as dq (k^ = rk k: dk = rk (dk^ - k^ (k^ . dk^))) */
        __syncthreads(); /* (every thread's read of srowp by dq's store done) */
        fq_bwd_dx_store<8, false>(a, a.k, a.dk, dKO, (const float *)NULL, a.rq ? srk : (const float *)NULL, srowp, u,
                                  16 * w + g, [&](int nb) { return 64 * u + 8 * nb + 2 * t; }, len, qrow, K);
    }
#endif
}

/* ================================================================ bwd_wy ==== */

/* Forward lines differentiated (per chunk, value head; DESIGN §2):
 *   S' = e^{g_C} S + K^T diag(e^{g_C - g}) Vn   -> dK += diag(m) Vn dS'^T,
 *        dgamma_r -= m_r x_r, dgamma_C += sum_r m_r x_r + e^{g_C} <S, dS'>
 *   Vn = U - W S                                -> dW = -dVn S^T, dU = dVn
 *   W  = A diag(b e^g) K                        -> dK += diag(b e^g) A^T dW, ...
 *   U  = A diag(b) V                            -> dV = diag(b) A^T dU, ...
 *   A  = (I + L)^-1                             -> dL = -strict_lower(A^T dA A^T)
 *   L  = strict_lower(diag(b)(K K^T ⊙ Gamma))   -> db, dK += (G + G^T) K, dgamma
 *   gamma = cumsum(g)                           -> dg = reverse cumsum(dgamma)
 * h and dS' by halves of v (F1 and dW accumulate over the two), each half
 * two tiles (row block); V then in their place, Gl in dA^T's.
 *
 *   product                 A (major)              B (major)
 *   F1 = Vn dS'^T           Vn [r][v] (K)          dS' [kd][v] (K)
 *   dW = dVn S^T (negated)  dVn [r][v] (K)         h [kd][v] (K)
 *   F2 = A^T dW             A [s][r] (MN)          dW [s][kd] (MN)
 *   F3 = A^T dU             A [s][r] (MN)          dVn [s][v] (MN)
 *   d1 = dW K^T             dW [r][kd] (K)         K [s][kd] (K)
 *   d2 = dVn V^T            dVn [r][v] (K)         V [s][v] (K)
 *   M1 = A^T dA             A [s][r] (MN)          dA^T [s'][s] (K)
 *   M2 = M1 A^T             M1 [r][s] (K)          A [s'][s] (K)
 *   KK = K K^T              K [r][kd] (K)          K [s][kd] (K)
 *   dK += Gl K + Gl^T K     Gl [r][s] (K), (MN)    K [s][kd] (MN)   */

__global__ void __launch_bounds__(256, 2) fq_bwd_wy90_kernel(fq_bwd_args a)
{
#if FQ_SM90A
    constexpr int K = 128, V = 128;
    typedef fq_wy90_smem SM;
    extern __shared__ __align__(16) unsigned char smem_raw[];
    unsigned char *smem = smem_raw + ((1024 - (fq_smem_u32(smem_raw) & 1023)) & 1023);
    unsigned char *sK = smem + SM::off_k, *sVn = smem + SM::off_vn, *sdVn = smem + SM::off_dvn;
    unsigned char *sH = smem + SM::off_h, *sdS = smem + SM::off_ds, *sV = smem + SM::off_v;
    unsigned char *sA = smem + SM::off_a, *sdAt = smem + SM::off_dat, *sM1 = smem + SM::off_m1;
    unsigned char *sGl = smem + SM::off_gl;
    float *sg = (float *)(smem + SM::off_vec), *seg = sg + 64, *sb = sg + 128, *sm = sg + 192;
    float *sdg = sg + 256, *srk = sg + 320;
    /* Deterministic reductions, as fq_bwd_wy_kernel: row sums slot [u][row]
     * (the two warpgroups' column halves), column sums slot [w][column] (the
     * four row quarters), block sums slot [warp]. */
    float *srowp = sg + 384, *sdgp = sg + 512, *sdbp = sg + 640, *scz = sg + 768, *sred = sg + 1024;

    const int HV = a.HV, H = a.H, G = HV / H;
    /* beside bwd_state90 (a.bready): block (hq, y), its chunk from the order in which
     * the chains finish theirs (fq_bwd_wy_order); else block (c, hq). Beside, one block
     * waits for the whole of bwd_state90 (fq_pdl_wait) before it exits, so that this
     * grid never completes before it: the last one (fq_bwd_wy_last) */
    int c, hq;
    if (a.bready) {
        hq = blockIdx.x;
        c = fq_bwd_wy_order(a, blockIdx.y);
    } else {
        c = blockIdx.x, hq = blockIdx.y;
    }
    const fq_chunk_info ci = a.chunks[c < 0 ? 0 : c];
    if (c < 0 || ci.seq < 0) {
        if (fq_bwd_wy_last(a)) fq_pdl_wait();
        return;
    }
    const int len = ci.len, tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int g = lane >> 2, t = lane & 3, u = warp >> 2, w = warp & 3;
    const int64_t qrow = (int64_t)ci.row0 * H + hq;

    if (tid < 64) {
        srk[tid] = (a.rk && tid < len) ? a.rk[(int64_t)(ci.row0 + tid) * H + hq] : 1.f;
        srowp[tid] = srowp[64 + tid] = 0.f;
    }
    fq_async_tiles<2>(sK, a.kb + qrow * K, (int64_t)H * K, 64, len);

    float dK[32]; /* columns kd = 64 u + 8 nb + 2 t + e % 2 */
#pragma unroll
    for (int i = 0; i < 32; i++) dK[i] = 0.f;

    for (int jj = 0; jj < G; jj++) {
        const int j = hq * G + jj;
        const int64_t tile = (int64_t)c * HV + j;
        /* beside bwd_state90: dS_next and dVn of (c, j), both column blocks, stored */
        if (a.bready && tid == 0) fq_bwd_wy_wait(a.bready + 2 * tile);
        if (jj > 0 || a.bready) __syncthreads(); /* the previous head is done with every buffer */
        if (tid < 64) {
            const float gm = a.gamma[tile * 64 + tid], gC = a.gamma[tile * 64 + 63];
            const bool ok = tid < len;
            sg[tid] = gm;
            seg[tid] = ok ? __expf(gm) : 0.f;
            sm[tid] = ok ? __expf(gC - gm) : 0.f;
            sb[tid] = ok ? fq_ld_f(a.beta, a.gdt, (int64_t)(ci.row0 + tid) * HV + j) : 0.f;
            sdg[tid] = a.dgam[tile * 64 + tid];
            sdgp[tid] = sdgp[64 + tid] = sdbp[tid] = sdbp[64 + tid] = 0.f;
            scz[tid] = scz[64 + tid] = scz[128 + tid] = scz[192 + tid] = 0.f;
        }
        const float gC_all = a.gamma[tile * 64 + 63]; /* every thread: causality, below */
        fq_async_tiles<2>(sVn, a.vn + tile * 64 * V, V, 64, 64);
        fq_async_tiles<2>(sdVn, a.dvl + tile * 64 * V, V, 64, 64);
        fq_async_tiles<1>(sA, a.a + tile * 64 * 64, 64, 64, 64);
        fq_async_tiles<1>(sH, a.h + tile * K * V, V, K, K);
        fq_async_tiles<1>(sdS, a.dsl + tile * K * V, V, K, K);
        fq_cp_async_commit();
        fq_cp_async_wait<0>();
        /* causality (issue 9), as fq_bwd_wy_kernel: dVn's non-finite elements
         * to zero unless gamma_C is not finite (then dv stays NaN) */
        if (isfinite(gC_all)) fq_finite_tiles<2>(sdVn, 64);
        __syncthreads(); /* srk and the vectors */
        if (jj == 0 && a.rk) fq_scale_tiles<2>(sK, srk);
        if (len < 64) { /* A's padding rows/columns -> identity */
            for (int idx = tid; idx < 64 * 64; idx += blockDim.x) {
                const int r = idx >> 6, s = idx & 63;
                if (r >= len || s >= len)
                    *(fq_bf16 *)(sA + fq_sw128(r, 2 * s)) = __float2bfloat16_rn(r == s ? 1.f : 0.f);
            }
        }
        fq_fence_async_smem();
        __syncthreads();

        /* ---- F1 = Vn dS'^T:  dK += diag(m) F1,  x = rowsum(F1 ⊙ K);
         *      dW = -dVn S^T;  <S, dS'> */
        float F1[32], dW[32], sdot = 0.f;
        for (int vh = 0; vh < 2; vh++) { /* the halves of v, the reduction */
            if (vh) {
                __syncthreads(); /* every warpgroup's reads of the first halves done */
                fq_async_tiles<1>(sH, a.h + tile * K * V + 64, V, K, K);
                fq_async_tiles<1>(sdS, a.dsl + tile * K * V + 64, V, K, K);
                fq_cp_async_commit();
                fq_cp_async_wait<0>();
                fq_fence_async_smem();
                __syncthreads();
            }
            fq_wgmma_fence();
            {
                const uint64_t dvn = fq_dkm(sVn + vh * FQ_TILE), ddvn = fq_dkm(sdVn + vh * FQ_TILE);
                const uint64_t dds = fq_dkm(sdS + u * FQ_TILE), dh = fq_dkm(sH + u * FQ_TILE);
#pragma unroll
                for (int kk = 0; kk < 4; kk++) fq_wg_ss<0, 0>(F1, fq_desc_at(dvn, 32 * kk), fq_desc_at(dds, 32 * kk), vh || kk);
#pragma unroll
                for (int kk = 0; kk < 4; kk++) fq_wg_ss<0, 0>(dW, fq_desc_at(ddvn, 32 * kk), fq_desc_at(dh, 32 * kk), vh || kk);
            }
            fq_wgmma_commit();
#pragma unroll 1
            for (int idx = tid; idx < K * 64 / 8; idx += blockDim.x) {
                const uint4 hv = ((const uint4 *)sH)[idx], dv = ((const uint4 *)sdS)[idx];
                const uint32_t *hs = (const uint32_t *)&hv, *ds = (const uint32_t *)&dv;
#pragma unroll
                for (int q = 0; q < 4; q++) {
                    const float2 x = fq_unpack_bf16(hs[q]), y = fq_unpack_bf16(ds[q]);
                    sdot += x.x * y.x + x.y * y.y;
                }
            }
            fq_wgmma_wait<0>();
            fq_reg_fence(F1);
            fq_reg_fence(dW);
        }
        float xr[2] = {0.f, 0.f};
#pragma unroll
        for (int nb = 0; nb < 8; nb++)
#pragma unroll
            for (int h = 0; h < 2; h++) {
                const int r = 16 * w + g + 8 * h, cl = 8 * nb + 2 * t;
                const float2 kv = fq_unpack_bf16(*fq_tile_pair(sK + u * FQ_TILE, r, cl));
                const float f0 = F1[4 * nb + 2 * h], f1 = F1[4 * nb + 2 * h + 1];
                dK[4 * nb + 2 * h] += sm[r] * f0;
                dK[4 * nb + 2 * h + 1] += sm[r] * f1;
                xr[h] += f0 * kv.x + f1 * kv.y;
            }
        {
            const float x0 = fq_quad_sum(xr[0]), x1 = fq_quad_sum(xr[1]);
            float mx = 0.f;
            if (t == 0) {
                const int r0 = 16 * w + g;
                sdgp[64 * u + r0] -= sm[r0] * x0;
                sdgp[64 * u + r0 + 8] -= sm[r0 + 8] * x1;
                mx = sm[r0] * x0 + sm[r0 + 8] * x1;
            }
            for (int o = 16; o > 0; o >>= 1) {
                mx += __shfl_xor_sync(0xffffffffu, mx, o);
                sdot += __shfl_xor_sync(0xffffffffu, sdot, o);
            }
            if (lane == 0) {
                sred[warp] = sdot;
                sred[8 + warp] = mx;
            }
        }
        __syncthreads(); /* every warpgroup's reads of Vn, h, dS' done */
        /* V rows into the (h, dS') place; its non-finite elements to zero (causality, as fq_bwd_wy_kernel) */
        fq_async_tiles<2>(sV, a.vb + ((int64_t)ci.row0 * HV + j) * V, (int64_t)HV * V, 64, len);
        fq_cp_async_commit();
        /* -dW (bf16) over Vn: [r][kd], warpgroup u's columns in tile u */
#pragma unroll
        for (int nb = 0; nb < 8; nb++) {
            const int r = 16 * w + g, cl = 8 * nb + 2 * t;
            *fq_tile_pair(sVn + u * FQ_TILE, r, cl) = fq_pack_bf16(-dW[4 * nb], -dW[4 * nb + 1]);
            *fq_tile_pair(sVn + u * FQ_TILE, r + 8, cl) = fq_pack_bf16(-dW[4 * nb + 2], -dW[4 * nb + 3]);
        }
        fq_cp_async_wait<0>();
        fq_finite_tiles<2>(sV, 64);
        fq_fence_async_smem();
        __syncthreads();

        /* F2 = A^T dW:  dK += diag(b e^g) F2;  xw = rowsum(F2 ⊙ K): db += e^g xw, dgamma += b e^g xw
         * F3 = A^T dU:  dv = diag(b) F3;  db += rowsum(F3 ⊙ V) */
        {
            float F2[32], F3[32];
            fq_wgmma_fence();
            fq_mm_64<1, 1>(F2, sA, sVn + u * FQ_TILE, 0);
            fq_mm_64<1, 1>(F3, sA, sdVn + u * FQ_TILE, 0);
            fq_wgmma_commit();
            fq_wgmma_wait<0>();
            fq_reg_fence(F2);
            fq_reg_fence(F3);
            float xw[2] = {0.f, 0.f}, xv[2] = {0.f, 0.f};
#pragma unroll
            for (int nb = 0; nb < 8; nb++)
#pragma unroll
                for (int h = 0; h < 2; h++) {
                    const int r = 16 * w + g + 8 * h, cl = 8 * nb + 2 * t, col = 64 * u + cl;
                    const float2 kv = fq_unpack_bf16(*fq_tile_pair(sK + u * FQ_TILE, r, cl));
                    const float2 vv = fq_unpack_bf16(*fq_tile_pair(sV + u * FQ_TILE, r, cl));
                    const float f0 = F2[4 * nb + 2 * h], f1 = F2[4 * nb + 2 * h + 1];
                    dK[4 * nb + 2 * h] += sb[r] * seg[r] * f0;
                    dK[4 * nb + 2 * h + 1] += sb[r] * seg[r] * f1;
                    xw[h] += f0 * kv.x + f1 * kv.y;
                    const float x0 = F3[4 * nb + 2 * h], x1 = F3[4 * nb + 2 * h + 1];
                    if (r < len)
                        fq_st_f2(a.dv, a.dt, ((int64_t)(ci.row0 + r) * HV + j) * V + col, sb[r] * x0, sb[r] * x1);
                    xv[h] += x0 * vv.x + x1 * vv.y;
                }
            const float w0 = fq_quad_sum(xw[0]), w1 = fq_quad_sum(xw[1]);
            const float v0 = fq_quad_sum(xv[0]), v1 = fq_quad_sum(xv[1]);
            if (t == 0) {
                const int r0 = 16 * w + g, r1 = r0 + 8;
                sdbp[64 * u + r0] += seg[r0] * w0;
                sdbp[64 * u + r1] += seg[r1] * w1;
                sdgp[64 * u + r0] += sb[r0] * seg[r0] * w0;
                sdgp[64 * u + r1] += sb[r1] * seg[r1] * w1;
                sdbp[64 * u + r0] += v0;
                sdbp[64 * u + r1] += v1;
            }
        }
        /* dA = dW K^T diag(b e^g) + dVn V^T diag(b) -> dA^T (bf16), its
         * non-finite entries to zero (causality, issue 9, as fq_bwd_wy_kernel) */
        {
            float d1[16], d2[16];
            fq_wgmma_fence();
            fq_mm_kk<8>(d1, sVn, sK + 4096 * u, 0);
            fq_mm_kk<8>(d2, sdVn, sV + 4096 * u, 0);
            fq_wgmma_commit();
            fq_wgmma_wait<0>();
            fq_reg_fence(d1);
            fq_reg_fence(d2);
#pragma unroll
            for (int nb = 0; nb < 4; nb++)
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    const int r = 16 * w + g + 8 * (e >> 1), s = 32 * u + 8 * nb + 2 * t + (e & 1);
                    const float y = d1[4 * nb + e] * (sb[s] * seg[s]) + d2[4 * nb + e] * sb[s];
                    *(fq_bf16 *)(sdAt + fq_sw128(s, 2 * r)) = __float2bfloat16_rn(isfinite(y) ? y : 0.f);
                }
        }
        fq_fence_async_smem();
        __syncthreads();

        /* M1 = A^T dA -> sM1 [r][s] */
        {
            float m1[16];
            fq_wgmma_fence();
            fq_mm_64<1, 0>(m1, sA, sdAt + 4096 * u, 0);
            fq_wait_all(m1);
#pragma unroll
            for (int nb = 0; nb < 4; nb++) {
                const int r = 16 * w + g, s = 32 * u + 8 * nb + 2 * t;
                *fq_tile_pair(sM1, r, s) = fq_pack_bf16(m1[4 * nb], m1[4 * nb + 1]);
                *fq_tile_pair(sM1, r + 8, s) = fq_pack_bf16(m1[4 * nb + 2], m1[4 * nb + 3]);
            }
        }
        fq_fence_async_smem();
        __syncthreads();

        /* M2 = M1 A^T, dL = -strict_lower(M2); with KK = K K^T and Gamma:
         *   y = dL ⊙ KK ⊙ Gamma: db += rowsum(y);  z = diag(b) y: dgamma += rowsum(z) - colsum(z)
         *   Gl = diag(b) dL ⊙ Gamma (strict lower) -> sGl, for dK += (Gl + Gl^T) K */
        {
            float m2[16], kk[16];
            fq_wgmma_fence();
            fq_mm_64<0, 0>(m2, sM1, sA + 4096 * u, 0);
            fq_mm_kk<8>(kk, sK, sK + 4096 * u, 0);
            fq_wgmma_commit();
            fq_wgmma_wait<0>();
            fq_reg_fence(m2);
            fq_reg_fence(kk);
            float ry[2] = {0.f, 0.f}, rz[2] = {0.f, 0.f}, cz[4][2];
#pragma unroll
            for (int nb = 0; nb < 4; nb++) {
                cz[nb][0] = cz[nb][1] = 0.f;
#pragma unroll
                for (int h = 0; h < 2; h++) {
                    const int r = 16 * w + g + 8 * h;
                    float gv[2];
#pragma unroll
                    for (int e2 = 0; e2 < 2; e2++) {
                        const int s = 32 * u + 8 * nb + 2 * t + e2;
                        gv[e2] = 0.f;
                        if (r > s) {
                            const float Gm = __expf(sg[r] - sg[s]);
                            const float dL = -m2[4 * nb + 2 * h + e2];
                            const float y = dL * kk[4 * nb + 2 * h + e2] * Gm;
                            const float z = sb[r] * y;
                            ry[h] += y;
                            rz[h] += z;
                            cz[nb][e2] += z;
                            gv[e2] = sb[r] * dL * Gm;
                        }
                    }
                    *fq_tile_pair(sGl, r, 32 * u + 8 * nb + 2 * t) = fq_pack_bf16(gv[0], gv[1]);
                }
            }
#pragma unroll
            for (int h = 0; h < 2; h++) {
                const float y = fq_quad_sum(ry[h]), z = fq_quad_sum(rz[h]);
                if (t == 0) {
                    sdbp[64 * u + 16 * w + g + 8 * h] += y;
                    sdgp[64 * u + 16 * w + g + 8 * h] += z;
                }
            }
#pragma unroll
            for (int nb = 0; nb < 4; nb++)
#pragma unroll
                for (int e2 = 0; e2 < 2; e2++) {
                    float z = cz[nb][e2];
                    z += __shfl_xor_sync(0xffffffffu, z, 4);
                    z += __shfl_xor_sync(0xffffffffu, z, 8);
                    z += __shfl_xor_sync(0xffffffffu, z, 16);
                    if (g == 0) scz[64 * w + 32 * u + 8 * nb + 2 * t + e2] = z;
                }
        }
        fq_fence_async_smem();
        __syncthreads(); /* Gl complete; dgamma, db of this head complete */

        /* dK += Gl K + Gl^T K */
        fq_wgmma_fence();
        fq_mm_64<0, 1>(dK, sGl, sK + u * FQ_TILE, 1);
        fq_mm_64<1, 1>(dK, sGl, sK + u * FQ_TILE, 1);
        fq_wgmma_commit();

        /* dg = reverse cumsum of dgamma; dbeta (warp 0: two rows per lane) */
        if (warp == 0) fq_bwd_dg_dbeta(a, sdg, sdgp, scz, sdbp, sred, sg[63], len, ci.row0, j, lane);
        fq_wgmma_wait<0>();
        fq_reg_fence(dK);
    }

    /* dk_hat = sum over the group of (this stage's dK + bwd_local's dK_O);
     * then the L2-norm backward, and dk in the input dtype. */
    fq_bwd_dx_store<8, true>(a, a.k, a.dk, dK, a.dkp + ((int64_t)ci.row0 * H + hq) * K, a.rk ? srk : (const float *)NULL,
                             srowp, u, 16 * w + g, [&](int nb) { return 64 * u + 8 * nb + 2 * t; }, len, qrow, K);
    if (fq_bwd_wy_last(a)) fq_pdl_wait();
#endif
}

/* 1 where this device runs the sm_90a kernels (compute capability 9 and the
 * sm_90a code loaded, not the PTX fallback); FLASHQLA_CUDA_BWD_SM90=0 (read
 * once) turns them off, for timing and testing the mma.sync kernels on Hopper. */
static int fq_bwd_sm90_available(void)
{
    static int env = -1;
    static signed char per_dev[64]; /* 0 unknown, 1 yes, 2 no */
    if (env < 0) {
        const char *e = getenv("FLASHQLA_CUDA_BWD_SM90");
        env = !(e && strcmp(e, "0") == 0);
    }
    if (!env) return 0;
    int dev = 0;
    if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= 64) return 0;
    if (per_dev[dev] == 0) {
        int major = 0;
        cudaFuncAttributes fa, fb;
        const int ok = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) == cudaSuccess &&
                       major == 9 && cudaFuncGetAttributes(&fa, (const void *)fq_bwd_wy90_kernel) == cudaSuccess &&
                       fa.ptxVersion >= 90 &&
                       cudaFuncGetAttributes(&fb, (const void *)fq_bwd_local90_kernel) == cudaSuccess &&
                       fb.ptxVersion >= 90;
        if (!ok) cudaGetLastError();
        per_dev[dev] = ok ? 1 : 2;
    }
    return per_dev[dev] == 1;
}

/* one block per (chunk, q/k head), two per SM (the largest shared-memory carveout, a hint) */
static fq_status fq_bwd_sm90_launch(const void *fn, int bytes, const fq_bwd_args &a, int64_t nc, int H,
                                    cudaStream_t stream)
{
    fq_status st = fq_cuda_set_smem(fn, bytes);
    if (st != FQ_OK) return st;
    if ((st = fq_cuda_func_attr(fn, cudaFuncAttributePreferredSharedMemoryCarveout, 100)) != FQ_OK) return st;
    void *args[] = {(void *)&a};
    FQ_CUDA_CHECK(cudaLaunchKernel(fn, dim3((unsigned)nc, (unsigned)H), dim3(256), args, (size_t)bytes, stream));
    return FQ_OK;
}

int fq_bwd_sm90_path(const fq_gdn_params *p)
{
    return p->K == 128 && p->V == 128 && fq_bwd_sm90_available();
}

fq_status fq_bwd_local90_launch(const fq_gdn_params *p, const fq_bwd_args &a, int64_t nc, cudaStream_t stream,
                                int *done)
{
    *done = 0;
    if (!fq_bwd_sm90_path(p)) return FQ_OK;
    fq_status st = fq_bwd_sm90_launch((const void *)fq_bwd_local90_kernel, fq_local90_smem::bytes, a, nc, (int)p->H,
                                      stream);
    *done = st == FQ_OK;
    return st;
}

fq_status fq_bwd_wy90_launch(const fq_gdn_params *p, const fq_bwd_args &a, int64_t nc, cudaStream_t stream, int *done)
{
    *done = 0;
    if (!fq_bwd_sm90_path(p)) return FQ_OK;
    fq_status st;
    if (a.bready) {
        /* beside bwd_state90: programmatic serialization, blocks (q/k head, order) */
        const void *fn = (const void *)fq_bwd_wy90_kernel;
        if ((st = fq_cuda_set_smem(fn, fq_wy90_smem::bytes)) != FQ_OK) return st;
        if ((st = fq_cuda_func_attr(fn, cudaFuncAttributePreferredSharedMemoryCarveout, 100)) != FQ_OK) return st;
        const int64_t rows = a.bseqch > 0 ? (int64_t)a.bnseq * a.bnseg * a.bsegch : nc;
        st = fq_launch_k(fq_bwd_wy90_kernel, dim3((unsigned)p->H, (unsigned)rows), 256, fq_wy90_smem::bytes, stream, 1, a);
    } else {
        st = fq_bwd_sm90_launch((const void *)fq_bwd_wy90_kernel, fq_wy90_smem::bytes, a, nc, (int)p->H, stream);
    }
    *done = st == FQ_OK;
    return st;
}
