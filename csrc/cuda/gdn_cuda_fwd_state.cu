/*
 * gdn_cuda_fwd_state.cu — forward stage B (DESIGN §2): the sequential state
 * pass, fq_fwd_state_kernel (described below). For each chunk c of a
 * sequence, with S the running state (K x V, fp32):
 *
 *     h_c = S                                          (bf16, for stage C / backward)
 *     Vn  = U - W S                                    (S rounded to bf16 for the mma)
 *     S   = e^{gamma_C} S + K^T diag(kdecay) Vn        kdecay_r = e^{gamma_C - gamma_r} rk_r
 *
 * S_0 = h0 (zeros when NULL); the last S is the final state ht (fp32). The
 * first version (S in the accumulators of 4 warps, shared-memory round
 * trips each chunk) was removed once superseded: see benchmarks/NOTES.md and
 * git history (commit 4599409).
 */
#include "gdn_cuda_state.cuh"

struct fq_state_args {
    const fq_seq_info *seqs;
    const fq_bf16 *kb;
    const float *h0;
    float *ht;
    int H, HV;
    const float *gamma, *kdecay;
    const fq_bf16 *w, *u;
    fq_bf16 *h, *vn;
    /* [serving] pool-indexed prefill: h0 = ht = the pool, sequence n at slot
     * idx[n] (no load and no store for a negative slot); idx NULL: slot n */
    const void *idx;
    int idx_is64;
    int64_t P;               /* pool slots: a slot >= P (not checkable from the host) is
                                treated like a negative one */
    int vk;                  /* states [V][K] (fq_state_at) */
    /* [serving] checkpoints: every ck_chunks chunks the state to row
     * cu_ck[n] + c - 1 of ckpt [rows, HV, K, V] (NULL: none) */
    float *ckpt;
    const int64_t *cu_ck;
    int ck_chunks;
};

/* ------------------------------------------------------ the kernel ----
 *
 * One block per (sequence n, value head j, BV = 16*NW state columns).
 * A group of KS warps (KS = 1 or 2) owns 16 state columns v and holds S^T
 * (16 x K, fp32) as mma accumulators, warp kh of the group the K/KS rows
 * k0 = kh*K/KS ..: lane (g = lane/4, t = lane%4) holds
 * S^T[g (+8)][k0 + 8 nt + 2t (+1)]. That is the A-operand layout of
 * m16n8k16, so both products of a chunk take their A operand from registers
 * (the removed first version went through shared memory, three __syncthreads per chunk):
 *
 *     h_c^T = S^T                               bf16, stored as h[K][V] (lane pairs
 *                                               swap halves to transpose)
 *     P     = S^T[:, k0..] W^T[k0.., :]         A = S^T (registers), B = W [row][k] (smem)
 *     Vn^T  = U^T - sum over the group's warps of P    (KS = 2: the two partial
 *                                               16x64 fp32 P swap through shared memory)
 *     S^T[:, k0..] = e^{gamma_C} S^T[:, k0..] + (Vn^T diag(kdecay)) K[:, k0..]
 *                                               A = Vn^T (registers), B = K (smem)
 *
 * KS = 2 halves each warp's chain (64 instead of 128 mma per chunk, half the
 * h stores) for the shapes with few chains, at the cost of one more
 * __syncthreads per chunk and 8 KB of shared memory per group.
 * Roundings: S and kdecay*Vn rounded to bf16 as mma operands, fp32
 * accumulation, h and Vn stored as bf16. The block's warps share the chunk's
 * W and K tiles (each group reads its 16 columns of U) from an NS-deep
 * cp.async ring; one __syncthreads per chunk for the ring (chunk landed,
 * previous buffer free).
 */
template <int K, int NW, int NS, int KS> struct fq_fwd_state_smem {
    static constexpr int BV = 16 * NW, LDK = K + 8, LDB = BV + 8;
    static constexpr int b_w = 0;
    static constexpr int b_k = b_w + 64 * LDK * 2;
    static constexpr int b_u = b_k + 64 * LDK * 2;
    static constexpr int b_g = b_u + 64 * LDB * 2;
    static constexpr int b_d = b_g + 64 * 4;
    static constexpr int buf = b_d + 64 * 4;
    static constexpr int off_x = NS * buf;                       /* KS = 2: P exchange */
    static constexpr int bytes = off_x + (KS == 2 ? NW * 2 * 16 * 64 * 4 : 0);
};

