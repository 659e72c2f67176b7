/*
 * dev/cuda/check_wgmma.cu — checks the wgmma wrappers of
 * csrc/cuda/gdn_cuda_hopper.cuh against a CPU product, one call per operand
 * form the fused forward uses (SWIZZLE_128B tiles written as TMA writes them,
 * register A fragments built from accumulator layouts, K-major and MN-major
 * B, the N = 128 form over two tiles, negated A, accumulate on/off).
 *
 *   nvcc -std=c++17 -O3 -Icsrc -Icsrc/cuda -gencode arch=compute_90a,code=sm_90a \
 *        -o /tmp/check_wgmma dev/cuda/check_wgmma.cu && /tmp/check_wgmma
 */
#include <cuda_runtime.h>
#include <cuda_bf16.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cuda/gdn_cuda_hopper.cuh"
#include "check_common.h"

/* tile t (64 x 64 bf16, [row][col]) of a row-major host matrix M (ld cols),
 * written into a SWIZZLE_128B shared tile */
static __device__ void put_tile(unsigned char *tile, const __nv_bfloat16 *M, int ld, int r0, int c0)
{
    for (int idx = threadIdx.x; idx < 64 * 64; idx += blockDim.x) {
        int r = idx / 64, c = idx % 64;
        *(__nv_bfloat16 *)(tile + fq_sw128(r, 2 * c)) = M[(r0 + r) * ld + c0 + c];
    }
}

/* A fragment (warp w rows 16w.., K-step kk) of a row-major bf16 matrix in global memory. */
static __device__ void frag_a(uint32_t a[4], const __nv_bfloat16 *M, int ld, int kk)
{
    int l = threadIdx.x & 31, w = threadIdx.x >> 5, g = l >> 2, t = l & 3;
    int r = 16 * w + g, c = 16 * kk + 2 * t;
    auto pk = [&](int rr, int cc) {
        __nv_bfloat162 v;
        v.x = M[rr * ld + cc];
        v.y = M[rr * ld + cc + 1];
        return *(uint32_t *)&v;
    };
    a[0] = pk(r, c); a[1] = pk(r + 8, c); a[2] = pk(r, c + 8); a[3] = pk(r + 8, c + 8);
}

template <int NR>
static __device__ void put_acc(float *D, int ldd, const float (&d)[NR])
{
    int l = threadIdx.x & 31, w = threadIdx.x >> 5, g = l >> 2, t = l & 3;
    for (int i = 0; i < NR / 4; i++)
        for (int e = 0; e < 4; e++) D[(16 * w + g + 8 * (e >> 1)) * ldd + 8 * i + 2 * t + (e & 1)] = d[4 * i + e];
}

/* case 0: D = A B^T, A [64 m][64 k], B [64 n][64 k], both K-major, SS, n64
 * case 1: D = A B, A regs [64 m][64 k], B [64 k][64 n] MN-major, RS, n64
 * case 2: D = A B, A regs [64][64], B [64 k][128 n] as two MN-major tiles, RS, n128
 * case 3: D = C - A B^T, A regs [64 m][128 k], B [64 n][128 k] as two K-major tiles, RS, n64, neg
 * case 4: D = A B with A [64 m][128 k] K-major from smem (two tiles), B [64 n][128 k] K-major, SS, n64
 * case 5: D = A B^T, A regs [64 m][64 k], B [64 n][64 k] zero above the 16 x 16 block diagonal
 *         (n < 16 (k / 16)), in the fused forward's A'' tile (no swizzle, K-step kk at 2048 kk,
 *         core matrices LBO 128, SBO 256; gdn_cuda_common.cuh), RS, n64
 * case 6: D = -A B, A [64 m][64 k] stored transposed ([k][m]: MN-major A), B [64 k][128 n] as two
 *         MN-major tiles, SS, n128, -A (the fused reverse kernel's chain: dS^T -= Z'^T K with Z'
 *         [c][v] and K [c][kd] tiles as they are) */
