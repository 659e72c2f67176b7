/*
 * gdn_cuda_bwd_state.cu — the reverse state pass (step 4 of gdn_cuda_bwd.cu):
 * bwd_state, dS^T held as the mma A operand, 16
 * state columns per warp or warp pair (K-split), columns per block and
 * K-split picked by the number of chains vs SMs as in the forward's stage B;
 * one ring barrier per chunk (+ a pair barrier with the K-split). The earlier
 * reverse state passes (dS in fp32 shared memory; then dS in accumulators of
 * 8 warps per 32 columns) were removed
 * once superseded: see benchmarks/NOTES.md and git history (commit 4599409).
 * Long sequences with few heads get the exact context parallelism of the
 * forward, reversed (fq_bwd_cp_args below: a MAP pass, the reverse combine,
 * the pass per segment).
 */
#include "gdn_cuda_bwd.cuh"
#include "gdn_cuda_state.cuh"

#include <stdlib.h>

/* ===================================================== bwd_state ====
 *
 * bwd_state: the reverse state pass laid out like the forward's stage B
 * (gdn_cuda_fwd_state.cu): one block per (sequence n, value head j, BV = 16 NW
 * state columns); a group of KS warps (KS = 1 or 2) owns 16 state columns v
 * and holds dS^T (16 x K, fp32) as mma accumulators, warp kh of the group the
 * K/KS state rows k0 = kh K/KS ..: lane (g, t) holds
 * dS^T[g (+8)][k0 + 8 nt + 2t (+1)], the A-operand layout of m16n8k16, so
 * both products of a chunk take their A operand from registers (the removed
 * predecessor: dS and dVn through shared memory, two barriers per chunk, 8 warps per
 * 32 columns). Per chunk c, last to first:
 *
 *     dS_next[c]^T = dS^T                       bf16; stored as dsl[c][K][V]
 *                                               (lane pairs swap halves)
 *     P     = dS_next^T[:, k0..] K^T[k0.., :]   A = dS^T (registers), B = K [row][k]
 *     dVn^T = dv_local^T + (sum over the group's warps of P) diag(kdecay)
 *                                               bf16; stored as dvl[c][64][V]
 *     dS^T[:, k0..] = e^{g_C} dS^T[:, k0..] + dS_local^T[:, k0..]
 *                     - dVn^T W[:, k0..]        A = -dVn^T (registers, exact
 *                                               sign flip), B = W (smem)
 *     ending in dh0.
 *
 * KS = 2 halves each warp's chain (64 instead of 128 mma per chunk) for the
 * shapes with few chains, at the cost of a 64-thread named barrier per chunk
 * (the two warps swap their 16 x 64 fp32 partial P through shared memory;
 * both add own + partner, bitwise the same sum). The block's warps share the
 * chunk's K and W tiles (each group reads its 16 columns of dv_local and
 * dS_local) from an NS-deep cp.async ring; one __syncthreads per chunk for
 * the ring (chunk landed everywhere, previous buffer free). The chunk's
 * addresses come from the sequence table (row0 = bos + 64 i, as the forward),
 * not from a global chunk-table load on the step's critical path; the next
 * chunk's copies are issued between the k-steps of the first product.
 * dS_next[c] and dVn overwrite dS_local[c] / dv_local[c] in place: only this
 * block reads those columns, and its copies of chunk c are complete (waited
 * for, then the barrier) before the first store.
 */
template <int K, int NW, int NS, int KS> struct fq_bwd_state_smem {
    static constexpr int BV = 16 * NW, LDK = K + 8, LDB = BV + 8;
    static constexpr int b_w = 0;                    /* W  [64][K]  */
    static constexpr int b_k = b_w + 64 * LDK * 2;   /* K  [64][K]  */
    static constexpr int b_dv = b_k + 64 * LDK * 2;  /* dv_local [64][BV] */
    static constexpr int b_ds = b_dv + 64 * LDB * 2; /* dS_local [K][BV]  */
    static constexpr int b_g = b_ds + K * LDB * 2;   /* gamma[64]  */
    static constexpr int b_d = b_g + 64 * 4;         /* kdecay[64] */
    static constexpr int buf = b_d + 64 * 4;
    static constexpr int off_x = NS * buf;           /* KS = 2: P exchange */
    static constexpr int bytes = off_x + (KS == 2 ? NW * 2 * 16 * 64 * 4 : 0);
};

