/*
 * gdn_cuda_bwd.cuh — what the CUDA backward's files share (internal): the
 * argument block of the backward kernels, small shared-memory helpers, and the
 * launchers of the kernels of gdn_cuda_bwd_fused.cu and gdn_cuda_bwd_state.cu
 * called by the host code in gdn_cuda_bwd.cu. Include only from
 * csrc/gdn_cuda_bwd*.cu.
 */
#ifndef FQ_GDN_CUDA_BWD_CUH
#define FQ_GDN_CUDA_BWD_CUH

#include "gdn_cuda_common.cuh"

/* ------------------------------------------------------- small helpers ---- */

static __device__ __forceinline__ float fq_bf(fq_bf16 x) { return __bfloat162float(x); }

/* Sum over the 4 lanes of a quad (one accumulator row). */
static __device__ __forceinline__ float fq_quad_sum(float x)
{
    x += __shfl_xor_sync(0xffffffffu, x, 1);
    x += __shfl_xor_sync(0xffffffffu, x, 2);
    return x;
}

/* Causality (issue 9): the mask that zeroes the non-finite halves of a bf16 pair
 * (x & fq_bf16x2_finite_mask(x): a select). */
static __device__ __forceinline__ uint32_t fq_bf16x2_finite_mask(uint32_t x)
{
    const uint32_t y = x & 0x7f807f80u;
    return ((y & 0xffffu) == 0x7f80u ? 0xffff0000u : 0xffffffffu) & ((y >> 16) == 0x7f80u ? 0x0000ffffu : 0xffffffffu);
}

/* ... of one 16-byte piece of bf16, in place (rewritten only when it holds one). */
static __device__ __forceinline__ void fq_zero_nonfinite8(uint4 *pp)
{
    uint4 x = *pp;
    uint32_t *xs = (uint32_t *)&x;
    if (fq_bf16x8_nonfinite(x)) {
#pragma unroll
        for (int q = 0; q < 4; q++) xs[q] &= fq_bf16x2_finite_mask(xs[q]);
        *pp = x;
    }
}

/* rows x D bf16, global row r at src + r * stride (16-byte aligned), rows >=
 * len zero-filled, by cp.async: every load of the block in flight at once.
 * The caller commits and waits. */
template <int D>
static __device__ __forceinline__ void fq_async_rows(fq_bf16 *dst, int ld, const fq_bf16 *src,
                                                     int64_t stride, int rows, int len)
{
    for (int idx = threadIdx.x; idx < rows * (D / 8); idx += blockDim.x) {
        const int r = idx / (D / 8), c = (idx % (D / 8)) * 8;
        const bool ok = r < len;
        fq_cp_async16(dst + r * ld + c, src + (ok ? r * stride + c : 0), ok ? 16 : 0);
    }
}

/* Causality inside a chunk (issue 9): the non-finite elements of a rows x D
 * bf16 tile loaded by fq_async_rows<D> set to zero (a select; rare: a piece
 * is rewritten only when it holds one). Each thread touches only the
 * 16-byte pieces it copied (or scaled, fq_scale_rows: the same pieces)
 * itself, so it runs right after the thread's cp.async wait, before the
 * barrier that publishes the tile (fq_bf16x8_nonfinite finds them). */
template <int D>
static __device__ __forceinline__ void fq_finite_rows(fq_bf16 *t, int ld, int rows)
{
    for (int idx = threadIdx.x; idx < rows * (D / 8); idx += blockDim.x) {
        const int r = idx / (D / 8), c = (idx % (D / 8)) * 8;
        fq_zero_nonfinite8((uint4 *)(t + r * ld + c));
    }
}

/* Causality (issue 9): 1 iff one of the 16-byte pieces of a rows x D bf16
 * tile that this thread visits (the fq_async_rows<D> mapping) holds a
 * non-finite value (fq_bf16x8_nonfinite; no writes). */