__global__ void __launch_bounds__(128) k_test(int which, const __nv_bfloat16 *A, const __nv_bfloat16 *Bm,
                                              const float *C, float *D)
{
#if FQ_SM90A
    __shared__ __align__(1024) unsigned char sm[4 * 8192];
    float d64[32];
    float d128[64];
    for (int i = 0; i < 32; i++) d64[i] = 0.f;
    for (int i = 0; i < 64; i++) d128[i] = 0.f;
    const uint32_t s0 = fq_smem_u32(sm);
    if (which == 0) {
        put_tile(sm, A, 64, 0, 0);
        put_tile(sm + 8192, Bm, 64, 0, 0);
        fq_fence_async_smem();
        __syncthreads();
        fq_wgmma_fence();
        for (int kk = 0; kk < 4; kk++)
            fq_wgmma_ss_n64<0, 0>(d64, fq_desc_sw128(s0 + 32 * kk, 16, 1024), fq_desc_sw128(s0 + 8192 + 32 * kk, 16, 1024),
                                  kk > 0);
        fq_wgmma_commit();
        fq_wgmma_wait<0>();
        fq_reg_fence(d64);
        put_acc(D, 64, d64);
    } else if (which == 1) {
        put_tile(sm, Bm, 64, 0, 0);
        fq_fence_async_smem();
        __syncthreads();
        uint32_t a[4][4];
        for (int kk = 0; kk < 4; kk++) frag_a(a[kk], A, 64, kk);
        fq_wgmma_fence();
        for (int kk = 0; kk < 4; kk++) fq_wgmma_rs_n64<1, 0>(d64, a[kk], fq_desc_sw128(s0 + 2048 * kk, 8192, 1024), kk > 0);
        fq_wgmma_commit();
        fq_wgmma_wait<0>();
        fq_reg_fence(d64);
        put_acc(D, 64, d64);
    } else if (which == 2) {
        put_tile(sm, Bm, 128, 0, 0);
        put_tile(sm + 8192, Bm, 128, 0, 64);
        fq_fence_async_smem();
        __syncthreads();
        uint32_t a[4][4];
        for (int kk = 0; kk < 4; kk++) frag_a(a[kk], A, 64, kk);
        fq_wgmma_fence();
        for (int kk = 0; kk < 4; kk++) fq_wgmma_rs_n128<1, 0>(d128, a[kk], fq_desc_sw128(s0 + 2048 * kk, 8192, 1024), kk > 0);
        fq_wgmma_commit();
        fq_wgmma_wait<0>();
        fq_reg_fence(d128);
        put_acc(D, 128, d128);
    } else if (which == 3) {
        put_tile(sm, Bm, 128, 0, 0);
        put_tile(sm + 8192, Bm, 128, 0, 64);
        fq_fence_async_smem();
        __syncthreads();
        {
            int l = threadIdx.x & 31, w = threadIdx.x >> 5, g = l >> 2, t = l & 3;
            for (int i = 0; i < 8; i++)
                for (int e = 0; e < 4; e++) d64[4 * i + e] = C[(16 * w + g + 8 * (e >> 1)) * 64 + 8 * i + 2 * t + (e & 1)];
        }
        uint32_t a[8][4];
        for (int kk = 0; kk < 8; kk++) frag_a(a[kk], A, 128, kk);
        fq_wgmma_fence();
        for (int kk = 0; kk < 8; kk++)
            fq_wgmma_rs_n64<0, 1>(d64, a[kk], fq_desc_sw128(s0 + (kk >> 2) * 8192 + 32 * (kk & 3), 16, 1024), 1);
        fq_wgmma_commit();
        fq_wgmma_wait<0>();
        fq_reg_fence(d64);
        put_acc(D, 64, d64);
    } else if (which == 6) {
        for (int idx = threadIdx.x; idx < 64 * 64; idx += blockDim.x) {
            const int k = idx / 64, m = idx % 64; /* tile row k, column m: A^T */
            *(__nv_bfloat16 *)(sm + fq_sw128(k, 2 * m)) = A[m * 64 + k];
        }
        put_tile(sm + 8192, Bm, 128, 0, 0);
        put_tile(sm + 16384, Bm, 128, 0, 64);
        fq_fence_async_smem();
        __syncthreads();
        fq_wgmma_fence();
        for (int kk = 0; kk < 4; kk++)
            fq_wgmma_ss_n128<1, 1, 1>(d128, fq_desc_sw128(s0 + 2048 * kk, 8192, 1024),
                                      fq_desc_sw128(s0 + 8192 + 2048 * kk, 8192, 1024), kk > 0);
        fq_wgmma_commit();
        fq_wgmma_wait<0>();
        fq_reg_fence(d128);
        put_acc(D, 128, d128);
    } else if (which == 5) {
        for (int idx = threadIdx.x; idx < 64 * 64; idx += blockDim.x) {
            const int r = idx / 64, c = idx % 64, kk = c >> 4;
            const __nv_bfloat16 b = fq_apack_index(r, c) < 0 ? __float2bfloat16(0.f) : Bm[idx];
            *(__nv_bfloat16 *)(sm + 2048 * kk + ((r >> 3) * 2 + ((c >> 3) & 1)) * 128 + (r & 7) * 16 + (c & 7) * 2) = b;
        }
        fq_fence_async_smem();
        __syncthreads();
        uint32_t a[4][4];
        for (int kk = 0; kk < 4; kk++) frag_a(a[kk], A, 64, kk);
        fq_wgmma_fence();
        for (int kk = 0; kk < 4; kk++) fq_wgmma_rs_n64<0, 0>(d64, a[kk], fq_desc_interleave(s0 + 2048 * kk, 128, 256), kk > 0);
        fq_wgmma_commit();
        fq_wgmma_wait<0>();
        fq_reg_fence(d64);
        put_acc(D, 64, d64);
    } else {
        put_tile(sm, A, 128, 0, 0);
        put_tile(sm + 8192, A, 128, 0, 64);
        put_tile(sm + 16384, Bm, 128, 0, 0);
        put_tile(sm + 24576, Bm, 128, 0, 64);
        fq_fence_async_smem();
        __syncthreads();
        fq_wgmma_fence();
        for (int kk = 0; kk < 8; kk++) {
            uint32_t off = (kk >> 2) * 8192 + 32 * (kk & 3);
            fq_wgmma_ss_n64<0, 0>(d64, fq_desc_sw128(s0 + off, 16, 1024), fq_desc_sw128(s0 + 16384 + off, 16, 1024), kk > 0);
        }
        fq_wgmma_commit();
        fq_wgmma_wait<0>();
        fq_reg_fence(d64);
        put_acc(D, 64, d64);
    }
#endif
}

