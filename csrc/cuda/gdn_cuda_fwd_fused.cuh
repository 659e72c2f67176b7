/*
 * gdn_cuda_fwd_fused.cuh — the forward's state pass and outputs in one
 * warp-specialised sm_90a kernel (DESIGN §2, C = 64): no chunk state, W, U
 * or Vn ever goes to global memory. Per CTA one (sequence n, value head j,
 * block of 64 state columns vb); per chunk of the sequence, in order:
 *
 *   Vn = A'' Y,   Y = V - diag(e^gamma rk) K S     (= U - W S with U = A'' V, W = A'' diag(e^gamma rk) K)
 *   O  = diag(qg) Q S + P Vn,   qg = scale e^gamma rq,
 *                               P = lower_incl(Q K^T ⊙ Gamma) scale diag(rq) . diag(rk)
 *   S  = e^{gamma_C} S + K^T diag(kd) Vn,   kd = e^{gamma_C - gamma} rk
 *
 * with A'' = A diag(beta), A = (I + L)^-1 and the gate record {gamma, beta,
 * rk, rq, ...} from fq_fwd_inverse_kernel (gdn_cuda_fwd_wy.cu), run just
 * before. Q and K are used as loaded: their row factors are applied to
 * register operands and accumulators instead. Y goes into its product as two
 * bf16 parts (Y = Yh + Yl; one part alone would cost ~0.3e-3 of the
 * forward's 5e-3 error budget, dev/cuda/sim_fwd_fused_numerics.py).
 *
 * Three warpgroups (384 threads), one CTA per SM (~215 KB of shared memory at
 * K = 128: three stages of 48 KB plus the exchange buffers):
 *   WG0, producer: one thread issues the TMA loads of a chunk's Q, K, V
 *        (this CTA's 64 columns) tiles, A'' (packed, bulk copy) and its gate record into the
 *        stage (mbarrier `full`), three chunks deep; warps 1..3 check V for
 *        non-finite rows and zero the rows that enter nothing (`checked`);
 *        setmaxnreg 40.
 *   WG1, output: P = Q K^T (masked, gated, bf16 A fragments in registers),
 *        O = Q S (S^T handed over by the chain at the chunk's start, read
 *        by wgmma from shared memory) scaled by qg, + P Vn (Vn^T from the
 *        chain), O by TMA store through the staging tile.
 *   WG2, chain: the state, S^T (64 columns x K) as wgmma accumulators in
 *        registers, never in global memory:
 *          X^T  = S^T K^T                    (A = S^T bf16 from registers)
 *          Vn^T = Y^T A''^T,  Y^T = V^T - X^T diag(e^gamma rk)
 *          S^T  = e^{gamma_C} S^T + (diag(kd) Vn)^T K
 *        handing S^T (at each chunk's start) and Vn^T to WG1 through
 *        double-buffered shared memory (sb_/vn_ full/empty), and `empty`.
 *
 * Shared-memory tiles are SWIZZLE_128B, 64 x 64 bf16 (8 KB), as TMA writes
 * them; gdn_cuda_hopper.cuh explains the operand descriptors. Padding rows of
 * a sequence's last chunk (the next sequence's tokens, or TMA's zeros past
 * the tensor) are zeroed before use, so nothing from another sequence enters
 * the arithmetic.
 *
 * [serving] The start state comes from h0 or a pool slot (state_indices,
 * resolved once in the segment table: a negative slot starts from zeros and
 * writes nothing, a duplicate starts from NaN), in either state layout; the
 * end state goes back to ht or the slot; with checkpoint_every the chain
 * stores S after every checkpoint_every tokens of a sequence from its
 * registers (the rows indexed by fq_cuda_fwd_checkpoint_index).
 *
 * Modes (MODE): FULL (the above), PAIR (FULL for both column blocks of a
 * value head, V = 128: 512 threads, two chain warpgroups of 64 columns each
 * sharing the stage's Q, K, A'' and record, the output warpgroup forming P
 * once and O for both blocks; two stages; chosen where FULL's CTAs would need
 * more than one wave, fq_fwd_pair; the same bits as FULL), MAP (a segment's affine state map for
 * context parallelism: start [I | 0], no Q, no o; only the producer and the
 * chain warpgroups, 256 threads, ~103 KB of shared memory: two CTAs per SM)
 * and HST (the backward's recompute: the chain as in FULL, no Q, no o; the
 * output warpgroup instead stores each chunk's start state h and Vn, see its
 * branch). In the forward the maps and the segments' start states live in
 * o's rows until the FULL pass writes o (fq_omap, gdn_cuda_common.cuh); in
 * the recompute, in its workspace.
 *
 * Only sm_90a code has the kernel; elsewhere it compiles to an empty body and
 * fq_cuda_fwd_fused_available() says no (gdn_cuda_fwd.cu then runs the
 * three-stage forward).
 */
#ifndef FQ_GDN_CUDA_FWD_FUSED_CUH
#define FQ_GDN_CUDA_FWD_FUSED_CUH

/* (included by gdn_cuda_fwd_fused.cu, which instantiates the FULL and MAP modes, and by
 * gdn_cuda_fwd_fused_states.cu, which instantiates HST: one mode more in the same
 * translation unit changed the other modes' code, as compiled) */

#include "gdn_cuda_hopper.cuh"

#include <stdlib.h> /* getenv */
#include <string.h>

#define FQ_FUSED_STAGES 3

/* MODE: what a CTA computes over its segment of chunks */
#define FQ_FUSED_FULL 0 /* o and the segment's end state (ht when the segment ends the sequence) */
#define FQ_FUSED_MAP 1  /* only the segment's affine state map [M | D] (context parallelism) */
#define FQ_FUSED_HST 2  /* the backward's recompute: no o; each chunk's start state h (bf16 [K][V])
                           and Vn (bf16 [64][V]) to the three-stage workspace layout (gdn_cuda_bwd.cu) */
#define FQ_FUSED_PAIR 3 /* FULL for both column blocks of a value head (V = 128) in one CTA: two
                           chain warpgroups share the stage's Q, K, A'' and record, the output
                           warpgroup's P; chosen when FULL's CTAs would need more than one wave */

/* Shared memory of one CTA. Per stage: Q (K/64 tiles), K (K/64 tiles), V
 * (NH tiles: one per chain), A''. Then, exchanged between each chain and the
 * output warpgroup, SBN / VNN buffers by chunk: S^T at a chunk's start (bf16
 * [v][kd], K/64 tiles) and Vn^T (bf16 [v][r]); the O staging per chain (fp32:
 * 64 rows of 68); the barriers, the checker's words and the stages' gate
 * records (FQ_REC_*). MAP has no Q tiles, no exchange buffers and no staging
 * (no output warpgroup): ~103 KB at K = 128, two CTAs per SM. PAIR (two
 * chains): 56 KB stages, two of them at K = 128 (three at K = 64), one S^T
 * buffer per chain (the chain hands S_{i+1} over a whole chunk after the
 * output warpgroup's Q S_i has read S_i): ~219 KB at K = 128. */
template <int K, int MODE> struct fq_fused_smem {
    static constexpr int KT = K / 64;
    static constexpr int PAIR = MODE == FQ_FUSED_PAIR;
    static constexpr int NH = PAIR ? 2 : 1;                  /* chains (column blocks of 64) per CTA */
    static constexpr int NS = PAIR && K == 128 ? 2 : FQ_FUSED_STAGES; /* stages */
    static constexpr int SBN = PAIR ? 1 : 2;                 /* S^T buffers per chain */
    static constexpr int VNN = 2;                            /* Vn^T buffers per chain */
    static constexpr int QT = MODE == FQ_FUSED_MAP ? 0 : KT; /* Q tiles per stage */
    static constexpr int XB = MODE == FQ_FUSED_MAP ? 0 : 1;  /* 1: the exchange buffers and the staging */
    static constexpr int off_q = 0;
    static constexpr int off_k = off_q + QT * FQ_TILE;
    static constexpr int off_v = off_k + KT * FQ_TILE;
    static constexpr int off_a = off_v + NH * FQ_TILE; /* A'' dense, no swizzle (gdn_cuda_common.cuh) */
    static constexpr int stage = off_a + FQ_TILE;
    static constexpr int off_sb = NS * stage;                       /* NH x SBN x S^T */
    static constexpr int off_vn = off_sb + XB * NH * SBN * KT * FQ_TILE; /* NH x VNN x Vn^T */
    static constexpr int off_o = off_vn + XB * NH * VNN * FQ_TILE;  /* NH x the O staging */
    static constexpr int o_bytes = 64 * 68 * 4;                     /* (17 KB: keeps 1024-byte alignment) */
    static constexpr int off_bar = off_o + XB * NH * o_bytes;
    /* per stage: full, empty, checked; per chain and buffer: sb_full, sb_empty, vn_full, vn_empty */
    static constexpr int nbar = 3 * NS + 2 * NH * (SBN + VNN);
    /* per stage and chain: the checker's row minimum, and (PAIR) the chain's first non-finite V row */
    static constexpr int off_chk = off_bar + (nbar * 8 + 15) / 16 * 16;
    static constexpr int off_rec = off_chk + (2 * NS * NH * 4 + 15) / 16 * 16; /* per stage: the gate record */
    static constexpr int rec_bytes = FQ_REC_FLOATS * 4;
    static constexpr int bytes = off_rec + NS * rec_bytes + 1024; /* + alignment slack */
    static constexpr uint32_t load_bytes = (2 * KT + NH) * FQ_TILE + FQ_APACK_BYTES + rec_bytes;
    static_assert(stage % 1024 == 0 && off_o % 1024 == 0 && o_bytes % 1024 == 0, "tiles keep their 1024-byte alignment");
    static_assert(MODE != FQ_FUSED_MAP || 2 * (bytes + 1024) <= 228 * 1024, "MAP: two CTAs per SM");
    static_assert(bytes <= 227 * 1024, "one CTA per SM");
};

