/*
 * gdn_cuda_bwd_state_sm90.cu — the reverse state pass (step 4 of
 * gdn_cuda_bwd.cu) on sm_90a at K = V = 128, bwd_state90: the chain of
 * fq_bwd_state_kernel (gdn_cuda_bwd_state.cu, which keeps every other head
 * size and the compute_80 PTX path) as a warp-specialised kernel in the
 * fused forward's form (gdn_cuda_fwd_fused.cuh), with step 3's dv_local and
 * dS_local formed on chip instead of read from bwd_local's stores. Per CTA one
 * (sequence or segment n, value head j, block of 64 state columns vb); per
 * chunk, last to first, with dS (the gradient of the state after the chunk,
 * dS' below) held as wgmma accumulators:
 *
 *   forward lines:  O  = diag(qg) Q S + P Vn,     P = lower_incl(Q K^T ⊙ Gamma) diag(scale rq) . diag(rk)
 *                   Vn = U - W S,                 S' = e^{gamma_C} S + K^T diag(kd) Vn
 *   so:  dS_next[c] = dS'                                         (bf16 -> dsl, for bwd_wy)
 *        dVn        = P^T dO + diag(kd) K dS'                     (bf16 -> dvl, for bwd_wy)
 *        dS         = e^{gamma_C} dS' + Q^T diag(qg) dO - W^T dVn
 *   with qg = scale e^gamma rq, kd = e^{gamma_C - gamma} rk (a.kdecay), gamma,
 *   W = A diag(fw) K, fw = beta e^gamma rk, A from the recompute's stage A
 *   (gdn_cuda_fwd_wy.cu); ending in dh0. W itself is never formed: the update
 *   is dS -= ((dVn^T A) diag(fw)) K.
 *
 * Three warpgroups (384 threads), one CTA per SM (~198 KB of shared memory):
 *   WG0, producer: one thread issues the TMA loads of a chunk's Q, K, A
 *        (K x 64 rows) and dO (this CTA's 64 columns) tiles and bulk copies of
 *        its gamma and kdecay into the stage (mbarrier `full`), three chunks
 *        deep, last chunk first; warps 1..3 (the checker) zero the rows past
 *        the chunk's tokens (another sequence's) in Q, K, dO, convert dO
 *        where it is not bf16 (or not 16-byte aligned: no TMA), and form the row
 *        vectors qg, scale rq, rk (`checked`); setmaxnreg 40.
 *   WG1, local: P = Q K^T (gated, masked by selects), then
 *        dVn_local^T = dO^T P (dO^T from registers, its non-finite elements
 *        zeroed: causality, as bwd_local's dv_local) into the exchange tile L
 *        (bf16 [v][r], double-buffered; lfull / lempty).
 *   WG2, chain: dS^T (64 columns v x K) in registers; per chunk
 *          dS_next^T                      to dsl by TMA store (transposed by stmatrix)
 *          X^T  = dS'^T K^T               (A = dS'^T bf16 from registers, K K-major)
 *          dS^T = e^{gamma_C} dS'^T + (dO^T diag(qg)) Q   (A = dO^T scaled, registers; Q MN-major)
 *          dVn^T = L + X^T diag(kd)       bf16, to dvl by TMA store
 *          Z^T  = dVn^T A                 (A = dVn^T from registers, A's tile MN-major)
 *          dS^T -= (Z^T diag(fw)) K       (A = -Z'^T bf16 from registers, K MN-major;
 *                                          NaN where stage A flagged the item: a.aflag)
 *
 * The same equations, bf16 operands and selects as fq_bwd_state_kernel plus
 * bwd_local's dv_local / dS_local, except that dS_local enters dS straight
 * from the accumulators (no bf16 store in between). Context parallelism
 * (few heads, long sequences; fq_bwd_cp_args, gdn_cuda_bwd.cuh): MAP per
 * segment over K + V columns (M blocks from I with no dO term: no loads of Q,
 * dO, no local work; D blocks from 0), the reverse combine, then the pass per
 * segment (SEG). Deterministic: no atomics, fixed orders.
 *
 * Shared-memory tiles are SWIZZLE_128B, 64 x 64 bf16, as TMA writes them
 * (gdn_cuda_hopper.cuh explains the operand descriptors).
 */
#include "gdn_cuda_bwd.cuh"
#include "gdn_cuda_hopper.cuh"
#include "gdn_cuda_state.cuh" /* fq_cp_combine_launch */

#include <string.h>

#define FQ_BST_STAGES 3

/* Shared memory of one CTA. Per stage: Q (2 tiles), K (2), A (1), dO (1: this
 * CTA's 64 columns). Then P [r][s] (the local warpgroup's own), two L tiles
 * (dVn_local^T [v][s], local -> chain), the staging of dS_next^T as [kd][v]
 * (2 tiles) and of dVn as [s][v] (1), the barriers and per stage the row
 * vectors: gamma, kdecay (bulk copies), qg, scale rq, rk, fw (the checker). */