template <int K, int NW, int NS, int KS>
__global__ void __launch_bounds__(NW * KS * 32, 1) fq_fwd_state_kernel(fq_state_args args, int V)
{
    typedef fq_fwd_state_smem<K, NW, NS, KS> SM;
    constexpr int BV = SM::BV, LDK = SM::LDK, LDB = SM::LDB, NTH = NW * KS * 32;
    constexpr int KW = K / KS;   /* state rows per warp */
    constexpr int NKT = KW / 8;  /* n8 tiles of S^T per warp */
    extern __shared__ __align__(16) unsigned char smem[];

    const int HV = args.HV, nvs = V / BV;
    const int vs = blockIdx.x % nvs, j = (blockIdx.x / nvs) % HV, n = blockIdx.x / (nvs * HV);
    const int hq = j / (HV / args.H);
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int gq = lane >> 2, tq = lane & 3;
    const int grp = warp / KS, kh = warp % KS;
    const int vw = vs * BV + 16 * grp; /* the group's first state column */
    const int k0 = kh * KW;            /* this warp's first state row */

    /* S_0^T = h0 slice.
     * [serving] pool-indexed prefill: the slice of slot idx[n] (zeros, and no
     * final store, for a negative slot); either state layout. */
    int64_t slot = n;
    if (args.idx) {
        slot = args.idx_is64 ? ((const int64_t *)args.idx)[n] : ((const int32_t *)args.idx)[n];
        if (slot >= args.P) slot = -1;
    }
    /* [serving] a slot an earlier sequence names too belongs to that one (as in
     * the recurrent step, gdn.h): this sequence runs from a NaN state (its o
     * comes out NaN) and writes nothing back */
    bool dup = false;
    if (args.idx && slot >= 0) {
        int d = 0;
        for (int m = tid; m < n && !d; m += NTH)
            d = (args.idx_is64 ? ((const int64_t *)args.idx)[m] : ((const int32_t *)args.idx)[m]) == slot;
        dup = __syncthreads_or(d) != 0;
        if (dup) slot = -1;
    }
    const int64_t state_off = (slot * HV + j) * K * V;
    const float *h0 = slot >= 0 ? args.h0 : NULL;
    float S[NKT][4];
#pragma unroll
    for (int nt = 0; nt < NKT; nt++)
#pragma unroll
        for (int e = 0; e < 4; e++) {
            int k = k0 + 8 * nt + 2 * tq + (e & 1), v = vw + gq + 8 * (e >> 1);
            S[nt][e] = h0 ? h0[state_off + fq_state_at(k, v, K, V, args.vk)]
                          : (dup ? __int_as_float(0x7fc00000) : 0.f);
        }

    /* programmatic dependent launch (gdn_cuda_common.cuh): h0 (a caller's
     * input) is read above, before the wait; the sequence table and stage A's
     * W, U, gamma, kdecay only after it */
    fq_pdl_trigger();
    fq_pdl_wait();
    const fq_seq_info si = args.seqs[n];
    /* [serving] checkpoints: this sequence's first row (written by an earlier
     * kernel of the call, so read after the wait) */
    const int64_t ck0 = args.ckpt ? args.cu_ck[n] : 0;

    /* async load of part `part` of chunk lc (local index) into buffer b:
     * rows part*RP .. part*RP + RP - 1 of W and K (RP = 64 / NPART), and in
     * part 0 also U's BV columns, gamma and kdecay. The NPART parts are
     * issued between the k-steps of the first product (a lone warp per SM
     * sub-partition issues everything itself; asm volatile keeps the order).
     * Each thread copies fixed 16-byte columns (c_t, c_u) of rows r_t + i *
     * RSTEP: per chunk one set of base pointers (fq_ld_base), then
     * compile-time offsets. */
    constexpr int NPART = KW / 16, RP = 64 / NPART;
    constexpr int CPR = K / 8, RSTEP = NTH / CPR, UPR = BV / 8, USTEP = NTH / UPR;
    static_assert(NTH % CPR == 0 && NTH % UPR == 0 && RP % RSTEP == 0 && 64 % USTEP == 0, "load split");
    const int r_t = tid / CPR, c_t = (tid % CPR) * 8, r_u = tid / UPR, c_u = (tid % UPR) * 8;
    const int64_t kstride = (int64_t)args.H * K; /* elements between k rows */
    struct fq_ld_base {
        const fq_bf16 *w, *k, *u;
        const float *g;
        int lim; /* rows r_t + r with r < lim are real tokens */
    };
    auto ld_base = [&](int lc) {
        fq_ld_base lb;
        const int64_t tile = ((int64_t)(si.chunk0 + lc) * HV + j) * 64;
        const int row0 = si.bos + lc * 64, len = min(64, si.len - lc * 64);
        lb.w = args.w + (tile + r_t) * K + c_t;
        lb.k = args.kb + ((int64_t)(row0 + r_t) * args.H + hq) * K + c_t;
        lb.u = args.u + (tile + r_u) * V + vs * BV + c_u;
        lb.g = tid < 16 ? args.gamma + tile + tid * 4 : args.kdecay + tile + (tid - 16) * 4;
        lb.lim = len - r_t;
        return lb;
    };
    auto load_part = [&](const fq_ld_base &lb, int b, int part) {
        unsigned char *buf = smem + b * SM::buf;
        fq_bf16 *Wd = (fq_bf16 *)(buf + SM::b_w) + r_t * LDK + c_t;
        fq_bf16 *Kd = (fq_bf16 *)(buf + SM::b_k) + r_t * LDK + c_t;
#pragma unroll
        for (int it = 0; it < RP / RSTEP; it++) {
            const int r = part * RP + it * RSTEP;
            fq_cp_async16(Wd + r * LDK, lb.w + r * K, 16);
            const bool ok = r < lb.lim;
            fq_cp_async16(Kd + r * LDK, ok ? lb.k + r * kstride : args.kb, ok ? 16 : 0);
        }
        if (part == 0) {
            fq_bf16 *Ud = (fq_bf16 *)(buf + SM::b_u) + r_u * LDB + c_u;
#pragma unroll
            for (int it = 0; it < 64 / USTEP; it++) {
                const int r = it * USTEP;
                fq_cp_async16(Ud + r * LDB, lb.u + (int64_t)r * V, 16);
            }
            if (tid < 32) fq_cp_async16(buf + (tid < 16 ? SM::b_g + tid * 16 : SM::b_d + (tid - 16) * 16), lb.g, 16);
        }
    };

#pragma unroll
    for (int s = 0; s < NS - 1; s++) {
        if (s < si.nchunks) {
            const fq_ld_base lb = ld_base(s);
#pragma unroll
            for (int part = 0; part < NPART; part++) load_part(lb, s, part);
        }
        fq_cp_async_commit();
    }

    for (int lc = 0; lc < si.nchunks; lc++) {
        /* group lc (chunk lc) is complete once at most NS-2 newer ones pend */
        fq_cp_async_wait<NS - 2>();
        __syncthreads(); /* chunk lc visible to all; buffer (lc-1) % NS free */
        const int lnext = lc + NS - 1, bnext = lnext % NS;
        const bool more = lnext < si.nchunks;
        fq_ld_base lbn;
        if (more) lbn = ld_base(lnext);

        const unsigned char *buf = smem + (lc % NS) * SM::buf;
        const fq_bf16 *Wb = (const fq_bf16 *)(buf + SM::b_w), *Kb = (const fq_bf16 *)(buf + SM::b_k);
        const fq_bf16 *Ub = (const fq_bf16 *)(buf + SM::b_u);
        const float *gam = (const float *)(buf + SM::b_g), *kdec = (const float *)(buf + SM::b_d);
        const int64_t chunk = si.chunk0 + lc;
        const int64_t tile = (chunk * HV + j) * 64;
        /* [serving] checkpoint: S here is the state after lc * 64 tokens */
        if (args.ckpt && lc > 0 && lc % args.ck_chunks == 0)
            fq_state_slice_store<NKT>(S, args.ckpt, ((ck0 + lc / args.ck_chunks - 1) * HV + j) * K * V, k0, vw,
                                      K, V, args.vk, gq, tq);

        /* acc = S^T[:, k0..] W^T[k0.., :] (16 x 64); h_c out on the way (a[q]
         * holds v = g + 8 (q & 1), k = k0 + 16 kk + 8 (q >> 1) + 2t, +1) */
        float acc[8][4];
#pragma unroll
        for (int nt = 0; nt < 8; nt++) acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0.f;
        /* h_c: word a[q] of k-step kk goes to rows k0 + 16 kk + 8 (q >> 1) + .. */
        fq_bf16 *hl = fq_st_t_lane(args.h + (chunk * HV + j) * K * V + (int64_t)k0 * V + vw, V, lane);
        const int64_t V8 = 8 * (int64_t)V;
#pragma unroll
        for (int kk = 0; kk < KW / 16; kk++) {
            uint32_t a[4];
            a[0] = fq_pack_bf16(S[2 * kk][0], S[2 * kk][1]);
            a[1] = fq_pack_bf16(S[2 * kk][2], S[2 * kk][3]);
            a[2] = fq_pack_bf16(S[2 * kk + 1][0], S[2 * kk + 1][1]);
            a[3] = fq_pack_bf16(S[2 * kk + 1][2], S[2 * kk + 1][3]);
#pragma unroll
            for (int n2 = 0; n2 < 4; n2++) {
                uint32_t b[4];
                fq_frag_b_nk(b, Wb, LDK, 16 * n2, k0 + 16 * kk);
                fq_mma_bf16(acc[2 * n2], a, b[0], b[1]);
                fq_mma_bf16(acc[2 * n2 + 1], a, b[2], b[3]);
            }
#pragma unroll
            for (int q = 0; q < 4; q++) fq_st_transposed(hl + (2 * kk + (q >> 1)) * V8 + 8 * (q & 1), a[q], gq);
            if (more) load_part(lbn, bnext, kk); /* chunk lc + NS - 1, part kk */
        }
        fq_cp_async_commit();

        if (KS == 2) {
            /* the group's two partial products: acc = P_own + P_partner (the
             * same sum, bitwise, in both warps). The exchange area is reused
             * next chunk only after the ring's __syncthreads. */
            float2 *xo = (float2 *)(smem + SM::off_x) + warp * 512;
            const float2 *xp = (const float2 *)(smem + SM::off_x) + (warp ^ 1) * 512;
            fq_pair_put(acc, xo, lane);
            __syncthreads();
            fq_pair_add(acc, xp, lane);
        }

        /* Vn^T = U^T - acc (uf[q] = U^T[g + 8 (q & 1)][16 kk + 8 (q >> 1) + 2t, +1]
         * pairs with acc[2 kk + (q >> 1)][2 (q & 1), +1]); Vn out (KS = 2:
         * warp kh stores the k-steps kk with kk % 2 == kh); the update's A
         * operand kdecay ⊙ Vn (rows along k) */
        fq_bf16 *vl = fq_st_t_lane(args.vn + tile * V + vw, V, lane);
        uint32_t va[4][4];
#pragma unroll
        for (int kk = 0; kk < 4; kk++) {
            uint32_t uf[4];
            fq_frag_a_trans(uf, Ub, LDB, 16 * grp, 16 * kk);
            const float2 d0 = *(const float2 *)(kdec + 16 * kk + 2 * tq);
            const float2 d8 = *(const float2 *)(kdec + 16 * kk + 8 + 2 * tq);
#pragma unroll
            for (int q = 0; q < 4; q++) {
                const float *x = acc[2 * kk + (q >> 1)] + 2 * (q & 1);
                float2 u = fq_unpack_bf16(uf[q]);
                float x0 = u.x - x[0], x1 = u.y - x[1];
                fq_st_transposed(vl + (2 * kk + (q >> 1)) * V8 + 8 * (q & 1), fq_pack_bf16(x0, x1), gq,
                                 KS == 1 || (kk & 1) == kh);
                float2 d = (q >> 1) ? d8 : d0;
                va[kk][q] = fq_pack_bf16(x0 * d.x, x1 * d.y);
            }
        }

        /* S^T[:, k0..] = e^{gamma_C} S^T[:, k0..] + (kdecay ⊙ Vn)^T K[:, k0..] */
        const float dc = __expf(gam[63]);
#pragma unroll
        for (int nt = 0; nt < NKT; nt++)
#pragma unroll
            for (int e = 0; e < 4; e++) S[nt][e] *= dc;
        fq_state_rank_update<KW>(S, va, Kb, LDK, k0);
    }
    fq_cp_async_wait<0>();

    /* [serving] checkpoint at the sequence's end (its length a multiple of
     * checkpoint_every: the final state); the final state to ht or the slot */
    if (args.ckpt && si.nchunks > 0 && si.len % (64 * args.ck_chunks) == 0)
        fq_state_slice_store<NKT>(S, args.ckpt, ((ck0 + si.nchunks / args.ck_chunks - 1) * HV + j) * K * V, k0, vw,
                                  K, V, args.vk, gq, tq);
    if (args.ht && slot >= 0) fq_state_slice_store<NKT>(S, args.ht, state_off, k0, vw, K, V, args.vk, gq, tq);
}

