/*
 * gdn_cuda_fwd.cu — the CUDA chunked forward (DESIGN §2, C = 64): the entry
 * points of gdn.h, the workspace layout, and the small stages around the three
 * main ones (chunk table, bf16 copies and L2 norms, NaN poisoning). The main
 * stages live in gdn_cuda_fwd_wy.cu (A), gdn_cuda_fwd_state.cu (B) and
 * gdn_cuda_fwd_output.cu (C); gdn_cuda_common.cuh describes them. Earlier
 * versions of the stages were removed once superseded: see
 * benchmarks/NOTES.md and git history (commit 4599409).
 */
#include "gdn_cuda_common.cuh"

#include <math.h>
#include <stdlib.h>
#include <string.h>

/* --------------------------------------------------- kernel attributes ---- */

/* cudaFuncSetAttribute(kernel, attr, value) once per (kernel, device,
 * attribute): a later call asking for at most the value set is free. The
 * table is small and a repeated call is harmless, so a lost race (two
 * threads) or a full table costs only a repeated call. */
extern "C" fq_status fq_cuda_func_attr(const void *kernel, cudaFuncAttribute attr, int value)
{
    enum { N = 256 };
    static struct {
        const void *kernel;
        int dev, attr, value;
    } done[N];
    int dev = 0;
    FQ_CUDA_CHECK(cudaGetDevice(&dev));
    for (int i = 0; i < N; i++)
        if (done[i].kernel == kernel && done[i].dev == dev && done[i].attr == (int)attr && done[i].value >= value)
            return FQ_OK;
    FQ_CUDA_CHECK(cudaFuncSetAttribute(kernel, attr, value));
    for (int i = 0; i < N; i++) {
        if (done[i].kernel == NULL ||
            (done[i].kernel == kernel && done[i].dev == dev && done[i].attr == (int)attr)) {
            done[i].kernel = kernel;
            done[i].dev = dev;
            done[i].attr = (int)attr;
            done[i].value = value;
            break;
        }
    }
    return FQ_OK;
}

/* The dynamic shared-memory limit, raised past the default 48 KB when asked. */
extern "C" fq_status fq_cuda_set_smem(const void *kernel, int bytes)
{
    if (bytes <= 48 * 1024) return FQ_OK;
    return fq_cuda_func_attr(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
}

/* ------------------------------------- programmatic dependent launch ---- */

__global__ void fq_poison_kernel(const int *flags, void *x, fq_dtype dt, int64_t n);

/* See gdn_cuda_common.cuh. The instructions exist only in the sm_90a code,
 * so the launch attribute is used only where that code runs: a kernel of
 * this module reports PTX version >= 90 (not so when the compute_80 PTX
 * fallback was JIT-compiled, e.g. with CUDA_FORCE_PTX_JIT=1 or on another
 * architecture). Cached per device; FLASHQLA_CUDA_PDL=0 turns it off. */
extern "C" int fq_cuda_pdl_enabled(void)
{
    static int env = -1;
    static signed char per_dev[64]; /* 0 unknown, 1 yes, 2 no */
    if (env < 0) {
        const char *e = getenv("FLASHQLA_CUDA_PDL");
        env = !(e && strcmp(e, "0") == 0);
    }
    if (!env) return 0;
    int dev = 0;
    if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= 64) return 0;
    if (per_dev[dev] == 0) {
        cudaFuncAttributes fa;
        int ok = cudaFuncGetAttributes(&fa, (const void *)fq_poison_kernel) == cudaSuccess && fa.ptxVersion >= 90;
        per_dev[dev] = ok ? 1 : 2;
    }
    return per_dev[dev] == 1;
}

/* ---------------------------------------------------- workspace layout ---- */

static size_t fq_align256(size_t x) { return (x + 255) & ~(size_t)255; }

/* Carves `bytes` from the running offset; returns the pointer (NULL base:
 * NULL). */
static void *fq_carve(char *base, size_t *off, size_t bytes)
{
    void *p = base ? base + *off : NULL;
    *off += fq_align256(bytes);
    return p;
}

