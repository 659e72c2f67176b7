/*
 * gdn_cuda_bwd.cu — the CUDA chunked backward (DESIGN §2, C = 64), the entry
 * points fq_cuda_chunk_bwd and fq_cuda_chunk_bwd_workspace_bytes of gdn.h.
 *
 * Everything is recomputed from the inputs. In algorithm order:
 *
 *   0. fq_cuda_fwd_prepare   chunk table, bf16 q/k/v, inverse norms rq, rk
 *   1. stage A: gamma, kdecay, A = (I+L)^-1 (kept for step 5), W (and U for
 *      the three-stage state pass): fq_cuda_fwd_wy_recompute (the persistent
 *      kernel) before step 2; where bwd_state90 runs after the fused kernel's
 *      step 2 (given_a), that kernel's own stage A (fq_cuda_fwd_inverse,
 *      tensor cores) writes gamma, kdecay and A and lists the items holding a
 *      non-finite input, and after step 2 fq_cuda_fwd_wy_given forms those
 *      items again by the backward's rules; W is never formed there
 *   2. chunk-start states h (bf16) and Vn = U - W h: where the fused forward
 *      runs (sm_90a, K and V in {64, 128}), its kernel in mode HST
 *      (fq_cuda_fwd_fused_states: stage A's A'' and gate record, the segment
 *      table, the exact context parallelism of long sequences, the chain as
 *      in the forward, h and Vn stored instead of o; its workspace inside
 *      dsl's, which is dead until step 3); elsewhere the three-stage state
 *      pass fq_cuda_fwd_state
 *      (1, 2 are the forward's stage launchers, gdn_cuda_common.cuh)
 *   3. bwd_local   per (chunk, value head). Forward lines:
 *          O  = scale (diag(e^g) Q S + P Vn),   P = lower_incl(Q K^T ⊙ Gamma)
 *        so  dv_local = scale P^T dO
 *            dP       = scale (dO Vn^T) ⊙ Gamma            (lower incl.)
 *            dQ       = scale diag(e^g) dO S^T + dP K
 *            dK_O     = dP^T Q
 *            dgamma   = rowsum(scale diag(e^g) dO S^T ⊙ Q) + rowsum(Z) - colsum(Z),
 *                       Z = dP ⊙ (Q K^T)
 *            dS_local = scale (diag(e^g) Q)^T dO          (K x V, for step 4)
 *   4. bwd_state   per (sequence, value head, state columns), sequential
 *      over chunks from last to first, dS (fp32) from dht:
 *          forward:  Vn = U - W S;  S' = e^{g_C} S + K^T diag(e^{g_C - g}) Vn
 *          dS_next[c] = dS   (stored bf16)
 *          dVn      = dv_local + diag(e^{g_C - g}) K dS                (stored bf16)
 *          dS       = e^{g_C} dS + dS_local - W^T dVn
 *      ending in dh0. Where the forward would split a sequence into
 *      segments (fq_bwd_nseg_max > 1: few heads; K <= 128), the pass
 *      runs per segment from each segment's end dS, chained exactly by each
 *      segment's affine map dS_start = M dS_end + D (a MAP pass and the
 *      reverse combine first; gdn_cuda_bwd_state.cu).
 *   5. bwd_wy      per (chunk, value head):
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
 *   6. dq, dk = sum over the GVA group of the per-value-head parts, then the
 *      L2-norm backward
 *          q_hat = q r, r = (|q|^2 + 1e-6)^-1/2:  dq = r (dq_hat - q_hat (q_hat . dq_hat))
 *
 * The kernels (the backward measured on the H200):
 *   3 + 6 for dq: bwd_local (gdn_cuda_bwd_fused.cu), one block per chunk and
 *     q/k head looping over the GVA group, products in registers, dq finished
 *     in the block, dK_O summed over the group; the chunk-start state h is
 *     loaded as a second cp.async group;
 *   4: bwd_state (gdn_cuda_bwd_state.cu), dS^T in registers as the mma A
 *     operand, 16 state columns per warp or warp pair, columns per block and
 *     K-split picked by the number of chains vs SMs (the environment variable
 *     FLASHQLA_CUDA_BWD_STATE=BV:KS, e.g. 32:1, forces one configuration, for
 *     timing the alternatives); at K = V = 128 on sm_90a bwd_state90
 *     (gdn_cuda_bwd_state_sm90.cu): the same pass warp-specialised (TMA loads,
 *     dS^T as wgmma accumulators of one warpgroup per 64 columns) with step 3's
 *     dv_local and dS_local formed on chip, so bwd_local there forms neither;
 *   5 + 6 for dk: bwd_wy (gdn_cuda_bwd_fused.cu), the same scheme as
 *     bwd_local, dk finished in the block; at K = V = 128 on sm_90a the same
 *     block with wgmma products (gdn_cuda_bwd_fused_sm90.cu, as bwd_local there),
 *     where bwd_state90's chains leave SMs free (fq_bwd_wy_beside) launched at once
 *     with it, each block waiting for the flags of its chunk that the chains set;
 *   4 + 5 where fq_bwd_rev_path (K = V = 128 on sm_90a, sequences x value heads
 *     filling enough of a wave): bwd_rev90 (gdn_cuda_bwd_reverse_sm90.cu), the
 *     chain and bwd_wy's products in one warp-specialised CTA per (sequence or
 *     segment, value head): dv, dbeta, its dgamma terms (dgam) and dK per value
 *     head (bf16, dkw); dS_next and dVn never leave the chip. Then 3 + 6:
 *     bwd_local90 runs after it and finishes dq, dk (dK_O + the group's dkw,
 *     the L2-norm backward) and dg (its dgamma + bwd_rev90's, reverse cumsum).
 * Versions 1-5 (unfused kernels, a separate dq/dk reduction, earlier reverse
 * state passes) were removed once superseded: see benchmarks/NOTES.md and git
 * history (commit 4599409).
 *
 * The formulas are checked in float64 against autograd through the
 * token-by-token recurrence by dev/cuda/derive_bwd_check.py (same stage names).
 * Tensor-core operands are bf16 (mma.sync m16n8k16), accumulation fp32.
 */