template <int D>
static __device__ __forceinline__ int fq_nonfinite_rows(const fq_bf16 *t, int ld, int rows)
{
    int b = 0;
    for (int idx = threadIdx.x; idx < rows * (D / 8); idx += blockDim.x) {
        const int r = idx / (D / 8), c = (idx % (D / 8)) * 8;
        b |= fq_bf16x8_nonfinite(*(const uint4 *)(t + r * ld + c));
    }
    return b;
}

/* In place: row r of a 64 x D bf16 tile times rs[r]. */
template <int D>
static __device__ __forceinline__ void fq_scale_rows(fq_bf16 *t, int ld, const float *rs)
{
    for (int idx = threadIdx.x; idx < 64 * (D / 8); idx += blockDim.x) {
        const int r = idx / (D / 8), c = (idx % (D / 8)) * 8;
        const float f = rs[r];
        uint4 *pp = (uint4 *)(t + r * ld + c);
        uint4 x = *pp;
        uint32_t *xs = (uint32_t *)&x;
#pragma unroll
        for (int q = 0; q < 4; q++) {
            float2 f2 = fq_unpack_bf16(xs[q]);
            xs[q] = fq_pack_bf16(f2.x * f, f2.y * f);
        }
        *pp = x;
    }
}

/* ------------------------------------------------------------ arguments ---- */

struct fq_bwd_args {
    const fq_chunk_info *chunks;
    const fq_seq_info *seqs;
    const fq_bf16 *qb, *kb, *vb;
    const float *rq, *rk;
    const float *gamma, *kdecay;
    const fq_bf16 *w, *h, *vn, *a;
    fq_bf16 *dvl;      /* [nc, HV, 64, V]: dv_local (step 3), then dVn (step 4); bwd_state90: dVn only */
    fq_bf16 *dsl;      /* [nc, HV, K, V]:  dS_local (step 3), then dS_next (step 4); bwd_state90: dS_next only */
    float *dgam;       /* [nc, HV, 64] dgamma of step 3 (bwd_rev90's path: of bwd_rev90, for bwd_local90) */
    float *dkp;        /* [B*T, H, K] bwd_local's dK_O summed over the GVA group (not on bwd_rev90's path) */
    fq_bf16 *dkw;      /* [B*T, HV, K] bf16: bwd_rev90's dK per value head (U's memory); given, bwd_local90
                          runs after bwd_rev90 and finishes dk and dg (else NULL) */
    const int *aflag;  /* [nc, HV] 1 where an item's W has NaN rows (a non-finite input before
                          the chunk's last token: stage A's rules): bwd_state90, which never
                          forms W, then makes the item's update NaN as W's rows would */
    const void *q, *k, *beta, *dout;
    const float *dht;
    void *dq, *dk, *dv, *dg, *dbeta;
    float *dh0;
    fq_dtype dt, gdt;
    int dout_async;    /* dout is bf16 and 16-byte aligned: cp.async rows */
    int H, HV;
    float scale;
    int state_vk;      /* [serving] dht, dh0 (and h0) stored [V][K] (fq_state_at) */
    /* bwd_wy90 beside bwd_state90 (fq_bwd_wy_beside, gdn_cuda_bwd.cu; else bready NULL):
     * bwd_state90 sets bready[2 tile + column block] once dS_next and dVn of the tile are
     * stored, and bwd_wy90, launched at once with it, waits for them per value head */
    int *bready;       /* [nc, HV, 2] zeroed before bwd_state90 */
    int bseqch;        /* chunks of every sequence where all have the same length (no cu_seqlens), else 0 */
    int bnseq;         /* N */
    int bnseg, bsegch; /* bseqch > 0: segments per sequence and chunks per segment (1, bseqch
                          without context parallelism), bnseg bsegch >= bseqch */
};

/* bwd_wy90 beside bwd_state90: the chunk of block row y (0 .. N S L - 1), in the order in
 * which the chains store theirs. Every sequence of bseqch chunks split alike into S
 * segments of L chunks (S = 1, L = bseqch without context parallelism): step y / (N S)
 * from each segment's end, then sequence and segment y % (N S); -1 past a sequence's end
 * (the last segment's missing steps). Any S L >= bseqch visits every chunk once; S and L
 * as the segment table's only make the order the chains'. Different lengths (bseqch 0):
 * the last chunk first (y = nc - 1 - c). */
