/*
 * gdn_cuda_bwd.cu — the CUDA chunked backward (DESIGN §2, C = 64), the entry
 * points fq_cuda_chunk_bwd and fq_cuda_chunk_bwd_workspace_bytes of gdn.h.
 *
 * Everything is recomputed from the inputs. In algorithm order:
 *
 *   0. fq_cuda_fwd_prepare   chunk table, bf16 q/k/v, inverse norms rq, rk
 *   1. fq_cuda_fwd_wy        gamma, A = (I+L)^-1 (kept for step 5), W, U
 *   2. fq_cuda_fwd_state     chunk-start states h (bf16) and Vn = U - W h
 *      (1, 2 are the forward's stage launchers, gdn_cuda_common.cuh)
 *   3. bwd_local   per (chunk, value head), chunk-parallel. Forward lines:
 *          O  = scale (diag(e^g) Q S + P Vn),   P = lower_incl(Q K^T ⊙ Gamma)
 *        so  dv_local = scale P^T dO
 *            dP       = scale (dO Vn^T) ⊙ Gamma            (lower incl.)
 *            dQ       = scale diag(e^g) dO S^T + dP K
 *            dK_O     = dP^T Q
 *            dgamma   = rowsum(scale diag(e^g) dO S^T ⊙ Q) + rowsum(Z) - colsum(Z),
 *                       Z = dP ⊙ (Q K^T)
 *            dS_local = scale (diag(e^g) Q)^T dO          (K x V, for step 4)
 *   4. bwd_state   per (sequence, value head, 32 state columns), sequential
 *      over chunks from last to first, dS (fp32, shared memory) from dht:
 *          forward:  Vn = U - W S;  S' = e^{g_C} S + K^T diag(e^{g_C - g}) Vn
 *          dS_next[c] = dS   (stored bf16)
 *          dVn      = dv_local + diag(e^{g_C - g}) K dS                (stored bf16)
 *          dS       = e^{g_C} dS + dS_local - W^T dVn
 *      ending in dh0.
 *   5. bwd_wy      per (chunk, value head), chunk-parallel:
 *          S' term:   dK += diag(m) Vn dS_next^T,   m = e^{g_C - g}
 *                     dgamma_r -= x_r, dgamma_C += sum x + e^{g_C} <S, dS_next>,
 *                     x_r = rowsum(diag(m) Vn dS_next^T ⊙ K)
 *          Vn = U - W S:            dW = -dVn S^T,  dU = dVn
 *          W = A diag(b e^g) K:     dK += diag(b e^g) A^T dW, db += e^g xw,
 *                                   dgamma += b e^g xw, xw = rowsum(A^T dW ⊙ K)
 *          U = A diag(b) V:         dV = diag(b) A^T dU, db += rowsum(A^T dU ⊙ V)
 *          dA = dW K^T diag(b e^g) + dU V^T diag(b)
 *          A = (I + L)^-1:          dL = -strict_lower(A^T dA A^T)
 *          L = strict_lower(diag(b)(K K^T ⊙ Gamma)):
 *                     db_r += sum_s dL_rs (K K^T ⊙ Gamma)_rs
 *                     dK   += (G + G^T) K,  G = diag(b) dL ⊙ Gamma
 *                     dgamma += rowsum(dL ⊙ L) - colsum(dL ⊙ L)
 *          gamma = cumsum(g):       dg = reverse cumsum of dgamma in the chunk
 *   6. bwd_qk_reduce per (token, q/k head): dq, dk = sum over the GVA group of
 *      the per-value-head fp32 partials, then the L2-norm backward
 *          q_hat = q r, r = (|q|^2 + 1e-6)^-1/2:  dq = r (dq_hat - q_hat (q_hat . dq_hat))
 *
 * This list is version 1 of the backward (FLASHQLA_CUDA_BWD_V1=1), kept as
 * verified. The default, version 3, runs steps 0-2 and 4 as above and the
 * fused kernels of gdn_cuda_bwd_fused.cu for 3 and 5 (same equations, one
 * block per chunk and q/k head looping over the GVA group, products kept in
 * registers, two blocks per SM), which also do step 6; see
 * fq_bwd_get_version below for the other versions.
 *
 * The formulas are checked in float64 against autograd through the
 * token-by-token recurrence by dev/cuda/derive_bwd_check.py (same stage names).
 * Tensor-core operands are bf16 (mma.sync m16n8k16), accumulation fp32.
 */
#include "gdn_cuda_bwd.cuh"

#include <stdlib.h>
#include <string.h>

#define FQ_BWD_VS 32 /* state columns per block in the reverse state pass */

/* ---------------------------------------------- block matrix product ---- */

/* C (M x N) = A (M x KD) * B (KD x N) over the block's warps, bf16 operands in
 * shared memory, fp32 accumulators; each warp owns 16 x WN output tiles and
 * hands each pair of adjacent outputs to epi(row, col, x, col+1's x).
 *   A_KM: A is stored transposed, [k][m] (otherwise [m][k]);
 *   B_NK: B is stored [n][k] (otherwise [k][n]).                            */
template <int M, int N, int KD, bool A_KM, bool B_NK, class Epi>
static __device__ __forceinline__ void fq_bmm(const fq_bf16 *A, int lda, const fq_bf16 *B, int ldb,
                                              Epi epi)
{
    constexpr int WN = (N % 32 == 0) ? 32 : 16;
    constexpr int NB = WN / 16;
    constexpr int TN = N / WN;
    const int nwarps = blockDim.x >> 5, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int g = lane >> 2, t = lane & 3;
    for (int tile = warp; tile < (M / 16) * TN; tile += nwarps) {
        const int m0 = (tile / TN) * 16, n0 = (tile % TN) * WN;
        float c[2 * NB][4];
#pragma unroll
        for (int j = 0; j < 2 * NB; j++) c[j][0] = c[j][1] = c[j][2] = c[j][3] = 0.f;
#pragma unroll 4
        for (int k0 = 0; k0 < KD; k0 += 16) {
            uint32_t a[4];
            if (A_KM) fq_frag_a_trans(a, A, lda, m0, k0);
            else fq_frag_a(a, A, lda, m0, k0);
#pragma unroll
            for (int nb = 0; nb < NB; nb++) {
                uint32_t b[4];
                if (B_NK) fq_frag_b_nk(b, B, ldb, n0 + 16 * nb, k0);
                else fq_frag_b_kn(b, B, ldb, k0, n0 + 16 * nb);
                fq_mma_bf16(c[2 * nb], a, b[0], b[1]);
                fq_mma_bf16(c[2 * nb + 1], a, b[2], b[3]);
            }
        }
#pragma unroll
        for (int j = 0; j < 2 * NB; j++) {
            const int col = n0 + 8 * j + 2 * t;
            epi(m0 + g, col, c[j][0], c[j][1]);
            epi(m0 + g + 8, col, c[j][2], c[j][3]);
        }
    }
}