#include "gdn_cuda_bwd.cuh"

#include <stdlib.h> /* getenv */
#include <string.h>

/* ========================================================= host side ==== */

typedef struct fq_bwd_ws {
    fq_fwd_ws f;
    fq_bf16 *a;    /* [nc, HV, 64, 64] */
    fq_bf16 *dsl;  /* [nc, HV, K, V]; before step 3 the fused recompute's own workspace */
    float *dgam;   /* [nc, HV, 64]     */
    float *dkp;    /* [B*T, H, K]: bwd_local's dK_O summed over the GVA group (given_a: in W's place when it fits) */
    fq_bf16 *dkw;  /* [B*T, HV, K] bf16: bwd_rev90's dK per value head (in U's place), else NULL */
    int *aflag;    /* [nc, HV] stage A's flags (gdn_cuda_fwd_wy.cu), bwd_state90's W poison; then
                      the count and the list of the flagged items ([1 + nc HV]) */
    int *bready;   /* [nc, HV, 2] bwd_state90's per-chunk flags for bwd_wy90 beside it (not on
                      bwd_rev90's path) */
    /* the reverse pass's context parallelism (nseg_max > 1 and K <= 128; else NULL):
     * seg.segs [seg_bound], seg.md [cp_bound, HV, K, K + V], seg.ss [cp_bound, HV, K, V] */
    fq_fwd_ws seg;
} fq_bwd_ws;

static size_t fq_bwd_align(size_t x) { return (x + 255) & ~(size_t)255; }

