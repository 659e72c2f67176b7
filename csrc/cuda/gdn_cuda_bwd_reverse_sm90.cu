/*
 * gdn_cuda_bwd_reverse_sm90.cu — the backward's reverse pass fused with the
 * WY part of the chunk gradients (steps 4 and 5 of gdn_cuda_bwd.cu) on sm_90a
 * at K = V = 128: one warp-specialised CTA per (sequence or segment, value
 * head j) walks the chunks last to first with dS' (the gradient of the state
 * after the chunk) on chip, and per chunk forms every gradient that needs dS'
 * or dVn, so neither is ever stored (bwd_state90 + bwd_wy90 wrote dS_next and
 * dVn, 48 KB per chunk and head, and read them back).
 *
 * Forward lines (per chunk and value head; K^ = diag(rk) K, the normalised
 * keys; m = e^{gamma_C - gamma}, bg = beta e^gamma, both 0 past the chunk's
 * tokens; W = A diag(bg) K^, U = A diag(beta) V):
 *   O  = diag(qg) Q S + P Vn,  P = lower_incl(Q K^T ⊙ Gamma) . diag(scale rq) (K^ carries rk)
 *   Vn = U - W S,              S' = e^{gamma_C} S + K^T diag(m) Vn
 * The chain (dS^T fp32 in the registers of warpgroup S):
 *   dVn  = P^T dO + diag(m) K^ dS'                   (dO's non-finite elements 0 in P^T dO)
 *   Z    = A^T dVn,   Z' = diag(bg) Z                (NaN where stage A flagged the item)
 *   dS   = e^{gamma_C} dS' + Q^T diag(qg) dO - K^T Z'
 * The WY part (bwd_wy90's equations, gdn_cuda_bwd_fused_sm90.cu):
 *   dv   = diag(beta) Z,  dbeta += rowsum(Z ⊙ V)
 *   F1   = Vn dS'^T:  dK = diag(m) F1,  x = rowsum(F1 ⊙ K^): dgamma -= m x,
 *                     dgamma_C += sum m x + e^{gamma_C} <S, dS'>
 *   dW   = -dVn S^T,  F2 = A^T dW:  dK += diag(bg) F2,  xw = rowsum(F2 ⊙ K^):
 *                     dbeta += e^gamma xw,  dgamma += bg xw
 *   dA   = dW K^T diag(bg) + dVn V^T diag(beta)  (stored transposed, non-finite -> 0)
 *   M1   = A^T dA,  M2 = M1 A^T,  dL = -strict_lower(M2)
 *   y    = dL ⊙ (K^ K^T) ⊙ Gamma: dbeta += rowsum(y),  z = diag(beta) y:
 *                     dgamma += rowsum(z) - colsum(z)
 *   Gl   = diag(beta) dL ⊙ Gamma,  dK += Gl K^ + Gl^T K^
 * dgamma (these terms) goes to a.dgam and dK (w.r.t. K^, per value head, rounded to
 * bf16) to a.dkw; bwd_local90 runs after this kernel: it adds its own dgamma and
 * forms dg = reverse cumsum(dgamma) in the chunk, and sums dK over the GVA group with
 * its dK_O before the L2-norm backward (gdn_cuda_bwd_fused_sm90.cu). With dv and
 * dbeta stored here, bwd_wy has nothing left.
 *
 * Four warpgroups (512 threads), one CTA per SM (~225 KB of shared memory):
 *   P (40 registers): thread 0 issues the TMA loads, per chunk three groups:
 *        KA (K, A, gamma; two stages), QO (Q, dO) and HVV
 *        (h, Vn, V), each once its buffers are released; warps 1..3 check
 *        each group (rows past the chunk's tokens to 0, K scaled by rk, A's
 *        padding to the identity, V's non-finite elements to 0, dO converted
 *        where no TMA, the row vectors) before the consumers see it.
 *   S (176): the chain. Publishes D' = bf16(dS'^T) [v][kd], then dS^T =
 *        e^{gamma_C} dS'^T + (dO^T diag(qg)) Q (A from registers) - Z'^T K^
 *        (both from shared memory, MN-major), dS^T as two m64n128 accumulator sets.
 *   V (120): P, then X^T = D' K^^T (m64n64 per half of v), dVn^T = X^T diag(m)
 *        + dO^T P, dVn^T to shared memory (for W too), Z = A^T dVn (both from
 *        shared memory), Z' for S; then dv and V's part of dbeta by rows of Z.
 *   W (176): the WY products F1, dW, F2, dA, M1, M2, K^ K^T, Gl K^, Gl^T K^,
 *        dK out, dg and dbeta; one chunk behind S and V at most. It starts on h
 *        and Vn as soon as they land (nobody checks them) and waits for the
 *        checked V only before dA: the HVV group is single-buffered, so its
 *        check would otherwise sit on W's critical path every chunk.
 * The epilogues' global stores (dv, dK) go through one row pointer per row with
 * the output type decided once per chunk: per-element dtype switches and 64-bit
 * addresses recomputed per element (what the compiler does under these register
 * budgets) cost more than the stores themselves (benchmarks/NOTES.md, session 22).
 * (The split of the 512 registers per thread slot is FQ_REV_REG_*: with 512 threads
 * ptxas compiles at 128 a thread and gives each role its setmaxnreg budget; if any role
 * runs short, ptxas serialises every wgmma of the kernel (C7512 in `ptxas -v`): check for
 * it after every edit of this file.)
 * Hand-overs are mbarriers, each completing once per chunk (parity = the
 * chunk's step & 1), every "full" paired with an "empty" that holds its
 * writer until the last reader is done. The chain's critical path per chunk:
 * S publishes D' -> V: X, dVn, Z, Z' -> S: two products -> next publish.
 *
 * Context parallelism as bwd_state90's (fq_bwd_cp_args): the MAP pass and
 * the reverse combine stay bwd_state90's; this kernel runs NONE (one chain
 * per sequence from dht) or SEG (per segment from E_s). Deterministic: no
 * atomics, fixed orders.
 */
#include "gdn_cuda_bwd.cuh"
#include "gdn_cuda_hopper.cuh"

#include <string.h>

/* registers per thread of the warpgroups P, S, V, W (512 in all) */
#define FQ_REV_REG_P 40
#define FQ_REV_REG_S 176
#define FQ_REV_REG_V 120
#define FQ_REV_REG_W 176

/* Shared memory. Tiles are 64 x 64 bf16 SWIZZLE_128B (8 KB) unless "tall"
 * (128 rows, 16 KB: one TMA box or one N = 128 operand). */
struct fq_rev_smem {
    static constexpr int KA = 3 * FQ_TILE;                   /* one KA stage: K^ [s][kd] (2 tiles), A [r][c] */
    static constexpr int off_ka = 0;                         /* two stages                               */
    static constexpr int off_q = off_ka + 2 * KA;            /* Q [r][kd], 2 tiles                       */
    static constexpr int off_do = off_q + 2 * FQ_TILE;       /* dO [r][v], 2 tiles (raw: NaN kept)        */
    static constexpr int off_h = off_do + 2 * FQ_TILE;       /* h = S [kd][v]: 2 tall tiles by v half     */
    static constexpr int off_vn = off_h + 4 * FQ_TILE;       /* Vn [r][v], then dW [r][kd] (W)            */
    static constexpr int off_v = off_vn + 2 * FQ_TILE;       /* V [s][v] (non-finite -> 0)                */
    static constexpr int off_d = off_v + 2 * FQ_TILE;        /* D' = dS'^T [v][kd]: 2 tall tiles by kd    */
    static constexpr int off_dvn = off_d + 4 * FQ_TILE;      /* dVn^T [v][r], 2 tiles by v half (W's copy) */
    static constexpr int off_z = off_dvn + 2 * FQ_TILE;      /* Z' [c][v], 2 tiles; tile 0 first P [r][s] */
    static constexpr int off_da = off_z + 2 * FQ_TILE;       /* dA^T [s][r], then Gl [r][s] (W)           */
    static constexpr int off_vec = off_da + FQ_TILE;
    /* per KA stage: gamma (a bulk copy), m, qg, pq = scale rq, beta, bg, eg = e^gamma, rk */
    static constexpr int VG = 0, VM = 64, VQG = 128, VPQ = 192, VB = 256, VBG = 320, VEG = 384, VRK = 448;
    static constexpr int vec_floats = 512;
    /* W's reduction slots (fq_bwd_dg_dbeta's layout): sdgp [128], scz [4][64], sdbp [128], sred [16];
     * V's: vdb [4][64] */
    static constexpr int off_slots = off_vec + 2 * vec_floats * 4;
    static constexpr int SDGP = 0, SCZ = 128, SDBP = 384, SRED = 512, VDB = 528, slot_floats = 784;
    static constexpr int off_bar = off_slots + slot_floats * 4;
    static constexpr int nbar = 20;
    static constexpr int bytes = off_bar + nbar * 8 + 1024; /* + alignment slack */
    static_assert(off_vec % 1024 == 0, "tiles keep their 1024-byte alignment");
    static_assert(bytes <= 227 * 1024, "one CTA per SM");
};