/* Named barrier 1 + grp over the 64 threads of warp pair grp (immediate ids,
 * so the kernel reserves only the barriers it uses). */
static __device__ __forceinline__ void fq_bar_pair(int grp)
{
    switch (grp) {
    case 0: asm volatile("bar.sync 1, 64;\n" ::: "memory"); break;
    case 1: asm volatile("bar.sync 2, 64;\n" ::: "memory"); break;
    case 2: asm volatile("bar.sync 3, 64;\n" ::: "memory"); break;
    default: asm volatile("bar.sync 4, 64;\n" ::: "memory"); break;
    }
}

template <int K, int NW, int NS, int KS, int CP>
__global__ void __launch_bounds__(NW * KS * 32, 1) fq_bwd_state_kernel(fq_bwd_args a, int V, fq_bwd_cp_args c)
{
    typedef fq_bwd_state_smem<K, NW, NS, KS> SM;
    constexpr int BV = SM::BV, LDK = SM::LDK, LDB = SM::LDB, NTH = NW * KS * 32;
    constexpr int KW = K / KS;  /* state rows per warp */
    constexpr int NKT = KW / 8; /* n8 tiles of dS^T per warp */
    constexpr int MAP = CP == FQ_BWD_CP_MAP;
    extern __shared__ __align__(16) unsigned char smem[];

    /* columns of the pass: V; MAP: K + V (M's, then D's) */
    const int HV = a.HV, H = a.H, nvs = (MAP ? K + V : V) / BV;
    const int vs = blockIdx.x % nvs, j = (blockIdx.x / nvs) % HV, n = blockIdx.x / (nvs * HV);
    const int hq = j / (HV / H);
    /* n: the sequence (CP 0) or the segment slot; seq: the sequence */
    fq_seq_info si;
    int seq = n, sidx = 0, scount = 1, cps = 0; /* cps: the segment's map / start-state slot */
    if constexpr (CP == FQ_BWD_CP_NONE) {
        si = a.seqs[n];
    } else {
        const fq_seg_info sg = c.segs[n];
        if (sg.seq < 0 || (MAP && sg.index == 0)) return; /* (block-uniform; no barrier passed yet) */
        si.bos = sg.bos;
        si.len = sg.len;
        si.chunk0 = sg.chunk0;
        si.nchunks = sg.nchunks;
        seq = sg.seq;
        sidx = sg.index;
        scount = sg.count;
        cps = sg.cp;
    }
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t = lane & 3;
    const int grp = warp / KS, kh = warp % KS;
    /* MAP: an M block (its columns < K: no dv_local, dS_local) or a D block (V's
     * columns vs BV - K ..) */
    const int mblk = MAP && vs * BV < K;
    const int cv0 = MAP ? (mblk ? 0 : vs * BV - K) : vs * BV; /* the block's first column of V (a D block) */
    const int vw = vs * BV + 16 * grp; /* the group's first state column (MAP: of [M | D]) */
    const int vwv = cv0 + 16 * grp;    /* ... as a column of V */
    const int k0 = kh * KW;            /* this warp's first state row */

    /* dS^T = dht slice (zeros when NULL); CP 2: E_s of a split sequence; MAP: I or 0 */
    const int64_t state_off = ((int64_t)seq * HV + j) * K * V;
    float D[NKT][4];
    if constexpr (CP == FQ_BWD_CP_NONE) {
#pragma unroll
        for (int nt = 0; nt < NKT; nt++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const int k = k0 + 8 * nt + 2 * t + (e & 1), v = vw + g + 8 * (e >> 1);
                D[nt][e] = a.dht ? a.dht[state_off + fq_state_at(k, v, K, V, a.state_vk)] : 0.f; /* [serving] layout */
            }
    } else {
        const float *src = NULL;
        int64_t off = 0;
        int svk = 0;
        if (!MAP && scount > 1) {
            src = c.ss;
            off = ((int64_t)cps * HV + j) * K * V;
        } else if (!MAP && a.dht) {
            src = a.dht;
            off = state_off;
            svk = a.state_vk;
        }
#pragma unroll
        for (int nt = 0; nt < NKT; nt++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const int k = k0 + 8 * nt + 2 * t + (e & 1), v = g + 8 * (e >> 1);
                if (MAP) D[nt][e] = mblk && k == vw + v ? 1.f : 0.f;
                else D[nt][e] = src ? src[off + fq_state_at(k, vw + v, K, V, svk)] : 0.f;
            }
    }

    /* Copies of chunk i (local index) into ring buffer b, in NPART parts
     * (part p: rows p RP .. of W and K, rows p SP .. of dS_local; part 0 also
     * dv_local, gamma, kdecay). Each thread copies fixed 16-byte columns of
     * rows r + m * STEP: per chunk one set of base pointers, then
     * compile-time offsets. */
    constexpr int NPART = KW / 16, RP = 64 / NPART, SP = K / NPART;
    constexpr int CPR = K / 8, RSTEP = NTH / CPR, UPR = BV / 8, USTEP = NTH / UPR;
    static_assert(NTH % CPR == 0 && NTH % UPR == 0 && RP % RSTEP == 0 && 64 % USTEP == 0 &&
                      SP % USTEP == 0, "load split");
    const int r_t = tid / CPR, c_t = (tid % CPR) * 8, r_u = tid / UPR, c_u = (tid % UPR) * 8;
    const int64_t kstride = (int64_t)H * K; /* elements between k rows */
    struct fq_ld_base {
        const fq_bf16 *w, *k, *dv, *ds;
        const float *g;
        int lim; /* rows r_t + r with r < lim are real tokens */
    };
    auto ld_base = [&](int i) {
        fq_ld_base lb;
        const int64_t tile = (int64_t)(si.chunk0 + i) * HV + j;
        const int row0 = si.bos + i * 64, len = min(64, si.len - i * 64);
        lb.w = a.w + (tile * 64 + r_t) * K + c_t;
        lb.k = a.kb + ((int64_t)(row0 + r_t) * H + hq) * K + c_t;
        lb.dv = a.dvl + (tile * 64 + r_u) * V + cv0 + c_u;
        lb.ds = a.dsl + (tile * K + r_u) * V + cv0 + c_u;
        lb.g = tid < 16 ? a.gamma + tile * 64 + tid * 4 : a.kdecay + tile * 64 + (tid - 16) * 4;
        lb.lim = len - r_t;
        return lb;
    };
    auto load_part = [&](const fq_ld_base &lb, int b, int part) {
        unsigned char *bb = smem + b * SM::buf;
        fq_bf16 *Wd = (fq_bf16 *)(bb + SM::b_w) + r_t * LDK + c_t;
        fq_bf16 *Kd = (fq_bf16 *)(bb + SM::b_k) + r_t * LDK + c_t;
#pragma unroll
        for (int it = 0; it < RP / RSTEP; it++) {
            const int r = part * RP + it * RSTEP;
            fq_cp_async16(Wd + r * LDK, lb.w + r * K, 16);
            const bool ok = r < lb.lim;
            fq_cp_async16(Kd + r * LDK, ok ? lb.k + r * kstride : a.kb, ok ? 16 : 0);
        }
        if (mblk) { /* (MAP's M block: no dS_local, dv_local) */
            if (part == 0 && tid < 32)
                fq_cp_async16(bb + (tid < 16 ? SM::b_g + tid * 16 : SM::b_d + (tid - 16) * 16), lb.g, 16);
            return;
        }
        fq_bf16 *Sd = (fq_bf16 *)(bb + SM::b_ds) + r_u * LDB + c_u;
#pragma unroll
        for (int it = 0; it < SP / USTEP; it++) {
            const int r = part * SP + it * USTEP;
            fq_cp_async16(Sd + r * LDB, lb.ds + (int64_t)r * V, 16);
        }
        if (part == 0) {
            fq_bf16 *Vd = (fq_bf16 *)(bb + SM::b_dv) + r_u * LDB + c_u;
#pragma unroll
            for (int it = 0; it < 64 / USTEP; it++) {
                const int r = it * USTEP;
                fq_cp_async16(Vd + r * LDB, lb.dv + (int64_t)r * V, 16);
            }
            if (tid < 32) fq_cp_async16(bb + (tid < 16 ? SM::b_g + tid * 16 : SM::b_d + (tid - 16) * 16), lb.g, 16);
        }
    };

    const int nch = si.nchunks;
#pragma unroll
    for (int s = 0; s < NS - 1; s++) {
        if (s < nch) {
            const fq_ld_base lb = ld_base(nch - 1 - s);
#pragma unroll
            for (int part = 0; part < NPART; part++) load_part(lb, s, part);
        }
        fq_cp_async_commit();
    }

    const int64_t V8 = 8 * (int64_t)V;
    for (int st = 0; st < nch; st++) {
        const int i = nch - 1 - st;
        /* group st (chunk i) is complete once at most NS-2 newer ones pend */
        fq_cp_async_wait<NS - 2>();
        __syncthreads(); /* chunk i visible to all; buffer (st-1) % NS free */
        const int snext = st + NS - 1, bnext = snext % NS;
        const bool more = snext < nch;
        fq_ld_base lbn;
        if (more) lbn = ld_base(nch - 1 - snext);

        const unsigned char *bb = smem + (st % NS) * SM::buf;
        const fq_bf16 *Wb = (const fq_bf16 *)(bb + SM::b_w), *Kb = (const fq_bf16 *)(bb + SM::b_k);
        const fq_bf16 *Dvb = (const fq_bf16 *)(bb + SM::b_dv), *Dsb = (const fq_bf16 *)(bb + SM::b_ds);
        const float *gam = (const float *)(bb + SM::b_g), *kdec = (const float *)(bb + SM::b_d);
        const int64_t tile = (int64_t)(si.chunk0 + i) * HV + j;

        /* P = dS_next^T[:, k0..] K^T[k0.., :] (16 x 64); dS_next out on the
         * way (af[q] holds v = g + 8 (q & 1), k = k0 + 16 kk + 8 (q >> 1) + 2t, +1) */
        float acc[8][4];
#pragma unroll
        for (int nt = 0; nt < 8; nt++) acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0.f;
        fq_bf16 *sl = fq_st_t_lane(a.dsl + tile * K * V + (int64_t)k0 * V + vwv, V, lane);
#pragma unroll
        for (int kk = 0; kk < KW / 16; kk++) {
            uint32_t af[4];
            af[0] = fq_pack_bf16(D[2 * kk][0], D[2 * kk][1]);
            af[1] = fq_pack_bf16(D[2 * kk][2], D[2 * kk][3]);
            af[2] = fq_pack_bf16(D[2 * kk + 1][0], D[2 * kk + 1][1]);
            af[3] = fq_pack_bf16(D[2 * kk + 1][2], D[2 * kk + 1][3]);
#pragma unroll
            for (int n2 = 0; n2 < 4; n2++) {
                uint32_t b[4];
                fq_frag_b_nk(b, Kb, LDK, 16 * n2, k0 + 16 * kk);
                fq_mma_bf16(acc[2 * n2], af, b[0], b[1]);
                fq_mma_bf16(acc[2 * n2 + 1], af, b[2], b[3]);
            }
            if constexpr (!MAP) /* (MAP: nothing stored per chunk) */
#pragma unroll
                for (int q = 0; q < 4; q++) fq_st_transposed(sl + (2 * kk + (q >> 1)) * V8 + 8 * (q & 1), af[q], g, true);
            if (more) load_part(lbn, bnext, kk); /* chunk i - (NS - 1), part kk */
        }
        fq_cp_async_commit();

        /* dS^T[:, k0..] <- e^{g_C} dS^T[:, k0..] + dS_local^T[:, k0..]
         * (lf[q] = dS_local^T[g + 8 (q & 1)][k0 + 16 kk + 8 (q >> 1) + 2t, +1]
         * pairs with D[2 kk + (q >> 1)][2 (q & 1), +1]) */
        {
            const float egC = __expf(gam[63]);
#pragma unroll
            for (int kk = 0; kk < KW / 16; kk++) {
                uint32_t lf[4] = {0u, 0u, 0u, 0u};
                if (!mblk) fq_frag_a_trans(lf, Dsb, LDB, 16 * grp, k0 + 16 * kk);
#pragma unroll
                for (int q = 0; q < 4; q++) {
                    float *x = D[2 * kk + (q >> 1)] + 2 * (q & 1);
                    const float2 l = fq_unpack_bf16(lf[q]);
                    x[0] = fmaf(x[0], egC, l.x);
                    x[1] = fmaf(x[1], egC, l.y);
                }
            }
        }

        if (KS == 2) {
            /* the group's two partial products: acc = P_own + P_partner. The
             * exchange area is rewritten next chunk only after the ring's
             * __syncthreads, which the partner reaches after its reads. */
            float2 *xo = (float2 *)(smem + SM::off_x) + warp * 512;
            const float2 *xp = (const float2 *)(smem + SM::off_x) + (warp ^ 1) * 512;
            fq_pair_put(acc, xo, lane);
            fq_bar_pair(grp); /* the pair only */
            fq_pair_add(acc, xp, lane);
        }

        /* dVn^T = dv_local^T + P diag(kdecay) (uf[q] = dv_local^T[g + 8 (q & 1)]
         * [16 kk + 8 (q >> 1) + 2t, +1] pairs with acc[2 kk + (q >> 1)][2 (q & 1), +1]);
         * dVn out (KS = 2: warp kh stores the k-steps kk with kk % 2 == kh);
         * the update's A operand -dVn^T (rows along the chunk's tokens) */
        fq_bf16 *vl = fq_st_t_lane(a.dvl + tile * 64 * V + vwv, V, lane);
        uint32_t va[4][4];
#pragma unroll
        for (int kk = 0; kk < 4; kk++) {
            uint32_t uf[4] = {0u, 0u, 0u, 0u};
            if (!mblk) fq_frag_a_trans(uf, Dvb, LDB, 16 * grp, 16 * kk);
            const float2 d0 = *(const float2 *)(kdec + 16 * kk + 2 * t);
            const float2 d8 = *(const float2 *)(kdec + 16 * kk + 8 + 2 * t);
#pragma unroll
            for (int q = 0; q < 4; q++) {
                const float *x = acc[2 * kk + (q >> 1)] + 2 * (q & 1);
                const float2 u = fq_unpack_bf16(uf[q]), d = (q >> 1) ? d8 : d0;
                const uint32_t w = fq_pack_bf16(u.x + d.x * x[0], u.y + d.y * x[1]);
                if constexpr (!MAP)
                    fq_st_transposed(vl + (2 * kk + (q >> 1)) * V8 + 8 * (q & 1), w, g, KS == 1 || (kk & 1) == kh);
                va[kk][q] = w ^ 0x80008000u; /* -dVn^T: bf16 sign flip, exact */
            }
        }

        /* dS^T[:, k0..] += (-dVn^T) W[:, k0..] */
        fq_state_rank_update<KW>(D, va, Wb, LDK, k0);
    }
    fq_cp_async_wait<0>();

    if constexpr (MAP) /* columns vw.. of the segment's [M | D] */
        fq_state_slice_store<NKT>(D, c.md, ((int64_t)cps * HV + j) * K * (K + V), k0, vw, K, K + V, 0, g, t);
    else if (a.dh0 && sidx == 0) /* (CP 2: the sequence's first segment ends the walk) */
        fq_state_slice_store<NKT>(D, a.dh0, state_off, k0, vw, K, V, a.state_vk, g, t);
}

