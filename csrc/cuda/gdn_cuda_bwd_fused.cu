/*
 * gdn_cuda_bwd_fused.cu — the backward's bwd_wy stage (step 5 of
 * gdn_cuda_bwd.cu) as bwd_wy, and bwd_local (step 3) further down.
 *
 * Same equations as the first, unfused bwd_wy kernel (removed: git history,
 * commit 4599409); what changes is where the intermediates live:
 * what changes is where the intermediates live:
 *   - one block per (chunk, q/k head); the block loops over the GVA group's
 *     value heads and keeps dK (64 x K, fp32) in mma accumulator registers
 *     across the whole group, so dk is written once, finished: plus the
 *     group's dK_O partials of bwd_local, then the L2-norm backward
 *         k_hat = k r:  dk = r (dk_hat - k_hat (k_hat . dk_hat))
 *     (the removed separate reduction kernel then only ran for dq);
 *   - every 64 x K and 64 x 64 product stays in registers (warp w owns the
 *     16 x 32 tiles at rows 16 (w % 4), columns 32 (w / 4) + 64 i), its
 *     elementwise work (row scales, row/column sums, Gamma, dL) done in the
 *     product's epilogue: no fp32 tile in shared memory;
 *   - the chunk-start state h and dS_next are read 64 state rows at a time
 *     (the products F1 = Vn dS_next^T and dW = -dVn S^T split by output
 *     column), so shared memory is ~105 KB at K = V = 128: two blocks per SM.
 *
 * Also here: bwd_local (the same scheme for step 3, which then finishes
 * dq). The reverse state pass bwd_state is in gdn_cuda_bwd_state.cu.
 *
 * Forward lines differentiated (per chunk, value head; DESIGN §2):
 *   S' = e^{g_C} S + K^T diag(e^{g_C - g}) Vn   -> dK += diag(m) Vn dS'^T,
 *        dgamma_r -= m_r x_r, dgamma_C += sum_r m_r x_r + e^{g_C} <S, dS'>
 *   Vn = U - W S                                -> dW = -dVn S^T, dU = dVn
 *   W  = A diag(b e^g) K                        -> dK += diag(b e^g) A^T dW, ...
 *   U  = A diag(b) V                            -> dV = diag(b) A^T dU, ...
 *   A  = (I + L)^-1                             -> dL = -strict_lower(A^T dA A^T)
 *   L  = strict_lower(diag(b)(K K^T ⊙ Gamma))   -> db, dK += (G + G^T) K, dgamma
 *   gamma = cumsum(g)                           -> dg = reverse cumsum(dgamma)
 */
#include "gdn_cuda_bwd.cuh"

/* c (16 x 32 warp tile at m0, n0) += A[m0.., 0..KD) B[0..KD, n0..]; bf16
 * operands in shared memory. c[jn][e]: row m0 + g + 8 (e / 2), column
 * n0 + 8 jn + 2 t + (e % 2), g = lane / 4, t = lane % 4.
 *   A_KM: A stored transposed [k][m];  B_NK: B stored [n][k].                */
template <int KD, bool A_KM, bool B_NK>
static __device__ __forceinline__ void fq_wtile(float c[4][4], const fq_bf16 *A, int lda, const fq_bf16 *B,
                                                int ldb, int m0, int n0)
{
#pragma unroll 2
    for (int k0 = 0; k0 < KD; k0 += 16) {
        uint32_t a[4];
        if (A_KM) fq_frag_a_trans(a, A, lda, m0, k0);
        else fq_frag_a(a, A, lda, m0, k0);
#pragma unroll
        for (int nb = 0; nb < 2; nb++) {
            uint32_t b[4];
            if (B_NK) fq_frag_b_nk(b, B, ldb, n0 + 16 * nb, k0);
            else fq_frag_b_kn(b, B, ldb, k0, n0 + 16 * nb);
            fq_mma_bf16(c[2 * nb], a, b[0], b[1]);
            fq_mma_bf16(c[2 * nb + 1], a, b[2], b[3]);
        }
    }
}

static __device__ __forceinline__ void fq_zero_tile(float c[4][4])
{
#pragma unroll
    for (int i = 0; i < 4; i++) c[i][0] = c[i][1] = c[i][2] = c[i][3] = 0.f;
}

template <int K, int V> struct fq_bwd_wy_smem {
    static constexpr int MX = K > V ? K : V;
    static constexpr int LDK = K + 8, LDV = V + 8, LDX = MX + 8, LDC = 72;
    static constexpr int off_k = 0;                        /* k_hat rows           */
    static constexpr int off_x = off_k + 64 * LDK * 2;     /* Vn, then dW          */
    static constexpr int off_dvn = off_x + 64 * LDX * 2;   /* dVn = dU             */
    static constexpr int off_a = off_dvn + 64 * LDV * 2;   /* A                    */
    static constexpr int off_m = off_a + 64 * LDC * 2;     /* dA, M1, G (bf16)     */
    static constexpr int off_r = off_m + 64 * LDC * 2;     /* (h, dS') 64 rows | V */
    static constexpr int off_vec = off_r + 2 * 64 * LDV * 2;
    static constexpr int bytes = off_vec + 16 * 64 * 4 + 16 * 4;
};

/* 2 blocks per SM (105 KB at K = V = 128); 1 at K = V = 256 (187 KB), up to
 * 255 registers (dK and dW: 64 fp32 each per thread there) */