/* The part both forwards share: chunk table, norms, bf16 copies. */
static size_t fq_fwd_ws_common(const fq_gdn_params *p, char *base, fq_fwd_ws *ws)
{
    memset(ws, 0, sizeof *ws);
    int64_t B = p->B, T = p->T, H = p->H, HV = p->HV, K = p->K, V = p->V, N = p->N;
    int64_t nct = (T + FQ_CHUNK - 1) / FQ_CHUNK;
    /* chunk slots from sizes only (the binding asks for the size without
     * saying whether cu_seqlens comes): with B == 1 up to ceil(T/64) + N
     * (every sequence may add one partial chunk), else B * ceil(T/64) */
    int64_t nc = B == 1 ? nct + N : B * nct;
    if (nc < 0) nc = 0;
    if (N < 0) N = 0;
    ws->nc_max = nc;
    ws->cp_fit = 0;
    size_t off = 0;
    ws->chunks = (fq_chunk_info *)fq_carve(base, &off, (size_t)(nc > 0 ? nc : 1) * sizeof(fq_chunk_info));
    ws->seqs = (fq_seq_info *)fq_carve(base, &off, (size_t)(N > 0 ? N : 1) * sizeof(fq_seq_info));
    ws->flags = (int *)fq_carve(base, &off, 16);
    /* the norms are reserved always (the size may not depend on options) */
    float *rq = (float *)fq_carve(base, &off, (size_t)(B * T * H) * 4);
    float *rk = (float *)fq_carve(base, &off, (size_t)(B * T * H) * 4);
    ws->rq = p->use_qk_l2norm ? rq : NULL;
    ws->rk = p->use_qk_l2norm ? rk : NULL;
    /* bf16 copies of q, k, v: reserved unless the inputs are bf16 (read in
     * place then; fq_cuda_fwd_check_sizes rejects unaligned bf16 pointers) */
    if (p->dtype != FQ_BF16) {
        ws->qb = (const fq_bf16 *)fq_carve(base, &off, (size_t)(B * T * H * K) * 2);
        ws->kb = (const fq_bf16 *)fq_carve(base, &off, (size_t)(B * T * H * K) * 2);
        ws->vb = (const fq_bf16 *)fq_carve(base, &off, (size_t)(B * T * HV * V) * 2);
    } else {
        ws->qb = (const fq_bf16 *)p->q;
        ws->kb = (const fq_bf16 *)p->k;
        ws->vb = (const fq_bf16 *)p->v;
    }
    return off;
}

extern "C" size_t fq_cuda_fwd_ws_layout(const fq_gdn_params *p, void *base_, fq_fwd_ws *ws)
{
    return fq_cuda_fwd_ws_layout_omit(p, base_, ws, 0);
}

extern "C" size_t fq_cuda_fwd_ws_layout_omit(const fq_gdn_params *p, void *base_, fq_fwd_ws *ws, int omit)
{
    char *base = (char *)base_;
    fq_fwd_ws tmp;
    if (!ws) ws = &tmp;
    size_t off = fq_fwd_ws_common(p, base, ws);
    const int64_t nc = ws->nc_max, HV = p->HV, K = p->K, V = p->V;
    ws->gamma = (float *)fq_carve(base, &off, (size_t)(nc * HV * FQ_CHUNK) * 4);
    ws->kdecay = (float *)fq_carve(base, &off, (size_t)(nc * HV * FQ_CHUNK) * 4);
    ws->w = omit & FQ_FWS_OMIT_W ? (fq_bf16 *)NULL : (fq_bf16 *)fq_carve(base, &off, (size_t)(nc * HV * FQ_CHUNK * K) * 2);
    ws->u = omit & FQ_FWS_OMIT_U ? (fq_bf16 *)NULL : (fq_bf16 *)fq_carve(base, &off, (size_t)(nc * HV * FQ_CHUNK * V) * 2);
    ws->h = (fq_bf16 *)fq_carve(base, &off, (size_t)(nc * HV * K * V) * 2);
    ws->vn = (fq_bf16 *)fq_carve(base, &off, (size_t)(nc * HV * FQ_CHUNK * V) * 2);
    ws->a = NULL;
    return off;
}

extern "C" int64_t fq_cuda_fwd_seg_bound(const fq_gdn_params *p, int64_t nc, int nseg_max)
{
    const int64_t N = p->N > 0 ? p->N : 0;
    const int64_t bound = N * nseg_max, alt = N + nc / FQ_CP_MIN_CHUNKS;
    return nseg_max > 1 && alt < bound ? alt : bound;
}