struct fq_bst_smem {
    static constexpr int NS = FQ_BST_STAGES;
    static constexpr int off_q = 0;
    static constexpr int off_k = off_q + 2 * FQ_TILE;
    static constexpr int off_a = off_k + 2 * FQ_TILE; /* A [r][c] (W = A diag(fw) K is never formed) */
    static constexpr int off_do = off_a + FQ_TILE;
    static constexpr int stage = off_do + FQ_TILE;
    static constexpr int off_p = NS * stage;
    static constexpr int off_l = off_p + FQ_TILE;
    static constexpr int off_ds = off_l + 2 * FQ_TILE;
    static constexpr int off_dv = off_ds + 2 * FQ_TILE;
    static constexpr int off_bar = off_dv + FQ_TILE;
    /* per stage: full, empty, checked; per L buffer: lfull, lempty */
    static constexpr int nbar = 3 * NS + 4;
    static constexpr int off_vec = off_bar + (nbar * 8 + 15) / 16 * 16;
    static constexpr int VG = 0, VKD = 64, VQG = 128, VPQ = 192, VRK = 256, VFW = 320, vec_floats = 384;
    static constexpr int bytes = off_vec + NS * vec_floats * 4 + 1024; /* + alignment slack */
    static_assert(stage % 1024 == 0 && off_p % 1024 == 0, "tiles keep their 1024-byte alignment");
    static_assert(bytes <= 227 * 1024, "one CTA per SM");
};

struct fq_bst_args {
    fq_bwd_args a;
    fq_bwd_cp_args c;
    int ncb;     /* column blocks of 64 per (unit, head): V / 64, MAP (K + V) / 64 */
    int do_tma;  /* dO by TMA (bf16, 16-byte aligned); else converted by the checker */
};

#if FQ_SM90A
/* An A operand's 8 x 8 blocks stored transposed (stmatrix.trans) into a
 * staging tile set: K-step kk of a 64-row (v) operand, whose K-index
 * (16 kk ..) becomes the destination row (tile (16 kk) / 64), v the column */
static __device__ __forceinline__ void fq_bst_store_t(unsigned char *dst, const uint32_t (&a)[4], int kk, int w,
                                                     int lane)
{
    const int m = lane >> 3, row = 16 * kk + 8 * (m >> 1) + (lane & 7), v0 = 16 * w + 8 * (m & 1);
    fq_stsm_x4_t(fq_smem_u32(dst + (row >> 6) * FQ_TILE + fq_sw128(row & 63, 2 * v0)), a[0], a[1], a[2], a[3]);
}

/* bwd_wy90 beside this pass (a.bready): the flag of a chunk's stores, set once they are
 * complete and visible (thread tc = 0, the one that issued them): the bulk group's
 * completion, the async proxy's writes ordered before the generic release */
static __device__ __forceinline__ void fq_bst_publish(int *flag)
{
    fq_bulk_wait0();
    fq_fence_proxy_async_global();
    fq_flag_publish(flag);
}

/* The chain's per-chunk stores of dS_next (ds: 8 K-steps of a bf16 A operand, 64 rows v)
 * and dVn (dv: 4 K-steps) to global memory: each transposed (fq_bst_store_t) into its
 * staging tiles, one proxy fence, then two TMA stores (boxes at (c0, 0, tile)) by thread
 * tc = 0 of the chain warpgroup, one bulk group. The staging is free once the group of
 * the chunk before has read it; pub (bwd_wy90 beside, else NULL): the flag of the chunk
 * before, set once its group is complete (a chunk later than its issue: no wait on the
 * chain in the usual case) */
static __device__ __forceinline__ void fq_bst_stage_stores(unsigned char *sds, const uint32_t (&ds)[8][4],
                                                          unsigned char *sdv, const uint32_t (&dv)[4][4],
                                                          const CUtensorMap *tm_ds, const CUtensorMap *tm_dv, int c0,
                                                          int tile, int tc, int w, int lane, int *pub)
{
    if (tc == 0) {
        if (pub) fq_bst_publish(pub);
        else fq_bulk_wait_read<0>();
    }
    fq_named_bar(2, 128);
#pragma unroll
    for (int kk = 0; kk < 8; kk++) fq_bst_store_t(sds, ds[kk], kk, w, lane);
#pragma unroll
    for (int kk = 0; kk < 4; kk++) fq_bst_store_t(sdv, dv[kk], kk, w, lane);
    fq_fence_async_smem();
    fq_named_bar(2, 128);
    if (tc == 0) {
        fq_tma_store_3d(tm_ds, sds, c0, 0, tile);
        fq_tma_store_3d(tm_dv, sdv, c0, 0, tile);
        fq_bulk_commit();
    }
}

#endif