template <int K, int NW, int NS, int KS>
static fq_status fq_launch_state_ns(const fq_state_args &args, int64_t blocks, int V, cudaStream_t stream)
{
    int bytes = fq_fwd_state_smem<K, NW, NS, KS>::bytes;
    fq_status st = fq_cuda_set_smem((const void *)fq_fwd_state_kernel<K, NW, NS, KS>, bytes);
    if (st != FQ_OK) return st;
    return fq_launch_k(fq_fwd_state_kernel<K, NW, NS, KS>, (unsigned)blocks, NW * KS * 32, bytes, stream,
                       fq_cuda_pdl_enabled(), args, V);
}

/* One block per SM or fewer: 4-deep ring (150-210 KB at K <= 128); at
 * K = 256 a ring stage is 70-76 KB (W, K tiles 33 KB each), so the deepest
 * ring that fits: 3-deep at bv16 (217 KB), else 2-deep (147-183 KB). More
 * blocks than SMs: 2-deep, two blocks per SM at K <= 128 (one at K = 256). */
template <int K, int NW, int KS>
static fq_status fq_launch_state(const fq_state_args &args, int64_t blocks, int V, int sms,
                                  cudaStream_t stream)
{
    if (blocks <= sms) {
        if constexpr (fq_fwd_state_smem<K, NW, 4, KS>::bytes <= FQ_SMEM_OPTIN_H100)
            return fq_launch_state_ns<K, NW, 4, KS>(args, blocks, V, stream);
        else if constexpr (fq_fwd_state_smem<K, NW, 3, KS>::bytes <= FQ_SMEM_OPTIN_H100)
            return fq_launch_state_ns<K, NW, 3, KS>(args, blocks, V, stream);
    }
    static_assert(fq_fwd_state_smem<K, NW, 2, KS>::bytes <= FQ_SMEM_OPTIN_H100, "2-deep ring must fit");
    return fq_launch_state_ns<K, NW, 2, KS>(args, blocks, V, stream);
}