struct fq_rev_args {
    fq_bwd_args a;
    fq_bwd_cp_args c;
    int do_tma; /* dO by TMA (bf16, 16-byte aligned); else converted by the checker */
};


/* dev: FQ_REV_TRACE records clock64 at 29 points of each role's chunk loop
 * (chunks 0..7 of CTA 0), copied out by fq_rev_trace_copy (printed by dev/cuda/check_bwd.cu `one`) */
#ifdef FQ_REV_TRACE
__device__ long long fq_rev_tr[8][32];
#define FQ_TR(slot) do { if (blockIdx.x == 0 && st < 8 && (threadIdx.x & 127) == (threadIdx.x < 128 && (slot) < 6 ? ((slot) < 4 ? 32 : 96) : 0)) fq_rev_tr[st][slot] = clock64(); } while (0)
#else
#define FQ_TR(slot) do { } while (0)
#endif

#if FQ_SM90A
/* Barrier indices (fq_rev_smem::off_bar) */
enum {
    RB_FULL_KA = 0,     /* [2] producer (tx)                */
    RB_CHK_KA = 2,      /* [2] checker (warps 1, 2), 64     */
    RB_EMPTY_KA = 4,    /* [2] S + V + W, 384               */
    RB_FULL_QO = 6,     /* producer (tx)                    */
    RB_CHK_QO = 7,      /* checker (warps 1, 2), 64         */
    RB_EMPTY_QO = 8,    /* S + V, 256                       */
    RB_FULL_HVV = 9,    /* producer (tx)                    */
    RB_CHK_HVV = 10,    /* checker (warp 3), 32             */
    RB_EMPTY_HVV = 11,  /* V + W, 256                       */
    RB_DFULL = 12,      /* S: D' published, 128             */
    RB_DEMPTY = 13,     /* V + W: D' read, 256              */
    RB_VFULL = 14,      /* V: dVn^T stored, 128             */
    RB_VEMPTY = 15,     /* W: dVn^T read, 128               */
    RB_ZFULL = 16,      /* V: Z' stored, 128                */
    RB_ZEMPTY = 17,     /* S: Z' read, 128                  */
    RB_VRFULL = 18,     /* V: its dbeta slots written, 128  */
    RB_VREMPTY = 19     /* W: those slots read, 128         */
};

/* bar.red.or over a named barrier: 1 if any of the n threads passes pred != 0 */
static __device__ __forceinline__ int fq_rev_bar_or(int id, int n, int pred)
{
    int r;
    asm volatile("{\n.reg .pred p, q;\nsetp.ne.b32 q, %1, 0;\nbar.red.or.pred p, %2, %3, q;\nselp.b32 %0, 1, 0, p;\n}\n"
                 : "=r"(r)
                 : "r"(pred), "r"(id), "r"(n)
                 : "memory");
    return r;
}

/* In place, the 16-byte pieces idx0, idx0 + step, .. of `rows` rows of
 * `nt` 64-column tiles (a row is 128 contiguous bytes whatever the swizzle):
 * rows >= len to 0, the others times f[row] (f NULL: unchanged). */
static __device__ __forceinline__ void fq_rev_rows(unsigned char *t, int nt, int len, const float *f, int idx0, int step)
{
    for (int idx = idx0; idx < nt * 64 * 8; idx += step) {
        const int r = (idx >> 3) & 63;
        uint4 *pp = (uint4 *)(t + (idx >> 9) * FQ_TILE + r * 128 + (idx & 7) * 16);
        if (r >= len) {
            *pp = make_uint4(0, 0, 0, 0);
        } else if (f) {
            uint4 x = *pp;
            uint32_t *xs = (uint32_t *)&x;
            const float s = f[r];
#pragma unroll
            for (int q = 0; q < 4; q++) {
                const float2 y = fq_unpack_bf16(xs[q]);
                xs[q] = fq_pack_bf16(y.x * s, y.y * s);
            }
            *pp = x;
        }
    }
}
#endif

