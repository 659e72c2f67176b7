/*
 * gdn_cuda_state.cuh — pieces shared by the two sequential state passes,
 * forward stage B (gdn_cuda_fwd_state.cu: S over the chunks) and the
 * backward's reverse pass (gdn_cuda_bwd_state.cu: dS over the chunks in
 * reverse). Both keep a K x 16 slice of the state transposed, X^T (16 state
 * columns v x the warp's K/KS state rows k), as m16n8k16 accumulators: lane
 * (g = lane / 4, t = lane % 4) holds X^T[g (+8)][k0 + 8 nt + 2t (+1)] in
 * X[nt][0..3], which is also the A-operand layout of the next product.
 */
#ifndef FQ_GDN_CUDA_STATE_CUH
#define FQ_GDN_CUDA_STATE_CUH

#include "gdn_cuda_common.cuh"

/* Transposed bf16 store: w = bf16x2 (X[v][k], X[v][k+1]) of a fragment whose
 * lane g holds column v = v0 + g goes into out[k][v]: lanes g and g^1 swap
 * words; even g stores (X[v][k], X[v+1][k]) at row k, odd g stores
 * (X[v-1][k+1], X[v][k+1]) at row k+1. dst = the lane's address,
 * out + (k + (g & 1)) * ld + v0 + (g & ~1) (fq_st_t_lane gives the part that
 * does not depend on the fragment). All 32 lanes must call it; `store`
 * false: the shuffle only. */
static __device__ __forceinline__ void fq_st_transposed(fq_bf16 *dst, uint32_t w, int g, bool store = true)
{
    uint32_t p = __shfl_xor_sync(0xffffffffu, w, 4); /* always: no shuffle under a branch */
    uint32_t x = (g & 1) ? __byte_perm(p, w, 0x7632) : __byte_perm(w, p, 0x5410);
    if (store) *(uint32_t *)dst = x;
}

/* out + (2t + (g & 1)) * ld + (g & ~1): the lane part of fq_st_transposed's
 * address for fragments whose k = k_frag + 2t */
static __device__ __forceinline__ fq_bf16 *fq_st_t_lane(fq_bf16 *out, int64_t ld, int lane)
{
    int g = lane >> 2, t = lane & 3;
    return out + (int64_t)(2 * t + (g & 1)) * ld + (g & ~1);
}

/* dst[off + (k, v)] = the lane's part of X (rows k0.., columns vw..), in
 * the layout vk of fq_state_at. (The loads of h0 / dht are written out in
 * each kernel: through a helper the backward's compiled differently.) */
template <int NKT>
static __device__ __forceinline__ void fq_state_slice_store(const float X[NKT][4], float *dst, int64_t off, int k0,
                                                            int vw, int K, int V, int vk, int g, int t)
{
#pragma unroll
    for (int nt = 0; nt < NKT; nt++)
#pragma unroll
        for (int e = 0; e < 4; e++) {
            const int k = k0 + 8 * nt + 2 * t + (e & 1), v = vw + g + 8 * (e >> 1);
            dst[off + fq_state_at(k, v, K, V, vk)] = X[nt][e];
        }
}

/* X^T[:, k0..] += A B[:, k0..] over a chunk: A = 16 x 64 as four k-steps of
 * A fragments (registers), B = the chunk's 64 x K tile in shared memory (row
 * stride ldb); X holds KW / 8 n8 tiles. */
template <int KW>
static __device__ __forceinline__ void fq_state_rank_update(float X[KW / 8][4], const uint32_t A[4][4],
                                                            const fq_bf16 *B, int ldb, int k0)
{
#pragma unroll
    for (int kk = 0; kk < 4; kk++) {
#pragma unroll
        for (int n2 = 0; n2 < KW / 16; n2++) {
            uint32_t b[4];
            fq_frag_b_kn(b, B, ldb, 16 * kk, k0 + 16 * n2);
            fq_mma_bf16(X[2 * n2], A[kk], b[0], b[1]);
            fq_mma_bf16(X[2 * n2 + 1], A[kk], b[2], b[3]);
        }
    }
}