/* Threads per CTA: producer, output and chain warpgroups (MAP: producer and
 * chain; its CTAs two per SM, fq_fwd_fused_kernel; PAIR: two chains) */
#define FQ_FUSED_THREADS(MODE) ((MODE) == FQ_FUSED_MAP ? 256 : (MODE) == FQ_FUSED_PAIR ? 512 : 384)

struct fq_fused_args {
    const fq_seg_info *segs;
    float *md;           /* MAP: [cp_bound, HV, K, K + V] out, by fq_seg_info.cp; NULL in the
                            forward: the maps are in o's rows then (fq_omap) */
    const float *ss;     /* FULL: [cp_bound, HV, K, V] start states of split sequences' segments,
                            by .cp; NULL in the forward: in o's rows (fq_omap) */
    const float *rec;    /* [nc_max, HV, FQ_REC_FLOATS] the gate records */
    const fq_bf16 *a;    /* [nc_max, HV, FQ_APACK_ELEMS] A'' packed */
    const float *h0;     /* [N, HV, K, V] or NULL; [serving] the pool [P, HV, K, V] */
    float *ht;           /* [N, HV, K, V] or NULL; [serving] the pool (h0 == ht) */
    int vk;              /* [serving] h0, ht, checkpoints stored [.., V, K] (fq_state_at) */
    float *ckpt;         /* [serving] checkpoints [rows, HV, K, V] or NULL: every ck_chunks full
                            chunks of a sequence its state to row cu_ck[n] + c - 1 (gdn.h) */
    const int64_t *cu_ck;
    int ck_chunks;
    void *o;             /* [B*T, HV, V], dtype odt (HST: none; h and Vn leave through the
                            tensor maps tm_o and tm_q, which HST has no other use for) */
    fq_dtype odt;
    int o_tma;           /* 1: full chunks of o leave by TMA store (tm_o; 16-bit o, 16-byte aligned) */
    int H, HV, V, ncb;   /* ncb: column blocks of 64 per (segment, head): V/64 (FULL), (K+V)/64 (MAP) */
    float scale;
};

#define FQ_LOG2E 1.4426950408889634f

#ifdef FQ_FUSED_TIMELINE
/* dev only (-DFQ_FUSED_TIMELINE, dev/cuda/check_fwd.cu `timeline`): per CTA of
 * the last FULL launch, clock64 at events 0..7 and the SM id (slot 8):
 * 0 entry, 1 segment read, 2 chain's start state loaded, 3 chain's first
 * stage checked, 4 chain's first chunk done, 5 chain's loop done, 6 chain's
 * end state stored, 7 output warpgroup done */
#define FQ_TL_CTAS 8192
__device__ unsigned long long fq_tl[FQ_TL_CTAS][10];
#define FQ_TL(ev) do { if (!MAP && blockIdx.x < FQ_TL_CTAS) fq_tl[blockIdx.x][ev] = clock64(); } while (0)
extern "C" int fq_cuda_fused_timeline(unsigned long long *host, int n)
{
    if (n > FQ_TL_CTAS) n = FQ_TL_CTAS;
    if (cudaMemcpyFromSymbol(host, fq_tl, (size_t)n * 10 * 8) != cudaSuccess) return -1;
    void *d = NULL; /* cleared for the next shape */
    if (cudaGetSymbolAddress(&d, fq_tl) != cudaSuccess || cudaMemset(d, 0, sizeof fq_tl) != cudaSuccess) return -1;
    return n;
}
#else
#define FQ_TL(ev) do { } while (0)
#endif

#if FQ_SM90A
/* A 64 x 64 fp32 tile in shared memory, [row][col] with rows of 68 floats
 * (the padding keeps the fragment stores and float4 loads below free of bank
 * conflicts, and every offset an immediate): the O staging of fp32 outputs. */
#define FQ_F32_LD 68
static __device__ __forceinline__ float *fq_f32_tile(float *U, int row, int col)
{
    return U + row * FQ_F32_LD + col;
}

/* The chain's S^T accumulators (the lane's rows v = 16 w + g + 8 h, columns
 * kd = 8 nb + 2 t + e) as state elements (kd, c0 + v) of a K x cols matrix at
 * dst in layout vk (fq_state_at): ht, a pool slot, a checkpoint, or columns
 * of a segment's [M | D]. */
template <int K>
static __device__ __forceinline__ void fq_chain_store_state(const float *S, float *dst, int c0, int cols, int vk, int w,
                                                            int g, int t)
{
#pragma unroll
    for (int nb = 0; nb < K / 8; nb++)
#pragma unroll
        for (int e = 0; e < 4; e++) {
            const int v = 16 * w + g + 8 * (e >> 1), kd = 8 * nb + 2 * t + (e & 1);
            dst[fq_state_at(kd, c0 + v, K, cols, vk)] = S[4 * nb + e];
        }
}

/* HST: one group of four 8 x 8 blocks of a bf16 SWIZZLE_128B tile `src`
 * (rows v = 8 (4 vh + m) .. for matrix m, the 16 bytes at byte cbyte of each
 * row) transposed into the staging tile `dst` (rows 8 cb .., bytes
 * 16 (4 vh + m) ..): ldmatrix.trans gives each thread the transposed
 * fragment, stmatrix stores it as it is. Lane l addresses row l % 8 of
 * matrix l / 8 on both sides. MASK: destination rows >= lim to zero (the
 * thread's elements are in row 8 cb + lane / 4). */
template <int MASK>
static __device__ __forceinline__ void fq_hst_transpose4(const unsigned char *src, int cbyte, unsigned char *dst,
                                                         int cb, int vh, int lim)
{
    const int lane = threadIdx.x & 31, l8 = lane & 7, vb8 = 4 * vh + (lane >> 3);
    uint32_t x[4];
    fq_ldsm_x4_trans(x, fq_smem_u32(src + fq_sw128(8 * vb8 + l8, cbyte)));
    if (MASK && 8 * cb + (lane >> 2) >= lim) x[0] = x[1] = x[2] = x[3] = 0u;
    fq_stsm_x4(fq_smem_u32(dst + fq_sw128(8 * cb + l8, 16 * vb8)), x[0], x[1], x[2], x[3]);
}

/* The output warpgroup's P = lower_incl(P0 ⊙ Gamma) diag(scale rq) . diag(rk)
 * as bf16 A fragments pf of P Vn, P0 = Q K^T from the wgmma group before the
 * last one committed (waited for here, after the record's loads); qr: the
 * lane's rows' qg = scale e^gamma rq (rows 16 w + g + 8 h). */