static __device__ __forceinline__ int fq_bwd_wy_order(const fq_bwd_args &a, int y)
{
    if (a.bseqch <= 0) return (int)gridDim.y - 1 - y;
    const int S = a.bnseg, L = a.bsegch, ns = a.bnseq * S;
    const int step = y / ns, n = (y % ns) / S, sg = y % S;
    const int k = sg * L + (L - 1 - step);
    if (step >= L || k >= a.bseqch) return -1;
    return a.seqs[n].chunk0 + k;
}

/* bwd_wy90 beside bwd_state90: the block that waits for the whole of bwd_state90 before it
 * exits (the grid's last), so that the grid never completes before bwd_state90 */
static __device__ __forceinline__ int fq_bwd_wy_last(const fq_bwd_args &a)
{
    return a.bready && blockIdx.x == gridDim.x - 1 && blockIdx.y == gridDim.y - 1;
}

/* bwd_wy90 beside bwd_state90, one thread: until both column blocks' flags f[0], f[1] are
 * set (acquire loads; the block's barrier after it orders the block's loads after them).
 * After 20 ms without them (never expected: every chunk of a sequence is stored by a
 * chain) it waits for the whole of bwd_state90 instead, which covers every store too. */
static __device__ __forceinline__ void fq_bwd_wy_wait(const int *f)
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    uint64_t t0, t1;
    asm volatile("mov.u64 %0, %%globaltimer;\n" : "=l"(t0));
    while (!(fq_flag_ready(f) && fq_flag_ready(f + 1))) {
        __nanosleep(100);
        asm volatile("mov.u64 %0, %%globaltimer;\n" : "=l"(t1));
        if (t1 - t0 > 20000000ull) {
            fq_pdl_wait();
            break;
        }
    }
#endif
}

/* Context parallelism of the reverse pass (exact, as the forward's, DESIGN §2).
 * Per chunk the pass is affine in dS:
 *     dS <- (e^{g_C} I - W^T diag(kdecay) K) dS + (dS_local - W^T dv_local) = M_c dS + D_c
 * with M_c (K x K) the same for every state column, so a segment of chunks maps
 * the dS at its end to the dS at its start by [M | D] (K x (K + V)): the pass
 * itself run from [I | 0] with dv_local = dS_local = 0 in the M columns. Modes:
 *   CP 0  (FQ_BWD_CP_NONE) one chain per sequence from dht (no segment table);
 *   CP 1  (FQ_BWD_CP_MAP)  per segment but each sequence's first, K + V columns:
 *                          M blocks (columns < K) from I, D blocks from 0; nothing
 *                          stored per chunk; [M | D] to c.md;
 *   then fq_cp_combine_kernel<K, 1>: E_{n-1} = dht, E_{s-1} = M_s E_s + D_s (c.ss);
 *   CP 2  (FQ_BWD_CP_SEG)  per segment from E_s (dht for a sequence of one segment),
 *                          the per-chunk stores of CP 0; dh0 from each sequence's
 *                          first segment. */
#define FQ_BWD_CP_NONE 0
#define FQ_BWD_CP_MAP 1
#define FQ_BWD_CP_SEG 2
struct fq_bwd_cp_args {
    const fq_seg_info *segs; /* the segment table (fq_cuda_fwd_segments) */
    float *md;               /* [cp_bound, HV, K, K + V] the segments' maps (by fq_seg_info.cp) */
    const float *ss;         /* [cp_bound, HV, K, V] E_s, each split sequence's segment's start dS (by .cp) */
};

/* ------------------------------- epilogues shared by bwd_local / bwd_wy ----
 * (the mma.sync kernels of gdn_cuda_bwd_fused.cu and the wgmma ones of
 * gdn_cuda_bwd_fused_sm90.cu: the same fragment shape per thread) */