/* ================================================ 3. bwd_local ========== */

template <int K, int V> struct fq_local_smem {
    static constexpr int LDK = K + 8, LDV = V + 8, LDC = 72, LDF = 68, LDFK = K + 4;
    static constexpr int off_q = 0;
    static constexpr int off_k = off_q + 64 * LDK * 2;
    static constexpr int off_do = off_k + 64 * LDK * 2;
    static constexpr int off_vn = off_do + 64 * LDV * 2;
    static constexpr int off_h = off_vn + 64 * LDV * 2;
    static constexpr int off_p = off_h + K * LDV * 2;
    static constexpr int off_dp = off_p + 64 * LDC * 2;
    static constexpr int off_qk = off_dp + 64 * LDC * 2;
    static constexpr int off_t = off_qk + 64 * LDF * 4;
    static constexpr int off_f = off_t + 64 * LDF * 4;
    static constexpr int off_vec = off_f + 64 * LDFK * 4;
    static constexpr int bytes = off_vec + 4 * 64 * 4;
};

template <int K, int V>
__global__ void __launch_bounds__(256) fq_bwd_local_kernel(fq_bwd_args a)
{
    typedef fq_local_smem<K, V> SM;
    extern __shared__ __align__(16) unsigned char smem[];
    fq_bf16 *sQ = (fq_bf16 *)(smem + SM::off_q), *sK = (fq_bf16 *)(smem + SM::off_k);
    fq_bf16 *sdO = (fq_bf16 *)(smem + SM::off_do), *sVn = (fq_bf16 *)(smem + SM::off_vn);
    fq_bf16 *sH = (fq_bf16 *)(smem + SM::off_h);
    fq_bf16 *sP = (fq_bf16 *)(smem + SM::off_p), *sdP = (fq_bf16 *)(smem + SM::off_dp);
    float *sQK = (float *)(smem + SM::off_qk), *sT = (float *)(smem + SM::off_t);
    float *sF = (float *)(smem + SM::off_f);
    float *sg = (float *)(smem + SM::off_vec), *sdg = sg + 64, *srq = sg + 128, *srk = sg + 192;

    const int c = blockIdx.x, j = blockIdx.y, HV = a.HV, H = a.H;
    const fq_chunk_info ci = a.chunks[c];
    if (ci.seq < 0) return;
    const int hq = j / (HV / H), len = ci.len, tid = threadIdx.x;
    const int64_t tile = (int64_t)c * HV + j;

    if (tid < 64) {
        sg[tid] = a.gamma[tile * 64 + tid];
        float rq = 1.f, rk = 1.f;
        if (a.rq && tid < len) {
            rq = a.rq[(int64_t)(ci.row0 + tid) * H + hq];
            rk = a.rk[(int64_t)(ci.row0 + tid) * H + hq];
        }
        srq[tid] = rq;
        srk[tid] = rk;
    }
    __syncthreads();
    const int64_t qrow = (int64_t)ci.row0 * H + hq;
    fq_async_rows<K>(sQ, SM::LDK, a.qb + qrow * K, (int64_t)H * K, 64, len);
    fq_async_rows<K>(sK, SM::LDK, a.kb + qrow * K, (int64_t)H * K, 64, len);
    fq_async_rows<V>(sVn, SM::LDV, a.vn + tile * 64 * V, V, 64, 64);
    fq_async_rows<V>(sH, SM::LDV, a.h + tile * K * V, V, K, K);
    if (a.dout_async) {
        fq_async_rows<V>(sdO, SM::LDV, (const fq_bf16 *)a.dout + ((int64_t)ci.row0 * HV + j) * V,
                         (int64_t)HV * V, 64, len);
    } else {
        for (int idx = tid; idx < 64 * V / 2; idx += blockDim.x) {
            const int r = idx / (V / 2), col = (idx % (V / 2)) * 2;
            float x = 0.f, y = 0.f;
            if (r < len) {
                int64_t o = ((int64_t)(ci.row0 + r) * HV + j) * V + col;
                x = fq_ld_f(a.dout, a.dt, o);
                y = fq_ld_f(a.dout, a.dt, o + 1);
            }
            *(uint32_t *)(sdO + r * SM::LDV + col) = fq_pack_bf16(x, y);
        }
    }
    fq_cp_async_commit();
    fq_cp_async_wait<0>();
    __syncthreads();
    if (a.rq) {
        fq_scale_rows<K>(sQ, SM::LDK, srq);
        fq_scale_rows<K>(sK, SM::LDK, srk);
        __syncthreads();
    }

    /* Q K^T and dO Vn^T (64 x 64, fp32) */
    fq_bmm<64, 64, K, false, true>(sQ, SM::LDK, sK, SM::LDK, [&](int r, int s, float x, float y) {
        *(float2 *)(sQK + r * SM::LDF + s) = make_float2(x, y);
    });
    fq_bmm<64, 64, V, false, true>(sdO, SM::LDV, sVn, SM::LDV, [&](int r, int s, float x, float y) {
        *(float2 *)(sT + r * SM::LDF + s) = make_float2(x, y);
    });
    __syncthreads();

    /* P = QK ⊙ Gamma, dP = scale dOVn ⊙ Gamma (lower incl.), Z = dP ⊙ QK */
    for (int idx = tid; idx < 64 * 64; idx += blockDim.x) {
        const int r = idx >> 6, s = idx & 63;
        const float G = r >= s ? __expf(sg[r] - sg[s]) : 0.f;
        const float qk = sQK[r * SM::LDF + s];
        const float dp = a.scale * sT[r * SM::LDF + s] * G;
        sP[r * SM::LDC + s] = __float2bfloat16_rn(qk * G);
        sdP[r * SM::LDC + s] = __float2bfloat16_rn(dp);
        sT[r * SM::LDF + s] = dp * qk;
    }
    __syncthreads();

    if (tid < 64) {
        float rs = 0.f, cs = 0.f;
        for (int s = 0; s < 64; s++) {
            rs += sT[tid * SM::LDF + s];
            cs += sT[s * SM::LDF + tid];
        }
        sdg[tid] = rs - cs;
    }
    /* dv_local = scale P^T dO */
    {
        fq_bf16 *dst = a.dvl + tile * 64 * V;
        const float sc = a.scale;
        fq_bmm<64, V, 64, true, false>(sP, SM::LDC, sdO, SM::LDV, [&](int r, int col, float x, float y) {
            *(uint32_t *)(dst + r * V + col) = fq_pack_bf16(sc * x, sc * y);
        });
    }
    __syncthreads();

    /* dO <- scale diag(e^g) dO */
    for (int idx = tid; idx < 64 * V / 2; idx += blockDim.x) {
        const int r = idx / (V / 2), col = (idx % (V / 2)) * 2;
        const float f = a.scale * __expf(sg[r]);
        uint32_t *pp = (uint32_t *)(sdO + r * SM::LDV + col);
        float2 v2 = fq_unpack_bf16(*pp);
        *pp = fq_pack_bf16(v2.x * f, v2.y * f);
    }
    __syncthreads();

    /* F = dOs S^T (64 x K);  dS_local = Q^T dOs (K x V);  dK_O = dP^T Q */
    fq_bmm<64, K, V, false, true>(sdO, SM::LDV, sH, SM::LDV, [&](int r, int col, float x, float y) {
        *(float2 *)(sF + r * SM::LDFK + col) = make_float2(x, y);
    });
    {
        fq_bf16 *dst = a.dsl + tile * K * V;
        fq_bmm<K, V, 64, true, false>(sQ, SM::LDK, sdO, SM::LDV, [&](int r, int col, float x, float y) {
            *(uint32_t *)(dst + r * V + col) = fq_pack_bf16(x, y);
        });
    }
    {
        float *dst = a.dkp + ((int64_t)ci.row0 * HV + j) * K;
        const int64_t ld = (int64_t)HV * K;
        fq_bmm<64, K, 64, true, false>(sdP, SM::LDC, sQ, SM::LDK, [&](int r, int col, float x, float y) {
            if (r < len) *(float2 *)(dst + r * ld + col) = make_float2(x, y);
        });
    }
    __syncthreads();

    /* dgamma += rowsum(F ⊙ Q) */
    {
        float s = fq_rowdot<K>([&](int r, int col) {
            return sF[r * SM::LDFK + col] * fq_bf(sQ[r * SM::LDK + col]);
        });
        if ((tid & 3) == 0) sdg[tid >> 2] += s;
    }
    __syncthreads();
    if (tid < 64) a.dgam[tile * 64 + tid] = sdg[tid];
    /* dQ = F + dP K */
    fq_bmm<64, K, 64, false, false>(sdP, SM::LDC, sK, SM::LDK, [&](int r, int col, float x, float y) {
        float2 *pp = (float2 *)(sF + r * SM::LDFK + col);
        float2 v2 = *pp;
        *pp = make_float2(v2.x + x, v2.y + y);
    });
    __syncthreads();
    {
        float *dst = a.dqp + ((int64_t)ci.row0 * HV + j) * K;
        const int64_t ld = (int64_t)HV * K;
        for (int idx = tid; idx < len * (K / 4); idx += blockDim.x) {
            const int r = idx / (K / 4), col = (idx % (K / 4)) * 4;
            *(float4 *)(dst + r * ld + col) = *(const float4 *)(sF + r * SM::LDFK + col);
        }
    }
}