static __device__ __forceinline__ void fq_out_gate_p(uint32_t (&pf)[4][4], float (&qr)[2], float (&pacc)[32],
                                                     const float *rec, int w, int g, int t)
{
    float gc[16], rkc[16], gr[2], pr[2];
#pragma unroll
    for (int nb = 0; nb < 8; nb++) {
        const float2 gg = *(const float2 *)(rec + FQ_REC_G2 + 8 * nb + 2 * t);
        const float2 rr = *(const float2 *)(rec + FQ_REC_RK + 8 * nb + 2 * t);
        gc[2 * nb] = gg.x, gc[2 * nb + 1] = gg.y;
        rkc[2 * nb] = rr.x, rkc[2 * nb + 1] = rr.y;
    }
#pragma unroll
    for (int h = 0; h < 2; h++) {
        gr[h] = rec[FQ_REC_G2 + 16 * w + g + 8 * h];
        pr[h] = rec[FQ_REC_PRQ + 16 * w + g + 8 * h];
        qr[h] = rec[FQ_REC_QG + 16 * w + g + 8 * h];
    }
    fq_wgmma_wait<1>();
    fq_reg_fence(pacc);
#pragma unroll
    for (int nb = 0; nb < 8; nb++)
#pragma unroll
        for (int e = 0; e < 4; e++) {
            const int h = e >> 1, r = 16 * w + g + 8 * h, c = 8 * nb + 2 * t + (e & 1);
            pacc[4 * nb + e] = c <= r ? pacc[4 * nb + e] * pr[h] * rkc[2 * nb + (e & 1)] *
                                            exp2f(gr[h] - gc[2 * nb + (e & 1)])
                                      : 0.f;
        }
#pragma unroll
    for (int kk = 0; kk < 4; kk++) fq_acc_to_a(pf[kk], &pacc[8 * kk], 1.f);
}

/* The output warpgroup's O (accumulators: rows 16 w + g + 8 h, columns
 * 8 nb + 2 t + e) to o's rows row0 + r, r < len, columns 64 vb.., through the
 * staging tile Os: 16-bit pairs by stmatrix into SWIZZLE_128B rows, then a
 * TMA store (a full chunk, o_tma) or per-thread 16-byte copies; fp32 by
 * float2 stores into rows of 68 and per-thread float4 copies. The staging is
 * free once the bulk store that last read it has: WAITN later store groups
 * (of other staging tiles) may still be pending. */
template <int WAITN>
static __device__ __forceinline__ void fq_out_store(const float (&oacc)[32], unsigned char *Os, const fq_fused_args &args,
                                                    const CUtensorMap *tm_o, int vb, int j, int row0, int len, int tp,
                                                    int w, int g, int t)
{
    if (tp == 0) fq_bulk_wait_read<WAITN>();
    fq_named_bar(3, 128);
    if (args.odt != FQ_F32) {
        /* 16-bit: O [r][v] pairs by stmatrix, SWIZZLE_128B rows */
        const int is_bf16 = args.odt == FQ_BF16;
#pragma unroll
        for (int nb2 = 0; nb2 < 4; nb2++) {
            uint32_t pk[4];
#pragma unroll
            for (int m = 0; m < 4; m++) {
                const int ix = 4 * (2 * nb2 + (m >> 1)) + 2 * (m & 1);
                if (is_bf16) {
                    pk[m] = fq_pack_bf16(oacc[ix], oacc[ix + 1]);
                } else {
                    __half2 hx = __floats2half2_rn(oacc[ix], oacc[ix + 1]);
                    pk[m] = *(uint32_t *)&hx;
                }
            }
            fq_stsm_pairs(Os, w, 2 * nb2, pk[0], pk[1], pk[2], pk[3]);
        }
        if (len == 64 && args.o_tma) {
            /* one thread stores the tile (TMA); its read is waited for before the next chunk's staging */
            fq_fence_async_smem();
            fq_named_bar(3, 128);
            if (tp == 0) {
                fq_tma_store_3d(tm_o, Os, 64 * vb, j, row0);
                fq_bulk_commit();
            }
        } else {
            fq_named_bar(3, 128);
            uint16_t *orow = (uint16_t *)args.o + ((int64_t)row0 * args.HV + j) * args.V + 64 * vb;
#pragma unroll
            for (int q = 0; q < 4; q++) {
                const int piece = tp + 128 * q, r = piece >> 3, c8 = piece & 7;
                if (r < len)
                    *(uint4 *)(orow + (int64_t)r * args.HV * args.V + 8 * c8) = *(const uint4 *)(Os + fq_sw128(r, 16 * c8));
            }
        }
    } else {
        float *Us = (float *)Os;
#pragma unroll
        for (int nb = 0; nb < 8; nb++)
#pragma unroll
            for (int h = 0; h < 2; h++) {
                const int r = 16 * w + g + 8 * h, v = 8 * nb + 2 * t;
                *(float2 *)fq_f32_tile(Us, r, v) = make_float2(oacc[4 * nb + 2 * h], oacc[4 * nb + 2 * h + 1]);
            }
        fq_named_bar(3, 128);
        float *orow = (float *)args.o + ((int64_t)row0 * args.HV + j) * args.V + 64 * vb;
#pragma unroll
        for (int q = 0; q < 8; q++) {
            const int piece = tp + 128 * q, r = piece >> 4, c4 = (piece & 15) * 4;
            if (r < len) *(float4 *)(orow + (int64_t)r * args.HV * args.V + c4) = *(const float4 *)fq_f32_tile(Us, r, c4);
        }
    }
}

/* An accumulator's rows scaled: the lane's row 16 w + g by x0, row + 8 by x1. */
static __device__ __forceinline__ void fq_scale_rows(float (&acc)[32], float x0, float x1)
{
#pragma unroll
    for (int nb = 0; nb < 8; nb++)
#pragma unroll
        for (int e = 0; e < 4; e++) acc[4 * nb + e] *= e >> 1 ? x1 : x0;
}

#endif