template <int K, int V>
__global__ void __launch_bounds__(256, (K > 128 || V > 128) ? 1 : 2) fq_bwd_wy_kernel(fq_bwd_args a)
{
    typedef fq_bwd_wy_smem<K, V> SM;
    constexpr int NTK = K / 64, NTV = V / 64;
    extern __shared__ __align__(16) unsigned char smem[];
    fq_bf16 *sK = (fq_bf16 *)(smem + SM::off_k), *sX = (fq_bf16 *)(smem + SM::off_x);
    fq_bf16 *sdVn = (fq_bf16 *)(smem + SM::off_dvn), *sA = (fq_bf16 *)(smem + SM::off_a);
    fq_bf16 *sM = (fq_bf16 *)(smem + SM::off_m);
    fq_bf16 *sH = (fq_bf16 *)(smem + SM::off_r), *sdS = sH + 64 * SM::LDV, *sV = sH;
    float *sg = (float *)(smem + SM::off_vec), *seg = sg + 64, *sb = sg + 128, *sm = sg + 192;
    float *sdg = sg + 256, *srk = sg + 320;
    /* Deterministic reductions: every partial sum has its own slot with one
     * writer, summed in a fixed order. Row sums: slot [w / 4][row] (the two
     * warps sharing a row); column sums: slot [w % 4][column]; block sums:
     * slot [w]. */
    float *srowp = sg + 384, *sdgp = sg + 512, *sdbp = sg + 640, *scz = sg + 768, *sred = sg + 1024;

    const int c = blockIdx.x, hq = blockIdx.y, HV = a.HV, H = a.H, G = HV / H;
    const fq_chunk_info ci = a.chunks[c];
    if (ci.seq < 0) return;
    const int len = ci.len, tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int g = lane >> 2, t = lane & 3;
    const int wr = 16 * (warp & 3), wc = 32 * (warp >> 2);
    const int64_t qrow = (int64_t)ci.row0 * H + hq;

    if (tid < 64) {
        srk[tid] = (a.rk && tid < len) ? a.rk[(int64_t)(ci.row0 + tid) * H + hq] : 1.f;
        srowp[tid] = srowp[64 + tid] = 0.f;
    }
    fq_async_rows<K>(sK, SM::LDK, a.kb + qrow * K, (int64_t)H * K, 64, len);
    const int c2 = warp >> 2, r4 = warp & 3;

    float dK[NTK][4][4];
#pragma unroll
    for (int i = 0; i < NTK; i++) fq_zero_tile(dK[i]);

    for (int jj = 0; jj < G; jj++) {
        const int j = hq * G + jj;
        const int64_t tile = (int64_t)c * HV + j;
        if (jj > 0) __syncthreads(); /* the previous head is done with every buffer */
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
        fq_async_rows<V>(sX, SM::LDX, a.vn + tile * 64 * V, V, 64, 64);
        fq_async_rows<V>(sdVn, SM::LDV, a.dvl + tile * 64 * V, V, 64, 64);
        fq_async_rows<64>(sA, SM::LDC, a.a + tile * 64 * 64, 64, 64, 64);
        fq_async_rows<V>(sH, SM::LDV, a.h + tile * K * V, V, 64, 64);
        fq_async_rows<V>(sdS, SM::LDV, a.dsl + tile * K * V, V, 64, 64);
        fq_cp_async_commit();
        fq_cp_async_wait<0>();
        /* causality (issue 9): dVn's non-finite elements to zero (this
         * thread's own pieces), so that dv = diag(b) A^T dU never multiplies
         * a structural zero of A^T by the NaN row of an earlier token (a NaN
         * k_t makes dVn row t NaN): dv rows after the chunk's last bad row
         * of a column are exact, the rows up to it (NaN in the reference)
         * finite values of no meaning. Not when the chunk's gamma_C is not
         * finite (a non-finite g: every gamma difference from it on is NaN
         * here, so dv could not be exact; it stays NaN, issue 9 open). */
        if (isfinite(gC_all)) fq_finite_rows<V>(sdVn, SM::LDV, 64);
        __syncthreads();
        if (jj == 0 && a.rk) {
            fq_scale_rows<K>(sK, SM::LDK, srk);
            __syncthreads();
        }
        if (len < 64) { /* A's padding rows/columns -> identity (read after the next barrier) */
            for (int idx = tid; idx < 64 * 64; idx += blockDim.x) {
                const int r = idx >> 6, s = idx & 63;
                if (r >= len || s >= len) sA[r * SM::LDC + s] = __float2bfloat16_rn(r == s ? 1.f : 0.f);
            }
        }

        /* ---- S' term and dW, 64 state rows (= output columns) at a time:
         *      F1 = Vn dS'^T:  dK += diag(m) F1,  x = rowsum(F1 ⊙ K)
         *      dW = -dVn S^T (registers until Vn is dead);  <S, dS'>        */
        float dW[NTK][4][4];
        float xr[2] = {0.f, 0.f}, sdot = 0.f;
#pragma unroll
        for (int i = 0; i < NTK; i++) {
            if (i > 0) {
                __syncthreads();
                fq_async_rows<V>(sH, SM::LDV, a.h + (tile * K + 64 * i) * V, V, 64, 64);
                fq_async_rows<V>(sdS, SM::LDV, a.dsl + (tile * K + 64 * i) * V, V, 64, 64);
                fq_cp_async_commit();
                fq_cp_async_wait<0>();
                __syncthreads();
            }
            fq_zero_tile(dW[i]);
            fq_wtile<V, false, true>(dW[i], sdVn, SM::LDV, sH, SM::LDV, wr, wc);
            float acc[4][4];
            fq_zero_tile(acc);
            fq_wtile<V, false, true>(acc, sX, SM::LDX, sdS, SM::LDV, wr, wc);
#pragma unroll
            for (int jn = 0; jn < 4; jn++)
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    const int r = wr + g + 8 * (e >> 1), kc = 64 * i + wc + 8 * jn + 2 * t + (e & 1);
                    dK[i][jn][e] += sm[r] * acc[jn][e];
                    xr[e >> 1] += acc[jn][e] * fq_bf(sK[r * SM::LDK + kc]);
                }
#pragma unroll 1
            for (int idx = tid; idx < 64 * (V / 8); idx += blockDim.x) {
                const int r = idx / (V / 8), col = (idx % (V / 8)) * 8;
                uint4 hv = *(const uint4 *)(sH + r * SM::LDV + col);
                uint4 dv = *(const uint4 *)(sdS + r * SM::LDV + col);
                const uint32_t *hs = (const uint32_t *)&hv, *ds = (const uint32_t *)&dv;
#pragma unroll
                for (int q = 0; q < 4; q++) {
                    float2 x = fq_unpack_bf16(hs[q]), y = fq_unpack_bf16(ds[q]);
                    sdot += x.x * y.x + x.y * y.y;
                }
            }
        }
        {
            const float x0 = fq_quad_sum(xr[0]), x1 = fq_quad_sum(xr[1]);
            float mx = 0.f;
            if (t == 0) {
                const int r0 = wr + g;
                sdgp[64 * c2 + r0] -= sm[r0] * x0;
                sdgp[64 * c2 + r0 + 8] -= sm[r0 + 8] * x1;
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
        __syncthreads(); /* Vn, h, dS' dead */

        /* dW (bf16) over Vn; V rows into the (h, dS') region */
#pragma unroll
        for (int i = 0; i < NTK; i++)
#pragma unroll
            for (int jn = 0; jn < 4; jn++) {
                const int r = wr + g, col = 64 * i + wc + 8 * jn + 2 * t;
                *(uint32_t *)(sX + r * SM::LDX + col) = fq_pack_bf16(-dW[i][jn][0], -dW[i][jn][1]);
                *(uint32_t *)(sX + (r + 8) * SM::LDX + col) = fq_pack_bf16(-dW[i][jn][2], -dW[i][jn][3]);
            }
        fq_async_rows<V>(sV, SM::LDV, a.vb + ((int64_t)ci.row0 * HV + j) * V, (int64_t)HV * V, 64, len);
        fq_cp_async_commit();
        fq_cp_async_wait<0>();
        /* causality (issue 9): V's non-finite elements to zero (this thread's
         * own pieces), so that dA = ... + dVn V^T diag(b) has no NaN column
         * for A^T dA A^T to spread over the structural zeros of A: the
         * columns c < t of dA (and so dL, dk, dbeta of the rows before a
         * NaN v_t, and dg up to t) stay exact */
        fq_finite_rows<V>(sV, SM::LDV, 64);
        __syncthreads();

        /* F2 = A^T dW:  dK += diag(b e^g) F2;  xw = rowsum(F2 ⊙ K): db += e^g xw, dgamma += b e^g xw */
        {
            float xw[2] = {0.f, 0.f};
#pragma unroll
            for (int i = 0; i < NTK; i++) {
                float acc[4][4];
                fq_zero_tile(acc);
                fq_wtile<64, true, false>(acc, sA, SM::LDC, sX, SM::LDX, wr, 64 * i + wc);
#pragma unroll
                for (int jn = 0; jn < 4; jn++)
#pragma unroll
                    for (int e = 0; e < 4; e++) {
                        const int r = wr + g + 8 * (e >> 1), kc = 64 * i + wc + 8 * jn + 2 * t + (e & 1);
                        dK[i][jn][e] += sb[r] * seg[r] * acc[jn][e];
                        xw[e >> 1] += acc[jn][e] * fq_bf(sK[r * SM::LDK + kc]);
                    }
            }
            const float x0 = fq_quad_sum(xw[0]), x1 = fq_quad_sum(xw[1]);
            if (t == 0) {
                const int r0 = wr + g, r1 = r0 + 8;
                sdbp[64 * c2 + r0] += seg[r0] * x0;
                sdbp[64 * c2 + r1] += seg[r1] * x1;
                sdgp[64 * c2 + r0] += sb[r0] * seg[r0] * x0;
                sdgp[64 * c2 + r1] += sb[r1] * seg[r1] * x1;
            }
        }
        /* F3 = A^T dU:  dv = diag(b) F3;  db += rowsum(F3 ⊙ V) */
        {
            float xv[2] = {0.f, 0.f};
#pragma unroll
            for (int i = 0; i < NTV; i++) {
                float acc[4][4];
                fq_zero_tile(acc);
                fq_wtile<64, true, false>(acc, sA, SM::LDC, sdVn, SM::LDV, wr, 64 * i + wc);
#pragma unroll
                for (int jn = 0; jn < 4; jn++)
#pragma unroll
                    for (int h = 0; h < 2; h++) {
                        const int r = wr + g + 8 * h, col = 64 * i + wc + 8 * jn + 2 * t;
                        const float x0 = acc[jn][2 * h], x1 = acc[jn][2 * h + 1];
                        if (r < len)
                            fq_st_f2(a.dv, a.dt, ((int64_t)(ci.row0 + r) * HV + j) * V + col, sb[r] * x0, sb[r] * x1);
                        const float2 vv = fq_unpack_bf16(*(const uint32_t *)(sV + r * SM::LDV + col));
                        xv[h] += x0 * vv.x + x1 * vv.y;
                    }
            }
            const float x0 = fq_quad_sum(xv[0]), x1 = fq_quad_sum(xv[1]);
            if (t == 0) {
                sdbp[64 * c2 + wr + g] += x0;
                sdbp[64 * c2 + wr + g + 8] += x1;
            }
        }
        /* dA = dW K^T diag(b e^g) + dVn V^T diag(b)  -> sM (bf16); its
         * non-finite entries to zero by a select (causality, issue 9: a NaN
         * beta_t makes column t NaN, which A^T dA A^T would spread over the
         * structural zeros of A; dL's columns c < t, and so dbeta_t, need
         * only dA's columns c < t) */
        {
            float d1[4][4], d2[4][4];
            fq_zero_tile(d1);
            fq_zero_tile(d2);
            fq_wtile<K, false, true>(d1, sX, SM::LDX, sK, SM::LDK, wr, wc);
            fq_wtile<V, false, true>(d2, sdVn, SM::LDV, sV, SM::LDV, wr, wc);
#pragma unroll
            for (int jn = 0; jn < 4; jn++) {
                const int s = wc + 8 * jn + 2 * t, r = wr + g;
                const float f0 = sb[s] * seg[s], f1 = sb[s + 1] * seg[s + 1], b0 = sb[s], b1 = sb[s + 1];
                float x[4];
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    const float y = d1[jn][e] * ((e & 1) ? f1 : f0) + d2[jn][e] * ((e & 1) ? b1 : b0);
                    x[e] = isfinite(y) ? y : 0.f;
                }
                *(uint32_t *)(sM + r * SM::LDC + s) = fq_pack_bf16(x[0], x[1]);
                *(uint32_t *)(sM + (r + 8) * SM::LDC + s) = fq_pack_bf16(x[2], x[3]);
            }
        }
        __syncthreads();

        /* M1 = A^T dA -> sM */
        {
            float m1[4][4];
            fq_zero_tile(m1);
            fq_wtile<64, true, false>(m1, sA, SM::LDC, sM, SM::LDC, wr, wc);
            __syncthreads();
#pragma unroll
            for (int jn = 0; jn < 4; jn++) {
                const int s = wc + 8 * jn + 2 * t, r = wr + g;
                *(uint32_t *)(sM + r * SM::LDC + s) = fq_pack_bf16(m1[jn][0], m1[jn][1]);
                *(uint32_t *)(sM + (r + 8) * SM::LDC + s) = fq_pack_bf16(m1[jn][2], m1[jn][3]);
            }
        }
        __syncthreads();

        /* M2 = M1 A^T, dL = -strict_lower(M2); with KK = K K^T and Gamma:
         *   y = dL ⊙ KK ⊙ Gamma: db += rowsum(y);  z = diag(b) y: dgamma += rowsum(z) - colsum(z)
         *   Gl = diag(b) dL ⊙ Gamma (strict lower) -> sM, for dK += (Gl + Gl^T) K */
        {
            float m2[4][4], kk[4][4];
            fq_zero_tile(m2);
            fq_zero_tile(kk);
            fq_wtile<64, false, true>(m2, sM, SM::LDC, sA, SM::LDC, wr, wc);
            fq_wtile<K, false, true>(kk, sK, SM::LDK, sK, SM::LDK, wr, wc);
            float ry[2] = {0.f, 0.f}, rz[2] = {0.f, 0.f}, cz[4][2];
            uint32_t gl[4][2];
#pragma unroll
            for (int jn = 0; jn < 4; jn++) {
                cz[jn][0] = cz[jn][1] = 0.f;
#pragma unroll
                for (int h = 0; h < 2; h++) {
                    const int r = wr + g + 8 * h;
                    float gv[2];
#pragma unroll
                    for (int e2 = 0; e2 < 2; e2++) {
                        const int s = wc + 8 * jn + 2 * t + e2;
                        gv[e2] = 0.f;
                        if (r > s) {
                            const float Gm = __expf(sg[r] - sg[s]);
                            const float dL = -m2[jn][2 * h + e2];
                            const float y = dL * kk[jn][2 * h + e2] * Gm;
                            const float z = sb[r] * y;
                            ry[h] += y;
                            rz[h] += z;
                            cz[jn][e2] += z;
                            gv[e2] = sb[r] * dL * Gm;
                        }
                    }
                    gl[jn][h] = fq_pack_bf16(gv[0], gv[1]);
                }
            }
#pragma unroll
            for (int h = 0; h < 2; h++) {
                const float y = fq_quad_sum(ry[h]), z = fq_quad_sum(rz[h]);
                if (t == 0) {
                    sdbp[64 * c2 + wr + g + 8 * h] += y;
                    sdgp[64 * c2 + wr + g + 8 * h] += z;
                }
            }
#pragma unroll
            for (int jn = 0; jn < 4; jn++)
#pragma unroll
                for (int e2 = 0; e2 < 2; e2++) {
                    float z = cz[jn][e2];
                    z += __shfl_xor_sync(0xffffffffu, z, 4);
                    z += __shfl_xor_sync(0xffffffffu, z, 8);
                    z += __shfl_xor_sync(0xffffffffu, z, 16);
                    if (g == 0) scz[64 * r4 + wc + 8 * jn + 2 * t + e2] = z;
                }
            __syncthreads(); /* every warp done with M1 */
#pragma unroll
            for (int jn = 0; jn < 4; jn++) {
                const int s = wc + 8 * jn + 2 * t, r = wr + g;
                *(uint32_t *)(sM + r * SM::LDC + s) = gl[jn][0];
                *(uint32_t *)(sM + (r + 8) * SM::LDC + s) = gl[jn][1];
            }
        }
        __syncthreads(); /* Gl complete; dgamma, db of this head complete */

        /* dK += Gl K + Gl^T K */
#pragma unroll
        for (int i = 0; i < NTK; i++) {
            fq_wtile<64, false, false>(dK[i], sM, SM::LDC, sK, SM::LDK, wr, 64 * i + wc);
            fq_wtile<64, true, false>(dK[i], sM, SM::LDC, sK, SM::LDK, wr, 64 * i + wc);
        }

        /* dg = reverse cumsum of dgamma; dbeta (warp 0: two rows per lane) */
        if (warp == 0) fq_bwd_dg_dbeta(a, sdg, sdgp, scz, sdbp, sred, sg[63], len, ci.row0, j, lane);
    }

    /* dk_hat = sum over the group of (this stage's dK + bwd_local's dK_O);
     * then the L2-norm backward, and dk in the input dtype. */
    fq_bwd_dx_store<4 * NTK, true>(a, a.k, a.dk, &dK[0][0][0], a.dkp + ((int64_t)ci.row0 * H + hq) * K,
                                   a.rk ? srk : (const float *)NULL, srowp, c2, wr + g,
                                   [&](int nb) { return 64 * (nb >> 2) + wc + 8 * (nb & 3) + 2 * t; }, len, qrow, K);
}