/* K-split 2: the two warps of a group each hold a partial 16 x 64 product P;
 * both need the sum. fq_pair_put writes this warp's P to its exchange area
 * xo (512 float2); after a barrier over the pair, fq_pair_add adds the
 * partner's (xp) in place, so both warps hold the same sum bitwise. */
static __device__ __forceinline__ void fq_pair_put(const float P[8][4], float2 *xo, int lane)
{
#pragma unroll
    for (int nt = 0; nt < 8; nt++) {
        xo[(2 * nt) * 32 + lane] = make_float2(P[nt][0], P[nt][1]);
        xo[(2 * nt + 1) * 32 + lane] = make_float2(P[nt][2], P[nt][3]);
    }
}
static __device__ __forceinline__ void fq_pair_add(float P[8][4], const float2 *xp, int lane)
{
#pragma unroll
    for (int nt = 0; nt < 8; nt++) {
        const float2 p0 = xp[(2 * nt) * 32 + lane], p1 = xp[(2 * nt + 1) * 32 + lane];
        P[nt][0] += p0.x;
        P[nt][1] += p0.y;
        P[nt][2] += p1.x;
        P[nt][3] += p1.y;
    }
}

/* The combine step of context parallelism (the fused forward's, REV = 0;
 * the backward's reverse state pass, REV = 1): one block of K threads
 * (thread = state row kd) per (segment slot, value head, FQ_CMB_CW = 8 state
 * columns); only a sequence's segment 0 (REV: its last segment, n - 1) works,
 * walking its segments:
 *   forward:  S_0 = h0 at the sequence's slot (0 without one, NaN for a
 *             duplicate slot)                          ->  ss[first]
 *             S_{sigma+1} = M_sigma S_sigma + D_sigma  ->  ss[first + sigma + 1]
 *   REV:      E_{n-1} = dht at the slot (0 without)    ->  ss[first + n - 1]
 *             E_{sigma-1} = M_sigma E_sigma + D_sigma  ->  ss[first + sigma - 1]
 *             (dS at a segment's end from dS at the next one's: the reverse
 *             pass's map, gdn_cuda_bwd_state.cu)
 * Only the state carries from one step to the next: the maps M_sigma (K x K)
 * do not depend on it, so the next step's M is on its way into shared memory
 * (cp.async, NB = 2 buffers of K x (K + 4) floats; NB = 1 where the device's
 * shared memory per block is too small: then after the step) while a step
 * multiplies, and a step is its arithmetic: row kd of M_sigma from shared
 * memory (float4, row stride K + 4: conflict-free), S_sigma's rows broadcast,
 *   x[c] = D[kd][c] + sum_{m = 0 .. K-1, ascending} M[kd][m] S[m][c]
 * (the order of the kernel before, which streamed M by slices of 32 columns
 * behind the state: 8 dependent L2 round trips per step; 141 -> 81 us for
 * the forward maps, 72 -> 44 for the reverse ones at 2/4 heads x 32768
 * tokens on the H100, benchmarks/NOTES.md session 19; D's row is still
 * loaded at each step's start, the next thing to move ahead with the map).
 * md == NULL (the forward only, REV = 0): md and ss are in o's rows
 * (fq_omap) instead of slots si.cp, si.cp + 1, ... */
#define FQ_CMB_CW 8
template <int K> static __host__ __device__ constexpr int fq_cmb_smem_bytes(int nb)
{
    return (nb * K * (K + 4) + K * FQ_CMB_CW) * 4;
}