/* dg_r = sum_{s >= r} dgamma_s for the rows < len of value head j, warp 0 (lane l
 * holds dgamma of rows 2l, 2l + 1 in x0, x1): suf = the inclusive suffix sum of the
 * lanes' pairs, after = that of the lanes above (never suf - pair: a NaN or a large
 * finite dgamma of a row at or before r would reach dg_r through the subtraction,
 * which the reference's dg_r never sees) */
static __device__ __forceinline__ void fq_bwd_dg_store(const fq_bwd_args &a, float x0, float x1, int len, int64_t row0,
                                                       int j, int lane)
{
    const int HV = a.HV;
    float suf = x0 + x1;
    for (int o = 1; o < 32; o <<= 1) {
        const float yv = __shfl_down_sync(0xffffffffu, suf, o);
        if (lane + o < 32) suf += yv;
    }
    float after = __shfl_down_sync(0xffffffffu, suf, 1);
    if (lane == 31) after = 0.f;
    const float d1 = after + x1, d0 = d1 + x0;
    const int64_t o0 = (row0 + 2 * lane) * HV + j;
    if (2 * lane < len) fq_st_f(a.dg, a.gdt, o0, d0);
    if (2 * lane + 1 < len) fq_st_f(a.dg, a.gdt, o0 + HV, d1);
}

/* bwd_wy's last step of a value head j, warp 0 (lane l: rows 2l, 2l + 1):
 *   dgamma_r = sdg + sdgp (both halves) - scz (four quarters),
 *              + e^{gamma_C} <S, dS'> + sum x at the chunk's last row (sred)
 *   dg_r     = sum_{s >= r} dgamma_s,   dbeta_r = sdbp (both halves)
 * stored for the rows < len. gC = gamma_C of the chunk. sdg NULL and dgam_out
 * given (bwd_rev90, whose bwd_local runs after it): dgamma_r without sdg's part
 * to dgam_out[r] (every row of the chunk), no dg (bwd_local90 finishes it). */
static __device__ __forceinline__ void fq_bwd_dg_dbeta(const fq_bwd_args &a, const float *sdg, const float *sdgp,
                                                       const float *scz, const float *sdbp, const float *sred,
                                                       float gC, int len, int64_t row0, int j, int lane,
                                                       float *dgam_out = NULL)
{
    const int HV = a.HV;
    float x[2], db[2];
#pragma unroll
    for (int e = 0; e < 2; e++) {
        const int r = 2 * lane + e;
        x[e] = (sdg ? sdg[r] : 0.f) + sdgp[r] + sdgp[64 + r] - (scz[r] + scz[64 + r] + scz[128 + r] + scz[192 + r]);
        db[e] = sdbp[r] + sdbp[64 + r];
        if (r == len - 1) {
            float dot = 0.f, mx = 0.f;
            for (int q = 0; q < 8; q++) {
                dot += sred[q];
                mx += sred[8 + q];
            }
            x[e] += __expf(gC) * dot + mx;
        }
    }
    const int64_t o0 = (row0 + 2 * lane) * HV + j;
    if (2 * lane < len) fq_st_f(a.dbeta, a.gdt, o0, db[0]);
    if (2 * lane + 1 < len) fq_st_f(a.dbeta, a.gdt, o0 + HV, db[1]);
    if (dgam_out) {
        *(float2 *)(dgam_out + 2 * lane) = make_float2(x[0], x[1]);
        return;
    }
    fq_bwd_dg_store(a, x[0], x[1], len, row0, j, lane);
}

/* dx (dq or dk, [B*T, H, K] in the input dtype) from a thread's fragment of
 * dx_hat: y[4 nb + 2 h + e] at row r0 + 8 h, column col_of(nb) + e, for the
 * rows < len; x the forward input (q or k), row r at x + (qrow + r H) K.
 *   ADD:  dx_hat += add[r H K + col]          (bwd_wy: bwd_local's dK_O)
 *   srn != NULL (use_qk_l2norm, srn[r] = the row's inverse norm rn):
 *         x_hat = rn x,   dx = rn (dx_hat - x_hat (x_hat . dx_hat))
 *   the row dot over the two column halves of the block (half 0 / 1) meets in
 *   srowp[64 half + r] across a block barrier (every thread calls this). */