/* 1: the reverse pass is bwd_rev90 (gdn_cuda_bwd_reverse_sm90.cu: the chain and
 * bwd_wy's products in one kernel), else bwd_state90 + bwd_wy90; only where
 * fq_bwd_sm90_path. bwd_rev90 runs one CTA per (sequence, value head), its chunk a
 * serial step of ~11.4 us (H100), for whole waves of FQ_CP_SMS CTAs; the two-kernel
 * form's chain is cheaper per chunk (~4.9 us) but its bwd_wy90 grid costs per
 * (chunk, value head), and more so the fewer value heads there are. Measured side by
 * side on the H100 (dev/cuda/time_bwd_dispatch.py, 4096-token sequences, the whole
 * backward; benchmarks/NOTES.md session 23), with fill = N HV / (waves x FQ_CP_SMS):
 *   HV = 32: fill 0.48 old 0.89 / rev 1.12 ms, 0.73 1.37 / 1.35, 0.97 1.71 / 1.56,
 *            two waves at 0.61 2.18 / 2.39, at 0.97 3.34 / 3.02
 *   HV = 16: 0.48 1.36 / 1.38, 0.73 2.04 / 1.72, 0.97 2.66 / 2.07, two at 0.73 3.91 / 3.29
 *   HV = 8:  0.36 1.20 / 1.28, 0.55 1.74 / 1.56, 0.73 2.28 / 1.82, two at 0.61 3.72 / 3.15
 *   HV = 4:  0.48 1.72 / 1.46, 0.73 2.51 / 1.83, 1.00 3.39 / 2.26
 * so bwd_rev90 where fill >= 0.83 at HV >= 32, 0.6 at 16 <= HV < 32, 0.45 below, and
 * never with context parallelism (N HV <= 44 splits the chains: 16/32 1 x 32768 3.84
 * against 3.75, 2/4 1 x 32768 0.92 against 0.77).
 * FLASHQLA_CUDA_BWD_REVERSE=1 / 0 (read once) forces one or the other, for tests and
 * timing. */
static int fq_bwd_rev_path(const fq_gdn_params *p)
{
    static int env = -2;
    if (env == -2) {
        const char *e = getenv("FLASHQLA_CUDA_BWD_REVERSE");
        env = e && (e[0] == '0' || e[0] == '1') && e[1] == 0 ? e[0] - '0' : -1;
    }
    if (env == 0 || !fq_bwd_sm90_path(p)) return 0;
    if (env == 1) return 1;
    const int64_t units = p->N * p->HV, waves = (units + FQ_CP_SMS - 1) / FQ_CP_SMS;
    if (3 * units <= FQ_CP_SMS) return 0; /* (fq_bwd_nseg_max would split the chains) */
    /* fill >= 0.83 / 0.6 / 0.45 of the waves, in integers: units * 100 >= thr * waves * SMs */
    const int64_t thr = p->HV >= 32 ? 83 : p->HV >= 16 ? 60 : 45;
    return units * 100 >= thr * waves * FQ_CP_SMS;
}

/* Segments per sequence at most for the reverse pass's context parallelism.
 * bwd_rev90: one CTA per (segment, value head), so the N HV chains are split
 * until about FQ_CP_SMS CTAs run (from N, HV only; none where N HV already
 * fills half the SMs). Else from (HV, K, V) only: the MAP pass (bwd_state,
 * (P - 1) HV (K + V)/64 blocks at 64 columns, one per SM) within one wave of
 * FQ_CP_SMS SMs. Fewer than three: none (two would gain nothing). */
static int fq_bwd_nseg_max(const fq_gdn_params *p)
{
    int64_t n;
    if (fq_bwd_rev_path(p)) { /* (K = V = 128: fq_bwd_sm90_path) */
        const int64_t units = p->N * p->HV;
        if (units <= 0 || units >= FQ_CP_SMS / 2) return 1;
        n = FQ_CP_SMS / units;
    } else {
        const int64_t map = p->HV * ((p->K + p->V) / 64);
        if (map <= 0) return 1;
        n = 1 + FQ_CP_SMS / map;
    }
    if (n > 16) n = 16;
    return n < 3 ? 1 : (int)n;
}

/* 1: the recompute's state pass is the fused kernel's HST mode (where the
 * fused forward runs); 0: the three-stage state pass. FLASHQLA_CUDA_BWD_RECOMPUTE=0
 * or 1 (read once) forces one, for timing the two (dev/cuda/check_bwd.cu). */
static int fq_bwd_fused_recompute(const fq_gdn_params *p)
{
    static int env = -2;
    if (env == -2) {
        const char *e = getenv("FLASHQLA_CUDA_BWD_RECOMPUTE");
        env = e && (e[0] == '0' || e[0] == '1') && e[1] == 0 ? e[0] - '0' : -1;
    }
    if (!fq_cuda_fwd_fused_available(p)) return 0;
    return env >= 0 ? env : 1;
}