template <int K, int REV, int NB>
__global__ void __launch_bounds__(K) fq_cp_combine_kernel(const fq_seg_info *segs, const float *md, const float *h0,
                                                          float *ss, int HV, int V, int vk, fq_omap om)
{
    constexpr int CW = FQ_CMB_CW, LDM = K + 4, PPR = K / 4; /* float4 pieces per map row */
    extern __shared__ __align__(16) float fq_cmb_smem[];
    float *Ms = fq_cmb_smem;          /* [NB][K][LDM] */
    float *S = Ms + NB * K * LDM;     /* [K][CW]: the state's columns of this block */
    fq_pdl_trigger();
    fq_pdl_wait();
    const int nvc = V / CW;
    const int vc = blockIdx.x % nvc, j = (blockIdx.x / nvc) % HV, gs = blockIdx.x / (nvc * HV);
    const fq_seg_info si = segs[gs];
    if (si.seq < 0 || si.index != (REV ? si.count - 1 : 0) || si.count < 2) return;
    constexpr int dir = REV ? -1 : 1; /* (the maps walked: si.cp, si.cp + dir, ...) */
    const int kd = threadIdx.x, c0 = CW * vc;
    const int64_t hbase = ((int64_t)si.slot * HV + j) * K * V;
    const float fill = si.slot == FQ_SLOT_DUP ? __int_as_float(0x7fc00000) : 0.f;
    float x[CW];
#pragma unroll
    for (int c = 0; c < CW; c++) x[c] = h0 && si.slot >= 0 ? h0[hbase + fq_state_at(kd, c0 + c, K, V, vk)] : fill;
    /* md and ss of the sg-th segment walked: by the segments' compact slots si.cp,
     * si.cp + dir, ...; or in o's rows (segment sg from si.bos, si.nchunks chunks
     * each), element (row, col) of a map in its block col / 64 whose first row R
     * (fq_omap_blk) is found once per block of 64 columns */
    const int omap = !REV && !md;
    auto mdp = [&](int sg, int64_t R, int row, int col) -> const float * {
        if (omap) return fq_omap_at(om, R, j, row, col & 63);
        return md + ((int64_t)(si.cp + dir * sg) * HV + j) * K * (K + V) + (int64_t)row * (K + V) + col;
    };
    auto blk = [&](int sg, int col) -> int64_t {
        return omap ? fq_omap_blk(om, si.bos, si.nchunks, si.count, om.ncb * sg + (col >> 6)) : 0;
    };
    auto ssp = [&](int sg) -> float * { /* row kd, columns c0 .. c0 + CW - 1 */
        if (omap) return fq_omap_ss(om, si.bos + (int64_t)64 * si.nchunks * sg, j, c0 >> 6, kd, c0 & 63);
        return ss + (((int64_t)(si.cp + dir * sg) * HV + j) * K + kd) * V + c0;
    };
    /* M of the sg-th segment walked into dst, by cp.async (16-byte pieces: a
     * warp copies 512 contiguous bytes of a row at K = 128); no commit */
    auto issue_map = [&](int sg, float *dst) {
        const int64_t R0 = blk(sg, 0), R1 = K > 64 ? blk(sg, 64) : R0;
#pragma unroll 4
        for (int p = 0; p < K / 4; p++) {
            const int f = p * K + kd, row = f / PPR, col = 4 * (f % PPR);
            fq_cp_async16(dst + row * LDM + col, mdp(sg, col < 64 ? R0 : R1, row, col), 16);
        }
    };
    float *ss0 = ssp(0);
#pragma unroll
    for (int c = 0; c < CW; c++) ss0[c] = x[c];
    issue_map(0, Ms);
    fq_cp_async_commit();
    for (int sg = 0; sg + 1 < si.count; sg++) {
        const float *Mc = Ms + (NB == 2 ? (sg & 1) : 0) * K * LDM;
        if (NB == 2 && sg + 2 < si.count) issue_map(sg + 1, Ms + ((sg + 1) & 1) * K * LDM);
        fq_cp_async_commit();
        /* row kd of D (its columns c0 ..) */
        float d[CW];
        const int64_t RD = blk(sg, K + c0);
#pragma unroll
        for (int c = 0; c < CW; c += 4) {
            const float4 v4 = *(const float4 *)mdp(sg, RD, kd, K + c0 + c);
            d[c] = v4.x, d[c + 1] = v4.y, d[c + 2] = v4.z, d[c + 3] = v4.w;
        }
#pragma unroll
        for (int c = 0; c < CW; c++) S[kd * CW + c] = x[c];
        fq_cp_async_wait<1>(); /* this step's map (every group but the newest) */
        __syncthreads();       /* S and the map visible to every thread */
#pragma unroll
        for (int c = 0; c < CW; c++) x[c] = d[c];
        /* x += M[kd][m] S[m][:], m ascending */
#pragma unroll 2
        for (int m = 0; m < K; m += 4) {
            const float4 a4 = *(const float4 *)(Mc + kd * LDM + m);
            const float am[4] = {a4.x, a4.y, a4.z, a4.w};
#pragma unroll
            for (int q = 0; q < 4; q++) {
                const float4 *sr = (const float4 *)(S + (m + q) * CW);
#pragma unroll
                for (int h = 0; h < CW / 4; h++) {
                    const float4 b = sr[h];
                    x[4 * h] += am[q] * b.x, x[4 * h + 1] += am[q] * b.y, x[4 * h + 2] += am[q] * b.z,
                        x[4 * h + 3] += am[q] * b.w;
                }
            }
        }
        float *dst = ssp(sg + 1);
#pragma unroll
        for (int c = 0; c < CW; c++) dst[c] = x[c];
        __syncthreads(); /* every thread done with S and this map before they are rewritten */
        if (NB == 1 && sg + 2 < si.count) issue_map(sg + 1, Ms);
    }
    fq_cp_async_wait<0>(); /* nothing in flight at exit */
}