/* Two blocks per SM need the largest shared-memory carveout (a hint; set once
 * per kernel and device). */
static fq_status fq_bwd_carveout(const void *fn)
{
    return fq_cuda_func_attr(fn, cudaFuncAttributePreferredSharedMemoryCarveout, 100);
}

/* ===================================================== bwd_local ==== */

/* 64 x 64 bf16 tiles without padding, 16-byte chunks XOR-swizzled by row:
 * element (r, s) at r * 64 + 8 ((s / 8) ^ (r % 8)) + s % 8. ldmatrix rows of
 * one 8x8 matrix then fall in 8 different bank groups. */
static __device__ __forceinline__ int fq_sw64(int r, int s)
{
    return r * 64 + ((((s >> 3) ^ r) & 7) << 3) + (s & 7);
}

/* c (16 x 32 at m0, n0) += A B with A (64 x 64) a swizzled tile (A_KM: the
 * tile stores A transposed) and B stored [k][n] with row stride ldb. If bs is
 * non-NULL, row k of B is multiplied by bs[k] in registers first. */
template <bool A_KM>
static __device__ __forceinline__ void fq_wtile_sw(float c[4][4], const fq_bf16 *A, const fq_bf16 *B, int ldb,
                                                   int m0, int n0, const float *bs)
{
    const int l = threadIdx.x & 31, t = l & 3;
#pragma unroll 2
    for (int k0 = 0; k0 < 64; k0 += 16) {
        uint32_t a[4];
        if (A_KM) {
            const int mi = l >> 3, row = k0 + (l & 7) + (mi >> 1) * 8, col = m0 + (mi & 1) * 8;
            fq_ldsm_x4_trans(a, fq_smem_u32(A + fq_sw64(row, col)));
        } else {
            const int row = m0 + (l & 7) + ((l >> 3) & 1) * 8, col = k0 + (l >> 4) * 8;
            fq_ldsm_x4(a, fq_smem_u32(A + fq_sw64(row, col)));
        }
        float f0 = 1.f, f1 = 1.f, f8 = 1.f, f9 = 1.f;
        if (bs) {
            f0 = bs[k0 + 2 * t];
            f1 = bs[k0 + 2 * t + 1];
            f8 = bs[k0 + 2 * t + 8];
            f9 = bs[k0 + 2 * t + 9];
        }
#pragma unroll
        for (int nb = 0; nb < 2; nb++) {
            uint32_t b[4];
            fq_frag_b_kn(b, B, ldb, k0, n0 + 16 * nb);
            if (bs) { /* b[0], b[2]: rows k0 + 2t, +1;  b[1], b[3]: rows k0 + 8 + 2t, +1 */
#pragma unroll
                for (int q = 0; q < 4; q++) {
                    const float2 x = fq_unpack_bf16(b[q]);
                    b[q] = (q & 1) ? fq_pack_bf16(x.x * f8, x.y * f9) : fq_pack_bf16(x.x * f0, x.y * f1);
                }
            }
            fq_mma_bf16(c[2 * nb], a, b[0], b[1]);
            fq_mma_bf16(c[2 * nb + 1], a, b[2], b[3]);
        }
    }
}