extern "C" int64_t fq_cuda_fwd_cp_bound(const fq_gdn_params *p, int64_t nc, int nseg_max)
{
    if (nseg_max <= 1) return 0;
    const int64_t sb = fq_cuda_fwd_seg_bound(p, nc, nseg_max), split = nc / FQ_CP_MIN_CHUNKS;
    return split < sb ? split : sb;
}

/* The fused forward's own part, from off on (ws->nc_max set). omap: the
 * segment maps and start states in o's rows (the forward: none reserved
 * here), else here (the backward's recompute: no o). */
static size_t fq_fwd_fused_extras(const fq_gdn_params *p, char *base, size_t off, fq_fwd_ws *ws, int omap)
{
    const int64_t nc = ws->nc_max, HV = p->HV;
    ws->a = (fq_bf16 *)fq_carve(base, &off, (size_t)(nc * HV) * FQ_APACK_BYTES); /* packed (gdn_cuda_common.cuh) */
    ws->rec = (float *)fq_carve(base, &off, (size_t)(nc * HV * FQ_REC_FLOATS) * 4);
    /* segments: nseg_max from the head shape only (never from data, never
     * from the batch), their slots bounded from sizes */
    const int64_t K = p->K, V = p->V;
    ws->nseg_max = fq_cuda_fwd_nseg_max(p);
    ws->seg_bound = fq_cuda_fwd_seg_bound(p, nc, ws->nseg_max);
    ws->segs = (fq_seg_info *)fq_carve(base, &off, (size_t)(ws->seg_bound > 0 ? ws->seg_bound : 1) * sizeof(fq_seg_info));
    ws->cp_bound = fq_cuda_fwd_cp_bound(p, nc, ws->nseg_max);
    ws->cp_fit = 1;
    ws->md = ws->ss = NULL;
    if (ws->nseg_max > 1 && !omap) {
        ws->md = (float *)fq_carve(base, &off, (size_t)(ws->cp_bound * HV * K * (K + V)) * 4);
        ws->ss = (float *)fq_carve(base, &off, (size_t)(ws->cp_bound * HV * K * V) * 4);
    }
    ws->ready = (int *)fq_carve(base, &off, (size_t)(nc * HV) * 4);
    return off;
}

extern "C" size_t fq_cuda_fwd_fused_ws_layout(const fq_gdn_params *p, void *base_, fq_fwd_ws *ws)
{
    fq_fwd_ws tmp;
    if (!ws) ws = &tmp;
    const size_t off = fq_fwd_ws_common(p, (char *)base_, ws);
    return fq_fwd_fused_extras(p, (char *)base_, off, ws, 1);
}

extern "C" size_t fq_cuda_fwd_fused_extras_layout(const fq_gdn_params *p, void *base_, fq_fwd_ws *ws)
{
    fq_fwd_ws tmp, c;
    if (!ws) ws = &tmp;
    fq_fwd_ws_common(p, NULL, &c); /* (nc_max from the sizes, as every layout sets it) */
    ws->nc_max = c.nc_max;
    return fq_fwd_fused_extras(p, (char *)base_, 0, ws, 0);
}