#ifdef __cplusplus
template <int K, int REV>
static fq_status fq_cp_combine_launch_k(const fq_gdn_params *p, const fq_fwd_ws *ws, const float *h0,
                                        cudaStream_t stream)
{
    /* map buffers: 2, or 1 where two do not fit a block's shared memory (the
     * attribute is set only for the kernel launched: fq_cuda_set_smem caches it) */
    int dev = 0, optin = 0;
    FQ_CUDA_CHECK(cudaGetDevice(&dev));
    FQ_CUDA_CHECK(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev));
    const int nb = optin >= fq_cmb_smem_bytes<K>(2) ? 2 : 1, bytes = fq_cmb_smem_bytes<K>(nb);
    void (*kern)(const fq_seg_info *, const float *, const float *, float *, int, int, int, fq_omap) =
        nb == 2 ? fq_cp_combine_kernel<K, REV, 2> : fq_cp_combine_kernel<K, REV, 1>;
    fq_status st = fq_cuda_set_smem((const void *)kern, bytes);
    if (st != FQ_OK) return st;
    const unsigned grid = (unsigned)(ws->seg_bound * p->HV * (p->V / FQ_CMB_CW));
    return fq_launch_k(kern, grid, K, (size_t)bytes, stream, fq_cuda_pdl_enabled(), (const fq_seg_info *)ws->segs,
                       (const float *)ws->md, h0, ws->ss, (int)p->HV, (int)p->V, (int)p->state_vk, fq_omap_of(p));
}

/* The combine step over ws's segment slots (ws->segs, md, ss, seg_bound;
 * K = 64 or 128): h0 is the forward's start states (REV = 0) or the
 * backward's dht (REV = 1), in layout p->state_vk. */
template <int REV>
static fq_status fq_cp_combine_launch(const fq_gdn_params *p, const fq_fwd_ws *ws, const float *h0,
                                      cudaStream_t stream)
{
    if (p->K == 128) return fq_cp_combine_launch_k<128, REV>(p, ws, h0, stream);
    if (p->K == 64) return fq_cp_combine_launch_k<64, REV>(p, ws, h0, stream);
    return fq_cuda_head_dims_unsupported(p);
}
#endif

#endif /* FQ_GDN_CUDA_STATE_CUH */