/* ================================================ 4. bwd_state ========== */

/* NS: prefetch ring depth (2 in version 1; 3 in version 4: two chunks in
 * flight while one is computed). */
template <int K, int V, int NS = 2> struct fq_state_smem {
    static constexpr int VS = FQ_BWD_VS;
    static constexpr int LDK = K + 8, LDS = VS + 8, LDSF = VS + 4;
    /* one prefetch buffer */
    static constexpr int b_k = 0;
    static constexpr int b_w = b_k + 64 * LDK * 2;
    static constexpr int b_dvl = b_w + 64 * LDK * 2;
    static constexpr int b_dsl = b_dvl + 64 * LDS * 2;
    static constexpr int b_vec = b_dsl + K * LDS * 2; /* gamma[64], kdecay[64] */
    static constexpr int buf = b_vec + 128 * 4;
    static constexpr int off_ds = NS * buf;
    static constexpr int off_dsb = off_ds + K * LDSF * 4;
    static constexpr int off_dvn = off_dsb + K * LDS * 2;
    static constexpr int bytes = off_dvn + 64 * LDS * 2;
};

template <int K, int V, int NS = 2>
__global__ void __launch_bounds__(256) fq_bwd_state_kernel(fq_bwd_args a)
{
    typedef fq_state_smem<K, V, NS> SM;
    constexpr int VS = SM::VS;
    extern __shared__ __align__(16) unsigned char smem[];
    float *sdS = (float *)(smem + SM::off_ds);
    fq_bf16 *sdSb = (fq_bf16 *)(smem + SM::off_dsb), *sdVn = (fq_bf16 *)(smem + SM::off_dvn);

    const int n = blockIdx.x, j = blockIdx.y, v0 = blockIdx.z * VS, HV = a.HV, H = a.H;
    const int tid = threadIdx.x, hq = j / (HV / H);
    const fq_seq_info si = a.seqs[n];
    const int64_t sbase = ((int64_t)n * HV + j) * K * V + v0;

    for (int idx = tid; idx < K * VS; idx += blockDim.x) {
        const int r = idx / VS, col = idx % VS;
        sdS[r * SM::LDSF + col] = a.dht ? a.dht[sbase + (int64_t)r * V + col] : 0.f;
    }

    auto prefetch = [&](int i, int b) {
        const int c = si.chunk0 + i;
        const fq_chunk_info ci = a.chunks[c];
        unsigned char *base = smem + b * SM::buf;
        const int64_t tile = (int64_t)c * HV + j;
        const fq_bf16 *kg = a.kb + ((int64_t)ci.row0 * H + hq) * K;
        for (int idx = tid; idx < 64 * (K / 8); idx += blockDim.x) {
            const int r = idx / (K / 8), col = (idx % (K / 8)) * 8;
            const bool ok = r < ci.len;
            fq_cp_async16(base + SM::b_k + (r * SM::LDK + col) * 2,
                          kg + (ok ? (int64_t)r * H * K + col : 0), ok ? 16 : 0);
            fq_cp_async16(base + SM::b_w + (r * SM::LDK + col) * 2, a.w + (tile * 64 + r) * K + col, 16);
        }
        for (int idx = tid; idx < 64 * (VS / 8); idx += blockDim.x) {
            const int r = idx / (VS / 8), col = (idx % (VS / 8)) * 8;
            fq_cp_async16(base + SM::b_dvl + (r * SM::LDS + col) * 2,
                          a.dvl + (tile * 64 + r) * V + v0 + col, 16);
        }
        for (int idx = tid; idx < K * (VS / 8); idx += blockDim.x) {
            const int r = idx / (VS / 8), col = (idx % (VS / 8)) * 8;
            fq_cp_async16(base + SM::b_dsl + (r * SM::LDS + col) * 2,
                          a.dsl + (tile * K + r) * V + v0 + col, 16);
        }
        if (tid < 16) fq_cp_async16(base + SM::b_vec + tid * 16, a.gamma + tile * 64 + tid * 4, 16);
        else if (tid < 32)
            fq_cp_async16(base + SM::b_vec + 256 + (tid - 16) * 16, a.kdecay + tile * 64 + (tid - 16) * 4, 16);
        fq_cp_async_commit();
    };

    const int nch = si.nchunks;
    if (nch > 0) prefetch(nch - 1, 0);
    if (NS > 2 && nch > 1) prefetch(nch - 2, 1);
    for (int i = nch - 1; i >= 0; i--) {
        const int b = (nch - 1 - i) % NS;
        const int c = si.chunk0 + i;
        const int64_t tile = (int64_t)c * HV + j;
        if (NS > 2 && i > 0) fq_cp_async_wait<1>(); /* chunk i - 1 may stay in flight */
        else fq_cp_async_wait<0>();
        __syncthreads();
        if (i - (NS - 1) >= 0) prefetch(i - (NS - 1), (b + NS - 1) % NS);
        unsigned char *base = smem + b * SM::buf;
        const fq_bf16 *sKc = (const fq_bf16 *)(base + SM::b_k);
        const fq_bf16 *sW = (const fq_bf16 *)(base + SM::b_w);
        const fq_bf16 *sDvl = (const fq_bf16 *)(base + SM::b_dvl);
        const fq_bf16 *sDsl = (const fq_bf16 *)(base + SM::b_dsl);
        const float *sgam = (const float *)(base + SM::b_vec), *skd = sgam + 64;
        const float egC = __expf(sgam[63]);

        /* dS_next[c] = dS;  dS <- e^{g_C} dS + dS_local */
        fq_bf16 *dsn = a.dsl + tile * K * V + v0;
        for (int idx = tid; idx < K * VS / 2; idx += blockDim.x) {
            const int r = idx / (VS / 2), col = (idx % (VS / 2)) * 2;
            float2 *pp = (float2 *)(sdS + r * SM::LDSF + col);
            float2 x = *pp;
            uint32_t xb = fq_pack_bf16(x.x, x.y);
            *(uint32_t *)(sdSb + r * SM::LDS + col) = xb;
            *(uint32_t *)(dsn + (int64_t)r * V + col) = xb;
            float2 l = fq_unpack_bf16(*(const uint32_t *)(sDsl + r * SM::LDS + col));
            *pp = make_float2(egC * x.x + l.x, egC * x.y + l.y);
        }
        __syncthreads();
        /* dVn = dv_local + diag(kdecay) K dS_next */
        {
            fq_bf16 *dst = a.dvl + tile * 64 * V + v0;
            fq_bmm<64, VS, K, false, false>(sKc, SM::LDK, sdSb, SM::LDS, [&](int r, int col, float x, float y) {
                float2 l = fq_unpack_bf16(*(const uint32_t *)(sDvl + r * SM::LDS + col));
                uint32_t v = fq_pack_bf16(l.x + skd[r] * x, l.y + skd[r] * y);
                *(uint32_t *)(sdVn + r * SM::LDS + col) = v;
                *(uint32_t *)(dst + (int64_t)r * V + col) = v;
            });
        }
        __syncthreads();
        /* dS -= W^T dVn */
        fq_bmm<K, VS, 64, true, false>(sW, SM::LDK, sdVn, SM::LDS, [&](int r, int col, float x, float y) {
            float2 *pp = (float2 *)(sdS + r * SM::LDSF + col);
            float2 v = *pp;
            *pp = make_float2(v.x - x, v.y - y);
        });
    }
    __syncthreads();
    if (a.dh0) {
        for (int idx = tid; idx < K * VS; idx += blockDim.x) {
            const int r = idx / VS, col = idx % VS;
            a.dh0[sbase + (int64_t)r * V + col] = sdS[r * SM::LDSF + col];
        }
    }
}