template <int K>
static fq_status fq_launch_state_k(const fq_state_args &args, int64_t blocks, int V, int sms, int bv, int ks,
                                    cudaStream_t stream)
{
    if constexpr (K == 256) {
        /* K = 256: only the K-split over a warp pair is built (64 fp32 state
         * registers per lane, as K = 128 unsplit); ks 1 would hold 128 */
        if (ks != 2)
            return fq_fail(FQ_ERR_INTERNAL, "fq_cuda_fwd_state_tiled: K = 256 runs ksplit 2 only, got %d", ks);
    }
    if (ks == 2) {
        if (bv == 16) return fq_launch_state<K, 1, 2>(args, blocks, V, sms, stream);
        if (bv == 32) return fq_launch_state<K, 2, 2>(args, blocks, V, sms, stream);
        return fq_launch_state<K, 4, 2>(args, blocks, V, sms, stream);
    }
    if constexpr (K != 256) {
        if (bv == 16) return fq_launch_state<K, 1, 1>(args, blocks, V, sms, stream);
        if (bv == 32) return fq_launch_state<K, 2, 1>(args, blocks, V, sms, stream);
        return fq_launch_state<K, 4, 1>(args, blocks, V, sms, stream);
    }
    return FQ_OK; /* not reached (K = 256 returned above) */
}