template <int CP>
__global__ void __launch_bounds__(384, 1)
    fq_bwd_state90_kernel(const __grid_constant__ CUtensorMap tm_q, const __grid_constant__ CUtensorMap tm_k,
                          const __grid_constant__ CUtensorMap tm_a, const __grid_constant__ CUtensorMap tm_do,
                          const __grid_constant__ CUtensorMap tm_ds, const __grid_constant__ CUtensorMap tm_dv,
                          const __grid_constant__ fq_bst_args args)
{
#if FQ_SM90A
    constexpr int K = 128, V = 128, NS = FQ_BST_STAGES;
    constexpr int MAP = CP == FQ_BWD_CP_MAP;
    typedef fq_bst_smem SM;
    extern __shared__ __align__(16) unsigned char smem_raw[];
    unsigned char *smem = smem_raw + ((1024 - (fq_smem_u32(smem_raw) & 1023)) & 1023);
    uint64_t *full = (uint64_t *)(smem + SM::off_bar), *empty = full + NS, *checked = empty + NS;
    uint64_t *lfull = checked + NS, *lempty = lfull + 2;
    const fq_bwd_args &a = args.a;
    /* bwd_wy90 beside this pass (a.bready) may start at once on the SMs left free
     * (a no-op where the next kernel is launched without programmatic serialization) */
    if constexpr (CP != FQ_BWD_CP_MAP) fq_pdl_trigger();

    const int HV = a.HV, ncb = args.ncb;
    const int cb = blockIdx.x % ncb, j = (blockIdx.x / ncb) % HV, unit = blockIdx.x / (ncb * HV);
    const int hq = j / (HV / a.H);
    /* MAP: blocks cb < K / 64 are the columns of M (start = I, no dO term), the
     * others those of D (V's column block cb - K / 64) */
    const int mblk = MAP && cb < K / 64;
    const int vb = MAP ? cb - K / 64 : cb;
    int bos, slen, chunk0, nch, seq, sidx = 0, scount = 1, cps = 0;
    if constexpr (CP == FQ_BWD_CP_NONE) {
        const fq_seq_info si = a.seqs[unit];
        bos = si.bos, slen = si.len, chunk0 = si.chunk0, nch = si.nchunks, seq = unit;
    } else {
        const fq_seg_info sg = args.c.segs[unit];
        if (sg.seq < 0 || (MAP && sg.index == 0)) return; /* (block-uniform, before any barrier) */
        bos = sg.bos, slen = sg.len, chunk0 = sg.chunk0, nch = sg.nchunks, seq = sg.seq;
        sidx = sg.index, scount = sg.count, cps = sg.cp;
    }
    const int tid = threadIdx.x, wg = tid >> 7;

    if (tid == 0) {
        for (int s = 0; s < NS; s++) {
            fq_mbar_init(&full[s], 1);
            fq_mbar_init(&empty[s], 256); /* the local and the chain warpgroups */
            fq_mbar_init(&checked[s], 96);
        }
        for (int b = 0; b < 2; b++) {
            fq_mbar_init(&lfull[b], 128);
            fq_mbar_init(&lempty[b], 128);
        }
        fq_mbar_init_fence();
        fq_tma_prefetch_desc(&tm_q);
        fq_tma_prefetch_desc(&tm_k);
        fq_tma_prefetch_desc(&tm_a);
        if (args.do_tma) fq_tma_prefetch_desc(&tm_do);
    }
    __syncthreads();

    if (wg == 0) {
        /* ---------------------------------------------------- producer ---- */
        fq_setmaxnreg_dec<40>();
        if (tid == 0) {
            const int qdo = !mblk; /* (MAP's M blocks: no Q, no dO) */
            const uint32_t bytes = (uint32_t)(3 + (qdo ? 2 + (args.do_tma ? 1 : 0) : 0)) * FQ_TILE + 512;
            for (int st = 0; st < nch; st++) {
                const int i = nch - 1 - st, s = st % NS;
                if (st >= NS) fq_mbar_wait(&empty[s], ((st / NS) - 1) & 1);
                unsigned char *sm = smem + s * SM::stage;
                float *vec = (float *)(smem + SM::off_vec) + s * SM::vec_floats;
                const int row = bos + 64 * i, tile = (chunk0 + i) * HV + j;
                fq_mbar_arrive_tx(&full[s], bytes);
                fq_bulk_load(vec + SM::VG, a.gamma + (int64_t)tile * 64, 256, &full[s]);
                fq_bulk_load(vec + SM::VKD, a.kdecay + (int64_t)tile * 64, 256, &full[s]);
                fq_tma_load_3d(sm + SM::off_a, &tm_a, &full[s], 0, 0, tile);
#pragma unroll
                for (int kt = 0; kt < 2; kt++) {
                    fq_tma_load_3d(sm + SM::off_k + kt * FQ_TILE, &tm_k, &full[s], 64 * kt, hq, row);
                    if (qdo) fq_tma_load_3d(sm + SM::off_q + kt * FQ_TILE, &tm_q, &full[s], 64 * kt, hq, row);
                }
                if (qdo && args.do_tma) fq_tma_load_3d(sm + SM::off_do, &tm_do, &full[s], 64 * vb, j, row);
            }
        } else if (tid >= 32) {
            /* checker, warps 1..3: the stage's tiles final (padding rows zeroed: the
             * next sequence's tokens, or TMA's zeros past the tensor, would reach the
             * sequence's dVn through P's structural zeros and then dS through W's zero
             * rows; dO converted where no TMA) and the row vectors of the chunk's rows r
             * (rows past its tokens: rq = rk = 0):
             *   qg_r = scale e^{gamma_r} rq_r,  pq_r = scale rq_r,  rk_r
             * K's non-finite elements stay (causality, as bwd_state's raw K: a NaN k_t
             * makes P's column t and dVn's row t NaN, which only row t and the earlier
             * tokens see, as the reference's; W's row t, NaN from stage A, carries it
             * into dS) */
            const int tk = tid - 32;
            for (int st = 0; st < nch; st++) {
                const int i = nch - 1 - st, s = st % NS;
                fq_mbar_wait(&full[s], (st / NS) & 1);
                unsigned char *sm = smem + s * SM::stage;
                float *vec = (float *)(smem + SM::off_vec) + s * SM::vec_floats;
                const int len = min(64, slen - 64 * i), row0 = bos + 64 * i;
                /* K (and Q): rows len.. of both tiles (a row is 128 bytes; the swizzle permutes
                 * only inside a row) */
                if (len < 64)
                    for (int idx = tk; idx < (mblk ? 2 : 4) * (64 - len) * 8; idx += 96) {
                        const int tl = idx / ((64 - len) * 8), r = len + (idx / 8) % (64 - len);
                        unsigned char *tb = tl < 2 ? sm + SM::off_k + tl * FQ_TILE : sm + SM::off_q + (tl - 2) * FQ_TILE;
                        *(uint4 *)(tb + r * 128 + (idx & 7) * 16) = make_uint4(0, 0, 0, 0);
                    }
                if (!mblk) {
                    if (args.do_tma) {
                        if (len < 64)
                            for (int idx = tk; idx < (64 - len) * 8; idx += 96)
                                *(uint4 *)(sm + SM::off_do + (len + idx / 8) * 128 + (idx & 7) * 16) = make_uint4(0, 0, 0, 0);
                    } else {
                        /* dO (fp16, fp32, or bf16 not 16-byte aligned) -> bf16 pairs, SWIZZLE_128B */
                        for (int idx = tk; idx < 64 * 32; idx += 96) {
                            const int r = idx >> 5, c = 2 * (idx & 31);
                            float x = 0.f, y = 0.f;
                            if (r < len) {
                                const int64_t o = ((int64_t)(row0 + r) * HV + j) * V + 64 * vb + c;
                                x = fq_ld_f(a.dout, a.dt, o);
                                y = fq_ld_f(a.dout, a.dt, o + 1);
                            }
                            *(uint32_t *)(sm + SM::off_do + fq_sw128(r, 2 * c)) = fq_pack_bf16(x, y);
                        }
                    }
                    if (tk < 64) {
                        const int r = tk;
                        float rq = 1.f, rk = 1.f;
                        if (r >= len) rq = rk = 0.f;
                        else if (a.rq) {
                            rq = a.rq[(int64_t)(row0 + r) * a.H + hq];
                            rk = a.rk[(int64_t)(row0 + r) * a.H + hq];
                        }
                        vec[SM::VQG + r] = a.scale * __expf(vec[SM::VG + r]) * rq;
                        vec[SM::VPQ + r] = a.scale * rq;
                        vec[SM::VRK + r] = rk;
                    }
                }
                /* W's column factors fw_r = beta_r e^{gamma_r} rk_r (0 past the chunk's
                 * tokens), every block (MAP's M blocks run the update too) */
                if (tk < 64) {
                    const int r = tk;
                    float fw = 0.f;
                    if (r < len) {
                        const float be = fq_ld_f(a.beta, a.gdt, (int64_t)(row0 + r) * HV + j);
                        const float rk = a.rk ? a.rk[(int64_t)(row0 + r) * a.H + hq] : 1.f;
                        fw = be * __expf(vec[SM::VG + r]) * rk;
                    }
                    vec[SM::VFW + r] = fw;
                }
                /* (tiles written here are read by wgmma: the async proxy; the vectors only by
                 * plain loads, which the barrier orders) */
                if (len < 64 || !args.do_tma) fq_fence_async_smem();
                fq_mbar_arrive(&checked[s]);
            }
        }
    } else if (wg == 1) {
        /* ------------------------------------------------------- local ---- */
        fq_setmaxnreg_inc<232>();
        const int tl = tid - 128, w = tl >> 5, lane = tl & 31, g = lane >> 2, t = lane & 3;
        unsigned char *sP = smem + SM::off_p;
        const uint64_t dpm = fq_desc_sw128(fq_smem_u32(sP), FQ_TILE, 1024);
        for (int st = 0; st < nch; st++) {
            const int s = st % NS, b = st & 1;
            fq_mbar_wait(&checked[s], (st / NS) & 1);
            if (mblk) { /* (MAP, M block: no dO term) */
                fq_mbar_arrive(&empty[s]);
                continue;
            }
            const unsigned char *sm = smem + s * SM::stage;
            const float *vec = (const float *)(smem + SM::off_vec) + s * SM::vec_floats;
            /* P0 = Q K^T (both K-major) */
            float pacc[32];
            fq_wgmma_fence();
            fq_wgmma_ss_qk<K>(pacc, fq_desc_sw128(fq_smem_u32(sm + SM::off_q), 16, 1024),
                              fq_desc_sw128(fq_smem_u32(sm + SM::off_k), 16, 1024));
            fq_wgmma_commit();
            /* dO^T with its non-finite elements zeroed (causality: dVn_local of the
             * rows before a NaN of dO stays exact; dS_local, in the chain, keeps it) */
            uint32_t za[4][4];
#pragma unroll
            for (int kk = 0; kk < 4; kk++) {
                fq_frag_a_mn(za[kk], sm + SM::off_do, kk, w, lane);
#pragma unroll
                for (int q = 0; q < 4; q++) za[kk][q] &= fq_bf16x2_finite_mask(za[kk][q]);
            }
            float gc[16], rkc[16], gr[2], pr[2];
#pragma unroll
            for (int nb = 0; nb < 8; nb++) {
                const float2 gg = *(const float2 *)(vec + SM::VG + 8 * nb + 2 * t);
                const float2 rr = *(const float2 *)(vec + SM::VRK + 8 * nb + 2 * t);
                gc[2 * nb] = gg.x, gc[2 * nb + 1] = gg.y;
                rkc[2 * nb] = rr.x, rkc[2 * nb + 1] = rr.y;
            }
#pragma unroll
            for (int h = 0; h < 2; h++) {
                gr[h] = vec[SM::VG + 16 * w + g + 8 * h];
                pr[h] = vec[SM::VPQ + 16 * w + g + 8 * h];
            }
            fq_wgmma_wait<0>();
            fq_reg_fence(pacc);
            /* P = lower_incl(P0 ⊙ Gamma) scale rq_r rk_s, by selects (never 0 * a non-finite value) */
            uint32_t pf[4][4];
#pragma unroll
            for (int nb = 0; nb < 8; nb++)
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    const int h = e >> 1, r = 16 * w + g + 8 * h, c = 8 * nb + 2 * t + (e & 1);
                    const float x = pacc[4 * nb + e] * pr[h] * rkc[2 * nb + (e & 1)] * __expf(gr[h] - gc[2 * nb + (e & 1)]);
                    pacc[4 * nb + e] = c <= r ? x : 0.f;
                }
#pragma unroll
            for (int kk = 0; kk < 4; kk++) fq_acc_to_a(pf[kk], &pacc[8 * kk], 1.f);
            fq_named_bar(1, 128); /* every warp done with the previous chunk's P (its wgmma waited for) */
#pragma unroll
            for (int kk = 0; kk < 4; kk++) fq_stsm_pairs(sP, w, 2 * kk, pf[kk][0], pf[kk][1], pf[kk][2], pf[kk][3]);
            fq_fence_async_smem();
            fq_named_bar(1, 128);
            /* dVn_local^T = dO^T P (P [r][s] MN-major) */
            float lacc[32];
            fq_wgmma_fence();
#pragma unroll
            for (int kk = 0; kk < 4; kk++) fq_wgmma_rs_n64<1, 0>(lacc, za[kk], fq_desc_at(dpm, 2048 * kk), kk > 0);
            fq_wgmma_commit();
            fq_wgmma_wait<0>();
            fq_reg_fence(lacc);
            fq_mbar_arrive(&empty[s]); /* Q, K, dO and the vectors read */
            if (st >= 2) fq_mbar_wait(&lempty[b], ((st >> 1) - 1) & 1);
            unsigned char *L = smem + SM::off_l + b * FQ_TILE;
#pragma unroll
            for (int kk = 0; kk < 4; kk++) {
                uint32_t lf[4];
                fq_acc_to_a(lf, &lacc[8 * kk], 1.f);
                fq_stsm_pairs(L, w, 2 * kk, lf[0], lf[1], lf[2], lf[3]);
            }
            fq_mbar_arrive(&lfull[b]); /* (read by ldmatrix: generic proxy, the barrier orders it) */
        }
    } else {
        /* ------------------------------------------------------- chain ---- */
        fq_setmaxnreg_inc<232>();
        const int tc = tid - 256, w = tc >> 5, lane = tc & 31, g = lane >> 2, t = lane & 3;
        /* dS^T: row v = 16 w + g + 8 h (this CTA's column 64 vb + v; MAP: column
         * 64 cb + v of [M | D]), column kd = 8 nb + 2 t + e: S[4 nb + 2 h + e] */
        float S[K / 2];
        {
            const float *src = NULL;
            int64_t off = 0;
            int svk = 0;
            if (!MAP && CP == FQ_BWD_CP_SEG && scount > 1) {
                src = args.c.ss;
                off = ((int64_t)cps * HV + j) * K * V;
            } else if (!MAP && a.dht) {
                src = a.dht;
                off = ((int64_t)seq * HV + j) * K * V;
                svk = a.state_vk;
            }
#pragma unroll
            for (int nb = 0; nb < K / 8; nb++)
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    const int v = 16 * w + g + 8 * (e >> 1), kd = 8 * nb + 2 * t + (e & 1);
                    if (MAP) S[4 * nb + e] = mblk && kd == 64 * cb + v ? 1.f : 0.f;
                    else S[4 * nb + e] = src ? src[off + fq_state_at(kd, 64 * vb + v, K, V, svk)] : 0.f;
                }
        }
        uint32_t sb[K / 16][4];