/* HS: h's rows in shared memory at once: all K (h as a second cp.async
 * group), or at K = 256 64-row slices, loaded one after the other inside
 * the F = dO S^T loop (the whole h would be 132 KB: 270 KB in all); 172 KB
 * then, one block per SM. */
template <int K, int V> struct fq_bwd_local_smem {
    static constexpr int LDK = K + 8, LDV = V + 8;
    static constexpr int HS = K > 128 ? 64 : K;
    static constexpr int off_q = 0;                        /* q_hat rows                */
    static constexpr int off_k = off_q + 64 * LDK * 2;     /* k_hat rows                */
    static constexpr int off_do = off_k + 64 * LDK * 2;    /* dO                        */
    static constexpr int off_vn = off_do + 64 * LDV * 2;   /* Vn, then P | dP (swizzled) */
    static constexpr int vn_bytes = 64 * LDV * 2 > 2 * 64 * 64 * 2 ? 64 * LDV * 2 : 2 * 64 * 64 * 2;
    static constexpr int off_h = off_vn + vn_bytes;        /* chunk-start state, K x V  */
    static constexpr int off_vec = off_h + HS * LDV * 2;
    static constexpr int bytes = off_vec + 12 * 64 * 4;
    static constexpr int per_sm = K > 128 ? 1 : 2; /* blocks per SM (shared memory) */
};