extern "C" fq_status fq_cuda_fwd_state_tiled(const fq_gdn_params *p, const fq_fwd_ws *ws, float *ht, int bv,
                                           int ksplit, cudaStream_t stream)
{
    if (p->N <= 0) return FQ_OK;
    int dev = 0, sms = 132;
    FQ_CUDA_CHECK(cudaGetDevice(&dev));
    FQ_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
    const int V = (int)p->V;
    /* 16-column groups in the grid */
    const int64_t groups = p->N * p->HV * (V / 16);
    /* K-split while every warp of it still gets an SM sub-partition of its
     * own (2 * groups <= 4 * SMs) */
    if (ksplit == 0) ksplit = p->K == 256 || groups <= 2 * (int64_t)sms ? 2 : 1; /* K = 256: always 2 */
    if (bv == 0) {
        /* few chains: each warp (pair) alone on an SM sub-partition, blocks
         * spread over the SMs; many: 4 warps per block */
        if (ksplit == 2) bv = groups <= sms ? 16 : 32;
        else bv = groups <= 2 * (int64_t)sms ? 32 : 64;
    }
    if ((bv != 16 && bv != 32 && bv != 64) || V % bv != 0 || (ksplit != 1 && ksplit != 2))
        return fq_fail(FQ_ERR_INTERNAL, "fq_cuda_fwd_state_tiled: bad bv %d / ksplit %d", bv, ksplit);
    fq_state_args args;
    args.seqs = ws->seqs;
    args.kb = ws->kb;
    args.h0 = (const float *)p->h0;
    args.ht = ht;
    args.H = (int)p->H;
    args.HV = (int)p->HV;
    args.gamma = ws->gamma;
    args.kdecay = ws->kdecay;
    args.w = ws->w;
    args.u = ws->u;
    args.h = ws->h;
    args.vn = ws->vn;
    /* [serving] pool, layout, checkpoints (gdn.h) */
    args.idx = NULL;
    args.idx_is64 = 0;
    args.P = p->P;
    if (p->state) { /* pool-indexed prefill: h0 and ht are the pool (h0, ht NULL then) */
        args.h0 = args.ht = (float *)p->state;
        args.idx = p->state_indices;
        args.idx_is64 = p->state_indices_is_int64;
    }
    args.vk = p->state_vk;
    args.ckpt = p->checkpoint_every ? (float *)p->checkpoints : NULL;
    args.cu_ck = (const int64_t *)p->cu_checkpoints;
    args.ck_chunks = (int)(p->checkpoint_every / 64);
    int64_t blocks = p->N * p->HV * (V / bv);
    if (p->K == 128) return fq_launch_state_k<128>(args, blocks, V, sms, bv, ksplit, stream);
    if (p->K == 64) return fq_launch_state_k<64>(args, blocks, V, sms, bv, ksplit, stream);
    if (p->K == 256 && V == 256) return fq_launch_state_k<256>(args, blocks, V, sms, bv, ksplit, stream);
    return fq_cuda_head_dims_unsupported(p);
}

/* Stage B (bv = 0: columns per block and K-split picked as above). */
extern "C" fq_status fq_cuda_fwd_state(const fq_gdn_params *p, const fq_fwd_ws *ws, float *ht, int bv,
                                       cudaStream_t stream)
{
    return fq_cuda_fwd_state_tiled(p, ws, ht, bv, 0, stream);
}
