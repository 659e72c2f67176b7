/*
 * gdn_cuda_fwd_output.cu — forward stage C (DESIGN §2), one block per (chunk,
 * value head), chunk-parallel:
 *
 *     O = scale ( diag(e^gamma) Q S + lower_incl(Q K^T ⊙ Gamma) Vn )
 *
 * with S = h_c (bf16 chunk-start state) and Vn from stage B. With
 * use_qk_l2norm q = rq q_raw, k = rk k_raw: the first term picks up rq_r, the
 * second rq_r rk_s. Warp w computes output rows 16w..16w+15; the masked
 * Q K^T tile goes from the accumulators straight into the A fragments of the
 * second product.
 *
 * 8 warps: warp w computes rows 16 (w % 4).. and the V/2 columns of half
 * w / 4, recomputing its rows of P. At K = V = 256, 16 warps: V/4 = 64
 * columns of quarter w / 4 each (O in 32 registers as at V = 128; each
 * column group recomputes P: 3 extra masked Q K^T, about a quarter more
 * tensor-core work than Q S + P Vn alone), one block per SM by
 * shared memory (Q, K 33 KB each, h 132 KB: 199 KB). Q, K arrive in a first cp.async group
 * and h in a second, so that P is computed while h is still in flight; Vn
 * goes into K's place once P is in registers, while Q h is computed. The
 * superseded versions (4 warps; Vn beside K, 2 blocks per SM) are in git
 * history (commits 4599409, f002431) and benchmarks/NOTES.md.
 */
#include "gdn_cuda_common.cuh"

struct fq_output_args {
    const fq_chunk_info *chunks;
    const fq_bf16 *qb, *kb;
    const float *rq, *rk;
    int H, HV;
    const float *gamma;
    const fq_bf16 *h, *vn;
    void *o;
    fq_dtype dtype;
    int o_aligned;
    float scale;
};

/* Q, K (later Vn in K's place), h: 70 KB at K = V = 128, 3 blocks of 8 warps
 * per SM (80 registers); 199 KB at K = V = 256, 1 block of 16 warps. NCG:
 * column groups (warps per output row block), NTH = 128 NCG threads. */
template <int K, int V> struct fq_output_smem {
    static constexpr int LDK = K + 8, LDV = V + 8;
    static constexpr int tile_k = 64 * LDK * 2, tile_v = 64 * LDV * 2;
    static constexpr int off_q = 0;
    static constexpr int off_k = off_q + tile_k;
    static constexpr int off_h = off_k + (tile_v > tile_k ? tile_v : tile_k);
    static constexpr int off_v = off_k;
    static constexpr int off_vec = off_h + K * LDV * 2;
    static constexpr int bytes = off_vec + 3 * 64 * 4;
    static constexpr int NCG = V > 128 ? 4 : 2, NTH = 128 * NCG;
    static constexpr int per_sm = V > 128 ? 1 : 3; /* blocks per SM (shared memory) */
};