/* ================================================== 5. bwd_wy ========== */

template <int K, int V> struct fq_wyb_smem {
    static constexpr int MX = K > V ? K : V;
    static constexpr int LDK = K + 8, LDV = V + 8, LDX = MX + 8, LDC = 72, LDF = 68;
    static constexpr int LDFK = K + 4, LDFV = V + 4, LDFM = MX + 4;
    static constexpr int off_k = 0;
    static constexpr int off_x = off_k + 64 * LDK * 2;     /* Vn, then dW */
    static constexpr int off_dvn = off_x + 64 * LDX * 2;
    static constexpr int off_a = off_dvn + 64 * LDV * 2;
    static constexpr int off_m = off_a + 64 * LDC * 2;
    static constexpr int off_dk = off_m + 64 * LDC * 2;
    static constexpr int off_u1 = off_dk + 64 * LDFK * 4;  /* F1 | (KK^T, Af) */
    static constexpr int u1_bytes = (64 * LDFK * 4 > 2 * 64 * LDF * 4) ? 64 * LDFK * 4 : 2 * 64 * LDF * 4;
    static constexpr int off_r0 = off_u1 + u1_bytes;       /* (h, dS_next) | (V, F2) */
    static constexpr int r0a = 2 * K * LDV * 2;
    static constexpr int f2_bytes = (64 * LDFM * 4 > 2 * 64 * LDF * 4) ? 64 * LDFM * 4 : 2 * 64 * LDF * 4;
    static constexpr int r0b = 64 * LDV * 2 + f2_bytes;
    static constexpr int r0_bytes = r0a > r0b ? r0a : r0b;
    static constexpr int off_vec = off_r0 + r0_bytes;
    static constexpr int bytes = off_vec + 8 * 64 * 4 + 16;
};