/* given_a: the fused recompute's stage A provides A, and W is never formed:
 * only where bwd_state90 runs (K = V = 128 on sm_90a), the one reverse pass
 * that multiplies by A and K instead of reading W (items: the list of flagged
 * items holds int). The workspace layout and the run ask the same question. */
static int fq_bwd_given_a(const fq_gdn_params *p, int64_t items)
{
    return fq_bwd_fused_recompute(p) && fq_bwd_sm90_path(p) && items < INT32_MAX / 2;
}

static size_t fq_bwd_ws_layout(const fq_gdn_params *p, void *base_, fq_bwd_ws *ws)
{
    fq_bwd_ws tmp;
    if (!ws) ws = &tmp;
    memset(ws, 0, sizeof *ws);
    /* bwd_rev90's path with given_a (lean): nothing reads or writes W (A replaces it,
     * dK_O is summed by bwd_local90 itself) or U (the fused recompute's chain forms Vn
     * itself, its stage A forms no U, bwd_rev90 stores no dVn): the forward's layout
     * without either */
    const int rev = fq_bwd_rev_path(p);
    fq_fwd_ws probe;
    fq_cuda_fwd_ws_layout(p, NULL, &probe); /* (nc_max) */
    const int lean = rev && fq_bwd_given_a(p, probe.nc_max * p->HV);
    size_t off = fq_cuda_fwd_ws_layout_omit(p, base_, &ws->f, lean ? FQ_FWS_OMIT_W | FQ_FWS_OMIT_U : 0);
    char *base = (char *)base_;
    const int64_t nc = ws->f.nc_max, HV = p->HV, K = p->K, V = p->V, BT = p->B * p->T;
#define FQ_CARVE(ptr, type, bytes)                                         \
    do {                                                                   \
        ptr = base ? (type)(base + off) : (type)NULL;                      \
        off += fq_bwd_align((size_t)(bytes));                              \
    } while (0)
    FQ_CARVE(ws->a, fq_bf16 *, nc * HV * 64 * 64 * 2);
    /* dsl: sized for all of its lives, whether or not the fused kernel runs here: the
     * fused recompute's part (step 2), then dS_next (bwd_state90's path) or, lean,
     * bwd_rev90's dK per value head ([B*T, HV, K] bf16, written after step 2) */
    const size_t dkw_bytes = (size_t)(BT * HV * K * 2);
    size_t dsl_bytes = rev ? (lean ? dkw_bytes : 0) : (size_t)(nc * HV * K * V * 2);
    const size_t fused_bytes = fq_cuda_fwd_fused_extras_layout(p, NULL, NULL);
    FQ_CARVE(ws->dsl, fq_bf16 *, dsl_bytes > fused_bytes ? dsl_bytes : fused_bytes);
    /* bwd_rev90's dK per value head: lean in dsl's place; else in U's (U [nc, HV, 64, V]
     * bf16 is dead after step 2 and dvl is bwd_state90's alone; K = V there and 64 nc >= B*T) */
    ws->dkw = NULL;
    if (lean) {
        ws->dkw = ws->dsl;
    } else if (rev) {
        const size_t u_bytes = (size_t)(nc * HV * 64 * V * 2);
        if (u_bytes >= dkw_bytes) {
            ws->dkw = ws->f.u; /* (the three-stage recompute still forms U there first) */
        } else {
            FQ_CARVE(ws->dkw, fq_bf16 *, dkw_bytes);
        }
    }
    FQ_CARVE(ws->dgam, float *, nc * HV * 64 * 4);
    /* dK_O's buffer (bwd_state90 + bwd_wy90's path only): where W is never formed
     * (given_a), in W's place when that is large enough (W is [nc, HV, 64, K] bf16,
     * dK_O [B*T, H, K] fp32: at HV >= 2 H) */
    const size_t w_bytes = (size_t)(nc * HV * 64 * K * 2), dkp_bytes = (size_t)(BT * p->H * K * 4);
    if (rev) {
        ws->dkp = NULL;
    } else if (fq_bwd_given_a(p, nc * HV) && w_bytes >= dkp_bytes) {
        ws->dkp = (float *)ws->f.w;
        ws->f.w = NULL;
    } else {
        FQ_CARVE(ws->dkp, float *, dkp_bytes);
    }
    FQ_CARVE(ws->aflag, int *, (2 * nc * HV + 1) * 4);
    if (!rev) FQ_CARVE(ws->bready, int *, 2 * nc * HV * 4);
    ws->seg = ws->f; /* (its chunk and sequence tables; segs, md, ss, ready NULL as in f) */
    ws->seg.nseg_max = K <= 128 ? fq_bwd_nseg_max(p) : 1;
    ws->seg.seg_bound = fq_cuda_fwd_seg_bound(p, nc, ws->seg.nseg_max);
    ws->seg.cp_bound = fq_cuda_fwd_cp_bound(p, nc, ws->seg.nseg_max);
    if (ws->seg.nseg_max > 1) {
        const int64_t sb = ws->seg.seg_bound;
        FQ_CARVE(ws->seg.segs, fq_seg_info *, (sb > 0 ? sb : 1) * (int64_t)sizeof(fq_seg_info));
        FQ_CARVE(ws->seg.md, float *, ws->seg.cp_bound * HV * K * (K + V) * 4);
        FQ_CARVE(ws->seg.ss, float *, ws->seg.cp_bound * HV * K * V * 4);
    }
#undef FQ_CARVE
    ws->f.a = ws->a;
    return off;
}