template <int K, int MODE>
__global__ void __launch_bounds__(FQ_FUSED_THREADS(MODE), MODE == FQ_FUSED_MAP ? 2 : 1)
    fq_fwd_fused_kernel(const __grid_constant__ CUtensorMap tm_q, const __grid_constant__ CUtensorMap tm_k,
                        const __grid_constant__ CUtensorMap tm_v, const __grid_constant__ CUtensorMap tm_o,
                        const fq_fused_args args, const int *ready)
{
#if FQ_SM90A
    typedef fq_fused_smem<K, MODE> SM;
    constexpr int KT = SM::KT, NS = SM::NS, NH = SM::NH, SBN = SM::SBN, VNN = SM::VNN;
    constexpr int PAIR = SM::PAIR;
    extern __shared__ __align__(16) unsigned char smem_raw[];
    /* 1024-byte alignment for the SWIZZLE_128B tiles, by offset (the pointer
     * stays a shared-memory one: plain STS/LDS, not generic accesses) */
    unsigned char *smem = smem_raw + ((1024 - (fq_smem_u32(smem_raw) & 1023)) & 1023);
    /* full: the stage's loads landed; empty: the chain and the output
     * warpgroup are done with the stage */
    uint64_t *full = (uint64_t *)(smem + SM::off_bar);
    uint64_t *empty = full + NS;
    /* checked: the stage's tiles final (issue 9: V rows checked, the record
     * poisoned where they are not finite, the rows that enter nothing
     * zeroed); chk: the checker's row minimum per stage */
    uint64_t *checked = empty + NS;
    /* per chain h and buffer b (chunk i: b = i % SBN, i % VNN): S^T of the
     * chunk's start / its Vn^T written (chain), read (output warpgroup), at
     * [h * SBN + b], [h * VNN + b] */
    uint64_t *sb_full = checked + NS, *sb_empty = sb_full + NH * SBN;
    uint64_t *vn_full = sb_empty + NH * SBN, *vn_empty = vn_full + NH * VNN;
    /* chk[s * NH + h]: the checker's scratch; PAIR: fvc[s * NH + h], chain h's first
     * non-finite V row in stage s (64: none), for the chain and the output warpgroup */
    int *chk = (int *)(smem + SM::off_chk), *fvc = chk + NS * NH;

    constexpr int MAP = MODE == FQ_FUSED_MAP;
    constexpr int HST = MODE == FQ_FUSED_HST; /* (the chain as in FULL; no Q, no o) */
    const int HV = args.HV, ncb = args.ncb;
    const int cb = blockIdx.x % ncb, j = (blockIdx.x / ncb) % HV, gs = blockIdx.x / (ncb * HV);
    const int hq = j / (HV / args.H);
    const int tid = threadIdx.x, wg = tid >> 7;
    /* 0 producer, 1 output, 2 chain (MAP: no output warpgroup; PAIR: warpgroups 2 and 3 the chains
     * of column blocks 0 and 1) */
    const int role = MAP ? 2 * wg : wg > 2 ? 2 : wg;
    /* MAP: column blocks cb < K/64 are the columns of M (v = 0, start = the
     * identity), the others those of D (start = 0); vb: this CTA's block of
     * V's columns (none for an M block) */
    const int mblk = MAP && cb < KT;
    const int vb = MAP ? cb - KT : cb + (PAIR && wg >= 2 ? wg - 2 : 0); /* (PAIR: the chain's block) */
    if (tid == 0) {
        FQ_TL(0);
#ifdef FQ_FUSED_TIMELINE
        if (!MAP && blockIdx.x < FQ_TL_CTAS) { unsigned sm; asm volatile("mov.u32 %0, %%smid;" : "=r"(sm)); fq_tl[blockIdx.x][8] = sm; }
#endif
    }

    if (tid == 0) {
        for (int s = 0; s < NS; s++) {
            /* full: the producer's one arrival plus the TMA bytes; the others:
             * every thread of the warpgroup arrives after its own accesses */
            fq_mbar_init(&full[s], 1);
            fq_mbar_init(&empty[s], MAP ? 128 : 128 * (NH + 1)); /* (the chains and the output warpgroup) */
            fq_mbar_init(&checked[s], 96);
            for (int h = 0; h < NH; h++) chk[s * NH + h] = 64;
        }
        for (int b = 0; b < NH * SBN; b++) {
            fq_mbar_init(&sb_full[b], 128);
            fq_mbar_init(&sb_empty[b], 128);
        }
        for (int b = 0; b < NH * VNN; b++) {
            fq_mbar_init(&vn_full[b], 128);
            fq_mbar_init(&vn_empty[b], 128);
        }
        fq_mbar_init_fence();
        fq_tma_prefetch_desc(&tm_q);
        fq_tma_prefetch_desc(&tm_k);
        fq_tma_prefetch_desc(&tm_v);
    }
    /* the blocks above the diagonal in every stage's A'' tile (K-step kk's first
     * 512 kk bytes, kk = 1..3: 192 pieces of 16 bytes per stage), zeroed once:
     * the copies never write them */
    for (int idx = tid; idx < NS * 192; idx += blockDim.x) {
        const int s = idx / 192, q = idx % 192, kk = q < 32 ? 1 : q < 96 ? 2 : 3;
        const int e = q - (kk == 1 ? 0 : kk == 2 ? 32 : 96);
        *(uint4 *)(smem + s * SM::stage + SM::off_a + 2048 * kk + 16 * e) = make_uint4(0, 0, 0, 0);
    }
    fq_fence_async_smem(); /* (read by wgmma) */
    __syncthreads();
    /* the segment table, A'' and the record come from the kernels before;
     * ready (stage A beside this pass, fq_cuda_fwd_beside): the kernels before
     * stage A completed before this one launched, and each chunk's A'' and
     * record are waited for by their flag (the producer, below) */
    if (!ready) fq_pdl_wait();
    const fq_seg_info si = args.segs[gs];
    if (tid == 0) FQ_TL(1);
    /* (block-uniform exits, before any role split) */
    if (si.seq < 0 || (MAP && si.index == si.count - 1)) {
        if (ready && tid == 0) fq_pdl_wait(); /* (beside: every block waits for stage A before it completes) */
        return;
    }
    const int nch = si.nchunks;

    if (role == 0) {
        /* ---------------------------------------------------- producer ---- */
        fq_setmaxnreg_dec<40>();
        if (tid == 0) {
            for (int i = 0; i < nch; i++) {
                const int s = i % NS;
                if (i >= NS) fq_mbar_wait(&empty[s], ((i / NS) - 1) & 1);
                unsigned char *st = smem + s * SM::stage;
                const int row = si.bos + 64 * i;
                if (!MAP && ready) {
                    /* stage A's flag for the chunk's A'' and record (generic-proxy stores of
                     * another SM, read below by bulk copies: the async proxy) */
                    const int *f = ready + (int64_t)(si.chunk0 + i) * HV + j;
                    while (!fq_flag_ready(f)) __nanosleep(64);
                    fq_fence_proxy_async_global();
                }
                /* MAP, HST: no Q (no outputs); MAP: no V for an M block (v = 0 there) */
                fq_mbar_arrive_tx(&full[s], MAP ? (uint32_t)(KT + 1 - mblk) * FQ_TILE + FQ_APACK_BYTES + SM::rec_bytes
                                          : HST ? SM::load_bytes - (uint32_t)KT * FQ_TILE
                                                : SM::load_bytes);
                fq_bulk_load(smem + SM::off_rec + s * SM::rec_bytes,
                             args.rec + ((int64_t)(si.chunk0 + i) * HV + j) * FQ_REC_FLOATS, SM::rec_bytes, &full[s]);
#pragma unroll
                for (int kt = 0; kt < KT; kt++) {
                    if (!MAP && !HST) fq_tma_load_3d(st + SM::off_q + kt * FQ_TILE, &tm_q, &full[s], 64 * kt, hq, row);
                    fq_tma_load_3d(st + SM::off_k + kt * FQ_TILE, &tm_k, &full[s], 64 * kt, hq, row);
                }
#pragma unroll
                for (int h = 0; h < NH; h++) /* (PAIR: vb = 0, the chains' blocks 0 and 1) */
                    if (!mblk) fq_tma_load_3d(st + SM::off_v + h * FQ_TILE, &tm_v, &full[s], 64 * (vb + h), j, row);
                /* A'': each K-step's stored rows (r >= 16 kk) to their place in the tile */
                for (int kk = 0; kk < 4; kk++)
                    fq_bulk_load(st + SM::off_a + 2048 * kk + 512 * kk,
                                 args.a + ((int64_t)(si.chunk0 + i) * HV + j) * FQ_APACK_ELEMS + fq_apack_step_bytes(kk) / 2,
                                 (8 - 2 * kk) * 256, &full[s]);
            }
            /* (beside: this grid completes only after stage A, as after a wait at its start) */
            if (ready) fq_pdl_wait();
        } else if (tid >= 32) {
            /* checker, warps 1..3 (issue 9: causality for V, which stage A
             * does not read): fv = the chunk's first row with a non-finite v
             * in this CTA's 64 columns; from it on the stage's record is
             * poisoned as stage A poisons it for k, g, beta (qg = NaN: those o
             * rows come out NaN; e^{gamma_C} = NaN: the state after the chunk).
             * Then the rows from zr = min(len, f, fv) (f: stage A's FQ_REC_F)
             * on enter nothing: the padding rows of a sequence's last chunk
             * (rows of the next sequence) and the rows from the chunk's first
             * non-finite k, g, beta (stage A) or v on (their NaN would reach
             * earlier rows through the zeros of A and P): zeroed in the Q, K,
             * V tiles before `checked` hands the stage to the compute
             * warpgroups. Off the critical path: the loads run up to three
             * chunks ahead. */
            const int tk = tid - 32, lane = tid & 31;
            for (int i = 0; i < nch; i++) {
                const int s = i % NS;
                fq_mbar_wait(&full[s], (i / NS) & 1);
                unsigned char *st = smem + s * SM::stage;
                float *rec = (float *)(smem + SM::off_rec + s * SM::rec_bytes);
                const int len = min(64, si.len - 64 * i);
                if constexpr (PAIR) {
                    /* per chain h (its V tile): fv_h = its first non-finite V row, to
                     * fvc for the chain (e^{gamma_C} = NaN) and the output warpgroup
                     * (qg = NaN from row fv_h on): the record and the Q, K tiles are
                     * shared, so they are not poisoned here, and Q, K rows are zeroed
                     * from zq = min(len, f) on only, V rows of chain h from
                     * min(zq, fv_h) on. Rows before fv_h get the bits FULL gives them
                     * (Q, K rows from fv_h on enter only rows from fv_h on); the rows
                     * from fv_h on are NaN, as there. The two V tiles are adjacent:
                     * piece idx (16 bytes) of both is row (idx & 511) / 8 of tile
                     * idx / 512; rows >= len (another sequence's) are not looked at.
                     * Three loads at a time (the scan is on the chains' path when it
                     * is slower than their chunk). */
                    int bad0 = 64, bad1 = 64;
#pragma unroll 1
                    for (int i0 = 0; i0 < 1024; i0 += 3 * 96) {
                        uint4 x[3];
#pragma unroll
                        for (int u = 0; u < 3; u++) {
                            const int idx = tk + i0 + 96 * u;
                            x[u] = make_uint4(0, 0, 0, 0);
                            if (idx < 1024 && ((idx & 511) >> 3) < len) x[u] = *(const uint4 *)(st + SM::off_v + 16 * idx);
                        }
#pragma unroll
                        for (int u = 0; u < 3; u++) {
                            const int idx = tk + i0 + 96 * u;
                            if (fq_bf16x8_nonfinite(x[u])) {
                                if (idx >> 9) bad1 = min(bad1, (idx & 511) >> 3);
                                else bad0 = min(bad0, (idx & 511) >> 3);
                            }
                        }
                    }
                    bad0 = __reduce_min_sync(0xffffffffu, bad0);
                    bad1 = __reduce_min_sync(0xffffffffu, bad1);
                    if (lane == 0 && bad0 < 64) atomicMin(&chk[2 * s], bad0);
                    if (lane == 0 && bad1 < 64) atomicMin(&chk[2 * s + 1], bad1);
                    fq_named_bar(4, 96);
                    const int fv0 = chk[2 * s], fv1 = chk[2 * s + 1], fr = (int)rec[FQ_REC_F];
                    fq_named_bar(4, 96); /* every checker has read them */
                    if (tk == 0) {
                        fvc[2 * s] = fv0;
                        fvc[2 * s + 1] = fv1;
                        chk[2 * s] = chk[2 * s + 1] = 64;
                    }
                    const int zq = min(len, fr);
                    if (zq < 64) { /* Q, K: the 2 KT tiles from off_q on */
                        const int nrow = 64 - zq;
                        for (int idx = tk; idx < 2 * KT * nrow * 8; idx += 96) {
                            const int tile = idx / (nrow * 8), r = zq + (idx / 8) % nrow, c = idx % 8;
                            *(uint4 *)(st + SM::off_q + tile * FQ_TILE + r * 128 + c * 16) = make_uint4(0, 0, 0, 0);
                        }
                    }
#pragma unroll
                    for (int h = 0; h < 2; h++) {
                        const int zv = min(zq, h ? fv1 : fv0);
                        for (int idx = tk; idx < (64 - zv) * 8; idx += 96)
                            *(uint4 *)(st + SM::off_v + h * FQ_TILE + (zv + idx / 8) * 128 + (idx % 8) * 16) =
                                make_uint4(0, 0, 0, 0);
                    }
                    fq_fence_async_smem();
                    fq_mbar_arrive(&checked[s]);
                    continue;
                }
                int bad = 64;
                if (!mblk) /* (a V row is 128 bytes; the swizzle permutes only inside a row) */
                    for (int idx = tk; idx < 8 * len; idx += 96)
                        if (fq_bf16x8_nonfinite(*(const uint4 *)(st + SM::off_v + 16 * idx))) bad = min(bad, idx >> 3);
                bad = __reduce_min_sync(0xffffffffu, bad);
                if (lane == 0 && bad < 64) atomicMin(&chk[s], bad);
                fq_named_bar(4, 96);
                const int fv = chk[s], fr = (int)rec[FQ_REC_F];
                if (fv < 64) { /* uniform over the checkers, rare */
                    fq_named_bar(4, 96); /* every checker has read fv and f */
                    if (tid < 64) { /* warp 1 */
                        const float nan = __int_as_float(0x7fc00000);
                        if (lane >= fv) rec[FQ_REC_QG + lane] = nan;
                        if (lane + 32 >= fv) rec[FQ_REC_QG + lane + 32] = nan;
                        if (lane == 0) {
                            rec[FQ_REC_EC] = nan;
                            chk[s] = 64;
                        }
                    }
                }
                const int zr = min(len, min(fv, fr));
                if (zr < 64) {
                    /* zero rows zr.. of Q, K, V (MAP: K, V: no Q tiles; HST: K, V: its output
                     * warpgroup stages h in the Q tiles, which the producer never fills then) */
                    constexpr int t0 = HST || MAP ? KT : 0;
                    const int nt = 2 * KT + 1 - t0, nrow = 64 - zr;
                    for (int idx = tk; idx < nt * nrow * 8; idx += 96) {
                        const int tile = t0 + idx / (nrow * 8), r = zr + (idx / 8) % nrow, c = idx % 8;
                        unsigned char *tb = st + (tile < KT ? SM::off_q + tile * FQ_TILE
                                                  : tile < 2 * KT ? SM::off_k + (tile - KT) * FQ_TILE
                                                                  : SM::off_v);
                        *(uint4 *)(tb + r * 128 + c * 16) = make_uint4(0, 0, 0, 0);
                    }
                }
                /* (the record and the tiles are read by wgmma / a later TMA load overwrites them) */
                fq_fence_async_smem();
                fq_mbar_arrive(&checked[s]);
            }
        }
    } else if (role == 1) {
        /* ------------------------------------------------------ output ---- */
        /* (PAIR: 512 threads, 128 registers each at launch: 40 + 136 + 2 x 168) */
        fq_setmaxnreg_inc<PAIR ? 136 : 232>();
        const int tp = tid - 128, w = tp >> 5, lane = tp & 31, g = lane >> 2, t = lane & 3;
        unsigned char *Os = smem + SM::off_o;
        for (int i = 0; i < nch; i++) {
            const int s = i % NS, b = i & 1; /* (FULL, HST: b the S^T and Vn^T buffer) */
            const uint32_t par = (i >> 1) & 1;
            unsigned char *st = smem + s * SM::stage;
            const float *rec = (const float *)(smem + SM::off_rec + s * SM::rec_bytes);
            const int len = min(64, si.len - 64 * i);
            /* the stage's tiles are final once its V rows are checked (and rows zeroed) */
            fq_mbar_wait(&checked[s], (i / NS) & 1);
            if constexpr (HST) {
                /* the backward's h and Vn, in the three-stage state pass's layouts:
                 *   h[c][j][kd][64 vb + v] = S^T[v][kd] at the chunk's start (bf16 as handed over)
                 *   vn[c][j][r][64 vb + v] = Vn^T[v][r]  (0 for rows r >= len)
                 * each 8 x 8 block transposed by ldmatrix.trans (from the chain's [v][kd],
                 * [v][r] tiles) + stmatrix into SWIZZLE_128B staging tiles [kd][v] (the
                 * stage's Q tiles, unused here) and [r][v] (the O staging), which leave by
                 * TMA store (tm_o: h, tm_q: vn; fq_cuda_fwd_fused_states) */
                fq_mbar_arrive(&empty[s]); /* nothing of the stage's loads is read here */
                unsigned char *hs = st + SM::off_q;
                /* the staging tiles are free once the stores of the chunk before have read them */
                if (tp == 0) fq_bulk_wait_read<0>();
                fq_named_bar(3, 128);
                fq_mbar_wait(&sb_full[b], par);
                const unsigned char *sbt = smem + SM::off_sb + b * KT * FQ_TILE;
#pragma unroll
                for (int q = 0; q < K / 16; q++) { /* group 4 q + w: kd block kdb, v blocks 4 (w & 1).. */
                    const int kdb = (4 * q + w) >> 1;
                    fq_hst_transpose4<0>(sbt + (kdb >> 3) * FQ_TILE, 16 * (kdb & 7), hs, kdb, w & 1, 0);
                }
                fq_mbar_arrive(&sb_empty[b]); /* S^T read (its values are in the staging now) */
                fq_mbar_wait(&vn_full[b], par);
                const unsigned char *vnt = smem + SM::off_vn + b * FQ_TILE;
#pragma unroll
                for (int q = 0; q < 4; q++) /* group 4 q + w: r block (4 q + w) / 2, v blocks 4 (w & 1).. */
                    fq_hst_transpose4<1>(vnt, 16 * ((4 * q + w) >> 1), Os, (4 * q + w) >> 1, w & 1, len);
                fq_mbar_arrive(&vn_empty[b]); /* Vn^T read */
                fq_fence_async_smem();
                fq_named_bar(3, 128);
                if (tp == 0) {
                    const int ch = (si.chunk0 + i) * HV + j;
                    fq_tma_store_3d(&tm_o, hs, 64 * vb, 0, ch);
                    fq_tma_store_3d(&tm_q, Os, 64 * vb, 0, ch);
                    fq_bulk_commit();
                }
                continue;
            }
            if constexpr (PAIR) {
                /* both column blocks h = 0, 1 (chains 0 and 1) of the value head, with one P:
                 *   O_h = diag(qg_h) Q S_h + P Vn_h,  qg_h = qg with rows from fv_h on NaN
                 * (fvc: chain h's first non-finite V row, the checker's), each step as FULL's */
                const int bv = i % VNN, fv0 = fvc[2 * s], fv1 = fvc[2 * s + 1];
                const uint32_t psb = (uint32_t)(i / SBN) & 1, pvn = (uint32_t)(i / VNN) & 1;
                float pacc[32], oacc[32], oac1[32];
                const uint64_t dq = fq_desc_sw128(fq_smem_u32(st + SM::off_q), 16, 1024);
                const uint64_t dk = fq_desc_sw128(fq_smem_u32(st + SM::off_k), 16, 1024);
                const uint64_t ds0 = fq_desc_sw128(fq_smem_u32(smem + SM::off_sb + (i % SBN) * KT * FQ_TILE), 16, 1024);
                const uint64_t ds1 = fq_desc_sw128(fq_smem_u32(smem + SM::off_sb + (SBN + i % SBN) * KT * FQ_TILE), 16, 1024);
                const uint64_t dv0 = fq_desc_sw128(fq_smem_u32(smem + SM::off_vn + bv * FQ_TILE), 16, 1024);
                const uint64_t dv1 = fq_desc_sw128(fq_smem_u32(smem + SM::off_vn + (VNN + bv) * FQ_TILE), 16, 1024);
                fq_wgmma_fence();
                fq_wgmma_ss_qk<K>(pacc, dq, dk);
                fq_wgmma_commit();
                fq_mbar_wait(&sb_full[i % SBN], psb);
                fq_wgmma_fence();
                fq_wgmma_ss_qk<K>(oacc, dq, ds0);
                fq_wgmma_commit();
                float qr[2];
                uint32_t pf[4][4];
                fq_out_gate_p(pf, qr, pacc, rec, w, g, t);
                fq_wgmma_wait<0>();
                fq_reg_fence(oacc);
                fq_mbar_arrive(&sb_empty[i % SBN]); /* S_0^T read */
                /* O_1 = Q S_1 while O_0 is finished */
                fq_mbar_wait(&sb_full[SBN + i % SBN], psb);
                fq_wgmma_fence();
                fq_wgmma_ss_qk<K>(oac1, dq, ds1);
                fq_wgmma_commit();
                const float nan = __int_as_float(0x7fc00000);
                const float q00 = 16 * w + g >= fv0 ? nan : qr[0], q01 = 16 * w + g + 8 >= fv0 ? nan : qr[1];
                fq_scale_rows(oacc, q00, q01);
                fq_mbar_wait(&vn_full[bv], pvn);
                fq_wgmma_fence();
#pragma unroll
                for (int kk = 0; kk < 4; kk++) fq_wgmma_rs_n64<0, 0>(oacc, pf[kk], fq_desc_at(dv0, 32 * kk), 1);
                fq_wgmma_commit();
                fq_wgmma_wait<0>();
                fq_reg_fence(oacc);
                fq_reg_fence(oac1);
                fq_mbar_arrive(&sb_empty[SBN + i % SBN]); /* S_1^T read */
                fq_mbar_arrive(&empty[s]);                /* Q, K and the record read */
                fq_mbar_arrive(&vn_empty[bv]);              /* Vn_0^T read */
                fq_out_store<0>(oacc, Os, args, &tm_o, 0, j, si.bos + 64 * i, len, tp, w, g, t);
                const float q10 = 16 * w + g >= fv1 ? nan : qr[0], q11 = 16 * w + g + 8 >= fv1 ? nan : qr[1];
                fq_scale_rows(oac1, q10, q11);
                fq_mbar_wait(&vn_full[VNN + bv], pvn);
                fq_wgmma_fence();
#pragma unroll
                for (int kk = 0; kk < 4; kk++) fq_wgmma_rs_n64<0, 0>(oac1, pf[kk], fq_desc_at(dv1, 32 * kk), 1);
                fq_wgmma_commit();
                fq_wgmma_wait<0>();
                fq_reg_fence(oac1);
                fq_mbar_arrive(&vn_empty[VNN + bv]); /* Vn_1^T read */
                /* (tile 1 of the staging: the store of tile 0 just issued may stay pending) */
                fq_out_store<1>(oac1, Os + SM::o_bytes, args, &tm_o, 1, j, si.bos + 64 * i, len, tp, w, g, t);
                continue;
            }

            /* P0 = Q K^T (Q and K K-major, M = the chunk's rows) */
            float pacc[32], oacc[32];
            const uint64_t dq = fq_desc_sw128(fq_smem_u32(st + SM::off_q), 16, 1024);
            const uint64_t dk = fq_desc_sw128(fq_smem_u32(st + SM::off_k), 16, 1024);
            const uint64_t ds = fq_desc_sw128(fq_smem_u32(smem + SM::off_sb + b * KT * FQ_TILE), 16, 1024);
            const uint64_t dv = fq_desc_sw128(fq_smem_u32(smem + SM::off_vn + b * FQ_TILE), 16, 1024);
            fq_wgmma_fence();
            fq_wgmma_ss_qk<K>(pacc, dq, dk);
            fq_wgmma_commit();
            /* O = Q S at the chunk's start (S^T from the chain, [v][kd]: K-major) */
            fq_mbar_wait(&sb_full[b], par);
            fq_wgmma_fence();
            fq_wgmma_ss_qk<K>(oacc, dq, ds);
            fq_wgmma_commit();
            /* P = lower_incl(P0 ⊙ Gamma) diag(scale rq) . diag(rk) as bf16 A fragments of P Vn */
            float qr[2];
            uint32_t pf[4][4];
            fq_out_gate_p(pf, qr, pacc, rec, w, g, t);
            fq_wgmma_wait<0>();
            fq_reg_fence(oacc);
            fq_mbar_arrive(&sb_empty[b]); /* S^T read */
            fq_mbar_arrive(&empty[s]);    /* Q, K and the record read */
            /* O = diag(qg) Q S (+ P Vn below) */
            fq_scale_rows(oacc, qr[0], qr[1]);
            fq_mbar_wait(&vn_full[b], par);
            fq_wgmma_fence();
#pragma unroll
            for (int kk = 0; kk < 4; kk++) fq_wgmma_rs_n64<0, 0>(oacc, pf[kk], fq_desc_at(dv, 32 * kk), 1);
            fq_wgmma_commit();
            fq_wgmma_wait<0>();
            fq_reg_fence(oacc);
            fq_mbar_arrive(&vn_empty[b]); /* Vn^T read */

            /* O through the staging to global rows r < len */
            fq_out_store<0>(oacc, smem + SM::off_o, args, &tm_o, vb, j, si.bos + 64 * i, len, tp, w, g, t);
        }
        if (tp == 0) fq_bulk_wait0(); /* the last tile stores are complete */
        if (tp == 0) FQ_TL(7);
    } else {
        /* ------------------------------------------------------- chain ---- */
        /* (MAP: 2 CTAs of 256 threads per SM, 128 registers each at launch: 40 + 216;
         * PAIR: chain ch = wg - 2 of column block vb = ch) */
        fq_setmaxnreg_inc<MAP ? 216 : PAIR ? 168 : 232>();
        const int ch = PAIR ? wg - 2 : 0;
        const int tc = tid - (MAP ? 128 : 256 + 128 * ch), w = tc >> 5, lane = tc & 31, g = lane >> 2, t = lane & 3;
        const int V = args.V;
        /* S^T: row v = 16 w + g + 8 h (this CTA's column 64 vb + v), column kd = 8 nb + 2 t + e:
         * S[4 nb + 2 h + e] */
        float S[K / 2];
        /* the start state: FULL: a split sequence's segments start from what
         * the combine step chained into ss (segment 0 too: its h0 copied
         * there, so that with a pool (h0 == ht) no segment reads a slot the
         * last one may already have written); a whole sequence from h0 at
         * its slot (zeros without one, NaN for a duplicate slot, gdn.h);
         * MAP: the identity's columns 64 cb + v (an M block) or zeros (a D
         * block) */
        const float *s0 = NULL;
        int64_t s0base = 0;
        int s0vk = 0;
        float s0fill = 0.f;
        /* a split sequence's start state in its segment's rows of o where the
         * forward keeps it there (fq_omap; ss NULL then) */
        const int om0 = !MAP && !HST && si.count > 1 && !args.ss;
        if (!MAP) {
            if (si.count > 1) {
                s0 = args.ss;
                s0base = ((int64_t)si.cp * HV + j) * K * V;
            } else if (si.slot >= 0 && args.h0) {
                s0 = args.h0;
                s0base = ((int64_t)si.slot * HV + j) * K * V;
                s0vk = args.vk;
            } else if (si.slot == FQ_SLOT_DUP) {
                s0fill = __int_as_float(0x7fc00000);
            }
        }
        if (om0) {
            /* element (kd, v) at r<h> + (kd - 2 t) ks for the lane's rows v = 16 w + g + 8 h */
            const fq_omap om = fq_omap_make(args.o, HV, K, V, args.odt);
            const int ks = (64 >> om.lfs) * HV * om.rb;
            const char *r0 = (const char *)fq_omap_ss(om, si.bos, j, vb, 2 * t, 16 * w + g);
            const char *r1 = (const char *)fq_omap_ss(om, si.bos, j, vb, 2 * t, 16 * w + g + 8);
#pragma unroll
            for (int nb = 0; nb < K / 8; nb++)
#pragma unroll
                for (int e = 0; e < 4; e++)
                    S[4 * nb + e] = *(const float *)((e >> 1 ? r1 : r0) + (8 * nb + (e & 1)) * ks);
        } else {
#pragma unroll
            for (int nb = 0; nb < K / 8; nb++)
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    const int v = 16 * w + g + 8 * (e >> 1), kd = 8 * nb + 2 * t + (e & 1);
                    if (MAP) S[4 * nb + e] = (mblk && kd == 64 * cb + v) ? 1.f : 0.f;
                    else S[4 * nb + e] = s0 ? s0[s0base + fq_state_at(kd, 64 * vb + v, K, V, s0vk)] : s0fill;
                }
        }
        uint32_t sb[K / 16][4];
#pragma unroll
        for (int kk = 0; kk < K / 16; kk++) fq_acc_to_a(sb[kk], &S[8 * kk], 1.f);
        if (tc == 0) FQ_TL(2);
        /* S^T (bf16, [v][kd]) of the chunk's start for the output warpgroup's Q S,
         * into buffer b once the output warpgroup has read what was there */
        auto hand_state = [&](int c) {
            const int b = ch * SBN + c % SBN;
            if (c >= SBN) fq_mbar_wait(&sb_empty[b], ((c / SBN) - 1) & 1);
            unsigned char *tb = smem + SM::off_sb + b * KT * FQ_TILE;
#pragma unroll
            for (int kk = 0; kk < K / 16; kk++)
                fq_stsm_pairs(tb + (kk >> 2) * FQ_TILE, w, (2 * kk) & 7, sb[kk][0], sb[kk][1], sb[kk][2], sb[kk][3]);
            fq_fence_async_smem();
            fq_mbar_arrive(&sb_full[b]);
        };

        for (int i = 0; i < nch; i++) {
            const int s = i % NS, b = ch * VNN + i % VNN; /* b: the Vn^T buffer */
            unsigned char *st = smem + s * SM::stage;
            fq_mbar_wait(&checked[s], (i / NS) & 1);
            if (tc == 0 && i == 0) FQ_TL(3);
            const float *rec = (const float *)(smem + SM::off_rec + s * SM::rec_bytes);
            const float *kdv = rec + FQ_REC_KD, *fav = rec + FQ_REC_FA1;
            float xacc[32], vacc[32];
            const uint64_t dk = fq_desc_sw128(fq_smem_u32(st + SM::off_k), 16, 1024);
            const uint64_t dkm = fq_desc_sw128(fq_smem_u32(st + SM::off_k), FQ_TILE, 1024);
            const uint32_t sa = fq_smem_u32(st + SM::off_a); /* A'' (dense, no swizzle) */
            /* V^T in the accumulator layout (V [r][v]: 8 x 8 blocks transposed by
             * ldmatrix; block (nb, h) = rows 8 nb.., columns 16 w + 8 h..), zeros
             * for an M block; loaded first, used after group 1 */
            uint32_t vt[16];
            if (!mblk) {
                const int m = lane >> 3;
#pragma unroll
                for (int q = 0; q < 4; q++) {
                    const int nb = 2 * q + (m >> 1), h = m & 1;
                    fq_ldsm_x4_trans(&vt[4 * q], fq_smem_u32(st + SM::off_v + ch * FQ_TILE +
                                                             fq_sw128(8 * nb + (lane & 7), 2 * (16 * w + 8 * h))));
                }
            } else {
#pragma unroll
                for (int q = 0; q < 16; q++) vt[q] = 0u;
            }
            fq_wgmma_fence();
            /* group 1: X^T = S^T K^T (K K-major) */
#pragma unroll
            for (int kk = 0; kk < K / 16; kk++)
                fq_wgmma_rs_n64<0, 0>(xacc, sb[kk], fq_desc_at(dk, (kk >> 2) * FQ_TILE + 32 * (kk & 3)), kk > 0);
            fq_wgmma_commit();
            /* S^T of this chunk's start to the output warpgroup, while group 1 runs */
            if constexpr (!MAP) hand_state(i);
            /* e^gamma rk of this thread's columns r = 8 nb + 2 t + e (PAIR: loaded after the
             * wait, the registers of S^T's bf16 copy are free then) */
            float fac[16];
            auto load_fac = [&]() {
#pragma unroll
                for (int nb = 0; nb < 8; nb++) {
                    const float2 f = *(const float2 *)(fav + 8 * nb + 2 * t);
                    fac[2 * nb] = f.x, fac[2 * nb + 1] = f.y;
                }
            };
            if constexpr (!PAIR) load_fac();
            fq_wgmma_wait<0>();
            fq_reg_fence(xacc);
            if constexpr (PAIR) load_fac();
            /* Y^T = V^T - X^T diag(e^gamma rk), split into two bf16 parts (Y = Yh + Yl)
             * as A fragments of the next product: Vn = A'' V - W S = A'' Y */
            uint32_t yh[4][4], yl[4][4];
#pragma unroll
            for (int kk = 0; kk < 4; kk++) {
                float y[8];
#pragma unroll
                for (int q = 0; q < 2; q++) {
                    const int nb = 2 * kk + q;
#pragma unroll
                    for (int h = 0; h < 2; h++) {
                        /* block (nb, h) of vt: matrix 2 (nb & 1) + h of ldmatrix nb >> 1 */
                        const float2 vv = fq_unpack_bf16(vt[4 * (nb >> 1) + 2 * (nb & 1) + h]);
                        y[4 * q + 2 * h] = vv.x - fac[2 * nb] * xacc[4 * nb + 2 * h];
                        y[4 * q + 2 * h + 1] = vv.y - fac[2 * nb + 1] * xacc[4 * nb + 2 * h + 1];
                    }
                }
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    yh[kk][e] = fq_pack_bf16(y[2 * e], y[2 * e + 1]);
                    const float2 hv = fq_unpack_bf16(yh[kk][e]);
                    yl[kk][e] = fq_pack_bf16(y[2 * e] - hv.x, y[2 * e + 1] - hv.y);
                }
            }
            fq_wgmma_fence();
            /* group 2: Vn^T = Y^T A''^T = Yh^T A''^T + Yl^T A''^T (A'' K-major, no swizzle:
             * K-step kk at 2048 kk, core matrices LBO 128, SBO 256) */
#pragma unroll
            for (int kk = 0; kk < 4; kk++) fq_wgmma_rs_n64<0, 0>(vacc, yh[kk], fq_desc_interleave(sa + 2048 * kk, 128, 256), kk > 0);
#pragma unroll
            for (int kk = 0; kk < 4; kk++) fq_wgmma_rs_n64<0, 0>(vacc, yl[kk], fq_desc_interleave(sa + 2048 * kk, 128, 256), 1);
            fq_wgmma_commit();
            /* this thread's columns r = 8 nb + 2 t + e of kd */
            float kdc[16];
#pragma unroll
            for (int nb = 0; nb < 8; nb++) {
                const float2 f = *(const float2 *)(kdv + 8 * nb + 2 * t);
                kdc[2 * nb] = f.x, kdc[2 * nb + 1] = f.y;
            }
            /* (PAIR: NaN from a non-finite V row of this chain's block, the checker's fvc) */
            const float eC = PAIR && fvc[s * NH + ch] < 64 ? __int_as_float(0x7fc00000) : rec[FQ_REC_EC];
            fq_wgmma_wait<0>();
            fq_reg_fence(vacc);
            /* Vn (for P Vn) and diag(kd) Vn (for the update, so K stays raw) as A fragments */
            uint32_t vn[4][4], vnd[4][4];
#pragma unroll
            for (int kk = 0; kk < 4; kk++) {
                fq_acc_to_a(vn[kk], &vacc[8 * kk], 1.f);
                const float *x = &vacc[8 * kk];
                const float k0 = kdc[4 * kk], k1 = kdc[4 * kk + 1], k2 = kdc[4 * kk + 2], k3 = kdc[4 * kk + 3];
                vnd[kk][0] = fq_pack_bf16(x[0] * k0, x[1] * k1);
                vnd[kk][1] = fq_pack_bf16(x[2] * k0, x[3] * k1);
                vnd[kk][2] = fq_pack_bf16(x[4] * k2, x[5] * k3);
                vnd[kk][3] = fq_pack_bf16(x[6] * k2, x[7] * k3);
            }
#pragma unroll
            for (int e = 0; e < K / 2; e++) S[e] *= eC;
            fq_wgmma_fence();
            /* group 3: S^T = e^{gamma_C} S^T + (diag(kd) Vn)^T K (K MN-major) */
#pragma unroll
            for (int kk = 0; kk < 4; kk++) {
                if constexpr (K == 128)
                    fq_wgmma_rs_n128<1, 0>(S, vnd[kk], fq_desc_at(dkm, 2048 * kk), 1);
                else
                    fq_wgmma_rs_n64<1, 0>(S, vnd[kk], fq_desc_at(dkm, 2048 * kk), 1);
            }
            fq_wgmma_commit();
            if constexpr (!MAP) {
                /* Vn^T (bf16 [v][r]) for the output warpgroup's P Vn, while the update runs */
                if (i >= VNN) fq_mbar_wait(&vn_empty[b], ((i / VNN) - 1) & 1);
                unsigned char *tb = smem + SM::off_vn + b * FQ_TILE;
#pragma unroll
                for (int kk = 0; kk < 4; kk++) fq_stsm_pairs(tb, w, 2 * kk, vn[kk][0], vn[kk][1], vn[kk][2], vn[kk][3]);
                fq_fence_async_smem();
                fq_mbar_arrive(&vn_full[b]);
            }
            fq_wgmma_wait<0>();
            fq_reg_fence(S);
            fq_mbar_arrive(&empty[s]); /* K, V, A'' and the record read */
            if (tc == 0 && i == 0) FQ_TL(4);
#pragma unroll
            for (int kk = 0; kk < K / 16; kk++) fq_acc_to_a(sb[kk], &S[8 * kk], 1.f);
            if constexpr (!MAP) {
                /* [serving] prefix-cache checkpoint: the state after c = cfirst + i + 1
                 * chunks of the sequence, when c is a multiple of ck_chunks and the
                 * chunk is full (gdn.h: the state after c * checkpoint_every tokens) */
                const int c = si.cfirst + i + 1, len = min(64, si.len - 64 * i);
                if (args.ckpt && len == 64 && c % args.ck_chunks == 0) {
                    float *ck = args.ckpt + ((args.cu_ck[si.seq] + c / args.ck_chunks - 1) * HV + j) * (int64_t)K * V;
                    fq_chain_store_state<K>(S, ck, 64 * vb, V, args.vk, w, g, t);
                }
            }
        }
        /* the end state: MAP: columns 64 cb.. of the segment's [M | D]; FULL: ht
         * when the segment ends its sequence */
        float *dst = NULL;
        int64_t dbase = 0;
        int c0 = 0, dcols = K + V, dvk = 0;
        if (MAP) {
            dst = args.md;
            dbase = ((int64_t)si.cp * HV + j) * K * (K + V);
            c0 = 64 * cb;
        } else if (si.index == si.count - 1 && si.slot >= 0) {
            dst = args.ht;
            dbase = ((int64_t)si.slot * HV + j) * K * V;
            c0 = 64 * vb;
            dcols = V;
            dvk = args.vk;
        }
        if (tc == 0) FQ_TL(5);
        if (MAP && !args.md) {
            /* element (kd, v) of block cb of the segment's map, in the sequence's rows of o
             * where the forward keeps it there (fq_omap; md NULL then) */
            const fq_omap om = fq_omap_make(args.o, HV, K, V, args.odt);
            const int64_t R = fq_omap_blk(om, si.bos - (int64_t)64 * si.cfirst, si.nchunks, si.count,
                                          om.ncb * si.index + cb);
#pragma unroll
            for (int nb = 0; nb < K / 8; nb++)
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    const int v = 16 * w + g + 8 * (e >> 1), kd = 8 * nb + 2 * t + (e & 1);
                    *fq_omap_at(om, R, j, kd, v) = S[4 * nb + e];
                }
        } else if (dst) {
            fq_chain_store_state<K>(S, dst + dbase, c0, dcols, dvk, w, g, t);
        }
        if (tc == 0) FQ_TL(6);
    }