#pragma unroll
        for (int kk = 0; kk < K / 16; kk++) fq_acc_to_a(sb[kk], &S[8 * kk], 1.f);
        unsigned char *sDs = smem + SM::off_ds, *sDv = smem + SM::off_dv;
        for (int st = 0; st < nch; st++) {
            const int i = nch - 1 - st, s = st % NS, b = st & 1;
            const int tile = (chunk0 + i) * HV + j;
            const int pois = a.aflag[tile]; /* (used at the update: its load on its way meanwhile) */
            const unsigned char *sm = smem + s * SM::stage;
            const float *vec = (const float *)(smem + SM::off_vec) + s * SM::vec_floats;
            fq_mbar_wait(&checked[s], (st / NS) & 1);
            /* e^{gamma_C} dS'^T, outside any wgmma group (dS'^T's bf16 copy sb is the A operand below) */
            const float eC = __expf(vec[SM::VG + 63]);
#pragma unroll
            for (int e = 0; e < K / 2; e++) S[e] *= eC;
            /* X^T = dS'^T K^T (K K-major) */
            float xacc[32];
            const uint64_t dk = fq_desc_sw128(fq_smem_u32(sm + SM::off_k), 16, 1024);
            fq_wgmma_fence();
#pragma unroll
            for (int kk = 0; kk < K / 16; kk++)
                fq_wgmma_rs_n64<0, 0>(xacc, sb[kk], fq_desc_at(dk, (kk >> 2) * FQ_TILE + 32 * (kk & 3)), kk > 0);
            fq_wgmma_commit();
            /* dS^T = e^{gamma_C} dS'^T (above) + (dO^T diag(qg)) Q (Q MN-major) */
            if (!mblk) {
                uint32_t qa[4][4];
#pragma unroll
                for (int kk = 0; kk < 4; kk++) {
                    fq_frag_a_mn(qa[kk], sm + SM::off_do, kk, w, lane);
                    fq_frag_a_scale_k(qa[kk], vec + SM::VQG, kk, t);
                }
                const uint64_t dqm = fq_desc_sw128(fq_smem_u32(sm + SM::off_q), FQ_TILE, 1024);
                fq_wgmma_fence();
#pragma unroll
                for (int kk = 0; kk < 4; kk++) fq_wgmma_rs_n128<1, 0>(S, qa[kk], fq_desc_at(dqm, 2048 * kk), 1);
                fq_wgmma_commit();
            }
            float kdc[16];
#pragma unroll
            for (int nb = 0; nb < 8; nb++) {
                const float2 f = *(const float2 *)(vec + SM::VKD + 8 * nb + 2 * t);
                kdc[2 * nb] = f.x, kdc[2 * nb + 1] = f.y;
            }
            /* X^T's group; dS_local's may still run (MAP: both, one wait for M and D blocks) */
            if constexpr (MAP) fq_wgmma_wait<0>();
            else fq_wgmma_wait<1>();
            fq_reg_fence(xacc);
            /* dVn^T = L + X^T diag(kd) (bf16, as bwd_state's: L = dv_local^T in bf16) */
            uint32_t lf[4][4];
            if (!mblk) {
                fq_mbar_wait(&lfull[b], (st >> 1) & 1);
                const unsigned char *L = smem + SM::off_l + b * FQ_TILE;
#pragma unroll
                for (int kk = 0; kk < 4; kk++) fq_ldsm_x4(lf[kk], fq_pair_addr(L, w, 2 * kk, lane));
                fq_mbar_arrive(&lempty[b]);
            } else {
#pragma unroll
                for (int kk = 0; kk < 4; kk++) lf[kk][0] = lf[kk][1] = lf[kk][2] = lf[kk][3] = 0u;
            }
            uint32_t va[4][4];
#pragma unroll
            for (int kk = 0; kk < 4; kk++)
#pragma unroll
                for (int q = 0; q < 4; q++) {
                    /* pair q: accumulator block 2 kk + (q >> 1), rows + 8 (q & 1) */
                    const int nb = 2 * kk + (q >> 1), e0 = 4 * nb + 2 * (q & 1);
                    const float2 l = fq_unpack_bf16(lf[kk][q]);
                    va[kk][q] = fq_pack_bf16(l.x + kdc[2 * nb] * xacc[e0], l.y + kdc[2 * nb + 1] * xacc[e0 + 1]);
                }
            /* dS^T -= dVn^T W with W = A diag(fw) K never formed: Z^T = dVn^T A (A [r][c]
             * MN-major), Z'^T = Z^T diag(fw) (bf16), dS^T -= Z'^T K (K MN-major; A operand
             * negated by the instruction). Where stage A flagged the item (W's rows from a
             * bad token before the chunk's end are NaN: a.aflag), Z'^T is NaN, as that W
             * made the whole update */
            float zacc[32];
            const uint64_t dam = fq_desc_sw128(fq_smem_u32(sm + SM::off_a), FQ_TILE, 1024);
            fq_wgmma_fence();
#pragma unroll
            for (int kk = 0; kk < 4; kk++) fq_wgmma_rs_n64<1, 0>(zacc, va[kk], fq_desc_at(dam, 2048 * kk), kk > 0);
            fq_wgmma_commit();
            /* dS_next[c] = dS' (bf16 [K][V]) and dVn (bf16 [64][V]) to dsl, dvl while Z runs
             * (va is its A operand; sb's product is complete): one proxy fence per chunk */
            if constexpr (!MAP)
                fq_bst_stage_stores(sDs, sb, sDv, va, &tm_ds, &tm_dv, 64 * vb, tile, tc, w, lane,
                                    a.bready && st > 0 ? a.bready + 2 * (tile + HV) + vb : (int *)NULL);
            float fwc[16];
#pragma unroll
            for (int nb = 0; nb < 8; nb++) {
                const float2 f = *(const float2 *)(vec + SM::VFW + 8 * nb + 2 * t);
                fwc[2 * nb] = f.x, fwc[2 * nb + 1] = f.y;
            }
            fq_wgmma_wait<0>();
            fq_reg_fence(zacc);
            uint32_t za[4][4];
#pragma unroll
            for (int kk = 0; kk < 4; kk++)
#pragma unroll
                for (int q = 0; q < 4; q++) {
                    /* pair q: accumulator block 2 kk + (q >> 1), rows + 8 (q & 1) (as va) */
                    const int nb = 2 * kk + (q >> 1), e0 = 4 * nb + 2 * (q & 1);
                    za[kk][q] = pois ? 0x7fc07fc0u : fq_pack_bf16(zacc[e0] * fwc[2 * nb], zacc[e0 + 1] * fwc[2 * nb + 1]);
                }
            const uint64_t dkm = fq_desc_sw128(fq_smem_u32(sm + SM::off_k), FQ_TILE, 1024);
            fq_wgmma_fence();
#pragma unroll
            for (int kk = 0; kk < 4; kk++) fq_wgmma_rs_n128<1, 1>(S, za[kk], fq_desc_at(dkm, 2048 * kk), 1);
            fq_wgmma_commit();
            fq_wgmma_wait<0>();
            fq_reg_fence(S);
            fq_mbar_arrive(&empty[s]); /* K, A, Q, dO and the vectors read */
#pragma unroll
            for (int kk = 0; kk < K / 16; kk++) fq_acc_to_a(sb[kk], &S[8 * kk], 1.f);
        }
        if (tc == 0) { /* the last stores complete (and their flag: chunk 0 of the unit) */
            if (!MAP && a.bready && nch > 0) fq_bst_publish(a.bready + 2 * (chunk0 * HV + j) + vb);
            else fq_bulk_wait0();
        }
        /* MAP: columns 64 cb.. of the segment's [M | D]; else dh0 at the sequence's
         * first segment (NONE: its only one) */
        float *dst = NULL;
        int64_t base = 0;
        int c0 = 0, cols = V, vk = 0;
        if (MAP) {
            dst = args.c.md;
            base = ((int64_t)cps * HV + j) * K * (K + V);
            c0 = 64 * cb;
            cols = K + V;
        } else if (a.dh0 && sidx == 0) {
            dst = a.dh0;
            base = ((int64_t)seq * HV + j) * K * V;
            c0 = 64 * vb;
            vk = a.state_vk;
        }
        if (dst)