extern "C" size_t fq_cuda_chunk_bwd_workspace_bytes(const fq_gdn_params *p)
{
    return fq_cuda_gates_ws_bytes(p, 'b') + fq_bwd_ws_layout(p, NULL, NULL);
}

/* 1: the reverse state pass with context parallelism where the sizes allow it
 * (ws->seg laid out: nseg_max > 1, K <= 128). FLASHQLA_CUDA_BWD_CP=0 (read
 * once) turns it off, for timing. */
static int fq_bwd_cp(const fq_bwd_ws *ws)
{
    static int env = -2;
    if (env == -2) {
        const char *e = getenv("FLASHQLA_CUDA_BWD_CP");
        env = e && e[0] == '0' && e[1] == 0 ? 0 : 1;
    }
    return env && ws->seg.segs != NULL;
}

/* 1: bwd_wy90 runs beside bwd_state90's last pass (the chains with context parallelism
 * or without), on the SMs the chains leave free, each block waiting per value head for
 * the flags of its chunk (fq_bwd_wy_wait) that the chains set as they store them, the
 * blocks ordered as the chains finish chunks (fq_bwd_wy_order). Where that pass has few
 * CTAs (one per SM: single long sequences, few heads; 64 of 132 SMs at 16/32 1 x 32768,
 * 80 at 4/8 with 5 segments) bwd_wy90's grid otherwise waits for the whole chain.
 * Only where at least 16 SMs stay free, programmatic dependent launch is on, and the
 * grid's sizes fit. FLASHQLA_CUDA_BWD_BESIDE=0 (read once) turns it off, for timing. */
static int fq_bwd_wy_beside(const fq_gdn_params *p, const fq_bwd_ws *ws, int cp, int rev, fq_bwd_args *a)
{
    static int env = -2;
    if (env == -2) {
        const char *e = getenv("FLASHQLA_CUDA_BWD_BESIDE");
        env = e && e[0] == '0' && e[1] == 0 ? 0 : 1;
    }
    if (!env || rev || !ws->bready || !fq_bwd_sm90_path(p) || !fq_cuda_pdl_enabled()) return 0;
    int dev = 0, sms = 0;
    if (cudaGetDevice(&dev) != cudaSuccess ||
        cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess) {
        cudaGetLastError();
        return 0;
    }
    const int64_t ctas = (cp ? ws->seg.seg_bound : p->N) * p->HV * (p->V / 64);
    if (ctas > sms - 16) return 0;
    /* the order (fq_bwd_wy_order): every sequence's chunks split as fq_fwd_segments_kernel
     * splits them (no cp_fit in the backward's table), else the last chunk first */
    const int64_t nch = (p->T + 63) / 64;
    if (nch > 65535) return 0;
    int S = 1, L = (int)nch;
    int64_t rows = ws->f.nc_max;
    if (!p->cu_seqlens) {
        if (cp) S = fq_cp_split((int)nch, (int)(nch / FQ_CP_MIN_CHUNKS < ws->seg.nseg_max ? nch / FQ_CP_MIN_CHUNKS
                                                                                           : ws->seg.nseg_max), &L);
        rows = p->N * S * L;
    }
    if (p->H > 65535 || rows > 65535 || rows <= 0) return 0;
    a->bseqch = p->cu_seqlens ? 0 : (int)nch;
    a->bnseq = (int)p->N;
    a->bnseg = S;
    a->bsegch = L;
    return 1;
}