#endif
}

/* ------------------------------------------------------------- host ---- */

/* The tensor maps of one call: q, k, v (bf16) and o (16-bit o at a 16-byte
 * aligned address; else the kernel stores o per thread); A'' (packed) comes
 * by bulk copy. */
struct fq_fused_maps {
    CUtensorMap q, k, v, o;
    int o_tma;
};

template <int K>
static fq_status fq_fused_maps_of(const fq_gdn_params *p, const fq_fwd_ws *ws, fq_fused_maps *m)
{
    /* (an empty problem still needs valid maps: no tile is loaded then) */
    const int64_t rows = p->B * p->T > 0 ? p->B * p->T : 1;
    const uint32_t box[3] = {64, 1, 64};
    const uint64_t dq[3] = {(uint64_t)K, (uint64_t)p->H, (uint64_t)rows};
    const uint64_t sq[2] = {(uint64_t)K * 2, (uint64_t)p->H * K * 2};
    const uint64_t dv[3] = {(uint64_t)p->V, (uint64_t)p->HV, (uint64_t)rows};
    const uint64_t sv[2] = {(uint64_t)p->V * 2, (uint64_t)p->HV * p->V * 2};
    fq_status st;
    if ((st = fq_tmap(&m->q, ws->qb, 3, dq, sq, box)) != FQ_OK) return st;
    if ((st = fq_tmap(&m->k, ws->kb, 3, dq, sq, box)) != FQ_OK) return st;
    if ((st = fq_tmap(&m->v, ws->vb, 3, dv, sv, box)) != FQ_OK) return st;
    m->o_tma = p->o && p->dtype != FQ_F32 && ((uintptr_t)p->o & 15) == 0; /* (the backward's HST pass: no o) */
    if (m->o_tma) return fq_tmap(&m->o, p->o, 3, dv, sv, box, p->dtype == FQ_F16);
    m->o = m->q; /* unused */
    return FQ_OK;
}