template <int K, int NW, int NS, int KS, int CP>
static fq_status fq_bwd_state_launch_ns(const fq_bwd_args &a, const fq_bwd_cp_args &c, int64_t blocks, int V,
                                        cudaStream_t stream)
{
    constexpr int bytes = fq_bwd_state_smem<K, NW, NS, KS>::bytes;
    static_assert(bytes <= FQ_SMEM_OPTIN_H100, "bwd_state: shared memory");
    const void *fn = (const void *)fq_bwd_state_kernel<K, NW, NS, KS, CP>;
    fq_status st = fq_cuda_set_smem(fn, bytes);
    if (st != FQ_OK) return st;
    fq_bwd_state_kernel<K, NW, NS, KS, CP><<<(unsigned)blocks, NW * KS * 32, bytes, stream>>>(a, V, c);
    FQ_CUDA_CHECK_LAUNCH();
    return FQ_OK;
}

/* The deepest ring that fits one block per SM (4; 3 when 4 does not fit:
 * 64 columns with K = 128), unless there are more blocks than SMs and the
 * 2-deep ring lets two blocks share an SM (smem_sm: shared memory per SM,
 * 1 KB of it reserved per block). cp: FQ_BWD_CP_* (MAP and SEG: K <= 128). */
template <int K, int NW, int KS>
static fq_status fq_bwd_state_launch_cfg(const fq_bwd_args &a, const fq_bwd_cp_args &c, int cp, int64_t blocks,
                                          int V, int sms, int smem_sm, cudaStream_t stream)
{
    /* K = 256: a ring stage is 82-93 KB (W, K tiles 33 KB each, dS_local
     * 12-20 KB): 2-deep only */
    constexpr int NSMAX = fq_bwd_state_smem<K, NW, 4, KS>::bytes <= FQ_SMEM_OPTIN_H100 ? 4
                          : fq_bwd_state_smem<K, NW, 3, KS>::bytes <= FQ_SMEM_OPTIN_H100 ? 3
                                                                                        : 2;
    const bool two = 2 * (fq_bwd_state_smem<K, NW, 2, KS>::bytes + 1024) <= smem_sm;
    if constexpr (K <= 128) {
        if (cp == FQ_BWD_CP_MAP) {
            if (blocks > sms && two) return fq_bwd_state_launch_ns<K, NW, 2, KS, FQ_BWD_CP_MAP>(a, c, blocks, V, stream);
            return fq_bwd_state_launch_ns<K, NW, NSMAX, KS, FQ_BWD_CP_MAP>(a, c, blocks, V, stream);
        }
        if (cp == FQ_BWD_CP_SEG) {
            if (blocks > sms && two) return fq_bwd_state_launch_ns<K, NW, 2, KS, FQ_BWD_CP_SEG>(a, c, blocks, V, stream);
            return fq_bwd_state_launch_ns<K, NW, NSMAX, KS, FQ_BWD_CP_SEG>(a, c, blocks, V, stream);
        }
    }
    if (cp != FQ_BWD_CP_NONE) return fq_fail(FQ_ERR_INTERNAL, "fq_bwd_state_launch: no context parallelism at K = %d", K);
    if (blocks > sms && two) return fq_bwd_state_launch_ns<K, NW, 2, KS, FQ_BWD_CP_NONE>(a, c, blocks, V, stream);
    return fq_bwd_state_launch_ns<K, NW, NSMAX, KS, FQ_BWD_CP_NONE>(a, c, blocks, V, stream);
}