template <int K, int V>
__global__ void __launch_bounds__(fq_output_smem<K, V>::NTH, fq_output_smem<K, V>::per_sm)
fq_fwd_output_kernel(fq_output_args args)
{
    typedef fq_output_smem<K, V> SM;
    constexpr int NTH = SM::NTH, VW = V / SM::NCG; /* threads; output columns per warp */
    constexpr int LDK = SM::LDK, LDV = SM::LDV;
    extern __shared__ __align__(16) unsigned char smem[];
    fq_bf16 *Qs = (fq_bf16 *)(smem + SM::off_q);
    fq_bf16 *Ks = (fq_bf16 *)(smem + SM::off_k);
    fq_bf16 *Hs = (fq_bf16 *)(smem + SM::off_h);
    fq_bf16 *Vs = (fq_bf16 *)(smem + SM::off_v);
    float *gam = (float *)(smem + SM::off_vec), *rqv = gam + 64, *rkv = gam + 128;

    const int HV = args.HV;
    const int chunk = blockIdx.x / HV, j = blockIdx.x % HV;
    /* programmatic dependent launch (gdn_cuda_common.cuh): everything this
     * block reads, the chunk table included, only after the wait */
    fq_pdl_wait();
    const fq_chunk_info ci = args.chunks[chunk];
    if (ci.seq < 0) return;
    const int hq = j / (HV / args.H);
    const int tid = threadIdx.x, lane = tid & 31, warp = (tid >> 5) & 3;
    const int gq = lane >> 2, tq = lane & 3;
    const int c0 = (tid >> 7) * VW; /* this warp's first output column (column group tid / 128) */
    const int64_t tile = (int64_t)blockIdx.x * 64;

    for (int idx = tid; idx < 64 * (K / 8); idx += NTH) {
        int r = idx / (K / 8), c = (idx % (K / 8)) * 8;
        const fq_bf16 *sq = args.qb, *sk = args.kb;
        int bytes = 0;
        if (r < ci.len) {
            int64_t off = ((int64_t)(ci.row0 + r) * args.H + hq) * K + c;
            sq = args.qb + off; sk = args.kb + off; bytes = 16;
        }
        fq_cp_async16(Qs + r * LDK + c, sq, bytes);
        fq_cp_async16(Ks + r * LDK + c, sk, bytes);
    }
    fq_cp_async_commit(); /* group 0: Q, K */
    {
        const fq_bf16 *hg = args.h + (int64_t)blockIdx.x * K * V;
        for (int idx = tid; idx < K * (V / 8); idx += NTH) {
            int r = idx / (V / 8), c = (idx % (V / 8)) * 8;
            fq_cp_async16(Hs + r * LDV + c, hg + r * V + c, 16);
        }
    }
    fq_cp_async_commit(); /* group 1: h */
    if (tid < 64) {
        gam[tid] = args.gamma[tile + tid];
        float rq = 1.f, rk = 1.f;
        if (args.rq && tid < ci.len) {
            int64_t vi = (int64_t)(ci.row0 + tid) * args.H + hq;
            rq = args.rq[vi];
            rk = args.rk[vi];
        }
        rqv[tid] = rq;
        rkv[tid] = rk;
    }
    fq_cp_async_wait<1>(); /* Q, K landed */
    __syncthreads();

    /* P = lower_incl(Q K^T ⊙ Gamma) (row scales rq, column scales rk) */
    float P[8][4];
#pragma unroll
    for (int n = 0; n < 8; n++) P[n][0] = P[n][1] = P[n][2] = P[n][3] = 0.f;
#pragma unroll
    for (int kk = 0; kk < K / 16; kk++) {
        uint32_t a[4];
        fq_frag_a(a, Qs, LDK, 16 * warp, 16 * kk);
#pragma unroll
        for (int n2 = 0; n2 < 4; n2++) {
            if (16 * n2 > 16 * warp + 15) continue; /* above the diagonal: all masked */
            uint32_t b[4];
            fq_frag_b_nk(b, Ks, LDK, 16 * n2, 16 * kk);
            fq_mma_bf16(P[2 * n2], a, b[0], b[1]);
            fq_mma_bf16(P[2 * n2 + 1], a, b[2], b[3]);
        }
    }
    float rowf[2];
#pragma unroll
    for (int hr = 0; hr < 2; hr++) {
        int r = 16 * warp + gq + 8 * hr;
        rowf[hr] = __expf(gam[r]) * rqv[r];
    }
#pragma unroll
    for (int n = 0; n < 8; n++)
#pragma unroll
        for (int e = 0; e < 4; e++) {
            int r = 16 * warp + gq + (e >> 1) * 8, s = 8 * n + 2 * tq + (e & 1);
            P[n][e] = (s <= r) ? P[n][e] * __expf(gam[r] - gam[s]) * rqv[r] * rkv[s] : 0.f;
        }

    {
        /* every warp is done with K: Vn goes into its place (group 2) */
        __syncthreads();
        const fq_bf16 *vg = args.vn + tile * V;
        for (int idx = tid; idx < 64 * (V / 8); idx += NTH) {
            int r = idx / (V / 8), c = (idx % (V / 8)) * 8;
            fq_cp_async16(Vs + r * LDV + c, vg + r * V + c, 16);
        }
        fq_cp_async_commit();
        fq_cp_async_wait<1>(); /* h landed */
        __syncthreads();
    }

    /* O = diag(e^gamma rq) Q S */
    float O[VW / 8][4];
#pragma unroll
    for (int n = 0; n < VW / 8; n++) O[n][0] = O[n][1] = O[n][2] = O[n][3] = 0.f;
#pragma unroll
    for (int kk = 0; kk < K / 16; kk++) {
        uint32_t a[4];
        fq_frag_a(a, Qs, LDK, 16 * warp, 16 * kk);
#pragma unroll
        for (int n2 = 0; n2 < VW / 16; n2++) {
            uint32_t b[4];
            fq_frag_b_kn(b, Hs, LDV, 16 * kk, c0 + 16 * n2);
            fq_mma_bf16(O[2 * n2], a, b[0], b[1]);
            fq_mma_bf16(O[2 * n2 + 1], a, b[2], b[3]);
        }
    }
#pragma unroll
    for (int n = 0; n < VW / 8; n++) {
        O[n][0] *= rowf[0]; O[n][1] *= rowf[0];
        O[n][2] *= rowf[1]; O[n][3] *= rowf[1];
    }
    fq_cp_async_wait<0>(); /* Vn landed */
    __syncthreads();
    /* O += P Vn */
#pragma unroll
    for (int kk = 0; kk < 4; kk++) {
        if (16 * kk > 16 * warp + 15) continue;
        uint32_t a[4];
        a[0] = fq_pack_bf16(P[2 * kk][0], P[2 * kk][1]);
        a[1] = fq_pack_bf16(P[2 * kk][2], P[2 * kk][3]);
        a[2] = fq_pack_bf16(P[2 * kk + 1][0], P[2 * kk + 1][1]);
        a[3] = fq_pack_bf16(P[2 * kk + 1][2], P[2 * kk + 1][3]);
#pragma unroll
        for (int n2 = 0; n2 < VW / 16; n2++) {
            uint32_t b[4];
            fq_frag_b_kn(b, Vs, LDV, 16 * kk, c0 + 16 * n2);
            fq_mma_bf16(O[2 * n2], a, b[0], b[1]);
            fq_mma_bf16(O[2 * n2 + 1], a, b[2], b[3]);
        }
    }
    /* o = scale * O, valid rows only */
    const float scale = args.scale;
#pragma unroll
    for (int hr = 0; hr < 2; hr++) {
        int r = 16 * warp + gq + 8 * hr;
        if (r >= ci.len) continue;
        int64_t base = ((int64_t)(ci.row0 + r) * HV + j) * V;
#pragma unroll
        for (int n = 0; n < VW / 8; n++) {
            int c = c0 + 8 * n + 2 * tq;
            float x = scale * O[n][2 * hr], y = scale * O[n][2 * hr + 1];
            if (args.o_aligned) {
                fq_st_f2(args.o, args.dtype, base + c, x, y);
            } else {
                fq_st_f(args.o, args.dtype, base + c, x);
                fq_st_f(args.o, args.dtype, base + c + 1, y);
            }
        }
    }
}

