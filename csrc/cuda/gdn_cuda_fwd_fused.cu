/*
 * gdn_cuda_fwd_fused.cu — the fused sm_90a forward (gdn_cuda_fwd_fused.cuh: the
 * kernel): its FULL and MAP passes, the segment table and the combine step of
 * context parallelism, stage A beside the state pass, the entry points of
 * gdn_cuda_common.cuh. The backward's HST pass: gdn_cuda_fwd_fused_states.cu.
 */
#include "gdn_cuda_fwd_fused.cuh"
#include "gdn_cuda_state.cuh" /* fq_cp_combine_kernel */

/* -------------------------------------------- context parallelism ----
 *
 * A sequence of nc chunks in nseg segments of L = ceil(nc / nseg) chunks.
 * Segment sigma maps its start state affinely, S_end = M_sigma S + D_sigma
 * (DESIGN §2: every exponent <= 0, exact for any gate). The forward then
 * runs, for sequences split at all:
 *   MAP pass    [M | D] of every segment but the last, from the fused kernel
 *               in MAP mode (start [I | 0], values [0 | V], no outputs);
 *   combine     S_0 = h0, S_{sigma+1} = M_sigma S_sigma + D_sigma (fp32);
 *   FULL pass   every segment at once from its start state.
 * nseg depends only on the sequence's own length, the head shape and o's
 * dtype (in the forward the maps live in o's rows: fq_omap, cp_fit). */

/* segments per sequence at most, from (HV, K, V) only (never from data or
 * the batch): one sequence's FULL pass (P HV V/64 CTAs, one per SM) and its
 * MAP pass ((P - 1) HV (K + V)/64 CTAs, two per SM) each within one wave of
 * FQ_CP_SMS SMs. Two segments gain nothing (the chain walks MAP + FULL, the
 * whole sequence), so fewer than three means none. */
extern "C" int fq_cuda_fwd_nseg_max(const fq_gdn_params *p)
{
    const int64_t full = p->HV * (p->V / 64), map = p->HV * ((p->K + p->V) / 64);
    if (full <= 0 || map <= 0) return 1;
    int64_t n = FQ_CP_SMS / full;
    const int64_t m = 1 + 2 * FQ_CP_SMS / map;
    if (m < n) n = m;
    if (n > 16) n = 16;
    return n < 3 ? 1 : (int)n;
}

/* One block of 1024 threads: the segment table from the sequence table
 * (segment slots past the real count get seq = -1), with each sequence's
 * state slot: n, or with a pool (idx != NULL) idx[n], FQ_SLOT_NONE for a
 * negative slot or one >= P, FQ_SLOT_DUP for a slot an earlier sequence
 * names (as the three-stage state pass does). */