template <int K>
static fq_status fq_bwd_state_launch_k(const fq_bwd_args &a, const fq_bwd_cp_args &c, int cp, int64_t blocks, int V,
                                        int sms, int smem_sm, int bv, int ks, cudaStream_t stream)
{
    if constexpr (K == 256) {
        /* K = 256 (issue 7 item 4): the K-split only (64 fp32 of dS^T per
         * lane, as K = 128 unsplit) and 16 or 32 columns per block (64: the
         * 2-deep ring alone is 223 KB, with the P exchange 255 KB) */
        if (ks != 2 || bv == 64)
            return fq_fail(FQ_ERR_INTERNAL, "fq_bwd_state_launch: K = 256 runs ks 2, bv 16 or 32; got bv %d ks %d", bv,
                           ks);
        if (bv == 16) return fq_bwd_state_launch_cfg<K, 1, 2>(a, c, cp, blocks, V, sms, smem_sm, stream);
        return fq_bwd_state_launch_cfg<K, 2, 2>(a, c, cp, blocks, V, sms, smem_sm, stream);
    } else {
        if (ks == 2) {
            if (bv == 16) return fq_bwd_state_launch_cfg<K, 1, 2>(a, c, cp, blocks, V, sms, smem_sm, stream);
            if (bv == 32) return fq_bwd_state_launch_cfg<K, 2, 2>(a, c, cp, blocks, V, sms, smem_sm, stream);
            return fq_bwd_state_launch_cfg<K, 4, 2>(a, c, cp, blocks, V, sms, smem_sm, stream);
        }
        if (bv == 16) return fq_bwd_state_launch_cfg<K, 1, 1>(a, c, cp, blocks, V, sms, smem_sm, stream);
        if (bv == 32) return fq_bwd_state_launch_cfg<K, 2, 1>(a, c, cp, blocks, V, sms, smem_sm, stream);
        return fq_bwd_state_launch_cfg<K, 4, 1>(a, c, cp, blocks, V, sms, smem_sm, stream);
    }
}