int main(void)
{
    const int n = 64 * 128;
    __nv_bfloat16 hA[n], hB[n];
    float fA[n], fB[n], hC[64 * 64], hD[64 * 128], ref[64 * 128];
    for (int i = 0; i < n; i++) {
        hA[i] = __float2bfloat16((float)nrand());
        hB[i] = __float2bfloat16((float)nrand());
        fA[i] = __bfloat162float(hA[i]);
        fB[i] = __bfloat162float(hB[i]);
    }
    for (int i = 0; i < 64 * 64; i++) hC[i] = (float)nrand();
    __nv_bfloat16 *dA, *dB;
    float *dC, *dD;
    CK(cudaMalloc(&dA, sizeof hA)); CK(cudaMalloc(&dB, sizeof hB));
    CK(cudaMalloc(&dC, sizeof hC)); CK(cudaMalloc(&dD, sizeof hD));
    CK(cudaMemcpy(dA, hA, sizeof hA, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(dB, hB, sizeof hB, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(dC, hC, sizeof hC, cudaMemcpyHostToDevice));
    const char *names[] = {"ss n64 K/K", "rs n64 B MN-major", "rs n128 B MN-major (2 tiles)",
                           "rs n64 B K-major (2 tiles), -A, +C", "ss n64 K/K (2 tiles each)",
                           "rs n64 B K-major no swizzle (A'' tile)", "ss n128 A, B MN-major (2 tiles), -A"};
    int fails = 0;
    for (int which = 0; which < 7; which++) {
        int N = (which == 2 || which == 6) ? 128 : 64, Kd = (which == 3 || which == 4) ? 128 : 64;
        for (int m = 0; m < 64; m++)
            for (int c = 0; c < N; c++) {
                double s = 0;
                for (int k = 0; k < Kd; k++) {
                    double a = fA[m * Kd + k];
                    double b = (which == 1 || which == 2 || which == 6) ? fB[k * N + c] : fB[c * Kd + k];
                    if (which == 5 && c < 16 * (k / 16)) b = 0.0; /* not stored, not multiplied */
                    s += a * b;
                }
                ref[m * N + c] = (float)(which == 3 ? hC[m * 64 + c] - s : which == 6 ? -s : s);
            }
        CK(cudaMemset(dD, 0xff, sizeof hD));
        k_test<<<1, 128>>>(which, dA, dB, dC, dD);
        CK(cudaGetLastError());
        CK(cudaDeviceSynchronize());
        CK(cudaMemcpy(hD, dD, 64 * N * 4, cudaMemcpyDeviceToHost));
        double num = 0, den = 0;
        for (int i = 0; i < 64 * N; i++) {
            double d = hD[i] - ref[i];
            num += d * d;
            den += (double)ref[i] * ref[i];
        }
        double rel = isfinite(num) ? sqrt(num / den) : INFINITY;
        int ok = rel < 1e-5;
        fails += !ok;
        printf("wgmma %-40s rel %.2e %s\n", names[which], rel, ok ? "ok" : "FAIL");
        /* on failure: where the first mismatches are, and which reference entry each matches */
        for (int i = 0, shown = 0; !ok && i < 64 * N && shown < 6; i++) {
            if (fabs(hD[i] - ref[i]) <= 1e-3 * (1 + fabs(ref[i]))) continue;
            int hit = -1;
            for (int q = 0; q < 64 * N && hit < 0; q++)
                if (fabs(hD[i] - ref[q]) <= 1e-4 * (1 + fabs(ref[q]))) hit = q;
            printf("    D[%d][%d] = %g, want %g; equals ref[%d][%d]\n", i / N, i % N, hD[i], ref[i],
                   hit < 0 ? -1 : hit / N, hit < 0 ? -1 : hit % N);
            shown++;
        }
    }
    printf("check_wgmma: %s\n", fails ? "FAIL" : "ALL OK");
    return fails ? 1 : 0;
}