/* The whole backward on the current device. ev (NULL in the library): seven
 * events, for dev/cuda/check_bwd.cu: ev[0..4] after steps 2, 3, 4, 5 and 6
 * (ev[3] == ev[4]: step 6 runs inside 3 and 5); ev[5] after the prepare
 * (+ stage A v3 before the three-stage state pass), ev[6] after the fused
 * stage A of step 2 (== ev[5] with the three-stage state pass); ev[0] then
 * includes fq_cuda_fwd_wy_given. (Events between the launches serialize stage A
 * and the state pass where they would run beside each other.) */
extern "C" fq_status fq_cuda_bwd_run(const fq_gdn_params *p, cudaEvent_t *ev)
{
    cudaStream_t stream = (cudaStream_t)p->stream;
    fq_status st = fq_cuda_check_workspace(p, fq_bwd_ws_layout(p, NULL, NULL));
    if (st != FQ_OK) return st;
    fq_bwd_ws ws;
    fq_bwd_ws_layout(p, p->workspace, &ws);
    /* 0-2. recompute the forward's chunk table, gamma, A, W, (U,) h, Vn. U
     * only for the three-stage state pass: the fused chain forms Vn itself,
     * so there step 1 loads no V tiles and forms no U (ws.f.u's memory is
     * only dvl's, from step 3 on) */
    const int fused_rc = fq_bwd_fused_recompute(p);
    const int64_t items = ws.f.nc_max * p->HV;
    const int given_a = fq_bwd_given_a(p, items); /* (then ws.f.w NULL, maybe dK_O's memory) */
    /* stage A's flags, written on both paths (1 where the item's W has NaN rows, for
     * bwd_state90); given_a: the fused recompute's stage A writes the backward's A too */
    ws.f.aflag = ws.aflag;
    ws.f.abwd = given_a ? ws.a : NULL;
    if ((st = fq_cuda_fwd_prepare(p, &ws.f, stream)) != FQ_OK) return st;
    if (!given_a && (st = fq_cuda_fwd_wy_recompute(p, &ws.f, !fused_rc, stream)) != FQ_OK) return st;
    if (ev) FQ_CUDA_CHECK(cudaEventRecord(ev[5], stream));
    if (fused_rc) {
        /* the fused forward's chain: its workspace = the chunk table, norms and
         * bf16 copies of ws.f + its own part in dsl's place (written only by step 3).
         * given_a: its stage A (the tensor-core inverse) also writes the backward's
         * A, gamma, kdecay and per item whether a non-finite input is there, and
         * lists those items; after the chain, fq_cuda_fwd_wy_given forms A, gamma,
         * kdecay again by the backward's rules and the flag (1: W's rows from a bad
         * token on NaN) only for the listed items: one inverse per item, and no W */
        fq_fwd_ws fz = ws.f; /* (abwd, aflag kept: the extras' layout sets only its own part) */
        fq_cuda_fwd_fused_extras_layout(p, ws.dsl, &fz);
        if (given_a) FQ_CUDA_CHECK(cudaMemsetAsync(ws.aflag + items, 0, sizeof(int), stream)); /* the list's count */
        int beside = 0;
        if ((st = fq_cuda_fwd_stage_a(p, &fz, &beside, stream)) != FQ_OK) return st;
        if (ev) FQ_CUDA_CHECK(cudaEventRecord(ev[6], stream));
        if ((st = fq_cuda_fwd_fused_states(p, &fz, beside, ws.f.h, ws.f.vn, stream)) != FQ_OK) return st;
        if (given_a && (st = fq_cuda_fwd_wy_given(p, &ws.f, stream)) != FQ_OK) return st;
    } else {
        if (ev) FQ_CUDA_CHECK(cudaEventRecord(ev[6], stream));
        if ((st = fq_cuda_fwd_state(p, &ws.f, NULL, 0, stream)) != FQ_OK) return st;
    }
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
    args.dkp = ws.dkp;
    args.dkw = ws.dkw;
    args.aflag = ws.aflag;
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
    args.H = (int)p->H;
    args.HV = (int)p->HV;
    args.scale = (float)p->scale;
    args.state_vk = p->state_vk;

    /* 3-6 (each launcher checks K, V; fq_cuda_fwd_check_sizes already did) */
    const int64_t nc = ws.f.nc_max;
    const int rev = fq_bwd_rev_path(p);
    if (!rev && (st = fq_bwd_local_launch(p, args, nc, stream)) != FQ_OK) return st;
    if (ev) FQ_CUDA_CHECK(cudaEventRecord(ev[1], stream));
    const int cp = fq_bwd_cp(&ws);
    if (cp && (st = fq_cuda_fwd_segments(p, &ws.seg, 0, stream)) != FQ_OK) return st;
    if (rev) {
        /* 4 + 5: the chain and bwd_wy's products in one kernel (its dgamma in dgam, its
         * dK per value head in dkw), then 3 + 6: bwd_local90 finishes dq, dk and dg
         * (events: "st" = bwd_rev90, "wy" = bwd_local90 there; ws.dkp NULL) */
        if ((st = fq_bwd_rev90_launch(p, args, cp ? &ws.seg : NULL, nc, stream)) != FQ_OK) return st;
        if (ev) FQ_CUDA_CHECK(cudaEventRecord(ev[2], stream));
        if ((st = fq_bwd_local_launch(p, args, nc, stream)) != FQ_OK) return st;
        if (ev) FQ_CUDA_CHECK(cudaEventRecord(ev[3], stream));
    } else {
        if (fq_bwd_sm90_path(p)) {
            if (fq_bwd_wy_beside(p, &ws, cp, rev, &args)) {
                FQ_CUDA_CHECK(cudaMemsetAsync(ws.bready, 0, (size_t)(2 * nc * p->HV) * sizeof(int), stream));
                args.bready = ws.bready;
            }
            if ((st = fq_bwd_state90_launch(p, args, cp ? &ws.seg : NULL, nc, stream)) != FQ_OK) return st;
        } else if ((st = fq_bwd_state_launch(p, args, cp ? &ws.seg : NULL, 0, 0, stream)) != FQ_OK) {
            return st;
        }
        if (ev) FQ_CUDA_CHECK(cudaEventRecord(ev[2], stream));
        if ((st = fq_bwd_wy_launch(p, args, nc, stream)) != FQ_OK) return st;
        if (ev) FQ_CUDA_CHECK(cudaEventRecord(ev[3], stream));
    }
    if (ev) FQ_CUDA_CHECK(cudaEventRecord(ev[4], stream)); /* (step 6 has no kernel of its own) */

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

/* [serving] fused gates around the backward: float32 g, beta pre-passed,
 * the backward's float32 dg, dbeta turned into da, db, dA_log, ddt_bias. */
static fq_status fq_chunk_bwd_on_device(const fq_gdn_params *p)
{
    fq_gdn_params q;
    fq_status st = fq_cuda_check_k256_smem(p); /* K = 256: Hopper's 227 KB per block */
    if (st != FQ_OK) return st;
    st = fq_cuda_gates_begin(p, 'b', &q, (cudaStream_t)p->stream);
    if (st != FQ_OK) return st;
    if ((st = fq_cuda_bwd_run(&q, NULL)) != FQ_OK) return st;
    return fq_cuda_gates_end(p, &q, (cudaStream_t)p->stream);
}

extern "C" fq_status fq_cuda_chunk_bwd(const fq_gdn_params *p)
{
    fq_status st = fq_check_params_device(p, 'b');
    if (st != FQ_OK) return st;
    if ((st = fq_cuda_fwd_check_sizes(p)) != FQ_OK) return st;
    if ((st = fq_cuda_check_contents(p, 'b')) != FQ_OK) return st; /* FLASHQLA_CHECK_INPUTS=1 */
    if ((st = fq_cuda_check_serving(p)) != FQ_OK) return st;
    return fq_cuda_on_device(p, fq_chunk_bwd_on_device);
}