template <int K, int MODE>
static fq_status fq_launch_fused(const fq_gdn_params *p, const fq_fwd_ws *ws, const fq_fused_maps &m,
                                 const int *ready, cudaStream_t stream)
{
    fq_fused_args args;
    args.segs = ws->segs;
    args.md = ws->md;
    args.ss = ws->ss;
    args.rec = ws->rec;
    args.a = ws->a;
    args.h0 = (const float *)(p->state ? p->state : p->h0);
    args.ht = (float *)(p->state ? p->state : p->ht);
    args.vk = p->state_vk;
    args.ckpt = p->checkpoint_every ? (float *)p->checkpoints : NULL;
    args.cu_ck = (const int64_t *)p->cu_checkpoints;
    args.ck_chunks = (int)(p->checkpoint_every / 64);
    args.o = p->o;
    args.odt = p->dtype;
    args.o_tma = m.o_tma;
    args.H = (int)p->H;
    args.HV = (int)p->HV;
    args.V = (int)p->V;
    args.ncb = (int)(MODE == FQ_FUSED_MAP ? (K + p->V) / 64 : MODE == FQ_FUSED_PAIR ? 1 : p->V / 64);
    args.scale = (float)p->scale;
    if (MODE == FQ_FUSED_HST) { /* (the recompute stores no o, no end state, no checkpoint) */
        args.o = NULL;
        args.ht = NULL;
        args.ckpt = NULL;
    }
    const int64_t blocks = ws->seg_bound * p->HV * args.ncb;
    if (blocks <= 0) return FQ_OK;
    const int bytes = fq_fused_smem<K, MODE>::bytes;
    fq_status st = fq_cuda_set_smem((const void *)fq_fwd_fused_kernel<K, MODE>, bytes);
    if (st != FQ_OK) return st;
    /* (MAP: two CTAs per SM need the largest shared-memory carveout) */
    if (MODE == FQ_FUSED_MAP &&
        (st = fq_cuda_func_attr((const void *)fq_fwd_fused_kernel<K, MODE>,
                                cudaFuncAttributePreferredSharedMemoryCarveout, 100)) != FQ_OK)
        return st;
    return fq_launch_k(fq_fwd_fused_kernel<K, MODE>, (unsigned)blocks, FQ_FUSED_THREADS(MODE), bytes, stream,
                       fq_cuda_pdl_enabled(), m.q,
                       m.k, m.v, m.o, args, ready);
}

/* Context parallelism's MAP pass and combine step (the segment start states
 * into ws->ss, or o's rows: fq_omap) where sequences are split (ws->nseg_max > 1; else nothing),
 * with the caller's maps (MAP reads k and v): the first launches of
 * fq_cuda_fwd_fused and fq_cuda_fwd_fused_states (gdn_cuda_fwd_fused.cu). */
fq_status fq_fwd_fused_cp(const fq_gdn_params *p, const fq_fwd_ws *ws, const fq_fused_maps &m, cudaStream_t stream);

#endif /* FQ_GDN_CUDA_FWD_FUSED_CUH */