template <int K, int V>
__global__ void __launch_bounds__(256) fq_bwd_wy_kernel(fq_bwd_args a)
{
    typedef fq_wyb_smem<K, V> SM;
    extern __shared__ __align__(16) unsigned char smem[];
    fq_bf16 *sK = (fq_bf16 *)(smem + SM::off_k), *sX = (fq_bf16 *)(smem + SM::off_x);
    fq_bf16 *sdVn = (fq_bf16 *)(smem + SM::off_dvn), *sA = (fq_bf16 *)(smem + SM::off_a);
    fq_bf16 *sM = (fq_bf16 *)(smem + SM::off_m);
    float *sdK = (float *)(smem + SM::off_dk);
    float *F1 = (float *)(smem + SM::off_u1);
    float *sKK = F1, *sAf = F1 + 64 * SM::LDF;
    fq_bf16 *sH = (fq_bf16 *)(smem + SM::off_r0), *sdS = sH + K * SM::LDV;
    fq_bf16 *sV = (fq_bf16 *)(smem + SM::off_r0);
    float *F2 = (float *)(smem + SM::off_r0 + 64 * SM::LDV * 2);
    float *F2b = F2 + 64 * SM::LDF;
    float *sg = (float *)(smem + SM::off_vec), *seg = sg + 64, *sb = sg + 128, *sm = sg + 192;
    float *sdg = sg + 256, *sdb = sg + 320, *srk = sg + 384, *sred = sg + 448;

    const int c = blockIdx.x, j = blockIdx.y, HV = a.HV, H = a.H;
    const fq_chunk_info ci = a.chunks[c];
    if (ci.seq < 0) return;
    const int hq = j / (HV / H), len = ci.len, tid = threadIdx.x;
    const int64_t tile = (int64_t)c * HV + j;
    const int64_t qrow = (int64_t)ci.row0 * H + hq;

    if (tid < 64) {
        const float gm = a.gamma[tile * 64 + tid], gC = a.gamma[tile * 64 + 63];
        const bool ok = tid < len;
        sg[tid] = gm;
        seg[tid] = ok ? __expf(gm) : 0.f;
        sm[tid] = ok ? __expf(gC - gm) : 0.f;
        sb[tid] = ok ? fq_ld_f(a.beta, a.gdt, (int64_t)(ci.row0 + tid) * HV + j) : 0.f;
        sdg[tid] = a.dgam[tile * 64 + tid];
        sdb[tid] = 0.f;
        srk[tid] = (a.rk && ok) ? a.rk[(int64_t)(ci.row0 + tid) * H + hq] : 1.f;
        if (tid < 4) sred[tid] = 0.f;
    }
    __syncthreads();
    fq_async_rows<K>(sK, SM::LDK, a.kb + qrow * K, (int64_t)H * K, 64, len);
    fq_async_rows<V>(sX, SM::LDX, a.vn + tile * 64 * V, V, 64, 64);
    fq_async_rows<V>(sdVn, SM::LDV, a.dvl + tile * 64 * V, V, 64, 64);
    fq_async_rows<V>(sH, SM::LDV, a.h + tile * K * V, V, K, K);
    fq_async_rows<V>(sdS, SM::LDV, a.dsl + tile * K * V, V, K, K);
    fq_async_rows<64>(sA, SM::LDC, a.a + tile * 64 * 64, 64, 64, 64);
    {
        const float *src = a.dkp + ((int64_t)ci.row0 * HV + j) * K;
        for (int idx = tid; idx < 64 * (K / 4); idx += blockDim.x) {
            const int r = idx / (K / 4), col = (idx % (K / 4)) * 4;
            const bool ok = r < len;
            fq_cp_async16(sdK + r * SM::LDFK + col, src + (ok ? (int64_t)r * HV * K + col : 0), ok ? 16 : 0);
        }
    }
    fq_cp_async_commit();
    fq_cp_async_wait<0>();
    __syncthreads();
    if (a.rk) fq_scale_rows<K>(sK, SM::LDK, srk);
    if (len < 64) {
        for (int idx = tid; idx < 64 * 64; idx += blockDim.x) {
            const int r = idx >> 6, s = idx & 63;
            if (r >= len || s >= len) sA[r * SM::LDC + s] = __float2bfloat16_rn(r == s ? 1.f : 0.f);
        }
    }
    __syncthreads();

    /* F1 = Vn dS_next^T;  <S, dS_next> */
    fq_bmm<64, K, V, false, true>(sX, SM::LDX, sdS, SM::LDV, [&](int r, int col, float x, float y) {
        *(float2 *)(F1 + r * SM::LDFK + col) = make_float2(x, y);
    });
    {
        float s = 0.f;
        for (int idx = tid; idx < K * V / 2; idx += blockDim.x) {
            const int r = idx / (V / 2), col = (idx % (V / 2)) * 2;
            float2 hh = fq_unpack_bf16(*(const uint32_t *)(sH + r * SM::LDV + col));
            float2 dd = fq_unpack_bf16(*(const uint32_t *)(sdS + r * SM::LDV + col));
            s += hh.x * dd.x + hh.y * dd.y;
        }
        for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
        if ((tid & 31) == 0) atomicAdd(&sred[0], s);
    }
    __syncthreads();

    /* dW = -dVn S^T (into sX, over Vn);  S' term of dK and dgamma */
    fq_bmm<64, K, V, false, true>(sdVn, SM::LDV, sH, SM::LDV, [&](int r, int col, float x, float y) {
        *(uint32_t *)(sX + r * SM::LDX + col) = fq_pack_bf16(-x, -y);
    });
    {
        const int r = tid >> 2;
        const float mr = sm[r];
        float s = fq_rowdot<K>([&](int rr, int col) {
            float f = F1[rr * SM::LDFK + col];
            sdK[rr * SM::LDFK + col] += mr * f;
            return f * fq_bf(sK[rr * SM::LDK + col]);
        });
        if ((tid & 3) == 0) {
            sdg[r] -= mr * s;
            atomicAdd(&sred[1], mr * s);
        }
    }
    __syncthreads();

    /* V -> shared (over h, dS_next; in flight during K K^T);  K K^T (fp32, into sKK) */
    fq_async_rows<V>(sV, SM::LDV, a.vb + ((int64_t)ci.row0 * HV + j) * V, (int64_t)HV * V, 64, len);
    fq_cp_async_commit();
    fq_bmm<64, 64, K, false, true>(sK, SM::LDK, sK, SM::LDK, [&](int r, int s, float x, float y) {
        *(float2 *)(sKK + r * SM::LDF + s) = make_float2(x, y);
    });
    if (tid == 0) sdg[len - 1] += __expf(sg[63]) * sred[0] + sred[1];
    fq_cp_async_wait<0>();
    __syncthreads();

    /* F2 = A^T dW */
    fq_bmm<64, K, 64, true, false>(sA, SM::LDC, sX, SM::LDX, [&](int r, int col, float x, float y) {
        *(float2 *)(F2 + r * SM::LDFK + col) = make_float2(x, y);
    });
    __syncthreads();
    {
        const int r = tid >> 2;
        const float be = sb[r] * seg[r];
        float s = fq_rowdot<K>([&](int rr, int col) {
            float f = F2[rr * SM::LDFK + col];
            sdK[rr * SM::LDFK + col] += be * f;
            return f * fq_bf(sK[rr * SM::LDK + col]);
        });
        if ((tid & 3) == 0) {
            sdb[r] += seg[r] * s;
            sdg[r] += be * s;
        }
    }
    __syncthreads();

    /* F2 = A^T dU (dU = dVn);  dV = diag(b) F2;  db += rowsum(F2 ⊙ V) */
    fq_bmm<64, V, 64, true, false>(sA, SM::LDC, sdVn, SM::LDV, [&](int r, int col, float x, float y) {
        *(float2 *)(F2 + r * SM::LDFV + col) = make_float2(x, y);
    });
    __syncthreads();
    {
        const int r = tid >> 2;
        const float br = sb[r];
        const int64_t orow = ((int64_t)(ci.row0 + r) * HV + j) * V;
        float s = fq_rowdot<V>([&](int rr, int col) {
            float f = F2[rr * SM::LDFV + col];
            if (rr < len) fq_st_f(a.dv, a.dt, orow + col, br * f);
            return f * fq_bf(sV[rr * SM::LDV + col]);
        });
        if ((tid & 3) == 0) sdb[r] += s;
    }
    __syncthreads();

    /* dA = dW K^T diag(b e^g) + dVn V^T diag(b) */
    fq_bmm<64, 64, K, false, true>(sX, SM::LDX, sK, SM::LDK, [&](int r, int s, float x, float y) {
        *(float2 *)(sAf + r * SM::LDF + s) = make_float2(x, y);
    });
    fq_bmm<64, 64, V, false, true>(sdVn, SM::LDV, sV, SM::LDV, [&](int r, int s, float x, float y) {
        *(float2 *)(F2 + r * SM::LDF + s) = make_float2(x, y);
    });
    __syncthreads();
    for (int idx = tid; idx < 64 * 64; idx += blockDim.x) {
        const int r = idx >> 6, s = idx & 63;
        const float x = sAf[r * SM::LDF + s] * sb[s] * seg[s] + F2[r * SM::LDF + s] * sb[s];
        sM[r * SM::LDC + s] = __float2bfloat16_rn(x);
    }
    __syncthreads();
    /* M1 = A^T dA */
    fq_bmm<64, 64, 64, true, false>(sA, SM::LDC, sM, SM::LDC, [&](int r, int s, float x, float y) {
        *(float2 *)(sAf + r * SM::LDF + s) = make_float2(x, y);
    });
    __syncthreads();
    for (int idx = tid; idx < 64 * 64; idx += blockDim.x) {
        const int r = idx >> 6, s = idx & 63;
        sM[r * SM::LDC + s] = __float2bfloat16_rn(sAf[r * SM::LDF + s]);
    }
    __syncthreads();
    /* M2 = M1 A^T;  dL = -strict_lower(M2) */
    fq_bmm<64, 64, 64, false, true>(sM, SM::LDC, sA, SM::LDC, [&](int r, int s, float x, float y) {
        *(float2 *)(sAf + r * SM::LDF + s) = make_float2(x, y);
    });
    __syncthreads();
    /* Y = dL ⊙ KK ⊙ Gamma (db), Z = diag(b) Y = dL ⊙ L (dgamma), sM = G + G^T */
    for (int idx = tid; idx < 64 * 64; idx += blockDim.x) {
        const int r = idx >> 6, s = idx & 63;
        float y = 0.f, gsym = 0.f;
        if (r > s) {
            const float G = __expf(sg[r] - sg[s]);
            const float dL = -sAf[r * SM::LDF + s];
            y = dL * sKK[r * SM::LDF + s] * G;
            gsym = sb[r] * dL * G;
        } else if (r < s) {
            const float G = __expf(sg[s] - sg[r]);
            gsym = -sb[s] * sAf[s * SM::LDF + r] * G;
        }
        F2[r * SM::LDF + s] = y;
        F2b[r * SM::LDF + s] = sb[r] * y;
        sM[r * SM::LDC + s] = __float2bfloat16_rn(gsym);
    }
    __syncthreads();
    if (tid < 64) {
        float ry = 0.f, rz = 0.f, cz = 0.f;
        for (int s = 0; s < 64; s++) {
            ry += F2[tid * SM::LDF + s];
            rz += F2b[tid * SM::LDF + s];
            cz += F2b[s * SM::LDF + tid];
        }
        sdb[tid] += ry;
        sdg[tid] += rz - cz;
    }
    /* dK += (G + G^T) K */
    fq_bmm<64, K, 64, false, false>(sM, SM::LDC, sK, SM::LDK, [&](int r, int col, float x, float y) {
        float2 *pp = (float2 *)(sdK + r * SM::LDFK + col);
        float2 v = *pp;
        *pp = make_float2(v.x + x, v.y + y);
    });
    __syncthreads();

    /* dg = reverse cumsum of dgamma (one warp: two rows per lane) */
    if (tid < 32) {
        const int lane = tid;
        /* suffix sums over rows 63..0: lane l holds rows 2l, 2l+1 */
        float x0 = sdg[2 * lane], x1 = sdg[2 * lane + 1];
        float pair = x0 + x1;
        float suf = pair; /* inclusive suffix scan over lanes */
        for (int o = 1; o < 32; o <<= 1) {
            float yv = __shfl_down_sync(0xffffffffu, suf, o);
            if (lane + o < 32) suf += yv;
        }
        const float after = suf - pair; /* rows > 2l+1 */
        const float d1 = after + x1, d0 = d1 + x0;
        const int64_t o0 = (int64_t)(ci.row0 + 2 * lane) * HV + j;
        if (2 * lane < len) {
            fq_st_f(a.dg, a.gdt, o0, d0);
            fq_st_f(a.dbeta, a.gdt, o0, sdb[2 * lane]);
        }
        if (2 * lane + 1 < len) {
            fq_st_f(a.dg, a.gdt, o0 + HV, d1);
            fq_st_f(a.dbeta, a.gdt, o0 + HV, sdb[2 * lane + 1]);
        }
    }
    {
        float *dst = a.dkp + ((int64_t)ci.row0 * HV + j) * K;
        for (int idx = tid; idx < len * (K / 4); idx += blockDim.x) {
            const int r = idx / (K / 4), col = (idx % (K / 4)) * 4;
            *(float4 *)(dst + (int64_t)r * HV * K + col) = *(const float4 *)(sdK + r * SM::LDFK + col);
        }
    }
}