extern "C" fq_status fq_cuda_fwd_check_sizes(const fq_gdn_params *p)
{
    if (p->dtype == FQ_F64)
        return fq_fail(FQ_ERR_TYPE, "q: float64 inputs are CPU-only (the CUDA backend takes "
                                    "float32, float16 or bfloat16)");
    if (p->gate_dtype != FQ_F32 && p->gate_dtype != p->dtype)
        return fq_fail(FQ_ERR_TYPE, "g: expected float32 or %s, got %s", fq_dtype_name(p->dtype),
                       fq_dtype_name(p->gate_dtype));
    if (p->state_dtype != FQ_F32)
        return fq_fail(FQ_ERR_TYPE, "initial_state: the CUDA backend keeps states in float32, got %s",
                       fq_dtype_name(p->state_dtype));
    /* K, V in {64, 128} in any pair, or K = V = 256 (issue 7 item 4; the
     * chunked forward runs its three stages there: fq_cuda_fwd_fused_available
     * says no) */
    if (p->K != 64 && p->K != 128 && p->K != 256)
        return fq_fail(FQ_ERR_VALUE,
                       "k: the CUDA backend supports head dims K in {64, 128} (and K = V = 256), got K=%lld",
                       (long long)p->K);
    if (p->V != 64 && p->V != 128 && p->V != 256)
        return fq_fail(FQ_ERR_VALUE,
                       "v: the CUDA backend supports head dims V in {64, 128} (and K = V = 256), got V=%lld",
                       (long long)p->V);
    if ((p->K == 256) != (p->V == 256))
        return fq_fail(FQ_ERR_VALUE,
                       "%s: the CUDA backend takes head dim 256 only as K = V = 256, got K=%lld V=%lld",
                       p->K == 256 ? "v" : "k", (long long)p->K, (long long)p->V);
    if (p->B * p->T >= ((int64_t)1 << 30) || p->N >= ((int64_t)1 << 30))
        return fq_fail(FQ_ERR_VALUE, "q: too many tokens for the CUDA backend (B*T=%lld)",
                       (long long)(p->B * p->T));
    if (p->dtype == FQ_BF16 &&
        (((uintptr_t)p->q | (uintptr_t)p->k | (uintptr_t)p->v) & 15))
        return fq_fail(FQ_ERR_VALUE, "q, k, v: bfloat16 CUDA inputs must be 16-byte aligned");
    return FQ_OK;
}

/* -------------------------------------------------------- chunk table ---- */

/* One block of 1024 threads. Validates cu_seqlens (starts at 0,
 * non-decreasing, ends at T), writes one fq_seq_info per sequence (chunk0 by a
 * block-wide exclusive scan of the chunk counts) and one fq_chunk_info per
 * chunk slot (the owner found by binary search over chunk0). Invalid contents:
 * flags[0] = 1 and every sequence is treated as empty (nothing is read out of
 * bounds; fq_cuda_fwd_poison then NaN-fills the outputs). */
__global__ void __launch_bounds__(1024) fq_chunk_table_kernel(const void *cu, int is64, int N, int T,
                                                              int nc_max, fq_chunk_info *chunks,
                                                              fq_seq_info *seqs, int *flags)
{
    __shared__ int s_bad, s_carry;
    __shared__ int s_warp[32];
    /* stage A, when it follows directly as a programmatic dependent launch,
     * may be scheduled now; it waits for this grid before reading the table */
    fq_pdl_trigger();
    int tid = threadIdx.x, nth = blockDim.x;
    if (tid == 0) { s_bad = 0; s_carry = 0; }
    __syncthreads();
    if (cu) {
        for (int64_t i = tid; i <= N; i += nth) {
            int64_t c = fq_ld_index(cu, is64, i);
            int bad = c < 0 || c > T || (i == 0 && c != 0) || (i == N && c != T);
            if (i > 0 && c < fq_ld_index(cu, is64, i - 1)) bad = 1;
            if (bad) atomicOr(&s_bad, 1);
        }
    }
    __syncthreads();
    int bad = s_bad;
    for (int base = 0; base < N; base += nth) {
        int i = base + tid;
        int bos = 0, len = 0;
        if (i < N) {
            if (cu) {
                bos = (int)fq_ld_index(cu, is64, i);
                len = (int)(fq_ld_index(cu, is64, i + 1) - bos);
            } else {
                bos = i * T;
                len = T;
            }
            if (bad) { bos = 0; len = 0; }
        }
        int nch = (len + FQ_CHUNK - 1) / FQ_CHUNK;
        const int incl = fq_block_inclusive_scan(nch, s_warp);
        int carry = s_carry;
        if (i < N) {
            fq_seq_info si;
            si.bos = bos; si.len = len; si.chunk0 = carry + incl - nch; si.nchunks = nch;
            seqs[i] = si;
        }
        __syncthreads();
        if (tid == nth - 1) s_carry = carry + incl;
        __syncthreads();
    }
    int total = s_carry;
    if (tid == 0) { flags[0] = bad; flags[1] = total; }
    __syncthreads(); /* seqs[] (global) written by this block is visible now */
    for (int c = tid; c < nc_max; c += nth) {
        fq_chunk_info ci;
        ci.seq = -1; ci.row0 = 0; ci.len = 0; ci.local = 0;
        if (c < total) {
            int lo = 0, hi = N - 1; /* largest n with chunk0 <= c */
            while (lo < hi) {
                int mid = (lo + hi + 1) >> 1;
                if (seqs[mid].chunk0 <= c) lo = mid; else hi = mid - 1;
            }
            fq_seq_info si = seqs[lo];
            int local = c - si.chunk0;
            ci.seq = lo;
            ci.local = local;
            ci.row0 = si.bos + local * FQ_CHUNK;
            ci.len = min(FQ_CHUNK, si.len - local * FQ_CHUNK);
        }
        chunks[c] = ci;
    }
}