#pragma unroll
            for (int nb = 0; nb < K / 8; nb++)
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    const int v = 16 * w + g + 8 * (e >> 1), kd = 8 * nb + 2 * t + (e & 1);
                    dst[base + fq_state_at(kd, c0 + v, K, cols, vk)] = S[4 * nb + e];
                }
    }
#endif
}

/* ------------------------------------------------------------- host ---- */

template <int CP>
static fq_status fq_bwd_state90_pass(const CUtensorMap (&m)[6], const fq_bst_args &args, int64_t units,
                                     cudaStream_t stream)
{
    const int64_t blocks = units * args.a.HV * args.ncb;
    if (blocks <= 0) return FQ_OK;
    const void *fn = (const void *)fq_bwd_state90_kernel<CP>;
    fq_status st = fq_cuda_set_smem(fn, fq_bst_smem::bytes);
    if (st != FQ_OK) return st;
    return fq_launch_k(fq_bwd_state90_kernel<CP>, (unsigned)blocks, 384, fq_bst_smem::bytes, stream, 0, m[0], m[1],
                       m[2], m[3], m[4], m[5], args);
}

/* The tensor maps of q, k ([rows][H][K] bf16), A ([tiles][64][64]) and dO
 * ([rows][HV][V]; m[3] = m[0], unused, where dO goes through the checker) as
 * m[0..3]: boxes of 64 columns x 64 rows (A: one 64 x 64 tile), SWIZZLE_128B;
 * bwd_state90's and bwd_rev90's common four (K = V = 128). */