template <int NB, bool ADD, class ColOf>
static __device__ __forceinline__ void fq_bwd_dx_store(const fq_bwd_args &a, const void *x, void *dx, float *y,
                                                       const float *add, const float *srn, float *srowp, int half,
                                                       int r0, ColOf col_of, int len, int64_t qrow, int K)
{
    const int H = a.H;
    if (ADD) {
#pragma unroll
        for (int nb = 0; nb < NB; nb++)
#pragma unroll
            for (int h = 0; h < 2; h++) {
                const int r = r0 + 8 * h, col = col_of(nb);
                if (r < len) {
                    const float2 p = *(const float2 *)(add + (int64_t)r * H * K + col);
                    y[4 * nb + 2 * h] += p.x;
                    y[4 * nb + 2 * h + 1] += p.y;
                }
            }
    }
    if (srn) {
        float dot[2] = {0.f, 0.f};
#pragma unroll
        for (int nb = 0; nb < NB; nb++)
#pragma unroll
            for (int h = 0; h < 2; h++) {
                const int r = r0 + 8 * h, col = col_of(nb);
                if (r < len) {
                    const int64_t o = (qrow + (int64_t)r * H) * K + col;
                    dot[h] += srn[r] * (fq_ld_f(x, a.dt, o) * y[4 * nb + 2 * h] +
                                        fq_ld_f(x, a.dt, o + 1) * y[4 * nb + 2 * h + 1]);
                }
            }
        const float d0 = fq_quad_sum(dot[0]), d1 = fq_quad_sum(dot[1]);
        if ((threadIdx.x & 3) == 0) {
            srowp[64 * half + r0] = d0;
            srowp[64 * half + r0 + 8] = d1;
        }
        __syncthreads();
    }
#pragma unroll
    for (int nb = 0; nb < NB; nb++)
#pragma unroll
        for (int h = 0; h < 2; h++) {
            const int r = r0 + 8 * h, col = col_of(nb);
            if (r < len) {
                const int64_t o = (qrow + (int64_t)r * H) * K + col;
                float y0 = y[4 * nb + 2 * h], y1 = y[4 * nb + 2 * h + 1];
                if (srn) {
                    const float rr = srn[r], dt = srowp[r] + srowp[64 + r];
                    y0 = rr * (y0 - rr * fq_ld_f(x, a.dt, o) * dt);
                    y1 = rr * (y1 - rr * fq_ld_f(x, a.dt, o + 1) * dt);
                }
                fq_st_f2(dx, a.dt, o, y0, y1);
            }
        }
}

/* bwd_local (gdn_cuda_bwd_fused.cu): one block per (chunk, q/k head)
 * looping over the GVA group; dq finished in the block (GVA sum + L2-norm
 * backward), dK_O summed over the group (into a.dkp, for bwd_wy); the
 * chunk-start state is loaded as a second cp.async group, waited for only
 * before dO S^T. nc: chunk-table bound (grid x). */
fq_status fq_bwd_local_launch(const fq_gdn_params *p, const fq_bwd_args &a, int64_t nc, cudaStream_t stream);
/* bwd_state (gdn_cuda_bwd_state.cu), the reverse state pass laid out like the
 * forward's stage B: dS^T in registers, 16 columns per warp (ks 1) or warp
 * pair (ks 2, K-split); bv state columns per block (16, 32, 64); bv = ks = 0
 * picks by the number of 16-column chains vs SMs, unless the environment
 * variable FLASHQLA_CUDA_BWD_STATE=BV:KS (read once) forces one. Grid
 * N * HV * V / bv. segws: NULL, or the segment table, maps and start states
 * (segs, md, ss, seg_bound of a fused-forward workspace layout, after
 * fq_cuda_fwd_segments; K <= 128): the exact context parallelism of the
 * reverse pass (gdn_cuda_bwd_state.cu). */
fq_status fq_bwd_state_launch(const fq_gdn_params *p, const fq_bwd_args &a, const fq_fwd_ws *segws, int bv, int ks,
                              cudaStream_t stream);