/* ------------------------------------------ bf16 copies and L2 norms ---- */

/* One warp per head vector of D elements (rows x heads of them): writes the
 * bf16 copy (xb != NULL) and the inverse norm 1/sqrt(sum x^2 + 1e-6)
 * (rnorm != NULL), computed from the input precision in fp32. */
__global__ void fq_prep_rows_kernel(const void *x, fq_dtype dt, int64_t nvec, int D, fq_bf16 *xb,
                                    float *rnorm)
{
    int64_t vec = (int64_t)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    int lane = threadIdx.x & 31;
    if (vec >= nvec) return;
    float ss = 0.f;
    for (int i = lane; i < D; i += 32) {
        float v = fq_ld_f(x, dt, vec * D + i);
        ss += v * v;
        if (xb) xb[vec * D + i] = __float2bfloat16_rn(v);
    }
    if (rnorm) {
        for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
        if (lane == 0) rnorm[vec] = 1.0f / sqrtf(ss + 1e-6f);
    }
}

static fq_status fq_launch_prep_rows(const void *x, fq_dtype dt, int64_t nvec, int D, fq_bf16 *xb,
                                     float *rnorm, cudaStream_t stream)
{
    if (nvec <= 0 || (!xb && !rnorm)) return FQ_OK;
    int64_t blocks = (nvec + 7) / 8;
    fq_prep_rows_kernel<<<(unsigned)blocks, 256, 0, stream>>>(x, dt, nvec, D, xb, rnorm);
    FQ_CUDA_CHECK_LAUNCH();
    return FQ_OK;
}

extern "C" fq_status fq_cuda_fwd_prepare(const fq_gdn_params *p, const fq_fwd_ws *ws,
                                         cudaStream_t stream)
{
    fq_chunk_table_kernel<<<1, 1024, 0, stream>>>(p->cu_seqlens, p->cu_seqlens_is_int64, (int)p->N,
                                                  (int)p->T, (int)ws->nc_max, ws->chunks, ws->seqs,
                                                  ws->flags);
    FQ_CUDA_CHECK_LAUNCH();
    int copy = p->dtype != FQ_BF16;
    int64_t rows = p->B * p->T;
    fq_status st;
    st = fq_launch_prep_rows(p->q, p->dtype, rows * p->H, (int)p->K, copy ? (fq_bf16 *)ws->qb : NULL,
                             ws->rq, stream);
    if (st != FQ_OK) return st;
    st = fq_launch_prep_rows(p->k, p->dtype, rows * p->H, (int)p->K, copy ? (fq_bf16 *)ws->kb : NULL,
                             ws->rk, stream);
    if (st != FQ_OK) return st;
    if (copy) {
        st = fq_launch_prep_rows(p->v, p->dtype, rows * p->HV, (int)p->V, (fq_bf16 *)ws->vb, NULL,
                                 stream);
        if (st != FQ_OK) return st;
    }
    return FQ_OK;
}

/* ------------------------------------------------------------- poison ---- */

__global__ void fq_poison_kernel(const int *flags, void *x, fq_dtype dt, int64_t n)
{
    if (flags[0] == 0) return;
    float nan = __int_as_float(0x7fc00000);
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (int64_t)gridDim.x * blockDim.x)
        fq_st_f(x, dt, i, nan);
}

extern "C" fq_status fq_cuda_poison_if_invalid(const int *flags, void *x, fq_dtype dt, int64_t n,
                                               cudaStream_t stream)
{
    if (!x || n <= 0) return FQ_OK;
    int64_t blocks = (n + 255) / 256;
    if (blocks > 1024) blocks = 1024;
    fq_poison_kernel<<<(unsigned)blocks, 256, 0, stream>>>(flags, x, dt, n);
    FQ_CUDA_CHECK_LAUNCH();
    return FQ_OK;
}