/* Forward line:  O = scale (diag(e^g) Q S + P Vn),  P = lower_incl(Q K^T ⊙ Gamma)
 *   dv_local = scale P^T dO                          (bf16 -> a.dvl, for bwd_state)
 *   dP       = scale (dO Vn^T) ⊙ Gamma (lower incl.);  Z = dP ⊙ Q K^T
 *   F        = diag(scale e^g) dO S^T
 *   dQ       = F + dP K                (summed over the GVA group in registers)
 *   dK_O     = dP^T Q                  (summed likewise -> a.dkp, group slot)
 *   dgamma   = rowsum(F ⊙ Q) + rowsum(Z) - colsum(Z)           (-> a.dgam)
 *   dS_local = Q^T diag(scale e^g) dO  (K x V, bf16 -> a.dsl, for bwd_state)
 * then dq = r (dq_hat - q_hat (q_hat . dq_hat)) with use_qk_l2norm.          */
template <int K, int V, bool SPLIT_H>
__global__ void __launch_bounds__(256, fq_bwd_local_smem<K, V>::per_sm) fq_bwd_local_kernel(fq_bwd_args a)
{
    typedef fq_bwd_local_smem<K, V> SM;
    static_assert(SM::HS == K || SPLIT_H, "h in slices needs SPLIT_H");
    constexpr int NTK = K / 64, NTV = V / 64;
    extern __shared__ __align__(16) unsigned char smem[];
    fq_bf16 *sQ = (fq_bf16 *)(smem + SM::off_q), *sK = (fq_bf16 *)(smem + SM::off_k);
    fq_bf16 *sdO = (fq_bf16 *)(smem + SM::off_do), *sVn = (fq_bf16 *)(smem + SM::off_vn);
    fq_bf16 *sP = sVn, *sdP = sVn + 64 * 64, *sH = (fq_bf16 *)(smem + SM::off_h);
    float *sg = (float *)(smem + SM::off_vec), *sfo = sg + 64, *srq = sg + 128, *srk = sg + 192;
    /* deterministic reductions as in bwd_wy: row-sum slots [w / 4][row],
     * column-sum slots [w % 4][column] */
    float *srowp = sg + 256, *sdgp = sg + 384, *scz = sg + 512;

    const int c = blockIdx.x, hq = blockIdx.y, HV = a.HV, H = a.H, G = HV / H;
    const fq_chunk_info ci = a.chunks[c];
    if (ci.seq < 0) return;
    const int len = ci.len, tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int g = lane >> 2, t = lane & 3;
    const int wr = 16 * (warp & 3), wc = 32 * (warp >> 2);
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
    const int c2 = warp >> 2, r4 = warp & 3;
    fq_async_rows<K>(sQ, SM::LDK, a.qb + qrow * K, (int64_t)H * K, 64, len);
    fq_async_rows<K>(sK, SM::LDK, a.kb + qrow * K, (int64_t)H * K, 64, len);

    float dQ[NTK][4][4];
#pragma unroll
    for (int i = 0; i < NTK; i++) fq_zero_tile(dQ[i]);
    /* dK_O is summed over the group in a.dkp ([B*T, H, K]): each thread adds
     * to the elements it wrote itself for the previous head, so no
     * synchronisation is needed and the registers stay free. */
    float *dko = a.dkp + ((int64_t)ci.row0 * H + hq) * K;

    for (int jj = 0; jj < G; jj++) {
        const int j = hq * G + jj;
        const int64_t tile = (int64_t)c * HV + j;
        if (jj > 0) __syncthreads(); /* the previous head is done with dO, Vn/P/dP, h, sdg */
        if (tid < 64) {
            const float gm = a.gamma[tile * 64 + tid];
            sg[tid] = gm;
            sfo[tid] = a.scale * __expf(gm);
            sdgp[tid] = sdgp[64 + tid] = 0.f;
        }
        fq_async_rows<V>(sVn, SM::LDV, a.vn + tile * 64 * V, V, 64, 64);
        if (!SPLIT_H) fq_async_rows<V>(sH, SM::LDV, a.h + tile * K * V, V, K, K);
        if (a.dout_async) {
            fq_async_rows<V>(sdO, SM::LDV, (const fq_bf16 *)a.dout + ((int64_t)ci.row0 * HV + j) * V,
                             (int64_t)HV * V, 64, len);
        } else {
            for (int idx = tid; idx < 64 * V / 2; idx += blockDim.x) {
                const int r = idx / (V / 2), col = (idx % (V / 2)) * 2;
                float x = 0.f, y = 0.f;
                if (r < len) {
                    const int64_t o = ((int64_t)(ci.row0 + r) * HV + j) * V + col;
                    x = fq_ld_f(a.dout, a.dt, o);
                    y = fq_ld_f(a.dout, a.dt, o + 1);
                }
                *(uint32_t *)(sdO + r * SM::LDV + col) = fq_pack_bf16(x, y);
            }
        }
        fq_cp_async_commit();
        if (SPLIT_H) { /* h is first needed by dO S^T: its load overlaps the products before
                        * (at K = 256 its first 64-row slice; the others in the F loop) */
            fq_async_rows<V>(sH, SM::LDV, a.h + tile * K * V, V, SM::HS, SM::HS);
            fq_cp_async_commit();
            fq_cp_async_wait<1>();
        } else {
            fq_cp_async_wait<0>();
        }
        /* causality (issue 9): K's non-finite elements to zero, so that dQ's
         * dP K never multiplies a structural zero of dP (above the diagonal)
         * by a NaN of a later token (this thread's own pieces; after the
         * scaling with use_qk_l2norm, whose rk of a NaN row is NaN) */
        if (jj == 0 && !a.rq) fq_finite_rows<K>(sK, SM::LDK, 64);
        __syncthreads();
        if (jj == 0 && a.rq) {
            fq_scale_rows<K>(sQ, SM::LDK, srq);
            fq_scale_rows<K>(sK, SM::LDK, srk);
            fq_finite_rows<K>(sK, SM::LDK, 64);
            __syncthreads();
        }

        /* Q K^T and dO Vn^T on the warp's 16 x 32 tile; P, dP, Z in registers */
        uint32_t pp[4][2], dpp[4][2];
        {
            float qk[4][4], dv[4][4];
            fq_zero_tile(qk);
            fq_zero_tile(dv);
            fq_wtile<K, false, true>(qk, sQ, SM::LDK, sK, SM::LDK, wr, wc);
            fq_wtile<V, false, true>(dv, sdO, SM::LDV, sVn, SM::LDV, wr, wc);
            float rz[2] = {0.f, 0.f}, cz[4][2];
#pragma unroll
            for (int jn = 0; jn < 4; jn++) {
                cz[jn][0] = cz[jn][1] = 0.f;
#pragma unroll
                for (int h = 0; h < 2; h++) {
                    const int r = wr + g + 8 * h;
                    float pv[2], dpv[2];
#pragma unroll
                    for (int e2 = 0; e2 < 2; e2++) {
                        const int s = wc + 8 * jn + 2 * t + e2;
                        /* lower_incl by selects (causality: never 0 * a non-finite value) */
                        const float Gm = __expf(sg[r] - sg[s]);
                        const float x = qk[jn][2 * h + e2];
                        pv[e2] = r >= s ? x * Gm : 0.f;
                        dpv[e2] = r >= s ? a.scale * dv[jn][2 * h + e2] * Gm : 0.f;
                        const float z = r >= s ? dpv[e2] * x : 0.f;
                        rz[h] += z;
                        cz[jn][e2] += z;
                    }
                    pp[jn][h] = fq_pack_bf16(pv[0], pv[1]);
                    dpp[jn][h] = fq_pack_bf16(dpv[0], dpv[1]);
                }
            }
#pragma unroll
            for (int h = 0; h < 2; h++) {
                const float z = fq_quad_sum(rz[h]);
                if (t == 0) sdgp[64 * c2 + wr + g + 8 * h] = z;
            }
#pragma unroll
            for (int jn = 0; jn < 4; jn++)
#pragma unroll
                for (int e2 = 0; e2 < 2; e2++) {
                    float z = cz[jn][e2];
                    z += __shfl_xor_sync(0xffffffffu, z, 4);
                    z += __shfl_xor_sync(0xffffffffu, z, 8);
                    z += __shfl_xor_sync(0xffffffffu, z, 16);
                    if (g == 0) scz[64 * r4 + wc + 8 * jn + 2 * t + e2] = z;
                }
        }
        __syncthreads(); /* every warp done with Vn */
#pragma unroll
        for (int jn = 0; jn < 4; jn++) {
            const int s = wc + 8 * jn + 2 * t, r = wr + g;
            *(uint32_t *)(sP + fq_sw64(r, s)) = pp[jn][0];
            *(uint32_t *)(sP + fq_sw64(r + 8, s)) = pp[jn][1];
            *(uint32_t *)(sdP + fq_sw64(r, s)) = dpp[jn][0];
            *(uint32_t *)(sdP + fq_sw64(r + 8, s)) = dpp[jn][1];
        }
        if (SPLIT_H) fq_cp_async_wait<0>();
        __syncthreads();

        /* dS_local = Q^T diag(scale e^g) dO: K x V, tiles at rows 16 (w % 4) + 64 ir */
#pragma unroll 1
        for (int ir = 0; ir < NTK; ir++)
#pragma unroll 1
            for (int ic = 0; ic < NTV; ic++) {
                float acc[4][4];
                fq_zero_tile(acc);
                /* A = Q^T: Q stored [r][kidx] = [k][m] */
#pragma unroll 2
                for (int k0 = 0; k0 < 64; k0 += 16) {
                    uint32_t af[4];
                    fq_frag_a_trans(af, sQ, SM::LDK, wr + 64 * ir, k0);
                    const float f0 = sfo[k0 + 2 * t], f1 = sfo[k0 + 2 * t + 1];
                    const float f8 = sfo[k0 + 2 * t + 8], f9 = sfo[k0 + 2 * t + 9];
#pragma unroll
                    for (int nb = 0; nb < 2; nb++) {
                        uint32_t b[4];
                        fq_frag_b_kn(b, sdO, SM::LDV, k0, 64 * ic + wc + 16 * nb);
#pragma unroll
                        for (int q = 0; q < 4; q++) {
                            const float2 x = fq_unpack_bf16(b[q]);
                            b[q] = (q & 1) ? fq_pack_bf16(x.x * f8, x.y * f9) : fq_pack_bf16(x.x * f0, x.y * f1);
                        }
                        fq_mma_bf16(acc[2 * nb], af, b[0], b[1]);
                        fq_mma_bf16(acc[2 * nb + 1], af, b[2], b[3]);
                    }
                }
                fq_bf16 *dst = a.dsl + tile * K * V;
#pragma unroll
                for (int jn = 0; jn < 4; jn++) {
                    const int r = wr + 64 * ir + g, col = 64 * ic + wc + 8 * jn + 2 * t;
                    *(uint32_t *)(dst + r * V + col) = fq_pack_bf16(acc[jn][0], acc[jn][1]);
                    *(uint32_t *)(dst + (r + 8) * V + col) = fq_pack_bf16(acc[jn][2], acc[jn][3]);
                }
            }
        /* F = diag(scale e^g) dO S^T:  dgamma += rowsum(F ⊙ Q);  dQ += F + dP K;  dK_O += dP^T Q */
        {
            float xr[2] = {0.f, 0.f};
#pragma unroll
            for (int i = 0; i < NTK; i++) {
                if (SM::HS < K && i > 0) {
                    /* K = 256: h rows 64 i .. 64 i + 63 into the slice, once
                     * every warp is done with the one before */
                    __syncthreads();
                    fq_async_rows<V>(sH, SM::LDV, a.h + (tile * K + 64 * i) * V, V, 64, 64);
                    fq_cp_async_commit();
                    fq_cp_async_wait<0>();
                    __syncthreads();
                }
                const fq_bf16 *sHi = sH + (SM::HS < K ? 0 : 64 * i * SM::LDV); /* h rows 64 i .. */
                float acc[4][4];
                fq_zero_tile(acc);
                fq_wtile<V, false, true>(acc, sdO, SM::LDV, sHi, SM::LDV, wr, wc);
#pragma unroll
                for (int jn = 0; jn < 4; jn++)
#pragma unroll
                    for (int e = 0; e < 4; e++) {
                        const int r = wr + g + 8 * (e >> 1), kc = 64 * i + wc + 8 * jn + 2 * t + (e & 1);
                        const float f = sfo[r] * acc[jn][e];
                        xr[e >> 1] += f * fq_bf(sQ[r * SM::LDK + kc]);
                        dQ[i][jn][e] += f;
                    }
                fq_wtile_sw<false>(dQ[i], sdP, sK, SM::LDK, wr, 64 * i + wc, NULL);
                fq_zero_tile(acc);
                fq_wtile_sw<true>(acc, sdP, sQ, SM::LDK, wr, 64 * i + wc, NULL);
#pragma unroll
                for (int jn = 0; jn < 4; jn++)
#pragma unroll
                    for (int h = 0; h < 2; h++) {
                        const int r = wr + g + 8 * h, col = 64 * i + wc + 8 * jn + 2 * t;
                        if (r < len) {
                            float2 *pk = (float2 *)(dko + (int64_t)r * H * K + col);
                            float2 x = make_float2(acc[jn][2 * h], acc[jn][2 * h + 1]);
                            if (jj > 0) {
                                const float2 y = *pk;
                                x.x += y.x;
                                x.y += y.y;
                            }
                            *pk = x;
                        }
                    }
            }
#pragma unroll
            for (int h = 0; h < 2; h++) {
                const float x = fq_quad_sum(xr[h]);
                if (t == 0) sdgp[64 * c2 + wr + g + 8 * h] += x;
            }
        }
        /* causality (issue 9): does dO hold a non-finite element? (a share
         * of the tile per thread, reduced by the barrier) */
        const int do_bad_mine = fq_nonfinite_rows<V>(sdO, SM::LDV, 64);
        /* dgamma complete; every warp done with dO for dS_local and F */
        const int do_bad = __syncthreads_or(do_bad_mine);
        if (tid < 64)
            a.dgam[tile * 64 + tid] =
                sdgp[tid] + sdgp[64 + tid] - (scz[tid] + scz[64 + tid] + scz[128 + tid] + scz[192 + tid]);
        if (do_bad) { /* causality, rare (block-uniform): dO's non-finite elements to zero for P^T dO */
            fq_finite_rows<V>(sdO, SM::LDV, 64);
            __syncthreads();
        }

        /* dv_local = scale P^T dO. Last, so that in a chunk whose dO holds a
         * non-finite element (causality, issue 9) it can use dO with those
         * zeroed (above): P^T dO multiplies the structural zeros of P^T
         * (P[r][s] = 0 for r < s) by dO's rows, so a NaN dO_t would reach
         * every row s > t; with the zeros, rows s > t (those after the last
         * bad row of a column) are exact, rows s <= t finite values of no
         * meaning (the reference's dv there is NaN). dS_local, F, dP keep the
         * NaN (the chain to earlier chunks and dh0 carries it). */
#pragma unroll
        for (int i = 0; i < NTV; i++) {
            float acc[4][4];
            fq_zero_tile(acc);
            fq_wtile_sw<true>(acc, sP, sdO, SM::LDV, wr, 64 * i + wc, NULL);
            fq_bf16 *dst = a.dvl + tile * 64 * V;
#pragma unroll
            for (int jn = 0; jn < 4; jn++) {
                const int r = wr + g, col = 64 * i + wc + 8 * jn + 2 * t;
                *(uint32_t *)(dst + r * V + col) = fq_pack_bf16(a.scale * acc[jn][0], a.scale * acc[jn][1]);
                *(uint32_t *)(dst + (r + 8) * V + col) = fq_pack_bf16(a.scale * acc[jn][2], a.scale * acc[jn][3]);
            }
        }
    }

    /* dq = dq_hat, or its L2-norm backward */
    fq_bwd_dx_store<4 * NTK, false>(a, a.q, a.dq, &dQ[0][0][0], (const float *)NULL, a.rq ? srq : (const float *)NULL,
                                    srowp, c2, wr + g,
                                    [&](int nb) { return 64 * (nb >> 2) + wc + 8 * (nb & 3) + 2 * t; }, len, qrow, K);
}