template <int CP>
__global__ void __launch_bounds__(512, 1)
    fq_bwd_rev90_kernel(const __grid_constant__ CUtensorMap tm_q, const __grid_constant__ CUtensorMap tm_k,
                        const __grid_constant__ CUtensorMap tm_a, const __grid_constant__ CUtensorMap tm_do,
                        const __grid_constant__ CUtensorMap tm_h, const __grid_constant__ CUtensorMap tm_vn,
                        const __grid_constant__ CUtensorMap tm_v, const __grid_constant__ fq_rev_args args)
{
#if FQ_SM90A
    constexpr int K = 128, V = 128;
    typedef fq_rev_smem SM;
    extern __shared__ __align__(16) unsigned char smem_raw[];
    unsigned char *smem = smem_raw + ((1024 - (fq_smem_u32(smem_raw) & 1023)) & 1023);
    uint64_t *bar = (uint64_t *)(smem + SM::off_bar);
    float *slots = (float *)(smem + SM::off_slots);
    const fq_bwd_args &a = args.a;

    const int HV = a.HV, j = blockIdx.x % HV, unit = blockIdx.x / HV;
    const int hq = j / (HV / a.H);
    int bos, slen, chunk0, nch, seq, sidx = 0, scount = 1, cps = 0;
    if constexpr (CP == FQ_BWD_CP_NONE) {
        const fq_seq_info si = a.seqs[unit];
        bos = si.bos, slen = si.len, chunk0 = si.chunk0, nch = si.nchunks, seq = unit;
    } else {
        const fq_seg_info sg = args.c.segs[unit];
        if (sg.seq < 0) return; /* (block-uniform, before any barrier) */
        bos = sg.bos, slen = sg.len, chunk0 = sg.chunk0, nch = sg.nchunks, seq = sg.seq;
        sidx = sg.index, scount = sg.count, cps = sg.cp;
    }
    const int tid = threadIdx.x, wg = tid >> 7;

    if (tid == 0) {
        const int cnt[SM::nbar] = {1, 1, 64, 64, 384, 384, 1, 64, 256, 1, 32, 256, 128, 256, 128, 128, 128, 128, 128, 128};
        for (int b = 0; b < SM::nbar; b++) fq_mbar_init(&bar[b], cnt[b]);
        fq_mbar_init_fence();
        fq_tma_prefetch_desc(&tm_q);
        fq_tma_prefetch_desc(&tm_k);
        fq_tma_prefetch_desc(&tm_a);
        fq_tma_prefetch_desc(&tm_h);
        fq_tma_prefetch_desc(&tm_vn);
        fq_tma_prefetch_desc(&tm_v);
        if (args.do_tma) fq_tma_prefetch_desc(&tm_do);
    }
    if (tid < 128) { /* slots that stay 0: fq_bwd_dg_dbeta's second halves and warps 4..7 */
        slots[SM::SDGP + 64 + (tid & 63)] = 0.f;
        if (tid < 8) slots[SM::SRED + 4 + (tid & 3) + 8 * (tid >> 2)] = 0.f;
    }
    __syncthreads();

    if (wg == 0) {
        /* ==================================================== producer ==== */
        fq_setmaxnreg_dec<FQ_REV_REG_P>();
        if (tid == 0) {
            const uint32_t ka_bytes = 3 * FQ_TILE + 256, qo_bytes = (2 + (args.do_tma ? 2 : 0)) * FQ_TILE;
            const uint32_t hvv_bytes = 8 * FQ_TILE;
            for (int st = 0; st < nch; st++) {
                const int i = nch - 1 - st, s = st & 1;
                const int row = bos + 64 * i, tile = (chunk0 + i) * HV + j;
                /* KA (two stages) */
                if (st >= 2) fq_mbar_wait(&bar[RB_EMPTY_KA + s], ((st >> 1) - 1) & 1);
                unsigned char *ka = smem + SM::off_ka + s * SM::KA;
                float *vec = (float *)(smem + SM::off_vec) + s * SM::vec_floats;
                uint64_t *fk = &bar[RB_FULL_KA + s];
                fq_mbar_arrive_tx(fk, ka_bytes);
                fq_bulk_load(vec + SM::VG, a.gamma + (int64_t)tile * 64, 256, fk);
                fq_tma_load_3d(ka + 2 * FQ_TILE, &tm_a, fk, 0, 0, tile);
                FQ_TR(26);
                for (int kt = 0; kt < 2; kt++) fq_tma_load_3d(ka + kt * FQ_TILE, &tm_k, fk, 64 * kt, hq, row);
                /* QO */
                if (st >= 1) fq_mbar_wait(&bar[RB_EMPTY_QO], (st - 1) & 1);
                fq_mbar_arrive_tx(&bar[RB_FULL_QO], qo_bytes);
                FQ_TR(27);
                for (int kt = 0; kt < 2; kt++) {
                    fq_tma_load_3d(smem + SM::off_q + kt * FQ_TILE, &tm_q, &bar[RB_FULL_QO], 64 * kt, hq, row);
                    if (args.do_tma)
                        fq_tma_load_3d(smem + SM::off_do + kt * FQ_TILE, &tm_do, &bar[RB_FULL_QO], 64 * kt, j, row);
                }
                /* HVV */
                if (st >= 1) fq_mbar_wait(&bar[RB_EMPTY_HVV], (st - 1) & 1);
                fq_mbar_arrive_tx(&bar[RB_FULL_HVV], hvv_bytes);
                FQ_TR(28);
                for (int vt = 0; vt < 2; vt++) {
                    fq_tma_load_3d(smem + SM::off_h + vt * 2 * FQ_TILE, &tm_h, &bar[RB_FULL_HVV], 64 * vt, 0, tile);
                    fq_tma_load_3d(smem + SM::off_vn + vt * FQ_TILE, &tm_vn, &bar[RB_FULL_HVV], 64 * vt, 0, tile);
                    fq_tma_load_3d(smem + SM::off_v + vt * FQ_TILE, &tm_v, &bar[RB_FULL_HVV], 64 * vt, j, row);
                }
            }
        } else if (tid >= 32 && tid < 96) {
            /* checker of KA and QO, warps 1..2 (HVV has warp 3: a late HVV never holds
             * the next chunk's KA and QO): each group final before its consumers see
             * it. Rows past the chunk's tokens (the next sequence's, or TMA's zeros) to
             * 0 in K, Q, dO: through P's, dVn's and W's structural zeros they would
             * reach this sequence's gradients. K's non-finite elements stay (causality,
             * as bwd_state90's: a NaN k_t reaches only token t and earlier ones, and dS
             * through the item's flag) */
            const int tk = tid - 32;
            for (int st = 0; st < nch; st++) {
                const int i = nch - 1 - st, s = st & 1;
                const int len = min(64, slen - 64 * i), row0 = bos + 64 * i;
                unsigned char *ka = smem + SM::off_ka + s * SM::KA;
                float *vec = (float *)(smem + SM::off_vec) + s * SM::vec_floats;
                /* KA: the vectors first (rk for K^), then K^ = diag(rk) K, A's padding */
                fq_mbar_wait(&bar[RB_FULL_KA + s], (st >> 1) & 1);
                FQ_TR(0);
                {
                    const int r = tk;
                    const bool ok = r < len;
                    const float gm = vec[SM::VG + r], gC = vec[SM::VG + 63];
                    const float rq = ok ? (a.rq ? a.rq[(int64_t)(row0 + r) * a.H + hq] : 1.f) : 0.f;
                    const float rk = ok ? (a.rk ? a.rk[(int64_t)(row0 + r) * a.H + hq] : 1.f) : 0.f;
                    const float be = ok ? fq_ld_f(a.beta, a.gdt, (int64_t)(row0 + r) * HV + j) : 0.f;
                    const float eg = ok ? __expf(gm) : 0.f;
                    vec[SM::VM + r] = ok ? __expf(gC - gm) : 0.f;
                    vec[SM::VQG + r] = a.scale * __expf(gm) * rq;
                    vec[SM::VPQ + r] = a.scale * rq;
                    vec[SM::VB + r] = be;
                    vec[SM::VBG + r] = be * eg;
                    vec[SM::VEG + r] = eg;
                    vec[SM::VRK + r] = rk;
                }
                fq_named_bar(3, 64); /* rk for every row */
                fq_rev_rows(ka, 2, len, a.rk ? vec + SM::VRK : (const float *)NULL, tk, 64);
                if (len < 64) /* A's padding rows / columns -> identity */
                    for (int idx = tk; idx < 64 * 64; idx += 64) {
                        const int r = idx >> 6, c = idx & 63;
                        if (r >= len || c >= len)
                            *(fq_bf16 *)(ka + 2 * FQ_TILE + fq_sw128(r, 2 * c)) = __float2bfloat16_rn(r == c ? 1.f : 0.f);
                    }
                fq_fence_async_smem();
                fq_mbar_arrive(&bar[RB_CHK_KA + s]);
                FQ_TR(1);
                /* QO */
                fq_mbar_wait(&bar[RB_FULL_QO], st & 1);
                FQ_TR(2);
                fq_rev_rows(smem + SM::off_q, 2, len, NULL, tk, 64);
                if (args.do_tma) {
                    fq_rev_rows(smem + SM::off_do, 2, len, NULL, tk, 64);
                } else {
                    /* dO (fp16, fp32, or bf16 not 16-byte aligned) -> bf16 pairs, SWIZZLE_128B */
                    for (int idx = tk; idx < 64 * 64; idx += 64) {
                        const int r = idx >> 6, v = 2 * (idx & 63);
                        float x = 0.f, y = 0.f;
                        if (r < len) {
                            const int64_t o = ((int64_t)(row0 + r) * HV + j) * V + v;
                            x = fq_ld_f(a.dout, a.dt, o);
                            y = fq_ld_f(a.dout, a.dt, o + 1);
                        }
                        *(uint32_t *)(smem + SM::off_do + (v >> 6) * FQ_TILE + fq_sw128(r, 2 * (v & 63))) = fq_pack_bf16(x, y);
                    }
                }
                if (len < 64 || !args.do_tma) fq_fence_async_smem(); /* (a full chunk by TMA: nothing written) */
                fq_mbar_arrive(&bar[RB_CHK_QO]);
                FQ_TR(3);
            }
        } else if (tid >= 96) {
            /* checker of HVV, warp 3: V's rows past len to 0 and its non-finite elements
             * to 0 (causality, as bwd_wy's) */
            const int tk = tid - 96;
            for (int st = 0; st < nch; st++) {
                const int i = nch - 1 - st, len = min(64, slen - 64 * i);
                fq_mbar_wait(&bar[RB_FULL_HVV], st & 1);
                FQ_TR(4);
                int wrote = len < 64;
                fq_rev_rows(smem + SM::off_v, 2, len, NULL, tk, 32);
                for (int idx = tk; idx < 2 * 64 * 8; idx += 32) {
                    uint4 *pp = (uint4 *)(smem + SM::off_v + (idx >> 9) * FQ_TILE + ((idx >> 3) & 63) * 128 + (idx & 7) * 16);
                    if (fq_bf16x8_nonfinite(*pp)) {
                        fq_zero_nonfinite8(pp);
                        wrote = 1;
                    }
                }
                if (wrote) fq_fence_async_smem(); /* (only a thread that wrote: rare but for partial chunks) */
                fq_mbar_arrive(&bar[RB_CHK_HVV]);
                FQ_TR(5);
            }
        }
    } else if (wg == 1) {
        /* ======================================================= chain S ==== */
        fq_setmaxnreg_inc<FQ_REV_REG_S>();
        const int tc = tid - 128, w = tc >> 5, lane = tc & 31, g = lane >> 2, t = lane & 3;
        /* dS^T: half mh, row v = 64 mh + 16 w + g + 8 (e >> 1), column kd = 8 nb + 2 t + (e & 1):
         * acc[mh][4 nb + e] */
        float acc[2][64];
        {
            const float *src = NULL;
            int64_t off = 0;
            int svk = 0;
            if (CP == FQ_BWD_CP_SEG && scount > 1) {
                src = args.c.ss;
                off = ((int64_t)cps * HV + j) * K * V;
            } else if (a.dht) {
                src = a.dht;
                off = ((int64_t)seq * HV + j) * K * V;
                svk = a.state_vk;
            }
#pragma unroll
            for (int mh = 0; mh < 2; mh++)
#pragma unroll
                for (int nb = 0; nb < 16; nb++)
#pragma unroll
                    for (int e = 0; e < 4; e++) {
                        const int v = 64 * mh + 16 * w + g + 8 * (e >> 1), kd = 8 * nb + 2 * t + (e & 1);
                        acc[mh][4 * nb + e] = src ? src[off + fq_state_at(kd, v, K, V, svk)] : 0.f;
                    }
        }
        unsigned char *sD = smem + SM::off_d;
        for (int st = 0; st < nch; st++) {
            const int s = st & 1;
            const unsigned char *ka = smem + SM::off_ka + s * SM::KA;
            const float *vec = (const float *)(smem + SM::off_vec) + s * SM::vec_floats;
            /* publish D' = bf16(dS'^T) [v][kd]: tall tile kd / 64, row v */
            if (st >= 1) fq_mbar_wait(&bar[RB_DEMPTY], (st - 1) & 1);
            FQ_TR(6);
#pragma unroll
            for (int mh = 0; mh < 2; mh++)
#pragma unroll
                for (int nb2 = 0; nb2 < 8; nb2++) {
                    const float *d8 = &acc[mh][8 * nb2];
                    fq_stsm_pairs(sD + (nb2 >> 2) * 2 * FQ_TILE + mh * FQ_TILE, w, (2 * nb2) & 7,
                                  fq_pack_bf16(d8[0], d8[1]), fq_pack_bf16(d8[2], d8[3]), fq_pack_bf16(d8[4], d8[5]),
                                  fq_pack_bf16(d8[6], d8[7]));
                }
            fq_fence_async_smem();
            fq_mbar_arrive(&bar[RB_DFULL]);
            FQ_TR(7);
            /* dS^T = e^{gamma_C} dS'^T + (dO^T diag(qg)) Q */
            fq_mbar_wait(&bar[RB_CHK_KA + s], (st >> 1) & 1);
            const float eC = __expf(vec[SM::VG + 63]);
#pragma unroll
            for (int mh = 0; mh < 2; mh++)
#pragma unroll
                for (int e = 0; e < 64; e++) acc[mh][e] *= eC;
            fq_mbar_wait(&bar[RB_CHK_QO], st & 1);
            const uint64_t dqm = fq_dmn(smem + SM::off_q);
#pragma unroll
            for (int mh = 0; mh < 2; mh++)
#pragma unroll
                for (int k2 = 0; k2 < 4; k2 += 2) { /* (two K-steps a group: 8 A registers in flight, not 16) */
                    uint32_t qa[2][4];
#pragma unroll
                    for (int kk = 0; kk < 2; kk++) {
                        fq_frag_a_mn(qa[kk], smem + SM::off_do + mh * FQ_TILE, k2 + kk, w, lane);
                        fq_frag_a_scale_k(qa[kk], vec + SM::VQG, k2 + kk, t);
                    }
                    fq_wgmma_fence();
#pragma unroll
                    for (int kk = 0; kk < 2; kk++)
                        fq_wgmma_rs_n128<1, 0>(acc[mh], qa[kk], fq_desc_at(dqm, 2048 * (k2 + kk)), 1);
                    fq_wgmma_commit();
                    fq_wgmma_wait<0>();
                    fq_reg_fence(acc[mh]);
                }
            fq_mbar_arrive(&bar[RB_EMPTY_QO]);
            FQ_TR(8);
            /* dS^T -= Z'^T K^ (Z' [c][v] and K^ [c][kd] both MN-major) */
            fq_mbar_wait(&bar[RB_ZFULL], st & 1);
            FQ_TR(9);
            const uint64_t dkn = fq_dmn(ka);
            fq_wgmma_fence();
#pragma unroll
            for (int mh = 0; mh < 2; mh++) {
                const uint64_t dz = fq_dmn(smem + SM::off_z + mh * FQ_TILE);
#pragma unroll
                for (int kk = 0; kk < 4; kk++)
                    fq_wgmma_ss_n128<1, 1, 1>(acc[mh], fq_desc_at(dz, 2048 * kk), fq_desc_at(dkn, 2048 * kk), 1);
            }
            fq_wgmma_commit();
            fq_wgmma_wait<0>();
            fq_reg_fence(acc[0]);
            fq_reg_fence(acc[1]);
            fq_mbar_arrive(&bar[RB_ZEMPTY]);
            FQ_TR(10);
            fq_mbar_arrive(&bar[RB_EMPTY_KA + s]);
        }
        /* dh0 at the sequence's first segment (NONE: its only one) */
        if (a.dh0 && sidx == 0) {
            const int64_t base = ((int64_t)seq * HV + j) * K * V;
#pragma unroll
            for (int mh = 0; mh < 2; mh++)
#pragma unroll
                for (int nb = 0; nb < 16; nb++)
#pragma unroll
                    for (int e = 0; e < 4; e++) {
                        const int v = 64 * mh + 16 * w + g + 8 * (e >> 1), kd = 8 * nb + 2 * t + (e & 1);
                        a.dh0[base + fq_state_at(kd, v, K, V, a.state_vk)] = acc[mh][4 * nb + e];
                    }
        }
    } else if (wg == 2) {
        /* ========================================================== V ==== */
        fq_setmaxnreg_dec<FQ_REV_REG_V>();
        const int tv = tid - 256, w = tv >> 5, lane = tv & 31, g = lane >> 2, t = lane & 3;
        unsigned char *sZ = smem + SM::off_z, *sDvn = smem + SM::off_dvn;
        float *vdb = slots + SM::VDB;
        for (int st = 0; st < nch; st++) {
            const int i = nch - 1 - st, s = st & 1;
            const int len = min(64, slen - 64 * i), row0 = bos + 64 * i, tile = (chunk0 + i) * HV + j;
            const unsigned char *ka = smem + SM::off_ka + s * SM::KA;
            const float *vec = (const float *)(smem + SM::off_vec) + s * SM::vec_floats;
            fq_mbar_wait(&bar[RB_CHK_KA + s], (st >> 1) & 1);
            fq_mbar_wait(&bar[RB_CHK_QO], st & 1);
            FQ_TR(11);
            /* P = lower_incl(Q K^^T ⊙ Gamma) diag(pq) (rows r: pq_r = scale rq_r), by selects */
            {
                float pacc[32];
                fq_wgmma_fence();
                fq_wgmma_ss_qk<K>(pacc, fq_dkm(smem + SM::off_q), fq_dkm(ka));
                fq_wgmma_commit();
                fq_wgmma_wait<0>();
                fq_reg_fence(pacc);
                float gr[2], pr[2];
#pragma unroll
                for (int h = 0; h < 2; h++) {
                    gr[h] = vec[SM::VG + 16 * w + g + 8 * h];
                    pr[h] = vec[SM::VPQ + 16 * w + g + 8 * h];
                }
#pragma unroll
                for (int nb = 0; nb < 8; nb++)
#pragma unroll
                    for (int e = 0; e < 4; e++) {
                        const int h = e >> 1, r = 16 * w + g + 8 * h, c = 8 * nb + 2 * t + (e & 1);
                        const float x = pacc[4 * nb + e] * pr[h] * __expf(gr[h] - vec[SM::VG + c]);
                        pacc[4 * nb + e] = c <= r ? x : 0.f;
                    }
                if (st >= 1) fq_mbar_wait(&bar[RB_ZEMPTY], (st - 1) & 1); /* S done with Z' (P's tile) */
#pragma unroll
                for (int kk = 0; kk < 4; kk++) {
                    uint32_t pf[4];
                    fq_acc_to_a(pf, &pacc[8 * kk], 1.f);
                    fq_stsm_pairs(sZ, w, 2 * kk, pf[0], pf[1], pf[2], pf[3]);
                }
                fq_fence_async_smem();
                fq_named_bar(1, 128);
                FQ_TR(12);
            }
            /* X^T = D' K^^T per half of v (D' [v][kd] and K^ [r][kd] K-major) */
            float x[2][32];
            fq_mbar_wait(&bar[RB_DFULL], st & 1);
            FQ_TR(13);
            {
                const uint64_t dk = fq_dkm(ka);
                fq_wgmma_fence();
#pragma unroll
                for (int mh = 0; mh < 2; mh++) {
                    const uint64_t dd = fq_dkm(smem + SM::off_d + mh * FQ_TILE);
#pragma unroll
                    for (int kk = 0; kk < 8; kk++)
                        fq_wgmma_ss_n64<0, 0>(x[mh], fq_desc_at(dd, (kk >> 2) * 2 * FQ_TILE + 32 * (kk & 3)),
                                              fq_desc_at(dk, fq_koff(kk)), kk > 0);
                }
                fq_wgmma_commit();
                fq_wgmma_wait<0>();
                fq_reg_fence(x[0]);
                fq_reg_fence(x[1]);
            }
            fq_mbar_arrive(&bar[RB_DEMPTY]);
            FQ_TR(14);
            /* dVn^T = X^T diag(m) + dO^T P (dO's non-finite elements 0: causality, as bwd_local's dv_local) */
#pragma unroll
            for (int nb = 0; nb < 8; nb++) {
                const float2 mm = *(const float2 *)(vec + SM::VM + 8 * nb + 2 * t);
#pragma unroll
                for (int mh = 0; mh < 2; mh++) {
                    x[mh][4 * nb] *= mm.x, x[mh][4 * nb + 1] *= mm.y;
                    x[mh][4 * nb + 2] *= mm.x, x[mh][4 * nb + 3] *= mm.y;
                }
            }
            {
                const uint64_t dpm = fq_dmn(sZ);
#pragma unroll
                for (int mh = 0; mh < 2; mh++) {
                    uint32_t za[4][4];
#pragma unroll
                    for (int kk = 0; kk < 4; kk++) {
                        fq_frag_a_mn(za[kk], smem + SM::off_do + mh * FQ_TILE, kk, w, lane);
#pragma unroll
                        for (int q = 0; q < 4; q++) za[kk][q] &= fq_bf16x2_finite_mask(za[kk][q]);
                    }
                    fq_wgmma_fence();
#pragma unroll
                    for (int kk = 0; kk < 4; kk++) fq_wgmma_rs_n64<1, 0>(x[mh], za[kk], fq_desc_at(dpm, 2048 * kk), 1);
                    fq_wgmma_commit();
                    fq_wgmma_wait<0>();
                    fq_reg_fence(x[mh]);
                }
            }
            fq_mbar_arrive(&bar[RB_EMPTY_QO]);
            /* dVn^T (bf16, raw) to its tiles [v][r]; Z from there (below); then W's copy: the
             * non-finite elements to 0 in place unless gamma_C is not finite (causality, as
             * bwd_wy's dVn; rare), the chain's Z raw */
            int bad = 0;
            if (st >= 1) fq_mbar_wait(&bar[RB_VEMPTY], (st - 1) & 1);
            FQ_TR(15);
#pragma unroll
            for (int mh = 0; mh < 2; mh++)
#pragma unroll
                for (int kk = 0; kk < 4; kk++) {
                    uint32_t y[4];
                    fq_acc_to_a(y, &x[mh][8 * kk], 1.f);
#pragma unroll
                    for (int q = 0; q < 4; q++) bad |= fq_bf16x2_finite_mask(y[q]) != 0xffffffffu;
                    fq_stsm_pairs(sDvn + mh * FQ_TILE, w, 2 * kk, y[0], y[1], y[2], y[3]);
                }
            fq_fence_async_smem();
            fq_named_bar(1, 128);
            /* Z = A^T dVn [c][v] (A [r][c] MN-major; dVn^T's two tiles, 128 rows v, as a
             * K-major B): row c = 16 w + g + 8 h, column v = 8 nb + 2 t + e */
            float z[64];
            const uint64_t dam = fq_dmn(ka + 2 * FQ_TILE), dvb = fq_dkm(sDvn);
            fq_wgmma_fence();
#pragma unroll
            for (int kk = 0; kk < 4; kk++)
                fq_wgmma_ss_n128<1, 0, 0>(z, fq_desc_at(dam, 2048 * kk), fq_desc_at(dvb, 32 * kk), kk > 0);
            fq_wgmma_commit();
            fq_wgmma_wait<0>();
            fq_reg_fence(z);
            const float gCv = vec[SM::VG + 63];
            const int zero_w = isfinite(gCv), fix = fq_rev_bar_or(1, 128, bad) && zero_w;
            if (fix) {
                for (int idx = tv; idx < 2 * 64 * 8; idx += 128)
                    fq_zero_nonfinite8((uint4 *)(sDvn + (idx >> 9) * FQ_TILE + ((idx >> 3) & 63) * 128 + (idx & 7) * 16));
                fq_fence_async_smem();
                fq_named_bar(1, 128);
            }
            fq_mbar_arrive(&bar[RB_VFULL]);
            FQ_TR(16);
            /* Z' = diag(bg) Z bf16 [c][v] (tiles by half of v) -> S (NaN where stage A
             * flagged the item: W's rows there are NaN, and so was its update) */
            const int pois = a.aflag[tile];
            const int c0 = 16 * w + g;
            {
                const float b0 = vec[SM::VBG + c0], b1 = vec[SM::VBG + c0 + 8];
#pragma unroll
                for (int nb2 = 0; nb2 < 8; nb2++) {
                    const float *d8 = &z[8 * nb2];
                    uint32_t y0 = fq_pack_bf16(d8[0] * b0, d8[1] * b0), y1 = fq_pack_bf16(d8[2] * b1, d8[3] * b1);
                    uint32_t y2 = fq_pack_bf16(d8[4] * b0, d8[5] * b0), y3 = fq_pack_bf16(d8[6] * b1, d8[7] * b1);
                    if (pois) y0 = y1 = y2 = y3 = 0x7fc07fc0u;
                    fq_stsm_pairs(sZ + (nb2 >> 2) * FQ_TILE, w, (2 * nb2) & 7, y0, y1, y2, y3);
                }
            }
            fq_fence_async_smem();
            fq_mbar_arrive(&bar[RB_ZFULL]);
            FQ_TR(17);
            /* dv = diag(beta) Z and V's part of dbeta, rowsum(Z ⊙ V), from the zeroed dVn
             * where that differs (rare: a non-finite dVn element and a finite gamma_C) */
            if (fix) {
                fq_wgmma_fence();
#pragma unroll
                for (int kk = 0; kk < 4; kk++)
                    fq_wgmma_ss_n128<1, 0, 0>(z, fq_desc_at(dam, 2048 * kk), fq_desc_at(dvb, 32 * kk), kk > 0);
                fq_wgmma_commit();
                fq_wgmma_wait<0>();
                fq_reg_fence(z);
            }
            fq_mbar_wait(&bar[RB_CHK_HVV], st & 1);
            float xv[2] = {0.f, 0.f};
            /* dbeta's V part: xv_c = sum_v Z[c][v] V[c][v] (V's row c: the 16-byte piece of
             * column block nb sits at piece nb ^ (c & 7) of its tile, SWIZZLE_128B) */
#pragma unroll
            for (int h = 0; h < 2; h++) {
                const int c = c0 + 8 * h;
                const uint32_t vrow = (fq_smem_u32(smem + SM::off_v) + c * 128 + 4 * t) ^ ((c & 7) << 4);
#pragma unroll
                for (int nb = 0; nb < 16; nb++) {
                    const float2 vv = fq_unpack_bf16(fq_lds_u32((vrow + (nb >> 3) * FQ_TILE) ^ ((nb & 7) << 4)));
                    xv[h] += z[4 * nb + 2 * h] * vv.x + z[4 * nb + 2 * h + 1] * vv.y;
                }
            }
            /* dv = diag(beta) Z: a row pointer each, the output type decided once (a branch
             * per element costs more than the stores: constant loads, reconvergence, code) */
            {
                const float b0 = vec[SM::VB + c0], b1 = vec[SM::VB + c0 + 8];
                const int64_t o0 = ((int64_t)(row0 + c0) * HV + j) * V + 2 * t, o1 = o0 + (int64_t)8 * HV * V;
                const bool ok0 = c0 < len, ok1 = c0 + 8 < len;
                if (a.dt == FQ_BF16) {
                    uint32_t *p0 = (uint32_t *)((fq_bf16 *)a.dv + o0), *p1 = (uint32_t *)((fq_bf16 *)a.dv + o1);
#pragma unroll
                    for (int nb = 0; nb < 16; nb++) {
                        if (ok0) p0[4 * nb] = fq_pack_bf16(b0 * z[4 * nb], b0 * z[4 * nb + 1]);
                        if (ok1) p1[4 * nb] = fq_pack_bf16(b1 * z[4 * nb + 2], b1 * z[4 * nb + 3]);
                    }
                } else {
                    for (int nb = 0; nb < 16; nb++) {
                        if (ok0) fq_st_f2(a.dv, a.dt, o0 + 8 * nb, b0 * z[4 * nb], b0 * z[4 * nb + 1]);
                        if (ok1) fq_st_f2(a.dv, a.dt, o1 + 8 * nb, b1 * z[4 * nb + 2], b1 * z[4 * nb + 3]);
                    }
                }
            }
            fq_mbar_arrive(&bar[RB_EMPTY_HVV]);
            const float xv0 = fq_quad_sum(xv[0]), xv1 = fq_quad_sum(xv[1]);
            if (st >= 1) fq_mbar_wait(&bar[RB_VREMPTY], (st - 1) & 1);
            if (t == 0) {
                vdb[c0] = xv0;
                vdb[c0 + 8] = xv1;
            }
            fq_mbar_arrive(&bar[RB_VRFULL]);
            FQ_TR(18);
            fq_mbar_arrive(&bar[RB_EMPTY_KA + s]);
        }
    } else {
        /* ========================================================== W ==== */
        fq_setmaxnreg_inc<FQ_REV_REG_W>();
        const int tw = tid - 384, w = tw >> 5, lane = tw & 31, g = lane >> 2, t = lane & 3;
        unsigned char *sVn = smem + SM::off_vn, *sDvn = smem + SM::off_dvn, *sDA = smem + SM::off_da;
        const unsigned char *sH = smem + SM::off_h, *sD = smem + SM::off_d, *sV = smem + SM::off_v;
        float *sdgp = slots + SM::SDGP, *scz = slots + SM::SCZ, *sdbp = slots + SM::SDBP, *sred = slots + SM::SRED;
        const float *vdb = slots + SM::VDB;
        for (int st = 0; st < nch; st++) {
            const int i = nch - 1 - st, s = st & 1;
            const int len = min(64, slen - 64 * i), row0 = bos + 64 * i;
            unsigned char *ka = smem + SM::off_ka + s * SM::KA;
            const unsigned char *sK = ka, *sA = ka + 2 * FQ_TILE;
            const float *vec = (const float *)(smem + SM::off_vec) + s * SM::vec_floats;
            fq_mbar_wait(&bar[RB_CHK_KA + s], (st >> 1) & 1);
            fq_mbar_wait(&bar[RB_FULL_HVV], st & 1); /* h, Vn: nobody checks them; V (checked) before dA */
            fq_mbar_wait(&bar[RB_DFULL], st & 1);
            FQ_TR(19);
            /* F1 = Vn D'^T = Vn dS'^T [r][kd] (Vn K-major; D' [v][kd] MN-major, N = kd over
             * the two tall tiles) */
            float F[64], dK[64];
            fq_wgmma_fence();
            {
                const uint64_t dvn = fq_dkm(sVn), dd = fq_desc_sw128(fq_smem_u32(sD), 2 * FQ_TILE, 1024);
#pragma unroll
                for (int kk = 0; kk < 8; kk++)
                    fq_wgmma_ss_n128<0, 1, 0>(F, fq_desc_at(dvn, fq_koff(kk)), fq_desc_at(dd, 2048 * kk), kk > 0);
            }
            fq_wgmma_commit();
            /* <S, dS'> = sum h[kd][v] D'[v][kd] (h [kd][v] by tall tiles of v, D' [v][kd] by tall
             * tiles of kd) meanwhile, by 8x8 blocks: warp w takes v in [32 w, 32 w + 32); ldmatrix
             * gives lane (g, t) D'[v0 + g][kd0 + 2t, +1], ldmatrix.trans of h's block h[kd0 + 2t,
             * +1][v0 + g]: the same (v, kd) pairs (two loads per 16 products) */
            float sdot = 0.f;
            {
                const int mi = lane >> 3, rl = lane & 7;
#pragma unroll 4
                for (int it = 0; it < 16; it++) {
                    const int vb = 4 * w + (it >> 2), kb = 4 * (it & 3) + mi;
                    uint32_t dr[4], hr[4];
                    fq_ldsm_x4(dr, fq_smem_u32(sD + (kb >> 3) * 2 * FQ_TILE + fq_sw128(8 * vb + rl, 16 * (kb & 7))));
                    fq_ldsm_x4_trans(hr, fq_smem_u32(sH + (vb >> 3) * 2 * FQ_TILE + fq_sw128(8 * kb + rl, 16 * (vb & 7))));
#pragma unroll
                    for (int q = 0; q < 4; q++) {
                        const float2 d = fq_unpack_bf16(dr[q]), hh = fq_unpack_bf16(hr[q]);
                        sdot += d.x * hh.x + d.y * hh.y;
                    }
                }
            }
            fq_wgmma_wait<0>();
            fq_reg_fence(F);
            fq_mbar_arrive(&bar[RB_DEMPTY]);
            FQ_TR(20);
            /* dK = diag(m) F1;  x = rowsum(F1 ⊙ K^): dgamma_r -= m_r x_r, sum m x -> dgamma_C */
            {
                float xr[2] = {0.f, 0.f};
#pragma unroll
                for (int nb = 0; nb < 16; nb++)
#pragma unroll
                    for (int h = 0; h < 2; h++) {
                        const int r = 16 * w + g + 8 * h, kd = 8 * nb + 2 * t;
                        const float2 kv = fq_unpack_bf16(*fq_tile_pair(ka + (kd >> 6) * FQ_TILE, r, kd & 63));
                        const float mr = vec[SM::VM + r];
                        const float f0 = F[4 * nb + 2 * h], f1 = F[4 * nb + 2 * h + 1];
                        dK[4 * nb + 2 * h] = mr * f0;
                        dK[4 * nb + 2 * h + 1] = mr * f1;
                        xr[h] += f0 * kv.x + f1 * kv.y;
                    }
                const float x0 = fq_quad_sum(xr[0]), x1 = fq_quad_sum(xr[1]);
                float mx = 0.f;
                const int r0 = 16 * w + g;
                if (t == 0) {
                    const float m0 = vec[SM::VM + r0], m1 = vec[SM::VM + r0 + 8];
                    sdgp[r0] = -m0 * x0;
                    sdgp[r0 + 8] = -m1 * x1;
                    sdbp[r0] = sdbp[r0 + 8] = 0.f;
                    mx = m0 * x0 + m1 * x1;
                }
                for (int o = 16; o > 0; o >>= 1) {
                    mx += __shfl_xor_sync(0xffffffffu, mx, o);
                    sdot += __shfl_xor_sync(0xffffffffu, sdot, o);
                }
                if (lane == 0) {
                    sred[w] = sdot;
                    sred[8 + w] = mx;
                }
            }
            /* dW = -dVn S^T [r][kd] (dVn^T [v][r] MN-major; h [kd][v] K-major, N = kd 128 rows) */
            fq_mbar_wait(&bar[RB_VFULL], st & 1);
            FQ_TR(21);
            fq_wgmma_fence();
            {
                const uint64_t dv = fq_dmn(sDvn), dh = fq_dkm(sH);
#pragma unroll
                for (int kk = 0; kk < 8; kk++)
                    fq_wgmma_ss_n128<1, 0, 1>(F, fq_desc_at(dv, (kk >> 2) * FQ_TILE + 2048 * (kk & 3)),
                                              fq_desc_at(dh, (kk >> 2) * 2 * FQ_TILE + 32 * (kk & 3)), kk > 0);
            }
            fq_wgmma_commit();
            fq_wgmma_wait<0>();
            fq_reg_fence(F);
            /* dW (bf16) over Vn [r][kd] (every warp's F1 read of Vn is complete: one wgmma) */
#pragma unroll
            for (int nb2 = 0; nb2 < 8; nb2++) {
                const float *d8 = &F[8 * nb2];
                fq_stsm_pairs(sVn + (nb2 >> 2) * FQ_TILE, w, (2 * nb2) & 7, fq_pack_bf16(d8[0], d8[1]),
                              fq_pack_bf16(d8[2], d8[3]), fq_pack_bf16(d8[4], d8[5]), fq_pack_bf16(d8[6], d8[7]));
            }
            fq_fence_async_smem();
            fq_named_bar(2, 128);
            /* F2 = A^T dW [s][kd]: dK += diag(bg) F2;  xw = rowsum(F2 ⊙ K^): dbeta += e^g xw,
             * dgamma += bg xw */
            fq_wgmma_fence();
            {
                const uint64_t da = fq_dmn(sA), dw = fq_dmn(sVn);
#pragma unroll
                for (int kk = 0; kk < 4; kk++)
                    fq_wgmma_ss_n128<1, 1, 0>(F, fq_desc_at(da, 2048 * kk), fq_desc_at(dw, 2048 * kk), kk > 0);
            }
            fq_wgmma_commit();
            fq_wgmma_wait<0>();
            fq_reg_fence(F);
            {
                float xw[2] = {0.f, 0.f};
#pragma unroll
                for (int nb = 0; nb < 16; nb++)
#pragma unroll
                    for (int h = 0; h < 2; h++) {
                        const int r = 16 * w + g + 8 * h, kd = 8 * nb + 2 * t;
                        const float2 kv = fq_unpack_bf16(*fq_tile_pair(ka + (kd >> 6) * FQ_TILE, r, kd & 63));
                        const float b = vec[SM::VBG + r];
                        const float f0 = F[4 * nb + 2 * h], f1 = F[4 * nb + 2 * h + 1];
                        dK[4 * nb + 2 * h] += b * f0;
                        dK[4 * nb + 2 * h + 1] += b * f1;
                        xw[h] += f0 * kv.x + f1 * kv.y;
                    }
                const float w0 = fq_quad_sum(xw[0]), w1 = fq_quad_sum(xw[1]);
                if (t == 0) {
                    const int r0 = 16 * w + g, r1 = r0 + 8;
                    sdbp[r0] += vec[SM::VEG + r0] * w0;
                    sdbp[r1] += vec[SM::VEG + r1] * w1;
                    sdgp[r0] += vec[SM::VBG + r0] * w0;
                    sdgp[r1] += vec[SM::VBG + r1] * w1;
                }
            }
            /* dA = dW K^T diag(bg) + dVn V^T diag(beta) -> dA^T [s][r] (bf16, non-finite -> 0) */
            {
                float d1[32], d2[32];
                fq_mbar_wait(&bar[RB_CHK_HVV], st & 1); /* V, checked */
                fq_wgmma_fence();
                {
                    const uint64_t dw = fq_dkm(sVn), dk = fq_dkm(sK), dv = fq_dmn(sDvn), dvv = fq_dkm(sV);
#pragma unroll
                    for (int kk = 0; kk < 8; kk++)
                        fq_wgmma_ss_n64<0, 0>(d1, fq_desc_at(dw, fq_koff(kk)), fq_desc_at(dk, fq_koff(kk)), kk > 0);
#pragma unroll
                    for (int kk = 0; kk < 8; kk++)
                        fq_wgmma_ss_n64<1, 0>(d2, fq_desc_at(dv, (kk >> 2) * FQ_TILE + 2048 * (kk & 3)),
                                              fq_desc_at(dvv, fq_koff(kk)), kk > 0);
                }
                fq_wgmma_commit();
                fq_wgmma_wait<0>();
                fq_reg_fence(d1);
                fq_reg_fence(d2);
                fq_mbar_arrive(&bar[RB_VEMPTY]);
                FQ_TR(22);
                fq_mbar_arrive(&bar[RB_EMPTY_HVV]); /* h, Vn / dW, V read */
                /* (stored transposed by stmatrix.trans: lane l addresses row sc = 8 nb + l % 8 of
                 * matrix l / 8 = (nb - nb0) * 2 + h, whose 8 columns are rows r = 16 w + 8 h ..) */
                const int lm = lane >> 3;
#pragma unroll
                for (int kk = 0; kk < 4; kk++) {
                    uint32_t pk[2][2];
#pragma unroll
                    for (int u = 0; u < 2; u++) {
                        const int nb = 2 * kk + u, sc = 8 * nb + 2 * t;
                        const float bg0 = vec[SM::VBG + sc], bg1 = vec[SM::VBG + sc + 1];
                        const float b0 = vec[SM::VB + sc], b1 = vec[SM::VB + sc + 1];
#pragma unroll
                        for (int h = 0; h < 2; h++) {
                            const float y0 = d1[4 * nb + 2 * h] * bg0 + d2[4 * nb + 2 * h] * b0;
                            const float y1 = d1[4 * nb + 2 * h + 1] * bg1 + d2[4 * nb + 2 * h + 1] * b1;
                            pk[u][h] = fq_pack_bf16(isfinite(y0) ? y0 : 0.f, isfinite(y1) ? y1 : 0.f);
                        }
                    }
                    const int srow = 8 * (2 * kk + (lm >> 1)) + (lane & 7);
                    fq_stsm_x4_t(fq_smem_u32(sDA + fq_sw128(srow, 16 * (2 * w + (lm & 1)))), pk[0][0], pk[0][1], pk[1][0], pk[1][1]);
                }
            }
            fq_fence_async_smem();
            fq_named_bar(2, 128);
            /* M1 = A^T dA (A MN-major, dA^T [s][s'] K-major); M2 = M1 A^T (M1 from registers,
             * A [s][s'] K-major); KK = K^ K^^T */
            {
                float m1[32], m2[32], kq[32];
                fq_wgmma_fence();
                {
                    const uint64_t da = fq_dmn(sA), dt = fq_dkm(sDA);
#pragma unroll
                    for (int kk = 0; kk < 4; kk++)
                        fq_wgmma_ss_n64<1, 0>(m1, fq_desc_at(da, 2048 * kk), fq_desc_at(dt, 32 * kk), kk > 0);
                }
                fq_wgmma_commit();
                fq_wgmma_ss_qk<K>(kq, fq_dkm(sK), fq_dkm(sK));
                fq_wgmma_commit();
                fq_wgmma_wait<1>();
                fq_reg_fence(m1);
                uint32_t m1a[4][4];
#pragma unroll
                for (int kk = 0; kk < 4; kk++) fq_acc_to_a(m1a[kk], &m1[8 * kk], 1.f);
                fq_wgmma_fence();
                {
                    const uint64_t dak = fq_dkm(sA);
#pragma unroll
                    for (int kk = 0; kk < 4; kk++) fq_wgmma_rs_n64<0, 0>(m2, m1a[kk], fq_desc_at(dak, 32 * kk), kk > 0);
                }
                fq_wgmma_commit();
                fq_wgmma_wait<0>();
                fq_reg_fence(m2);
                fq_reg_fence(kq);
                /* dL = -strict_lower(M2);  y = dL ⊙ KK ⊙ Gamma: dbeta += rowsum(y);  z = diag(beta) y:
                 * dgamma += rowsum(z) - colsum(z);  Gl = diag(beta) dL ⊙ Gamma -> over dA^T */
                float ry[2] = {0.f, 0.f}, rz[2] = {0.f, 0.f}, cz[8][2];
                uint32_t gp[8][2];
#pragma unroll
                for (int nb = 0; nb < 8; nb++) {
                    cz[nb][0] = cz[nb][1] = 0.f;
#pragma unroll
                    for (int h = 0; h < 2; h++) {
                        const int r = 16 * w + g + 8 * h;
                        const float br = vec[SM::VB + r], gmr = vec[SM::VG + r];
                        float gv[2];
#pragma unroll
                        for (int e2 = 0; e2 < 2; e2++) {
                            const int sc = 8 * nb + 2 * t + e2;
                            gv[e2] = 0.f;
                            if (r > sc) {
                                const float Gm = __expf(gmr - vec[SM::VG + sc]);
                                const float dL = -m2[4 * nb + 2 * h + e2];
                                const float y = dL * kq[4 * nb + 2 * h + e2] * Gm;
                                const float zz = br * y;
                                ry[h] += y;
                                rz[h] += zz;
                                cz[nb][e2] += zz;
                                gv[e2] = br * dL * Gm;
                            }
                        }
                        gp[nb][h] = fq_pack_bf16(gv[0], gv[1]);
                    }
                }
#pragma unroll
                for (int kk = 0; kk < 4; kk++) fq_stsm_pairs(sDA, w, 2 * kk, gp[2 * kk][0], gp[2 * kk][1], gp[2 * kk + 1][0], gp[2 * kk + 1][1]);
#pragma unroll
                for (int h = 0; h < 2; h++) {
                    const float y = fq_quad_sum(ry[h]), zz = fq_quad_sum(rz[h]);
                    if (t == 0) {
                        sdbp[16 * w + g + 8 * h] += y;
                        sdgp[16 * w + g + 8 * h] += zz;
                    }
                }
#pragma unroll
                for (int nb = 0; nb < 8; nb++)
#pragma unroll
                    for (int e2 = 0; e2 < 2; e2++) {
                        float zz = cz[nb][e2];
                        zz += __shfl_xor_sync(0xffffffffu, zz, 4);
                        zz += __shfl_xor_sync(0xffffffffu, zz, 8);
                        zz += __shfl_xor_sync(0xffffffffu, zz, 16);
                        if (g == 0) scz[64 * w + 8 * nb + 2 * t + e2] = zz;
                    }
            }
            fq_fence_async_smem();
            fq_named_bar(2, 128);
            FQ_TR(23);
            /* dK += Gl K^ + Gl^T K^ (Gl [r][s] K-major, then MN-major; K^ MN-major) */
            fq_wgmma_fence();
            {
                const uint64_t gk = fq_dkm(sDA), gm = fq_dmn(sDA), dkn = fq_dmn(sK);
#pragma unroll
                for (int kk = 0; kk < 4; kk++)
                    fq_wgmma_ss_n128<0, 1, 0>(dK, fq_desc_at(gk, 32 * kk), fq_desc_at(dkn, 2048 * kk), 1);
#pragma unroll
                for (int kk = 0; kk < 4; kk++)
                    fq_wgmma_ss_n128<1, 1, 0>(dK, fq_desc_at(gm, 2048 * kk), fq_desc_at(dkn, 2048 * kk), 1);
            }
            fq_wgmma_commit();
            /* dg = reverse cumsum of dgamma, dbeta (warp 0) meanwhile; V's dbeta slots summed
             * into sdbp's second half first */
            fq_mbar_wait(&bar[RB_VRFULL], st & 1);
            FQ_TR(24);
            if (w == 0) {
                for (int r = lane; r < 64; r += 32) sdbp[64 + r] = vdb[r];
                __syncwarp();
                fq_bwd_dg_dbeta(a, (const float *)NULL, sdgp, scz, sdbp, sred, vec[SM::VG + 63], len, row0, j, lane,
                                a.dgam + (int64_t)((chunk0 + i) * HV + j) * 64);
            }
            fq_named_bar(2, 128); /* the slots read before the next chunk writes them */
            fq_mbar_arrive(&bar[RB_VREMPTY]);
            fq_wgmma_wait<0>();
            fq_reg_fence(dK);
            fq_mbar_arrive(&bar[RB_EMPTY_KA + s]);
            FQ_TR(25);
            /* dK (w.r.t. K^, this value head) -> a.dkw [rows][HV][K] bf16 (the group's partial
             * sums, FlashQLA's choice too: one rounding per value head, under the 1e-2 budget;
             * half the bytes of fp32), a row pointer each */
#pragma unroll
            for (int h = 0; h < 2; h++) {
                const int r = 16 * w + g + 8 * h;
                uint32_t *pr = (uint32_t *)(a.dkw + ((int64_t)(row0 + r) * HV + j) * K + 2 * t);
                if (r < len) {
#pragma unroll
                    for (int nb = 0; nb < 16; nb++) pr[4 * nb] = fq_pack_bf16(dK[4 * nb + 2 * h], dK[4 * nb + 2 * h + 1]);
                }
            }
        }
    }
#endif
}