/* Invalid cu_seqlens: NaN outputs, o, ht and [serving] the checkpoints (a pool
 * is left as it was: every sequence counted as empty wrote back its start). */
extern "C" fq_status fq_cuda_fwd_poison(const fq_gdn_params *p, const fq_fwd_ws *ws, cudaStream_t stream)
{
    if (!p->cu_seqlens) return FQ_OK; /* only cu_seqlens contents can be invalid */
    fq_status st = fq_cuda_poison_if_invalid(ws->flags, p->o, p->dtype, p->B * p->T * p->HV * p->V,
                                             stream);
    if (st == FQ_OK && p->checkpoint_every)
        st = fq_cuda_poison_if_invalid(ws->flags, p->checkpoints, FQ_F32,
                                       fq_checkpoint_rows(p) * p->HV * p->K * p->V, stream);
    if (st != FQ_OK) return st;
    return fq_cuda_poison_if_invalid(ws->flags, p->ht, FQ_F32, p->N * p->HV * p->K * p->V, stream);
}

/* -------------------------------------------------------- entry points ---- */

/* fn(p) with p->device current; the caller's device is restored after (a
 * failure to restore it is reported unless fn failed first). */
extern "C" fq_status fq_cuda_on_device(const fq_gdn_params *p, fq_status (*fn)(const fq_gdn_params *p))
{
    int prev = 0;
    FQ_CUDA_CHECK(cudaGetDevice(&prev));
    if (prev != p->device) FQ_CUDA_CHECK(cudaSetDevice(p->device));
    fq_status st = fn(p);
    if (prev != p->device) {
        cudaError_t e = cudaSetDevice(prev);
        if (st == FQ_OK && e != cudaSuccess)
            st = fq_fail(FQ_ERR_CUDA, "%s:%d: %s", __FILE__, __LINE__, cudaGetErrorString(e));
    }
    return st;
}

/* The fused forward where the current device runs it (every forward there:
 * h0 / ht, a pool's slots, either state layout and the checkpoints are its
 * own; asked without a device switch: the binding sizes the workspace before
 * the call), else the three-stage forward, whose workspace is larger. */
extern "C" size_t fq_cuda_chunk_fwd_workspace_bytes(const fq_gdn_params *p)
{
    return fq_cuda_gates_ws_bytes(p, 'f') +
           (fq_cuda_fwd_fused_available(p) ? fq_cuda_fwd_fused_ws_layout(p, NULL, NULL) : fq_cuda_fwd_ws_layout(p, NULL, NULL));
}

/* Stage A of the fused forward and the segment table, in the order the state
 * pass wants: stage A, then the table; or, beside (fq_cuda_fwd_beside), the
 * table first and stage A at once with the state pass (*beside = 1 then). */
extern "C" fq_status fq_cuda_fwd_stage_a(const fq_gdn_params *p, const fq_fwd_ws *ws, int *beside, cudaStream_t stream)
{
    fq_status st;
    const int nb = fq_cuda_fwd_beside(p, ws);
    *beside = nb != 0;
    if (nb) {
        if ((st = fq_cuda_fwd_segments(p, ws, 1, stream)) != FQ_OK) return st;
        return fq_cuda_fwd_inverse(p, ws, nb, stream);
    }
    if ((st = fq_cuda_fwd_inverse(p, ws, 0, stream)) != FQ_OK) return st;
    return fq_cuda_fwd_segments(p, ws, 0, stream);
}

/* Fused forward: 0. as below, A. gamma and A = (I+L)^-1 per chunk, B+C. the
 * state pass with the outputs (gdn_cuda_fwd_fused.cu). */