/* bwd_wy (gdn_cuda_bwd_fused.cu): one block per (chunk, q/k head) looping
 * over the GVA group; also finishes dk (GVA sum of the dK_O partials in
 * a.dkp, L2-norm backward). */
fq_status fq_bwd_wy_launch(const fq_gdn_params *p, const fq_bwd_args &a, int64_t nc, cudaStream_t stream);
/* 1 where the backward runs its sm_90a kernels (gdn_cuda_bwd_fused_sm90.cu,
 * gdn_cuda_bwd_state_sm90.cu): K = V = 128, this device runs the module's
 * sm_90a code, and FLASHQLA_CUDA_BWD_SM90 is not 0 (read once: the mma.sync
 * kernels and bwd_state on Hopper too, for timing and testing them). */
int fq_bwd_sm90_path(const fq_gdn_params *p);
/* bwd_local and bwd_wy on sm_90a (gdn_cuda_bwd_fused_sm90.cu): the same blocks
 * and results with wgmma products (bwd_local without dv_local, dS_local:
 * bwd_state90 forms them); *done = 0 (and nothing launched) where
 * fq_bwd_sm90_path says no. */
fq_status fq_bwd_local90_launch(const fq_gdn_params *p, const fq_bwd_args &a, int64_t nc, cudaStream_t stream,
                                int *done);
/* a.bready (fq_bwd_wy_beside): bwd_wy90 launched with programmatic serialization right
 * after bwd_state90's last pass, blocks (q/k head, fq_bwd_wy_order's row y): N S L rows
 * (nc with cu_seqlens) */
fq_status fq_bwd_wy90_launch(const fq_gdn_params *p, const fq_bwd_args &a, int64_t nc, cudaStream_t stream, int *done);
/* bwd_state90 (gdn_cuda_bwd_state_sm90.cu), where fq_bwd_sm90_path: the reverse
 * state pass as bwd_state (the same dsl, dvl, dh0 and context parallelism:
 * segws as there) with dv_local and dS_local formed on chip from q, k, dO;
 * one warp-specialised CTA per (sequence or segment, value head, 64 state
 * columns). nc: the chunk-table bound (the workspace's per-chunk arrays). */
fq_status fq_bwd_state90_launch(const fq_gdn_params *p, const fq_bwd_args &a, const fq_fwd_ws *segws, int64_t nc,
                                cudaStream_t stream);
/* The q, k, A, dO tensor maps that bwd_state90 and bwd_rev90 share (m[0..3];
 * gdn_cuda_bwd_state_sm90.cu; CUtensorMap from <cuda.h>, through gdn_cuda_hopper.cuh). */
struct CUtensorMap_st;
fq_status fq_bwd_tmaps_qkado(const fq_gdn_params *p, const fq_bwd_args &a, int64_t nc, struct CUtensorMap_st *m);
/* Its MAP pass over segws's segments and the reverse combine only (the start
 * dS E_s of every split sequence's segments in segws->ss), for bwd_rev90. */
fq_status fq_bwd_state90_map(const fq_gdn_params *p, const fq_bwd_args &a, const fq_fwd_ws *segws, int64_t nc,
                             cudaStream_t stream);
/* bwd_rev90 (gdn_cuda_bwd_reverse_sm90.cu), where fq_bwd_sm90_path: the reverse
 * state pass fused with bwd_wy's products (one warp-specialised CTA per
 * (sequence or segment, value head)): dv, dbeta, its dgamma into a.dgam and its
 * dK per value head into a.dkw (bf16); nothing in dsl, dvl. segws as
 * bwd_state90's (its MAP pass and combine first). bwd_local90 runs after it
 * (a.dkw given) and finishes dq, dk (the group's sum) and dg. */
fq_status fq_bwd_rev90_launch(const fq_gdn_params *p, const fq_bwd_args &a, const fq_fwd_ws *segws, int64_t nc,
                              cudaStream_t stream);

#endif /* FQ_GDN_CUDA_BWD_CUH */