/* ------------------------------------------------------------- host ---- */

template <int CP>
static fq_status fq_bwd_rev90_pass(const CUtensorMap (&m)[7], const fq_rev_args &args, int64_t units,
                                   cudaStream_t stream)
{
    const int64_t blocks = units * args.a.HV;
    if (blocks <= 0) return FQ_OK;
    const void *fn = (const void *)fq_bwd_rev90_kernel<CP>;
    fq_status st = fq_cuda_set_smem(fn, fq_rev_smem::bytes);
    if (st != FQ_OK) return st;
    return fq_launch_k(fq_bwd_rev90_kernel<CP>, (unsigned)blocks, 512, fq_rev_smem::bytes, stream, 0, m[0], m[1], m[2],
                       m[3], m[4], m[5], m[6], args);
}

fq_status fq_bwd_rev90_launch(const fq_gdn_params *p, const fq_bwd_args &a, const fq_fwd_ws *segws, int64_t nc,
                              cudaStream_t stream)
{
    if (p->N <= 0) return FQ_OK;
    if (p->K != 128 || p->V != 128)
        return fq_fail(FQ_ERR_INTERNAL, "fq_bwd_rev90_launch: K = V = 128 only (got %d, %d)", (int)p->K, (int)p->V);
    const uint64_t K = 128, V = 128, HV = (uint64_t)p->HV;
    const uint64_t rows = p->B * p->T > 0 ? (uint64_t)(p->B * p->T) : 1;
    const uint64_t tiles = nc * p->HV > 0 ? (uint64_t)(nc * p->HV) : 1;
    /* q, k, A, dO (fq_bwd_tmaps_qkado); h [tiles][K][V] (64 columns x K rows: one tall
     * tile); Vn [tiles][64][V]; V [rows][HV][V] (64 columns x 64 rows) */
    const uint64_t dvv[3] = {V, HV, rows}, svv[2] = {V * 2, HV * V * 2};
    const uint64_t dh[3] = {V, K, tiles}, sh[2] = {V * 2, K * V * 2};
    const uint64_t dvn[3] = {V, 64, tiles}, svn[2] = {V * 2, 64 * V * 2};
    const uint32_t brow[3] = {64, 1, 64}, btile[3] = {64, 64, 1}, bh[3] = {64, (uint32_t)K, 1};
    CUtensorMap m[7];
    fq_status st = fq_bwd_tmaps_qkado(p, a, nc, m);
    if (st != FQ_OK) return st;
    if ((st = fq_tmap(&m[4], a.h, 3, dh, sh, bh)) != FQ_OK) return st;
    if ((st = fq_tmap(&m[5], a.vn, 3, dvn, svn, btile)) != FQ_OK) return st;
    if ((st = fq_tmap(&m[6], a.vb, 3, dvv, svv, brow)) != FQ_OK) return st;
    fq_rev_args args;
    memset(&args, 0, sizeof args);
    args.a = a;
    args.do_tma = a.dout_async;
    if (!segws) {
        st = fq_bwd_rev90_pass<FQ_BWD_CP_NONE>(m, args, p->N, stream);
    } else {
        /* context parallelism: bwd_state90's MAP pass and the reverse combine (E_s),
         * then every segment from its E_s */
        if ((st = fq_bwd_state90_map(p, a, segws, nc, stream)) != FQ_OK) return st;
        args.c.segs = segws->segs;
        args.c.md = segws->md;
        args.c.ss = segws->ss;
        st = fq_bwd_rev90_pass<FQ_BWD_CP_SEG>(m, args, segws->seg_bound, stream);
    }
    return st;
}

#ifdef FQ_REV_TRACE
/* (dev) the trace of the last run: t[c][slot], clock64 values, 0 where not recorded */
extern "C" cudaError_t fq_rev_trace_copy(long long t[8][32])
{
    return cudaMemcpyFromSymbol(t, fq_rev_tr, 8 * 32 * sizeof(long long));
}
#endif