fq_status fq_bwd_tmaps_qkado(const fq_gdn_params *p, const fq_bwd_args &a, int64_t nc, CUtensorMap *m)
{
    const uint64_t K = 128, V = 128, H = (uint64_t)p->H, HV = (uint64_t)p->HV;
    const uint64_t rows = p->B * p->T > 0 ? (uint64_t)(p->B * p->T) : 1;
    const uint64_t tiles = nc * p->HV > 0 ? (uint64_t)(nc * p->HV) : 1;
    const uint64_t dqk[3] = {K, H, rows}, sqk[2] = {K * 2, H * K * 2};
    const uint64_t ddo[3] = {V, HV, rows}, sdo[2] = {V * 2, HV * V * 2};
    const uint64_t dam[3] = {64, 64, tiles}, sam[2] = {64 * 2, 64 * 64 * 2};
    const uint32_t brow[3] = {64, 1, 64}, btile[3] = {64, 64, 1};
    fq_status st;
    if ((st = fq_tmap(&m[0], a.qb, 3, dqk, sqk, brow)) != FQ_OK) return st;
    if ((st = fq_tmap(&m[1], a.kb, 3, dqk, sqk, brow)) != FQ_OK) return st;
    if ((st = fq_tmap(&m[2], a.a, 3, dam, sam, btile)) != FQ_OK) return st;
    if (a.dout_async) return fq_tmap(&m[3], a.dout, 3, ddo, sdo, brow);
    m[3] = m[0];
    return FQ_OK;
}