/* ============================================ 6. bwd_qk_reduce ========== */

/* One warp per (token row, q/k head): sum the GVA group's partials, then the
 * L2-norm backward from the raw input (fp32) and its inverse norm. */
__global__ void fq_bwd_qk_reduce_kernel(const float *part, const void *x, fq_dtype dt, const float *rnorm,
                                        void *out, int64_t nvec, int H, int G, int K)
{
    const int64_t vec = (int64_t)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    const int lane = threadIdx.x & 31;
    if (vec >= nvec) return;
    const int64_t row = vec / H;
    const int hq = (int)(vec % H);
    float d[4], xh[4];
    float dot = 0.f;
#pragma unroll
    for (int e = 0; e < 4; e++) {
        const int i = lane + 32 * e;
        d[e] = 0.f;
        xh[e] = 0.f;
        if (i < K) {
            for (int jj = 0; jj < G; jj++) d[e] += part[((row * H + hq) * G + jj) * K + i];
            if (rnorm) {
                xh[e] = fq_ld_f(x, dt, vec * K + i) * rnorm[vec];
                dot += xh[e] * d[e];
            }
        }
    }
    if (rnorm) {
        for (int o = 16; o > 0; o >>= 1) dot += __shfl_xor_sync(0xffffffffu, dot, o);
    }
#pragma unroll
    for (int e = 0; e < 4; e++) {
        const int i = lane + 32 * e;
        if (i < K) {
            float v = rnorm ? rnorm[vec] * (d[e] - xh[e] * dot) : d[e];
            fq_st_f(out, dt, vec * K + i, v);
        }
    }
}

/* ========================================================= host side ==== */

typedef struct fq_bwd_ws {
    fq_fwd_ws f;
    fq_bf16 *a;    /* [nc, HV, 64, 64] */
    fq_bf16 *dsl;  /* [nc, HV, K, V]   */
    float *dgam;   /* [nc, HV, 64]     */
    float *dqp, *dkp; /* [B*T, HV, K]  */
} fq_bwd_ws;