template <int K, int V>
static fq_status fq_launch_output(const fq_output_args &args, int64_t blocks, cudaStream_t stream)
{
    int bytes = fq_output_smem<K, V>::bytes;
    fq_status st = fq_cuda_set_smem((const void *)fq_fwd_output_kernel<K, V>, bytes);
    if (st != FQ_OK) return st;
    return fq_launch_k(fq_fwd_output_kernel<K, V>, (unsigned)blocks, fq_output_smem<K, V>::NTH, bytes, stream,
                       fq_cuda_pdl_enabled(), args);
}

/* Stage C. */
extern "C" fq_status fq_cuda_fwd_output(const fq_gdn_params *p, const fq_fwd_ws *ws, cudaStream_t stream)
{
    int64_t blocks = ws->nc_max * p->HV;
    if (blocks <= 0) return FQ_OK;
    fq_output_args args;
    args.chunks = ws->chunks;
    args.qb = ws->qb;
    args.kb = ws->kb;
    args.rq = ws->rq;
    args.rk = ws->rk;
    args.H = (int)p->H;
    args.HV = (int)p->HV;
    args.gamma = ws->gamma;
    args.h = ws->h;
    args.vn = ws->vn;
    args.o = p->o;
    args.dtype = p->dtype;
    args.o_aligned = ((uintptr_t)p->o & 7) == 0;
    args.scale = (float)p->scale;
    if (p->K == 128 && p->V == 128) return fq_launch_output<128, 128>(args, blocks, stream);
    if (p->K == 128 && p->V == 64) return fq_launch_output<128, 64>(args, blocks, stream);
    if (p->K == 64 && p->V == 128) return fq_launch_output<64, 128>(args, blocks, stream);
    if (p->K == 64 && p->V == 64) return fq_launch_output<64, 64>(args, blocks, stream);
    if (p->K == 256 && p->V == 256) return fq_launch_output<256, 256>(args, blocks, stream); /* issue 7 item 4 */
    return fq_cuda_head_dims_unsupported(p);
}