static fq_status fq_chunk_fwd_fused(const fq_gdn_params *p)
{
    cudaStream_t stream = (cudaStream_t)p->stream;
    fq_fwd_ws ws;
    fq_cuda_fwd_fused_ws_layout(p, p->workspace, &ws);
    /* o leaves by 16-byte stores (TMA, uint4 / float4 per thread) and holds context
     * parallelism's maps as fp32 read by 16 bytes (fq_omap): a clear error, not a fault */
    if ((uintptr_t)p->o & 15)
        return fq_fail(FQ_ERR_VALUE, "o: the CUDA forward needs a 16-byte aligned output buffer");
    fq_status st;
    if ((st = fq_cuda_fwd_prepare(p, &ws, stream)) != FQ_OK) return st;
    if ((st = fq_cuda_fwd_checkpoint_index(p, &ws, stream)) != FQ_OK) return st; /* [serving] */
    int beside = 0;
    if ((st = fq_cuda_fwd_stage_a(p, &ws, &beside, stream)) != FQ_OK) return st;
    if ((st = fq_cuda_fwd_fused(p, &ws, beside, stream)) != FQ_OK) return st;
    return fq_cuda_fwd_poison(p, &ws, stream);
}

/* K = V = 256 runs chunk kernels laid out for Hopper's 227 KB of shared
 * memory per block (the forward's stage C alone takes 199 KB, the
 * backward's bwd_state 199 KB): a clear error elsewhere instead of a failed
 * launch. FQ_OK for other head dims. On the current device. */
extern "C" fq_status fq_cuda_check_k256_smem(const fq_gdn_params *p)
{
    if (p->K != 256) return FQ_OK;
    int dev = 0, optin = 0;
    FQ_CUDA_CHECK(cudaGetDevice(&dev));
    FQ_CUDA_CHECK(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev));
    if (optin < FQ_SMEM_OPTIN_H100)
        return fq_fail(FQ_ERR_VALUE,
                       "k: the CUDA chunked forward and backward at K = V = 256 need %d bytes of shared "
                       "memory per block (H100 / H200); this GPU offers %d",
                       FQ_SMEM_OPTIN_H100, optin);
    return FQ_OK;
}

static fq_status fq_chunk_fwd_on_device(const fq_gdn_params *caller)
{
    cudaStream_t stream = (cudaStream_t)caller->stream;
    fq_status sk = fq_cuda_check_k256_smem(caller);
    if (sk != FQ_OK) return sk;
    /* [serving] fused gates: float32 g, beta pre-passed into the gate region
     * at the workspace's start; p is the call as the stages see it */
    fq_gdn_params pg;
    fq_status st = fq_cuda_gates_begin(caller, 'f', &pg, stream);
    if (st != FQ_OK) return st;
    const fq_gdn_params *p = &pg;
    if (fq_cuda_fwd_fused_available(p) && p->workspace &&
        p->workspace_bytes >= fq_cuda_fwd_fused_ws_layout(p, NULL, NULL))
        return fq_chunk_fwd_fused(p);
    if ((st = fq_cuda_check_workspace(p, fq_cuda_fwd_ws_layout(p, NULL, NULL))) != FQ_OK) return st;
    fq_fwd_ws ws;
    fq_cuda_fwd_ws_layout(p, p->workspace, &ws);
    /* 0. chunk table, bf16 copies, inverse norms; [serving] the checkpoint index */
    if ((st = fq_cuda_fwd_prepare(p, &ws, stream)) != FQ_OK) return st;
    if ((st = fq_cuda_fwd_checkpoint_index(p, &ws, stream)) != FQ_OK) return st;
    /* A. gamma, A = (I+L)^-1, W, U per chunk */
    if ((st = fq_cuda_fwd_wy(p, &ws, stream)) != FQ_OK) return st;
    /* B. the sequential state pass: h, Vn, final state */
    if ((st = fq_cuda_fwd_state(p, &ws, (float *)p->ht, 0, stream)) != FQ_OK) return st;
    /* C. outputs */
    if ((st = fq_cuda_fwd_output(p, &ws, stream)) != FQ_OK) return st;
    return fq_cuda_fwd_poison(p, &ws, stream);
}

extern "C" fq_status fq_cuda_chunk_fwd(const fq_gdn_params *p)
{
    fq_status st = fq_check_params_device(p, 'f');
    if (st != FQ_OK) return st;
    if ((st = fq_cuda_fwd_check_sizes(p)) != FQ_OK) return st;
    if ((st = fq_cuda_check_contents(p, 'f')) != FQ_OK) return st; /* FLASHQLA_CHECK_INPUTS=1 */
    if ((st = fq_cuda_check_serving(p)) != FQ_OK) return st;
    return fq_cuda_on_device(p, fq_chunk_fwd_on_device);
}