__global__ void __launch_bounds__(1024) fq_fwd_segments_kernel(const fq_seq_info *seqs, int N, int nseg_max,
                                                               int seg_bound, int64_t cp_bound, fq_seg_info *segs,
                                                               const void *idx, int idx64, int64_t P, int *ready,
                                                               int64_t nready, int fit, fq_omap om)
{
    __shared__ int s_warp[32];
    __shared__ int s_carry, s_cpcarry;
    fq_pdl_trigger();
    fq_pdl_wait();
    const int tid = threadIdx.x, nth = blockDim.x;
    /* stage A's flags, before stage A (beside the state pass) sets them */
    for (int64_t x = tid; x < nready; x += nth) ready[x] = 0;
    if (tid == 0) s_carry = s_cpcarry = 0;
    __syncthreads();
    for (int base = 0; base < N; base += nth) {
        const int n = base + tid;
        fq_seq_info si = {0, 0, 0, 0};
        int nseg = 0, L = 1, slot = n;
        if (n < N && idx) {
            const int64_t sl = fq_ld_index(idx, idx64, n);
            slot = sl < 0 || sl >= P ? FQ_SLOT_NONE : (int)sl;
            for (int m = 0; m < n && slot >= 0; m++)
                if (fq_ld_index(idx, idx64, m) == sl) slot = FQ_SLOT_DUP;
        }
        if (n < N) {
            si = seqs[n];
            nseg = si.nchunks / FQ_CP_MIN_CHUNKS;
            if (nseg > nseg_max) nseg = nseg_max;
            /* cp_fit: no further than the maps and start states fit in the
             * sequence's rows of o (fq_omap): P start states of rss rows, each
             * in its own segment (the last one's too), and P - 1 maps in the
             * rest; P and L as they come out below */
            for (; fit && nseg >= 3; nseg--) {
                const int Lt = (si.nchunks + nseg - 1) / nseg, Pt = (si.nchunks + Lt - 1) / Lt;
                const int last = si.len - (Pt - 1) * 64 * Lt; /* the last segment's tokens */
                const int cap = (64 * Lt - om.rss) / om.rblk, cap_last = (last - om.rss) / om.rblk;
                if (last >= om.rss && cap >= 1 && (Pt - 1) * cap + cap_last >= (Pt - 1) * om.ncb) break;
            }
            nseg = fq_cp_split(si.nchunks, nseg, &L); /* (an empty sequence: one segment, ht = h0) */
        }
        /* this sequence's first segment: the exclusive prefix sum of nseg; its first
         * map / start-state slot: that of nseg over the split sequences only */
        const int first = s_carry + fq_block_inclusive_scan(nseg, s_warp) - nseg;
        __syncthreads(); /* (s_warp reused) */
        const int ncp = nseg > 1 ? nseg : 0;
        const int cpfirst = s_cpcarry + fq_block_inclusive_scan(ncp, s_warp) - ncp;
        for (int sg = 0; sg < nseg; sg++) {
            fq_seg_info e;
            e.seq = n;
            e.bos = si.bos + 64 * L * sg;
            e.chunk0 = si.chunk0 + L * sg;
            e.nchunks = min(L, si.nchunks - L * sg);
            if (e.nchunks < 0) e.nchunks = 0;
            e.len = min(64 * L, si.len - 64 * L * sg);
            if (e.len < 0) e.len = 0;
            e.index = sg;
            e.count = nseg;
            e.cp = ncp ? cpfirst + sg : -1;
            if (e.cp >= cp_bound) e.seq = -1; /* (only an invalid chunk table gets here: its outputs are NaN) */
            e.cfirst = L * sg;
            e.slot = slot;
            if (first + sg < seg_bound) segs[first + sg] = e;
        }
        __syncthreads();
        if (tid == nth - 1) {
            s_carry = first + nseg;
            s_cpcarry = cpfirst + ncp;
        }
        __syncthreads();
    }
    const int total = s_carry;
    for (int sg = total + tid; sg < seg_bound; sg += nth) {
        fq_seg_info e = {-1, 0, 0, 0, 0, 0, 0, -1, 0, FQ_SLOT_NONE};
        segs[sg] = e;
    }
}

/* Cached per device: 1 when the kernel's loaded code is the sm_90a one
 * (PTX version >= 90; not so when the compute_80 PTX was JIT-compiled, e.g.
 * with CUDA_FORCE_PTX_JIT=1) on a compute-capability 9.x GPU.
 * FLASHQLA_CUDA_FUSED_FWD=0 (read once) says no everywhere: the three-stage
 * forward then runs, as off sm_90a (the tests run it so on the H200). */
extern "C" int fq_cuda_fwd_fused_available(const fq_gdn_params *p)
{
    static int env = -1;
    static signed char per_dev[64]; /* 0 unknown, 1 yes, 2 no */
    if (env < 0) {
        const char *e = getenv("FLASHQLA_CUDA_FUSED_FWD");
        env = !(e && strcmp(e, "0") == 0);
    }
    if (!env) return 0;
    if ((p->K != 64 && p->K != 128) || (p->V != 64 && p->V != 128)) return 0;
    int dev = 0;
    if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= 64) return 0;
    if (per_dev[dev] == 0) {
        int major = 0;
        const void *ks[6] = {(const void *)fq_fwd_fused_kernel<64, FQ_FUSED_FULL>,
                             (const void *)fq_fwd_fused_kernel<128, FQ_FUSED_FULL>,
                             (const void *)fq_fwd_fused_kernel<64, FQ_FUSED_MAP>,
                             (const void *)fq_fwd_fused_kernel<128, FQ_FUSED_MAP>,
                             (const void *)fq_fwd_fused_kernel<64, FQ_FUSED_PAIR>,
                             (const void *)fq_fwd_fused_kernel<128, FQ_FUSED_PAIR>};
        int ok = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) == cudaSuccess && major == 9;
        for (int i = 0; ok && i < 6; i++) {
            cudaFuncAttributes fa;
            ok = cudaFuncGetAttributes(&fa, ks[i]) == cudaSuccess && fa.ptxVersion >= 90;
        }
        if (!ok) cudaGetLastError();
        per_dev[dev] = ok ? 1 : 2;
    }
    return per_dev[dev] == 1;
}

fq_status fq_fwd_fused_cp(const fq_gdn_params *p, const fq_fwd_ws *ws, const fq_fused_maps &m, cudaStream_t stream)
{
    if (ws->seg_bound <= 0 || ws->nseg_max <= 1) return FQ_OK; /* (never beside: fq_cuda_fwd_beside) */
    fq_status st;
    if (p->K == 128) st = fq_launch_fused<128, FQ_FUSED_MAP>(p, ws, m, NULL, stream);
    else if (p->K == 64) st = fq_launch_fused<64, FQ_FUSED_MAP>(p, ws, m, NULL, stream);
    else return fq_cuda_head_dims_unsupported(p);
    if (st != FQ_OK) return st;
    return fq_cp_combine_launch<0>(p, ws, (const float *)(p->state ? p->state : p->h0), stream);
}