static size_t fq_bwd_align(size_t x) { return (x + 255) & ~(size_t)255; }

static size_t fq_bwd_ws_layout(const fq_gdn_params *p, void *base_, fq_bwd_ws *ws)
{
    fq_bwd_ws tmp;
    if (!ws) ws = &tmp;
    memset(ws, 0, sizeof *ws);
    size_t off = fq_cuda_fwd_ws_layout(p, base_, &ws->f);
    char *base = (char *)base_;
    const int64_t nc = ws->f.nc_max, HV = p->HV, K = p->K, V = p->V, BT = p->B * p->T;
#define FQ_CARVE(ptr, type, bytes)                                         \
    do {                                                                   \
        ptr = base ? (type)(base + off) : (type)NULL;                      \
        off += fq_bwd_align((size_t)(bytes));                              \
    } while (0)
    FQ_CARVE(ws->a, fq_bf16 *, nc * HV * 64 * 64 * 2);
    FQ_CARVE(ws->dsl, fq_bf16 *, nc * HV * K * V * 2);
    FQ_CARVE(ws->dgam, float *, nc * HV * 64 * 4);
    FQ_CARVE(ws->dqp, float *, BT * HV * K * 4);
    FQ_CARVE(ws->dkp, float *, BT * HV * K * 4);
#undef FQ_CARVE
    ws->f.a = ws->a;
    return off;
}

extern "C" size_t fq_cuda_chunk_bwd_workspace_bytes(const fq_gdn_params *p)
{
    return fq_bwd_ws_layout(p, NULL, NULL);
}

/* Which version of the backward runs:
 *   1  the first verified one: every stage as in the comment at the top;
 *   2  bwd_local 1, bwd_wy fused (gdn_cuda_bwd_fused.cu: GVA loop, registers,
 *      dk finished there), bwd_qk_reduce for dq only;
 *   3  (default) bwd_local and bwd_wy fused: no bwd_qk_reduce at all;
 *   4  version 3 with a 3-deep prefetch ring in bwd_state (measured: no gain);
 *   5  version 3 with bwd_state2 (gdn_cuda_bwd_state.cu: dS in registers,
 *      two barriers per chunk, 4-deep prefetch ring) and bwd_local2 loading h
 *      as a second cp.async group (written after the one H200 run of this
 *      step: not yet measured);
 *   6  (default) version 5 with bwd_state3 (gdn_cuda_bwd_state.cu: dS^T in
 *      registers as the mma A operand, 16 columns per warp or warp pair,
 *      K-split and columns per block picked by the number of chains, one
 *      ring barrier per chunk; not yet measured: FLASHQLA_CUDA_BWD_VERSION=5
 *      returns to version 5).
 * FLASHQLA_CUDA_BWD_V1=1 in the environment selects version 1, else
 * FLASHQLA_CUDA_BWD_VERSION=1..6 picks one (read once, at the first backward
 * call). fq_cuda_bwd_set_version (no gdn.h entry; for
 * dev/cuda/check_bwd.cu, which checks and times every version) overrides. */
static int fq_bwd_version = 0;

extern "C" void fq_cuda_bwd_set_version(int v) { fq_bwd_version = (v >= 1 && v <= 6) ? v : 3; }

static int fq_bwd_get_version(void)
{
    if (fq_bwd_version == 0) {
        const char *e = getenv("FLASHQLA_CUDA_BWD_V1");
        const char *v = getenv("FLASHQLA_CUDA_BWD_VERSION");
        if (e && e[0] == '1') fq_bwd_version = 1;
        else if (v && v[0] >= '1' && v[0] <= '6' && v[1] == 0) fq_bwd_version = v[0] - '0';
        else fq_bwd_version = 6;
    }
    return fq_bwd_version;
}

template <int K, int V>
static fq_status fq_bwd_launch_kv(const fq_gdn_params *p, const fq_bwd_ws *ws, const fq_bwd_args &args,
                                  cudaStream_t stream, cudaEvent_t *ev)
{
    const int64_t nc = ws->f.nc_max;
    fq_status st;
    const int ver = fq_bwd_get_version();
    if (ver >= 3) {
        if ((st = fq_bwd_local2_launch(p, args, nc, ver >= 5, stream)) != FQ_OK) return st;
    } else if (nc > 0) {
        const int bytes = fq_local_smem<K, V>::bytes;
        if ((st = fq_cuda_set_smem((const void *)fq_bwd_local_kernel<K, V>, bytes)) != FQ_OK) return st;
        fq_bwd_local_kernel<K, V><<<dim3((unsigned)nc, (unsigned)p->HV), 256, bytes, stream>>>(args);
        FQ_CUDA_CHECK_LAUNCH();
    }
    if (ev) FQ_CUDA_CHECK(cudaEventRecord(ev[0], stream));
    if (ver == 6) {
        if ((st = fq_bwd_state3_launch(p, args, 0, 0, stream)) != FQ_OK) return st;
    } else if (ver == 5) {
        if ((st = fq_bwd_state2_launch(p, args, stream)) != FQ_OK) return st;
    } else if (ver == 4) {
        const int bytes = fq_state_smem<K, V, 3>::bytes;
        if ((st = fq_cuda_set_smem((const void *)fq_bwd_state_kernel<K, V, 3>, bytes)) != FQ_OK) return st;
        fq_bwd_state_kernel<K, V, 3><<<dim3((unsigned)p->N, (unsigned)p->HV, V / FQ_BWD_VS), 256, bytes, stream>>>(args);
        FQ_CUDA_CHECK_LAUNCH();
    } else {
        const int bytes = fq_state_smem<K, V>::bytes;
        if ((st = fq_cuda_set_smem((const void *)fq_bwd_state_kernel<K, V>, bytes)) != FQ_OK) return st;
        fq_bwd_state_kernel<K, V><<<dim3((unsigned)p->N, (unsigned)p->HV, V / FQ_BWD_VS), 256, bytes, stream>>>(args);
        FQ_CUDA_CHECK_LAUNCH();
    }
    if (ev) FQ_CUDA_CHECK(cudaEventRecord(ev[1], stream));
    if (ver >= 2) {
        if ((st = fq_bwd_wy2_launch(p, args, nc, stream)) != FQ_OK) return st;
    } else if (nc > 0) {
        const int bytes = fq_wyb_smem<K, V>::bytes;
        if ((st = fq_cuda_set_smem((const void *)fq_bwd_wy_kernel<K, V>, bytes)) != FQ_OK) return st;
        fq_bwd_wy_kernel<K, V><<<dim3((unsigned)nc, (unsigned)p->HV), 256, bytes, stream>>>(args);
        FQ_CUDA_CHECK_LAUNCH();
    }
    if (ev) FQ_CUDA_CHECK(cudaEventRecord(ev[2], stream));
    return FQ_OK;
}