template <int K, int V, bool SPLIT_H>
static fq_status fq_bwd_local_launch_kv(const fq_bwd_args &a, int64_t nc, int H, cudaStream_t stream)
{
    const int bytes = fq_bwd_local_smem<K, V>::bytes;
    const void *fn = (const void *)fq_bwd_local_kernel<K, V, SPLIT_H>;
    fq_status st = fq_cuda_set_smem(fn, bytes);
    if (st != FQ_OK) return st;
    if ((st = fq_bwd_carveout(fn)) != FQ_OK) return st;
    fq_bwd_local_kernel<K, V, SPLIT_H><<<dim3((unsigned)nc, (unsigned)H), 256, bytes, stream>>>(a);
    FQ_CUDA_CHECK_LAUNCH();
    return FQ_OK;
}

/* SPLIT_H = true only (h as a second cp.async group, as measured); false (h
 * in the first group, an earlier layout) is no longer instantiated. */
fq_status fq_bwd_local_launch(const fq_gdn_params *p, const fq_bwd_args &a, int64_t nc, cudaStream_t stream)
{
    if (nc <= 0) return FQ_OK;
    int done = 0; /* K = V = 128 on sm_90a: the wgmma kernel (gdn_cuda_bwd_fused_sm90.cu) */
    fq_status st = fq_bwd_local90_launch(p, a, nc, stream, &done);
    if (st != FQ_OK || done) return st;
    if (a.dkw) /* (bwd_rev90's path implies the sm_90a kernel's) */
        return fq_fail(FQ_ERR_INTERNAL, "fq_bwd_local_launch: finishing bwd_rev90's dk needs the sm_90a kernel");
    const int H = (int)p->H;
    if (p->K == 128 && p->V == 128) return fq_bwd_local_launch_kv<128, 128, true>(a, nc, H, stream);
    if (p->K == 128 && p->V == 64) return fq_bwd_local_launch_kv<128, 64, true>(a, nc, H, stream);
    if (p->K == 64 && p->V == 128) return fq_bwd_local_launch_kv<64, 128, true>(a, nc, H, stream);
    if (p->K == 64 && p->V == 64) return fq_bwd_local_launch_kv<64, 64, true>(a, nc, H, stream);
    if (p->K == 256 && p->V == 256) return fq_bwd_local_launch_kv<256, 256, true>(a, nc, H, stream); /* issue 7 item 4 */
    return fq_cuda_head_dims_unsupported(p);
}