static fq_status fq_bwd_state90_run(const fq_gdn_params *p, const fq_bwd_args &a, const fq_fwd_ws *segws, int64_t nc,
                                    int map_only, cudaStream_t stream)
{
    if (p->N <= 0) return FQ_OK;
    if (p->K != 128 || p->V != 128)
        return fq_fail(FQ_ERR_INTERNAL, "fq_bwd_state90_launch: K = V = 128 only (got %d, %d)", (int)p->K, (int)p->V);
    const uint64_t K = 128, V = 128;
    const uint64_t tiles = nc * p->HV > 0 ? (uint64_t)(nc * p->HV) : 1;
    /* q, k, A, dO (fq_bwd_tmaps_qkado); dS_next [tiles][K][V] (64 columns x K rows, one
     * store for both tiles); dVn [tiles][64][V] (64 x 64) */
    const uint64_t dds[3] = {V, K, tiles}, sds[2] = {V * 2, K * V * 2};
    const uint64_t ddv[3] = {V, 64, tiles}, sdv[2] = {V * 2, 64 * V * 2};
    const uint32_t btile[3] = {64, 64, 1}, bds[3] = {64, (uint32_t)K, 1};
    CUtensorMap m[6];
    fq_status st = fq_bwd_tmaps_qkado(p, a, nc, m);
    if (st != FQ_OK) return st;
    if (map_only) { /* (MAP stores nothing per chunk; bwd_rev90's lean path lays out no dvl) */
        m[4] = m[5] = m[0];
    } else {
        if ((st = fq_tmap(&m[4], a.dsl, 3, dds, sds, bds)) != FQ_OK) return st;
        if ((st = fq_tmap(&m[5], a.dvl, 3, ddv, sdv, btile)) != FQ_OK) return st;
    }
    fq_bst_args args;
    memset(&args, 0, sizeof args);
    args.a = a;
    args.do_tma = a.dout_async;
    if (!segws) {
        args.ncb = (int)(V / 64);
        return fq_bwd_state90_pass<FQ_BWD_CP_NONE>(m, args, p->N, stream);
    }
    /* context parallelism: MAP over every segment but each sequence's first, the
     * reverse combine, then every segment from its E_s */
    args.c.segs = segws->segs;
    args.c.md = segws->md;
    args.c.ss = segws->ss;
    args.ncb = (int)((K + V) / 64);
    if ((st = fq_bwd_state90_pass<FQ_BWD_CP_MAP>(m, args, segws->seg_bound, stream)) != FQ_OK) return st;
    if ((st = fq_cp_combine_launch<1>(p, segws, a.dht, stream)) != FQ_OK) return st;
    if (map_only) return FQ_OK;
    args.ncb = (int)(V / 64);
    return fq_bwd_state90_pass<FQ_BWD_CP_SEG>(m, args, segws->seg_bound, stream);
}

fq_status fq_bwd_state90_launch(const fq_gdn_params *p, const fq_bwd_args &a, const fq_fwd_ws *segws, int64_t nc,
                                cudaStream_t stream)
{
    return fq_bwd_state90_run(p, a, segws, nc, 0, stream);
}

fq_status fq_bwd_state90_map(const fq_gdn_params *p, const fq_bwd_args &a, const fq_fwd_ws *segws, int64_t nc,
                             cudaStream_t stream)
{
    return fq_bwd_state90_run(p, a, segws, nc, 1, stream);
}