/* One pass over `chains` 16-column chains (cols columns per chain unit of
 * `units`: N sequences or seg_bound segment slots). bv: state columns per
 * block (16, 32, 64), ks: K-split (1, 2); both 0: the environment variable
 * FLASHQLA_CUDA_BWD_STATE=BV:KS (read once; for timing the alternatives) or
 * else the pick, as the forward's stage B picks: K-split while every warp of
 * it still gets an SM sub-partition of its own (16-column groups <= 2 SMs;
 * at K = 128 <= 1 SM, as measured), then 16 columns per block if the groups
 * fit the SMs one per SM, else 32; without the K-split 32 columns up to 2
 * SMs' worth of groups, else 64 (4 warps sharing the K and W tiles). */
static fq_status fq_bwd_state_pass(const fq_gdn_params *p, const fq_bwd_args &a, const fq_bwd_cp_args &c, int cp,
                                   int64_t units, int cols, int bv, int ks, cudaStream_t stream)
{
    int dev = 0, sms = 132;
    FQ_CUDA_CHECK(cudaGetDevice(&dev));
    FQ_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
    int smem_sm = 228 * 1024;
    FQ_CUDA_CHECK(cudaDeviceGetAttribute(&smem_sm, cudaDevAttrMaxSharedMemoryPerMultiprocessor, dev));
    const int V = (int)p->V;
    const int64_t groups = units * p->HV * (cols / 16);
    if (bv == 0 && ks == 0) { /* FLASHQLA_CUDA_BWD_STATE=BV:KS (e.g. 32:1) overrides the pick */
        static int env_bv = -1, env_ks = 0;
        if (env_bv < 0) {
            const char *e = getenv("FLASHQLA_CUDA_BWD_STATE");
            int b = 0, k = 0;
            if (e && e[0] >= '0' && e[0] <= '9' && e[1] >= '0' && e[1] <= '9' && e[2] == ':' &&
                (e[3] == '1' || e[3] == '2') && e[4] == 0) {
                b = (e[0] - '0') * 10 + (e[1] - '0');
                k = e[3] - '0';
            }
            if (b != 16 && b != 32 && b != 64) b = k = 0; /* anything else: ignored */
            env_ks = k;
            env_bv = b;
        }
        bv = env_bv;
        ks = env_ks;
        if (p->K == 256 && (ks == 1 || bv == 64)) bv = ks = 0; /* not built at K = 256: the pick below */
    }
    /* the K-split up to 2 SMs' worth of groups, but at K = 128 only up to one:
     * between one and two (16/32 heads, one sequence: 256 groups) ks 1 with
     * bv 32 measured 6-10 % faster than ks 2 (benchmarks/NOTES.md, session 16) */
    const int64_t ks2_max = p->K == 128 ? (int64_t)sms : 2 * (int64_t)sms;
    if (ks == 0) ks = p->K == 256 || groups <= ks2_max ? 2 : 1; /* K = 256: always 2 */
    if (bv == 0) {
        if (ks == 2) bv = groups <= sms ? 16 : 32;
        else bv = groups <= 2 * (int64_t)sms ? 32 : 64;
    }
    if ((bv != 16 && bv != 32 && bv != 64) || V % bv != 0 || (ks != 1 && ks != 2))
        return fq_fail(FQ_ERR_INTERNAL, "fq_bwd_state_launch: bad bv %d / ks %d", bv, ks);
    const int64_t blocks = units * p->HV * (cols / bv);
    if (blocks <= 0) return FQ_OK;
    if (p->K == 128) return fq_bwd_state_launch_k<128>(a, c, cp, blocks, V, sms, smem_sm, bv, ks, stream);
    if (p->K == 64) return fq_bwd_state_launch_k<64>(a, c, cp, blocks, V, sms, smem_sm, bv, ks, stream);
    if (p->K == 256 && V == 256) return fq_bwd_state_launch_k<256>(a, c, cp, blocks, V, sms, smem_sm, bv, ks, stream);
    return fq_cuda_head_dims_unsupported(p);
}

fq_status fq_bwd_state_launch(const fq_gdn_params *p, const fq_bwd_args &a, const fq_fwd_ws *segws, int bv, int ks,
                              cudaStream_t stream)
{
    if (p->N <= 0) return FQ_OK;
    const int V = (int)p->V, K = (int)p->K;
    fq_bwd_cp_args c = {NULL, NULL, NULL};
    if (!segws) return fq_bwd_state_pass(p, a, c, FQ_BWD_CP_NONE, p->N, V, bv, ks, stream);
    /* context parallelism: MAP over every segment but each sequence's first, the
     * reverse combine, then every segment from its E_s */
    c.segs = segws->segs;
    c.md = segws->md;
    c.ss = segws->ss;
    const int64_t units = segws->seg_bound;
    fq_status st = fq_bwd_state_pass(p, a, c, FQ_BWD_CP_MAP, units, K + V, bv, ks, stream);
    if (st != FQ_OK) return st;
    if ((st = fq_cp_combine_launch<1>(p, segws, a.dht, stream)) != FQ_OK) return st;
    return fq_bwd_state_pass(p, a, c, FQ_BWD_CP_SEG, units, V, bv, ks, stream);
}