template <int K, int V>
static fq_status fq_bwd_wy_launch_kv(const fq_bwd_args &a, int64_t nc, int H, cudaStream_t stream)
{
    const int bytes = fq_bwd_wy_smem<K, V>::bytes;
    const void *fn = (const void *)fq_bwd_wy_kernel<K, V>;
    fq_status st = fq_cuda_set_smem(fn, bytes);
    if (st != FQ_OK) return st;
    if ((st = fq_bwd_carveout(fn)) != FQ_OK) return st;
    fq_bwd_wy_kernel<K, V><<<dim3((unsigned)nc, (unsigned)H), 256, bytes, stream>>>(a);
    FQ_CUDA_CHECK_LAUNCH();
    return FQ_OK;
}

fq_status fq_bwd_wy_launch(const fq_gdn_params *p, const fq_bwd_args &a, int64_t nc, cudaStream_t stream)
{
    if (nc <= 0) return FQ_OK;
    int done = 0; /* K = V = 128 on sm_90a: the wgmma kernel (gdn_cuda_bwd_fused_sm90.cu) */
    fq_status st = fq_bwd_wy90_launch(p, a, nc, stream, &done);
    if (st != FQ_OK || done) return st;
    const int H = (int)p->H;
    if (p->K == 128 && p->V == 128) return fq_bwd_wy_launch_kv<128, 128>(a, nc, H, stream);
    if (p->K == 128 && p->V == 64) return fq_bwd_wy_launch_kv<128, 64>(a, nc, H, stream);
    if (p->K == 64 && p->V == 128) return fq_bwd_wy_launch_kv<64, 128>(a, nc, H, stream);
    if (p->K == 64 && p->V == 64) return fq_bwd_wy_launch_kv<64, 64>(a, nc, H, stream);
    if (p->K == 256 && p->V == 256) return fq_bwd_wy_launch_kv<256, 256>(a, nc, H, stream); /* issue 7 item 4 */
    return fq_cuda_head_dims_unsupported(p);
}