/* The FULL pass as PAIR CTAs (both column blocks of a value head in one CTA,
 * its two chains sharing the stage's Q, K, A'' and record and the output
 * warpgroup's P) where V = 128 and FULL's CTAs (one per column block) would
 * not fit in one wave on this GPU: there the SMs are all busy, and one PAIR
 * CTA keeps the tensor pipe busier than a FULL CTA, whose chain's dependent
 * steps leave it idle about half of each chunk. Where FULL fits in one wave
 * its CTAs (twice as many, each with half the work) finish sooner. The bits
 * are FULL's either way (the same arithmetic per column block), so the
 * choice, from shapes only, never changes a sequence's outputs. FQ_PAIR=0 (a
 * -D of a dev build) turns it off for A/B runs. */
#ifndef FQ_PAIR
#define FQ_PAIR 1
#endif
static int fq_fwd_pair(const fq_gdn_params *p, const fq_fwd_ws *ws, int beside)
{
    if (!FQ_PAIR || beside || p->V != 128) return 0;
    int dev = 0, sms = 0;
    if (cudaGetDevice(&dev) != cudaSuccess || cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess) {
        cudaGetLastError();
        return 0;
    }
    return ws->seg_bound * p->HV * (p->V / 64) > sms;
}

template <int K>
static fq_status fq_fwd_fused_k(const fq_gdn_params *p, const fq_fwd_ws *ws, int beside, cudaStream_t stream)
{
    if (ws->seg_bound <= 0) return FQ_OK;
    fq_status st;
    fq_fused_maps m;
    if ((st = fq_fused_maps_of<K>(p, ws, &m)) != FQ_OK) return st;
    if ((st = fq_fwd_fused_cp(p, ws, m, stream)) != FQ_OK) return st;
    if (fq_fwd_pair(p, ws, beside)) return fq_launch_fused<K, FQ_FUSED_PAIR>(p, ws, m, NULL, stream);
    return fq_launch_fused<K, FQ_FUSED_FULL>(p, ws, m, beside ? ws->ready : NULL, stream);
}

extern "C" fq_status fq_cuda_fwd_fused(const fq_gdn_params *p, const fq_fwd_ws *ws, int beside, cudaStream_t stream)
{
    if (p->K == 128) return fq_fwd_fused_k<128>(p, ws, beside, stream);
    if (p->K == 64) return fq_fwd_fused_k<64>(p, ws, beside, stream);
    return fq_cuda_head_dims_unsupported(p);
}

extern "C" fq_status fq_cuda_fwd_segments(const fq_gdn_params *p, const fq_fwd_ws *ws, int beside, cudaStream_t stream)
{
    if (ws->seg_bound <= 0) return FQ_OK;
    return fq_launch_k(fq_fwd_segments_kernel, 1, 1024, 0, stream, fq_cuda_pdl_enabled(), (const fq_seq_info *)ws->seqs,
                       (int)p->N, ws->nseg_max, (int)ws->seg_bound, ws->cp_bound, ws->segs,
                       p->state ? p->state_indices : (const void *)NULL, p->state_indices_is_int64, (int64_t)p->P,
                       beside ? ws->ready : (int *)NULL, (int64_t)(beside ? ws->nc_max * p->HV : 0), ws->cp_fit,
                       fq_omap_of(p));
}

/* Stage A beside the state pass (gdn_cuda_common.cuh). Only where the FULL
 * pass leaves at least half of the SMs free: stage A on fewer SMs takes
 * longer (here ~2x on half of them), and it must stay ahead of the chains,
 * which take chunk after chunk at ~1.4 us while stage A finishes a chunk of
 * every head in well under that. FQ_BESIDE=0 (a -D of a dev build) turns it
 * off for A/B runs. */
#ifndef FQ_BESIDE
#define FQ_BESIDE 1
#endif
extern "C" int fq_cuda_fwd_beside(const fq_gdn_params *p, const fq_fwd_ws *ws)
{
    if (!FQ_BESIDE || ws->nseg_max > 1 || ws->seg_bound <= 0 || !fq_cuda_pdl_enabled()) return 0;
    int dev = 0, sms = 0;
    if (cudaGetDevice(&dev) != cudaSuccess || cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess) {
        cudaGetLastError();
        return 0;
    }
    const int64_t items = ws->seg_bound * p->HV * (p->V / 64);
    if (items > sms / 2) return 0;
    return sms - (int)items;
}