/* The whole backward on the current device. ev (NULL in the library): five
 * events recorded after stages 2, 3, 4, 5, 6, for dev/cuda/check_bwd.cu. */
extern "C" fq_status fq_cuda_bwd_run(const fq_gdn_params *p, cudaEvent_t *ev)
{
    cudaStream_t stream = (cudaStream_t)p->stream;
    const size_t need = fq_bwd_ws_layout(p, NULL, NULL);
    if (!p->workspace || p->workspace_bytes < need)
        return fq_fail(FQ_ERR_VALUE, "workspace: expected at least %zu bytes, got %zu", need,
                       p->workspace ? p->workspace_bytes : (size_t)0);
    fq_bwd_ws ws;
    fq_bwd_ws_layout(p, p->workspace, &ws);
    fq_status st;
    /* 0-2. recompute the forward's chunk table, gamma, A, W, U, h, Vn */
    if ((st = fq_cuda_fwd_prepare(p, &ws.f, stream)) != FQ_OK) return st;
    if ((st = fq_cuda_fwd_wy_recompute(p, &ws.f, stream)) != FQ_OK) return st;
    if ((st = fq_cuda_fwd_state(p, &ws.f, NULL, 0, stream)) != FQ_OK) return st;
    if (ev) FQ_CUDA_CHECK(cudaEventRecord(ev[0], stream));

    fq_bwd_args args;
    memset(&args, 0, sizeof args);
    args.chunks = ws.f.chunks;
    args.seqs = ws.f.seqs;
    args.qb = ws.f.qb;
    args.kb = ws.f.kb;
    args.vb = ws.f.vb;
    args.rq = ws.f.rq;
    args.rk = ws.f.rk;
    args.gamma = ws.f.gamma;
    args.kdecay = ws.f.kdecay;
    args.w = ws.f.w;
    args.h = ws.f.h;
    args.vn = ws.f.vn;
    args.a = ws.a;
    args.dvl = ws.f.u; /* U is dead after stage 2 */
    args.dsl = ws.dsl;
    args.dgam = ws.dgam;
    args.dqp = ws.dqp;
    args.dkp = ws.dkp;
    args.q = p->q;
    args.k = p->k;
    args.beta = p->beta;
    args.dout = p->dout;
    args.dht = (const float *)p->dht;
    args.dq = p->dq;
    args.dk = p->dk;
    args.dv = p->dv;
    args.dg = p->dg;
    args.dbeta = p->dbeta;
    args.dh0 = p->h0 ? (float *)p->dh0 : NULL;
    args.dt = p->dtype;
    args.gdt = p->gate_dtype;
    args.dout_async = p->dtype == FQ_BF16 && ((uintptr_t)p->dout & 15) == 0;
    const int ver = fq_bwd_get_version();
    args.dko_group = ver >= 3;
    args.H = (int)p->H;
    args.HV = (int)p->HV;
    args.scale = (float)p->scale;

    /* 3-5 */
    if (p->K == 128 && p->V == 128) st = fq_bwd_launch_kv<128, 128>(p, &ws, args, stream, ev ? ev + 1 : NULL);
    else if (p->K == 128 && p->V == 64) st = fq_bwd_launch_kv<128, 64>(p, &ws, args, stream, ev ? ev + 1 : NULL);
    else if (p->K == 64 && p->V == 128) st = fq_bwd_launch_kv<64, 128>(p, &ws, args, stream, ev ? ev + 1 : NULL);
    else if (p->K == 64 && p->V == 64) st = fq_bwd_launch_kv<64, 64>(p, &ws, args, stream, ev ? ev + 1 : NULL);
    else st = fq_fail(FQ_ERR_VALUE, "k, v: the CUDA backend supports K, V in {64, 128}, got K=%lld V=%lld",
                      (long long)p->K, (long long)p->V);
    if (st != FQ_OK) return st;

    /* 6. dq, dk: GVA sum + L2-norm backward (version 2: dq only; 3: none) */
    const int64_t nvec = p->B * p->T * p->H;
    if (nvec > 0 && ver <= 2) {
        const unsigned blocks = (unsigned)((nvec + 7) / 8);
        const int G = (int)(p->HV / p->H);
        fq_bwd_qk_reduce_kernel<<<blocks, 256, 0, stream>>>(ws.dqp, p->q, p->dtype, ws.f.rq, p->dq, nvec,
                                                            (int)p->H, G, (int)p->K);
        FQ_CUDA_CHECK_LAUNCH();
        if (ver == 1) { /* version 2 finishes dk in bwd_wy */
            fq_bwd_qk_reduce_kernel<<<blocks, 256, 0, stream>>>(ws.dkp, p->k, p->dtype, ws.f.rk, p->dk, nvec,
                                                                (int)p->H, G, (int)p->K);
            FQ_CUDA_CHECK_LAUNCH();
        }
    }
    if (ev) FQ_CUDA_CHECK(cudaEventRecord(ev[4], stream));

    /* invalid cu_seqlens: NaN outputs */
    if (p->cu_seqlens) {
        const int64_t BT = p->B * p->T;
        const int *fl = ws.f.flags;
        if ((st = fq_cuda_poison_if_invalid(fl, p->dq, p->dtype, BT * p->H * p->K, stream)) != FQ_OK) return st;
        if ((st = fq_cuda_poison_if_invalid(fl, p->dk, p->dtype, BT * p->H * p->K, stream)) != FQ_OK) return st;
        if ((st = fq_cuda_poison_if_invalid(fl, p->dv, p->dtype, BT * p->HV * p->V, stream)) != FQ_OK) return st;
        if ((st = fq_cuda_poison_if_invalid(fl, p->dg, p->gate_dtype, BT * p->HV, stream)) != FQ_OK) return st;
        if ((st = fq_cuda_poison_if_invalid(fl, p->dbeta, p->gate_dtype, BT * p->HV, stream)) != FQ_OK) return st;
        if (args.dh0 &&
            (st = fq_cuda_poison_if_invalid(fl, args.dh0, FQ_F32, p->N * p->HV * p->K * p->V, stream)) != FQ_OK)
            return st;
    }
    return FQ_OK;
}

extern "C" fq_status fq_cuda_chunk_bwd(const fq_gdn_params *p)
{
    fq_status st = fq_check_params_device(p, 'b');
    if (st != FQ_OK) return st;
    if ((st = fq_cuda_fwd_check_sizes(p)) != FQ_OK) return st;
    int prev = 0;
    FQ_CUDA_CHECK(cudaGetDevice(&prev));
    if (prev != p->device) FQ_CUDA_CHECK(cudaSetDevice(p->device));
    st = fq_cuda_bwd_run(p, NULL);
    if (prev != p->device) {
        cudaError_t e = cudaSetDevice(prev);
        if (st == FQ_OK && e != cudaSuccess)
            st = fq_fail(FQ_ERR_CUDA, "%s:%d: %s", __FILE__, __LINE__, cudaGetErrorString(e));
    }
    return st;
}
